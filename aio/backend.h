// aio/backend.h: the seam between the Engine and the kernel.
//
// A Backend moves plain-value requests (Op) to the kernel and reports raw results (OpResult:
// bytes transferred or -errno), nothing more: it never retries, splits, resubmits a short
// transfer or interprets an error. All of that lives in one layer above (aio/engine.cc). Backends:
// io_uring (liburing), libaio, posix (pread/pwrite, executed at Reap); FaultInjectingBackend
// (aio/fault_injection.h) wraps any of them.
//
// Thread safety: a Backend is not thread-safe; each Engine worker thread owns one and alone calls
// Submit and Reap. The exception is UpdateBuffer/UpdateFile, which the Engine calls from other
// threads while the worker runs: io_uring's register calls touch no user-space ring state and the
// kernel serializes them against submission, and wrappers must only forward them.
#ifndef STRATA_AIO_BACKEND_H_
#define STRATA_AIO_BACKEND_H_

#include <sys/uio.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "aio/config.h"

namespace strata::aio {

enum class OpKind : uint8_t { kRead, kWrite };

struct Op {
  uint64_t tag = 0;  // Returned unchanged in the OpResult.
  OpKind kind = OpKind::kRead;
  int fd = -1;         // Always valid.
  int file_slot = -1;  // Registered-file slot, or -1 (io_uring only).
  void* buf = nullptr;
  uint32_t length = 0;
  uint64_t offset = 0;
  int buf_index = -1;  // Registered-buffer index containing [buf, buf+length), or -1.
};

struct OpResult {
  uint64_t tag = 0;
  int64_t result = 0;  // Bytes transferred (possibly fewer than asked), or -errno.
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual absl::string_view name() const = 0;

  // Hands `ops` to the kernel. Either all of them are accepted (each yields exactly one OpResult
  // later) or none is and the status says why. The caller never has more than the queue depth
  // the backend was created with in flight.
  virtual absl::Status Submit(absl::Span<const Op> ops) = 0;

  // Writes up to out.size() results into `out`, blocking until at least `min_results` are
  // available (0: never blocks). Returns how many were written.
  virtual absl::StatusOr<size_t> Reap(absl::Span<OpResult> out, size_t min_results) = 0;

  // Registered buffers and files (io_uring). Tables are sparse: Register* reserves `count` slots,
  // Update* fills one (iov_base == nullptr / fd == -1 clears it). Backends without them return
  // Unimplemented and the Engine passes plain pointers and fds.
  virtual absl::Status RegisterBufferTable(int count) { return Unsupported("registered buffers"); }
  virtual absl::Status UpdateBuffer(int index, iovec iov) {
    return Unsupported("registered buffers");
  }
  virtual absl::Status RegisterFileTable(int count) { return Unsupported("registered files"); }
  virtual absl::Status UpdateFile(int slot, int fd) { return Unsupported("registered files"); }

 protected:
  absl::Status Unsupported(absl::string_view what) const;
};

struct BackendOptions {
  int queue_depth = 8;
  bool sqpoll = false;
  int sqpoll_idle_ms = 1000;
};

// Creates a backend of `kind`. Fails (with the kernel's reason) when the kernel or the limits
// refuse it; it does not fall back: Engine::Create does that, with the probe's report.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(EngineKind kind,
                                                       const BackendOptions& options);

}  // namespace strata::aio

#endif  // STRATA_AIO_BACKEND_H_
