// planner/plan_time.h: how fast a training run goes — one step of a model on a node under a config,
// as a trace the step replay runs (planner/plan_step.h), and what it yields: the step's time beside
// its lower bound, where the time goes, tokens per second and model TFLOPs per GPU.
//
// The step modelled is what strata's trainer front runs, per GPU (each of the W ranks, N a node on
// `nodes` nodes, runs the same step on its share):
//   partitions: per layer, and one for the embeddings and output head, the parameters P in the
//     training dtype, the gradient G and the optimizer state S (fp32 master weights and Adam's
//     moments: 12 bytes per parameter, 8 in fp32 training). Homes: P on the device, or with
//     stage 3 and offload_param in the host (cpu) or the NVMe store (nvme); S on the device, or
//     where offload_optimizer puts it; G on the device, or with offload_optimizer in its host
//     buffer. With W ranks a rank moves its 1/W of what ZeRO partitions (S from stage 1, G from
//     stage 2 or when offloaded, P when offloaded).
//   collectives between the ranks (planner/plan_comm.h says which, when and their bytes): the
//     weights' all-gathers before each unit's forward and backward at stage 3 (ahead of need but
//     the first of a forward), the gradients' reduce-scatters after each unit's backward at
//     stages 2 and 3 (overlapping backward with overlap_comm), at the step the gradients reduced
//     there (stage 1; stage 3's norms and biases) in a group of their own, and after the
//     optimizer the new weights of the parameters not partitioned, in a group that waits for it.
//     ZeRO stage 0 across ranks is planned as stage 1, as the engine runs it (Training::StageRun).
//   groups: forward, layer by layer (P on the device); the output head; backward from the head,
//     last layer first (P and G on the device, G written and, with offload_optimizer, sent down
//     at once: GradientReady); with offload_optimizer the optimizer steps each unit on the CPU as
//     soon as its gradient is down, beside backward (S, G and P in the host, P's new weights
//     written there; in one process at stage 3 only, as the front stages it), else on the GPU
//     after backward. gradient_accumulation_steps k: forward and
//     backward run k times, the optimizer once; an offloaded gradient is added into a host buffer
//     on the CPU (the last micro-step's optimizer reads both).
//   compute: FLOPs / (gpu.tflops x gpu.efficiency): a layer's forward 2 x its active matrix
//     parameters x tokens + 4 x sequence x hidden x tokens, the head's 2 x vocab x hidden x tokens;
//     backward twice the forward, three times with activation checkpointing (the forward again).
//     The optimizer: 28 bytes of memory traffic per parameter (bench/cpu_adam's count) at
//     host.optimizer_gbps / N on the CPU, at gpu.hbm_gbps on the GPU; adding a gradient into the
//     accumulation buffer, 3 x dtype bytes per parameter at host.optimizer_gbps / N.
// Budgets, for copies away from their homes: the device's HBM less the activations and what lives
// there; the host's RAM less what the memory plan keeps there (planner/plan_memory.h), its room for
// the optimizer's staged param copies included, / N. A config's strata.device_budget_bytes and
// strata.host_budget_bytes cap them. Lanes: one GPU's PCIe each way; the NVMe drives and the CPU
// optimizer shared by the node's N ranks (/N each); staging: offload_param's buffer_count buffers
// of buffer_size; the collectives on the links (gpu_link, and the network across nodes), on the
// GPU's lane for a "loopback" link (Lanes::comm_shares_cores).
//
// Thread safety: pure functions of their arguments.
#ifndef STRATA_PLANNER_PLAN_TIME_H_
#define STRATA_PLANNER_PLAN_TIME_H_

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "planner/plan_comm.h"
#include "planner/plan_hardware.h"
#include "planner/plan_memory.h"
#include "planner/plan_model.h"
#include "planner/plan_step.h"
#include "sched/scheduler.h"

namespace strata::plan {

// The runtime's scheduler, replayed.
using sched::Policy;
using sched::Scheduler;
using sched::SchedulerConfig;

struct StepModel {
  StepTrace trace;
  Lanes lanes;
  Budgets budgets;
  SchedulerConfig scheduler;
  double tokens_per_gpu = 0;  // per step
};
// InvalidArgument when the device has no room left for copies away from their homes (HBM less
// the activations and what lives there); a host with none left gets a budget of 0, and the replay
// then names the first partition that needs host room.
absl::StatusOr<StepModel> ModelStep(const Transformer& model, const Hardware& hardware,
                                    const Training& training, const MemoryPlan& memory);

struct TimePlan {
  StepModel model;
  Prediction step;
  CommTotals comm;                  // one rank's collectives a step (none in one rank)
  double tokens_per_s = 0;          // every rank's
  double model_flops_per_gpu = 0;   // a step's: 3 forwards' FLOPs per token (no recompute)
  double model_tflops_per_gpu = 0;  // those over the step's seconds
};
absl::StatusOr<TimePlan> PlanTime(const Transformer& model, const Hardware& hardware,
                                  const Training& training, const MemoryPlan& memory);

// --suggest: the configuration with the most tokens per second that fits, searched over the ZeRO
// stage (0-3; 1-3 across ranks), where the optimizer state (none, cpu, nvme when the hardware has
// it) and, at stage 3, the parameters (none, cpu, nvme) live, the micro-batch (1 to 64, powers of
// two), activation checkpointing on or off and stage3_prefetch_bucket_size (5e7, 2e8, 1e9). The
// training dtype, gradient accumulation, the buffer keys and the budgets the config gives are kept;
// the budgets the replay used are returned in the suggestion.
struct Suggestion {
  Training training;
  Transformer model;  // at the suggested micro-batch
  MemoryPlan memory;
  TimePlan time;
  int tried = 0, fitting = 0;
};
// NotFound when nothing fits.
absl::StatusOr<Suggestion> Suggest(const Transformer& model, const Hardware& hardware,
                                   const Training& base);
// The suggestion as a config block to paste: zero_optimization (stage, the offload blocks with
// their buffer keys, stage3_prefetch_bucket_size), train_micro_batch_size_per_gpu, bf16 or fp16,
// gradient_accumulation_steps, and strata's device and host budgets.
nlohmann::json SuggestionConfig(const Suggestion& s);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_TIME_H_
