// The Runtime facade on the host-emulated device tier (what every CI run has): configuration
// from DeepSpeed-style JSON, acquire/release across the three tiers, budgets and LRU eviction,
// and a write-back that fails.
#include "tiering/runtime.h"

#include <cerrno>
#include <fstream>
#include <set>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>
#include <sys/wait.h>

#include "aio/fault_injection.h"
#include "base/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/aio/test_util.h"

namespace strata::tiering {
namespace {

using ::strata::testing::RandomBytes;
using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;

TEST(RuntimeConfigTest, ReadsADeepSpeedZero3NvmeConfigAndReportsWhatItDoesNotUse) {
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({
    "train_batch_size": 16,
    "fp16": {"enabled": true},
    "zero_optimization": {
      "stage": 3,
      "overlap_comm": true,
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                        "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                            "buffer_count": 4, "fast_init": false, "pipeline_read": true},
      "stage3_prefetch_bucket_size": 5e8,
      "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": 1e9},
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
            "single_submit": false, "overlap_events": true},
    "strata": {"host_budget_bytes": 8589934592, "eviction_policy": "lru"}})",
                                     &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_stage, 3);
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c->offload_param.buffer_size, 100000000);
  EXPECT_EQ(c->offload_param.max_in_cpu, 1000000000);
  EXPECT_TRUE(c->offload_optimizer.pipeline_read);
  EXPECT_EQ(c->stage3_prefetch_bucket_size, 500000000);
  EXPECT_EQ(c->host_budget_bytes, 8589934592u);
  EXPECT_EQ(c->SwapPath(), "/local_nvme");
  std::string all;
  for (const auto& w : warnings) all += w + "\n";
  EXPECT_THAT(all, HasSubstr("aio.thread_count is DeepSpeed's old name"));
  EXPECT_THAT(all, HasSubstr("train_batch_size: not used by strata"));
  EXPECT_THAT(all, HasSubstr("zero_optimization.overlap_comm: not used by strata"));
}

struct Bad {
  const char* json;
  const char* message;
};
class RuntimeConfigRejects : public ::testing::TestWithParam<Bad> {};

TEST_P(RuntimeConfigRejects, NamingTheKeyAndWhatIsAccepted) {
  auto c = RuntimeConfigFromJsonText(GetParam().json);
  ASSERT_FALSE(c.ok()) << GetParam().json;
  EXPECT_THAT(c.status().message(), HasSubstr(GetParam().message)) << c.status();
}

INSTANTIATE_TEST_SUITE_P(
    BadValues, RuntimeConfigRejects,
    ::testing::Values(
        Bad{R"({"strata": {"host_budget_bytes": 0}})", "strata.host_budget_bytes: must be in [1,"},
        Bad{R"({"strata": {"device_budget_bytes": -5}})", "strata.device_budget_bytes"},
        Bad{R"({"strata": {"device": "tpu"}})", "accepted: emulated, cuda"},
        Bad{R"({"strata": {"eviction": "lru"}})", "strata.eviction: unknown key; accepted keys"},
        Bad{R"({"strata": {"eviction_policy": "fifo"}})", "accepted: trace, lru"},
        Bad{R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
            "offload_param.nvme_path: is required when device is \"nvme\""},
        Bad{R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
            "parameter offload needs stage 3"},
        Bad{R"({"zero_optimization": {"stage": 5}})", "zero_optimization.stage: must be in [0, 3]"},
        Bad{R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
            "accepted: none, cpu, nvme"},
        Bad{R"({"zero_optimization": {"offload_optimizer": {"buffer_size": 1.5}}})",
            "offload_optimizer.buffer_size: must be an integer"},
        Bad{R"({"zero_optimization": {"offload_optimizer": {"nvme": "/x"}}})",
            "offload_optimizer.nvme: unknown key"},
        Bad{R"({"aio": {"queue_depth": 0}})", "aio.queue_depth"}));

RuntimeConfig SmallConfig(const std::string& nvme_path) {
  RuntimeConfig c;
  c.aio.block_size = 64 << 10;
  c.device_budget_bytes = 2 * 100000;  // two partitions of 100000 bytes
  c.offload_param.buffer_size = 64 << 10;
  c.host_budget_bytes = 3 * 100000 + 2 * (64 << 10);  // three, and the two staging buffers
  c.nvme_capacity_bytes = 8 << 20;
  c.nvme_path = nvme_path;
  return c;
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
    EXPECT_LE((*rt)->residency().used_bytes(Tier::kDevice), 200000u);
    EXPECT_LE((*rt)->residency().used_bytes(Tier::kHost), 300000u);
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

TEST(RuntimeTest, APrefetchBringsThePartitionAheadAndTheAcquireIsAHit) {
  ScratchDir dir;
  auto rt = Runtime::Create(SmallConfig(dir.File("swap")));
  ASSERT_TRUE(rt.ok());
  ASSERT_TRUE((*rt)->Register(Desc(1), Tier::kNvme, RandomBytes(100000, 41)).ok());
  std::future<absl::Status> f = (*rt)->Prefetch(1, Tier::kDevice);
  ASSERT_TRUE(f.get().ok());
  const uint64_t hits = (*rt)->stats().acquire_hits;
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*rt)->stats().acquire_hits, hits + 1);
  EXPECT_EQ(0, std::memcmp(*p, RandomBytes(100000, 41).data(), 100000));
  EXPECT_EQ((*rt)->Prefetch(1, Tier::kNvme).get().code(), absl::StatusCode::kInvalidArgument);
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

}  // namespace
}  // namespace strata::tiering
