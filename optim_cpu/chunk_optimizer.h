// optim_cpu/chunk_optimizer.h: one interface over the CPU optimizers, for callers that step
// partitions of state without caring which optimizer it is (the NVMe swapper, the Runtime).
//
// Every optimizer takes an AdamChunk: Adam its two moments (exp_avg, exp_avg_sq); Adagrad its sum
// and Lion its exp_avg in exp_avg, exp_avg_sq unused (ignored, may be null). The updates are the
// optimizers' own (adam.h, adagrad.h, lion.h); so are the validation (Validate: what Step would
// refuse, touching nothing) and the overflow scan.
//
// Thread safety: as the optimizer wrapped: one thread at a time; Validate (const, reading only its
// arguments and the configuration) may run beside the others.
#ifndef STRATA_OPTIM_CPU_CHUNK_OPTIMIZER_H_
#define STRATA_OPTIM_CPU_CHUNK_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "optim_cpu/adagrad.h"
#include "optim_cpu/adam.h"
#include "optim_cpu/common.h"
#include "optim_cpu/lion.h"

namespace strata::optim_cpu {

enum class OptimizerKind { kAdam, kAdagrad, kLion };
absl::string_view OptimizerKindName(OptimizerKind kind);

// Which optimizer, and its hyper-parameters (only `kind`'s are read).
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdam;
  AdamConfig adam;
  AdagradConfig adagrad;
  LionConfig lion;
};

class ChunkOptimizer {
 public:
  virtual ~ChunkOptimizer() = default;
  virtual absl::Status Validate(int64_t t, const AdamChunk& chunk,
                                const StepOptions& options) const = 0;
  virtual absl::StatusOr<StepResult> Step(int64_t t, const AdamChunk& chunk,
                                          const StepOptions& options) = 0;
  virtual bool HasNonFinite(const void* grad, DType dtype, size_t n) = 0;
  virtual OptimizerKind kind() const = 0;
  virtual Isa isa() const = 0;
};

// Makes the optimizer `config` names (its Create's validation, InvalidArgument naming the key).
absl::StatusOr<std::unique_ptr<ChunkOptimizer>> MakeChunkOptimizer(const OptimizerConfig& config);

// Adapts a CpuAdam the caller owns (it must outlive the adapter).
std::unique_ptr<ChunkOptimizer> BorrowAdam(CpuAdam* adam);

}  // namespace strata::optim_cpu

#endif  // STRATA_OPTIM_CPU_CHUNK_OPTIMIZER_H_
