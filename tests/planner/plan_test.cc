// The planner's model, hardware and memory arithmetic (planner/plan_*.h), on hand-checked cases.
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/plan_hardware.h"
#include "planner/plan_memory.h"
#include "planner/plan_model.h"
#include "planner/plan_time.h"

namespace strata::plan {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

Transformer Model(const Json& j, int64_t sequence = 1024, int64_t batch = 1) {
  auto t = TransformerFromHfConfig(j, sequence, batch);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : Transformer{};
}

TEST(PlanModelTest, Gpt2SmallHasItsPublishedParameterCount) {
  // gpt2's config.json: 124,439,808 parameters (tied embeddings, learned positions, biases).
  const Json gpt2 = {{"model_type", "gpt2"}, {"n_layer", 12},
                     {"n_embd", 768},        {"n_head", 12},
                     {"n_inner", nullptr},   {"vocab_size", 50257},
                     {"n_positions", 1024},  {"activation_function", "gelu_new"}};
  const Transformer t = Model(gpt2);
  EXPECT_FALSE(t.gated_mlp);
  EXPECT_EQ(t.ffn, 4 * 768);
  EXPECT_EQ(t.TotalParams(), 124439808);
}

TEST(PlanModelTest, Llama2SevenBHasItsPublishedParameterCount) {
  // Llama-2-7b-hf's config.json: 6,738,415,616 parameters (untied, SwiGLU, RMSNorm, no biases).
  const Json llama = {{"model_type", "llama"},        {"num_hidden_layers", 32},
                      {"hidden_size", 4096},          {"num_attention_heads", 32},
                      {"num_key_value_heads", 32},    {"intermediate_size", 11008},
                      {"vocab_size", 32000},          {"max_position_embeddings", 4096},
                      {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
  const Transformer t = Model(llama, 0);
  EXPECT_TRUE(t.gated_mlp);
  EXPECT_EQ(t.sequence, 2048);  // the model's own, capped
  EXPECT_EQ(t.TotalParams(), 6738415616);
}

TEST(PlanModelTest, GroupedQueryAttentionShrinksKeyAndValue) {
  Json j = {{"model_type", "llama"},    {"num_hidden_layers", 1},   {"hidden_size", 64},
            {"num_attention_heads", 8}, {"num_key_value_heads", 2}, {"intermediate_size", 128},
            {"vocab_size", 10}};
  const Transformer t = Model(j);
  // q and o 64x64; k and v 64 x (2 heads x 8); three 64x128 MLP matrices.
  EXPECT_EQ(t.LayerMatrixParams(), 2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 128);
}

TEST(PlanModelTest, FlopsAndActivationsFollowTheStatedFormulas) {
  const Json j = {{"model_type", "gpt_neox"}, {"num_hidden_layers", 2},    {"hidden_size", 256},
                  {"num_attention_heads", 4}, {"intermediate_size", 1024}, {"vocab_size", 1000}};
  const Transformer t = Model(j, 128, 2);
  const double matrices = 2.0 * (4 * 256 * 256 + 2 * 256 * 1024);  // two layers
  EXPECT_DOUBLE_EQ(t.ForwardFlopsPerToken(), 2 * (matrices + 1000.0 * 256) + 4.0 * 2 * 128 * 256);
  EXPECT_DOUBLE_EQ(t.LayerActivationBytes(), 128.0 * 2 * 256 * (34 + 5.0 * 4 * 128 / 256));
  EXPECT_DOUBLE_EQ(t.CheckpointBytesPerLayer(), 2.0 * 128 * 2 * 256);
  EXPECT_DOUBLE_EQ(t.LogitBytes(), 4.0 * 128 * 2 * 1000);
}

TEST(PlanModelTest, FamiliesWithTheirOwnShapesHaveTheirPublishedCounts) {
  // Mixtral-8x7B: 8 experts of Mistral's MLP and a router: 46,702,792,704 parameters.
  const Json mixtral = {{"model_type", "mixtral"},  {"num_hidden_layers", 32},
                        {"hidden_size", 4096},      {"num_attention_heads", 32},
                        {"num_key_value_heads", 8}, {"intermediate_size", 14336},
                        {"vocab_size", 32000},      {"num_local_experts", 8},
                        {"num_experts_per_tok", 2}, {"tie_word_embeddings", false}};
  EXPECT_EQ(Model(mixtral).TotalParams(), 46702792704);
  // A token goes through 2 of the 8 experts: its FLOPs count those (and the router), not all 8.
  const double active = 2.0 * 4096 * 4096 + 2.0 * 4096 * 1024 + 2 * 3.0 * 4096 * 14336 + 4096 * 8;
  EXPECT_DOUBLE_EQ(Model(mixtral, 1024).ForwardFlopsPerToken(),
                   2 * (32 * active + 32000.0 * 4096) + 4.0 * 32 * 1024 * 4096);
  // Gemma-7B: head_dim 256 where hidden / heads is 192; tied: 8,537,680,896.
  const Json gemma = {{"model_type", "gemma"},      {"num_hidden_layers", 28},
                      {"hidden_size", 3072},        {"num_attention_heads", 16},
                      {"num_key_value_heads", 16},  {"head_dim", 256},
                      {"intermediate_size", 24576}, {"vocab_size", 256000}};
  EXPECT_EQ(Model(gemma).TotalParams(), 8537680896);
  // StarCoder (gpt_bigcode, multi-query: one key/value head): 15,517,456,384.
  const Json starcoder = {{"model_type", "gpt_bigcode"},
                          {"n_layer", 40},
                          {"n_embd", 6144},
                          {"n_head", 48},
                          {"n_inner", 24576},
                          {"vocab_size", 49152},
                          {"n_positions", 8192},
                          {"multi_query", true}};
  EXPECT_EQ(Model(starcoder).TotalParams(), 15517456384);
}

TEST(PlanModelTest, AModelTooLargeToCountIsRefusedNotWrapped) {
  // hidden x ffn x layers beyond int64: refused, never a small wrapped count.
  const Json huge = {{"model_type", "llama"},  {"num_hidden_layers", 100000},
                     {"hidden_size", 1 << 20}, {"num_attention_heads", 1},
                     {"vocab_size", 1},        {"intermediate_size", int64_t{1} << 32}};
  auto t = TransformerFromHfConfig(huge, 1, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("more than strata plans for"));
}

TEST(PlanModelTest, BadModelsNameTheKeyAndWhatIsAccepted) {
  const Json good = {{"num_hidden_layers", 2},
                     {"hidden_size", 64},
                     {"num_attention_heads", 4},
                     {"vocab_size", 100}};
  struct Case {
    const char* key;
    Json value;  // null: removed
    const char* says;
  } cases[] = {
      {"num_hidden_layers", nullptr, "num_hidden_layers (or n_layer, num_layers): missing"},
      {"hidden_size", "64", "hidden_size: \"64\" is not a number"},
      {"num_attention_heads", 3, "3 does not divide the hidden size 64"},
      {"vocab_size", 1.5, "vocab_size: 1.5 is not a whole number"},
      {"num_hidden_layers", 0, "out of range; the number of transformer layers, an integer in [1"},
      {"tie_word_embeddings", "yes", "tie_word_embeddings: \"yes\" is not true or false"},
  };
  for (const Case& c : cases) {
    Json j = good;
    if (c.value.is_null()) {
      j.erase(c.key);
    } else {
      j[c.key] = c.value;
    }
    auto t = TransformerFromHfConfig(j, 16, 1);
    ASSERT_FALSE(t.ok()) << c.key;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr(c.says)) << t.status();
  }
  EXPECT_FALSE(TransformerFromHfConfig(Json::array(), 16, 1).ok());
  Json gpt2 = good;
  gpt2["model_type"] = "gpt2";
  EXPECT_THAT(TransformerFromHfConfig(gpt2, 16, 1).status().message(),
              HasSubstr("learned position embeddings"));
}

Json A100() {
  return {{"name", "test node"},
          {"gpu", {{"count", 1}, {"hbm_gib", 80}, {"tflops", 312}}},
          {"host", {{"ram_gib", 512}, {"cores", 32}, {"optimizer_gbps", 50}}},
          {"pcie", {{"to_device_gbps", 24}, {"to_host_gbps", 20}}},
          {"nvme", {{"drives", 4}, {"read_gbps", 6.5}, {"write_gbps", 5}, {"capacity_tb", 3.84}}}};
}

TEST(PlanHardwareTest, ReadsEveryKeyInItsUnits) {
  auto h = HardwareFromJson(A100());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->gpus, 1);
  EXPECT_DOUBLE_EQ(h->hbm_bytes, 80.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(h->gpu_flops, 312e12);
  EXPECT_DOUBLE_EQ(h->efficiency, 0.5);  // the default
  EXPECT_DOUBLE_EQ(h->host_bytes, 512.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(h->optimizer_bytes_per_s, 50e9);
  EXPECT_DOUBLE_EQ(h->pcie_to_device, 24e9);
  EXPECT_DOUBLE_EQ(h->pcie_to_host, 20e9);
  EXPECT_EQ(h->nvme_drives, 4);
  EXPECT_DOUBLE_EQ(h->nvme_read, 4 * 6.5e9);  // striped over the drives
  EXPECT_DOUBLE_EQ(h->nvme_write, 4 * 5e9);
  EXPECT_DOUBLE_EQ(h->nvme_bytes, 4 * 3.84e12);
  EXPECT_DOUBLE_EQ(h->nvme_commit_s, 0);  // the default
  Json committing = A100();
  committing["nvme"]["commit_ms"] = 1.5;
  EXPECT_DOUBLE_EQ(HardwareFromJson(committing)->nvme_commit_s, 1.5e-3);
  Json no_nvme = A100();
  no_nvme.erase("nvme");
  auto without = HardwareFromJson(no_nvme);
  ASSERT_TRUE(without.ok());
  EXPECT_FALSE(without->has_nvme());
}

TEST(PlanHardwareTest, BadDescriptionsNameTheKey) {
  struct Case {
    Json patch;  // merged into the description
    const char* says;
  } cases[] = {
      {{{"gpu", {{"hbm_gib", nullptr}}}}, "hardware: gpu.hbm_gib: missing"},
      {{{"host", {{"ram_gib", nullptr}, {"ram_gb", 512}}}}, "did you mean ram_gib?"},
      {{{"pcie", {{"to_device_gbps", -1}, {"to_host_gbps", 20}}}}, "hardware: pcie.to_device_gbps"},
      {{{"gpus", 2}}, "did you mean gpu?"},
      {{{"nvme", "fast"}}, "hardware: nvme: \"fast\" is not an object"},
      {{{"nvme", {{"commit_ms", -1}}}}, "hardware: nvme.commit_ms"},
  };
  for (const Case& c : cases) {
    Json j = A100();
    j.merge_patch(c.patch);
    auto h = HardwareFromJson(j);
    ASSERT_FALSE(h.ok()) << c.patch;
    EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(h.status().message(), HasSubstr(c.says)) << h.status();
  }
  Json no_host = A100();
  no_host.erase("host");
  EXPECT_THAT(HardwareFromJson(no_host).status().message(), HasSubstr("hardware: host: missing"));
}

// A 1.2B-parameter model (gpt_neox-like: two MLP matrices with biases, LayerNorm, untied).
Json OneB() {
  return {{"model_type", "gpt_neox"},    {"num_hidden_layers", 24},   {"hidden_size", 2048},
          {"num_attention_heads", 16},   {"intermediate_size", 8192}, {"vocab_size", 50304},
          {"tie_word_embeddings", false}};
}

Training Config(const Json& j) {
  std::vector<std::string> warnings;
  auto t = TrainingFromConfig(j, &warnings);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : Training{};
}

TEST(PlanMemoryTest, BytesPerTierAtEachStageAndOffloadChoiceMatchTheFormulas) {
  const Transformer m = Model(OneB(), 1024, 1);
  const double h = 2048, f = 8192, V = 50304, L = 24;
  const double layer = 4 * h * h + 2 * h * f + (5 * h + f) + 4 * h;
  const double psi = L * layer + 2 * V * h + 2 * h;
  ASSERT_EQ(m.TotalParams(), static_cast<int64_t>(psi));
  const double largest = V * h;  // the embedding is larger than a layer
  const double small = L * ((5 * h + f) + 4 * h);
  const Hardware hw = *HardwareFromJson(A100());
  const double acts = L * 2 * 1024 * h + 1024 * h * (34 + 5.0 * 16 * 1024 / h) + 4 * 1024 * V;

  struct Case {
    const char* name;
    Json zero;
    double device_params, device_grads, device_opt, host_params, host_grads, host_opt, host_staging,
        nvme_params, nvme_opt;
  } cases[] = {
      {"stage 0", {{"stage", 0}}, 2 * psi, 2 * psi, 12 * psi, 0, 0, 0, 0, 0, 0},
      {"stage 2, optimizer on cpu",
       {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}},
       2 * psi,
       2 * 2 * largest,
       0,
       0,
       4 * 2 * largest,
       12 * psi,
       0,
       0,
       0},
      {"stage 3, params and optimizer on cpu",
       {{"stage", 3},
        {"offload_param", {{"device", "cpu"}}},
        {"offload_optimizer", {{"device", "cpu"}}},
        {"stage3_max_live_parameters", 3e8}},
       2 * (3e8 + small),
       2 * 2 * largest,
       0,
       2 * psi,
       4 * 2 * largest,
       12 * psi,
       0,
       0,
       0},
      {"stage 3, both on nvme",
       {{"stage", 3},
        {"offload_param",
         {{"device", "nvme"}, {"nvme_path", "/x"}, {"buffer_count", 5}, {"buffer_size", 1e8}}},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}, {"buffer_count", 4}}},
        {"stage3_max_live_parameters", 3e8}},
       2 * (3e8 + small),
       2 * 2 * largest,
       0,
       2 * small,  // the step's new weights of the small unpartitioned ones (the rest: below)
       4 * 2 * largest,
       0,
       // The staging pool and the optimizer's ring; no read-ahead room ("auto": none where
       // nothing decides the step after backward, no clipping here).
       5 * 1e8 + 4 * 12 * largest,
       2 * psi,
       2 * 12 * psi},  // the crash-consistent second copy
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Training t = Config({{"bf16", {{"enabled", true}}}, {"zero_optimization", c.zero}});
    auto p = PlanMemory(m, hw, t);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_DOUBLE_EQ(p->device.params, c.device_params);
    EXPECT_DOUBLE_EQ(p->device.grads, c.device_grads);
    EXPECT_DOUBLE_EQ(p->device.optimizer, c.device_opt);
    EXPECT_DOUBLE_EQ(p->device.activations, acts);
    EXPECT_DOUBLE_EQ(p->host.params, c.host_params);
    EXPECT_DOUBLE_EQ(p->host.grads, c.host_grads);
    EXPECT_DOUBLE_EQ(p->host.optimizer, c.host_opt);
    EXPECT_DOUBLE_EQ(p->host.staging, c.host_staging);
    EXPECT_DOUBLE_EQ(p->nvme.params, c.nvme_params);
    EXPECT_DOUBLE_EQ(p->nvme.optimizer, c.nvme_opt);
    EXPECT_FALSE(p->overflow.has_value());
  }
}

// strata.optimizer_commit "partition": NVMe holds the optimizer state once and one partition more
// (the largest parameter's), not a second copy of the whole of it; and the state steps during
// backward only where host-resident state would (no clipping here: it does).
TEST(PlanMemoryTest, CommittingEachPartitionNeedsTheStateOnceAndOnePartitionOnNvme) {
  const Transformer m = Model(OneB(), 1024, 1);
  const Hardware hw = *HardwareFromJson(A100());
  const double psi = static_cast<double>(m.TotalParams());
  const double largest = static_cast<double>(m.LargestParamParams());
  Bytes host;  // the last plan's host row
  auto nvme_state = [&](const char* commit, double clipping) {
    const Training t = Config({{"bf16", {{"enabled", true}}},
                               {"gradient_clipping", clipping},
                               {"zero_optimization",
                                {{"stage", 3},
                                 {"offload_param", {{"device", "cpu"}}},
                                 {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}}},
                               {"strata", {{"optimizer_commit", commit}}}});
    auto p = PlanMemory(m, hw, t);
    EXPECT_TRUE(p.ok()) << p.status();
    auto time = PlanTime(m, hw, t, *p);
    EXPECT_TRUE(time.ok()) << time.status();
    int in_backward = 0;
    for (const Group& g : time->model.trace.groups) {
      in_backward += g.on_cpu && g.compute_s > 0 && g.phase == kBackward;
    }
    host = p->host;
    return std::make_pair(p->nvme.optimizer, in_backward);
  };
  EXPECT_DOUBLE_EQ(nvme_state("step", 1.0).first, 2 * 12 * psi);
  // The parameters' host copies (offload_param cpu) and the step's staged new weights.
  EXPECT_DOUBLE_EQ(host.params, 2 * psi + 2 * psi);
  // "auto": an eighth of the default host budget, with clipping to decide after backward.
  constexpr double kReadAhead = 1 << 29;
  EXPECT_DOUBLE_EQ(host.staging, 4 * 12 * largest + kReadAhead);
  EXPECT_DOUBLE_EQ(nvme_state("partition", 1.0).first, 12 * (psi + largest));
  // No staged copies: each goes out from the ring's copy buffer (fp32-sized) as it lands.
  EXPECT_DOUBLE_EQ(host.params, 2 * psi);
  EXPECT_DOUBLE_EQ(host.staging, 4 * (12 + 4) * largest + kReadAhead);
  EXPECT_EQ(nvme_state("step", 1.0).second, m.layers + 1);  // staged, dropped when it clips
  EXPECT_EQ(nvme_state("partition", 1.0).second, 0);        // after backward: it clips
  EXPECT_EQ(nvme_state("partition", 0.0).second, m.layers + 1);
}

// zero_optimization.sub_group_size: the NVMe optimizer's ring (and with optimizer_commit
// "partition" its room beyond the state) holds a sub-group when the largest parameter is larger,
// as Runtime::CreateOptimizer sets it aside.
TEST(PlanMemoryTest, SubGroupsBoundTheOptimizersRingAndItsCommitRoom) {
  const Transformer m = Model(OneB(), 1024, 1);
  const Hardware hw = *HardwareFromJson(A100());
  const double psi = static_cast<double>(m.TotalParams());
  const double largest = static_cast<double>(m.LargestParamParams());
  ASSERT_GT(largest, 1e7);
  for (const char* commit : {"step", "partition"}) {
    const bool each = std::string(commit) == "partition";
    Json zero = {{"stage", 3},
                 {"offload_param", {{"device", "cpu"}}},
                 {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}};
    const Training whole = Config({{"bf16", {{"enabled", true}}},
                                   {"zero_optimization", zero},
                                   {"strata", {{"optimizer_commit", commit}}}});
    zero["sub_group_size"] = 1e7;
    const Training cut = Config({{"bf16", {{"enabled", true}}},
                                 {"zero_optimization", zero},
                                 {"strata", {{"optimizer_commit", commit}}}});
    auto a = PlanMemory(m, hw, whole), b = PlanMemory(m, hw, cut);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_DOUBLE_EQ(a->host.staging - b->host.staging, 4 * (each ? 16 : 12) * (largest - 1e7))
        << commit;
    // With "partition", room for the store's largest blob beside the state: here the largest
    // parameter's partition (2 bytes an element), larger than a sub-group's state.
    EXPECT_DOUBLE_EQ(b->nvme.optimizer,
                     each ? 12 * psi + std::max(12 * 1e7, 2 * largest) : 2 * 12 * psi)
        << commit;
    EXPECT_GT(2 * largest, 12 * 1e7);
  }
}

// Memory-centric tiling (Transformer::tile_params, strata.tile_linears): a layer is lent in tiles,
// so the device holds two tiles in use (or the embeddings, when larger) instead of two layers,
// and the step's replay lends each tile alone, with its share of the layer's compute: the 1T
// shape that does not fit a V100 whole fits it tiled.
TEST(PlanMemoryTest, TilingLendsALayerInTilesSoTheDeviceHoldsTilesNotLayers) {
  Transformer m = Model({{"model_type", "gpt2"},
                         {"n_layer", 4},
                         {"n_embd", 25600},
                         {"n_head", 160},
                         {"vocab_size", 50257},
                         {"n_positions", 2048}},
                        2048, 1);
  Json hw_json = A100();
  hw_json["gpu"]["hbm_gib"] = 32;
  hw_json["nvme"] = {{"drives", 1}, {"capacity_tb", 4}, {"read_gbps", 6}, {"write_gbps", 3}};
  const Hardware hw = *HardwareFromJson(hw_json);
  const Training t = Config({{"fp16", {{"enabled", true}}},
                             {"zero_optimization",
                              {{"stage", 3},
                               {"sub_group_size", 1e8},
                               {"offload_param", {{"device", "nvme"}, {"nvme_path", "/x"}}},
                               {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}}},
                             {"strata", {{"optimizer_commit", "partition"}}}});
  auto whole = PlanMemory(m, hw, t);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(whole->overflow.has_value());
  EXPECT_EQ(whole->overflow->tier, "device");
  EXPECT_EQ(m.LayerUnits(), 1);
  m.tile_params = 1000000000;
  // Each Linear tiled alone, as tile_linears does: q, k, v and o (0.66e9: 1 tile each), the MLP's
  // two (2.62e9: 3 each).
  EXPECT_EQ(m.LayerUnits(), 10);
  EXPECT_EQ(m.LentUnitParams(), 1000000000);         // an MLP tile
  EXPECT_EQ(m.LargestParamParams(), 50257 * 25600);  // the embeddings, not tiled
  auto tiled = PlanMemory(m, hw, t);
  ASSERT_TRUE(tiled.ok()) << tiled.status();
  EXPECT_FALSE(tiled->overflow.has_value()) << tiled->overflow->tier;
  const double unit = 50257.0 * 25600;  // the largest unit lent: the embeddings
  EXPECT_DOUBLE_EQ(tiled->device.grads, 2 * 2 * unit);
  // and the small ones: biases and norms, 13 x hidden a layer
  EXPECT_DOUBLE_EQ(tiled->device.params, 2 * (2 * unit + 4 * 13 * 25600));
  auto time = PlanTime(m, hw, t, *tiled);
  ASSERT_TRUE(time.ok()) << time.status();
  const StepTrace& tr = time->model.trace;
  EXPECT_EQ(tr.partitions.size(), 3u * (4 * 10 + 1));
  EXPECT_EQ(tr.names[3 * 11], "the parameters of layer 1's tile 1");
  double forward = 0;
  for (const Group& g : tr.groups) forward += g.phase == kForward ? g.compute_s : 0;
  // The same flops as the untiled model's (on a GPU with room for it), in ten times the units.
  m.tile_params = 0;
  hw_json["gpu"]["hbm_gib"] = 80;
  const Hardware big = *HardwareFromJson(hw_json);
  auto unbounded = PlanMemory(m, big, t);
  ASSERT_TRUE(unbounded.ok() && !unbounded->overflow) << unbounded.status();
  auto whole_time = PlanTime(m, big, t, *unbounded);
  ASSERT_TRUE(whole_time.ok()) << whole_time.status();
  double whole_forward = 0;
  for (const Group& g : whole_time->model.trace.groups) {
    whole_forward += g.phase == kForward ? g.compute_s : 0;
  }
  EXPECT_NEAR(forward, whole_forward, 1e-9 * whole_forward);
  EXPECT_EQ(whole_time->model.trace.partitions.size(), 3u * (4 + 1));
  // A mixture of experts' expert weights are one tensor each (not Linears): never tiled, so
  // the device still holds them whole.
  Transformer moe = Model({{"model_type", "mixtral"},
                           {"num_hidden_layers", 2},
                           {"hidden_size", 4096},
                           {"intermediate_size", 14336},
                           {"num_attention_heads", 32},
                           {"num_key_value_heads", 8},
                           {"vocab_size", 32000},
                           {"num_local_experts", 8},
                           {"num_experts_per_tok", 2}},
                          1024, 1);
  const int64_t experts = int64_t{8} * 2 * 4096 * 14336;  // gate and up, fused
  EXPECT_EQ(moe.LargestParamParams(), experts);
  moe.tile_params = 100000000;
  EXPECT_EQ(moe.LentUnitParams(), experts);
  EXPECT_EQ(moe.LargestParamParams(), experts);
  EXPECT_EQ(moe.LayerUnits(), 1 + 1 + 1 + 1 + 2 + 1);  // q, k, v, o; two expert tensors; router
}

TEST(PlanMemoryTest, Fp32TrainingKeepsEightBytesOfStateAndAccumulatedGradientsStayInTheHost) {
  const Transformer m = Model(OneB(), 1024, 1);
  const double psi = static_cast<double>(m.TotalParams());
  const Training t =
      Config({{"gradient_accumulation_steps", 4},
              {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}});
  EXPECT_EQ(t.dtype_bytes, 4);
  auto p = PlanMemory(m, *HardwareFromJson(A100()), t);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->host.optimizer, 8 * psi);
  EXPECT_DOUBLE_EQ(p->host.grads, 4 * psi);
}

TEST(PlanMemoryTest, NvmeOptimizerStateKeepsTheCrashConsistentSecondCopyAndParamCopies) {
  // As Runtime::CreateOptimizer sets aside: twice the state on NVMe (the step writes a new copy
  // before the old one is given up) and 2 bytes per element in the host for the param copies.
  const Transformer m = Model(OneB(), 1024, 1);
  const double psi = static_cast<double>(m.TotalParams());
  const Training t =
      Config({{"bf16", {{"enabled", true}}},
              {"zero_optimization",
               {{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}}}});
  auto p = PlanMemory(m, *HardwareFromJson(A100()), t);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->nvme.optimizer, 2 * 12 * psi);
  EXPECT_DOUBLE_EQ(p->host.params, 2 * psi);
}

TEST(PlanMemoryTest, TheSmallestHostBudgetIsTheStagingTheRingAtItsSmallestAndAPartition) {
  // ZeRO-Infinity: what strata.initialize refuses below and check_config says, from the model's
  // sizes (RuntimeConfig::MinimumHost): far below the state.
  const Transformer m = Model(OneB(), 1024, 1);
  const double psi = static_cast<double>(m.TotalParams());
  const Training t = Config({{"bf16", {{"enabled", true}}},
                             {"zero_optimization",
                              {{"stage", 3},
                               {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}},
                               {"offload_param",
                                {{"device", "nvme"},
                                 {"nvme_path", "/x"},
                                 {"buffer_count", 4},
                                 {"buffer_size", 1 << 24}}}}},
                             {"strata", {{"host_budget_bytes", 1ull << 30}}}});
  auto p = PlanMemory(m, *HardwareFromJson(A100()), t);
  ASSERT_TRUE(p.ok()) << p.status();
  const auto& least = p->host_minimum;
  EXPECT_EQ(least.staging, 4u << 24);
  const double largest = static_cast<double>(m.LargestParamParams());
  EXPECT_DOUBLE_EQ(static_cast<double>(least.partition), 4 * largest + 2 * largest);
  EXPECT_LT(static_cast<double>(least.total()), 12 * psi / 4);
  EXPECT_LT(least.total(), 1ull << 30);
}

TEST(PlanMemoryTest, ActivationsAreInTheTrainingDtype) {
  const Transformer m = Model(OneB(), 1024, 1);
  const Hardware hw = *HardwareFromJson(A100());
  auto fp32 = PlanMemory(m, hw, Config({{"zero_optimization", {{"stage", 0}}}}));
  auto bf16 = PlanMemory(m, hw, Config({{"bfloat16", {{"enabled", true}}}}));
  ASSERT_TRUE(fp32.ok() && bf16.ok());
  EXPECT_DOUBLE_EQ(fp32->activations_full, 2 * bf16->activations_full);
  EXPECT_DOUBLE_EQ(fp32->device.activations, 2 * bf16->device.activations);
}

TEST(PlanMemoryTest, SeveralGpusDivideTheStatesByStage) {
  const Transformer m = Model(OneB(), 1024, 1);
  const double psi = static_cast<double>(m.TotalParams());
  Json node = A100();
  node["gpu"]["count"] = 8;
  const Hardware hw = *HardwareFromJson(node);
  const Training s1 =
      Config({{"bf16", {{"enabled", true}}}, {"zero_optimization", {{"stage", 1}}}});
  auto p = PlanMemory(m, hw, s1);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->device.optimizer, 12 * psi / 8);
  EXPECT_DOUBLE_EQ(p->device.grads, 2 * psi);
  const Training s2 =
      Config({{"bf16", {{"enabled", true}}}, {"zero_optimization", {{"stage", 2}}}});
  p = PlanMemory(m, hw, s2);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->device.grads, 2 * psi / 8 + 2 * 50304.0 * 2048);
}

TEST(PlanMemoryTest, TheFirstTierOverItsCapacityIsNamedWithHowMuch) {
  const Transformer m = Model(OneB(), 1024, 1);
  Json small = A100();
  small["gpu"]["hbm_gib"] = 8;
  const Training t = Config({{"bf16", {{"enabled", true}}}, {"zero_optimization", {{"stage", 0}}}});
  auto p = PlanMemory(m, *HardwareFromJson(small), t);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->overflow.has_value());
  EXPECT_EQ(p->overflow->tier, "device");
  EXPECT_DOUBLE_EQ(p->overflow->need, p->device.total());
  EXPECT_DOUBLE_EQ(p->overflow->have, 8.0 * (1 << 30));
  // Without checkpointing the activations are larger.
  EXPECT_GT(p->activations_full, p->activations_checkpointed);
}

TEST(PlanMemoryTest, OffloadingToATierTheHardwareLacksIsRefused) {
  const Transformer m = Model(OneB(), 1024, 1);
  Json node = A100();
  node.erase("nvme");
  const Training t =
      Config({{"zero_optimization",
               {{"stage", 3}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}}}});
  auto p = PlanMemory(m, *HardwareFromJson(node), t);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(p.status().message(),
              HasSubstr("zero_optimization.offload_optimizer.device: nvme, but the hardware"));
}

TEST(PlanMemoryTest, TheConfigsTrainingKeysAreReadAndBadOnesNamed) {
  std::vector<std::string> warnings;
  auto t = TrainingFromConfig({{"bf16", {{"enabled", true}}},
                               {"train_micro_batch_size_per_gpu", 4},
                               {"gradient_accumulation_steps", 2},
                               {"gradient_clipping", 1.0}},
                              &warnings);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype_bytes, 2);
  EXPECT_EQ(t->micro_batch, 4);
  EXPECT_EQ(t->gradient_accumulation, 2);
  // The keys read here are not reported as unused; the others are.
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("gradient_clipping"));
  EXPECT_THAT(
      TrainingFromConfig({{"bf16", {{"enabled", true}}}, {"fp16", {{"enabled", true}}}}, nullptr)
          .status()
          .message(),
      HasSubstr("enable one of them"));
  EXPECT_THAT(
      TrainingFromConfig({{"train_micro_batch_size_per_gpu", "auto"}}, nullptr).status().message(),
      HasSubstr("train_micro_batch_size_per_gpu"));
  EXPECT_THAT(TrainingFromConfig({{"bf16", {{"enabled", "auto"}}}}, nullptr).status().message(),
              HasSubstr("bf16.enabled: \"auto\""));
  EXPECT_THAT(TrainingFromConfig({{"zero_optimization",
                                   {{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}}}}}},
                                 nullptr)
                  .status()
                  .message(),
              HasSubstr("needs a ZeRO stage of 1 or more"));
}

TEST(PlanTimeTest, AStepThatFitsOnTheGpuTakesItsFlopsAtTheGivenEfficiency) {
  // Stage 0, nothing offloaded, bf16, activation checkpointing: nothing crosses a link, so the step
  // is its compute (the header's cost model, written out here) and equals its lower bound.
  const Transformer m = Model(OneB(), 1024, 2);
  const Hardware hw = *HardwareFromJson(A100());
  const Training t = Config({{"bf16", {{"enabled", true}}}, {"train_micro_batch_size_per_gpu", 2}});
  auto mem = PlanMemory(m, hw, t);
  ASSERT_TRUE(mem.ok() && !mem->overflow);
  auto time = PlanTime(m, hw, t, *mem);
  ASSERT_TRUE(time.ok()) << time.status();
  const double h = 2048, f = 8192, V = 50304, L = 24, tok = 1024 * 2, rate = 312e12 * 0.5;
  const double layer_fwd = (2 * (4 * h * h + 2 * h * f) * tok + 4 * 1024 * h * tok) / rate;
  const double head_fwd = 2 * V * h * tok / rate;
  const double psi = static_cast<double>(m.TotalParams());
  const double optimizer = 28 * psi / 1.5e12;  // on the GPU at the default 1500 GB/s
  const double want = L * layer_fwd * (1 + 3) + head_fwd * (1 + 2) + optimizer;
  EXPECT_NEAR(time->step.step_s, want, 1e-9 * want);
  EXPECT_NEAR(time->step.bound.seconds(), want, 1e-9 * want);
  EXPECT_EQ(time->step.bytes[kToDevice] + time->step.bytes[kNvmeRead], 0);
  EXPECT_NEAR(time->tokens_per_s, tok / want, 1e-6 * tok / want);
  EXPECT_NEAR(time->model_tflops_per_gpu, 3 * m.ForwardFlopsPerToken() * tok / want / 1e12, 1e-9);
}

TEST(PlanTimeTest, OffloadingToNvmeWithALowHostBudgetMovesTheStateEveryStep) {
  const Transformer m = Model(OneB(), 1024, 1);
  const Hardware hw = *HardwareFromJson(A100());
  Json c = {{"bf16", {{"enabled", true}}},
            {"zero_optimization",
             {{"stage", 3},
              {"offload_param", {{"device", "nvme"}, {"nvme_path", "/x"}}},
              {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}}},
            {"strata", {{"host_budget_bytes", 4000000000}}}};
  const Training t = Config(c);
  auto mem = PlanMemory(m, hw, t);
  ASSERT_TRUE(mem.ok() && !mem->overflow);
  auto time = PlanTime(m, hw, t, *mem);
  ASSERT_TRUE(time.ok()) << time.status();
  EXPECT_EQ(time->model.budgets.host, 4000000000u);
  const double state = 12.0 * m.TotalParams();
  // At least the state that does not fit the host's 4 GB is read and written back each step.
  EXPECT_GE(time->step.bytes[kNvmeRead], state - 4e9);
  EXPECT_GE(time->step.bytes[kNvmeWrite], state - 4e9);
  EXPECT_GE(time->step.step_s, time->step.bound.seconds() - 1e-12);
  EXPECT_GE(time->step.bound.seconds(), (state - 4e9) / (4 * 6.5e9));  // the disk's reads alone
  // Too little room for the embeddings' optimizer state names it.
  c["strata"]["host_budget_bytes"] = 2000000000;
  const Training tight = Config(c);
  auto refused = PlanTime(m, hw, tight, *PlanMemory(m, hw, tight));
  EXPECT_THAT(refused.status().message(),
              HasSubstr("(the optimizer state of the embeddings and head), 2472591360 bytes, does "
                        "not fit the host tier's budget of 2000000000 bytes"));
  double waited = 0;
  for (double w : time->step.waits_s) waited += w;
  EXPECT_GT(waited, 0);
  // A write-back's commit (the store's syncs) is in the lanes and lengthens the step, where the
  // store syncs: only with its files kept (strata.nvme_keep_files).
  Json slow = A100();
  slow["nvme"]["commit_ms"] = 100;
  const Hardware committing = *HardwareFromJson(slow);
  auto unsynced = PlanTime(m, committing, t, *PlanMemory(m, committing, t));
  ASSERT_TRUE(unsynced.ok()) << unsynced.status();
  EXPECT_EQ(unsynced->model.lanes.nvme_commit_s, 0.0);
  EXPECT_DOUBLE_EQ(unsynced->step.step_s, time->step.step_s);
  Training kept = t;
  kept.runtime.nvme_keep_files = true;
  auto longer = PlanTime(m, committing, kept, *PlanMemory(m, committing, kept));
  ASSERT_TRUE(longer.ok()) << longer.status();
  EXPECT_DOUBLE_EQ(longer->model.lanes.nvme_commit_s, 0.1);
  EXPECT_GT(longer->step.step_s, time->step.step_s);
}

// Parameters homed on NVMe: beyond offload_param.max_in_cpu (or when twice their copies do not fit
// half the host budget) the host holds none of their weights, and after the commit each one's
// state is read back whole for its new weights (the front's _refresh_weights): 12 more bytes a
// parameter read from NVMe each step. Within it the Runtime keeps their host copies and the step
// stages their new weights in the host (2 bytes a parameter each), and reads nothing back.
TEST(PlanTimeTest, ParametersOnNvmeTakeTheirNewWeightsFromTheMasterWeightsBeyondMaxInCpu) {
  const Transformer m = Model(OneB(), 1024, 1);
  const Hardware hw = *HardwareFromJson(A100());
  const double psi = static_cast<double>(m.TotalParams());
  const double small = static_cast<double>(m.layers) * (m.LayerParams() - m.LayerMatrixParams());
  auto plan = [&](double max_in_cpu, const char* commit = "step", double clipping = 0) {
    Json c = {
        {"bf16", {{"enabled", true}}},
        {"gradient_clipping", clipping},
        {"zero_optimization",
         {{"stage", 3},
          {"offload_param", {{"device", "nvme"}, {"nvme_path", "/x"}, {"max_in_cpu", max_in_cpu}}},
          {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}}},
        {"strata", {{"host_budget_bytes", 64e9}, {"optimizer_commit", commit}}}};
    const Training t = Config(c);
    auto mem = PlanMemory(m, hw, t);
    EXPECT_TRUE(mem.ok()) << mem.status();
    auto time = PlanTime(m, hw, t, *mem);
    EXPECT_TRUE(time.ok()) << time.status();
    return std::make_pair(*mem, time->step);
  };
  const auto [kept_mem, kept] = plan(1e12);
  EXPECT_FALSE(kept_mem.weights_from_master);
  EXPECT_DOUBLE_EQ(kept_mem.host.params, 2 * 2 * psi);  // host copies, and the step's staged ones
  const auto [streamed_mem, streamed] = plan(1e9);
  ASSERT_GT(psi - small, 1e9);
  EXPECT_TRUE(streamed_mem.weights_from_master);
  EXPECT_DOUBLE_EQ(streamed_mem.host.params, 2 * small);
  // The state read back after the commit (12 bytes a parameter, the small ones' too: they are
  // counted with their units); the state written once either way.
  EXPECT_NEAR(streamed.bytes[kNvmeRead] - kept.bytes[kNvmeRead], 12 * psi, 0.02 * 12 * psi);
  EXPECT_GE(streamed.bytes[kNvmeWrite], 12 * psi);
  EXPECT_GT(streamed.step_s, kept.step_s);
  // strata.optimizer_commit "partition" with the step after backward (clipping): the optimizer's
  // thread writes the new weights into their partitions as each state lands; nothing read back.
  const auto [each_mem, each] = plan(1e9, "partition", 1.0);
  EXPECT_TRUE(each_mem.weights_from_master);
  EXPECT_LT(each.bytes[kNvmeRead], streamed.bytes[kNvmeRead] - 10 * psi);
  // And with the step during backward (no clipping): the same, as each state lands then.
  const auto [during_mem, during] = plan(1e9, "partition", 0.0);
  EXPECT_TRUE(during_mem.weights_from_master);
  EXPECT_LT(during.bytes[kNvmeRead], streamed.bytes[kNvmeRead] - 10 * psi);
}

// The optimizer's state in host memory steps after backward, as the trainer's front does it by
// default (its steps in the optimizer phase, the step waiting for them), unless
// strata.optimizer_during_backward lets it step during backward, which clipping forbids; state on
// NVMe steps during backward (the staged step). Its default ("auto") is on for a GPU, which the
// planner models. The same model, hardware and budgets each time.
TEST(PlanTimeTest, HostResidentOptimizerStateStepsAfterBackwardUnlessItMayStepDuringIt) {
  const Transformer m = Model(OneB(), 1024, 1);
  const Hardware hw = *HardwareFromJson(A100());
  auto plan = [&](const std::string& where, Json during, double clipping) {
    Json c = {{"bf16", {{"enabled", true}}},
              {"gradient_clipping", clipping},
              {"zero_optimization",
               {{"stage", 3},
                {"offload_param", {{"device", "cpu"}}},
                {"offload_optimizer", {{"device", where}, {"nvme_path", "/x"}}}}},
              {"strata", {{"optimizer_during_backward", during}}}};
    if (during.is_null()) c.erase("strata");
    const Training t = Config(c);
    auto time = PlanTime(m, hw, t, *PlanMemory(m, hw, t));
    EXPECT_TRUE(time.ok()) << time.status();
    int in_backward = 0, after = 0;
    for (const Group& g : time->model.trace.groups) {
      if (!g.on_cpu || g.compute_s == 0) continue;
      (g.phase == kOptimizer ? after : in_backward) += 1;
    }
    return std::make_tuple(in_backward, after, time->step.step_s);
  };
  const auto [b0, a0, after_s] = plan("cpu", false, 0.0);
  EXPECT_EQ(b0, 0);
  EXPECT_EQ(a0, m.layers + 1);
  const auto [b1, a1, during_s] = plan("cpu", true, 0.0);
  EXPECT_EQ(b1, m.layers + 1);
  EXPECT_EQ(a1, 0);
  EXPECT_LT(during_s, after_s);  // the optimizer hidden behind backward
  const auto [b_auto, a_auto, auto_s] = plan("cpu", Json(), 0.0);
  EXPECT_EQ(b_auto, m.layers + 1);
  EXPECT_EQ(a_auto, 0);
  EXPECT_DOUBLE_EQ(auto_s, during_s);
  const auto [b2, a2, clipped_s] = plan("cpu", true, 1.0);
  EXPECT_EQ(b2, 0);
  EXPECT_DOUBLE_EQ(clipped_s, after_s);
  const auto [b3, a3, nvme_s] = plan("nvme", false, 1.0);
  EXPECT_EQ(b3, m.layers + 1);
  EXPECT_EQ(a3, 0);
  EXPECT_THAT(TrainingFromConfig({{"gradient_clipping", -1}}, nullptr).status().message(),
              HasSubstr("gradient_clipping"));
}

TEST(PlanTimeTest, SuggestKeepsASmallModelOnTheGpuAndOffloadsABigOne) {
  const Hardware hw = *HardwareFromJson(A100());
  const Training base = Config({{"bf16", {{"enabled", true}}}});
  auto small = Suggest(Model(OneB(), 1024, 1), hw, base);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->training.runtime.offload_optimizer.device, tiering::OffloadDevice::kNone);
  EXPECT_GT(small->fitting, 0);
  // Llama-2-13B in bf16 does not fit 80 GB with Adam's state on the GPU: the state moves out.
  Json l13 = {{"model_type", "llama"},       {"num_hidden_layers", 40},    {"hidden_size", 5120},
              {"num_attention_heads", 40},   {"intermediate_size", 13824}, {"vocab_size", 32000},
              {"tie_word_embeddings", false}};
  auto big = Suggest(Model(l13, 2048, 1), hw, base);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_NE(big->training.runtime.offload_optimizer.device, tiering::OffloadDevice::kNone);
  EXPECT_FALSE(big->memory.overflow);
  // The block reads back as a config that plans the same.
  const Json block = SuggestionConfig(*big);
  // A GPU's config (strata.device "cuda"): the optimizer during backward ("auto") as planned.
  EXPECT_EQ(block["strata"]["device"], "cuda");
  Training again = Config(block);
  EXPECT_TRUE(again.runtime.OptimizerDuringBackward());
  again.activation_checkpointing = big->training.activation_checkpointing;
  EXPECT_EQ(again.runtime.zero_stage, big->training.runtime.zero_stage);
  EXPECT_EQ(again.micro_batch, big->training.micro_batch);
  auto mem = PlanMemory(big->model, hw, again);
  ASSERT_TRUE(mem.ok());
  EXPECT_FALSE(mem->overflow);
  // Nothing fits a 1 GiB GPU with 1 GiB of host memory and no NVMe.
  Json tiny = A100();
  tiny["gpu"]["hbm_gib"] = 1;
  tiny["host"]["ram_gib"] = 1;
  tiny.erase("nvme");
  auto none = Suggest(Model(l13, 2048, 1), *HardwareFromJson(tiny), base);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("both strata.optimizer_commit modes"));
  // 64 GiB of host memory leaves Adam's state (156 GB) to NVMe, and 0.25 TB of NVMe holds it once
  // but not twice: the suggestion commits each partition, and says so in its config.
  Json small_disk = A100();
  small_disk["host"]["ram_gib"] = 64;
  small_disk["nvme"]["drives"] = 1;
  small_disk["nvme"]["capacity_tb"] = 0.25;
  auto each = Suggest(Model(l13, 2048, 1), *HardwareFromJson(small_disk), base);
  ASSERT_TRUE(each.ok()) << each.status();
  EXPECT_EQ(each->training.runtime.offload_optimizer.device, tiering::OffloadDevice::kNvme);
  EXPECT_TRUE(each->training.runtime.optimizer_commit_each);
  EXPECT_EQ(SuggestionConfig(*each)["strata"]["optimizer_commit"], "partition");
  // Where the state fits twice, the default commit stays.
  EXPECT_FALSE(big->training.runtime.optimizer_commit_each);
}

}  // namespace
}  // namespace strata::plan
