#include "planner/plan_memory.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/config_reader.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::plan {
namespace {

using Json = nlohmann::json;
using tiering::OffloadDevice;

// DeepSpeed's keys the planner reads (the Runtime leaves them to the trainer, or accepts the stage
// without acting on it yet): their notes are not passed on.
constexpr const char* kPlannerKeys[] = {"bf16",
                                        "bfloat16",
                                        "fp16",
                                        "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps",
                                        "zero_optimization.stage",
                                        "zero_optimization.reduce_bucket_size",
                                        "zero_optimization.allgather_bucket_size",
                                        "zero_optimization.overlap_comm"};

absl::StatusOr<bool> Enabled(const Json& root, const char* block) {
  auto it = root.find(block);
  if (it == root.end()) return false;
  if (!it->is_object()) {
    return config::Bad(block, absl::StrCat(it->dump(), " is not an object ({\"enabled\": true})"));
  }
  bool on = false;
  if (auto e = it->find("enabled"); e != it->end() && e->is_string() && *e == "auto") {
    return config::Bad(absl::StrCat(block, ".enabled"),
                       "\"auto\" is filled in by the trainer's integration before DeepSpeed sees "
                       "the config; write true or false");
  }
  STRATA_RETURN_IF_ERROR(config::ReadBool(*it, absl::StrCat(block, "."), "enabled", &on));
  return on;
}

// The keys the trainer's front reads for its collectives across ranks, checked as it checks them
// (ranks.bucket_settings).
absl::Status ReadCollectiveKeys(const Json& root, Training& t) {
  auto zero = root.find("zero_optimization");
  if (zero == root.end() || !zero->is_object()) return absl::OkStatus();
  for (const auto& [key, out] : {std::pair{"reduce_bucket_size", &t.reduce_bucket},
                                 std::pair{"allgather_bucket_size", &t.allgather_bucket}}) {
    auto it = zero->find(key);
    if (it == zero->end()) continue;
    if (!it->is_number() || !(it->get<double>() >= 1) || !(it->get<double>() < 1e18)) {
      return config::Bad(absl::StrCat("zero_optimization.", key),
                         absl::StrCat(it->dump(),
                                      " is not accepted; accepted: a number of "
                                      "elements, 1 or more"));
    }
    *out = static_cast<int64_t>(it->get<double>());
  }
  if (auto it = zero->find("overlap_comm"); it != zero->end()) {
    if (it->is_boolean()) {
      t.overlap_comm = it->get<bool>();
    } else if (it->is_number_integer() && (*it == 0 || *it == 1)) {
      t.overlap_comm = *it == 1;
    } else {
      return config::Bad("zero_optimization.overlap_comm",
                         absl::StrCat(it->dump(), " is not accepted; accepted: true or false"));
    }
  }
  return absl::OkStatus();
}

// A bucket as the front caps it: a 64th of the host budget (the Runtime's default when the config
// gives none) in elements, at least 65536.
int64_t CappedBucket(int64_t bucket, std::optional<uint64_t> host_budget) {
  const uint64_t budget = host_budget.value_or(tiering::RuntimeConfig().host_budget_bytes);
  return std::min(bucket, std::max<int64_t>(1 << 16, static_cast<int64_t>(budget / 64)));
}

}  // namespace

int64_t Training::ReduceBucket() const { return CappedBucket(reduce_bucket, host_budget); }
int64_t Training::AllgatherBucket() const { return CappedBucket(allgather_bucket, host_budget); }

absl::StatusOr<Training> TrainingFromConfig(const Json& root, std::vector<std::string>* warnings) {
  std::vector<std::string> all;
  STRATA_ASSIGN_OR_RETURN(tiering::RuntimeConfig runtime,
                          tiering::RuntimeConfigFromJson(root, &all));
  Training t;
  t.runtime = std::move(runtime);
  STRATA_ASSIGN_OR_RETURN(const bool bf16_new, Enabled(root, "bf16"));
  STRATA_ASSIGN_OR_RETURN(const bool bf16_old, Enabled(root, "bfloat16"));  // DeepSpeed's old name
  const bool bf16 = bf16_new || bf16_old;
  STRATA_ASSIGN_OR_RETURN(const bool fp16, Enabled(root, "fp16"));
  if (bf16 && fp16) {
    return config::Bad("bf16", "bf16 and fp16 are both enabled; enable one of them");
  }
  t.dtype_bytes = bf16 || fp16 ? 2 : 4;
  t.fp16 = fp16;
  STRATA_RETURN_IF_ERROR(
      config::ReadInt(root, "", "train_micro_batch_size_per_gpu", 1, 1 << 20, &t.micro_batch));
  STRATA_RETURN_IF_ERROR(config::ReadInt(root, "", "gradient_accumulation_steps", 1, 1 << 20,
                                         &t.gradient_accumulation));
  if (auto it = root.find("gradient_clipping"); it != root.end()) {
    if (!it->is_number() || it->get<double>() < 0) {
      return config::Bad("gradient_clipping",
                         absl::StrCat(it->dump(), ": accepted: a number, 0 or more (0: off)"));
    }
    t.gradient_clipping = it->get<double>();
  }
  if (auto it = root.find("strata"); it != root.end() && it->is_object()) {
    if (it->contains("device_budget_bytes")) t.device_budget = t.runtime.device_budget_bytes;
    if (it->contains("host_budget_bytes")) t.host_budget = t.runtime.host_budget_bytes;
  }
  STRATA_RETURN_IF_ERROR(ReadCollectiveKeys(root, t));
  if (t.runtime.offload_optimizer.device != OffloadDevice::kNone && t.runtime.zero_stage == 0) {
    return config::Bad("zero_optimization.offload_optimizer",
                       "optimizer offload needs a ZeRO stage of 1 or more, the stage is 0");
  }
  if (warnings != nullptr) {
    for (std::string& w : all) {
      const bool read_here =
          std::any_of(std::begin(kPlannerKeys), std::end(kPlannerKeys),
                      [&](const char* k) { return absl::StartsWith(w, absl::StrCat(k, ": ")); });
      if (!read_here) warnings->push_back(std::move(w));
    }
  }
  return t;
}

absl::StatusOr<MemoryPlan> PlanMemory(const Transformer& m, const Hardware& hw, const Training& t) {
  const tiering::RuntimeConfig& rc = t.runtime;
  const OffloadDevice param_to = rc.offload_param.device;
  const OffloadDevice opt_to = rc.offload_optimizer.device;
  for (const auto& [block, to] :
       {std::pair{"offload_param", param_to}, std::pair{"offload_optimizer", opt_to}}) {
    if (to == OffloadDevice::kNvme && !hw.has_nvme()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: zero_optimization.", block, ".device: nvme, but the hardware ",
                       hw.name.empty() ? "" : absl::StrCat("(", hw.name, ") "),
                       "has no nvme block; offload to cpu or none, or describe the drives"));
    }
  }
  const double n = hw.gpus;     // the node's processes
  const double w = hw.ranks();  // every node's: what ZeRO partitions over
  const double node = n / w;    // the node's share of what is partitioned (1 on one node)
  const double d = t.dtype_bytes;
  const double psi = static_cast<double>(m.TotalParams());
  // The largest unit lent (a layer, or one of its tiles; or the embeddings), in parameters.
  const double layer = static_cast<double>(std::max(m.LentUnitParams(), m.vocab * m.hidden));
  const double small = static_cast<double>(m.layers) * (m.LayerParams() - m.LayerMatrixParams());
  const double largest = static_cast<double>(m.LargestParamParams());
  const double opt_per_param = t.dtype_bytes == 4 ? 8 : 12;
  MemoryPlan p;
  // Parameters homed on NVMe: the Runtime keeps their host copies while they are within
  // offload_param.max_in_cpu and twice their copies fit half the host budget (the front's
  // _params_in_cpu); otherwise the step takes their new weights from the master weights. The
  // host budget: the config's, else (as the replay takes it) the machine's memory.
  const bool nvme_params = rc.zero_stage >= 3 && param_to == OffloadDevice::kNvme;
  const double host_budget =
      t.host_budget ? static_cast<double>(*t.host_budget) : static_cast<double>(hw.host_bytes);
  const bool params_kept_in_host =
      nvme_params && psi - small <= static_cast<double>(rc.offload_param.max_in_cpu) &&
      2 * d * (psi - small) <= host_budget / 2;
  p.weights_from_master = nvme_params && !params_kept_in_host;

  // Optimizer state.
  if (opt_to == OffloadDevice::kNone) {
    p.device.optimizer = opt_per_param * psi / (t.StageRun(hw.ranks()) >= 1 ? w : 1);
  } else if (opt_to == OffloadDevice::kCpu) {
    p.host.optimizer = node * opt_per_param * psi;
  } else {
    // As Runtime::CreateOptimizer sets aside: a second copy on NVMe (a step writes the new state
    // before the old is given up), a ring of buffers for the largest partition (one parameter, or
    // a sub-group of it),
    // and a copy in the training dtype of the new weights the step stages in the host: every
    // parameter's, or with their weights taken from the master weights only the small ones the
    // front does not partition. With strata.optimizer_commit "partition": the second copy of one
    // partition, and no staged copies but an fp32 copy buffer beside each ring buffer.
    // The ring's buffers and the commit's room beyond the state hold a sub-group
    // (zero_optimization.sub_group_size) when the largest parameter is larger.
    tiering::RuntimeConfig process = rc;  // CommitEach against one process's host budget
    process.host_budget_bytes =
        static_cast<uint64_t>(t.host_budget ? host_budget : host_budget / n);
    const bool each = process.CommitEach(static_cast<uint64_t>(opt_per_param * psi / w));
    p.commit_each = each;
    const double group =
        rc.sub_group_size > 0 ? std::min(largest, static_cast<double>(rc.sub_group_size)) : largest;
    // With "partition", room beside the state for the store's copy on write of its largest blob:
    // a sub-group's state or the largest parameter's partition.
    p.nvme.optimizer =
        each ? node * opt_per_param * psi + std::max(opt_per_param * group, d * largest)
             : 2 * node * opt_per_param * psi;
    if (!each) p.host.params += node * d * (p.weights_from_master ? small : psi);
    p.host.staging += n * static_cast<double>(rc.offload_optimizer.buffer_count) *
                      (opt_per_param + (each ? 4 : 0)) * group;
    // Each process's read-ahead room (strata.optimizer_read_ahead_bytes; "auto": an eighth of
    // its host budget where the trainer's front would hold a step, none elsewhere: one process,
    // and a step decided after backward, by clipping or by "partition" stepping after backward
    // (runtime_settings.py)), at most its share of the state (with "partition", a copy buffer's
    // room beside each sub-group's).
    // (optimizer_during_backward "auto" is on for the GPU the planner plans for, as plan_time.cc
    // models it; nothing is staged during backward below stage 3.)
    const bool during = rc.optimizer_during_backward.value_or(true);
    const bool held =
        w == 1 && rc.zero_stage == 3 && (t.gradient_clipping > 0 || (each && !(during && !t.fp16)));
    // As the Runtime sizes it: 12 bytes an element of state whatever the dtype.
    const double ahead_most = (12 + (each ? 4 : 0)) * psi / w;
    const double ahead = rc.optimizer_read_ahead_bytes.has_value()
                             ? static_cast<double>(*rc.optimizer_read_ahead_bytes)
                         : held ? static_cast<double>(rc.host_budget_bytes) / 8
                                : 0;
    p.host.staging += n * std::min(ahead_most, ahead);
  }

  // Parameters.
  if (rc.zero_stage < 3) {
    p.device.params = d * psi;
  } else {
    const double live =
        std::min(psi, std::max(2 * layer, static_cast<double>(rc.stage3_max_live_parameters)));
    if (param_to == OffloadDevice::kNone) {
      p.device.params = std::min(d * psi, d * psi / w + d * live);
    } else {
      p.device.params = d * std::min(psi, live + small);
      if (param_to == OffloadDevice::kCpu) {
        p.host.params += node * d * psi;  // beside the NVMe optimizer's staged copies, if any
      } else {
        p.nvme.params = node * d * psi;
        if (params_kept_in_host) p.host.params += node * d * psi;
        p.host.staging += n * static_cast<double>(rc.offload_param.buffer_count) *
                          static_cast<double>(rc.offload_param.buffer_size);
      }
    }
  }

  // Gradients.
  if (opt_to == OffloadDevice::kNone) {
    p.device.grads = rc.zero_stage >= 2 ? d * psi / w + d * layer : d * psi;
  } else {
    p.device.grads = 2 * d * layer;
    p.host.grads = t.gradient_accumulation == 1 ? n * 4 * d * layer : node * d * psi;
  }

  // Activations.
  const double full = static_cast<double>(m.layers) * m.LayerActivationBytes() + m.LogitBytes();
  const double ckpt = static_cast<double>(m.layers) * m.CheckpointBytesPerLayer() +
                      m.LayerActivationBytes() + m.LogitBytes();
  const double dtype_scale = d / 2;  // the formulas count 16-bit activations
  p.activations_full = full * dtype_scale;
  p.activations_checkpointed = ckpt * dtype_scale;
  p.device.activations =
      t.activation_checkpointing ? p.activations_checkpointed : p.activations_full;

  // The smallest host budget of a process: the staging buffers, the optimizer's room at its
  // smallest and, at stage 3, the largest gradient partition (fp32) with its parameter's (each
  // process's shard of them), as the front gives them to RuntimeConfig::MinimumHost.
  {
    tiering::RuntimeConfig process = rc;
    process.host_budget_bytes =
        static_cast<uint64_t>(t.host_budget ? host_budget : host_budget / n);
    const double shard = t.StageRun(hw.ranks()) >= 1 ? w : 1;
    const double grad = rc.zero_stage == 3 ? 4 * largest / w : 0;
    p.host_minimum = process.MinimumHost(
        static_cast<uint64_t>(psi / shard), static_cast<uint64_t>(largest / shard),
        static_cast<uint64_t>(grad), static_cast<uint64_t>(d * psi / shard),
        static_cast<uint64_t>(grad / 4 * d));
  }

  const struct {
    const char* tier;
    double need, have;
  } tiers[] = {{"device", p.device.total(), hw.hbm_bytes},
               {"host", p.host.total(), hw.host_bytes},
               {"nvme", p.nvme.total(), hw.nvme_bytes}};
  for (const auto& tier : tiers) {
    if (tier.need > tier.have) {
      p.overflow = MemoryPlan::Overflow{tier.tier, tier.need, tier.have};
      break;
    }
  }
  return p;
}

}  // namespace strata::plan
