// The Mover on its own, with host-emulated device memory: moves carried for the table, copies
// dropped and forgotten, and the trainer's stream fences — a device copy is not read or overwritten
// before its fences have passed, and its memory is freed only once they have.
#include "swap/mover.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"

namespace strata::swap {
namespace {

using ::strata::testing::RandomBytes;
using ::testing::HasSubstr;
using tiering::PartitionDesc;

constexpr uint64_t kBytes = 100000;

// A fence a test opens by hand (a stand-in for an event on a trainer's stream).
class GateFence final : public tiering::Fence {
 public:
  absl::Status Wait() override {
    while (!open_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return failure_;
  }
  bool Passed() override { return open_.load(); }
  void Open(absl::Status failure = absl::OkStatus()) {
    failure_ = std::move(failure);
    open_.store(true);
  }

 private:
  std::atomic<bool> open_{false};
  absl::Status failure_;
};

struct Fixture {
  tiering::ResidencyTable table{{4 * 102400, 4 * 102400, 0}};
  tiering::HostMemoryResource raw_device{"device memory (host-emulated)"};
  tiering::StatisticsResource device{&raw_device};
  tiering::HostMemoryResource host;
  tiering::HostCopyEngine copy;
  StagingPool staging{&host, 64 << 10, 1};
  Mover mover{MoverParts{&table, &device, &host, nullptr, &copy, &staging}};

  PartitionDesc Desc(PartitionId id) {
    PartitionDesc d;
    d.id = id;
    d.bytes = kBytes;
    return d;
  }
  // A partition whose only copy is on the device, holding `seed`'s bytes.
  void OnDevice(PartitionId id, uint64_t seed) {
    ASSERT_TRUE(table.Register(Desc(id)).ok());
    ASSERT_TRUE(table.Materialize(id, Tier::kDevice).ok());
    ASSERT_TRUE(mover.Fill(Desc(id), Tier::kDevice, RandomBytes(kBytes, seed)).ok());
  }
};

TEST(MoverTest, ADeviceCopyIsNotReadBeforeItsFencesHavePassed) {
  Fixture f;
  f.OnDevice(1, 1);
  auto fence = std::make_shared<GateFence>();
  f.mover.AddFence(1, fence);
  // The trainer's kernel "writes" the copy before its fence is reached.
  std::memcpy(f.mover.Address(1, Tier::kDevice), RandomBytes(kBytes, 2).data(), kBytes);
  ASSERT_TRUE(f.table.BeginMove(1, Tier::kDevice, Tier::kHost).ok());
  std::future<absl::Status> carried =
      std::async(std::launch::async, [&] { return f.mover.Carry(1, Tier::kDevice, Tier::kHost); });
  EXPECT_EQ(carried.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the copy was read before its fence passed";
  fence->Open();
  ASSERT_TRUE(carried.get().ok());
  EXPECT_EQ(0, std::memcmp(f.mover.Address(1, Tier::kHost), RandomBytes(kBytes, 2).data(), kBytes));
}

TEST(MoverTest, AFenceThatFailsFailsTheMoveAndChangesNothing) {
  Fixture f;
  f.OnDevice(1, 1);
  auto fence = std::make_shared<GateFence>();
  fence->Open(absl::InternalError("the trainer's stream failed"));
  f.mover.AddFence(1, fence);
  ASSERT_TRUE(f.table.BeginMove(1, Tier::kDevice, Tier::kHost).ok());
  absl::Status s = f.mover.Carry(1, Tier::kDevice, Tier::kHost);
  EXPECT_THAT(s.message(), HasSubstr("the trainer's stream failed"));
  EXPECT_THAT(s.message(), HasSubstr("move of partition 1 device -> host"));
  const tiering::Residency r = *f.table.Get(1);
  EXPECT_TRUE(r.only_current(Tier::kDevice));
  EXPECT_FALSE(r.has_copy[static_cast<int>(Tier::kHost)]);
  EXPECT_TRUE(f.table.CheckInvariants().ok());
}

TEST(MoverTest, ADroppedDeviceCopyIsFreedOnlyOnceItsFencesHavePassed) {
  Fixture f;
  f.OnDevice(1, 1);
  ASSERT_TRUE(f.table.BeginMove(1, Tier::kDevice, Tier::kHost).ok());
  ASSERT_TRUE(f.mover.Carry(1, Tier::kDevice, Tier::kHost).ok());
  auto fence = std::make_shared<GateFence>();
  f.mover.AddFence(1, fence);
  const uint64_t in_use = f.device.counts().bytes_in_use;
  ASSERT_TRUE(f.mover.Drop(1, Tier::kDevice).ok());
  EXPECT_FALSE(f.table.Get(1)->has_copy[static_cast<int>(Tier::kDevice)]);
  EXPECT_EQ(f.device.counts().bytes_in_use, in_use) << "freed under the trainer's kernels";
  EXPECT_EQ(f.mover.held_aside_bytes(), kBytes);
  fence->Open();
  f.OnDevice(2, 2);  // a later call frees what has passed
  EXPECT_EQ(f.mover.held_aside_bytes(), 0u);
  EXPECT_EQ(f.device.counts().bytes_in_use, kBytes);  // 1's freed; 2's in use
  // Forget too holds a copy aside while its fence has not passed, and the destructor waits.
  auto second = std::make_shared<GateFence>();
  f.mover.AddFence(2, second);
  ASSERT_TRUE(f.table.Unregister(2).ok());
  f.mover.Forget(2);
  EXPECT_EQ(f.mover.held_aside_bytes(), kBytes);
  second->Open();
}

TEST(MoverTest, AFenceOnAPartitionWithoutADeviceCopyIsIgnored) {
  Fixture f;
  ASSERT_TRUE(f.table.Register(f.Desc(1)).ok());
  ASSERT_TRUE(f.table.Materialize(1, Tier::kHost).ok());
  ASSERT_TRUE(f.mover.Fill(f.Desc(1), Tier::kHost, {}).ok());
  f.mover.AddFence(1, std::make_shared<GateFence>());  // never opened
  f.mover.AddFence(1, nullptr);
  ASSERT_TRUE(f.table.BeginMove(1, Tier::kHost, Tier::kDevice).ok());
  ASSERT_TRUE(f.mover.Carry(1, Tier::kHost, Tier::kDevice).ok());  // does not wait
}

}  // namespace
}  // namespace strata::swap
