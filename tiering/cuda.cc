// The CUDA pieces of tiering/: the copy engine (cudaMemcpyAsync on a stream) and the device
// memory resource (stream-ordered cudaMallocAsync). The only file of this module where
// STRATA_HAVE_CUDA appears; without CUDA the factories return Unimplemented.
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "tiering/copy_engine.h"
#include "tiering/internal/cuda_host.h"
#include "tiering/memory_resource.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::tiering {

#if STRATA_HAVE_CUDA
namespace {

static_assert(sizeof(cudaStream_t) == sizeof(StreamHandle));

class CudaCopyEngine final : public CopyEngine {
 public:
  // `to_device` carries the copies to the device, `to_host` the copies back (the same stream when
  // the engine has one), `zeros` the zeroing.
  CudaCopyEngine(int device, cudaStream_t to_device, cudaStream_t to_host, cudaStream_t zeros)
      : device_(device), to_device_(to_device), to_host_(to_host), zeros_(zeros) {}
  ~CudaCopyEngine() override {
    cudaSetDevice(device_);
    for (cudaStream_t s : {to_device_, to_host_, zeros_}) cudaStreamSynchronize(s);
    cudaStreamDestroy(to_device_);
    if (to_host_ != to_device_) cudaStreamDestroy(to_host_);
    cudaStreamDestroy(zeros_);
  }
  void Copy(void* dst, const void* src, size_t bytes, CopyDirection direction, Done done) override {
    cudaSetDevice(device_);
    const bool down = direction == CopyDirection::kHostToDevice;
    cudaStream_t stream = down ? to_device_ : to_host_;
    const cudaError_t err = cudaMemcpyAsync(
        dst, src, bytes, down ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream);
    Complete(stream, err, absl::StrCat("cudaMemcpyAsync of ", bytes, " bytes"), std::move(done));
  }
  void Zero(void* dst, size_t bytes, Done done) override {
    cudaSetDevice(device_);
    const cudaError_t err = cudaMemsetAsync(dst, 0, bytes, zeros_);
    Complete(zeros_, err, absl::StrCat("cudaMemsetAsync of ", bytes, " bytes"), std::move(done));
  }
  absl::string_view name() const override { return "CUDA copy engine"; }

  absl::StatusOr<std::shared_ptr<Fence>> RecordFence(StreamHandle stream) override {
    if (stream == nullptr) return std::shared_ptr<Fence>();
    cudaSetDevice(device_);
    cudaEvent_t event;
    cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaEventCreate: ", cudaGetErrorName(err)));
    }
    // kLegacyDefaultStream is CUDA's cudaStreamLegacy.
    err =
        cudaEventRecord(event, stream == kLegacyDefaultStream ? cudaStreamLegacy
                                                              : static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      cudaEventDestroy(event);
      return absl::InvalidArgumentError(
          absl::StrCat("cudaEventRecord on the trainer's stream: ", cudaGetErrorName(err),
                       " (pass a cudaStream_t of this device, or null)"));
    }
    return std::shared_ptr<Fence>(new EventFence(device_, event));
  }

 private:
  // `done` runs once the work just queued on `stream` (`queued`: its status, named by `what`) has
  // run: from a host function queued behind it.
  void Complete(cudaStream_t stream, cudaError_t queued, absl::string_view what, Done done) {
    if (queued != cudaSuccess) {
      std::move(done)(absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(queued))));
      return;
    }
    auto* heap = new Done(std::move(done));
    const cudaError_t cb = cudaLaunchHostFunc(
        stream,
        [](void* arg) {
          auto* d = static_cast<Done*>(arg);
          std::move (*d)(absl::OkStatus());
          delete d;
        },
        heap);
    if (cb != cudaSuccess) {
      cudaStreamSynchronize(stream);
      std::move (*heap)(
          absl::InternalError(absl::StrCat("cudaLaunchHostFunc: ", cudaGetErrorName(cb))));
      delete heap;
    }
  }

  // An event recorded on a trainer's stream.
  class EventFence final : public Fence {
   public:
    EventFence(int device, cudaEvent_t event) : device_(device), event_(event) {}
    ~EventFence() override {
      cudaSetDevice(device_);
      cudaEventDestroy(event_);
    }
    absl::Status Wait() override {
      cudaSetDevice(device_);
      const cudaError_t err = cudaEventSynchronize(event_);
      if (err != cudaSuccess) {
        return absl::InternalError(absl::StrCat(
            "waiting for the trainer's stream (cudaEventSynchronize): ", cudaGetErrorName(err)));
      }
      return absl::OkStatus();
    }
    bool Passed() override {
      cudaSetDevice(device_);
      // cudaErrorNotReady: not yet; any other error is met again (and reported) by Wait.
      return cudaEventQuery(event_) == cudaSuccess;
    }

   private:
    int device_;
    cudaEvent_t event_;
  };

  int device_;
  cudaStream_t to_device_;
  cudaStream_t to_host_;
  cudaStream_t zeros_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(int device, int streams) {
  if (streams != 1 && streams != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA copy engine: ", streams, " streams; accepted: 1 or 2"));
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA copy engine: no CUDA device ", device,
                     err != cudaSuccess ? absl::StrCat(" (", cudaGetErrorName(err), ")")
                                        : absl::StrCat(" (", count, " present)")));
  }
  cudaSetDevice(device);
  // The copy streams, then the zeroing's.
  cudaStream_t made[3] = {nullptr, nullptr, nullptr};
  for (int i = 0; i < streams + 1; ++i) {
    err = cudaStreamCreateWithFlags(&made[i], cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      for (int j = 0; j < i; ++j) cudaStreamDestroy(made[j]);
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA copy engine: cudaStreamCreate: ", cudaGetErrorName(err)));
    }
  }
  return std::unique_ptr<CopyEngine>(
      new CudaCopyEngine(device, made[0], streams == 2 ? made[1] : made[0], made[streams]));
}

// Device memory from a stream-ordered pool of strata's own, which keeps what it has mapped (its
// release threshold is unbounded) until the Runtime ends: up to the most the Runtime held at once
// (within its device budget) plus the pool's rounding. A pool giving its memory back at every
// synchronization (the default pool's threshold, 0) would map and unmap device memory for each
// partition lent.
class CudaDeviceResource final : public MemoryResource {
 public:
  CudaDeviceResource(int device, cudaStream_t stream, cudaMemPool_t pool)
      : device_(device), stream_(stream), pool_(pool) {}
  ~CudaDeviceResource() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    cudaMemPoolDestroy(pool_);
  }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    cudaSetDevice(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, pool_, stream_);
    if (err == cudaSuccess) cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaMallocFromPoolAsync of ", bytes, " bytes: ", cudaGetErrorName(err)));
    }
    return p;
  }
  void Deallocate(void* p, size_t) override {
    cudaSetDevice(device_);
    cudaFreeAsync(p, stream_);
  }
  absl::string_view name() const override { return "CUDA device memory"; }

 private:
  int device_;
  cudaStream_t stream_;
  cudaMemPool_t pool_;
};

absl::StatusOr<std::unique_ptr<MemoryResource>> CreateCudaDeviceResource(int device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device memory: no CUDA device ", device));
  }
  cudaSetDevice(device);
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool;
  err = cudaMemPoolCreate(&pool, &props);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device memory: cudaMemPoolCreate: ", cudaGetErrorName(err)));
  }
  uint64_t keep_all = UINT64_MAX;
  err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
  cudaStream_t stream = nullptr;
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    cudaGetLastError();
    cudaMemPoolDestroy(pool);
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA device memory: setting up its pool and stream: ", cudaGetErrorName(err)));
  }
  return std::unique_ptr<MemoryResource>(new CudaDeviceResource(device, stream, pool));
}

absl::Status internal::CudaHostRegister(void* p, size_t bytes) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("no CUDA device");
  }
  const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("cudaHostRegister: ", cudaGetErrorName(err)));
  }
  return absl::OkStatus();
}

void internal::CudaHostUnregister(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

#else

absl::Status internal::CudaHostRegister(void*, size_t) {
  return absl::UnimplementedError("strata was built without CUDA");
}

void internal::CudaHostUnregister(void*) {}

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(int, int) {
  return absl::UnimplementedError("CUDA copy engine: strata was built without CUDA");
}

absl::StatusOr<std::unique_ptr<MemoryResource>> CreateCudaDeviceResource(int) {
  return absl::UnimplementedError("CUDA device memory: strata was built without CUDA");
}

#endif

}  // namespace strata::tiering
