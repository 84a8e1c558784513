// optim_cpu/chunk_optimizer.h: each kind made by MakeChunkOptimizer steps as the optimizer itself
// does, refuses what its Step would refuse (touching nothing), and scans for overflow.
#include "optim_cpu/chunk_optimizer.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::optim_cpu {
namespace {

using ::testing::HasSubstr;

OptimizerConfig ConfigOf(OptimizerKind kind) {
  OptimizerConfig c;
  c.kind = kind;
  c.adam.threads = c.adagrad.threads = c.lion.threads = 2;
  return c;
}

class ChunkOptimizerTest : public ::testing::TestWithParam<OptimizerKind> {};

TEST_P(ChunkOptimizerTest, StepsAsTheOptimizerItself) {
  constexpr size_t kN = 777;
  auto chunked = MakeChunkOptimizer(ConfigOf(GetParam()));
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  EXPECT_EQ((*chunked)->kind(), GetParam());
  std::vector<float> p1(kN), p2(kN), g(kN), a1(kN, 0.1f), a2(kN, 0.1f), b1(kN), b2(kN);
  for (size_t i = 0; i < kN; ++i) {
    p1[i] = p2[i] = std::sin(0.1f * i);
    g[i] = std::cos(0.3f * i);
  }
  AdamChunk c;
  c.param = p1.data();
  c.grad = g.data();
  c.exp_avg = a1.data();
  c.exp_avg_sq = b1.data();
  c.size = kN;
  ASSERT_TRUE((*chunked)->Step(1, c, {}).ok());
  // The optimizer itself on the second copy.
  const OptimizerConfig config = ConfigOf(GetParam());
  if (GetParam() == OptimizerKind::kAdam) {
    AdamChunk d = c;
    d.param = p2.data();
    d.exp_avg = a2.data();
    d.exp_avg_sq = b2.data();
    ASSERT_TRUE((*CpuAdam::Create(config.adam))->Step(1, d).ok());
  } else {
    StateChunk d;
    d.param = p2.data();
    d.grad = g.data();
    d.state = a2.data();
    d.size = kN;
    if (GetParam() == OptimizerKind::kAdagrad) {
      ASSERT_TRUE((*CpuAdagrad::Create(config.adagrad))->Step(1, d).ok());
    } else {
      ASSERT_TRUE((*CpuLion::Create(config.lion))->Step(1, d).ok());
    }
  }
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(a1, a2);
  EXPECT_NE(p1[5], std::sin(0.5f));  // it stepped
}

TEST_P(ChunkOptimizerTest, RefusesWhatItsStepWouldRefuseAndFindsOverflow) {
  auto chunked = MakeChunkOptimizer(ConfigOf(GetParam()));
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  std::vector<float> p(16, 1.0f), g(16, 1.0f), a(16), b(16);
  AdamChunk c;
  c.param = p.data();
  c.exp_avg = a.data();
  c.exp_avg_sq = b.data();
  c.size = 16;
  absl::Status s = (*chunked)->Validate(1, c, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("grad is null"));
  c.grad = g.data();
  EXPECT_TRUE((*chunked)->Validate(1, c, {}).ok());
  EXPECT_THAT((*chunked)->Validate(0, c, {}).message(), HasSubstr("t must be >= 1"));
  EXPECT_EQ(p, std::vector<float>(16, 1.0f));  // Validate touched nothing
  g[7] = INFINITY;
  EXPECT_TRUE((*chunked)->HasNonFinite(g.data(), DType::kF32, 16));
  auto r = (*chunked)->Step(1, c, {.check_overflow = true});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->overflow);
  EXPECT_EQ(p, std::vector<float>(16, 1.0f));
}

TEST(ChunkOptimizerConfigTest, BadHyperParametersAreNamed) {
  OptimizerConfig c = ConfigOf(OptimizerKind::kLion);
  c.lion.beta1 = 1.5f;
  auto made = MakeChunkOptimizer(c);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(made.status().message(), HasSubstr("betas[0]"));
}

INSTANTIATE_TEST_SUITE_P(Kinds, ChunkOptimizerTest,
                         ::testing::Values(OptimizerKind::kAdam, OptimizerKind::kAdagrad,
                                           OptimizerKind::kLion),
                         [](const auto& info) {
                           return std::string(OptimizerKindName(info.param));
                         });

}  // namespace
}  // namespace strata::optim_cpu
