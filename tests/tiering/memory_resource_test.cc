#include "tiering/memory_resource.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"

namespace strata::tiering {
namespace {

using ::strata::testing::VmLckKiB;
using ::testing::HasSubstr;

TEST(LimitingResourceTest, BudgetHoldsUnderConcurrentAllocationFromSeveralThreads) {
  HostMemoryResource host;
  LimitingResource limited(&host, 8 << 20, "host tier");
  std::atomic<int> over{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<void*, size_t>> held;
      for (int i = 0; i < 400; ++i) {
        if (!held.empty() && rng() % 2) {
          limited.Deallocate(held.back().first, held.back().second);
          held.pop_back();
          continue;
        }
        const size_t bytes = 4096 * (1 + rng() % 256);
        auto p = limited.Allocate(bytes);
        if (!p.ok()) {
          ++refused;
          continue;
        }
        if (limited.used_bytes() > limited.budget_bytes()) ++over;
        held.emplace_back(*p, bytes);
      }
      for (auto& [p, bytes] : held) limited.Deallocate(p, bytes);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(over.load(), 0);
  EXPECT_GT(refused.load(), 0);  // the budget was reached
  EXPECT_EQ(limited.used_bytes(), 0u);
}

TEST(LimitingResourceTest, OnExhaustedMayEvictAndTheAllocationIsRetried) {
  HostMemoryResource host;
  std::vector<std::pair<void*, size_t>> resident;
  LimitingResource* self = nullptr;
  std::vector<size_t> asked;
  LimitingResource limited(&host, 1 << 20, "device tier (host-emulated)", [&](size_t short_by) {
    asked.push_back(short_by);
    if (resident.empty()) return false;
    self->Deallocate(resident.back().first, resident.back().second);  // evict
    resident.pop_back();
    return true;
  });
  self = &limited;
  auto a = limited.Allocate(768 << 10);
  ASSERT_TRUE(a.ok());
  resident.emplace_back(*a, 768 << 10);
  auto b = limited.Allocate(512 << 10);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(asked, std::vector<size_t>{256 << 10});
  EXPECT_EQ(limited.used_bytes(), 512u << 10);
  // Nothing left to evict: a clear status, not an OOM.
  auto c = limited.Allocate(768 << 10);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(c.status().message(),
              HasSubstr("device tier (host-emulated) budget of 1048576 bytes: 524288 in use, "
                        "786432 asked"));
  limited.Deallocate(*b, 512 << 10);
}

TEST(LimitingResourceTest, ACallbackThatFreesNothingIsNotRetriedForever) {
  HostMemoryResource host;
  int calls = 0;
  LimitingResource limited(
      &host, 4096, "t", [&](size_t) { return ++calls > 0; }, 3);
  EXPECT_FALSE(limited.Allocate(8192).ok());
  EXPECT_EQ(calls, 3);
}

TEST(StatisticsResourceTest, CountsBytesPeakAndFailures) {
  HostMemoryResource host;
  LimitingResource limited(&host, 1 << 20, "t");
  StatisticsResource stats(&limited);
  auto a = stats.Allocate(600 << 10);
  auto b = stats.Allocate(300 << 10);
  EXPECT_FALSE(stats.Allocate(300 << 10).ok());
  stats.Deallocate(*a, 600 << 10);
  const auto c = stats.counts();
  EXPECT_EQ(c.bytes_in_use, 300u << 10);
  EXPECT_EQ(c.peak_bytes, 900u << 10);
  EXPECT_EQ(c.allocations, 2u);
  EXPECT_EQ(c.failures, 1u);
  stats.Deallocate(*b, 300 << 10);
}

bool MayLock(size_t bytes) {
  rlimit limit{};
  getrlimit(RLIMIT_MEMLOCK, &limit);
  return geteuid() == 0 || limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= bytes;
}

TEST(PinnedHostResourceTest, LocksWhenAllowedAndWarnsOnceWhenNot) {
  if (MayLock(8 << 20)) {
    PinnedHostResource pinned;
    const int64_t before = VmLckKiB();
    auto p = pinned.Allocate(4 << 20);
    ASSERT_TRUE(p.ok());
    static_cast<char*>(*p)[(4 << 20) - 1] = 1;
    EXPECT_TRUE(pinned.pinned());
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    EXPECT_GE(VmLckKiB() - before, 4 << 10);  // the kernel counts it locked
#endif
    pinned.Deallocate(*p, 4 << 20);
  }
  // A process that may lock nothing: unlocked memory and one warning.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ASan and TSan intercept mlock() and make it a no-op that succeeds, so a "
                  "refused lock cannot be seen under them";
#endif
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit none{0, 0};
    if (setrlimit(RLIMIT_MEMLOCK, &none) != 0) _exit(3);
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(4);  // no CAP_IPC_LOCK
    int warnings = 0;
    PinnedHostResource pinned({.on_warning = [&](absl::string_view w) {
      if (w.find("RLIMIT_MEMLOCK") != absl::string_view::npos) ++warnings;
    }});
    auto a = pinned.Allocate(1 << 20);
    auto b = pinned.Allocate(1 << 20);
    if (!a.ok() || !b.ok()) _exit(5);
    if (pinned.pinned()) _exit(6);
    _exit(warnings == 1 ? 0 : 10 + warnings);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << WEXITSTATUS(status);
}

TEST(PoolingResourceTest, FreedBlocksAreReusedAndEverythingHeldStaysInTheBudget) {
  HostMemoryResource host;
  StatisticsResource upstream(&host);
  {
    PoolingResource pool(&upstream, 1 << 20);
    EXPECT_EQ(*PoolingResource::ClassOf(1), 4096u);
    EXPECT_EQ(*PoolingResource::ClassOf(300000), 303104u);  // whole pages, no power-of-two slack
    auto a = pool.Allocate(300000);
    ASSERT_TRUE(a.ok());
    pool.Deallocate(*a, 300000);
    EXPECT_EQ(pool.cached_bytes(), 303104u);
    auto b = pool.Allocate(303000);  // the same page count: the same block again
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(*a, *b);
    EXPECT_EQ(pool.reused(), 1u);
    pool.Deallocate(*b, 303000);
    // A block of another size: the cached one goes back upstream to make room.
    auto c = pool.Allocate(900 << 10);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(pool.cached_bytes(), 0u);
    EXPECT_EQ(pool.held_bytes(), 900u << 10);
    EXPECT_EQ(upstream.counts().bytes_in_use, 900u << 10);
    // Past the budget: refused, naming it.
    auto d = pool.Allocate(200 << 10);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(d.status().message(), HasSubstr("a budget of 1048576 bytes, 921600 in use"));
    pool.Deallocate(*c, 900 << 10);
    EXPECT_LE(pool.held_bytes(), 1u << 20);
  }
  EXPECT_EQ(upstream.counts().bytes_in_use, 0u);  // the pool returned everything
}

TEST(PoolingResourceTest, HeldBytesNeverPassTheBudgetUnderChurn) {
  HostMemoryResource host;
  StatisticsResource upstream(&host);
  PoolingResource pool(&upstream, 8 << 20);
  std::atomic<int> over{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<void*, size_t>> held;
      for (int i = 0; i < 300; ++i) {
        if (!held.empty() && rng() % 2) {
          pool.Deallocate(held.back().first, held.back().second);
          held.pop_back();
        } else {
          const size_t bytes = 1000 + rng() % (700 << 10);
          if (auto p = pool.Allocate(bytes); p.ok()) held.emplace_back(*p, bytes);
        }
        if (upstream.counts().bytes_in_use > pool.budget_bytes()) ++over;
      }
      for (auto& [p, bytes] : held) pool.Deallocate(p, bytes);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(over.load(), 0);
}

TEST(PoolingResourceTest, SizesPastTheLimitAreRefusedNotLoopedOn) {
  HostMemoryResource host;
  PoolingResource pool(&host, 1 << 20);
  for (size_t bytes : {size_t{0}, (size_t{1} << 62) + 1, (size_t{1} << 63) + 1, SIZE_MAX}) {
    EXPECT_EQ(PoolingResource::ClassOf(bytes).status().code(), absl::StatusCode::kInvalidArgument)
        << bytes;
    EXPECT_EQ(pool.Allocate(bytes).status().code(), absl::StatusCode::kInvalidArgument) << bytes;
  }
  EXPECT_EQ(pool.Allocate(size_t{1} << 40).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(LimitingResourceTest, AHugeRequestDoesNotWrapTheBudgetCheck) {
  HostMemoryResource host;
  LimitingResource limited(&host, 1 << 20, "t");
  auto a = limited.Allocate(4096);
  ASSERT_TRUE(a.ok());
  // used + bytes would wrap to less than the budget.
  auto b = limited.Allocate(SIZE_MAX - 100);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(limited.used_bytes(), 4096u);
  limited.Deallocate(*a, 4096);
}

TEST(NumaTest, NearestNodeIsWhatTheKernelSaysOrUnknown) {
  EXPECT_EQ(NumaNodeNearest("/nonexistent/strata"), -1);
  // A memory filesystem has no block device behind it.
  if (std::filesystem::exists("/dev/shm")) {
    EXPECT_EQ(NumaNodeNearest("/dev/shm"), -1);
  }
  // Whatever it answers for the build disk is a node this machine has; -1 only when the kernel
  // names no node for the disk's device.
  const int node = NumaNodeNearest(".");
  if (node >= 0) {
    EXPECT_TRUE(std::filesystem::exists("/sys/devices/system/node/node" + std::to_string(node)));
  } else {
    EXPECT_EQ(node, -1);
    struct stat st;
    ASSERT_EQ(stat(".", &st), 0);
    const std::string dev = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                            std::to_string(minor(st.st_dev));
    for (const std::string up :
         {"/device/numa_node", "/device/device/numa_node", "/../device/numa_node"}) {
      std::ifstream f(dev + up);
      int named = -1;
      if (f >> named) {
        EXPECT_LT(named, 0) << dev + up << " names node " << named;
      }
    }
  }
}

TEST(HostMemoryResourceTest, ZeroBytesIsInvalid) {
  HostMemoryResource host;
  EXPECT_EQ(host.Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::tiering
