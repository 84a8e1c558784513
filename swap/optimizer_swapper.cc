#include "swap/optimizer_swapper.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace strata::swap {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
uint64_t StateBytes(uint64_t elements) { return elements * 3 * sizeof(float); }
// The most elements whose state bytes a uint64_t holds.
constexpr uint64_t kMaxElements = std::numeric_limits<uint64_t>::max() / (3 * sizeof(float));
// The param copy's element: bf16 or fp16, the copy dtypes CpuAdam writes (it refuses others).
// Bytes per element of a param copy: fp32 (a trainer computing in fp32), bf16 or fp16.
uint64_t CopyBytes(optim_cpu::DType t) { return t == optim_cpu::DType::kF32 ? 4 : 2; }

absl::Span<const std::byte> Bytes(const float* p, uint64_t elements) {
  return {reinterpret_cast<const std::byte*>(p), StateBytes(elements)};
}
absl::Span<std::byte> MutableBytes(float* p, uint64_t elements) {
  return {reinterpret_cast<std::byte*>(p), StateBytes(elements)};
}

}  // namespace

absl::StatusOr<std::unique_ptr<PipelinedOptimizerSwapper>> PipelinedOptimizerSwapper::Create(
    tiering::NvmeStore* store, optim_cpu::CpuAdam* adam, tiering::MemoryResource* host,
    const OptimizerSwapperConfig& config,
    const std::vector<std::pair<tiering::PartitionId, uint64_t>>& partitions) {
  if (adam == nullptr) {
    return absl::InvalidArgumentError("optimizer swapper: the optimizer is required");
  }
  std::unique_ptr<optim_cpu::ChunkOptimizer> adapter = optim_cpu::BorrowAdam(adam);
  auto s = Create(store, adapter.get(), host, config, partitions);
  if (s.ok()) (*s)->owned_optimizer_ = std::move(adapter);
  return s;
}

absl::StatusOr<std::unique_ptr<PipelinedOptimizerSwapper>> PipelinedOptimizerSwapper::Create(
    tiering::NvmeStore* store, optim_cpu::ChunkOptimizer* optimizer, tiering::MemoryResource* host,
    const OptimizerSwapperConfig& config,
    const std::vector<std::pair<tiering::PartitionId, uint64_t>>& partitions) {
  if (optimizer == nullptr || host == nullptr) {
    return absl::InvalidArgumentError(
        "optimizer swapper: the optimizer and host memory are required");
  }
  const bool pipelined = config.pipeline_read || config.pipeline_write;
  if (config.ring_buffers < 0 || config.ring_buffers > 64 ||
      (pipelined && config.ring_buffers > 0 && config.ring_buffers < 3)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer swapper: ring_buffers is ", config.ring_buffers,
                     "; accepted: 0 (the default), or ", pipelined ? "3" : "1",
                     "..64 (pipelined steps need 3)"));
  }
  auto s = std::unique_ptr<PipelinedOptimizerSwapper>(new PipelinedOptimizerSwapper());
  s->store_ = store;
  s->optimizer_ = optimizer;
  s->host_ = host;
  s->config_ = config;
  uint64_t in_cpu = 0;
  for (const auto& [id, elements] : partitions) {
    if (elements == 0 || elements > kMaxElements) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer swapper: partition ", id, " has ",
                                                     elements, " elements (accepted: 1 to ",
                                                     kMaxElements, ", 12 state bytes each)"));
    }
    if (s->parts_.contains(id)) {  // before anything is allocated for it
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer swapper: partition ", id, " listed twice"));
    }
    Part part;
    part.elements = elements;
    if (StateBytes(elements) <= config.max_in_cpu_bytes - in_cpu) {  // in_cpu <= max_in_cpu
      STRATA_ASSIGN_OR_RETURN(void* p, host->Allocate(StateBytes(elements)));
      part.host_state = static_cast<float*>(p);
      std::memset(p, 0, StateBytes(elements));
      in_cpu += StateBytes(elements);
    } else {
      if (store == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("optimizer swapper: partition ", id, " does not fit in max_in_cpu (",
                         config.max_in_cpu_bytes, " bytes) and there is no NVMe store"));
      }
      s->buffer_bytes_ = std::max(s->buffer_bytes_, StateBytes(elements));
    }
    s->parts_.emplace(id, part);
  }
  if (s->buffer_bytes_ > 0) {
    const int count = config.ring_buffers > 0 ? config.ring_buffers : pipelined ? 3 : 1;
    for (int i = 0; i < count; ++i) {
      STRATA_ASSIGN_OR_RETURN(void* p, host->Allocate(s->buffer_bytes_));
      s->buffers_.push_back(static_cast<float*>(p));
    }
  }
  return s;
}

PipelinedOptimizerSwapper::~PipelinedOptimizerSwapper() {
  if (copy_staging_ != nullptr) host_->Deallocate(copy_staging_, copy_staging_bytes_);
  for (float* b : buffers_) host_->Deallocate(b, buffer_bytes_);
  for (auto& [id, part] : parts_) {
    if (part.host_state != nullptr) host_->Deallocate(part.host_state, StateBytes(part.elements));
  }
}

absl::StatusOr<const PipelinedOptimizerSwapper::Part*> PipelinedOptimizerSwapper::Find(
    tiering::PartitionId id) const {
  auto it = parts_.find(id);
  if (it == parts_.end()) {
    return absl::NotFoundError(absl::StrCat("optimizer swapper: no partition ", id));
  }
  return &it->second;
}

bool PipelinedOptimizerSwapper::on_nvme(tiering::PartitionId id) const {
  auto it = parts_.find(id);
  return it != parts_.end() && it->second.host_state == nullptr;
}

absl::Status PipelinedOptimizerSwapper::Initialize(tiering::PartitionId id,
                                                   absl::Span<const float> master,
                                                   float initial_state) {
  STRATA_ASSIGN_OR_RETURN(const Part* part, Find(id));
  if (master.size() != part->elements) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer swapper: partition ", id, " has ",
                                                   part->elements, " elements, got ",
                                                   master.size()));
  }
  float* state = part->host_state != nullptr ? part->host_state : buffers_.front();
  std::memcpy(state, master.data(), master.size() * sizeof(float));
  std::fill(state + part->elements, state + 2 * part->elements, initial_state);
  std::memset(state + 2 * part->elements, 0, part->elements * sizeof(float));
  if (part->host_state != nullptr) return absl::OkStatus();
  std::unique_ptr<tiering::NvmeStore::Batch> batch = store_->NewBatch();
  STRATA_RETURN_IF_ERROR(batch->Stage(StoreKey(id), Bytes(state, part->elements)));
  return batch->Commit();
}

absl::Status PipelinedOptimizerSwapper::ReadState(tiering::PartitionId id, absl::Span<float> master,
                                                  absl::Span<float> exp_avg,
                                                  absl::Span<float> exp_avg_sq) {
  STRATA_ASSIGN_OR_RETURN(const Part* part, Find(id));
  const uint64_t n = part->elements;
  if (master.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer swapper: partition ", id, " has ", n, " elements"));
  }
  const float* state = part->host_state;
  if (state == nullptr) {
    STRATA_RETURN_IF_ERROR(store_->Get(StoreKey(id), MutableBytes(buffers_.front(), n)));
    state = buffers_.front();
  }
  std::memcpy(master.data(), state, n * sizeof(float));
  std::memcpy(exp_avg.data(), state + n, n * sizeof(float));
  std::memcpy(exp_avg_sq.data(), state + 2 * n, n * sizeof(float));
  return absl::OkStatus();
}

void PipelinedOptimizerSwapper::Emit(StepEvent event, tiering::PartitionId id) const {
  if (config_.on_event) config_.on_event(event, id);
}

absl::Status PipelinedOptimizerSwapper::ReserveCopyStaging(uint64_t bytes) {
  if (bytes <= copy_staging_bytes_) return absl::OkStatus();
  if (copy_staging_ != nullptr) host_->Deallocate(copy_staging_, copy_staging_bytes_);
  copy_staging_ = nullptr;
  copy_staging_bytes_ = 0;
  STRATA_ASSIGN_OR_RETURN(void* p, host_->Allocate(bytes));
  copy_staging_ = static_cast<std::byte*>(p);
  copy_staging_bytes_ = bytes;
  return absl::OkStatus();
}

absl::StatusOr<StepReport> PipelinedOptimizerSwapper::Step(int64_t t,
                                                           absl::Span<const StepInput> inputs,
                                                           const optim_cpu::StepOptions& options) {
  StepReport report;
  const auto t0 = Clock::now();
  const std::string unchanged = absl::StrCat("optimizer step ", t, ": nothing was changed");
  // Every input is checked before anything is read, stepped or written.
  struct Planned {
    const StepInput* in;
    const Part* part;
    std::byte* staged_copy;  // NVMe-resident with a param_copy: where its copy is staged
  };
  std::vector<Planned> nvme, host;
  absl::flat_hash_set<tiering::PartitionId> seen;
  uint64_t staging_bytes = 0;
  for (const StepInput& in : inputs) {
    const std::string context = absl::StrCat("optimizer step ", t, ": partition ", in.id);
    auto part = Find(in.id);
    if (!part.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": not one of the swapper's partitions; nothing was changed"));
    }
    if (!seen.insert(in.id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(context,
                       ": listed twice (each partition at most once per step); nothing "
                       "was changed"));
    }
    // What CpuAdam would refuse (null grad, a dtype it does not take, t < 1, ...), checked on
    // stand-in state pointers.
    float stand_in = 0;
    optim_cpu::AdamChunk c;
    c.param = &stand_in;
    c.exp_avg = c.exp_avg_sq = &stand_in;
    c.grad = in.grad;
    c.grad_dtype = in.grad_dtype;
    c.param_copy = in.param_copy;
    c.copy_dtype = in.copy_dtype;
    c.size = (*part)->elements;
    if (absl::Status s = optimizer_->Validate(t, c, options); !s.ok()) {
      return Annotate(s, absl::StrCat(context, ": nothing was changed"));
    }
    if ((*part)->host_state != nullptr) {
      host.push_back({&in, *part, nullptr});
    } else {
      nvme.push_back({&in, *part, nullptr});
      if (in.param_copy != nullptr) staging_bytes += (*part)->elements * CopyBytes(in.copy_dtype);
    }
  }
  if (options.check_overflow) {
    for (const StepInput& in : inputs) {
      if (optimizer_->HasNonFinite(in.grad, in.grad_dtype, parts_.at(in.id).elements)) {
        report.overflow = true;
        report.seconds = Since(t0);
        return report;
      }
    }
  }
  if (absl::Status s = ReserveCopyStaging(staging_bytes); !s.ok()) {
    return Annotate(s, absl::StrCat(unchanged,
                                    " (staging the param copies of its NVMe-resident "
                                    "partitions needs ",
                                    staging_bytes, " bytes of host memory)"));
  }
  uint64_t staged_at = 0;
  for (Planned& p : nvme) {
    if (p.in->param_copy == nullptr) continue;
    p.staged_copy = copy_staging_ + staged_at;
    staged_at += p.part->elements * CopyBytes(p.in->copy_dtype);
  }

  optim_cpu::StepOptions no_check = options;
  no_check.check_overflow = false;
  auto step_one = [&](const StepInput& in, uint64_t n, float* state,
                      void* param_copy) -> absl::Status {
    optim_cpu::AdamChunk c;
    c.param = state;
    c.exp_avg = state + n;
    c.exp_avg_sq = state + 2 * n;
    c.grad = in.grad;
    c.grad_dtype = in.grad_dtype;
    c.param_copy = param_copy;
    c.copy_dtype = in.copy_dtype;
    c.size = n;
    const auto c0 = Clock::now();
    absl::Status s = optimizer_->Step(t, c, no_check).status();
    report.compute_seconds += Since(c0);
    return s;
  };

  // NVMe-resident partitions: read k+1 | step k | write k-1, staged in one batch.
  std::unique_ptr<tiering::NvmeStore::Batch> batch;
  if (!nvme.empty()) batch = store_->NewBatch();
  const size_t n_parts = nvme.size();
  const size_t ring = buffers_.size();
  using Result = std::pair<absl::Status, double>;  // status, seconds
  std::vector<std::future<Result>> reads(n_parts);
  std::vector<std::shared_future<Result>> writes(n_parts);
  auto id_of = [&](size_t k) { return nvme[k].in->id; };
  auto start_read = [&](size_t k) {
    float* buf = buffers_[k % ring];
    const tiering::PartitionId id = id_of(k);
    const uint64_t n = nvme[k].part->elements;
    auto work = [this, buf, id, n] {
      Emit(StepEvent::kReadStarted, id);
      const auto r0 = Clock::now();
      absl::Status s = store_->Get(StoreKey(id), MutableBytes(buf, n));
      return Result(s, Since(r0));
    };
    if (config_.pipeline_read) {
      reads[k] = std::async(std::launch::async, work);
      Emit(StepEvent::kReadLaunched, id);
    } else {
      reads[k] = std::async(std::launch::deferred, work);
    }
  };
  auto await_write = [&](size_t k) -> const Result& {
    Emit(StepEvent::kWriteAwaited, id_of(k));
    return writes[k].get();
  };
  auto start_write = [&](size_t k) {
    float* buf = buffers_[k % ring];
    const tiering::PartitionId id = id_of(k);
    const uint64_t n = nvme[k].part->elements;
    std::shared_future<Result> prev = k > 0 ? writes[k - 1] : std::shared_future<Result>();
    // Writes are staged one after another (a Batch is used by one thread at a time).
    auto work = [this, buf, id, n, prev, b = batch.get()] {
      if (prev.valid()) prev.wait();
      Emit(StepEvent::kWriteStarted, id);
      const auto w0 = Clock::now();
      absl::Status s = b->Stage(StoreKey(id), Bytes(buf, n));
      return Result(s, Since(w0));
    };
    if (config_.pipeline_write) {
      writes[k] = std::async(std::launch::async, work).share();
      Emit(StepEvent::kWriteLaunched, id);
    } else {
      writes[k] = std::async(std::launch::deferred, work).share();
      await_write(k);
    }
  };
  absl::Status failure;
  if (n_parts > 0) start_read(0);
  for (size_t k = 0; k < n_parts && failure.ok(); ++k) {
    // Read k+1 ahead (pipeline_read) into its buffer, which k+1-ring used last: that write must
    // be done first.
    auto start_next = [&] {
      if (k + 1 >= n_parts) return;
      if (k + 1 >= ring) {
        if (const absl::Status& s = await_write(k + 1 - ring).first; !s.ok()) {
          failure = s;
          return;
        }
      }
      start_read(k + 1);
    };
    if (config_.pipeline_read) start_next();
    if (!failure.ok()) break;
    Emit(StepEvent::kReadAwaited, id_of(k));
    auto [read_status, read_s] = reads[k].get();
    report.read_seconds += read_s;
    if (!read_status.ok()) {
      failure = read_status;
      break;
    }
    report.bytes_read += StateBytes(nvme[k].part->elements);
    Emit(StepEvent::kStepStarted, id_of(k));
    absl::Status stepped =
        step_one(*nvme[k].in, nvme[k].part->elements, buffers_[k % ring], nvme[k].staged_copy);
    Emit(StepEvent::kStepFinished, id_of(k));
    if (!stepped.ok()) {
      failure = stepped;
      break;
    }
    start_write(k);
    if (!config_.pipeline_read) start_next();
  }
  // Wait for everything in flight before deciding (no I/O may outlive this call).
  for (size_t k = 0; k < n_parts; ++k) {
    // A deferred read that was never needed is not run.
    if (reads[k].valid() &&
        reads[k].wait_for(std::chrono::seconds(0)) != std::future_status::deferred) {
      Emit(StepEvent::kReadAwaited, id_of(k));
      reads[k].wait();
    }
    if (writes[k].valid()) {
      const Result& w = await_write(k);
      report.write_seconds += w.second;
      if (w.first.ok()) {
        report.bytes_written += StateBytes(nvme[k].part->elements);
      } else if (failure.ok()) {
        failure = w.first;
      }
    }
  }
  if (!failure.ok()) {
    if (batch) batch->Abort();
    return Annotate(failure, absl::StrCat(unchanged, " (the NVMe state is step ", t - 1, "'s)"));
  }
  if (batch) {
    const auto c0 = Clock::now();
    absl::Status committed = batch->Commit();
    report.write_seconds += Since(c0);
    if (!committed.ok()) return Annotate(committed, unchanged);
  }
  // Committed: what the caller sees changes now, by steps that cannot fail. The staged param
  // copies go out, then the host-resident partitions step (their inputs were validated above, so
  // CpuAdam has nothing left to refuse: an error here is a bug, reported as such).
  for (const Planned& p : nvme) {
    if (p.staged_copy != nullptr) {
      std::memcpy(p.in->param_copy, p.staged_copy, p.part->elements * CopyBytes(p.in->copy_dtype));
    }
  }
  for (const Planned& p : host) {
    if (absl::Status s = step_one(*p.in, p.part->elements, p.part->host_state, p.in->param_copy);
        !s.ok()) {
      return absl::InternalError(absl::StrCat(
          "optimizer step ", t, ": the NVMe state was committed but host-resident partition ",
          p.in->id, " failed after validation: ", s.message()));
    }
  }
  report.seconds = Since(t0);
  return report;
}

}  // namespace strata::swap
