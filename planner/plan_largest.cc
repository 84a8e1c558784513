#include "planner/plan_largest.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "planner/plan_time.h"

namespace strata::plan {
namespace {

constexpr int64_t kStep = 256;  // widths: whole heads of 128, an even number of them
constexpr int64_t kNarrowest = 512;

int64_t LayersOf(int64_t width) { return std::max<int64_t>(2, width / 128); }

// Whether the member `width` wide fits (the plan it fits with), or the overflow that refuses it.
struct Tried {
  std::optional<Largest> fits;
  MemoryPlan::Overflow refused;
};

absl::StatusOr<Tried> Try(int64_t width, const Hardware& hw, const Training& training,
                          const LargestOptions& o) {
  Largest l;
  l.hf_config = LlamaShaped(width, o.vocab, o.sequence);
  auto model = TransformerFromHfConfig(l.hf_config, o.sequence, training.micro_batch);
  if (!model.ok()) return model.status();
  l.width = width;
  l.layers = model->layers;
  l.heads = model->heads;
  Tried t;
  if (o.suggest) {
    auto s = Suggest(*model, hw, training);
    if (s.ok()) {
      l.model = s->model;
      l.training = s->training;
      t.fits = std::move(l);
      return t;
    }
    if (s.status().code() != absl::StatusCode::kNotFound) return s.status();
    // Nothing it searched fits: the given config is planned (its overflow names the tier).
  }
  auto memory = PlanMemory(*model, hw, training);
  if (!memory.ok()) return memory.status();
  if (memory->overflow.has_value()) {
    t.refused = *memory->overflow;
    return t;
  }
  l.model = *model;
  l.training = training;
  t.fits = std::move(l);
  return t;
}

}  // namespace

nlohmann::json LlamaShaped(int64_t width, int64_t vocab, int64_t sequence) {
  const int64_t heads = width / 128;
  return {{"model_type", "llama"},
          {"architectures", {"LlamaForCausalLM"}},
          {"hidden_size", width},
          {"num_hidden_layers", LayersOf(width)},
          {"num_attention_heads", heads},
          {"num_key_value_heads", heads % 2 == 0 ? heads / 2 : heads},
          {"intermediate_size", (8 * width / 3 + 63) / 64 * 64},
          {"vocab_size", vocab},
          {"max_position_embeddings", sequence},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false}};
}

double TrainingStateBytes(const Transformer& model, const Training& training) {
  const double params = static_cast<double>(model.TotalParams());
  const double master = training.dtype_bytes == 4 ? 0 : 4;  // fp32 training steps its weights
  return params * (2.0 * training.dtype_bytes + master + 8);
}

absl::StatusOr<Largest> FindLargest(const Hardware& hardware, const Training& training,
                                    const LargestOptions& options) {
  if (options.vocab < 1 || options.sequence < 1 || options.max_width < kNarrowest) {
    return absl::InvalidArgumentError(absl::StrCat("--largest: vocab ", options.vocab,
                                                   ", sequence ", options.sequence, ", widest ",
                                                   options.max_width,
                                                   "; accepted: a vocabulary and a sequence of "
                                                   "1 or more, a widest of ",
                                                   kNarrowest, " or more"));
  }
  int tried = 0;
  auto attempt = [&](int64_t width) {
    ++tried;
    return Try(width, hardware, training, options);
  };
  auto narrowest = attempt(kNarrowest);
  if (!narrowest.ok()) return narrowest.status();
  if (!narrowest->fits.has_value()) {
    const MemoryPlan::Overflow& r = narrowest->refused;
    return absl::NotFoundError(absl::StrCat(
        "no member of the family fits", options.suggest ? " with any configuration searched" : "",
        ": the narrowest (", kNarrowest, " wide, ", LayersOf(kNarrowest), " layers) needs ",
        absl::StrFormat("%.2f GB", r.need / 1e9), " of the ", r.tier, " tier's ",
        absl::StrFormat("%.2f GB", r.have / 1e9), options.suggest ? " with the config given" : ""));
  }
  // Bisection: `fits` fits, `refused` (when set) does not.
  Largest best = *std::move(narrowest->fits);
  std::optional<MemoryPlan::Overflow> refused_at_hi;
  int64_t lo = kNarrowest / kStep;  // in steps of kStep: lo fits, hi does not
  auto widest = attempt(options.max_width / kStep * kStep);
  if (!widest.ok()) return widest.status();
  if (widest->fits.has_value()) {
    best = *std::move(widest->fits);
    best.tried = tried;
    return best;  // the whole family fits
  }
  int64_t hi = options.max_width / kStep;
  refused_at_hi = widest->refused;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    auto t = attempt(mid * kStep);
    if (!t.ok()) return t.status();
    if (t->fits.has_value()) {
      lo = mid;
      best = *std::move(t->fits);
    } else {
      hi = mid;
      refused_at_hi = t->refused;
    }
  }
  best.tried = tried;
  best.wider_refused = refused_at_hi;
  return best;
}

}  // namespace strata::plan
