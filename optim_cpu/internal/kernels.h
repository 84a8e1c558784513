// The per-ISA optimizer kernels and their arguments. One translation unit per ISA, each compiled
// with that ISA's flags; adam.cc picks one at run time.
//
// Every kernel computes each element with the same sequence of fp32 operations in its vector body
// and its tail (the tail runs through the vector body on a padded copy), so the bits of a result
// do not depend on where a chunk starts or ends.
#ifndef STRATA_OPTIM_CPU_INTERNAL_KERNELS_H_
#define STRATA_OPTIM_CPU_INTERNAL_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "optim_cpu/common.h"

namespace strata::optim_cpu::internal {

// Which update a kernel applies (formulas in adam.h, adagrad.h and lion.h).
enum class Rule { kAdam, kAdagrad, kLion };

struct UpdateArgs {
  Rule rule = Rule::kAdam;
  float* param = nullptr;
  const void* grad = nullptr;
  void* state1 = nullptr;      // Adam: exp_avg; Adagrad: the sum; Lion: exp_avg
  void* state2 = nullptr;      // Adam: exp_avg_sq; others: null
  void* param_copy = nullptr;  // may be null
  DType grad_dtype = DType::kF32, state_dtype = DType::kF32, copy_dtype = DType::kBF16;
  // Scalars, precomputed once per step.
  float beta1 = 0, beta2 = 0, one_minus_beta1 = 1, one_minus_beta2 = 1;
  float eps = 0;
  float step_size = 0;  // Adam: lr / (1 - beta1^t) or lr; Adagrad: the decayed lr; Lion: lr
  float bc2_sqrt = 1;   // Adam: sqrt(1 - beta2^t), or 1
  float grad_scale = 1;
  float l2 = 0;     // coupled (L2) weight decay added to the gradient, or 0
  float decay = 1;  // decoupled weight decay: 1 - lr * weight_decay
  bool decoupled = false;
};

// Updates elements [begin, end).
using UpdateKernel = void (*)(const UpdateArgs& args, size_t begin, size_t end);
// True when some element of [begin, end) is inf or nan.
using NonFiniteKernel = bool (*)(const void* grad, DType dtype, size_t begin, size_t end);

struct Kernels {
  UpdateKernel update;
  NonFiniteKernel non_finite;
};

Kernels ScalarKernels();
Kernels Avx2Kernels();
Kernels Avx512Kernels();
Kernels Avx512Bf16Kernels();

// Elements per vector in the widest ISA: chunk boundaries are kept at multiples of this.
inline constexpr size_t kGranule = 64;

}  // namespace strata::optim_cpu::internal

#endif  // STRATA_OPTIM_CPU_INTERNAL_KERNELS_H_
