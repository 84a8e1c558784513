// The CUDA pieces of tiering/: the copy engine (cudaMemcpyAsync on a stream) and the device
// memory resource (stream-ordered cudaMallocAsync). The only file of this module where
// STRATA_HAVE_CUDA appears; without CUDA the factories return Unimplemented.
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

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaCopyEngine() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  void Copy(void* dst, const void* src, size_t bytes, CopyDirection direction, Done done) override {
    cudaSetDevice(device_);
    const cudaError_t err = cudaMemcpyAsync(
        dst, src, bytes,
        direction == CopyDirection::kHostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
        stream_);
    Complete(err, absl::StrCat("cudaMemcpyAsync of ", bytes, " bytes"), std::move(done));
  }
  void Zero(void* dst, size_t bytes, Done done) override {
    cudaSetDevice(device_);
    const cudaError_t err = cudaMemsetAsync(dst, 0, bytes, stream_);
    Complete(err, absl::StrCat("cudaMemsetAsync of ", bytes, " bytes"), std::move(done));
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
    err = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      cudaEventDestroy(event);
      return absl::InvalidArgumentError(
          absl::StrCat("cudaEventRecord on the trainer's stream: ", cudaGetErrorName(err),
                       " (pass a cudaStream_t of this device, or null)"));
    }
    return std::shared_ptr<Fence>(new EventFence(device_, event));
  }

 private:
  // `done` runs once the work just queued on the stream (`queued`: its status, named by `what`)
  // has run: from a host function queued behind it.
  void Complete(cudaError_t queued, absl::string_view what, Done done) {
    if (queued != cudaSuccess) {
      std::move(done)(absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(queued))));
      return;
    }
    auto* heap = new Done(std::move(done));
    const cudaError_t cb = cudaLaunchHostFunc(
        stream_,
        [](void* arg) {
          auto* d = static_cast<Done*>(arg);
          std::move (*d)(absl::OkStatus());
          delete d;
        },
        heap);
    if (cb != cudaSuccess) {
      cudaStreamSynchronize(stream_);
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
  cudaStream_t stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(int device) {
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
  cudaStream_t stream;
  err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA copy engine: cudaStreamCreate: ", cudaGetErrorName(err)));
  }
  return std::unique_ptr<CopyEngine>(new CudaCopyEngine(device, stream));
}

class CudaDeviceResource final : public MemoryResource {
 public:
  CudaDeviceResource(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaDeviceResource() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    cudaSetDevice(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMallocAsync(&p, bytes, stream_);
    if (err == cudaSuccess) cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaMallocAsync of ", bytes, " bytes: ", cudaGetErrorName(err)));
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
  cudaStream_t stream;
  err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device memory: cudaStreamCreate: ", cudaGetErrorName(err)));
  }
  return std::unique_ptr<MemoryResource>(new CudaDeviceResource(device, stream));
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

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(int) {
  return absl::UnimplementedError("CUDA copy engine: strata was built without CUDA");
}

absl::StatusOr<std::unique_ptr<MemoryResource>> CreateCudaDeviceResource(int) {
  return absl::UnimplementedError("CUDA device memory: strata was built without CUDA");
}

#endif

}  // namespace strata::tiering
