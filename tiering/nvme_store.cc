#include "tiering/nvme_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <array>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <future>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::tiering {
namespace {

constexpr char kManifest[] = "manifest.json";
constexpr char kManifestTmp[] = "manifest.json.tmp";
constexpr int kFormat = 1;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string SwapName(uint32_t i) { return absl::StrFormat("swap-%03d.bin", i); }

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

// The manifest's checksum covers its canonical text without the checksum field.
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

}  // namespace

NvmeStore::~NvmeStore() = default;

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
  } else if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("nvme store: nvme_path ", dir, " is not a directory"));
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return Annotate(ErrnoStatus(errno, "access", dir), "nvme store: nvme_path is not writable");
  }

  const std::string manifest = dir + "/" + kManifest;
  if (std::filesystem::exists(manifest)) {
    STRATA_RETURN_IF_ERROR(store->LoadManifest(corrupt));
    return store;
  }

  // A new store: check the space, then reserve it.
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError("nvme store: capacity_bytes: must be > 0");
  }
  const uint64_t capacity = AlignUp(options.capacity_bytes, options.alignment);
  struct statvfs vfs;
  if (statvfs(dir.c_str(), &vfs) != 0) return ErrnoStatus(errno, "statvfs", dir);
  const uint64_t available = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (available < capacity) {
    return absl::ResourceExhaustedError(absl::StrCat("nvme store: ", dir, " has ", available,
                                                     " bytes free; the store needs ", capacity,
                                                     " (nothing was written)"));
  }
  const uint64_t file_bytes = AlignUp(options.file_bytes, options.alignment);
  std::vector<std::string> created;
  auto undo = [&] {
    store->files_.clear();
    for (const auto& p : created) unlink(p.c_str());
  };
  for (uint64_t reserved = 0; reserved < capacity;) {
    const uint64_t size = std::min(file_bytes, capacity - reserved);
    const uint32_t index = static_cast<uint32_t>(store->files_.size());
    const std::string path = dir + "/" + SwapName(index);
    aio::OpenOptions oo;
    oo.writable = oo.create = oo.truncate = true;
    auto file = engine->Open(path, oo);
    if (!file.ok()) {
      undo();
      return Annotate(file.status(), "nvme store");
    }
    created.push_back(path);
    if (absl::Status s = file->Allocate(0, size); !s.ok()) {
      undo();
      return Annotate(s, "nvme store: reserving swap space");
    }
    store->files_.push_back(*std::move(file));
    store->file_sizes_.push_back(size);
    reserved += size;
  }
  MutexLock lock(&store->mu_);
  store->free_.resize(store->files_.size());
  for (size_t i = 0; i < store->files_.size(); ++i) store->free_[i][0] = store->file_sizes_[i];
  if (absl::Status s = store->CommitLocked(); !s.ok()) {
    undo();
    return s;
  }
  return store;
}

absl::Status NvmeStore::LoadManifest(std::vector<PartitionId>* corrupt) {
  const std::string path = dir_ + "/" + kManifest;
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("nvme store: manifest ", path, ": ", what));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not valid JSON");
  if (j.value("strata_nvme_store", 0) != kFormat) return bad("not a strata store manifest");
  auto stored = ParseHex(j.value("checksum", std::string()));
  if (!stored.ok() || *stored != ManifestChecksum(j)) {
    return bad("checksum does not match its contents (damaged)");
  }
  MutexLock lock(&mu_);
  try {
    generation_ = j.at("generation").get<uint64_t>();
    options_.alignment = j.at("alignment").get<uint64_t>();
    for (const auto& f : j.at("files")) {
      const std::string fpath = dir_ + "/" + f.at("name").get<std::string>();
      aio::OpenOptions oo;
      oo.writable = true;
      auto file = engine_->Open(fpath, oo);
      if (!file.ok()) return Annotate(file.status(), "nvme store");
      const uint64_t size = f.at("bytes").get<uint64_t>();
      auto actual = file->Size();
      if (!actual.ok()) return actual.status();
      if (*actual < size) {
        return bad(absl::StrCat(fpath, " is ", *actual, " bytes, the manifest says ", size));
      }
      files_.push_back(*std::move(file));
      file_sizes_.push_back(size);
    }
    free_.assign(files_.size(), {});
    for (size_t i = 0; i < files_.size(); ++i) free_[i][0] = file_sizes_[i];
    for (const auto& p : j.at("partitions")) {
      PartitionRecord r;
      r.id = p.at("id").get<uint64_t>();
      r.file = p.at("file").get<uint32_t>();
      r.offset = p.at("offset").get<uint64_t>();
      r.length = p.at("length").get<uint64_t>();
      auto sum = ParseHex(p.at("checksum").get<std::string>());
      if (!sum.ok()) return bad(absl::StrCat("partition ", r.id, ": bad checksum field"));
      r.checksum = *sum;
      r.generation = p.at("generation").get<uint64_t>();
      if (r.file >= files_.size() || r.offset + r.length > file_sizes_[r.file]) {
        return bad(absl::StrCat("partition ", r.id, " lies outside its swap file"));
      }
      // Take the extent out of the free list.
      const uint64_t len = AlignUp(r.length, options_.alignment);
      auto& fl = free_[r.file];
      auto it = fl.upper_bound(r.offset);
      if (it == fl.begin() || std::prev(it)->first + std::prev(it)->second < r.offset + len) {
        return bad(absl::StrCat("partition ", r.id, " overlaps another"));
      }
      --it;
      const uint64_t start = it->first, flen = it->second;
      fl.erase(it);
      if (r.offset > start) fl[start] = r.offset - start;
      if (start + flen > r.offset + len) fl[r.offset + len] = start + flen - (r.offset + len);
      used_ += len;
      records_[r.id] = r;
    }
  } catch (const nlohmann::json::exception& e) {
    return bad(absl::StrCat("missing or mistyped field (", e.what(), ")"));
  }
  // Verify every partition's bytes.
  std::vector<std::byte> scratch;
  for (const auto& [id, r] : records_) {
    absl::Status s = VerifyRecord(r, &scratch);
    if (s.code() == absl::StatusCode::kDataLoss) {
      if (corrupt != nullptr) corrupt->push_back(id);
    } else if (!s.ok()) {
      return s;
    }
  }
  if (corrupt != nullptr) std::sort(corrupt->begin(), corrupt->end());
  return absl::OkStatus();
}

absl::Status NvmeStore::VerifyRecord(const PartitionRecord& r, std::vector<std::byte>* scratch) {
  scratch->resize(r.length);
  STRATA_RETURN_IF_ERROR(engine_->ReadSync(files_[r.file], r.offset, absl::MakeSpan(*scratch)));
  const uint64_t sum = Checksum(*scratch);
  if (sum != r.checksum) return Mismatch(r, sum);
  return absl::OkStatus();
}

absl::Status NvmeStore::Mismatch(const PartitionRecord& r, uint64_t sum) const {
  return absl::DataLossError(absl::StrCat(
      "nvme store: partition ", r.id, " in ", dir_, "/", SwapName(r.file), " @ ", r.offset, " len ",
      r.length, ": checksum ", Hex(sum), " does not match the manifest's ", Hex(r.checksum)));
}

Mutex* NvmeStore::PartitionMutex(PartitionId id) {
  MutexLock lock(&mu_);
  auto& m = partition_mu_[id];
  if (m == nullptr) m = std::make_unique<Mutex>();
  return m.get();
}

absl::StatusOr<NvmeStore::Extent> NvmeStore::AllocateLocked(uint64_t length) {
  const uint64_t len = AlignUp(length, options_.alignment);
  for (uint32_t f = 0; f < free_.size(); ++f) {
    for (auto it = free_[f].begin(); it != free_[f].end(); ++it) {
      if (it->second < len) continue;
      const Extent e{f, it->first, len};
      const uint64_t rest = it->second - len, rest_at = it->first + len;
      free_[f].erase(it);
      if (rest > 0) free_[f][rest_at] = rest;
      used_ += len;
      return e;
    }
  }
  return absl::ResourceExhaustedError(absl::StrCat("nvme store ", dir_, ": no free extent of ", len,
                                                   " bytes (", used_, " of ", capacity_bytes(),
                                                   " bytes in use; nothing was written)"));
}

void NvmeStore::FreeLocked(const Extent& e) {
  auto& fl = free_[e.file];
  uint64_t start = e.offset, len = e.length;
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
  used_ -= e.length;
}

absl::Status NvmeStore::CommitLocked() {
  nlohmann::json j;
  j["strata_nvme_store"] = kFormat;
  j["generation"] = generation_ + 1;
  j["alignment"] = options_.alignment;
  j["files"] = nlohmann::json::array();
  for (uint32_t i = 0; i < file_sizes_.size(); ++i) {
    j["files"].push_back({{"name", SwapName(i)}, {"bytes", file_sizes_[i]}});
  }
  j["partitions"] = nlohmann::json::array();
  std::vector<PartitionId> ids;
  for (const auto& [id, r] : records_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (PartitionId id : ids) {
    const PartitionRecord& r = records_.at(id);
    j["partitions"].push_back({{"id", r.id},
                               {"file", r.file},
                               {"offset", r.offset},
                               {"length", r.length},
                               {"checksum", Hex(r.checksum)},
                               {"generation", r.generation}});
  }
  j["checksum"] = Hex(ManifestChecksum(j));
  const std::string text = j.dump(1) + "\n";
  const std::string tmp = dir_ + "/" + kManifestTmp, final_path = dir_ + "/" + kManifest;
  {
    aio::OpenOptions oo;
    oo.writable = oo.create = oo.truncate = true;
    auto file = engine_->Open(tmp, oo);
    if (!file.ok()) return Annotate(file.status(), "nvme store: manifest");
    STRATA_RETURN_IF_ERROR(
        Annotate(engine_->WriteSync(*file, 0,
                                    {reinterpret_cast<const std::byte*>(text.data()), text.size()}),
                 "nvme store: writing the manifest"));
    STRATA_RETURN_IF_ERROR(file->Sync());
  }
  if (rename(tmp.c_str(), final_path.c_str()) != 0) {
    return ErrnoStatus(errno, "rename", tmp + " -> " + final_path);
  }
  STRATA_RETURN_IF_ERROR(SyncDir(dir_));
  ++generation_;
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
  MutexLock lock(&store_->mu_);
  for (const auto& [id, st] : staged_) store_->FreeLocked(st.extent);
  staged_.clear();
}

absl::Status NvmeStore::Batch::Stage(PartitionId id, absl::Span<const std::byte> bytes) {
  const std::string context = absl::StrCat("nvme store: put partition ", id);
  if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(context, ": no bytes"));
  Extent e;
  {
    MutexLock lock(&store_->mu_);
    STRATA_ASSIGN_OR_RETURN(e, store_->AllocateLocked(bytes.size()));
  }
  // The checksum is computed while the bytes are being written (the engine only reads them).
  std::future<absl::Status> written =
      store_->engine_->WriteAsync(store_->files_[e.file], e.offset, bytes);
  const uint64_t sum = Checksum(bytes);
  absl::Status s = written.get();
  if (s.ok()) s = store_->files_[e.file].Sync();
  MutexLock lock(&store_->mu_);
  if (!s.ok()) {
    store_->FreeLocked(e);
    return Annotate(s, context);
  }
  if (auto it = staged_.find(id); it != staged_.end()) store_->FreeLocked(it->second.extent);
  staged_[id] = Staged{e, bytes.size(), sum};
  return absl::OkStatus();
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
  Extent e;
  {
    MutexLock lock(&store_->mu_);
    STRATA_ASSIGN_OR_RETURN(e, store_->AllocateLocked(length));
  }
  const std::array<absl::Span<std::byte>, 2> buffers = {buffer_a, buffer_b};
  XXH3_state_t* hash = XXH3_createState();
  XXH3_64bits_reset(hash);
  std::array<std::future<absl::Status>, 2> writes;
  absl::Status s;
  for (uint64_t off = 0, i = 0; off < length && s.ok(); off += chunk, ++i) {
    const uint64_t n = std::min(chunk, length - off);
    std::future<absl::Status>& pending = writes[i % 2];
    if (pending.valid()) s.Update(pending.get());  // chunk i-2 left this buffer
    if (!s.ok()) break;
    const absl::Span<std::byte> buf = buffers[i % 2].subspan(0, n);
    s.Update(produce(off, buf));
    if (!s.ok()) break;
    XXH3_64bits_update(hash, buf.data(), n);
    pending = store_->engine_->WriteAsync(store_->files_[e.file], e.offset + off, buf);
  }
  for (auto& w : writes) {
    if (w.valid()) s.Update(w.get());
  }
  const uint64_t sum = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  if (s.ok()) s = store_->files_[e.file].Sync();
  MutexLock lock(&store_->mu_);
  if (!s.ok()) {
    store_->FreeLocked(e);
    return Annotate(s, context);
  }
  if (auto it = staged_.find(id); it != staged_.end()) store_->FreeLocked(it->second.extent);
  staged_[id] = Staged{e, length, sum};
  return absl::OkStatus();
}

absl::Status NvmeStore::Batch::Commit() {
  if (staged_.empty()) return absl::OkStatus();
  // Readers of these partitions finish before their old extents are freed (ids in order: no
  // deadlock between batches).
  std::vector<Mutex*> partition_locks;
  for (const auto& [id, st] : staged_) partition_locks.push_back(store_->PartitionMutex(id));
  for (Mutex* m : partition_locks) m->Lock();
  absl::Status result;
  {
    MutexLock lock(&store_->mu_);
    std::map<PartitionId, std::optional<PartitionRecord>> old;
    for (const auto& [id, st] : staged_) {
      auto it = store_->records_.find(id);
      old[id] =
          it == store_->records_.end() ? std::nullopt : std::optional<PartitionRecord>(it->second);
      store_->records_[id] = PartitionRecord{id,        st.extent.file, st.extent.offset,
                                             st.length, st.checksum,    store_->generation_ + 1};
    }
    result = store_->CommitLocked();
    if (!result.ok()) {
      // The manifest in force is still the previous one: so are the previous copies.
      for (const auto& [id, r] : old) {
        if (r) {
          store_->records_[id] = *r;
        } else {
          store_->records_.erase(id);
        }
      }
      for (const auto& [id, st] : staged_) store_->FreeLocked(st.extent);
      result = Annotate(result, absl::StrCat("nvme store: put partition ", staged_.begin()->first,
                                             staged_.size() > 1 ? " and others" : ""));
    } else {
      for (const auto& [id, r] : old) {
        if (r)
          store_->FreeLocked({r->file, r->offset, AlignUp(r->length, store_->options_.alignment)});
      }
    }
    staged_.clear();
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
  std::vector<std::future<absl::Status>> chunks;
  for (uint64_t off = 0; off < r.length; off += kChunk) {
    chunks.push_back(engine_->ReadAsync(files_[r.file], r.offset + off,
                                        out.subspan(off, std::min(kChunk, r.length - off))));
  }
  XXH3_state_t* hash = options_.verify_on_get ? XXH3_createState() : nullptr;
  if (hash != nullptr) XXH3_64bits_reset(hash);
  absl::Status read;
  for (uint64_t i = 0; i < chunks.size(); ++i) {
    read.Update(chunks[i].get());
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
    return engine_->ReadAsync(files_[r.file], r.offset + off,
                              buffers[i % 2].subspan(0, std::min(chunk, r.length - off)));
  };
  const uint64_t chunks = (r.length + chunk - 1) / chunk;
  XXH3_state_t* hash = XXH3_createState();
  XXH3_64bits_reset(hash);
  absl::Status s;
  std::future<absl::Status> next = read(0);
  for (uint64_t i = 0; i < chunks && s.ok(); ++i) {
    s.Update(next.get());
    if (!s.ok()) break;
    if (i + 1 < chunks) next = read(i + 1);  // into the other buffer, while this one is consumed
    const uint64_t off = i * chunk, n = std::min(chunk, r.length - off);
    const absl::Span<const std::byte> got = buffers[i % 2].subspan(0, n);
    XXH3_64bits_update(hash, got.data(), n);
    s.Update(consume(off, got));
  }
  if (next.valid()) next.wait();
  const uint64_t sum = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  STRATA_RETURN_IF_ERROR(Annotate(s, absl::StrCat("nvme store: get partition ", id)));
  if (options_.verify_on_get && sum != r.checksum) return Mismatch(r, sum);
  return absl::OkStatus();
}

absl::Status NvmeStore::Erase(PartitionId id) {
  MutexLock partition(PartitionMutex(id));
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    return absl::NotFoundError(absl::StrCat("nvme store ", dir_, ": no partition ", id));
  }
  const PartitionRecord old = it->second;
  records_.erase(it);
  if (absl::Status s = CommitLocked(); !s.ok()) {
    records_[id] = old;
    return Annotate(s, absl::StrCat("nvme store: erase partition ", id));
  }
  FreeLocked({old.file, old.offset, AlignUp(old.length, options_.alignment)});
  return absl::OkStatus();
}

absl::StatusOr<PartitionRecord> NvmeStore::Find(PartitionId id) const {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    return absl::NotFoundError(absl::StrCat("nvme store ", dir_, ": no partition ", id));
  }
  return it->second;
}

uint64_t NvmeStore::generation() const {
  MutexLock lock(&mu_);
  return generation_;
}

uint64_t NvmeStore::used_bytes() const {
  MutexLock lock(&mu_);
  return used_;
}

uint64_t NvmeStore::capacity_bytes() const {
  uint64_t total = 0;
  for (uint64_t s : file_sizes_) total += s;
  return total;
}

}  // namespace strata::tiering
