// The Runtime's optimizer (sched/runtime.h, "the optimizer step"): CreateOptimizer, its state's
// load and read, and the step staged, held, committed or aborted over the partitions' gradients
// and the parameters' new weights. runtime.cc holds the partitions' moves.
#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "sched/runtime.h"
#include "sched/runtime_internal.h"

namespace strata::sched {

using internal::I;
using internal::kOptimizerKey;
using internal::Pages;
using tiering::Residency;

absl::Status Runtime::CreateOptimizer(
    const optim_cpu::AdamConfig& adam,
    const std::vector<std::pair<PartitionId, uint64_t>>& partitions) {
  optim_cpu::OptimizerConfig config;
  config.adam = adam;
  return CreateOptimizer(config, partitions);
}

absl::Status Runtime::CreateOptimizer(
    const optim_cpu::OptimizerConfig& optimizer,
    const std::vector<std::pair<PartitionId, uint64_t>>& partitions, optim_cpu::DType copy_dtype,
    std::optional<uint64_t> copy_elements_wanted) {
  const tiering::OffloadConfig& oc = config_.offload_optimizer;
  if (oc.device == tiering::OffloadDevice::kNone) {
    return absl::FailedPreconditionError(
        "create optimizer: zero_optimization.offload_optimizer.device is \"none\" (the "
        "optimizer state stays with the trainer); accepted for strata's optimizer: \"cpu\" or "
        "\"nvme\"");
  }
  if (oc.device == tiering::OffloadDevice::kNvme && store_ == nullptr) {
    return absl::FailedPreconditionError(
        "create optimizer: offload_optimizer.device is \"nvme\" but there is no NVMe tier");
  }
  const bool on_nvme = oc.device == tiering::OffloadDevice::kNvme;
  {
    MutexLock lock(&optimizer_mu_);  // (checked again below, before it is made)
    if (optimizer_ != nullptr) {
      return absl::FailedPreconditionError("create optimizer: this Runtime has one already");
    }
  }
  // Each partition checked before anything (the config's "auto" answers below) changes.
  uint64_t state = 0, widest = 0;  // the NVMe state's bytes; the largest partition's elements
  for (const auto& [id, elements] : partitions) {
    if (id >= kOptimizerKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("create optimizer: partition ", id, ": ids are below 2^63"));
    }
    if (elements == 0 || elements > tiering::kMaxPartitionBytes / 12) {
      return absl::InvalidArgumentError(absl::StrCat("create optimizer: partition ", id, " has ",
                                                     elements, " elements (accepted: 1 to ",
                                                     tiering::kMaxPartitionBytes / 12, ")"));
    }
    state += elements * 12;
    widest = std::max(widest, elements);
  }
  if (config_.optimizer_commit_auto) {
    // optimizer_commit "auto": "partition" where the NVMe state is beyond the host's room.
    config_.optimizer_commit_each = config_.CommitEach(on_nvme ? state : 0);
    config_.optimizer_commit_auto = false;  // answered
    if (config_.optimizer_commit_each) {
      Warn(absl::StrCat(
          "create optimizer: the optimizer state on NVMe (", state,
          " bytes) is larger than "
          "strata.host_budget_bytes (",
          config_.host_budget_bytes,
          "): each partition's new "
          "state commits as it is written (optimizer_commit \"auto\" takes \"partition\" "
          "here, as DeepSpeed writes each sub-group back), so that a step reads the state once "
          "and the new weights go into their partitions as each lands; a step once begun is not "
          "dropped. optimizer_commit \"step\" commits a step whole, at the price of reading "
          "the state of parameters homed on NVMe again to give them their new weights"));
    }
  }
  const bool pipelined = oc.pipeline_read || oc.pipeline_write;
  const int ring = pipelined ? static_cast<int>(std::clamp<int64_t>(oc.buffer_count, 3, 64))
                             : static_cast<int>(std::clamp<int64_t>(oc.buffer_count, 1, 64));
  if (on_nvme && widest > 0) {
    // The sub-groups: zero_optimization.sub_group_size at most, smaller where the ring's buffers
    // for it would take more than a quarter of the host room left (RuntimeConfig::SubGroupFor).
    const uint64_t budget = table_->budget_bytes(Tier::kHost);  // the staging buffers' taken
    // Beside what is set aside already and, under "step", the staged copies.
    uint64_t copies = 0;
    if (!config_.optimizer_commit_each) {
      uint64_t elements = 0;
      for (const auto& [id, n] : partitions) elements += n;
      if (copy_elements_wanted.has_value()) elements = std::min(elements, *copy_elements_wanted);
      copies = Pages(elements * (copy_dtype == optim_cpu::DType::kF32 ? 4 : 2));
    }
    const uint64_t aside = table_->set_aside_bytes(Tier::kHost) + copies;
    const uint64_t group = config_.SubGroupFor(widest, ring, config_.optimizer_commit_each,
                                               budget > aside ? budget - aside : 0);
    const uint64_t asked = config_.sub_group_size > 0
                               ? std::min(widest, static_cast<uint64_t>(config_.sub_group_size))
                               : widest;
    if (group < asked) {
      Warn(absl::StrCat("create optimizer: sub-groups of ", group, " elements, not ", asked,
                        " (zero_optimization.sub_group_size ", config_.sub_group_size,
                        "): the ring's ", ring,
                        " buffers for those would take more than a "
                        "quarter of the ",
                        budget > aside ? budget - aside : 0,
                        " bytes of strata.host_budget_bytes left beside the staging buffers and "
                        "the staged copies; the steps are the same bits"));
      config_.sub_group_size = static_cast<int64_t>(group);
    }
  }
  std::array<uint64_t, tiering::kTierCount> need{};
  uint64_t largest = 0, copy_elements = 0, most_elements = 0;
  // What every NVMe sub-group would take in the read-ahead room at once (swap/optimizer_swapper.h:
  // its state, and a copy buffer with optimizer_commit "partition", each in whole pages).
  uint64_t ahead_most = 0, ahead_least = UINT64_MAX;  // every sub-group's room; the smallest
  auto ahead_slot = [this](uint64_t g) {
    return Pages(g * 12) + (config_.optimizer_commit_each ? Pages(g * 4) : 0);
  };
  // A partition's sub-groups: zero_optimization.sub_group_size elements at most (0 or less:
  // whole).
  auto sub_group = [this](uint64_t elements) {
    return config_.sub_group_size > 0
               ? std::min(elements, static_cast<uint64_t>(config_.sub_group_size))
               : elements;
  };
  for (const auto& [id, elements] : partitions) {
    if (on_nvme) {
      // The ring's buffers hold a sub-group (zero_optimization.sub_group_size) at most.
      largest = std::max(largest, sub_group(elements) * 12);
      most_elements = std::max(most_elements, elements);
      copy_elements += elements;
      // The state (each sub-group a blob, in whole pages), and its second copy while a step
      // commits (with optimizer_commit "partition", one sub-group's: below).
      const uint64_t g = sub_group(elements);
      const uint64_t stored = (elements / g) * Pages(g * 12) + Pages(elements % g * 12);
      need[I(Tier::kNvme)] += (config_.optimizer_commit_each ? 1 : 2) * stored;
      ahead_most +=
          (elements / g) * ahead_slot(g) + (elements % g > 0 ? ahead_slot(elements % g) : 0);
      ahead_least = std::min(ahead_least, ahead_slot(elements % g > 0 ? elements % g : g));
    } else {
      need[I(Tier::kHost)] += Pages(elements * 12);
    }
  }
  // The staged param copies of the NVMe-resident partitions, in the trainer's dtype.
  const uint64_t copy_bytes = copy_dtype == optim_cpu::DType::kF32 ? 4 : 2;
  if (copy_elements_wanted.has_value()) {
    copy_elements = std::min(copy_elements, *copy_elements_wanted);
  }
  if (on_nvme && config_.optimizer_commit_each) {
    // The store's copy on write, one Put at a time, needs room for its largest blob beside the
    // state: a sub-group's, or a parameter's partition (by convention as many elements as its
    // optimizer partition, in the trainer's dtype), whichever is larger. A copy buffer
    // (fp32-sized) beside each ring buffer instead of the staged copies.
    need[I(Tier::kNvme)] += Pages(std::max(largest, most_elements * copy_bytes));
    need[I(Tier::kHost)] += ring * (Pages(largest) + Pages(largest / 3));
    copy_elements = 0;
  } else if (on_nvme) {
    need[I(Tier::kHost)] += ring * Pages(largest) + Pages(copy_elements * copy_bytes);
  }
  // The read-ahead room (strata.optimizer_read_ahead_bytes; "auto": an eighth of the host budget).
  const bool ahead_auto = !config_.optimizer_read_ahead_bytes.has_value();
  uint64_t ahead = 0;
  if (on_nvme) {
    ahead = std::min(ahead_most, Pages(ahead_auto ? config_.host_budget_bytes / 8
                                                  : *config_.optimizer_read_ahead_bytes));
  }
  // "auto": none where no sub-group would fit in it.
  auto too_small = [&](uint64_t bytes) { return ahead_auto && bytes < ahead_least; };
  if (too_small(ahead)) ahead = 0;
  const uint64_t ahead_wanted = ahead;
  need[I(Tier::kHost)] += ahead;
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ != nullptr) {
    return absl::FailedPreconditionError("create optimizer: this Runtime has one already");
  }
  for (bool again = true; again;) {
    again = false;
    for (Tier t : {Tier::kHost, Tier::kNvme}) {
      absl::Status s = table_->SetAside(t, need[I(t)]);
      if (s.ok()) continue;
      table_->GiveBack(Tier::kHost, t == Tier::kNvme ? need[I(Tier::kHost)] : 0);
      if (t == Tier::kHost && ahead_auto && ahead > 0) {
        // "auto" gives way: half as much, down to none (said below, once the rest fits).
        const uint64_t was = ahead;
        ahead = ahead / 2 >= (1 << 20) && !too_small(Pages(ahead / 2)) ? Pages(ahead / 2) : 0;
        need[I(Tier::kHost)] -= was - ahead;
        again = true;
        break;
      }
      return Annotate(
          s,
          absl::StrCat("create optimizer: its state and buffers (offload_optimizer."
                       "device \"",
                       on_nvme ? "nvme" : "cpu", "\", buffer_count ", oc.buffer_count,
                       on_nvme ? absl::StrCat(", read-ahead ", ahead, " bytes") : "", ") need ",
                       need[I(t)], " bytes of the ", TierName(t), " tier; accepted: ",
                       t == Tier::kHost ? "strata.host_budget_bytes" : "strata.nvme_capacity_bytes",
                       " with room for them beside the rest"));
    }
  }
  auto give_back = [&] {
    for (Tier t : {Tier::kHost, Tier::kNvme}) table_->GiveBack(t, need[I(t)]);
  };
  // The config's thread count where the caller left the optimizer's at its default (0).
  optim_cpu::OptimizerConfig threaded = optimizer;
  for (int* threads : {&threaded.adam.threads, &threaded.adagrad.threads, &threaded.lion.threads}) {
    if (*threads == 0) *threads = config_.OptimizerThreads(optim_cpu::ThreadPool::Cores());
  }
  auto created = optim_cpu::MakeChunkOptimizer(threaded);
  if (!created.ok()) {
    give_back();
    return Annotate(created.status(), "create optimizer");
  }
  swap::OptimizerSwapperConfig sc;
  // While backward runs, the config's share of the pool, unless the caller sized the optimizer's.
  if (optimizer.adam.threads == 0 && optimizer.adagrad.threads == 0 &&
      optimizer.lion.threads == 0) {
    sc.threads_while_staging = config_.OptimizerThreadsWhileStaging(optim_cpu::ThreadPool::Cores());
  }
  sc.pipeline_read = oc.pipeline_read;
  sc.pipeline_write = oc.pipeline_write;
  sc.max_in_cpu_bytes = on_nvme ? 0 : UINT64_MAX;
  sc.ring_buffers = ring;
  sc.commit_each = config_.optimizer_commit_each;
  sc.read_ahead_bytes = ahead;
  sc.write_behind = on_nvme && config_.OptimizerWriteBehind();
  if (ahead < ahead_wanted) {
    Warn(ahead == 0
             ? std::string("create optimizer: its read-ahead room (strata.optimizer_read_ahead_"
                           "bytes \"auto\") does not fit in the host tier beside its other "
                           "buffers; none is taken: a step decided after backward (clipping) "
                           "reads its NVMe state after backward")
             : absl::StrCat("create optimizer: its read-ahead room (strata.optimizer_read_ahead_"
                            "bytes \"auto\") is ",
                            ahead, " bytes of the ", ahead_wanted,
                            " wanted, what the host tier had room for beside its other buffers"));
  }
  sc.sub_group_elements = static_cast<uint64_t>(std::max<int64_t>(0, config_.sub_group_size));
  sc.store_key_bits = kOptimizerKey;
  sc.on_event = options_.on_optimizer_event;
  auto swapper = swap::PipelinedOptimizerSwapper::Create(store_.get(), created->get(),
                                                         host_memory_.get(), sc, partitions);
  if (!swapper.ok()) {
    give_back();
    return Annotate(swapper.status(), "create optimizer");
  }
  chunk_optimizer_ = *std::move(created);
  optimizer_ = *std::move(swapper);
  optimizer_set_aside_ = need;
  copy_staging_room_ = on_nvme ? copy_elements * copy_bytes : 0;
  return absl::OkStatus();
}

absl::Status Runtime::InitializeOptimizerState(PartitionId id, absl::Span<const float> master,
                                               float initial_state) {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer state: CreateOptimizer first");
  }
  return optimizer_->Initialize(id, master, initial_state);
}

absl::Status Runtime::BeginLoadOptimizerState() {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer state: CreateOptimizer first");
  }
  return optimizer_->BeginLoad();
}

absl::Status Runtime::LoadOptimizerState(PartitionId id, absl::Span<const float> master,
                                         absl::Span<const float> exp_avg,
                                         absl::Span<const float> exp_avg_sq) {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer state: CreateOptimizer first");
  }
  return optimizer_->Load(id, master, exp_avg, exp_avg_sq);
}

absl::Status Runtime::CommitLoadOptimizerState() {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer state: CreateOptimizer first");
  }
  return optimizer_->CommitLoad();
}

void Runtime::AbortLoadOptimizerState() {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ != nullptr) optimizer_->AbortLoad();
}

absl::Status Runtime::ReadOptimizerState(PartitionId id, absl::Span<float> master,
                                         absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq,
                                         bool mixed_steps) {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer state: CreateOptimizer first");
  }
  const uint64_t before = optimizer_->read_state_bytes();
  absl::Status read = optimizer_->ReadState(id, master, exp_avg, exp_avg_sq, mixed_steps);
  state_read_bytes_.fetch_add(optimizer_->read_state_bytes() - before, std::memory_order_relaxed);
  return read;
}

absl::StatusOr<swap::StepReport> Runtime::OptimizerStep(int64_t t,
                                                        std::vector<swap::StepInput> inputs,
                                                        const optim_cpu::StepOptions& options) {
  std::vector<PartitionId> order;
  {
    MutexLock lock(&mu_);
    order = scheduler_->GradientOrder();
  }
  absl::flat_hash_map<PartitionId, size_t> rank;
  for (size_t i = 0; i < order.size(); ++i) rank.emplace(order[i], i);
  std::stable_sort(inputs.begin(), inputs.end(),
                   [&](const swap::StepInput& a, const swap::StepInput& b) {
                     auto ra = rank.find(a.id), rb = rank.find(b.id);
                     const size_t ka = ra == rank.end() ? order.size() : ra->second;
                     const size_t kb = rb == rank.end() ? order.size() : rb->second;
                     return ka < kb;
                   });
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer step: CreateOptimizer first");
  }
  return optimizer_->Step(t, inputs, options);
}

absl::Status Runtime::BeginOptimizerStep(bool host_early, bool hold) {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer step: CreateOptimizer first");
  }
  return optimizer_->Begin(copy_staging_room_, host_early, hold);
}

absl::Status Runtime::ReleaseOptimizerStep(float grad_scale) {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer step: CreateOptimizer first");
  }
  if (config_.optimizer_commit_each) {
    MutexLock staged(&staged_mu_);
    drop_stepped_gradients_ = true;
  }
  return optimizer_->Release(grad_scale);
}

uint64_t Runtime::OptimizerReadAheadBytes() {
  MutexLock lock(&optimizer_mu_);
  return optimizer_ == nullptr ? 0 : optimizer_->read_ahead_bytes();
}

absl::StatusOr<optim_cpu::DType> Runtime::StepPartitionDtype(PartitionId partition,
                                                             PartitionId optimizer_id,
                                                             const std::string& what,
                                                             absl::string_view hint) {
  absl::StatusOr<Residency> r;
  {
    MutexLock lock(&mu_);
    r = table_->Get(partition);
  }
  if (!r.ok()) return absl::NotFoundError(absl::StrCat(what, " is not registered", hint));
  const tiering::PartitionDesc& d = r->desc;
  absl::StatusOr<uint64_t> elements = optimizer_->elements(optimizer_id);
  if (d.dtype == tiering::ElementType::kOther || !elements.ok() || d.elements != *elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " holds ", d.elements, " elements of dtype ", static_cast<int>(d.dtype),
        "; accepted: float32, bfloat16 or float16, as many elements as the optimizer's "
        "partition (",
        elements.ok() ? absl::StrCat(*elements) : "none", ")"));
  }
  static_assert(
      static_cast<int>(tiering::ElementType::kBF16) == static_cast<int>(optim_cpu::DType::kBF16) &&
      static_cast<int>(tiering::ElementType::kF16) == static_cast<int>(optim_cpu::DType::kF16));
  return static_cast<optim_cpu::DType>(d.dtype);
}

absl::Status Runtime::StageOptimizerStep(int64_t t, std::vector<swap::StepInput> inputs,
                                         const optim_cpu::StepOptions& options,
                                         tiering::StreamHandle grad_stream) {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer step: CreateOptimizer first");
  }
  if (!optimizer_->staging()) {
    return absl::FailedPreconditionError("optimizer step: Stage before Begin");
  }
  if (grad_stream != nullptr) {
    absl::StatusOr<std::shared_ptr<tiering::Fence>> fence = copy_->RecordFence(grad_stream);
    if (!fence.ok()) {
      return Annotate(fence.status(), absl::StrCat("optimizer step ", t,
                                                   ": the gradients' stream (nothing staged)"));
    }
    for (swap::StepInput& in : inputs) {
      if (in.grad != nullptr) in.grad_ready = *fence;
    }
  }
  // A gradient to be taken from its partition: its dtype is the partition's, its size the
  // optimizer partition's (checked here, before anything is staged).
  for (swap::StepInput& in : inputs) {
    if (in.grad != nullptr) continue;
    STRATA_ASSIGN_OR_RETURN(
        in.grad_dtype,
        StepPartitionDtype(in.id, in.id,
                           absl::StrCat("optimizer step ", t, ": the gradient partition ", in.id),
                           " (an input with no gradient address steps from it)"));
  }
  // A partition to take an input's new weights: its elements, its dtype the copy's.
  bool sinks = false;
  for (swap::StepInput& in : inputs) {
    if (!in.copy_to_sink) continue;
    sinks = true;
    STRATA_ASSIGN_OR_RETURN(
        in.copy_dtype,
        StepPartitionDtype(in.sink_target, in.id,
                           absl::StrCat("optimizer step ", t, ": partition ", in.sink_target,
                                        " (to take ", in.id, "'s new weights)")));
  }
  swap::PipelinedOptimizerSwapper::CopySink sink;
  if (sinks) {
    sink.get = [this](PartitionId id, PartitionId target) -> absl::StatusOr<void*> {
      // Every byte is written: a copy not in the host tier is given its room, not read.
      absl::StatusOr<std::byte*> p = AcquireToReplace(target);
      absl::Status refused = p.status();
      if (p.ok()) {
        // A copy pinned in the device tier (the parameter still lent) could not go stale under
        // its holder when this one is written: the copy is not placed, and the caller writes it
        // when it is free (nothing was written: released clean).
        bool lent = false;
        {
          MutexLock lock(&mu_);
          absl::StatusOr<Residency> r = table_->Get(target);
          lent = r.ok() && r->pins[I(Tier::kDevice)] > 0;
        }
        if (!lent) return static_cast<void*>(*p);
        Release(target, Tier::kHost, false, nullptr, Access::kOutOfTrace).IgnoreError();
        refused = absl::FailedPreconditionError("it is lent to the device");
      }
      Warn(absl::StrCat("optimizer step: the new weights of ", id, " were not written into ",
                        "partition ", target, " as its state landed (", refused.message(),
                        "): the trainer writes them after the step"));
      return refused;
    };
    sink.done = [this](PartitionId id, PartitionId target, bool whole) {
      // Pinned by this thread, checked not lent, and written (all of it, or the sub-groups that
      // landed of a step that failed part way: released written all the same, and not counted
      // copied): the release cannot fail but by a bug (another holder pinning the device copy
      // meanwhile); the weights are then counted as not placed, for the caller to write them
      // again.
      absl::Status s = Release(target, Tier::kHost, true, nullptr, Access::kOutOfTrace);
      if (!s.ok()) {
        // Lent to the device since get checked (the trainer acquired it meanwhile): the pin is
        // let go (released clean: the device copy's holder keeps the bytes it has), the weights
        // not counted placed, for the trainer to write them after the step.
        absl::Status clean = Release(target, Tier::kHost, false, nullptr, Access::kOutOfTrace);
        Warn(absl::StrCat("optimizer step: partition ", target, " was lent while ", id,
                          "'s new weights were written into it (", s.message(),
                          "): released as it was",
                          clean.ok() ? "" : " failed too: ", clean.ok() ? "" : clean.message(),
                          "; the trainer writes them after the step"));
        return;
      }
      if (!whole) return;
      MutexLock lock(&staged_mu_);
      copied_.push_back(id);
    };
  }
  // Each gradient is pinned in the host tier while its partition steps and let go right after
  // (it stays registered, for a step taken anew): never all of them pinned at once.
  swap::PipelinedOptimizerSwapper::GradSource source;
  source.get = [this](PartitionId id) -> absl::StatusOr<const void*> {
    absl::StatusOr<std::byte*> p = Acquire(id, Tier::kHost, Access::kOutOfTrace);
    if (!p.ok()) return p.status();
    MutexLock lock(&staged_mu_);
    staged_gradients_.push_back(id);
    return static_cast<const void*>(*p);
  };
  source.done = [this](PartitionId id) {
    ReleaseStagedGradients(id);
    bool drop = false;
    {
      MutexLock lock(&staged_mu_);
      drop = drop_stepped_gradients_;
    }
    // Refused only while another holder pins it (it then goes at the step's end, as the rest).
    if (drop) Discard(id).IgnoreError();
  };
  return optimizer_->Stage(t, inputs, options, std::move(source), std::move(sink));
}

std::vector<PartitionId> Runtime::PartlySteppedOptimizerPartitions() {
  MutexLock lock(&optimizer_mu_);
  return optimizer_ != nullptr ? optimizer_->PartlyStepped() : std::vector<PartitionId>{};
}

std::vector<PartitionId> Runtime::TakeCopiedPartitions() {
  MutexLock lock(&staged_mu_);
  return std::exchange(copied_, {});
}

void Runtime::EndDroppingGradients() {
  MutexLock lock(&staged_mu_);
  drop_stepped_gradients_ = false;
}

void Runtime::ReleaseStagedGradients(std::optional<PartitionId> only) {
  std::vector<PartitionId> ids;
  {
    MutexLock lock(&staged_mu_);
    if (only.has_value()) {
      auto it = std::find(staged_gradients_.begin(), staged_gradients_.end(), *only);
      if (it == staged_gradients_.end()) return;
      staged_gradients_.erase(it);
      ids.push_back(*only);
    } else {
      ids.swap(staged_gradients_);
    }
  }
  for (PartitionId id : ids) {
    // Pinned by the optimizer's thread and never written: this cannot fail but by a bug.
    if (absl::Status s = Release(id, Tier::kHost, false, nullptr, Access::kOutOfTrace); !s.ok()) {
      Warn(absl::StrCat("optimizer step: releasing gradient ", id, ": ", s.message()));
    }
  }
}

absl::StatusOr<swap::StepReport> Runtime::CommitOptimizerStep() {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer step: CreateOptimizer first");
  }
  absl::StatusOr<swap::StepReport> r = optimizer_->Commit();
  ReleaseStagedGradients();
  EndDroppingGradients();
  return r;
}

absl::Status Runtime::PrepareOptimizerStep() {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError("optimizer step: CreateOptimizer first");
  }
  return optimizer_->Prepare();
}

absl::Status Runtime::FlushOptimizer() {
  MutexLock lock(&optimizer_mu_);
  return optimizer_ != nullptr ? optimizer_->Flush() : absl::OkStatus();
}

void Runtime::WaitForEarlySteps() {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ != nullptr) optimizer_->WaitForEarlySteps();
}

std::vector<PartitionId> Runtime::AbortOptimizerStep() {
  MutexLock lock(&optimizer_mu_);
  if (optimizer_ == nullptr) return {};
  std::vector<PartitionId> stepped = optimizer_->Abort();
  ReleaseStagedGradients();
  EndDroppingGradients();
  return stepped;
}

}  // namespace strata::sched
