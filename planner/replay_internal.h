// planner/replay_internal.h: the step replay (planner/replay.cc) that PredictStep
// (planner/plan_step.cc) runs once it has checked the trace. Not part of the interface: what the
// replay models is said in planner/plan_step.h.
//
// Thread safety: a pure function of its arguments.
#ifndef STRATA_PLANNER_REPLAY_INTERNAL_H_
#define STRATA_PLANNER_REPLAY_INTERNAL_H_

#include "absl/status/status.h"
#include "planner/plan_step.h"

namespace strata::plan::internal {

// Replays three steps of `trace` (the first records, the next two are planned) and fills `out`
// with the last one's time, lanes, timeline and the peak room of the replayed steps (not its
// bound). `trace` and `lanes` must have passed PredictStep's checks. InvalidArgument when a
// partition cannot fit its tier's budget even with everything else evicted.
absl::Status ReplaySteps(const StepTrace& trace, const Lanes& lanes, const Budgets& budgets,
                         const SchedulerConfig& config, Prediction* out);

}  // namespace strata::plan::internal

#endif  // STRATA_PLANNER_REPLAY_INTERNAL_H_
