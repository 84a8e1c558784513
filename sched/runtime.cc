#include "sched/runtime.h"

#include <malloc.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "optim_cpu/thread_pool.h"
#include "sched/runtime_internal.h"

namespace strata::sched {

using internal::I;
using internal::kOptimizerKey;
using internal::Pages;
using tiering::Residency;

namespace {

using Clock = std::chrono::steady_clock;
bool IsMemory(Tier t) { return t != Tier::kNvme; }
// What a trainer waiting for a move from -> to waits for.
WaitCause MoveCause(Tier from, Tier to, bool eviction) {
  if (eviction || to == Tier::kNvme) return WaitCause::kWriteBack;
  return from == Tier::kNvme ? WaitCause::kNvmeRead : WaitCause::kCopy;
}
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

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

const char* ModeName(Scheduler::Mode m) {
  switch (m) {
    case Scheduler::Mode::kRecording:
      return "recorded";
    case Scheduler::Mode::kPlanned:
      return "planned";
    case Scheduler::Mode::kFallback:
      return "fallback";
    case Scheduler::Mode::kOnDemand:
      return "on-demand";
  }
  return "?";
}

// strata.malloc_mmap_threshold_bytes: the tiers' memory is mmap'd and returned when freed, but
// a trainer's own large blocks (torch's gradient tensors, the BLAS's buffers) come from malloc.
// glibc raises its mmap threshold to the size of each large block freed, after which such blocks
// come from its heap, and the heap stays as large as their busiest moment: measured, the resident
// memory of a 24 MiB-budget fine-tuning run rose by up to 120 MiB over what it held. A fixed
// threshold gives such blocks back to the system as they are freed.
void FixMallocMmapThreshold(uint64_t bytes) {
#if defined(__GLIBC__)
  if (bytes > 0) mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes));
#else
  (void)bytes;
#endif
}

}  // namespace

absl::string_view WaitCauseName(WaitCause c) {
  switch (c) {
    case WaitCause::kNvmeRead:
      return "nvme_read";
    case WaitCause::kCopy:
      return "copy";
    case WaitCause::kWriteBack:
      return "write_back";
    case WaitCause::kBudgetFull:
      return "budget_full";
  }
  return "?";
}

std::string StepReport::ToJson() const {
  nlohmann::ordered_json j;
  j["step"] = step;
  j["mode"] = mode;
  if (!divergence.empty()) j["divergence"] = divergence;
  j["seconds"] = seconds;
  j["wait_seconds"] = wait_seconds;
  for (int c = 0; c < kWaitCauseCount; ++c) {
    j["wait_by_cause"][std::string(WaitCauseName(static_cast<WaitCause>(c)))] = wait_by_cause[c];
  }
  for (int f = 0; f < tiering::kTierCount; ++f) {
    for (int t = 0; t < tiering::kTierCount; ++t) {
      if (f == t || bytes_moved[f][t] == 0) continue;
      j["bytes_moved"][absl::StrCat(TierName(static_cast<Tier>(f)), "_to_",
                                    TierName(static_cast<Tier>(t)))] = bytes_moved[f][t];
    }
  }
  if (!j.contains("bytes_moved")) j["bytes_moved"] = nlohmann::ordered_json::object();
  j["nvme_read_by_role"] = nlohmann::ordered_json::object();
  j["nvme_written_by_role"] = nlohmann::ordered_json::object();
  for (int r = 0; r < tiering::kRoleCount; ++r) {
    const std::string role(tiering::RoleName(static_cast<tiering::Role>(r)));
    if (nvme_by_role[r][0] > 0) j["nvme_read_by_role"][role] = nvme_by_role[r][0];
    if (nvme_by_role[r][1] > 0) j["nvme_written_by_role"][role] = nvme_by_role[r][1];
  }
  j["optimizer_state_read_bytes"] = optimizer_state_read_bytes;
  j["acquires"] = acquires;
  j["hits"] = hits;
  j["prefetch_hits"] = prefetch_hits;
  j["late_prefetches"] = late_prefetches;
  j["misses"] = misses;
  j["zero_fills"] = zero_fills;
  j["prefetches"] = prefetches;
  j["prefetch_failures"] = prefetch_failures;
  j["prefetches_blocked"] = prefetches_blocked;
  j["evictions"] = evictions;
  j["write_backs"] = write_backs;
  j["write_back_failures"] = write_back_failures;
  j["lookahead"] = lookahead;
  return j.dump();
}

void Runtime::Warn(std::string w) {
  if (options_.on_warning) {
    options_.on_warning(w);
  } else {
    std::fprintf(stderr, "strata: %s\n", w.c_str());
  }
  MutexLock lock(&warnings_mu_);
  warnings_.push_back(std::move(w));
}

void Runtime::WarnLocked(std::string w) { pending_warnings_.push_back(std::move(w)); }

void Runtime::TellWarnings() {
  std::vector<std::string> pending;
  {
    MutexLock lock(&mu_);
    pending.swap(pending_warnings_);
  }
  for (std::string& w : pending) Warn(std::move(w));
}

std::vector<std::string> Runtime::warnings() const {
  MutexLock lock(&warnings_mu_);
  return warnings_;
}

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::Create(const RuntimeConfig& config,
                                                         RuntimeOptions options) {
  if (options.workers < 1 || options.workers > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("RuntimeOptions::workers is ", options.workers, "; accepted: 1..64"));
  }
  auto rt = std::unique_ptr<Runtime>(new Runtime());
  rt->config_ = config;
  FixMallocMmapThreshold(config.malloc_mmap_threshold_bytes);
  rt->options_ = std::move(options);
  auto warn = [r = rt.get()](absl::string_view w) { r->Warn(std::string(w)); };
  aio::EngineOptions eo = rt->options_.engine_options;
  if (!eo.on_warning) eo.on_warning = warn;
  STRATA_ASSIGN_OR_RETURN(rt->engine_, aio::Engine::Create(config.aio, eo));
  STRATA_ASSIGN_OR_RETURN(const int rank, FromEnvironment(rt->options_.rank, "RANK", "rank"));
  const std::string base = config.SwapPath();
  const std::string swap = base.empty() ? "" : absl::StrCat(base, "/rank", rank);
  if (!swap.empty()) {
    struct stat st;
    std::error_code made;  // its missing parents too, as DeepSpeed's swap folders are
    if (stat(base.c_str(), &st) != 0 && !std::filesystem::create_directories(base, made) && made) {
      return Annotate(ErrnoStatus(made.value(), "mkdir -p", base),
                      "config: nvme_path must be a directory that exists or can be made");
    }
    if (stat(base.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("config: nvme_path ", base, " is not a directory"));
    }
    tiering::NvmeStoreOptions so;
    so.capacity_bytes = config.nvme_capacity_bytes;
    so.remove_files_on_close = !config.nvme_keep_files;
    // Swap files that no later process reopens need no sync on each commit (DeepSpeed's swap
    // files have none); kept ones (strata.nvme_keep_files) are synced, for a reopen after a crash.
    so.durable = config.nvme_keep_files;
    so.on_warning = warn;
    STRATA_ASSIGN_OR_RETURN(rt->store_, tiering::NvmeStore::Open(swap, so, rt->engine_.get()));
    // What the run may take, said before it takes it.
    struct statvfs vfs;
    const uint64_t free_bytes =
        statvfs(swap.c_str(), &vfs) == 0 ? static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize : 0;
    const uint64_t cap = rt->store_->capacity_bytes();
    rt->Warn(absl::StrCat(
        "NVMe store at ", swap, ": swap files grow on demand up to ", cap,
        " bytes (strata.nvme_capacity_bytes); ", free_bytes, " bytes free on that filesystem now",
        cap > free_bytes ? "; the cap is more than that: a run that needs it all fails when the "
                           "disk fills (ResourceExhausted naming the file)"
                         : "",
        config.nvme_keep_files ? "" : "; removed when the Runtime ends (strata.nvme_keep_files)"));
  }
  if (config.emulated_device) {
    rt->Warn(
        "strata.device is \"emulated\": the device tier is ordinary host memory with its own "
        "budget (device_budget_bytes), copied by a worker thread, and Acquire(kDevice) hands back "
        "host pointers. Nothing runs on a GPU; on a machine with one, set strata.device to "
        "\"cuda\".");
    // Pooled, as a device's allocator is (cudaMallocAsync's pool): the emulation pays no page
    // faults for a copy that a GPU would not. The residency table keeps what is in use within the
    // device budget; the pool may hold twice it, for dropped copies held aside beyond the budget
    // while their fences have not passed (swap/mover.h: on this device only a test's copy engine,
    // RuntimeOptions::wrap_copy_engine, records fences).
    rt->device_backing_ =
        std::make_unique<tiering::HostMemoryResource>("device memory (host-emulated)");
    rt->device_memory_ = std::make_unique<tiering::PoolingResource>(
        rt->device_backing_.get(),
        2 * std::min<uint64_t>(config.device_budget_bytes, tiering::kMaxPartitionBytes));
    rt->copy_ = std::make_unique<tiering::HostCopyEngine>(config.copy_bandwidth_bytes_per_s);
  } else {
    STRATA_ASSIGN_OR_RETURN(
        const int device, FromEnvironment(rt->options_.device_index >= 0 ? rt->options_.device_index
                                                                         : config.device_index,
                                          "LOCAL_RANK", "device_index"));
    rt->cuda_device_ = device;
    auto memory = tiering::CreateCudaDeviceResource(device);
    if (!memory.ok()) return Annotate(memory.status(), "config: strata.device is \"cuda\"");
    rt->device_memory_ = *std::move(memory);
    STRATA_ASSIGN_OR_RETURN(
        rt->copy_, tiering::CreateCudaCopyEngine(device, static_cast<int>(config.copy_streams)));
  }
  if (rt->options_.wrap_copy_engine) {
    rt->copy_ = rt->options_.wrap_copy_engine(std::move(rt->copy_));
  }
  // Pinned host memory: near the NVMe drive's NUMA node, registered with CUDA on a real device,
  // pinned once and pooled (freed blocks are reused, up to the host budget).
  tiering::PinnedOptions po;
  po.on_warning = warn;
  po.numa_node = swap.empty() ? -1 : tiering::NumaNodeNearest(swap);
  po.cuda_register = !config.emulated_device;
  rt->pinned_memory_ = std::make_unique<tiering::PinnedHostResource>(po);
  rt->host_memory_ = std::make_unique<tiering::PoolingResource>(rt->pinned_memory_.get(),
                                                                config.host_budget_bytes);
  // The staging pool (offload_param.buffer_count buffers of buffer_size, in pairs) comes out of
  // the host budget: set aside now, allocated (from the same pool) at its first use.
  rt->staging_ = std::make_unique<swap::StagingPool>(
      rt->host_memory_.get(), config.StagingBufferBytes(), config.StagingPairs());
  uint64_t host_for_partitions = config.host_budget_bytes;
  if (rt->store_ != nullptr) {
    STRATA_RETURN_IF_ERROR(config.CheckStagingFits());
    host_for_partitions -= rt->staging_->total_bytes();
  }
  rt->table_ = std::make_unique<tiering::ResidencyTable>(
      std::array<uint64_t, tiering::kTierCount>{config.device_budget_bytes, host_for_partitions,
                                                rt->store_ ? rt->store_->capacity_bytes() : 0});
  rt->mover_ = std::make_unique<swap::Mover>(
      swap::MoverParts{rt->table_.get(), rt->device_memory_.get(), rt->host_memory_.get(),
                       rt->store_.get(), rt->copy_.get(), rt->staging_.get()});
  SchedulerConfig sc;
  sc.policy = config.eviction_policy == "lru" ? Policy::kLru : Policy::kTrace;
  if (rt->options_.policy) sc.policy = *rt->options_.policy;
  sc.prefetch_bucket_elements = static_cast<uint64_t>(config.stage3_prefetch_bucket_size);
  {
    MutexLock lock(&rt->mu_);
    rt->scheduler_ = std::make_unique<Scheduler>(sc);
    rt->step_start_ = Clock::now();
  }
  rt->pool_ = std::make_unique<WorkerPool>(rt->options_.workers);
  return rt;
}

Runtime::~Runtime() {
  AbortOptimizerStep();  // its thread may be acquiring gradients
  if (absl::Status s = FlushOptimizer(); !s.ok()) {
    Warn(
        absl::StrCat("the last optimizer step's state was not written to NVMe when the Runtime "
                     "was destroyed; it is lost: ",
                     s.message()));
  }
  if (pool_ != nullptr) pool_->Stop();  // the jobs still queued are cancelled (none: Create failed)
  if (store_ != nullptr) {
    {
      // Pins the trainer left are dropped: the process is letting go of the partitions.
      MutexLock lock(&mu_);
      for (const auto& [id, st] : parts_) {
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
}

double Runtime::Now() const {
  return std::chrono::duration<double>(Clock::now() - step_start_).count();
}

absl::Status Runtime::Register(const tiering::PartitionDesc& desc, Tier tier,
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
  if (desc.id >= kOptimizerKey) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition ", desc.id,
                     ": ids are below 2^63 (the store keys the optimizer's state with "
                     "the top bit)"));
  }
  MutexLock lock(&mu_);
  if (unregistering_.contains(desc.id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("partition ", desc.id, ": being unregistered by another thread"));
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
  STRATA_RETURN_IF_ERROR(table_->Register(desc));
  auto undo = [&](absl::Status s) {
    table_->Unregister(desc.id).IgnoreError();
    return s;
  };
  absl::Status s = table_->Materialize(desc.id, tier);
  if (s.code() == absl::StatusCode::kResourceExhausted && IsMemory(tier)) {
    if (absl::Status room = MakeRoomLocked(tier, desc, Purpose::kAcquire, 0, nullptr); !room.ok()) {
      return undo(room);
    }
    s = table_->Materialize(desc.id, tier);
  }
  if (!s.ok()) return undo(s);
  // The bytes are written without the lock; the partition is unknown to everything but the table
  // (not in parts_: Unregister refuses it, nothing evicts or prefetches it) until they are.
  mu_.Unlock();
  absl::Status filled = mover_->Fill(desc, tier, initial);
  mu_.Lock();
  if (!filled.ok()) return undo(filled);
  PartState& st = parts_[desc.id];
  if (IsMemory(tier)) st.last_use[I(tier)] = ++tick_;
  MarkHostCachedLocked(desc, st);
  return absl::OkStatus();
}

void Runtime::MarkHostCachedLocked(const tiering::PartitionDesc& desc, PartState& st) {
  const auto& op = config_.offload_param;
  if (store_ == nullptr || desc.role != tiering::Role::kParam ||
      op.device != tiering::OffloadDevice::kNvme || op.max_in_cpu <= 0 ||
      host_cached_elements_ + desc.elements > static_cast<uint64_t>(op.max_in_cpu)) {
    return;
  }
  st.host_cached = true;
  host_cached_elements_ += desc.elements;
}

absl::Status Runtime::Adopt(const tiering::PartitionDesc& desc) {
  if (store_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("adopt partition ", desc.id, ": no NVMe tier to adopt it from"));
  }
  if (desc.id >= kOptimizerKey) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adopt partition ", desc.id,
        ": ids are below 2^63 (the top bit keys the optimizer's state, which is not a partition)"));
  }
  MutexLock lock(&mu_);
  if (unregistering_.contains(desc.id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("adopt partition ", desc.id, ": being unregistered by another thread"));
  }
  absl::StatusOr<PartitionRecord> found = store_->Find(desc.id);
  if (!found.ok()) {
    return Annotate(found.status(), absl::StrCat("adopt partition ", desc.id,
                                                 " (StoredPartitions lists what can be adopted)"));
  }
  const PartitionRecord stored = *found;
  if (stored.length != desc.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("adopt partition ", desc.id,
                                                   ": the store holds ", stored.length,
                                                   " bytes, the descriptor says ", desc.bytes));
  }
  STRATA_RETURN_IF_ERROR(table_->Register(desc));
  if (absl::Status s = table_->Materialize(desc.id, Tier::kNvme); !s.ok()) {
    table_->Unregister(desc.id).IgnoreError();
    return s;
  }
  MarkHostCachedLocked(desc, parts_[desc.id]);
  return absl::OkStatus();
}

std::vector<PartitionRecord> Runtime::StoredPartitions() const {
  std::vector<PartitionRecord> out;
  if (store_ == nullptr) return out;
  for (const PartitionRecord& r : store_->List()) {
    if (r.id < kOptimizerKey) out.push_back(r);  // the optimizer's state is not a partition
  }
  return out;
}

void Runtime::WaitForMoveLocked(PartitionId id) {
  for (;;) {
    auto r = table_->Get(id);
    if (!r.ok() || !r->move) return;
    moved_.Wait(&mu_);
  }
}

absl::Status Runtime::Unregister(PartitionId id) {
  if (id >= kOptimizerKey) {
    return absl::InvalidArgumentError(absl::StrCat("unregister partition ", id,
                                                   ": ids are below 2^63 (the top bit keys the "
                                                   "optimizer's state, which is not a partition)"));
  }
  MutexLock lock(&mu_);
  if (unregistering_.contains(id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("unregister partition ", id, ": another thread is unregistering it"));
  }
  const bool known = parts_.contains(id);
  if (!known && table_->Get(id).ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unregister partition ", id, ": it is being registered (or adopted) by another thread"));
  }
  const bool stored = store_ != nullptr && store_->Find(id).ok();
  if (!known && !stored) {
    return absl::NotFoundError(absl::StrCat("partition ", id, ": not registered"));
  }
  if (known) {
    // A move of it in flight ends first, and so does every thread between a move's unlocked
    // bytes and its re-lock (it still uses the partition's state).
    for (;;) {
      WaitForMoveLocked(id);
      if (parts_.at(id).carrying == 0) break;
      moved_.Wait(&mu_);
    }
    STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
    for (Tier t : {Tier::kDevice, Tier::kHost}) {
      if (r.pins[I(t)] > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "unregister partition ", id, ": it is pinned in the ", TierName(t), " tier"));
      }
    }
    if (parts_.at(id).busy > 0 || parts_.at(id).joining > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("unregister partition ", id, ": another thread is bringing it in"));
    }
    const uint64_t elements = r.desc.elements;
    STRATA_RETURN_IF_ERROR(table_->Unregister(id));
    mover_->Forget(id);
    if (parts_.at(id).host_cached) host_cached_elements_ -= elements;
    parts_.erase(id);
  }
  if (!stored) return absl::OkStatus();
  // The store's commit runs without the lock; meanwhile Register and Adopt refuse the id.
  unregistering_.insert(id);
  mu_.Unlock();
  absl::Status erased = store_->Erase(id);
  mu_.Lock();
  unregistering_.erase(id);
  if (!erased.ok()) {
    return Annotate(erased, absl::StrCat("unregister partition ", id,
                                         ": its memory copies are freed but its NVMe copy is "
                                         "still in the store (StoredPartitions); Unregister it "
                                         "again to erase it"));
  }
  return absl::OkStatus();
}

absl::Status Runtime::MoveLocked(PartitionId id, Tier from, Tier to, Purpose purpose,
                                 uint64_t limit, Waits* waits, bool* raced, bool zeros) {
  STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
  const bool fill = from == to;  // zeros for a partition without bytes (Discarded)
  for (;;) {
    if (purpose != Purpose::kAcquire && IsMemory(from) && !fill) {
      // A prefetch or a write-back never reads a pinned copy (its holder may be writing it); the
      // lock is held from here until the move is begun.
      STRATA_ASSIGN_OR_RETURN(const Residency now, table_->Get(id));
      if (now.pins[I(from)] > 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("partition ", id, ": its ", TierName(from),
                         " copy was pinned (in use) before its move ", TierName(from), " -> ",
                         TierName(to), " could begin"));
      }
    }
    absl::Status begun = fill ? table_->BeginFill(id, to) : table_->BeginMove(id, from, to);
    if (begun.ok()) break;
    if (begun.code() != absl::StatusCode::kResourceExhausted || !IsMemory(to)) return begun;
    absl::Status room = MakeRoomLocked(to, r.desc, purpose, limit, waits);
    // Making room released the lock: another thread may have moved this partition meanwhile (a
    // prefetch may even have brought it where it is wanted, which is why no room was found).
    STRATA_ASSIGN_OR_RETURN(const Residency now, table_->Get(id));
    const bool still_wanted = fill ? !now.written : !now.current[I(to)] && now.current[I(from)];
    if (now.move || !still_wanted) {
      if (raced != nullptr) *raced = true;
      return absl::AbortedError(absl::StrCat("partition ", id,
                                             ": moved by another thread while "
                                             "room was made for its move ",
                                             TierName(from), " -> ", TierName(to)));
    }
    STRATA_RETURN_IF_ERROR(room);
  }
  // A partition being registered is not in parts_ yet, and moves only through its Fill.
  PartState* st = &parts_.at(id);
  st->moving = purpose;
  ++st->carrying;  // Unregister waits for it: `st` is used again after the unlocked move
  ++moves_in_flight_;
  const auto t0 = Clock::now();
  mu_.Unlock();
  absl::Status moved = mover_->Carry(id, from, to, zeros);
  mu_.Lock();
  --moves_in_flight_;
  --st->carrying;
  st->moving.reset();
  moved_.SignalAll();
  if (waits != nullptr) {
    waits->s[static_cast<int>(MoveCause(from, to, IsEviction(purpose)))] += Since(t0);
  }
  return moved;
}

absl::Status Runtime::MakeRoomLocked(Tier t, const tiering::PartitionDesc& desc, Purpose purpose,
                                     uint64_t limit, Waits* waits) {
  const uint64_t bytes = table_->Footprint(desc);
  const uint64_t aside = table_->set_aside_bytes(t);
  if (bytes > table_->budget_bytes(t) - aside) {
    // Nothing evicted would make it fit.
    return absl::ResourceExhaustedError(absl::StrCat(
        "partition ", desc.id, " (", desc.bytes, " bytes, counted as ", bytes,
        " in whole pages) is larger than the ", TierName(t), " tier's budget of ",
        table_->budget_bytes(t), " bytes",
        aside > 0 ? absl::StrCat(" less the ", aside, " set aside for the optimizer") : ""));
  }
  absl::flat_hash_set<PartitionId> skipped;  // victims whose eviction failed
  absl::Status last_failure;
  const bool planned = scheduler_->plans_evictions();
  const uint64_t window = static_cast<uint64_t>(scheduler_->lookahead());
  while (table_->used_bytes(t) > table_->budget_bytes(t) - bytes) {
    // The victim: planned, the copy needed furthest in the future (among those not needed within
    // the window, clean before dirty); else the least recently used. Never a copy pinned, moving,
    // being brought in, or (for a prefetch) needed before the prefetched one.
    PartitionId victim = 0;
    bool found = false;
    std::tuple<bool, bool, bool, uint64_t> best{};  // planned: (not reused soon, far, clean, next)
    uint64_t oldest = UINT64_MAX;                   // on demand: last use
    for (const auto& [id, st] : parts_) {
      if (id == desc.id || st.busy > 0 || skipped.contains(id)) continue;
      auto r = table_->Get(id);
      if (!r.ok() || !r->has_copy[I(t)] || r->pins[I(t)] > 0 || r->move) continue;
      const bool param_on_device = t == Tier::kDevice && r->desc.role == tiering::Role::kParam;
      // stage3_param_persistence_threshold: small parameters stay on the device.
      if (param_on_device &&
          r->desc.elements < static_cast<uint64_t>(config_.stage3_param_persistence_threshold)) {
        continue;
      }
      const bool clean = !r->only_current(t);
      if (planned) {
        // A copy in either memory tier serves an access in the other (one copy away).
        // A gradient the optimizer step reads from the host tier is needed there at the step.
        const uint64_t next =
            std::min({scheduler_->NextUse(id, Tier::kDevice), scheduler_->NextUse(id, Tier::kHost),
                      t == Tier::kHost ? scheduler_->StepUse(id) : Scheduler::kNever});
        // A prefetch evicts nothing the window needs (nor anything before its own partition).
        if (ForPrefetch(purpose) && next <= std::max(limit, window)) continue;
        // stage3_max_reuse_distance: a parameter needed again within that many parameter
        // elements is evicted from the device only when nothing else can be.
        const bool reused_soon =
            param_on_device && scheduler_->ParamElementsBeforeNextUse(id, Tier::kDevice) <
                                   static_cast<uint64_t>(config_.stage3_max_reuse_distance);
        const std::tuple<bool, bool, bool, uint64_t> key{!reused_soon, next > window, clean, next};
        if (!found || key > best) {
          best = key;
          victim = id;
          found = true;
        }
      } else if (st.last_use[I(t)] < oldest || !found) {
        oldest = st.last_use[I(t)];
        victim = id;
        found = true;
      }
    }
    if (!found) {
      if (!ForPrefetch(purpose) && moves_in_flight_ > 0) {
        // Moves in flight may free room (a write-back) or leave a copy that can be evicted.
        const auto t0 = Clock::now();
        moved_.Wait(&mu_);
        if (waits != nullptr) waits->s[static_cast<int>(WaitCause::kBudgetFull)] += Since(t0);
        skipped.clear();
        continue;
      }
      const uint64_t free =
          table_->budget_bytes(t) - std::min(table_->budget_bytes(t), table_->used_bytes(t));
      absl::Status full = absl::ResourceExhaustedError(absl::StrCat(
          "the ", TierName(t), " tier's budget of ", table_->budget_bytes(t), " bytes has ", free,
          " free, ", bytes, " needed, and every copy in it is pinned, in use by a move",
          t == Tier::kDevice ? ", a parameter below stage3_param_persistence_threshold" : "",
          ForPrefetch(purpose) ? ", needed sooner than the prefetched partition" : "",
          " or could not be evicted"));
      return last_failure.ok()
                 ? full
                 : Annotate(full, absl::StrCat("last eviction failure: ", last_failure.message()));
    }
    // A prefetch's eviction follows the prefetch's rules (no waiting, nothing needed sooner).
    const Purpose evict_for = ForPrefetch(purpose) ? Purpose::kEvictForPrefetch : Purpose::kEvict;
    if (absl::Status s = EvictLocked(victim, t, evict_for, limit, waits); !s.ok()) {
      skipped.insert(victim);
      last_failure = s;
    }
  }
  return absl::OkStatus();
}

absl::Status Runtime::EvictLocked(PartitionId id, Tier tier, Purpose purpose, uint64_t limit,
                                  Waits* waits) {
  if (!IsMemory(tier)) {
    return absl::InvalidArgumentError(
        absl::StrCat("evict partition ", id, ": only the device and host tiers are evicted"));
  }
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(Residency r, table_->Get(id));
    if (!r.has_copy[I(tier)]) return absl::OkStatus();
    if (r.pins[I(tier)] > 0) {
      return absl::FailedPreconditionError(absl::StrCat("evict partition ", id,
                                                        ": it is pinned in the ", TierName(tier),
                                                        " tier (release it first)"));
    }
    if (r.move && (r.move->first == tier || r.move->second == tier)) {
      // A move reads or fills this copy (it began while the lock was released): it ends first.
      if (ForPrefetch(purpose)) {
        return absl::FailedPreconditionError(
            absl::StrCat("evict partition ", id, ": a move uses its ", TierName(tier), " copy"));
      }
      WaitForMoveLocked(id);
      continue;
    }
    if (!r.only_current(tier)) break;  // another copy is current: a drop
    // Parameters offloaded to NVMe skip the host on the way down, as in ZeRO-Infinity.
    const bool device_to_nvme =
        tier == Tier::kDevice && store_ != nullptr && r.desc.role == tiering::Role::kParam &&
        config_.offload_param.device == tiering::OffloadDevice::kNvme && !parts_.at(id).host_cached;
    const Tier lower = tier == Tier::kDevice && !device_to_nvme ? Tier::kHost : Tier::kNvme;
    if (lower == Tier::kNvme && store_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("partition ", id,
                       ": its host copy is the only current one and there is no NVMe tier "
                       "to write it back to"));
    }
    bool raced = false;
    absl::Status down = MoveLocked(id, tier, lower, purpose, limit, waits, &raced);
    if (down.code() == absl::StatusCode::kResourceExhausted && lower == Tier::kHost &&
        store_ != nullptr) {
      // The host tier has no room: the device copy goes straight to NVMe, staged.
      down = MoveLocked(id, tier, Tier::kNvme, purpose, limit, waits, &raced);
    }
    if (raced) continue;  // another thread moved it while room was made: look again
    STRATA_RETURN_IF_ERROR(down);
    ++stats_.write_backs;
    ++step_.r.write_backs;
    // Look again: the lock was released while the bytes moved.
  }
  STRATA_RETURN_IF_ERROR(mover_->Drop(id, tier));
  ++stats_.evictions;
  ++step_.r.evictions;
  return absl::OkStatus();
}

absl::Status Runtime::WriteBackLocked(PartitionId id) {
  WaitForMoveLocked(id);
  STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
  if (!r.written || r.current[I(Tier::kNvme)]) return absl::OkStatus();
  for (Tier t : {Tier::kDevice, Tier::kHost}) {
    if (r.current[I(t)] && r.pins[I(t)] > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("partition ", id, " is pinned in the ", TierName(t),
                       " tier with bytes NVMe does not have; release it first"));
    }
  }
  const Tier from = r.current[I(Tier::kHost)] ? Tier::kHost : Tier::kDevice;
  STRATA_RETURN_IF_ERROR(MoveLocked(id, from, Tier::kNvme, Purpose::kEvict, 0, nullptr));
  ++stats_.write_backs;
  ++step_.r.write_backs;
  return absl::OkStatus();
}

absl::Status Runtime::Flush() {
  if (store_ == nullptr) return absl::OkStatus();
  MutexLock lock(&mu_);
  std::vector<PartitionId> ids;
  for (const auto& [id, st] : parts_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (PartitionId id : ids) {
    if (!parts_.contains(id)) continue;  // unregistered while the lock was released
    STRATA_RETURN_IF_ERROR(Annotate(WriteBackLocked(id), "flush"));
  }
  return absl::OkStatus();
}

absl::Status Runtime::BringLocked(PartitionId id, Tier tier, Purpose purpose, uint64_t limit,
                                  Waits* waits, bool* filled, bool overwrite) {
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
    // An Acquire pins the copy and may write it: a move still reading it (a write-back begun
    // before the Acquire) ends first.
    const bool being_read = r.move && r.move->first == tier;
    if (r.current[I(tier)] && !(purpose == Purpose::kAcquire && being_read)) {
      return absl::OkStatus();
    }
    if (r.move) {
      // Join the move in flight (a prefetch's, or a write-back reading this copy). The move
      // protects the copy meanwhile; the caller's busy mark does not stand in the way of room
      // being made while it waits (once the move has ended, a waiter not yet woken would
      // otherwise hold a current copy that nothing could evict). Evicted before it wakes, it is
      // brought again below.
      PartState& st = parts_.at(id);
      const std::optional<Purpose> why = st.moving;
      const WaitCause cause =
          MoveCause(r.move->first, r.move->second, why.has_value() && IsEviction(*why));
      const auto t0 = Clock::now();
      --st.busy;
      ++st.joining;  // Unregister refuses it meanwhile: this thread still holds `st`
      WaitForMoveLocked(id);
      --st.joining;
      ++st.busy;
      if (waits != nullptr) waits->s[static_cast<int>(cause)] += Since(t0);
      continue;
    }
    // The source: the other memory tier's copy (host <-> device through the copy engine), else
    // NVMe (to the host through aio, to the device staged in chunks). A prefetch never reads a
    // pinned copy (its holder may be writing it): it reads NVMe's when that is current.
    const Tier other = tier == Tier::kDevice ? Tier::kHost : Tier::kDevice;
    if (!r.written) {
      // Discarded: zeros are made where they are wanted (the room alone for an overwrite);
      // nothing is read.
      bool raced = false;
      absl::Status made =
          MoveLocked(id, tier, tier, purpose, limit, waits, &raced, /*zeros=*/!overwrite);
      if (made.ok() && filled != nullptr) *filled = true;
      if (!made.ok() && !raced) return made;
      continue;
    }
    const bool other_usable =
        r.current[I(other)] && (purpose == Purpose::kAcquire || r.pins[I(other)] == 0);
    Tier from;
    if (other_usable) {
      from = other;
    } else if (r.current[I(Tier::kNvme)]) {
      from = Tier::kNvme;
      if (tier == Tier::kDevice && parts_.at(id).host_cached && !r.has_copy[I(Tier::kHost)]) {
        // A parameter within max_in_cpu: through the host tier, whose clean copy stays for its
        // next use (backward, the next step) instead of the disk being read again. Without room
        // there it goes straight to the device, staged.
        bool raced = false;
        absl::Status staged =
            MoveLocked(id, Tier::kNvme, Tier::kHost, purpose, limit, waits, &raced);
        if (staged.ok() || raced) continue;  // the host copy is the source now: look again
        if (staged.code() != absl::StatusCode::kResourceExhausted) return staged;
      }
    } else if (r.current[I(other)]) {
      return absl::FailedPreconditionError(
          absl::StrCat("prefetch partition ", id, " to the ", TierName(tier), " tier: its ",
                       TierName(other), " copy, the only current one, is pinned (in use)"));
    } else {
      return absl::InternalError(absl::StrCat("partition ", id, ": no current copy to bring"));
    }
    bool raced = false;
    absl::Status moved = MoveLocked(id, from, tier, purpose, limit, waits, &raced);
    if (!moved.ok() && !raced) return moved;  // raced: look again
  }
}

absl::StatusOr<std::byte*> Runtime::Acquire(PartitionId id, Tier tier, Access access,
                                            bool overwrite) {
  if (!IsMemory(tier)) {
    return absl::InvalidArgumentError(absl::StrCat("acquire partition ", id,
                                                   ": the device or host tier (nvme is not "
                                                   "addressable)"));
  }
  absl::StatusOr<std::byte*> result;
  {
    MutexLock lock(&mu_);
    result = AcquireLocked(id, tier, access == Access::kTraced, overwrite);
  }
  TellWarnings();
  return result;
}

absl::StatusOr<std::byte*> Runtime::AcquireToReplace(PartitionId id) {
  absl::StatusOr<std::byte*> result;
  {
    MutexLock lock(&mu_);
    bool replace = false;
    if (auto it = parts_.find(id); it != parts_.end()) {
      PartState& st = it->second;
      // Written, not current in the host tier, and nothing holding, moving or bringing it.
      auto replaceable = [&](const absl::StatusOr<Residency>& r) {
        return r.ok() && !r->move && st.busy == 0 && st.joining == 0 && st.carrying == 0 &&
               std::all_of(r->pins.begin(), r->pins.end(), [](int p) { return p == 0; }) &&
               r->written && !r->current[I(Tier::kHost)];
      };
      absl::StatusOr<Residency> r = table_->Get(id);
      if (replaceable(r)) {
        // The room first: the old bytes are dropped only once the new ones have their room (a
        // stale host copy's, or room made now), so that a replace that finds none reads them as
        // an acquire does. Making room may let the lock go: the partition is looked at again.
        bool room = r->has_copy[I(Tier::kHost)];
        if (!room) {
          room = MakeRoomLocked(Tier::kHost, r->desc, Purpose::kAcquire, 0, nullptr).ok();
          r = table_->Get(id);
          room = room && r.ok() && !r->has_copy[I(Tier::kHost)];
        }
        if (room && replaceable(r)) {
          // A stale memory copy that cannot be dropped stays, stale, and is reclaimed as such;
          // once the table holds it discarded, the fill below gives it its room.
          DiscardIdleLocked(id, st).IgnoreError();
          absl::StatusOr<Residency> now = table_->Get(id);
          replace = now.ok() && !now->written;
        }
      }
    }
    result = AcquireLocked(id, Tier::kHost, /*traced=*/false, /*overwrite=*/replace);
  }
  TellWarnings();
  return result;
}

absl::StatusOr<std::byte*> Runtime::AcquireLocked(PartitionId id, Tier tier, bool traced,
                                                  bool overwrite) {
  auto it = parts_.find(id);
  if (it == parts_.end()) {
    return absl::NotFoundError(absl::StrCat("acquire partition ", id, ": not registered"));
  }
  PartState& st = it->second;  // node_hash_map: stable while the lock is released
  STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
  if (traced) {
    const bool had_divergence = scheduler_->divergence().has_value();
    scheduler_->OnAcquire(r.desc, tier, Now());
    if (!had_divergence && scheduler_->divergence()) {
      WarnLocked(absl::StrCat("step ", stats_.steps + 1,
                              ": the access order differs from the recorded trace (",
                              *scheduler_->divergence(),
                              "); the rest of the step is fetched on demand with LRU eviction "
                              "and recorded anew"));
    }
  }
  StepReport untraced;  // the counters an untraced access updates (dropped)
  StepReport& report = traced ? step_.r : untraced;
  if (traced) ++stats_.acquires;
  ++report.acquires;
  const bool hit = r.current[I(tier)];
  const bool late = !hit && (prefetching_.contains(std::make_pair(id, tier)) ||
                             (r.move && st.moving == Purpose::kPrefetch));
  // A hit too: a write-back still reading the copy ends before the caller may write it.
  const auto t0 = Clock::now();
  ++st.busy;
  Waits waits;
  bool filled = false;  // zeros made for a discarded partition by this Acquire
  absl::Status brought = BringLocked(id, tier, Purpose::kAcquire, 0, &waits, &filled, overwrite);
  // Counted once each: acquires = hits + zero fills + late prefetches + misses.
  if (hit) {
    if (traced) ++stats_.acquire_hits;
    ++report.hits;
    if (st.prefetched[I(tier)]) ++report.prefetch_hits;
  } else if (filled) {
    ++report.zero_fills;
  } else if (late) {
    ++report.late_prefetches;  // a prefetch was bringing it (or was queued to): joined
  } else {
    ++report.misses;
  }
  if (brought.ok()) brought = table_->Pin(id, tier);
  --st.busy;
  if (discards_waiting_ > 0) moved_.SignalAll();  // for a thread that no longer brings it in
  if (traced) st.prefetched[I(tier)] = false;
  if (brought.ok()) st.last_use[I(tier)] = ++tick_;
  const double waited_s = Since(t0);
  if (traced) stats_.acquire_wait_seconds += waited_s;
  report.wait_seconds += waited_s;
  for (int c = 0; c < kWaitCauseCount; ++c) report.wait_by_cause[c] += waits.s[c];
  if (traced && !hit && !filled) scheduler_->OnLateOrMiss();
  PlanPrefetchesLocked();
  STRATA_RETURN_IF_ERROR(brought);
  return mover_->Address(id, tier);
}

absl::Status Runtime::Release(PartitionId id, Tier tier, bool dirty, tiering::StreamHandle stream,
                              Access access) {
  const bool traced = access == Access::kTraced;
  MutexLock lock(&mu_);
  STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
  if (r.pins[I(tier)] == 0) return table_->Unpin(id, tier);  // names what is wrong
  if (tier == Tier::kDevice && stream != nullptr) {
    // Still pinned: nothing can move or free the copy before its fence is known.
    absl::StatusOr<std::shared_ptr<tiering::Fence>> fence = copy_->RecordFence(stream);
    if (!fence.ok()) {
      return Annotate(fence.status(), absl::StrCat("release partition ", id,
                                                   ": it stays pinned (release it again with a "
                                                   "valid stream, or none once its work is done)"));
    }
    mover_->AddFence(id, *std::move(fence));
  }
  if (traced) scheduler_->OnRelease(r.desc, tier, dirty, Now());
  if (dirty) {
    // Still pinned: a move reading this copy (a prefetch into the other tier) ends first, and the
    // copy it made goes stale below.
    WaitForMoveLocked(id);
    absl::StatusOr<std::vector<Tier>> stale = table_->MarkWritten(id, tier);
    if (!stale.ok()) {
      // Another holder has the other tier's copy pinned: this write cannot make it stale under
      // it. The pin stays (the changed bytes are not given up): release that copy, then this one
      // again.
      return Annotate(stale.status(),
                      absl::StrCat("release partition ", id, " dirty in the ", TierName(tier),
                                   " tier: refused, and it stays pinned so that the change is "
                                   "not lost; release the other holder's pin, then release it "
                                   "again"));
    }
    for (Tier t : *stale) {
      // A stale NVMe copy keeps its extent until the next write-back replaces it.
      if (IsMemory(t)) STRATA_RETURN_IF_ERROR(mover_->Drop(id, t));
    }
  }
  STRATA_RETURN_IF_ERROR(table_->Unpin(id, tier));
  // A host copy written that the host tier cannot keep until its next use goes down to NVMe in
  // the background now (staying, clean): the eviction that makes room later is then a drop.
  if (dirty && tier == Tier::kHost) WriteBackEarlyLocked(id);
  return absl::OkStatus();
}

absl::Status Runtime::Evict(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  if (!parts_.contains(id)) {
    return absl::NotFoundError(absl::StrCat("evict partition ", id, ": not registered"));
  }
  WaitForMoveLocked(id);
  return EvictLocked(id, tier, Purpose::kEvict, 0, nullptr);
}

absl::Status Runtime::Discard(PartitionId id) {
  MutexLock lock(&mu_);
  // A move of it (a write-back, a prefetch) and every thread bringing it in end first: the bytes
  // they carry are dropped below, or the Acquire among them pins them and the discard is refused.
  // The partition is looked up again after every wait (another thread may unregister it).
  PartState* st = nullptr;
  for (;;) {
    auto it = parts_.find(id);
    if (it == parts_.end()) {
      return absl::NotFoundError(absl::StrCat("discard partition ", id, ": not registered"));
    }
    st = &it->second;
    if (auto r = table_->Get(id); r.ok() && r->move) {
      WaitForMoveLocked(id);
      continue;
    }
    if (st->busy == 0 && st->joining == 0 && st->carrying == 0) break;
    ++discards_waiting_;
    moved_.Wait(&mu_);
    --discards_waiting_;
  }
  return DiscardIdleLocked(id, *st);
}

absl::Status Runtime::DiscardIdleLocked(PartitionId id, PartState& st) {
  STRATA_RETURN_IF_ERROR(Annotate(table_->Discard(id), "discard"));
  scheduler_->OnDiscard(id);
  st.prefetched = {};
  // Every copy is stale now: the memory ones are freed (a stale NVMe copy keeps its extent until
  // the next write-back replaces it), and whoever waits for room is told.
  absl::Status dropped;
  for (Tier t : {Tier::kDevice, Tier::kHost}) {
    auto r = table_->Get(id);
    if (r.ok() && r->has_copy[I(t)]) dropped.Update(mover_->Drop(id, t));
  }
  moved_.SignalAll();
  return dropped;
}

void Runtime::PlanPrefetchesLocked() {
  if (scheduler_->mode() != Scheduler::Mode::kPlanned || !options_.plan_prefetches) return;
  const int max_in_flight = scheduler_->max_in_flight();
  // stage3_max_live_parameters: the parameter elements on the device (held, arriving, and queued
  // to arrive) that prefetches may bring it to.
  uint64_t live = table_->param_elements(Tier::kDevice);
  for (const auto& [id, tier] : prefetching_) {
    auto r = table_->Get(id);
    if (tier == Tier::kDevice && r.ok() && r->desc.role == tiering::Role::kParam &&
        !r->has_copy[I(Tier::kDevice)]) {
      live += r->desc.elements;
    }
  }
  const uint64_t max_live = static_cast<uint64_t>(config_.stage3_max_live_parameters);
  for (const Scheduler::Upcoming& u : scheduler_->Window()) {
    if (max_in_flight > 0 && static_cast<int>(prefetching_.size()) >= max_in_flight) break;
    const auto key = std::make_pair(u.id, u.tier);
    if (prefetching_.contains(key)) continue;
    auto r = table_->Get(u.id);
    // A discarded partition is not prefetched: its zeros would only take room early.
    if (!r.ok() || r->current[I(u.tier)] || !r->written || !parts_.contains(u.id)) continue;
    const bool param_to_device = u.tier == Tier::kDevice && r->desc.role == tiering::Role::kParam;
    if (param_to_device && !r->has_copy[I(Tier::kDevice)]) {
      if (live + r->desc.elements > max_live) break;  // the trainer's own Acquires go on
      live += r->desc.elements;
    }
    if (!scheduler_->reads_ahead_from_nvme() && !r->current[I(Tier::kHost)] &&
        !r->current[I(Tier::kDevice)]) {
      break;  // DeepSpeed-like: prefetching stops at the first partition still on NVMe
    }
    const bool queued =
        pool_->Post([this, id = u.id, tier = u.tier] { RunPrefetch(id, tier, true, nullptr); },
                    [this, key] {
                      MutexLock lock(&mu_);
                      prefetching_.erase(key);
                    });
    if (!queued) return;  // the Runtime is being destroyed
    prefetching_.insert(key);
    ++step_.r.prefetches;
  }
}

void Runtime::RunPrefetch(PartitionId id, Tier tier, bool planned,
                          std::promise<absl::Status>* done) {
  MutexLock lock(&mu_);
  absl::Status s;
  auto it = parts_.find(id);
  uint64_t limit = 0;
  if (planned) limit = scheduler_->NextUse(id, tier);
  if (it == parts_.end()) {
    s = absl::NotFoundError(absl::StrCat("prefetch partition ", id, ": not registered"));
  } else if (planned && limit == Scheduler::kNever) {
    // The plan changed (a divergence) since it was queued: not needed.
  } else if (auto r = table_->Get(id); planned && r.ok() && !r->written) {
    // Discarded since it was queued: its zeros are made when it is acquired.
  } else {
    PartState& st = it->second;  // node_hash_map: stable while the lock is released
    ++st.busy;
    auto before = table_->Get(id);
    const bool was_there = before.ok() && before->current[I(tier)];
    // A prefetch (planned or asked for) never reads a pinned copy and never waits for room.
    s = BringLocked(id, tier, Purpose::kPrefetch, limit, nullptr);
    if (s.ok() && !was_there) st.prefetched[I(tier)] = true;
    if (planned && tier == Tier::kDevice && s.code() == absl::StatusCode::kResourceExhausted) {
      // No room on the device yet: stage it in the host tier (NVMe -> host now, host -> device
      // when room comes), unless a memory tier has it already.
      auto r = table_->Get(id);
      if (r.ok() && !r->current[I(Tier::kHost)] && !r->current[I(Tier::kDevice)]) {
        absl::Status staged = BringLocked(id, Tier::kHost, Purpose::kPrefetch, limit, nullptr);
        if (staged.ok()) {
          st.prefetched[I(Tier::kHost)] = true;
        } else {
          s = staged;
        }
      }
    }
    --st.busy;
    if (discards_waiting_ > 0) moved_.SignalAll();  // for a thread that no longer brings it in
  }
  if (planned) {
    prefetching_.erase(std::make_pair(id, tier));
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      ++step_.r.prefetches_blocked;
      scheduler_->OnBudgetTight(limit);
    } else if (!s.ok()) {
      ++step_.r.prefetch_failures;
    }
  }
  // Moved, not copied: the status's message (refcounted inside Debian's Abseil, which TSan cannot
  // see) then belongs to the future alone, never freed on this thread after the caller read it.
  if (done != nullptr) done->set_value(std::move(s));
}

std::future<absl::Status> Runtime::Prefetch(PartitionId id, Tier tier) {
  auto done = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> f = done->get_future();
  if (!IsMemory(tier)) {
    done->set_value(
        absl::InvalidArgumentError(absl::StrCat("prefetch partition ", id,
                                                ": the device or host tier (nvme is not "
                                                "addressable)")));
    return f;
  }
  const bool queued = pool_->Post(
      [this, done, id, tier] { RunPrefetch(id, tier, false, done.get()); },
      [done] { done->set_value(absl::CancelledError("prefetch: the Runtime was destroyed")); });
  if (!queued) done->set_value(absl::CancelledError("prefetch: the Runtime is being destroyed"));
  return f;
}

void Runtime::GradientReady(PartitionId id) {
  MutexLock lock(&mu_);
  if (!parts_.contains(id)) return;
  if (scheduler_->NextUse(id, Tier::kDevice) <= static_cast<uint64_t>(scheduler_->lookahead())) {
    return;  // needed on the device again soon
  }
  PostForPartition(id, [this, id](const Residency& r) {
    if (r.pins[I(Tier::kDevice)] > 0) return;  // in use again: it stays
    // It stays on the device, current, when this fails; a later eviction retries.
    CountWriteBackFailure(EvictLocked(id, Tier::kDevice, Purpose::kEvict, 0, nullptr));
  });
}

void Runtime::PostForPartition(PartitionId id, std::function<void(const Residency&)> work,
                               bool background) {
  pool_->Post(
      [this, id, work = std::move(work)] {
        MutexLock lock(&mu_);
        if (!parts_.contains(id)) return;  // unregistered meanwhile
        WaitForMoveLocked(id);
        if (auto r = table_->Get(id); r.ok()) work(*r);
      },
      [] {}, background);
}

void Runtime::CountWriteBackFailure(const absl::Status& s) {
  // Pinned again or moved by another thread meanwhile: not a failure, the copy is in use.
  if (s.ok() || s.code() == absl::StatusCode::kFailedPrecondition ||
      s.code() == absl::StatusCode::kAborted) {
    return;
  }
  ++stats_.write_back_failures;
  ++step_.r.write_back_failures;
}

void Runtime::WriteBackEarlyLocked(PartitionId id) {
  if (store_ == nullptr || !scheduler_->plans_evictions()) return;
  // Only a copy that the host tier will not keep until its next use (the plan says so).
  const uint64_t capacity =
      table_->budget_bytes(Tier::kHost) - table_->set_aside_bytes(Tier::kHost);
  auto resident = [this](PartitionId other) {
    auto r = table_->Get(other);
    return r.ok() && r->has_copy[I(Tier::kHost)];
  };
  if (!scheduler_->EvictedBeforeNextUse(id, capacity, resident)) return;
  PostForPartition(
      id,
      [this, id](const Residency& r) {
        if (!r.only_current(Tier::kHost) || r.pins[I(Tier::kHost)] > 0) return;
        absl::Status s = MoveLocked(id, Tier::kHost, Tier::kNvme, Purpose::kEvict, 0, nullptr);
        if (s.ok()) {
          ++stats_.write_backs;
          ++step_.r.write_backs;
        }
        CountWriteBackFailure(s);
      },
      /*background=*/true);
}

StepReport Runtime::EndStep() {
  StepReport report;
  {
    MutexLock lock(&mu_);
    report = EndStepLocked();
  }
  TellWarnings();
  return report;
}

StepReport Runtime::EndStepLocked() {
  const Scheduler::Mode mode = scheduler_->mode();
  std::optional<std::string> diverged = scheduler_->EndStep();
  if (diverged && mode == Scheduler::Mode::kPlanned) {
    WarnLocked(absl::StrCat("step ", stats_.steps + 1, ": ", *diverged,
                            "; the next step is planned from this one"));
  }
  StepReport report = step_.r;
  report.step = ++stats_.steps;
  report.mode = diverged ? "fallback" : ModeName(mode);
  report.divergence = diverged.value_or("");
  report.seconds = Since(step_start_);
  const swap::TierMatrix now = mover_->bytes_moved();
  for (int f = 0; f < tiering::kTierCount; ++f) {
    for (int t = 0; t < tiering::kTierCount; ++t) {
      report.bytes_moved[f][t] = now[f][t] - step_.moved_at_start[f][t];
    }
  }
  const swap::RoleNvmeBytes by_role = mover_->nvme_bytes_by_role();
  for (int r = 0; r < tiering::kRoleCount; ++r) {
    for (int w = 0; w < 2; ++w) {
      report.nvme_by_role[r][w] = by_role[r][w] - step_.nvme_by_role_at_start[r][w];
    }
  }
  const uint64_t state_read = state_read_bytes_.load(std::memory_order_relaxed);
  report.optimizer_state_read_bytes = state_read - step_.state_read_at_start;
  report.lookahead = scheduler_->lookahead();
  step_ = StepCounters{};
  step_.moved_at_start = now;
  step_.nvme_by_role_at_start = by_role;
  step_.state_read_at_start = state_read;
  step_start_ = Clock::now();
  PlanPrefetchesLocked();  // the next step's first accesses
  return report;
}

RuntimeStats Runtime::stats() const {
  MutexLock lock(&mu_);
  RuntimeStats s = stats_;
  s.host_held_bytes = host_memory_->held_bytes();
  for (int t = 0; t < tiering::kTierCount; ++t) {
    s.peak_bytes[t] = table_->peak_bytes(static_cast<Tier>(t));
    s.budget_bytes[t] = table_->budget_bytes(static_cast<Tier>(t));
  }
  s.bytes_moved = mover_->bytes_moved();
  return s;
}

}  // namespace strata::sched
