// sched/runtime.h: the Runtime facade a trainer links, with the prefetching scheduler behind it.
//
// A Runtime is made from a RuntimeConfig (tiering/runtime_config.h). It owns the aio engine, the
// NVMe store (when anything is offloaded to NVMe), the memory of the device tier (CUDA's
// stream-ordered pool, or host-emulated ordinary memory, pooled, with its own budget when
// strata.device is "emulated" — the test seam every CI run uses, announced by a warning at
// Create), the pinned host memory, the copy engine, the staging pool, the residency table, the
// Mover (swap/mover.h: every byte move) and the Scheduler (sched/scheduler.h: the plan).
//
// Where NVMe swap lives: the store is the folder rank<R> under the configured nvme_path (made when
// missing), R being RuntimeOptions::rank, else the RANK variable that torchrun and DeepSpeed's
// launcher set, else 0 — so the ranks of a job given one nvme_path (as DeepSpeed configs do) never
// share a store. A store is locked for its Runtime's life: a second Runtime (in this process or
// another) on the same folder is refused at Create. The CUDA device is RuntimeOptions::
// device_index, else the config's strata.device_index, else LOCAL_RANK, else 0.
//
// The trainer registers partitions (with their first bytes in a tier), then asks for a partition
// in a memory tier with Acquire — which brings a current copy there (NVMe -> host through the aio
// engine; host <-> device through the copy engine; NVMe <-> device in chunks through a pair of
// pinned staging buffers of offload_param.buffer_size, the disk and the copy engine overlapping),
// making room by evicting unpinned copies of that tier (writing a copy back first when it is the
// only current one), and pins it until Release. A Release marked dirty makes that copy the only
// current one (the stale memory copies are freed). Discard drops a partition's bytes (a gradient
// once the optimizer has stepped from it): its next Acquire gets zeros, made where they are wanted
// without reading anything. EndStep marks the end of a training step.
//
// The scheduler: the first step is recorded; from the second the Runtime follows the recorded
// trace, prefetching the next accesses on its worker threads (NVMe -> host -> device, or NVMe ->
// device staged) so they arrive before they are needed, and evicting the copy needed furthest in
// the future (clean before dirty among those not needed soon; a prefetch never evicts one the
// window needs), with DeepSpeed's stage-3 knobs: stage3_prefetch_bucket_size bounds the parameter
// elements in the window, stage3_max_live_parameters the parameter elements the scheduler's
// prefetches may bring to the device, stage3_max_reuse_distance keeps a device parameter needed
// again within that many parameter elements over other copies, and parameters with fewer than
// stage3_param_persistence_threshold elements are never evicted from the device to make room. A
// dirty host copy that the plan says would be evicted before its next use is written to NVMe in
// the background at once. A step whose accesses differ from the trace falls back to on-demand
// fetching with least-recently-used eviction for its rest, warns once, and is recorded anew. With
// strata.eviction_policy "lru" there is no plan: on demand and LRU throughout. GradientReady tells
// the Runtime a gradient partition is complete on the device: it leaves the device in the
// background (to the host tier, or to NVMe when the host has no room) unless the plan needs it
// there again within the window. Per step, EndStep reports the trainer's waits by cause, the
// bytes moved per pair of tiers and the prefetch outcomes.
//
// Pinned copies are the trainer's: no prefetch or write-back reads a pinned copy, and an Acquire
// of a copy that a write-back is still reading waits for it to end (the trainer may write the
// copy once it has it). One exception, the caller's to avoid: acquiring a partition in one tier
// while its only current copy is pinned in the other and being written reads bytes being written.
//
// Concurrency: the Runtime's metadata lock is never held across I/O or a copy. Moves of different
// partitions run at once (a trainer thread's Acquire, the prefetch workers, write-backs); an
// Acquire of a partition already current in its tier returns at once whatever else is in flight;
// an Acquire of a partition being moved joins that move. A copy being acquired is never chosen as
// an eviction victim; when no victim can be found but moves are in flight, a move that needs room
// waits for them rather than failing.
//
// Budgets: the host budget covers the partitions' host copies and the staging pool
// (offload_param.buffer_count buffers, used in pairs: an odd count's last buffer is not set
// aside, and at least one pair is; set aside at Create when there is an NVMe tier), so pinned
// memory held stays within strata.host_budget_bytes. A copy is counted in whole pages (4096
// bytes); a partition larger than a tier's budget (less what is set aside for the optimizer) is
// refused there at once (ResourceExhausted).
//
// Restarts: a Runtime reopening a store finds the partitions an earlier run left there
// (StoredPartitions). Adopt takes one over with its bytes; Register refuses an id the store already
// holds (it would overwrite the stored bytes); Unregister drops a partition, stored or not. Flush
// writes every partition whose NVMe copy is stale back to NVMe, and the destructor flushes (a
// failure there is reported as a warning: release everything and Flush before destroying to see
// the status).
//
// Nothing is lost: every move goes through the residency table's rules (tiering/residency.h); a
// write-back that fails leaves the previous copy valid and the partition dirty, and the caller
// whose Acquire needed it gets the status (a prefetch's failure is counted and left for the
// trainer's own Acquire to meet).
//
// Thread safety: thread-safe. A partition pinned by Acquire must be released by the caller; one
// thread's Acquire and Release of a partition may interleave with other threads' of the same one.
#ifndef STRATA_SCHED_RUNTIME_H_
#define STRATA_SCHED_RUNTIME_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "aio/engine.h"
#include "base/mutex.h"
#include "base/worker_pool.h"
#include "optim_cpu/adam.h"
#include "optim_cpu/chunk_optimizer.h"
#include "sched/scheduler.h"
#include "swap/mover.h"
#include "swap/optimizer_swapper.h"
#include "swap/staging_pool.h"
#include "tiering/copy_engine.h"
#include "tiering/memory_resource.h"
#include "tiering/nvme_store.h"
#include "tiering/residency.h"
#include "tiering/runtime_config.h"

namespace strata::sched {

using tiering::PartitionRecord;
using tiering::RuntimeConfig;

struct RuntimeOptions {
  std::function<void(absl::string_view)> on_warning;  // default: stderr
  // This process's rank (its store is <nvme_path>/rank<rank>); -1: the RANK environment
  // variable, else 0.
  int rank = -1;
  // The CUDA device of the device tier; -1: the config's strata.device_index, else the
  // LOCAL_RANK environment variable, else 0.
  int device_index = -1;
  // Threads that run prefetches and background write-backs.
  int workers = 4;
  // Overrides the policy strata.eviction_policy picks (benchmarks compare kDeepSpeedLike).
  std::optional<Policy> policy;
  // Test seam: false queues no prefetch from the plan (evictions still follow it), so that which
  // copies a tier holds, and the window, do not hang on when the prefetch threads ran.
  bool plan_prefetches = true;
  // Passed to the aio engine (tests wrap the backend with a FaultInjector).
  aio::EngineOptions engine_options;
  // Test seam: wraps the copy engine the Runtime made (a test's engine may record fences of its
  // own on the emulated device, which has none).
  std::function<std::unique_ptr<tiering::CopyEngine>(std::unique_ptr<tiering::CopyEngine>)>
      wrap_copy_engine;
  // Test seam: the optimizer step's events (swap/optimizer_swapper.h), with the caller's ids.
  std::function<void(swap::StepEvent, PartitionId)> on_optimizer_event;
};

// Why the trainer waited.
enum class WaitCause : uint8_t {
  kNvmeRead,    // bytes coming from NVMe (its own move, or a prefetch it joined)
  kCopy,        // a host <-> device copy (or zeros made for a discarded partition)
  kWriteBack,   // an eviction's write-back that had to finish to make room
  kBudgetFull,  // no copy could be evicted until other moves finished
};
inline constexpr int kWaitCauseCount = 4;
absl::string_view WaitCauseName(WaitCause c);

struct StepReport {
  uint64_t step = 0;        // 1-based
  std::string mode;         // "recorded", "planned", "fallback" (diverged), "on-demand" (lru)
  std::string divergence;   // what differed from the trace; empty when nothing did
  double seconds = 0;       // wall time since the previous EndStep (or Create)
  double wait_seconds = 0;  // the trainer's Acquires, waiting for bytes
  std::array<double, kWaitCauseCount> wait_by_cause{};
  swap::TierMatrix bytes_moved{};  // [from][to], this step, prefetches and write-backs included
  // The partitions' bytes read from and written to NVMe this step by their role (param, grad,
  // other...): [role][0: read, 1: written]. The optimizer's own state is not among them: its
  // step reports it (swap::StepReport), and ReadOptimizerState's reads are below.
  swap::RoleNvmeBytes nvme_by_role{};
  uint64_t optimizer_state_read_bytes = 0;  // NVMe state read by ReadOptimizerState this step
  uint64_t acquires = 0;
  uint64_t hits = 0;             // current in the tier when asked for
  uint64_t prefetch_hits = 0;    // of the hits, brought by a prefetch
  uint64_t late_prefetches = 0;  // a prefetch was still moving it: the Acquire joined
  uint64_t misses = 0;           // the Acquire moved it itself
  // acquires of a discarded partition, nothing read: zeros made, or (an overwrite) its room alone
  uint64_t zero_fills = 0;
  // (acquires = hits + zero_fills + late_prefetches + misses)
  uint64_t prefetches = 0, prefetch_failures = 0, prefetches_blocked = 0;  // blocked: no room
  uint64_t evictions = 0, write_backs = 0;
  uint64_t write_back_failures = 0;  // background write-backs (GradientReady) that failed
  int lookahead = 0;                 // the adaptive window at the step's end, in accesses
  // One JSON object on one line.
  std::string ToJson() const;
};

struct RuntimeStats {
  // Time Acquire spent waiting for bytes, since Create.
  double acquire_wait_seconds = 0;
  uint64_t acquires = 0, acquire_hits = 0;  // hits: already current in the tier
  uint64_t evictions = 0, write_backs = 0, write_back_failures = 0;
  uint64_t steps = 0;
  // Pinned host memory held (partitions' copies, staging buffers, freed blocks kept for reuse,
  // page rounding): never more than strata.host_budget_bytes.
  uint64_t host_held_bytes = 0;
  // Per tier (device, host, nvme): the most bytes of partitions (and budget set aside) it has
  // held at once since Create, against its budget (the residency table's accounting).
  std::array<uint64_t, tiering::kTierCount> peak_bytes{}, budget_bytes{};
  swap::TierMatrix bytes_moved{};  // [from][to]
};

// Whether an access is part of the step's trace (Runtime::Acquire).
enum class Access : uint8_t { kTraced, kOutOfTrace };

class Runtime {
 public:
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(const RuntimeConfig& config,
                                                         RuntimeOptions options = {});
  ~Runtime();

  // Registers a partition whose first bytes are `initial` (zeros when empty, written to NVMe
  // through the staging buffers when `tier` is NVMe), placed in `tier`. AlreadyExists when the id
  // is registered, or held by the store from an earlier run (Adopt or Unregister it).
  absl::Status Register(const tiering::PartitionDesc& desc, Tier tier,
                        absl::Span<const std::byte> initial = {});
  // Registers a partition the store already holds (from an earlier run), with its bytes: NotFound
  // when the store has no such id, InvalidArgument when its length is not desc.bytes.
  absl::Status Adopt(const tiering::PartitionDesc& desc);
  // The partitions in the NVMe store (empty without an NVMe tier), registered or not.
  std::vector<PartitionRecord> StoredPartitions() const;
  // Forgets a partition: its memory copies are freed and its NVMe copy erased. Refused while it is
  // pinned, brought in (or waited for) or being registered by another thread; waits for a move of
  // it in flight to end. Ids of 2^63 and more are refused (they key the optimizer's state).
  // Also drops a stored partition never adopted. If erasing the NVMe copy fails, the memory
  // copies are gone and the stored one stays (StoredPartitions): Unregister again to erase it.
  absl::Status Unregister(PartitionId id);
  // Writes back to NVMe every registered partition whose NVMe copy is not current, so the store
  // holds every partition's latest bytes (what a restart adopts; a discarded partition has none to
  // write, and its stored copy keeps the bytes it had). FailedPrecondition naming the
  // first partition pinned while dirty; a no-op without an NVMe tier.
  absl::Status Flush();
  // Brings a current copy into `tier` (device or host), pins it, returns its address. It returns
  // once the bytes are in place (the copy engine's completion observed on the host), so kernels
  // the trainer queues afterwards, on any stream, read them without synchronizing the device.
  // Access::kOutOfTrace: an access the scheduler does not see (not recorded, not compared with
  // the plan, not counted in the step's report), for accesses whose order may vary from step to
  // step (the optimizer step's, which depend on clipping or a retried step); release it the same
  // way. `overwrite`: the caller writes every byte before it releases (dirty): a partition without
  // bytes (discarded) is given its room as it is, no zeros made (a gradient's first micro-batch).
  absl::StatusOr<std::byte*> Acquire(PartitionId id, Tier tier, Access access = Access::kTraced,
                                     bool overwrite = false);
  // Unpins; `dirty`: the caller changed the bytes in `tier` (its other copies go stale and their
  // memory is freed). `stream` (device tier, CUDA: the cudaStream_t where the trainer queued the
  // kernels that use the copy, tiering::kLegacyDefaultStream for CUDA's legacy default stream,
  // whose handle is 0; null when they are done): the copy is not read, overwritten or
  // freed until the work queued there so far has run (an event recorded on it, waited for by the
  // thread that moves or frees the copy, never by a device-wide synchronize). The host-emulated
  // device has no streams: `stream` is accepted and there is nothing to wait for. A dirty release
  // while another holder pins the other memory tier's copy is refused (FailedPrecondition) and
  // keeps the pin, so the change is not lost: release that holder's pin, then this one again.
  absl::Status Release(PartitionId id, Tier tier, bool dirty,
                       tiering::StreamHandle stream = nullptr, Access access = Access::kTraced);
  // Drops the copy in `tier` (memory tiers), writing it back first when it is the only current
  // copy: a device copy to host, or straight to NVMe when parameters are offloaded to NVMe
  // (offload_param.device "nvme") or the host tier has no room; a host copy to NVMe. A clean
  // copy is dropped without I/O.
  absl::Status Evict(PartitionId id, Tier tier);
  // The partition's bytes are no longer needed (a gradient the optimizer has consumed, as
  // zero_grad says of it): every copy goes stale at once, the memory copies are freed, and the next
  // Acquire gets zeros made in its tier without reading anything (nothing crosses the link or the
  // disk; a device's zeros are made on the device). The NVMe copy keeps its extent, holding the
  // old bytes, until a write-back replaces it: a restart that adopts the partition before then
  // gets them. Flush skips it; the scheduler does not prefetch it (an explicit Prefetch makes its
  // zeros ahead). Waits for a move of it in flight and for threads bringing it in; refused
  // (FailedPrecondition) while it is pinned.
  absl::Status Discard(PartitionId id);
  // Brings a current copy into `tier` on a worker thread (no pin) and returns at once; the future
  // completes when it is there (it may be discarded), or with the reason it is not: no room that
  // can be made without waiting (ResourceExhausted), or the only current copy pinned in the other
  // memory tier (FailedPrecondition: its holder may be writing it; a current NVMe copy is read
  // instead when there is one). The destructor completes queued ones with Cancelled.
  std::future<absl::Status> Prefetch(PartitionId id, Tier tier);
  // The gradient partition `id` is complete in the device tier (released dirty): it leaves the
  // device in the background unless the plan needs it there within the window.
  void GradientReady(PartitionId id);
  // The training step ends: returns its report (ToJson gives the log line). A recorded or
  // diverged step becomes the next step's plan.
  StepReport EndStep();

  // The optimizer (offload_optimizer): CpuAdam (Adagrad or Lion by the overload below) over the
  // fp32 master weights and moments of
  // `partitions` ((id, elements)), on the Runtime's own store and budgets — kept per
  // offload_optimizer.device: "cpu", in pinned host memory; "nvme", in the NVMe store, stepped
  // through a ring of offload_optimizer.buffer_count pinned buffers (at least three with
  // pipeline_read or pipeline_write, which overlap reading the next partition's state and writing
  // the last one's with the step), each as large as the largest partition's state or a
  // sub-group's (zero_optimization.sub_group_size elements: larger partitions step in sub-groups
  // of it; ids below 2^40 then). The host and NVMe room it needs (state, ring, the staged bf16
  // copies of NVMe-resident weights; twice the NVMe state, as a step writes the new state beside
  // the old before its commit, or once and a sub-group with optimizer_commit "partition") is set
  // aside from strata.host_budget_bytes and the store's capacity
  // at once: ResourceExhausted, naming what is needed and free, when it does not fit (create the
  // optimizer before filling the host tier). Its ids are its own: the store keeps them apart from
  // the partitions'. By convention an optimizer partition has the id of the gradient partition it
  // steps from, so that the trace orders the step (below). Once per Runtime.
  absl::Status CreateOptimizer(const optim_cpu::AdamConfig& adam,
                               const std::vector<std::pair<PartitionId, uint64_t>>& partitions);
  // The same with Adam, Adagrad or Lion (optim_cpu/chunk_optimizer.h: a one-state optimizer keeps
  // its state where Adam keeps exp_avg; ReadOptimizerState gives it there). `copy_dtype`: the
  // dtype of the param copies OptimizerStep will be asked for (the host room set aside for staging
  // them: 2 bytes an element, 4 for fp32); `copy_elements`: how many elements of the NVMe-resident
  // partitions will ask for one (default: all; a trainer whose parameters are homed on NVMe reads
  // theirs back from the master weights instead, and sets aside room only for the others').
  absl::Status CreateOptimizer(const optim_cpu::OptimizerConfig& optimizer,
                               const std::vector<std::pair<PartitionId, uint64_t>>& partitions,
                               optim_cpu::DType copy_dtype = optim_cpu::DType::kBF16,
                               std::optional<uint64_t> copy_elements = std::nullopt);
  // Sets a partition's master weights; its first state starts at `initial_state` (Adagrad's
  // initial_accumulator_value; 0 otherwise), Adam's second moment at zero. (A state that an
  // earlier run left in the store is stepped from as it is, without this.)
  absl::Status InitializeOptimizerState(PartitionId id, absl::Span<const float> master,
                                        float initial_state = 0.0f);
  // One optimizer step t over `inputs` (swap/optimizer_swapper.h: every input validated first;
  // a step that fails changes nothing). The partitions are stepped, and their NVMe state read
  // ahead, in the order their gradients were released dirty in the recorded trace (backward's
  // order), the rest after them in the order given. With strata.optimizer_write_behind (on by
  // default with the state on NVMe) the step stands once it returns, its NVMe writes finishing
  // behind it (FlushOptimizer, below: a write that fails then is written again, not undone).
  absl::StatusOr<swap::StepReport> OptimizerStep(int64_t t, std::vector<swap::StepInput> inputs,
                                                 const optim_cpu::StepOptions& options = {});
  // The step in parts (swap/optimizer_swapper.h's transaction), for a trainer that steps each
  // partition as backward makes its gradient final and commits after backward (or aborts and
  // steps again when clipping or an overflow changes the step): Begin, then Stage as gradients
  // become final (each call with its own t and options), then Commit or Abort. A staged input with
  // a null `grad` is the gradient partition `id` (the optimizer partition's id, by the convention
  // above): the optimizer's thread acquires it in the host tier, out of the trace (waiting there,
  // not in the trainer, for GradientReady's move down), and holds it only while its partition
  // steps: it is let go right after (it stays registered, wherever the tiers' budgets put it, for
  // a step taken anew), so the gradients of a model larger than the host tier step through it.
  // Commit changes everything or nothing, as OptimizerStep; the destructor aborts a step left
  // open. With `host_early` (swap/optimizer_swapper.h's Begin), host-resident partitions step in
  // place as they are staged, during backward, for a trainer that will not abort the step for its
  // arithmetic; AbortOptimizerStep returns those that had stepped (after a failed Commit too).
  // With strata.optimizer_commit "partition" an input may name, in `sink_target` with
  // copy_to_sink, a registered partition of as many 16- or 32-bit elements (its parameter) to
  // take its new weights: once its state has landed, the optimizer's thread acquires that
  // partition in the host tier out of the trace, writes them and releases it written (so the
  // weights of parameters homed on NVMe go there without a copy of the model in host memory);
  // TakeCopiedPartitions returns the optimizer partitions whose weights went so.
  // With `hold` (swap/optimizer_swapper.h's held step), the staged partitions' NVMe state is read
  // ahead into the optimizer's read-ahead room (strata.optimizer_read_ahead_bytes) and nothing
  // steps until ReleaseOptimizerStep gives the gradients' scale (every staged input's grad_scale
  // replaced by it), for a trainer that learns it after backward (clipping's global norm).
  absl::Status BeginOptimizerStep(bool host_early = false, bool hold = false);
  absl::Status ReleaseOptimizerStep(float grad_scale);
  // The read-ahead room the optimizer holds (0: none, or no optimizer).
  uint64_t OptimizerReadAheadBytes();
  // `grad_stream` (device tier, CUDA; as Release's `stream`): the stream where the inputs' given
  // gradients are still being copied into host memory. A fence is recorded there and whichever
  // thread steps an input waits for it before reading its gradient, so a trainer stages each
  // gradient as its copy is queued, without waiting for the device. Null: they are in place.
  absl::Status StageOptimizerStep(int64_t t, std::vector<swap::StepInput> inputs,
                                  const optim_cpu::StepOptions& options = {},
                                  tiering::StreamHandle grad_stream = nullptr);
  absl::StatusOr<swap::StepReport> CommitOptimizerStep();
  // A commit in two phases, for ranks that commit only if every one can
  // (swap/optimizer_swapper.h's Prepare): waits for the staged work and returns the failure the
  // commit would meet before anything of it stands, the step left open for CommitOptimizerStep or
  // AbortOptimizerStep.
  absl::Status PrepareOptimizerStep();
  std::vector<PartitionId> AbortOptimizerStep();
  std::vector<PartitionId> TakeCopiedPartitions();
  // The optimizer partitions stepped in part (zero_optimization.sub_group_size with
  // optimizer_commit "partition": a step that failed inside them), until they are stepped again
  // at that step (swap/optimizer_swapper.h's PartlyStepped).
  std::vector<PartitionId> PartlySteppedOptimizerPartitions();
  // strata.optimizer_write_behind: waits until the last step's optimizer state, written behind
  // it, is on NVMe (writing again what failed); its error while that fails (the state kept in
  // host memory). Every call that reads or steps the state does it first; a trainer calls it
  // where it wants the step durable. OK at once otherwise.
  absl::Status FlushOptimizer();
  // With a host_early step open, waits until the host-resident partitions staged so far have
  // stepped (their state and param copies are then read whole); at once otherwise.
  void WaitForEarlySteps();
  // Loads optimizer state (a checkpoint's), all or none: swap/optimizer_swapper.h's BeginLoad,
  // Load and CommitLoad or AbortLoad.
  absl::Status BeginLoadOptimizerState();
  absl::Status LoadOptimizerState(PartitionId id, absl::Span<const float> master,
                                  absl::Span<const float> exp_avg,
                                  absl::Span<const float> exp_avg_sq);
  absl::Status CommitLoadOptimizerState();
  void AbortLoadOptimizerState();
  // `mixed_steps`: PipelinedOptimizerSwapper::ReadState's.
  absl::Status ReadOptimizerState(PartitionId id, absl::Span<float> master,
                                  absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq,
                                  bool mixed_steps = false);

  RuntimeStats stats() const;
  const tiering::ResidencyTable& residency() const { return *table_; }
  const RuntimeConfig& config() const { return config_; }
  // The CUDA device the device tier is on (chosen as the header says); -1 on the host-emulated
  // device.
  int cuda_device() const { return cuda_device_; }
  // Every warning so far (a copy: worker threads may add to them).
  std::vector<std::string> warnings() const;

 private:
  struct Waits {
    std::array<double, kWaitCauseCount> s{};
  };
  // On whose behalf a move runs. A prefetch (and an eviction that makes room for one) never waits
  // for room and never evicts a copy needed before the prefetched one; nothing but an Acquire
  // reads a pinned copy.
  enum class Purpose : uint8_t { kAcquire, kPrefetch, kEvict, kEvictForPrefetch };
  static bool ForPrefetch(Purpose p) {
    return p == Purpose::kPrefetch || p == Purpose::kEvictForPrefetch;
  }
  static bool IsEviction(Purpose p) {
    return p == Purpose::kEvict || p == Purpose::kEvictForPrefetch;
  }
  struct PartState {
    std::array<uint64_t, 2> last_use{};  // device, host: the tick of the last access
    int busy = 0;                        // operations bringing it: never a victim meanwhile
    int joining = 0;                     // threads parked on its move (not busy: evictable)
    int carrying = 0;                    // MoveLocked calls between their unlock and re-lock
    std::array<bool, 2> prefetched{};    // device, host: brought by a prefetch, not yet acquired
    std::optional<Purpose> moving;       // why its move in flight runs
    // A parameter homed on NVMe within offload_param.max_in_cpu: brought to the device through
    // the host tier, whose clean copy stays (room permitting) for its next use.
    bool host_cached = false;
  };
  // Marks `st` host_cached when `desc` is a parameter homed on NVMe and the elements so marked
  // stay within offload_param.max_in_cpu (DeepSpeed's parameter elements kept in CPU memory).
  void MarkHostCachedLocked(const tiering::PartitionDesc& desc, PartState& st)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counters of the current step.
  struct StepCounters {
    StepReport r;
    swap::TierMatrix moved_at_start{};
    swap::RoleNvmeBytes nvme_by_role_at_start{};
    uint64_t state_read_at_start = 0;
  };

  Runtime() = default;
  // Brings a current copy of `id` into `tier` (joining a move in flight). `limit`: for a prefetch,
  // the distance of its use (victims must be needed later). The caller holds a busy mark on `id`.
  // `filled` (when given) is set when this call made room for a discarded partition: zeros unless
  // `overwrite` (Acquire's).
  absl::Status BringLocked(PartitionId id, Tier tier, Purpose purpose, uint64_t limit, Waits* waits,
                           bool* filled = nullptr, bool overwrite = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The optimizer thread's acquire of a partition's host copy that it writes whole (a parameter's
  // new weights, made from optimizer state that has landed: the old bytes are obsolete): a copy
  // not current in the host tier is not read, only its room is taken (its bytes discarded first).
  // One pinned, moving or being brought in elsewhere is acquired as usual (read).
  absl::StatusOr<std::byte*> AcquireToReplace(PartitionId id);
  // Discards `id`, which nothing holds, moves or brings in (Discard's work once it has waited for
  // that): every copy stale, the memory ones freed, the scheduler and the waiters for room told.
  absl::Status DiscardIdleLocked(PartitionId id, PartState& st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `traced`: an access of the trainer's, seen by the scheduler and counted in the step's report;
  // else the optimizer thread's (StageOptimizerStep), which neither sees.
  absl::StatusOr<std::byte*> AcquireLocked(PartitionId id, Tier tier, bool traced = true,
                                           bool overwrite = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The staged step is over: its gradients are no longer dropped as they are let go.
  void EndDroppingGradients();
  // Releases the gradients the optimizer's thread acquired for a staged step and still holds
  // (`only`: that one, if held: called on the optimizer's thread once its partition has stepped).
  void ReleaseStagedGradients(std::optional<PartitionId> only = std::nullopt);
  // The dtype of `partition`, registered with as many 16- or 32-bit elements as the optimizer's
  // partition `optimizer_id` (a step's gradient or copy target); else why not, after `what`
  // (`hint` follows "is not registered").
  absl::StatusOr<optim_cpu::DType> StepPartitionDtype(PartitionId partition,
                                                      PartitionId optimizer_id,
                                                      const std::string& what,
                                                      absl::string_view hint = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(optimizer_mu_);
  // Begins (making room when needed), carries and ends one move, unlocking mu_ while bytes move.
  // `raced` is set (and Aborted returned) when another thread moved the partition while room was
  // made: the caller looks again. A fill (from == to) makes zeros unless not `zeros`.
  absl::Status MoveLocked(PartitionId id, Tier from, Tier to, Purpose purpose, uint64_t limit,
                          Waits* waits, bool* raced = nullptr, bool zeros = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts copies from `t` until a copy of `desc` fits. A prefetch (purpose kPrefetch) never waits
  // and never evicts a copy needed within `limit` accesses; its evictions follow the same rules.
  absl::Status MakeRoomLocked(Tier t, const tiering::PartitionDesc& desc, Purpose purpose,
                              uint64_t limit, Waits* waits) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the copy in `tier`, writing it down first when it is the only current one. `purpose`
  // and `limit`: on whose behalf (a prefetch's eviction follows the prefetch's rules).
  absl::Status EvictLocked(PartitionId id, Tier tier, Purpose purpose, uint64_t limit, Waits* waits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteBackLocked(PartitionId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WaitForMoveLocked(PartitionId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlanPrefetchesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Planned: a dirty host copy that Belady's rule on the plan would evict before its next use is
  // written to NVMe in the background.
  void WriteBackEarlyLocked(PartitionId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountWriteBackFailure(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `work` on a worker, under the lock, once no move of `id` is in flight (not at all when it
  // has been unregistered meanwhile). A `background` job (an early write-back) runs after the
  // queued others, and never on the last worker free: a prefetch always finds one.
  void PostForPartition(PartitionId id, std::function<void(const tiering::Residency&)> work,
                        bool background = false);
  StepReport EndStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunPrefetch(PartitionId id, Tier tier, bool planned, std::promise<absl::Status>* done);
  double Now() const;
  void Warn(std::string w);
  // A warning raised under mu_: told (to the callback, which may call the Runtime) by
  // TellWarnings once the lock is released.
  void WarnLocked(std::string w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TellWarnings() ABSL_LOCKS_EXCLUDED(mu_);

  RuntimeConfig config_;
  RuntimeOptions options_;
  int cuda_device_ = -1;
  mutable Mutex warnings_mu_;
  std::vector<std::string> warnings_ ABSL_GUARDED_BY(warnings_mu_);
  std::unique_ptr<aio::Engine> engine_;
  std::unique_ptr<tiering::NvmeStore> store_;
  std::unique_ptr<tiering::MemoryResource> device_backing_;  // emulated: what device_memory_ pools
  std::unique_ptr<tiering::MemoryResource> device_memory_;
  std::unique_ptr<tiering::MemoryResource> pinned_memory_;
  std::unique_ptr<tiering::PoolingResource> host_memory_;  // pools pinned_memory_
  std::unique_ptr<tiering::CopyEngine> copy_;
  std::unique_ptr<swap::StagingPool> staging_;
  std::unique_ptr<tiering::ResidencyTable> table_;
  std::unique_ptr<swap::Mover> mover_;
  // The optimizer (CreateOptimizer); destroyed before the store and host memory it uses.
  Mutex optimizer_mu_;
  std::unique_ptr<optim_cpu::ChunkOptimizer> chunk_optimizer_ ABSL_GUARDED_BY(optimizer_mu_);
  std::unique_ptr<swap::PipelinedOptimizerSwapper> optimizer_ ABSL_GUARDED_BY(optimizer_mu_);
  std::array<uint64_t, tiering::kTierCount> optimizer_set_aside_ ABSL_GUARDED_BY(optimizer_mu_){};
  // The host room set aside for the staged param copies (what a staged step's Begin asks for).
  uint64_t copy_staging_room_ ABSL_GUARDED_BY(optimizer_mu_) = 0;
  // NVMe state read by ReadOptimizerState since Create (any thread).
  std::atomic<uint64_t> state_read_bytes_{0};
  // Gradient partitions the optimizer's thread pinned in the host tier for the staged step.
  Mutex staged_mu_;
  std::vector<PartitionId> staged_gradients_ ABSL_GUARDED_BY(staged_mu_);
  std::vector<PartitionId> copied_ ABSL_GUARDED_BY(staged_mu_);  // TakeCopiedPartitions
  // A held step released with optimizer_commit_each: it is never taken anew, so each gradient the
  // optimizer's thread lets go is dropped at once (its room freed, never written to NVMe), not at
  // the step's end.
  bool drop_stepped_gradients_ ABSL_GUARDED_BY(staged_mu_) = false;

  mutable Mutex mu_;
  // Signalled when a move ends, when a Discard frees copies, and when a thread stops bringing a
  // partition in while a Discard waits for that.
  CondVar moved_;
  absl::node_hash_map<PartitionId, PartState> parts_ ABSL_GUARDED_BY(mu_);
  uint64_t host_cached_elements_ ABSL_GUARDED_BY(mu_) = 0;  // of the parts_ marked host_cached
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  int moves_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Discards waiting (on moved_) for the threads bringing their partition in: an Acquire or a
  // prefetch that ends signals moved_ only when one waits, not on every call.
  int discards_waiting_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<Scheduler> scheduler_ ABSL_GUARDED_BY(mu_);
  // Planned prefetches queued or running.
  absl::flat_hash_set<std::pair<PartitionId, Tier>> prefetching_ ABSL_GUARDED_BY(mu_);
  // Partitions whose NVMe copy Unregister is erasing (without the lock).
  absl::flat_hash_set<PartitionId> unregistering_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pending_warnings_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point step_start_ ABSL_GUARDED_BY(mu_);
  StepCounters step_ ABSL_GUARDED_BY(mu_);
  RuntimeStats stats_ ABSL_GUARDED_BY(mu_);

  // The worker threads: prefetches, GradientReady's moves, early write-backs (in the background).
  std::unique_ptr<WorkerPool> pool_;
};

}  // namespace strata::sched

#endif  // STRATA_SCHED_RUNTIME_H_
