#include "sched/runtime.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::sched {
namespace {

using Clock = std::chrono::steady_clock;
using tiering::Residency;
int I(Tier t) { return static_cast<int>(t); }
bool IsMemory(Tier t) { return t != Tier::kNvme; }
uint64_t Key(PartitionId id, Tier t) { return id * 4 + static_cast<uint64_t>(t); }
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
  j["acquires"] = acquires;
  j["hits"] = hits;
  j["prefetch_hits"] = prefetch_hits;
  j["late_prefetches"] = late_prefetches;
  j["misses"] = misses;
  j["prefetches"] = prefetches;
  j["prefetch_failures"] = prefetch_failures;
  j["prefetches_blocked"] = prefetches_blocked;
  j["evictions"] = evictions;
  j["write_backs"] = write_backs;
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
  rt->options_ = std::move(options);
  auto warn = [r = rt.get()](absl::string_view w) { r->Warn(std::string(w)); };
  aio::EngineOptions eo = rt->options_.engine_options;
  if (!eo.on_warning) eo.on_warning = warn;
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
    tiering::NvmeStoreOptions so;
    so.capacity_bytes = config.nvme_capacity_bytes;
    so.on_warning = warn;
    STRATA_ASSIGN_OR_RETURN(rt->store_, tiering::NvmeStore::Open(swap, so, rt->engine_.get()));
  }
  if (config.emulated_device) {
    rt->Warn(
        "strata.device is \"emulated\": the device tier is ordinary host memory with its own "
        "budget (device_budget_bytes), copied by a worker thread, and Acquire(kDevice) hands back "
        "host pointers. Nothing runs on a GPU; on a machine with one, set strata.device to "
        "\"cuda\".");
    rt->device_memory_ =
        std::make_unique<tiering::HostMemoryResource>("device memory (host-emulated)");
    rt->copy_ = std::make_unique<tiering::HostCopyEngine>(config.copy_bandwidth_bytes_per_s);
  } else {
    STRATA_ASSIGN_OR_RETURN(
        const int device, FromEnvironment(rt->options_.device_index, "LOCAL_RANK", "device_index"));
    auto memory = tiering::CreateCudaDeviceResource(device);
    if (!memory.ok()) return Annotate(memory.status(), "config: strata.device is \"cuda\"");
    rt->device_memory_ = *std::move(memory);
    STRATA_ASSIGN_OR_RETURN(rt->copy_, tiering::CreateCudaCopyEngine(device));
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
  const uint64_t buffer_bytes = (static_cast<uint64_t>(std::max<int64_t>(
                                     config.offload_param.buffer_size, tiering::kMinBufferSize)) +
                                 tiering::kPageBytes - 1) /
                                tiering::kPageBytes * tiering::kPageBytes;
  const int pairs = static_cast<int>(std::max<int64_t>(1, config.offload_param.buffer_count / 2));
  rt->staging_ = std::make_unique<swap::StagingPool>(rt->host_memory_.get(), buffer_bytes, pairs);
  uint64_t host_for_partitions = config.host_budget_bytes;
  if (rt->store_ != nullptr) {
    if (rt->staging_->total_bytes() > config.host_budget_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: the staging buffers (", 2 * pairs, " of offload_param.buffer_size: ",
          rt->staging_->total_bytes(), " bytes; buffer_count ", config.offload_param.buffer_count,
          " gives ", pairs, " pair(s), at least one) do not fit in strata.host_budget_bytes (",
          config.host_budget_bytes,
          "); lower buffer_size or buffer_count, or raise the host budget"));
    }
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
  for (int i = 0; i < rt->options_.workers; ++i) {
    rt->workers_.emplace_back([r = rt.get()] { r->WorkerLoop(); });
  }
  return rt;
}

Runtime::~Runtime() {
  std::deque<Job> cancelled;
  {
    MutexLock lock(&jobs_mu_);
    stop_ = true;
    cancelled.swap(jobs_);
    jobs_cv_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
  for (Job& j : cancelled) j.cancel();
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

void Runtime::Post(std::function<void()> job, std::function<void()> cancel) {
  {
    MutexLock lock(&jobs_mu_);
    if (!stop_) {
      jobs_.push_back({std::move(job), std::move(cancel)});
      jobs_cv_.Signal();
      return;
    }
  }
  cancel();
}

void Runtime::WorkerLoop() {
  for (;;) {
    Job j;
    {
      MutexLock lock(&jobs_mu_);
      while (!stop_ && jobs_.empty()) jobs_cv_.Wait(&jobs_mu_);
      if (stop_) return;
      j = std::move(jobs_.front());
      jobs_.pop_front();
    }
    j.run();
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
    return s;
  };
  absl::Status s = table_->Materialize(desc.id, tier);
  if (s.code() == absl::StatusCode::kResourceExhausted && IsMemory(tier)) {
    if (absl::Status room =
            MakeRoomLocked(tier, desc.bytes, desc.id, Purpose::kAcquire, 0, nullptr);
        !room.ok()) {
      return undo(room);
    }
    s = table_->Materialize(desc.id, tier);
  }
  if (!s.ok()) return undo(s);
  // The bytes are written without the lock; the partition is unknown to everything but the table
  // (not in parts_) until they are.
  mu_.Unlock();
  absl::Status filled = mover_->Fill(desc, tier, initial);
  mu_.Lock();
  if (!filled.ok()) return undo(filled);
  PartState& st = parts_[desc.id];
  if (IsMemory(tier)) st.last_use[I(tier)] = ++tick_;
  return absl::OkStatus();
}

absl::Status Runtime::Adopt(const tiering::PartitionDesc& desc) {
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
  parts_[desc.id];
  return absl::OkStatus();
}

std::vector<PartitionRecord> Runtime::StoredPartitions() const {
  return store_ == nullptr ? std::vector<PartitionRecord>{} : store_->List();
}

void Runtime::WaitForMoveLocked(PartitionId id) {
  for (;;) {
    auto r = table_->Get(id);
    if (!r.ok() || !r->move) return;
    moved_.Wait(&mu_);
  }
}

absl::Status Runtime::Unregister(PartitionId id) {
  MutexLock lock(&mu_);
  const bool known = parts_.contains(id);
  if (!known && (store_ == nullptr || !store_->Find(id).ok())) {
    return absl::NotFoundError(absl::StrCat("partition ", id, ": not registered"));
  }
  if (known) {
    WaitForMoveLocked(id);
    STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
    for (Tier t : {Tier::kDevice, Tier::kHost}) {
      if (r.pins[I(t)] > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "unregister partition ", id, ": it is pinned in the ", TierName(t), " tier"));
      }
    }
    if (parts_[id].busy > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("unregister partition ", id, ": another thread is bringing it in"));
    }
  }
  // The NVMe copy goes first: once the store has forgotten it, nothing can bring it back.
  if (store_ != nullptr && store_->Find(id).ok()) STRATA_RETURN_IF_ERROR(store_->Erase(id));
  if (known) {
    STRATA_RETURN_IF_ERROR(table_->Unregister(id));
    mover_->Forget(id);
    parts_.erase(id);
  }
  return absl::OkStatus();
}

absl::Status Runtime::MoveLocked(PartitionId id, Tier from, Tier to, Purpose purpose,
                                 uint64_t limit, Waits* waits, bool* raced) {
  STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
  for (;;) {
    if (purpose != Purpose::kAcquire && IsMemory(from)) {
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
    absl::Status begun = table_->BeginMove(id, from, to);
    if (begun.ok()) break;
    if (begun.code() != absl::StatusCode::kResourceExhausted || !IsMemory(to)) return begun;
    STRATA_RETURN_IF_ERROR(MakeRoomLocked(to, r.desc.bytes, id, purpose, limit, waits));
    // Making room released the lock: another thread may have moved this partition meanwhile.
    STRATA_ASSIGN_OR_RETURN(const Residency now, table_->Get(id));
    if (now.move || now.current[I(to)] || !now.current[I(from)]) {
      if (raced != nullptr) *raced = true;
      return absl::AbortedError(absl::StrCat("partition ", id,
                                             ": moved by another thread while "
                                             "room was made for its move ",
                                             TierName(from), " -> ", TierName(to)));
    }
  }
  ++moves_in_flight_;
  const auto t0 = Clock::now();
  mu_.Unlock();
  absl::Status moved = mover_->Carry(id, from, to);
  mu_.Lock();
  --moves_in_flight_;
  moved_.SignalAll();
  if (waits != nullptr) {
    const WaitCause cause = from == Tier::kNvme ? WaitCause::kNvmeRead
                            : to == Tier::kNvme ? WaitCause::kWriteBack
                                                : WaitCause::kCopy;
    waits->s[static_cast<int>(cause)] += Since(t0);
  }
  return moved;
}

absl::Status Runtime::MakeRoomLocked(Tier t, uint64_t bytes, PartitionId for_id, Purpose purpose,
                                     uint64_t limit, Waits* waits) {
  absl::flat_hash_set<PartitionId> skipped;  // victims whose eviction failed
  absl::Status last_failure;
  const bool planned = scheduler_->mode() == Scheduler::Mode::kPlanned;
  const uint64_t window = static_cast<uint64_t>(scheduler_->lookahead());
  while (bytes > table_->budget_bytes(t) ||
         table_->used_bytes(t) > table_->budget_bytes(t) - bytes) {
    // The victim: planned, the copy needed furthest in the future (among those not needed within
    // the window, clean before dirty); else the least recently used. Never a copy pinned, moving,
    // being brought in, or (for a prefetch) needed before the prefetched one.
    PartitionId victim = 0;
    bool found = false;
    std::tuple<bool, bool, uint64_t> best{};  // planned: (far, clean, next use)
    uint64_t oldest = UINT64_MAX;             // on demand: last use
    for (const auto& [id, st] : parts_) {
      if (id == for_id || st.busy > 0 || skipped.contains(id)) continue;
      auto r = table_->Get(id);
      if (!r.ok() || !r->has_copy[I(t)] || r->pins[I(t)] > 0 || r->move) continue;
      int others = 0;
      for (int u = 0; u < tiering::kTierCount; ++u) others += u != I(t) && r->current[u];
      const bool clean = !r->current[I(t)] || others > 0;
      if (planned) {
        // A copy in either memory tier serves an access in the other (one copy away).
        const uint64_t next =
            std::min(scheduler_->NextUse(id, Tier::kDevice), scheduler_->NextUse(id, Tier::kHost));
        if (purpose == Purpose::kPrefetch && next <= limit) continue;
        const std::tuple<bool, bool, uint64_t> key{next > window, clean, next};
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
      if (purpose != Purpose::kPrefetch && moves_in_flight_ > 0) {
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
          purpose == Purpose::kPrefetch ? ", needed sooner than the prefetched partition" : "",
          " or could not be evicted"));
      return last_failure.ok()
                 ? full
                 : Annotate(full, absl::StrCat("last eviction failure: ", last_failure.message()));
    }
    const auto t0 = Clock::now();
    absl::Status s = EvictLocked(victim, t, nullptr);
    if (waits != nullptr) waits->s[static_cast<int>(WaitCause::kWriteBack)] += Since(t0);
    if (!s.ok()) {
      skipped.insert(victim);
      last_failure = s;
    }
  }
  return absl::OkStatus();
}

absl::Status Runtime::EvictLocked(PartitionId id, Tier tier, Waits* waits) {
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
  for (int t = 0; t < tiering::kTierCount; ++t) others += t != I(tier) && r.current[t];
  if (r.current[I(tier)] && others == 0) {
    // Parameters offloaded to NVMe skip the host on the way down, as in ZeRO-Infinity.
    const bool device_to_nvme = tier == Tier::kDevice && store_ != nullptr &&
                                config_.offload_param.device == tiering::OffloadDevice::kNvme;
    const Tier lower = tier == Tier::kDevice && !device_to_nvme ? Tier::kHost : Tier::kNvme;
    if (lower == Tier::kNvme && store_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("partition ", id,
                       ": its host copy is the only current one and there is no NVMe tier "
                       "to write it back to"));
    }
    absl::Status down = MoveLocked(id, tier, lower, Purpose::kEvict, 0, waits);
    if (down.code() == absl::StatusCode::kResourceExhausted && lower == Tier::kHost &&
        store_ != nullptr) {
      // The host tier has no room: the device copy goes straight to NVMe, staged.
      down = MoveLocked(id, tier, Tier::kNvme, Purpose::kEvict, 0, waits);
    }
    STRATA_RETURN_IF_ERROR(down);
    ++stats_.write_backs;
    ++step_.r.write_backs;
  }
  // The lock was released while the bytes moved: the copy may have been pinned meanwhile (the
  // table then refuses, and it stays).
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
                                  Waits* waits) {
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
    // An Acquire pins the copy and may write it: a move still reading it (a write-back begun
    // before the Acquire) ends first.
    const bool being_read = r.move && r.move->first == tier;
    if (r.current[I(tier)] && !(purpose == Purpose::kAcquire && being_read)) {
      return absl::OkStatus();
    }
    if (r.move) {
      // Join the move in flight (a prefetch's, or a write-back reading this copy).
      const WaitCause cause = r.move->first == Tier::kNvme    ? WaitCause::kNvmeRead
                              : r.move->second == Tier::kNvme ? WaitCause::kWriteBack
                                                              : WaitCause::kCopy;
      const auto t0 = Clock::now();
      WaitForMoveLocked(id);
      if (waits != nullptr) waits->s[static_cast<int>(cause)] += Since(t0);
      continue;
    }
    const Tier other = tier == Tier::kDevice ? Tier::kHost : Tier::kDevice;
    Tier from;
    if (r.current[I(other)]) {
      from = other;  // host <-> device through the copy engine
    } else if (r.current[I(Tier::kNvme)]) {
      from = Tier::kNvme;  // NVMe -> host through aio, NVMe -> device staged in chunks
    } else {
      return absl::InternalError(absl::StrCat("partition ", id, ": no current copy to bring"));
    }
    if (purpose == Purpose::kPrefetch && IsMemory(from) && r.pins[I(from)] > 0) {
      // Its holder may be writing it: a prefetch never reads a pinned copy.
      return absl::FailedPreconditionError(
          absl::StrCat("prefetch partition ", id, " to the ", TierName(tier), " tier: its ",
                       TierName(from), " copy is pinned (in use)"));
    }
    bool raced = false;
    absl::Status moved = MoveLocked(id, from, tier, purpose, limit, waits, &raced);
    if (!moved.ok() && !raced) return moved;  // raced: look again
  }
}

absl::StatusOr<std::byte*> Runtime::Acquire(PartitionId id, Tier tier) {
  if (!IsMemory(tier)) {
    return absl::InvalidArgumentError("acquire: the device or host tier (nvme is not addressable)");
  }
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  auto it = parts_.find(id);
  if (it == parts_.end()) {
    return absl::NotFoundError(absl::StrCat("acquire partition ", id, ": not registered"));
  }
  PartState& st = it->second;  // node_hash_map: stable while the lock is released
  STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
  const bool had_divergence = scheduler_->divergence().has_value();
  scheduler_->OnAcquire(r.desc, tier, Now());
  if (!had_divergence && scheduler_->divergence()) {
    Warn(absl::StrCat("step ", stats_.steps + 1,
                      ": the access order differs from the recorded "
                      "trace (",
                      *scheduler_->divergence(),
                      "); the rest of the step is fetched on demand with LRU eviction and "
                      "recorded anew"));
  }
  ++stats_.acquires;
  ++step_.r.acquires;
  ++st.busy;
  Waits waits;
  absl::Status brought;
  bool waited = false;
  if (r.current[I(tier)]) {
    ++stats_.acquire_hits;
    ++step_.r.hits;
    if (st.prefetched) ++step_.r.prefetch_hits;
  } else {
    waited = true;
    if (r.move || prefetching_.contains(Key(id, tier))) {
      ++step_.r.late_prefetches;
    } else {
      ++step_.r.misses;
    }
  }
  // A hit too: a write-back still reading the copy ends before the caller may write it.
  brought = BringLocked(id, tier, Purpose::kAcquire, 0, &waits);
  if (brought.ok()) brought = table_->Pin(id, tier);
  --st.busy;
  st.prefetched = false;
  if (brought.ok()) st.last_use[I(tier)] = ++tick_;
  const double waited_s = Since(t0);
  stats_.acquire_wait_seconds += waited_s;
  step_.r.wait_seconds += waited_s;
  for (int c = 0; c < kWaitCauseCount; ++c) step_.r.wait_by_cause[c] += waits.s[c];
  if (waited) scheduler_->OnLateOrMiss();
  PlanPrefetchesLocked();
  STRATA_RETURN_IF_ERROR(brought);
  return mover_->Address(id, tier);
}

absl::Status Runtime::Release(PartitionId id, Tier tier, bool dirty) {
  MutexLock lock(&mu_);
  STRATA_ASSIGN_OR_RETURN(const Residency r, table_->Get(id));
  if (r.pins[I(tier)] == 0) return table_->Unpin(id, tier);  // names what is wrong
  scheduler_->OnRelease(r.desc, tier, dirty, Now());
  if (dirty) {
    // Still pinned: a move reading this copy (a prefetch into the other tier) ends first, and the
    // copy it made goes stale below.
    WaitForMoveLocked(id);
    STRATA_ASSIGN_OR_RETURN(const std::vector<Tier> stale, table_->MarkWritten(id, tier));
    for (Tier t : stale) {
      // A stale NVMe copy keeps its extent until the next write-back replaces it.
      if (IsMemory(t)) STRATA_RETURN_IF_ERROR(mover_->Drop(id, t));
    }
  }
  return table_->Unpin(id, tier);
}

absl::Status Runtime::Evict(PartitionId id, Tier tier) {
  MutexLock lock(&mu_);
  if (!parts_.contains(id)) {
    return absl::NotFoundError(absl::StrCat("evict partition ", id, ": not registered"));
  }
  WaitForMoveLocked(id);
  return EvictLocked(id, tier, nullptr);
}

void Runtime::PlanPrefetchesLocked() {
  if (scheduler_->mode() != Scheduler::Mode::kPlanned) return;
  const int max_in_flight = scheduler_->max_in_flight();
  for (const Scheduler::Upcoming& u : scheduler_->Window()) {
    if (max_in_flight > 0 && static_cast<int>(prefetching_.size()) >= max_in_flight) break;
    const uint64_t key = Key(u.id, u.tier);
    if (prefetching_.contains(key)) continue;
    auto r = table_->Get(u.id);
    if (!r.ok() || r->current[I(u.tier)] || !parts_.contains(u.id)) continue;
    if (!scheduler_->reads_ahead_from_nvme() && !r->current[I(Tier::kHost)] &&
        !r->current[I(Tier::kDevice)]) {
      break;  // DeepSpeed-like: prefetching stops at the first partition still on NVMe
    }
    prefetching_.insert(key);
    ++step_.r.prefetches;
    Post([this, id = u.id, tier = u.tier] { RunPrefetch(id, tier, true, nullptr); },
         [this, key] {
           MutexLock lock(&mu_);
           prefetching_.erase(key);
         });
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
  } else {
    ++it->second.busy;
    // A prefetch (planned or asked for) never reads a pinned copy and never waits for room.
    s = BringLocked(id, tier, Purpose::kPrefetch, limit, nullptr);
    if (planned && tier == Tier::kDevice && s.code() == absl::StatusCode::kResourceExhausted) {
      // No room on the device yet: stage it in the host tier (NVMe -> host now, host -> device
      // when room comes), unless a memory tier has it already.
      auto r = table_->Get(id);
      if (r.ok() && !r->current[I(Tier::kHost)] && !r->current[I(Tier::kDevice)]) {
        absl::Status staged = BringLocked(id, Tier::kHost, Purpose::kPrefetch, limit, nullptr);
        if (!staged.ok()) s = staged;
      }
    }
    --it->second.busy;
    if (s.ok()) it->second.prefetched = true;
  }
  if (planned) {
    prefetching_.erase(Key(id, tier));
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      ++step_.r.prefetches_blocked;
      scheduler_->OnBudgetTight(limit);
    } else if (!s.ok()) {
      ++step_.r.prefetch_failures;
    }
  }
  if (done != nullptr) done->set_value(s);
}

std::future<absl::Status> Runtime::Prefetch(PartitionId id, Tier tier) {
  auto done = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> f = done->get_future();
  if (!IsMemory(tier)) {
    done->set_value(absl::InvalidArgumentError("prefetch: the device or host tier"));
    return f;
  }
  Post([this, done, id, tier] { RunPrefetch(id, tier, false, done.get()); },
       [done] { done->set_value(absl::CancelledError("prefetch: the Runtime was destroyed")); });
  return f;
}

void Runtime::GradientReady(PartitionId id) {
  MutexLock lock(&mu_);
  if (!parts_.contains(id)) return;
  if (scheduler_->NextUse(id, Tier::kDevice) <= static_cast<uint64_t>(scheduler_->lookahead())) {
    return;  // needed on the device again soon
  }
  Post(
      [this, id] {
        MutexLock lock(&mu_);
        if (!parts_.contains(id)) return;
        WaitForMoveLocked(id);
        auto r = table_->Get(id);
        if (!r.ok() || r->pins[I(Tier::kDevice)] > 0) return;  // in use again: it stays
        if (absl::Status s = EvictLocked(id, Tier::kDevice, nullptr); !s.ok()) {
          // It stays on the device, current; a later eviction retries the write-back.
          ++step_.r.prefetch_failures;
        }
      },
      [] {});
}

StepReport Runtime::EndStep() {
  MutexLock lock(&mu_);
  const Scheduler::Mode mode = scheduler_->mode();
  std::optional<std::string> diverged = scheduler_->EndStep();
  if (diverged && mode == Scheduler::Mode::kPlanned) {
    Warn(absl::StrCat("step ", stats_.steps + 1, ": ", *diverged,
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
  report.lookahead = scheduler_->lookahead();
  step_ = StepCounters{};
  step_.moved_at_start = now;
  step_start_ = Clock::now();
  PlanPrefetchesLocked();  // the next step's first accesses
  return report;
}

RuntimeStats Runtime::stats() const {
  MutexLock lock(&mu_);
  RuntimeStats s = stats_;
  s.host_held_bytes = host_memory_->held_bytes();
  s.bytes_moved = mover_->bytes_moved();
  return s;
}

}  // namespace strata::sched
