#include "optim_cpu/adam.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "optim_cpu/internal/kernels.h"

namespace strata::optim_cpu {
namespace {

using internal::AdamArgs;
using internal::Kernels;

internal::Kernels KernelsFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return internal::Avx512Bf16Kernels();
    case Isa::kAvx512:
      return internal::Avx512Kernels();
    case Isa::kAvx2:
      return internal::Avx2Kernels();
    case Isa::kScalar:
      break;
  }
  return internal::ScalarKernels();
}

bool Finite(float x) { return std::isfinite(x); }

}  // namespace

absl::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
  }
  return "unknown";
}

std::vector<Isa> SupportedIsas() {
  __builtin_cpu_init();
  std::vector<Isa> out;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // F16C has no __builtin_cpu_supports name in GCC 12; every AVX2 CPU has it (Haswell, Zen).
  if (avx512 && __builtin_cpu_supports("avx512bf16")) out.push_back(Isa::kAvx512Bf16);
  if (avx512) out.push_back(Isa::kAvx512);
  if (avx2) out.push_back(Isa::kAvx2);
  out.push_back(Isa::kScalar);
  return out;
}

absl::Status ValidateAdamConfig(const AdamConfig& c) {
  auto bad = [](absl::string_view key, absl::string_view accepted, float got) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam config: ", key, ": must be ", accepted, ", got ", got));
  };
  if (!Finite(c.lr) || c.lr < 0) return bad("lr", "finite and >= 0", c.lr);
  if (!Finite(c.beta1) || c.beta1 < 0 || c.beta1 >= 1) return bad("betas[0]", "in [0, 1)", c.beta1);
  if (!Finite(c.beta2) || c.beta2 < 0 || c.beta2 >= 1) return bad("betas[1]", "in [0, 1)", c.beta2);
  if (!Finite(c.eps) || c.eps <= 0) return bad("eps", "finite and > 0", c.eps);
  if (!Finite(c.weight_decay) || c.weight_decay < 0) {
    return bad("weight_decay", "finite and >= 0", c.weight_decay);
  }
  if (c.threads < 0 || c.threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adam config: threads: must be in [0, 1024] (0: one per core), got ", c.threads));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CpuAdam>> CpuAdam::Create(const AdamConfig& config) {
  if (absl::Status s = ValidateAdamConfig(config); !s.ok()) return s;
  auto adam = std::unique_ptr<CpuAdam>(new CpuAdam());
  adam->config_ = config;
  const std::vector<Isa> supported = SupportedIsas();
  std::string wanted = config.isa;
  if (wanted.empty()) {
    if (const char* env = std::getenv("STRATA_CPU_ADAM_ISA"); env != nullptr) wanted = env;
  }
  adam->isa_ = supported.front();
  if (!wanted.empty()) {
    std::vector<std::string> names;
    bool found = false;
    for (Isa isa : supported) {
      names.emplace_back(IsaName(isa));
      if (IsaName(isa) == wanted) {
        adam->isa_ = isa;
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("adam config: isa (or STRATA_CPU_ADAM_ISA): \"", wanted,
                       "\" is not one this CPU runs; accepted here: ", absl::StrJoin(names, ", ")));
    }
  }
  auto pool = ThreadPool::Create(config.threads, config.bind_threads);
  if (!pool.ok()) return pool.status();
  adam->pool_ = *std::move(pool);
  return adam;
}

bool CpuAdam::HasNonFinite(const void* grad, DType dtype, size_t n) {
  const Kernels k = KernelsFor(isa_);
  std::atomic<bool> found{false};
  pool_->ParallelFor(n, internal::kGranule, [&](size_t b, size_t e, int) {
    if (k.non_finite(grad, dtype, b, e)) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

absl::StatusOr<StepResult> CpuAdam::Step(int64_t t, const AdamChunk& c,
                                         const StepOptions& options) {
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("CpuAdam::Step: ", what));
  };
  if (t < 1) return bad(absl::StrCat("step t must be >= 1, got ", t));
  if (c.size == 0) return bad("size is 0 (an empty chunk)");
  if (c.param == nullptr) return bad("param is null");
  if (c.grad == nullptr) return bad("grad is null");
  if (c.exp_avg == nullptr) return bad("exp_avg is null");
  if (c.exp_avg_sq == nullptr) return bad("exp_avg_sq is null");
  if (c.moment_dtype == DType::kF16) return bad("moment_dtype fp16: accepted fp32, bf16");
  if (c.param_copy != nullptr && c.copy_dtype == DType::kF32) {
    return bad("copy_dtype fp32: accepted bf16, fp16 (the fp32 parameters are `param`)");
  }
  if (!Finite(options.grad_scale)) return bad("grad_scale must be finite");
  const float lr = options.lr >= 0 ? options.lr : config_.lr;
  if (!Finite(lr)) return bad("lr must be finite");
  if (options.check_overflow && HasNonFinite(c.grad, c.grad_dtype, c.size)) {
    return StepResult{.overflow = true};
  }
  AdamArgs a;
  a.param = c.param;
  a.grad = c.grad;
  a.exp_avg = c.exp_avg;
  a.exp_avg_sq = c.exp_avg_sq;
  a.param_copy = c.param_copy;
  a.grad_dtype = c.grad_dtype;
  a.moment_dtype = c.moment_dtype;
  a.copy_dtype = c.copy_dtype;
  a.beta1 = config_.beta1;
  a.beta2 = config_.beta2;
  a.one_minus_beta1 = 1.0f - config_.beta1;
  a.one_minus_beta2 = 1.0f - config_.beta2;
  a.eps = config_.eps;
  // Bias corrections in double, then rounded once, as PyTorch computes them from Python floats.
  const double bc1 =
      config_.bias_correction ? 1.0 - std::pow(double{config_.beta1}, double(t)) : 1.0;
  const double bc2 =
      config_.bias_correction ? 1.0 - std::pow(double{config_.beta2}, double(t)) : 1.0;
  a.step_size = static_cast<float>(lr / bc1);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.grad_scale = options.grad_scale;
  a.adamw = config_.adamw;
  a.l2 = config_.adamw ? 0.0f : config_.weight_decay;
  a.decay = config_.adamw ? static_cast<float>(1.0 - double{lr} * config_.weight_decay) : 1.0f;
  if (config_.adamw && config_.weight_decay == 0.0f) a.adamw = false;  // p * 1: skip it
  const Kernels k = KernelsFor(isa_);
  pool_->ParallelFor(c.size, internal::kGranule, [&](size_t b, size_t e, int) { k.adam(a, b, e); });
  return StepResult{};
}

}  // namespace strata::optim_cpu
