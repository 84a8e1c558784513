// What every CPU optimizer front-end (CpuAdam, CpuAdagrad, CpuLion) shares: choosing the kernel
// ISA, the thread pool, the overflow scan, checking a chunk's spans, and running a kernel over a
// chunk in contiguous per-thread ranges.
#ifndef STRATA_OPTIM_CPU_INTERNAL_CORE_H_
#define STRATA_OPTIM_CPU_INTERNAL_CORE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "optim_cpu/common.h"
#include "optim_cpu/internal/kernels.h"
#include "optim_cpu/thread_pool.h"

namespace strata::optim_cpu::internal {

class Core {
 public:
  // `who` names the optimizer in messages ("adam config"). `isa` empty: $STRATA_CPU_ADAM_ISA, else
  // the best the CPU has.
  static absl::StatusOr<std::unique_ptr<Core>> Create(absl::string_view who, std::string isa,
                                                      int threads, bool bind);
  Isa isa() const { return isa_; }
  ThreadPool& pool() { return *pool_; }
  bool HasNonFinite(const void* grad, DType dtype, size_t n);
  // `threads`: StepOptions::threads (0: the whole pool).
  void Run(const UpdateArgs& args, size_t n, int threads = 0);

 private:
  Isa isa_ = Isa::kScalar;
  Kernels kernels_{};
  std::unique_ptr<ThreadPool> pool_;
};

// Checks the step number, the spans and the dtypes of one chunk; messages start with `who`.
// state2 is checked only when need_state2.
absl::Status CheckChunk(absl::string_view who, int64_t t, const float* param, const void* grad,
                        const void* state1, const void* state2, bool need_state2, DType state_dtype,
                        const void* param_copy, DType copy_dtype, size_t size,
                        const StepOptions& options);

// Sets args' betas (and one minus each) for one step: the step's (StepOptions::beta1/beta2, a
// param group's) where given, else the config's (`beta1`, `beta2`).
void SetBetas(const StepOptions& options, float beta1, float beta2, UpdateArgs* args);

// Finite and within [lo, hi] (hi_open: [lo, hi)); the message names `key` and the range.
absl::Status CheckHyper(absl::string_view who, absl::string_view key, float value, float lo,
                        float hi, bool hi_open);

}  // namespace strata::optim_cpu::internal

#endif  // STRATA_OPTIM_CPU_INTERNAL_CORE_H_
