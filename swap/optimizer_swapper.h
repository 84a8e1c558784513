// swap/optimizer_swapper.h: the optimizer step over state that lives on NVMe, as a pipeline
// (DeepSpeed's PipelinedOptimizerSwapper is the anchor).
//
// Each partition's optimizer state — fp32 master weights, exp_avg and exp_avg_sq — is one blob
// [master | exp_avg | exp_avg_sq] (one read and one write per partition, as large as they come).
// Partitions are placed in order: while their state fits in max_in_cpu_bytes it stays in pinned
// host memory and never touches the disk; the rest lives in the NVMe store.
//
// Step(t) runs CpuAdam over the partitions it is given (each at most once, any order). Every input
// is validated first (a known partition, listed once, and everything CpuAdam would refuse: a null
// gradient, a copy dtype it cannot write, t < 1), so a bad input returns InvalidArgument before
// anything is read, stepped or written. For the NVMe-resident ones, with pipeline_read the state
// of k+1 is read while k steps, and with pipeline_write the state of k-1 is written while k steps,
// through a ring of three pinned buffers (one without pipelining); the gradients come from the
// caller's host memory. The new state is staged in fresh extents and committed in one manifest
// record at the end of the step, and only then are the host-resident partitions stepped (their
// inputs being valid, that cannot fail). So a step that fails (a read, a write, the commit)
// changes no optimizer state: NVMe holds the previous step's state, whole; the host-resident
// state and the gradients are untouched; retrying the step gives, bit for bit, the result of a
// step that never failed. What it does not cover: the `param_copy` outputs of NVMe-resident
// partitions stepped before the failure already hold the new step's weights (they are written as
// each partition steps, to keep no second copy of them); the retry rewrites them with the same
// bits. The price of the promise is NVMe space for a second copy of the stepped state during the
// step.
//
// Thread safety: one Step (or Initialize/ReadState) at a time. The store, the optimizer and the
// host memory resource are borrowed and must outlive the swapper.
#ifndef STRATA_SWAP_OPTIMIZER_SWAPPER_H_
#define STRATA_SWAP_OPTIMIZER_SWAPPER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "optim_cpu/adam.h"
#include "tiering/memory_resource.h"
#include "tiering/nvme_store.h"

namespace strata::swap {

struct OptimizerSwapperConfig {
  bool pipeline_read = true;
  bool pipeline_write = true;
  uint64_t max_in_cpu_bytes = 0;  // state bytes (12 per parameter) kept in host memory
};

// What one partition's step needs besides its state.
struct StepInput {
  tiering::PartitionId id = 0;
  const void* grad = nullptr;
  optim_cpu::DType grad_dtype = optim_cpu::DType::kF32;
  void* param_copy = nullptr;  // optional bf16/fp16 copy of the new weights
  optim_cpu::DType copy_dtype = optim_cpu::DType::kBF16;
};

struct StepReport {
  bool overflow = false;       // a gradient was inf/nan; nothing changed
  double seconds = 0;          // the whole step
  double read_seconds = 0;     // summed time of the reads
  double write_seconds = 0;    // summed time of the writes, commit included
  double compute_seconds = 0;  // summed optimizer time
  uint64_t bytes_read = 0, bytes_written = 0;
};

class PipelinedOptimizerSwapper {
 public:
  // `partitions`: (id, elements) in step order.
  static absl::StatusOr<std::unique_ptr<PipelinedOptimizerSwapper>> Create(
      tiering::NvmeStore* store, optim_cpu::CpuAdam* adam, tiering::MemoryResource* host,
      const OptimizerSwapperConfig& config,
      const std::vector<std::pair<tiering::PartitionId, uint64_t>>& partitions);
  ~PipelinedOptimizerSwapper();

  // Sets a partition's master weights; its moments start at zero.
  absl::Status Initialize(tiering::PartitionId id, absl::Span<const float> master);
  // One optimizer step t over `inputs` (each partition once, any order); see above.
  absl::StatusOr<StepReport> Step(int64_t t, absl::Span<const StepInput> inputs,
                                  const optim_cpu::StepOptions& options = {});
  // Copies a partition's state out (tests, checkpoints).
  absl::Status ReadState(tiering::PartitionId id, absl::Span<float> master,
                         absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq);

  bool on_nvme(tiering::PartitionId id) const;
  size_t buffer_count() const { return buffers_.size(); }

 private:
  struct Part {
    uint64_t elements = 0;
    float* host_state = nullptr;  // host-resident: [master | m | v]; else null
  };
  PipelinedOptimizerSwapper() = default;
  absl::StatusOr<const Part*> Find(tiering::PartitionId id) const;

  tiering::NvmeStore* store_ = nullptr;
  optim_cpu::CpuAdam* adam_ = nullptr;
  tiering::MemoryResource* host_ = nullptr;
  OptimizerSwapperConfig config_;
  absl::flat_hash_map<tiering::PartitionId, Part> parts_;
  uint64_t buffer_bytes_ = 0;
  std::vector<float*> buffers_;
};

}  // namespace strata::swap

#endif  // STRATA_SWAP_OPTIMIZER_SWAPPER_H_
