#include "swap/optimizer_swapper.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/mutex.h"
#include "base/status.h"
#include "base/worker_pool.h"

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

uint64_t WholePages(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }
// A sub-group's room in the read-ahead memory: its state, and with commit_each a copy buffer (an
// fp32 copy, as the ring's), each in whole pages.
uint64_t ReadAheadSlot(uint64_t elements, bool commit_each) {
  return WholePages(StateBytes(elements)) + (commit_each ? WholePages(elements * 4) : 0);
}

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
  constexpr tiering::PartitionId kGroupBits =
      ((tiering::PartitionId{1} << 63) - 1) & ~((tiering::PartitionId{1} << kGroupShift) - 1);
  if (config.sub_group_elements > 0 && (config.store_key_bits & kGroupBits) != 0) {
    return absl::InvalidArgumentError(
        "optimizer swapper: store_key_bits has bits 40 to 62 set, which key the sub-groups "
        "(sub_group_elements); accepted with sub-groups: bit 63 and bits below 40");
  }
  if (config.ring_buffers < 0 || config.ring_buffers > 64 ||
      (pipelined && config.ring_buffers > 0 && config.ring_buffers < 3)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer swapper: ring_buffers is ", config.ring_buffers,
                     "; accepted: 0 (the default), or ", pipelined ? "3" : "1",
                     "..64 (pipelined steps need 3)"));
  }
  if (config.write_behind && config.commit_each) {
    return absl::InvalidArgumentError(
        "optimizer swapper: write_behind with commit_each (each partition's state lands as it is "
        "written already); accepted: one of them");
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
      const uint64_t g = config.sub_group_elements;
      part.group = g > 0 && elements > g ? g : elements;
      const uint64_t groups = (elements + part.group - 1) / part.group;
      // With sub-groups, a piece's key carries its index above bit 40: every NVMe-resident id
      // (cut or not, or one could be a cut one's piece) is below 2^40.
      if (g > 0 && (id >= (tiering::PartitionId{1} << kGroupShift) ||
                    groups >= (uint64_t{1} << (63 - kGroupShift)))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer swapper: partition ", id, " of ", elements, " elements in ", groups,
            " sub-groups of ", g, " (sub_group_elements); accepted with sub-groups: ids below 2^",
            kGroupShift, " and fewer than 2^", 63 - kGroupShift, " sub-groups a partition"));
      }
      part.groups = static_cast<uint32_t>(groups);
      s->buffer_bytes_ = std::max(s->buffer_bytes_, StateBytes(part.group));
    }
    s->parts_.emplace(id, part);
  }
  if (s->buffer_bytes_ > 0 && config.read_ahead_bytes > 0) {
    // No more than every NVMe-resident sub-group's room at once.
    uint64_t most = 0;
    for (const auto& [id, part] : s->parts_) {
      if (part.host_state != nullptr) continue;
      for (uint32_t j = 0; j < part.groups; ++j) {
        most += ReadAheadSlot(part.GroupSize(j), config.commit_each);
      }
    }
    const uint64_t bytes =
        config.read_ahead_bytes >= most ? most : WholePages(config.read_ahead_bytes);
    STRATA_ASSIGN_OR_RETURN(void* p, host->Allocate(bytes));
    s->read_ahead_ = static_cast<std::byte*>(p);
    s->read_ahead_bytes_ = bytes;
  }
  if (s->buffer_bytes_ > 0) {
    const int count = config.ring_buffers > 0 ? config.ring_buffers : pipelined ? 3 : 1;
    // The reads (as many in flight as the ring holds, and the room's read ahead) and the writes
    // (one after another) on threads kept for the swapper's life: not one made per sub-group.
    s->readers_ = std::make_unique<WorkerPool>(count + 1);
    s->writer_ = std::make_unique<WorkerPool>(1);
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

std::vector<tiering::PartitionId> PipelinedOptimizerSwapper::PartlyStepped() const {
  std::vector<tiering::PartitionId> ids;
  for (const auto& [id, p] : partial_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
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
  STRATA_RETURN_IF_ERROR(Settle());
  STRATA_ASSIGN_OR_RETURN(const Part* part, Find(id));
  if (master.size() != part->elements) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer swapper: partition ", id, " has ",
                                                   part->elements, " elements, got ",
                                                   master.size()));
  }
  auto fill = [&](float* state, uint64_t offset, uint64_t n) {
    std::memcpy(state, master.data() + offset, n * sizeof(float));
    std::fill(state + n, state + 2 * n, initial_state);
    std::memset(state + 2 * n, 0, n * sizeof(float));
  };
  if (part->host_state != nullptr) {
    fill(part->host_state, 0, part->elements);
    return absl::OkStatus();
  }
  // All at once (one record); with commit_each each sub-group in place of its old one, so that
  // no more than one sub-group's second copy is needed.
  std::unique_ptr<tiering::NvmeStore::Batch> batch =
      config_.commit_each ? nullptr : store_->NewBatch();
  for (uint32_t j = 0; j < part->groups; ++j) {
    const uint64_t n = part->GroupSize(j);
    fill(buffers_.front(), part->GroupOffset(j), n);
    STRATA_RETURN_IF_ERROR(batch != nullptr
                               ? batch->Stage(StoreKey(id, j), Bytes(buffers_.front(), n))
                               : store_->Put(StoreKey(id, j), Bytes(buffers_.front(), n)));
  }
  if (batch != nullptr) STRATA_RETURN_IF_ERROR(batch->Commit());
  partial_.erase(id);
  return absl::OkStatus();
}

absl::Status PipelinedOptimizerSwapper::ReadState(tiering::PartitionId id, absl::Span<float> master,
                                                  absl::Span<float> exp_avg,
                                                  absl::Span<float> exp_avg_sq, bool mixed_steps) {
  STRATA_ASSIGN_OR_RETURN(const Part* part, Find(id));
  const uint64_t n = part->elements;
  if (master.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer swapper: partition ", id, " has ", n, " elements"));
  }
  // No host-resident state is read while it steps, and the committed state is the last step's,
  // written.
  WaitForEarlySteps();
  STRATA_RETURN_IF_ERROR(Settle());
  if (auto p = partial_.find(id); p != partial_.end() && !mixed_steps) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optimizer swapper: partition ", id, ": ", PartlyStepped(p->second),
        " (a step that failed part way): its state is not of one step; accepted: reading it once "
        "a step at ",
        p->second.t, " has stepped the rest"));
  }
  auto out = [&](const float* state, uint64_t offset, uint64_t count) {
    std::memcpy(master.data() + offset, state, count * sizeof(float));
    std::memcpy(exp_avg.data() + offset, state + count, count * sizeof(float));
    std::memcpy(exp_avg_sq.data() + offset, state + 2 * count, count * sizeof(float));
  };
  if (part->host_state != nullptr) {
    out(part->host_state, 0, n);
    return absl::OkStatus();
  }
  // The committed state (a staged step changes nothing before its Commit). While one is staged
  // the ring is the worker's: each blob is read into memory of its own.
  float* into = buffers_.front();
  std::unique_ptr<float[]> own;
  if (txn_ != nullptr) {
    own = std::make_unique<float[]>(3 * part->group);
    into = own.get();
  }
  for (uint32_t j = 0; j < part->groups; ++j) {
    const uint64_t count = part->GroupSize(j);
    STRATA_RETURN_IF_ERROR(store_->Get(StoreKey(id, j), MutableBytes(into, count)));
    read_state_bytes_.fetch_add(3 * count * sizeof(float), std::memory_order_relaxed);
    out(into, part->GroupOffset(j), count);
  }
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
  // A copy_to_sink partition's target, asked of the sink once (at its first sub-group to land)
  // and given back (done) once: by the write of its last sub-group, else when the worker ends.
  // Its sub-groups' writes run one after another, so they take turns with it.
  struct SinkHold {
    void* to = nullptr;
    bool asked = false;
    bool done = false;
    uint32_t placed = 0;  // sub-groups whose copy went there
  };
  struct Item {
    StepInput in;
    int64_t t = 0;
    optim_cpu::StepOptions options;
    const Part* part = nullptr;
    // NVMe-resident: one sub-group of the partition (the whole of one not cut), and whether it
    // is the last of the partition's staged in this step; host-resident: the whole partition.
    uint32_t group = 0;
    uint64_t offset = 0, count = 0;
    bool last = true;
    // Stepped already by a step that failed part way (commit_each): its param copy is remade
    // from its state; nothing is stepped or written.
    bool copy_only = false;
    std::byte* staged_copy = nullptr;  // NVMe-resident with a param_copy: where it is staged
    std::shared_ptr<const GradSource> source;  // for a null in.grad
    std::shared_ptr<const CopySink> sink;      // for in.copy_to_sink
    std::shared_ptr<SinkHold> hold;            // likewise
  };
  Mutex mu;
  CondVar staged;  // an item was staged, or the transaction closed
  // The NVMe-resident items (a deque: the worker holds references while more are staged).
  std::deque<Item> nvme ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;  // Commit or Abort: nothing more is staged
  // A held transaction (Begin's hold): nothing steps until Release gives the scale.
  bool held = false;
  bool released ABSL_GUARDED_BY(mu) = false;
  float scale ABSL_GUARDED_BY(mu) = 1;
  bool cancelled ABSL_GUARDED_BY(mu) = false;  // Abort: stop at the next item
  // The caller's:
  std::vector<Item> host;
  // The host-resident items' gradients taken so far (Prepare, or Commit), in `host`'s order;
  // those a source gave are held until the step ends (the source's `done`: GiveBack).
  std::vector<const void*> host_grads;
  std::vector<std::pair<const GradSource*, tiering::PartitionId>> grads_held;
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
  // commit_each: the sub-groups whose new state has landed (the worker's until it is joined),
  // then (SettleLanded) the partitions whose every sub-group has, at their step.
  std::vector<const Item*> landed_groups;
  std::vector<tiering::PartitionId> landed;
  // Those some of whose sub-groups landed and the others not, as "id (k of n sub-groups)".
  std::vector<std::string> partly;
  absl::Status early_failure;
  double early_compute_s = 0;
  std::thread early_worker;
  // write_behind: the worker's loop is over (every item stepped, or it stopped; `failure`,
  // `overflow` and `report` are then final), and what Commit made of it: commit the batch once
  // the writes are done, or drop it. Both under mu, signalled on `progress`.
  enum class Tail { kUndecided, kCommit, kDrop };
  bool loop_done ABSL_GUARDED_BY(mu) = false;
  Tail tail ABSL_GUARDED_BY(mu) = Tail::kUndecided;
  CondVar progress;
  // The worker's after its loop, until joined: the items whose write failed then (each with the
  // buffer that still holds its new state), the tail's outcome and the bytes it wrote.
  std::vector<std::pair<const Item*, float*>> unwritten;
  absl::Status tail_status;
  uint64_t tail_bytes = 0;
  // The worker's until joined: the sub-groups written from the read-ahead room (offset in it,
  // store key, bytes, and the checksum of the bytes written), for KeepRoomCopies once the record
  // naming them is committed.
  struct RoomWrite {
    uint64_t offset = 0;
    tiering::PartitionId key = 0;
    uint64_t bytes = 0, checksum = 0;
  };
  std::vector<RoomWrite> room_written;
};

PipelinedOptimizerSwapper::~PipelinedOptimizerSwapper() {
  Abort();
  AbortLoad();
  // A step's writes behind it finish before the buffers they write from go; what failed is not
  // written again here (Flush first: the Runtime does, and warns), and goes with the swapper.
  if (behind_ != nullptr && behind_->worker.joinable()) behind_->worker.join();
  behind_.reset();
  if (copy_staging_ != nullptr) host_->Deallocate(copy_staging_, copy_staging_bytes_);
  for (float* b : buffers_) host_->Deallocate(b, buffer_bytes_);
  for (std::byte* b : copy_buffers_) host_->Deallocate(b, copy_buffer_bytes_);
  if (read_ahead_ != nullptr) host_->Deallocate(read_ahead_, read_ahead_bytes_);
  for (auto& [id, part] : parts_) {
    if (part.host_state != nullptr) host_->Deallocate(part.host_state, StateBytes(part.elements));
  }
}

namespace {

// Gives each gradient a source gave back to it (its `done`).
void GiveBack(const std::vector<std::pair<const PipelinedOptimizerSwapper::GradSource*,
                                          tiering::PartitionId>>& held) {
  for (const auto& [source, id] : held) {
    if (source->done) source->done(id);
  }
}

// Waits until `in`'s gradient has landed (StepInput::grad_ready), on the thread about to read it.
absl::Status GradLanded(const StepInput& in) {
  if (in.grad_ready == nullptr) return absl::OkStatus();
  return Annotate(in.grad_ready->Wait(),
                  absl::StrCat("the gradient of partition ", in.id, " on its way to host memory"));
}

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
  for (const StepInput& in : inputs) {
    if (absl::Status s = GradLanded(in); !s.ok()) {
      return Annotate(s, absl::StrCat("optimizer step ", t, ": nothing was changed"));
    }
  }
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

absl::Status PipelinedOptimizerSwapper::Begin(uint64_t copy_staging_bytes, bool host_early,
                                              bool hold) {
  if (hold && host_early) {
    return absl::InvalidArgumentError(
        "optimizer swapper: Begin with hold and host_early (a held step steps nothing before "
        "Release, host_early steps as staged); accepted: one of them");
  }
  if (txn_ != nullptr) {
    return absl::FailedPreconditionError(
        "optimizer swapper: a step is already being staged (Commit or Abort it first)");
  }
  if (loading_ != nullptr) {
    return absl::FailedPreconditionError(
        "optimizer swapper: a state is being loaded (CommitLoad or AbortLoad it first)");
  }
  // The last step's writes behind it end first: the ring and the read-ahead room are theirs.
  STRATA_RETURN_IF_ERROR(Settle());
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
  txn_->held = hold;
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
  for (const StepInput& in : inputs) {
    auto partial = partial_.find(in.id);
    if (partial != partial_.end() && partial->second.t != t) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer step ", t, ": partition ", in.id, ": ", PartlyStepped(partial->second),
          " already (a step that failed part way); accepted: step it at ", partial->second.t,
          ", which steps the others (nothing of this call was staged)"));
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
    item.count = parts[i]->elements;
    if (item.in.grad == nullptr) item.source = shared_source;
    if (item.in.copy_to_sink) {
      item.sink = shared_sink;
      item.hold = std::make_shared<Txn::SinkHold>();
    }
    if (parts[i]->host_state != nullptr) {
      (x.host_early ? early : x.host).push_back(std::move(item));
      continue;
    }
    std::byte* staged_copy = nullptr;
    const uint64_t copy_bytes = CopyBytes(item.in.copy_dtype);
    if (item.in.param_copy != nullptr && !config_.commit_each) {
      staged_copy = copy_staging_ + x.copy_used;
      x.copy_used += parts[i]->elements * copy_bytes;
    }
    // One item a sub-group; one that stepped already (a step that failed part way) only remakes
    // its param copy, when there is one to make.
    auto partial = partial_.find(item.in.id);
    const bool copied = item.in.param_copy != nullptr || item.in.copy_to_sink;
    const size_t first = nvme.size();
    for (uint32_t j = 0; j < parts[i]->groups; ++j) {
      Txn::Item g = item;
      g.group = j;
      g.offset = parts[i]->GroupOffset(j);
      g.count = parts[i]->GroupSize(j);
      g.copy_only = partial != partial_.end() && partial->second.landed[j];
      if (g.copy_only && !copied) continue;
      g.last = false;
      if (staged_copy != nullptr) g.staged_copy = staged_copy + g.offset * copy_bytes;
      nvme.push_back(std::move(g));
    }
    if (nvme.size() > first) nvme.back().last = true;
  }
  if (!nvme.empty() || !early.empty()) {
    MutexLock lock(&x.mu);
    for (Txn::Item& item : nvme) x.nvme.push_back(std::move(item));
    for (Txn::Item& item : early) x.early.push_back(std::move(item));
    x.staged.SignalAll();
  }
  return absl::OkStatus();
}

absl::Status PipelinedOptimizerSwapper::Release(float grad_scale) {
  if (txn_ == nullptr || !txn_->held) {
    return absl::FailedPreconditionError(
        "optimizer swapper: Release with no held step open (Begin with hold first)");
  }
  if (!(grad_scale > 0) || !std::isfinite(grad_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer swapper: Release: grad_scale ",
                                                   grad_scale, "; accepted: finite and above 0"));
  }
  Txn& x = *txn_;
  MutexLock lock(&x.mu);
  if (x.released) {
    return absl::FailedPreconditionError("optimizer swapper: Release: the step was released");
  }
  x.released = true;
  x.scale = grad_scale;
  x.staged.SignalAll();
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
    bool open = false;  // staging goes on: the trainer still computes
    {
      MutexLock lock(&x->mu);
      x->early_done = k;
      x->early_progress.SignalAll();
      while (!x->closed && !x->cancelled && x->early.size() <= k) x->staged.Wait(&x->mu);
      if (x->cancelled || x->early.size() <= k) return;
      it = &x->early[k];  // a deque's elements stay put while more are staged
      open = !x->closed;
    }
    const void* grad = it->in.grad;
    if (absl::Status landed = GradLanded(it->in); !landed.ok()) {
      x->early_failure = landed;
      return;
    }
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
    optim_cpu::StepOptions options = it->options;
    if (open) options.threads = config_.threads_while_staging;
    absl::Status s = StepInPlace(optimizer_, it->in, it->t, options, it->part->host_state,
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

namespace {

// The jobs a step launches on the swapper's pools. Each task lives here, on the step's thread,
// until every job has returned from it (a job is still inside its task when its future turns
// ready): so no job outlives what it uses, and each result is made on a pool's thread and freed on
// the step's, as std::async's are.
template <typename R>
class Launched {
 public:
  Launched() = default;
  Launched(const Launched&) = delete;
  Launched& operator=(const Launched&) = delete;
  ~Launched() { WaitAll(); }

  // Runs `work` on `pool` (on this thread if the pool is stopping); its result comes through the
  // future, which (unlike std::async's) does not wait for the work when it goes.
  template <typename F>
  std::future<R> Launch(WorkerPool& pool, F work) {
    std::packaged_task<R()>& task = tasks_.emplace_back(std::move(work));
    std::future<R> result = task.get_future();
    {
      MutexLock lock(&mu_);
      ++running_;
    }
    auto run = [this, &task] {
      task();
      MutexLock lock(&mu_);
      if (--running_ == 0) returned_.SignalAll();
    };
    if (!pool.Post(run, run)) run();
    return result;
  }

  void WaitAll() {
    MutexLock lock(&mu_);
    while (running_ > 0) returned_.Wait(&mu_);
  }

 private:
  Mutex mu_;
  CondVar returned_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::packaged_task<R()>> tasks_;  // (a deque: a task stays put as more come)
};

}  // namespace

// RunStaged's own state, on the worker's thread until it returns: the items it has seen, where
// each one's state is, and the reads and writes in flight. Declared in the order they are made,
// so they go in the reverse: the jobs on the pools (launched) end before what they use goes.
struct PipelinedOptimizerSwapper::StagedRun {
  StagedRun(Txn* x, size_t ring, bool ahead_open, absl::flat_hash_map<uint64_t, RoomCopy> kept)
      : x(x), ring(ring), ring_user(ring, kNone), ahead_open(ahead_open), kept(std::move(kept)) {}

  Txn* const x;
  const size_t ring;
  std::vector<std::future<IoResult>> reads;
  std::vector<std::shared_future<IoResult>> writes;
  std::deque<uint64_t> written_sum;  // the checksum of what each write staged
  // The reads and writes on the pools, each ended before what it uses goes.
  Launched<IoResult> launched;
  // The items seen so far (a deque's elements stay put; indexing it would race with Stage). An
  // item is one sub-group of a partition (the whole of one not cut), a partition's in a row.
  std::vector<const Txn::Item*> items;
  // Item k's state and (commit_each) copy buffer: a ring buffer's, or its room in the read-ahead
  // memory (a held step's, and any step's without commit_each, given in the order staged while
  // it lasts; one that does not fit goes through the ring).
  std::vector<float*> state_of;
  std::vector<std::byte*> copy_of;
  static constexpr size_t kNone = std::numeric_limits<size_t>::max();
  std::vector<size_t> ring_user;  // the item that used each ring buffer last
  size_t ring_next = 0;
  uint64_t ahead_used = 0;
  // The room holds a held step's state as it is read ahead, and any step's without commit_each:
  // what a step leaves there committed is not read again (KeepRoomCopies).
  bool ahead_open;
  // What the room holds as the last step committed it; from here on it is this step's.
  const absl::flat_hash_map<uint64_t, RoomCopy> kept;
  std::vector<bool> reused;  // item k's state is in its room as committed: not read
  static constexpr size_t kAheadInFlight = 8;
  std::deque<size_t> in_flight;  // reads started ahead, oldest first
  std::optional<float> held_scale;
  // A gradient from the source, held from the first of its partition's sub-groups that steps
  // until the last has (then let go: the caller may let each gradient go while the rest step).
  const void* held = nullptr;
  tiering::PartitionId held_id = 0;
  const GradSource* held_source = nullptr;
};

void PipelinedOptimizerSwapper::RunStaged(Txn* x) {
  StagedRun run(x, buffers_.size(), read_ahead_ != nullptr && (x->held || !config_.commit_each),
                std::exchange(room_copies_, {}));
  // Each item as it is staged: its read (and k+1's), a held step's scale, its step, its write.
  for (size_t k = 0; HasItem(run, k, /*wait=*/true); ++k) {
    if (!ReadStarted(run, k) && !ReadItem(run, k)) break;
    // pipeline_read: k+1's read while k steps, when it is staged already.
    if (config_.pipeline_read) {
      if (HasItem(run, k + 1, /*wait=*/false) && !ReadStarted(run, k + 1)) {
        if (!ReadItem(run, k + 1)) break;
      }
    }
    if (x->held && !run.held_scale.has_value()) {
      run.held_scale = AwaitRelease(run, k);
      if (!run.held_scale.has_value()) break;  // aborted
    }
    if (!AwaitRead(run, k)) break;
    if (!StepItem(run, k)) break;
    StartWrite(run, k);
  }
  LetGoOfGradient(run);
  // write_behind: Commit may go on now (the step is in memory); the writes still in flight are
  // the tail's, and their figures too.
  const bool behind = config_.write_behind;
  if (behind) {
    MutexLock lock(&x->mu);
    x->loop_done = true;
    x->progress.SignalAll();
  }
  // Wait for everything in flight before deciding (no I/O may outlive the transaction).
  AwaitInFlight(run, behind);
  GiveBackSinkTargets(run);
  // Commit the batch once Commit says so (it has landed the step), unless dropped.
  if (behind) CommitTail(x);
}

bool PipelinedOptimizerSwapper::HasItem(StagedRun& run, size_t k, bool wait) {
  if (k < run.items.size()) return true;
  Txn* x = run.x;
  MutexLock lock(&x->mu);
  while (wait && !x->closed && !x->cancelled && x->nvme.size() <= k) x->staged.Wait(&x->mu);
  if (x->cancelled || x->nvme.size() <= k) return false;
  run.items.push_back(&x->nvme[k]);
  return true;
}

bool PipelinedOptimizerSwapper::ReadStarted(const StagedRun& run, size_t k) {
  return k < run.reads.size() && run.reads[k].valid();
}

bool PipelinedOptimizerSwapper::InRoom(const float* buf) const {
  const auto* b = reinterpret_cast<const std::byte*>(buf);
  return read_ahead_ != nullptr && b >= read_ahead_ && b < read_ahead_ + read_ahead_bytes_;
}

bool PipelinedOptimizerSwapper::CommittedThere(const StagedRun& run, uint64_t offset,
                                               size_t k) const {
  const Txn::Item& it = *run.items[k];
  auto c = run.kept.find(offset);
  if (config_.commit_each || c == run.kept.end()) return false;
  const tiering::PartitionId key = StoreKey(it.in.id, it.group);
  const uint64_t bytes = StateBytes(it.count);
  if (c->second.key != key || c->second.bytes != bytes) return false;
  auto record = store_->Find(key);
  return record.ok() && record->length == bytes && record->checksum == c->second.checksum;
}

bool PipelinedOptimizerSwapper::TakeAhead(StagedRun& run, size_t k) {
  const Txn::Item& it = *run.items[k];
  const uint64_t slot = ReadAheadSlot(it.count, config_.commit_each);
  // One that does not fit goes through the ring; a later, smaller one may still fit.
  if (!run.ahead_open || slot > read_ahead_bytes_ - run.ahead_used) {
    if (read_ahead_bytes_ - run.ahead_used < 4096) run.ahead_open = false;  // nothing more fits
    return false;
  }
  run.state_of[k] = reinterpret_cast<float*>(read_ahead_ + run.ahead_used);
  const uint64_t state = WholePages(StateBytes(it.count));
  run.copy_of[k] = config_.commit_each ? read_ahead_ + run.ahead_used + state : nullptr;
  if (run.reused.size() <= k) run.reused.resize(k + 1);
  run.reused[k] = CommittedThere(run, run.ahead_used, k);
  run.ahead_used += slot;
  return true;
}

void PipelinedOptimizerSwapper::StartRead(StagedRun& run, size_t k) {
  const Txn::Item& it = *run.items[k];
  if (run.reads.size() <= k) run.reads.resize(k + 1);
  float* buf = run.state_of[k];
  const tiering::PartitionId id = it.in.id;
  const tiering::PartitionId key = StoreKey(id, it.group);
  const uint64_t n = it.count;
  auto work = [this, buf, id, key, n] {
    Emit(StepEvent::kReadStarted, id);
    const auto r0 = Clock::now();
    absl::Status s = store_->Get(key, MutableBytes(buf, n));
    return IoResult(s, Since(r0));
  };
  if (k < run.reused.size() && run.reused[k]) {  // its committed state is in its room already
    Emit(StepEvent::kReadReused, id);
    std::promise<IoResult> there;
    there.set_value(IoResult(absl::OkStatus(), 0.0));
    run.reads[k] = there.get_future();
    return;
  }
  // A read into the read-ahead room runs at once, pipelined or not: it is read ahead.
  const bool ahead = InRoom(buf);
  if (config_.pipeline_read || ahead) {
    run.reads[k] = run.launched.Launch(*readers_, std::move(work));
    Emit(StepEvent::kReadLaunched, id);
  } else {
    run.reads[k] = std::async(std::launch::deferred, work);
  }
}

// Starts the read of k into its buffer: its read-ahead room, else the next ring buffer, whose
// last item's write must be done first (that item has stepped: at most two items, k and k+1,
// are read and not stepped in the ring at once, and the ring has three buffers or more when
// reads are pipelined). `ahead_only`: not into the ring (returns false, no failure, when there
// is no room ahead).
bool PipelinedOptimizerSwapper::ReadItem(StagedRun& run, size_t k, bool ahead_only) {
  if (run.state_of.size() <= k) {
    run.state_of.resize(k + 1);
    run.copy_of.resize(k + 1);
  }
  if (!TakeAhead(run, k)) {
    if (ahead_only) return false;
    const size_t r = run.ring_next++ % run.ring;
    if (run.ring_user[r] != StagedRun::kNone) {
      if (const absl::Status& s = AwaitWrite(run, run.ring_user[r]).first; !s.ok()) {
        run.x->failure = s;
        return false;
      }
    }
    run.ring_user[r] = k;
    run.state_of[k] = buffers_[r];
    run.copy_of[k] = config_.commit_each ? copy_buffers_[r] : nullptr;
  }
  StartRead(run, k);
  return true;
}

// A held step: until Release, the items staged after k are read ahead while the read-ahead room
// lasts (one that does not fit is left to the ring, after Release), at most kAheadInFlight
// reads at a time. Returns the scale, or nothing when the step was aborted first.
std::optional<float> PipelinedOptimizerSwapper::AwaitRelease(StagedRun& run, size_t k) {
  Txn* x = run.x;
  for (size_t j = k + 1;; ++j) {
    {
      MutexLock lock(&x->mu);
      while (!x->released && !x->cancelled && !(run.ahead_open && x->nvme.size() > j)) {
        x->staged.Wait(&x->mu);
      }
      if (x->cancelled) return std::nullopt;
      if (x->released) return x->scale;
      while (run.items.size() <= j) run.items.push_back(&x->nvme[run.items.size()]);
    }
    if (ReadStarted(run, j)) continue;
    while (run.in_flight.size() >= StagedRun::kAheadInFlight) {  // a read takes a bounded time
      run.reads[run.in_flight.front()].wait();
      run.in_flight.pop_front();
    }
    if (ReadItem(run, j, /*ahead_only=*/true)) run.in_flight.push_back(j);
  }
}

bool PipelinedOptimizerSwapper::AwaitRead(StagedRun& run, size_t k) {
  const Txn::Item* it = run.items[k];
  StepReport& report = run.x->report;
  Emit(StepEvent::kReadAwaited, it->in.id);
  auto [read_status, read_s] = run.reads[k].get();
  report.read_seconds += read_s;
  if (!read_status.ok()) {
    run.x->failure = read_status;
    return false;
  }
  (k < run.reused.size() && run.reused[k] ? report.bytes_reused : report.bytes_read) +=
      StateBytes(it->count);
  return true;
}

bool PipelinedOptimizerSwapper::StepItem(StagedRun& run, size_t k) {
  Txn* x = run.x;
  const Txn::Item* it = run.items[k];
  float* state = run.state_of[k];
  const uint64_t n = it->count;
  optim_cpu::AdamChunk c;
  c.param = state;
  c.exp_avg = state + n;
  c.exp_avg_sq = state + 2 * n;
  c.grad_dtype = it->in.grad_dtype;
  optim_cpu::StepOptions options = it->options;
  options.check_overflow = false;
  if (run.held_scale.has_value()) options.grad_scale = *run.held_scale;
  {
    MutexLock lock(&x->mu);
    if (!x->closed) options.threads = config_.threads_while_staging;  // backward still runs
  }
  if (it->copy_only) {
    // Its master weights as they are, copied by the optimizer's own conversion: a step of
    // rate 0 and no decay over a zero gradient (the second moment's slot, zeroed: the moments
    // change in the ring only, never written).
    std::memset(state + 2 * n, 0, n * sizeof(float));
    c.grad = state + 2 * n;
    c.grad_dtype = optim_cpu::DType::kF32;
    options.lr = 0;
    options.weight_decay = 0;
    options.grad_scale = 1;
  } else if (!GradientFor(run, k, &c)) {
    return false;
  }
  Emit(StepEvent::kStepStarted, it->in.id);
  c.param_copy = config_.commit_each && (it->in.param_copy != nullptr || it->in.copy_to_sink)
                     ? run.copy_of[k]
                     : it->staged_copy;
  c.copy_dtype = it->in.copy_dtype;
  c.size = n;
  const auto c0 = Clock::now();
  absl::Status stepped = optimizer_->Step(it->t, c, options).status();
  x->report.compute_seconds += Since(c0);
  if (it->last && run.held_id == it->in.id) LetGoOfGradient(run);
  Emit(StepEvent::kStepFinished, it->in.id);
  if (!stepped.ok()) {
    x->failure = stepped;
    return false;
  }
  return true;
}

bool PipelinedOptimizerSwapper::GradientFor(StagedRun& run, size_t k, optim_cpu::AdamChunk* c) {
  Txn* x = run.x;
  const Txn::Item* it = run.items[k];
  if (it->in.grad != nullptr) {
    if (absl::Status landed = GradLanded(it->in); !landed.ok()) {
      x->failure = landed;
      return false;
    }
    c->grad = it->in.grad;
  } else {
    if (run.held == nullptr || run.held_id != it->in.id) {
      LetGoOfGradient(run);
      absl::StatusOr<const void*> got = it->source->get(it->in.id);
      if (!got.ok() || *got == nullptr) {
        if (got.ok() && it->source->done) it->source->done(it->in.id);
        x->failure =
            got.ok() ? absl::InternalError("the gradient source gave no address") : got.status();
        x->failure = Annotate(x->failure, absl::StrCat("the gradient of partition ", it->in.id));
        return false;
      }
      run.held = *got;
      run.held_id = it->in.id;
      run.held_source = it->source.get();
    }
    c->grad = run.held;
  }
  c->grad = static_cast<const std::byte*>(c->grad) +
            it->offset * (it->in.grad_dtype == optim_cpu::DType::kF32 ? 4 : 2);
  if (it->options.check_overflow &&
      optimizer_->HasNonFinite(c->grad, it->in.grad_dtype, it->count)) {
    x->overflow = true;
    return false;
  }
  return true;
}

void PipelinedOptimizerSwapper::StartWrite(StagedRun& run, size_t k) {
  const Txn::Item& it = *run.items[k];
  if (run.writes.size() <= k) run.writes.resize(k + 1);
  if (run.written_sum.size() <= k) run.written_sum.resize(k + 1);  // (a deque: elements stay put)
  uint64_t* sum = &run.written_sum[k];
  float* buf = run.state_of[k];
  std::shared_future<IoResult> prev = k > 0 ? run.writes[k - 1] : std::shared_future<IoResult>();
  // With commit_each, the param copy computed into this slot's copy buffer goes out once the
  // state has landed (a sub-group that had stepped already writes nothing: its copy goes out).
  std::byte* copy = run.copy_of[k];
  const uint64_t copy_bytes = CopyBytes(it.in.copy_dtype);
  // Writes are staged one after another (a Batch is used by one thread at a time; with
  // commit_each, one Put at a time needs the store's room for one sub-group's second copy).
  auto work = [this, buf, &it, prev, b = run.x->batch.get(), copy, copy_bytes, sum] {
    if (prev.valid()) prev.wait();
    const tiering::PartitionId id = it.in.id;
    const auto w0 = Clock::now();
    absl::Status s;
    if (!it.copy_only) {
      Emit(StepEvent::kWriteStarted, id);
      s = b != nullptr ? b->Stage(StoreKey(id, it.group), Bytes(buf, it.count), sum)
                       : store_->Put(StoreKey(id, it.group), Bytes(buf, it.count));
    }
    if (!s.ok() || copy == nullptr) return IoResult(s, Since(w0));
    const uint64_t at = it.offset * copy_bytes;
    if (it.in.param_copy != nullptr) {
      std::memcpy(static_cast<std::byte*>(it.in.param_copy) + at, copy, it.count * copy_bytes);
    }
    if (it.hold != nullptr) {  // landed: the copy goes where the sink says
      Txn::SinkHold& h = *it.hold;
      if (!h.asked) {
        h.asked = true;
        absl::StatusOr<void*> to = it.sink->get(id, it.in.sink_target);
        if (to.ok()) h.to = *to;
        if (h.to != nullptr) Emit(StepEvent::kSinkHeld, id);
      }
      if (h.to != nullptr) {
        std::memcpy(static_cast<std::byte*>(h.to) + at, copy, it.count * copy_bytes);
        ++h.placed;
        if (it.last) {
          h.done = true;
          if (it.sink->done) {
            it.sink->done(id, it.in.sink_target, h.placed == it.part->groups);
          }
        }
      }
    }
    return IoResult(s, Since(w0));
  };
  if (config_.pipeline_write) {
    run.writes[k] = run.launched.Launch(*writer_, std::move(work)).share();
    Emit(StepEvent::kWriteLaunched, it.in.id);
  } else {
    run.writes[k] = std::async(std::launch::deferred, work).share();
    AwaitWrite(run, k);
  }
}

const PipelinedOptimizerSwapper::IoResult& PipelinedOptimizerSwapper::AwaitWrite(StagedRun& run,
                                                                                 size_t k) {
  Emit(StepEvent::kWriteAwaited, run.items[k]->in.id);
  return run.writes[k].get();
}

void PipelinedOptimizerSwapper::LetGoOfGradient(StagedRun& run) {
  if (run.held != nullptr && run.held_source->done) run.held_source->done(run.held_id);
  run.held = nullptr;
}

void PipelinedOptimizerSwapper::AwaitInFlight(StagedRun& run, bool behind) {
  Txn* x = run.x;
  StepReport& report = x->report;
  uint64_t* written = behind ? &x->tail_bytes : &report.bytes_written;
  for (size_t j = 0; j < std::max(run.reads.size(), run.writes.size()); ++j) {
    // A deferred read that was never needed is not run.
    if (j < run.reads.size() && run.reads[j].valid() &&
        run.reads[j].wait_for(std::chrono::seconds(0)) != std::future_status::deferred) {
      Emit(StepEvent::kReadAwaited, run.items[j]->in.id);
      run.reads[j].wait();
    }
    if (j < run.writes.size() && run.writes[j].valid()) {
      const IoResult& w = AwaitWrite(run, j);
      if (!behind) report.write_seconds += w.second;
      const Txn::Item* it = run.items[j];
      if (w.first.ok()) {
        if (!it->copy_only) {
          *written += StateBytes(it->count);
          if (config_.commit_each) x->landed_groups.push_back(it);
          if (InRoom(run.state_of[j])) {
            const auto at = reinterpret_cast<std::byte*>(run.state_of[j]) - read_ahead_;
            x->room_written.push_back({static_cast<uint64_t>(at), StoreKey(it->in.id, it->group),
                                       StateBytes(it->count), run.written_sum[j]});
          }
        }
      } else if (behind) {
        // Its new state is still in its buffer (the loop is over: none is reused).
        if (x->tail_status.ok()) x->tail_status = w.first;
        x->unwritten.emplace_back(it, run.state_of[j]);
      } else if (x->failure.ok()) {
        x->failure = w.first;
      }
    }
  }
}

// A target asked for and not given back (its partition's last sub-group did not land, or was
// not reached) is given back now, with what landed of it.
void PipelinedOptimizerSwapper::GiveBackSinkTargets(const StagedRun& run) {
  for (const Txn::Item* it : run.items) {
    if (it->hold != nullptr && it->hold->to != nullptr && !it->hold->done) {
      it->hold->done = true;
      if (it->sink->done) {
        it->sink->done(it->in.id, it->in.sink_target, it->hold->placed == it->part->groups);
      }
    }
  }
}

void PipelinedOptimizerSwapper::CommitTail(Txn* x) {
  Txn::Tail tail;
  {
    MutexLock lock(&x->mu);
    while (x->tail == Txn::Tail::kUndecided) x->progress.Wait(&x->mu);
    tail = x->tail;
  }
  if (tail == Txn::Tail::kCommit && x->unwritten.empty()) {
    x->tail_status = x->batch->Commit();
    if (x->tail_status.ok()) KeepRoomCopies(*x);
  }
}

void PipelinedOptimizerSwapper::KeepRoomCopies(const Txn& x) {
  if (config_.commit_each) return;
  // The checksum of the bytes written from the room, not the store's record of them: a later step
  // finds them only while the store's record of its sub-group says exactly those bytes.
  for (const Txn::RoomWrite& w : x.room_written) {
    room_copies_[w.offset] = RoomCopy{w.key, w.bytes, w.checksum};
  }
}

void PipelinedOptimizerSwapper::SettleLanded(Txn* x) {
  for (const Txn::Item* it : x->landed_groups) {
    auto [p, added] = partial_.try_emplace(it->in.id);
    if (added) {
      p->second.t = it->t;
      p->second.landed.assign(it->part->groups, false);
    }
    p->second.landed[it->group] = true;
    if (std::find(p->second.landed.begin(), p->second.landed.end(), false) ==
        p->second.landed.end()) {
      x->landed.push_back(it->in.id);
      partial_.erase(p);
    }
  }
  x->landed_groups.clear();
  // Every partition staged that is stepped in part now, by this step or an earlier one (a
  // partition's items are staged in a row).
  const Txn::Item* previous = nullptr;
  for (const Txn::Item& it : x->nvme) {
    if (previous != nullptr && previous->in.id == it.in.id) continue;
    previous = &it;
    if (auto p = partial_.find(it.in.id); p != partial_.end()) {
      x->partly.push_back(absl::StrCat(it.in.id, ": ", PartlyStepped(p->second)));
    }
  }
}

std::string PipelinedOptimizerSwapper::PartlyStepped(const Partial& p) {
  return absl::StrCat(std::count(p.landed.begin(), p.landed.end(), true), " of its ",
                      p.landed.size(), " sub-groups stepped to step ", p.t);
}

std::vector<tiering::PartitionId> PipelinedOptimizerSwapper::Abort() {
  if (txn_ == nullptr) return std::exchange(failed_early_, {});
  {
    MutexLock lock(&txn_->mu);
    txn_->closed = txn_->cancelled = true;
    txn_->tail = Txn::Tail::kDrop;
    txn_->staged.SignalAll();
    txn_->progress.SignalAll();  // a worker that stopped early waits there for the decision
  }
  if (txn_->worker.joinable()) txn_->worker.join();
  if (txn_->early_worker.joinable()) txn_->early_worker.join();
  SettleLanded(txn_.get());
  GiveBack(txn_->grads_held);  // (taken by a Prepare)
  if (txn_->batch) txn_->batch->Abort();
  std::vector<tiering::PartitionId> stepped = std::move(txn_->stepped_early);
  stepped.insert(stepped.end(), txn_->landed.begin(), txn_->landed.end());
  txn_.reset();
  return stepped;
}

absl::Status PipelinedOptimizerSwapper::CloseAndWait(const char* what) {
  {
    MutexLock lock(&txn_->mu);
    if (txn_->held && !txn_->released) {
      return absl::FailedPreconditionError(
          absl::StrCat("optimizer swapper: ", what,
                       " of a held step before its Release (the scale of its gradients); the "
                       "step is still open"));
    }
    txn_->closed = true;
    txn_->staged.SignalAll();
  }
  // write_behind: the step goes on once every partition has stepped; its writes still in flight
  // end behind it (the worker commits them once Commit tells it to).
  if (config_.write_behind && txn_->worker.joinable()) {
    MutexLock lock(&txn_->mu);
    while (!txn_->loop_done) txn_->progress.Wait(&txn_->mu);
  } else if (txn_->worker.joinable()) {
    txn_->worker.join();
  }
  if (txn_->early_worker.joinable()) txn_->early_worker.join();
  return absl::OkStatus();
}

absl::Status PipelinedOptimizerSwapper::Prepare() {
  if (txn_ == nullptr) {
    return absl::FailedPreconditionError("optimizer swapper: Prepare before Begin");
  }
  STRATA_RETURN_IF_ERROR(CloseAndWait("Prepare"));
  const std::string step = absl::StrCat("optimizer step ", txn_->first_t, " (prepared to commit)");
  if (!txn_->early_failure.ok()) {
    return Annotate(txn_->early_failure,
                    absl::StrCat(step, ": host-resident partitions stepping during backward"));
  }
  if (!txn_->failure.ok()) return Annotate(txn_->failure, step);
  return TakeHostGrads(txn_.get(), step);
}

absl::Status PipelinedOptimizerSwapper::TakeHostGrads(Txn* x, const std::string& context) {
  for (size_t i = x->host_grads.size(); i < x->host.size(); ++i) {
    const Txn::Item& it = x->host[i];
    const void* grad = it.in.grad;
    STRATA_RETURN_IF_ERROR(Annotate(GradLanded(it.in), context));
    if (grad == nullptr) {
      absl::StatusOr<const void*> got = it.source->get(it.in.id);
      if (got.ok() && *got != nullptr) x->grads_held.emplace_back(it.source.get(), it.in.id);
      if (!got.ok() || *got == nullptr) {
        return Annotate(
            got.ok() ? absl::InternalError("the gradient source gave no address") : got.status(),
            absl::StrCat(context, " (the gradient of partition ", it.in.id, ")"));
      }
      grad = *got;
    }
    if (it.options.check_overflow &&
        optimizer_->HasNonFinite(grad, it.in.grad_dtype, it.part->elements)) {
      x->overflow = true;
    }
    x->host_grads.push_back(grad);
  }
  return absl::OkStatus();
}

absl::StatusOr<StepReport> PipelinedOptimizerSwapper::Commit() {
  if (txn_ == nullptr) {
    return absl::FailedPreconditionError("optimizer swapper: Commit before Begin");
  }
  const auto c0 = Clock::now();
  STRATA_RETURN_IF_ERROR(CloseAndWait("Commit"));
  float held_scale = 0;  // a held step's (0: not held)
  if (txn_->held) {
    MutexLock lock(&txn_->mu);
    held_scale = txn_->scale;
  }
  const bool behind = config_.write_behind && txn_->worker.joinable();
  std::unique_ptr<Txn> x = std::move(txn_);
  // write_behind: the tail is dropped (its worker joined) unless this step committed it.
  auto decide = [&x](Txn::Tail tail) {
    {
      MutexLock lock(&x->mu);
      if (x->tail == Txn::Tail::kUndecided) x->tail = tail;
      x->progress.SignalAll();
    }
    if (tail == Txn::Tail::kDrop && x->worker.joinable()) x->worker.join();
  };
  absl::Cleanup undecided = [&] {
    if (x != nullptr && behind) decide(Txn::Tail::kDrop);
  };
  SettleLanded(x.get());
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
  std::vector<std::string> said;
  if (!stepped.empty()) {
    said.push_back(absl::StrCat(stepped.size(),
                                stepped.size() == 1 ? " partition had" : " partitions had",
                                " stepped (", absl::StrJoin(stepped, ", "), ")"));
  }
  if (!x->partly.empty()) {
    said.push_back(
        absl::StrCat(x->partly.size(), x->partly.size() == 1 ? " partition" : " partitions",
                     " had stepped in part (", absl::StrJoin(x->partly, "; "),
                     "; each steps only the rest when it is stepped again at that step)"));
  }
  const bool changed = !said.empty();
  const std::string unchanged =
      !changed ? absl::StrCat("optimizer step ", t, ": nothing was changed")
               : absl::StrCat("optimizer step ", t, ": ", absl::StrJoin(said, ", "),
                              ", the others had not");
  failed_early_ = stepped;  // until the step commits, below
  auto abort = [&] {
    if (behind) decide(Txn::Tail::kDrop);
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
    return Annotate(
        x->failure,
        !changed ? absl::StrCat(unchanged, " (the NVMe state is step ", t - 1, "'s)") : unchanged);
  }
  // The host-resident partitions' gradients, before anything is committed (taken by Prepare
  // already, or now); those from a source are let go once they are no longer read, whatever the
  // outcome.
  absl::Status taken = TakeHostGrads(x.get(), unchanged);
  absl::Cleanup give_back = [held = std::move(x->grads_held)] { GiveBack(held); };
  if (!taken.ok()) {
    abort();
    return taken;
  }
  const std::vector<const void*> host_grads = std::move(x->host_grads);
  if (x->overflow) {
    abort();
    report = StepReport{};
    report.overflow = true;
    return finish();
  }
  if (behind) {
    decide(Txn::Tail::kCommit);  // from here on the step stands; its record follows its writes
  } else if (x->batch) {
    const auto w0 = Clock::now();
    absl::Status committed = x->batch->Commit();
    report.write_seconds += Since(w0);
    if (!committed.ok()) return Annotate(committed, unchanged);
    KeepRoomCopies(*x);
  }
  failed_early_.clear();  // committed
  // Committed: what the caller sees changes now, by steps that cannot fail. The staged param
  // copies go out, then the host-resident partitions step (their inputs were validated when they
  // were staged, so the optimizer has nothing left to refuse: an error here is a bug, reported as
  // such).
  for (const Txn::Item& it : x->nvme) {
    if (it.staged_copy != nullptr) {
      const uint64_t copy_bytes = CopyBytes(it.in.copy_dtype);
      std::memcpy(static_cast<std::byte*>(it.in.param_copy) + it.offset * copy_bytes,
                  it.staged_copy, it.count * copy_bytes);
    }
  }
  for (size_t i = 0; i < x->host.size(); ++i) {
    const Txn::Item& it = x->host[i];
    const auto s0 = Clock::now();
    optim_cpu::StepOptions options = it.options;
    if (held_scale > 0) options.grad_scale = held_scale;
    absl::Status s = StepInPlace(optimizer_, it.in, it.t, options, it.part->host_state,
                                 it.part->elements, host_grads[i]);
    report.compute_seconds += Since(s0);
    if (!s.ok()) {
      if (behind) behind_ = std::move(x);  // its NVMe part stands, written behind
      return absl::InternalError(absl::StrCat("optimizer step ", it.t, ": the NVMe state ",
                                              behind ? "stands (written behind)" : "was committed",
                                              " but host-resident partition ", it.in.id,
                                              " failed after validation: ", s.message()));
    }
  }
  StepReport done = finish();
  done.behind_bytes_written = std::exchange(behind_bytes_written_, 0);
  done.behind_wait_seconds = std::exchange(behind_wait_s_, 0);
  if (behind) {
    done.written_behind = true;
    behind_ = std::move(x);
  }
  return done;
}

absl::Status PipelinedOptimizerSwapper::Settle() {
  if (behind_ == nullptr) return absl::OkStatus();
  Txn* x = behind_.get();
  const auto w0 = Clock::now();
  if (x->worker.joinable()) x->worker.join();
  behind_wait_s_ += Since(w0);
  if (!x->tail_status.ok()) {
    // Again: the writes that failed, from the buffers that still hold their new state, then the
    // record (a batch whose commit failed keeps what it staged).
    absl::Status s;
    std::vector<std::pair<const Txn::Item*, float*>> still;
    for (const auto& [it, state] : x->unwritten) {
      absl::Status w = x->batch->Stage(StoreKey(it->in.id, it->group), Bytes(state, it->count));
      if (w.ok()) {
        x->tail_bytes += StateBytes(it->count);
      } else {
        s.Update(w);
        still.emplace_back(it, state);
      }
    }
    x->unwritten = std::move(still);
    if (s.ok()) s = x->batch->Commit();
    x->tail_status = s;
    if (!s.ok()) {
      return Annotate(
          s, absl::StrCat("optimizer step ", x->first_t,
                          ": its new state, written behind the step (write_behind), is not "
                          "stored yet; the step stands (its new weights are out) and that state "
                          "is kept in host memory, written again at the next call (Begin, Step, "
                          "ReadState, Initialize, BeginLoad or Flush), which fails until it is"));
    }
  }
  behind_bytes_written_ += x->tail_bytes;
  behind_.reset();
  return absl::OkStatus();
}

absl::Status PipelinedOptimizerSwapper::BeginLoad() {
  if (txn_ != nullptr || loading_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("optimizer swapper: load: a ",
                     txn_ != nullptr ? "step is being staged" : "load is open", " (end it first)"));
  }
  STRATA_RETURN_IF_ERROR(Settle());
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
  auto fill = [&](float* into, uint64_t offset, uint64_t count) {
    std::memcpy(into, master.data() + offset, count * sizeof(float));
    std::memcpy(into + count, exp_avg.data() + offset, count * sizeof(float));
    std::memcpy(into + 2 * count, exp_avg_sq.data() + offset, count * sizeof(float));
  };
  if (part->host_state != nullptr) {
    auto held = std::find_if(loading_->host.begin(), loading_->host.end(),
                             [part](const auto& h) { return h.first == part; });
    if (held == loading_->host.end()) {
      STRATA_ASSIGN_OR_RETURN(void* p, host_->Allocate(StateBytes(n)));
      loading_->host.emplace_back(part, static_cast<float*>(p));
      held = loading_->host.end() - 1;
    }
    fill(held->second, 0, n);
    return absl::OkStatus();
  }
  for (uint32_t j = 0; j < part->groups; ++j) {
    const uint64_t count = part->GroupSize(j);
    float* into = buffers_.front();
    fill(into, part->GroupOffset(j), count);
    if (loading_->batch == nullptr) {  // commit_each: in place of the old at once
      STRATA_RETURN_IF_ERROR(store_->Put(StoreKey(id, j), Bytes(into, count)));
      if (j + 1 == part->groups) partial_.erase(id);  // what a failed step left is replaced
    } else {
      STRATA_RETURN_IF_ERROR(loading_->batch->Stage(StoreKey(id, j), Bytes(into, count)));
    }
  }
  if (loading_->batch != nullptr) loading_->loaded.push_back(id);
  return absl::OkStatus();
}

absl::Status PipelinedOptimizerSwapper::CommitLoad() {
  if (loading_ == nullptr) {
    return absl::FailedPreconditionError("optimizer swapper: CommitLoad before BeginLoad");
  }
  std::unique_ptr<Loading> l = std::move(loading_);
  absl::Status committed = l->batch != nullptr ? l->batch->Commit() : absl::OkStatus();
  if (committed.ok()) {
    for (tiering::PartitionId id : l->loaded) partial_.erase(id);
  }
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
