#include "tiering/residency.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace strata::tiering {
namespace {

int I(Tier t) { return static_cast<int>(t); }

#ifndef NDEBUG
constexpr bool kCheckEveryChange = true;
#else
constexpr bool kCheckEveryChange = false;
#endif

absl::Status Refuse(PartitionId id, absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat("partition ", id, ": ", what));
}

}  // namespace

absl::string_view TierName(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

absl::string_view RoleName(Role r) {
  switch (r) {
    case Role::kParam:
      return "param";
    case Role::kGrad:
      return "grad";
    case Role::kMaster:
      return "master";
    case Role::kExpAvg:
      return "exp_avg";
    case Role::kExpAvgSq:
      return "exp_avg_sq";
    case Role::kOther:
      return "other";
  }
  return "?";
}

ResidencyTable::ResidencyTable(std::array<uint64_t, kTierCount> budgets_bytes,
                               uint64_t granule_bytes)
    : budgets_(budgets_bytes), granule_(std::max<uint64_t>(granule_bytes, 1)) {}

absl::StatusOr<Residency*> ResidencyTable::FindLocked(PartitionId id) {
  auto it = table_.find(id);
  if (it == table_.end())
    return absl::NotFoundError(absl::StrCat("partition ", id, ": not registered"));
  return &it->second;
}

absl::Status ResidencyTable::ReserveLocked(Tier t, const PartitionDesc& desc) {
  const uint64_t bytes = Footprint(desc);
  if (used_[I(t)] > budgets_[I(t)] || bytes > budgets_[I(t)] - used_[I(t)]) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "partition ", desc.id, ": the ", TierName(t), " tier's budget of ", budgets_[I(t)],
        " bytes has ", budgets_[I(t)] - used_[I(t)], " free, ", bytes, " needed"));
  }
  used_[I(t)] += bytes;
  peak_[I(t)] = std::max(peak_[I(t)], used_[I(t)]);
  if (desc.role == Role::kParam) param_elements_[I(t)] += desc.elements;
  return absl::OkStatus();
}

void ResidencyTable::UnreserveLocked(Tier t, const PartitionDesc& desc) {
  used_[I(t)] -= Footprint(desc);
  if (desc.role == Role::kParam) param_elements_[I(t)] -= desc.elements;
}

absl::Status ResidencyTable::Register(const PartitionDesc& desc) {
  if (desc.bytes == 0 || desc.bytes > kMaxPartitionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("partition ", desc.id, ": bytes must be in 1..",
                                                   kMaxPartitionBytes, ", got ", desc.bytes));
  }
  MutexLock lock(&mu_);
  Residency r;
  r.desc = desc;
  if (!table_.emplace(desc.id, r).second) {
    return absl::AlreadyExistsError(absl::StrCat("partition ", desc.id, ": already registered"));
  }
  return absl::OkStatus();
}

absl::Status ResidencyTable::Unregister(PartitionId id) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  const Residency& r = **found;
  if (r.move) return Refuse(id, "a move is in flight");
  for (int t = 0; t < kTierCount; ++t) {
    if (r.pins[t] > 0)
      return Refuse(id, absl::StrCat("pinned in ", TierName(static_cast<Tier>(t))));
  }
  for (int t = 0; t < kTierCount; ++t) {
    if (r.has_copy[t]) UnreserveLocked(static_cast<Tier>(t), r.desc);
  }
  table_.erase(id);
  return absl::OkStatus();
}

absl::Status ResidencyTable::Materialize(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (r.written) return Refuse(id, "already has bytes; use a move");
  if (r.has_copy[I(tier)]) return Refuse(id, "already has a copy there");
  if (absl::Status s = ReserveLocked(tier, r.desc); !s.ok()) return s;
  r.has_copy[I(tier)] = r.current[I(tier)] = true;
  r.written = true;
  if (kCheckEveryChange) return CheckLocked();
  return absl::OkStatus();
}

absl::Status ResidencyTable::BeginMove(PartitionId id, Tier from, Tier to) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (from == to) return Refuse(id, "a move needs two different tiers");
  if (r.move) {
    return Refuse(id, absl::StrCat("a move ", TierName(r.move->first), " -> ",
                                   TierName(r.move->second), " is already in flight"));
  }
  if (!r.current[I(from)]) {
    return Refuse(id, absl::StrCat("no current copy in ", TierName(from), " to move from"));
  }
  if (r.current[I(to)]) return Refuse(id, absl::StrCat("already current in ", TierName(to)));
  if (r.pins[I(to)] > 0) return Refuse(id, absl::StrCat("its ", TierName(to), " copy is pinned"));
  if (!r.has_copy[I(to)]) {
    if (absl::Status s = ReserveLocked(to, r.desc); !s.ok()) return s;
    r.has_copy[I(to)] = true;
  }
  r.move = std::make_pair(from, to);
  if (kCheckEveryChange) return CheckLocked();
  return absl::OkStatus();
}

absl::Status ResidencyTable::BeginFill(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (tier == Tier::kNvme) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition ", id, ": a fill is made in the device or host tier, not nvme"));
  }
  if (r.written) return Refuse(id, "has bytes; a fill is for a partition without (discarded)");
  if (r.move) return Refuse(id, "a move is in flight");
  if (r.has_copy[I(tier)]) return Refuse(id, "a stale copy is held there; drop it first");
  if (absl::Status s = ReserveLocked(tier, r.desc); !s.ok()) return s;
  r.has_copy[I(tier)] = true;
  r.move = std::make_pair(tier, tier);
  if (kCheckEveryChange) return CheckLocked();
  return absl::OkStatus();
}

absl::Status ResidencyTable::Discard(PartitionId id) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (r.move) return Refuse(id, "a move is in flight");
  for (int t = 0; t < kTierCount; ++t) {
    if (r.pins[t] > 0)
      return Refuse(id, absl::StrCat("pinned in ", TierName(static_cast<Tier>(t))));
  }
  r.current = {};
  r.written = false;
  if (kCheckEveryChange) return CheckLocked();
  return absl::OkStatus();
}

absl::Status ResidencyTable::EndMove(PartitionId id, bool ok) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (!r.move) return Refuse(id, "no move in flight");
  const auto [from, to] = *r.move;
  r.move.reset();
  if (ok) {
    r.current[I(to)] = true;
    r.written = true;  // a fill's first bytes (a move's partition was written already)
  } else if (!r.current[I(to)]) {
    // The destination holds nothing usable: release it; every other copy is as it was.
    r.has_copy[I(to)] = false;
    UnreserveLocked(to, r.desc);
  }
  if (kCheckEveryChange) return CheckLocked();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Tier>> ResidencyTable::MarkWritten(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (!r.current[I(tier)]) return Refuse(id, absl::StrCat("no current copy in ", TierName(tier)));
  if (r.move) return Refuse(id, "written while a move is in flight");
  std::vector<Tier> stale;
  for (int t = 0; t < kTierCount; ++t) {
    if (t == I(tier) || !r.current[t]) continue;
    if (r.pins[t] > 0) {
      return Refuse(id, absl::StrCat("its ", TierName(static_cast<Tier>(t)),
                                     " copy is pinned and would go stale"));
    }
  }
  for (int t = 0; t < kTierCount; ++t) {
    if (t != I(tier) && r.current[t]) {
      r.current[t] = false;
      stale.push_back(static_cast<Tier>(t));
    }
  }
  if (kCheckEveryChange) {
    if (absl::Status s = CheckLocked(); !s.ok()) return s;
  }
  return stale;
}

absl::Status ResidencyTable::Drop(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (!r.has_copy[I(tier)]) return Refuse(id, absl::StrCat("no copy in ", TierName(tier)));
  if (r.pins[I(tier)] > 0)
    return Refuse(id, absl::StrCat("its ", TierName(tier), " copy is pinned"));
  if (r.move && (r.move->first == tier || r.move->second == tier)) {
    return Refuse(id, absl::StrCat("a move uses its ", TierName(tier), " copy"));
  }
  if (r.only_current(tier)) {
    return Refuse(id, absl::StrCat("its ", TierName(tier),
                                   " copy is the only current one; write it back first"));
  }
  r.has_copy[I(tier)] = r.current[I(tier)] = false;
  UnreserveLocked(tier, r.desc);
  if (kCheckEveryChange) return CheckLocked();
  return absl::OkStatus();
}

absl::Status ResidencyTable::Pin(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (!r.current[I(tier)])
    return Refuse(id, absl::StrCat("no current copy in ", TierName(tier), " to pin"));
  ++r.pins[I(tier)];
  return absl::OkStatus();
}

absl::Status ResidencyTable::Unpin(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  absl::StatusOr<Residency*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Residency& r = **found;
  if (r.pins[I(tier)] == 0) return Refuse(id, absl::StrCat("not pinned in ", TierName(tier)));
  --r.pins[I(tier)];
  return absl::OkStatus();
}

absl::StatusOr<Residency> ResidencyTable::Get(PartitionId id) const {
  MutexLock lock(&mu_);
  auto it = table_.find(id);
  if (it == table_.end())
    return absl::NotFoundError(absl::StrCat("partition ", id, ": not registered"));
  return it->second;
}

uint64_t ResidencyTable::used_bytes(Tier t) const {
  MutexLock lock(&mu_);
  return used_[I(t)];
}

uint64_t ResidencyTable::peak_bytes(Tier t) const {
  MutexLock lock(&mu_);
  return peak_[I(t)];
}

absl::Status ResidencyTable::SetAside(Tier t, uint64_t bytes) {
  MutexLock lock(&mu_);
  if (used_[I(t)] > budgets_[I(t)] || bytes > budgets_[I(t)] - used_[I(t)]) {
    return absl::ResourceExhaustedError(
        absl::StrCat("setting ", bytes, " bytes of the ", TierName(t),
                     " tier's budget aside: its budget of ", budgets_[I(t)], " bytes has ",
                     budgets_[I(t)] - std::min(budgets_[I(t)], used_[I(t)]), " free"));
  }
  used_[I(t)] += bytes;
  peak_[I(t)] = std::max(peak_[I(t)], used_[I(t)]);
  set_aside_[I(t)] += bytes;
  return absl::OkStatus();
}

void ResidencyTable::GiveBack(Tier t, uint64_t bytes) {
  MutexLock lock(&mu_);
  bytes = std::min(bytes, set_aside_[I(t)]);
  used_[I(t)] -= bytes;
  set_aside_[I(t)] -= bytes;
}

uint64_t ResidencyTable::param_elements(Tier t) const {
  MutexLock lock(&mu_);
  return param_elements_[I(t)];
}

uint64_t ResidencyTable::set_aside_bytes(Tier t) const {
  MutexLock lock(&mu_);
  return set_aside_[I(t)];
}

absl::Status ResidencyTable::CheckInvariants() const {
  MutexLock lock(&mu_);
  return CheckLocked();
}

absl::Status ResidencyTable::CheckLocked() const {
  std::array<uint64_t, kTierCount> held{}, held_params{};
  for (const auto& [id, r] : table_) {
    int current = 0;
    for (int t = 0; t < kTierCount; ++t) {
      if (r.current[t] && !r.has_copy[t]) {
        return absl::InternalError(absl::StrCat("partition ", id, ": current without a copy in ",
                                                TierName(static_cast<Tier>(t))));
      }
      if (r.pins[t] > 0 && !r.current[t]) {
        return absl::InternalError(absl::StrCat("partition ", id, ": pinned copy in ",
                                                TierName(static_cast<Tier>(t)), " is not current"));
      }
      current += r.current[t];
      if (r.has_copy[t]) held[t] += Footprint(r.desc);
      if (r.has_copy[t] && r.desc.role == Role::kParam) held_params[t] += r.desc.elements;
    }
    if (r.written && current == 0) {
      return absl::InternalError(absl::StrCat("partition ", id, ": no current copy left"));
    }
    if (r.move && r.current[I(r.move->second)] && !r.current[I(r.move->first)]) {
      return absl::InternalError(
          absl::StrCat("partition ", id, ": a move overwrites the only current copy"));
    }
  }
  for (int t = 0; t < kTierCount; ++t) {
    if (held_params[t] != param_elements_[t]) {
      return absl::InternalError(
          absl::StrCat(TierName(static_cast<Tier>(t)), " tier: ", held_params[t],
                       " parameter elements held, ", param_elements_[t], " accounted"));
    }
    if (held[t] + set_aside_[t] != used_[t]) {
      return absl::InternalError(absl::StrCat(TierName(static_cast<Tier>(t)), " tier: ", held[t],
                                              " bytes held and ", set_aside_[t], " set aside, ",
                                              used_[t], " accounted"));
    }
    if (used_[t] > budgets_[t]) {
      return absl::InternalError(absl::StrCat(TierName(static_cast<Tier>(t)), " tier: ", used_[t],
                                              " bytes over its budget of ", budgets_[t]));
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::tiering
