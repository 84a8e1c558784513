#include "aio/stats.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "absl/strings/str_format.h"

namespace strata::aio {

int LatencyHistogram::BucketOf(uint64_t micros) {
  if (micros < kSubBuckets) return static_cast<int>(micros);
  const int exponent = std::bit_width(micros) - 1;  // >= 4
  const int shift = exponent - 4;                   // log2(kSubBuckets) == 4
  const int sub = static_cast<int>((micros >> shift) & (kSubBuckets - 1));
  return std::min(kBuckets - 1, (exponent - 3) * kSubBuckets + sub);
}

double LatencyHistogram::BucketUpper(int bucket) {
  if (bucket < kSubBuckets) return bucket + 1;
  const int exponent = bucket / kSubBuckets + 3;
  const int sub = bucket % kSubBuckets;
  return std::ldexp(kSubBuckets + sub + 1, exponent - 4);
}

void LatencyHistogram::Record(uint64_t micros) {
  ++buckets_[BucketOf(micros)];
  ++count_;
  max_ = std::max(max_, micros);
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  for (int i = 0; i < kBuckets; ++i) buckets_[i] += other.buckets_[i];
  count_ += other.count_;
  max_ = std::max(max_, other.max_);
}

double LatencyHistogram::Percentile(double q) const {
  if (count_ == 0) return 0;
  const uint64_t rank = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * count_)));
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += buckets_[i];
    if (seen >= rank) {
      if (i == kBuckets - 1) return static_cast<double>(max_);
      return std::min(BucketUpper(i), static_cast<double>(max_));
    }
  }
  return static_cast<double>(max_);
}

std::string EngineStats::ToString() const {
  return absl::StrFormat(
      "requests %d (failed %d), read %d B in %d ops, written %d B in %d ops, retries %d, staged "
      "pieces %d, queue full %.3f s, piece latency p50 %.0f us p99 %.0f us max %d us",
      requests, failed_requests, bytes_read, read_ops, bytes_written, write_ops, retries,
      staged_pieces, queue_full_seconds, piece_latency.Percentile(0.5),
      piece_latency.Percentile(0.99), piece_latency.max_us());
}

}  // namespace strata::aio
