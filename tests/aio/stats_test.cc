#include "aio/stats.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::aio {
namespace {

TEST(LatencyHistogramTest, EmptyGivesZero) {
  LatencyHistogram h;
  EXPECT_EQ(h.Percentile(0.5), 0);
  EXPECT_EQ(h.count(), 0u);
}

TEST(LatencyHistogramTest, PercentilesAreWithinABucketOfTheTruth) {
  LatencyHistogram h;
  for (uint64_t us = 1; us <= 10000; ++us) h.Record(us);
  EXPECT_EQ(h.count(), 10000u);
  EXPECT_EQ(h.max_us(), 10000u);
  EXPECT_NEAR(h.Percentile(0.5), 5000, 5000 * 0.07);
  EXPECT_NEAR(h.Percentile(0.99), 9900, 9900 * 0.07);
  EXPECT_EQ(h.Percentile(1.0), 10000);
}

TEST(LatencyHistogramTest, MergeAddsCountsAndKeepsTheMax) {
  LatencyHistogram a, b;
  a.Record(10);
  b.Record(1000000);
  a.Merge(b);
  EXPECT_EQ(a.count(), 2u);
  EXPECT_EQ(a.max_us(), 1000000u);
  EXPECT_LE(a.Percentile(0.5), 11);
}

TEST(LatencyHistogramTest, HugeValuesLandInTheLastBucket) {
  LatencyHistogram h;
  h.Record(uint64_t{1} << 62);
  EXPECT_EQ(h.Percentile(0.5), static_cast<double>(uint64_t{1} << 62));
}

}  // namespace
}  // namespace strata::aio
