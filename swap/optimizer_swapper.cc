#include "swap/optimizer_swapper.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/mutex.h"
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
      if (config.commit_each) {
        s->copy_buffer_bytes_ = s->buffer_bytes_ / 3;  // an fp32 copy: 4 bytes of 12
        STRATA_ASSIGN_OR_RETURN(void* c, host->Allocate(s->copy_buffer_bytes_));
        s->copy_buffers_.push_back(static_cast<std::byte*>(c));
      }
    }
  }
  return s;
}

PipelinedOptimizerSwapper::~PipelinedOptimizerSwapper() {
  Abort();
  AbortLoad();
  if (copy_staging_ != nullptr) host_->Deallocate(copy_staging_, copy_staging_bytes_);
  for (float* b : buffers_) host_->Deallocate(b, buffer_bytes_);
  for (std::byte* b : copy_buffers_) host_->Deallocate(b, copy_buffer_bytes_);
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

absl::StatusOr<uint64_t> PipelinedOptimizerSwapper::elements(tiering::PartitionId id) const {
  STRATA_ASSIGN_OR_RETURN(const Part* part, Find(id));
  return part->elements;
}

bool PipelinedOptimizerSwapper::on_nvme(tiering::PartitionId id) const {
  auto it = parts_.find(id);
  return it != parts_.end() && it->second.host_state == nullptr;
}

absl::Status PipelinedOptimizerSwapper::Initialize(tiering::PartitionId id,
                                                   absl::Span<const float> master,
                                                   float initial_state) {
  if (txn_ != nullptr) {
    return absl::FailedPreconditionError(
        "optimizer swapper: a step is being staged (Commit or Abort it first)");
  }
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
  WaitForEarlySteps();  // no host-resident state is read while it steps
  // The committed state (a staged step changes nothing before its Commit). While one is staged
  // the ring is the worker's: the blob is read into memory of its own.
  const float* state = part->host_state;
  std::unique_ptr<float[]> own;
  if (state == nullptr) {
    float* into = buffers_.front();
    if (txn_ != nullptr) {
      own = std::make_unique<float[]>(3 * n);
      into = own.get();
    }
    STRATA_RETURN_IF_ERROR(store_->Get(StoreKey(id), MutableBytes(into, n)));
    state = into;
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

struct PipelinedOptimizerSwapper::Txn {
  struct Item {
    StepInput in;
    int64_t t = 0;
    optim_cpu::StepOptions options;
    const Part* part = nullptr;
    std::byte* staged_copy = nullptr;  // NVMe-resident with a param_copy: where it is staged
    std::shared_ptr<const GradSource> source;  // for a null in.grad
    std::shared_ptr<const CopySink> sink;      // for in.copy_to_sink
  };
  Mutex mu;
  CondVar staged;  // an item was staged, or the transaction closed
  // The NVMe-resident items (a deque: the worker holds references while more are staged).
  std::deque<Item> nvme ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;     // Commit or Abort: nothing more is staged
  bool cancelled ABSL_GUARDED_BY(mu) = false;  // Abort: stop at the next item
  // The caller's:
  std::vector<Item> host;
  absl::flat_hash_set<tiering::PartitionId> seen;
  uint64_t copy_used = 0;
  Clock::time_point t0;
  int64_t first_t = 0;
  // The worker's until it is joined:
  std::unique_ptr<tiering::NvmeStore::Batch> batch;
  absl::Status failure;
  bool overflow = false;
  StepReport report;
  std::thread worker;
  // host_early: the host-resident items, stepped in place by early_worker as they come; what it
  // stepped, its failure and its compute time are its own until it is joined.
  bool host_early = false;
  std::deque<Item> early ABSL_GUARDED_BY(mu);
  size_t early_done ABSL_GUARDED_BY(mu) = 0;       // items of `early` the worker is done with
  bool early_stopped ABSL_GUARDED_BY(mu) = false;  // it returned (closed, cancelled or failed)
  CondVar early_progress;                          // early_done or early_stopped changed
  std::vector<tiering::PartitionId> stepped_early;
  // commit_each: the NVMe-resident partitions whose new state has landed (the worker's).
  std::vector<tiering::PartitionId> landed;
  absl::Status early_failure;
  double early_compute_s = 0;
  std::thread early_worker;
};

namespace {

// Steps host-resident partition `it` in place with gradient `grad` (validated when staged).
absl::Status StepInPlace(optim_cpu::ChunkOptimizer* optimizer, const StepInput& in, int64_t t,
                         const optim_cpu::StepOptions& given, float* state, uint64_t n,
                         const void* grad) {
  optim_cpu::AdamChunk c;
  c.param = state;
  c.exp_avg = state + n;
  c.exp_avg_sq = state + 2 * n;
  c.grad = grad;
  c.grad_dtype = in.grad_dtype;
  c.param_copy = in.param_copy;
  c.copy_dtype = in.copy_dtype;
  c.size = n;
  optim_cpu::StepOptions options = given;
  options.check_overflow = false;
  return optimizer->Step(t, c, options).status();
}

}  // namespace

absl::StatusOr<std::vector<const PipelinedOptimizerSwapper::Part*>>
PipelinedOptimizerSwapper::ValidateInputs(int64_t t, absl::Span<const StepInput> inputs,
                                          const optim_cpu::StepOptions& options, bool have_source,
                                          absl::flat_hash_set<tiering::PartitionId>* seen) const {
  std::vector<const Part*> out;
  out.reserve(inputs.size());
  absl::flat_hash_set<tiering::PartitionId> added;
  for (const StepInput& in : inputs) {
    const std::string context = absl::StrCat("optimizer step ", t, ": partition ", in.id);
    auto part = Find(in.id);
    if (!part.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": not one of the swapper's partitions; nothing was changed"));
    }
    if (seen->contains(in.id) || !added.insert(in.id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(context,
                       ": listed twice (each partition at most once per step); nothing "
                       "was changed"));
    }
    // What the optimizer would refuse (null grad, a dtype it does not take, t < 1, ...), checked
    // on stand-in state pointers (and a stand-in gradient for one that comes from the source).
    float stand_in = 0;
    optim_cpu::AdamChunk c;
    c.param = &stand_in;
    c.exp_avg = c.exp_avg_sq = &stand_in;
    c.grad = in.grad == nullptr && have_source ? &stand_in : in.grad;
    c.grad_dtype = in.grad_dtype;
    c.param_copy = in.copy_to_sink ? &stand_in : in.param_copy;  // its dtype checked too
    c.copy_dtype = in.copy_dtype;
    c.size = (*part)->elements;
    if (absl::Status s = optimizer_->Validate(t, c, options); !s.ok()) {
      return Annotate(s, absl::StrCat(context, ": nothing was changed"));
    }
    out.push_back(*part);
  }
  seen->insert(added.begin(), added.end());
  return out;
}

absl::StatusOr<StepReport> PipelinedOptimizerSwapper::Step(int64_t t,
                                                           absl::Span<const StepInput> inputs,
                                                           const optim_cpu::StepOptions& options) {
  const auto t0 = Clock::now();
  // Every input is checked before anything is read, stepped or written.
  absl::flat_hash_set<tiering::PartitionId> seen;
  STRATA_ASSIGN_OR_RETURN(std::vector<const Part*> parts,
                          ValidateInputs(t, inputs, options, false, &seen));
  if (options.check_overflow) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (optimizer_->HasNonFinite(inputs[i].grad, inputs[i].grad_dtype, parts[i]->elements)) {
        StepReport report;
        report.overflow = true;
        report.seconds = Since(t0);
        return report;
      }
    }
  }
  uint64_t staging_bytes = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (parts[i]->host_state == nullptr && inputs[i].param_copy != nullptr &&
        !config_.commit_each) {
      staging_bytes += parts[i]->elements * CopyBytes(inputs[i].copy_dtype);
    }
  }
  if (absl::Status s = Begin(staging_bytes); !s.ok()) {
    return Annotate(s, absl::StrCat("optimizer step ", t, ": nothing was changed"));
  }
  optim_cpu::StepOptions checked = options;
  checked.check_overflow = false;
  if (absl::Status s = Stage(t, inputs, checked); !s.ok()) {
    Abort();
    return s;
  }
  absl::StatusOr<StepReport> r = Commit();
  if (r.ok()) r->seconds = Since(t0);
  return r;
}

absl::Status PipelinedOptimizerSwapper::Begin(uint64_t copy_staging_bytes, bool host_early) {
  if (txn_ != nullptr) {
    return absl::FailedPreconditionError(
        "optimizer swapper: a step is already being staged (Commit or Abort it first)");
  }
  if (loading_ != nullptr) {
    return absl::FailedPreconditionError(
        "optimizer swapper: a state is being loaded (CommitLoad or AbortLoad it first)");
  }
  if (absl::Status s = ReserveCopyStaging(copy_staging_bytes); !s.ok()) {
    return Annotate(s, absl::StrCat("staging the param copies of the NVMe-resident partitions "
                                    "needs ",
                                    copy_staging_bytes, " bytes of host memory"));
  }
  if (host_early && !buffers_.empty() && !config_.commit_each) {
    return absl::FailedPreconditionError(
        "optimizer swapper: host_early with NVMe-resident partitions (their commit could fail "
        "after the host-resident ones had stepped); accepted: host_early when every partition is "
        "host-resident");
  }
  failed_early_.clear();
  txn_ = std::make_unique<Txn>();
  txn_->t0 = Clock::now();
  txn_->host_early = host_early;
  if (!buffers_.empty()) {
    if (!config_.commit_each) txn_->batch = store_->NewBatch();
    txn_->worker = std::thread([this, x = txn_.get()] { RunStaged(x); });
  }
  if (host_early) txn_->early_worker = std::thread([this, x = txn_.get()] { RunEarly(x); });
  return absl::OkStatus();
}

absl::Status PipelinedOptimizerSwapper::Stage(int64_t t, absl::Span<const StepInput> inputs,
                                              const optim_cpu::StepOptions& options,
                                              GradSource source, CopySink sink) {
  if (txn_ == nullptr) {
    return absl::FailedPreconditionError("optimizer swapper: Stage before Begin");
  }
  Txn& x = *txn_;
  if (x.host_early && options.check_overflow) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer step ", t,
        ": check_overflow in a step begun with host_early (the host-resident partitions step as "
        "they are staged, so an overflow found later could not undo them); accepted: "
        "check_overflow false, or Begin without host_early"));
  }
  if (config_.commit_each && !buffers_.empty() && options.check_overflow) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer step ", t,
        ": check_overflow with commit_each (each NVMe-resident partition's new state lands as it "
        "is written, so an overflow found later could not undo the ones before it); accepted: "
        "check_overflow false (Step checks every gradient first), or a swapper without "
        "commit_each"));
  }
  absl::flat_hash_set<tiering::PartitionId> seen = x.seen;
  STRATA_ASSIGN_OR_RETURN(std::vector<const Part*> parts,
                          ValidateInputs(t, inputs, options, static_cast<bool>(source), &seen));
  uint64_t copies = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (parts[i]->host_state == nullptr && inputs[i].param_copy != nullptr &&
        !config_.commit_each) {
      copies += parts[i]->elements * CopyBytes(inputs[i].copy_dtype);
    }
  }
  if (copies > copy_staging_bytes_ - x.copy_used) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optimizer step ", t, ": the staged param copies need ", x.copy_used + copies,
        " bytes; Begin set aside ", copy_staging_bytes_, " (nothing of this call was staged)"));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].copy_to_sink) continue;
    const char* wrong = !config_.commit_each              ? "the swapper has no commit_each"
                        : !sink                           ? "no CopySink was given"
                        : parts[i]->host_state != nullptr ? "its state is host-resident"
                        : inputs[i].param_copy != nullptr ? "it has a param_copy too"
                                                          : nullptr;
    if (wrong != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer step ", t, ": partition ", inputs[i].id, ": copy_to_sink, but ", wrong,
          "; accepted: copy_to_sink for NVMe-resident state with commit_each and a CopySink "
          "(nothing of this call was staged)"));
    }
  }
  if (x.seen.empty() && x.host.empty()) x.first_t = t;
  x.seen = std::move(seen);
  auto shared_source = source ? std::make_shared<const GradSource>(std::move(source)) : nullptr;
  auto shared_sink = sink ? std::make_shared<const CopySink>(std::move(sink)) : nullptr;
  std::vector<Txn::Item> nvme, early;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Txn::Item item;
    item.in = inputs[i];
    item.t = t;
    item.options = options;
    item.part = parts[i];
    if (item.in.grad == nullptr) item.source = shared_source;
    if (item.in.copy_to_sink) item.sink = shared_sink;
    if (parts[i]->host_state != nullptr) {
      (x.host_early ? early : x.host).push_back(std::move(item));
      continue;
    }
    if (item.in.param_copy != nullptr && !config_.commit_each) {
      item.staged_copy = copy_staging_ + x.copy_used;
      x.copy_used += parts[i]->elements * CopyBytes(item.in.copy_dtype);
    }
    nvme.push_back(std::move(item));
  }
  if (!nvme.empty() || !early.empty()) {
    MutexLock lock(&x.mu);
    for (Txn::Item& item : nvme) x.nvme.push_back(std::move(item));
    for (Txn::Item& item : early) x.early.push_back(std::move(item));
    x.staged.SignalAll();
  }
  return absl::OkStatus();
}

void PipelinedOptimizerSwapper::WaitForEarlySteps() {
  if (txn_ == nullptr || !txn_->host_early) return;
  Txn& x = *txn_;
  MutexLock lock(&x.mu);
  while (!x.early_stopped && x.early_done < x.early.size()) x.early_progress.Wait(&x.mu);
}

void PipelinedOptimizerSwapper::RunEarly(Txn* x) {
  // Each item is done (stepped or not) when the next is taken; the worker's end is announced.
  struct Stopped {
    Txn* x;
    ~Stopped() {
      MutexLock lock(&x->mu);
      x->early_stopped = true;
      x->early_progress.SignalAll();
    }
  } stopped{x};
  for (size_t k = 0;; ++k) {
    const Txn::Item* it = nullptr;
    {
      MutexLock lock(&x->mu);
      x->early_done = k;
      x->early_progress.SignalAll();
      while (!x->closed && !x->cancelled && x->early.size() <= k) x->staged.Wait(&x->mu);
      if (x->cancelled || x->early.size() <= k) return;
      it = &x->early[k];  // a deque's elements stay put while more are staged
    }
    const void* grad = it->in.grad;
    if (grad == nullptr) {
      absl::StatusOr<const void*> got = it->source->get(it->in.id);
      if (!got.ok() || *got == nullptr) {
        if (got.ok() && it->source->done) it->source->done(it->in.id);
        x->early_failure = Annotate(
            got.ok() ? absl::InternalError("the gradient source gave no address") : got.status(),
            absl::StrCat("the gradient of partition ", it->in.id));
        return;
      }
      grad = *got;
    }
    Emit(StepEvent::kStepStarted, it->in.id);
    const auto c0 = Clock::now();
    absl::Status s = StepInPlace(optimizer_, it->in, it->t, it->options, it->part->host_state,
                                 it->part->elements, grad);
    x->early_compute_s += Since(c0);
    if (it->in.grad == nullptr && it->source->done) it->source->done(it->in.id);
    Emit(StepEvent::kStepFinished, it->in.id);
    if (!s.ok()) {
      x->early_failure = s;
      return;
    }
    x->stepped_early.push_back(it->in.id);
  }
}

void PipelinedOptimizerSwapper::RunStaged(Txn* x) {
  using Result = std::pair<absl::Status, double>;  // status, seconds
  StepReport& report = x->report;
  const size_t ring = buffers_.size();
  std::vector<std::future<Result>> reads;
  std::vector<std::shared_future<Result>> writes;
  // The items seen so far (a deque's elements stay put; indexing it would race with Stage).
  std::vector<const Txn::Item*> items;
  // Item k (at most one past those seen): waits for it to be staged when `wait`; null when it is
  // not there (or will not come).
  auto item = [x, &items](size_t k, bool wait) -> const Txn::Item* {
    if (k < items.size()) return items[k];
    MutexLock lock(&x->mu);
    while (wait && !x->closed && !x->cancelled && x->nvme.size() <= k) x->staged.Wait(&x->mu);
    if (x->cancelled || x->nvme.size() <= k) return nullptr;
    items.push_back(&x->nvme[k]);
    return items.back();
  };
  auto started = [&](size_t k) { return k < reads.size() && reads[k].valid(); };
  auto start_read = [&](size_t k, const Txn::Item& it) {
    if (reads.size() <= k) reads.resize(k + 1);
    float* buf = buffers_[k % ring];
    const tiering::PartitionId id = it.in.id;
    const uint64_t n = it.part->elements;
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
    Emit(StepEvent::kWriteAwaited, items[k]->in.id);
    return writes[k].get();
  };
  auto start_write = [&](size_t k, const Txn::Item& it) {
    if (writes.size() <= k) writes.resize(k + 1);
    float* buf = buffers_[k % ring];
    const tiering::PartitionId id = it.in.id;
    const uint64_t n = it.part->elements;
    std::shared_future<Result> prev = k > 0 ? writes[k - 1] : std::shared_future<Result>();
    // With commit_each, the param copy computed into this slot's copy buffer goes out once the
    // state has landed.
    std::byte* copy = config_.commit_each ? copy_buffers_[k % ring] : nullptr;
    void* copy_to = copy != nullptr ? it.in.param_copy : nullptr;
    const uint64_t copy_bytes = n * CopyBytes(it.in.copy_dtype);
    const CopySink* sink = copy != nullptr && it.in.copy_to_sink ? it.sink.get() : nullptr;
    const tiering::PartitionId target = it.in.sink_target;
    // Writes are staged one after another (a Batch is used by one thread at a time; with
    // commit_each, one Put at a time needs the store's room for one partition's second copy).
    auto work = [this, buf, id, n, prev, b = x->batch.get(), copy, copy_to, copy_bytes, sink,
                 target] {
      if (prev.valid()) prev.wait();
      Emit(StepEvent::kWriteStarted, id);
      const auto w0 = Clock::now();
      absl::Status s = b != nullptr ? b->Stage(StoreKey(id), Bytes(buf, n))
                                    : store_->Put(StoreKey(id), Bytes(buf, n));
      if (s.ok() && copy_to != nullptr) std::memcpy(copy_to, copy, copy_bytes);
      if (s.ok() && sink != nullptr) {  // landed: the copy goes where the sink says
        absl::StatusOr<void*> to = sink->get(id, target);
        if (to.ok() && *to != nullptr) {
          std::memcpy(*to, copy, copy_bytes);
          if (sink->done) sink->done(id, target);
        }
      }
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
  // Starts the read of k into its buffer, which k-ring used last: that write must be done first.
  auto read = [&](size_t k, const Txn::Item& it) -> bool {
    if (k >= ring) {
      if (const absl::Status& s = await_write(k - ring).first; !s.ok()) {
        x->failure = s;
        return false;
      }
    }
    start_read(k, it);
    return true;
  };
  size_t k = 0;
  for (;; ++k) {
    const Txn::Item* it = item(k, true);
    if (it == nullptr) break;
    if (!started(k) && !read(k, *it)) break;
    // pipeline_read: k+1's read while k steps, when it is staged already.
    if (config_.pipeline_read) {
      if (const Txn::Item* next = item(k + 1, false); next != nullptr && !started(k + 1)) {
        if (!read(k + 1, *next)) break;
      }
    }
    Emit(StepEvent::kReadAwaited, it->in.id);
    auto [read_status, read_s] = reads[k].get();
    report.read_seconds += read_s;
    if (!read_status.ok()) {
      x->failure = read_status;
      break;
    }
    report.bytes_read += StateBytes(it->part->elements);
    const void* grad = it->in.grad;
    // A gradient from the source is let go as soon as this partition no longer reads it.
    auto let_go = [it] {
      if (it->in.grad == nullptr && it->source->done) it->source->done(it->in.id);
    };
    if (grad == nullptr) {
      absl::StatusOr<const void*> got = it->source->get(it->in.id);
      if (!got.ok() || *got == nullptr) {
        if (got.ok()) let_go();
        x->failure =
            got.ok() ? absl::InternalError("the gradient source gave no address") : got.status();
        x->failure = Annotate(x->failure, absl::StrCat("the gradient of partition ", it->in.id));
        break;
      }
      grad = *got;
    }
    if (it->options.check_overflow &&
        optimizer_->HasNonFinite(grad, it->in.grad_dtype, it->part->elements)) {
      let_go();
      x->overflow = true;
      break;
    }
    Emit(StepEvent::kStepStarted, it->in.id);
    optim_cpu::AdamChunk c;
    float* state = buffers_[k % ring];
    const uint64_t n = it->part->elements;
    c.param = state;
    c.exp_avg = state + n;
    c.exp_avg_sq = state + 2 * n;
    c.grad = grad;
    c.grad_dtype = it->in.grad_dtype;
    c.param_copy = config_.commit_each && (it->in.param_copy != nullptr || it->in.copy_to_sink)
                       ? copy_buffers_[k % ring]
                       : it->staged_copy;
    c.copy_dtype = it->in.copy_dtype;
    c.size = n;
    optim_cpu::StepOptions options = it->options;
    options.check_overflow = false;
    const auto c0 = Clock::now();
    absl::Status stepped = optimizer_->Step(it->t, c, options).status();
    report.compute_seconds += Since(c0);
    let_go();
    Emit(StepEvent::kStepFinished, it->in.id);
    if (!stepped.ok()) {
      x->failure = stepped;
      break;
    }
    start_write(k, *it);
  }
  // Wait for everything in flight before deciding (no I/O may outlive the transaction).
  for (size_t j = 0; j < std::max(reads.size(), writes.size()); ++j) {
    // A deferred read that was never needed is not run.
    if (j < reads.size() && reads[j].valid() &&
        reads[j].wait_for(std::chrono::seconds(0)) != std::future_status::deferred) {
      Emit(StepEvent::kReadAwaited, items[j]->in.id);
      reads[j].wait();
    }
    if (j < writes.size() && writes[j].valid()) {
      const Result& w = await_write(j);
      report.write_seconds += w.second;
      if (w.first.ok()) {
        report.bytes_written += StateBytes(items[j]->part->elements);
        if (config_.commit_each) x->landed.push_back(items[j]->in.id);
      } else if (x->failure.ok()) {
        x->failure = w.first;
      }
    }
  }
}

std::vector<tiering::PartitionId> PipelinedOptimizerSwapper::Abort() {
  if (txn_ == nullptr) return std::exchange(failed_early_, {});
  {
    MutexLock lock(&txn_->mu);
    txn_->closed = txn_->cancelled = true;
    txn_->staged.SignalAll();
  }
  if (txn_->worker.joinable()) txn_->worker.join();
  if (txn_->early_worker.joinable()) txn_->early_worker.join();
  if (txn_->batch) txn_->batch->Abort();
  std::vector<tiering::PartitionId> stepped = std::move(txn_->stepped_early);
  stepped.insert(stepped.end(), txn_->landed.begin(), txn_->landed.end());
  txn_.reset();
  return stepped;
}

absl::StatusOr<StepReport> PipelinedOptimizerSwapper::Commit() {
  if (txn_ == nullptr) {
    return absl::FailedPreconditionError("optimizer swapper: Commit before Begin");
  }
  const auto c0 = Clock::now();
  {
    MutexLock lock(&txn_->mu);
    txn_->closed = true;
    txn_->staged.SignalAll();
  }
  if (txn_->worker.joinable()) txn_->worker.join();
  if (txn_->early_worker.joinable()) txn_->early_worker.join();
  std::unique_ptr<Txn> x = std::move(txn_);
  const int64_t t = x->first_t;
  x->report.compute_seconds += x->early_compute_s;
  // What had stepped (host_early) or landed (commit_each) stays so: a failure from here on says
  // which, and leaves them for the caller's Abort.
  std::vector<tiering::PartitionId> stepped = x->stepped_early;
  stepped.insert(stepped.end(), x->landed.begin(), x->landed.end());
  if (!x->early_failure.ok()) {
    failed_early_ = stepped;  // for the caller's Abort: they stay stepped
    return Annotate(
        x->early_failure,
        absl::StrCat("optimizer step ", t, ": host-resident partitions stepping during backward: ",
                     stepped.size(), " of them had stepped (", absl::StrJoin(stepped, ", "),
                     "), the others had not"));
  }
  const std::string unchanged =
      stepped.empty()
          ? absl::StrCat("optimizer step ", t, ": nothing was changed")
          : absl::StrCat("optimizer step ", t, ": ", stepped.size(),
                         stepped.size() == 1 ? " partition had" : " partitions had", " stepped (",
                         absl::StrJoin(stepped, ", "), "), the others had not");
  failed_early_ = stepped;  // until the step commits, below
  auto abort = [&] {
    if (x->batch) x->batch->Abort();
  };
  StepReport& report = x->report;
  auto finish = [&] {
    report.commit_seconds = Since(c0);
    report.seconds = Since(x->t0);
    return report;
  };
  if (!x->failure.ok()) {
    abort();
    return Annotate(x->failure,
                    stepped.empty()
                        ? absl::StrCat(unchanged, " (the NVMe state is step ", t - 1, "'s)")
                        : unchanged);
  }
  // The host-resident partitions' gradients, before anything is committed; those from a source
  // are let go once they are no longer read, whatever the outcome.
  std::vector<const void*> host_grads;
  struct LetGo {
    std::vector<std::pair<const GradSource*, tiering::PartitionId>> held;
    ~LetGo() {
      for (const auto& [source, id] : held) {
        if (source->done) source->done(id);
      }
    }
  } let_go;
  for (const Txn::Item& it : x->host) {
    const void* grad = it.in.grad;
    if (grad == nullptr) {
      absl::StatusOr<const void*> got = it.source->get(it.in.id);
      if (got.ok() && *got != nullptr) let_go.held.emplace_back(it.source.get(), it.in.id);
      if (!got.ok() || *got == nullptr) {
        abort();
        return Annotate(
            got.ok() ? absl::InternalError("the gradient source gave no address") : got.status(),
            absl::StrCat(unchanged, " (the gradient of partition ", it.in.id, ")"));
      }
      grad = *got;
    }
    if (it.options.check_overflow &&
        optimizer_->HasNonFinite(grad, it.in.grad_dtype, it.part->elements)) {
      x->overflow = true;
    }
    host_grads.push_back(grad);
  }
  if (x->overflow) {
    abort();
    report = StepReport{};
    report.overflow = true;
    return finish();
  }
  if (x->batch) {
    const auto w0 = Clock::now();
    absl::Status committed = x->batch->Commit();
    report.write_seconds += Since(w0);
    if (!committed.ok()) return Annotate(committed, unchanged);
  }
  failed_early_.clear();  // committed
  // Committed: what the caller sees changes now, by steps that cannot fail. The staged param
  // copies go out, then the host-resident partitions step (their inputs were validated when they
  // were staged, so the optimizer has nothing left to refuse: an error here is a bug, reported as
  // such).
  for (const Txn::Item& it : x->nvme) {
    if (it.staged_copy != nullptr) {
      std::memcpy(it.in.param_copy, it.staged_copy,
                  it.part->elements * CopyBytes(it.in.copy_dtype));
    }
  }
  for (size_t i = 0; i < x->host.size(); ++i) {
    const Txn::Item& it = x->host[i];
    const auto s0 = Clock::now();
    absl::Status s = StepInPlace(optimizer_, it.in, it.t, it.options, it.part->host_state,
                                 it.part->elements, host_grads[i]);
    report.compute_seconds += Since(s0);
    if (!s.ok()) {
      return absl::InternalError(absl::StrCat(
          "optimizer step ", it.t, ": the NVMe state was committed but host-resident partition ",
          it.in.id, " failed after validation: ", s.message()));
    }
  }
  return finish();
}

absl::Status PipelinedOptimizerSwapper::BeginLoad() {
  if (txn_ != nullptr || loading_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("optimizer swapper: load: a ",
                     txn_ != nullptr ? "step is being staged" : "load is open", " (end it first)"));
  }
  loading_ = std::make_unique<Loading>();
  if (store_ != nullptr && !config_.commit_each) loading_->batch = store_->NewBatch();
  return absl::OkStatus();
}

absl::Status PipelinedOptimizerSwapper::Load(tiering::PartitionId id,
                                             absl::Span<const float> master,
                                             absl::Span<const float> exp_avg,
                                             absl::Span<const float> exp_avg_sq) {
  if (loading_ == nullptr) {
    return absl::FailedPreconditionError("optimizer swapper: Load before BeginLoad");
  }
  STRATA_ASSIGN_OR_RETURN(const Part* part, Find(id));
  const uint64_t n = part->elements;
  if (master.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer swapper: load partition ", id, ": it has ", n, " elements, given ",
                     master.size(), ", ", exp_avg.size(), " and ", exp_avg_sq.size()));
  }
  float* into = buffers_.empty() ? nullptr : buffers_.front();
  if (part->host_state != nullptr) {
    auto held = std::find_if(loading_->host.begin(), loading_->host.end(),
                             [part](const auto& h) { return h.first == part; });
    if (held == loading_->host.end()) {
      STRATA_ASSIGN_OR_RETURN(void* p, host_->Allocate(StateBytes(n)));
      loading_->host.emplace_back(part, static_cast<float*>(p));
      held = loading_->host.end() - 1;
    }
    into = held->second;
  }
  std::memcpy(into, master.data(), n * sizeof(float));
  std::memcpy(into + n, exp_avg.data(), n * sizeof(float));
  std::memcpy(into + 2 * n, exp_avg_sq.data(), n * sizeof(float));
  if (part->host_state != nullptr) return absl::OkStatus();
  if (loading_->batch == nullptr) return store_->Put(StoreKey(id), Bytes(into, n));  // commit_each
  return loading_->batch->Stage(StoreKey(id), Bytes(into, n));
}

absl::Status PipelinedOptimizerSwapper::CommitLoad() {
  if (loading_ == nullptr) {
    return absl::FailedPreconditionError("optimizer swapper: CommitLoad before BeginLoad");
  }
  std::unique_ptr<Loading> l = std::move(loading_);
  absl::Status committed = l->batch != nullptr ? l->batch->Commit() : absl::OkStatus();
  for (const auto& [part, state] : l->host) {
    if (committed.ok()) std::memcpy(part->host_state, state, StateBytes(part->elements));
    host_->Deallocate(state, StateBytes(part->elements));
  }
  return Annotate(committed, "optimizer swapper: load: nothing was changed");
}

void PipelinedOptimizerSwapper::AbortLoad() {
  if (loading_ == nullptr) return;
  std::unique_ptr<Loading> l = std::move(loading_);
  if (l->batch != nullptr) l->batch->Abort();
  for (const auto& [part, state] : l->host) host_->Deallocate(state, StateBytes(part->elements));
}

}  // namespace strata::swap
