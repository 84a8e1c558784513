#include "aio/fault_injection.h"

#include <cerrno>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::aio {
namespace {

Op MakeOp(uint64_t offset, uint32_t length, OpKind kind = OpKind::kRead) {
  Op op;
  op.offset = offset;
  op.length = length;
  op.kind = kind;
  return op;
}

std::vector<int> Draw(uint64_t seed) {
  FaultRule r = FaultRule::Error(EIO);
  r.probability = 0.5;
  FaultInjector injector(seed, {r});
  std::vector<int> out;
  for (int i = 0; i < 64; ++i) out.push_back(injector.Decide(MakeOp(i * 4096, 4096)).error);
  return out;
}

TEST(FaultInjectorTest, SameSeedSameDecisions) {
  EXPECT_EQ(Draw(7), Draw(7));
  EXPECT_NE(Draw(7), Draw(8));
}

TEST(FaultInjectorTest, RulesSelectByKindOffsetSkipAndMaxHits) {
  FaultRule r = FaultRule::Error(ENOSPC);
  r.only = OpKind::kWrite;
  r.offset_begin = 8192;
  r.offset_end = 16384;
  r.skip = 1;
  r.max_hits = 1;
  FaultInjector injector(1, {r});
  EXPECT_EQ(injector.Decide(MakeOp(8192, 4096, OpKind::kRead)).error, 0);        // a read
  EXPECT_EQ(injector.Decide(MakeOp(0, 4096, OpKind::kWrite)).error, 0);          // before the range
  EXPECT_EQ(injector.Decide(MakeOp(8192, 4096, OpKind::kWrite)).error, 0);       // skipped
  EXPECT_EQ(injector.Decide(MakeOp(4096, 8192, OpKind::kWrite)).error, ENOSPC);  // overlaps
  EXPECT_EQ(injector.Decide(MakeOp(8192, 4096, OpKind::kWrite)).error, 0);       // max_hits reached
  EXPECT_EQ(injector.hits(0), 1u);
}

TEST(FaultInjectorTest, ShortTransfersReportFewerBytesButNotZero) {
  FaultInjector injector(3, {FaultRule::Short()});
  for (int i = 0; i < 100; ++i) {
    const auto d = injector.Decide(MakeOp(0, 65536));
    EXPECT_GE(d.short_length, 1u);
    EXPECT_LT(d.short_length, 65536u);
  }
  EXPECT_EQ(injector.Decide(MakeOp(0, 1)).short_length, 0u);  // nothing shorter than one byte
}

}  // namespace
}  // namespace strata::aio
