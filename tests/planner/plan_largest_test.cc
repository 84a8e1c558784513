// planner/plan_largest.h: the family's shape, the training state's bytes, and the search checked
// against planning every width of the family one by one.
#include "planner/plan_largest.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/plan_hardware.h"
#include "planner/plan_memory.h"

namespace strata::plan {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

Hardware Machine(double hbm_gib, double ram_gib, double disk_gb) {
  Json j = {{"name", "test"},
            {"gpu", {{"count", 1}, {"hbm_gib", hbm_gib}, {"tflops", 100}}},
            {"host", {{"ram_gib", ram_gib}, {"cores", 8}, {"optimizer_gbps", 10}}},
            {"pcie", {{"to_device_gbps", 20}, {"to_host_gbps", 20}}}};
  if (disk_gb > 0) {
    j["nvme"] = {
        {"drives", 1}, {"read_gbps", 2}, {"write_gbps", 1}, {"capacity_tb", disk_gb / 1e3}};
  }
  auto hw = HardwareFromJson(j);
  EXPECT_TRUE(hw.ok()) << hw.status();
  return *hw;
}

Training Config(const Json& j) {
  std::vector<std::string> warnings;
  auto t = TrainingFromConfig(j, &warnings);
  EXPECT_TRUE(t.ok()) << t.status();
  return *t;
}

const Json kZero3Offloaded = {
    {"bf16", {{"enabled", true}}},
    {"zero_optimization",
     {{"stage", 3},
      {"offload_param", {{"device", "cpu"}}},
      {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/tmp/plan"}}}}}};

TEST(PlanLargestTest, TheFamilyIsExamplesLlamaShape) {
  // examples/llama.py's llama(32, 4096, 32, 2048, vocab=32000): Llama-2 7B's proportions, half as
  // many key-value heads, an MLP of ceil(8 x 4096 / 3 / 64) x 64 = 10944.
  const Json j = LlamaShaped(4096, 32000, 2048);
  EXPECT_EQ(j["hidden_size"], 4096);
  EXPECT_EQ(j["num_hidden_layers"], 32);
  EXPECT_EQ(j["num_attention_heads"], 32);
  EXPECT_EQ(j["num_key_value_heads"], 16);
  EXPECT_EQ(j["intermediate_size"], 10944);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  auto t = TransformerFromHfConfig(j, 0, 1);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->gated_mlp);
  EXPECT_EQ(t->sequence, 2048);
  // 32 layers of q, o (4096^2 each), k, v (4096 x 2048 each), the MLP (3 x 4096 x 10944) and
  // two norms, the untied embeddings (2 x 32000 x 4096) and the final norm.
  const int64_t layer = 2 * 4096 * 4096 + 2 * 4096 * 2048 + 3 * 4096 * 10944 + 2 * 4096;
  EXPECT_EQ(t->TotalParams(), 32 * layer + 2 * 32000 * 4096 + 4096);
  EXPECT_EQ(LlamaShaped(512, 256, 128)["num_hidden_layers"], 4);
  EXPECT_EQ(LlamaShaped(256, 256, 128)["num_hidden_layers"], 2);  // at least 2
}

TEST(PlanLargestTest, TheTrainingStateIsSixteenBytesAParameter) {
  auto t = TransformerFromHfConfig(LlamaShaped(1024, 256, 128), 0, 1);
  ASSERT_TRUE(t.ok());
  const double params = static_cast<double>(t->TotalParams());
  // bf16: weights 2 + gradients 2 + fp32 master weights 4 + moments 8; fp32: 4 + 4 + 8.
  EXPECT_EQ(TrainingStateBytes(*t, Config(kZero3Offloaded)), 16 * params);
  EXPECT_EQ(TrainingStateBytes(*t, Config(Json::object())), 16 * params);
}

// The bisection's answer is the family's largest member that fits: it fits, the next does not,
// each planned directly (and so every narrower one fits: checked on every width up to it).
TEST(PlanLargestTest, TheAnswerFitsAndTheNextWiderDoesNot) {
  const Hardware hw = Machine(24, 64, 200);
  const Training training = Config(kZero3Offloaded);
  LargestOptions o;
  o.vocab = 256;
  o.sequence = 128;
  o.max_width = 8192;
  auto found = FindLargest(hw, training, o);
  ASSERT_TRUE(found.ok()) << found.status();
  auto fits = [&](int64_t width) {
    auto m = TransformerFromHfConfig(LlamaShaped(width, o.vocab, o.sequence), o.sequence,
                                     training.micro_batch);
    EXPECT_TRUE(m.ok());
    auto plan = PlanMemory(*m, hw, training);
    EXPECT_TRUE(plan.ok());
    return !plan->overflow.has_value();
  };
  for (int64_t w = 512; w <= found->width; w += 256) EXPECT_TRUE(fits(w)) << w;
  EXPECT_FALSE(fits(found->width + 256));
  EXPECT_GT(found->width, 512);
  EXPECT_LT(found->width, 8192);
  ASSERT_TRUE(found->wider_refused.has_value());
  EXPECT_EQ(found->wider_refused->tier, "nvme");  // the optimizer state, 24 bytes a parameter
  EXPECT_GT(found->wider_refused->need, found->wider_refused->have);
  EXPECT_EQ(found->layers, found->width / 128);
  EXPECT_LE(found->tried, 2 + 6);  // the two ends and a bisection of 30 widths
  // With the state in host memory the host tier bounds it instead.
  const Training on_host = Config({{"bf16", {{"enabled", true}}},
                                   {"zero_optimization",
                                    {{"stage", 3},
                                     {"offload_param", {{"device", "cpu"}}},
                                     {"offload_optimizer", {{"device", "cpu"}}}}}});
  auto host_bound = FindLargest(hw, on_host, o);
  ASSERT_TRUE(host_bound.ok()) << host_bound.status();
  EXPECT_EQ(host_bound->wider_refused->tier, "host");
}

TEST(PlanLargestTest, SuggestSearchesTheConfigurationsToo) {
  // No NVMe, a small host: the given config (the optimizer on a disk the machine lacks is not
  // given here: stage 0, nothing offloaded) holds less than what --suggest finds.
  const Hardware hw = Machine(16, 256, 0);
  const Training plain = Config({{"bf16", {{"enabled", true}}}});
  LargestOptions o;
  o.vocab = 256;
  o.sequence = 128;
  o.max_width = 8192;
  auto given = FindLargest(hw, plain, o);
  o.suggest = true;
  auto searched = FindLargest(hw, plain, o);
  ASSERT_TRUE(given.ok()) << given.status();
  ASSERT_TRUE(searched.ok()) << searched.status();
  EXPECT_GT(searched->width, given->width);
  EXPECT_GT(searched->training.runtime.zero_stage, 0);  // offloaded, which stage 0 cannot
}

TEST(PlanLargestTest, NothingThatFitsAndBadOptionsAreNamed) {
  const Hardware tiny = Machine(0.25, 0.25, 0);
  LargestOptions o;
  o.vocab = 1000000;  // the embeddings alone: 2 x 512 x 10^6 parameters, 16 GB of state
  o.sequence = 128;
  auto none = FindLargest(tiny, Config({{"bf16", {{"enabled", true}}}}), o);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(none.status().message()),
              HasSubstr("the narrowest (512 wide, 4 layers) needs "));
  EXPECT_THAT(std::string(none.status().message()), HasSubstr(" GB of the device tier's 0.27 GB"));
  for (auto [vocab, sequence, widest] :
       {std::tuple{0, 128, 1024}, std::tuple{256, 0, 1024}, std::tuple{256, 128, 256}}) {
    LargestOptions bad;
    bad.vocab = vocab;
    bad.sequence = sequence;
    bad.max_width = widest;
    auto r = FindLargest(Machine(24, 64, 0), Config(Json::object()), bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("accepted"));
  }
}

}  // namespace
}  // namespace strata::plan
