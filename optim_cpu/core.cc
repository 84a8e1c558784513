#include "optim_cpu/internal/core.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace strata::optim_cpu {

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

namespace internal {
namespace {

Kernels KernelsFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return Avx512Bf16Kernels();
    case Isa::kAvx512:
      return Avx512Kernels();
    case Isa::kAvx2:
      return Avx2Kernels();
    case Isa::kScalar:
      break;
  }
  return ScalarKernels();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Core>> Core::Create(absl::string_view who, std::string wanted,
                                                   int threads, bool bind) {
  if (threads < 0 || threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": threads: must be in [0, 1024] (0: one per core), got ", threads));
  }
  auto core = std::make_unique<Core>();
  const std::vector<Isa> supported = SupportedIsas();
  if (wanted.empty()) {
    if (const char* env = std::getenv("STRATA_CPU_ADAM_ISA"); env != nullptr) wanted = env;
  }
  core->isa_ = supported.front();
  if (!wanted.empty()) {
    std::vector<std::string> names;
    bool found = false;
    for (Isa isa : supported) {
      names.emplace_back(IsaName(isa));
      if (IsaName(isa) == wanted) {
        core->isa_ = isa;
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": isa (or STRATA_CPU_ADAM_ISA): \"", wanted,
                       "\" is not one this CPU runs; accepted here: ", absl::StrJoin(names, ", ")));
    }
  }
  core->kernels_ = KernelsFor(core->isa_);
  auto pool = ThreadPool::Create(threads, bind);
  if (!pool.ok()) return pool.status();
  core->pool_ = *std::move(pool);
  return core;
}

bool Core::HasNonFinite(const void* grad, DType dtype, size_t n) {
  std::atomic<bool> found{false};
  const NonFiniteKernel k = kernels_.non_finite;
  pool_->ParallelFor(n, kGranule, [&](size_t b, size_t e, int) {
    if (k(grad, dtype, b, e)) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

void Core::Run(const UpdateArgs& args, size_t n, int threads) {
  const UpdateKernel k = kernels_.update;
  pool_->ParallelFor(
      n, kGranule, [&](size_t b, size_t e, int) { k(args, b, e); }, threads);
}

absl::Status CheckChunk(absl::string_view who, int64_t t, const float* param, const void* grad,
                        const void* state1, const void* state2, bool need_state2, DType state_dtype,
                        const void* param_copy, DType copy_dtype, size_t size,
                        const StepOptions& options) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", what));
  };
  if (t < 1) return bad(absl::StrCat("step t must be >= 1, got ", t));
  if (size == 0) return bad("size is 0 (an empty chunk)");
  if (param == nullptr) return bad("param is null");
  if (grad == nullptr) return bad("grad is null");
  if (state1 == nullptr) return bad(need_state2 ? "exp_avg is null" : "state is null");
  if (need_state2 && state2 == nullptr) return bad("exp_avg_sq is null");
  if (state_dtype == DType::kF16) return bad("moment_dtype fp16: accepted fp32, bf16");
  if (!std::isfinite(options.grad_scale)) return bad("grad_scale must be finite");
  if (!std::isfinite(options.lr)) return bad("lr must be finite");
  if (!std::isfinite(options.weight_decay)) return bad("weight_decay must be finite");
  for (const auto& [key, beta] :
       {std::pair{"beta1", options.beta1}, std::pair{"beta2", options.beta2}}) {
    if (!(std::isfinite(beta) && beta < 1.0f)) {
      return bad(
          absl::StrCat(key, " ", beta, ": accepted 0 <= ", key, " < 1 (negative: the config's)"));
    }
  }
  return absl::OkStatus();
}

void SetBetas(const StepOptions& options, float beta1, float beta2, UpdateArgs* args) {
  args->beta1 = options.beta1 >= 0 ? options.beta1 : beta1;
  args->beta2 = options.beta2 >= 0 ? options.beta2 : beta2;
  args->one_minus_beta1 = 1.0f - args->beta1;
  args->one_minus_beta2 = 1.0f - args->beta2;
}

absl::Status CheckHyper(absl::string_view who, absl::string_view key, float value, float lo,
                        float hi, bool hi_open) {
  const bool ok = std::isfinite(value) && value >= lo && (hi_open ? value < hi : value <= hi);
  if (ok) return absl::OkStatus();
  std::string range;
  if (hi == std::numeric_limits<float>::infinity()) {
    range = lo == 0 && key == "eps" ? "finite and > 0" : absl::StrCat("finite and >= ", lo);
  } else {
    range = absl::StrCat("in [", lo, ", ", hi, hi_open ? ")" : "]");
  }
  return absl::InvalidArgumentError(
      absl::StrCat(who, ": ", key, ": must be ", range, ", got ", value));
}

}  // namespace internal
}  // namespace strata::optim_cpu
