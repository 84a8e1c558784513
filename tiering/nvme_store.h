// tiering/nvme_store.h: the NVMe tier's swap space, a crash-consistent store of partitions.
//
// Layout. The store owns a directory (created 0700 when missing) holding swap files (swap-000.bin,
// ...), a manifest snapshot (manifest.json), a manifest log (journal-N.log) and a lock file
// (lock). Partitions live in extents of the swap files, aligned for O_DIRECT; a partition may span
// several extents, in one file or several, so a partition larger than one swap file, or one that
// fits only in the pieces of a fragmented store, is stored all the same. Why extents over a few
// large files rather than a file per partition or per layer: space, once taken, is reused without
// touching the filesystem, so a rewrite creates and unlinks no files and writes no directory
// metadata while training; and few files mean few descriptors and registered-file slots for
// io_uring.
//
// Growth. A new store takes no swap space: the files grow on demand, up to
// NvmeStoreOptions::capacity_bytes, which is a cap, never exceeded. When an allocation (a new
// partition, a Put, a staged Batch entry) finds too little free space, the store fallocates more
// at the end of the last swap file, or adds a new file once the last holds file_bytes (growing by
// at least an eighth of what it holds, so a store that fills up grows a few times, not once per
// partition; by exactly what is needed when the disk has no more). Growth is durable before it is
// used: the space is fallocated and the file synced (a new file's directory entry too: the
// directory is fsync'd) before any extent in it is handed out, so a commit record never points at
// space that a crash could take away; the record that first uses the grown space also records the
// files' sizes, and a reopen takes the files at the sizes the manifest records, giving back (by
// truncating, or removing a file no record names) what a crash left grown but unrecorded. A growth
// that fails (the disk is full: fallocate's ENOSPC) is undone and the allocation fails with
// ResourceExhausted naming the file, the bytes asked for, what is in use and the cap; nothing was
// written, the previous copy stays in force. Files never shrink while the store is open: space
// freed by a Put or an Erase is reused, not given back.
//
// One store per directory. Open takes an exclusive lock (a POSIX record lock on dir/lock, held for
// the store's life; the lock file also names the holder's pid): a second store on the same
// directory, in this process or another, is refused with FailedPrecondition naming the holder. A
// lock taken on a lock file that its holder removed meanwhile (remove_files_on_close) is dropped
// and taken again on the new file, so two stores never both believe they hold the directory. The
// lock belongs to the process that opened the store: a child it forks (a data loader's worker)
// does not hold it, so closing the store frees the directory at once; and it dies with its process,
// so a crashed process never blocks its successor. Ranks of one job must be given
// directories of their own (the Runtime puts each rank in a subfolder of nvme_path).
//
// Nothing is lost. A Put writes the new bytes into fresh extents (copy on write), syncs the data
// (NvmeStoreOptions::durable), then commits a manifest record that points at them, and only then
// frees the old extents. A Put that fails at any point leaves the previous copy and the previous
// manifest in force. (A commit whose log write fails may have reached the disk in part or whole:
// the store then replaces its log at once, so a reopen finds the previous state; should that fail
// too, a reopen finds the previous state or the new one, whole, as after a crash in mid-commit, and
// the new copy's space is not reused until the log has been replaced.) A commit appends one
// checksummed record (the partitions it changes, padded to a 4 KiB block of its own) to the
// manifest log and fdatasyncs it, so its cost is proportional to the change, not to the store. When
// the log has grown past twice the snapshot (and at least 64 KiB), and whenever a store with a
// non-empty log is reopened, the state is compacted into a new snapshot: a new empty log is made
// durable, the snapshot naming it is written to manifest.json.tmp, fdatasync'd, renamed over
// manifest.json and the directory fsync'd, and only then is the old log removed. A crash at any
// point leaves the previous state or the new one, whole: on reopen the snapshot is read, the log's
// records are replayed in order up to the first one that is torn or fails its checksum (only the
// last record can be torn: a commit returns only after its record is synced), and files no snapshot
// names (an older log, a .tmp) are removed. Each partition's bytes carry an XXH3-64 checksum,
// verified by Get as the bytes arrive; Open does not reread the partitions (reopening a large store
// costs only its manifest): Verify() rereads all of them on request, and
// NvmeStoreOptions::verify_on_open does it at Open.
//
// Space. Stored bytes are rounded up to the alignment. A copy-on-write needs room for the new copy
// while the old one is still in force, so the store keeps a reserve: a new partition, or a Put
// that makes a partition larger, is admitted only when, after it, the free space under the cap
// still holds a copy of the largest partition; and the files are grown at its admission to hold
// that reserve on disk, so the rewrites it is for never wait on the disk's free space. Capacity
// for a set of partitions is therefore the sum of their aligned sizes plus the largest one; that
// guarantees that one Put of an existing partition at a time always finds room. Each further Put
// in flight at the same time, and each partition staged in an open Batch, needs its own size on
// top (a Batch that stages every partition needs twice their sum), taken from the disk when it
// is needed. A Put that cannot get space fails with ResourceExhausted before any byte is written,
// naming what is in use and the cap (or, when the disk is full, the file it could not grow).
//
// Removal. With NvmeStoreOptions::remove_files_on_close the destructor of a store that opened
// removes its swap files, manifest, log and lock file, and the directory when Open created it and
// nothing else is left in it. Otherwise the files stay for the next Open (a restarted process).
//
// Thread safety: NvmeStore is thread-safe; Puts and Gets of different partitions run
// concurrently (their I/O through the shared aio Engine); commits are serialized by the log but
// readers never wait behind a commit's I/O; two Puts of one partition are serialized, and a Get
// concurrent with a Put of the same partition reads the old or the new copy, whole.
#ifndef STRATA_TIERING_NVME_STORE_H_
#define STRATA_TIERING_NVME_STORE_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "aio/engine.h"
#include "base/mutex.h"
#include "nlohmann/json_fwd.hpp"

namespace strata::tiering {

using PartitionId = uint64_t;

struct NvmeStoreOptions {
  // The most space the swap files may take, split over files of at most file_bytes each (rounded
  // up to the alignment). > 0 when the store is created; on reopen a value > 0 replaces the cap
  // the manifest records (never below what the files already hold), 0 keeps it. file_bytes is only
  // read when the store is created.
  uint64_t capacity_bytes = 0;
  uint64_t file_bytes = 4ull << 30;
  // Extent alignment (bytes, a power of two >= the files' O_DIRECT alignment).
  uint64_t alignment = 4096;
  // Verify each partition's checksum on Get.
  bool verify_on_get = true;
  // Reread and verify every partition at Open (see Verify()); off: reopening reads only the
  // manifest, and Get finds a damaged partition when it is read.
  bool verify_on_open = false;
  // The destructor removes the store's files (see "Removal" above). Off: they stay for a reopen.
  bool remove_files_on_close = false;
  // Each commit syncs its data and its log record (fdatasync) before it returns, so that a
  // machine that loses power finds it on reopen. Off, for a store whose files no later process
  // reopens (remove_files_on_close): the same writes in the same order, not synced. A process
  // that dies still leaves them to the kernel, which writes them. A crash of the machine (power,
  // kernel) may lose commits, and since freed extents are reused before the records that freed
  // them are on the disk, a reopen may then find partitions whose checksums fail (an error on
  // Get, never other bytes given as theirs). The growth of the files, and the snapshot written at
  // a compaction, are synced either way (rare, and what a reopen must be able to trust).
  bool durable = true;
  // The manifest log is compacted into a new snapshot when it grows past
  // max(compact_min_log_bytes, 2 x the snapshot's size).
  uint64_t compact_min_log_bytes = 64 << 10;
  // Notices that are not errors of the call that met them (a compaction that failed and will be
  // retried; stale files removed at Open). Default: stderr.
  std::function<void(absl::string_view)> on_warning;
  // Test seam: called at each step of a commit, of a compaction and of a growth with the step's
  // name ("commit:data-synced", "commit:log-written", "commit:log-synced"; not durable:
  // "commit:data-written" and "commit:log-unsynced" in their places, "compact:log-created",
  // "compact:snapshot-written", "compact:snapshot-renamed", "compact:old-log-removed",
  // "grow:allocated": the new space fallocated and synced, not yet handed out), so a test can kill
  // the process there and check what a reopen finds.
  std::function<void(absl::string_view)> test_hook;
  // Test seam: called before each fallocate that grows a swap file (path, offset, length); a
  // nonzero errno it returns is taken as that fallocate's failure (ENOSPC: a full disk).
  std::function<int(const std::string& path, uint64_t offset, uint64_t length)>
      test_fallocate_errno;
};

// A piece of a swap file: `length` is a multiple of the store's alignment.
struct StoreExtent {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const StoreExtent& o) const {
    return file == o.file && offset == o.offset && length == o.length;
  }
};

struct PartitionRecord {
  PartitionId id = 0;
  uint64_t length = 0;               // bytes stored
  uint64_t checksum = 0;             // XXH3-64 of the bytes
  uint64_t generation = 0;           // manifest generation that last wrote it
  std::vector<StoreExtent> extents;  // in order; their lengths add up to >= length
};

class NvmeStore {
 public:
  // Creates the store in `dir` (taking no swap space yet) or reopens the one there, after taking
  // the directory's lock. On reopen the manifest snapshot and log are read (and compacted when the
  // log is not empty); with options.verify_on_open every partition is verified and `corrupt`
  // (when not null) receives the ids whose bytes do not match their checksum (they stay listed;
  // Get on them fails with DataLoss). Errors name the path: dir not a directory, not writable,
  // in use by another store (FailedPrecondition), a filesystem refusing O_DIRECT (when the
  // engine uses it, found by opening the manifest log), a manifest that does not parse or whose
  // checksum does not match, or a swap file shorter than the manifest records (DataLoss). The cap
  // is not checked against the disk's free space: a full disk is found by the growth that meets
  // it.
  static absl::StatusOr<std::unique_ptr<NvmeStore>> Open(
      const std::string& dir, const NvmeStoreOptions& options, aio::Engine* engine,
      std::vector<PartitionId>* corrupt = nullptr);
  ~NvmeStore();

  // Writes `bytes` as partition `id` (copy on write; see above).
  absl::Status Put(PartitionId id, absl::Span<const std::byte> bytes);

  // Several partitions written as one: Stage writes (and syncs) new bytes into fresh extents
  // while the previous copies stay in force; Commit makes all of them current in one manifest
  // record (all or none); Abort, or destroying an uncommitted Batch, frees what was staged. A
  // Commit that fails keeps what was staged (nothing is current yet): Commit may be called again
  // (the log replaced first where the failed record may have reached it in part), or the Batch
  // aborted (where that record may have reached the log, its extents stay allocated until the log
  // is replaced, as after a failed Put; so do those of a partition staged again meanwhile, which
  // the new copy replaces). A Batch is used by one thread at a time; several Batches may be open
  // at once.
  class Batch {
   public:
    ~Batch();
    // `checksum`, when given, receives the staged bytes' checksum (what their record will say).
    absl::Status Stage(PartitionId id, absl::Span<const std::byte> bytes,
                       uint64_t* checksum = nullptr);
    // Stages `length` bytes produced chunk by chunk: produce(offset, chunk) fills chunk i into one
    // of the two buffers while chunk i-1 is written from the other. The buffers are of one size,
    // a multiple of the alignment.
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
      std::vector<StoreExtent> extents;
      uint64_t length = 0, checksum = 0;
    };
    // Allocates room for `length` bytes of `id` (the reserve rule above) and records it staged.
    absl::StatusOr<std::vector<StoreExtent>> Allocate(PartitionId id, uint64_t length,
                                                      const std::string& context);
    // Keeps what was written (replacing an earlier staged copy of `id`: freed, or kept allocated
    // until the log is replaced where a failed record naming it may be there), or frees it on
    // error.
    absl::Status Keep(PartitionId id, std::vector<StoreExtent> extents, uint64_t length,
                      uint64_t checksum, absl::Status written, const std::string& context);
    // Lets staged extents go: freed, or kept allocated until the log is replaced where a failed
    // record naming them may be there (maybe_logged_).
    void LetGo(const std::vector<StoreExtent>& extents);
    NvmeStore* const store_;
    std::map<PartitionId, Staged> staged_;
    // A Commit failed writing its record: one naming staged_ may be in the log until it is
    // replaced (log_poisoned_).
    bool maybe_logged_ = false;
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

  // Drops partition `id` (its extents are freed once the record without it is committed).
  absl::Status Erase(PartitionId id);

  // Rereads every partition and returns, sorted, the ids whose bytes do not match their
  // checksum. An I/O error other than a mismatch is returned as the status.
  absl::StatusOr<std::vector<PartitionId>> Verify();

  absl::StatusOr<PartitionRecord> Find(PartitionId id) const;
  // Every partition in the store, by id (what a restarted process adopts).
  std::vector<PartitionRecord> List() const;
  uint64_t generation() const;
  // Bytes held by partitions and by staged copies (aligned).
  uint64_t used_bytes() const;
  // The cap: the most the swap files may take.
  uint64_t capacity_bytes() const;
  // What the swap files take now (fallocated; grows toward capacity_bytes()).
  uint64_t allocated_bytes() const;
  // Bytes of manifest log written since the last snapshot (what the next commit appends to).
  uint64_t log_bytes() const;
  const std::string& dir() const { return dir_; }

 private:
  class Pending;
  NvmeStore() = default;
  absl::Status Lock();
  absl::Status Create();
  // Takes `length` (aligned) bytes of free space; the caller has checked that the files hold them.
  std::vector<StoreExtent> AllocateLocked(uint64_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(const std::vector<StoreExtent>& extents) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds [offset, offset + length) of file `f` to its free ranges, coalescing.
  void InsertFreeLocked(uint32_t f, uint64_t offset, uint64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t AllocatedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Grows the swap files until they hold `target` bytes (at most the cap): fallocated, synced and
  // published whole, or not at all (see "Growth" above). OK at once when they already do.
  absl::Status Grow(uint64_t target, const std::string& context)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(grow_mu_);
  // One growth of `bytes` (the end of the last file, then new files), all or nothing.
  absl::Status GrowBy(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(grow_mu_);
  absl::Status Fallocate(const aio::File& file, uint64_t offset, uint64_t length) const;
  // Opens swap file `index` as holding `size` bytes (the next file, or a larger size for one
  // already open), checking that the file on disk is at least that long.
  absl::Status AdoptFileLocked(uint32_t index, uint64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The swap file `f` (open for the store's life; the pointer stays valid).
  const aio::File* FileAt(uint32_t f) const;
  void RemoveFiles();
  absl::Status Carve(const PartitionRecord& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends one record (puts and erases) to the log and makes it durable, then applies it.
  // Requires commit_mu_, not mu_. On failure the puts' extents stay the caller's, and
  // `*maybe_logged` (when set) says the record may have reached the log, which is not yet
  // replaced (they must not be reused until it is).
  absl::Status CommitRecord(const std::map<PartitionId, Batch::Staged>& puts,
                            const std::vector<PartitionId>& erases, const std::string& context,
                            bool* maybe_logged = nullptr);
  // Writes a new snapshot of the committed state naming a new, empty log (see above).
  absl::Status Compact() ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // Writes manifest.json naming journal-<log_seq>.log; `*sizes` receives the file sizes it records.
  absl::Status WriteSnapshot(uint64_t log_seq, uint64_t* bytes, std::vector<uint64_t>* sizes);
  absl::Status Load();
  // Replays the log's records; `*any` is set when the log holds anything (records or a torn tail).
  absl::Status Replay(const std::string& log_path, bool* any) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyRecord(const nlohmann::json& j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Pending ReadPieces(const PartitionRecord& r, uint64_t offset, absl::Span<std::byte> out);
  Pending WritePieces(const std::vector<StoreExtent>& extents, uint64_t offset,
                      absl::Span<const std::byte> bytes);
  absl::Status SyncFiles(const std::vector<StoreExtent>& extents);
  absl::Status VerifyRecord(const PartitionRecord& r, std::vector<std::byte>* scratch);
  // DataLoss naming the partition, its place and both checksums.
  absl::Status Mismatch(const PartitionRecord& r, uint64_t sum) const;
  Mutex* PartitionMutex(PartitionId id);
  void Hook(absl::string_view point) const;
  void Warn(const std::string& w) const;

  std::string dir_;
  NvmeStoreOptions options_;
  aio::Engine* engine_ = nullptr;
  int lock_fd_ = -1;
  std::pair<dev_t, ino_t>
      lock_key_{};            // the lock file's device and inode (this process's registry)
  bool created_dir_ = false;  // Open made dir_
  bool opened_ = false;       // Open succeeded (only then may the destructor remove files)
  // Set by Open, then constant: the cap and the size a swap file grows to (both aligned).
  uint64_t capacity_ = 0;
  uint64_t file_bytes_ = 0;

  // Serializes growth; never held by a thread that holds mu_ or commit_mu_.
  Mutex grow_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  // Serializes commits (the log's order); held across the log's I/O, never with mu_ over I/O.
  mutable Mutex commit_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  aio::File log_ ABSL_GUARDED_BY(commit_mu_);
  uint64_t log_seq_ ABSL_GUARDED_BY(commit_mu_) = 0;  // journal-<log_seq_>.log
  uint64_t log_end_ ABSL_GUARDED_BY(commit_mu_) = 0;
  uint64_t snapshot_bytes_ ABSL_GUARDED_BY(commit_mu_) = 0;
  // After a log write that failed, the log's tail is unknown: no record is appended until a
  // compaction has replaced the log, and the extents of the failed commit stay allocated until
  // then (a record that reached the disk after all must not point at reused space).
  bool log_poisoned_ ABSL_GUARDED_BY(commit_mu_) = false;
  std::vector<StoreExtent> quarantined_ ABSL_GUARDED_BY(commit_mu_);
  // The swap files' sizes as the manifest (snapshot and log) records them; a commit records the
  // sizes that differ.
  std::vector<uint64_t> logged_sizes_ ABSL_GUARDED_BY(commit_mu_);

  mutable Mutex mu_;
  // The swap files (appended to by growth, never removed while the store is open) and the bytes
  // of each that are fallocated, synced and handed out.
  std::vector<std::unique_ptr<aio::File>> files_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> file_sizes_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<PartitionId, PartitionRecord> records_ ABSL_GUARDED_BY(mu_);
  // Aligned lengths of the stored partitions (the largest sets the copy-on-write reserve).
  std::multiset<uint64_t> lengths_ ABSL_GUARDED_BY(mu_);
  // Free extents per file: offset -> length, coalesced.
  std::vector<std::map<uint64_t, uint64_t>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<PartitionId, std::unique_ptr<Mutex>> partition_mu_ ABSL_GUARDED_BY(mu_);
};

// A write-back's cost in the store beyond its bytes (the planner's per-write-back commit): the
// median time of `puts` Puts of one 4 KiB partition into a scratch store created at `scratch` (a
// path that must not exist yet; removed after, whatever the outcome).
absl::StatusOr<double> MeasureCommitSeconds(const std::string& scratch, aio::Engine* engine,
                                            int puts = 9);

}  // namespace strata::tiering

#endif  // STRATA_TIERING_NVME_STORE_H_
