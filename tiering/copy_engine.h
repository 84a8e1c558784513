// tiering/copy_engine.h: moving bytes between device memory and host memory, asynchronously.
//
// Two implementations behind one interface:
//  - CUDA (CreateCudaCopyEngine): cudaMemcpyAsync on a dedicated stream (or one per direction),
//    completion reported by a host callback on that stream; host buffers should be pinned. Built
//    when the CUDA toolkit is present; fails with a clear status when there is no device.
//  - Host-emulated (HostCopyEngine): a worker thread that memcpy's, in submission order, with an
//    optional bandwidth cap (bytes per second) so simulations can model PCIe. This is what runs on
//    machines without a GPU, where the device tier is ordinary memory; it is a test seam and says
//    so in its name.
//
// Copies complete in submission order (CUDA with a stream per direction: within a direction).
// `done` runs exactly once, on the engine's thread (CUDA: a CUDA callback thread); it must not
// block on the engine.
//
// Fences: a trainer's kernels run on its own stream, after the host code that queued them has
// moved on. RecordFence(stream) marks the point on that stream where the work queued so far ends
// (CUDA: an event recorded there); Wait() on the fence returns once the device has passed it (a
// host wait on the event, never a device-wide synchronize), Passed() says whether it has. The
// runtime waits on a device copy's fences before it reads or overwrites that copy, and frees its
// memory only once they have passed. The host-emulated engine has no streams:
// its "kernels" are the trainer's own host code, done before Release returns, so its fence is
// null (nothing to wait for) whatever stream is passed.
//
// Thread safety: Copy may be called from any thread. Destroying an engine waits for the copies
// already submitted.
#ifndef STRATA_TIERING_COPY_ENGINE_H_
#define STRATA_TIERING_COPY_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/mutex.h"

namespace strata::tiering {

enum class CopyDirection { kHostToDevice, kDeviceToHost };

// A point on a stream (see above). Thread-safe: Wait may be called from several threads.
class Fence {
 public:
  virtual ~Fence() = default;
  // Blocks until the stream has passed the fence.
  virtual absl::Status Wait() = 0;
  // Whether it has, without blocking.
  virtual bool Passed() = 0;
};

// A trainer's stream, as its API hands it over (CUDA: a cudaStream_t); null: none given. CUDA's
// legacy default stream, whose cudaStream_t is 0 (torch's default stream), is passed as
// kLegacyDefaultStream (CUDA's own name for it, cudaStreamLegacy).
using StreamHandle = void*;
inline StreamHandle const kLegacyDefaultStream = reinterpret_cast<StreamHandle>(uintptr_t{1});

class CopyEngine {
 public:
  using Done = absl::AnyInvocable<void(absl::Status) &&>;
  virtual ~CopyEngine() = default;
  // The work queued on `stream` so far (null: nothing to wait for).
  virtual absl::StatusOr<std::shared_ptr<Fence>> RecordFence(StreamHandle stream) {
    (void)stream;
    return std::shared_ptr<Fence>();
  }
  virtual void Copy(void* dst, const void* src, size_t bytes, CopyDirection direction,
                    Done done) = 0;
  // Sets `bytes` of device memory at `dst` to zero, without crossing the link. Not ordered with
  // the copies in flight (CUDA: cudaMemsetAsync on a stream of its own, so that a gradient's
  // zeros do not wait behind the weights and gradients crossing the link; host-emulated: a memset
  // on the engine's thread, not paced by the link's cap): a caller waits for what it needs first.
  virtual void Zero(void* dst, size_t bytes, Done done) = 0;
  virtual absl::string_view name() const = 0;

  // The same, completed through a future.
  std::future<absl::Status> CopyAsync(void* dst, const void* src, size_t bytes,
                                      CopyDirection direction);
  std::future<absl::Status> ZeroAsync(void* dst, size_t bytes);
};

class HostCopyEngine final : public CopyEngine {
 public:
  // bytes_per_second == 0: no cap.
  explicit HostCopyEngine(uint64_t bytes_per_second = 0);
  ~HostCopyEngine() override;
  void Copy(void* dst, const void* src, size_t bytes, CopyDirection direction, Done done) override;
  void Zero(void* dst, size_t bytes, Done done) override;
  absl::string_view name() const override { return "host-emulated copy engine"; }

 private:
  struct Job {
    void* dst;
    const void* src;  // null: zeros (not paced: nothing crosses the link)
    size_t bytes;
    Done done;
  };
  void Run();

  const uint64_t bytes_per_second_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// A CUDA copy engine on `device` with `streams` copy streams: 1 (both directions, in submission
// order) or 2 (one per direction: copies to the host and to the device overlap, as the link carries
// both at once); zeroing has a stream of its own either way. Unimplemented when built without CUDA;
// FailedPrecondition naming the CUDA error when there is no usable device; InvalidArgument for
// another stream count.
absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(int device, int streams = 1);

}  // namespace strata::tiering

#endif  // STRATA_TIERING_COPY_ENGINE_H_
