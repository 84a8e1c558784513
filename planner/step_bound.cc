#include "planner/step_bound.h"

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace strata::plan {

double Group::comm_s() const {
  double s = 0;
  for (const auto* run : {&before, &after}) {
    for (const Exchange& x : *run) s += x.seconds;
  }
  return s;
}

double Group::agree_s() const {
  double s = 0;
  for (const auto* run : {&before, &after}) {
    for (const Exchange& x : *run) s += x.agree_s;
  }
  return s;
}

std::vector<Access> Accesses(const std::vector<Group>& step) {
  std::vector<Access> a;
  for (const Group& g : step) {
    a.insert(a.end(), g.accesses.begin(), g.accesses.end());
    if (g.discard) a.push_back({*g.discard, Tier::kNvme, false, true});
  }
  return a;
}

Traffic Belady(Sizes bytes, const std::vector<Access>& step, uint64_t budget,
               std::optional<Tier> tier) {
  std::vector<Access> seq = step;
  seq.insert(seq.end(), step.begin(), step.end());
  seq.insert(seq.end(), step.begin(), step.end());  // next uses of the second pass
  auto page = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  auto here = [&](const Access& a) { return !tier || a.tier == *tier; };
  // The next access in this memory that needs the copy, or seq.size(): never (a discard, or a
  // write elsewhere that leaves it stale, comes first).
  auto next_use = [&](PartitionId id, size_t i) {
    for (size_t k = i + 1; k < seq.size(); ++k) {
      const Access& a = seq[k];
      if (a.id != id) continue;
      if (a.discard || (!here(a) && a.dirty)) return seq.size();
      if (here(a)) return k;
    }
    return seq.size();
  };
  // Whether the copy's bytes are dropped before anything reads them again (a discard comes first).
  auto dead = [&](PartitionId id, size_t i) {
    for (size_t k = i + 1; k < seq.size(); ++k) {
      if (seq[k].id == id) return seq[k].discard;
    }
    return true;
  };
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
    if (!here(x)) {
      // An access in another memory: a dirty copy here crosses to it first, and a write there
      // leaves this copy stale.
      if (auto it = held.find(x.id); it != held.end()) {
        if (it->second.dirty && count) t.written += bytes(x.id);
        it->second.dirty = false;
        if (x.dirty) {
          used -= page(bytes(x.id));
          held.erase(it);
        }
      }
      discarded.erase(x.id);
      continue;
    }
    if (!held.contains(x.id)) {
      while (used + page(bytes(x.id)) > budget && !held.empty()) {
        PartitionId victim = 0;
        size_t furthest = 0;
        for (const auto& [id, h] : held) {
          const size_t next = next_use(id, i);
          if (next >= furthest) {
            furthest = next;
            victim = id;
          }
        }
        if (held[victim].dirty && !dead(victim, i) && count) t.written += bytes(victim);
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
    (g.on_cpu ? needs[g.phase].cpu_s : needs[g.phase].compute_s) += g.compute_s;
    needs[g.phase].comm_s += g.comm_s();
    needs[g.phase].agree_s += g.agree_s();
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

}  // namespace strata::plan
