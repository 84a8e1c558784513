// optim_cpu/lion.h: vectorized Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
// Algorithms"; the update of the widely used lion-pytorch) on the CPU, in place, in fp32:
//
//   g = grad * grad_scale
//   p = p * (1 - lr * weight_decay)                  (decoupled)
//   p = p - lr * sign(beta1 * m + (1 - beta1) * g)   (sign(0) = 0)
//   m = beta2 * m + (1 - beta2) * g
//
// One state tensor, m (fp32 or bf16), in StateChunk::state. Gradients, copy out, chunks, overflow
// skip, kernels and threads work as for CpuAdam (optim_cpu/adam.h).
//
// Thread safety: one thread at a time per CpuLion; Validate (const) may run beside the others.
#ifndef STRATA_OPTIM_CPU_LION_H_
#define STRATA_OPTIM_CPU_LION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "optim_cpu/adagrad.h"  // StateChunk
#include "optim_cpu/common.h"

namespace strata::optim_cpu {

struct LionConfig {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;
  int threads = 0;
  bool bind_threads = true;
  std::string isa;
};

class CpuLion {
 public:
  // lr >= 0, betas in [0, 1), weight_decay >= 0, all finite.
  static absl::StatusOr<std::unique_ptr<CpuLion>> Create(const LionConfig& config);
  ~CpuLion();
  absl::StatusOr<StepResult> Step(int64_t t, const StateChunk& chunk,
                                  const StepOptions& options = {});
  // What Step would refuse (the same InvalidArgument), touching nothing.
  absl::Status Validate(int64_t t, const StateChunk& chunk, const StepOptions& options = {}) const;
  // Whether any of the n gradients is inf or nan (vectorized, on the pool).
  bool HasNonFinite(const void* grad, DType dtype, size_t n);
  Isa isa() const;

 private:
  CpuLion();
  LionConfig config_;
  std::unique_ptr<internal::Core> core_;
};

}  // namespace strata::optim_cpu

#endif  // STRATA_OPTIM_CPU_LION_H_
