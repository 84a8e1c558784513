#include "planner/plan_model.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::plan {
namespace {

using Json = nlohmann::json;

absl::Status BadKey(std::initializer_list<const char*> names, absl::string_view what) {
  const char* first = *names.begin();
  std::string also;
  if (names.size() > 1) {
    std::vector<std::string> rest(names.begin() + 1, names.end());
    also = absl::StrCat(" (or ", absl::StrJoin(rest, ", "), ")");
  }
  return absl::InvalidArgumentError(absl::StrCat("model: ", first, also, ": ", what));
}

// The first of `names` present (and not null) as a whole number in [lo, hi]; nullopt when none is.
absl::StatusOr<std::optional<int64_t>> IntOf(const Json& j,
                                             std::initializer_list<const char*> names, int64_t lo,
                                             int64_t hi, absl::string_view meaning) {
  for (const char* name : names) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_number()) {
      return absl::InvalidArgumentError(absl::StrCat("model: ", name, ": ", it->dump(),
                                                     " is not a number; ", meaning,
                                                     ", an integer in [", lo, ", ", hi, "]"));
    }
    const double d = it->get<double>();
    if (d != std::floor(d)) {
      return absl::InvalidArgumentError(absl::StrCat("model: ", name, ": ", it->dump(),
                                                     " is not a whole number; ", meaning,
                                                     ", an integer in [", lo, ", ", hi, "]"));
    }
    if (d < static_cast<double>(lo) || d > static_cast<double>(hi)) {
      return absl::InvalidArgumentError(absl::StrCat("model: ", name, ": ", it->dump(),
                                                     " is out of range; ", meaning,
                                                     ", an integer in [", lo, ", ", hi, "]"));
    }
    const int64_t v = it->is_number_integer() ? it->get<int64_t>() : static_cast<int64_t>(d);
    return std::optional<int64_t>(v);
  }
  return std::optional<int64_t>();
}

absl::StatusOr<int64_t> Required(const Json& j, std::initializer_list<const char*> names,
                                 int64_t lo, int64_t hi, absl::string_view meaning) {
  STRATA_ASSIGN_OR_RETURN(const std::optional<int64_t> v, IntOf(j, names, lo, hi, meaning));
  if (!v.has_value()) {
    return BadKey(names,
                  absl::StrCat("missing; ", meaning, ", an integer in [", lo, ", ", hi, "]"));
  }
  return *v;
}

std::string StringOr(const Json& j, const char* key, std::string fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : fallback;
}

bool IsOneOf(const std::string& s, std::initializer_list<const char*> names) {
  return std::any_of(names.begin(), names.end(), [&](const char* n) { return s == n; });
}

}  // namespace

namespace {
// One layer's attention matrices, and one expert's MLP matrices.
int64_t Attention(const Transformer& t) {
  const int64_t q = t.heads * t.head_dim(), kv = t.kv_heads * t.head_dim();
  return 2 * t.hidden * q + 2 * t.hidden * kv;
}
int64_t Mlp(const Transformer& t) { return (t.gated_mlp ? 3 : 2) * t.hidden * t.ffn; }
}  // namespace

int64_t Transformer::LayerMatrixParams() const {
  const int64_t router = experts > 1 ? hidden * experts : 0;
  return Attention(*this) + experts * Mlp(*this) + router;
}

int64_t Transformer::LayerActiveMatrixParams() const {
  const int64_t router = experts > 1 ? hidden * experts : 0;
  return Attention(*this) + std::min(experts, experts_per_token) * Mlp(*this) + router;
}

int64_t Transformer::LayerParams() const {
  if (gated_mlp) return LayerMatrixParams() + 2 * hidden;  // two RMSNorm weights
  const int64_t q = heads * head_dim(), kv = kv_heads * head_dim();
  // Biases of q, k, v, o and of both MLP matrices (each expert's); two LayerNorms, weight and bias.
  const int64_t bias_params = biases ? q + 2 * kv + hidden + experts * (ffn + hidden) : 0;
  return LayerMatrixParams() + bias_params + 4 * hidden;
}

int64_t Transformer::LargestParamParams() const {
  // A mixture of experts' expert weights are one tensor (as transformers stores them), never
  // tiled; the others are Linear matrices, tiled when tile_params is set.
  if (tile_params > 0) return std::max(vocab * hidden, LentUnitParams());
  const int64_t mlp = experts > 1 ? experts * (gated_mlp ? 2 : 1) * hidden * ffn : hidden * ffn;
  const int64_t matrix = std::max(mlp, hidden * (heads * head_dim() + 2 * kv_heads * head_dim()));
  return std::max(vocab * hidden, matrix);
}

int64_t Transformer::LentUnitParams() const {
  if (tile_params <= 0) return LayerParams();
  const int64_t q = heads * head_dim(), kv = kv_heads * head_dim();
  auto tile = [this](int64_t matrix) { return std::min(matrix, tile_params); };
  const int64_t mlp =
      experts > 1 ? experts * (gated_mlp ? 2 : 1) * hidden * ffn : tile(hidden * ffn);
  return std::max({tile(hidden * q), tile(hidden * kv), tile(q * hidden), mlp});
}

int64_t Transformer::LayerUnits() const {
  if (tile_params <= 0) return 1;
  // Each Linear tiled on its own, as tile_linears does: q, k, v and o, the MLP's two (three
  // gated) matrices; a mixture of experts' two expert tensors (never tiled) and its router.
  auto tiles = [this](int64_t matrix) { return (matrix + tile_params - 1) / tile_params; };
  const int64_t q = heads * head_dim(), kv = kv_heads * head_dim();
  const int64_t mlp =
      experts > 1 ? 2 + tiles(hidden * experts) : (gated_mlp ? 3 : 2) * tiles(hidden * ffn);
  return tiles(hidden * q) + 2 * tiles(hidden * kv) + tiles(q * hidden) + mlp;
}

int64_t Transformer::LayerTensors() const {
  if (tile_params > 0) return LayerUnits();
  const int64_t attention = fused_qkv ? 2 : 4;
  return attention + (experts > 1 ? 3 : gated_mlp ? 3 : 2);
}

int64_t Transformer::OuterParams() const {
  const int64_t embeddings = (tied_embeddings ? 1 : 2) * vocab * hidden;
  const int64_t final_norm = gated_mlp ? hidden : 2 * hidden;
  return embeddings + learned_positions * hidden + final_norm;
}

double Transformer::ForwardFlopsPerToken() const {
  const double matmul =
      static_cast<double>(layers) * LayerActiveMatrixParams() + static_cast<double>(vocab) * hidden;
  return 2 * matmul + 4.0 * layers * sequence * hidden;
}

double Transformer::LayerActivationBytes() const {
  const double sbh = static_cast<double>(sequence) * micro_batch * hidden;
  return sbh * (34 + 5.0 * heads * sequence / hidden);
}

double Transformer::CheckpointBytesPerLayer() const {
  return 2.0 * sequence * micro_batch * hidden;
}

double Transformer::LogitBytes() const { return 4.0 * sequence * micro_batch * vocab; }

absl::StatusOr<Transformer> TransformerFromHfConfig(const Json& j, int64_t sequence,
                                                    int64_t micro_batch) {
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        "model: the model description must be a JSON object with a Hugging Face config.json's "
        "keys (num_hidden_layers, hidden_size, num_attention_heads, vocab_size, ...)");
  }
  constexpr int64_t kMax = int64_t{1} << 40;
  Transformer t;
  t.name = StringOr(j, "model_type", "transformer");
  STRATA_ASSIGN_OR_RETURN(t.layers, Required(j, {"num_hidden_layers", "n_layer", "num_layers"}, 1,
                                             100000, "the number of transformer layers"));
  STRATA_ASSIGN_OR_RETURN(t.hidden, Required(j, {"hidden_size", "n_embd", "n_embed", "d_model"}, 1,
                                             1 << 20, "the hidden size"));
  STRATA_ASSIGN_OR_RETURN(t.heads, Required(j, {"num_attention_heads", "n_head"}, 1, t.hidden,
                                            "the attention heads per layer"));
  if (t.hidden % t.heads != 0) {
    return BadKey({"num_attention_heads", "n_head"},
                  absl::StrCat(t.heads, " does not divide the hidden size ", t.hidden,
                               "; heads must divide it"));
  }
  STRATA_ASSIGN_OR_RETURN(
      const std::optional<int64_t> kv,
      IntOf(j, {"num_key_value_heads", "num_kv_heads"}, 1, t.heads,
            "the key/value heads (grouped-query attention; at most the attention heads)"));
  t.kv_heads = kv.value_or(t.heads);
  if (auto mq = j.find("multi_query"); mq != j.end() && mq->is_boolean() && mq->get<bool>()) {
    t.kv_heads = 1;
  }
  STRATA_ASSIGN_OR_RETURN(const std::optional<int64_t> head_dim,
                          IntOf(j, {"head_dim"}, 1, 1 << 16, "the size of one attention head"));
  t.head_size = head_dim.value_or(0);
  STRATA_ASSIGN_OR_RETURN(const std::optional<int64_t> experts,
                          IntOf(j, {"num_local_experts", "num_experts"}, 1, 1 << 16,
                                "the experts of a mixture-of-experts MLP"));
  t.experts = experts.value_or(1);
  STRATA_ASSIGN_OR_RETURN(const std::optional<int64_t> per_token,
                          IntOf(j, {"num_experts_per_tok"}, 1, t.experts,
                                "the experts each token uses (at most the experts)"));
  t.experts_per_token = per_token.value_or(1);
  if (auto b = j.find("bias"); b != j.end()) {
    if (!b->is_boolean()) return BadKey({"bias"}, absl::StrCat(b->dump(), " is not true or false"));
    t.biases = b->get<bool>();
  }
  STRATA_ASSIGN_OR_RETURN(const std::optional<int64_t> ffn,
                          IntOf(j, {"intermediate_size", "n_inner", "ffn_dim", "d_ff"}, 1,
                                int64_t{1} << 32, "the MLP's inner size"));
  t.ffn = ffn.value_or(4 * t.hidden);
  STRATA_ASSIGN_OR_RETURN(t.vocab,
                          Required(j, {"vocab_size"}, 1, int64_t{1} << 32, "the vocabulary size"));
  STRATA_ASSIGN_OR_RETURN(const std::optional<int64_t> positions,
                          IntOf(j, {"max_position_embeddings", "n_positions"}, 1, kMax,
                                "the longest sequence the model takes"));
  if (IsOneOf(t.name, {"gpt2", "opt", "gpt_bigcode", "bert", "roberta"})) {
    if (!positions.has_value()) {
      return BadKey({"max_position_embeddings", "n_positions"},
                    absl::StrCat("missing; model_type ", t.name,
                                 " has learned position embeddings of that many rows"));
    }
    t.learned_positions = *positions;
  }
  if (auto it = j.find("tie_word_embeddings"); it != j.end()) {
    if (!it->is_boolean()) {
      return BadKey({"tie_word_embeddings"}, absl::StrCat(it->dump(), " is not true or false"));
    }
    t.tied_embeddings = it->get<bool>();
  }
  t.fused_qkv = IsOneOf(t.name, {"gpt2", "gpt_bigcode", "bloom", "gpt_neox"});
  const std::string act = StringOr(j, "hidden_act", StringOr(j, "activation_function", ""));
  t.gated_mlp = IsOneOf(act, {"silu", "swiglu", "swish"}) ||
                IsOneOf(t.name, {"llama", "mistral", "mixtral", "qwen2", "gemma", "gemma2", "phi3",
                                 "olmo", "internlm2", "yi"});
  if (sequence < 0 || micro_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: sequence ", sequence, " and micro-batch ", micro_batch,
                     ": a sequence length of at least 1 (0: the model's own, capped at 2048) and "
                     "a micro-batch of at least 1"));
  }
  if (sequence == 0) sequence = std::min<int64_t>(positions.value_or(2048), 2048);
  t.sequence = sequence;
  t.micro_batch = micro_batch;
  // Counted in double first: the int64 arithmetic below 10^15 cannot wrap.
  const double hd = static_cast<double>(t.head_dim()), h = static_cast<double>(t.hidden);
  const double layer = 2 * h * hd * static_cast<double>(t.heads + t.kv_heads) +
                       static_cast<double>(t.experts) * 3 * h * static_cast<double>(t.ffn);
  const double total = static_cast<double>(t.layers) * layer +
                       2 * h * static_cast<double>(t.vocab + t.learned_positions);
  if (total > 1e15) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: about ", total,
                     " parameters, more than strata plans for (10^15); check "
                     "num_hidden_layers, hidden_size, intermediate_size and vocab_size"));
  }
  return t;
}

}  // namespace strata::plan
