// Runtime::Discard: a partition whose bytes are no longer needed (a gradient once stepped) comes
// back as zeros made in place, without a byte crossing the link or the disk; what it refuses, what
// a restart finds, and how the scheduler treats it.
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

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
using ::strata::sched::testing::Quiet;
using ::strata::testing::RandomBytes;
using ::strata::testing::ScratchDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

uint64_t Moved(const Runtime& rt) {
  uint64_t total = 0;
  for (const auto& row : rt.stats().bytes_moved) {
    for (uint64_t b : row) total += b;
  }
  return total;
}

bool AllZero(const std::byte* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != std::byte{0}) return false;
  }
  return true;
}

TEST(RuntimeDiscardTest, ADiscardedPartitionComesBackAsZerosWithoutMovingAByte) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto grad = Desc(1, kBytes, tiering::Role::kGrad);
  ASSERT_TRUE((*rt)->Register(grad, Tier::kNvme, RandomBytes(kBytes, 1)).ok());
  for (Tier tier : {Tier::kDevice, Tier::kHost}) {
    SCOPED_TRACE(TierName(tier));
    // Give it bytes in both memory tiers, then discard them.
    auto p = (*rt)->Acquire(1, Tier::kHost);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
    p = (*rt)->Acquire(1, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << p.status();
    std::memset(*p, 0x5a, kBytes);
    ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, true).ok());
    ASSERT_TRUE((*rt)->Discard(1).ok());
    auto r = (*rt)->residency().Get(1);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->written);
    EXPECT_THAT(r->current, ElementsAre(false, false, false));
    EXPECT_THAT(r->has_copy, ElementsAre(false, false, true));  // the extent stays for reuse
    EXPECT_EQ((*rt)->residency().used_bytes(Tier::kDevice), 0u);
    EXPECT_EQ((*rt)->residency().used_bytes(Tier::kHost), 0u);

    (void)(*rt)->EndStep();
    const uint64_t moved = Moved(**rt);
    p = (*rt)->Acquire(1, tier);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(AllZero(*p, kBytes));
    EXPECT_EQ(Moved(**rt), moved) << "zeros are made in place: nothing crosses a link";
    std::memset(*p, 0x33, kBytes);
    ASSERT_TRUE((*rt)->Release(1, tier, true).ok());
    const StepReport report = (*rt)->EndStep();
    EXPECT_EQ(report.zero_fills, 1u);
    EXPECT_EQ(report.misses, 0u);
    EXPECT_EQ(report.hits, 0u);
    // Written again, it is an ordinary partition: its bytes survive eviction to NVMe.
    ASSERT_TRUE((*rt)->Evict(1, tier).ok());
    if (tier == Tier::kDevice) ASSERT_TRUE((*rt)->Evict(1, Tier::kHost).ok());
    p = (*rt)->Acquire(1, Tier::kHost);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ((*p)[kBytes - 1], std::byte{0x33});
    ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  }
  EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
}

// Acquire(..., overwrite): the caller writes every byte, so a discarded partition is given its
// room without zeros (the copy engine zeroes nothing; a gradient's first micro-batch copies into
// it); the bytes it writes are the partition's. A partition with bytes is brought as ever.
TEST(RuntimeDiscardTest, AnOverwritingAcquireOfADiscardedPartitionMakesNoZeros) {
  ScratchDir dir;
  auto zeros = std::make_shared<std::atomic<int>>(0);
  RuntimeOptions ro = Quiet();
  ro.wrap_copy_engine = [zeros](std::unique_ptr<tiering::CopyEngine> inner) {
    class Counting final : public tiering::CopyEngine {
     public:
      Counting(std::unique_ptr<tiering::CopyEngine> inner, std::shared_ptr<std::atomic<int>> n)
          : inner_(std::move(inner)), n_(std::move(n)) {}
      void Copy(void* dst, const void* src, size_t bytes, tiering::CopyDirection d,
                Done done) override {
        inner_->Copy(dst, src, bytes, d, std::move(done));
      }
      void Zero(void* dst, size_t bytes, Done done) override {
        ++*n_;
        inner_->Zero(dst, bytes, std::move(done));
      }
      absl::string_view name() const override { return "counting"; }

     private:
      std::unique_ptr<tiering::CopyEngine> inner_;
      std::shared_ptr<std::atomic<int>> n_;
    };
    return std::unique_ptr<tiering::CopyEngine>(new Counting(std::move(inner), zeros));
  };
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), ro);
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto grad = Desc(1, kBytes, tiering::Role::kGrad);
  ASSERT_TRUE((*rt)->Register(grad, Tier::kNvme, RandomBytes(kBytes, 1)).ok());
  for (bool overwrite : {false, true}) {
    SCOPED_TRACE(overwrite ? "overwrite" : "zeros");
    ASSERT_TRUE((*rt)->Discard(1).ok());
    const int before = zeros->load();
    auto p = (*rt)->Acquire(1, Tier::kDevice, Access::kTraced, overwrite);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(zeros->load() - before, overwrite ? 0 : 1);
    std::memset(*p, 0x44, kBytes);
    ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, true).ok());
    ASSERT_TRUE((*rt)->Evict(1, Tier::kDevice).ok());
    auto h = (*rt)->Acquire(1, Tier::kHost);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ((*h)[0], std::byte{0x44});
    EXPECT_EQ((*h)[kBytes - 1], std::byte{0x44});
    ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  }
  // With bytes, an overwriting acquire brings them as any acquire does.
  auto p = (*rt)->Acquire(1, Tier::kDevice, Access::kTraced, /*overwrite=*/true);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)[kBytes / 2], std::byte{0x44});
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
}

TEST(RuntimeDiscardTest, ADiscardIsRefusedWhilePinnedAndNamesAnUnknownPartition) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto bytes = RandomBytes(kBytes, 2);
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, bytes).ok());
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::Status s = (*rt)->Discard(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("pinned in device"));
  // Nothing changed: the pinned copy is still current and holds its bytes.
  EXPECT_EQ(0, std::memcmp(*p, bytes.data(), kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  EXPECT_TRUE((*rt)->residency().Get(1)->written);
  s = (*rt)->Discard(7);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("discard partition 7: not registered"));
}

TEST(RuntimeDiscardTest, FlushSkipsADiscardedPartitionAndARestartFindsItsLastStoredBytes) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 2, 2);
  config.nvme_keep_files = true;  // what the next Runtime adopts
  const auto stored = RandomBytes(kBytes, 3);
  {
    auto rt = Runtime::Create(config, Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, stored).ok());
    auto p = (*rt)->Acquire(1, Tier::kHost);
    ASSERT_TRUE(p.ok()) << p.status();
    std::memset(*p, 0x11, kBytes);  // changed, never written back: discarded below
    ASSERT_TRUE((*rt)->Release(1, Tier::kHost, true).ok());
    ASSERT_TRUE((*rt)->Discard(1).ok());
    ASSERT_TRUE((*rt)->Flush().ok());
    EXPECT_EQ((*rt)->stats().write_backs, 0u);
  }
  std::vector<std::string> warnings;
  auto rt = Runtime::Create(config, Quiet(&warnings));
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Adopt(Desc(1)).ok());
  auto p = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(0, std::memcmp(*p, stored.data(), kBytes)) << "the store's copy, as the header says";
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
}

// A copy link slow enough (4 MB/s: 25 ms for a partition) that a move is surely in flight when
// another thread calls in.
RuntimeConfig SlowLink(const std::string& path) {
  RuntimeConfig c = Config(path, 2, 2);
  c.copy_bandwidth_bytes_per_s = 4'000'000;
  return c;
}

TEST(RuntimeDiscardTest, ADiscardWaitsForTheWriteBackInFlightToEnd) {
  ScratchDir dir;
  auto rt = Runtime::Create(SlowLink(dir.File("swap")), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE(
      (*rt)
          ->Register(Desc(1, kBytes, tiering::Role::kGrad), Tier::kDevice, RandomBytes(kBytes, 5))
          .ok());
  // The device copy is the only one: evicting it writes it down to the host over the slow link.
  std::thread evict([&] { EXPECT_TRUE((*rt)->Evict(1, Tier::kDevice).ok()); });
  while (!(*rt)->residency().Get(1)->move) std::this_thread::yield();
  ASSERT_TRUE((*rt)->Discard(1).ok());
  // The discard came after the write-back had ended (it was not cut short) and took effect.
  EXPECT_EQ((*rt)->stats().write_backs, 1u);
  auto r = (*rt)->residency().Get(1);
  EXPECT_FALSE(r->move);
  EXPECT_FALSE(r->written);
  evict.join();
  EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
  auto p = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(AllZero(*p, kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
}

TEST(RuntimeDiscardTest, ADiscardRacingAnUnregisterOfThePartitionEndsCleanly) {
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(round);
    ScratchDir dir;
    auto rt = Runtime::Create(SlowLink(dir.File("swap")), Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kDevice, RandomBytes(kBytes, 6)).ok());
    std::thread evict([&] { (void)(*rt)->Evict(1, Tier::kDevice); });
    while (!(*rt)->residency().Get(1)->move) std::this_thread::yield();
    // Both wait for the move; whichever goes first, the other finds the partition gone (or
    // discarded), and nothing reads freed state.
    absl::Status discarded, unregistered;
    std::thread discard([&] { discarded = (*rt)->Discard(1); });
    std::thread unregister([&] { unregistered = (*rt)->Unregister(1); });
    discard.join();
    unregister.join();
    evict.join();
    EXPECT_TRUE(discarded.ok() || discarded.code() == absl::StatusCode::kNotFound) << discarded;
    EXPECT_TRUE(unregistered.ok()) << unregistered;
    EXPECT_FALSE((*rt)->residency().Get(1).ok());
    EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
  }
}

TEST(RuntimeDiscardTest, EveryAcquireIsCountedOnceWhenTwoThreadsWantTheZeros) {
  ScratchDir dir;
  auto rt = Runtime::Create(SlowLink(dir.File("swap")), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1, kBytes, tiering::Role::kGrad), Tier::kHost).ok());
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE(round);
    ASSERT_TRUE((*rt)->Discard(1).ok());
    (void)(*rt)->EndStep();
    // One thread makes the zeros; the other finds them made, or being made, and joins or copies.
    std::thread other([&] {
      auto p = (*rt)->Acquire(1, Tier::kHost);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_TRUE(AllZero(*p, kBytes));
      EXPECT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
    });
    auto p = (*rt)->Acquire(1, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(AllZero(*p, kBytes));
    ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
    other.join();
    const StepReport r = (*rt)->EndStep();
    EXPECT_EQ(r.acquires, 2u);
    EXPECT_EQ(r.hits + r.zero_fills + r.late_prefetches + r.misses, 2u);
    EXPECT_GE(r.zero_fills, 1u);
  }
  // An explicit Prefetch of a discarded partition makes its zeros ahead: the Acquire is a hit.
  ASSERT_TRUE((*rt)->Discard(1).ok());
  (void)(*rt)->EndStep();
  ASSERT_TRUE((*rt)->Prefetch(1, Tier::kDevice).get().ok());
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(AllZero(*p, kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  const StepReport r = (*rt)->EndStep();
  EXPECT_EQ(r.zero_fills, 0u);
  EXPECT_EQ(r.prefetch_hits, 1u);
}

// Round after round, a gradient released dirty and handed to GradientReady is discarded (whether
// its background eviction has run yet or not): the next Acquire sees zeros, and another
// partition's bytes are untouched. (A discard overlapping a write-back for sure: above.)
TEST(RuntimeDiscardTest, RepeatedDiscardsAfterGradientReadyGiveZerosAndLeaveOthersAlone) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto other = RandomBytes(kBytes, 4);
  ASSERT_TRUE((*rt)->Register(Desc(1, kBytes, tiering::Role::kGrad), Tier::kHost).ok());
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kHost, other).ok());
  for (int round = 0; round < 20; ++round) {
    auto p = (*rt)->Acquire(1, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(AllZero(*p, kBytes)) << "round " << round;
    std::memset(*p, 0x77, kBytes);
    ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, true).ok());
    (*rt)->GradientReady(1);  // it leaves the device in the background: racing the discard
    if (round % 2) std::this_thread::sleep_for(std::chrono::microseconds(100 * round));
    ASSERT_TRUE((*rt)->Discard(1).ok());
    ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
    auto q = (*rt)->Acquire(2, Tier::kDevice);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(0, std::memcmp(*q, other.data(), kBytes));
    ASSERT_TRUE((*rt)->Release(2, Tier::kDevice, false).ok());
    (void)(*rt)->EndStep();
  }
}

// Planned steps: the scheduler never prefetches a discarded partition (its zeros would only take
// room early), and the trainer's acquire of it waits for nothing.
TEST(RuntimeDiscardTest, PlannedStepsMakeDiscardedGradientsInPlaceAndPrefetchTheRest) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 3, 8);
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  constexpr int kLayers = 4;
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE((*rt)->Register(Desc(2 * l), Tier::kNvme, RandomBytes(kBytes, l)).ok());
    ASSERT_TRUE((*rt)->Register(Desc(2 * l + 1, kBytes, tiering::Role::kGrad), Tier::kNvme).ok());
  }
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE(step);
    for (int l = kLayers - 1; l >= 0; --l) {  // backward: parameters read, gradients written
      auto param = (*rt)->Acquire(2 * l, Tier::kDevice);
      ASSERT_TRUE(param.ok()) << param.status();
      auto grad = (*rt)->Acquire(2 * l + 1, Tier::kDevice);
      ASSERT_TRUE(grad.ok()) << grad.status();
      if (step > 0) EXPECT_TRUE(AllZero(*grad, kBytes)) << "layer " << l;
      std::memset(*grad, l + 1, kBytes);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ASSERT_TRUE((*rt)->Release(2 * l, Tier::kDevice, false).ok());
      ASSERT_TRUE((*rt)->Release(2 * l + 1, Tier::kDevice, true).ok());
      (*rt)->GradientReady(2 * l + 1);
    }
    for (int l = kLayers - 1; l >= 0; --l) {  // the optimizer reads each gradient, then drops it
      auto grad = (*rt)->Acquire(2 * l + 1, Tier::kHost);
      ASSERT_TRUE(grad.ok()) << grad.status();
      EXPECT_EQ((*grad)[0], std::byte(l + 1));
      ASSERT_TRUE((*rt)->Release(2 * l + 1, Tier::kHost, false).ok());
      ASSERT_TRUE((*rt)->Discard(2 * l + 1).ok());
    }
    const StepReport r = (*rt)->EndStep();
    if (step == 0) {
      EXPECT_EQ(r.zero_fills, 0u);  // registered with zeros on NVMe: read like any partition
    } else {
      EXPECT_EQ(r.zero_fills, static_cast<uint64_t>(kLayers));
      // The host holds everything: what goes up to the device is parameters, never a gradient.
      EXPECT_LE(r.bytes_moved[1][0], kLayers * kBytes);
    }
  }
}

}  // namespace
}  // namespace strata::sched
