// tools/aio_bench/scratch.h: the test file the aio tools measure on, made safely.
//
// ScratchFile::Create(dir, name, bytes, options):
//  - checks the directory (CheckMeasuredDirectory: memory and pseudo filesystems);
//  - refuses to start without enough free space in `dir` (the message says how much it needs);
//  - never writes over an existing file unless options.overwrite;
//  - checks that the filesystem takes O_DIRECT; when it does not, it stops with a clear message,
//    unless options.allow_buffered (then direct() is false and warning() says so, to be carried
//    into every output);
//  - lays the file down whole with random bytes (through the aio engine, O_DIRECT when possible);
//  - removes it when destroyed, at exit and on SIGINT/SIGTERM/SIGHUP (the handler unlinks the file
//    and re-raises the signal).
//
// Thread safety: one ScratchFile per process at a time (the signal handler knows one path).
#ifndef STRATA_TOOLS_AIO_BENCH_SCRATCH_H_
#define STRATA_TOOLS_AIO_BENCH_SCRATCH_H_

#include <fcntl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace strata::aio_bench {

struct ScratchOptions {
  bool overwrite = false;
  bool allow_buffered = false;
  // Measure on a memory-backed filesystem (tmpfs, ramfs): the figures are RAM's, not a drive's.
  bool allow_memory_fs = false;
  uint64_t headroom_bytes = 64ull << 20;  // free space to leave beyond the file
  // The open(2) used to ask whether the filesystem takes O_DIRECT. A seam for tests, which
  // stand in a filesystem that refuses it; production code leaves the default.
  std::function<int(const char* path, int flags, mode_t mode)> open_for_probe = ::open;
};

// Checks the directory a tool is told to measure, before anything else: it must exist and be a
// directory (NotFound / FailedPrecondition), on a filesystem that stores data on a drive, where
// this user may make a file (read-only: FailedPrecondition; no write permission:
// PermissionDenied). A kernel pseudo filesystem (proc, sysfs, cgroup, debugfs, ...) is
// InvalidArgument; a
// memory-backed one (tmpfs, ramfs: recent kernels give tmpfs O_DIRECT, so it would pass for a
// very fast drive) is InvalidArgument unless options.allow_memory_fs, and then `*warning` says so
// (for every output to carry). The tools map these to exit code 2.
absl::Status CheckMeasuredDirectory(const std::string& dir, const ScratchOptions& options,
                                    std::string* warning);

// Makes `dir` (and its parents) and checks that a file can be written in it (a probe file of
// its own, removed): the tools call it before measuring, so an unusable --out is found at once,
// not after the sweep. FailedPrecondition naming the directory and the reason.
absl::Status PrepareOutputDirectory(const std::string& dir);

// The same for one output file (--json): its directory is made and checked, and an existing
// `path` must be a writable file; nothing is written to it. An empty path is OK (no output).
absl::Status PrepareOutputFile(const std::string& path);

class ScratchFile {
 public:
  // Errors: FailedPrecondition (file exists, not enough space, O_DIRECT refused), NotFound
  // (dir missing), or the I/O error that stopped the lay-down.
  static absl::StatusOr<std::unique_ptr<ScratchFile>> Create(const std::string& dir,
                                                             const std::string& name,
                                                             uint64_t bytes,
                                                             const ScratchOptions& options);
  ~ScratchFile();
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t bytes() const { return bytes_; }
  bool direct() const { return direct_; }
  // Non-empty when running buffered: the warning every output must carry.
  const std::string& warning() const { return warning_; }

 private:
  ScratchFile() = default;
  std::string path_;
  uint64_t bytes_ = 0;
  bool direct_ = true;
  std::string warning_;
  bool owned_ = false;  // removed on destruction only once we made (or may overwrite) it
};

}  // namespace strata::aio_bench

#endif  // STRATA_TOOLS_AIO_BENCH_SCRATCH_H_
