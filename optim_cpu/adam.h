// optim_cpu/adam.h: vectorized Adam and AdamW on the CPU, in place on caller-owned host buffers.
//
// The update follows torch.optim.Adam / torch.optim.AdamW (PyTorch 1.13, single-tensor path),
// element by element, in fp32, with t the step number (1 for the first step):
//
//   g  = grad * grad_scale                      (grad_scale = clip_coef / loss_scale; 1 by default)
//   Adam:  g = g + weight_decay * p             (L2, as torch.optim.Adam)
//   AdamW: p = p * (1 - lr * weight_decay)      (decoupled, as torch.optim.AdamW)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   with bias correction:    denom = sqrt(v) / sqrt(1 - beta2^t) + eps
//                            p     = p - (lr / (1 - beta1^t)) * (m / denom)
//   without bias correction: denom = sqrt(v) + eps
//                            p     = p - lr * (m / denom)
//
// eps is added after the square root and after the bias correction of v, as in PyTorch.
// Master parameters are fp32. Gradients are fp32, bf16 or fp16. The moments are fp32, or bf16
// to halve their memory and I/O (computed in fp32, stored rounded to nearest even; the accuracy
// cost is measured in docs/performance.md). The updated parameters can also be written, in the
// same pass, as a bf16 or fp16 copy (the copy that goes back to the GPU), or an fp32 one (for a
// trainer computing in fp32, whose weights live apart from the master weights).
//
// Spans may have any length and alignment. Step() works on a chunk: a caller may step partition
// k while k-1 is being written and k+1 read; every chunk of one optimizer step passes the same t.
// The result bits do not depend on the thread count or on how a partition is cut into chunks.
//
// Overflow (dynamic loss scaling): with check_overflow, the gradients are scanned for inf/nan
// first; if one is found, Step returns overflow = true and touches no state (skip the step).
//
// Kernels: AVX-512 with AVX512-BF16 conversions (avx512bf16), AVX-512 (avx512), AVX2+FMA+F16C
// (avx2) and scalar, the best the CPU has chosen once from cpuid; AdamConfig::isa or
// $STRATA_CPU_ADAM_ISA forces one (an ISA the CPU lacks is an error at Create). The paths differ
// only in the last bits (fused multiply-adds) and in bf16 rounding of denormals.
//
// Thread safety: a CpuAdam may be used by one thread at a time (its pool serializes anyway);
// Validate (const) may run beside the others.
// It does not own the buffers; they must not be touched by others during Step.
#ifndef STRATA_OPTIM_CPU_ADAM_H_
#define STRATA_OPTIM_CPU_ADAM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "optim_cpu/common.h"
#include "optim_cpu/thread_pool.h"

namespace strata::optim_cpu {

namespace internal {
class Core;
}

struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw = true;  // decoupled weight decay (AdamW); false: L2 (Adam)
  bool bias_correction = true;
  int threads = 0;  // 0: one per core
  bool bind_threads = true;
  // Force a kernel ISA; empty: the best the CPU has (or $STRATA_CPU_ADAM_ISA when set).
  std::string isa;
};

// The tensors of one chunk. `param`, `exp_avg`, `exp_avg_sq` are updated in place; `grad` is read;
// `param_copy` (optional) receives the updated parameters in copy_dtype.
struct AdamChunk {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType moment_dtype = DType::kF32;  // kF32 or kBF16
  void* param_copy = nullptr;
  DType copy_dtype = DType::kBF16;  // kBF16, kF16 or kF32
  size_t size = 0;                  // elements
};

class CpuAdam {
 public:
  // Validates the hyper-parameters (lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0, all
  // finite) and makes the thread pool.
  static absl::StatusOr<std::unique_ptr<CpuAdam>> Create(const AdamConfig& config);

  // One optimizer step t (>= 1) over one chunk. Bad spans (null, empty, unsupported dtypes) are
  // InvalidArgument naming the argument.
  absl::StatusOr<StepResult> Step(int64_t t, const AdamChunk& chunk,
                                  const StepOptions& options = {});

  // Checks what Step would refuse (the same InvalidArgument), touching nothing: for callers that
  // must know every chunk of a step is valid before they change anything.
  absl::Status Validate(int64_t t, const AdamChunk& chunk, const StepOptions& options = {}) const;

  // Whether any of the n gradients is inf or nan (vectorized, on the pool).
  bool HasNonFinite(const void* grad, DType dtype, size_t n);

  Isa isa() const;
  const AdamConfig& config() const { return config_; }
  ThreadPool& pool();

  ~CpuAdam();

 private:
  CpuAdam();
  AdamConfig config_;
  std::unique_ptr<internal::Core> core_;
};

// Validation of hyper-parameters, shared with other optimizers' configs.
absl::Status ValidateAdamConfig(const AdamConfig& config);

}  // namespace strata::optim_cpu

#endif  // STRATA_OPTIM_CPU_ADAM_H_
