// planner/plan_memory.h: will it fit — the bytes a training run keeps in each tier, from the model,
// the hardware and a strata or DeepSpeed config, and the first tier that overflows.
//
// What strata keeps where (Ψ parameters, d bytes per element of the training dtype: 2 for bf16 or
// fp16, 4 for fp32; N GPUs on the node, each a data-parallel rank, W ranks on every node (N on one
// node; the formulas below say N for one node); "a layer" is the largest partition, one layer's
// parameters or the embedding):
//   optimizer state: fp32 master weights, Adam's m and v: 12 bytes per parameter (8 in fp32
//     training, where the parameters are the master weights). Not offloaded: on the GPUs, divided
//     by N from stage 1. offload_optimizer cpu: host; nvme: twice that on NVMe (the step writes
//     the new state before the old is given up: crash-consistent), buffer_count of the host's
//     staging buffers (one layer's state each) and a 2-byte param copy per parameter in the host.
//   parameters: stages 0-2: d·Ψ on each GPU. Stage 3: d·Ψ/N on each GPU when not offloaded, plus
//     the layers gathered for use (stage3_max_live_parameters, at least two layers); offloaded
//     (offload_param cpu: host; nvme: NVMe with buffer_count x buffer_size of pinned staging), a
//     GPU holds only what is in use and the small parameters kept there (all the norms and
//     biases, taken to be under stage3_param_persistence_threshold: the threshold is not read).
//   gradients: not offloaded, d·Ψ per GPU (stage 0-1) or d·Ψ/N (stages 2-3) plus a layer being
//     reduced. With offload_optimizer, each gradient leaves the GPU as backward produces it (two
//     layers held there); with gradient_accumulation_steps 1 the CPU optimizer steps it as it comes
//     and it is discarded (a few layers held in the host), else every gradient accumulates in the
//     host (d·Ψ). Unlike DeepSpeed, which keeps fp32 gradients (4·Ψ) for its CPU optimizer,
//     strata's CPU Adam reads gradients in the training dtype.
//   activations (in the training dtype: the 16-bit formulas x d/2): per GPU,
//     Transformer::LayerActivationBytes per layer, or with activation
//     checkpointing Transformer::CheckpointBytesPerLayer per layer plus one layer's full set;
//     the logits besides. Both figures are reported; the fit uses the one asked for.
// Device bytes are per GPU (a GPU's share of what is partitioned: 1/W); host and NVMe bytes are
// the node's (all its N ranks: N/W of what is partitioned). Not counted: the
// CUDA context and the framework's own workspace on the GPU, and the trainer process's own host
// memory (the data loader, the Python runtime): leave room for them.
//
// Thread safety: plain values and pure functions.
#ifndef STRATA_PLANNER_PLAN_MEMORY_H_
#define STRATA_PLANNER_PLAN_MEMORY_H_

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "planner/plan_hardware.h"
#include "planner/plan_model.h"
#include "tiering/runtime_config.h"

namespace strata::plan {

// What the planner reads of a strata or DeepSpeed config: the Runtime's blocks
// (tiering/runtime_config.h) and DeepSpeed's training keys bf16.enabled (or its older name
// bfloat16.enabled), fp16.enabled,
// train_micro_batch_size_per_gpu and gradient_accumulation_steps; and what the trainer's front
// reads for its collectives across ranks (python/strata/ranks.py): zero_optimization's
// reduce_bucket_size and allgather_bucket_size (elements, 5e8 by default) and overlap_comm (on
// at stage 3 by default, off below).
struct Training {
  tiering::RuntimeConfig runtime;
  int dtype_bytes = 4;  // fp32 unless bf16 or fp16 is enabled
  bool fp16 = false;
  int64_t micro_batch = 1;
  int64_t gradient_accumulation = 1;
  double gradient_clipping = 0;  // DeepSpeed's gradient_clipping (0: off)
  bool activation_checkpointing = true;
  // strata.device_budget_bytes and strata.host_budget_bytes when the config gives them (the
  // planner's step replay caps its budgets there; else it gives the tiers what the hardware has
  // left).
  std::optional<uint64_t> device_budget, host_budget;
  int64_t reduce_bucket = 500000000, allgather_bucket = 500000000;  // as the config gives them
  std::optional<bool> overlap_comm;
  // The buckets as the front takes them: each capped at a 64th of strata.host_budget_bytes
  // (4 GiB when the config gives none) in elements, at least 65536 (ranks.Ranks.configure).
  int64_t ReduceBucket() const;
  int64_t AllgatherBucket() const;
  bool OverlapComm() const { return overlap_comm.value_or(runtime.zero_stage == 3); }
  // The ZeRO stage the front runs on `ranks` ranks: the config's, but stage 0 across ranks runs
  // as stage 1 (the same numbers as data parallel, each rank holding a shard of the optimizer's
  // state: python/strata/engine.py).
  int StageRun(int ranks) const {
    return ranks > 1 ? std::max(runtime.zero_stage, 1) : runtime.zero_stage;
  }
};
absl::StatusOr<Training> TrainingFromConfig(const nlohmann::json& config,
                                            std::vector<std::string>* warnings);

struct Bytes {
  double params = 0, grads = 0, optimizer = 0, activations = 0, staging = 0;
  double total() const { return params + grads + optimizer + activations + staging; }
};

struct MemoryPlan {
  Bytes device, host, nvme;  // device: per GPU; host and NVMe: the node's
  double activations_checkpointed = 0, activations_full = 0;  // per GPU, both ways
  struct Overflow {
    std::string tier;  // "device", "host" or "nvme"
    double need = 0, have = 0;
  };
  std::optional<Overflow> overflow;  // the first tier (device, host, NVMe) over its capacity
  // Parameters homed on NVMe whose new weights the step does not stage in host memory: after the
  // commit the trainer's front reads each one's committed master weights back (its whole
  // optimizer state) and writes its partition (python/strata/engine.py, _refresh_weights).
  bool weights_from_master = false;
  // strata.optimizer_commit "partition" as the Runtime takes it: the config's, or its "auto"
  // answered for this model (RuntimeConfig::CommitEach: the NVMe state beyond a process's host
  // budget).
  bool commit_each = false;
  // The smallest strata.host_budget_bytes of each process for this model and config
  // (tiering::RuntimeConfig::MinimumHost, from the model's sizes: what strata.check_config says
  // with the model and strata.initialize refuses below).
  tiering::RuntimeConfig::HostMinimum host_minimum;
};

// InvalidArgument when the config offloads to a tier the hardware lacks (NVMe).
absl::StatusOr<MemoryPlan> PlanMemory(const Transformer& model, const Hardware& hardware,
                                      const Training& training);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_MEMORY_H_
