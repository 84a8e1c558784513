// tiering/nvme_store.h: the NVMe tier's swap space, a crash-consistent store of partitions.
//
// Layout. The store owns a directory (created 0700 when missing) holding a few large swap files
// (swap-000.bin, ...), each preallocated with fallocate when the store is created, and a manifest
// (manifest.json). Partitions live in extents of those files, aligned for O_DIRECT. Why extents
// over a few large files rather than a file per partition or per layer: the space is reserved
// once, so a full disk is found when the store is made and never in the middle of a step; writes
// create and unlink no files, so no directory metadata is written while training; and few files
// mean few descriptors and registered-file slots for io_uring.
//
// Nothing is lost. Put(id, bytes) writes the new bytes into a fresh extent (copy on write), syncs
// the data, then commits a new manifest that points at it, and only then frees the old extent. A
// Put that fails at any point leaves the previous copy and the previous manifest in force. The
// manifest is committed atomically: written to manifest.json.tmp, fdatasync'd, renamed over
// manifest.json, and the directory fsync'd; a crash at any point leaves the previous manifest or
// the new one, whole (its own checksum proves which). Each partition's bytes carry an XXH3-64
// checksum; Get verifies it, and Open verifies every partition and names each whose bytes do not
// match.
//
// Space: a Put that cannot get an extent fails with ResourceExhausted before any byte is written.
//
// Thread safety: NvmeStore is thread-safe; Puts and Gets of different partitions run
// concurrently (their I/O through the shared aio Engine); two Puts of one partition are
// serialized, and a Get concurrent with a Put of the same partition reads the old or the new
// copy, whole.
#ifndef STRATA_TIERING_NVME_STORE_H_
#define STRATA_TIERING_NVME_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "aio/engine.h"
#include "base/mutex.h"

namespace strata::tiering {

using PartitionId = uint64_t;

struct NvmeStoreOptions {
  // Total space to reserve, split over swap files of at most file_bytes each. > 0.
  uint64_t capacity_bytes = 0;
  uint64_t file_bytes = 4ull << 30;
  // Extent alignment (bytes, a power of two >= the files' O_DIRECT alignment).
  uint64_t alignment = 4096;
  // Verify each partition's checksum on Get.
  bool verify_on_get = true;
};

struct PartitionRecord {
  PartitionId id = 0;
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t checksum = 0;    // XXH3-64 of the bytes
  uint64_t generation = 0;  // manifest generation that last wrote it
};

class NvmeStore {
  struct Extent {
    uint32_t file;
    uint64_t offset, length;
  };

 public:
  // Creates the store in `dir` (reserving capacity) or reopens the one there. On reopen the
  // manifest is read, every partition is verified, and `corrupt` (when not null) receives the ids
  // whose bytes do not match their checksum (they stay listed; Get on them fails with DataLoss).
  // Errors name the path: dir not a directory, not writable, a filesystem refusing O_DIRECT (when
  // the engine uses it), not enough space (ResourceExhausted, before anything is written), a
  // manifest that does not parse or whose checksum does not match (DataLoss).
  static absl::StatusOr<std::unique_ptr<NvmeStore>> Open(
      const std::string& dir, const NvmeStoreOptions& options, aio::Engine* engine,
      std::vector<PartitionId>* corrupt = nullptr);
  ~NvmeStore();

  // Writes `bytes` as partition `id` (copy on write; see above).
  absl::Status Put(PartitionId id, absl::Span<const std::byte> bytes);

  // Several partitions written as one: Stage writes (and syncs) new bytes into fresh extents
  // while the previous copies stay in force; Commit makes all of them current in one manifest
  // commit (all or none); Abort, or destroying an uncommitted Batch, frees what was staged. A
  // Batch is used by one thread at a time; several Batches may be open at once.
  class Batch {
   public:
    ~Batch();
    absl::Status Stage(PartitionId id, absl::Span<const std::byte> bytes);
    // Stages `length` bytes produced chunk by chunk: produce(offset, chunk) fills chunk i into one
    // of the two buffers while chunk i-1 is written from the other.
    using ChunkProducer = std::function<absl::Status(uint64_t offset, absl::Span<std::byte>)>;
    absl::Status StageChunked(PartitionId id, uint64_t length, absl::Span<std::byte> buffer_a,
                              absl::Span<std::byte> buffer_b, const ChunkProducer& produce);
    absl::Status Commit();
    void Abort();
    size_t staged() const { return staged_.size(); }

   private:
    friend class NvmeStore;
    explicit Batch(NvmeStore* store) : store_(store) {}
    struct Staged {
      Extent extent;
      uint64_t length = 0, checksum = 0;
    };
    NvmeStore* const store_;
    std::map<PartitionId, Staged> staged_;
  };
  std::unique_ptr<Batch> NewBatch();
  // Reads partition `id` into `out`, which must be exactly its length. NotFound when absent;
  // DataLoss when its bytes do not match the checksum.
  absl::Status Get(PartitionId id, absl::Span<std::byte> out);
  // Reads partition `id` in chunks through two caller buffers of equal size (a multiple of the
  // alignment): chunk i+1 is read while consume(offset, bytes) handles chunk i, so a consumer that
  // copies to a device overlaps the disk. The checksum is verified as the chunks arrive; on any
  // error (DataLoss on a mismatch) the consumer must discard what it was given.
  using ChunkConsumer = std::function<absl::Status(uint64_t offset, absl::Span<const std::byte>)>;
  absl::Status GetChunked(PartitionId id, absl::Span<std::byte> buffer_a,
                          absl::Span<std::byte> buffer_b, const ChunkConsumer& consume);

  // Drops partition `id` (its extent is freed once the manifest without it is committed).
  absl::Status Erase(PartitionId id);

  absl::StatusOr<PartitionRecord> Find(PartitionId id) const;
  uint64_t generation() const;
  uint64_t used_bytes() const;
  uint64_t capacity_bytes() const;
  const std::string& dir() const { return dir_; }

 private:
  NvmeStore() = default;
  absl::StatusOr<Extent> AllocateLocked(uint64_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(const Extent& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status LoadManifest(std::vector<PartitionId>* corrupt);
  absl::Status VerifyRecord(const PartitionRecord& r, std::vector<std::byte>* scratch);
  // DataLoss naming the partition, its place and both checksums.
  absl::Status Mismatch(const PartitionRecord& r, uint64_t sum) const;
  Mutex* PartitionMutex(PartitionId id);

  std::string dir_;
  NvmeStoreOptions options_;
  aio::Engine* engine_ = nullptr;
  std::vector<aio::File> files_;
  std::vector<uint64_t> file_sizes_;

  mutable Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<PartitionId, PartitionRecord> records_ ABSL_GUARDED_BY(mu_);
  // Free extents per file: offset -> length, coalesced.
  std::vector<std::map<uint64_t, uint64_t>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<PartitionId, std::unique_ptr<Mutex>> partition_mu_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::tiering

#endif  // STRATA_TIERING_NVME_STORE_H_
