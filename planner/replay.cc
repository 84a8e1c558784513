// The step replay: the Runtime's step on modelled time (planner/plan_step.h says what it models).
// Replay::Step is a step's outline; its parts, each a member function, model one part of the
// Runtime: the trainer's acquire and release, the scheduler's prefetches on the workers, a fetch
// into a tier and the room it evicts for under the tier's budget, the moves between tiers, the
// gradient's write-back and the early write-back, and the collectives between the ranks around
// the trainer's groups. LaneClock keeps each lane's time.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <queue>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "planner/plan_step.h"
#include "planner/replay_internal.h"

namespace strata::plan::internal {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kSteps = 3;

int I(Tier t) { return static_cast<int>(t); }

// One lane's busy intervals, start -> end, none overlapping. A move is placed in the first gap at
// or after its ready time that holds it: moves issued later may run before earlier ones still
// waiting for their inputs, as queued I/O does.
class Track {
 public:
  double Place(double ready, double seconds) {
    double start = ready;
    auto it = busy_.upper_bound(start);
    if (it != busy_.begin()) {
      auto prev = std::prev(it);
      if (prev->second > start) start = prev->second;
    }
    while (it != busy_.end() && it->first < start + seconds) {
      start = std::max(start, it->second);
      ++it;
    }
    if (seconds > 0) busy_.emplace(start, start + seconds);
    return start;
  }
  // Intervals ending before `t` can no longer hold a move (none is issued ready before the
  // trainer's time, or before its last group began computing for a gather ahead): forget them.
  void Forget(double t) {
    while (!busy_.empty() && busy_.begin()->second < t) busy_.erase(busy_.begin());
  }

 private:
  std::map<double, double> busy_;
};

// The lanes' time: each lane's busy intervals, the staging buffers NVMe <-> device moves go
// through, and, while reporting, what the reported step spent on each lane (its spans, the bytes
// moved, the trainer's waits by the lane waited on).
class LaneClock {
 public:
  explicit LaneClock(const Lanes& lanes) : lanes_(lanes) {
    for (int i = 0; i < lanes_.staging_count; ++i) staging_.push(0.0);
  }

  // Whether what follows counts in the reported step.
  void set_reporting(bool reporting) { reporting_ = reporting; }

  // A move or a computation of `seconds` on `lane`, ready at `ready`: returns its end.
  double Occupy(Lane lane, double ready, double seconds, PartitionId id, double bytes = 0) {
    const double start = TrackOf(lane).Place(ready, seconds);
    const double end = start + seconds;
    if (reporting_) {
      spans_.push_back({lane, start, end, id});
      moved_[lane] += bytes;
    }
    return end;
  }

  // `lane` held from `ready` for `seconds` without working (the trainer waiting on the ranks):
  // nothing placed after it on its lane runs in that time; no span, no bytes.
  void Hold(Lane lane, double ready, double seconds) { TrackOf(lane).Place(ready, seconds); }

  // `bytes` of `id` over `lane` at its rate, ready at `ready`: returns the end.
  double Transfer(Lane lane, double ready, double bytes, PartitionId id) {
    return Occupy(lane, ready, bytes / Rate(lane), id, bytes);
  }

  // Through the staging buffers, chunk by chunk: `first` then `second` for each.
  double Staged(Lane first, Lane second, double ready, double bytes, PartitionId id) {
    const double chunk = static_cast<double>(lanes_.staging_bytes);
    double end = ready;
    for (double done = 0; done < bytes; done += chunk) {
      const double c = std::min(chunk, bytes - done);
      const double slot = staging_.top();
      staging_.pop();
      const double a = Transfer(first, std::max(ready, slot), c, id);
      end = Transfer(second, a, c, id);
      staging_.push(end);
    }
    return end;
  }

  // A write-back ends once its commit (the store's syncs) follows its bytes: a wait, not the disk's
  // time (concurrent write-backs' syncs overlap; the file system commits them together).
  double Commit(double written) const { return written + lanes_.nvme_commit_s; }

  // Every lane's intervals ending before `t` (the trainer's time) are forgotten.
  void Forget(double t) {
    for (Track* track : {&gpu_, &cpu_, &down_, &up_, &disk_, &comm_}) track->Forget(t);
  }

  // The trainer waited `seconds` on `lane`.
  void Wait(Lane lane, double seconds) {
    if (reporting_) waits_[lane] += seconds;
  }

  // The reported step, from `start` to `now`: each lane's bytes, waits, busy time and timeline.
  void Report(double start, double now, Prediction* out) {
    for (int l = 0; l < kLaneCount; ++l) {
      out->bytes[l] = moved_[l];
      out->waits_s[l] = waits_[l];
    }
    std::sort(spans_.begin(), spans_.end(), [](const auto& a, const auto& b) {
      return a.lane != b.lane ? a.lane < b.lane : a.start < b.start;
    });
    for (const Prediction::Span& s : spans_) {
      out->busy_s[s.lane] += std::max(0.0, std::min(s.end, now) - std::max(s.start, start));
      Prediction::Span rel{s.lane, s.start - start, s.end - start, s.id};
      if (!out->timeline.empty() && out->timeline.back().lane == rel.lane &&
          out->timeline.back().id == rel.id &&
          std::abs(out->timeline.back().end - rel.start) < 1e-12) {
        out->timeline.back().end = rel.end;  // chunks of one move, back to back
      } else {
        out->timeline.push_back(rel);
      }
    }
  }

 private:
  Track& TrackOf(Lane lane) {
    switch (lane) {
      case kGpu:
        return gpu_;
      case kCpu:
        return cpu_;
      case kToDevice:
        return down_;
      case kToHost:
        return lanes_.link_duplex ? up_ : down_;
      case kComm:
        return lanes_.comm_shares_cores ? gpu_ : comm_;
      case kNvmeRead:
      case kNvmeWrite:
      case kLaneCount:
        break;
    }
    return disk_;
  }

  double Rate(Lane lane) const {
    switch (lane) {
      case kToDevice:
        return lanes_.to_device;
      case kToHost:
        return lanes_.to_host;
      case kNvmeRead:
        return lanes_.nvme_read;
      case kNvmeWrite:
        return lanes_.nvme_write;
      default:
        return 1;
    }
  }

  const Lanes lanes_;
  Track gpu_, cpu_, down_, up_, disk_, comm_;
  std::priority_queue<double, std::vector<double>, std::greater<>> staging_;
  bool reporting_ = false;
  std::vector<Prediction::Span> spans_;
  std::array<double, kLaneCount> moved_{}, waits_{};
};

struct Copy {
  bool valid = false;
  bool dirty = false;     // newer than the home's copy (the home's is stale)
  double ready = 0;       // its bytes are all there
  Lane cause = kGpu;      // the lane of the move that delivered it, or of the room it waited for
  double busy_until = 0;  // in use by a group (kInf while its group acquires)
  double last_use = 0;
  double read_until = 0;  // the end of the last move reading it: its room is not free before
  Lane read_by = kGpu;    // that move's lane
  double room_from = 0;   // when its room (outside its home) was granted
};

struct Part {
  std::array<Copy, tiering::kTierCount> at;
  bool fresh = false;  // discarded: its next access makes zeros in its tier
};

struct Pending {
  double at;
  uint64_t bytes;
  Lane cause;
  bool operator>(const Pending& o) const { return at > o.at; }
};

struct Room {
  uint64_t budget = 0, held = 0;  // held: copies there or arriving, and room still being vacated
  std::priority_queue<Pending, std::vector<Pending>, std::greater<>> vacating;
  uint64_t vacating_bytes = 0;

  void Vacate(const Pending& p) {
    vacating.push(p);
    vacating_bytes += p.bytes;
  }
  Pending Reclaim() {
    const Pending p = vacating.top();
    vacating.pop();
    vacating_bytes -= p.bytes;
    held -= p.bytes;
    return p;
  }
};

// When a group's bytes are all there, and the lane of what it waited on last.
struct Arrival {
  double at;
  Lane cause;
};

class Replay {
 public:
  Replay(const StepTrace& trace, const Lanes& lanes, const Budgets& budgets,
         const SchedulerConfig& config)
      : trace_(trace),
        worker_count_(lanes.workers),
        clock_(lanes),
        scheduler_(config),
        parts_(trace.partitions.size()) {
    room_[I(Tier::kDevice)].budget = budgets.device;
    room_[I(Tier::kHost)].budget = budgets.host;
    for (size_t id = 0; id < parts_.size(); ++id) {
      Copy& home = parts_[id].at[I(trace.home[id])];
      home.valid = true;
    }
    for (int i = 0; i < worker_count_; ++i) workers_.push(0.0);
    for (int i = 1; i < worker_count_; ++i) background_.push(0.0);
  }

  // Replays kSteps steps (the first records, the next are planned) and reports the last in `out`.
  absl::Status Run(Prediction* out) {
    for (int step = 0; step < kSteps; ++step) {
      const bool report = step == kSteps - 1;
      const double start = now_;
      if (report) clock_.set_reporting(true);
      STRATA_RETURN_IF_ERROR(Step());
      scheduler_.EndStep();
      if (report) {
        out->step_s = now_ - start;
        clock_.Report(start, now_, out);
        out->peak_room = {PeakRoom(Tier::kDevice), PeakRoom(Tier::kHost)};
        break;
      }
      // The reported step's first prefetches count in it.
      clock_.set_reporting(step + 1 == kSteps - 1);
      STRATA_RETURN_IF_ERROR(Prefetch(now_));  // the next step's first accesses
    }
    return absl::OkStatus();
  }

 private:
  // One step: each group acquires its partitions, computes, releases them, then sends its gradient
  // down and discards what it discards; the step ends when the trainer, the CPU optimizer and the
  // streamed partitions' write-backs are done.
  absl::Status Step() {
    double cpu_done = now_;
    double written_done = now_;  // the streamed partitions' write-backs
    for (const Group& g : trace_.groups) {
      clock_.Forget(std::min(now_, last_compute_start_));  // (a gather ahead is issued then)
      if (g.waits_for_cpu) WaitUntil(cpu_done, kCpu);
      STRATA_ASSIGN_OR_RETURN(Arrival arrival, Acquire(g));
      Gather(g, &arrival);
      const double end = Compute(g, arrival, &cpu_done);
      STRATA_RETURN_IF_ERROR(Release(g, end, &written_done));
      Scatter(g);
      if (g.gradient_ready) STRATA_RETURN_IF_ERROR(SendDown(*g.gradient_ready, end));
      if (g.discard) Discard(*g.discard, end);
    }
    WaitUntil(cpu_done, kCpu);
    WaitUntil(written_done, kNvmeWrite);
    WaitUntil(in_flight_, kComm);
    return absl::OkStatus();
  }

  // --- The collectives between the ranks, on their lane.

  // The group's gathers before it computes: each issued as its acquire began, or ahead when the
  // trainer's previous group began computing (a prefetch); the trainer first waits for the ranks'
  // agreement where one comes with it (Exchange::agree_s). `arrival` becomes when they are all
  // there too.
  void Gather(const Group& g, Arrival* arrival) {
    const PartitionId first = g.accesses.empty() ? 0 : g.accesses.front().id;
    for (const Exchange& x : g.before) {
      Agree(x);
      const double issued = x.ahead ? std::min(now_, last_compute_start_) : now_;
      const double end = clock_.Occupy(kComm, issued, x.seconds, first, x.bytes);
      if (end > arrival->at) *arrival = Arrival{end, kComm};
    }
    if (arrival->at < now_) arrival->at = now_;
  }

  // The group's reduce-scatters once it has ended (the trainer's time): each issued once the one
  // in flight ends; the trainer waits for it unless it runs ahead (then it is the one in flight).
  void Scatter(const Group& g) {
    const PartitionId first = g.accesses.empty() ? 0 : g.accesses.front().id;
    for (const Exchange& x : g.after) {
      WaitUntil(in_flight_, kComm);
      Agree(x);
      const double end = clock_.Occupy(kComm, now_, x.seconds, first, x.bytes);
      if (x.ahead) {
        in_flight_ = end;
      } else {
        WaitUntil(end, kComm);
      }
    }
  }

  // The trainer waits for the ranks to agree (Exchange::agree_s): its time, on its lane (where
  // the collectives share the cores, what comes after runs after it).
  void Agree(const Exchange& x) {
    clock_.Hold(kGpu, now_, x.agree_s);
    clock_.Wait(kComm, x.agree_s);
    now_ += x.agree_s;
  }

  // The trainer's acquires of the group's partitions, each fetched on its thread (the Runtime
  // issuing prefetches as each returns): when their bytes are all there and the lane waited on.
  absl::StatusOr<Arrival> Acquire(const Group& g) {
    // Acquire: the group's copies already there are held first, so that bringing one of its
    // partitions never evicts another.
    for (const Access& a : g.accesses) {
      Copy& c = parts_[a.id].at[I(a.tier)];
      if (c.valid) c.busy_until = kInf;
    }
    double ready = now_;
    Lane cause = kGpu;
    for (const Access& a : g.accesses) {
      // On the trainer's thread, one acquire after another: each once the last has its bytes.
      op_ = ready;
      const bool planned = scheduler_.mode() == Scheduler::Mode::kPlanned;
      scheduler_.OnAcquire(trace_.partitions[a.id], a.tier, now_);
      Copy& c = parts_[a.id].at[I(a.tier)];
      const bool there = c.valid && c.ready <= op_;
      const bool zeros = !c.valid && parts_[a.id].fresh;
      STRATA_ASSIGN_OR_RETURN(const bool fetched, Fetch(a.id, a.tier, std::nullopt));
      (void)fetched;
      c.busy_until = kInf;
      if (c.ready > ready) {
        ready = c.ready;
        cause = c.cause;
      }
      if (c.read_until > ready) {  // as the Runtime's: a move still reading the copy ends first
        ready = c.read_until;
        cause = c.read_by;
      }
      if (planned && !there && !zeros && !g.on_cpu) scheduler_.OnLateOrMiss();
      STRATA_RETURN_IF_ERROR(Prefetch(ready));  // the Runtime issues them as the acquire returns
    }
    return Arrival{ready, cause};
  }

  // The group's computation once its bytes are there: on the GPU the trainer waits for it (its
  // wait for the bytes counted); on the CPU lane it does not, and the step's end waits for
  // `cpu_done`. Returns its end.
  double Compute(const Group& g, const Arrival& arrival, double* cpu_done) {
    const PartitionId first = g.accesses.empty() ? 0 : g.accesses.front().id;
    const double end = clock_.Occupy(g.on_cpu ? kCpu : kGpu, arrival.at, g.compute_s, first);
    if (g.on_cpu) {
      *cpu_done = std::max(*cpu_done, end);
    } else {
      clock_.Wait(arrival.cause, arrival.at - now_);
      last_compute_start_ = end - g.compute_s;
      now_ = end;
    }
    return end;
  }

  // The group's releases at `end`: its writes, a streamed partition written back and dropped (the
  // step's end waits for `written_done`), a host copy released dirty perhaps written back early.
  absl::Status Release(const Group& g, double end, double* written_done) {
    for (const Access& a : g.accesses) {
      Copy& c = parts_[a.id].at[I(a.tier)];
      c.busy_until = end;
      c.last_use = end;
      if (a.dirty) Write(a.id, a.tier, end);
      scheduler_.OnRelease(trace_.partitions[a.id], a.tier, a.dirty, end);
      if (trace_.Streamed(a.id) && a.tier != Tier::kNvme) {
        // Written back to NVMe (when dirtied) and not kept; the step's commit waits for the
        // write, as the optimizer's does.
        Drop(a.id, a.tier, end);
        *written_done = std::max(*written_done, parts_[a.id].at[I(Tier::kNvme)].ready);
      } else if (a.dirty && a.tier == Tier::kHost) {
        STRATA_RETURN_IF_ERROR(WriteBackEarly(a.id, end));
      }
    }
    return absl::OkStatus();
  }

  // The trainer waits at the step's end until `done`, on `lane`.
  void WaitUntil(double done, Lane lane) {
    if (done > now_) {
      clock_.Wait(lane, done - now_);
      now_ = done;
    }
  }

  // --- The scheduler's prefetches, on the Runtime's workers.

  // Prefetches along the plan, as the Runtime issues them after each acquire and at the end of a
  // step: each of the window's partitions on its own, as its workers run them. One with no room on
  // the device yet is staged in the host (read from NVMe now, brought up when room comes), unless
  // a memory tier has it.
  absl::Status Prefetch(double issued) {
    const std::vector<Scheduler::Upcoming> window = scheduler_.Window();
    for (size_t i = 0; i < window.size(); ++i) {
      const Scheduler::Upcoming& u = window[i];
      Part& p = parts_[u.id];
      if (p.fresh || p.at[I(u.tier)].valid) continue;
      bool tight = false;
      STRATA_RETURN_IF_ERROR(OnWorker(issued, [&]() -> absl::StatusOr<std::optional<double>> {
        STRATA_ASSIGN_OR_RETURN(const bool room, Fetch(u.id, u.tier, i));
        if (room) return p.at[I(u.tier)].ready;
        tight = true;
        if (u.tier != Tier::kDevice || p.at[I(Tier::kHost)].valid) return std::nullopt;
        STRATA_ASSIGN_OR_RETURN(const bool staged, Fetch(u.id, Tier::kHost, i));
        if (!staged) return std::nullopt;
        return p.at[I(Tier::kHost)].ready;
      }));
      if (tight) scheduler_.OnBudgetTight(i);
    }
    return absl::OkStatus();
  }

  // Work on one of the Runtime's worker threads, issued at `issued`: runs once one is free (op_ is
  // then), holding it until `work` returns the end of what it did (or nullopt: nothing done). A
  // background job (an early write-back) runs on one of workers - 1 threads of its own (on the
  // one worker when there is only one): the Runtime runs the other jobs first and leaves them a
  // worker, which this models as if they had all of them (optimistic only while both kinds crowd
  // the workers).
  absl::Status OnWorker(double issued,
                        const std::function<absl::StatusOr<std::optional<double>>()>& work,
                        bool background = false) {
    auto& pool = background && worker_count_ > 1 ? background_ : workers_;
    op_ = std::max(issued, pool.top());
    STRATA_ASSIGN_OR_RETURN(const std::optional<double> end, work());
    if (end) {
      pool.pop();
      pool.push(std::max(*end, op_));
    }
    op_ = now_;
    return absl::OkStatus();
  }

  // --- A copy into a tier, and the room it takes under the tier's budget.

  // Brings `id` into tier `t`. A prefetch (`distance` given) returns false when there is no room
  // for it without evicting what is needed sooner; a demand fetch fails only when the partition is
  // larger than the tier's budget with everything else evicted.
  absl::StatusOr<bool> Fetch(PartitionId id, Tier t, std::optional<uint64_t> distance) {
    Part& p = parts_[id];
    Copy& dst = p.at[I(t)];
    if (dst.valid) return true;
    const Tier home = trace_.home[id];
    double room_at = op_;
    Lane room_cause = kGpu;
    if (t != home) {
      auto room = Reserve(t, trace_.partitions[id].bytes, distance);
      if (!room) {
        if (distance) return false;
        return absl::InvalidArgumentError(
            absl::StrCat(trace_.Name(id), ", ", trace_.partitions[id].bytes,
                         " bytes, does not fit the ", TierName(t), " tier's budget of ",
                         room_[I(t)].budget, " bytes with everything else evicted"));
      }
      std::tie(room_at, room_cause) = *room;
    }
    if (p.fresh) {  // zeros made in the tier: nothing read
      dst = Copy{true, false, room_at, room_cause, 0, op_};
      dst.room_from = room_at;
      return true;
    }
    const Tier from = Source(p, t, distance.has_value());
    const Copy& src = p.at[I(from)];
    if (!src.valid) {
      return absl::InternalError(absl::StrCat("partition ", id, " has no copy to read"));
    }
    const double ready = std::max(room_at, src.ready);
    auto [end, lane] = Move(id, from, t, ready);
    // What it waited on longest: room, the source's own arrival, or the move.
    Lane cause = lane;
    double longest = end - ready;
    if (room_at - op_ > longest) {
      cause = room_cause;
      longest = room_at - op_;
    }
    if (src.ready - op_ > longest) cause = src.cause;
    dst = Copy{true, src.dirty && t != home, end, cause, 0, op_};
    dst.room_from = room_at;
    if (t == home) {
      for (Copy& c : p.at) c.dirty = false;
    }
    return true;
  }

  // The tier a fetch of `p` into tier `t` reads from.
  Tier Source(const Part& p, Tier t, bool prefetch) const {
    const Copy& dev = p.at[I(Tier::kDevice)];
    const Copy& host = p.at[I(Tier::kHost)];
    const Copy& nvme = p.at[I(Tier::kNvme)];
    // As the Runtime's BringLocked: the other memory tier's copy, unless a prefetch would read a
    // copy in use there and NVMe has a current one.
    const Copy& other = t == Tier::kDevice ? host : dev;
    const bool other_in_use = other.busy_until > op_;
    return other.valid && (!prefetch || !other_in_use || !nvme.valid)
               ? (t == Tier::kDevice ? Tier::kHost : Tier::kDevice)
               : Tier::kNvme;
  }

  // Room for `bytes` in tier `t` from `op_`: the time it is free and the lane waited on, or
  // nullopt. A prefetch for an access `distance` ahead evicts only copies needed later than that.
  std::optional<std::pair<double, Lane>> Reserve(Tier t, uint64_t bytes,
                                                 std::optional<uint64_t> distance) {
    Room& r = room_[I(t)];
    // Room already free for everything modelled from now on (op_ may be later than operations
    // still to be replayed, which must not see room that frees only after their time).
    while (!r.vacating.empty() && r.vacating.top().at <= now_) r.Reclaim();
    if (bytes > r.budget) return std::nullopt;
    std::vector<Victim> victims;
    const uint64_t waitable = Waitable(r, distance);
    if (r.held + bytes > r.budget + waitable) {
      victims = Victims(t, distance);
      uint64_t could = waitable;
      for (const Victim& v : victims) could += trace_.partitions[v.id].bytes;
      if (r.held + bytes > r.budget + could) return std::nullopt;
    }
    double at = op_;
    Lane cause = kGpu;
    size_t next_victim = 0;
    while (r.held + bytes > r.budget) {
      const bool wait = !r.vacating.empty() && (!distance || r.vacating.top().at <= op_);
      if (!wait && next_victim < victims.size()) Drop(victims[next_victim++].id, t, op_);
      if (r.vacating.empty()) return std::nullopt;  // not reached: `could` counted enough
      const Pending p = r.Reclaim();
      if (p.at > at) {
        at = p.at;
        cause = p.cause;
      }
      if (p.at > now_ && r.held + bytes < r.budget) {
        // What this reservation does not need of that room is free only at its time too.
        const uint64_t spare = std::min(p.bytes, r.budget - r.held - bytes);
        r.held += spare;
        r.Vacate({p.at, spare, p.cause});
      }
    }
    r.held += bytes;
    return std::make_pair(at, cause);
  }

  // The room being vacated in `r` that a reservation may wait for: a prefetch (`distance` given)
  // never waits for another move's (the Runtime's fails and narrows the window instead), only for
  // its own victims' write-backs.
  uint64_t Waitable(const Room& r, std::optional<uint64_t> distance) const {
    uint64_t waitable = r.vacating_bytes;
    if (distance) {
      waitable = 0;
      for (auto pending = r.vacating; !pending.empty() && pending.top().at <= op_; pending.pop()) {
        waitable += pending.top().bytes;
      }
    }
    return waitable;
  }

  // A copy a reservation may evict.
  struct Victim {
    PartitionId id;
    uint64_t next;
    double last_use;
    bool dirty;
    bool later;  // its room comes only after now
  };

  // The copies in tier `t` a reservation may evict, the first to go first.
  std::vector<Victim> Victims(Tier t, std::optional<uint64_t> distance) const {
    std::vector<Victim> victims;
    for (PartitionId id = 0; id < parts_.size(); ++id) {
      if (!Evictable(id, t, !distance)) continue;
      // As the Runtime counts it: a copy in either memory tier serves an access in the other.
      // And a gradient the optimizer step reads from the host tier is needed there then.
      const uint64_t next =
          scheduler_.plans_evictions()
              ? std::min({scheduler_.NextUse(id, Tier::kDevice),
                          scheduler_.NextUse(id, Tier::kHost),
                          t == Tier::kHost ? scheduler_.StepUse(id) : Scheduler::kNever})
              : 0;
      // A prefetch evicts nothing the window needs, nor anything needed before its own.
      if (distance && next <= std::max<uint64_t>(*distance, scheduler_.lookahead())) continue;
      const Copy& c = parts_[id].at[I(t)];
      victims.push_back(
          {id, next, c.last_use, c.dirty, std::max({c.ready, c.busy_until, c.read_until}) > op_});
    }
    std::sort(victims.begin(), victims.end(), [&](const Victim& a, const Victim& b) {
      if (a.later != b.later) return !a.later;  // room now before room later
      if (scheduler_.plans_evictions()) {
        if (a.next != b.next) return a.next > b.next;  // needed furthest ahead first
        if (a.dirty != b.dirty) return !a.dirty;       // clean before dirty
      }
      return a.last_use < b.last_use;  // least recently used first
    });
    return victims;
  }

  // Whether a copy of `id` in tier `t` may be evicted to make room: for a prefetch, one there and
  // not in use now; for a demand fetch also one arriving or in use by a group still to run (its
  // room comes once that ends: the fetch waits for it, as the CPU optimizer's queue waits for
  // room), but never one the acquiring group holds.
  bool Evictable(PartitionId id, Tier t, bool demand) const {
    const Copy& c = parts_[id].at[I(t)];
    if (!c.valid || trace_.home[id] == t) return false;
    return demand ? c.busy_until != kInf
                  : c.ready <= op_ && c.busy_until <= op_ && c.read_until <= op_;
  }

  // A copy leaves tier `t` (its room is free again at `at`, once the moves reading it end, or once
  // its write-back ends).
  void Drop(PartitionId id, Tier t, double at) {
    Part& p = parts_[id];
    Copy& c = p.at[I(t)];
    if (!c.valid) return;
    const Tier home = trace_.home[id];
    double free_at = std::max({at, c.ready, c.busy_until, c.read_until});
    Lane cause = c.cause;
    if (c.dirty && t != home) {
      // The only newer bytes? Another newer copy in the other memory tier keeps them.
      bool kept = false;
      for (Tier u : {Tier::kDevice, Tier::kHost}) {
        if (u != t && u != home && p.at[I(u)].valid && p.at[I(u)].dirty) kept = true;
      }
      if (!kept) {
        auto [end, lane] = Move(id, t, home, free_at);
        Copy& h = p.at[I(home)];
        h.valid = true;
        h.dirty = false;
        h.ready = end;
        h.cause = lane;
        free_at = end;
        cause = lane;
      }
    }
    if (t != home) {
      room_[I(t)].Vacate({free_at, trace_.partitions[id].bytes, cause});
      Occupied(t, c.room_from, free_at, trace_.partitions[id].bytes);
    }
    c = Copy{};
  }

  // A copy's room in tier `t` from `from` to `to`.
  void Occupied(Tier t, double from, double to, uint64_t bytes) {
    auto& events = occupied_[I(t)];
    events.push_back({from, static_cast<double>(bytes)});
    events.push_back({to, -static_cast<double>(bytes)});
  }

  // The most room in use at any instant (a room freed at T is reusable at T).
  uint64_t PeakRoom(Tier t) {
    for (PartitionId id = 0; id < parts_.size(); ++id) {
      const Copy& c = parts_[id].at[I(t)];
      if (c.valid && trace_.home[id] != t) {
        Occupied(t, c.room_from, kInf, trace_.partitions[id].bytes);
      }
    }
    auto events = occupied_[I(t)];
    std::sort(events.begin(), events.end());  // at one instant, frees before grants
    double in_use = 0, peak = 0;
    for (const auto& [at, delta] : events) {
      in_use += delta;
      peak = std::max(peak, in_use);
    }
    return static_cast<uint64_t>(peak + 0.5);
  }

  // --- Moves between tiers, on the lanes.

  // Moves `id`'s bytes from tier `from` to `to`, starting no earlier than `ready`: returns the end
  // and the lane that finished last.
  // The source copy is read until that end.
  std::pair<double, Lane> Move(PartitionId id, Tier from, Tier to, double ready) {
    const std::pair<double, Lane> done = Carry(id, from, to, ready);
    Copy& src = parts_[id].at[I(from)];
    if (done.first > src.read_until) {
      src.read_until = done.first;
      src.read_by = done.second;
    }
    return done;
  }
  // The lanes a move from tier `from` to `to` takes: over the link, to or from the disk, or through
  // the staging buffers between the disk and the device; a write to the disk ends with its commit.
  std::pair<double, Lane> Carry(PartitionId id, Tier from, Tier to, double ready) {
    const double bytes = static_cast<double>(trace_.partitions[id].bytes);
    if (from == Tier::kHost && to == Tier::kDevice) {
      return {clock_.Transfer(kToDevice, ready, bytes, id), kToDevice};
    }
    if (from == Tier::kDevice && to == Tier::kHost) {
      return {clock_.Transfer(kToHost, ready, bytes, id), kToHost};
    }
    if (from == Tier::kNvme && to == Tier::kHost) {
      return {clock_.Transfer(kNvmeRead, ready, bytes, id), kNvmeRead};
    }
    if (from == Tier::kHost && to == Tier::kNvme) {
      return {clock_.Commit(clock_.Transfer(kNvmeWrite, ready, bytes, id)), kNvmeWrite};
    }
    if (from == Tier::kNvme && to == Tier::kDevice) {
      return {clock_.Staged(kNvmeRead, kToDevice, ready, bytes, id), kToDevice};
    }
    // device -> NVMe
    return {clock_.Commit(clock_.Staged(kToHost, kNvmeWrite, ready, bytes, id)), kNvmeWrite};
  }

  // --- What a group's accesses do to the other copies: its writes and its discard.

  // The group's dirty accesses leave the other tiers' copies stale.
  void Write(PartitionId id, Tier t, double at) {
    Part& p = parts_[id];
    p.fresh = false;
    const Tier home = trace_.home[id];
    for (Tier u : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
      if (u == t || !p.at[I(u)].valid) continue;
      if (u == home) {
        p.at[I(u)].valid = false;
      } else {
        p.at[I(u)].dirty = false;  // stale: dropped without a write-back
        Drop(id, u, at);
      }
    }
    Copy& c = p.at[I(t)];
    c.dirty = t != home;
    c.ready = std::max(c.ready, at);
  }

  // A discarded partition: every copy goes without a write-back; its next access makes zeros.
  void Discard(PartitionId id, double at) {
    scheduler_.OnDiscard(id);
    Part& p = parts_[id];
    const Tier home = trace_.home[id];
    for (Tier u : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
      p.at[I(u)].dirty = false;
      if (u == home) {
        p.at[I(u)].valid = false;
      } else {
        Drop(id, u, at);
      }
    }
    p.fresh = true;
  }

  // --- Write-backs on the workers: the gradient's and the early one.

  // GradientReady, as the Runtime does it: unless the plan needs the device copy again within the
  // lookahead, it leaves the device; when it is the only current copy it goes to the host first
  // (to NVMe, its home, when the host has no room), and a copy the host already holds just goes.
  absl::Status SendDown(PartitionId id, double at) {
    Part& p = parts_[id];
    Copy& dev = p.at[I(Tier::kDevice)];
    const Tier home = trace_.home[id];
    if (!dev.valid || home == Tier::kDevice) return absl::OkStatus();
    if (scheduler_.NextUse(id, Tier::kDevice) <= static_cast<uint64_t>(scheduler_.lookahead())) {
      return absl::OkStatus();  // needed on the device again soon
    }
    return OnWorker(at, [&]() -> absl::StatusOr<std::optional<double>> {
      Copy& host = p.at[I(Tier::kHost)];
      double end = op_;
      if (dev.dirty && home != Tier::kHost && !host.valid) {
        // The Runtime's eviction for it (Purpose::kEvict) evicts by the plan, the window
        // included, and waits for moves in flight: a demand's rules.
        auto room = Reserve(Tier::kHost, trace_.partitions[id].bytes, std::nullopt);
        if (room) {
          end = Move(id, Tier::kDevice, Tier::kHost, std::max(op_, room->first)).first;
          host = Copy{true, true, end, kToHost, 0, op_};
          host.room_from = room->first;
          dev.dirty = false;
        }
      } else if (host.valid) {
        dev.dirty = false;  // the host's copy has the same bytes
      }
      const bool writes_back = dev.dirty;
      Drop(id, Tier::kDevice, op_);  // writes it back to its home unless another copy has it
      if (writes_back) end = p.at[I(home)].ready;
      return end;
    });
  }

  // The Runtime's early write-back: a host copy released dirty that the host tier will not keep
  // until its next use (the plan says so) goes down to NVMe, its home, on a worker at once and
  // stays, clean; its eviction later is a drop.
  absl::Status WriteBackEarly(PartitionId id, double at) {
    if (!scheduler_.plans_evictions() || trace_.home[id] != Tier::kNvme) return absl::OkStatus();
    auto resident = [this](PartitionId other) { return parts_[other].at[I(Tier::kHost)].valid; };
    if (!scheduler_.EvictedBeforeNextUse(id, room_[I(Tier::kHost)].budget, resident)) {
      return absl::OkStatus();
    }
    return OnWorker(
        at,
        [&]() -> absl::StatusOr<std::optional<double>> {
          Part& p = parts_[id];
          Copy& host = p.at[I(Tier::kHost)];
          // As the Runtime's: only while the host's is the only current copy and no group holds it.
          if (!host.valid || !host.dirty || p.at[I(Tier::kDevice)].valid || host.busy_until > op_) {
            return std::nullopt;
          }
          const double end = Move(id, Tier::kHost, Tier::kNvme, std::max(op_, host.ready)).first;
          Copy& nvme = p.at[I(Tier::kNvme)];
          nvme.valid = true;
          nvme.ready = end;
          nvme.cause = kNvmeWrite;
          host.dirty = false;
          return end;
        },
        /*background=*/true);
  }

  const StepTrace& trace_;
  const int worker_count_;  // the Runtime's worker threads
  LaneClock clock_;
  Scheduler scheduler_;
  std::vector<Part> parts_;
  std::array<Room, 2> room_;  // device, host
  double now_ = 0;
  double last_compute_start_ = 0;  // the trainer's last group began computing then
  double in_flight_ = 0;           // the last reduce-scatter issued ahead ends then
  double op_ = 0;  // when the fetch or eviction being modelled runs: now_ on the trainer, else
                   // when a worker takes it
  std::priority_queue<double, std::vector<double>, std::greater<>> workers_;     // each free at
  std::priority_queue<double, std::vector<double>, std::greater<>> background_;  // their own
  std::array<std::vector<std::pair<double, double>>, 2> occupied_;               // (time, +-bytes)
};

}  // namespace

absl::Status ReplaySteps(const StepTrace& trace, const Lanes& lanes, const Budgets& budgets,
                         const SchedulerConfig& config, Prediction* out) {
  Replay replay(trace, lanes, budgets, config);
  return replay.Run(out);
}

}  // namespace strata::plan::internal
