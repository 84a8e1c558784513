#include "tiering/nvme_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "aio/buffer.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::tiering {
namespace {

constexpr char kManifest[] = "manifest.json";
constexpr char kManifestTmp[] = "manifest.json.tmp";
constexpr char kLockFile[] = "lock";
// Format 3: swap files grow on demand; the snapshot records the cap and file_bytes, and a log
// record the files' sizes that changed. Format 2 (files reserved whole at creation) is read too.
constexpr int kFormat = 3;
constexpr int kOldestFormat = 2;
// A log record: magic, payload length, XXH3-64 of the payload, the payload (JSON), zero padding
// to the next multiple of kRecordBlock (a record never shares a block with another, so appending
// one never rewrites the block of one already committed).
constexpr uint32_t kRecordMagic = 0x314a5453;  // "STJ1"
constexpr uint64_t kRecordHeader = 16;
constexpr uint64_t kRecordBlock = 4096;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string SwapName(uint32_t i) { return absl::StrFormat("swap-%03d.bin", i); }

// The index of a swap file's name, or -1 for any other name.
int64_t SwapIndex(const std::string& name) {
  unsigned index = 0;
  char tail = 0;
  if (std::sscanf(name.c_str(), "swap-%u.bi%c", &index, &tail) != 2 || tail != 'n' ||
      SwapName(index) != name) {
    return -1;
  }
  return index;
}
std::string LogName(uint64_t seq) { return absl::StrFormat("journal-%d.log", seq); }

uint64_t Checksum(absl::Span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

absl::StatusOr<uint64_t> ParseHex(const std::string& s) {
  uint64_t v = 0;
  if (s.size() != 16) return absl::DataLossError("bad checksum field");
  for (char c : s) {
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= static_cast<uint64_t>(c - 'a' + 10);
    } else {
      return absl::DataLossError("bad checksum field");
    }
  }
  return v;
}

// The snapshot's checksum covers its canonical text without the checksum field.
uint64_t ManifestChecksum(nlohmann::json j) {
  j.erase("checksum");
  const std::string text = j.dump();
  return XXH3_64bits(text.data(), text.size());
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open", dir);
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0) return ErrnoStatus(err, "fsync", dir);
  return absl::OkStatus();
}

nlohmann::json ExtentsJson(const std::vector<StoreExtent>& extents) {
  nlohmann::json a = nlohmann::json::array();
  for (const StoreExtent& e : extents) a.push_back({e.file, e.offset, e.length});
  return a;
}

nlohmann::json RecordJson(const PartitionRecord& r) {
  return {{"id", r.id},
          {"length", r.length},
          {"checksum", Hex(r.checksum)},
          {"generation", r.generation},
          {"extents", ExtentsJson(r.extents)}};
}

// Parses a record written by RecordJson; throws nlohmann::json::exception on a missing or
// mistyped field (the callers catch it).
absl::StatusOr<PartitionRecord> ParseRecord(const nlohmann::json& j) {
  PartitionRecord r;
  r.id = j.at("id").get<uint64_t>();
  r.length = j.at("length").get<uint64_t>();
  STRATA_ASSIGN_OR_RETURN(r.checksum, ParseHex(j.at("checksum").get<std::string>()));
  r.generation = j.at("generation").get<uint64_t>();
  for (const auto& e : j.at("extents")) {
    r.extents.push_back(
        {e.at(0).get<uint32_t>(), e.at(1).get<uint64_t>(), e.at(2).get<uint64_t>()});
  }
  return r;
}

uint64_t ExtentBytes(const std::vector<StoreExtent>& extents) {
  uint64_t n = 0;
  for (const StoreExtent& e : extents) n += e.length;
  return n;
}

// Calls fn(file, file_offset, n) for each piece of bytes [offset, offset + length) of a partition
// laid over `extents`, in order.
template <typename Fn>
void ForEachPiece(const std::vector<StoreExtent>& extents, uint64_t offset, uint64_t length,
                  Fn fn) {
  uint64_t base = 0;
  for (const StoreExtent& e : extents) {
    if (length == 0) break;
    if (offset < base + e.length) {
      const uint64_t in = offset - base, n = std::min(length, e.length - in);
      fn(e.file, e.offset + in, n);
      offset += n;
      length -= n;
    }
    base += e.length;
  }
}

// The directories this process's stores hold, by the lock file's device and inode. A POSIX
// record lock does not exclude its own process, and closing any descriptor of the lock file drops
// it, so a second store of this process is refused here, before it opens the file.
Mutex g_locked_mu;
std::set<std::pair<dev_t, ino_t>>& LockedFiles() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_locked_mu) {
  static auto* files = new std::set<std::pair<dev_t, ino_t>>();
  return *files;
}

}  // namespace

// The I/O of one span, split over extents: several engine requests completing as one.
class NvmeStore::Pending {
 public:
  Pending() = default;
  Pending(Pending&&) = default;
  Pending& operator=(Pending&& o) {
    Wait().IgnoreError();
    futures_ = std::move(o.futures_);
    return *this;
  }
  ~Pending() { Wait().IgnoreError(); }
  void Add(std::future<absl::Status> f) { futures_.push_back(std::move(f)); }
  bool valid() const { return !futures_.empty(); }
  absl::Status Wait() {
    absl::Status s;
    for (auto& f : futures_) s.Update(f.get());
    futures_.clear();
    return s;
  }

 private:
  std::vector<std::future<absl::Status>> futures_;
};

NvmeStore::~NvmeStore() {
  {
    MutexLock commit(&commit_mu_);
    log_.Close();
  }
  {
    MutexLock lock(&mu_);
    files_.clear();
  }
  // Removed while the lock is still held: no other store opens the directory meanwhile.
  if (opened_ && options_.remove_files_on_close) RemoveFiles();
  if (lock_fd_ >= 0) {
    MutexLock registry(&g_locked_mu);
    close(lock_fd_);
    LockedFiles().erase(lock_key_);
  }
  if (opened_ && options_.remove_files_on_close && created_dir_) {
    rmdir(dir_.c_str());  // only when empty: whatever else is there stays, and the directory
  }
}

void NvmeStore::RemoveFiles() {
  // The files this store writes, by name (whatever a crash of an earlier process left too); the
  // lock file last, so a reader of the folder never finds a lock without a store.
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (SwapIndex(name) >= 0 || absl::StartsWith(name, "journal-") || name == kManifest ||
        name == kManifestTmp) {
      names.push_back(name);
    }
  }
  names.push_back(kLockFile);
  for (const std::string& name : names) {
    const std::string path = dir_ + "/" + name;
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      Warn(absl::StrCat("nvme store: could not remove ", path, ": ", std::strerror(errno)));
    }
  }
}

void NvmeStore::Hook(absl::string_view point) const {
  if (options_.test_hook) options_.test_hook(point);
}

void NvmeStore::Warn(const std::string& w) const {
  if (options_.on_warning) {
    options_.on_warning(w);
  } else {
    std::fprintf(stderr, "strata: %s\n", w.c_str());
  }
}

absl::StatusOr<std::unique_ptr<NvmeStore>> NvmeStore::Open(const std::string& dir,
                                                           const NvmeStoreOptions& options,
                                                           aio::Engine* engine,
                                                           std::vector<PartitionId>* corrupt) {
  if (engine == nullptr) return absl::InvalidArgumentError("NvmeStore::Open: engine is null");
  if (options.alignment < 512 || (options.alignment & (options.alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nvme store: alignment: must be a power of two >= 512, got ", options.alignment));
  }
  if (options.file_bytes < options.alignment) {
    return absl::InvalidArgumentError(
        absl::StrCat("nvme store: file_bytes: must be >= the alignment (", options.alignment,
                     "), got ", options.file_bytes));
  }
  auto store = std::unique_ptr<NvmeStore>(new NvmeStore());
  store->dir_ = dir;
  store->options_ = options;
  store->engine_ = engine;

  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return ErrnoStatus(errno, "stat", dir);
    if (mkdir(dir.c_str(), 0700) != 0) {
      return Annotate(ErrnoStatus(errno, "mkdir", dir),
                      "nvme store: nvme_path must be a directory that exists or can be made");
    }
    store->created_dir_ = true;
  } else if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("nvme store: nvme_path ", dir, " is not a directory"));
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return Annotate(ErrnoStatus(errno, "access", dir), "nvme store: nvme_path is not writable");
  }
  STRATA_RETURN_IF_ERROR(store->Lock());

  if (std::filesystem::exists(dir + "/" + kManifest)) {
    STRATA_RETURN_IF_ERROR(store->Load());
  } else {
    STRATA_RETURN_IF_ERROR(store->Create());
  }
  if (options.verify_on_open) {
    STRATA_ASSIGN_OR_RETURN(std::vector<PartitionId> bad, store->Verify());
    if (corrupt != nullptr) *corrupt = std::move(bad);
  }
  store->opened_ = true;
  return store;
}

absl::Status NvmeStore::Lock() {
  const std::string path = dir_ + "/" + kLockFile;
  auto in_use = [&](const std::string& who) {
    return absl::FailedPreconditionError(
        absl::StrCat("nvme store: ", dir_, " is in use by another strata store (", who, " holds ",
                     path, "); each process, Runtime and rank needs an nvme_path of its own"));
  };
  MutexLock registry(&g_locked_mu);
  if (struct stat st;
      stat(path.c_str(), &st) == 0 && LockedFiles().count({st.st_dev, st.st_ino}) > 0) {
    // Checked before opening: closing any descriptor of the lock file would drop the lock this
    // process already holds.
    // In this process: most often an engine of an earlier run, still alive.
    return absl::FailedPreconditionError(absl::StrCat(
        "nvme store: ", dir_, " is in use by another strata store of this process (", getpid(),
        ", which holds ", path,
        "): an earlier engine or Runtime on this nvme_path is still "
        "alive; close it first (engine.close(), or strata.lightning.release(model) for a "
        "Lightning module), or give this one an nvme_path of its own"));
  }
  int fd = -1;
  std::pair<dev_t, ino_t> key;
  // A holder that removes its files (remove_files_on_close) unlinks the lock file before it lets
  // the lock go: a lock won on an unlinked file is worthless, so it is taken again on the file
  // the path names now.
  for (int attempt = 0;; ++attempt) {
    fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return Annotate(ErrnoStatus(errno, "open", path), "nvme store: lock file");
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      return Annotate(ErrnoStatus(err, "fstat", path), "nvme store: lock file");
    }
    key = {st.st_dev, st.st_ino};
    // A POSIX record lock (not flock): it belongs to this process alone, so a child forked while
    // the store is open (a data loader's worker) does not keep it after this process closes the
    // store or dies; the kernel drops it when the process ends, however it ends.
    struct flock want = {};
    want.l_type = F_WRLCK;
    want.l_whence = SEEK_SET;
    if (fcntl(fd, F_SETLK, &want) != 0) {
      const int err = errno;
      if (err != EACCES && err != EAGAIN) {
        close(fd);
        return Annotate(ErrnoStatus(err, "fcntl(F_SETLK)", path), "nvme store");
      }
      struct flock held = {};
      held.l_type = F_WRLCK;
      held.l_whence = SEEK_SET;
      const bool known = fcntl(fd, F_GETLK, &held) == 0 && held.l_type != F_UNLCK;
      close(fd);
      return in_use(known ? absl::StrCat("process ", held.l_pid) : std::string("another process"));
    }
    struct stat now;
    if (stat(path.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) break;
    close(fd);
    if (attempt == 100) {
      return absl::UnavailableError(
          absl::StrCat("nvme store: the lock file ", path, " keeps being removed and made again"));
    }
  }
  const std::string pid = absl::StrCat(getpid(), "\n");  // for a person looking at the folder
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    const int err = errno;
    close(fd);
    return Annotate(ErrnoStatus(err, "write", path), "nvme store: lock file");
  }
  lock_fd_ = fd;
  lock_key_ = key;
  LockedFiles().insert(key);
  return absl::OkStatus();
}

absl::Status NvmeStore::Create() {
  // A new store: no swap space yet (the files grow on demand, up to the cap); the manifest log
  // and the snapshot naming it.
  if (options_.capacity_bytes == 0) {
    return absl::InvalidArgumentError("nvme store: capacity_bytes: must be > 0");
  }
  capacity_ = AlignUp(options_.capacity_bytes, options_.alignment);
  file_bytes_ = AlignUp(options_.file_bytes, options_.alignment);
  MutexLock commit(&commit_mu_);
  const std::string log_path = dir_ + "/" + LogName(0);
  aio::OpenOptions oo;
  oo.writable = oo.create = oo.truncate = true;
  auto log = engine_->Open(log_path, oo);
  if (!log.ok()) return Annotate(log.status(), "nvme store: manifest log");
  log_ = *std::move(log);
  absl::Status s = log_.Sync();
  if (s.ok()) s = SyncDir(dir_);
  {
    MutexLock lock(&mu_);
    generation_ = 1;
  }
  if (s.ok()) s = WriteSnapshot(0, &snapshot_bytes_, &logged_sizes_);
  if (!s.ok()) {
    log_.Close();
    unlink(log_path.c_str());
  }
  return s;
}

absl::Status NvmeStore::WriteSnapshot(uint64_t log_seq, uint64_t* bytes,
                                      std::vector<uint64_t>* sizes) {
  nlohmann::json j;
  j["strata_nvme_store"] = kFormat;
  j["alignment"] = options_.alignment;
  j["capacity_bytes"] = capacity_;
  j["file_bytes"] = file_bytes_;
  j["log"] = LogName(log_seq);
  j["files"] = nlohmann::json::array();
  j["partitions"] = nlohmann::json::array();
  std::vector<uint64_t> recorded;
  {
    MutexLock lock(&mu_);
    recorded = file_sizes_;
    for (uint32_t i = 0; i < file_sizes_.size(); ++i) {
      j["files"].push_back({{"name", SwapName(i)}, {"bytes", file_sizes_[i]}});
    }
    j["generation"] = generation_;
    std::vector<PartitionId> ids;
    for (const auto& [id, r] : records_) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    for (PartitionId id : ids) j["partitions"].push_back(RecordJson(records_.at(id)));
  }
  j["checksum"] = Hex(ManifestChecksum(j));
  const std::string text = j.dump(1) + "\n";
  const std::string tmp = dir_ + "/" + kManifestTmp, final_path = dir_ + "/" + kManifest;
  {
    aio::OpenOptions oo;
    oo.writable = oo.create = oo.truncate = true;
    auto file = engine_->Open(tmp, oo);
    if (!file.ok()) return Annotate(file.status(), "nvme store: writing the manifest snapshot");
    STRATA_RETURN_IF_ERROR(
        Annotate(engine_->WriteSync(*file, 0,
                                    {reinterpret_cast<const std::byte*>(text.data()), text.size()}),
                 "nvme store: writing the manifest snapshot"));
    STRATA_RETURN_IF_ERROR(Annotate(file->Sync(), "nvme store: writing the manifest snapshot"));
  }
  Hook("compact:snapshot-written");
  if (rename(tmp.c_str(), final_path.c_str()) != 0) {
    return ErrnoStatus(errno, "rename", tmp + " -> " + final_path);
  }
  STRATA_RETURN_IF_ERROR(SyncDir(dir_));
  Hook("compact:snapshot-renamed");
  *bytes = text.size();
  *sizes = std::move(recorded);
  return absl::OkStatus();
}

absl::Status NvmeStore::Compact() {
  const uint64_t seq = log_seq_ + 1;
  const std::string old_path = dir_ + "/" + LogName(log_seq_), path = dir_ + "/" + LogName(seq);
  aio::OpenOptions oo;
  oo.writable = oo.create = oo.truncate = true;
  auto log = engine_->Open(path, oo);
  if (!log.ok()) return Annotate(log.status(), "nvme store: compacting the manifest log");
  absl::Status s = log->Sync();
  if (s.ok()) s = SyncDir(dir_);
  if (s.ok()) Hook("compact:log-created");
  uint64_t bytes = 0;
  std::vector<uint64_t> sizes;
  if (s.ok()) s = WriteSnapshot(seq, &bytes, &sizes);
  if (!s.ok()) {
    // The snapshot in force still names the old log; the new one is not needed.
    log->Close();
    unlink(path.c_str());
    return Annotate(s, "nvme store: compacting the manifest log");
  }
  log_.Close();
  if (unlink(old_path.c_str()) != 0 && errno != ENOENT) {
    Warn(absl::StrCat("nvme store: could not remove the old manifest log ", old_path, ": ",
                      std::strerror(errno), " (it is removed at the next open)"));
  }
  Hook("compact:old-log-removed");
  log_ = *std::move(log);
  log_seq_ = seq;
  log_end_ = 0;
  snapshot_bytes_ = bytes;
  logged_sizes_ = std::move(sizes);
  log_poisoned_ = false;
  MutexLock lock(&mu_);
  FreeLocked(quarantined_);
  quarantined_.clear();
  return absl::OkStatus();
}

absl::Status NvmeStore::Load() {
  const std::string path = dir_ + "/" + kManifest;
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("nvme store: manifest ", path, ": ", what));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not valid JSON");
  const int format = j.value("strata_nvme_store", 0);
  if (format < kOldestFormat || format > kFormat) {
    return bad(format == 0
                   ? std::string("not a strata store manifest")
                   : absl::StrCat("format ", format, " (this strata reads formats ", kOldestFormat,
                                  " to ", kFormat, "); move the store aside or remove it"));
  }
  auto stored = ParseHex(j.value("checksum", std::string()));
  if (!stored.ok() || *stored != ManifestChecksum(j)) {
    return bad("checksum does not match its contents (damaged)");
  }
  MutexLock commit(&commit_mu_);
  std::string log_name;
  bool log_nonempty = false;
  {
    MutexLock lock(&mu_);
    try {
      generation_ = j.at("generation").get<uint64_t>();
      options_.alignment = j.at("alignment").get<uint64_t>();
      log_name = j.at("log").get<std::string>();
      if (std::sscanf(log_name.c_str(), "journal-%lu.log", &log_seq_) != 1 ||
          LogName(log_seq_) != log_name) {
        return bad(absl::StrCat("log name ", log_name, " is not journal-N.log"));
      }
      for (const auto& f : j.at("files")) {
        const uint32_t index = static_cast<uint32_t>(files_.size());
        if (f.at("name").get<std::string>() != SwapName(index)) {
          return bad(absl::StrCat("swap file ", index, " is named ", f.at("name").dump(), ", not ",
                                  SwapName(index)));
        }
        if (absl::Status s = AdoptFileLocked(index, f.at("bytes").get<uint64_t>()); !s.ok()) {
          return s.code() == absl::StatusCode::kDataLoss ? bad(s.message()) : s;
        }
      }
      // Format 2 reserved its files whole at creation: they were its capacity.
      const uint64_t allocated = AllocatedLocked();
      uint64_t recorded_cap = allocated;
      file_bytes_ = AlignUp(options_.file_bytes, options_.alignment);
      if (format >= 3) {
        recorded_cap = j.at("capacity_bytes").get<uint64_t>();
        file_bytes_ = j.at("file_bytes").get<uint64_t>();
        if (file_bytes_ == 0 || file_bytes_ % options_.alignment != 0) {
          return bad(
              absl::StrCat("file_bytes ", file_bytes_, " is not a multiple of the alignment"));
        }
      }
      const uint64_t wanted = options_.capacity_bytes > 0
                                  ? AlignUp(options_.capacity_bytes, options_.alignment)
                                  : recorded_cap;
      capacity_ = std::max(wanted, allocated);
      for (const auto& p : j.at("partitions")) {
        auto r = ParseRecord(p);
        if (!r.ok()) return bad(r.status().message());
        if (absl::Status s = Carve(*r); !s.ok()) return bad(s.message());
      }
    } catch (const nlohmann::json::exception& e) {
      return bad(absl::StrCat("missing or mistyped field (", e.what(), ")"));
    }
    STRATA_RETURN_IF_ERROR(Replay(dir_ + "/" + log_name, &log_nonempty));
    capacity_ = std::max(capacity_, AllocatedLocked());
    // A growth that a crash left unrecorded is given back: a file grown past the size the manifest
    // records is truncated to it (nothing recorded lies past it), and a file no record names is
    // removed below.
    for (uint32_t i = 0; i < files_.size(); ++i) {
      auto actual = files_[i]->Size();
      if (actual.ok() && *actual > file_sizes_[i]) {
        if (absl::Status t = files_[i]->Truncate(file_sizes_[i]); !t.ok()) {
          Warn(absl::StrCat("nvme store: giving back space a growth left unrecorded: ",
                            t.message()));
        }
      }
    }
    logged_sizes_ = file_sizes_;
  }
  aio::OpenOptions oo;
  oo.writable = true;
  STRATA_ASSIGN_OR_RETURN(log_, engine_->Open(dir_ + "/" + log_name, oo));
  snapshot_bytes_ = std::filesystem::file_size(path);
  // Files no snapshot names: logs of compactions that crashed, a snapshot never renamed, swap
  // files of a growth that no commit recorded.
  uint64_t swap_files = 0;
  {
    MutexLock lock(&mu_);
    swap_files = files_.size();
  }
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if ((absl::StartsWith(name, "journal-") && name != log_name) || name == kManifestTmp ||
        SwapIndex(name) >= static_cast<int64_t>(swap_files)) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
  // The replayed log becomes a snapshot: each open starts with an empty log.
  if (log_nonempty) STRATA_RETURN_IF_ERROR(Compact());
  return absl::OkStatus();
}

absl::Status NvmeStore::Replay(const std::string& log_path, bool* any) {
  std::ifstream in(log_path, std::ios::binary);
  if (!in) {
    return absl::DataLossError(
        absl::StrCat("nvme store: manifest log ", log_path, " named by the snapshot is missing"));
  }
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  *any = !log.empty();
  for (uint64_t pos = 0; pos + kRecordHeader <= log.size();) {
    uint32_t magic = 0, length = 0;
    uint64_t sum = 0;
    std::memcpy(&magic, log.data() + pos, 4);
    std::memcpy(&length, log.data() + pos + 4, 4);
    std::memcpy(&sum, log.data() + pos + 8, 8);
    // A torn tail (a commit that never returned) ends the log.
    if (magic != kRecordMagic || length > log.size() - pos - kRecordHeader) break;
    const char* payload = log.data() + pos + kRecordHeader;
    if (XXH3_64bits(payload, length) != sum) break;
    nlohmann::json j = nlohmann::json::parse(payload, payload + length, nullptr, false);
    const std::string where = absl::StrCat("nvme store: manifest log ", log_path, " @ ", pos);
    if (j.is_discarded()) return absl::DataLossError(absl::StrCat(where, ": not valid JSON"));
    try {
      const uint64_t g = j.at("g").get<uint64_t>();
      if (g != generation_ + 1) {
        return absl::DataLossError(absl::StrCat(where, ": record of generation ", g,
                                                " does not follow generation ", generation_));
      }
      if (absl::Status s = ApplyRecord(j); !s.ok()) return Annotate(s, where);
    } catch (const nlohmann::json::exception& e) {
      return absl::DataLossError(
          absl::StrCat(where, ": missing or mistyped field (", e.what(), ")"));
    }
    pos += AlignUp(kRecordHeader + length, kRecordBlock);
  }
  return absl::OkStatus();
}

absl::Status NvmeStore::ApplyRecord(const nlohmann::json& j) {
  const uint64_t g = j.at("g").get<uint64_t>();
  // The files' sizes that changed (a growth), before the puts that use the space.
  if (auto files = j.find("files"); files != j.end()) {
    for (const auto& f : *files) {
      STRATA_RETURN_IF_ERROR(AdoptFileLocked(f.at(0).get<uint32_t>(), f.at(1).get<uint64_t>()));
    }
  }
  std::vector<PartitionRecord> puts;
  for (const auto& p : j.at("put")) {
    STRATA_ASSIGN_OR_RETURN(PartitionRecord r, ParseRecord(p));
    puts.push_back(std::move(r));
  }
  // Old copies first (a record may move one partition into space another one left).
  auto drop = [&](PartitionId id) {
    auto it = records_.find(id);
    if (it == records_.end()) return;
    FreeLocked(it->second.extents);
    lengths_.erase(lengths_.find(ExtentBytes(it->second.extents)));
    records_.erase(it);
  };
  for (const auto& id : j.at("erase")) drop(id.get<PartitionId>());
  for (const PartitionRecord& r : puts) drop(r.id);
  for (PartitionRecord& r : puts) STRATA_RETURN_IF_ERROR(Carve(r));
  generation_ = g;
  return absl::OkStatus();
}

absl::Status NvmeStore::AdoptFileLocked(uint32_t index, uint64_t size) {
  const std::string path = dir_ + "/" + SwapName(index);
  if (index > files_.size()) {
    return absl::DataLossError(absl::StrCat("the manifest names ", path, " but the store has ",
                                            files_.size(), " swap files before it"));
  }
  if (size % options_.alignment != 0) {
    return absl::DataLossError(absl::StrCat("the manifest gives ", path, " ", size,
                                            " bytes, not a multiple of the alignment"));
  }
  if (index < files_.size() && size <= file_sizes_[index]) return absl::OkStatus();
  std::unique_ptr<aio::File> opened;
  const aio::File* file = nullptr;
  if (index == files_.size()) {
    aio::OpenOptions oo;
    oo.writable = true;
    auto f = engine_->Open(path, oo);
    if (!f.ok()) return Annotate(f.status(), "nvme store");
    opened = std::make_unique<aio::File>(*std::move(f));
    file = opened.get();
  } else {
    file = files_[index].get();
  }
  STRATA_ASSIGN_OR_RETURN(const uint64_t actual, file->Size());
  if (actual < size) {
    return absl::DataLossError(
        absl::StrCat(path, " is ", actual, " bytes, the manifest says ", size));
  }
  if (opened != nullptr) {
    files_.push_back(std::move(opened));
    file_sizes_.push_back(0);
    free_.emplace_back();
  }
  InsertFreeLocked(index, file_sizes_[index], size - file_sizes_[index]);
  file_sizes_[index] = size;
  return absl::OkStatus();
}

// Marks a record's extents used (checking that they lie in free space) and lists it.
absl::Status NvmeStore::Carve(const PartitionRecord& r) {
  if (ExtentBytes(r.extents) < r.length) {
    return absl::DataLossError(
        absl::StrCat("partition ", r.id, ": its extents hold fewer than its ", r.length, " bytes"));
  }
  for (const StoreExtent& e : r.extents) {
    if (e.file >= free_.size() || e.length == 0 || e.offset % options_.alignment != 0 ||
        e.length % options_.alignment != 0 || e.offset > file_sizes_[e.file] ||
        e.length > file_sizes_[e.file] - e.offset) {
      return absl::DataLossError(
          absl::StrCat("partition ", r.id, " has an extent outside the files"));
    }
    auto& fl = free_[e.file];
    auto it = fl.upper_bound(e.offset);
    if (it == fl.begin() || std::prev(it)->first + std::prev(it)->second < e.offset + e.length) {
      return absl::DataLossError(absl::StrCat("partition ", r.id, " overlaps another"));
    }
    --it;
    const uint64_t start = it->first, flen = it->second;
    fl.erase(it);
    if (e.offset > start) fl[start] = e.offset - start;
    if (start + flen > e.offset + e.length) {
      fl[e.offset + e.length] = start + flen - (e.offset + e.length);
    }
    used_ += e.length;
  }
  lengths_.insert(ExtentBytes(r.extents));
  records_[r.id] = r;
  return absl::OkStatus();
}

absl::Status NvmeStore::VerifyRecord(const PartitionRecord& r, std::vector<std::byte>* scratch) {
  // Chunk by chunk through one small buffer: a partition of any size is verified in bounded memory.
  constexpr uint64_t kChunk = 8 << 20;
  scratch->resize(std::min(kChunk, r.length));
  XXH3_state_t* hash = XXH3_createState();
  XXH3_64bits_reset(hash);
  absl::Status s;
  for (uint64_t off = 0; off < r.length && s.ok(); off += kChunk) {
    const absl::Span<std::byte> chunk =
        absl::MakeSpan(*scratch).subspan(0, std::min(kChunk, r.length - off));
    s = ReadPieces(r, off, chunk).Wait();
    if (s.ok()) XXH3_64bits_update(hash, chunk.data(), chunk.size());
  }
  const uint64_t sum = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  STRATA_RETURN_IF_ERROR(s);
  if (sum != r.checksum) return Mismatch(r, sum);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PartitionId>> NvmeStore::Verify() {
  std::vector<PartitionId> corrupt;
  std::vector<std::byte> scratch;
  for (const PartitionRecord& listed : List()) {
    MutexLock partition(PartitionMutex(listed.id));
    auto r = Find(listed.id);
    if (!r.ok()) continue;  // erased meanwhile
    absl::Status s = VerifyRecord(*r, &scratch);
    if (s.code() == absl::StatusCode::kDataLoss) {
      corrupt.push_back(r->id);
    } else if (!s.ok()) {
      return s;
    }
  }
  std::sort(corrupt.begin(), corrupt.end());
  return corrupt;
}

absl::Status NvmeStore::Mismatch(const PartitionRecord& r, uint64_t sum) const {
  const StoreExtent& first = r.extents.front();
  return absl::DataLossError(absl::StrCat(
      "nvme store: partition ", r.id, " in ", dir_, "/", SwapName(first.file), " @ ", first.offset,
      r.extents.size() > 1 ? absl::StrCat(" (+", r.extents.size() - 1, " more extents)") : "",
      " len ", r.length, ": checksum ", Hex(sum), " does not match the manifest's ",
      Hex(r.checksum)));
}

Mutex* NvmeStore::PartitionMutex(PartitionId id) {
  MutexLock lock(&mu_);
  auto& m = partition_mu_[id];
  if (m == nullptr) m = std::make_unique<Mutex>();
  return m.get();
}

std::vector<StoreExtent> NvmeStore::AllocateLocked(uint64_t length) {
  const uint64_t len = AlignUp(length, options_.alignment);
  // One piece when a free range is large enough (first fit); otherwise the largest free ranges,
  // as many as it takes.
  std::vector<StoreExtent> out;
  for (uint32_t f = 0; f < free_.size() && out.empty(); ++f) {
    for (auto& [off, flen] : free_[f]) {
      if (flen >= len) {
        out.push_back({f, off, len});
        break;
      }
    }
  }
  if (out.empty()) {
    std::vector<StoreExtent> ranges;
    for (uint32_t f = 0; f < free_.size(); ++f) {
      for (const auto& [off, flen] : free_[f]) ranges.push_back({f, off, flen});
    }
    std::sort(ranges.begin(), ranges.end(),
              [](const StoreExtent& a, const StoreExtent& b) { return a.length > b.length; });
    uint64_t need = len;
    for (const StoreExtent& r : ranges) {
      if (need == 0) break;
      out.push_back({r.file, r.offset, std::min(need, r.length)});
      need -= out.back().length;
    }
  }
  for (const StoreExtent& e : out) {
    auto& fl = free_[e.file];
    auto it = fl.find(e.offset);
    const uint64_t rest = it->second - e.length;
    fl.erase(it);
    if (rest > 0) fl[e.offset + e.length] = rest;
    used_ += e.length;
  }
  return out;
}

void NvmeStore::InsertFreeLocked(uint32_t f, uint64_t offset, uint64_t length) {
  if (length == 0) return;
  auto& fl = free_[f];
  uint64_t start = offset, len = length;
  auto next = fl.lower_bound(start);
  if (next != fl.end() && next->first == start + len) {
    len += next->second;
    next = fl.erase(next);
  }
  if (next != fl.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      fl.erase(prev);
    }
  }
  fl[start] = len;
}

void NvmeStore::FreeLocked(const std::vector<StoreExtent>& extents) {
  for (const StoreExtent& e : extents) {
    InsertFreeLocked(e.file, e.offset, e.length);
    used_ -= e.length;
  }
}

uint64_t NvmeStore::AllocatedLocked() const {
  uint64_t total = 0;
  for (uint64_t s : file_sizes_) total += s;
  return total;
}

const aio::File* NvmeStore::FileAt(uint32_t f) const {
  MutexLock lock(&mu_);
  return files_[f].get();
}

absl::Status NvmeStore::Fallocate(const aio::File& file, uint64_t offset, uint64_t length) const {
  if (options_.test_fallocate_errno) {
    if (const int err = options_.test_fallocate_errno(file.path(), offset, length); err != 0) {
      return ErrnoStatus(err, "fallocate", file.path(), offset, length);
    }
  }
  return file.Allocate(offset, length);
}

absl::Status NvmeStore::Grow(uint64_t target, const std::string& context) {
  uint64_t allocated = 0, used = 0;
  {
    MutexLock lock(&mu_);
    allocated = AllocatedLocked();
    used = used_;
  }
  if (allocated >= target) return absl::OkStatus();  // grown by another thread meanwhile
  target = std::min(target, capacity_);
  if (allocated >= target) {
    return absl::ResourceExhaustedError(absl::StrCat(context, ": no room under the cap (", used,
                                                     " of ", capacity_,
                                                     " bytes in use; nothing was written)"));
  }
  // By an eighth of what the files hold at least (few growths for a store that fills up), by
  // exactly what is needed when the disk has no room for more.
  const uint64_t needed = target - allocated;
  const uint64_t ahead =
      std::min(capacity_ - allocated, std::max(needed, AlignUp(allocated / 8, options_.alignment)));
  absl::Status s = GrowBy(ahead);
  if (!s.ok() && ahead > needed && StatusErrno(s) == ENOSPC) s = GrowBy(needed);
  if (!s.ok()) {
    return Annotate(s, absl::StrCat(context, ": growing the swap files in ", dir_, " by ", needed,
                                    " bytes (", used, " of ", capacity_, " bytes in use, the cap; ",
                                    allocated, " held by the files now; nothing was written)"));
  }
  return absl::OkStatus();
}

absl::Status NvmeStore::GrowBy(uint64_t bytes) {
  struct Step {
    uint32_t file;
    uint64_t from, length;
    bool created;
  };
  std::vector<Step> steps;
  {
    MutexLock lock(&mu_);
    uint64_t rest = bytes;
    const uint32_t n = static_cast<uint32_t>(files_.size());
    if (n > 0 && file_sizes_.back() < file_bytes_) {
      const uint64_t e = std::min(rest, file_bytes_ - file_sizes_.back());
      steps.push_back({n - 1, file_sizes_.back(), e, false});
      rest -= e;
    }
    for (uint32_t f = n; rest > 0; ++f) {
      const uint64_t e = std::min(rest, file_bytes_);
      steps.push_back({f, 0, e, true});
      rest -= e;
    }
  }
  // Each step fallocated and synced (a new file's size and blocks durable with it); then the
  // directory entries of new files; only then is the space handed out. On failure every step
  // taken is undone: an extended file truncated back, a new file removed.
  std::vector<std::unique_ptr<aio::File>> created;
  auto undo = [&](size_t taken) {
    for (size_t i = 0; i < taken; ++i) {
      const Step& st = steps[i];
      if (st.created) continue;
      if (absl::Status t = FileAt(st.file)->Truncate(st.from); !t.ok()) {
        Warn(absl::StrCat("nvme store: undoing a growth that failed: ", t.message()));
      }
    }
    for (const auto& file : created) unlink(file->path().c_str());
    created.clear();
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& st = steps[i];
    const aio::File* file = nullptr;
    if (st.created) {
      aio::OpenOptions oo;
      oo.writable = oo.create = oo.truncate = true;
      auto opened = engine_->Open(dir_ + "/" + SwapName(st.file), oo);
      if (!opened.ok()) {
        undo(i);
        return opened.status();
      }
      created.push_back(std::make_unique<aio::File>(*std::move(opened)));
      file = created.back().get();
    } else {
      file = FileAt(st.file);
    }
    absl::Status s = Fallocate(*file, st.from, st.length);
    if (s.ok()) s = file->Sync();
    if (!s.ok()) {
      undo(i + 1);
      return s;
    }
  }
  if (!created.empty()) {
    if (absl::Status s = SyncDir(dir_); !s.ok()) {
      undo(steps.size());
      return s;
    }
  }
  Hook("grow:allocated");
  MutexLock lock(&mu_);
  size_t next_created = 0;
  for (const Step& st : steps) {
    if (st.created) {
      files_.push_back(std::move(created[next_created++]));
      file_sizes_.push_back(0);
      free_.emplace_back();
    }
    InsertFreeLocked(st.file, st.from, st.length);
    file_sizes_[st.file] = st.from + st.length;
  }
  return absl::OkStatus();
}

NvmeStore::Pending NvmeStore::ReadPieces(const PartitionRecord& r, uint64_t offset,
                                         absl::Span<std::byte> out) {
  Pending p;
  uint64_t pos = 0;
  ForEachPiece(r.extents, offset, out.size(), [&](uint32_t f, uint64_t at, uint64_t n) {
    p.Add(engine_->ReadAsync(*FileAt(f), at, out.subspan(pos, n)));
    pos += n;
  });
  return p;
}

NvmeStore::Pending NvmeStore::WritePieces(const std::vector<StoreExtent>& extents, uint64_t offset,
                                          absl::Span<const std::byte> bytes) {
  Pending p;
  uint64_t pos = 0;
  ForEachPiece(extents, offset, bytes.size(), [&](uint32_t f, uint64_t at, uint64_t n) {
    p.Add(engine_->WriteAsync(*FileAt(f), at, bytes.subspan(pos, n)));
    pos += n;
  });
  return p;
}

absl::Status NvmeStore::SyncFiles(const std::vector<StoreExtent>& extents) {
  if (!options_.durable) return absl::OkStatus();
  std::vector<uint32_t> touched;
  for (const StoreExtent& e : extents) touched.push_back(e.file);
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (uint32_t f : touched) STRATA_RETURN_IF_ERROR(FileAt(f)->Sync());
  return absl::OkStatus();
}

absl::Status NvmeStore::CommitRecord(const std::map<PartitionId, Batch::Staged>& puts,
                                     const std::vector<PartitionId>& erases,
                                     const std::string& context, bool* maybe_logged) {
  MutexLock commit(&commit_mu_);
  Hook(options_.durable ? "commit:data-synced" : "commit:data-written");
  if (log_poisoned_) {
    // A failed append left the log's tail unknown: replace the log before appending to it.
    if (absl::Status c = Compact(); !c.ok()) return Annotate(c, context);
  }
  uint64_t g = 0;
  std::vector<PartitionRecord> records;
  std::vector<uint64_t> sizes;
  {
    MutexLock lock(&mu_);
    g = generation_ + 1;
    sizes = file_sizes_;
  }
  nlohmann::json j;
  j["g"] = g;
  // The files' sizes the manifest does not record yet: every extent this record names lies in
  // space fallocated and synced before it was handed out, within these sizes.
  nlohmann::json grown = nlohmann::json::array();
  for (uint32_t i = 0; i < sizes.size(); ++i) {
    if (i >= logged_sizes_.size() || sizes[i] != logged_sizes_[i]) grown.push_back({i, sizes[i]});
  }
  if (!grown.empty()) j["files"] = grown;
  j["put"] = nlohmann::json::array();
  for (const auto& [id, st] : puts) {
    records.push_back(PartitionRecord{id, st.length, st.checksum, g, st.extents});
    j["put"].push_back(RecordJson(records.back()));
  }
  j["erase"] = erases;
  const std::string payload = j.dump();
  std::vector<std::byte> block(AlignUp(kRecordHeader + payload.size(), kRecordBlock));
  const uint32_t length = static_cast<uint32_t>(payload.size());
  const uint64_t sum = XXH3_64bits(payload.data(), payload.size());
  std::memcpy(block.data(), &kRecordMagic, 4);
  std::memcpy(block.data() + 4, &length, 4);
  std::memcpy(block.data() + 8, &sum, 8);
  std::memcpy(block.data() + kRecordHeader, payload.data(), payload.size());
  absl::Status s = engine_->WriteSync(log_, log_end_, block);
  if (s.ok()) {
    Hook("commit:log-written");
    if (options_.durable) s = log_.Sync();
  }
  if (!s.ok()) {
    s = Annotate(s, absl::StrCat(context, ": writing the manifest log ", log_.path()));
    // The record may have reached the disk in part or whole: the staged extents must not be
    // reused until a compaction has replaced this log (tried now, and before the next commit).
    log_poisoned_ = true;
    if (absl::Status c = Compact(); !c.ok()) {
      Warn(absl::StrCat(c.message(), " (retried before the next commit)"));
    }
    if (maybe_logged != nullptr) *maybe_logged = log_poisoned_;
    return s;
  }
  Hook(options_.durable ? "commit:log-synced" : "commit:log-unsynced");
  log_end_ += block.size();
  logged_sizes_ = std::move(sizes);
  {
    MutexLock lock(&mu_);
    auto drop = [&](PartitionId id) {
      auto it = records_.find(id);
      if (it == records_.end()) return;
      FreeLocked(it->second.extents);
      lengths_.erase(lengths_.find(ExtentBytes(it->second.extents)));
      records_.erase(it);
    };
    for (PartitionId id : erases) drop(id);
    for (PartitionRecord& r : records) {
      drop(r.id);
      lengths_.insert(ExtentBytes(r.extents));
      records_[r.id] = std::move(r);
    }
    generation_ = g;
  }
  if (log_end_ > std::max(options_.compact_min_log_bytes, 2 * snapshot_bytes_)) {
    if (absl::Status c = Compact(); !c.ok()) {
      Warn(absl::StrCat(c.message(), " (the log keeps growing; retried at the next commit)"));
    }
  }
  return absl::OkStatus();
}

absl::Status NvmeStore::Put(PartitionId id, absl::Span<const std::byte> bytes) {
  Batch batch(this);
  STRATA_RETURN_IF_ERROR(batch.Stage(id, bytes));
  return batch.Commit();
}

std::unique_ptr<NvmeStore::Batch> NvmeStore::NewBatch() {
  return std::unique_ptr<Batch>(new Batch(this));
}

NvmeStore::Batch::~Batch() { Abort(); }

void NvmeStore::Batch::Abort() {
  for (const auto& [id, st] : staged_) LetGo(st.extents);
  staged_.clear();
}

void NvmeStore::Batch::LetGo(const std::vector<StoreExtent>& extents) {
  if (maybe_logged_) {
    // A failed record naming them may be in the log until it is replaced: they stay allocated
    // until then (Compact frees them).
    MutexLock commit(&store_->commit_mu_);
    if (store_->log_poisoned_) {
      store_->quarantined_.insert(store_->quarantined_.end(), extents.begin(), extents.end());
      return;
    }
  }
  MutexLock lock(&store_->mu_);
  store_->FreeLocked(extents);
}

absl::StatusOr<std::vector<StoreExtent>> NvmeStore::Batch::Allocate(PartitionId id, uint64_t length,
                                                                    const std::string& context) {
  const uint64_t len = AlignUp(length, store_->options_.alignment);
  // Checked and taken under one hold of mu_; when the files hold too little, grown (one growth at
  // a time, without mu_) and checked again: what others took meanwhile is counted.
  for (;;) {
    uint64_t target = 0;
    {
      MutexLock lock(&store_->mu_);
      const uint64_t capacity = store_->capacity_, used = store_->used_;
      uint64_t reserve = 0;
      if (!staged_.contains(id)) {
        // A new partition, or one that grows: admitted only if, once it is committed, the free
        // space under the cap still holds a copy-on-write of the largest partition. (A Put that
        // does not grow a partition always fits: the reserve is there for it.)
        const auto it = store_->records_.find(id);
        const uint64_t old = it == store_->records_.end() ? 0 : ExtentBytes(it->second.extents);
        if (len > old) {
          const uint64_t grow = len - old;
          const uint64_t largest =
              std::max(len, store_->lengths_.empty() ? 0 : *store_->lengths_.rbegin());
          const uint64_t free = capacity - used;
          if (grow > free || free - grow < largest) {
            uint64_t stored = grow;
            for (uint64_t l : store_->lengths_) stored += l;
            return absl::ResourceExhaustedError(absl::StrCat(
                context, ": ", old == 0 ? "admitting " : "growing the partition by ", grow,
                " more bytes would leave ", grow > free ? 0 : free - grow, " free, less than the ",
                largest, " a copy-on-write of the largest partition needs (", used, " of ",
                capacity, " bytes in use, the cap; a store for these partitions needs ",
                stored + largest, " bytes: their sum plus the largest; nothing was written)"));
          }
          // The files are grown to hold that reserve now, not when a rewrite needs it.
          reserve = largest;
        }
      }
      if (len > capacity - used) {
        return absl::ResourceExhaustedError(
            absl::StrCat(context, ": no room for ", len, " bytes under the cap (", used, " of ",
                         capacity, " bytes in use; nothing was written)"));
      }
      target = std::min(capacity, used + len + reserve);
      if (store_->AllocatedLocked() >= target) return store_->AllocateLocked(len);
    }
    MutexLock grow(&store_->grow_mu_);
    STRATA_RETURN_IF_ERROR(store_->Grow(target, context));
  }
}

absl::Status NvmeStore::Batch::Keep(PartitionId id, std::vector<StoreExtent> extents,
                                    uint64_t length, uint64_t checksum, absl::Status written,
                                    const std::string& context) {
  if (!written.ok()) {
    MutexLock lock(&store_->mu_);
    store_->FreeLocked(extents);
    return Annotate(written, context);
  }
  auto [it, added] = staged_.try_emplace(id);
  if (!added) LetGo(it->second.extents);  // the copy it replaces
  it->second = Staged{std::move(extents), length, checksum};
  return absl::OkStatus();
}

absl::Status NvmeStore::Batch::Stage(PartitionId id, absl::Span<const std::byte> bytes,
                                     uint64_t* checksum) {
  const std::string context = absl::StrCat("nvme store: put partition ", id);
  if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(context, ": no bytes"));
  STRATA_ASSIGN_OR_RETURN(std::vector<StoreExtent> extents, Allocate(id, bytes.size(), context));
  // The checksum is computed while the bytes are being written (the engine only reads them).
  Pending written = store_->WritePieces(extents, 0, bytes);
  const uint64_t sum = Checksum(bytes);
  absl::Status s = written.Wait();
  if (s.ok()) s = store_->SyncFiles(extents);
  if (checksum != nullptr) *checksum = sum;
  return Keep(id, std::move(extents), bytes.size(), sum, s, context);
}

absl::Status NvmeStore::Batch::StageChunked(PartitionId id, uint64_t length,
                                            absl::Span<std::byte> buffer_a,
                                            absl::Span<std::byte> buffer_b,
                                            const ChunkProducer& produce) {
  const std::string context = absl::StrCat("nvme store: put partition ", id);
  const uint64_t chunk = buffer_a.size();
  if (length == 0 || chunk == 0 || buffer_b.size() != chunk ||
      chunk % store_->options_.alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": needs bytes and two buffers of one size, a multiple of ",
                     store_->options_.alignment));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<StoreExtent> extents, Allocate(id, length, context));
  const std::array<absl::Span<std::byte>, 2> buffers = {buffer_a, buffer_b};
  XXH3_state_t* hash = XXH3_createState();
  XXH3_64bits_reset(hash);
  std::array<Pending, 2> writes;
  absl::Status s;
  for (uint64_t off = 0, i = 0; off < length && s.ok(); off += chunk, ++i) {
    const uint64_t n = std::min(chunk, length - off);
    Pending& pending = writes[i % 2];
    s.Update(pending.Wait());  // chunk i-2 left this buffer
    if (!s.ok()) break;
    const absl::Span<std::byte> buf = buffers[i % 2].subspan(0, n);
    s.Update(produce(off, buf));
    if (!s.ok()) break;
    XXH3_64bits_update(hash, buf.data(), n);
    pending = store_->WritePieces(extents, off, buf);
  }
  for (auto& w : writes) s.Update(w.Wait());
  const uint64_t sum = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  if (s.ok()) s = store_->SyncFiles(extents);
  return Keep(id, std::move(extents), length, sum, s, context);
}

absl::Status NvmeStore::Batch::Commit() {
  if (staged_.empty()) return absl::OkStatus();
  // Readers of these partitions finish before their old extents are freed (ids in order: no
  // deadlock between batches).
  std::vector<Mutex*> partition_locks;
  for (const auto& [id, st] : staged_) partition_locks.push_back(store_->PartitionMutex(id));
  for (Mutex* m : partition_locks) m->Lock();
  const std::string context = absl::StrCat("nvme store: put partition ", staged_.begin()->first,
                                           staged_.size() > 1 ? " and others" : "");
  // On failure the staged extents stay staged: for a Commit again, or Abort.
  bool maybe_logged = false;
  absl::Status result = store_->CommitRecord(staged_, {}, context, &maybe_logged);
  if (result.ok()) {
    staged_.clear();
    maybe_logged_ = false;
  } else {
    maybe_logged_ = maybe_logged_ || maybe_logged;
  }
  for (auto it = partition_locks.rbegin(); it != partition_locks.rend(); ++it) (*it)->Unlock();
  return result;
}

absl::Status NvmeStore::Get(PartitionId id, absl::Span<std::byte> out) {
  MutexLock partition(PartitionMutex(id));
  STRATA_ASSIGN_OR_RETURN(const PartitionRecord r, Find(id));
  if (out.size() != r.length) {
    return absl::InvalidArgumentError(absl::StrCat("nvme store: get partition ", id, ": it is ",
                                                   r.length, " bytes, the buffer ", out.size()));
  }
  // Read in chunks, all in flight at once; each chunk is hashed as soon as it is in, while the
  // later ones are still being read.
  constexpr uint64_t kChunk = 8 << 20;
  std::vector<Pending> chunks;
  for (uint64_t off = 0; off < r.length; off += kChunk) {
    chunks.push_back(ReadPieces(r, off, out.subspan(off, std::min(kChunk, r.length - off))));
  }
  XXH3_state_t* hash = options_.verify_on_get ? XXH3_createState() : nullptr;
  if (hash != nullptr) XXH3_64bits_reset(hash);
  absl::Status read;
  for (uint64_t i = 0; i < chunks.size(); ++i) {
    read.Update(chunks[i].Wait());
    if (hash != nullptr && read.ok()) {
      const uint64_t off = i * kChunk;
      XXH3_64bits_update(hash, out.data() + off, std::min(kChunk, r.length - off));
    }
  }
  const uint64_t sum = hash != nullptr ? XXH3_64bits_digest(hash) : 0;
  if (hash != nullptr) XXH3_freeState(hash);
  STRATA_RETURN_IF_ERROR(Annotate(read, absl::StrCat("nvme store: get partition ", id)));
  if (options_.verify_on_get && sum != r.checksum) return Mismatch(r, sum);
  return absl::OkStatus();
}

absl::Status NvmeStore::GetChunked(PartitionId id, absl::Span<std::byte> buffer_a,
                                   absl::Span<std::byte> buffer_b, const ChunkConsumer& consume) {
  const uint64_t chunk = buffer_a.size();
  if (chunk == 0 || buffer_b.size() != chunk || chunk % options_.alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("nvme store: get partition ", id,
                     ": needs two buffers of one size, a multiple of ", options_.alignment));
  }
  MutexLock partition(PartitionMutex(id));
  STRATA_ASSIGN_OR_RETURN(const PartitionRecord r, Find(id));
  const std::array<absl::Span<std::byte>, 2> buffers = {buffer_a, buffer_b};
  auto read = [&](uint64_t i) {
    const uint64_t off = i * chunk;
    return ReadPieces(r, off, buffers[i % 2].subspan(0, std::min(chunk, r.length - off)));
  };
  const uint64_t chunks = (r.length + chunk - 1) / chunk;
  XXH3_state_t* hash = XXH3_createState();
  XXH3_64bits_reset(hash);
  absl::Status s;
  Pending next = read(0);
  for (uint64_t i = 0; i < chunks && s.ok(); ++i) {
    s.Update(next.Wait());
    if (!s.ok()) break;
    if (i + 1 < chunks) next = read(i + 1);  // into the other buffer, while this one is consumed
    const uint64_t off = i * chunk, n = std::min(chunk, r.length - off);
    const absl::Span<const std::byte> got = buffers[i % 2].subspan(0, n);
    XXH3_64bits_update(hash, got.data(), n);
    s.Update(consume(off, got));
  }
  next.Wait().IgnoreError();
  const uint64_t sum = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  STRATA_RETURN_IF_ERROR(Annotate(s, absl::StrCat("nvme store: get partition ", id)));
  if (options_.verify_on_get && sum != r.checksum) return Mismatch(r, sum);
  return absl::OkStatus();
}

absl::Status NvmeStore::Erase(PartitionId id) {
  MutexLock partition(PartitionMutex(id));
  STRATA_RETURN_IF_ERROR(Find(id).status());
  return CommitRecord({}, {id}, absl::StrCat("nvme store: erase partition ", id));
}

absl::StatusOr<PartitionRecord> NvmeStore::Find(PartitionId id) const {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    return absl::NotFoundError(absl::StrCat("nvme store ", dir_, ": no partition ", id));
  }
  return it->second;
}

std::vector<PartitionRecord> NvmeStore::List() const {
  MutexLock lock(&mu_);
  std::vector<PartitionRecord> out;
  for (const auto& [id, r] : records_) out.push_back(r);
  std::sort(out.begin(), out.end(),
            [](const PartitionRecord& a, const PartitionRecord& b) { return a.id < b.id; });
  return out;
}

uint64_t NvmeStore::generation() const {
  MutexLock lock(&mu_);
  return generation_;
}

uint64_t NvmeStore::used_bytes() const {
  MutexLock lock(&mu_);
  return used_;
}

uint64_t NvmeStore::capacity_bytes() const { return capacity_; }

uint64_t NvmeStore::allocated_bytes() const {
  MutexLock lock(&mu_);
  return AllocatedLocked();
}

uint64_t NvmeStore::log_bytes() const {
  MutexLock commit(&commit_mu_);
  return log_end_;
}

absl::StatusOr<double> MeasureCommitSeconds(const std::string& scratch, aio::Engine* engine,
                                            int puts) {
  std::error_code ec;
  if (puts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("puts is ", puts, "; at least 1"));
  }
  if (std::filesystem::exists(scratch, ec)) {
    return absl::AlreadyExistsError(
        absl::StrCat("measuring the store's commit: ", scratch, " already exists"));
  }
  absl::StatusOr<std::vector<double>> seconds = [&]() -> absl::StatusOr<std::vector<double>> {
    NvmeStoreOptions so;
    so.capacity_bytes = 16 << 20;
    so.on_warning = [](absl::string_view) {};
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NvmeStore> store, NvmeStore::Open(scratch, so, engine));
    STRATA_ASSIGN_OR_RETURN(aio::AlignedBuffer block, aio::AlignedBuffer::Allocate(4096));
    std::memset(block.data(), 0x5a, 4096);
    std::vector<double> s;
    for (int i = 0; i < puts; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(store->Put(0, {block.data(), 4096}));
      s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return s;
  }();
  std::filesystem::remove_all(scratch, ec);
  if (!seconds.ok()) {
    return Annotate(seconds.status(), absl::StrCat("measuring the store's commit under ", scratch));
  }
  std::sort(seconds->begin(), seconds->end());
  return (*seconds)[seconds->size() / 2];
}

}  // namespace strata::tiering
