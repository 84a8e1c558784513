// The Runtime at its edges, on the host-emulated device tier: budgets that are not whole pages, a
// partition larger than a budget, registration racing unregistration, a dirty release that the
// other tier's pin refuses, prefetches that must not wait or must read from NVMe, what the step
// report counts, and warning callbacks that call back into the Runtime.
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <thread>

#include "aio/fault_injection.h"
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
using ::strata::sched::testing::WithinSeconds;
using ::strata::testing::RandomBytes;
using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr int kDevice = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

RuntimeOptions WithFaults(std::shared_ptr<aio::FaultInjector> injector) {
  RuntimeOptions ro = Quiet();
  ro.engine_options.wrap_backend = aio::FaultInjector::ForEngine(std::move(injector));
  ro.engine_options.on_warning = [](absl::string_view) {};
  return ro;
}

TEST(RuntimeEdgesTest, ABudgetThatIsNotWholePagesEvictsInsteadOfSpinning) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 2, 4);
  // Room for one partition's 25 pages and not quite two: the second needs an eviction.
  config.device_budget_bytes = 2 * kSlot - 1000;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kDevice, RandomBytes(kBytes, 1)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kHost, RandomBytes(kBytes, 2)).ok());
  WithinSeconds(20, "an Acquire needing an eviction under a budget of part pages", [&] {
    auto p = (*rt)->Acquire(2, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(0, std::memcmp(*p, RandomBytes(kBytes, 2).data(), kBytes));
    ASSERT_TRUE((*rt)->Release(2, Tier::kDevice, false).ok());
  });
  EXPECT_FALSE((*rt)->residency().Get(1)->has_copy[kDevice]);
  // A registration that needs the same room.
  WithinSeconds(20, "a Register needing an eviction under a budget of part pages", [&] {
    ASSERT_TRUE((*rt)->Register(Desc(3), Tier::kDevice, RandomBytes(kBytes, 3)).ok());
  });
  auto back = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(0, std::memcmp(*back, RandomBytes(kBytes, 1).data(), kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
}

TEST(RuntimeEdgesTest, APartitionLargerThanABudgetFailsAtOnceAndEvictsNothing) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 3, 8), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  for (PartitionId id = 1; id <= 3; ++id) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kDevice, RandomBytes(kBytes, id)).ok());
  }
  ASSERT_TRUE((*rt)->Register(Desc(4, 4 * kBytes), Tier::kHost).ok());
  auto p = (*rt)->Acquire(4, Tier::kDevice);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr("larger than the device tier's budget"));
  absl::Status r = (*rt)->Register(Desc(5, 4 * kBytes), Tier::kDevice);
  EXPECT_EQ(r.code(), absl::StatusCode::kResourceExhausted) << r;
  EXPECT_THAT(r.message(), HasSubstr("larger than the device tier's budget"));
  EXPECT_FALSE((*rt)->residency().Get(5).ok());
  for (PartitionId id = 1; id <= 3; ++id) {
    EXPECT_TRUE((*rt)->residency().Get(id)->has_copy[kDevice]) << id << " was evicted for nothing";
  }
  EXPECT_EQ((*rt)->stats().write_backs, 0u);
}

TEST(RuntimeEdgesTest, UnregisteringAPartitionBeingRegisteredIsRefused) {
  ScratchDir dir;
  aio::FaultRule slow = aio::FaultRule::Latency(std::chrono::milliseconds(400));
  slow.only = aio::OpKind::kWrite;
  auto injector = std::make_shared<aio::FaultInjector>(1, std::vector<aio::FaultRule>{slow});
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), WithFaults(injector));
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto bytes = RandomBytes(kBytes, 1);
  std::future<absl::Status> registered =
      std::async(std::launch::async, [&] { return (*rt)->Register(Desc(1), Tier::kNvme, bytes); });
  while (!(*rt)->residency().Get(1).ok()) std::this_thread::yield();
  absl::Status u = (*rt)->Unregister(1);
  EXPECT_EQ(u.code(), absl::StatusCode::kFailedPrecondition) << u;
  EXPECT_THAT(u.message(), HasSubstr("being registered"));
  ASSERT_TRUE(registered.get().ok());
  injector->Arm(false);
  auto p = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(0, std::memcmp(*p, bytes.data(), kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  // Now it unregisters, store copy and all; a second Unregister finds nothing.
  ASSERT_TRUE((*rt)->Unregister(1).ok());
  EXPECT_TRUE((*rt)->StoredPartitions().empty());
  EXPECT_EQ((*rt)->Unregister(1).code(), absl::StatusCode::kNotFound);
}

TEST(RuntimeEdgesTest, ADirtyReleaseRefusedByTheOtherTiersPinKeepsThePinForARetry) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, RandomBytes(kBytes, 1)).ok());
  auto host = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(host.ok());
  auto device = (*rt)->Acquire(1, Tier::kDevice);  // a second holder, reading
  ASSERT_TRUE(device.ok());
  const auto changed = RandomBytes(kBytes, 7);
  std::memcpy(*host, changed.data(), kBytes);
  absl::Status refused = (*rt)->Release(1, Tier::kHost, true);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("release it again"));
  EXPECT_EQ((*rt)->residency().Get(1)->pins[kHost], 1) << "the pin went with the refused write";
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, true).ok());
  EXPECT_FALSE((*rt)->residency().Get(1)->has_copy[kDevice]) << "the stale copy stayed";
  auto again = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(0, std::memcmp(*again, changed.data(), kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
}

TEST(RuntimeEdgesTest, APrefetchsEvictionDoesNotWaitForRoomBelowItGoesToNvme) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 2, 1);
  config.copy_bandwidth_bytes_per_s = 400000;  // a quarter of a second per copy
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kDevice, RandomBytes(kBytes, 1)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kDevice, RandomBytes(kBytes, 2)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(3), Tier::kNvme, RandomBytes(kBytes, 3)).ok());
  // 2 goes down into the host's only slot (a copy in flight); 3 wants the device, whose other
  // copy (1, its only current copy) could go down to the host only once 2's move has ended. The
  // prefetch does not wait for that: 1 goes straight to NVMe.
  std::future<absl::Status> down =
      std::async(std::launch::async, [&] { return (*rt)->Evict(2, Tier::kDevice); });
  while (!(*rt)->residency().Get(2)->move) std::this_thread::yield();
  absl::Status prefetched = (*rt)->Prefetch(3, Tier::kDevice).get();
  EXPECT_TRUE(prefetched.ok()) << prefetched;
  ASSERT_TRUE(down.get().ok());
  const RuntimeStats stats = (*rt)->stats();
  EXPECT_EQ(stats.bytes_moved[kDevice][2], kBytes) << "1 did not go straight to NVMe";
  EXPECT_EQ(stats.bytes_moved[kHost][2], 0u) << "the prefetch waited, then evicted 2 for 1";
  for (PartitionId id = 1; id <= 3; ++id) {
    auto p = (*rt)->Acquire(id, Tier::kHost);
    ASSERT_TRUE(p.ok()) << id << ": " << p.status();
    EXPECT_EQ(0, std::memcmp(*p, RandomBytes(kBytes, id).data(), kBytes)) << id;
    ASSERT_TRUE((*rt)->Release(id, Tier::kHost, false).ok());
  }
}

TEST(RuntimeEdgesTest, APrefetchReadsFromNvmeWhenTheOtherMemoryCopyIsPinned) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, RandomBytes(kBytes, 1)).ok());
  auto host = (*rt)->Acquire(1, Tier::kHost);  // clean: NVMe holds the same bytes
  ASSERT_TRUE(host.ok());
  absl::Status s = (*rt)->Prefetch(1, Tier::kDevice).get();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE((*rt)->residency().Get(1)->current[kDevice]);
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  auto device = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(device.ok());
  EXPECT_EQ(0, std::memcmp(*device, RandomBytes(kBytes, 1).data(), kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  const StepReport report = (*rt)->EndStep();
  EXPECT_EQ(report.prefetch_hits, 1u);
  EXPECT_EQ(report.bytes_moved[2][0], kBytes);
}

TEST(RuntimeEdgesTest, AnAcquireJoiningAnEvictionIsAMissThatWaitedForAWriteBack) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 2, 2);
  config.copy_bandwidth_bytes_per_s = 200000;  // the device -> host copy takes half a second
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kDevice, RandomBytes(kBytes, 1)).ok());
  std::future<absl::Status> evicted =
      std::async(std::launch::async, [&] { return (*rt)->Evict(1, Tier::kDevice); });
  while (!(*rt)->residency().Get(1)->move) std::this_thread::yield();
  auto p = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(0, std::memcmp(*p, RandomBytes(kBytes, 1).data(), kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  ASSERT_TRUE(evicted.get().ok());
  const StepReport report = (*rt)->EndStep();
  EXPECT_EQ(report.misses, 1u);
  EXPECT_EQ(report.late_prefetches, 0u);
  EXPECT_GT(report.wait_by_cause[static_cast<int>(WaitCause::kWriteBack)], 0.2);
  EXPECT_EQ(report.wait_by_cause[static_cast<int>(WaitCause::kCopy)], 0.0);
}

TEST(RuntimeEdgesTest, APrefetchOfACopyAlreadyThereIsNoPrefetchHit) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, RandomBytes(kBytes, 1)).ok());
  ASSERT_TRUE((*rt)->Prefetch(1, Tier::kHost).get().ok());
  // A prefetch into the device does not make the host copy's Acquire a prefetch hit either.
  ASSERT_TRUE((*rt)->Prefetch(1, Tier::kDevice).get().ok());
  ASSERT_TRUE((*rt)->Acquire(1, Tier::kHost).ok());
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  StepReport report = (*rt)->EndStep();
  EXPECT_EQ(report.hits, 1u);
  EXPECT_EQ(report.prefetch_hits, 0u);
  ASSERT_TRUE((*rt)->Acquire(1, Tier::kDevice).ok());
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  report = (*rt)->EndStep();
  EXPECT_EQ(report.prefetch_hits, 1u);
}

TEST(RuntimeEdgesTest, AGradientWriteBackThatFailsIsCountedAsSuchAndTheGradientStays) {
  ScratchDir dir;
  aio::FaultRule enospc = aio::FaultRule::Error(ENOSPC);
  enospc.only = aio::OpKind::kWrite;
  auto injector = std::make_shared<aio::FaultInjector>(1, std::vector<aio::FaultRule>{enospc});
  injector->Arm(false);
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 1), WithFaults(injector));
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, RandomBytes(kBytes, 1)).ok());
  ASSERT_TRUE((*rt)->Acquire(1, Tier::kHost).ok());  // the host's only slot, pinned
  const auto grad = RandomBytes(kBytes, 2);
  ASSERT_TRUE((*rt)->Register(Desc(2, kBytes, tiering::Role::kGrad), Tier::kDevice, grad).ok());
  injector->Arm(true);
  (*rt)->GradientReady(2);  // no host room: it goes to NVMe, and the write fails
  const auto t0 = Clock::now();
  while ((*rt)->stats().write_back_failures == 0 && SecondsSince(t0) < 20) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  injector->Arm(false);
  const StepReport report = (*rt)->EndStep();
  EXPECT_EQ(report.write_back_failures, 1u);
  EXPECT_EQ(report.prefetch_failures, 0u);
  EXPECT_TRUE((*rt)->residency().Get(2)->dirty(Tier::kDevice));
  auto p = (*rt)->Acquire(2, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(0, std::memcmp(*p, grad.data(), kBytes));
  ASSERT_TRUE((*rt)->Release(2, Tier::kDevice, false).ok());
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
}

TEST(RuntimeEdgesTest, AWarningCallbackMayCallBackIntoTheRuntime) {
  ScratchDir dir;
  std::atomic<Runtime*> runtime{nullptr};
  std::atomic<int> called{0};
  RuntimeOptions ro;
  ro.on_warning = [&](absl::string_view) {
    if (Runtime* r = runtime.load(); r != nullptr) {
      (void)r->stats();
      ++called;
    }
  };
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), ro);
  ASSERT_TRUE(rt.ok()) << rt.status();
  runtime.store(rt->get());
  for (PartitionId id = 1; id <= 2; ++id) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kHost, RandomBytes(kBytes, id)).ok());
  }
  WithinSeconds(20, "a step whose warning callback calls stats()", [&] {
    for (PartitionId id : {1, 2}) {
      ASSERT_TRUE((*rt)->Acquire(id, Tier::kDevice).ok());
      ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, false).ok());
    }
    (*rt)->EndStep();
    for (PartitionId id : {2, 1}) {  // diverges: warned during the Acquire
      ASSERT_TRUE((*rt)->Acquire(id, Tier::kDevice).ok());
      ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, false).ok());
    }
    (*rt)->EndStep();
  });
  EXPECT_GE(called.load(), 1);
}

TEST(RuntimeEdgesTest, PrefetchesRaceRegistrationsThatGrowThePartitionMap) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 2, 2);
  config.copy_bandwidth_bytes_per_s = 2000000;  // each copy: 50 ms
  config.host_budget_bytes += 3000 * tiering::kPageBytes;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, RandomBytes(kBytes, 1)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kHost, RandomBytes(kBytes, 2)).ok());
  std::future<absl::Status> a = (*rt)->Prefetch(1, Tier::kDevice);
  std::future<absl::Status> b = (*rt)->Prefetch(2, Tier::kDevice);
  // Thousands of registrations while the copies run: the map of partitions rehashes under them.
  for (PartitionId id = 100; id < 3100; ++id) {
    ASSERT_TRUE((*rt)->Register(Desc(id, 4096), Tier::kHost).ok());
  }
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(b.get().ok());
  for (PartitionId id : {1, 2}) {
    auto p = (*rt)->Acquire(id, Tier::kDevice);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(0, std::memcmp(*p, RandomBytes(kBytes, id).data(), kBytes));
    ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, false).ok());
  }
  EXPECT_EQ((*rt)->EndStep().prefetch_hits, 2u);
}

// A copy engine whose fences a test opens by hand (the emulated engine has none).
class GatedCopyEngine final : public tiering::CopyEngine {
 public:
  class Gate final : public tiering::Fence {
   public:
    absl::Status Wait() override {
      while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return absl::OkStatus();
    }
    bool Passed() override { return open.load(); }
    std::atomic<bool> open{false};
  };
  explicit GatedCopyEngine(std::unique_ptr<tiering::CopyEngine> inner) : inner_(std::move(inner)) {}
  void Copy(void* dst, const void* src, size_t bytes, tiering::CopyDirection direction,
            Done done) override {
    inner_->Copy(dst, src, bytes, direction, std::move(done));
  }
  void Zero(void* dst, size_t bytes, Done done) override {
    inner_->Zero(dst, bytes, std::move(done));
  }
  absl::string_view name() const override { return "gated test engine"; }
  absl::StatusOr<std::shared_ptr<tiering::Fence>> RecordFence(tiering::StreamHandle) override {
    return std::shared_ptr<tiering::Fence>(gate);
  }
  std::shared_ptr<Gate> gate = std::make_shared<Gate>();

 private:
  std::unique_ptr<tiering::CopyEngine> inner_;
};

// Quiet options whose copy engine is a GatedCopyEngine (its gate handed back in `gate`).
RuntimeOptions Gated(std::shared_ptr<GatedCopyEngine::Gate>* gate) {
  RuntimeOptions ro = Quiet();
  ro.wrap_copy_engine = [gate](std::unique_ptr<tiering::CopyEngine> inner) {
    auto engine = std::make_unique<GatedCopyEngine>(std::move(inner));
    *gate = engine->gate;
    return engine;
  };
  return ro;
}

TEST(RuntimeEdgesTest, AReleaseWithAStreamHoldsTheCopyUntilTheStreamsWorkHasRun) {
  ScratchDir dir;
  std::shared_ptr<GatedCopyEngine::Gate> gate;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Gated(&gate));
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, RandomBytes(kBytes, 1)).ok());
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  int stream = 0;  // any handle: the test's engine records its own fence
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, true, &stream).ok());
  // The "kernels" still run: the write-back waits for them, and does not hold up the Runtime.
  std::future<absl::Status> evicted =
      std::async(std::launch::async, [&] { return (*rt)->Evict(1, Tier::kDevice); });
  EXPECT_EQ(evicted.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the copy was written back before the stream's work had run";
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kHost, RandomBytes(kBytes, 2)).ok());  // not blocked
  std::memcpy(*p, RandomBytes(kBytes, 9).data(), kBytes);  // the last "kernel" writes
  gate->open = true;
  ASSERT_TRUE(evicted.get().ok());
  auto back = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(0, std::memcmp(*back, RandomBytes(kBytes, 9).data(), kBytes));
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
}

// A dropped device copy whose "kernels" still run is held aside beyond the device budget; the
// emulated device's pool must still serve what the residency table allows.
TEST(RuntimeEdgesTest, CopiesHeldAsideForTheirStreamsDoNotStarveTheEmulatedDevice) {
  ScratchDir dir;
  std::shared_ptr<GatedCopyEngine::Gate> gate;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Gated(&gate));
  ASSERT_TRUE(rt.ok()) << rt.status();
  int stream = 0;
  for (PartitionId id : {1, 2}) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kDevice).ok());
    ASSERT_TRUE((*rt)->Acquire(id, Tier::kDevice).ok());
    ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, true, &stream).ok());
    ASSERT_TRUE((*rt)->Discard(id).ok());  // dropped: held aside until the gate opens
  }
  for (PartitionId id : {1, 2}) {
    auto p = (*rt)->Acquire(id, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, false).ok());
  }
  gate->open = true;
}

TEST(RuntimeEdgesTest, UnregisterIsRefusedWhileAnAcquireWaitsOnAMoveOfThePartition) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 2, 2);
  config.copy_bandwidth_bytes_per_s = 2000000;  // 50 ms per copy
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  // Who wakes first when the move ends is up to the scheduler: several rounds.
  for (PartitionId id = 1; id <= 12; ++id) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kDevice, RandomBytes(kBytes, id)).ok());
    std::future<absl::Status> evicted =
        std::async(std::launch::async, [&] { return (*rt)->Evict(id, Tier::kDevice); });
    while (!(*rt)->residency().Get(id)->move) std::this_thread::yield();
    std::future<absl::StatusOr<std::byte*>> acquired =
        std::async(std::launch::async, [&] { return (*rt)->Acquire(id, Tier::kHost); });
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // parked on the move
    absl::Status u = (*rt)->Unregister(id);
    EXPECT_EQ(u.code(), absl::StatusCode::kFailedPrecondition) << id << ": " << u;
    auto p = acquired.get();
    ASSERT_TRUE(p.ok()) << id << ": " << p.status();
    EXPECT_EQ(0, std::memcmp(*p, RandomBytes(kBytes, id).data(), kBytes));
    ASSERT_TRUE((*rt)->Release(id, Tier::kHost, false).ok());
    ASSERT_TRUE(evicted.get().ok());
    ASSERT_TRUE((*rt)->Unregister(id).ok());
  }
}

TEST(RuntimeEdgesTest, UnregisterRacingTheEndOfAnEvictionWaitsForIt) {
  ScratchDir dir;
  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  for (PartitionId id = 1; id <= 40; ++id) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kDevice, RandomBytes(kBytes, id)).ok());
    std::future<absl::Status> evicted =
        std::async(std::launch::async, [&] { return (*rt)->Evict(id, Tier::kDevice); });
    absl::Status u;
    do {
      u = (*rt)->Unregister(id);
    } while (!u.ok() && u.code() == absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(u.ok()) << u;
    const absl::Status e = evicted.get();
    // The eviction ran first, or found the partition gone: never anything else.
    EXPECT_TRUE(e.ok() || e.code() == absl::StatusCode::kNotFound) << e;
  }
  ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
}

TEST(RuntimeEdgesTest, AnAcquireWaitingForRoomWhileAPrefetchBringsItsPartitionGetsIt) {
  ScratchDir dir;
  RuntimeConfig config = Config(dir.File("swap"), 2, 4);
  config.copy_bandwidth_bytes_per_s = 400000;  // a quarter of a second per copy
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kDevice, RandomBytes(kBytes, 1)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kDevice, RandomBytes(kBytes, 2)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(3), Tier::kHost, RandomBytes(kBytes, 3)).ok());
  ASSERT_TRUE((*rt)->Acquire(2, Tier::kDevice).ok());  // pinned: 1 is the only victim
  std::future<absl::Status> prefetched = (*rt)->Prefetch(3, Tier::kDevice);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // evicting 1 for it
  auto p = (*rt)->Acquire(3, Tier::kDevice);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(0, std::memcmp(*p, RandomBytes(kBytes, 3).data(), kBytes));
  ASSERT_TRUE((*rt)->Release(3, Tier::kDevice, false).ok());
  ASSERT_TRUE((*rt)->Release(2, Tier::kDevice, false).ok());
  EXPECT_TRUE(prefetched.get().ok());
}

TEST(RuntimeEdgesTest, EveryBadCallIsNamedAndChangesNothing) {
  ScratchDir dir;
  for (int workers : {0, 65}) {
    RuntimeOptions ro = Quiet();
    ro.workers = workers;
    auto bad = Runtime::Create(Config(dir.File("w"), 2, 2), ro);
    EXPECT_THAT(bad.status().message(), HasSubstr("accepted: 1..64")) << workers;
  }
  RuntimeConfig staging = Config(dir.File("s"), 2, 2);
  staging.host_budget_bytes = 3 * (64 << 10);  // less than the two pairs of staging buffers
  EXPECT_THAT(Runtime::Create(staging, Quiet()).status().message(),
              HasSubstr("do not fit in strata.host_budget_bytes"));

  auto rt = Runtime::Create(Config(dir.File("swap"), 2, 2), Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  Runtime& r = **rt;
  ASSERT_TRUE(r.Register(Desc(1), Tier::kHost, RandomBytes(kBytes, 1)).ok());
  EXPECT_EQ(r.Register(Desc(1), Tier::kHost).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(r.Register(Desc(2), Tier::kHost, RandomBytes(10, 2)).message(),
              HasSubstr("initial bytes are 10, the partition 100000"));
  EXPECT_THAT(r.Register(Desc(3, 0), Tier::kHost).message(), HasSubstr("bytes must be in 1.."));
  EXPECT_THAT(r.Acquire(1, Tier::kNvme).status().message(), HasSubstr("nvme is not addressable"));
  EXPECT_EQ(r.Acquire(9, Tier::kHost).status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.Release(1, Tier::kHost, false).message(), HasSubstr("not pinned in host"));
  EXPECT_EQ(r.Release(9, Tier::kHost, false).code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.Evict(1, Tier::kNvme).message(), HasSubstr("only the device and host tiers"));
  EXPECT_EQ(r.Evict(9, Tier::kHost).code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.Prefetch(1, Tier::kNvme).get().message(), HasSubstr("nvme is not addressable"));
  EXPECT_EQ(r.Prefetch(9, Tier::kHost).get().code(), absl::StatusCode::kNotFound);
  r.GradientReady(9);  // unknown: nothing to send down
  EXPECT_EQ(r.Unregister(9).code(), absl::StatusCode::kNotFound);
  // The top bit keys the optimizer's state in the store: no partition call reaches it.
  const PartitionId top = (PartitionId{1} << 63) | 7;
  EXPECT_THAT(r.Unregister(top).message(), HasSubstr("ids are below 2^63"));
  EXPECT_THAT(r.Adopt(Desc(top)).message(), HasSubstr("ids are below 2^63"));
  EXPECT_EQ(r.Acquire(top, Tier::kHost).status().code(), absl::StatusCode::kNotFound);
  absl::Status adopt = r.Adopt(Desc(9));
  EXPECT_EQ(adopt.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(adopt.message(), HasSubstr("no partition 9"));
  EXPECT_THAT(adopt.message(), HasSubstr("adopt partition 9"));
  // Pinned and dirty: Unregister and Flush refuse, naming why; the bytes stay.
  auto p = r.Acquire(1, Tier::kHost);
  ASSERT_TRUE(p.ok());
  std::memcpy(*p, RandomBytes(kBytes, 5).data(), kBytes);
  EXPECT_THAT(r.Unregister(1).message(), HasSubstr("pinned in the host tier"));
  ASSERT_TRUE(r.Release(1, Tier::kHost, true).ok());
  ASSERT_TRUE(r.Acquire(1, Tier::kHost).ok());
  EXPECT_THAT(r.Flush().message(),
              HasSubstr("pinned in the host tier with bytes NVMe does not have"));
  ASSERT_TRUE(r.Release(1, Tier::kHost, false).ok());
  ASSERT_TRUE(r.Flush().ok());
  auto back = r.Acquire(1, Tier::kHost);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(0, std::memcmp(*back, RandomBytes(kBytes, 5).data(), kBytes));
  ASSERT_TRUE(r.Release(1, Tier::kHost, false).ok());
  EXPECT_TRUE(r.residency().CheckInvariants().ok());
  EXPECT_EQ(r.residency().Get(1)->pins[kHost], 0);
}

}  // namespace
}  // namespace strata::sched
