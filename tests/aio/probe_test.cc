#include "aio/probe.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::aio {
namespace {

TEST(ProbeTest, ReportsLimitsAndAReasonForEachUnusableBackend) {
  SystemProbe p = ProbeSystem();
  if (!p.io_uring_usable) {
    EXPECT_FALSE(p.io_uring_reason.empty());
  }
  if (!p.libaio_usable) {
    EXPECT_FALSE(p.libaio_reason.empty());
  }
  EXPECT_GT(p.memlock_limit_bytes, 0u);
  EXPECT_THAT(p.ToString(), ::testing::HasSubstr("RLIMIT_MEMLOCK"));
  if (p.cap_ipc_lock) {
    EXPECT_EQ(p.LockableBytes(), UINT64_MAX);
  }
}

}  // namespace
}  // namespace strata::aio
