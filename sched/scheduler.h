// sched/scheduler.h: the prefetching scheduler's plan — what the trainer will need next, and which
// copy is needed furthest in the future.
//
// The trainer's accesses repeat from step to step. The Scheduler records every acquire and release
// of a step (the partition, its tier, role and size, and when it came, relative to the step's
// start): that is the trace. The first step only records. From the next step on the trace is the
// plan: the Scheduler follows the trainer through it (the cursor: the position of the next access
// it expects) and answers two questions for the Runtime —
//   Window():  the next accesses, in the order they will come (the Runtime prefetches them);
//   NextUse(): how many accesses ahead a partition is needed again in a tier (Belady's rule on the
//              known trace: evict the copy needed furthest in the future). The plan wraps around
//              the step's end into the next step, which repeats it, so the first layers are brought
//              back while the last ones run.
// Planning stops at the first mismatch (a different partition or tier than the plan expects, or
// an access past its end): the Scheduler says so once (divergence()), the rest of the step runs on
// demand with least-recently-used eviction (mode kFallback), and the step is recorded anew: the
// next step is planned from it. A step that ends early with every access as planned (a trainer's
// short last window of an epoch) is no mismatch: the plan stays for the next whole step.
//
// The window is adaptive: it widens while the trainer still waits for prefetched partitions
// (OnLateOrMiss) and narrows when a prefetch finds no room in a tier's budget (OnBudgetTight),
// between 1 and SchedulerConfig::max_lookahead accesses. DeepSpeed's stage-3 knobs bound it:
// prefetch_bucket_elements caps the parameter elements ahead of the access due now (the first
// partition ahead is always allowed: a layer may hold more than the bucket).
//
// With policy kLru there is no plan: every step is on demand with LRU eviction (what the Runtime
// did before the scheduler). kDeepSpeedLike models DeepSpeed's coordinator for comparison: a fixed
// window of prefetch_bucket_elements parameter elements, device-tier accesses only, at most two
// prefetches in flight, and no read ahead from NVMe.
//
// Thread safety: not thread-safe; the Runtime calls it under its own mutex.
#ifndef STRATA_SCHED_SCHEDULER_H_
#define STRATA_SCHED_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "tiering/residency.h"

namespace strata::sched {

using tiering::PartitionDesc;
using tiering::PartitionId;
using tiering::Tier;

enum class Policy : uint8_t { kTrace, kLru, kDeepSpeedLike };

struct SchedulerConfig {
  Policy policy = Policy::kTrace;
  int initial_lookahead = 4;  // accesses
  int max_lookahead = 256;
  // stage3_prefetch_bucket_size: parameter elements (Role::kParam) ahead in the window.
  uint64_t prefetch_bucket_elements = 50000000;
};

// One event of the trace.
struct TraceEvent {
  PartitionId id = 0;
  Tier tier = Tier::kDevice;
  tiering::Role role = tiering::Role::kParam;
  uint64_t bytes = 0, elements = 0;
  bool acquire = true;    // else a release
  bool dirty = false;     // a release that changed the bytes
  double at_seconds = 0;  // since the step began
};

class Scheduler {
 public:
  enum class Mode : uint8_t { kRecording, kPlanned, kFallback, kOnDemand };
  static constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

  explicit Scheduler(const SchedulerConfig& config);

  // The trainer's acquire of (desc, tier) at `at_seconds` into the step. Returns true when it is
  // the access the plan expected (false in the other modes, and on the mismatch that ends the
  // plan).
  bool OnAcquire(const PartitionDesc& desc, Tier tier, double at_seconds);
  void OnRelease(const PartitionDesc& desc, Tier tier, bool dirty, double at_seconds);

  // The step ends: a recorded or diverged step becomes the plan of the next one (a planned step
  // that ended short of the plan leaves it as it is). Returns the divergence of the step that
  // ended, if any.
  std::optional<std::string> EndStep();

  struct Upcoming {
    PartitionId id;
    Tier tier;
  };
  // The accesses to prefetch now, in order (empty unless planned).
  std::vector<Upcoming> Window() const;
  // Accesses from the cursor until (id, tier) is needed again; kNever when it is not in the plan
  // (or there is no plan).
  uint64_t NextUse(PartitionId id, Tier tier) const;
  // A gradient partition (Role::kGrad) released written in this step is needed in the host tier
  // at the step's end, by the optimizer step that reads it there after the trace's last access
  // (out of the trace): the accesses from the cursor to that end; kNever for any other partition
  // or without a plan. An eviction from the host tier keeps it over what the next step needs.
  uint64_t StepUse(PartitionId id) const;
  // `id` was discarded (its bytes dropped): nothing of this step needs it any more.
  void OnDiscard(PartitionId id) { for_step_.erase(id); }

  // The trainer waited for an access the plan knew (planned steps only: a recording step's misses
  // say nothing about the window).
  void OnLateOrMiss();
  // The parameter elements (Role::kParam accesses, as DeepSpeed counts reuse distance) the plan
  // acquires before (id, tier) is needed again; kNever when it is not in the plan.
  uint64_t ParamElementsBeforeNextUse(PartitionId id, Tier tier) const;
  // Whether a copy of `id` held in a tier of `capacity` bytes is evicted before its next use (in
  // either memory tier, or its StepUse) by Belady's rule on the plan: at some access before that
  // use, the copies needed sooner than it — those `resident` now and accessed again before it, and
  // those brought in and accessed again before it — with the one in use and its own bytes exceed
  // `capacity`. (Every access counts against the one tier: an estimate that errs towards eviction.)
  // False when there is no plan or it is not in the plan.
  bool EvictedBeforeNextUse(PartitionId id, uint64_t capacity,
                            const std::function<bool(PartitionId)>& resident) const;
  // The gradient partitions (Role::kGrad) of the plan in the order they were released dirty
  // (backward's order), each once; empty without a plan.
  std::vector<PartitionId> GradientOrder() const;
  // A prefetch `distance` accesses ahead found no room: the window narrows to it.
  void OnBudgetTight(uint64_t distance);

  Mode mode() const { return mode_; }
  int lookahead() const { return lookahead_; }
  // Prefetches a policy allows in flight at once (0: no limit).
  int max_in_flight() const { return config_.policy == Policy::kDeepSpeedLike ? 2 : 0; }
  // Whether eviction follows the plan (Belady's rule: kTrace, planned); else least recently used.
  bool plans_evictions() const {
    return config_.policy == Policy::kTrace && mode_ == Mode::kPlanned;
  }
  bool reads_ahead_from_nvme() const { return config_.policy != Policy::kDeepSpeedLike; }
  const std::vector<TraceEvent>& plan() const { return plan_; }
  // The divergence of this step, once detected.
  const std::optional<std::string>& divergence() const { return divergence_; }

 private:
  void Diverge(std::string why);

  SchedulerConfig config_;
  Mode mode_;
  int lookahead_;
  std::vector<TraceEvent> plan_;         // the acquires and releases of the planned step
  std::vector<uint32_t> plan_acquires_;  // indices of plan_'s acquires, in order
  std::vector<uint64_t> param_prefix_;   // parameter elements of the first k acquires
  // (id, tier) -> its positions among the acquires.
  absl::flat_hash_map<std::pair<PartitionId, Tier>, std::vector<uint32_t>> uses_;
  std::vector<TraceEvent> recording_;  // this step's events
  // Gradient partitions released written in this step: the optimizer step reads them at its end.
  absl::flat_hash_set<PartitionId> for_step_;
  uint64_t cursor_ = 0;  // position of the next expected acquire
  std::optional<std::string> divergence_;
  bool tight_ = false;  // a prefetch found no room since the window last widened or held
};

}  // namespace strata::sched

#endif  // STRATA_SCHED_SCHEDULER_H_
