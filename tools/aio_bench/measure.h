// tools/aio_bench/measure.h: measuring one aio configuration ("point") on one file.
//
// A point is an aio config plus read or write. MeasurePoint creates an Engine for it, streams
// sequential requests over the file (wrapping at its end) for a warm-up, then for `reps`
// repetitions of `rep_seconds` each (more when they spread widely: MeasureOptions), and reports
// the median, min and max GB/s, IOPS (block-sized
// operations per second), the engine's piece latency percentiles over the measured repetitions,
// and CPU use (CPU seconds per wall second of this process, all threads).
//
// Memory: a point keeps block_size x queue_depth x threads bytes in flight, plus one request;
// the caller passes a buffer of at least BufferBytesFor(point) (huge-page backed, as strata's
// pinned pools are, unless it wants to measure otherwise).
//
// Thread safety: functions are reentrant; one point runs at a time per file.
#ifndef STRATA_TOOLS_AIO_BENCH_MEASURE_H_
#define STRATA_TOOLS_AIO_BENCH_MEASURE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "aio/config.h"
#include "aio/engine.h"
#include "bench/common/report.h"
#include "nlohmann/json.hpp"

namespace strata::aio_bench {

enum class Op { kRead, kWrite };
const char* OpName(Op op);

struct Point {
  aio::AioConfig config;
  Op op = Op::kRead;

  // "io_uring read bs=1M qd=16 t=2 +regbuf +regfile +sqpoll"
  std::string Describe() const;
  // The same configuration ignoring op (used to pair read and write results).
  std::string ConfigKey() const;
};

struct MeasureOptions {
  double warmup_seconds = 0.2;
  double rep_seconds = 0.5;
  int reps = 5;
  // A point whose repetitions spread widely ((max - min) / median above max_spread: a stall of the
  // drive, or another process) is measured again, `reps` more repetitions at a time, up to
  // extra_rounds times, and summarized over all of them; still wide after that, it is marked
  // noisy.
  double max_spread = 0.5;
  int extra_rounds = 2;
};

struct PointResult {
  Point point;
  bool ok = false;
  std::string error;        // when !ok: why the point failed
  bench::Summary gb_per_s;  // over the repetitions
  double iops = 0;          // median
  double latency_p50_us = 0, latency_p99_us = 0, latency_max_us = 0;
  double cpu_cores = 0;                      // CPU seconds / wall seconds over the repetitions
  double seconds = 0;                        // wall time of the whole point, setup included
  int rounds_repeated = 0;                   // extra rounds taken because the spread was wide
  bool noisy = false;                        // still wide after them
  std::vector<std::string> engine_warnings;  // fallbacks the engine took

  nlohmann::json ToJson() const;
};

// Request size used for a point, and the buffer it needs.
uint64_t RequestBytesFor(const aio::AioConfig& config);
uint64_t BufferBytesFor(const aio::AioConfig& config);

// The memory a point's buffer may take, read once before anything is allocated.
struct MemoryLimits {
  uint64_t available_bytes = 0;  // MemAvailable from /proc/meminfo; 0 when it cannot be read
  // Bytes that may be locked (registered with io_uring): RLIMIT_MEMLOCK, unlimited with
  // CAP_IPC_LOCK (aio::SystemProbe::LockableBytes).
  uint64_t lockable_bytes = UINT64_MAX;
  static MemoryLimits Probe();
};

// OK when BufferBytesFor(config) fits in half of limits.available_bytes (not checked when that is
// unknown) and, with registered buffers, in limits.lockable_bytes (the engine's own staging
// buffers are checked by the engine). Otherwise ResourceExhausted saying what block size x queue
// depth x threads needs and what this machine allows.
absl::Status CheckBufferFits(const aio::AioConfig& config, const MemoryLimits& limits);

// Byte counts of a stream in consecutive time windows.
struct StreamResult {
  std::vector<double> window_seconds;      // length of each window
  std::vector<uint64_t> window_bytes;      // bytes of the requests completed in it
  std::vector<double> window_cpu_seconds;  // CPU time of this process in it
};

// Streams sequential requests of RequestBytesFor(engine.config()) over [0, file_bytes), wrapping,
// with enough in flight to fill every worker's queue, from time 0 until boundaries.back()
// (seconds), then lets the requests in flight complete (uncounted). Window i runs from
// boundaries[i] to boundaries[i + 1]; completions before boundaries[0] (the warm-up) are not
// counted, and the engine's statistics are reset at boundaries[0]. The queue stays full across
// windows, so each measures the steady state. `buffer` holds at least
// BufferBytesFor(engine.config()) bytes; file_bytes is a multiple of the request size.
absl::StatusOr<StreamResult> Stream(aio::Engine& engine, const aio::File& file, uint64_t file_bytes,
                                    Op op, std::byte* buffer,
                                    const std::vector<double>& boundaries);

// Measures `point` on the file at `path` (which holds at least file_bytes). Never fails as a
// function: a point that cannot run comes back with ok == false and the reason.
PointResult MeasurePoint(const Point& point, const std::string& path, uint64_t file_bytes,
                         std::byte* buffer, const MeasureOptions& options);

}  // namespace strata::aio_bench

#endif  // STRATA_TOOLS_AIO_BENCH_MEASURE_H_
