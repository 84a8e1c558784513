// planner/step_bound.h: the lower bound of a training step's traffic (bench/sched_step and the
// planner).
//
// A step is the trainer's groups of partition accesses in order, each group acquired together,
// computed on for a modelled time and released, in phases (forward, backward, optimizer) that run
// one after another. Two counts bound what any tiering policy must move:
//  - Belady: the bytes loaded into, and dirty bytes written back out of, a memory of `budget` bytes
//    by the offline-optimal eviction (the copy needed furthest in the future goes first) over the
//    step repeated (the second pass counted: the steady state; sizes in whole 4 KiB pages; the copy
//    in use is never evicted). A discard drops its partition's copy without a write-back, and the
//    next access after it loads nothing (it writes fresh bytes); a copy whose next event is its
//    discard is needed never again. A counting bound: it charges a link its loads, its dirty
//    evictions and the dirty bytes another memory reads, not every byte a real schedule moves.
//  - PhaseLowerBounds: at a phase's start the memory tiers hold at most their budgets' bytes, so of
//    the partitions a phase accesses, all but that many bytes are read from NVMe within the phase,
//    and of those it dirties, all but that many are written back within it (a dirty copy leaves
//    memory only once written back, and at the phase's end memory again holds at most its
//    budgets). The same for the device tier and the link. A partition without bytes when the phase
//    first accesses it (discarded earlier) is read from nowhere, and one the phase discards need
//    not be written back. The step takes at least the sum over phases of max(the phase's compute
//    on the trainer, its compute on the CPU optimizer's threads, its disk time, its link time).
//
// Thread safety: plain functions of their arguments.
#ifndef STRATA_PLANNER_STEP_BOUND_H_
#define STRATA_PLANNER_STEP_BOUND_H_

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "tiering/residency.h"

namespace strata::plan {

using tiering::PartitionId;
using tiering::Tier;

struct Access {
  PartitionId id;
  Tier tier;
  bool dirty;
  bool discard = false;  // not an acquire: Discard(id), the bytes no longer needed
};
enum Phase : int { kForward, kBackward, kOptimizer, kPhaseCount };
// Collectives between the data-parallel ranks around a group (planner/plan_comm.h says what they
// are and costs them), on a lane of their own: one or a run of alike ones, one rank's side.
struct Exchange {
  // kAgreement: the ranks meeting alone (a rendezvous, `agree_s`), no collective of bytes after.
  enum Kind : int { kAllGather, kReduceScatter, kAgreement } kind = kAllGather;
  double seconds = 0;  // on the collectives' lane, every one's latency included
  double bytes = 0;    // this rank's on the wire
  int count = 1;       // collectives
  double agree_s = 0;  // the trainer's, as it issues them: the ranks agreeing (kAgreement)
  // Before a group: issued when the trainer's previous group began (a gather prefetched), else as
  // the group's acquire begins; after it: the trainer goes on (overlap_comm), else it waits.
  bool ahead = false;
};
struct Group {
  std::vector<Access> accesses;
  double compute_s = 0;
  Phase phase = kForward;
  std::optional<PartitionId> gradient_ready;  // handed to GradientReady after the release
  std::optional<PartitionId> discard;         // then Discard (a gradient once stepped from)
  // Computed by the CPU optimizer's threads beside the trainer, which goes on without waiting for
  // it (else the trainer computes it, or waits while the GPU does).
  bool on_cpu = false;
  // The trainer's only: its collectives before it computes (its weights' all-gathers) and after
  // (its gradients' reduce-scatters), and whether it first waits for the CPU optimizer's groups
  // issued before it (the step's new weights, which a gather after the step sends).
  std::vector<Exchange> before, after;
  bool waits_for_cpu = false;
  // Its collectives' seconds on their lane, and its agreeing's, before and after it.
  double comm_s() const;
  double agree_s() const;
};

// A partition's bytes.
using Sizes = absl::FunctionRef<uint64_t(PartitionId)>;

// The step's accesses in order, a discard after its group's.
std::vector<Access> Accesses(const std::vector<Group>& step);

struct Traffic {
  uint64_t loaded = 0, written = 0;
};
// Belady's count over `step` (accesses, discards among them) with `budget` bytes. With `tier`,
// the memory counted is that tier alone (its link): accesses in other tiers take none of its room,
// but a dirty copy held in it crosses to them before they read it (counted as written), and a
// write there leaves its copy stale (dropped, so its next access here loads).
Traffic Belady(Sizes bytes, const std::vector<Access>& step, uint64_t budget,
               std::optional<Tier> tier = std::nullopt);

struct PhaseNeeds {
  double compute_s = 0;  // the trainer's groups
  double cpu_s = 0;      // the groups on the CPU optimizer's threads
  double comm_s = 0;     // the groups' collectives (their lane's time)
  double agree_s = 0;    // the trainer's, agreeing on them
  Traffic disk, link;
};
// What each phase must move within itself: `memory_budget` is the device and host tiers together
// (for the disk), `device_budget` the device's (for the link).
std::array<PhaseNeeds, kPhaseCount> PhaseLowerBounds(Sizes bytes, const std::vector<Group>& step,
                                                     uint64_t device_budget,
                                                     uint64_t memory_budget);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_STEP_BOUND_H_
