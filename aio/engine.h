// aio/engine.h: strata's asynchronous file I/O engine.
//
// An Engine moves bytes between file regions and host buffers. A request of any size, offset and
// buffer alignment is split at file offsets that are multiples of block_size into pieces; the
// pieces are spread round-robin over intra_op_parallelism worker threads, each of which owns one
// Backend (io_uring by default, libaio, or pread/pwrite) and keeps up to queue_depth pieces in
// flight. A request completes when all its pieces have.
//
// O_DIRECT: files are opened with O_DIRECT unless AioConfig::direct is false; their alignment comes
// from statx(STATX_DIOALIGN), else the device's logical block size, else 4096. A piece whose
// buffer, offset or length is not aligned goes through one of the worker's staging buffers
// (allocated, and registered with io_uring when asked, once at creation): reads read the covering
// aligned range and copy out; writes whose edges are unaligned read the covering block first
// (read-modify-write), patch it and write it whole. O_DIRECT is never dropped quietly. A write
// that extends the file to an unaligned end leaves the file exactly offset + length long.
// Concurrent unaligned writes that share one aligned block must be ordered by the caller.
//
// Errors: short transfers, EINTR and EAGAIN are resubmitted in exactly one place (the worker's
// completion handler); any other error fails the request with a status naming the operation, the
// file, the offset, the length and the errno (StatusErrno() gives it back). A read that meets the
// end of the file before its last byte is OutOfRange: a request comes back whole or fails. After a
// failure the request's pieces not yet submitted are dropped; pieces in flight finish, so when the
// callback runs the engine no longer touches the caller's buffer.
//
// At creation the engine probes the kernel and limits (aio/probe.h) and falls back io_uring ->
// libaio -> posix, and drops registered buffers, registered files or SQPOLL when they cannot be
// had, each time with a warning (EngineOptions::on_warning, and Engine::warnings()).
//
// Ownership and threads: the Engine is thread-safe: any thread may open files and submit. The
// caller's buffer must stay valid until the request completes. Callbacks run on a worker thread:
// they must be short and must not wait on the engine (the synchronous helpers would deadlock
// there). A File must be closed (destroyed) before its Engine. Destroying the Engine completes
// every request already submitted, then joins the workers.
#ifndef STRATA_AIO_ENGINE_H_
#define STRATA_AIO_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "aio/backend.h"
#include "aio/config.h"
#include "aio/probe.h"
#include "aio/stats.h"

namespace strata::aio {

class Engine;
namespace internal {
struct EngineShared;
struct FileEntry;
class Worker;
}  // namespace internal

// O_DIRECT alignment of one file, and where it came from ("statx", "logical block size",
// "default", or "none" for a file opened without O_DIRECT).
struct DirectIoAlignment {
  uint32_t memory = 1;
  uint32_t offset = 1;
  std::string source = "none";
};

struct OpenOptions {
  bool writable = false;   // O_RDWR, else O_RDONLY.
  bool create = false;     // O_CREAT, mode 0600.
  bool exclusive = false;  // O_EXCL: fail when the file exists.
  bool truncate = false;   // O_TRUNC.
};

// A file opened through an Engine. Move-only; closing (or destroying) it releases its registered
// slot and closes the descriptor once no request of the engine still uses it.
class File {
 public:
  File() = default;
  File(File&&) noexcept = default;
  File& operator=(File&&) noexcept = default;
  ~File() = default;

  bool is_open() const { return entry_ != nullptr; }
  const std::string& path() const;
  int fd() const;
  bool direct() const;
  bool writable() const;
  const DirectIoAlignment& alignment() const;
  // The file's current size (fstat).
  absl::StatusOr<uint64_t> Size() const;
  // Sets the size (ftruncate) / reserves space (fallocate, mode 0).
  absl::Status Truncate(uint64_t size_bytes) const;
  absl::Status Allocate(uint64_t offset, uint64_t length) const;
  // fdatasync.
  absl::Status Sync() const;
  void Close() { entry_.reset(); }

 private:
  friend class Engine;
  explicit File(std::shared_ptr<internal::FileEntry> entry) : entry_(std::move(entry)) {}
  std::shared_ptr<internal::FileEntry> entry_;
};

struct EngineOptions {
  // Called with every fallback and notice (default: printed to stderr with an "aio:" prefix).
  std::function<void(absl::string_view)> on_warning;
  // Wraps each worker's backend; tests pass a FaultInjectingBackend factory here.
  std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>, int worker_index)> wrap_backend;
  // Staging buffers per worker = min(queue_depth * 5/4 (at least +1),
  //                                  max(2, staging_bytes_per_worker / block_size)).
  uint64_t staging_bytes_per_worker = 64ull << 20;
  // Buffers that Engine::RegisterBuffer may register at once.
  int max_registered_buffers = 64;
  // Files that may be registered at once (files past that use plain descriptors).
  int max_registered_files = 256;
};

using IoCallback = absl::AnyInvocable<void(absl::Status) &&>;

class Engine {
 public:
  // Validates `config` (a bad value is InvalidArgument naming the key and range), probes, falls
  // back as described above, and starts the workers.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const AioConfig& config,
                                                        EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Opens `path`. A missing file without create is NotFound; a directory without write permission
  // is PermissionDenied; a filesystem that refuses O_DIRECT is FailedPrecondition (set
  // strata.aio.direct false to run buffered); block_size not a multiple of the file's O_DIRECT
  // offset alignment is InvalidArgument naming aio.block_size.
  absl::StatusOr<File> Open(const std::string& path, OpenOptions options = {});

  // Asynchronous read/write of [offset, offset + buffer.size()). `done` runs exactly once, on a
  // worker thread (or on this thread when the request is rejected before any I/O: an empty
  // buffer completes OK at once; a closed file or a write to a read-only file is
  // FailedPrecondition).
  void Read(const File& file, uint64_t offset, absl::Span<std::byte> buffer, IoCallback done);
  void Write(const File& file, uint64_t offset, absl::Span<const std::byte> buffer,
             IoCallback done);

  // The same, completed through a future.
  std::future<absl::Status> ReadAsync(const File& file, uint64_t offset,
                                      absl::Span<std::byte> buffer);
  std::future<absl::Status> WriteAsync(const File& file, uint64_t offset,
                                       absl::Span<const std::byte> buffer);

  // Synchronous helpers (never from a callback).
  absl::Status ReadSync(const File& file, uint64_t offset, absl::Span<std::byte> buffer);
  absl::Status WriteSync(const File& file, uint64_t offset, absl::Span<const std::byte> buffer);

  // Registers [buffer.data(), +size) with every worker's io_uring so pieces inside it use
  // READ_FIXED/WRITE_FIXED. A no-op returning OK when registered buffers are off or unavailable.
  // The buffer must stay valid until UnregisterBuffer; at most EngineOptions::
  // max_registered_buffers at once (else ResourceExhausted); each at most 1 GiB (io_uring's limit).
  absl::Status RegisterBuffer(absl::Span<std::byte> buffer);
  absl::Status UnregisterBuffer(absl::Span<std::byte> buffer);

  // The configuration in force (after fallbacks), the backend's name, and the fallbacks taken.
  const AioConfig& config() const { return config_; }
  absl::string_view backend_name() const { return backend_name_; }
  const SystemProbe& probe() const { return probe_; }
  const std::vector<std::string>& warnings() const { return warnings_; }
  int staging_buffers_per_worker() const { return staging_per_worker_; }

  EngineStats Stats() const;
  // Zeroes the statistics (for example after a warm-up).
  void ResetStats();

 private:
  friend struct internal::FileEntry;
  Engine() = default;
  void Submit(const File& file, OpKind kind, uint64_t offset, std::byte* buffer, uint64_t length,
              IoCallback done);
  void ReleaseFileSlot(int slot);
  void Warn(std::string message);

  AioConfig config_;
  EngineOptions options_;
  SystemProbe probe_;
  std::string backend_name_;
  std::vector<std::string> warnings_;
  int staging_per_worker_ = 0;
  std::vector<std::unique_ptr<internal::Worker>> workers_;
  std::unique_ptr<internal::EngineShared> shared_;
};

}  // namespace strata::aio

#endif  // STRATA_AIO_ENGINE_H_
