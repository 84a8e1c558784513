// optim_cpu/adagrad.h: vectorized Adagrad on the CPU, in place, following torch.optim.Adagrad
// (PyTorch 1.13) element by element in fp32, t the step number (1 for the first step):
//
//   g     = grad * grad_scale
//   g     = g + weight_decay * p                     (L2, as torch.optim.Adagrad)
//   clr   = lr / (1 + (t - 1) * lr_decay)
//   sum   = sum + g * g
//   p     = p - clr * g / (sqrt(sum) + eps)
//
// The accumulator `sum` is fp32 or bf16; start it at torch's initial_accumulator_value (0 by
// default) yourself. Gradients fp32/bf16/fp16, the optional bf16/fp16 copy out, chunks, overflow
// skip, kernels and threads work as for CpuAdam (optim_cpu/adam.h).
//
// Thread safety: one thread at a time per CpuAdagrad; Validate (const) may run beside the others.
#ifndef STRATA_OPTIM_CPU_ADAGRAD_H_
#define STRATA_OPTIM_CPU_ADAGRAD_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "optim_cpu/common.h"
#include "optim_cpu/thread_pool.h"

namespace strata::optim_cpu {

namespace internal {
class Core;
}

// A chunk of an optimizer with one state tensor (Adagrad's sum, Lion's exp_avg).
struct StateChunk {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* state = nullptr;
  DType state_dtype = DType::kF32;  // kF32 or kBF16
  void* param_copy = nullptr;
  DType copy_dtype = DType::kBF16;  // kBF16 or kF16
  size_t size = 0;
};

struct AdagradConfig {
  float lr = 1e-2f;
  float lr_decay = 0.0f;
  float weight_decay = 0.0f;
  float eps = 1e-10f;
  int threads = 0;
  bool bind_threads = true;
  std::string isa;
};

class CpuAdagrad {
 public:
  // lr >= 0, lr_decay >= 0, weight_decay >= 0, eps > 0, all finite.
  static absl::StatusOr<std::unique_ptr<CpuAdagrad>> Create(const AdagradConfig& config);
  ~CpuAdagrad();
  absl::StatusOr<StepResult> Step(int64_t t, const StateChunk& chunk,
                                  const StepOptions& options = {});
  // What Step would refuse (the same InvalidArgument), touching nothing.
  absl::Status Validate(int64_t t, const StateChunk& chunk, const StepOptions& options = {}) const;
  // Whether any of the n gradients is inf or nan (vectorized, on the pool).
  bool HasNonFinite(const void* grad, DType dtype, size_t n);
  Isa isa() const;

 private:
  CpuAdagrad();
  AdagradConfig config_;
  std::unique_ptr<internal::Core> core_;
};

}  // namespace strata::optim_cpu

#endif  // STRATA_OPTIM_CPU_ADAGRAD_H_
