// The per-ISA Adam kernels and their arguments. One translation unit per ISA, each compiled with
// that ISA's flags; adam.cc picks one at run time.
//
// Every kernel computes each element with the same sequence of fp32 operations in its vector body
// and its tail (the tail runs through the vector body on a padded copy), so the bits of a result
// do not depend on where a chunk starts or ends.
#ifndef STRATA_OPTIM_CPU_INTERNAL_KERNELS_H_
#define STRATA_OPTIM_CPU_INTERNAL_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "optim_cpu/adam.h"

namespace strata::optim_cpu::internal {

struct AdamArgs {
  float* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* param_copy;  // may be null
  DType grad_dtype, moment_dtype, copy_dtype;
  // Scalars, precomputed once per step.
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float eps;
  float step_size;  // lr / (1 - beta1^t), or lr
  float bc2_sqrt;   // sqrt(1 - beta2^t), or 1
  float grad_scale;
  float l2;     // Adam: weight_decay (else 0)
  float decay;  // AdamW: 1 - lr * weight_decay (else 1)
  bool adamw;
};

// Updates elements [begin, end).
using AdamKernel = void (*)(const AdamArgs& args, size_t begin, size_t end);
// True when some element of [begin, end) is inf or nan.
using NonFiniteKernel = bool (*)(const void* grad, DType dtype, size_t begin, size_t end);

struct Kernels {
  AdamKernel adam;
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
