// The front-ends of Adagrad and Lion: validation and the per-step scalars; the kernels are the
// shared ones (internal/adam_impl.h).
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "optim_cpu/adagrad.h"
#include "optim_cpu/internal/core.h"
#include "optim_cpu/lion.h"

namespace strata::optim_cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

internal::UpdateArgs ArgsFor(internal::Rule rule, const StateChunk& c, const StepOptions& o) {
  internal::UpdateArgs a;
  a.rule = rule;
  a.param = c.param;
  a.grad = c.grad;
  a.state1 = c.state;
  a.param_copy = c.param_copy;
  a.grad_dtype = c.grad_dtype;
  a.state_dtype = c.state_dtype;
  a.copy_dtype = c.copy_dtype;
  a.grad_scale = o.grad_scale;
  return a;
}

absl::Status CheckStateChunk(absl::string_view who, int64_t t, const StateChunk& c,
                             const StepOptions& o) {
  return internal::CheckChunk(who, t, c.param, c.grad, c.state, nullptr, false, c.state_dtype,
                              c.param_copy, c.copy_dtype, c.size, o);
}

template <typename Optimizer>
absl::StatusOr<StepResult> RunStep(absl::string_view who, internal::Core& core, int64_t t,
                                   const StateChunk& c, const StepOptions& o,
                                   const internal::UpdateArgs& a) {
  if (auto s = CheckStateChunk(who, t, c, o); !s.ok()) return s;
  if (o.check_overflow && core.HasNonFinite(c.grad, c.grad_dtype, c.size)) {
    return StepResult{.overflow = true};
  }
  core.Run(a, c.size, o.threads);
  return StepResult{};
}

}  // namespace

// --- Adagrad -----------------------------------------------------------------------------------

CpuAdagrad::CpuAdagrad() = default;
CpuAdagrad::~CpuAdagrad() = default;
Isa CpuAdagrad::isa() const { return core_->isa(); }
absl::Status CpuAdagrad::Validate(int64_t t, const StateChunk& c, const StepOptions& o) const {
  return CheckStateChunk("CpuAdagrad::Step", t, c, o);
}
bool CpuAdagrad::HasNonFinite(const void* grad, DType dtype, size_t n) {
  return core_->HasNonFinite(grad, dtype, n);
}

absl::StatusOr<std::unique_ptr<CpuAdagrad>> CpuAdagrad::Create(const AdagradConfig& config) {
  constexpr char kWho[] = "adagrad config";
  using internal::CheckHyper;
  for (const auto& [key, value] :
       {std::pair{"lr", config.lr}, std::pair{"lr_decay", config.lr_decay},
        std::pair{"weight_decay", config.weight_decay}}) {
    if (auto s = CheckHyper(kWho, key, value, 0, kInf, false); !s.ok()) return s;
  }
  if (!std::isfinite(config.eps) || config.eps <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWho, ": eps: must be finite and > 0, got ", config.eps));
  }
  auto core = internal::Core::Create(kWho, config.isa, config.threads, config.bind_threads);
  if (!core.ok()) return core.status();
  auto out = std::unique_ptr<CpuAdagrad>(new CpuAdagrad());
  out->config_ = config;
  out->core_ = *std::move(core);
  return out;
}

absl::StatusOr<StepResult> CpuAdagrad::Step(int64_t t, const StateChunk& c, const StepOptions& o) {
  internal::UpdateArgs a = ArgsFor(internal::Rule::kAdagrad, c, o);
  const float lr = o.lr >= 0 ? o.lr : config_.lr;
  const float weight_decay = o.weight_decay >= 0 ? o.weight_decay : config_.weight_decay;
  a.step_size = static_cast<float>(lr / (1.0 + double(t - 1) * config_.lr_decay));
  a.eps = config_.eps;
  a.l2 = weight_decay;
  return RunStep<CpuAdagrad>("CpuAdagrad::Step", *core_, t, c, o, a);
}

// --- Lion --------------------------------------------------------------------------------------

CpuLion::CpuLion() = default;
CpuLion::~CpuLion() = default;
Isa CpuLion::isa() const { return core_->isa(); }
absl::Status CpuLion::Validate(int64_t t, const StateChunk& c, const StepOptions& o) const {
  return CheckStateChunk("CpuLion::Step", t, c, o);
}
bool CpuLion::HasNonFinite(const void* grad, DType dtype, size_t n) {
  return core_->HasNonFinite(grad, dtype, n);
}

absl::StatusOr<std::unique_ptr<CpuLion>> CpuLion::Create(const LionConfig& config) {
  constexpr char kWho[] = "lion config";
  using internal::CheckHyper;
  if (auto s = CheckHyper(kWho, "lr", config.lr, 0, kInf, false); !s.ok()) return s;
  if (auto s = CheckHyper(kWho, "betas[0]", config.beta1, 0, 1, true); !s.ok()) return s;
  if (auto s = CheckHyper(kWho, "betas[1]", config.beta2, 0, 1, true); !s.ok()) return s;
  if (auto s = CheckHyper(kWho, "weight_decay", config.weight_decay, 0, kInf, false); !s.ok()) {
    return s;
  }
  auto core = internal::Core::Create(kWho, config.isa, config.threads, config.bind_threads);
  if (!core.ok()) return core.status();
  auto out = std::unique_ptr<CpuLion>(new CpuLion());
  out->config_ = config;
  out->core_ = *std::move(core);
  return out;
}

absl::StatusOr<StepResult> CpuLion::Step(int64_t t, const StateChunk& c, const StepOptions& o) {
  internal::UpdateArgs a = ArgsFor(internal::Rule::kLion, c, o);
  const float lr = o.lr >= 0 ? o.lr : config_.lr;
  const float weight_decay = o.weight_decay >= 0 ? o.weight_decay : config_.weight_decay;
  internal::SetBetas(o, config_.beta1, config_.beta2, &a);
  a.step_size = lr;
  a.decoupled = weight_decay != 0.0f;
  a.decay = static_cast<float>(1.0 - double{lr} * weight_decay);
  return RunStep<CpuLion>("CpuLion::Step", *core_, t, c, o, a);
}

}  // namespace strata::optim_cpu
