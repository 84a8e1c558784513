// The collectives between ranks (planner/plan_comm.h) and the links they take
// (planner/plan_hardware.h), counted by hand.
#include "planner/plan_comm.h"

#include <string>
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

// A node of `gpus` GPUs joined by NVLink at 10 GB/s bus and 10 us a collective.
Json Node(int gpus) {
  return {{"gpu", {{"count", gpus}, {"hbm_gib", 80}, {"tflops", 312}}},
          {"host", {{"ram_gib", 512}, {"cores", 32}, {"optimizer_gbps", 50}}},
          {"pcie", {{"to_device_gbps", 24}, {"to_host_gbps", 20}}},
          {"gpu_link", {{"kind", "nvlink"}, {"bus_gbps", 10}, {"latency_us", 10}}}};
}

TEST(PlanLinksTest, ReadsTheLinksInTheirUnits) {
  Json two = Node(8);
  two["nodes"] = 2;
  two["network"] = {{"gbps", 4}, {"latency_us", 5}};
  auto h = HardwareFromJson(two);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->link_kind, LinkKind::kNvlink);
  EXPECT_DOUBLE_EQ(h->link_bus_bytes_per_s, 10e9);
  EXPECT_DOUBLE_EQ(h->link_latency_s, 10e-6);
  EXPECT_FALSE(h->link_assumed);
  EXPECT_EQ(h->nodes, 2);
  EXPECT_EQ(h->ranks(), 16);
  // Across nodes a ring crosses each node's network: the smaller bus, the latencies added.
  EXPECT_DOUBLE_EQ(h->CollectiveBusBytesPerS(), 4e9);
  EXPECT_DOUBLE_EQ(h->CollectiveLatencyS(), 15e-6);
  // One node: the network (given or not) is not crossed.
  auto one = HardwareFromJson(Node(8));
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->ranks(), 8);
  EXPECT_DOUBLE_EQ(one->CollectiveBusBytesPerS(), 10e9);
  EXPECT_DOUBLE_EQ(one->CollectiveLatencyS(), 10e-6);
  Json loopback = Node(2);
  loopback["gpu_link"]["kind"] = "loopback";
  EXPECT_EQ(HardwareFromJson(loopback)->link_kind, LinkKind::kLoopback);
}

TEST(PlanLinksTest, WithoutALinkTheGpusOfANodeTalkOverPcieAndSaySo) {
  Json eight = Node(8);
  eight.erase("gpu_link");
  auto h = HardwareFromJson(eight);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->link_kind, LinkKind::kPcie);
  EXPECT_DOUBLE_EQ(h->link_bus_bytes_per_s, 20e9);  // the smaller of pcie's directions
  EXPECT_DOUBLE_EQ(h->link_latency_s, 20e-6);
  EXPECT_TRUE(h->link_assumed);
  Json one = Node(1);
  one.erase("gpu_link");
  EXPECT_FALSE(HardwareFromJson(one)->link_assumed);  // nothing to assume: no collectives
}

TEST(PlanLinksTest, BadLinksNameTheKeyAndWhatIsAccepted) {
  struct Case {
    Json patch;  // merged into the description
    const char* says;
  } cases[] = {
      {{{"gpu_link", {{"kind", "infiniband"}}}},
       "hardware: gpu_link.kind: \"infiniband\" is not accepted; accepted: \"nvlink\", \"pcie\" "
       "or \"loopback\""},
      {{{"gpu_link", {{"kind", nullptr}}}}, "hardware: gpu_link.kind: missing"},
      {{{"gpu_link", {{"bus_gbps", -1}}}}, "hardware: gpu_link.bus_gbps"},
      {{{"gpu_link", {{"bus_gbps", nullptr}}}}, "hardware: gpu_link.bus_gbps: missing"},
      {{{"gpu_link", {{"latency_us", "low"}}}}, "hardware: gpu_link.latency_us"},
      {{{"gpu_link", {{"bandwidth_gbps", 100}}}},
       "hardware: gpu_link.bandwidth_gbps: unknown key; accepted keys: kind, bus_gbps, latency_us"},
      {{{"gpu_link", {{"bus_gbs", 100}}}}, "did you mean bus_gbps?"},
      {{{"gpu_link", "nvlink"}}, "hardware: gpu_link: \"nvlink\" is not an object"},
      {{{"nodes", 0}}, "hardware: nodes"},
      {{{"nodes", 1.5}}, "hardware: nodes"},
      {{{"nodes", 2}}, "hardware: network: missing"},
      {{{"nodes", 2}, {"network", {{"gbps", 0}, {"latency_us", 5}}}}, "hardware: network.gbps"},
      {{{"nodes", 2}, {"network", {{"gbps", 25}}}}, "hardware: network.latency_us: missing"},
      {{{"network", {{"gbps", 25}, {"latency_us", 5}, {"nics", 8}}}}, "network"},
      {{{"node", 2}}, "did you mean nodes?"},
  };
  for (const Case& c : cases) {
    Json j = Node(8);
    j.merge_patch(c.patch);
    auto h = HardwareFromJson(j);
    ASSERT_FALSE(h.ok()) << c.patch;
    EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(h.status().message(), HasSubstr(c.says)) << h.status();
  }
}

// A small Llama: 2 layers of hidden 64, MLP 128 (gated: 3 matrices), vocabulary 100, untied, no
// biases, no learned positions. A layer's matrices 4 x 64^2 + 3 x 64 x 128 = 40960 (7 tensors:
// q, k, v, o and the MLP's three), its norms 2 x 64 = 128; the embeddings 2 x 100 x 64 = 12800,
// the final norm 64. Ψ = 2 x (40960 + 128) + 12800 + 64 = 95040; Ψp = 2 x 40960 + 12800 = 94720;
// Ψs = 320.
Transformer SmallLlama() {
  const Json j = {{"model_type", "llama"},       {"num_hidden_layers", 2},   {"hidden_size", 64},
                  {"num_attention_heads", 4},    {"intermediate_size", 128}, {"vocab_size", 100},
                  {"tie_word_embeddings", false}};
  auto t = TransformerFromHfConfig(j, 16, 1);
  EXPECT_TRUE(t.ok()) << t.status();
  return *t;
}

Training Config(const Json& j) {
  std::vector<std::string> warnings;
  auto t = TrainingFromConfig(j, &warnings);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : Training{};
}

// The step's collectives, one rank's, on 4 ranks in bf16 at `zero`.
CommTotals Totals(const Json& zero) {
  const Transformer m = SmallLlama();
  EXPECT_EQ(m.TotalParams(), 95040);
  const Hardware hw = *HardwareFromJson(Node(4));
  const Training t = Config({{"bf16", {{"enabled", true}}}, {"zero_optimization", zero}});
  auto mem = PlanMemory(m, hw, t);
  EXPECT_TRUE(mem.ok() && !mem->overflow);
  auto time = PlanTime(m, hw, t, *mem);
  EXPECT_TRUE(time.ok()) << time.status();
  return time.ok() ? time->comm : CommTotals{};
}

// The bucket keys as the trainer's front reads them (python/strata/ranks.py, bucket_settings):
// a bad value names the key and what is accepted; a bucket is capped at a 64th of the host
// budget in elements (the engine's 4 GiB without one), 65536 at least.
TEST(PlanCommTest, BadBucketKeysAreNamedAndBucketsAreCappedAsTheFrontCapsThem) {
  for (const auto& [zero, says] : std::vector<std::pair<Json, std::string>>{
           {{{"reduce_bucket_size", 0}}, "zero_optimization.reduce_bucket_size"},
           {{{"allgather_bucket_size", "5e8"}}, "zero_optimization.allgather_bucket_size"},
           {{{"overlap_comm", "yes"}}, "zero_optimization.overlap_comm"},
           {{{"overlap_comm", 2}}, "accepted: true or false"}}) {
    std::vector<std::string> warnings;
    Json config = {{"zero_optimization", zero}};
    config["zero_optimization"]["stage"] = 2;
    auto t = TrainingFromConfig(config, &warnings);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << zero.dump();
    EXPECT_THAT(t.status().message(), HasSubstr(says)) << zero.dump();
  }
  const Training plain = Config({{"zero_optimization", {{"stage", 2}}}});
  EXPECT_EQ(plain.ReduceBucket(), (int64_t{4} << 30) / 64);  // 5e8 capped by 4 GiB / 64
  const Training small =
      Config({{"zero_optimization",
               {{"stage", 2}, {"reduce_bucket_size", 1000}, {"allgather_bucket_size", 1 << 20}}},
              {"strata", {{"host_budget_bytes", 1 << 20}}}});
  EXPECT_EQ(small.ReduceBucket(), 1000);      // under the cap: as given
  EXPECT_EQ(small.AllgatherBucket(), 65536);  // 1 MiB / 64 = 16384, raised to 65536
  EXPECT_FALSE(plain.OverlapComm());          // off below stage 3
  EXPECT_TRUE(Config({{"zero_optimization", {{"stage", 3}}}}).OverlapComm());
}

TEST(PlanCommTest, StageOneReducesEveryGradientAtTheStepAndGathersTheNewWeights) {
  // At the step: Ψ's fp32 gradients, 95040 x 4 = 380160 bytes whole, 3/4 of them on the wire:
  // 285120, in one bucket and the flags' all-reduce (2). After it: Ψ's bf16 weights, 95040 x 2 =
  // 190080 whole, 142560 on the wire, in one bucket.
  const CommTotals c = Totals({{"stage", 1}});
  EXPECT_DOUBLE_EQ(c.scattered_bytes, 285120);
  EXPECT_EQ(c.scatters, 2);
  EXPECT_DOUBLE_EQ(c.gathered_bytes, 142560);
  EXPECT_EQ(c.gathers, 1);
  // Each collective: its digest's all-gather (10 us), the ranks meeting at it (10 us: sync_us 0)
  // and its bytes at 10 GB/s; and the trainer waits at the step for the ranks to agree that the
  // step staged during backward stands (10 us).
  EXPECT_NEAR(c.seconds, 3 * 20e-6 + (285120 + 142560) / 10e9, 1e-12);
  EXPECT_NEAR(c.agree_s, 10e-6, 1e-12);
}

TEST(PlanCommTest, StageTwoReducesInBackwardBucketByBucket) {
  // Backward: Ψ's fp32 gradients, 285120 bytes on the wire as at stage 1, in one bucket (the
  // default, 5e8 elements, capped at 4 GiB / 64: 67108864); after the step the bf16 weights.
  CommTotals c = Totals({{"stage", 2}});
  EXPECT_DOUBLE_EQ(c.scattered_bytes, 285120);
  EXPECT_EQ(c.scatters, 1);
  EXPECT_DOUBLE_EQ(c.gathered_bytes, 142560);
  EXPECT_EQ(c.gathers, 1);
  EXPECT_NEAR(c.agree_s, 10e-6, 1e-12);  // the staged step's, at the step
  // Buckets of 40000 elements: backward makes the head's and embeddings' 12864, then layer 1's
  // 41088 (53952: a bucket's or more, all of it reduce-scattered), then layer 0's (41088: again):
  // 2 reduce-scatters, the same bytes.
  c = Totals({{"stage", 2}, {"reduce_bucket_size", 40000}});
  EXPECT_EQ(c.scatters, 2);
  EXPECT_DOUBLE_EQ(c.scattered_bytes, 285120);
}

TEST(PlanCommTest, StageThreeGathersEachUnitsWeightsForwardAndBackward) {
  // Gathered, bf16: forward the input embedding (6400), 2 layers (40960 each, 7 tensors), the
  // output head (6400); backward the head and, untied, the input embedding (12800, 2 tensors), 2
  // layers: 189440 elements, 378880 bytes whole, 284160 on the wire, in 1 + 14 + 1 + 2 + 14 = 32
  // collectives; after the step Ψs's 320: 640 bytes whole, 480 on the wire, 1 more.
  // Reduce-scattered, fp32: Ψp's 94720 in backward (378880 whole, 284160 on the wire, one
  // bucket); Ψs's 320 at the step (1280 whole, 960 on the wire: its bucket and the flags).
  const CommTotals c = Totals({{"stage", 3}});
  EXPECT_DOUBLE_EQ(c.gathered_bytes, 284160 + 480);
  EXPECT_EQ(c.gathers, 33);
  EXPECT_DOUBLE_EQ(c.scattered_bytes, 284160 + 960);
  EXPECT_EQ(c.scatters, 3);
}

TEST(PlanCommTest, GradientAccumulationRepeatsAllButTheStepsCollectives) {
  // Two micro-steps: stage 3's gathers and backward's reduce-scatters twice, the step's once.
  const CommTotals c = Totals({{"stage", 3}});
  const Transformer m = SmallLlama();
  const Hardware hw = *HardwareFromJson(Node(4));
  const Training t = Config({{"bf16", {{"enabled", true}}},
                             {"gradient_accumulation_steps", 2},
                             {"zero_optimization", {{"stage", 3}}}});
  auto time = PlanTime(m, hw, t, *PlanMemory(m, hw, t));
  ASSERT_TRUE(time.ok()) << time.status();
  EXPECT_DOUBLE_EQ(time->comm.gathered_bytes, 2 * 284160 + 480);
  EXPECT_DOUBLE_EQ(time->comm.scattered_bytes, 2 * 284160 + 960);
  EXPECT_EQ(time->comm.gathers, 2 * 32 + 1);
  EXPECT_EQ(c.gathers, 33);
}

TEST(PlanCommTest, OneRankHasNoCollectivesAndStageZeroAcrossRanksIsPlannedAsStageOne) {
  const Transformer m = SmallLlama();
  Json one = Node(1);
  const Training s3 = Config({{"zero_optimization", {{"stage", 3}}}});
  const Hardware single = *HardwareFromJson(one);
  auto time = PlanTime(m, single, s3, *PlanMemory(m, single, s3));
  ASSERT_TRUE(time.ok());
  EXPECT_EQ(time->comm.gathers + time->comm.scatters, 0);
  EXPECT_EQ(time->step.busy_s[kComm], 0);
  const Hardware four = *HardwareFromJson(Node(4));
  // The engine runs stage 0 across ranks as stage 1: the same collectives, shards and step.
  const Training s0 = Config(Json::object());
  const Training s1 = Config({{"zero_optimization", {{"stage", 1}}}});
  auto mem0 = PlanMemory(m, four, s0), mem1 = PlanMemory(m, four, s1);
  ASSERT_TRUE(mem0.ok() && mem1.ok());
  EXPECT_EQ(mem0->device.optimizer, mem1->device.optimizer);
  EXPECT_LT(mem0->device.optimizer, PlanMemory(m, single, s0)->device.optimizer);
  auto t0 = PlanTime(m, four, s0, *mem0), t1 = PlanTime(m, four, s1, *mem1);
  ASSERT_TRUE(t0.ok()) << t0.status();
  ASSERT_TRUE(t1.ok()) << t1.status();
  EXPECT_GT(t0->comm.scattered_bytes, 0);
  EXPECT_GT(t0->comm.gathered_bytes, 0);
  EXPECT_EQ(t0->comm.bytes(), t1->comm.bytes());
  EXPECT_EQ(t0->step.step_s, t1->step.step_s);
  auto s = Suggest(m, four, s0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GE(s->training.runtime.zero_stage, 1);
}

TEST(PlanCommTest, AcrossRanksTheNvmeStateStepsDuringBackwardAsTheFrontStagesIt) {
  // The front stages each shard's step as its gradient is reduced (stages 2 and 3) where the step
  // cannot change after backward; the state in host memory steps after backward across ranks.
  const Transformer m = SmallLlama();
  Json node = Node(2);
  node["nvme"] = {{"drives", 1}, {"read_gbps", 3}, {"write_gbps", 2}, {"capacity_tb", 1}};
  const Hardware hw = *HardwareFromJson(node);
  auto cpu_groups_in_backward = [&](const Json& config) {
    const Training t = Config(config);
    auto time = PlanTime(m, hw, t, *PlanMemory(m, hw, t));
    EXPECT_TRUE(time.ok()) << time.status();
    int n = 0;
    for (const Group& g : time->model.trace.groups) n += g.on_cpu && g.phase == kBackward;
    return n;
  };
  const Json nvme = {{"device", "nvme"}, {"nvme_path", "/nvme"}};
  EXPECT_GT(
      cpu_groups_in_backward({{"zero_optimization", {{"stage", 3}, {"offload_optimizer", nvme}}}}),
      0);
  EXPECT_GT(
      cpu_groups_in_backward({{"zero_optimization", {{"stage", 2}, {"offload_optimizer", nvme}}}}),
      0);
  EXPECT_EQ(
      cpu_groups_in_backward({{"gradient_clipping", 1.0},
                              {"zero_optimization", {{"stage", 3}, {"offload_optimizer", nvme}}}}),
      0);
  EXPECT_EQ(cpu_groups_in_backward({{"zero_optimization",
                                     {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}}}}),
            0);
  EXPECT_EQ(
      cpu_groups_in_backward({{"zero_optimization", {{"stage", 1}, {"offload_optimizer", nvme}}}}),
      0);
}

// Stage `stage`, nothing offloaded (no link, no disk), the optimizer on the GPUs: the step is the
// trainer's compute and its collectives.
Prediction Step(int stage, const char* link, std::optional<bool> overlap) {
  const Transformer m = SmallLlama();
  Json node = Node(2);
  node["gpu_link"] = {{"kind", link}, {"bus_gbps", 0.001}, {"latency_us", 0}};
  const Hardware hw = *HardwareFromJson(node);
  Json zero = {{"stage", stage}, {"reduce_bucket_size", 20000}};
  if (overlap) zero["overlap_comm"] = *overlap;
  const Training t = Config({{"zero_optimization", zero}});
  auto time = PlanTime(m, hw, t, *PlanMemory(m, hw, t));
  EXPECT_TRUE(time.ok()) << time.status();
  return time.ok() ? time->step : Prediction{};
}

TEST(PlanCommTest, OverlapCommHidesReduceScattersBehindBackward) {
  // A slow link (1 MB/s): stage 2's reduce-scatters in buckets of 20000 elements. Without
  // overlap_comm (stage 2's default) the trainer waits for each: the step is its compute and every
  // collective; with it they run beside backward.
  const Prediction off = Step(2, "nvlink", std::nullopt);
  EXPECT_NEAR(off.step_s, off.bound.compute_s + off.busy_s[kComm], 1e-9 * off.step_s);
  EXPECT_NEAR(off.waits_s[kComm], off.busy_s[kComm], 1e-9 * off.step_s);
  const Prediction on = Step(2, "nvlink", true);
  EXPECT_LT(on.step_s, off.step_s);
  EXPECT_LT(on.waits_s[kComm], off.waits_s[kComm]);
  EXPECT_GE(on.step_s, on.bound.seconds() * (1 - 1e-9));
}

TEST(PlanCommTest, StageThreeGathersAheadOverlapComputeExceptOnTheComputeCores) {
  // Stage 3, overlap_comm on by default: on NVLink the gathers ahead and the reduce-scatters run
  // beside compute; on loopback (Gloo over the ranks' own cores) every collective adds to it.
  const Prediction nvlink = Step(3, "nvlink", std::nullopt);
  const Prediction loopback = Step(3, "loopback", std::nullopt);
  EXPECT_NEAR(loopback.step_s, loopback.bound.compute_s + loopback.busy_s[kComm],
              1e-9 * loopback.step_s);
  EXPECT_LT(nvlink.step_s, loopback.step_s);
  EXPECT_NEAR(nvlink.busy_s[kComm], loopback.busy_s[kComm], 1e-9 * loopback.step_s);
}

}  // namespace
}  // namespace strata::plan
