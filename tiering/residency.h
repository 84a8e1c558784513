// tiering/residency.h: the tier model and the residency table.
//
// Three tiers: device (GPU HBM, or its host emulation), host (pinned RAM), nvme. A partition
// (descriptor below) may have a copy in any of them. The table records, for every partition,
// which copies exist and which are current (hold its latest bytes), pins, and the one move in
// flight, and keeps these invariants, checked after every change in debug builds and on demand
// (CheckInvariants) in tests:
//   1. a partition that has been written has at least one current copy: the only current copy is
//      never dropped, and never the target of a move (it is never overwritten);
//   2. a tier never holds more bytes than its budget (a move's destination is reserved when the
//      move begins); a copy counts as whole granules (4 KiB pages by default: what the memory
//      resources and the NVMe store actually hold for it);
//   3. at most one move per partition is in flight;
//   4. a pinned copy is never dropped, and stays current while pinned;
//   5. a dirty copy (current where the nvme copy is not) is dropped only once another current
//      copy exists.
// Operations that would break one fail with FailedPrecondition (or ResourceExhausted for a
// budget) and change nothing.
//
// Thread safety: ResidencyTable is thread-safe.
#ifndef STRATA_TIERING_RESIDENCY_H_
#define STRATA_TIERING_RESIDENCY_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/mutex.h"
#include "tiering/nvme_store.h"  // PartitionId

namespace strata::tiering {

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kTierCount = 3;
absl::string_view TierName(Tier t);

enum class Role : uint8_t { kParam, kGrad, kMaster, kExpAvg, kExpAvgSq, kOther };
inline constexpr int kRoleCount = static_cast<int>(Role::kOther) + 1;
absl::string_view RoleName(Role r);

enum class ElementType : uint8_t { kF32, kBF16, kF16, kOther };

struct PartitionDesc {
  PartitionId id = 0;
  Role role = Role::kParam;
  ElementType dtype = ElementType::kF32;
  uint64_t elements = 0;
  uint64_t bytes = 0;
  int owner_rank = 0;
  int group = 0;  // layer
};

// A partition's bytes, at most 2^62 (sizes are checked before any arithmetic on them).
inline constexpr uint64_t kMaxPartitionBytes = uint64_t{1} << 62;
inline constexpr uint64_t kPageBytes = 4096;

// What the table knows about one partition.
struct Residency {
  PartitionDesc desc;
  std::array<bool, kTierCount> has_copy{};  // memory or extent held in the tier
  std::array<bool, kTierCount> current{};   // that copy holds the latest bytes
  std::array<int, kTierCount> pins{};
  bool written = false;  // some bytes were ever written (else no copy needs to be current)
  std::optional<std::pair<Tier, Tier>> move;  // from, to
  bool dirty(Tier t) const {
    return current[static_cast<int>(t)] && !current[static_cast<int>(Tier::kNvme)];
  }
  // The copy in `t` is the only current one (dropping it would lose the bytes).
  bool only_current(Tier t) const {
    for (int u = 0; u < kTierCount; ++u) {
      if (current[u] != (u == static_cast<int>(t))) return false;
    }
    return true;
  }
};

class ResidencyTable {
 public:
  // `granule_bytes`: a copy is counted against a budget rounded up to a multiple of it (1 counts
  // bytes exactly).
  explicit ResidencyTable(std::array<uint64_t, kTierCount> budgets_bytes,
                          uint64_t granule_bytes = kPageBytes);

  // Registers a partition with no copies. bytes > 0; an id registered twice is AlreadyExists.
  absl::Status Register(const PartitionDesc& desc);

  // Forgets a partition and releases its budget. Refused while pinned or moving.
  absl::Status Unregister(PartitionId id);

  // A first copy comes into being in `tier` (the trainer filled it): it is current and reserved
  // against the tier's budget.
  absl::Status Materialize(PartitionId id, Tier tier);

  // A move: from a current copy in `from` to `to`. Begin reserves `to` against its budget (a copy
  // already in `to` is reused); End(ok) makes the new copy current (ok) or releases the reservation
  // and leaves everything as it was (failed).
  absl::Status BeginMove(PartitionId id, Tier from, Tier to);
  absl::Status EndMove(PartitionId id, bool ok);
  // A partition with no bytes (Discarded) gets a new first copy in `tier`, which its caller fills
  // (with zeros): recorded as a move `tier` -> `tier` until EndMove, which makes it current and
  // the partition written (ok), or releases it (failed). Reserved against the budget now. Refused
  // for a partition that has bytes, a move in flight or a stale copy still held in `tier` (drop it
  // first), and for the NVMe tier (InvalidArgument: a fill is made in memory).
  absl::Status BeginFill(PartitionId id, Tier tier);

  // The partition's bytes are no longer needed: every copy goes stale (the copies stay held, and
  // counted, until dropped) and it counts as never written, so no copy needs to be current until
  // a fill (BeginFill) gives it bytes again. Refused while pinned or moving.
  absl::Status Discard(PartitionId id);

  // The copy in `tier` was changed (released dirty): it is the only current copy now. Returns the
  // tiers whose copies went stale (their memory may be freed with Drop).
  absl::StatusOr<std::vector<Tier>> MarkWritten(PartitionId id, Tier tier);

  // Drops the copy in `tier` (frees its budget). Refused for the only current copy, a pinned copy,
  // a copy that a move reads or writes.
  absl::Status Drop(PartitionId id, Tier tier);

  absl::Status Pin(PartitionId id, Tier tier);
  absl::Status Unpin(PartitionId id, Tier tier);

  // Sets `bytes` of a tier's budget aside for memory the table does not track as partitions (the
  // optimizer's state and buffers): ResourceExhausted, naming what is free, when they are not
  // free. GiveBack returns them (at most what is set aside).
  absl::Status SetAside(Tier t, uint64_t bytes);
  void GiveBack(Tier t, uint64_t bytes);
  uint64_t set_aside_bytes(Tier t) const;
  // The elements of the parameter partitions (Role::kParam) with a copy (or one being made) in t.
  uint64_t param_elements(Tier t) const;

  absl::StatusOr<Residency> Get(PartitionId id) const;
  uint64_t used_bytes(Tier t) const;
  // The most bytes the tier has held at once (reservations and set-asides included) since the
  // table was made: never more than its budget.
  uint64_t peak_bytes(Tier t) const;
  uint64_t budget_bytes(Tier t) const { return budgets_[static_cast<int>(t)]; }
  // What a copy of the partition is counted as against a budget: its bytes in whole granules.
  uint64_t Footprint(const PartitionDesc& desc) const {
    return (desc.bytes + granule_ - 1) / granule_ * granule_;
  }

  // Checks every invariant over the whole table; the first violation, named.
  absl::Status CheckInvariants() const;

 private:
  absl::Status CheckLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Residency*> FindLocked(PartitionId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a copy of `desc` in tier t (ResourceExhausted when it does not fit), or no more.
  absl::Status ReserveLocked(Tier t, const PartitionDesc& desc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnreserveLocked(Tier t, const PartitionDesc& desc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::array<uint64_t, kTierCount> budgets_;
  const uint64_t granule_;
  mutable Mutex mu_;
  std::array<uint64_t, kTierCount> used_ ABSL_GUARDED_BY(mu_){};
  std::array<uint64_t, kTierCount> set_aside_ ABSL_GUARDED_BY(mu_){};  // part of used_
  std::array<uint64_t, kTierCount> peak_ ABSL_GUARDED_BY(mu_){};       // the most used_ has been
  std::array<uint64_t, kTierCount> param_elements_ ABSL_GUARDED_BY(mu_){};
  absl::flat_hash_map<PartitionId, Residency> table_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::tiering

#endif  // STRATA_TIERING_RESIDENCY_H_
