// tiering/runtime.h: the Runtime facade a trainer links (first cut).
//
// A Runtime is made from a RuntimeConfig (tiering/runtime_config.h). It owns the aio engine, the
// NVMe store (when anything is offloaded to NVMe), the memory of the device tier (CUDA, or
// host-emulated ordinary memory with its own budget when strata.device is "emulated" — the test
// seam every CI run uses, announced by a warning at Create), the pinned host memory, the copy
// engine and the residency table.
//
// Where NVMe swap lives: the store is the folder rank<R> under the configured nvme_path (made when
// missing), R being RuntimeOptions::rank, else the RANK variable that torchrun and DeepSpeed's
// launcher set, else 0 — so the ranks of a job given one nvme_path (as DeepSpeed configs do) never
// share a store. A store is locked for its Runtime's life: a second Runtime (in this process or
// another) on the same folder is refused at Create. The CUDA device is RuntimeOptions::
// device_index, else LOCAL_RANK, else 0.
//
// The trainer registers partitions (with their first bytes in a tier), then asks for a partition
// in a memory tier with Acquire — which brings a current copy there (NVMe -> host through the
// aio engine; host <-> device through the copy engine; NVMe <-> device in chunks through two
// pinned staging buffers of offload_param.buffer_size, the disk and the copy engine overlapping),
// evicting the least recently used unpinned copies of that tier to stay within its budget
// (writing a copy back first when it is the only current one; when a victim cannot be evicted, the
// next one is tried) — and pins it until Release. A Release marked dirty makes that copy the only
// current one (the stale copies are freed). The time Acquire spent waiting for bytes to move is
// counted in stats().
//
// Budgets: the host budget covers the partitions' host copies and the two staging buffers (set
// aside at Create when there is an NVMe tier), so pinned memory held stays within
// strata.host_budget_bytes.
//
// Restarts: a Runtime reopening a store finds the partitions an earlier run left there
// (StoredPartitions). Adopt takes one over with its bytes; Register refuses an id the store already
// holds (it would overwrite the stored bytes); Unregister drops a partition, stored or not. Flush
// writes every partition whose NVMe copy is stale back to NVMe, and the destructor flushes (a
// failure there is reported as a warning: release everything and Flush before destroying to see
// the status).
//
// Nothing is lost: every move goes through the residency table's rules (tiering/residency.h); a
// write-back that fails leaves the previous copy valid and the partition dirty, and the caller
// gets the status.
//
// First cut: one operation at a time (a runtime-wide mutex; moves of different partitions do not
// overlap yet, and a Prefetch holds the runtime while it moves — sched/ and swap/ bring
// concurrent moves). Thread safety: thread-safe.
#ifndef STRATA_TIERING_RUNTIME_H_
#define STRATA_TIERING_RUNTIME_H_

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "aio/engine.h"
#include "base/mutex.h"
#include "tiering/copy_engine.h"
#include "tiering/memory_resource.h"
#include "tiering/nvme_store.h"
#include "tiering/residency.h"
#include "tiering/runtime_config.h"

namespace strata::tiering {

struct RuntimeOptions {
  std::function<void(absl::string_view)> on_warning;  // default: stderr
  // This process's rank (its store is <nvme_path>/rank<rank>); -1: the RANK environment
  // variable, else 0.
  int rank = -1;
  // The CUDA device of the device tier; -1: the LOCAL_RANK environment variable, else 0.
  int device_index = -1;
  // Passed to the aio engine (tests wrap the backend with a FaultInjector).
  aio::EngineOptions engine_options;
};

struct RuntimeStats {
  // Time Acquire spent waiting: for bytes to move, and for the runtime while another operation
  // (a prefetch's move among them) held it.
  double acquire_wait_seconds = 0;
  uint64_t acquires = 0, acquire_hits = 0;  // hits: already current in the tier
  uint64_t evictions = 0, write_backs = 0;
  // Pinned host memory held (partitions' copies, staging buffers, freed blocks kept for reuse,
  // page rounding): never more than strata.host_budget_bytes.
  uint64_t host_held_bytes = 0;
  std::array<std::array<uint64_t, kTierCount>, kTierCount> bytes_moved{};  // [from][to]
};

class Runtime {
 public:
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(const RuntimeConfig& config,
                                                         RuntimeOptions options = {});
  ~Runtime();

  // Registers a partition whose first bytes are `initial` (zeros when empty, written to NVMe
  // through the staging buffers when `tier` is NVMe), placed in `tier`. AlreadyExists when the id
  // is registered, or held by the store from an earlier run (Adopt or Unregister it).
  absl::Status Register(const PartitionDesc& desc, Tier tier,
                        absl::Span<const std::byte> initial = {});
  // Registers a partition the store already holds (from an earlier run), with its bytes: NotFound
  // when the store has no such id, InvalidArgument when its length is not desc.bytes.
  absl::Status Adopt(const PartitionDesc& desc);
  // The partitions in the NVMe store (empty without an NVMe tier), registered or not.
  std::vector<PartitionRecord> StoredPartitions() const;
  // Forgets a partition: its memory copies are freed and its NVMe copy erased. Refused while it is
  // pinned. Also drops a stored partition that was never adopted.
  absl::Status Unregister(PartitionId id);
  // Writes back to NVMe every registered partition whose NVMe copy is not current, so the store
  // holds every partition's latest bytes (what a restart adopts). FailedPrecondition naming the
  // first partition pinned while dirty; a no-op without an NVMe tier.
  absl::Status Flush();
  // Brings a current copy into `tier` (device or host), pins it, returns its address.
  absl::StatusOr<std::byte*> Acquire(PartitionId id, Tier tier);
  // Unpins; `dirty`: the caller changed the bytes in `tier`.
  absl::Status Release(PartitionId id, Tier tier, bool dirty);
  // Drops the copy in `tier` (memory tiers), writing it back first when it is the only current
  // copy: a device copy to host, or straight to NVMe when parameters are offloaded to NVMe
  // (offload_param.device "nvme"); a host copy to NVMe. A clean copy is dropped without I/O.
  absl::Status Evict(PartitionId id, Tier tier);

  // Queues bringing a current copy into `tier` on the Runtime's prefetch thread (no pin) and
  // returns at once; the future completes when it is there (it may be discarded). Prefetches run
  // in the order queued. The destructor waits for the one running and completes the queued ones
  // with Cancelled.
  std::future<absl::Status> Prefetch(PartitionId id, Tier tier);

  RuntimeStats stats() const;
  const ResidencyTable& residency() const { return *table_; }
  const RuntimeConfig& config() const { return config_; }
  // Every warning so far (a copy: prefetch threads may add to them).
  std::vector<std::string> warnings() const;

 private:
  Runtime() = default;
  MemoryResource& ResourceFor(Tier t);
  absl::Status MoveLocked(PartitionId id, Tier from, Tier to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status BringLocked(PartitionId id, Tier tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StagingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts unpinned copies of `t` (least recently used first) until `bytes` fit. Copies of the
  // partitions being moved (protected_) are never chosen: a cascade of evictions must not take
  // the copy an outer move reads.
  absl::Status MakeRoomLocked(Tier t, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteBackLocked(PartitionId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EvictLocked(PartitionId id, Tier tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FreeCopyLocked(PartitionId id, Tier tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Warn(std::string w);

  RuntimeConfig config_;
  RuntimeOptions options_;
  mutable Mutex warnings_mu_;
  std::vector<std::string> warnings_ ABSL_GUARDED_BY(warnings_mu_);
  std::unique_ptr<aio::Engine> engine_;
  std::unique_ptr<NvmeStore> store_;
  std::unique_ptr<MemoryResource> device_memory_;
  std::unique_ptr<MemoryResource> pinned_memory_;
  std::unique_ptr<PoolingResource> host_memory_;  // pools pinned_memory_, within the host budget
  std::unique_ptr<CopyEngine> copy_;
  std::unique_ptr<ResidencyTable> table_;

  mutable Mutex mu_;
  struct Buffers {
    std::array<std::byte*, 2> ptr{};  // device, host
    std::array<uint64_t, 2> last_use{};
  };
  absl::flat_hash_map<PartitionId, Buffers> buffers_ ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  std::array<std::byte*, 2> staging_ ABSL_GUARDED_BY(mu_){};  // NVMe <-> device chunks
  uint64_t staging_bytes_ = 0;
  std::vector<PartitionId> protected_ ABSL_GUARDED_BY(mu_);  // being moved (see MakeRoomLocked)

  // The prefetch thread and its queue.
  void PrefetchLoop();
  struct PrefetchRequest {
    PartitionId id;
    Tier tier;
    std::promise<absl::Status> done;
  };
  Mutex prefetch_mu_;
  CondVar prefetch_cv_;
  std::deque<PrefetchRequest> prefetch_queue_ ABSL_GUARDED_BY(prefetch_mu_);
  bool prefetch_stop_ ABSL_GUARDED_BY(prefetch_mu_) = false;
  std::thread prefetch_thread_;
  RuntimeStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::tiering

#endif  // STRATA_TIERING_RUNTIME_H_
