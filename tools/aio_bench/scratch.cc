#include "tools/aio_bench/scratch.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "aio/buffer.h"
#include "aio/engine.h"
#include "base/status.h"

namespace strata::aio_bench {
namespace {

char g_path[4096] = {};  // the file the signal handler removes

void OnSignal(int sig) {
  if (g_path[0] != '\0') unlink(g_path);
  std::signal(sig, SIG_DFL);
  raise(sig);
}

void AtExit() {
  if (g_path[0] != '\0') unlink(g_path);
}

}  // namespace

absl::Status CheckMeasuredDirectory(const std::string& dir, const ScratchOptions& options,
                                    std::string* warning) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no such directory (", std::strerror(errno), ")"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  }
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) != 0) {
    return absl::InternalError(absl::StrCat("statfs ", dir, ": ", std::strerror(errno)));
  }
  // Kernel pseudo filesystems: nothing there is stored on a drive.
  struct Named {
    uint64_t magic;
    const char* name;
  };
  static constexpr Named kPseudo[] = {
      {0x9fa0, "proc"},           {0x62656572, "sysfs"},   {0x27e0eb, "cgroup"},
      {0x63677270, "cgroup2"},    {0x64626720, "debugfs"}, {0x74726163, "tracefs"},
      {0x73636673, "securityfs"}, {0x1cd1, "devpts"},      {0x62656570, "configfs"},
      {0xcafe4a11, "bpf"},        {0x6165676c, "pstore"},  {0x42494e4d, "binfmt_misc"},
      {0x19800202, "mqueue"},     {0x65735543, "fusectl"}, {0xde5e81e4, "efivarfs"},
      {0xf97cff8c, "selinuxfs"},  {0x6e736673, "nsfs"}};
  static constexpr Named kMemory[] = {
      {0x01021994, "tmpfs"}, {0x858458f6, "ramfs"}, {0x958458f6, "hugetlbfs"}};
  const uint64_t type = static_cast<uint64_t>(fs.f_type);
  for (const Named& n : kPseudo) {
    if (type == n.magic) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, " is on ", n.name,
                       ", a kernel pseudo filesystem, not a disk: give a directory on "
                       "the drive to tune"));
    }
  }
  if ((fs.f_flags & ST_RDONLY) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is on a read-only filesystem: the test file cannot be written there"));
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        dir, ": this user cannot make the test file there (", std::strerror(errno), ")"));
  }
  for (const Named& n : kMemory) {
    if (type != n.magic) continue;
    if (!options.allow_memory_fs) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir, " is on ", n.name,
          ", which keeps files in memory: the figures would be RAM's, "
          "not a drive's, and a config tuned on them would mislead. Give a directory on the drive "
          "to tune, or --allow-memory-fs to measure memory anyway"));
    }
    if (warning != nullptr) {
      *warning = absl::StrCat("MEMORY: ", dir, " is on ", n.name,
                              ", which keeps files in memory; these figures are RAM's, not a "
                              "drive's: do not use them to configure NVMe offload");
    }
  }
  return absl::OkStatus();
}

absl::Status PrepareOutputDirectory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::FailedPreconditionError(absl::StrCat(dir, ": cannot be made: ", ec.message()));
  std::string probe = dir + "/.strata-write-probe-XXXXXX";
  const int fd = mkstemp(probe.data());
  const bool written = fd >= 0 && write(fd, "probe\n", 6) == 6;
  const int err = errno;
  if (fd >= 0) {
    close(fd);
    unlink(probe.c_str());
  }
  if (!written) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": cannot write a file in it: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::Status PrepareOutputFile(const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  const std::filesystem::path p = std::filesystem::absolute(path);
  STRATA_RETURN_IF_ERROR(PrepareOutputDirectory(p.parent_path().string()));
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return absl::OkStatus();  // made when written
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a file"));
  }
  if (access(path.c_str(), W_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cannot be written: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ScratchFile>> ScratchFile::Create(const std::string& dir,
                                                                 const std::string& name,
                                                                 uint64_t bytes,
                                                                 const ScratchOptions& options) {
  std::error_code ec;
  std::string memory_warning;
  STRATA_RETURN_IF_ERROR(CheckMeasuredDirectory(dir, options, &memory_warning));
  auto file = std::unique_ptr<ScratchFile>(new ScratchFile());
  file->warning_ = memory_warning;
  file->path_ = (std::filesystem::absolute(dir) / name).string();
  file->bytes_ = bytes;
  if (file->path_.size() >= sizeof(g_path)) {
    return absl::InvalidArgumentError(absl::StrCat(file->path_, ": path too long"));
  }
  const bool exists = std::filesystem::exists(file->path_, ec);
  if (exists && !options.overwrite) {
    return absl::FailedPreconditionError(
        absl::StrCat(file->path_, " exists; not writing over it (pass --overwrite to allow that)"));
  }
  uint64_t reusable = 0;
  if (exists) reusable = std::filesystem::file_size(file->path_, ec);
  const auto space = std::filesystem::space(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("statfs ", dir, ": ", ec.message()));
  const uint64_t need = bytes + options.headroom_bytes;
  if (space.available + reusable < need) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": needs ", need >> 20, " MiB free for the test file (", bytes >> 20,
                     " MiB plus ", options.headroom_bytes >> 20, " MiB headroom), has ",
                     (space.available + reusable) >> 20, " MiB"));
  }

  // O_DIRECT: does this filesystem take it?
  const int fd =
      options.open_for_probe(file->path_.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EINVAL) {
    if (!options.allow_buffered) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir,
          " is on a filesystem that refuses O_DIRECT (tmpfs on older kernels, some network "
          "and FUSE filesystems): results would measure the page cache, not the drive. Use "
          "a directory on the drive to tune, or --allow-buffered to measure anyway"));
    }
    file->direct_ = false;
    if (!file->warning_.empty()) file->warning_ += "; ";
    file->warning_ += absl::StrCat("BUFFERED: ", dir,
                                   " refuses O_DIRECT; these figures include the page cache and "
                                   "do not describe the drive");
  } else if (fd < 0) {
    return ErrnoStatus(errno, "open", file->path_);
  } else {
    close(fd);
  }
  // From here on the file is ours (created, or allowed to be written over) and is removed with us.
  file->owned_ = true;
  std::strncpy(g_path, file->path_.c_str(), sizeof(g_path) - 1);
  static bool handlers = false;
  if (!handlers) {
    handlers = true;
    std::atexit(AtExit);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, OnSignal);
  }

  // Lay the file down whole with random bytes through the engine.
  aio::AioConfig config;
  config.direct = file->direct_;
  config.queue_depth = 16;
  config.engine = aio::EngineKind::kIoUring;
  aio::EngineOptions eo;
  eo.on_warning = [](absl::string_view) {};
  auto engine = aio::Engine::Create(config, eo);
  if (!engine.ok()) return engine.status();
  aio::OpenOptions oo;
  oo.writable = oo.create = true;
  auto f = (*engine)->Open(file->path_, oo);
  if (!f.ok()) return f.status();
  if (auto s = f->Truncate(0); !s.ok()) return s;
  if (auto s = f->Allocate(0, bytes); !s.ok()) {
    return Annotate(s, "reserving the test file's space");
  }
  constexpr uint64_t kChunk = 16 << 20;
  auto buffer = aio::AlignedBuffer::Allocate(kChunk, {.huge_pages = true});
  if (!buffer.ok()) return buffer.status();
  std::mt19937_64 rng(0x5eed);
  for (uint64_t i = 0; i + 8 <= kChunk; i += 8) {
    const uint64_t v = rng();
    std::memcpy(buffer->data() + i, &v, 8);
  }
  for (uint64_t off = 0; off < bytes; off += kChunk) {
    const uint64_t len = std::min(kChunk, bytes - off);
    buffer->data()[0] = static_cast<std::byte>(off >> 20);  // no two chunks alike
    if (auto s = (*engine)->WriteSync(*f, off, {buffer->data(), len}); !s.ok()) {
      return Annotate(s, "laying down the test file");
    }
  }
  if (auto s = f->Sync(); !s.ok()) return s;
  return file;
}

ScratchFile::~ScratchFile() {
  if (owned_) unlink(path_.c_str());
  if (path_ == g_path) g_path[0] = '\0';
}

}  // namespace strata::aio_bench
