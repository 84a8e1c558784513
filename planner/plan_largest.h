// planner/plan_largest.h: the largest model of one family a machine trains with a config: what
// strata_plan --largest answers ("which Llama-shaped model is the largest this GPU machine
// fine-tunes, its state offloaded?").
//
// The family is examples/llama.py's, the model bench/bigger_than_ram.py builds: transformers'
// LlamaForCausalLM `width` wide in steps of 256, width / 128 attention heads (half as many
// key-value heads), width / 128 decoder layers (Llama-2 7B's proportions: 4096 wide, 32 layers;
// at least 2), an MLP 8/3 as wide rounded up to 64, an untied head, `vocab` tokens. A member fits
// when PlanMemory finds room for it in every tier with the config given (with `suggest`, when
// Suggest finds a configuration that fits: stage, offload, micro-batch, checkpointing). Every
// tier's bytes grow with the width, so whether a member fits is monotone in it and the search
// bisects the widths.
//
// Thread safety: pure functions.
#ifndef STRATA_PLANNER_PLAN_LARGEST_H_
#define STRATA_PLANNER_PLAN_LARGEST_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "planner/plan_hardware.h"
#include "planner/plan_memory.h"
#include "planner/plan_model.h"

namespace strata::plan {

struct LargestOptions {
  int64_t vocab = 32000;      // Llama-2's
  int64_t sequence = 2048;    // tokens a sequence (max_position_embeddings)
  int64_t max_width = 32768;  // the widest tried (a member of about 3.0T parameters)
  bool suggest = false;       // a configuration searched for each member, not the given one
};

// The family's member `width` wide, as a Hugging Face config.json (LlamaConfig's keys).
nlohmann::json LlamaShaped(int64_t width, int64_t vocab, int64_t sequence);

// What training a model holds across the tiers: its weights and gradients in the training dtype,
// and in 16-bit training the fp32 master weights too, and Adam's two fp32 moments.
double TrainingStateBytes(const Transformer& model, const Training& training);

struct Largest {
  nlohmann::json hf_config;  // the member's config.json
  Transformer model;         // as the planner reads it (at the config's micro-batch)
  Training training;         // the config it fits with: the one given, or Suggest's
  int64_t width = 0, layers = 0, heads = 0;
  int tried = 0;  // members planned
  // The member one step wider (width + 256): the first tier it does not fit, and the bytes it
  // needs there and has; none when the search reached max_width.
  std::optional<MemoryPlan::Overflow> wider_refused;
};

// InvalidArgument for options out of range (vocab, sequence at least 1; max_width 512 or more);
// NotFound when the narrowest member (512 wide) does not fit, naming the tier that refuses it.
absl::StatusOr<Largest> FindLargest(const Hardware& hardware, const Training& training,
                                    const LargestOptions& options);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_LARGEST_H_
