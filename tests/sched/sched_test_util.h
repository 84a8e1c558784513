// Helpers shared by the sched/ tests: a small configuration counted in 100000-byte partitions
// (25 pages each), quiet options, descriptors and one trainer step.
#ifndef STRATA_TESTS_SCHED_SCHED_TEST_UTIL_H_
#define STRATA_TESTS_SCHED_SCHED_TEST_UTIL_H_

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "sched/runtime.h"

namespace strata::sched::testing {

inline constexpr uint64_t kBytes = 100000;  // 25 pages: 102400 bytes of budget
inline constexpr uint64_t kSlot = 102400;

// `device_slots` and `host_slots` partitions of kBytes; two pairs of 64 KiB staging buffers on
// top of the host slots.
inline RuntimeConfig Config(const std::string& nvme_path, int device_slots, int host_slots) {
  RuntimeConfig c;
  c.aio.block_size = 64 << 10;
  c.device_budget_bytes = device_slots * kSlot;
  c.offload_param.buffer_size = 64 << 10;
  c.offload_param.buffer_count = 4;  // two pairs: two staged moves at once
  c.host_budget_bytes = host_slots * kSlot + 4 * (64 << 10);
  c.nvme_capacity_bytes = 64 << 20;
  c.nvme_path = nvme_path;
  c.eviction_policy = "trace";
  c.stage3_param_persistence_threshold = 0;  // these partitions are small: none stays for that
  return c;
}

inline RuntimeOptions Quiet(std::vector<std::string>* warnings = nullptr) {
  RuntimeOptions o;
  o.on_warning = [warnings](absl::string_view w) {
    if (warnings != nullptr) warnings->emplace_back(w);
  };
  return o;
}

inline tiering::PartitionDesc Desc(PartitionId id, uint64_t bytes = kBytes,
                                   tiering::Role role = tiering::Role::kParam) {
  tiering::PartitionDesc d;
  d.id = id;
  d.bytes = bytes;
  d.elements = bytes / 4;
  d.role = role;
  return d;
}

// One trainer step over `order` on the device: acquire, check the bytes, "compute", release.
inline void RunStep(Runtime& rt, const std::vector<PartitionId>& order,
                    std::chrono::microseconds compute,
                    const std::map<PartitionId, std::vector<std::byte>>& bytes) {
  for (PartitionId id : order) {
    auto p = rt.Acquire(id, Tier::kDevice);
    ASSERT_TRUE(p.ok()) << id << ": " << p.status();
    ASSERT_EQ(0, std::memcmp(*p, bytes.at(id).data(), kBytes)) << id;
    std::this_thread::sleep_for(compute);
    ASSERT_TRUE(rt.Release(id, Tier::kDevice, false).ok());
  }
}

// Runs `fn` on this thread; if it is still running after `seconds` (a hang: a defect) the test
// binary ends with a message naming `what`, instead of blocking the suite until its timeout.
template <typename F>
void WithinSeconds(double seconds, const char* what, F fn) {
  std::atomic<bool> done{false};
  std::thread guard([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!done.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!done.load()) {
      std::fprintf(stderr, "FAILED: %s was still running after %g s (a hang)\n", what, seconds);
      std::_Exit(1);
    }
  });
  fn();
  done.store(true);
  guard.join();
}

}  // namespace strata::sched::testing

#endif  // STRATA_TESTS_SCHED_SCHED_TEST_UTIL_H_
