#include "aio/engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "aio/internal/worker.h"
#include "base/check.h"
#include "base/status.h"

namespace strata::aio {
namespace {

using internal::FileEntry;
using internal::Phase;
using internal::Piece;
using internal::Request;

constexpr uint64_t kMaxRegisteredBufferBytes = 1ull << 30;  // io_uring's limit per buffer

uint64_t AlignDown(uint64_t v, uint64_t a) { return v / a * a; }
uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint32_t ReadSysfsNumber(const std::string& path) {
  std::ifstream in(path);
  uint32_t value = 0;
  if (!(in >> value)) return 0;
  return value;
}

// The O_DIRECT alignment of an open file: statx(STATX_DIOALIGN), else the logical block size of
// the device under it, else 4096.
DirectIoAlignment ProbeDirectIoAlignment(int fd) {
  struct statx stx = {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
      stx.stx_dio_offset_align > 0 && stx.stx_dio_mem_align > 0) {
    return {stx.stx_dio_mem_align, stx.stx_dio_offset_align, "statx"};
  }
  struct stat st;
  if (fstat(fd, &st) == 0) {
    const std::string dev =
        absl::StrCat("/sys/dev/block/", major(st.st_dev), ":", minor(st.st_dev));
    uint32_t lbs = ReadSysfsNumber(dev + "/queue/logical_block_size");
    if (lbs == 0) lbs = ReadSysfsNumber(dev + "/../queue/logical_block_size");  // a partition
    if (lbs > 0) return {lbs, lbs, "logical block size"};
  }
  return {4096, 4096, "default"};
}

}  // namespace

// --- File -------------------------------------------------------------------------------------

const std::string& File::path() const { return entry_->path; }
int File::fd() const { return entry_->fd; }
bool File::direct() const { return entry_->direct; }
bool File::writable() const { return entry_->writable; }
const DirectIoAlignment& File::alignment() const { return entry_->alignment; }

absl::StatusOr<uint64_t> File::Size() const {
  struct stat st;
  if (fstat(entry_->fd, &st) != 0) return ErrnoStatus(errno, "fstat", entry_->path);
  return static_cast<uint64_t>(st.st_size);
}

absl::Status File::Truncate(uint64_t size_bytes) const {
  if (ftruncate(entry_->fd, static_cast<off_t>(size_bytes)) != 0) {
    return ErrnoStatus(errno, "ftruncate", entry_->path, size_bytes);
  }
  return absl::OkStatus();
}

absl::Status File::Allocate(uint64_t offset, uint64_t length) const {
  if (fallocate(entry_->fd, 0, static_cast<off_t>(offset), static_cast<off_t>(length)) != 0) {
    return ErrnoStatus(errno, "fallocate", entry_->path, offset, length);
  }
  return absl::OkStatus();
}

absl::Status File::Sync() const {
  if (fdatasync(entry_->fd) != 0) return ErrnoStatus(errno, "fdatasync", entry_->path);
  return absl::OkStatus();
}

// --- Engine -----------------------------------------------------------------------------------

void Engine::Warn(std::string message) {
  if (options_.on_warning) {
    options_.on_warning(message);
  } else {
    std::fprintf(stderr, "aio: %s\n", message.c_str());
  }
  warnings_.push_back(std::move(message));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const AioConfig& config,
                                                       EngineOptions options) {
  STRATA_RETURN_IF_ERROR(Validate(config));
  if (options.max_registered_buffers < 0 || options.max_registered_files < 0) {
    return absl::InvalidArgumentError(
        "EngineOptions: max_registered_buffers and max_registered_files must be >= 0");
  }
  auto engine = std::unique_ptr<Engine>(new Engine());
  engine->config_ = config;
  engine->options_ = std::move(options);
  engine->shared_ = std::make_unique<internal::EngineShared>();
  engine->probe_ = ProbeSystem();
  AioConfig& c = engine->config_;
  const SystemProbe& probe = engine->probe_;

  // Choose the backend: the one asked for, else the next that works.
  std::vector<EngineKind> order;
  switch (c.engine) {
    case EngineKind::kIoUring:
      order = {EngineKind::kIoUring, EngineKind::kLibAio, EngineKind::kPosix};
      break;
    case EngineKind::kLibAio:
      order = {EngineKind::kLibAio, EngineKind::kPosix};
      break;
    case EngineKind::kPosix:
      order = {EngineKind::kPosix};
      break;
  }
  const int threads = c.intra_op_parallelism;
  std::vector<std::unique_ptr<Backend>> backends;
  for (size_t k = 0; k < order.size() && backends.empty(); ++k) {
    BackendOptions bo{c.queue_depth, c.sqpoll && order[k] == EngineKind::kIoUring,
                      c.sqpoll_idle_ms};
    absl::Status failure;
    for (int i = 0; i < threads; ++i) {
      absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(order[k], bo);
      if (!b.ok() && bo.sqpoll) {
        engine->Warn(absl::StrCat("SQPOLL refused (", b.status().message(),
                                  "); running io_uring without it"));
        c.sqpoll = bo.sqpoll = false;
        b = CreateBackend(order[k], bo);
      }
      if (!b.ok()) {
        failure = b.status();
        break;
      }
      backends.push_back(*std::move(b));
    }
    if (!failure.ok()) {
      backends.clear();
      if (k + 1 == order.size()) return Annotate(failure, "aio: no backend could be created");
      engine->Warn(absl::StrCat(EngineKindName(order[k]), " unavailable (", failure.message(),
                                "); falling back to ", EngineKindName(order[k + 1])));
      continue;
    }
    c.engine = order[k];
  }
  engine->backend_name_ = std::string(EngineKindName(c.engine));
  if (c.engine != EngineKind::kIoUring) {
    if (c.registered_buffers) engine->Warn("registered buffers need io_uring; turned off");
    if (c.registered_files) engine->Warn("registered files need io_uring; turned off");
    if (c.sqpoll) engine->Warn("SQPOLL needs io_uring; turned off");
    c.registered_buffers = c.registered_files = c.sqpoll = false;
  }

  // Staging buffers: the queue depth plus a quarter (so the queue can be refilled while completed
  // reads are copied out), within the per-worker byte budget.
  const uint64_t staging = std::min<uint64_t>(
      c.queue_depth + std::max(1, c.queue_depth / 4),
      std::max<uint64_t>(2, engine->options_.staging_bytes_per_worker / c.block_size));
  engine->staging_per_worker_ = static_cast<int>(staging);
  const uint64_t staging_bytes = staging * c.block_size * static_cast<uint64_t>(threads);
  if (c.registered_buffers && !probe.io_uring_fixed_rw) {
    engine->Warn("the kernel lacks READ_FIXED/WRITE_FIXED; registered buffers turned off");
    c.registered_buffers = false;
  }
  if (c.registered_buffers && probe.LockableBytes() < staging_bytes) {
    engine->Warn(absl::StrCat("registered buffers need ", staging_bytes,
                              " bytes of locked memory but RLIMIT_MEMLOCK allows ",
                              probe.memlock_limit_bytes,
                              " (raise it or grant CAP_IPC_LOCK); turned off"));
    c.registered_buffers = false;
  }

  for (int i = 0; i < threads; ++i) {
    // Huge pages matter here: a 1 MiB O_DIRECT transfer from 4 KiB pages pins 256 pages and, on
    // devices with max_segments < 256 (virtio-blk: 254), is split in two; from one 2 MiB page it
    // is one segment. Measured on this project's virtual disk: 2.6x the read bandwidth.
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer region,
                            AlignedBuffer::Allocate(staging * c.block_size, {.huge_pages = true}));
    std::unique_ptr<Backend> backend = std::move(backends[i]);
    if (engine->options_.wrap_backend) {
      backend = engine->options_.wrap_backend(std::move(backend), i);
    }
    internal::WorkerConfig wc{i, c.queue_depth, c.single_submit, c.overlap_events};
    engine->workers_.push_back(std::make_unique<internal::Worker>(
        wc, std::move(backend), std::move(region), staging, c.block_size, engine->shared_.get()));
  }

  // Registration, all or nothing across the workers.
  if (c.registered_buffers) {
    absl::Status s;
    const int table = static_cast<int>(staging) + engine->options_.max_registered_buffers;
    for (auto& w : engine->workers_) {
      s.Update(w->backend().RegisterBufferTable(table));
      for (size_t b = 0; s.ok() && b < w->staging_count(); ++b) {
        s.Update(
            w->backend().UpdateBuffer(static_cast<int>(b), iovec{w->staging(b), w->slot_bytes()}));
      }
      if (!s.ok()) break;
    }
    if (s.ok()) {
      for (auto& w : engine->workers_) {
        for (size_t b = 0; b < w->staging_count(); ++b) w->SetStagingIndex(b, static_cast<int>(b));
      }
      MutexLock lock(&engine->shared_->mu);
      engine->shared_->buffer_index_used.assign(engine->options_.max_registered_buffers, false);
    } else {
      engine->Warn(absl::StrCat("registering buffers failed (", s.message(), "); turned off"));
      c.registered_buffers = false;
    }
  }
  if (c.registered_files) {
    absl::Status s;
    for (auto& w : engine->workers_) {
      s.Update(w->backend().RegisterFileTable(engine->options_.max_registered_files));
    }
    if (s.ok()) {
      MutexLock lock(&engine->shared_->mu);
      engine->shared_->file_slot_used.assign(engine->options_.max_registered_files, false);
    } else {
      engine->Warn(absl::StrCat("registering files failed (", s.message(), "); turned off"));
      c.registered_files = false;
    }
  }
  for (auto& w : engine->workers_) w->Start();
  return engine;
}

Engine::~Engine() {
  // Finish every request first: the last request of a closed File releases its slot through
  // ReleaseFileSlot, which walks workers_, so no worker may be destroyed before all have stopped.
  for (auto& w : workers_) w->Stop();
  STRATA_CHECK(shared_->open_files.load(std::memory_order_acquire) == 0,
               "aio::Engine destroyed while a File it opened is still open; close (destroy) "
               "every File before its Engine");
  workers_.clear();
}

absl::StatusOr<File> Engine::Open(const std::string& path, OpenOptions options) {
  int flags = O_CLOEXEC | (options.writable ? O_RDWR : O_RDONLY);
  if (options.create) flags |= O_CREAT;
  if (options.exclusive) flags |= O_EXCL;
  if (options.truncate) flags |= O_TRUNC;
  if (config_.direct) flags |= O_DIRECT;
  const int fd = open(path.c_str(), flags, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EINVAL && config_.direct) {
      return absl::FailedPreconditionError(
          absl::StrCat("open ", path,
                       ": the filesystem refuses O_DIRECT (tmpfs does); put the file on one "
                       "that accepts it, or set strata.aio.direct to false to run buffered"));
    }
    return ErrnoStatus(err, "open", path);
  }
  auto entry = std::make_shared<FileEntry>();
  entry->engine = this;
  entry->shared = shared_.get();
  shared_->open_files.fetch_add(1, std::memory_order_acq_rel);
  entry->path = path;
  entry->fd = fd;
  entry->direct = config_.direct;
  entry->writable = options.writable;
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  if (S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("open ", path, ": is a directory"));
  }
  if (config_.direct) {
    entry->alignment = ProbeDirectIoAlignment(fd);
    if (config_.block_size % entry->alignment.offset != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: aio.block_size: ", config_.block_size, " is not a multiple of ", path,
          "'s O_DIRECT offset alignment ", entry->alignment.offset, " (from ",
          entry->alignment.source, "); accepted: multiples of ", entry->alignment.offset));
    }
    if (entry->alignment.memory > 4096) {
      return absl::InvalidArgumentError(absl::StrCat("open ", path, ": O_DIRECT memory alignment ",
                                                     entry->alignment.memory,
                                                     " is larger than a page; not supported"));
    }
  }
  if (config_.registered_files) {
    int slot = -1;
    {
      MutexLock lock(&shared_->mu);
      auto& used = shared_->file_slot_used;
      auto it = std::find(used.begin(), used.end(), false);
      if (it != used.end()) {
        slot = static_cast<int>(it - used.begin());
        *it = true;
      }
    }
    if (slot >= 0) {
      absl::Status s;
      for (auto& w : workers_) s.Update(w->backend().UpdateFile(slot, fd));
      if (s.ok()) {
        entry->slot = slot;
      } else {
        ReleaseFileSlot(slot);
        return Annotate(s, absl::StrCat("registering ", path));
      }
    }
  }
  return File(std::move(entry));
}

void Engine::ReleaseFileSlot(int slot) {
  for (auto& w : workers_) w->backend().UpdateFile(slot, -1).IgnoreError();
  MutexLock lock(&shared_->mu);
  shared_->file_slot_used[slot] = false;
}

void Engine::Submit(const File& file, OpKind kind, uint64_t offset, std::byte* buffer,
                    uint64_t length, IoCallback done) {
  if (!file.is_open()) {
    std::move(done)(absl::FailedPreconditionError("aio: the file is not open"));
    return;
  }
  const std::shared_ptr<FileEntry>& entry = file.entry_;
  if (entry->engine != this) {
    std::move(done)(absl::InvalidArgumentError(
        absl::StrCat("aio: ", entry->path, " was opened by another engine")));
    return;
  }
  if (kind == OpKind::kWrite && !entry->writable) {
    std::move(done)(absl::FailedPreconditionError(
        absl::StrCat("write ", entry->path, ": the file was opened read-only")));
    return;
  }
  if (offset + length < offset) {
    std::move(done)(absl::InvalidArgumentError(
        absl::StrCat("aio: ", entry->path, " @ ", offset, " len ", length, " overflows")));
    return;
  }
  if (length == 0) {
    std::move(done)(absl::OkStatus());
    return;
  }

  auto* request = new Request();
  request->file = entry;
  request->kind = kind;
  request->offset = offset;
  request->length = length;
  request->done = std::move(done);

  const uint64_t bs = config_.block_size;
  const uint64_t end = offset + length;
  const uint64_t align = entry->alignment.offset;
  const uint64_t mem_align = entry->alignment.memory;
  if (kind == OpKind::kWrite && entry->direct) {
    absl::StatusOr<uint64_t> size = entry->BeginWrite(end);
    if (!size.ok()) {
      IoCallback cb = std::move(request->done);
      delete request;
      std::move(cb)(size.status());
      return;
    }
    request->size_before = static_cast<int64_t>(*size);
  }

  const uint64_t first_block = offset / bs;
  const uint64_t last_block = (end - 1) / bs;
  request->pieces.resize(last_block - first_block + 1);
  for (uint64_t b = first_block; b <= last_block; ++b) {
    Piece& p = request->pieces[b - first_block];
    p.request = request;
    p.offset = std::max(offset, b * bs);
    const uint64_t piece_end = std::min(end, (b + 1) * bs);
    p.length = static_cast<uint32_t>(piece_end - p.offset);
    p.user = buffer + (p.offset - offset);
    const bool aligned = p.offset % align == 0 && piece_end % align == 0 &&
                         reinterpret_cast<uintptr_t>(p.user) % mem_align == 0;
    if (aligned) {
      p.io_offset = p.offset;
      p.io_length = p.length;
      p.phase = kind == OpKind::kRead ? Phase::kRead : Phase::kWrite;
      p.required = p.length;
      continue;
    }
    p.staged = true;
    p.io_offset = AlignDown(p.offset, align);
    p.io_length = static_cast<uint32_t>(AlignUp(piece_end, align) - p.io_offset);
    if (kind == OpKind::kRead) {
      p.phase = Phase::kRead;
      p.required = static_cast<uint32_t>(piece_end - p.io_offset);
    } else if (p.io_offset == p.offset && p.io_length == p.length) {
      p.phase = Phase::kWrite;  // Only the buffer is misaligned: copy in, no read first.
      p.required = p.io_length;
    } else {
      p.phase = Phase::kFillForWrite;
      const int64_t existing = request->size_before - static_cast<int64_t>(p.io_offset);
      p.required = static_cast<uint32_t>(std::clamp<int64_t>(existing, 0, p.io_length));
    }
  }

  // Round-robin over the workers, starting where the last request left off.
  const size_t n = workers_.size();
  std::vector<std::vector<Piece*>> per_worker(n);
  const uint64_t start = shared_->next_worker.fetch_add(1, std::memory_order_relaxed);
  for (size_t i = 0; i < request->pieces.size(); ++i) {
    per_worker[(start + i) % n].push_back(&request->pieces[i]);
  }
  request->pieces_left.store(request->pieces.size(), std::memory_order_release);
  // After the last Enqueue the request may already be complete and deleted.
  for (size_t w = 0; w < n; ++w) workers_[w]->Enqueue(per_worker[w]);
}

void Engine::Read(const File& file, uint64_t offset, absl::Span<std::byte> buffer,
                  IoCallback done) {
  Submit(file, OpKind::kRead, offset, buffer.data(), buffer.size(), std::move(done));
}

void Engine::Write(const File& file, uint64_t offset, absl::Span<const std::byte> buffer,
                   IoCallback done) {
  // The engine only reads a write's buffer; the cast lets reads and writes share one path.
  Submit(file, OpKind::kWrite, offset, const_cast<std::byte*>(buffer.data()), buffer.size(),
         std::move(done));
}

std::future<absl::Status> Engine::ReadAsync(const File& file, uint64_t offset,
                                            absl::Span<std::byte> buffer) {
  std::promise<absl::Status> promise;
  std::future<absl::Status> future = promise.get_future();
  Read(file, offset, buffer,
       [p = std::move(promise)](absl::Status s) mutable { p.set_value(std::move(s)); });
  return future;
}

std::future<absl::Status> Engine::WriteAsync(const File& file, uint64_t offset,
                                             absl::Span<const std::byte> buffer) {
  std::promise<absl::Status> promise;
  std::future<absl::Status> future = promise.get_future();
  Write(file, offset, buffer,
        [p = std::move(promise)](absl::Status s) mutable { p.set_value(std::move(s)); });
  return future;
}

absl::Status Engine::ReadSync(const File& file, uint64_t offset, absl::Span<std::byte> buffer) {
  return ReadAsync(file, offset, buffer).get();
}

absl::Status Engine::WriteSync(const File& file, uint64_t offset,
                               absl::Span<const std::byte> buffer) {
  return WriteAsync(file, offset, buffer).get();
}

absl::Status Engine::RegisterBuffer(absl::Span<std::byte> buffer) {
  if (!config_.registered_buffers) return absl::OkStatus();
  if (buffer.empty() || buffer.size() > kMaxRegisteredBufferBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RegisterBuffer: size ", buffer.size(), " outside [1, ", kMaxRegisteredBufferBytes, "]"));
  }
  int index = -1;
  {
    MutexLock lock(&shared_->mu);
    auto& used = shared_->buffer_index_used;
    auto it = std::find(used.begin(), used.end(), false);
    if (it == used.end()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("RegisterBuffer: all ", used.size(), " registered-buffer slots are taken"));
    }
    *it = true;
    index = staging_per_worker_ + static_cast<int>(it - used.begin());
  }
  absl::Status s;
  for (auto& w : workers_) {
    s.Update(w->backend().UpdateBuffer(index, iovec{buffer.data(), buffer.size()}));
  }
  MutexLock lock(&shared_->mu);
  if (!s.ok()) {
    shared_->buffer_index_used[index - staging_per_worker_] = false;
    return s;
  }
  const auto begin = reinterpret_cast<uintptr_t>(buffer.data());
  shared_->regions.push_back({begin, begin + buffer.size(), index});
  shared_->region_count.store(static_cast<int>(shared_->regions.size()), std::memory_order_release);
  return absl::OkStatus();
}

absl::Status Engine::UnregisterBuffer(absl::Span<std::byte> buffer) {
  if (!config_.registered_buffers) return absl::OkStatus();
  int index = -1;
  {
    MutexLock lock(&shared_->mu);
    const auto begin = reinterpret_cast<uintptr_t>(buffer.data());
    auto& regions = shared_->regions;
    auto it = std::find_if(regions.begin(), regions.end(), [&](const auto& r) {
      return r.begin == begin && r.end == begin + buffer.size();
    });
    if (it == regions.end()) {
      return absl::NotFoundError("UnregisterBuffer: this buffer is not registered");
    }
    index = it->index;
    regions.erase(it);
    shared_->region_count.store(static_cast<int>(regions.size()), std::memory_order_release);
  }
  absl::Status s;
  for (auto& w : workers_) s.Update(w->backend().UpdateBuffer(index, iovec{nullptr, 0}));
  MutexLock lock(&shared_->mu);
  shared_->buffer_index_used[index - staging_per_worker_] = false;
  return s;
}

void Engine::ResetStats() {
  for (auto& w : workers_) w->ResetStats();
}

EngineStats Engine::Stats() const {
  EngineStats stats;
  for (const auto& w : workers_) w->AddStats(&stats);
  return stats;
}

}  // namespace strata::aio
