// The optimizer step on the Runtime's own store and budgets (offload_optimizer): bit-exact with
// CpuAdam in memory, its room set aside from the host and NVMe budgets, its state kept apart from
// the partitions in the one store and found again by a restarted Runtime, stepped in the order
// the trace released the gradients, and its bad inputs named.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sched/runtime.h"
#include "tests/aio/test_util.h"
#include "tests/sched/sched_test_util.h"

namespace strata::sched {
namespace {

using ::strata::sched::testing::Config;
using ::strata::sched::testing::Desc;
using ::strata::sched::testing::kBytes;
using ::strata::sched::testing::kSlot;
using ::strata::sched::testing::Quiet;
using ::strata::testing::RandomBytes;
using ::strata::testing::ScratchDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using tiering::OffloadDevice;

const std::vector<std::pair<PartitionId, uint64_t>> kParts = {{11, 5000}, {12, 7001}, {13, 3000}};

RuntimeConfig OptimizerConfig(const std::string& path, OffloadDevice device) {
  RuntimeConfig c = Config(path, 2, 4);
  c.host_budget_bytes += 1 << 20;  // room for the optimizer's buffers and state
  c.offload_optimizer.device = device;
  c.offload_optimizer.pipeline_read = true;
  c.offload_optimizer.pipeline_write = true;
  c.offload_optimizer.buffer_count = 4;
  return c;
}

optim_cpu::AdamConfig Adam() {
  optim_cpu::AdamConfig a;
  a.threads = 2;
  a.weight_decay = 0.01f;
  return a;
}

std::vector<float> Normal(uint64_t n, int seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The same steps in plain memory.
struct Reference {
  std::vector<std::vector<float>> p, m, v;
  std::unique_ptr<optim_cpu::CpuAdam> adam = *optim_cpu::CpuAdam::Create(Adam());
  Reference() {
    for (size_t i = 0; i < kParts.size(); ++i) {
      p.push_back(Normal(kParts[i].second, static_cast<int>(i), 1));
      m.emplace_back(kParts[i].second, 0.0f);
      v.emplace_back(kParts[i].second, 0.0f);
    }
  }
  void Step(int64_t t, const std::vector<std::vector<float>>& grads) {
    for (size_t i = 0; i < kParts.size(); ++i) {
      optim_cpu::AdamChunk c;
      c.param = p[i].data();
      c.exp_avg = m[i].data();
      c.exp_avg_sq = v[i].data();
      c.grad = grads[i].data();
      c.size = kParts[i].second;
      ASSERT_TRUE(adam->Step(t, c).ok());
    }
  }
};

std::vector<std::vector<float>> Grads(int64_t t) {
  std::vector<std::vector<float>> g;
  for (size_t i = 0; i < kParts.size(); ++i) {
    g.push_back(Normal(kParts[i].second, static_cast<int>(100 * t + i), 0.1f));
  }
  return g;
}

std::vector<swap::StepInput> Inputs(const std::vector<std::vector<float>>& grads) {
  std::vector<swap::StepInput> in;
  for (size_t i = 0; i < kParts.size(); ++i) {
    swap::StepInput s;
    s.id = kParts[i].first;
    s.grad = grads[i].data();
    in.push_back(s);
  }
  return in;
}

uint64_t WholePages(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

// The optimizer's read-ahead room at strata.optimizer_read_ahead_bytes "auto": an eighth of the
// host budget, at most every NVMe sub-group's state in whole pages (and its copy buffer's with
// optimizer_commit "partition").
uint64_t AutoReadAhead(const RuntimeConfig& c, uint64_t sub_group = 0) {
  uint64_t most = 0;
  for (const auto& [id, n] : kParts) {
    const uint64_t g = sub_group > 0 ? std::min(sub_group, n) : n;
    for (uint64_t at = 0; at < n; at += g) {
      const uint64_t k = std::min(g, n - at);
      most += WholePages(k * 12) + (c.optimizer_commit_each ? WholePages(k * 4) : 0);
    }
  }
  return std::min(most, WholePages(c.host_budget_bytes / 8));
}

void ExpectState(Runtime& rt, const Reference& ref) {
  for (size_t i = 0; i < kParts.size(); ++i) {
    const uint64_t n = kParts[i].second;
    std::vector<float> p(n), m(n), v(n);
    ASSERT_TRUE(rt.ReadOptimizerState(kParts[i].first, absl::MakeSpan(p), absl::MakeSpan(m),
                                      absl::MakeSpan(v))
                    .ok());
    EXPECT_EQ(0, std::memcmp(p.data(), ref.p[i].data(), n * 4)) << kParts[i].first;
    EXPECT_EQ(0, std::memcmp(m.data(), ref.m[i].data(), n * 4)) << kParts[i].first;
    EXPECT_EQ(0, std::memcmp(v.data(), ref.v[i].data(), n * 4)) << kParts[i].first;
  }
}

class RuntimeOptimizerTest : public ::testing::TestWithParam<OffloadDevice> {};

TEST_P(RuntimeOptimizerTest, StepsMatchCpuAdamInMemoryWithinTheRuntimesBudgets) {
  ScratchDir dir;
  const RuntimeConfig config = OptimizerConfig(dir.File("swap"), GetParam());
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  // A partition with the same id as an optimizer partition: the one store keeps them apart.
  ASSERT_TRUE((*rt)->Register(Desc(11), Tier::kNvme, RandomBytes(kBytes, 11)).ok());
  ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
  const bool nvme = GetParam() == OffloadDevice::kNvme;
  uint64_t state = 0, largest = 0, elements = 0, state_bytes = 0;
  for (const auto& [id, n] : kParts) {
    state_bytes += n * 12;
    state += (n * 12 + 4095) / 4096 * 4096;
    largest = std::max(largest, (n * 12 + 4095) / 4096 * 4096);
    elements += n;
  }
  const auto& table = (*rt)->residency();
  EXPECT_EQ(
      table.set_aside_bytes(Tier::kHost),
      nvme ? 4 * largest + (elements * 2 + 4095) / 4096 * 4096 + AutoReadAhead(config) : state);
  EXPECT_EQ((*rt)->OptimizerReadAheadBytes(), nvme ? AutoReadAhead(config) : 0);
  EXPECT_EQ(table.set_aside_bytes(Tier::kNvme), nvme ? 2 * state : 0);
  Reference ref;
  for (size_t i = 0; i < kParts.size(); ++i) {
    ASSERT_TRUE((*rt)->InitializeOptimizerState(kParts[i].first, ref.p[i]).ok());
  }
  for (int64_t t = 1; t <= 3; ++t) {
    const auto grads = Grads(t);
    auto r = (*rt)->OptimizerStep(t, Inputs(grads));
    ASSERT_TRUE(r.ok()) << r.status();
    // The read-ahead room ("auto") holds the whole state here: from step 2 on each step finds
    // there what the last one committed, and reads nothing.
    EXPECT_EQ(r->bytes_read, nvme && t == 1 ? state_bytes : 0u) << "state read from NVMe";
    EXPECT_EQ(r->bytes_reused, nvme && t > 1 ? state_bytes : 0u) << "state found in the room";
    ref.Step(t, grads);
  }
  ExpectState(**rt, ref);
  EXPECT_LE((*rt)->stats().host_held_bytes, config.host_budget_bytes);
  ASSERT_TRUE(table.CheckInvariants().ok()) << table.CheckInvariants();
  auto p = (*rt)->Acquire(11, Tier::kHost);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(0, std::memcmp(*p, RandomBytes(kBytes, 11).data(), kBytes));
  ASSERT_TRUE((*rt)->Release(11, Tier::kHost, false).ok());
  ASSERT_EQ((*rt)->StoredPartitions().size(), 1u);  // the optimizer's state is not a partition
  // The step's report names what was read from NVMe: the state ExpectState read back (none when
  // it is in host memory) apart from the partition's bytes, counted by its role.
  const StepReport report = (*rt)->EndStep();
  EXPECT_EQ(report.optimizer_state_read_bytes, nvme ? state_bytes : 0u);
  EXPECT_EQ(report.nvme_by_role[static_cast<int>(tiering::Role::kParam)][0], kBytes);
  EXPECT_EQ(report.nvme_by_role[static_cast<int>(tiering::Role::kGrad)][0], 0u);
  EXPECT_EQ((*rt)->EndStep().optimizer_state_read_bytes, 0u);  // counted in its step alone
}

// The host room set aside for the staged param copies of NVMe-resident partitions is counted in
// the copies' dtype: 4 bytes an element for an fp32 trainer's (it was 2 whatever the dtype).
TEST(RuntimeOptimizerTest, TheCopiesRoomSetAsideFollowsTheirDtype) {
  for (optim_cpu::DType copy : {optim_cpu::DType::kBF16, optim_cpu::DType::kF32}) {
    ScratchDir dir;
    auto rt = Runtime::Create(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme), Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    optim_cpu::OptimizerConfig oc;
    oc.adam = Adam();
    ASSERT_TRUE((*rt)->CreateOptimizer(oc, kParts, copy).ok());
    uint64_t largest = 0, elements = 0;
    for (const auto& [id, n] : kParts) {
      largest = std::max(largest, (n * 12 + 4095) / 4096 * 4096);
      elements += n;
    }
    const uint64_t bytes = copy == optim_cpu::DType::kF32 ? 4 : 2;
    EXPECT_EQ((*rt)->residency().set_aside_bytes(Tier::kHost),
              4 * largest + (elements * bytes + 4095) / 4096 * 4096 +
                  AutoReadAhead(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme)))
        << optim_cpu::DTypeName(copy);
  }
}

// strata.optimizer_read_ahead_bytes: "auto" (above), a size (capped at the NVMe state's), 0
// (none), each set aside in the host tier; "auto" that does not fit beside the optimizer's other
// buffers takes none and says so, a size that does not fit is refused naming it; state in host
// memory takes none.
TEST(RuntimeOptimizerTest, TheReadAheadRoomIsSetAsideAsConfigured) {
  uint64_t most = 0;
  for (const auto& [id, n] : kParts) most += WholePages(n * 12);
  struct Case {
    std::optional<uint64_t> bytes;
    uint64_t host_budget;
    OffloadDevice device;
    uint64_t want;
    bool warned;
  };
  const uint64_t base = OptimizerConfig("", OffloadDevice::kNvme).host_budget_bytes;
  // A host budget with room for the optimizer's ring at its smallest sub-groups (1024 elements:
  // the ring may take no more than a quarter of the room) and the staged copies, and a page more
  // (beside the staging pool, which the budget also holds).
  uint64_t tight = 0;
  {
    ScratchDir dir;
    auto rt = Runtime::Create(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme), Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    uint64_t elements = 0;
    for (const auto& [id, n] : kParts) elements += n;
    tight = base - (*rt)->residency().budget_bytes(Tier::kHost) + 4 * WholePages(1024 * 12) +
            WholePages(elements * 2) + 4096;
  }
  for (const Case& c :
       std::vector<Case>{{0, base, OffloadDevice::kNvme, 0, false},
                         {10000, base, OffloadDevice::kNvme, 12288, false},
                         {uint64_t{1} << 40, base, OffloadDevice::kNvme, most, false},
                         {std::nullopt, 64 << 20, OffloadDevice::kNvme, most, false},
                         {std::nullopt, base, OffloadDevice::kCpu, 0, false},
                         // Room for the ring and copies only: auto gives way.
                         {std::nullopt, tight, OffloadDevice::kNvme, 0, true}}) {
    SCOPED_TRACE(absl::StrCat(c.bytes.value_or(-1), " ", c.host_budget));
    ScratchDir dir;
    RuntimeConfig config = OptimizerConfig(dir.File("swap"), c.device);
    config.host_budget_bytes = c.host_budget;
    config.optimizer_read_ahead_bytes = c.bytes;
    config.optimizer_commit_auto = false;  // "step" (its staged copies) whatever the budget
    auto rt = Runtime::Create(config, Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    absl::Status s = (*rt)->CreateOptimizer(Adam(), kParts);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ((*rt)->OptimizerReadAheadBytes(), c.want);
    bool warned = false;
    for (const std::string& w : (*rt)->warnings()) {
      warned = warned || absl::StrContains(w, "read-ahead room");
    }
    EXPECT_EQ(warned, c.warned);
  }
  // A size that does not fit is refused, naming it.
  ScratchDir dir;
  RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
  config.optimizer_read_ahead_bytes = uint64_t{1} << 40;
  config.host_budget_bytes = tight;
  config.optimizer_commit_auto = false;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  absl::Status s = (*rt)->CreateOptimizer(Adam(), kParts);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("read-ahead"));
}

// A held step through the Runtime (BeginOptimizerStep with hold): staged, released at a scale,
// committed: CpuAdam's step in memory at that scale, bit for bit.
TEST(RuntimeOptimizerTest, AHeldStepIsTheStepAtItsReleasedScale) {
  ScratchDir dir;
  auto rt = Runtime::Create(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
  ASSERT_GT((*rt)->OptimizerReadAheadBytes(), 0u);
  Reference ref;
  for (size_t i = 0; i < kParts.size(); ++i) {
    ASSERT_TRUE((*rt)->InitializeOptimizerState(kParts[i].first, ref.p[i]).ok());
  }
  for (int64_t t = 1; t <= 2; ++t) {
    auto grads = Grads(t);
    ASSERT_TRUE((*rt)->BeginOptimizerStep(false, true).ok());
    ASSERT_TRUE((*rt)->StageOptimizerStep(t, Inputs(grads)).ok());
    EXPECT_EQ((*rt)->CommitOptimizerStep().status().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE((*rt)->ReleaseOptimizerStep(0.25f).ok());
    auto r = (*rt)->CommitOptimizerStep();
    ASSERT_TRUE(r.ok()) << r.status();
    for (auto& g : grads) {
      for (float& x : g) x *= 0.25f;  // exact: a power of two
    }
    ref.Step(t, grads);
  }
  ExpectState(**rt, ref);
}

int ThreadsOfThisProcess() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++n;
  }
  return n;
}

// strata.optimizer_threads sizes the optimizer's pool where the optimizer's own count is left at
// 0; a count the caller set stays.
TEST(RuntimeOptimizerTest, TheConfigsOptimizerThreadsSizeItsPoolUnlessTheOptimizerSetsThem) {
  for (const auto& [configured, given, made] :
       std::vector<std::tuple<int, int, int>>{{3, 0, 3}, {3, 2, 2}, {5, 0, 5}}) {
    ScratchDir dir;
    RuntimeConfig c = OptimizerConfig(dir.File("swap"), OffloadDevice::kCpu);
    c.optimizer_threads = configured;
    auto rt = Runtime::Create(c, Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    optim_cpu::OptimizerConfig oc;
    oc.adam = Adam();
    oc.adam.threads = given;
    const int before = ThreadsOfThisProcess();
    ASSERT_TRUE((*rt)->CreateOptimizer(oc, kParts, optim_cpu::DType::kF32).ok());
    EXPECT_EQ(ThreadsOfThisProcess() - before, made)
        << "strata.optimizer_threads " << configured << ", the optimizer's own " << given;
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, RuntimeOptimizerTest,
                         ::testing::Values(OffloadDevice::kCpu, OffloadDevice::kNvme),
                         [](const auto& info) {
                           return info.param == OffloadDevice::kCpu ? "cpu" : "nvme";
                         });

TEST(RuntimeOptimizerTest, ARestartedRuntimeStepsFromTheStateTheLastOneLeft) {
  ScratchDir dir;
  RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
  config.nvme_keep_files = true;  // what the next Runtime adopts
  Reference ref;
  {
    auto rt = Runtime::Create(config, Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
    for (size_t i = 0; i < kParts.size(); ++i) {
      ASSERT_TRUE((*rt)->InitializeOptimizerState(kParts[i].first, ref.p[i]).ok());
    }
    const auto grads = Grads(1);
    ASSERT_TRUE((*rt)->OptimizerStep(1, Inputs(grads)).ok());
    ref.Step(1, grads);
  }
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_TRUE((*rt)->StoredPartitions().empty());
  ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
  const auto grads = Grads(2);
  ASSERT_TRUE((*rt)->OptimizerStep(2, Inputs(grads)).ok());
  ref.Step(2, grads);
  ExpectState(**rt, ref);
}

TEST(RuntimeOptimizerTest, TheStepFollowsTheOrderTheTraceReleasedTheGradients) {
  ScratchDir dir;
  RuntimeOptions ro = Quiet();
  std::vector<PartitionId> stepped;
  ro.on_optimizer_event = [&](swap::StepEvent e, PartitionId id) {
    if (e == swap::StepEvent::kStepStarted) stepped.push_back(id);
  };
  auto rt = Runtime::Create(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme), ro);
  ASSERT_TRUE(rt.ok()) << rt.status();
  // Backward writes the gradients 13, 12, 11 (partitions of their own ids).
  for (PartitionId id : {13, 12, 11}) {
    ASSERT_TRUE(
        (*rt)
            ->Register(Desc(id, kBytes, tiering::Role::kGrad), Tier::kHost, RandomBytes(kBytes, id))
            .ok());
  }
  for (PartitionId id : {13, 12, 11}) {
    ASSERT_TRUE((*rt)->Acquire(id, Tier::kDevice).ok());
    ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, true).ok());
  }
  (*rt)->EndStep();
  ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
  Reference ref;
  for (size_t i = 0; i < kParts.size(); ++i) {
    ASSERT_TRUE((*rt)->InitializeOptimizerState(kParts[i].first, ref.p[i]).ok());
  }
  const auto grads = Grads(1);
  ASSERT_TRUE((*rt)->OptimizerStep(1, Inputs(grads)).ok());  // given as 11, 12, 13
  EXPECT_THAT(stepped, ElementsAre(13, 12, 11));
  ref.Step(1, grads);
  ExpectState(**rt, ref);
}

TEST(RuntimeOptimizerTest, EachPartitionStepsAsItsGradientArrivesWhileBackwardGoesOn) {
  ScratchDir dir;
  auto rt = Runtime::Create(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
  Reference ref;
  for (size_t i = 0; i < kParts.size(); ++i) {
    ASSERT_TRUE((*rt)->InitializeOptimizerState(kParts[i].first, ref.p[i]).ok());
    // The gradient partitions, written by backward on the device.
    ASSERT_TRUE((*rt)
                    ->Register(Desc(kParts[i].first, kBytes, tiering::Role::kGrad), Tier::kHost,
                               RandomBytes(kBytes, i))
                    .ok());
  }
  const auto grads = Grads(1);
  Mutex mu;
  CondVar ready_cv;
  std::vector<size_t> ready;  // indices whose gradient is complete
  std::thread optimizer([&] {
    for (size_t done = 0; done < kParts.size(); ++done) {
      size_t i;
      {
        MutexLock lock(&mu);
        while (ready.size() <= done) ready_cv.Wait(&mu);
        i = ready[done];
      }
      swap::StepInput in;
      in.id = kParts[i].first;
      in.grad = grads[i].data();
      auto r = (*rt)->OptimizerStep(1, {in});  // one partition, its own commit
      EXPECT_TRUE(r.ok()) << r.status();
    }
  });
  // Backward, last layer first: each gradient written on the device, then handed on.
  for (size_t k = kParts.size(); k-- > 0;) {
    auto p = (*rt)->Acquire(kParts[k].first, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << p.status();
    std::memcpy(*p, RandomBytes(kBytes, 50 + k).data(), kBytes);
    ASSERT_TRUE((*rt)->Release(kParts[k].first, Tier::kDevice, true).ok());
    (*rt)->GradientReady(kParts[k].first);
    MutexLock lock(&mu);
    ready.push_back(k);
    ready_cv.Signal();
  }
  optimizer.join();
  ref.Step(1, grads);
  ExpectState(**rt, ref);
  ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
}

// The optimizer over kParts with the reference's master weights, and each partition's fp32
// gradient partition registered in the host tier (holding `grads` when given, else empty).
void SetUpStagedOptimizer(Runtime& rt, const Reference& ref,
                          const std::vector<std::vector<float>>* grads) {
  ASSERT_TRUE(rt.CreateOptimizer(Adam(), kParts).ok());
  for (size_t i = 0; i < kParts.size(); ++i) {
    ASSERT_TRUE(rt.InitializeOptimizerState(kParts[i].first, ref.p[i]).ok());
    const uint64_t bytes = kParts[i].second * 4;
    absl::Span<const std::byte> initial;
    if (grads != nullptr) initial = {reinterpret_cast<const std::byte*>((*grads)[i].data()), bytes};
    ASSERT_TRUE(
        rt.Register(Desc(kParts[i].first, bytes, tiering::Role::kGrad), Tier::kHost, initial).ok());
  }
}

// The step in parts as a trainer drives it during backward: each gradient written on the device,
// released, sent down (GradientReady) and staged with no address, so the optimizer's thread takes
// it from its partition in the host tier. Three steps equal CpuAdam in memory bit for bit; the
// optimizer's acquires stay out of the trace (the scheduler plans from step 2 without diverging,
// and the trainer's report counts only its own accesses); nothing stays pinned after Commit; an
// Abort changes nothing. With the state in host memory and host_early (the param), each partition
// steps on the optimizer's thread as it is staged, with the same bits.
class StagedStepTest : public ::testing::TestWithParam<bool> {};

TEST_P(StagedStepTest, AStagedStepTakesTheGradientsFromTheirPartitionsOutOfTheTrace) {
  const bool early = GetParam();
  ScratchDir dir;
  RuntimeConfig config =
      OptimizerConfig(dir.File("swap"), early ? OffloadDevice::kCpu : OffloadDevice::kNvme);
  config.device_budget_bytes = 8 * kSlot;
  config.host_budget_bytes += 4 * kSlot;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  Reference ref;
  ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, nullptr));
  // The new weights in bf16, as the trainer's parameters (the room for staging them was set
  // aside by CreateOptimizer).
  std::vector<std::vector<uint16_t>> copies, want;
  for (const auto& [id, n] : kParts) {
    copies.emplace_back(n, 0);
    want.emplace_back(n, 0);
  }
  for (int64_t t = 1; t <= 4; ++t) {
    const auto grads = Grads(t);
    ASSERT_TRUE((*rt)->BeginOptimizerStep(early).ok());
    for (size_t k = kParts.size(); k-- > 0;) {  // backward: last layer first
      const PartitionId id = kParts[k].first;
      auto p = (*rt)->Acquire(id, Tier::kDevice);
      ASSERT_TRUE(p.ok()) << p.status();
      std::memcpy(*p, grads[k].data(), kParts[k].second * 4);
      ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, true).ok());
      (*rt)->GradientReady(id);
      auto staged =
          (*rt)->StageOptimizerStep(t, {swap::StepInput{.id = id, .param_copy = copies[k].data()}});
      ASSERT_TRUE(staged.ok()) << staged;
    }
    if (t == 3 && !early) {  // dropped: step 3 is done again below
      EXPECT_THAT((*rt)->AbortOptimizerStep(), ::testing::IsEmpty());
      ExpectState(**rt, ref);
      ASSERT_TRUE((*rt)->BeginOptimizerStep().ok());
      ASSERT_TRUE((*rt)->StageOptimizerStep(t, Inputs(grads)).ok());
    }
    auto r = (*rt)->CommitOptimizerStep();
    ASSERT_TRUE(r.ok()) << r.status();
    ref.Step(t, grads);
    ExpectState(**rt, ref);
    if (t != 3 || early) {  // step 3's retry was given no copies
      for (size_t i = 0; i < kParts.size(); ++i) {
        for (uint64_t j = 0; j < kParts[i].second; ++j) {
          uint32_t bits;
          std::memcpy(&bits, &ref.p[i][j], 4);
          want[i][j] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
        }
        EXPECT_EQ(copies[i], want[i]) << "the bf16 copy of " << kParts[i].first;
      }
    }
    for (const auto& [id, n] : kParts) {
      auto res = (*rt)->residency().Get(id);
      ASSERT_TRUE(res.ok());
      EXPECT_EQ(res->pins[1], 0) << "gradient " << id << " left pinned in the host tier";
      ASSERT_TRUE((*rt)->Discard(id).ok());
    }
    const StepReport report = (*rt)->EndStep();
    EXPECT_EQ(report.acquires, kParts.size()) << "the optimizer's acquires were counted";
    if (t >= 2) EXPECT_EQ(report.mode, "planned") << t;
  }
  for (const std::string& w : (*rt)->warnings()) {
    EXPECT_THAT(w, ::testing::Not(HasSubstr("differs from the recorded trace")));
  }
  ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
}

INSTANTIATE_TEST_SUITE_P(HostEarly, StagedStepTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "host_early" : "nvme"; });

// A staged step holds each gradient only while its partition steps: once the optimizer's thread
// has stepped them all, none is pinned, before Commit (the gradients of a model larger than the
// host tier go through it one at a time).
// A held step released with optimizer_commit "partition" is never taken anew: each gradient the
// optimizer's thread lets go is dropped then (never written down to NVMe for a step that will not
// read it). With the whole step's commit, or before the release, the gradients stay for a step
// taken anew.
TEST(RuntimeOptimizerTest, AReleasedHeldStepDropsEachGradientOnceItsPartitionHasStepped) {
  for (const bool each : {false, true}) {
    SCOPED_TRACE(each ? "commit each partition" : "commit the step");
    ScratchDir dir;
    RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
    config.optimizer_commit_each = each;
    // As the last partition's state is written, the first one's gradient has been let go (its
    // partition stepped): dropped by then, not at the Commit.
    RuntimeOptions options = Quiet();
    Runtime* runtime = nullptr;
    std::atomic<int> first_written_then{-1};
    options.on_optimizer_event = [&](swap::StepEvent e, PartitionId id) {
      if (e == swap::StepEvent::kWriteStarted && id == kParts.back().first) {
        first_written_then = runtime->residency().Get(kParts.front().first)->written;
      }
    };
    auto rt = Runtime::Create(config, options);
    ASSERT_TRUE(rt.ok()) << rt.status();
    runtime = rt->get();
    Reference ref;
    auto grads = Grads(1);
    ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
    auto written = [&](PartitionId id) { return (*rt)->residency().Get(id)->written; };
    ASSERT_TRUE((*rt)->BeginOptimizerStep(false, true).ok());
    for (const auto& [id, n] : kParts) {
      ASSERT_TRUE((*rt)->StageOptimizerStep(1, {swap::StepInput{.id = id}}).ok());
    }
    for (const auto& [id, n] : kParts) EXPECT_TRUE(written(id)) << id << " before the release";
    ASSERT_TRUE((*rt)->ReleaseOptimizerStep(1.0f).ok());
    auto r = (*rt)->CommitOptimizerStep();
    ASSERT_TRUE(r.ok()) << r.status();
    for (const auto& [id, n] : kParts) EXPECT_EQ(written(id), !each) << id;
    // (The whole step's writes may still be under way at its Commit: written behind it.)
    if (each) EXPECT_EQ(first_written_then.load(), 0);
    ref.Step(1, grads);
    ExpectState(**rt, ref);
  }
}

TEST(RuntimeOptimizerTest, AStagedStepLetsEachGradientGoOnceItsPartitionHasStepped) {
  ScratchDir dir;
  RuntimeOptions ro = Quiet();
  Mutex mu;
  CondVar stepped_cv;
  int stepped = 0;
  ro.on_optimizer_event = [&](swap::StepEvent e, PartitionId) {
    if (e != swap::StepEvent::kWriteStarted) return;
    MutexLock lock(&mu);
    ++stepped;
    stepped_cv.SignalAll();
  };
  auto rt = Runtime::Create(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme), ro);
  ASSERT_TRUE(rt.ok()) << rt.status();
  Reference ref;
  const auto grads = Grads(1);
  ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
  ASSERT_TRUE((*rt)->BeginOptimizerStep().ok());
  for (const auto& [id, n] : kParts) {
    ASSERT_TRUE((*rt)->StageOptimizerStep(1, {swap::StepInput{.id = id}}).ok());
  }
  {
    MutexLock lock(&mu);
    while (stepped < static_cast<int>(kParts.size())) stepped_cv.Wait(&mu);
  }
  for (const auto& [id, n] : kParts) {
    EXPECT_EQ((*rt)->residency().Get(id)->pins[1], 0) << "gradient " << id << " still pinned";
  }
  ASSERT_TRUE((*rt)->CommitOptimizerStep().ok());
  ref.Step(1, grads);
  ExpectState(**rt, ref);
}

// Step 1 staged partition by partition, each from its gradient partition, and committed.
void StageEachAndCommit(Runtime& rt) {
  ASSERT_TRUE(rt.BeginOptimizerStep().ok());
  for (const auto& [id, n] : kParts) {
    ASSERT_TRUE(rt.StageOptimizerStep(1, {swap::StepInput{.id = id}}).ok());
  }
  ASSERT_TRUE(rt.CommitOptimizerStep().ok());
}

// The parameters of kParts' optimizer partitions (fp32, ids 100 above) registered in `tier`
// (`old`: 12's parameter's initial values, else none), then step 1 staged with each parameter as
// its copy's sink and committed; the optimizer partitions whose weights were written there.
std::vector<PartitionId> StepIntoParameterSinks(Runtime& rt, Tier tier,
                                                const std::vector<float>* old = nullptr,
                                                PartitionId lend = 0) {
  for (const auto& [id, n] : kParts) {
    tiering::PartitionDesc d = Desc(id + 100, n * 4);
    d.dtype = tiering::ElementType::kF32;
    absl::Span<const std::byte> initial;
    if (id == 12 && old != nullptr)
      initial = {reinterpret_cast<const std::byte*>(old->data()), n * 4};
    EXPECT_TRUE(rt.Register(d, tier, initial).ok());
  }
  if (lend != 0) EXPECT_TRUE(rt.Acquire(lend, Tier::kDevice).ok());  // the trainer still holds it
  EXPECT_TRUE(rt.BeginOptimizerStep().ok());
  for (const auto& [id, n] : kParts) {
    swap::StepInput in{.id = id};
    in.copy_to_sink = true;
    in.sink_target = id + 100;
    EXPECT_TRUE(rt.StageOptimizerStep(1, {in}).ok());
  }
  EXPECT_TRUE(rt.CommitOptimizerStep().ok());
  std::vector<PartitionId> copied = rt.TakeCopiedPartitions();
  std::sort(copied.begin(), copied.end());
  return copied;
}

// Each of kParts' parameter partitions (ids 100 above, fp32) unpinned and holding its master
// weights, as a sink wrote them.
void ExpectParametersHoldTheMasters(Runtime& rt, const Reference& ref) {
  for (size_t i = 0; i < kParts.size(); ++i) {
    const PartitionId pid = kParts[i].first + 100;
    EXPECT_EQ(rt.residency().Get(pid)->pins[1], 0) << pid << " still pinned";
    auto held = rt.Acquire(pid, Tier::kHost);
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_EQ(0, std::memcmp(*held, ref.p[i].data(), kParts[i].second * 4)) << pid;
    ASSERT_TRUE(rt.Release(pid, Tier::kHost, false).ok());
  }
}

// NVMe state committed a partition at a time (the CopySink's mode), with room for the
// parameters' partitions in the host and device tiers.
RuntimeConfig SinkConfig(const ScratchDir& dir) {
  RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
  config.optimizer_commit_each = true;
  config.host_budget_bytes += 64 * kSlot;
  config.device_budget_bytes += 64 * kSlot;
  return config;
}

// The same with the parameters homed on NVMe (offload_param "nvme").
RuntimeConfig NvmeHomedSinkConfig(const ScratchDir& dir) {
  RuntimeConfig config = SinkConfig(dir);
  config.offload_param.device = OffloadDevice::kNvme;
  return config;
}

// strata.optimizer_commit "partition": an input naming a parameter partition (homed on NVMe) as
// its copy's sink gets its new weights written there by the optimizer's thread once its state has
// landed, the partition released written (its host copy the latest: read back, it holds them);
// TakeCopiedPartitions says which; a sink that is not registered or not of the partition's size
// is named before anything is staged. The parameters' host copies are never all pinned at once.
TEST(RuntimeOptimizerTest, EachPartitionsNewWeightsGoIntoItsParameterPartitionAsItLands) {
  ScratchDir dir;
  const RuntimeConfig config = NvmeHomedSinkConfig(dir);
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  Reference ref;
  const auto grads = Grads(1);
  ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
  (*rt)->EndStep();
  EXPECT_THAT(StepIntoParameterSinks(**rt, Tier::kNvme), ElementsAre(11, 12, 13));
  // The old weights are not read from NVMe to be overwritten: each sink is given its room.
  EXPECT_EQ((*rt)->EndStep().nvme_by_role[static_cast<int>(tiering::Role::kParam)][0], 0u);
  ref.Step(1, grads);
  ExpectState(**rt, ref);
  EXPECT_TRUE((*rt)->TakeCopiedPartitions().empty());
  ExpectParametersHoldTheMasters(**rt, ref);
  // A sink partition that is not registered, or not of the optimizer partition's size.
  ASSERT_TRUE((*rt)->BeginOptimizerStep().ok());
  swap::StepInput unknown{.id = 11};
  unknown.copy_to_sink = true;
  unknown.sink_target = 999;
  EXPECT_THAT((*rt)->StageOptimizerStep(2, {unknown}).message(), HasSubstr("not registered"));
  swap::StepInput wrong = unknown;
  wrong.sink_target = 112;  // 12's parameter: 7001 elements, not 11's 5000
  EXPECT_THAT((*rt)->StageOptimizerStep(2, {wrong}).message(),
              HasSubstr("as many elements as the optimizer's partition"));
  EXPECT_TRUE((*rt)->AbortOptimizerStep().empty());
}

// A sink whose host room cannot be made (the host tier filled with pinned partitions as the
// step writes) reads the parameter's old weights as an acquire does, or is refused: the old bytes
// are never dropped before the new ones have their room (they were, found by an audit: the
// partition was left with no bytes, and read back as zeros).
TEST(RuntimeOptimizerTest, ASinkThatFindsNoHostRoomLeavesTheParameterItsBytes) {
  ScratchDir dir;
  const RuntimeConfig config = NvmeHomedSinkConfig(dir);
  RuntimeOptions options = Quiet();
  Runtime* runtime = nullptr;
  std::vector<PartitionId> fillers;
  std::atomic<bool> filled{false};
  options.on_optimizer_event = [&](swap::StepEvent e, PartitionId id) {
    if (e != swap::StepEvent::kWriteStarted || id != 12 || filled.exchange(true)) return;
    for (PartitionId f = 500;; ++f) {  // every page of the host tier pinned
      if (!runtime->Register(Desc(f, 4096), Tier::kHost).ok()) break;
      if (!runtime->Acquire(f, Tier::kHost).ok()) {
        runtime->Unregister(f).IgnoreError();
        break;
      }
      fillers.push_back(f);
    }
  };
  auto rt = Runtime::Create(config, options);
  ASSERT_TRUE(rt.ok()) << rt.status();
  runtime = rt->get();
  Reference ref;
  const auto grads = Grads(1);
  ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
  const std::vector<float> old(kParts[1].second, 7.0f);  // 12's parameter, 112
  const std::vector<PartitionId> copied = StepIntoParameterSinks(**rt, Tier::kNvme, &old);
  ASSERT_TRUE(filled.load());
  EXPECT_FALSE(std::count(copied.begin(), copied.end(), 12)) << "112 had no room";
  for (PartitionId f : fillers) ASSERT_TRUE((*rt)->Release(f, Tier::kHost, false).ok());
  EXPECT_TRUE((*rt)->residency().Get(112)->written);
  auto held = (*rt)->Acquire(112, Tier::kHost);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(0, std::memcmp(*held, old.data(), old.size() * 4)) << "112 lost its weights";
  ASSERT_TRUE((*rt)->Release(112, Tier::kHost, false).ok());
}

// zero_optimization.sub_group_size: partitions larger than it step in sub-groups. The ring set
// aside holds a sub-group, not the largest partition (the NVMe room counts each sub-group's blob
// in whole pages); the steps are CpuAdam's in memory bit for bit, with the step's gradients taken
// from their partitions and, with optimizer_commit "partition", each parameter's new weights
// written into its partition (one acquire and one release of it, whatever its sub-groups).
TEST(RuntimeOptimizerTest, SubGroupsBoundTheRingAndStepTheSameBits) {
  for (bool each : {false, true}) {
    SCOPED_TRACE(each ? "optimizer_commit partition" : "optimizer_commit step");
    ScratchDir dir;
    RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
    config.sub_group_size = 2000;  // 11: 3 sub-groups, 12: 4 (the last 1001), 13: 2
    config.optimizer_commit_each = each;
    config.offload_param.device = OffloadDevice::kNvme;
    config.host_budget_bytes += 64 * kSlot;
    auto rt = Runtime::Create(config, Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    Reference ref;
    const auto grads = Grads(1);
    ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
    const uint64_t piece = (2000 * 12 + 4095) / 4096 * 4096;
    const uint64_t stored = (2 + 3 + 1) * piece + 2 * ((1000 * 12 + 4095) / 4096 * 4096) +
                            (1001 * 12 + 4095) / 4096 * 4096;
    const auto& table = (*rt)->residency();
    EXPECT_EQ(table.set_aside_bytes(Tier::kHost),
              (each ? 4 * (piece + (2000 * 4 + 4095) / 4096 * 4096)
                    : 4 * piece + ((5000 + 7001 + 3000) * 2 + 4095) / 4096 * 4096) +
                  AutoReadAhead(config, 2000));
    EXPECT_EQ(table.set_aside_bytes(Tier::kNvme), each ? stored + piece : 2 * stored);
    if (each) {
      EXPECT_THAT(StepIntoParameterSinks(**rt, Tier::kNvme), ElementsAre(11, 12, 13));
    } else {
      ASSERT_NO_FATAL_FAILURE(StageEachAndCommit(**rt));
    }
    ref.Step(1, grads);
    ExpectState(**rt, ref);
    if (each) ExpectParametersHoldTheMasters(**rt, ref);
    for (const auto& [id, n] : kParts) EXPECT_EQ(table.Get(id)->pins[1], 0) << id;
    EXPECT_LE((*rt)->stats().host_held_bytes, config.host_budget_bytes);
  }
}

// A partition CreateOptimizer refuses (no elements) leaves the config as it was: optimizer_commit
// "auto" not answered, sub_group_size not fitted.
TEST(RuntimeOptimizerTest, ARefusedPartitionLeavesTheConfigAsItWas) {
  ScratchDir dir;
  RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
  config.host_budget_bytes -= 1 << 20;  // below the state: "auto" would answer "partition"
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  auto parts = kParts;
  parts.push_back({14, 0});
  EXPECT_THAT((*rt)->CreateOptimizer(Adam(), parts).message(), HasSubstr("has 0 elements"));
  EXPECT_TRUE((*rt)->config().optimizer_commit_auto);
  EXPECT_FALSE((*rt)->config().optimizer_commit_each);
  EXPECT_EQ((*rt)->config().sub_group_size, config.sub_group_size);
}

// A host budget whose room beside the staging pool would be more than a quarter taken by the ring
// at sub_group_size (here whole partitions): smaller sub-groups, said, and the same bits.
TEST(RuntimeOptimizerTest, SubGroupsShrinkToFitTheHostRoomAndStepTheSameBits) {
  ScratchDir dir;
  RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
  config.optimizer_commit_auto = false;  // "step", its staged copies counted
  std::vector<std::string> warnings;
  uint64_t room = 0;
  {
    auto probe = Runtime::Create(config, Quiet());
    ASSERT_TRUE(probe.ok()) << probe.status();
    // 4 ring buffers of 7001 elements' state would be 4 x 86016 bytes: give them 4 x 49152 beside
    // the staged copies (a quarter of it: 2048-element sub-groups).
    room = 4 * 4 * 2048 * 12 + (15001 * 2 + 4095) / 4096 * 4096;
    config.host_budget_bytes =
        config.host_budget_bytes - (*probe)->residency().budget_bytes(Tier::kHost) + room;
  }
  config.optimizer_read_ahead_bytes = 0;
  auto rt = Runtime::Create(config, Quiet(&warnings));
  ASSERT_TRUE(rt.ok()) << rt.status();
  Reference ref;
  const auto grads = Grads(1);
  ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
  EXPECT_THAT(warnings, ::testing::Contains(HasSubstr("sub-groups of 2048 elements, not 7001")));
  EXPECT_EQ((*rt)->config().sub_group_size, 2048);
  ASSERT_NO_FATAL_FAILURE(StageEachAndCommit(**rt));
  ref.Step(1, grads);
  ExpectState(**rt, ref);
  EXPECT_LE((*rt)->stats().host_held_bytes, config.host_budget_bytes);
}

// sub_group_size 0 set in a RuntimeConfig (the JSON refuses it): whole partitions (it divided by
// zero). With optimizer_commit "partition" and sub-groups smaller than a parameter's partition,
// the NVMe room set aside beside the state holds the largest blob the store copies on write, a
// parameter's partition (bf16: 2 bytes an element) as well as a sub-group's state: a store of
// exactly the parameters and what CreateOptimizer set aside takes every Initialize and a step
// (with a sub-group's room only, the first Initialize was refused).
TEST(RuntimeOptimizerTest, SubGroupSizeZeroIsWholeAndTheCommitRoomHoldsAParameter) {
  {
    ScratchDir dir;
    RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
    config.sub_group_size = 0;
    auto rt = Runtime::Create(config, Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
  }
  auto pages = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  auto run = [&](uint64_t capacity, uint64_t* set_aside) -> absl::Status {
    ScratchDir dir;
    RuntimeConfig config = OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme);
    config.sub_group_size = 500;  // 6000-byte pieces: smaller than 12's 14002-byte parameter
    config.optimizer_commit_each = true;
    config.offload_param.device = OffloadDevice::kNvme;
    if (capacity > 0) config.nvme_capacity_bytes = capacity;
    auto rt = Runtime::Create(config, Quiet());
    if (!rt.ok()) return rt.status();
    for (const auto& [id, n] : kParts) {
      tiering::PartitionDesc d = Desc(id + 100, n * 2);
      d.dtype = tiering::ElementType::kBF16;
      STRATA_RETURN_IF_ERROR((*rt)->Register(d, Tier::kNvme));
    }
    STRATA_RETURN_IF_ERROR((*rt)->CreateOptimizer(Adam(), kParts));
    *set_aside = (*rt)->residency().set_aside_bytes(Tier::kNvme);
    Reference ref;
    for (size_t i = 0; i < kParts.size(); ++i) {
      STRATA_RETURN_IF_ERROR((*rt)->InitializeOptimizerState(kParts[i].first, ref.p[i]));
    }
    const auto grads = Grads(1);
    return (*rt)->OptimizerStep(1, Inputs(grads)).status();
  };
  uint64_t set_aside = 0;
  ASSERT_TRUE(run(0, &set_aside).ok());
  EXPECT_GE(set_aside, pages(7001 * 2));
  const uint64_t params = pages(5000 * 2) + pages(7001 * 2) + pages(3000 * 2);
  uint64_t again = 0;
  absl::Status tight = run(params + set_aside, &again);
  EXPECT_TRUE(tight.ok()) << tight;
  EXPECT_EQ(again, set_aside);
}

// A parameter still lent to the device (pinned there) when its state lands: writing its host copy
// could not make the device copy stale under its holder, so the sink leaves it alone (not in
// TakeCopiedPartitions, for the caller to write later); no pin is left behind and every current
// copy keeps the old bytes.
TEST(RuntimeOptimizerTest, ASinkPartitionLentToTheDeviceIsLeftForTheCallerWithNoPinBehind) {
  ScratchDir dir;
  const RuntimeConfig config = SinkConfig(dir);
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  Reference ref;
  const auto grads = Grads(1);
  ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
  const std::vector<float> old(kParts[1].second, 7.0f);  // 12's parameter: 7s
  EXPECT_THAT(StepIntoParameterSinks(**rt, Tier::kHost, &old, /*lend=*/112), ElementsAre(11, 13));
  ref.Step(1, grads);
  ExpectState(**rt, ref);  // the step stands
  EXPECT_EQ((*rt)->residency().Get(112)->pins[1], 0) << "a host pin left behind";
  ASSERT_TRUE((*rt)->Release(112, Tier::kDevice, false).ok());
  auto held = (*rt)->Acquire(112, Tier::kHost);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(0, std::memcmp(*held, old.data(), old.size() * 4)) << "the old weights, untouched";
  ASSERT_TRUE((*rt)->Release(112, Tier::kHost, false).ok());
  EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
}

// The same, but the parameter is lent after the sink took it and before its weights are released
// written (the trainer acquiring it on the device meanwhile): the written release is refused, so
// the sink lets its pin go as it was, says so, and does not count the weights placed (the pin was
// left behind for good before: the partition could not even be unregistered).
TEST(RuntimeOptimizerTest, ASinkPartitionLentWhileItIsWrittenLeavesNoPinBehind) {
  ScratchDir dir;
  const RuntimeConfig config = SinkConfig(dir);
  RuntimeOptions options = Quiet();
  Runtime* runtime = nullptr;
  std::atomic<bool> lent{false};
  options.on_optimizer_event = [&](swap::StepEvent e, PartitionId id) {
    if (e == swap::StepEvent::kSinkHeld && id == 12 && !lent.exchange(true)) {
      EXPECT_TRUE(runtime->Acquire(112, Tier::kDevice).ok());  // the trainer lends it now
    }
  };
  auto rt = Runtime::Create(config, options);
  ASSERT_TRUE(rt.ok()) << rt.status();
  runtime = rt->get();
  Reference ref;
  const auto grads = Grads(1);
  ASSERT_NO_FATAL_FAILURE(SetUpStagedOptimizer(**rt, ref, &grads));
  EXPECT_THAT(StepIntoParameterSinks(**rt, Tier::kHost), ElementsAre(11, 13));
  EXPECT_TRUE(lent);
  ref.Step(1, grads);
  ExpectState(**rt, ref);  // the step stands
  EXPECT_EQ((*rt)->residency().Get(112)->pins[1], 0) << "a host pin left behind";
  const std::vector<std::string> warnings = (*rt)->warnings();
  EXPECT_TRUE(std::any_of(warnings.begin(), warnings.end(), [](const std::string& w) {
    return w.find("partition 112 was lent while 12's new weights were written") !=
           std::string::npos;
  }));
  ASSERT_TRUE((*rt)->Release(112, Tier::kDevice, false).ok());
  EXPECT_TRUE((*rt)->Unregister(112).ok());
  EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
}

// Begin twice, Stage or Commit with none open, a staged step beside OptimizerStep, a gradient
// partition that is not registered or not of the optimizer partition's size: each named.
TEST(RuntimeOptimizerTest, StagedStepMisuseIsNamed) {
  ScratchDir dir;
  const auto grads = Grads(1);  // outlives the Runtime, whose destructor aborts the step using it
  auto rt = Runtime::Create(OptimizerConfig(dir.File("swap"), OffloadDevice::kNvme), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_EQ((*rt)->BeginOptimizerStep().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*rt)->CreateOptimizer(Adam(), kParts).ok());
  Reference ref;
  for (size_t i = 0; i < kParts.size(); ++i) {
    ASSERT_TRUE((*rt)->InitializeOptimizerState(kParts[i].first, ref.p[i]).ok());
  }
  EXPECT_EQ((*rt)->StageOptimizerStep(1, {swap::StepInput{.id = 11}}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*rt)->CommitOptimizerStep().status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*rt)->BeginOptimizerStep().ok());
  EXPECT_EQ((*rt)->BeginOptimizerStep().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*rt)->OptimizerStep(1, Inputs(grads)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // No gradient partition 12; gradient partition 13 of the wrong size: named at once.
  absl::Status s = (*rt)->StageOptimizerStep(1, {swap::StepInput{.id = 12}});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("gradient partition 12 is not registered"));
  ASSERT_TRUE((*rt)->Register(Desc(13, 4 * 2999, tiering::Role::kGrad), Tier::kHost).ok());
  s = (*rt)->StageOptimizerStep(1, {swap::StepInput{.id = 13}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("as many elements as the optimizer's partition (3000)"));
  // Refused inputs staged nothing: the step goes on.
  ASSERT_TRUE((*rt)->StageOptimizerStep(1, Inputs(grads)).ok());
  auto r = (*rt)->CommitOptimizerStep();
  ASSERT_TRUE(r.ok()) << r.status();
  ref.Step(1, grads);
  ExpectState(**rt, ref);
  // Left open: the destructor aborts it.
  ASSERT_TRUE((*rt)->BeginOptimizerStep().ok());
  ASSERT_TRUE((*rt)->StageOptimizerStep(1, Inputs(grads)).ok());
}

TEST(RuntimeOptimizerTest, BadUsesAreNamed) {
  ScratchDir dir;
  RuntimeConfig none = OptimizerConfig(dir.File("swap"), OffloadDevice::kNone);
  auto rt = Runtime::Create(none, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  absl::Status s = (*rt)->CreateOptimizer(Adam(), kParts);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("offload_optimizer.device is \"none\""));
  EXPECT_EQ((*rt)->OptimizerStep(1, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<float> master(5000);
  EXPECT_THAT((*rt)->InitializeOptimizerState(11, master).message(),
              HasSubstr("CreateOptimizer first"));
  EXPECT_THAT((*rt)->Register(Desc(PartitionId{1} << 63), Tier::kHost).message(),
              HasSubstr("ids are below 2^63"));
  rt->reset();

  ScratchDir dir2;
  RuntimeConfig small = OptimizerConfig(dir2.File("swap"), OffloadDevice::kCpu);
  {
    // Duplicate ids are refused before anything is allocated: no pinned memory is left behind.
    auto dup = Runtime::Create(small, Quiet());
    ASSERT_TRUE(dup.ok()) << dup.status();
    for (int i = 0; i < 3; ++i) {
      absl::Status twice = (*dup)->CreateOptimizer(Adam(), {{1, 8000}, {1, 8000}});
      EXPECT_THAT(twice.message(), HasSubstr("listed twice"));
    }
    EXPECT_EQ((*dup)->residency().set_aside_bytes(Tier::kHost), 0u);
    // The whole host budget is still there: fill the host tier to its last page, then move
    // through the staging buffers (which come out of the same pinned pool).
    const uint64_t room = (*dup)->residency().budget_bytes(Tier::kHost);
    for (PartitionId id = 100; (id - 99) * kSlot <= room; ++id) {
      ASSERT_TRUE((*dup)->Register(Desc(id), Tier::kHost).ok()) << id;
    }
    absl::Status staged = (*dup)->Register(Desc(99), Tier::kNvme, RandomBytes(kBytes, 99));
    EXPECT_TRUE(staged.ok()) << staged;
  }
  small.host_budget_bytes = 4 * (64 << 10) + 100 * 4096;  // 100 pages besides the staging
  auto tight = Runtime::Create(small, Quiet());
  ASSERT_TRUE(tight.ok()) << tight.status();
  s = (*tight)->CreateOptimizer(Adam(), {{1, 1 << 20}});  // 12 MiB of state
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("need 12582912 bytes of the host tier; accepted: "
                                     "strata.host_budget_bytes with room for them"));
  EXPECT_EQ((*tight)->residency().set_aside_bytes(Tier::kHost), 0u);
  ASSERT_TRUE((*tight)->CreateOptimizer(Adam(), {{1, 1000}, {2, 1000}}).ok());
  EXPECT_THAT((*tight)->CreateOptimizer(Adam(), {{3, 1000}}).message(),
              HasSubstr("has one already"));
  EXPECT_THAT((*tight)->CreateOptimizer(Adam(), {}).message(), HasSubstr("has one already"));
  auto unknown = (*tight)->OptimizerStep(1, {swap::StepInput{.id = 7}});
  // With the optimizer's room set aside, a partition larger than what is left is refused at
  // once: nothing is evicted for it.
  ASSERT_TRUE((*tight)->Register(Desc(20, 40000), Tier::kHost, RandomBytes(40000, 20)).ok());
  const uint64_t left = (*tight)->residency().budget_bytes(Tier::kHost) -
                        (*tight)->residency().set_aside_bytes(Tier::kHost);
  absl::Status big = (*tight)->Register(Desc(21, left + 1), Tier::kHost);
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted) << big;
  EXPECT_THAT(big.message(), HasSubstr("set aside for the optimizer"));
  EXPECT_TRUE((*tight)->residency().Get(20)->has_copy[1]) << "evicted for nothing";
  EXPECT_EQ((*tight)->stats().evictions, 0u);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("partition 7"));
  EXPECT_EQ((*tight)->residency().set_aside_bytes(Tier::kNvme), 0u);
  EXPECT_EQ((*tight)->residency().set_aside_bytes(Tier::kHost), 2 * 12288u);
}

}  // namespace
}  // namespace strata::sched
