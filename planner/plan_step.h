// planner/plan_step.h: how long a training step takes — a step's accesses replayed through the
// scheduler's plan on modelled lanes, beside the step's lower bound.
//
// The step is a trace (StepTrace): partitions, each with a home (where its own copy lives: kept on
// the device, in pinned host memory, or in the NVMe store) and the trainer's groups of accesses
// (planner/step_bound.h). PredictStep replays it as the Runtime runs it, on modelled time:
//  - the Scheduler itself (sched/scheduler.h) records the first step and plans the next ones: the
//    replay asks it for the window to prefetch and for each copy's next use in either memory tier
//    (Belady's rule: a prefetch evicts only copies needed later than the window; a demand fetch
//    and a gradient sent down evict the copy needed furthest ahead, least recently used before a
//    plan exists; without a plan nothing is prefetched), and tells it of
//    late or missed accesses and of prefetches that found no room, so its window adapts as it does
//    live;
//  - every move takes time on its lane: the GPU (the trainer's compute), the CPU optimizer, PCIe to
//    the device and to the host (one link each way, or one shared when `link_duplex` is false, as
//    the host-emulated device's copy thread), NVMe reads and writes (one disk: a read and a write
//    do not overlap, their rates are each direction's; a write-back ends `nvme_commit_s` after its
//    bytes, the store's syncs, which overlap other moves). A lane runs its moves one after another
//    in the order they were issued. NVMe <-> device moves go through the staging buffers in chunks
//    (`staging_count` buffers of `staging_bytes`), the disk and the link overlapping chunk by
//    chunk;
//  - a tier's budget is never exceeded: room is made by evicting, and a dirty copy that is not its
//    partition's home is written back first (device -> host home, or to NVMe through the staging
//    buffers; host -> NVMe), its room reusable only once that ends; a discarded partition comes
//    back as zeros made in its tier, nothing read; a copy's room is free only once the moves
//    reading it end; GradientReady sends a gradient down as soon as its group ends unless the plan
//    needs it on the device within the lookahead (to the host, to NVMe when the host has no room;
//    a copy the host already holds is just dropped);
//  - the trainer waits for its group's bytes and for the GPU; a group on the CPU (Group::on_cpu)
//    waits for its bytes and the CPU lane without holding the trainer; the step ends when the
//    trainer and the CPU are done, and the streamed partitions' write-backs (StepTrace::streamed:
//    the NVMe optimizer's state, whose commit ends the step) have ended.
//  - prefetches are issued as the Runtime issues them, after each acquire and at a step's end, each
//    of the window's partitions on its own; each runs on one of `workers` worker threads (as do
//    GradientReady's moves), waiting for one to be free; a prefetch evicts nothing the window
//    needs and never waits for room another move is vacating (it fails, narrowing the window);
//    one that finds no room on the device reads its partition from NVMe into the host;
//    the trainer's own fetches run on its thread, one acquire after another, each also waiting
//    for a move still reading the copy it acquires;
//  - the collectives between the data-parallel ranks (Group::before and Group::after, Exchange)
//    run on a lane of their own, each after the ones issued before it: a group's gathers are
//    issued as its acquire begins, or, ahead (a prefetch), when the trainer's previous group began
//    computing, and the group computes once they end; its reduce-scatters are issued once it ends,
//    each after the last one issued ends (one in flight), and the trainer waits for them unless
//    they are ahead (overlap_comm); the step's end waits for every one. The trainer spends each
//    one's `agree_s` (the ranks agreeing) as it issues it. With `comm_shares_cores` (ranks as
//    processes on one machine's cores, their collectives over its TCP stack) the collectives'
//    lane is the GPU's: they never overlap compute;
//  - a host copy released dirty that Belady's rule would evict before its next use is written
//    back to NVMe at once and stays, clean (the Runtime's early write-back), on at most
//    workers - 1 threads at once (1 with a single worker); the other jobs, which the Runtime runs
//    first and always leaves a worker, are modelled as if they had all `workers`.
// Three steps are replayed (the first records, the next two are planned; the wrap-around prefetch
// of a planned step reaches into the next); the last is reported. What the Runtime does that the
// replay does not: its stage3_max_live_parameters limit, and the copy engine's and the workers'
// own overheads beyond the store's commit.
//
// Thread safety: pure functions of their arguments.
#ifndef STRATA_PLANNER_PLAN_STEP_H_
#define STRATA_PLANNER_PLAN_STEP_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/step_bound.h"
#include "sched/scheduler.h"
#include "tiering/residency.h"

namespace strata::plan {

// The runtime's scheduler, replayed.
using sched::Policy;
using sched::Scheduler;
using sched::SchedulerConfig;

// The lanes a step's time is spent on.
enum Lane : int { kGpu, kCpu, kToDevice, kToHost, kNvmeRead, kNvmeWrite, kComm, kLaneCount };
const char* LaneName(Lane lane);  // "gpu", "cpu optimizer", "pcie to device", ..., "collectives"

struct StepTrace {
  std::vector<tiering::PartitionDesc> partitions;  // partitions[i].id == i
  std::vector<Tier> home;                          // each partition's own copy
  std::vector<Group> groups;                       // one step, in order
  std::vector<std::string> names;                  // optional: what each partition is, for messages
  // Optional: partitions kept in no memory tier past a use (empty: none). Homed on NVMe, each is
  // read from there at every access and, dirtied, written back and dropped once its group ends:
  // the NVMe optimizer's state, which the Runtime reads into the optimizer's ring, steps and
  // writes back every step whatever room the host tier has.
  std::vector<bool> streamed;
  bool Streamed(PartitionId id) const { return id < streamed.size() && streamed[id]; }
  std::string Name(PartitionId id) const;  // "partition 7", or "partition 7 (its name)"
};

// Bytes per second; staging: the NVMe <-> device chunks.
struct Lanes {
  double to_device = 0, to_host = 0;
  bool link_duplex = true;  // PCIe carries both directions at once; else one shared link
  double nvme_read = 0, nvme_write = 0;
  // A write-back's commit after its bytes, seconds: the NVMe store syncs its data and its manifest
  // record (tiering/nvme_store.h). The write-back ends that much later; other moves go on.
  double nvme_commit_s = 0;
  uint64_t staging_bytes = 64 << 20;
  int staging_count = 4;
  int workers = 4;  // the Runtime's worker threads: prefetches and write-backs run on them
  // The collectives run on the cores the trainer computes on (Gloo on loopback): their lane is
  // the GPU's.
  bool comm_shares_cores = false;
  // The link's time for `down` bytes to the device and `up` to the host (duplex: the longer).
  double LinkSeconds(double down, double up) const;
  double DiskSeconds(double read, double written) const;
};

// The room of the device and host tiers for copies that are not their partitions' homes.
struct Budgets {
  uint64_t device = 0, host = 0;
};

struct Bound {
  // max(the trainer's compute and its agreeing on collectives, the CPU optimizer, link, disk,
  // collectives) over the whole step (Belady's bytes; the collectives added to the trainer's where
  // they share the cores)
  double whole_s = 0;
  double by_phase_s = 0;  // the sum over phases of each phase's max
  double compute_s = 0, cpu_s = 0, comm_s = 0, agree_s = 0;
  // The whole step's largest term: kGpu (compute, with the collectives where they share the
  // cores), kCpu, kToDevice (the link), kNvmeRead (the disk) or kComm.
  Lane limit = kGpu;
  Traffic link, disk;                            // Belady's, over the whole step
  std::array<PhaseNeeds, kPhaseCount> phases{};  // what each phase must move within itself
  double seconds() const { return whole_s > by_phase_s ? whole_s : by_phase_s; }
};
// The step's lower bound (planner/step_bound.h): partitions homed on the device cross no link and
// those homed in the host touch no disk.
Bound StepLowerBound(const StepTrace& trace, const Lanes& lanes, const Budgets& budgets);

struct Prediction {
  double step_s = 0;
  Bound bound;
  std::array<double, kLaneCount> busy_s{};   // each lane's busy time within the step
  std::array<double, kLaneCount> bytes{};    // bytes each lane moved (0 for gpu and cpu)
  std::array<double, kLaneCount> waits_s{};  // the trainer's waits, by the lane it waited on
  struct Span {
    Lane lane;
    double start, end;  // seconds from the step's start
    PartitionId id;     // the partition moved or computed on (its group's first access)
  };
  std::vector<Span> timeline;  // the reported step's, lane by lane
  // The most room the device's and the host's copies took at any instant of the replayed steps
  // (a copy's room counts from when it was granted until it is free again): never over the budget.
  std::array<uint64_t, 2> peak_room{};
};

// InvalidArgument when the trace is malformed (a partition id out of range, homes not one per
// partition, a lane's bandwidth not positive where the trace needs it) or a partition cannot fit
// its tier's budget even with everything else evicted (named, with the budget).
absl::StatusOr<Prediction> PredictStep(const StepTrace& trace, const Lanes& lanes,
                                       const Budgets& budgets,
                                       const SchedulerConfig& scheduler = {});

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_STEP_H_
