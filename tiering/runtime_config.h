// tiering/runtime_config.h: the Runtime's configuration, read from a DeepSpeed-style JSON config.
//
// Read from DeepSpeed's own blocks, with DeepSpeed's names and defaults:
//   "aio": {...}                                  (aio/config.h)
//   "zero_optimization": {
//     "stage": 0..3,
//     "offload_param":     {"device": "none"|"cpu"|"nvme", "nvme_path", "pin_memory",
//                           "buffer_count" (5), "buffer_size" (1e8: 4 KiB..256 MiB, used rounded up
//                           to whole 4 KiB pages), "max_in_cpu" (1e9)},
//     "offload_optimizer": {"device", "nvme_path", "pin_memory", "buffer_count" (4),
//                           "pipeline_read", "pipeline_write", "fast_init", "ratio"},
//     "stage3_prefetch_bucket_size" (5e7), "stage3_max_live_parameters" (1e9),
//     "stage3_max_reuse_distance" (1e9), "stage3_param_persistence_threshold" (1e5)
//         (each also under DeepSpeed's other spelling, without "stage3_"; one or the other, not
//          both; their meanings in sched/runtime.h),
//     "sub_group_size" (1e9: the optimizer state on NVMe is stepped in pieces of at most that
//         many elements, swap/optimizer_swapper.h's sub_group_elements)}
// and strata's own, in "strata": {"aio": {...}, "device": "cuda"|"emulated",
//   "device_budget_bytes", "host_budget_bytes", "nvme_capacity_bytes", "nvme_keep_files",
//   "nvme_path", "copy_bandwidth_bytes_per_s", "eviction_policy": "lru"|"trace"}.
// Values follow base/config_reader.h's rule (integers exact; DeepSpeed's 1e8 accepted; "auto"
// explained; JSON errors with line and column). Unknown keys are reported, never silently
// ignored: DeepSpeed's other top-level keys and zero_optimization keys are warnings ("left to the
// trainer"); a key that is neither DeepSpeed's nor strata's is an error naming the closest known
// key, at the top level and in every block strata reads (each offload block takes only the keys
// DeepSpeed gives it). Keys strata checks but does not act on yet (pin_memory, fast_init, ratio,
// the zero stage; listed in one place in runtime_config.cc) warn "accepted but not yet used".
// offload_param.max_in_cpu: with parameters on NVMe, up to that many parameter elements (the
// first registered) go to the device through the host tier and keep a clean host copy there,
// room in host_budget_bytes permitting, as DeepSpeed keeps them in CPU memory; 0: none.
// strata keeps one NVMe store per process, at SwapPath(): strata.nvme_path when given, else
// offload_param's nvme_path when its device is "nvme", else offload_optimizer's; every other
// nvme_path given (a second path, or a block not on NVMe) is kept here and named in a warning.
// The NVMe store's swap files grow on demand up to strata.nvme_capacity_bytes (a cap, not a
// reservation), and are removed when the Runtime ends unless strata.nvme_keep_files is true (for a
// restarted process that adopts what the last one left). Only kept files are synced as each write
// commits (tiering::NvmeStoreOptions::durable): a machine that loses power finds them whole.
// strata.eviction_policy "trace" (the default): the scheduler plans prefetches and evictions from
// the recorded trace (sched/scheduler.h); "lru": on demand, least recently used evicted first.
//
// Thread safety: plain values and pure functions.
#ifndef STRATA_TIERING_RUNTIME_CONFIG_H_
#define STRATA_TIERING_RUNTIME_CONFIG_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "aio/config.h"
#include "nlohmann/json_fwd.hpp"

namespace strata::tiering {

enum class OffloadDevice { kNone, kCpu, kNvme };

// offload_param.buffer_size: the size of each of the Runtime's staging buffers (buffer_count of
// them, in pairs, at least one pair).
inline constexpr int64_t kMinBufferSize = 4096;
inline constexpr int64_t kMaxBufferSize = int64_t{256} << 20;

// One offload block; a key the block does not have in DeepSpeed (offload_optimizer has no
// buffer_size or max_in_cpu; offload_param no pipeline_*, fast_init or ratio) keeps its default.
struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  double ratio = 1.0;
};

struct RuntimeConfig {
  aio::AioConfig aio;
  int zero_stage = 0;
  OffloadConfig offload_param;
  OffloadConfig offload_optimizer;  // buffer_count defaults to 4
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  int64_t stage3_param_persistence_threshold = 100000;
  // zero_optimization.sub_group_size: a parameter's optimizer state on NVMe is read, stepped and
  // written in sub-groups of at most this many elements (DeepSpeed's; its default, 1e9), so the
  // optimizer's buffers hold a sub-group, not the largest parameter. Smaller parameters are not
  // merged: each is stepped as one. A ceiling: where the ring's buffers for sub-groups of this size
  // would take more than a quarter of the host room left to the optimizer, smaller ones are taken
  // (SubGroupFor; the bits are the same whatever the size).
  int64_t sub_group_size = 1000000000;
  // The elements of the optimizer's sub-groups on NVMe for a largest partition of `largest`
  // elements, `ring` buffers (12 bytes an element of state, 16 with optimizer_commit
  // "partition"'s copy buffers) and `room` bytes of host memory left to the optimizer:
  // sub_group_size (at most `largest`), or the most that keeps the ring within a quarter of `room`
  // where that is less, in multiples of 1024 elements (whole pages), at least 1024.
  uint64_t SubGroupFor(uint64_t largest, int ring, bool commit_each, uint64_t room) const {
    uint64_t g =
        sub_group_size > 0 ? std::min(largest, static_cast<uint64_t>(sub_group_size)) : largest;
    const uint64_t per_element = static_cast<uint64_t>(ring) * (commit_each ? 16 : 12);
    const uint64_t fit = room / 4 / std::max<uint64_t>(per_element, 1) / 1024 * 1024;
    if (g > fit) g = std::max<uint64_t>(fit, 1024);
    return std::min(g, largest);
  }
  // strata's own
  bool emulated_device = true;  // "device": "emulated" (no GPU) or "cuda"
  // "device_index": the GPU of a "cuda" device tier, among those the process sees; -1
  // ("local_rank", the default): LOCAL_RANK's, as launchers give each rank of a node its own.
  int device_index = -1;
  uint64_t device_budget_bytes = 1ull << 30;
  uint64_t host_budget_bytes = 4ull << 30;
  uint64_t nvme_capacity_bytes = 16ull << 30;  // the most the swap files may grow to
  bool nvme_keep_files = false;  // false: the store's files are removed when the Runtime ends
  std::string nvme_path;         // default: offload_param's nvme_path, else offload_optimizer's
  uint64_t copy_bandwidth_bytes_per_s = 0;  // emulated device: model PCIe (0: no cap)
  std::string eviction_policy = "trace";    // "lru": on demand, least recently used first
  // glibc's M_MMAP_THRESHOLD, fixed by the Runtime for the whole process when not 0. 0 (the
  // default, as torch and DeepSpeed leave it): glibc's own, which rises after a large block is
  // freed, after which freed megabyte tensors stay resident in its heap, and the process can hold
  // more than its tiers' budgets. A fixed threshold gives them back as they are freed, and each
  // such block is mapped and faulted in anew: measured on the CPU, a model's element-wise ops ran
  // 2-4x slower and a training step 1.3-1.5x (docs/performance.md, vs DeepSpeed). glibc takes at
  // most 32 MiB.
  uint64_t malloc_mmap_threshold_bytes = 0;
  // Across ranks (comm/): how long a rendezvous or a collective may wait for the other ranks
  // before it fails naming what it waited for (torch.distributed's default: 30 minutes).
  uint64_t comm_timeout_s = 1800;
  // Across ranks: what the collectives travel by (comm/job.h): "auto" (shared memory when every
  // rank is on this host, else Gloo over TCP), "shm" or "tcp". Read by the Python front, which
  // joins the job before a Runtime is made; checked here with the rest of the config.
  std::string comm_transport = "auto";
  // The CPU optimizer's threads (0: one per core, each bound to its core: OptimizerThreads();
  // while backward still runs, with optimizer_during_backward on, only the first all but two of
  // them step: OptimizerThreadsWhileStaging()). On a GPU the trainer's thread queues the kernels
  // and the Runtime's workers queue the copies: an optimizer on every core competes with both
  // while it steps during backward; the step after backward, which the trainer waits for, gets
  // every core. Set, the pool is that many threads and all of them step, always.
  int64_t optimizer_threads = 0;
  // The CUDA copy engine's streams: 1 (both directions on one, in submission order) or 2 (one per
  // direction: a gradient going to the host need not wait behind a weight coming to the device).
  // The host-emulated engine has one worker whatever this says.
  int64_t copy_streams = 1;
  // The optimizer state in host memory (offload_optimizer "cpu") steps during backward, each
  // partition in place as backward makes its gradient final, rather than after backward, when
  // nothing learnt after backward can change the step (no gradient clipping, no fp16 loss scale,
  // one process). The trainer's front decides; this says whether it may. Unset ("auto", the
  // default): where the trainer computes on a GPU (strata.device "cuda"), not where it computes
  // on the host's cores (the emulated device), whose threads the optimizer's would take while
  // backward runs. Measured in docs/performance.md. Below ZeRO stage 2 (zero_stage) nothing steps
  // or is staged during backward, and "auto" is off.
  std::optional<bool> optimizer_during_backward;

  // How a step's new optimizer state on NVMe replaces the old ("optimizer_commit"): "step" writes
  // all of it to fresh extents and commits it in one record after backward, so a
  // step can be dropped (clipping, an overflow, a second backward) or fail with nothing changed,
  // at the price of NVMe room for a second copy of the whole state; "partition" (true here)
  // commits each partition as soon as it is written, so NVMe holds the state once plus one
  // partition, and a step, once begun, is not dropped: it is taken during backward only where
  // host-resident state would step then (OptimizerDuringBackward() and its conditions), else
  // after backward, and one that fails part way keeps what had stepped and steps the rest when
  // it is taken again. "auto" (optimizer_commit_auto; unset, the default): CommitEach picks one
  // once the optimizer's partitions are known (Runtime::CreateOptimizer, the planner).
  bool optimizer_commit_each = false;
  bool optimizer_commit_auto = true;
  // "auto"'s answer for an optimizer whose NVMe-resident state is `nvme_state_bytes`: "partition"
  // where that state is larger than host_budget_bytes (the state beyond the host's room, where a
  // step after backward cannot keep its new weights in host memory until one record commits them
  // all: "step" would read the state of parameters homed on NVMe a second time to give them their
  // new weights), unless optimizer_write_behind is true (a "step" option); "step" elsewhere. A
  // given optimizer_commit is that (optimizer_commit_each set true is "partition" whatever
  // optimizer_commit_auto says).
  bool CommitEach(uint64_t nvme_state_bytes) const {
    if (!optimizer_commit_auto || optimizer_commit_each) return optimizer_commit_each;
    return offload_optimizer.device == OffloadDevice::kNvme &&
           !optimizer_write_behind.value_or(false) && nvme_state_bytes > host_budget_bytes;
  }
  // Pinned host memory for reading the NVMe optimizer state ahead while backward runs, when the
  // step waits for what is learnt after backward (gradient clipping's global norm): the trainer
  // stages each partition as its gradient is final, its state is read into this room, and the
  // step after backward steps it from there (swap/optimizer_swapper.h's held step).
  // "optimizer_read_ahead_bytes": bytes (0: none), or "auto" (unset here, the default): an eighth
  // of host_budget_bytes, at most the NVMe state itself, none where it would hold no sub-group
  // (the Python front sets 0 where it never holds a step). Set aside in the host tier with the
  // optimizer's other buffers; "auto" gives way by halves, down to none, said in a warning,
  // where they do not fit beside it.
  std::optional<uint64_t> optimizer_read_ahead_bytes;
  // Whether a step's NVMe optimizer state is written behind it ("optimizer_write_behind"): the
  // step returns once every partition has stepped and its new weights are out, the state's
  // writes and their record finishing while the trainer goes on (the next forward); the next step
  // (or a read of the state: a checkpoint) waits for them first. A write that fails behind a step
  // keeps that state in host memory, is written again by the next call that needs it, and fails
  // that call, saying so, until the disk takes it (swap/optimizer_swapper.h's write_behind).
  // true, false, or "auto" (unset here, the default): with optimizer_commit "step" (it is not
  // taken with "partition", which lands each partition as it is written).
  std::optional<bool> optimizer_write_behind;
  bool OptimizerWriteBehind() const {
    return !optimizer_commit_each && optimizer_write_behind.value_or(true);
  }

  // Whether host-resident optimizer state may step during backward: the setting, or "auto"'s
  // answer for this device and stage.
  bool OptimizerDuringBackward() const {
    return optimizer_during_backward.value_or(!emulated_device && zero_stage >= 2);
  }
  // The CPU optimizer's pool for a machine of `cores` cores: optimizer_threads, or when that is
  // 0, one thread per core.
  int OptimizerThreads(int cores) const;
  // How many of the pool's threads step while backward still runs (swap/optimizer_swapper.h's
  // threads_while_staging; 0: all): all but two cores (left to the trainer's and the copies'
  // threads, at least one) where OptimizerDuringBackward() says the optimizer may step then and
  // optimizer_threads is 0; else 0.
  int OptimizerThreadsWhileStaging(int cores) const;

  RuntimeConfig() { offload_optimizer.buffer_count = 4; }
  // Where NVMe swap lives ("" when nothing is offloaded to NVMe).
  std::string SwapPath() const;

  // The staging buffers an NVMe store reads and writes through: pairs of buffers (buffer_count /
  // 2, at least one) of offload_param.buffer_size bytes (at least kMinBufferSize) in whole pages.
  int StagingPairs() const;
  uint64_t StagingBufferBytes() const;
  // The smallest host_budget_bytes a run can take, in its parts: the staging buffers (where there
  // is an NVMe store), the optimizer's host room at its smallest (offload_optimizer "cpu": its
  // state, 12 bytes an element; "nvme": its ring at the sub-groups SubGroupFor gives for that
  // room (at least 1024 elements), with
  // optimizer_commit "partition"'s copy buffers where that is taken, and `staged_copy_bytes`
  // under "step", no read-ahead room), and `largest_partition_bytes`, the largest partition the
  // host tier must hold beside them (a gradient on its way to the optimizer), with under
  // "partition" `largest_param_bytes` beside it (the parameter partition its new weights are
  // written into as its state lands). The optimizer steps `optimizer_elements` elements, `widest`
  // in its largest partition. Below it something is refused (the room set aside, or a
  // partition's move), or the step reads more than the state once (a parameter partition with no
  // room to take its new weights has them read back from its state).
  struct HostMinimum {
    uint64_t staging = 0, optimizer = 0, partition = 0;
    uint64_t total() const { return staging + optimizer + partition; }
  };
  HostMinimum MinimumHost(uint64_t optimizer_elements, uint64_t widest,
                          uint64_t largest_partition_bytes, uint64_t staged_copy_bytes,
                          uint64_t largest_param_bytes = 0) const;
  // OK, or InvalidArgument naming the keys where there is an NVMe store (SwapPath() not empty)
  // and its staging buffers do not fit in host_budget_bytes, which holds them.
  absl::Status CheckStagingFits() const;
};

absl::StatusOr<RuntimeConfig> RuntimeConfigFromJson(const nlohmann::json& root,
                                                    std::vector<std::string>* warnings = nullptr);
absl::StatusOr<RuntimeConfig> RuntimeConfigFromJsonText(
    absl::string_view text, std::vector<std::string>* warnings = nullptr);

}  // namespace strata::tiering

#endif  // STRATA_TIERING_RUNTIME_CONFIG_H_
