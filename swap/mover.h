// swap/mover.h: every byte move of a partition between tiers (the Mover).
//
// The Mover carries out moves the residency table has begun, and keeps the address of every
// memory copy (device and host tiers). It is handed what it needs at construction — the residency
// table, the device and host memory resources, the NVMe store (none without an NVMe tier), the
// copy engine and the staging pool — and owns none of them. It decides nothing: which move, when,
// and what to evict to make room are its caller's (sched/), which begins each move in the table
// (reserving the destination against its tier's budget) before calling Carry.
//
// The routes: NVMe -> host and host -> NVMe through the store (the aio engine; a write-back is a
// copy-on-write Put, checked and committed before the move ends); host <-> device through the copy
// engine; NVMe <-> device chunk by chunk through a pair of pinned staging buffers (the disk and the
// copy engine overlapping), never the whole partition in host memory.
//
// Moves run on the calling thread and hold no lock across their I/O: moves of different partitions
// run at once from several threads (the disk, the copy engine and the CPU each busy). A failed move
// leaves everything as it was — the table's move ended as failed (the destination released), the
// destination's memory freed unless it held a copy before — and the status names the partition
// and the tiers. A copy the table knows is freed only through Drop, which the table allows only
// for a copy that is not the only current one, not pinned and not in a move; Forget frees the
// copies of a partition the table has forgotten, and the destructor whatever is left.
//
// Thread safety: thread-safe. Carry of one partition must not run twice at once (the table allows
// one move per partition).
#ifndef STRATA_SWAP_MOVER_H_
#define STRATA_SWAP_MOVER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "swap/staging_pool.h"
#include "tiering/copy_engine.h"
#include "tiering/memory_resource.h"
#include "tiering/nvme_store.h"
#include "tiering/residency.h"

namespace strata::swap {

using tiering::PartitionId;
using tiering::Tier;

struct MoverParts {
  tiering::ResidencyTable* table = nullptr;
  tiering::MemoryResource* device = nullptr;
  tiering::MemoryResource* host = nullptr;
  tiering::NvmeStore* store = nullptr;  // null: no NVMe tier
  tiering::CopyEngine* copy = nullptr;
  StagingPool* staging = nullptr;  // for NVMe writes of new partitions and NVMe <-> device
};

using TierMatrix = std::array<std::array<uint64_t, tiering::kTierCount>, tiering::kTierCount>;
// Bytes read from and written to the NVMe tier by the partitions' role: [role][0: read, 1:
// written].
using RoleNvmeBytes = std::array<std::array<uint64_t, 2>, tiering::kRoleCount>;

class Mover {
 public:
  explicit Mover(const MoverParts& parts);
  // Frees every memory copy still held.
  ~Mover();
  Mover(const Mover&) = delete;
  Mover& operator=(const Mover&) = delete;

  // Writes the first bytes of a partition whose copy in `tier` the caller has just reserved
  // (ResidencyTable::Materialize): `initial` (exactly desc.bytes) or zeros when empty. Device:
  // through the copy engine (zeros made on the device, without crossing the link); NVMe: staged
  // chunk by chunk and committed, never the whole partition in host memory. On failure nothing is
  // held (memory freed, nothing committed) and the caller unregisters the partition.
  absl::Status Fill(const tiering::PartitionDesc& desc, Tier tier,
                    absl::Span<const std::byte> initial);

  // Carries out the move from -> to that the table has begun (ResidencyTable::BeginMove), and ends
  // it (EndMove: the new copy current, or released on failure). from == to: the fill the table
  // has begun (ResidencyTable::BeginFill, memory tiers only): zeros made in that tier (on the
  // device by the copy engine, without crossing the link), not counted as bytes moved; with not
  // `zeros`, the room alone (its caller overwrites every byte).
  absl::Status Carry(PartitionId id, Tier from, Tier to, bool zeros = true);

  // Drops the copy in `tier` through the table (its rules) and frees its memory (memory tiers; a
  // stale NVMe copy keeps its extent until the next write-back replaces it).
  absl::Status Drop(PartitionId id, Tier tier);

  // Frees the memory copies of a partition the table no longer knows (after Unregister).
  void Forget(PartitionId id);

  // The trainer's kernels queued up to `fence` may use the device copy of `id` (a Release with a
  // stream; null: nothing). The copy is not read (moved down) or overwritten before its fences
  // have passed (the moving thread waits for them; the caller holds no lock over a Carry), and a
  // dropped copy's memory is freed only once they have: until then it is held aside (device memory
  // can be above its budget by such copies for as long as those kernels run, as with torch's
  // record_stream), freed by a later call that finds them passed, or by the destructor.
  void AddFence(PartitionId id, std::shared_ptr<tiering::Fence> fence);
  // Device memory held aside for dropped copies whose fences have not passed.
  uint64_t held_aside_bytes() const;

  // The memory copy's address (device or host tier); null when there is none.
  std::byte* Address(PartitionId id, Tier tier) const;

  // Bytes moved so far, [from][to].
  TierMatrix bytes_moved() const;
  // Bytes read from and written to NVMe so far, by the partitions' role.
  RoleNvmeBytes nvme_bytes_by_role() const;

 private:
  tiering::MemoryResource& ResourceFor(Tier t) const;
  absl::Status Bytes(PartitionId id, uint64_t bytes, Tier from, Tier to, std::byte* src,
                     std::byte* dst, bool zeros = true);
  // Zeros in a memory tier's copy (the device's made there by the copy engine).
  absl::Status Zeros(Tier tier, std::byte* dst, uint64_t bytes);

  const MoverParts parts_;
  mutable Mutex mu_;
  struct Copies {
    std::array<std::byte*, 2> at{};  // device, host
    uint64_t bytes = 0;              // each copy's size (the table may have forgotten it)
    std::vector<std::shared_ptr<tiering::Fence>> fences;  // of the device copy
  };
  struct HeldAside {
    std::byte* at;
    uint64_t bytes;
    std::vector<std::shared_ptr<tiering::Fence>> fences;
  };
  // Waits for the fences of `id`'s device copy (without the lock); those passed are forgotten.
  absl::Status WaitForFences(PartitionId id);
  // Frees the device copy `at` now, or holds it aside until `fences` have passed.
  void FreeDeviceLocked(std::byte* at, uint64_t bytes,
                        std::vector<std::shared_ptr<tiering::Fence>> fences)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees what was held aside and has passed its fences.
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::flat_hash_map<PartitionId, Copies> copies_ ABSL_GUARDED_BY(mu_);
  std::vector<HeldAside> held_aside_ ABSL_GUARDED_BY(mu_);
  TierMatrix bytes_moved_ ABSL_GUARDED_BY(mu_){};
  RoleNvmeBytes nvme_by_role_ ABSL_GUARDED_BY(mu_){};
};

}  // namespace strata::swap

#endif  // STRATA_SWAP_MOVER_H_
