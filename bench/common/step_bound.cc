#include "bench/common/step_bound.h"

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace strata::bench {

std::vector<Access> Accesses(const std::vector<Group>& step) {
  std::vector<Access> a;
  for (const Group& g : step) {
    a.insert(a.end(), g.accesses.begin(), g.accesses.end());
    if (g.discard) a.push_back({*g.discard, Tier::kNvme, false, true});
  }
  return a;
}

Traffic Belady(Sizes bytes, const std::vector<Access>& step, uint64_t budget) {
  std::vector<Access> seq = step;
  seq.insert(seq.end(), step.begin(), step.end());
  seq.insert(seq.end(), step.begin(), step.end());  // next uses of the second pass
  auto page = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  struct Held {
    bool dirty = false;
  };
  absl::flat_hash_map<PartitionId, Held> held;
  absl::flat_hash_set<PartitionId> discarded;
  uint64_t used = 0;
  Traffic t;
  const size_t n = step.size();
  for (size_t i = 0; i < 2 * n; ++i) {
    const Access& x = seq[i];
    const bool count = i >= n;
    if (x.discard) {
      if (auto it = held.find(x.id); it != held.end()) {
        used -= page(bytes(x.id));
        held.erase(it);
      }
      discarded.insert(x.id);
      continue;
    }
    if (!held.contains(x.id)) {
      while (used + page(bytes(x.id)) > budget && !held.empty()) {
        PartitionId victim = 0;
        size_t furthest = 0;
        for (const auto& [id, h] : held) {
          size_t next = i + 1;
          while (next < seq.size() && seq[next].id != id) ++next;
          if (next < seq.size() && seq[next].discard) next = seq.size();  // needed never again
          if (next >= furthest) {
            furthest = next;
            victim = id;
          }
        }
        size_t next = i + 1;
        while (next < seq.size() && seq[next].id != victim) ++next;
        const bool dead = next < seq.size() && seq[next].discard;
        if (held[victim].dirty && !dead && count) t.written += bytes(victim);
        used -= page(bytes(victim));
        held.erase(victim);
      }
      held[x.id];
      used += page(bytes(x.id));
      if (count && !discarded.contains(x.id)) t.loaded += bytes(x.id);
    }
    discarded.erase(x.id);
    if (x.dirty) held[x.id].dirty = true;
  }
  return t;
}

std::array<PhaseNeeds, kPhaseCount> PhaseLowerBounds(Sizes bytes, const std::vector<Group>& step,
                                                     uint64_t device_budget,
                                                     uint64_t memory_budget) {
  // Without bytes at the step's start: discarded, and not accessed again by the step's end.
  absl::flat_hash_set<PartitionId> fresh;
  for (const Access& a : Accesses(step)) {
    if (a.discard) {
      fresh.insert(a.id);
    } else {
      fresh.erase(a.id);
    }
  }
  std::array<PhaseNeeds, kPhaseCount> needs;
  struct Sets {
    absl::flat_hash_set<PartitionId> read, dirtied, read_on_device, dirtied_on_device;
  };
  std::array<Sets, kPhaseCount> sets;
  for (const Group& g : step) {
    needs[g.phase].compute_s += g.compute_s;
    Sets& p = sets[g.phase];
    for (const Access& a : g.accesses) {
      const bool has_bytes = !fresh.contains(a.id);
      fresh.erase(a.id);
      if (has_bytes && !p.dirtied.contains(a.id)) p.read.insert(a.id);
      if (a.dirty) p.dirtied.insert(a.id);
      if (a.tier == Tier::kDevice) {
        if (has_bytes && !p.dirtied.contains(a.id)) p.read_on_device.insert(a.id);
        if (a.dirty) p.dirtied_on_device.insert(a.id);
      }
    }
    if (g.discard) {
      fresh.insert(*g.discard);
      p.dirtied.erase(*g.discard);
      p.dirtied_on_device.erase(*g.discard);
    }
  }
  auto beyond = [&](const absl::flat_hash_set<PartitionId>& ids, uint64_t budget) {
    uint64_t total = 0;
    for (PartitionId id : ids) total += bytes(id);
    return total > budget ? total - budget : 0;
  };
  for (int p = 0; p < kPhaseCount; ++p) {
    needs[p].disk = {beyond(sets[p].read, memory_budget), beyond(sets[p].dirtied, memory_budget)};
    needs[p].link = {beyond(sets[p].read_on_device, device_budget),
                     beyond(sets[p].dirtied_on_device, device_budget)};
  }
  return needs;
}

}  // namespace strata::bench
