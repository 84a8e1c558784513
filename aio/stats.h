// aio/stats.h: what an Engine reports about itself: bytes, operations, retries, latency
// percentiles and the time its workers spent with the queue full.
//
// LatencyHistogram: log-linear buckets (16 per power of two, so a percentile is within ~4% of the
// true value) from 1 µs to about 70 minutes. Not thread-safe; the Engine keeps one per worker under
// that worker's lock and merges them into an EngineStats snapshot.
#ifndef STRATA_AIO_STATS_H_
#define STRATA_AIO_STATS_H_

#include <array>
#include <cstdint>
#include <string>

namespace strata::aio {

class LatencyHistogram {
 public:
  void Record(uint64_t micros);
  void Merge(const LatencyHistogram& other);
  uint64_t count() const { return count_; }
  uint64_t max_us() const { return max_; }
  // The q-quantile (0 < q <= 1) in microseconds, or 0 when empty.
  double Percentile(double q) const;

 private:
  static constexpr int kSubBuckets = 16;
  static constexpr int kBuckets = 32 * kSubBuckets;
  static int BucketOf(uint64_t micros);
  static double BucketUpper(int bucket);

  std::array<uint64_t, kBuckets> buckets_ = {};
  uint64_t count_ = 0;
  uint64_t max_ = 0;
};

struct EngineStats {
  uint64_t requests = 0;  // Requests completed (successfully or not).
  uint64_t failed_requests = 0;
  uint64_t bytes_read = 0;  // Bytes the callers asked for and got (not bounce padding).
  uint64_t bytes_written = 0;
  uint64_t read_ops = 0;  // Operations handed to the backend, retries included.
  uint64_t write_ops = 0;
  uint64_t retries = 0;            // Resubmissions after a short transfer, EINTR or EAGAIN.
  uint64_t staged_pieces = 0;      // Pieces that went through a staging (bounce) buffer.
  double queue_full_seconds = 0;   // Summed over workers: pieces waiting, queue_depth in flight.
  LatencyHistogram piece_latency;  // Per block-sized piece: first submission to completion.

  std::string ToString() const;
};

}  // namespace strata::aio

#endif  // STRATA_AIO_STATS_H_
