// swap/optimizer_swapper.h: the optimizer step over state that lives on NVMe, as a pipeline
// (DeepSpeed's PipelinedOptimizerSwapper is the anchor).
//
// Each partition's optimizer state — fp32 master weights, exp_avg and exp_avg_sq — is one blob
// [master | exp_avg | exp_avg_sq] (one read and one write per partition, as large as they come).
// Partitions are placed in order: while their state fits in max_in_cpu_bytes it stays in pinned
// host memory and never touches the disk; the rest lives in the NVMe store.
//
// Step(t) runs CpuAdam over the partitions it is given: any subset of the swapper's partitions, in
// any order, each at most once (a partition not listed is not stepped and keeps its state). Every
// input is validated first: a known partition, listed once, and everything CpuAdam would refuse (a
// null gradient, a grad or copy dtype it does not take, t < 1); `grad` must point to as many
// values of grad_dtype as the partition has elements, and `param_copy`, when set, to as many of
// copy_dtype (raw pointers: those sizes cannot be checked). A bad input returns InvalidArgument
// before anything is read, stepped or written. For the NVMe-resident partitions, with
// pipeline_read the state of k+1 is read while k steps, and with pipeline_write the state of k-1
// is written while k steps, through a ring of pinned buffers (three by default, one without
// pipelining); the gradients come from the caller's host memory.
//
// A step changes nothing until it commits (unless commit_each or write_behind, below). The new
// NVMe state is staged in fresh extents and committed in one manifest record at the end of the
// step; the param copies of the NVMe-resident
// partitions are computed into a staging buffer meanwhile. Only after the commit are the staged
// copies copied to the callers' `param_copy` and the host-resident partitions stepped (their
// inputs being valid, neither can fail). So a step that fails (a read, a write, the commit, the
// staging buffer's allocation) changes nothing the caller can see: NVMe holds the previous step's
// state, whole; the host-resident state, the gradients and every `param_copy` are untouched; and
// retrying the step gives, bit for bit, the result of a step that never failed. The price: NVMe
// space for a second copy of the stepped state during the step, and host memory (from `host`,
// kept for the next step) for the NVMe-resident partitions' param copies, 2 bytes (4 for fp32)
// per element of those that ask for one.
//
// The step in parts, for a trainer that steps partitions while backward still runs (the
// speculative step of DeepSpeed's SuperOffload, kept exact by the caller: it aborts and steps
// again when clipping or an overflow, known only after backward, changes the step): Begin opens
// it; Stage hands partitions over as their gradients become final, each call with its own t and
// options; a worker thread reads each one's NVMe state, steps it into the ring and writes it to
// fresh extents, its param copy into staging, in the order staged and pipelined as above. Commit
// waits for that work and then commits exactly as Step does; it reports an overflow (a staged
// input with options.check_overflow whose gradient is not finite) or the first failure with
// nothing changed. Abort drops it all, nothing changed. Host-resident partitions step at Commit,
// in place, after the NVMe commit, unless the step was begun with host_early: then they step in
// place as they are staged (see Begin). Step is Begin, Stage of every input and Commit.
//
// A step whose gradients' scale is learnt only after backward (clipping by the global norm, as
// DeepSpeed's gradient_clipping: every partition's step depends on every gradient) can still have
// its disk reads overlap backward: Begin(..., hold) opens a held transaction. Its partitions are
// staged as their gradients become final, and the worker reads their NVMe state ahead, in the
// order staged, into the read-ahead room (read_ahead_bytes of pinned host memory, taken at Create;
// each sub-group's state there in whole pages until the transaction ends, and a copy buffer's room
// beside it with commit_each) while it lasts (a sub-group that does not fit is left to the ring;
// at most eight reads ahead at a time beside the ring's first two; pipeline_read or not), but
// steps nothing until
// Release(grad_scale) gives the scale, which replaces every staged input's grad_scale (those
// staged after it too). Then it goes on as any transaction: the rest through the ring, pipelined.
// Nothing is stepped, written or landed before Release, so an Abort before it changes nothing
// (commit_each too) and drops what was read ahead. Commit before Release is refused
// (FailedPrecondition, the transaction left open). Host-resident partitions read nothing ahead and
// step at Commit.
// Without commit_each every step, held or not, takes its sub-groups' state into the room in the
// order staged while it lasts (the rest through the ring), and the room keeps what a step left
// there: once the step's record is committed, each sub-group it stepped and wrote from the room
// is, in the room, the committed state. The next step that gives a sub-group the same place in
// the room (the same order of staging: a trainer's backward) does not read it again when the
// store's record of it is still the one committed then (its checksum: a load or a step since
// would have changed it); StepReport::bytes_reused counts those bytes. So a room as large as the
// NVMe-resident state turns a step's disk traffic into writes alone. Each transaction forgets
// what the room held as it starts, and only a step whose record commits (written behind, its
// tail's) fills it again: a step that fails or is aborted, with anything of it stepped in the
// room or not, leaves nothing known there. Not with commit_each (its copy buffers are there).
//
// With write_behind (below) a step stands from Commit, which returns once every partition has
// stepped and its param copy is out; the writes still in flight, then the record, finish behind
// it on the transaction's thread; the next call that needs the ring or the committed state waits
// for them first (Flush), writes again what failed, and fails while that fails, the new state
// kept in its buffers meanwhile: never dropped before it is on NVMe, but by the destructor (it
// waits for the writes; what failed goes with it: Flush first).
//
// Thread safety: one Step, transaction (Begin .. Commit or Abort, its calls from one thread at a
// time), Initialize, ReadState or Flush at a time; ReadState may be called while a step is staged
// (from the thread that stages it) and reads the committed state (with host_early, a host-resident
// partition reads stepped once it has: ReadState first waits for the early steps staged so far,
// as WaitForEarlySteps). The store, the optimizer and the host
// memory resource are borrowed and must outlive the swapper.
#ifndef STRATA_SWAP_OPTIMIZER_SWAPPER_H_
#define STRATA_SWAP_OPTIMIZER_SWAPPER_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/worker_pool.h"
#include "optim_cpu/adam.h"
#include "optim_cpu/chunk_optimizer.h"
#include "tiering/copy_engine.h"
#include "tiering/memory_resource.h"
#include "tiering/nvme_store.h"

namespace strata::swap {

// The moments of a step for one NVMe-resident partition (see OptimizerSwapperConfig::on_event).
enum class StepEvent : uint8_t {
  kReadLaunched,   // its read was handed to an I/O thread (pipeline_read, or read ahead)
  kReadStarted,    // its read begins, on whichever thread runs it
  kReadAwaited,    // the step's thread waits for its read (or, without pipeline_read, runs it)
  kReadReused,     // its committed state was found in the read-ahead room: no read
  kStepStarted,    // CpuAdam begins on it (the step's thread)
  kStepFinished,   // CpuAdam is done with it
  kWriteLaunched,  // its write was handed to an I/O thread (pipeline_write only)
  kWriteStarted,   // its write (Batch::Stage) begins, on whichever thread runs it
  kWriteAwaited,   // the step's thread waits for its write (or, without pipeline_write, runs it)
  kSinkHeld,       // a CopySink gave its copy's target (get), before the copy goes there
};

struct OptimizerSwapperConfig {
  bool pipeline_read = true;
  bool pipeline_write = true;
  uint64_t max_in_cpu_bytes = 0;  // state bytes (12 per parameter) kept in host memory
  // Buffers in the ring of NVMe-resident state, each as large as the largest partition's state:
  // 0 picks three with pipelining (read k+1, step k, write k-1) and one without; more than three
  // lets writes fall further behind before a read must wait for one (offload_optimizer's
  // buffer_count). At least three with pipelining, at least one without.
  int ring_buffers = 0;
  // OR-ed into each partition's id to make its key in the store, keeping the optimizer's state
  // apart from other users of the same store (the Runtime's partitions). 0: the ids themselves.
  tiering::PartitionId store_key_bits = 0;
  // Each NVMe-resident partition's new state replaces its old one as soon as it is written (a
  // Put of its own: the store's copy on write of that partition, synced and committed, the old
  // extents freed), and its param copy goes to the caller's param_copy then, from a copy buffer
  // of its ring slot; no staging buffer. So NVMe needs room for the state once plus one
  // partition, not the step's second copy of it (strata.optimizer_commit "partition"). The price:
  // a step cannot be dropped once a partition has landed. As with Begin's host_early, Abort and a
  // failed Commit report the partitions that had stepped (the caller keeps their step and steps
  // only the others when it steps again: the result is the unfailed step's, bit for bit), and an
  // input with check_overflow is refused by Stage (Step checks every gradient before anything).
  // Loads likewise: Load writes each NVMe-resident partition at once; AbortLoad undoes only the
  // host-resident ones (see BeginLoad).
  bool commit_each = false;
  // The state of an NVMe-resident partition larger than this is read, stepped and written in
  // sub-groups of at most this many elements (DeepSpeed's sub_group_size; the last one shorter),
  // each a blob of its own in the store, pipelined like partitions: the ring's buffers are as
  // large as the largest sub-group, not the largest partition, so host memory is bounded by the
  // config whatever a parameter's size, and with commit_each NVMe's room beyond the state is one
  // sub-group. The results are the same bits (the optimizers' bits do not depend on how a
  // partition is cut). With commit_each a step that fails part way may leave a partition with
  // some sub-groups stepped: it is not among those reported stepped, and when it is staged again
  // (at the same t; another t is refused) only its other sub-groups step, while its param copy is
  // made whole again (the stepped sub-groups' copies are remade from their state, read, not
  // written). 0: whole partitions. Host-resident state is never cut. A partition cut in more than
  // one is keyed by its id and its sub-group's index: ids below 2^40, fewer than 2^23 sub-groups.
  uint64_t sub_group_elements = 0;
  // Pinned host memory for a held step's read-ahead (above), taken at Create: at most what the
  // NVMe-resident partitions' sub-groups would take there all at once (in whole pages, with a
  // copy buffer's room each with commit_each). Without commit_each every step's state goes
  // there while it lasts, and what a step left there committed is not read again (above).
  // 0: none (a held step reads as the ring allows).
  uint64_t read_ahead_bytes = 0;
  // Commit returns once every partition has stepped and its param copy is out, the writes of the
  // new NVMe state still in flight then (and the manifest record after them) finishing behind it,
  // on the transaction's thread, while the caller goes on (the next forward). The step stands
  // from Commit: should a write or the record fail after it, the new state is not dropped: the
  // buffers it was written from (ring buffers, the read-ahead room) stay its own, and the next
  // call that needs them (Begin, Step, ReadState, Initialize, BeginLoad, Flush) first waits for
  // the writes, writes again what failed and commits, and fails, saying so, while that fails (the
  // state kept in memory meanwhile). NVMe holds the previous step's state, whole, until then. Not
  // with commit_each. Default off: a step changes nothing until it is on NVMe, as above.
  bool write_behind = false;
  // Test seam: called at each StepEvent of an NVMe-resident partition (and kStepStarted and
  // kStepFinished of a host-resident one stepping early: Begin's host_early), on the thread where
  // it happens, so a test can see how reads, steps and writes interleave. It may block to hold a
  // read or write back; a step never waits for an I/O thread without announcing it with an
  // *Awaited event first, so a hook that holds an I/O thread until the step moves on, or until
  // that event, cannot deadlock. Default: none.
  std::function<void(StepEvent, tiering::PartitionId)> on_event;
  // StepOptions::threads for the partitions stepped while a transaction is still open for
  // staging (Begin to Commit or Abort: the trainer's backward still runs), by the early worker
  // (host_early) or the NVMe worker; what steps once Commit waits for it gets the whole pool.
  // 0: the whole pool always.
  int threads_while_staging = 0;
};

// What one partition's step needs besides its state.
struct StepInput {
  tiering::PartitionId id = 0;
  const void* grad = nullptr;
  optim_cpu::DType grad_dtype = optim_cpu::DType::kF32;
  void* param_copy = nullptr;  // optional bf16, fp16 or fp32 copy of the new weights
  optim_cpu::DType copy_dtype = optim_cpu::DType::kBF16;
  // With commit_each, instead of param_copy: the copy goes where Stage's CopySink says, once the
  // partition's state has landed; `sink_target` is passed to the sink as it is.
  bool copy_to_sink = false;
  tiering::PartitionId sink_target = 0;
  // Set: `grad` is still being written by a copy queued on a device stream (a GPU's gradient on
  // its way to pinned host memory while backward goes on). Whichever thread reads `grad` waits for
  // the fence first (the worker, the early worker, or Commit), so the caller stages it without
  // waiting for the device; a fence that fails to pass fails the step as a failed read would.
  std::shared_ptr<tiering::Fence> grad_ready;
};

struct StepReport {
  bool overflow = false;       // a gradient was inf/nan; nothing changed
  double seconds = 0;          // the whole step (a transaction: Begin to the end of Commit)
  double commit_seconds = 0;   // in Commit: what the caller waited for once it asked to commit
  double read_seconds = 0;     // summed time of the reads
  double write_seconds = 0;    // summed time of the writes, commit included
  double compute_seconds = 0;  // summed optimizer time
  uint64_t bytes_read = 0, bytes_written = 0;
  // State found in the read-ahead room as the last step committed it (see above), and so not
  // read.
  uint64_t bytes_reused = 0;
  // write_behind: the step's writes went on behind it (bytes_written and write_seconds are 0
  // then: the bytes come in a later report, as behind_bytes_written).
  bool written_behind = false;
  // write_behind, in the report of a step that commits: the bytes written behind the steps before
  // it since the last such report, and how long the calls since then waited for those writes
  // (Begin, ReadState, Flush...; 0: they were done when asked for).
  uint64_t behind_bytes_written = 0;
  double behind_wait_seconds = 0;
};

class PipelinedOptimizerSwapper {
 public:
  // `partitions`: (id, elements) in step order. `optimizer`: Adam, Adagrad or Lion
  // (optim_cpu/chunk_optimizer.h; one-state optimizers keep their state in the exp_avg slot of the
  // blob, the exp_avg_sq slot unused), borrowed.
  static absl::StatusOr<std::unique_ptr<PipelinedOptimizerSwapper>> Create(
      tiering::NvmeStore* store, optim_cpu::ChunkOptimizer* optimizer,
      tiering::MemoryResource* host, const OptimizerSwapperConfig& config,
      const std::vector<std::pair<tiering::PartitionId, uint64_t>>& partitions);
  // The same over a CpuAdam (borrowed).
  static absl::StatusOr<std::unique_ptr<PipelinedOptimizerSwapper>> Create(
      tiering::NvmeStore* store, optim_cpu::CpuAdam* adam, tiering::MemoryResource* host,
      const OptimizerSwapperConfig& config,
      const std::vector<std::pair<tiering::PartitionId, uint64_t>>& partitions);
  ~PipelinedOptimizerSwapper();

  // Sets a partition's master weights; its first state starts at `initial_state` (Adagrad's
  // initial_accumulator_value; 0 for Adam's and Lion's moments), the second at zero.
  absl::Status Initialize(tiering::PartitionId id, absl::Span<const float> master,
                          float initial_state = 0.0f);
  // One optimizer step t over `inputs` (each partition once, any order); see above.
  absl::StatusOr<StepReport> Step(int64_t t, absl::Span<const StepInput> inputs,
                                  const optim_cpu::StepOptions& options = {});
  // The step in parts (above). `copy_staging_bytes`: room for the staged param copies of the
  // NVMe-resident partitions (2 bytes an element, 4 for fp32), allocated from `host` (kept for
  // the next step). FailedPrecondition while one is open.
  // `host_early`: the host-resident partitions step in place as they are staged (on a thread of
  // the transaction's), during backward, rather than at Commit. For a caller that will not abort
  // the step for its arithmetic (no clipping or loss scale to learn after backward): an input with
  // check_overflow is refused, and an Abort, or a failure, leaves those that stepped stepped (Abort
  // returns them). FailedPrecondition when the swapper has NVMe-resident partitions (whose commit
  // could fail after the host-resident ones had changed), unless it commits each one (commit_each).
  // `hold`: a held transaction (above; not with host_early).
  absl::Status Begin(uint64_t copy_staging_bytes, bool host_early = false, bool hold = false);
  // A held transaction's gradient scale (above): the worker steps from now on. FailedPrecondition
  // with no held transaction open, or after its Release; InvalidArgument for a scale that is not
  // finite and positive.
  absl::Status Release(float grad_scale);
  // Where a staged input with a null `grad` gets its gradient: `get` is called on the worker
  // thread just before the partition steps (its state's read already under way), or at Commit
  // for a host-resident one, so the gradient may still be on its way to host memory when it is
  // staged; it returns the gradient's address or why there is none. `done` (when set) is called
  // once that address is no longer read: as soon as the partition has stepped (or the step ended
  // without it), on the same thread, so a caller can let each gradient go while the rest step.
  struct GradSource {
    std::function<absl::StatusOr<const void*>(tiering::PartitionId)> get;
    std::function<void(tiering::PartitionId)> done;
    explicit operator bool() const { return static_cast<bool>(get); }
  };
  // With commit_each, where an input with copy_to_sink puts its param copy: `get(id, target)` is
  // called on the thread that wrote the partition's state, once it has landed, and returns the
  // address of as many elements of copy_dtype, or why there is none (then the copy is not
  // placed: the step stands, its state landed; the caller learns it from done's absence);
  // `done(id, target, whole)` follows once the copy is there: `whole` when every sub-group's is
  // (a partition cut in sub-groups, some of which failed to land, gets the copies of those that
  // landed, and whole false: the rest come when it is stepped again). Asked for and given back
  // once a partition, whatever its sub-groups.
  struct CopySink {
    std::function<absl::StatusOr<void*>(tiering::PartitionId, tiering::PartitionId)> get;
    std::function<void(tiering::PartitionId, tiering::PartitionId, bool whole)> done;
    explicit operator bool() const { return static_cast<bool>(get); }
  };
  // Stages `inputs` for step t: all of them validated first (as Step's, and against the
  // partitions staged already), none staged when one is refused (InvalidArgument; the
  // transaction stays open). An input with a null `grad` needs `source`; one with copy_to_sink
  // needs `sink` and commit_each, and NVMe-resident state.
  absl::Status Stage(int64_t t, absl::Span<const StepInput> inputs,
                     const optim_cpu::StepOptions& options = {}, GradSource source = {},
                     CopySink sink = {});
  absl::StatusOr<StepReport> Commit();
  // The first phase of a commit in two (the ranks of a job, each with its own step, commit only
  // if every one can): closes the step to further staging, waits for its staged work as Commit
  // does, and returns the first failure Commit would report before it writes anything to stand
  // (a read, step or write of NVMe state that failed, a host-resident partition's early step, a
  // gradient that did not land or that its source could not give: those it gives are held until
  // the step ends), the step left open either way: the caller then Aborts it, as it would after
  // any failure, or Commits it, which can then fail only at its record (and finds an overflow in
  // host-resident gradients as ever). A held step before its Release is refused
  // (FailedPrecondition), as Commit refuses it.
  absl::Status Prepare();
  // Drops the step; returns the partitions that had stepped: host-resident ones in place
  // (host_early), NVMe-resident ones whose new state had landed whole (commit_each; one with only
  // some sub-groups landed is not among them, and a failed Commit's message names it); or, with
  // no step open, those of such a step whose Commit failed (once).
  std::vector<tiering::PartitionId> Abort();
  // With a host_early step open: waits until every host-resident partition staged so far has
  // stepped (or the stepping stopped at a failure), so that their state and param copies can be
  // read. Returns at once otherwise.
  void WaitForEarlySteps();
  bool staging() const { return txn_ != nullptr; }
  // write_behind: waits until the last step's writes behind it are committed (writing again,
  // then, what failed); its error, and the state kept in memory, while that fails. OK at once
  // when none are pending.
  absl::Status Flush() { return Settle(); }
  bool writing_behind() const { return behind_ != nullptr; }
  // Replaces the state of any of the partitions, all or none (loading a checkpoint): BeginLoad,
  // then Load each partition's master weights and moments (an NVMe-resident one is written to
  // fresh extents at once, through the ring; a host-resident one is kept aside in memory from
  // `host`), then CommitLoad (one manifest record, then the host-resident ones copied in) or
  // AbortLoad; nothing changes before CommitLoad, and a failed CommitLoad changes nothing. With
  // commit_each a Load writes an NVMe-resident partition's state in place of the old at once (no
  // second copy of the state on NVMe): a load that fails part way leaves those partitions loaded.
  // FailedPrecondition while a step is staged (and Step or Begin while a load is).
  absl::Status BeginLoad();
  absl::Status Load(tiering::PartitionId id, absl::Span<const float> master,
                    absl::Span<const float> exp_avg, absl::Span<const float> exp_avg_sq);
  absl::Status CommitLoad();
  void AbortLoad();
  // Copies a partition's committed state out (tests, checkpoints). A partition whose last step
  // failed part way (PartlyStepped: its sub-groups at different steps) is refused unless
  // `mixed_steps`: then each sub-group's is given as it is (its master weights are the weights
  // its parameter has: the trainer's copy of them written again, never a checkpoint).
  absl::Status ReadState(tiering::PartitionId id, absl::Span<float> master,
                         absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq,
                         bool mixed_steps = false);
  // Bytes of NVMe-resident state ReadState has read so far (any thread).
  uint64_t read_state_bytes() const { return read_state_bytes_.load(std::memory_order_relaxed); }

  bool on_nvme(tiering::PartitionId id) const;
  // The partitions some of whose sub-groups have stepped and the others not (commit_each: a step
  // that failed inside them), until a step at that t steps the rest; sorted.
  std::vector<tiering::PartitionId> PartlyStepped() const;
  // A partition's elements (NotFound: not one of the swapper's).
  absl::StatusOr<uint64_t> elements(tiering::PartitionId id) const;
  size_t buffer_count() const { return buffers_.size(); }
  // Bytes of host memory held for staging param copies (see above).
  uint64_t copy_staging_bytes() const { return copy_staging_bytes_; }
  // Bytes of pinned host memory held for the read-ahead room (read_ahead_bytes, capped).
  uint64_t read_ahead_bytes() const { return read_ahead_bytes_; }

 private:
  struct Part {
    uint64_t elements = 0;
    float* host_state = nullptr;  // host-resident: [master | m | v]; else null
    // NVMe-resident: cut in `groups` sub-groups of `group` elements (the last one shorter).
    uint64_t group = 0;
    uint32_t groups = 1;
    // Sub-group j's first element and length.
    uint64_t GroupOffset(uint32_t j) const { return j * group; }
    uint64_t GroupSize(uint32_t j) const { return std::min(group, elements - j * group); }
  };
  // commit_each: a partition some of whose sub-groups have stepped to step t, the others not (a
  // step that failed part way), until a step at t lands the others.
  struct Partial {
    int64_t t = 0;
    std::vector<bool> landed;
  };
  struct Txn;  // an open transaction (optimizer_swapper.cc)
  // Commit's and Prepare's start (`what`: which): closes the open step to staging and waits for
  // its work (with write_behind, for the worker's loop; else for the worker itself).
  absl::Status CloseAndWait(const char* what);
  // The host-resident items' gradients not yet taken (landed, or asked of their source), each
  // checked for an overflow where asked, into `x` (Prepare's, or Commit's); `context` starts a
  // failure.
  absl::Status TakeHostGrads(Txn* x, const std::string& context);
  struct Loading {  // an open load
    std::unique_ptr<tiering::NvmeStore::Batch> batch;
    // Host-resident partitions' new state, copied in at CommitLoad.
    std::vector<std::pair<const Part*, float*>> host;
    std::vector<tiering::PartitionId> loaded;  // NVMe-resident ones, staged in `batch`
  };
  PipelinedOptimizerSwapper() = default;
  absl::StatusOr<const Part*> Find(tiering::PartitionId id) const;
  // Each input as Step and Stage check it (`seen`: partitions staged already, added to); the
  // inputs' partitions in order.
  absl::StatusOr<std::vector<const Part*>> ValidateInputs(
      int64_t t, absl::Span<const StepInput> inputs, const optim_cpu::StepOptions& options,
      bool have_source, absl::flat_hash_set<tiering::PartitionId>* seen) const;
  // The worker of a transaction: steps its NVMe-resident partitions as they are staged.
  void RunStaged(Txn* x);
  // RunStaged's parts, on its thread, over its own state (`run`: optimizer_swapper.cc); item k is
  // the k-th NVMe-resident item staged. None is called with x->mu held: those that need it take it.
  struct StagedRun;
  using IoResult = std::pair<absl::Status, double>;  // a read's or write's status and seconds
  // Item k (at most one past those seen): whether it is there, waiting for it to be staged when
  // `wait` (under x->mu); false when it is not there (or will not come).
  static bool HasItem(StagedRun& run, size_t k, bool wait);
  // Whether item k's read was started (or found its state in the room).
  static bool ReadStarted(const StagedRun& run, size_t k);
  // Whether `buf` lies in the read-ahead room.
  bool InRoom(const float* buf) const;
  // Whether item k, placed at `offset` in the room, finds its committed state there.
  bool CommittedThere(const StagedRun& run, uint64_t offset, size_t k) const;
  // Gives item k its place in the read-ahead room when it fits there; false: not in the room.
  bool TakeAhead(StagedRun& run, size_t k);
  // Starts item k's read into the buffer it was given (or finds its state there already).
  void StartRead(StagedRun& run, size_t k);
  // Gives item k a buffer (the room's, else the ring's) and starts its read; false when it stops.
  bool ReadItem(StagedRun& run, size_t k, bool ahead_only = false);
  // A held step: reads ahead what is staged after k until Release; the scale, or none (aborted).
  std::optional<float> AwaitRelease(StagedRun& run, size_t k);
  // Waits for item k's read and counts its bytes; false (x->failure) when it failed.
  bool AwaitRead(StagedRun& run, size_t k);
  // Steps item k in its buffer, its param copy to its copy buffer or staging; false when the step
  // stops (x->failure or x->overflow).
  bool StepItem(StagedRun& run, size_t k);
  // Points `c` at item k's gradient (landed, or from the source, held for the partition's next
  // sub-groups); false when it did not come (x->failure) or is not finite (x->overflow).
  bool GradientFor(StagedRun& run, size_t k, optim_cpu::AdamChunk* c);
  // Starts the write of item k's new state after the writes before it, then its param copy out.
  void StartWrite(StagedRun& run, size_t k);
  // Waits for item k's write (without pipeline_write: runs it).
  const IoResult& AwaitWrite(StagedRun& run, size_t k);
  // Lets the gradient held from the source go (GradSource::done).
  static void LetGoOfGradient(StagedRun& run);
  // After the loop: waits for every read and write in flight and records what each write came to
  // (landed, unwritten behind the step, or the step's failure).
  void AwaitInFlight(StagedRun& run, bool behind);
  // Gives back the sink targets asked for and not given back, with what landed of them.
  static void GiveBackSinkTargets(const StagedRun& run);
  // write_behind: waits for Commit's word on the tail; commits the batch when told to and every
  // write landed.
  void CommitTail(Txn* x);
  // The other worker, with host_early: steps the host-resident partitions in place as staged.
  void RunEarly(Txn* x);
  // "k of its n sub-groups stepped to step t", of a partition stepped in part.
  static std::string PartlyStepped(const Partial& p);
  // Sub-group j of partition id's key in the store (j 0: the partition's, cut or not).
  tiering::PartitionId StoreKey(tiering::PartitionId id, uint32_t j = 0) const {
    return id | config_.store_key_bits | (tiering::PartitionId{j} << kGroupShift);
  }
  static constexpr int kGroupShift = 40;
  // After the worker is joined: the sub-groups that landed (commit_each) are recorded in
  // partial_, and the partitions now whole at their step added to the transaction's `landed`.
  void SettleLanded(Txn* x);
  void Emit(StepEvent event, tiering::PartitionId id) const;
  // Flush (above): the caller's calls that need the ring, or the committed state, start with it.
  absl::Status Settle();
  // Makes the param-copy staging buffer at least `bytes` long.
  absl::Status ReserveCopyStaging(uint64_t bytes);
  // Once x's record is committed: the state it wrote from the read-ahead room is what the room
  // holds (room_copies_).
  void KeepRoomCopies(const Txn& x);

  tiering::NvmeStore* store_ = nullptr;
  optim_cpu::ChunkOptimizer* optimizer_ = nullptr;
  std::unique_ptr<optim_cpu::ChunkOptimizer> owned_optimizer_;  // the CpuAdam overload's adapter
  tiering::MemoryResource* host_ = nullptr;
  OptimizerSwapperConfig config_;
  absl::flat_hash_map<tiering::PartitionId, Part> parts_;
  uint64_t buffer_bytes_ = 0;
  std::vector<float*> buffers_;
  // commit_each: one per ring buffer, as large as the largest partition's fp32 copy.
  std::vector<std::byte*> copy_buffers_;
  uint64_t copy_buffer_bytes_ = 0;
  std::byte* read_ahead_ = nullptr;
  uint64_t read_ahead_bytes_ = 0;
  // What the read-ahead room holds as committed: by offset in the room, the sub-group's store key,
  // its bytes and the checksum of the bytes written from there. Set once a step's record is
  // committed (by Commit's caller, or by the transaction's worker for a step written behind),
  // taken and emptied by the next transaction's worker as it starts (Begin joined the one
  // before it by then).
  struct RoomCopy {
    tiering::PartitionId key = 0;
    uint64_t bytes = 0, checksum = 0;
  };
  absl::flat_hash_map<uint64_t, RoomCopy> room_copies_;
  std::byte* copy_staging_ = nullptr;
  uint64_t copy_staging_bytes_ = 0;
  std::atomic<uint64_t> read_state_bytes_{0};  // ReadState's NVMe reads
  // The NVMe reads and writes of a step (RunStaged), with NVMe-resident state.
  std::unique_ptr<WorkerPool> readers_, writer_;
  std::unique_ptr<Txn> txn_;
  // write_behind: the last committed step while its writes are behind it (its worker running, or
  // joined with writes to do again), and what they came to once settled (for the next report).
  std::unique_ptr<Txn> behind_;
  uint64_t behind_bytes_written_ = 0;
  double behind_wait_s_ = 0;
  // The partitions a host_early or commit_each step had stepped when its Commit failed, for the
  // next Abort.
  std::vector<tiering::PartitionId> failed_early_;
  absl::flat_hash_map<tiering::PartitionId, Partial> partial_;
  std::unique_ptr<Loading> loading_;
};

}  // namespace strata::swap

#endif  // STRATA_SWAP_OPTIMIZER_SWAPPER_H_
