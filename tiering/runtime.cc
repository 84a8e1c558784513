#include "tiering/runtime.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace strata::tiering {
namespace {

using Clock = std::chrono::steady_clock;
int I(Tier t) { return static_cast<int>(t); }
bool IsMemory(Tier t) { return t != Tier::kNvme; }

// `value` when >= 0; else the environment variable `name` (a launcher's), else 0.
absl::StatusOr<int> FromEnvironment(int value, const char* name, absl::string_view option) {
  if (value >= 0) return value;
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return 0;
  int parsed = 0;
  if (!absl::SimpleAtoi(env, &parsed) || parsed < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment: ", name, "=\"", env,
        "\" is not a rank (a non-negative integer); unset it or set RuntimeOptions::", option));
  }
  return parsed;
}

// Protects a partition's copies from eviction for a scope (see MakeRoomLocked).
class Protect {
 public:
  Protect(std::vector<PartitionId>* list, PartitionId id) : list_(list) { list_->push_back(id); }
  ~Protect() { list_->pop_back(); }

 private:
  std::vector<PartitionId>* list_;
};

}  // namespace

void Runtime::Warn(std::string w) {
  if (options_.on_warning) {
    options_.on_warning(w);
  } else {
    std::fprintf(stderr, "strata: %s\n", w.c_str());
  }
  MutexLock lock(&warnings_mu_);
  warnings_.push_back(std::move(w));
}

std::vector<std::string> Runtime::warnings() const {
  MutexLock lock(&warnings_mu_);
  return warnings_;
}

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::Create(const RuntimeConfig& config,
                                                         RuntimeOptions options) {
  auto rt = std::unique_ptr<Runtime>(new Runtime());
  rt->config_ = config;
  rt->options_ = std::move(options);
  aio::EngineOptions eo = rt->options_.engine_options;
  if (!eo.on_warning)
    eo.on_warning = [r = rt.get()](absl::string_view w) { r->Warn(std::string(w)); };
  STRATA_ASSIGN_OR_RETURN(rt->engine_, aio::Engine::Create(config.aio, eo));
  STRATA_ASSIGN_OR_RETURN(const int rank, FromEnvironment(rt->options_.rank, "RANK", "rank"));
  const std::string base = config.SwapPath();
  const std::string swap = base.empty() ? "" : absl::StrCat(base, "/rank", rank);
  if (!swap.empty()) {
    if (mkdir(base.c_str(), 0700) != 0 && errno != EEXIST) {
      return Annotate(ErrnoStatus(errno, "mkdir", base),
                      "config: nvme_path must be a directory that exists or can be made");
    }
    struct stat st;
    if (stat(base.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("config: nvme_path ", base, " is not a directory"));
    }
    NvmeStoreOptions so;
    so.capacity_bytes = config.nvme_capacity_bytes;
    so.on_warning = [r = rt.get()](absl::string_view w) { r->Warn(std::string(w)); };
    STRATA_ASSIGN_OR_RETURN(rt->store_, NvmeStore::Open(swap, so, rt->engine_.get()));
  }
  if (config.emulated_device) {
    rt->Warn(
        "strata.device is \"emulated\": the device tier is ordinary host memory with its own "
        "budget (device_budget_bytes), copied by a worker thread, and Acquire(kDevice) hands back "
        "host pointers. Nothing runs on a GPU; on a machine with one, set strata.device to "
        "\"cuda\".");
    rt->device_memory_ = std::make_unique<HostMemoryResource>("device memory (host-emulated)");
    rt->copy_ = std::make_unique<HostCopyEngine>(config.copy_bandwidth_bytes_per_s);
  } else {
    STRATA_ASSIGN_OR_RETURN(
        const int device, FromEnvironment(rt->options_.device_index, "LOCAL_RANK", "device_index"));
    auto memory = CreateCudaDeviceResource(device);
    if (!memory.ok()) return Annotate(memory.status(), "config: strata.device is \"cuda\"");
    rt->device_memory_ = *std::move(memory);
    STRATA_ASSIGN_OR_RETURN(rt->copy_, CreateCudaCopyEngine(device));
  }
  // Pinned host memory: near the NVMe drive's NUMA node, registered with CUDA on a real device,
  // pinned once and pooled (freed blocks are reused, up to the host budget).
  PinnedOptions po;
  po.on_warning = [r = rt.get()](absl::string_view w) { r->Warn(std::string(w)); };
  po.numa_node = swap.empty() ? -1 : NumaNodeNearest(swap);
  po.cuda_register = !config.emulated_device;
  rt->pinned_memory_ = std::make_unique<PinnedHostResource>(po);
  rt->host_memory_ =
      std::make_unique<PoolingResource>(rt->pinned_memory_.get(), config.host_budget_bytes);
  // The two staging buffers of NVMe <-> device moves come out of the host budget: set aside now,
  // allocated (from the same pool) on first use.
  uint64_t host_for_partitions = config.host_budget_bytes;
  if (rt->store_ != nullptr) {
    // offload_param.buffer_size is checked by the config (4 KiB..256 MiB); whole pages here.
    rt->staging_bytes_ = (static_cast<uint64_t>(
                              std::max<int64_t>(config.offload_param.buffer_size, kMinBufferSize)) +
                          4095) /
                         4096 * 4096;
    if (2 * rt->staging_bytes_ > config.host_budget_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: the two staging buffers of offload_param.buffer_size (2 x ",
                       rt->staging_bytes_, " bytes) do not fit in strata.host_budget_bytes (",
                       config.host_budget_bytes, "); lower buffer_size or raise the host budget"));
    }
    host_for_partitions -= 2 * rt->staging_bytes_;
  }
  rt->table_ = std::make_unique<ResidencyTable>(
      std::array<uint64_t, kTierCount>{config.device_budget_bytes, host_for_partitions,
                                       rt->store_ ? rt->store_->capacity_bytes() : 0});
  return rt;
}

Runtime::~Runtime() {
  {
    MutexLock lock(&prefetch_mu_);
    prefetch_stop_ = true;
    for (auto& r : prefetch_queue_) {
      r.done.set_value(absl::CancelledError("prefetch: the Runtime was destroyed"));
    }
    prefetch_queue_.clear();
    prefetch_cv_.SignalAll();
  }
  if (prefetch_thread_.joinable()) prefetch_thread_.join();
  if (store_ != nullptr) {
    {
      // Pins the trainer left are dropped: the process is letting go of the partitions.
      MutexLock lock(&mu_);
      for (const auto& [id, b] : buffers_) {
        for (Tier t : {Tier::kDevice, Tier::kHost}) {
          while (table_->Unpin(id, t).ok()) {
          }
        }
      }
    }
    if (absl::Status s = Flush(); !s.ok()) {
      Warn(
          absl::StrCat("partitions were not written back to NVMe when the Runtime was destroyed; "
                       "their latest bytes are lost: ",
                       s.message()));
    }
  }
  MutexLock lock(&mu_);
  for (std::byte* b : staging_) {
    if (b != nullptr) host_memory_->Deallocate(b, staging_bytes_);
  }
  for (auto& [id, b] : buffers_) {
    auto r = table_->Get(id);
    if (!r.ok()) continue;
    for (Tier t : {Tier::kDevice, Tier::kHost}) {
      if (b.ptr[I(t)] != nullptr) ResourceFor(t).Deallocate(b.ptr[I(t)], r->desc.bytes);
    }
  }
}

MemoryResource& Runtime::ResourceFor(Tier t) {
  return t == Tier::kDevice ? *device_memory_ : *host_memory_;
}

absl::Status Runtime::Register(const PartitionDesc& desc, Tier tier,
                               absl::Span<const std::byte> initial) {
  if (!initial.empty() && initial.size() != desc.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("partition ", desc.id, ": initial bytes are ",
                                                   initial.size(), ", the partition ", desc.bytes));
  }
  if (tier == Tier::kNvme && store_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("partition ", desc.id,
                     ": no NVMe tier (set an nvme_path in offload_param, "
                     "offload_optimizer or strata)"));
  }
  if (table_->Get(desc.id).ok()) {
    return absl::AlreadyExistsError(absl::StrCat("partition ", desc.id, ": already registered"));
  }
  if (store_ != nullptr && store_->Find(desc.id).ok()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "partition ", desc.id, ": the NVMe store ", store_->dir(),
        " already holds it (from an earlier run); Adopt it to keep its bytes, or Unregister it "
        "first"));
  }
  MutexLock lock(&mu_);
  STRATA_RETURN_IF_ERROR(table_->Register(desc));
  auto undo = [&](absl::Status s) {
    table_->Unregister(desc.id).IgnoreError();
    buffers_.erase(desc.id);
    return s;
  };
  absl::Status s = table_->Materialize(desc.id, tier);
  if (s.code() == absl::StatusCode::kResourceExhausted && IsMemory(tier)) {
    if (absl::Status room = MakeRoomLocked(tier, desc.bytes); !room.ok()) return undo(room);
    s = table_->Materialize(desc.id, tier);
  }
  if (!s.ok()) return undo(s);
  if (tier == Tier::kNvme) {
    // Through the staging buffers, chunk by chunk: never the whole partition in memory.
    if (absl::Status st = StagingLocked(); !st.ok()) return undo(st);
    auto batch = store_->NewBatch();
    absl::Status put = batch->StageChunked(
        desc.id, desc.bytes, {staging_[0], staging_bytes_}, {staging_[1], staging_bytes_},
        [&](uint64_t off, absl::Span<std::byte> chunk) {
          if (initial.empty()) {
            std::memset(chunk.data(), 0, chunk.size());
          } else {
            std::memcpy(chunk.data(), initial.data() + off, chunk.size());
          }
          return absl::OkStatus();
        });
    if (put.ok()) put = batch->Commit();
    if (!put.ok()) return undo(put);
    return absl::OkStatus();
  }
  absl::StatusOr<void*> p = ResourceFor(tier).Allocate(desc.bytes);
  if (!p.ok()) return undo(p.status());
  auto* bytes = static_cast<std::byte*>(*p);
  if (tier == Tier::kDevice) {
    absl::Status c;
    if (initial.empty()) {
      // Zeros from one small buffer, chunk by chunk: never the whole partition in host memory.
      static const std::vector<std::byte> kZeros(1 << 20);
      for (uint64_t off = 0; off < desc.bytes && c.ok(); off += kZeros.size()) {
        c = copy_
                ->CopyAsync(bytes + off, kZeros.data(),
                            std::min<uint64_t>(kZeros.size(), desc.bytes - off),
                            CopyDirection::kHostToDevice)
                .get();
      }
    } else {
      c = copy_->CopyAsync(bytes, initial.data(), desc.bytes, CopyDirection::kHostToDevice).get();
    }
    if (!c.ok()) {
      device_memory_->Deallocate(bytes, desc.bytes);
      return undo(c);
    }
  } else if (initial.empty()) {
    std::memset(bytes, 0, desc.bytes);
  } else {
    std::memcpy(bytes, initial.data(), desc.bytes);
  }
  Buffers& b = buffers_[desc.id];
  b.ptr[I(tier)] = bytes;
  b.last_use[I(tier)] = ++tick_;
  return absl::OkStatus();
}

absl::Status Runtime::Adopt(const PartitionDesc& desc) {
  if (store_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("adopt partition ", desc.id, ": no NVMe tier to adopt it from"));
  }
  STRATA_ASSIGN_OR_RETURN(const PartitionRecord stored, store_->Find(desc.id));
  if (stored.length != desc.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("adopt partition ", desc.id,
                                                   ": the store holds ", stored.length,
                                                   " bytes, the descriptor says ", desc.bytes));
  }
  MutexLock lock(&mu_);
  STRATA_RETURN_IF_ERROR(table_->Register(desc));
  if (absl::Status s = table_->Materialize(desc.id, Tier::kNvme); !s.ok()) {
    table_->Unregister(desc.id).IgnoreError();
    return s;
  }
  return absl::OkStatus();
}

std::vector<PartitionRecord> Runtime::StoredPartitions() const {
  return store_ == nullptr ? std::vector<PartitionRecord>{} : store_->List();
}

absl::Status Runtime::Unregister(PartitionId id) {
  MutexLock lock(&mu_);
  auto r = table_->Get(id);
  if (!r.ok() && (store_ == nullptr || !store_->Find(id).ok())) return r.status();
  if (r.ok()) {
    for (Tier t : {Tier::kDevice, Tier::kHost}) {
      if (r->pins[I(t)] > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "unregister partition ", id, ": it is pinned in the ", TierName(t), " tier"));
      }
    }
  }
  // The NVMe copy goes first: once the store has forgotten it, nothing can bring it back.
  if (store_ != nullptr && store_->Find(id).ok()) STRATA_RETURN_IF_ERROR(store_->Erase(id));
  if (r.ok()) {
    STRATA_RETURN_IF_ERROR(table_->Unregister(id));
    auto it = buffers_.find(id);
    if (it != buffers_.end()) {
      for (Tier t : {Tier::kDevice, Tier::kHost}) {
        if (it->second.ptr[I(t)] != nullptr) {
          ResourceFor(t).Deallocate(it->second.ptr[I(t)], r->desc.bytes);
        }
      }
      buffers_.erase(it);
    }
  }
  return absl::OkStatus();
}

absl::Status Runtime::WriteBackLocked(PartitionId id) {
  STRATA_ASSIGN_OR_RETURN(Residency r, table_->Get(id));
  if (!r.written || r.current[I(Tier::kNvme)]) return absl::OkStatus();
  for (Tier t : {Tier::kDevice, Tier::kHost}) {
    if (r.current[I(t)] && r.pins[I(t)] > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("partition ", id, " is pinned in the ", TierName(t),
                       " tier with bytes NVMe does not have; release it first"));
    }
  }
  const Tier from = r.current[I(Tier::kHost)] ? Tier::kHost : Tier::kDevice;
  STRATA_RETURN_IF_ERROR(MoveLocked(id, from, Tier::kNvme));
  ++stats_.write_backs;
  return absl::OkStatus();
}

absl::Status Runtime::Flush() {
  if (store_ == nullptr) return absl::OkStatus();
  MutexLock lock(&mu_);
  std::vector<PartitionId> ids;
  for (const auto& [id, b] : buffers_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (PartitionId id : ids) {
    STRATA_RETURN_IF_ERROR(Annotate(WriteBackLocked(id), "flush"));
  }
  return absl::OkStatus();
}

absl::Status Runtime::MakeRoomLocked(Tier t, uint64_t bytes) {
  std::vector<PartitionId> skipped;  // victims whose eviction failed
  absl::Status last_failure;
  while (bytes > table_->budget_bytes(t) ||
         table_->used_bytes(t) > table_->budget_bytes(t) - bytes) {
    // The least recently used copy in `t` that is neither pinned nor moving nor protected.
    PartitionId victim = 0;
    uint64_t oldest = UINT64_MAX;
    for (const auto& [id, b] : buffers_) {
      if (b.ptr[I(t)] == nullptr || b.last_use[I(t)] >= oldest) continue;
      if (std::find(protected_.begin(), protected_.end(), id) != protected_.end() ||
          std::find(skipped.begin(), skipped.end(), id) != skipped.end()) {
        continue;
      }
      auto r = table_->Get(id);
      if (!r.ok() || r->pins[I(t)] > 0 || r->move) continue;
      victim = id;
      oldest = b.last_use[I(t)];
    }
    if (oldest == UINT64_MAX) {
      const uint64_t free =
          table_->budget_bytes(t) - std::min(table_->budget_bytes(t), table_->used_bytes(t));
      absl::Status full = absl::ResourceExhaustedError(
          absl::StrCat("the ", TierName(t), " tier's budget of ", table_->budget_bytes(t),
                       " bytes has ", free, " free, ", bytes, " needed, and every copy in it is ",
                       "pinned, in use by this move, or could not be evicted"));
      return last_failure.ok()
                 ? full
                 : Annotate(full, absl::StrCat("last eviction failure: ", last_failure.message()));
    }
    if (absl::Status s = EvictLocked(victim, t); !s.ok()) {
      skipped.push_back(victim);
      last_failure = s;
    }
  }
  return absl::OkStatus();
}

absl::Status Runtime::FreeCopyLocked(PartitionId id, Tier tier) {
  auto r = table_->Get(id);
  if (!r.ok()) return r.status();
  STRATA_RETURN_IF_ERROR(table_->Drop(id, tier));
  Buffers& b = buffers_[id];
  if (b.ptr[I(tier)] != nullptr) {
    ResourceFor(tier).Deallocate(b.ptr[I(tier)], r->desc.bytes);
    b.ptr[I(tier)] = nullptr;
  }
  return absl::OkStatus();
}

absl::Status Runtime::EvictLocked(PartitionId id, Tier tier) {
  if (!IsMemory(tier)) {
    return absl::InvalidArgumentError("evict: only the device and host tiers are evicted");
  }
  STRATA_ASSIGN_OR_RETURN(Residency r, table_->Get(id));
  if (!r.has_copy[I(tier)]) return absl::OkStatus();
  if (r.pins[I(tier)] > 0) {
    return absl::FailedPreconditionError(absl::StrCat("evict partition ", id,
                                                      ": it is pinned in the ", TierName(tier),
                                                      " tier (release it first)"));
  }
  int others = 0;
  for (int t = 0; t < kTierCount; ++t) others += t != I(tier) && r.current[t];
  if (r.current[I(tier)] && others == 0) {
    // Parameters offloaded to NVMe skip the host on the way down, as in ZeRO-Infinity.
    const bool device_to_nvme = tier == Tier::kDevice && store_ != nullptr &&
                                config_.offload_param.device == OffloadDevice::kNvme;
    const Tier lower = tier == Tier::kDevice && !device_to_nvme ? Tier::kHost : Tier::kNvme;
    if (lower == Tier::kNvme && store_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("partition ", id,
                       ": its host copy is the only current one and there is no NVMe tier "
                       "to write it back to"));
    }
    absl::Status down = MoveLocked(id, tier, lower);
    if (down.code() == absl::StatusCode::kResourceExhausted && lower == Tier::kHost &&
        store_ != nullptr) {
      // The host tier has no room: the device copy goes straight to NVMe, staged.
      down = MoveLocked(id, tier, Tier::kNvme);
    }
    STRATA_RETURN_IF_ERROR(down);
    ++stats_.write_backs;
  }
  STRATA_RETURN_IF_ERROR(FreeCopyLocked(id, tier));
  ++stats_.evictions;
  return absl::OkStatus();
}

absl::Status Runtime::StagingLocked() {
  if (staging_[0] != nullptr) return absl::OkStatus();
  // Two pinned buffers of offload_param.buffer_size (in whole 4 KiB pages), set aside
  // from the host budget at Create: allocated once, reused by every NVMe <-> device move.
  for (auto& b : staging_) {
    STRATA_ASSIGN_OR_RETURN(void* p, host_memory_->Allocate(staging_bytes_));
    b = static_cast<std::byte*>(p);
  }
  return absl::OkStatus();
}

absl::Status Runtime::MoveLocked(PartitionId id, Tier from, Tier to) {
  STRATA_ASSIGN_OR_RETURN(Residency r, table_->Get(id));
  const uint64_t bytes = r.desc.bytes;
  const Protect keep(&protected_, id);
  absl::Status begun = table_->BeginMove(id, from, to);
  if (begun.code() == absl::StatusCode::kResourceExhausted && IsMemory(to)) {
    STRATA_RETURN_IF_ERROR(MakeRoomLocked(to, bytes));
    begun = table_->BeginMove(id, from, to);
  }
  STRATA_RETURN_IF_ERROR(begun);
  Buffers& b = buffers_[id];
  bool allocated = false;
  if (IsMemory(to) && b.ptr[I(to)] == nullptr) {
    absl::StatusOr<void*> p = ResourceFor(to).Allocate(bytes);
    if (!p.ok()) {
      table_->EndMove(id, false).IgnoreError();
      return p.status();
    }
    b.ptr[I(to)] = static_cast<std::byte*>(*p);
    allocated = true;
  }
  absl::Status moved;
  const bool staged =
      (from == Tier::kNvme && to == Tier::kDevice) || (from == Tier::kDevice && to == Tier::kNvme);
  if (staged) moved = StagingLocked();
  if (!moved.ok()) {
    // no staging memory: fall through to the failure handling below
  } else if (from == Tier::kNvme && to == Tier::kDevice) {
    std::byte* dst = b.ptr[I(to)];
    moved = store_->GetChunked(id, {staging_[0], staging_bytes_}, {staging_[1], staging_bytes_},
                               [&](uint64_t off, absl::Span<const std::byte> chunk) {
                                 return copy_
                                     ->CopyAsync(dst + off, chunk.data(), chunk.size(),
                                                 CopyDirection::kHostToDevice)
                                     .get();
                               });
  } else if (from == Tier::kDevice && to == Tier::kNvme) {
    const std::byte* src = b.ptr[I(from)];
    auto batch = store_->NewBatch();
    moved = batch->StageChunked(
        id, bytes, {staging_[0], staging_bytes_}, {staging_[1], staging_bytes_},
        [&](uint64_t off, absl::Span<std::byte> chunk) {
          return copy_
              ->CopyAsync(chunk.data(), src + off, chunk.size(), CopyDirection::kDeviceToHost)
              .get();
        });
    if (moved.ok()) moved = batch->Commit();
  } else if (from == Tier::kNvme) {  // to host
    moved = store_->Get(id, {b.ptr[I(to)], bytes});
  } else if (to == Tier::kNvme) {  // from host
    moved = store_->Put(id, {b.ptr[I(from)], bytes});
  } else {
    moved = copy_
                ->CopyAsync(b.ptr[I(to)], b.ptr[I(from)], bytes,
                            to == Tier::kDevice ? CopyDirection::kHostToDevice
                                                : CopyDirection::kDeviceToHost)
                .get();
  }
  STRATA_RETURN_IF_ERROR(table_->EndMove(id, moved.ok()));
  if (!moved.ok()) {
    if (allocated) {
      ResourceFor(to).Deallocate(b.ptr[I(to)], bytes);
      b.ptr[I(to)] = nullptr;
    }
    return Annotate(
        moved, absl::StrCat("move of partition ", id, " ", TierName(from), " -> ", TierName(to)));
  }
  stats_.bytes_moved[I(from)][I(to)] += bytes;
  if (IsMemory(to)) b.last_use[I(to)] = ++tick_;
  return absl::OkStatus();
}

absl::Status Runtime::BringLocked(PartitionId id, Tier tier) {
  STRATA_ASSIGN_OR_RETURN(Residency r, table_->Get(id));
  if (r.current[I(tier)]) return absl::OkStatus();
  if (tier == Tier::kDevice) {
    // From host when it is current there; else straight from NVMe, staged in chunks.
    STRATA_RETURN_IF_ERROR(
        MoveLocked(id, r.current[I(Tier::kHost)] ? Tier::kHost : Tier::kNvme, Tier::kDevice));
  } else {
    STRATA_RETURN_IF_ERROR(
        MoveLocked(id, r.current[I(Tier::kDevice)] ? Tier::kDevice : Tier::kNvme, Tier::kHost));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::byte*> Runtime::Acquire(PartitionId id, Tier tier) {
  if (!IsMemory(tier)) {
    return absl::InvalidArgumentError("acquire: the device or host tier (nvme is not addressable)");
  }
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  ++stats_.acquires;
  absl::Status brought;
  STRATA_ASSIGN_OR_RETURN(Residency r, table_->Get(id));
  if (r.current[I(tier)]) {
    ++stats_.acquire_hits;
  } else {
    brought = BringLocked(id, tier);
  }
  stats_.acquire_wait_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  STRATA_RETURN_IF_ERROR(brought);
  STRATA_RETURN_IF_ERROR(table_->Pin(id, tier));
  Buffers& b = buffers_[id];
  b.last_use[I(tier)] = ++tick_;
  return b.ptr[I(tier)];
}

std::future<absl::Status> Runtime::Prefetch(PartitionId id, Tier tier) {
  std::promise<absl::Status> done;
  std::future<absl::Status> f = done.get_future();
  if (!IsMemory(tier)) {
    done.set_value(absl::InvalidArgumentError("prefetch: the device or host tier"));
    return f;
  }
  MutexLock lock(&prefetch_mu_);
  if (!prefetch_thread_.joinable()) prefetch_thread_ = std::thread([this] { PrefetchLoop(); });
  prefetch_queue_.push_back({id, tier, std::move(done)});
  prefetch_cv_.Signal();
  return f;
}

void Runtime::PrefetchLoop() {
  for (;;) {
    PrefetchRequest r;
    {
      MutexLock lock(&prefetch_mu_);
      while (!prefetch_stop_ && prefetch_queue_.empty()) prefetch_cv_.Wait(&prefetch_mu_);
      if (prefetch_stop_) return;
      r = std::move(prefetch_queue_.front());
      prefetch_queue_.pop_front();
    }
    MutexLock lock(&mu_);
    r.done.set_value(BringLocked(r.id, r.tier));  // not an acquire: no pin, no wait counted
  }
}

absl::Status Runtime::Release(PartitionId id, Tier tier, bool dirty) {
  MutexLock lock(&mu_);
  STRATA_RETURN_IF_ERROR(table_->Unpin(id, tier));
  if (!dirty) return absl::OkStatus();
  absl::StatusOr<std::vector<Tier>> stale = table_->MarkWritten(id, tier);
  if (!stale.ok()) {
    table_->Pin(id, tier).IgnoreError();  // as it was
    return stale.status();
  }
  for (Tier t : *stale) {
    // A stale NVMe copy keeps its extent until the next write-back replaces it.
    if (IsMemory(t)) STRATA_RETURN_IF_ERROR(FreeCopyLocked(id, t));
  }
  return absl::OkStatus();
}

absl::Status Runtime::Evict(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  return EvictLocked(id, tier);
}

RuntimeStats Runtime::stats() const {
  MutexLock lock(&mu_);
  RuntimeStats s = stats_;
  s.host_held_bytes = host_memory_->held_bytes();
  return s;
}

}  // namespace strata::tiering
