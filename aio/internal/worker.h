// Internals of the Engine: requests, pieces and the worker threads that run them.
//
// Thread safety: a Worker's queue is guarded by its mutex (any thread enqueues); everything else a
// worker touches while running (its backend, staging buffers, the pieces it holds) is owned by its
// thread. A Request is shared by the workers that run its pieces: its counters are atomic and its
// status is guarded by its mutex.
#ifndef STRATA_AIO_INTERNAL_WORKER_H_
#define STRATA_AIO_INTERNAL_WORKER_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "aio/backend.h"
#include "aio/buffer.h"
#include "aio/engine.h"
#include "aio/stats.h"
#include "base/mutex.h"

namespace strata::aio::internal {

using Clock = std::chrono::steady_clock;

struct EngineShared;

struct FileEntry {
  ~FileEntry();  // Releases the registered slot, then closes the descriptor.

  // Writes on an O_DIRECT file are written in whole aligned blocks, so a write that extends the
  // file to an unaligned end leaves padding. The padding is cut when no write of this file is in
  // flight any more, and only when a write of that batch extended the file (so the bytes cut were
  // never anyone's data). BeginWrite returns the file size (for the read-modify-write of unaligned
  // edges); EndWrite may trim and then returns the trim's status.
  absl::StatusOr<uint64_t> BeginWrite(uint64_t end);
  absl::Status EndWrite(uint64_t end, bool ok);

  Engine* engine = nullptr;
  EngineShared* shared = nullptr;
  std::string path;
  int fd = -1;
  bool direct = false;
  bool writable = false;
  DirectIoAlignment alignment;
  int slot = -1;  // Registered-file slot, or -1.

 private:
  Mutex write_mu_;
  int writes_in_flight_ ABSL_GUARDED_BY(write_mu_) = 0;
  uint64_t batch_max_end_ ABSL_GUARDED_BY(write_mu_) = 0;
  bool batch_extended_ ABSL_GUARDED_BY(write_mu_) = false;
  bool batch_failed_ ABSL_GUARDED_BY(write_mu_) = false;
};

// Registered user buffers and file slots, shared by the engine and its workers.
struct EngineShared {
  struct Region {
    uintptr_t begin = 0;
    uintptr_t end = 0;
    int index = -1;
  };
  Mutex mu;
  std::vector<Region> regions ABSL_GUARDED_BY(mu);
  std::vector<bool> buffer_index_used ABSL_GUARDED_BY(mu);
  std::vector<bool> file_slot_used ABSL_GUARDED_BY(mu);
  std::atomic<int> region_count{0};
  std::atomic<int> open_files{0};  // FileEntries alive; must be 0 when the Engine is destroyed.
  std::atomic<uint64_t> next_worker{0};

  // The registered index whose region holds [p, p + length), or -1.
  int FindRegion(const std::byte* p, uint64_t length);
};

struct Request;

// What a piece is doing: reading, writing, or reading the covering block of an unaligned write
// before patching it (read-modify-write).
enum class Phase : uint8_t { kRead, kWrite, kFillForWrite };

// One block-sized part of a request. [offset, offset + length) is what the caller asked for;
// [io_offset, io_offset + io_length) is what goes to the kernel (the covering aligned range when
// staged). `done` bytes of the I/O range have been transferred; `required` bytes must be for a
// read phase to succeed (the rest may lie past the end of the file).
struct Piece {
  Request* request = nullptr;
  uint64_t offset = 0;
  uint32_t length = 0;
  std::byte* user = nullptr;
  uint64_t io_offset = 0;
  uint32_t io_length = 0;
  bool staged = false;
  Phase phase = Phase::kRead;
  std::byte* io_buf = nullptr;  // Set when the piece is first prepared.
  int buf_index = -1;
  int staging_slot = -1;
  uint32_t done = 0;
  uint32_t required = 0;
  int transient_retries = 0;  // EINTR / EAGAIN
  int stalls = 0;             // Completions that made no aligned progress.
  bool started = false;
  Clock::time_point start;
};

struct Request {
  std::shared_ptr<FileEntry> file;
  OpKind kind = OpKind::kRead;
  uint64_t offset = 0;
  uint64_t length = 0;
  IoCallback done;
  std::vector<Piece> pieces;
  std::atomic<size_t> pieces_left{0};
  // File size at submission, for writes on an O_DIRECT file; else -1.
  int64_t size_before = -1;

  // Keeps the request's first error (later ones are dropped) and marks it failed. A worker that
  // sees failed() finds that error already in status(), so a piece cancelled because of it never
  // stands in for it.
  void Fail(absl::Status error) ABSL_LOCKS_EXCLUDED(mu);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  absl::Status status() const ABSL_LOCKS_EXCLUDED(mu);

 private:
  std::atomic<bool> failed_{false};
  mutable Mutex mu;
  absl::Status status_ ABSL_GUARDED_BY(mu);
};

struct WorkerConfig {
  int index = 0;
  int queue_depth = 8;
  bool single_submit = false;
  bool overlap_events = true;
};

class Worker {
 public:
  // `staging` is one region (huge-page backed where the kernel gives them) cut into
  // `staging_count` slots of `slot_bytes`.
  Worker(WorkerConfig config, std::unique_ptr<Backend> backend, AlignedBuffer staging,
         size_t staging_count, uint64_t slot_bytes, EngineShared* shared);
  ~Worker();  // Stop(), if not done yet.

  // Runs every queued piece to completion, then joins the thread. Idempotent.
  void Stop();

  Backend& backend() { return *backend_; }
  // Marks staging buffer i as registered under `index` (-1: not registered).
  void SetStagingIndex(size_t i, int index) { staging_index_[i] = index; }
  size_t staging_count() const { return staging_index_.size(); }
  std::byte* staging(size_t i) const { return staging_.data() + i * slot_bytes_; }
  uint64_t slot_bytes() const { return slot_bytes_; }

  void Start();
  void Enqueue(const std::vector<Piece*>& pieces);
  void AddStats(EngineStats* out) const;
  void ResetStats();

 private:
  enum class Prepared { kReady, kCancelled, kNoStaging };

  void Run();
  void SubmitReady(std::deque<Piece*>* ready);
  Prepared Prepare(Piece* piece, Op* op);
  void Handle(Piece* piece, int64_t result, std::deque<Piece*>* ready);
  void Finish(Piece* piece, absl::Status status);
  void FailAll(const absl::Status& status, std::deque<Piece*>* ready);

  const WorkerConfig config_;
  std::unique_ptr<Backend> backend_;
  AlignedBuffer staging_;
  const uint64_t slot_bytes_;
  std::vector<int> staging_index_;
  std::vector<int> free_staging_;
  EngineShared* const shared_;
  absl::flat_hash_set<Piece*> in_flight_;  // Worker thread only.
  std::vector<Op> batch_;                  // Worker thread only: SubmitReady's batch.
  std::vector<Piece*> copy_out_;           // Worker thread only: staged reads to copy out.
  absl::Status broken_;                    // Worker thread only: a fatal backend error.
  std::thread thread_;

  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Piece*> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::aio::internal

#endif  // STRATA_AIO_INTERNAL_WORKER_H_
