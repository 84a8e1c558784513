#include "optim_cpu/adam.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "optim_cpu/internal/core.h"

namespace strata::optim_cpu {
namespace {
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr char kWho[] = "adam config";
}  // namespace

absl::Status ValidateAdamConfig(const AdamConfig& c) {
  using internal::CheckHyper;
  if (auto s = CheckHyper(kWho, "lr", c.lr, 0, kInf, false); !s.ok()) return s;
  if (auto s = CheckHyper(kWho, "betas[0]", c.beta1, 0, 1, true); !s.ok()) return s;
  if (auto s = CheckHyper(kWho, "betas[1]", c.beta2, 0, 1, true); !s.ok()) return s;
  if (!std::isfinite(c.eps) || c.eps <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWho, ": eps: must be finite and > 0, got ", c.eps));
  }
  return CheckHyper(kWho, "weight_decay", c.weight_decay, 0, kInf, false);
}

CpuAdam::CpuAdam() = default;
CpuAdam::~CpuAdam() = default;
Isa CpuAdam::isa() const { return core_->isa(); }
ThreadPool& CpuAdam::pool() { return core_->pool(); }

absl::StatusOr<std::unique_ptr<CpuAdam>> CpuAdam::Create(const AdamConfig& config) {
  if (absl::Status s = ValidateAdamConfig(config); !s.ok()) return s;
  auto core = internal::Core::Create(kWho, config.isa, config.threads, config.bind_threads);
  if (!core.ok()) return core.status();
  auto adam = std::unique_ptr<CpuAdam>(new CpuAdam());
  adam->config_ = config;
  adam->core_ = *std::move(core);
  return adam;
}

bool CpuAdam::HasNonFinite(const void* grad, DType dtype, size_t n) {
  return core_->HasNonFinite(grad, dtype, n);
}

absl::Status CpuAdam::Validate(int64_t t, const AdamChunk& c, const StepOptions& options) const {
  return internal::CheckChunk("CpuAdam::Step", t, c.param, c.grad, c.exp_avg, c.exp_avg_sq,
                              /*need_state2=*/true, c.moment_dtype, c.param_copy, c.copy_dtype,
                              c.size, options);
}

absl::StatusOr<StepResult> CpuAdam::Step(int64_t t, const AdamChunk& c,
                                         const StepOptions& options) {
  STRATA_RETURN_IF_ERROR(Validate(t, c, options));
  const float lr = options.lr >= 0 ? options.lr : config_.lr;
  const float weight_decay =
      options.weight_decay >= 0 ? options.weight_decay : config_.weight_decay;
  if (options.check_overflow && core_->HasNonFinite(c.grad, c.grad_dtype, c.size)) {
    return StepResult{.overflow = true};
  }
  internal::UpdateArgs a;
  a.rule = internal::Rule::kAdam;
  a.param = c.param;
  a.grad = c.grad;
  a.state1 = c.exp_avg;
  a.state2 = c.exp_avg_sq;
  a.param_copy = c.param_copy;
  a.grad_dtype = c.grad_dtype;
  a.state_dtype = c.moment_dtype;
  a.copy_dtype = c.copy_dtype;
  internal::SetBetas(options, config_.beta1, config_.beta2, &a);
  a.eps = config_.eps;
  // Bias corrections in double, rounded once, as PyTorch computes them from Python floats (with
  // this step's betas, as torch's Adam takes its group's at each step).
  const double bc1 = config_.bias_correction ? 1.0 - std::pow(double{a.beta1}, double(t)) : 1.0;
  const double bc2 = config_.bias_correction ? 1.0 - std::pow(double{a.beta2}, double(t)) : 1.0;
  a.step_size = static_cast<float>(lr / bc1);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.grad_scale = options.grad_scale;
  a.l2 = config_.adamw ? 0.0f : weight_decay;
  a.decoupled = config_.adamw && weight_decay != 0.0f;
  a.decay = static_cast<float>(1.0 - double{lr} * weight_decay);
  core_->Run(a, c.size, options.threads);
  return StepResult{};
}

}  // namespace strata::optim_cpu
