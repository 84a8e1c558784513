// planner/plan_model.h: the planner's model — a decoder-only transformer described by the keys of a
// Hugging Face config.json, and what it costs: parameters, FLOPs per token, activation bytes.
//
// Keys read (each under the names the common architectures use; the first present wins):
//   layers:  num_hidden_layers | n_layer | num_layers
//   hidden:  hidden_size | n_embd | d_model
//   heads:   num_attention_heads | n_head
//   kv heads: num_key_value_heads | num_kv_heads (default: heads; grouped-query attention; 1 when
//            multi_query is true)
//   head_dim (default hidden / heads; Gemma's differs)
//   experts: num_local_experts | num_experts (default 1: a dense MLP; else that many MLPs and a
//            router, num_experts_per_tok of them used per token)
//   ffn:     intermediate_size | n_inner | ffn_dim | d_ff (default 4 x hidden; null means default)
//   vocab:   vocab_size
//   positions: max_position_embeddings | n_positions (learned position embeddings are counted for
//            the architectures that have them: gpt2, opt, gpt_bigcode, bert, roberta)
//   tie_word_embeddings (Hugging Face's default: true), model_type, hidden_act.
// The MLP is gated (three hidden x ffn matrices, SwiGLU as in llama, mistral, qwen2, gemma) when
// hidden_act is "silu" or "swiglu" or model_type names such a family; else two matrices with
// biases (unless "bias" is false) and LayerNorm (gpt2, opt, bloom, gpt_neox). A missing required
// key, or one of the wrong type or out of range, is InvalidArgument naming the key and the names
// accepted; so is a model of more than 10^15 parameters.
//
// The cost model (docs/research/published-figures.md gives the sources):
//   parameters: per layer q and o (hidden^2 each), k and v (hidden x kv_heads x head_dim each),
//     the MLP, norms (and biases where the family has them); embeddings vocab x hidden (twice when
//     untied), learned positions, the final norm.
//   FLOPs per token, forward: 2 x (the layers' active matrix parameters + the output projection
//     vocab x hidden) + 4 x layers x sequence x hidden (attention scores and their weighted sum);
//     a training step is 3 forwards (forward and backward), 4 with activation checkpointing
//     (the forward again during backward). Model FLOPs (what TFLOPs figures quote) count 3.
//   Activations per layer in the training dtype (Korthikanti et al. 2022, Eq. 1, 16-bit):
//     sequence x batch x hidden x (34 + 5 x heads x sequence / hidden) bytes; with activation
//     checkpointing 2 x sequence x batch x hidden per layer kept, plus one layer's full set while
//     it is recomputed. Logits: sequence x batch x vocab x 4 bytes (fp32 for the loss).
//
// Thread safety: plain values and pure functions.
#ifndef STRATA_PLANNER_PLAN_MODEL_H_
#define STRATA_PLANNER_PLAN_MODEL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace strata::plan {

struct Transformer {
  std::string name;  // model_type, or what the caller names it
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  int64_t learned_positions = 0;  // rows of a learned position embedding (0: rotary or none)
  int64_t head_size = 0;          // hidden / heads unless the config says otherwise
  int64_t experts = 1, experts_per_token = 1;
  bool gated_mlp = false;  // SwiGLU: three hidden x ffn matrices, RMSNorm, no biases
  bool biases = true;      // the non-gated families' linear biases
  bool tied_embeddings = true;
  // q, k and v in one tensor (one module): gpt2's and gpt_bigcode's c_attn, bloom's and gpt_neox's
  // query_key_value.
  bool fused_qkv = false;
  int64_t sequence = 0, micro_batch = 1;
  // Memory-centric tiling (strata.tile_linears(model, tile_params), strata.TiledLinear): each of a
  // layer's matrices larger than this many parameters is cut into tiles of at most so many, each
  // its own partition, lent one at a time. 0: not tiled. The embeddings are not tiled.
  int64_t tile_params = 0;

  int64_t head_dim() const { return head_size > 0 ? head_size : hidden / heads; }
  // The matrix parameters of one layer (every expert's, and the router's).
  int64_t LayerMatrixParams() const;
  // Those a token multiplies by (num_experts_per_tok of the experts).
  int64_t LayerActiveMatrixParams() const;
  // Every parameter of one layer: matrices, biases, norms.
  int64_t LayerParams() const;
  // Embeddings (input, output when untied, learned positions) and the final norm.
  int64_t OuterParams() const;
  // The largest single parameter (one tensor, one partition in the Runtime): the embedding or an
  // MLP matrix (a mixture-of-experts layer's experts as one tensor, as transformers stores them).
  int64_t LargestParamParams() const;
  // The units a layer is lent in: 1, or with tiling its Linears' tiles (each matrix's
  // ceil(matrix / tile_params): q, k, v, o and the MLP's; a mixture of experts' expert tensors
  // are not tiled), each taking an equal share of the layer's parameters and compute in the
  // step's replay.
  int64_t LayerUnits() const;
  // The tensors of a layer's matrices, each a module's weight (what the trainer's front lends, and
  // across ranks gathers, a module at a time): q, k, v and o (q, k and v one tensor where fused),
  // the MLP's two or three (a mixture of experts' two expert tensors and its router); with tiling
  // the tiles (LayerUnits).
  int64_t LayerTensors() const;
  // The largest of those units (a layer, or the largest tile or untiled tensor), in parameters:
  // what the device must hold of a layer at once.
  int64_t LentUnitParams() const;
  int64_t TotalParams() const { return layers * LayerParams() + OuterParams(); }
  // Forward FLOPs for one token at this sequence length.
  double ForwardFlopsPerToken() const;
  // Activation bytes of one layer kept for backward (16-bit): all of them, or the checkpoint.
  double LayerActivationBytes() const;
  double CheckpointBytesPerLayer() const;
  double LogitBytes() const;
};

// From a Hugging Face config.json's contents; `sequence` and `micro_batch` as the trainer runs it
// (sequence 0: the model's max_position_embeddings, capped at 2048).
absl::StatusOr<Transformer> TransformerFromHfConfig(const nlohmann::json& config, int64_t sequence,
                                                    int64_t micro_batch);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_MODEL_H_
