// The worker loop and the one place where completions are interpreted.
//
// Strategy for results (Worker::Handle):
//  - -EINTR / -EAGAIN: the piece is resubmitted unchanged (at most kMaxTransientRetries times).
//  - another -errno: the piece, and so its request, fails with a status naming op, file, offset,
//    length and errno.
//  - a short transfer: the piece continues from where the kernel stopped. On an O_DIRECT file the
//    progress is rounded down to the offset alignment (re-transferring a few bytes is harmless and
//    keeps every resubmission aligned); kMaxStalls completions without progress fail the piece.
//  - 0 bytes on a read before the piece's required bytes: the file ended early, OutOfRange.
#include "aio/internal/worker.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "aio/internal/stream_copy.h"
#include "base/check.h"
#include "base/status.h"

namespace strata::aio::internal {
namespace {

constexpr int kMaxTransientRetries = 1000;
constexpr int kMaxStalls = 16;

uint64_t AlignDown(uint64_t v, uint64_t a) { return v / a * a; }

absl::string_view OpName(const Piece& p) { return p.phase == Phase::kWrite ? "write" : "read"; }

}  // namespace

FileEntry::~FileEntry() {
  if (slot >= 0) engine->ReleaseFileSlot(slot);
  if (fd >= 0) close(fd);
  if (shared != nullptr) shared->open_files.fetch_sub(1, std::memory_order_acq_rel);
}

absl::StatusOr<uint64_t> FileEntry::BeginWrite(uint64_t end) {
  MutexLock lock(&write_mu_);
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  const auto size = static_cast<uint64_t>(st.st_size);
  ++writes_in_flight_;
  if (end > size) batch_extended_ = true;
  return size;
}

absl::Status FileEntry::EndWrite(uint64_t end, bool ok) {
  MutexLock lock(&write_mu_);
  batch_max_end_ = std::max(batch_max_end_, end);
  batch_failed_ |= !ok;
  if (--writes_in_flight_ > 0) return absl::OkStatus();
  const uint64_t max_end = batch_max_end_;
  const bool trim = batch_extended_ && !batch_failed_ && max_end % alignment.offset != 0;
  batch_max_end_ = 0;
  batch_extended_ = batch_failed_ = false;
  if (!trim) return absl::OkStatus();
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  const uint64_t padded = (max_end / alignment.offset + 1) * alignment.offset;
  if (static_cast<uint64_t>(st.st_size) == padded &&
      ftruncate(fd, static_cast<off_t>(max_end)) != 0) {
    return ErrnoStatus(errno, "ftruncate", path, max_end);
  }
  return absl::OkStatus();
}

int EngineShared::FindRegion(const std::byte* p, uint64_t length) {
  if (region_count.load(std::memory_order_acquire) == 0) return -1;
  const auto begin = reinterpret_cast<uintptr_t>(p);
  MutexLock lock(&mu);
  for (const Region& r : regions) {
    if (begin >= r.begin && begin + length <= r.end) return r.index;
  }
  return -1;
}

void Request::Fail(absl::Status error) {
  {
    MutexLock lock(&mu);
    if (status_.ok()) status_ = std::move(error);
  }
  failed_.store(true, std::memory_order_release);  // only once the error is there to be found
}

absl::Status Request::status() const {
  MutexLock lock(&mu);
  return Unshared(status_);  // read on several workers' threads: each frees its own
}

Worker::Worker(WorkerConfig config, std::unique_ptr<Backend> backend, AlignedBuffer staging,
               size_t staging_count, uint64_t slot_bytes, EngineShared* shared)
    : config_(config),
      backend_(std::move(backend)),
      staging_(std::move(staging)),
      slot_bytes_(slot_bytes),
      staging_index_(staging_count, -1),
      shared_(shared) {
  for (int i = static_cast<int>(staging_count) - 1; i >= 0; --i) free_staging_.push_back(i);
}

Worker::~Worker() { Stop(); }

void Worker::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  if (thread_.joinable()) thread_.join();
}

void Worker::Start() {
  thread_ = std::thread([this] { Run(); });
}

void Worker::Enqueue(const std::vector<Piece*>& pieces) {
  if (pieces.empty()) return;
  {
    MutexLock lock(&mu_);
    queue_.insert(queue_.end(), pieces.begin(), pieces.end());
  }
  cv_.Signal();
}

void Worker::ResetStats() {
  MutexLock lock(&mu_);
  stats_ = EngineStats();
}

void Worker::AddStats(EngineStats* out) const {
  MutexLock lock(&mu_);
  out->requests += stats_.requests;
  out->failed_requests += stats_.failed_requests;
  out->bytes_read += stats_.bytes_read;
  out->bytes_written += stats_.bytes_written;
  out->read_ops += stats_.read_ops;
  out->write_ops += stats_.write_ops;
  out->retries += stats_.retries;
  out->staged_pieces += stats_.staged_pieces;
  out->queue_full_seconds += stats_.queue_full_seconds;
  out->piece_latency.Merge(stats_.piece_latency);
}

void Worker::Run() {
  const size_t depth = static_cast<size_t>(config_.queue_depth);
  std::deque<Piece*> ready;  // Pieces to (re)submit, in order.
  std::vector<OpResult> results(depth);
  batch_.reserve(depth);
  while (true) {
    bool waiting_more;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && ready.empty() && in_flight_.empty() && copy_out_.empty() &&
             !stopping_) {
        cv_.Wait(&mu_);
      }
      if (queue_.empty() && ready.empty() && in_flight_.empty() && copy_out_.empty()) return;
      const size_t room = depth - in_flight_.size();
      while (ready.size() < room && !queue_.empty()) {
        ready.push_back(queue_.front());
        queue_.pop_front();
      }
      waiting_more = !queue_.empty();
    }

    SubmitReady(&ready);
    // Staged reads that completed: copy out now that the queue is full again, so the copies
    // overlap the transfers in flight; each copy frees a staging slot, which is refilled at once
    // (a read waiting for a slot would otherwise wait for every copy before it).
    for (Piece* piece : copy_out_) {
      StreamCopy(piece->user, piece->io_buf + (piece->offset - piece->io_offset), piece->length);
      Finish(piece, absl::OkStatus());
      SubmitReady(&ready);
    }
    copy_out_.clear();
    if (in_flight_.empty()) continue;

    // Reap.
    const bool queue_full = in_flight_.size() == depth && (waiting_more || !ready.empty());
    const size_t min_results = config_.overlap_events ? 1 : in_flight_.size();
    const Clock::time_point reap_start = Clock::now();
    absl::StatusOr<size_t> reaped = backend_->Reap(absl::MakeSpan(results), min_results);
    if (!reaped.ok()) {
      FailAll(Annotate(reaped.status(), backend_->name()), &ready);
      continue;
    }
    if (queue_full) {
      MutexLock lock(&mu_);
      stats_.queue_full_seconds += std::chrono::duration<double>(Clock::now() - reap_start).count();
    }
    for (size_t i = 0; i < *reaped; ++i) {
      auto* piece = reinterpret_cast<Piece*>(static_cast<uintptr_t>(results[i].tag));
      STRATA_CHECK(in_flight_.erase(piece) == 1, "aio: a completion for a piece not in flight");
      Handle(piece, results[i].result, &ready);
    }
  }
}

// Submits what is ready, up to the queue depth; without overlap_events a new batch starts only
// when the last one is all reaped.
void Worker::SubmitReady(std::deque<Piece*>* ready) {
  if (!config_.overlap_events && !in_flight_.empty()) return;
  const size_t depth = static_cast<size_t>(config_.queue_depth);
  std::vector<Op>& batch = batch_;
  batch.clear();
  uint64_t reads = 0, writes = 0, staged = 0;
  for (auto it = ready->begin(); it != ready->end() && in_flight_.size() < depth;) {
    Piece* piece = *it;
    // A write copied into staging first: what is batched goes to the disk before the copy,
    // so that the disk works while this thread copies (after a reap of several completions,
    // copying them all before submitting any left the disk's queue that much emptier).
    if (!batch.empty() && !piece->started && piece->staged && piece->phase != Phase::kRead) {
      absl::Status s = backend_->Submit(batch);
      batch.clear();
      if (!s.ok()) {
        FailAll(Annotate(s, backend_->name()), ready);
        break;
      }
    }
    Op op;
    const bool first = !piece->started;
    const Prepared prepared = Prepare(piece, &op);
    if (prepared == Prepared::kNoStaging) {
      ++it;
      continue;
    }
    it = ready->erase(it);
    if (prepared == Prepared::kCancelled) {
      Finish(piece, absl::CancelledError("an earlier piece of the request failed"));
      continue;
    }
    if (first && piece->staged) ++staged;
    (op.kind == OpKind::kRead ? reads : writes) += 1;
    in_flight_.insert(piece);
    if (config_.single_submit) {
      absl::Status s = backend_->Submit({&op, 1});
      if (!s.ok()) {
        FailAll(Annotate(s, backend_->name()), ready);
        break;
      }
    } else {
      batch.push_back(op);
    }
  }
  if (!batch.empty()) {
    absl::Status s = backend_->Submit(batch);
    if (!s.ok()) FailAll(Annotate(s, backend_->name()), ready);
  }
  MutexLock lock(&mu_);
  stats_.read_ops += reads;
  stats_.write_ops += writes;
  stats_.staged_pieces += staged;
}

Worker::Prepared Worker::Prepare(Piece* piece, Op* op) {
  Request& request = *piece->request;
  if (request.failed() || !broken_.ok()) {
    if (!broken_.ok()) request.Fail(broken_);
    return Prepared::kCancelled;
  }
  if (!piece->started) {
    if (piece->staged) {
      if (free_staging_.empty()) return Prepared::kNoStaging;
      piece->staging_slot = free_staging_.back();
      free_staging_.pop_back();
      piece->io_buf = staging(static_cast<size_t>(piece->staging_slot));
      piece->buf_index = staging_index_[piece->staging_slot];
      std::byte* user_in_staging = piece->io_buf + (piece->offset - piece->io_offset);
      if (piece->phase == Phase::kWrite) {
        StreamCopy(user_in_staging, piece->user, piece->length);
      } else if (piece->phase == Phase::kFillForWrite && piece->required == 0) {
        // The covering block lies wholly past the end of the file: nothing to read first.
        std::memset(piece->io_buf, 0, piece->io_length);
        StreamCopy(user_in_staging, piece->user, piece->length);
        piece->phase = Phase::kWrite;
        piece->required = piece->io_length;
      }
    } else {
      piece->io_buf = piece->user;
      piece->buf_index = shared_->FindRegion(piece->user, piece->length);
    }
    piece->started = true;
    piece->start = Clock::now();
  }
  const FileEntry& file = *request.file;
  op->tag = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(piece));
  op->kind = piece->phase == Phase::kWrite ? OpKind::kWrite : OpKind::kRead;
  op->fd = file.fd;
  op->file_slot = file.slot;
  op->buf = piece->io_buf + piece->done;
  op->length = piece->io_length - piece->done;
  op->offset = piece->io_offset + piece->done;
  op->buf_index = piece->buf_index;
  return Prepared::kReady;
}

void Worker::Handle(Piece* piece, int64_t result, std::deque<Piece*>* ready) {
  const FileEntry& file = *piece->request->file;
  if (result == -EINTR || result == -EAGAIN) {
    if (++piece->transient_retries > kMaxTransientRetries) {
      Finish(piece, ErrnoStatus(static_cast<int>(-result), OpName(*piece), file.path,
                                piece->io_offset + piece->done, piece->io_length - piece->done));
      return;
    }
    {
      MutexLock lock(&mu_);
      ++stats_.retries;
    }
    ready->push_back(piece);
    return;
  }
  if (result < 0) {
    Finish(piece, ErrnoStatus(static_cast<int>(-result), OpName(*piece), file.path,
                              piece->io_offset + piece->done, piece->io_length - piece->done));
    return;
  }
  const uint64_t reached = piece->done + static_cast<uint64_t>(result);
  const bool reading = piece->phase != Phase::kWrite;
  if (reading && reached >= piece->required) {
    if (piece->phase == Phase::kRead) {
      if (piece->staged) {
        copy_out_.push_back(piece);  // copied after the queue is refilled
      } else {
        Finish(piece, absl::OkStatus());
      }
      return;
    }
    // kFillForWrite: the covering block is in; zero what lies past the end of the file, patch in
    // the caller's bytes and write the block whole.
    if (reached < piece->io_length) {
      std::memset(piece->io_buf + reached, 0, piece->io_length - reached);
    }
    StreamCopy(piece->io_buf + (piece->offset - piece->io_offset), piece->user, piece->length);
    piece->phase = Phase::kWrite;
    piece->done = 0;
    piece->required = piece->io_length;
    piece->stalls = 0;
    ready->push_back(piece);
    return;
  }
  if (!reading && reached >= piece->io_length) {
    Finish(piece, absl::OkStatus());
    return;
  }
  if (reading && (result == 0 || (file.direct && reached % file.alignment.offset != 0))) {
    // Zero bytes, or an O_DIRECT read cut short off the alignment: has the file ended?
    struct stat st;
    if (fstat(file.fd, &st) != 0) {
      Finish(piece, ErrnoStatus(errno, "fstat", file.path));
      return;
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    if (size <= piece->io_offset + reached) {
      Finish(piece, absl::OutOfRangeError(absl::StrCat(
                        "read ", file.path, " @ ", piece->offset, " len ", piece->length,
                        ": the file ends at ", size,
                        ", before the last byte asked for (a read must come back whole)")));
      return;
    }
  }
  // A short transfer: continue from an aligned point.
  const uint64_t progress_to = file.direct ? AlignDown(reached, file.alignment.offset) : reached;
  if (progress_to <= piece->done) {
    if (++piece->stalls > kMaxStalls) {
      Finish(piece, absl::DataLossError(absl::StrCat(
                        OpName(*piece), " ", file.path, " @ ", piece->io_offset + piece->done,
                        " len ", piece->io_length - piece->done, ": no progress after ", kMaxStalls,
                        " short transfers")));
      return;
    }
  } else {
    piece->done = static_cast<uint32_t>(progress_to);
  }
  {
    MutexLock lock(&mu_);
    ++stats_.retries;
  }
  ready->push_back(piece);
}

void Worker::Finish(Piece* piece, absl::Status status) {
  Request* request = piece->request;
  if (piece->staging_slot >= 0) {
    free_staging_.push_back(piece->staging_slot);
    piece->staging_slot = -1;
  }
  const bool ok = status.ok();
  if (!ok) request->Fail(std::move(status));
  {
    MutexLock lock(&mu_);
    if (piece->started) {
      stats_.piece_latency.Record(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - piece->start)
              .count()));
    }
    if (ok) {
      (request->kind == OpKind::kRead ? stats_.bytes_read : stats_.bytes_written) += piece->length;
    }
  }
  if (request->pieces_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;

  // The last piece: finish the request.
  absl::Status final_status = request->status();
  if (request->size_before >= 0) {
    final_status.Update(
        request->file->EndWrite(request->offset + request->length, final_status.ok()));
  }
  {
    MutexLock lock(&mu_);
    ++stats_.requests;
    if (!final_status.ok()) ++stats_.failed_requests;
  }
  IoCallback done = std::move(request->done);
  delete request;
  std::move(done)(std::move(final_status));
}

void Worker::FailAll(const absl::Status& status, std::deque<Piece*>* ready) {
  // A backend error that is not about one op (the ring or context itself failed): nothing this
  // worker holds can complete, and later pieces are failed as they arrive.
  broken_ = status;
  std::vector<Piece*> held(in_flight_.begin(), in_flight_.end());
  in_flight_.clear();
  held.insert(held.end(), ready->begin(), ready->end());
  ready->clear();
  for (Piece* piece : held) Finish(piece, status);
}

}  // namespace strata::aio::internal
