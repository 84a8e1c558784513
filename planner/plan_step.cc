#include "planner/plan_step.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "planner/replay_internal.h"

namespace strata::plan {
namespace {

absl::Status Check(const StepTrace& t, const Lanes& lanes) {
  if (t.home.size() != t.partitions.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the trace has ", t.partitions.size(),
                                                   " partitions but ", t.home.size(), " homes"));
  }
  for (size_t i = 0; i < t.partitions.size(); ++i) {
    if (t.partitions[i].id != i) {
      return absl::InvalidArgumentError(
          absl::StrCat("partition ", i, " has id ", t.partitions[i].id, "; ids are their indices"));
    }
  }
  if (!t.streamed.empty() && t.streamed.size() != t.partitions.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the trace has ", t.partitions.size(), " partitions but ", t.streamed.size(),
                     " streamed flags (accepted: none, or one each)"));
  }
  for (size_t i = 0; i < t.streamed.size(); ++i) {
    if (t.streamed[i] && t.home[i] != Tier::kNvme) {
      return absl::InvalidArgumentError(
          absl::StrCat(t.Name(i), " is streamed but homed in the ", TierName(t.home[i]),
                       " tier; accepted: streamed partitions homed on NVMe"));
    }
  }
  bool device = false, nvme = false;
  for (const Group& g : t.groups) {
    for (size_t i = 0; i < g.accesses.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (g.accesses[i].id == g.accesses[j].id) {
          return absl::InvalidArgumentError(
              absl::StrCat("a group accesses partition ", g.accesses[i].id,
                           " twice; a group holds each partition once, in one tier"));
        }
      }
    }
    for (const Access& a : g.accesses) {
      if (a.discard) {
        return absl::InvalidArgumentError(
            "an access marked as a discard: a group discards through Group::discard");
      }
      if (a.id >= t.partitions.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("an access names partition ", a.id, " of ", t.partitions.size()));
      }
      if (a.tier == Tier::kNvme) {
        return absl::InvalidArgumentError(
            "an access in the NVMe tier: the trainer acquires "
            "partitions in the device or host tier");
      }
      // The link: a partition acquired on the device but homed elsewhere, or the reverse.
      device = device || (t.home[a.id] == Tier::kDevice) != (a.tier == Tier::kDevice);
      nvme = nvme || t.home[a.id] == Tier::kNvme;
    }
    if (g.on_cpu && (!g.before.empty() || !g.after.empty() || g.waits_for_cpu)) {
      return absl::InvalidArgumentError(
          "a group on the CPU optimizer's threads with collectives or a wait for the CPU; "
          "accepted: those on the trainer's groups only");
    }
    for (const auto* run : {&g.before, &g.after}) {
      for (const Exchange& x : *run) {
        if (!(x.seconds >= 0) || !(x.bytes >= 0) || !(x.agree_s >= 0) || x.count < 1 ||
            std::isinf(x.seconds) || std::isinf(x.agree_s)) {
          return absl::InvalidArgumentError(
              absl::StrCat("a collective of ", x.seconds, " s, ", x.bytes, " bytes, ", x.count,
                           " collectives, ", x.agree_s,
                           " s to agree; accepted: finite, not negative, at "
                           "least one collective"));
        }
      }
    }
    for (const auto& id : {g.gradient_ready, g.discard}) {
      if (id && *id >= t.partitions.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("a group names partition ", *id, " of ", t.partitions.size()));
      }
    }
  }
  if (device && (lanes.to_device <= 0 || lanes.to_host <= 0)) {
    return absl::InvalidArgumentError(
        "the trace moves partitions between tiers but the link's "
        "bandwidth is not positive");
  }
  if (nvme && (lanes.nvme_read <= 0 || lanes.nvme_write <= 0)) {
    return absl::InvalidArgumentError(
        "the trace has partitions on NVMe but the disk's bandwidth is not positive");
  }
  if (!(lanes.nvme_commit_s >= 0) || std::isinf(lanes.nvme_commit_s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the disk's commit time per write-back: ", lanes.nvme_commit_s, " s; accepted: 0 or more"));
  }
  if (lanes.staging_count < 1 || lanes.staging_bytes == 0) {
    return absl::InvalidArgumentError("the staging buffers: at least one, of at least one byte");
  }
  if (lanes.workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the runtime's workers: ", lanes.workers, "; at least one"));
  }
  return absl::OkStatus();
}

// The groups with only the accesses `keep` allows (their compute, phases and discards kept).
std::vector<Group> Filtered(const std::vector<Group>& groups,
                            const std::function<bool(PartitionId)>& keep) {
  std::vector<Group> out = groups;
  for (Group& g : out) {
    std::erase_if(g.accesses, [&](const Access& a) { return !keep(a.id); });
    if (g.discard && !keep(*g.discard)) g.discard.reset();
  }
  return out;
}

}  // namespace

std::string StepTrace::Name(PartitionId id) const {
  if (id < names.size() && !names[id].empty())
    return absl::StrCat("partition ", id, " (", names[id], ")");
  return absl::StrCat("partition ", id);
}

const char* LaneName(Lane lane) {
  static constexpr const char* kNames[] = {"gpu",          "cpu optimizer", "pcie to device",
                                           "pcie to host", "nvme read",     "nvme write",
                                           "collectives"};
  return lane >= 0 && lane < kLaneCount ? kNames[lane] : "?";
}

double Lanes::LinkSeconds(double down, double up) const {
  return link_duplex ? std::max(down / to_device, up / to_host) : down / to_device + up / to_host;
}

double Lanes::DiskSeconds(double read, double written) const {
  return (read > 0 ? read / nvme_read : 0) + (written > 0 ? written / nvme_write : 0);
}

Bound StepLowerBound(const StepTrace& t, const Lanes& lanes, const Budgets& budgets) {
  auto bytes = [&t](PartitionId id) { return t.partitions[id].bytes; };
  const std::vector<Group> linked =
      Filtered(t.groups, [&](PartitionId id) { return t.home[id] != Tier::kDevice; });
  const std::vector<Group> on_disk = Filtered(
      t.groups, [&](PartitionId id) { return t.home[id] == Tier::kNvme && !t.Streamed(id); });
  const uint64_t memory = budgets.device + budgets.host;
  Bound b;
  b.link = Belady(bytes, Accesses(linked), budgets.device, Tier::kDevice);
  b.disk = Belady(bytes, Accesses(on_disk), memory);
  // A streamed partition crosses the disk at each access, whatever room there is: read before
  // its group and, dirtied, written after it (counted in the phase of the access).
  std::array<Traffic, kPhaseCount> streamed{};
  for (const Group& g : t.groups) {
    for (const Access& a : g.accesses) {
      if (!t.Streamed(a.id)) continue;
      streamed[g.phase].loaded += bytes(a.id);
      if (a.dirty) streamed[g.phase].written += bytes(a.id);
    }
  }
  for (const Traffic& x : streamed) {
    b.disk.loaded += x.loaded;
    b.disk.written += x.written;
  }
  for (const Group& g : t.groups) {
    (g.on_cpu ? b.cpu_s : b.compute_s) += g.compute_s;
    b.comm_s += g.comm_s();
    b.agree_s += g.agree_s();
  }
  auto link_s = [&](const Traffic& x) {
    return x.loaded + x.written > 0 ? lanes.LinkSeconds(x.loaded, x.written) : 0.0;
  };
  // The trainer's compute (and its agreeing on collectives) and the collectives, on their lanes:
  // one lane where they share the cores.
  auto trainer_s = [&](double compute, double agree, double comm) {
    return lanes.comm_shares_cores ? std::pair{compute + agree + comm, 0.0}
                                   : std::pair{compute + agree, comm};
  };
  const auto [compute_s, comm_s] = trainer_s(b.compute_s, b.agree_s, b.comm_s);
  const std::pair<double, Lane> terms[] = {
      {compute_s, kGpu},
      {b.cpu_s, kCpu},
      {link_s(b.link), kToDevice},
      {lanes.DiskSeconds(b.disk.loaded, b.disk.written), kNvmeRead},
      {comm_s, kComm}};
  for (const auto& [seconds, lane] : terms) {
    if (seconds > b.whole_s) {
      b.whole_s = seconds;
      b.limit = lane;
    }
  }
  const auto link_phases = PhaseLowerBounds(bytes, linked, budgets.device, memory);
  const auto disk_phases = PhaseLowerBounds(bytes, on_disk, budgets.device, memory);
  for (int p = 0; p < kPhaseCount; ++p) {
    b.phases[p] = link_phases[p];
    b.phases[p].disk = disk_phases[p].disk;
    b.phases[p].disk.loaded += streamed[p].loaded;
    b.phases[p].disk.written += streamed[p].written;
    const auto [phase_compute_s, phase_comm_s] =
        trainer_s(b.phases[p].compute_s, b.phases[p].agree_s, b.phases[p].comm_s);
    b.by_phase_s += std::max({phase_compute_s, b.phases[p].cpu_s, link_s(b.phases[p].link),
                              lanes.DiskSeconds(b.phases[p].disk.loaded, b.phases[p].disk.written),
                              phase_comm_s});
  }
  return b;
}

absl::StatusOr<Prediction> PredictStep(const StepTrace& trace, const Lanes& lanes,
                                       const Budgets& budgets, const SchedulerConfig& scheduler) {
  STRATA_RETURN_IF_ERROR(Check(trace, lanes));
  Prediction out;
  STRATA_RETURN_IF_ERROR(internal::ReplaySteps(trace, lanes, budgets, scheduler, &out));
  out.bound = StepLowerBound(trace, lanes, budgets);
  return out;
}

}  // namespace strata::plan
