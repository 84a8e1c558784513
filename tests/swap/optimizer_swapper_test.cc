// The pipelined NVMe optimizer step against the same step in memory: bitwise equal, over several
// steps and partition sizes that are not multiples of the block size; faults during reads and
// write-backs change nothing and a retry matches; buffers stay within their count.
#include "swap/optimizer_swapper.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>

#include "aio/backend.h"
#include "aio/fault_injection.h"
#include "base/mutex.h"
#include "base/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"

namespace strata::swap {
namespace {

using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;

const std::vector<std::pair<tiering::PartitionId, uint64_t>> kParts = {
    {10, 1000 + 7}, {11, 16384 + 1}, {12, 65536 * 3 + 5}, {13, 40000}, {14, 3}};

struct Reference {  // the same optimizer on in-memory arrays
  std::vector<std::vector<float>> p, m, v;
};

struct Fixture {
  ScratchDir dir;
  std::shared_ptr<aio::FaultInjector> injector;
  std::unique_ptr<aio::Engine> engine;
  std::unique_ptr<tiering::NvmeStore> store;
  std::unique_ptr<optim_cpu::CpuAdam> adam;
  tiering::HostMemoryResource raw;
  std::unique_ptr<tiering::StatisticsResource> host;
  std::unique_ptr<PipelinedOptimizerSwapper> swapper;
  std::vector<std::vector<float>> grads;
  Reference ref;

  explicit Fixture(OptimizerSwapperConfig config, std::vector<aio::FaultRule> rules = {}) {
    aio::AioConfig ac;
    ac.block_size = 64 << 10;
    aio::EngineOptions eo;
    eo.on_warning = [](absl::string_view) {};
    injector = std::make_shared<aio::FaultInjector>(1, rules);
    injector->Arm(false);
    eo.wrap_backend = aio::FaultInjector::ForEngine(injector);
    engine = *aio::Engine::Create(ac, eo);
    tiering::NvmeStoreOptions so;
    so.capacity_bytes = 32 << 20;
    store = *tiering::NvmeStore::Open(dir.File("swap"), so, engine.get());
    optim_cpu::AdamConfig adam_config;
    adam_config.threads = 2;
    adam_config.weight_decay = 0.01f;
    adam = *optim_cpu::CpuAdam::Create(adam_config);
    host = std::make_unique<tiering::StatisticsResource>(&raw);
    auto s = PipelinedOptimizerSwapper::Create(store.get(), adam.get(), host.get(), config, kParts);
    EXPECT_TRUE(s.ok()) << s.status();
    swapper = *std::move(s);
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0, 1);
    for (const auto& [id, n] : kParts) {
      std::vector<float> master(n);
      for (float& x : master) x = d(rng);
      EXPECT_TRUE(swapper->Initialize(id, master).ok());
      ref.p.push_back(master);
      ref.m.emplace_back(n, 0.0f);
      ref.v.emplace_back(n, 0.0f);
      grads.emplace_back(n);
    }
  }

  void NewGrads(int seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0, 0.1f);
    for (auto& g : grads) {
      for (float& x : g) x = d(rng);
    }
  }
  std::vector<StepInput> Inputs() {
    std::vector<StepInput> in;
    for (size_t i = 0; i < kParts.size(); ++i) {
      StepInput s;
      s.id = kParts[i].first;
      s.grad = grads[i].data();
      in.push_back(s);
    }
    return in;
  }
  void StepReference(int64_t t) {
    for (size_t i = 0; i < kParts.size(); ++i) {
      optim_cpu::AdamChunk c;
      c.param = ref.p[i].data();
      c.grad = grads[i].data();
      c.exp_avg = ref.m[i].data();
      c.exp_avg_sq = ref.v[i].data();
      c.size = kParts[i].second;
      ASSERT_TRUE(adam->Step(t, c).ok());
    }
  }
  void ExpectMatchesReference() {
    for (size_t i = 0; i < kParts.size(); ++i) {
      const uint64_t n = kParts[i].second;
      std::vector<float> p(n), m(n), v(n);
      ASSERT_TRUE(
          swapper
              ->ReadState(kParts[i].first, absl::MakeSpan(p), absl::MakeSpan(m), absl::MakeSpan(v))
              .ok());
      EXPECT_EQ(0, std::memcmp(p.data(), ref.p[i].data(), n * 4))
          << "master of " << kParts[i].first;
      EXPECT_EQ(0, std::memcmp(m.data(), ref.m[i].data(), n * 4))
          << "exp_avg of " << kParts[i].first;
      EXPECT_EQ(0, std::memcmp(v.data(), ref.v[i].data(), n * 4))
          << "exp_avg_sq of " << kParts[i].first;
    }
  }
};

class SwapperModes : public ::testing::TestWithParam<OptimizerSwapperConfig> {};

TEST_P(SwapperModes, AStepOverNvmeStateIsBitwiseTheStepInMemory) {
  Fixture f(GetParam());
  const uint64_t max_blob = (65536 * 3 + 5) * 12;
  for (int64_t t = 1; t <= 4; ++t) {
    f.NewGrads(static_cast<int>(t));
    auto r = f.swapper->Step(t, f.Inputs());
    ASSERT_TRUE(r.ok()) << r.status();
    f.StepReference(t);
    f.ExpectMatchesReference();
  }
  // Pinned buffers: never more than the ring (three with pipelining, one without), plus the
  // host-resident state.
  uint64_t in_cpu = 0;
  for (const auto& [id, n] : kParts) {
    if (!f.swapper->on_nvme(id)) in_cpu += n * 12;
  }
  EXPECT_LE(f.host->counts().peak_bytes, f.swapper->buffer_count() * max_blob + in_cpu);
  EXPECT_LE(f.swapper->buffer_count(), 3u);
}

INSTANTIATE_TEST_SUITE_P(Configs, SwapperModes,
                         ::testing::Values(OptimizerSwapperConfig{true, true, 0},
                                           OptimizerSwapperConfig{false, false, 0},
                                           OptimizerSwapperConfig{true, false, 0},
                                           OptimizerSwapperConfig{false, true, 0},
                                           OptimizerSwapperConfig{
                                               true, true, 220000}),  // 10, 11, 14 stay in host
                         [](const auto& info) {
                           return absl::StrCat(info.param.pipeline_read ? "read" : "noread", "_",
                                               info.param.pipeline_write ? "write" : "nowrite",
                                               "_cpu", info.param.max_in_cpu_bytes);
                         });

TEST(SwapperTest, HostResidentStateNeverTouchesTheDisk) {
  Fixture f({true, true, 220000});
  EXPECT_FALSE(f.swapper->on_nvme(10));
  EXPECT_FALSE(f.swapper->on_nvme(11));
  EXPECT_TRUE(f.swapper->on_nvme(12));
  EXPECT_FALSE(f.store->Find(10).ok());
  EXPECT_TRUE(f.store->Find(12).ok());
  EXPECT_FALSE(f.swapper->on_nvme(14));  // placement is greedy: a small one after a big one fits
}

void FaultThenRetry(aio::FaultRule rule, int expected_errno) {
  Fixture f({true, true, 220000}, {rule});
  f.NewGrads(1);
  ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
  f.StepReference(1);
  f.NewGrads(2);
  f.injector->Arm(true);
  auto failed = f.swapper->Step(2, f.Inputs());
  f.injector->Arm(false);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(StatusErrno(failed.status()), expected_errno) << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr("nothing was changed"));
  EXPECT_GT(f.injector->total_hits(), 0u);
  f.ExpectMatchesReference();  // still step 1's state, NVMe and host alike
  // Every partition's bytes on NVMe match their checksums (reread from the disk).
  auto corrupt = f.store->Verify();
  ASSERT_TRUE(corrupt.ok()) << corrupt.status();
  EXPECT_TRUE(corrupt->empty());
  // Retrying the step succeeds and matches the in-memory result.
  auto retried = f.swapper->Step(2, f.Inputs());
  ASSERT_TRUE(retried.ok()) << retried.status();
  f.StepReference(2);
  f.ExpectMatchesReference();
}

TEST(SwapperTest, AReadThatFailsChangesNothingAndARetryMatches) {
  aio::FaultRule eio = aio::FaultRule::Error(EIO);
  eio.only = aio::OpKind::kRead;
  eio.skip = 2;
  eio.max_hits = 1;
  FaultThenRetry(eio, EIO);
}

TEST(SwapperTest, AWriteBackThatFailsChangesNothingAndARetryMatches) {
  aio::FaultRule enospc = aio::FaultRule::Error(ENOSPC);
  enospc.only = aio::OpKind::kWrite;
  enospc.skip = 5;
  enospc.max_hits = 1;
  FaultThenRetry(enospc, ENOSPC);
}

TEST(SwapperTest, AnOverflowSkipsTheStepWithoutTouchingState) {
  Fixture f({true, true, 0});
  f.NewGrads(1);
  f.grads[3][17] = std::numeric_limits<float>::infinity();
  auto r = f.swapper->Step(1, f.Inputs(), {.check_overflow = true});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->overflow);
  EXPECT_EQ(r->bytes_read, 0u);
  f.ExpectMatchesReference();
}

TEST(SwapperTest, BadInputIsRefused) {
  Fixture f({true, true, 0});
  std::vector<float> wrong(5);
  EXPECT_EQ(f.swapper->Initialize(10, wrong).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.swapper->Initialize(99, wrong).code(), absl::StatusCode::kNotFound);
  StepInput bad;
  bad.id = 10;
  EXPECT_THAT(f.swapper->Step(1, {&bad, 1}).status().message(), HasSubstr("grad is null"));
  f.NewGrads(1);
  auto in = f.Inputs();
  in[0].id = 99;
  EXPECT_THAT(f.swapper->Step(1, in).status().message(),
              HasSubstr("partition 99: not one of the swapper's partitions"));
  in = f.Inputs();
  EXPECT_EQ(f.swapper->Step(0, in).status().code(), absl::StatusCode::kInvalidArgument);
  tiering::HostMemoryResource raw;
  EXPECT_THAT(PipelinedOptimizerSwapper::Create(nullptr, f.adam.get(), &raw, {}, {{1, 100}})
                  .status()
                  .message(),
              HasSubstr("there is no NVMe store"));
}

// Inputs that are refused must be refused before anything changes: a bad input at the end of the
// list (after NVMe-resident partitions that would already have been stepped and committed, on a
// host-resident partition that is stepped last) changes neither NVMe nor host state, and a
// duplicate id is refused rather than stepped twice.
TEST(SwapperTest, EveryInputIsValidatedBeforeAnythingChanges) {
  Fixture f({true, true, 220000});  // 10 and 11 in host memory, the rest on NVMe
  ASSERT_FALSE(f.swapper->on_nvme(10));
  ASSERT_TRUE(f.swapper->on_nvme(12));
  f.NewGrads(1);
  const uint64_t generation = f.store->generation();
  std::vector<uint16_t> copy(kParts[0].second, 0xabcd);
  auto in = f.Inputs();
  std::rotate(in.begin(), in.begin() + 2, in.end());  // NVMe partitions first, host ones last
  in.back().param_copy = copy.data();
  in.back().copy_dtype = optim_cpu::DType::kF32;  // a copy dtype CpuAdam cannot write
  auto r = f.swapper->Step(1, in);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("copy_dtype fp32"));
  EXPECT_THAT(r.status().message(), HasSubstr("nothing was changed"));
  EXPECT_EQ(f.store->generation(), generation);
  f.ExpectMatchesReference();
  EXPECT_EQ(copy[0], 0xabcd);
  // A duplicate id.
  in = f.Inputs();
  in.push_back(in[3]);
  r = f.swapper->Step(1, in);
  EXPECT_THAT(r.status().message(), HasSubstr("partition 13: listed twice"));
  EXPECT_EQ(f.store->generation(), generation);
  f.ExpectMatchesReference();
  // And then a good step is the step in memory.
  ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
  f.StepReference(1);
  f.ExpectMatchesReference();
}

// What a failed step does to param_copy, as the header states: the copies of NVMe partitions
// stepped before the failure hold the new weights, and the retry rewrites every copy with exactly
// the bits a clean step writes.
TEST(SwapperTest, AFailedStepsParamCopiesAreRewrittenByTheRetry) {
  aio::FaultRule eio = aio::FaultRule::Error(EIO);
  eio.only = aio::OpKind::kRead;
  eio.skip = 2;
  eio.max_hits = 1;
  Fixture clean({true, true, 0});
  Fixture faulty({true, true, 0}, {eio});
  std::vector<std::vector<uint16_t>> clean_copy, faulty_copy;
  auto with_copies = [](Fixture& f, std::vector<std::vector<uint16_t>>& copies) {
    auto in = f.Inputs();
    copies.clear();
    for (const auto& [id, n] : kParts) copies.emplace_back(n, 0);
    for (size_t i = 0; i < in.size(); ++i) in[i].param_copy = copies[i].data();
    return in;
  };
  clean.NewGrads(1);
  faulty.NewGrads(1);
  auto clean_in = with_copies(clean, clean_copy);
  ASSERT_TRUE(clean.swapper->Step(1, clean_in).ok());
  auto faulty_in = with_copies(faulty, faulty_copy);
  faulty.injector->Arm(true);
  ASSERT_FALSE(faulty.swapper->Step(1, faulty_in).ok());
  faulty.injector->Arm(false);
  ASSERT_TRUE(faulty.swapper->Step(1, faulty_in).ok());
  EXPECT_EQ(faulty_copy, clean_copy);
}

// A backend wrapper that holds the write of partition k until the read of partition k+1 has been
// submitted: a pipelined step has that read in flight already (pipeline_read) or issues it while
// k is being written (pipeline_write), so the write goes on; a serial step waits for the write
// before it reads on, so the write waits in vain until `patience` runs out, and that is counted.
// One op per read and write (the blobs are smaller than the block size and aligned), and the
// writes of a step reach the disk in partition order.
struct Gate {
  Mutex mu;
  CondVar cv;
  int reads = 0, writes = 0, reads_expected = 0, stalls = 0;
  std::chrono::milliseconds patience{0};
};

class GatedBackend : public aio::Backend {
 public:
  GatedBackend(std::unique_ptr<aio::Backend> inner, std::shared_ptr<Gate> gate)
      : inner_(std::move(inner)), gate_(std::move(gate)) {}
  absl::string_view name() const override { return inner_->name(); }
  absl::Status Submit(absl::Span<const aio::Op> ops) override {
    for (const aio::Op& op : ops) {
      MutexLock lock(&gate_->mu);
      if (op.kind == aio::OpKind::kRead) {
        ++gate_->reads;
        gate_->cv.SignalAll();
      } else if (gate_->reads_expected > 0) {
        const int k = gate_->writes++;
        const int wanted = std::min(k + 2, gate_->reads_expected);  // R0 .. R(k+1)
        const auto deadline = std::chrono::steady_clock::now() + gate_->patience;
        while (gate_->reads < wanted) {
          if (!gate_->cv.WaitFor(&gate_->mu, deadline - std::chrono::steady_clock::now())) {
            ++gate_->stalls;
            break;
          }
        }
      }
    }
    return inner_->Submit(ops);
  }
  absl::StatusOr<size_t> Reap(absl::Span<aio::OpResult> out, size_t min_results) override {
    return inner_->Reap(out, min_results);
  }

 private:
  std::unique_ptr<aio::Backend> inner_;
  std::shared_ptr<Gate> gate_;
};

int StallsOfAStep(OptimizerSwapperConfig config, std::chrono::milliseconds patience) {
  ScratchDir dir;
  auto gate = std::make_shared<Gate>();
  aio::AioConfig ac;
  ac.block_size = 4 << 20;
  ac.intra_op_parallelism = 2;
  aio::EngineOptions eo;
  eo.on_warning = [](absl::string_view) {};
  eo.wrap_backend = [gate](std::unique_ptr<aio::Backend> inner, int) {
    return std::make_unique<GatedBackend>(std::move(inner), gate);
  };
  auto engine = *aio::Engine::Create(ac, eo);
  tiering::NvmeStoreOptions so;
  so.capacity_bytes = 16 << 20;
  so.on_warning = [](absl::string_view) {};
  auto store = *tiering::NvmeStore::Open(dir.File("swap"), so, engine.get());
  optim_cpu::AdamConfig adam_config;
  adam_config.threads = 1;
  auto adam = *optim_cpu::CpuAdam::Create(adam_config);
  tiering::HostMemoryResource host;
  std::vector<std::pair<tiering::PartitionId, uint64_t>> parts;
  // 20480 elements: 240 KiB of state, a whole number of 4 KiB blocks (an unaligned tail would be
  // written read-modify-write, and that read would count).
  for (tiering::PartitionId id = 0; id < 6; ++id) parts.emplace_back(id, 20480);
  auto swapper = *PipelinedOptimizerSwapper::Create(store.get(), adam.get(), &host, config, parts);
  std::vector<float> master(20480, 0.5f), grad(20480, 0.01f);
  for (const auto& [id, n] : parts) EXPECT_TRUE(swapper->Initialize(id, master).ok());
  std::vector<StepInput> in;
  for (const auto& [id, n] : parts) in.push_back({.id = id, .grad = grad.data()});
  {
    MutexLock lock(&gate->mu);
    gate->reads = gate->writes = 0;
    gate->reads_expected = static_cast<int>(parts.size());
    gate->patience = patience;
  }
  EXPECT_TRUE(swapper->Step(1, in).ok());
  MutexLock lock(&gate->mu);
  return gate->stalls;
}

TEST(SwapperTest, APipelinedStepReadsAheadWhileItWritesBehind) {
  for (OptimizerSwapperConfig config :
       {OptimizerSwapperConfig{true, true, 0}, OptimizerSwapperConfig{true, false, 0},
        OptimizerSwapperConfig{false, true, 0}}) {
    EXPECT_EQ(StallsOfAStep(config, std::chrono::seconds(30)), 0)
        << "pipeline_read " << config.pipeline_read << " pipeline_write " << config.pipeline_write;
  }
  // The check can fail: a serial step stalls at every write that has a read after it.
  EXPECT_EQ(StallsOfAStep({false, false, 0}, std::chrono::milliseconds(100)), 5);
}

}  // namespace
}  // namespace strata::swap
