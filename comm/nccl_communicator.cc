#include "comm/nccl_communicator.h"

#include "absl/strings/str_cat.h"

#if STRATA_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "base/mutex.h"
#endif

namespace strata::comm {

#if !STRATA_HAVE_NCCL

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(TcpStore&,
                                                                     const NcclOptions&) {
  return absl::UnimplementedError(
      "NCCL: strata was built without NCCL (the CUDA toolkit or its NCCL was not found); Gloo "
      "serves host buffers");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(
      absl::StrCat("NCCL communicator: ", what, ": ", cudaGetErrorString(e)));
}

absl::Status NcclError(ncclResult_t r, const std::string& what) {
  return absl::UnavailableError(
      absl::StrCat("NCCL communicator: ", what, ": ", ncclGetErrorString(r)));
}

// Shared by the communicator and its Works: the comm, and whether it is broken.
struct State {
  ncclComm_t comm = nullptr;
  int device = 0;
  Duration timeout{0};
  Mutex mu;
  absl::Status broken ABSL_GUARDED_BY(mu);
};

// Polls until NCCL's asynchronous state leaves ncclInProgress (and, with an event, the event has
// completed), or the timeout passes, when the communicator is aborted.
absl::Status Poll(State& s, cudaEvent_t event, const std::string& what) {
  const auto deadline = Clock::now() + s.timeout;
  while (true) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(s.comm, &async);
    if (r != ncclSuccess) return NcclError(r, what);
    if (async != ncclSuccess && async != ncclInProgress) return NcclError(async, what);
    if (async == ncclSuccess) {
      if (event == nullptr) return absl::OkStatus();
      cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaError(e, what.c_str());
    }
    if (Clock::now() > deadline) {
      ncclCommAbort(s.comm);
      s.comm = nullptr;
      return absl::DeadlineExceededError(
          absl::StrCat("NCCL communicator: ", what, " did not complete within ", s.timeout.count(),
                       " ms (a rank died or stopped answering?); the communicator was aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<State> state, cudaEvent_t event, std::string what, absl::Status early)
      : state_(std::move(state)), event_(event), what_(std::move(what)), early_(std::move(early)) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  absl::Status Wait() override {
    MutexLock lock(&mu_);
    if (finished_) return status_;
    if (!early_.ok()) {
      status_ = early_;
    } else {
      MutexLock state_lock(&state_->mu);
      if (!state_->broken.ok()) {
        status_ = state_->broken;
      } else {
        cudaSetDevice(state_->device);
        status_ = Poll(*state_, event_, what_);
        if (!status_.ok()) state_->broken = status_;
      }
    }
    finished_ = true;
    return status_;
  }
  bool WaitFor(std::chrono::milliseconds timeout) override {
    // The event is polled (a blocking wait would not see NCCL's asynchronous errors): in steps.
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  }
  bool done() const override {
    MutexLock lock(&mu_);
    return finished_ || !early_.ok() ||
           (event_ != nullptr && cudaEventQuery(event_) != cudaErrorNotReady);
  }

 private:
  std::shared_ptr<State> state_;
  cudaEvent_t event_;
  const std::string what_;
  const absl::Status early_;
  mutable Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<State> state, int rank, int size, cudaStream_t stream,
                   float* scratch)
      : state_(std::move(state)), rank_(rank), size_(size), stream_(stream), scratch_(scratch) {}
  ~NcclCommunicator() override {
    cudaSetDevice(state_->device);
    cudaStreamSynchronize(stream_);
    MutexLock lock(&state_->mu);
    if (state_->comm != nullptr) {
      if (state_->broken.ok()) {
        ncclCommDestroy(state_->comm);
      } else {
        ncclCommAbort(state_->comm);
      }
      state_->comm = nullptr;
    }
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void Abort() override {
    MutexLock lock(&state_->mu);
    if (state_->broken.ok()) {
      state_->broken = absl::CancelledError(
          absl::StrCat("nccl: rank ", rank_, " of ", size_,
                       ": the communicator was aborted (a wait for a collective was interrupted)"));
    }
    if (state_->comm != nullptr) {
      cudaSetDevice(state_->device);
      ncclCommAbort(state_->comm);
      state_->comm = nullptr;
    }
  }

  std::shared_ptr<Work> AllGather(absl::Span<const std::byte> in,
                                  absl::Span<std::byte> out) override {
    if (out.size() != in.size() * static_cast<size_t>(size_)) {
      return Refused("all-gather",
                     absl::StrCat("the output holds ", out.size(),
                                  " bytes; accepted: size x the input's ", in.size()));
    }
    return Issue("all-gather", [&](ncclComm_t c) {
      return ncclAllGather(in.data(), out.data(), in.size(), ncclUint8, c, stream_);
    });
  }
  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> in, absl::Span<float> out) override {
    if (in.size() != out.size() * static_cast<size_t>(size_)) {
      return Refused("reduce-scatter",
                     absl::StrCat("the input holds ", in.size(),
                                  " floats; accepted: size x the output's ", out.size()));
    }
    return Issue("reduce-scatter", [&](ncclComm_t c) {
      return ncclReduceScatter(in.data(), out.data(), out.size(), ncclFloat32, ncclSum, c, stream_);
    });
  }
  std::shared_ptr<Work> AllReduce(absl::Span<float> data) override {
    return Issue("all-reduce", [&](ncclComm_t c) {
      return ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat32, ncclSum, c, stream_);
    });
  }
  std::shared_ptr<Work> Broadcast(absl::Span<std::byte> data, int root) override {
    if (root < 0 || root >= size_) {
      return Refused("broadcast", absl::StrCat("root ", root, "; accepted: 0..", size_ - 1));
    }
    return Issue("broadcast", [&](ncclComm_t c) {
      return ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8, root, c, stream_);
    });
  }
  std::shared_ptr<Work> Barrier() override {
    return Issue("barrier", [&](ncclComm_t c) {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, c, stream_);
    });
  }

 private:
  std::shared_ptr<Work> Refused(const char* what, const std::string& why) {
    return std::make_shared<NcclWork>(state_, nullptr, what,
                                      absl::InvalidArgumentError(absl::StrCat(what, ": ", why)));
  }

  template <typename Launch>
  std::shared_ptr<Work> Issue(const char* what, Launch launch) {
    MutexLock lock(&state_->mu);
    if (!state_->broken.ok())
      return std::make_shared<NcclWork>(state_, nullptr, what, state_->broken);
    cudaSetDevice(state_->device);
    ncclResult_t r = launch(state_->comm);
    if (r != ncclSuccess && r != ncclInProgress) {
      state_->broken = NcclError(r, what);
      return std::make_shared<NcclWork>(state_, nullptr, what, state_->broken);
    }
    cudaEvent_t event = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(event, stream_);
    if (e != cudaSuccess) {
      state_->broken = CudaError(e, what);
      if (event != nullptr) cudaEventDestroy(event);
      return std::make_shared<NcclWork>(state_, nullptr, what, state_->broken);
    }
    return std::make_shared<NcclWork>(state_, event, what, absl::OkStatus());
  }

  std::shared_ptr<State> state_;
  const int rank_, size_;
  cudaStream_t stream_;
  float* scratch_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(TcpStore& store,
                                                                     const NcclOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL: rank ", options.rank, " of world size ",
                                                   options.size, "; accepted: 0 <= rank < size"));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError("NCCL: no CUDA device on this machine");
  }
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NCCL: device ", options.device, "; accepted: 0..", devices - 1, " (this machine's GPUs)"));
  }
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return CudaError(e, "cudaSetDevice");
  }
  ncclUniqueId id;
  const std::string key = options.prefix + "/unique-id";
  if (options.rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return NcclError(r, "ncclGetUniqueId");
    }
    absl::Status s =
        store.Set(key, std::vector<char>(id.internal, id.internal + sizeof id.internal));
    if (!s.ok()) return s;
  } else {
    auto v = store.Get(key, options.timeout);
    if (!v.ok()) return v.status();
    if (v->size() != sizeof id.internal) {
      return absl::DataLossError("NCCL: rank 0's unique id has the wrong size");
    }
    std::memcpy(id.internal, v->data(), sizeof id.internal);
  }
  auto state = std::make_shared<State>();
  state->device = options.device;
  state->timeout = options.timeout;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that the timeout can end a rendezvous a rank never comes to
  ncclResult_t r = ncclCommInitRankConfig(&state->comm, options.size, id, options.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, "ncclCommInitRankConfig");
  if (absl::Status s = Poll(*state, nullptr, "joining the other ranks"); !s.ok()) return s;
  cudaStream_t stream = nullptr;
  float* scratch = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&scratch), sizeof(float));
  if (e != cudaSuccess) {
    ncclCommDestroy(state->comm);
    if (stream != nullptr) cudaStreamDestroy(stream);
    return CudaError(e, "making its stream");
  }
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(std::move(state), options.rank, options.size, stream, scratch));
}

#endif  // STRATA_HAVE_NCCL

}  // namespace strata::comm
