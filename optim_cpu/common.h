// optim_cpu/common.h: what the CPU optimizers (adam.h, adagrad.h, lion.h) share: the kernel
// ISAs, the element types, and the per-step options and result.
//
// Thread safety: plain values and pure functions.
#ifndef STRATA_OPTIM_CPU_COMMON_H_
#define STRATA_OPTIM_CPU_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"

namespace strata::optim_cpu {

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Bf16 };
absl::string_view IsaName(Isa isa);
// The ISAs this CPU can run, best first.
std::vector<Isa> SupportedIsas();

enum class DType { kF32, kBF16, kF16 };
absl::string_view DTypeName(DType t);

struct StepOptions {
  float grad_scale = 1.0f;  // multiplies every gradient (1/loss_scale times a clip coefficient)
  bool check_overflow = false;
  float lr = -1;  // >= 0: this step's learning rate (schedulers); else config's
  // >= 0: this step's weight decay (a parameter group's: no decay for biases and norms); else
  // config's.
  float weight_decay = -1;
  // >= 0: this step's betas (Adam's and Lion's: a parameter group's, set by a schedule that
  // cycles momentum, torch's OneCycleLR); else config's.
  float beta1 = -1;
  float beta2 = -1;
  // > 0: at most this many of the optimizer's pool threads work on this step (the first ones:
  // bound to the lowest cores), leaving the others' cores free (a step taken while the trainer
  // still computes); 0: all of them.
  int threads = 0;
};

struct StepResult {
  bool overflow = false;  // true: a gradient was inf or nan; nothing was changed
};

}  // namespace strata::optim_cpu

#endif  // STRATA_OPTIM_CPU_COMMON_H_
