// optim_cpu/chunk_optimizer.cc: see chunk_optimizer.h.
#include "optim_cpu/chunk_optimizer.h"

#include <utility>

namespace strata::optim_cpu {
namespace {

class AdamAdapter : public ChunkOptimizer {
 public:
  AdamAdapter(CpuAdam* adam, std::unique_ptr<CpuAdam> owned)
      : adam_(adam), owned_(std::move(owned)) {}
  absl::Status Validate(int64_t t, const AdamChunk& c, const StepOptions& o) const override {
    return adam_->Validate(t, c, o);
  }
  absl::StatusOr<StepResult> Step(int64_t t, const AdamChunk& c, const StepOptions& o) override {
    return adam_->Step(t, c, o);
  }
  bool HasNonFinite(const void* grad, DType dtype, size_t n) override {
    return adam_->HasNonFinite(grad, dtype, n);
  }
  OptimizerKind kind() const override { return OptimizerKind::kAdam; }
  Isa isa() const override { return adam_->isa(); }

 private:
  CpuAdam* adam_;
  std::unique_ptr<CpuAdam> owned_;
};

// Adagrad or Lion: one state, carried in the chunk's exp_avg.
template <typename Optimizer, OptimizerKind kKind>
class OneStateAdapter : public ChunkOptimizer {
 public:
  explicit OneStateAdapter(std::unique_ptr<Optimizer> optimizer)
      : optimizer_(std::move(optimizer)) {}
  absl::Status Validate(int64_t t, const AdamChunk& c, const StepOptions& o) const override {
    return optimizer_->Validate(t, StateOf(c), o);
  }
  absl::StatusOr<StepResult> Step(int64_t t, const AdamChunk& c, const StepOptions& o) override {
    return optimizer_->Step(t, StateOf(c), o);
  }
  bool HasNonFinite(const void* grad, DType dtype, size_t n) override {
    return optimizer_->HasNonFinite(grad, dtype, n);
  }
  OptimizerKind kind() const override { return kKind; }
  Isa isa() const override { return optimizer_->isa(); }

 private:
  static StateChunk StateOf(const AdamChunk& c) {
    StateChunk s;
    s.param = c.param;
    s.grad = c.grad;
    s.grad_dtype = c.grad_dtype;
    s.state = c.exp_avg;
    s.state_dtype = c.moment_dtype;
    s.param_copy = c.param_copy;
    s.copy_dtype = c.copy_dtype;
    s.size = c.size;
    return s;
  }
  std::unique_ptr<Optimizer> optimizer_;
};

}  // namespace

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdagrad:
      return "adagrad";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<ChunkOptimizer>> MakeChunkOptimizer(const OptimizerConfig& config) {
  switch (config.kind) {
    case OptimizerKind::kAdam: {
      auto adam = CpuAdam::Create(config.adam);
      if (!adam.ok()) return adam.status();
      CpuAdam* raw = adam->get();
      return std::unique_ptr<ChunkOptimizer>(new AdamAdapter(raw, *std::move(adam)));
    }
    case OptimizerKind::kAdagrad: {
      auto adagrad = CpuAdagrad::Create(config.adagrad);
      if (!adagrad.ok()) return adagrad.status();
      return std::unique_ptr<ChunkOptimizer>(
          new OneStateAdapter<CpuAdagrad, OptimizerKind::kAdagrad>(*std::move(adagrad)));
    }
    case OptimizerKind::kLion: {
      auto lion = CpuLion::Create(config.lion);
      if (!lion.ok()) return lion.status();
      return std::unique_ptr<ChunkOptimizer>(
          new OneStateAdapter<CpuLion, OptimizerKind::kLion>(*std::move(lion)));
    }
  }
  return absl::InvalidArgumentError("optimizer: unknown kind");
}

std::unique_ptr<ChunkOptimizer> BorrowAdam(CpuAdam* adam) {
  return std::make_unique<AdamAdapter>(adam, nullptr);
}

}  // namespace strata::optim_cpu
