// CpuAdam against a double-precision reference of the formula in optim_cpu/adam.h, on every
// kernel ISA this CPU runs, for every dtype combination; determinism across thread counts and
// chunkings; overflow skip; bad input.
#include "optim_cpu/adam.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "base/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim_cpu/adagrad.h"
#include "optim_cpu/lion.h"

namespace strata::optim_cpu {

void PrintTo(Isa isa, std::ostream* os) { *os << IsaName(isa); }

namespace {

using ::testing::HasSubstr;

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t ToF16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t out;
  std::memcpy(&out, &h, 2);
  return out;
}
float FromF16(uint16_t v) {
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return static_cast<float>(h);
}

// The tensors of a test, with gradients and moments in their storage types.
struct State {
  std::vector<float> p;
  std::vector<uint16_t> g16, m16, v16, copy;
  std::vector<float> g32, m32, v32;
  DType grad_dtype = DType::kF32, moment_dtype = DType::kF32;
  bool with_copy = false;
  DType copy_dtype = DType::kBF16;

  float Grad(size_t i) const {
    if (grad_dtype == DType::kF32) return g32[i];
    return grad_dtype == DType::kBF16 ? FromBf16(g16[i]) : FromF16(g16[i]);
  }
  float M(size_t i) const { return moment_dtype == DType::kF32 ? m32[i] : FromBf16(m16[i]); }
  float V(size_t i) const { return moment_dtype == DType::kF32 ? v32[i] : FromBf16(v16[i]); }

  AdamChunk Chunk(size_t begin, size_t n) {
    AdamChunk c;
    c.param = p.data() + begin;
    c.grad_dtype = grad_dtype;
    c.grad = grad_dtype == DType::kF32 ? static_cast<const void*>(g32.data() + begin)
                                       : static_cast<const void*>(g16.data() + begin);
    c.moment_dtype = moment_dtype;
    if (moment_dtype == DType::kF32) {
      c.exp_avg = m32.data() + begin;
      c.exp_avg_sq = v32.data() + begin;
    } else {
      c.exp_avg = m16.data() + begin;
      c.exp_avg_sq = v16.data() + begin;
    }
    if (with_copy) {
      c.param_copy = copy.data() + begin;
      c.copy_dtype = copy_dtype;
    }
    c.size = n;
    return c;
  }

  void NewGrads(std::mt19937_64& rng, float scale) {
    std::normal_distribution<float> d(0, scale);
    for (size_t i = 0; i < p.size(); ++i) {
      const float g = d(rng);
      if (grad_dtype == DType::kF32) {
        g32[i] = g;
      } else {
        g16[i] = grad_dtype == DType::kBF16 ? ToBf16(g) : ToF16(g);
      }
    }
  }
};

State MakeState(size_t n, DType grad, DType moments, bool copy, DType copy_dtype, uint64_t seed) {
  State s;
  s.grad_dtype = grad;
  s.moment_dtype = moments;
  s.with_copy = copy;
  s.copy_dtype = copy_dtype;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0, 1);
  s.p.resize(n);
  for (float& x : s.p) x = d(rng);
  s.g32.assign(n, 0);
  s.g16.assign(n, 0);
  s.m32.assign(n, 0);
  s.v32.assign(n, 0);
  s.m16.assign(n, 0);
  s.v16.assign(n, 0);
  s.copy.assign(n, 0);
  s.NewGrads(rng, 0.1f);
  return s;
}

struct Reference {
  double p, m, v;
  double p_scale, m_scale;  // magnitudes of the terms summed, for the error bound
};

Reference RefStep(const AdamConfig& c, int64_t t, double p, double g, double m, double v,
                  double grad_scale) {
  g *= grad_scale;
  if (!c.adamw) g += double{c.weight_decay} * p;
  const double p0 = c.adamw ? p * (1.0 - double{c.lr} * c.weight_decay) : p;
  Reference r;
  r.m = c.beta1 * m + (1.0 - c.beta1) * g;
  r.m_scale = std::fabs(c.beta1 * m) + std::fabs((1.0 - c.beta1) * g);
  r.v = c.beta2 * v + (1.0 - c.beta2) * g * g;
  const double bc1 = c.bias_correction ? 1.0 - std::pow(double{c.beta1}, double(t)) : 1.0;
  const double bc2 = c.bias_correction ? 1.0 - std::pow(double{c.beta2}, double(t)) : 1.0;
  const double denom = std::sqrt(r.v) / std::sqrt(bc2) + c.eps;
  const double update = (c.lr / bc1) * (r.m / denom);
  r.p = p0 - update;
  r.p_scale = std::fabs(p0) + std::fabs(update) + std::fabs(p);
  return r;
}

struct Case {
  DType grad, moments;
  bool copy;
  DType copy_dtype;
  bool adamw, bias_correction;
};

std::string CaseName(const Case& c) {
  return absl::StrCat("grad_", DTypeName(c.grad), "_m_", DTypeName(c.moments),
                      c.copy ? absl::StrCat("_copy_", DTypeName(c.copy_dtype)) : "",
                      c.adamw ? "_adamw" : "_adam", c.bias_correction ? "" : "_nobc");
}

std::vector<Case> AllCases() {
  std::vector<Case> out;
  for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType m : {DType::kF32, DType::kBF16}) {
      for (int copy = 0; copy < 3; ++copy) {
        for (bool adamw : {true, false}) {
          for (bool bc : {true, false}) {
            out.push_back({g, m, copy > 0, copy == 2 ? DType::kF16 : DType::kBF16, adamw, bc});
          }
        }
      }
    }
  }
  return out;
}

class AdamIsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  AdamConfig Config(bool adamw, bool bc) {
    AdamConfig c;
    c.lr = 1e-2f;
    c.weight_decay = 0.01f;
    c.adamw = adamw;
    c.bias_correction = bc;
    c.threads = 2;
    c.isa = std::string(IsaName(GetParam()));
    return c;
  }
};

TEST_P(AdamIsaTest, MatchesTheDoubleReferenceForEveryDtypeCombination) {
  constexpr size_t kN = 1000 + 37;  // not a multiple of any vector width
  constexpr int kSteps = 12;
  for (const Case& tc : AllCases()) {
    SCOPED_TRACE(CaseName(tc));
    const AdamConfig config = Config(tc.adamw, tc.bias_correction);
    auto adam = CpuAdam::Create(config);
    ASSERT_TRUE(adam.ok()) << adam.status();
    ASSERT_EQ((*adam)->isa(), GetParam());
    State s = MakeState(kN, tc.grad, tc.moments, tc.copy, tc.copy_dtype, 7);
    std::mt19937_64 rng(11);
    const float grad_scale = 0.5f;
    for (int64_t t = 1; t <= kSteps; ++t) {
      std::vector<Reference> ref(kN);
      for (size_t i = 0; i < kN; ++i) {
        ref[i] = RefStep(config, t, s.p[i], s.Grad(i), s.M(i), s.V(i), grad_scale);
      }
      auto r = (*adam)->Step(t, s.Chunk(0, kN), {.grad_scale = grad_scale});
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_FALSE(r->overflow);
      // fp32 moments: every element within 1e-6 of the reference, relative to the magnitude
      // of the terms summed. bf16 moments: within bf16's half-ulp rounding (2^-8 relative).
      const double moment_tol = tc.moments == DType::kF32 ? 1e-6 : 1.0 / 256;
      for (size_t i = 0; i < kN; ++i) {
        ASSERT_LE(std::fabs(s.p[i] - ref[i].p), 1e-6 * ref[i].p_scale)
            << "p[" << i << "] step " << t << ": " << s.p[i] << " vs " << ref[i].p;
        ASSERT_LE(std::fabs(s.M(i) - ref[i].m), moment_tol * ref[i].m_scale + 1e-30)
            << "m[" << i << "] step " << t;
        ASSERT_LE(std::fabs(s.V(i) - ref[i].v), moment_tol * ref[i].v + 1e-30)
            << "v[" << i << "] step " << t;
        if (tc.copy) {
          const uint16_t want = tc.copy_dtype == DType::kBF16 ? ToBf16(s.p[i]) : ToF16(s.p[i]);
          ASSERT_EQ(s.copy[i], want) << "copy[" << i << "] step " << t;
        }
      }
      s.NewGrads(rng, 0.1f);
    }
  }
}

TEST_P(AdamIsaTest, AnFp32CopyIsTheUpdatedMasterWeightsBitForBit) {
  constexpr size_t kN = 1000 + 37;
  auto adam = CpuAdam::Create(Config(/*adamw=*/true, /*bc=*/true));
  ASSERT_TRUE(adam.ok()) << adam.status();
  State s = MakeState(kN, DType::kBF16, DType::kF32, false, DType::kBF16, 5);
  std::vector<float> copy(kN, -1.0f);
  std::mt19937_64 rng(3);
  for (int64_t t = 1; t <= 3; ++t) {
    AdamChunk c = s.Chunk(0, kN);
    c.param_copy = copy.data();
    c.copy_dtype = DType::kF32;
    auto r = (*adam)->Step(t, c);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(std::memcmp(copy.data(), s.p.data(), kN * sizeof(float)), 0) << "step " << t;
    s.NewGrads(rng, 0.1f);
  }
}

TEST_P(AdamIsaTest, AStepsWeightDecayReplacesTheConfigsAsAParamGroupsDoes) {
  constexpr size_t kN = 517;
  for (const bool adamw : {true, false}) {
    AdamConfig with = Config(adamw, /*bc=*/true), without = with;
    with.weight_decay = 0.3f;
    without.weight_decay = 0.0f;
    auto decaying = CpuAdam::Create(with);
    auto plain = CpuAdam::Create(without);
    ASSERT_TRUE(decaying.ok() && plain.ok());
    State a = MakeState(kN, DType::kF32, DType::kF32, false, DType::kBF16, 7);
    State b = MakeState(kN, DType::kF32, DType::kF32, false, DType::kBF16, 7);
    for (int64_t t = 1; t <= 3; ++t) {
      ASSERT_TRUE((*decaying)->Step(t, a.Chunk(0, kN), {.weight_decay = 0.0f}).ok());
      ASSERT_TRUE((*plain)->Step(t, b.Chunk(0, kN)).ok());
    }
    EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), kN * sizeof(float)), 0) << "adamw " << adamw;
    // And the other way: a decay the config does not have.
    ASSERT_TRUE((*plain)->Step(4, b.Chunk(0, kN), {.weight_decay = 0.3f}).ok());
    ASSERT_TRUE((*decaying)->Step(4, a.Chunk(0, kN)).ok());
    EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), kN * sizeof(float)), 0) << "adamw " << adamw;
  }
}

TEST_P(AdamIsaTest, AStepsBetasReplaceTheConfigsAsAParamGroupsDo) {
  // A schedule cycling momentum (torch's OneCycleLR) sets a group's betas each step: a step
  // given betas is, bit for bit, the step of an optimizer made with them (its bias corrections
  // too), and the config's come back when none are given.
  constexpr size_t kN = 517;
  for (const bool adamw : {true, false}) {
    AdamConfig made = Config(adamw, /*bc=*/true), cycled = made;
    cycled.beta1 = 0.85f;
    cycled.beta2 = 0.99f;
    auto given = CpuAdam::Create(made);
    auto other = CpuAdam::Create(cycled);
    ASSERT_TRUE(given.ok() && other.ok());
    State a = MakeState(kN, DType::kF32, DType::kF32, false, DType::kBF16, 7);
    State b = MakeState(kN, DType::kF32, DType::kF32, false, DType::kBF16, 7);
    for (int64_t t = 1; t <= 3; ++t) {
      ASSERT_TRUE((*given)->Step(t, a.Chunk(0, kN), {.beta1 = 0.85f, .beta2 = 0.99f}).ok());
      ASSERT_TRUE((*other)->Step(t, b.Chunk(0, kN)).ok());
    }
    EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), kN * sizeof(float)), 0) << "adamw " << adamw;
    EXPECT_EQ(std::memcmp(a.m32.data(), b.m32.data(), kN * sizeof(float)), 0);
    ASSERT_TRUE((*given)->Step(4, a.Chunk(0, kN)).ok());
    ASSERT_TRUE((*other)->Step(4, b.Chunk(0, kN), {.beta1 = made.beta1, .beta2 = made.beta2}).ok());
    EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), kN * sizeof(float)), 0) << "adamw " << adamw;
  }
  LionConfig lc;
  lc.isa = std::string(IsaName(GetParam()));
  LionConfig lc_cycled = lc;
  lc_cycled.beta1 = 0.8f;
  lc_cycled.beta2 = 0.95f;
  auto lion = CpuLion::Create(lc);
  auto lion_cycled = CpuLion::Create(lc_cycled);
  ASSERT_TRUE(lion.ok() && lion_cycled.ok());
  State a = MakeState(kN, DType::kF32, DType::kF32, false, DType::kBF16, 9);
  State b = MakeState(kN, DType::kF32, DType::kF32, false, DType::kBF16, 9);
  for (State* s : {&a, &b}) {
    std::mt19937_64 rng(3);  // (new gradients each step: the sign Lion steps by follows beta1)
    for (int64_t t = 1; t <= 3; ++t) {
      StateChunk c;
      c.param = s->p.data();
      c.grad = s->g32.data();
      c.grad_dtype = DType::kF32;
      c.state = s->m32.data();
      c.size = kN;
      auto r = s == &a ? (*lion)->Step(t, c, {.beta1 = 0.8f, .beta2 = 0.95f})
                       : (*lion_cycled)->Step(t, c);
      ASSERT_TRUE(r.ok()) << r.status();
      s->NewGrads(rng, 0.1f);
    }
  }
  EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), kN * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a.m32.data(), b.m32.data(), kN * sizeof(float)), 0);
}

// Runs `steps` steps with the given thread count, cutting the tensors into `cuts` chunks.
State RunWith(Isa isa, int threads, const std::vector<size_t>& cuts, DType grad, DType moments) {
  AdamConfig c;
  c.threads = threads;
  c.isa = std::string(IsaName(isa));
  c.weight_decay = 0.1f;
  auto adam = CpuAdam::Create(c);
  EXPECT_TRUE(adam.ok());
  State s = MakeState(5003, grad, moments, true, DType::kBF16, 3);
  std::mt19937_64 rng(5);
  for (int64_t t = 1; t <= 5; ++t) {
    size_t begin = 0;
    for (size_t cut : cuts) {
      EXPECT_TRUE((*adam)->Step(t, s.Chunk(begin, cut - begin)).ok());
      begin = cut;
    }
    s.NewGrads(rng, 0.1f);
  }
  return s;
}

TEST_P(AdamIsaTest, BitsDoNotDependOnThreadsOrChunking) {
  for (DType grad : {DType::kF32, DType::kBF16}) {
    for (DType moments : {DType::kF32, DType::kBF16}) {
      const State one = RunWith(GetParam(), 1, {5003}, grad, moments);
      for (const auto& [threads, cuts] : std::vector<std::pair<int, std::vector<size_t>>>{
               {2, {5003}}, {3, {5003}}, {7, {5003}}, {2, {1, 17, 2048, 5003}}, {1, {999, 5003}}}) {
        const State other = RunWith(GetParam(), threads, cuts, grad, moments);
        EXPECT_EQ(0, std::memcmp(one.p.data(), other.p.data(), one.p.size() * 4))
            << threads << " threads, " << cuts.size() << " chunks";
        EXPECT_EQ(one.m32, other.m32);
        EXPECT_EQ(one.v16, other.v16);
        EXPECT_EQ(one.copy, other.copy);
      }
    }
  }
}

TEST_P(AdamIsaTest, OverflowIsReportedAndNoStateIsTouched) {
  auto adam = CpuAdam::Create(Config(true, true));
  ASSERT_TRUE(adam.ok());
  for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t bad_at : {0u, 500u, 1036u}) {
      for (float bad :
           {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
            std::numeric_limits<float>::quiet_NaN()}) {
        State s = MakeState(1037, grad, DType::kF32, true, DType::kBF16, 9);
        if (grad == DType::kF32) {
          s.g32[bad_at] = bad;
        } else {
          s.g16[bad_at] = grad == DType::kBF16 ? ToBf16(bad) : ToF16(bad);
        }
        const State before = s;
        auto r = (*adam)->Step(1, s.Chunk(0, 1037), {.check_overflow = true});
        ASSERT_TRUE(r.ok());
        EXPECT_TRUE(r->overflow);
        EXPECT_EQ(0, std::memcmp(s.p.data(), before.p.data(), s.p.size() * 4));
        EXPECT_EQ(s.m32, before.m32);
        EXPECT_EQ(s.v32, before.v32);
        EXPECT_EQ(s.copy, before.copy);
      }
    }
    State fine = MakeState(1037, grad, DType::kF32, false, DType::kBF16, 9);
    EXPECT_FALSE((*adam)->HasNonFinite(fine.Chunk(0, 1037).grad, grad, 1037));
  }
}

// Adagrad and Lion run through the same kernels; their own reference checks, per ISA.
TEST_P(AdamIsaTest, AdagradAndLionMatchTheirDoubleReferences) {
  constexpr size_t kN = 1000 + 37;
  const std::string isa(IsaName(GetParam()));
  AdagradConfig ac;
  ac.lr = 0.05f;
  ac.lr_decay = 0.01f;
  ac.weight_decay = 0.01f;
  ac.threads = 2;
  ac.isa = isa;
  auto adagrad = CpuAdagrad::Create(ac);
  ASSERT_TRUE(adagrad.ok()) << adagrad.status();
  LionConfig lc;
  lc.lr = 1e-3f;
  lc.weight_decay = 0.1f;
  lc.threads = 2;
  lc.isa = isa;
  auto lion = CpuLion::Create(lc);
  ASSERT_TRUE(lion.ok()) << lion.status();
  for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (bool is_lion : {false, true}) {
      SCOPED_TRACE(absl::StrCat(is_lion ? "lion" : "adagrad", " grad ", DTypeName(grad)));
      State s = MakeState(kN, grad, DType::kF32, true, DType::kF16, 13);
      std::mt19937_64 rng(17);
      for (int64_t t = 1; t <= 8; ++t) {
        std::vector<double> ref_p(kN), ref_s(kN), scale(kN);
        for (size_t i = 0; i < kN; ++i) {
          const double p = s.p[i], g = s.Grad(i), st = s.m32[i];
          if (is_lion) {
            const double p0 = p * (1.0 - double{lc.lr} * lc.weight_decay);
            const double c = lc.beta1 * st + (1.0 - lc.beta1) * g;
            const double sign = c > 0 ? 1 : (c < 0 ? -1 : 0);
            ref_p[i] = p0 - lc.lr * sign;
            ref_s[i] = lc.beta2 * st + (1.0 - lc.beta2) * g;
            scale[i] = std::fabs(p0) + lc.lr + std::fabs(p);
          } else {
            const double g2 = g + double{ac.weight_decay} * p;
            const double clr = ac.lr / (1.0 + (t - 1) * double{ac.lr_decay});
            ref_s[i] = st + g2 * g2;
            const double update = clr * g2 / (std::sqrt(ref_s[i]) + ac.eps);
            ref_p[i] = p - update;
            scale[i] = std::fabs(p) + std::fabs(update);
          }
        }
        StateChunk c;
        c.param = s.p.data();
        c.grad = grad == DType::kF32 ? static_cast<const void*>(s.g32.data())
                                     : static_cast<const void*>(s.g16.data());
        c.grad_dtype = grad;
        c.state = s.m32.data();
        c.param_copy = s.copy.data();
        c.copy_dtype = DType::kF16;
        c.size = kN;
        auto r = is_lion ? (*lion)->Step(t, c) : (*adagrad)->Step(t, c);
        ASSERT_TRUE(r.ok()) << r.status();
        for (size_t i = 0; i < kN; ++i) {
          ASSERT_LE(std::fabs(s.p[i] - ref_p[i]), 1e-6 * scale[i]) << "p[" << i << "] t " << t;
          ASSERT_LE(std::fabs(s.m32[i] - ref_s[i]),
                    1e-6 * (std::fabs(ref_s[i]) + std::fabs(s.Grad(i))) + 1e-30)
              << "state[" << i << "] t " << t;
          ASSERT_EQ(s.copy[i], ToF16(s.p[i]));
        }
        s.NewGrads(rng, 0.1f);
      }
    }
  }
}

TEST(AdagradLionConfigTest, BadHyperParametersAreRejected) {
  AdagradConfig a;
  a.eps = 0;
  EXPECT_THAT(CpuAdagrad::Create(a).status().message(), HasSubstr("adagrad config: eps"));
  a = AdagradConfig();
  a.lr_decay = -1;
  EXPECT_THAT(CpuAdagrad::Create(a).status().message(),
              HasSubstr("lr_decay: must be finite and >= 0"));
  LionConfig l;
  l.beta2 = 1;
  EXPECT_THAT(CpuLion::Create(l).status().message(),
              HasSubstr("lion config: betas[1]: must be in [0, 1)"));
  l = LionConfig();
  l.lr = NAN;
  EXPECT_THAT(CpuLion::Create(l).status().message(), HasSubstr("lion config: lr"));
  auto lion = CpuLion::Create(LionConfig{.threads = 1});
  ASSERT_TRUE(lion.ok());
  StateChunk empty;
  EXPECT_THAT((*lion)->Step(1, empty).status().message(), HasSubstr("CpuLion::Step: size is 0"));
}

INSTANTIATE_TEST_SUITE_P(Isas, AdamIsaTest, ::testing::ValuesIn(SupportedIsas()),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

TEST(AdamConfigTest, BadHyperParametersAreRejectedNamingTheKeyAndRange) {
  struct Bad {
    AdamConfig c;
    const char* message;
  };
  auto with = [](auto f) {
    AdamConfig c;
    f(c);
    return c;
  };
  for (const Bad& b : std::vector<Bad>{
           {with([](AdamConfig& c) { c.lr = -1; }), "lr: must be finite and >= 0"},
           {with([](AdamConfig& c) { c.lr = NAN; }), "lr: must be finite"},
           {with([](AdamConfig& c) { c.beta1 = 1.0f; }), "betas[0]: must be in [0, 1)"},
           {with([](AdamConfig& c) { c.beta2 = -0.1f; }), "betas[1]: must be in [0, 1)"},
           {with([](AdamConfig& c) { c.eps = 0; }), "eps: must be finite and > 0"},
           {with([](AdamConfig& c) { c.eps = INFINITY; }), "eps"},
           {with([](AdamConfig& c) { c.weight_decay = -1; }), "weight_decay"},
           {with([](AdamConfig& c) { c.threads = -2; }), "threads: must be in [0, 1024]"},
           {with([](AdamConfig& c) { c.isa = "avx9000"; }), "accepted here:"}}) {
    auto adam = CpuAdam::Create(b.c);
    EXPECT_EQ(adam.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(adam.status().message(), HasSubstr(b.message));
  }
}

TEST(AdamStepTest, BadSpansAreRejectedNamingTheArgument) {
  auto adam = CpuAdam::Create(AdamConfig{.threads = 1});
  ASSERT_TRUE(adam.ok());
  State s = MakeState(64, DType::kF32, DType::kF32, false, DType::kBF16, 1);
  auto expect = [&](AdamChunk c, const char* what, int64_t t = 1) {
    auto r = (*adam)->Step(t, c);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(r.status().message(), HasSubstr(what));
  };
  AdamChunk c = s.Chunk(0, 64);
  expect(c, "step t must be >= 1", 0);
  c.size = 0;
  expect(c, "size is 0");
  c = s.Chunk(0, 64);
  c.param = nullptr;
  expect(c, "param is null");
  c = s.Chunk(0, 64);
  c.grad = nullptr;
  expect(c, "grad is null");
  c = s.Chunk(0, 64);
  c.exp_avg_sq = nullptr;
  expect(c, "exp_avg_sq is null");
  c = s.Chunk(0, 64);
  c.moment_dtype = DType::kF16;
  expect(c, "moment_dtype fp16");
  c = s.Chunk(0, 64);
  auto r = (*adam)->Step(1, c, {.grad_scale = NAN});
  EXPECT_THAT(r.status().message(), HasSubstr("grad_scale"));
  r = (*adam)->Step(1, c, {.weight_decay = INFINITY});
  EXPECT_THAT(r.status().message(), HasSubstr("weight_decay must be finite"));
  r = (*adam)->Step(1, c, {.beta1 = 1.0f});
  EXPECT_THAT(r.status().message(), HasSubstr("beta1 1: accepted 0 <= beta1 < 1"));
  r = (*adam)->Step(1, c, {.beta2 = NAN});
  EXPECT_THAT(r.status().message(), HasSubstr("beta2 nan: accepted 0 <= beta2 < 1"));
}

TEST(AdamStepTest, ChosenIsaIsTheBestTheCpuHas) {
  auto adam = CpuAdam::Create(AdamConfig{.threads = 1});
  ASSERT_TRUE(adam.ok());
  if (getenv("STRATA_CPU_ADAM_ISA") == nullptr) EXPECT_EQ((*adam)->isa(), SupportedIsas().front());
}

TEST(ThreadPoolTest, RangesCoverEverythingOnceAtGranuleBoundaries) {
  auto pool = ThreadPool::Create(3);
  ASSERT_TRUE(pool.ok());
  std::vector<std::atomic<int>> hits(1000);
  std::atomic<int> misaligned{0};
  (*pool)->ParallelFor(1000, 64, [&](size_t b, size_t e, int) {
    if (b % 64 != 0) ++misaligned;
    for (size_t i = b; i < e; ++i) ++hits[i];
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  EXPECT_EQ(misaligned.load(), 0);
  EXPECT_FALSE((*pool)->placement().empty());
}

// A call limited to the first k workers (StepOptions::threads: the optimizer stepping while the
// trainer still computes) covers everything once on those workers alone.
TEST(ThreadPoolTest, ACallLimitedToKWorkersRunsOnTheFirstKAlone) {
  auto pool = ThreadPool::Create(4);
  ASSERT_TRUE(pool.ok());
  for (int k : {1, 2, 3, 4, 0, 9}) {
    std::vector<std::atomic<int>> hits(1000);
    std::set<int> workers;
    Mutex mu;
    (*pool)->ParallelFor(
        1000, 64,
        [&](size_t b, size_t e, int worker) {
          for (size_t i = b; i < e; ++i) ++hits[i];
          MutexLock lock(&mu);
          workers.insert(worker);
        },
        k);
    for (auto& h : hits) ASSERT_EQ(h.load(), 1) << "k " << k;
    const int used = k <= 0 || k > 4 ? 4 : k;
    EXPECT_EQ(workers.size(), static_cast<size_t>(used)) << "k " << k;
    EXPECT_LT(*workers.rbegin(), used) << "k " << k << ": only the first ones work";
  }
}

}  // namespace
}  // namespace strata::optim_cpu
