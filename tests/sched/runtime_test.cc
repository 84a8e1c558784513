// The Runtime facade on the host-emulated device tier (what every CI run has): acquire/release
// across the three tiers, budgets and eviction, write-backs that fail, restarts, ranks, and
// concurrent use. (Its configuration's tests are in runtime_config_test.cc.)
#include "sched/runtime.h"

#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "aio/fault_injection.h"
#include "base/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/aio/test_util.h"

namespace strata::sched {
namespace {

using tiering::OffloadDevice;
using tiering::PartitionDesc;
using tiering::Residency;

using ::strata::testing::RandomBytes;
using ::strata::testing::ScratchDir;
using ::strata::testing::VmLckKiB;
using ::testing::HasSubstr;

RuntimeConfig SmallConfig(const std::string& nvme_path) {
  RuntimeConfig c;
  c.aio.block_size = 64 << 10;
  // Partitions of 100000 bytes hold 25 pages (102400 bytes) each.
  c.device_budget_bytes = 2 * 102400;  // two partitions
  c.offload_param.buffer_size = 64 << 10;
  c.offload_param.buffer_count = 2;                   // one pair of staging buffers
  c.host_budget_bytes = 3 * 102400 + 2 * (64 << 10);  // three, and the two staging buffers
  c.nvme_capacity_bytes = 8 << 20;
  c.nvme_path = nvme_path;
  c.stage3_param_persistence_threshold = 0;  // these partitions are small: none stays for that
  return c;
}

RuntimeOptions Quiet() {
  RuntimeOptions o;
  o.on_warning = [](absl::string_view) {};
  return o;
}

PartitionDesc Desc(PartitionId id) {
  PartitionDesc d;
  d.id = id;
  d.bytes = 100000;
  d.elements = 25000;
  return d;
}

TEST(RuntimeTest, APartitionTravelsNvmeToDeviceAndBackWithItsChanges) {
  ScratchDir dir;
  std::vector<std::string> warnings;
  RuntimeOptions ro;
  ro.on_warning = [&](absl::string_view w) { warnings.emplace_back(w); };
  auto rt = Runtime::Create(SmallConfig(dir.File("swap")), ro);
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto v1 = RandomBytes(100000, 1);
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, v1).ok());
  auto p = (*rt)->Acquire(1, Tier::kDevice);  // NVMe -> device, in staged chunks
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(0, std::memcmp(*p, v1.data(), v1.size()));
  (*p)[0] = std::byte{0x5a};
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, /*dirty=*/true).ok());
  auto r = (*rt)->residency().Get(1);
  EXPECT_TRUE(r->dirty(Tier::kDevice));
  EXPECT_FALSE(r->has_copy[static_cast<int>(Tier::kHost)]);  // the stale host copy was freed
  ASSERT_TRUE((*rt)->Evict(1, Tier::kDevice).ok());          // written back to host
  ASSERT_TRUE((*rt)->Evict(1, Tier::kHost).ok());            // and to NVMe
  r = (*rt)->residency().Get(1);
  EXPECT_TRUE(r->current[static_cast<int>(Tier::kNvme)]);
  auto h = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ((*h)[0], std::byte{0x5a});
  EXPECT_EQ(0, std::memcmp(*h + 1, v1.data() + 1, v1.size() - 1));
  const RuntimeStats s = (*rt)->stats();
  EXPECT_EQ(s.write_backs, 2u);
  EXPECT_EQ(s.bytes_moved[2][0], 100000u);  // nvme -> device, no host copy on the way
  EXPECT_EQ(s.bytes_moved[2][1], 100000u);  // nvme -> host at the end
  EXPECT_GT(s.acquire_wait_seconds, 0);
}

// offload_param.max_in_cpu (DeepSpeed's parameter elements kept in CPU memory): a parameter homed
// on NVMe within it goes to the device through the host tier and keeps its clean host copy, so
// its next use (backward, the next step) reads no disk; one beyond it goes straight, staged.
TEST(RuntimeTest, ParametersWithinMaxInCpuKeepAHostCopyAndAreReadFromTheDiskOnce) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.offload_param.device = OffloadDevice::kNvme;
  config.offload_param.max_in_cpu = 25000;  // the first partition's elements, not the second's
  config.device_budget_bytes = 1 << 20;
  config.host_budget_bytes = 1 << 20;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto v1 = RandomBytes(100000, 41), v2 = RandomBytes(100000, 42);
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, v1).ok());
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kNvme, v2).ok());
  for (int use = 0; use < 3; ++use) {
    for (PartitionId id : {1, 2}) {
      auto p = (*rt)->Acquire(id, Tier::kDevice);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(0, std::memcmp(*p, (id == 1 ? v1 : v2).data(), 100000)) << id << " " << use;
      ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, false).ok());
      ASSERT_TRUE((*rt)->Evict(id, Tier::kDevice).ok());  // clean: dropped
    }
  }
  const RuntimeStats s = (*rt)->stats();
  EXPECT_EQ(s.bytes_moved[2][1], 100000u);      // the first, NVMe -> host once
  EXPECT_EQ(s.bytes_moved[1][0], 3 * 100000u);  // and host -> device at each use
  EXPECT_EQ(s.bytes_moved[2][0], 3 * 100000u);  // the second, NVMe -> device at each use
  auto r1 = (*rt)->residency().Get(1), r2 = (*rt)->residency().Get(2);
  EXPECT_TRUE(r1->current[static_cast<int>(Tier::kHost)]);
  EXPECT_FALSE(r2->has_copy[static_cast<int>(Tier::kHost)]);
  // Its host copy is clean: evicted for room, it is dropped without a write.
  const RuntimeStats before = (*rt)->stats();
  ASSERT_TRUE((*rt)->Evict(1, Tier::kHost).ok());
  EXPECT_EQ((*rt)->stats().bytes_moved, before.bytes_moved);
}

TEST(RuntimeTest, ParametersWithinMaxInCpuGoStraightToTheDeviceWhenTheHostHasNoRoom) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.offload_param.device = OffloadDevice::kNvme;
  config.device_budget_bytes = 1 << 20;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  // The host tier holds three partitions: all pinned, there is no room for a fourth's copy.
  std::vector<std::byte*> held;
  for (PartitionId id : {1, 2, 3}) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kHost, RandomBytes(100000, id)).ok());
    auto h = (*rt)->Acquire(id, Tier::kHost);
    ASSERT_TRUE(h.ok()) << h.status();
  }
  const auto v = RandomBytes(100000, 44);
  ASSERT_TRUE((*rt)->Register(Desc(4), Tier::kNvme, v).ok());
  auto p = (*rt)->Acquire(4, Tier::kDevice);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(0, std::memcmp(*p, v.data(), v.size()));
  EXPECT_EQ((*rt)->stats().bytes_moved[2][0], 100000u);  // straight, staged
  ASSERT_TRUE((*rt)->Release(4, Tier::kDevice, false).ok());
  for (PartitionId id : {1, 2, 3}) ASSERT_TRUE((*rt)->Release(id, Tier::kHost, false).ok());
}

TEST(RuntimeTest, BudgetsHoldByEvictingTheLeastRecentlyUsedUnpinnedCopy) {
  ScratchDir dir;
  auto rt = Runtime::Create(SmallConfig(dir.File("swap")));
  ASSERT_TRUE(rt.ok()) << rt.status();
  for (PartitionId id : {1, 2, 3, 4}) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kNvme, RandomBytes(100000, id)).ok());
  }
  // Two device slots: each acquire past two evicts the least recently used device copy.
  const std::vector<std::pair<PartitionId, std::set<PartitionId>>> steps = {
      {1, {1}}, {2, {1, 2}}, {3, {2, 3}}, {4, {3, 4}}, {1, {4, 1}}, {3, {1, 3}}};
  for (const auto& [id, on_device] : steps) {
    auto p = (*rt)->Acquire(id, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << id << ": " << p.status();
    EXPECT_EQ(0, std::memcmp(*p, RandomBytes(100000, id).data(), 100000));
    ASSERT_TRUE((*rt)->Release(id, Tier::kDevice, false).ok());
    std::set<PartitionId> seen;
    for (PartitionId q : {1, 2, 3, 4}) {
      if ((*rt)->residency().Get(q)->has_copy[0]) seen.insert(q);
    }
    EXPECT_EQ(seen, on_device) << "after acquiring " << id;
    EXPECT_LE((*rt)->residency().used_bytes(Tier::kDevice), 2u * 102400);
    EXPECT_LE((*rt)->residency().used_bytes(Tier::kHost), 3u * 102400);
    ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
  }
  EXPECT_GT((*rt)->stats().evictions, 0u);
  // Pinned copies are never evicted: with both device slots pinned, a third acquire fails clearly.
  ASSERT_TRUE((*rt)->Acquire(1, Tier::kDevice).ok());
  ASSERT_TRUE((*rt)->Acquire(2, Tier::kDevice).ok());
  auto third = (*rt)->Acquire(3, Tier::kDevice);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("every copy in it is pinned"));
}

TEST(RuntimeTest, AFailedWriteBackLeavesThePartitionDirtyAndReadable) {
  ScratchDir dir;
  aio::FaultRule eio = aio::FaultRule::Error(EIO);
  eio.only = aio::OpKind::kWrite;
  eio.skip = 3;  // the store's creation and the registration's writes go through
  eio.max_hits = 1;
  auto injector = std::make_shared<aio::FaultInjector>(1, std::vector<aio::FaultRule>{eio});
  RuntimeOptions ro;
  ro.engine_options.wrap_backend = aio::FaultInjector::ForEngine(injector);
  ro.engine_options.on_warning = [](absl::string_view) {};
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  auto rt = Runtime::Create(config, ro);
  ASSERT_TRUE(rt.ok()) << rt.status();
  const auto v = RandomBytes(100000, 7);
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, v).ok());
  absl::Status s;
  int attempts = 0;
  do {  // write-backs until the injected EIO lands on one
    auto p = (*rt)->Acquire(1, Tier::kHost);
    ASSERT_TRUE(p.ok());
    (*p)[1] = std::byte{static_cast<unsigned char>(attempts)};
    ASSERT_TRUE((*rt)->Release(1, Tier::kHost, true).ok());
    s = (*rt)->Evict(1, Tier::kHost);
    ++attempts;
  } while (s.ok() && attempts < 10);
  ASSERT_FALSE(s.ok()) << "the fault never fired";
  EXPECT_EQ(StatusErrno(s), EIO) << s;
  EXPECT_THAT(s.message(), HasSubstr("move of partition 1 host -> nvme"));
  auto r = (*rt)->residency().Get(1);
  EXPECT_TRUE(r->dirty(Tier::kHost));  // still the only current copy, still in host
  auto p = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)[1], std::byte{static_cast<unsigned char>(attempts - 1)});
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  EXPECT_TRUE((*rt)->Evict(1, Tier::kHost).ok());  // retried, it goes through
}

TEST(RuntimeTest, ParametersOffloadedToNvmeMoveBetweenDeviceAndNvmeInStagedChunks) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.offload_param.device = OffloadDevice::kNvme;
  config.offload_param.max_in_cpu = 0;          // none kept in the host tier
  config.offload_param.buffer_size = 64 << 10;  // a partition is several chunks
  config.device_budget_bytes = 1 << 20;
  config.host_budget_bytes = 1 << 20;
  auto rt = Runtime::Create(config);
  ASSERT_TRUE(rt.ok()) << rt.status();
  PartitionDesc big = Desc(1);
  big.bytes = 300001;
  const auto v = RandomBytes(big.bytes, 31);
  ASSERT_TRUE((*rt)->Register(big, Tier::kNvme, v).ok());
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(0, std::memcmp(*p, v.data(), v.size()));
  EXPECT_EQ((*rt)->residency().used_bytes(Tier::kHost), 0u);  // never through a host copy
  (*p)[300000] = std::byte{0x77};
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, true).ok());
  ASSERT_TRUE((*rt)->Evict(1, Tier::kDevice).ok());  // dirty: device -> NVMe directly
  auto r = (*rt)->residency().Get(1);
  EXPECT_TRUE(r->current[static_cast<int>(Tier::kNvme)]);
  EXPECT_FALSE(r->has_copy[static_cast<int>(Tier::kDevice)]);
  EXPECT_EQ((*rt)->stats().bytes_moved[0][2], 300001u);
  // A clean device copy is dropped without any I/O.
  ASSERT_TRUE((*rt)->Acquire(1, Tier::kDevice).ok());
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  const RuntimeStats before = (*rt)->stats();
  ASSERT_TRUE((*rt)->Evict(1, Tier::kDevice).ok());
  EXPECT_EQ((*rt)->stats().bytes_moved, before.bytes_moved);
  EXPECT_EQ((*rt)->stats().write_backs, before.write_backs);
  // And the change made it to NVMe.
  auto h = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ((*h)[300000], std::byte{0x77});
}

TEST(RuntimeTest, APrefetchRunsInTheBackgroundAndTheAcquireIsAHit) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.copy_bandwidth_bytes_per_s = 200000;  // the 100000-byte copy takes half a second
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok());
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, RandomBytes(100000, 41)).ok());
  std::future<absl::Status> f = (*rt)->Prefetch(1, Tier::kDevice);
  // Prefetch returned before the move could have ended (a synchronous one would be ready).
  EXPECT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  ASSERT_TRUE(f.get().ok());
  const uint64_t hits = (*rt)->stats().acquire_hits;
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*rt)->stats().acquire_hits, hits + 1);
  EXPECT_EQ(0, std::memcmp(*p, RandomBytes(100000, 41).data(), 100000));
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  EXPECT_EQ((*rt)->Prefetch(1, Tier::kNvme).get().code(), absl::StatusCode::kInvalidArgument);
  // A discarded future does not make Prefetch wait, and an Acquire that waits behind the
  // prefetch's move counts that wait.
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kNvme, RandomBytes(100000, 42)).ok());
  const double waited = (*rt)->stats().acquire_wait_seconds;
  (void)(*rt)->Prefetch(2, Tier::kDevice);
  EXPECT_FALSE((*rt)->residency().Get(2)->current[0]);  // still moving (half a second)
  // Behind the prefetch (a hit when it ran first) or moving it itself: either way the time is
  // counted.
  auto q = (*rt)->Acquire(2, Tier::kDevice);
  ASSERT_TRUE(q.ok());
  EXPECT_GT((*rt)->stats().acquire_wait_seconds - waited, 0.25);
  ASSERT_TRUE((*rt)->Release(2, Tier::kDevice, false).ok());
}

TEST(RuntimeTest, AStagedWriteBackThatFailsKeepsTheDeviceCopyDirty) {
  ScratchDir dir;
  aio::FaultRule eio = aio::FaultRule::Error(EIO);
  eio.only = aio::OpKind::kWrite;
  auto injector = std::make_shared<aio::FaultInjector>(1, std::vector<aio::FaultRule>{eio});
  injector->Arm(false);
  RuntimeOptions ro;
  ro.engine_options.wrap_backend = aio::FaultInjector::ForEngine(injector);
  ro.engine_options.on_warning = [](absl::string_view) {};
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.offload_param.device = OffloadDevice::kNvme;
  config.offload_param.max_in_cpu = 0;  // the straight path: none kept in the host tier
  config.offload_param.buffer_size = 64 << 10;
  auto rt = Runtime::Create(config, ro);
  ASSERT_TRUE(rt.ok());
  const auto v = RandomBytes(100000, 51);
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kDevice, v).ok());
  injector->Arm(true);
  absl::Status s = (*rt)->Evict(1, Tier::kDevice);
  injector->Arm(false);
  EXPECT_EQ(StatusErrno(s), EIO) << s;
  auto r = (*rt)->residency().Get(1);
  EXPECT_TRUE(r->dirty(Tier::kDevice));
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(0, std::memcmp(*p, v.data(), v.size()));
  ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, false).ok());
  EXPECT_TRUE((*rt)->Evict(1, Tier::kDevice).ok());
}

TEST(RuntimeTest, BadSwapPathsAreRefusedAtCreation) {
  ScratchDir dir;
  { std::ofstream(dir.File("file")) << "x"; }
  auto rt = Runtime::Create(SmallConfig(dir.File("file")));
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(rt.status().message(), HasSubstr("is not a directory"));
  RuntimeConfig no_nvme = SmallConfig("");
  auto plain = Runtime::Create(no_nvme);
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT((*plain)->Register(Desc(1), Tier::kNvme).message(), HasSubstr("no NVMe tier"));
}

std::vector<std::byte> HostBytes(Runtime& rt, PartitionId id, uint64_t n = 100000) {
  auto p = rt.Acquire(id, Tier::kHost);
  EXPECT_TRUE(p.ok()) << id << ": " << p.status();
  if (!p.ok()) return {};
  std::vector<std::byte> out(*p, *p + n);
  EXPECT_TRUE(rt.Release(id, Tier::kHost, false).ok());
  return out;
}

// The Runtime's notice about its NVMe store (the engine's fallbacks may come before it).
std::string StoreNotice(const Runtime& rt) {
  for (const std::string& w : rt.warnings()) {
    if (w.rfind("NVMe store at ", 0) == 0) return w;
  }
  return "";
}

TEST(RuntimeTest, TheStoreSaysWhatItMayTakeAndItsFilesGoWithTheRuntime) {
  ScratchDir dir;
  const std::string rank0 = dir.File("swap/rank0");
  {
    auto rt = Runtime::Create(SmallConfig(dir.File("swap")), Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    const std::string said = StoreNotice(**rt);
    EXPECT_THAT(said, HasSubstr("NVMe store at " + rank0 +
                                ": swap files grow on demand up to 8388608 bytes "
                                "(strata.nvme_capacity_bytes); "));
    EXPECT_THAT(said, HasSubstr("bytes free on that filesystem now"));
    EXPECT_THAT(said, ::testing::Not(HasSubstr("the cap is more than that")));
    ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, RandomBytes(100000, 1)).ok());
    EXPECT_TRUE(std::filesystem::exists(rank0 + "/swap-000.bin"));
  }
  EXPECT_FALSE(std::filesystem::exists(rank0));            // strata.nvme_keep_files is false
  EXPECT_TRUE(std::filesystem::exists(dir.File("swap")));  // the user's folder stays
  RuntimeConfig huge = SmallConfig(dir.File("swap"));
  huge.nvme_capacity_bytes = 1ull << 60;
  auto rt = Runtime::Create(huge, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_THAT(StoreNotice(**rt), HasSubstr("the cap is more than that"));
}

TEST(RuntimeTest, ARestartedRuntimeAdoptsWhatTheLastOneLeftWithItsLatestBytes) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.nvme_keep_files = true;  // what the next Runtime adopts
  const auto changed = RandomBytes(100000, 77);
  {
    auto rt = Runtime::Create(config, Quiet());
    ASSERT_TRUE(rt.ok()) << rt.status();
    ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, RandomBytes(100000, 1)).ok());
    ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kNvme, RandomBytes(100000, 2)).ok());
    ASSERT_TRUE((*rt)->Register(Desc(3), Tier::kHost, RandomBytes(100000, 3)).ok());
    auto p = (*rt)->Acquire(1, Tier::kDevice);
    ASSERT_TRUE(p.ok());
    std::memcpy(*p, changed.data(), changed.size());
    ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, /*dirty=*/true).ok());
    // Destroyed with partition 1 dirty on the device and 3 only in host memory: both are
    // written back.
  }
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  std::vector<PartitionId> stored;
  for (const auto& r : (*rt)->StoredPartitions()) stored.push_back(r.id);
  EXPECT_THAT(stored, ::testing::ElementsAre(1, 2, 3));
  // Registering a stored id would overwrite it: refused, naming the way out.
  absl::Status again = (*rt)->Register(Desc(1), Tier::kNvme);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.message(), HasSubstr("Adopt it"));
  PartitionDesc wrong = Desc(2);
  wrong.bytes = 5;
  EXPECT_EQ((*rt)->Adopt(wrong).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*rt)->Adopt(Desc(9)).code(), absl::StatusCode::kNotFound);
  for (PartitionId id : {1, 2, 3}) ASSERT_TRUE((*rt)->Adopt(Desc(id)).ok()) << id;
  // Registered now (adopted): a second registration says so, not "from an earlier run".
  absl::Status twice = (*rt)->Register(Desc(1), Tier::kHost);
  EXPECT_EQ(twice.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(twice.message(), HasSubstr("partition 1: already registered"));
  EXPECT_EQ((*rt)->Adopt(Desc(1)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(HostBytes(**rt, 1), changed);
  EXPECT_EQ(HostBytes(**rt, 2), RandomBytes(100000, 2));
  EXPECT_EQ(HostBytes(**rt, 3), RandomBytes(100000, 3));
  // Unregister forgets it everywhere, and a stored partition never adopted can be dropped too.
  ASSERT_TRUE((*rt)->Unregister(2).ok());
  EXPECT_EQ((*rt)->StoredPartitions().size(), 2u);
  EXPECT_TRUE((*rt)->Register(Desc(2), Tier::kNvme).ok());
  EXPECT_EQ(HostBytes(**rt, 2), std::vector<std::byte>(100000));  // zeros
}

TEST(RuntimeTest, TwoRuntimesOnOnePathAreRefusedUnlessTheirRanksDiffer) {
  ScratchDir dir;
  const RuntimeConfig config = SmallConfig(dir.File("swap"));
  RuntimeOptions rank0 = Quiet(), rank1 = Quiet();
  rank0.rank = 0;
  rank1.rank = 1;
  auto a = Runtime::Create(config, rank0);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = Runtime::Create(config, rank0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(b.status().message(), HasSubstr("in use by another strata store"));
  auto c = Runtime::Create(config, rank1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(std::filesystem::is_directory(dir.File("swap/rank0")));
  EXPECT_TRUE(std::filesystem::is_directory(dir.File("swap/rank1")));
  // Without an explicit rank, the launcher's RANK decides; a RANK that is not a number is named.
  setenv("RANK", "3", 1);
  auto d = Runtime::Create(config, Quiet());
  EXPECT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(std::filesystem::is_directory(dir.File("swap/rank3")));
  setenv("RANK", "three", 1);
  auto e = Runtime::Create(config, Quiet());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("RANK=\"three\""));
  unsetenv("RANK");
}

TEST(RuntimeTest, WithBothTiersFullACascadeOfEvictionsKeepsTheCopyTheMoveReads) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.host_budget_bytes = 2 * 102400 + 2 * (64 << 10);  // two host slots
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  // Host: X (only copy, least recently used), then Y (clean, also on NVMe). Device: V1, V2, each
  // the only copy.
  ASSERT_TRUE((*rt)->Register(Desc(10), Tier::kHost, RandomBytes(100000, 10)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(11), Tier::kNvme, RandomBytes(100000, 11)).ok());
  EXPECT_EQ(HostBytes(**rt, 11), RandomBytes(100000, 11));
  ASSERT_TRUE((*rt)->Register(Desc(20), Tier::kDevice, RandomBytes(100000, 20)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(21), Tier::kDevice, RandomBytes(100000, 21)).ok());
  // X to the device: V1 must go down to the host, which must drop Y — not X, which this move reads.
  auto x = (*rt)->Acquire(10, Tier::kDevice);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(0, std::memcmp(*x, RandomBytes(100000, 10).data(), 100000));
  ASSERT_TRUE((*rt)->Release(10, Tier::kDevice, false).ok());
  ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
  for (PartitionId id : {10, 11, 20, 21}) {
    EXPECT_EQ(HostBytes(**rt, id), RandomBytes(100000, id)) << id;
  }
}

TEST(RuntimeTest, MakingRoomGoesOnPastAVictimThatCannotBeWrittenBack) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.offload_param.device = OffloadDevice::kNvme;  // device copies go down to NVMe
  config.offload_param.max_in_cpu = 0;                 // none kept in the host tier
  config.nvme_capacity_bytes = 3 * 102400;  // two stored partitions and the copy-on-write reserve
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  // Device: V1 (the only copy; the store has no room to admit it) and V2 (clean, on NVMe).
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kDevice, RandomBytes(100000, 1)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kNvme, RandomBytes(100000, 2)).ok());
  ASSERT_TRUE((*rt)->Register(Desc(3), Tier::kNvme, RandomBytes(100000, 3)).ok());
  ASSERT_TRUE((*rt)->Acquire(2, Tier::kDevice).ok());
  ASSERT_TRUE((*rt)->Release(2, Tier::kDevice, false).ok());
  auto z = (*rt)->Acquire(3, Tier::kDevice);  // V1 is older, but cannot go: V2 is dropped
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_EQ(0, std::memcmp(*z, RandomBytes(100000, 3).data(), 100000));
  ASSERT_TRUE((*rt)->Release(3, Tier::kDevice, false).ok());
  EXPECT_TRUE((*rt)->residency().Get(1)->current[0]);  // V1 kept, whole
  EXPECT_FALSE((*rt)->residency().Get(2)->has_copy[0]);
}

TEST(RuntimeTest, EvictingAPinnedCopyIsRefusedBeforeAnyWriteBack) {
  ScratchDir dir;
  auto rt = Runtime::Create(SmallConfig(dir.File("swap")), Quiet());
  ASSERT_TRUE(rt.ok());
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kHost, RandomBytes(100000, 1)).ok());
  ASSERT_TRUE((*rt)->Acquire(1, Tier::kHost).ok());
  const auto before = (*rt)->stats();
  absl::Status s = (*rt)->Evict(1, Tier::kHost);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("pinned"));
  EXPECT_EQ((*rt)->stats().write_backs, before.write_backs);
  EXPECT_TRUE((*rt)->StoredPartitions().empty());  // nothing was written
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  EXPECT_TRUE((*rt)->Evict(1, Tier::kHost).ok());
  EXPECT_EQ((*rt)->StoredPartitions().size(), 1u);
}

TEST(RuntimeTest, RegisteringOnNvmeDoesNotHoldThePartitionInMemory) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.nvme_capacity_bytes = 300ull << 20;
  config.offload_param.buffer_size = 1 << 20;
  config.host_budget_bytes = 8 << 20;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  PartitionDesc big = Desc(1);
  big.bytes = 128ull << 20;
  struct rusage before, after;
  getrusage(RUSAGE_SELF, &before);
  ASSERT_TRUE((*rt)->Register(big, Tier::kNvme).ok());  // zeros
  getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 32 << 10) << "KiB of peak resident memory";
  EXPECT_EQ((*rt)->StoredPartitions().at(0).length, 128ull << 20);
}

TEST(RuntimeTest, ConcurrentAcquiresAndReleasesKeepEveryPartitionsBytes) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.nvme_capacity_bytes = 32 << 20;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  constexpr int kThreads = 4, kRounds = 12;
  for (PartitionId id = 0; id < 2 * kThreads; ++id) {
    ASSERT_TRUE((*rt)->Register(Desc(id), Tier::kNvme, RandomBytes(100000, id)).ok());
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        const PartitionId id = static_cast<PartitionId>(2 * t + round % 2);
        const Tier tier = round % 3 == 0 ? Tier::kHost : Tier::kDevice;
        // Budgets are small and every thread holds at most one pin: a ResourceExhausted here is
        // a real shortage (all slots pinned by others), retried for up to 30 s (a count of
        // retries ran out on a loaded machine while the holders were not scheduled).
        absl::StatusOr<std::byte*> p;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        do {
          p = (*rt)->Acquire(id, tier);
          if (p.ok() || p.status().code() != absl::StatusCode::kResourceExhausted) break;
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        } while (std::chrono::steady_clock::now() < deadline);
        if (!p.ok()) {
          ++failures;
          ADD_FAILURE() << p.status();
          continue;
        }
        const auto expect =
            RandomBytes(100000, round == 0 || round == 1 ? id : 1000 * id + round - 2);
        if (std::memcmp(*p, expect.data(), 100000) != 0) ++failures;
        const auto next = RandomBytes(100000, 1000 * id + round);
        std::memcpy(*p, next.data(), 100000);
        if (!(*rt)->Release(id, tier, true).ok()) ++failures;
        (void)(*rt)->warnings();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  ASSERT_TRUE((*rt)->residency().CheckInvariants().ok());
  ASSERT_TRUE((*rt)->Flush().ok());
}

// Pinned memory actually held — partitions' host copies with their page rounding, the staging
// buffers, freed blocks kept for reuse — stays within the host budget however the sizes churn.
TEST(RuntimeTest, PinnedMemoryHeldStaysWithinTheHostBudget) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.host_budget_bytes = 64 << 20;
  config.device_budget_bytes = 16 << 20;
  config.offload_param.buffer_size = 4 << 20;
  config.nvme_capacity_bytes = 256 << 20;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  [[maybe_unused]] const int64_t locked_before = VmLckKiB();
  std::mt19937 rng(5);
  for (PartitionId id = 0; id < 24; ++id) {
    PartitionDesc d = Desc(id);
    d.bytes = 1000000 + rng() % 3000000;  // 1-4 MB, odd sizes
    ASSERT_TRUE((*rt)->Register(d, Tier::kNvme).ok()) << id;
  }
  for (int round = 0; round < 80; ++round) {
    const PartitionId id = rng() % 24;
    const Tier tier = round % 4 == 0 ? Tier::kDevice : Tier::kHost;
    auto p = (*rt)->Acquire(id, tier);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE((*rt)->Release(id, tier, round % 3 == 0).ok());
    ASSERT_LE((*rt)->stats().host_held_bytes, config.host_budget_bytes) << "round " << round;
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    if (locked_before >= 0) {
      ASSERT_LE(VmLckKiB() - locked_before, static_cast<int64_t>(config.host_budget_bytes >> 10))
          << "round " << round;
    }
#endif
  }
  EXPECT_GT((*rt)->stats().host_held_bytes, 32u << 20);  // the budget was used
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)  // they replace malloc
// With strata.malloc_mmap_threshold_bytes set, a trainer's megabyte blocks (torch's gradients) go
// back to the system when freed, not stay in glibc's heap: the Runtime fixes glibc's mmap
// threshold, which glibc would otherwise raise past a megabyte the first time such a block is
// freed.
TEST(RuntimeTest, LargeBlocksAMallocFreesLeaveTheProcessOnceARuntimeIsMadeWithAThreshold) {
  ScratchDir dir;
  RuntimeConfig config = SmallConfig(dir.File("swap"));
  config.malloc_mmap_threshold_bytes = 256 << 10;
  auto rt = Runtime::Create(config, Quiet());
  ASSERT_TRUE(rt.ok()) << rt.status();
  constexpr size_t kBlock = 1 << 20;
  for (int round = 0; round < 3; ++round) {
    const size_t mapped_before = mallinfo2().hblkhd;
    void* volatile block = std::malloc(kBlock);
    ASSERT_NE(block, nullptr);
    EXPECT_GE(mallinfo2().hblkhd, mapped_before + kBlock)
        << "round " << round << ": the block came from the heap";
    std::free(block);
    EXPECT_EQ(mallinfo2().hblkhd, mapped_before) << "round " << round;
  }
}
#endif

TEST(RuntimeTest, AHugeOrOverflowingSizeIsAStatusInEveryTier) {
  ScratchDir dir;
  auto rt = Runtime::Create(SmallConfig(dir.File("swap")), Quiet());
  ASSERT_TRUE(rt.ok());
  for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    for (uint64_t bytes : {uint64_t{1} << 62, (uint64_t{1} << 63) + 5, UINT64_MAX}) {
      PartitionDesc d = Desc(50);
      d.bytes = bytes;
      absl::Status s = (*rt)->Register(d, tier);  // no exception, no allocation of that size
      EXPECT_FALSE(s.ok()) << TierName(tier) << " " << bytes;
      EXPECT_TRUE(s.code() == absl::StatusCode::kInvalidArgument ||
                  s.code() == absl::StatusCode::kResourceExhausted)
          << s;
    }
  }
  EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
  EXPECT_TRUE((*rt)->Register(Desc(50), Tier::kHost, RandomBytes(100000, 50)).ok());
}

// On a machine with a CUDA device (skipped, with the reason, elsewhere): a partition goes NVMe ->
// device memory (staged through pinned, CUDA-registered buffers) and back down, through host memory
// or straight to NVMe, and comes back with its bytes.
TEST(RuntimeTest, OnACudaDeviceAPartitionTravelsThroughDeviceMemoryWithItsBytes) {
  for (const bool straight_to_nvme : {false, true}) {
    ScratchDir dir;
    RuntimeConfig config = SmallConfig(dir.File("swap"));
    config.emulated_device = false;
    if (straight_to_nvme) config.offload_param.device = OffloadDevice::kNvme;
    RuntimeOptions o = Quiet();
    o.device_index = 0;
    auto rt = Runtime::Create(config, o);
    if (!rt.ok() && (rt.status().code() == absl::StatusCode::kFailedPrecondition ||
                     rt.status().code() == absl::StatusCode::kUnimplemented)) {
      GTEST_SKIP() << "no CUDA device here: " << rt.status();
    }
    ASSERT_TRUE(rt.ok()) << rt.status();
    const auto bytes = RandomBytes(100000, 61);
    ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, bytes).ok());
    ASSERT_TRUE((*rt)->Register(Desc(2), Tier::kDevice, RandomBytes(100000, 62)).ok());
    ASSERT_TRUE((*rt)->Acquire(1, Tier::kDevice).ok());
    // Marked changed on the device: its device copy is now the only current one.
    ASSERT_TRUE((*rt)->Release(1, Tier::kDevice, /*dirty=*/true).ok());
    ASSERT_TRUE((*rt)->Evict(1, Tier::kDevice).ok());  // written back down first
    EXPECT_EQ(HostBytes(**rt, 1), bytes) << (straight_to_nvme ? "via NVMe" : "via host");
    ASSERT_TRUE((*rt)->Evict(2, Tier::kDevice).ok());
    EXPECT_EQ(HostBytes(**rt, 2), RandomBytes(100000, 62));
    EXPECT_TRUE((*rt)->residency().CheckInvariants().ok());
  }
}

}  // namespace
}  // namespace strata::sched
