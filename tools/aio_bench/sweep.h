// tools/aio_bench/sweep.h: the grid of aio_bench_perf_sweep, how points are chosen under a time
// budget, how the best configurations are picked, and the outputs (CSV, JSON, SVG heatmaps, the
// config block).
//
// Thread safety: plain values and functions; a Planner is used from one thread.
#ifndef STRATA_TOOLS_AIO_BENCH_SWEEP_H_
#define STRATA_TOOLS_AIO_BENCH_SWEEP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "tools/aio_bench/measure.h"

namespace strata::aio_bench {

// io_uring's own options as one grid axis.
struct UringOptions {
  bool registered_buffers = false;
  bool registered_files = false;
  bool sqpoll = false;
  std::string Name() const;  // "plain", "registered", "sqpoll", "registered+sqpoll"
};

struct Grid {
  std::vector<aio::EngineKind> engines;
  std::vector<uint64_t> block_sizes;
  std::vector<int> queue_depths;
  std::vector<int> threads;
  std::vector<Op> ops;
  std::vector<UringOptions> uring_options;  // applied to io_uring points only
  bool direct = true;

  // Engines io_uring and libaio; block sizes 128K..8M; depths 1..64; threads 1..cores; read and
  // write; io_uring plain, with registered buffers and files, and with SQPOLL.
  static Grid Full(int cores);
  // A coarse grid that finishes in under a minute on 2 cores: 256K/1M/4M, depths 4/16/64,
  // threads 1 and cores, io_uring plain.
  static Grid Quick(int cores);

  std::vector<Point> Points() const;  // every combination, in a stable order
};

// Chooses the next point to measure within a time budget: the coarse grid first (centre first,
// for at most half the budget), then, for read and for write, the unmeasured neighbours (one step
// along one axis of the fine grid) of the best point so far, climbing while a neighbour is
// better, then whatever is left of the coarse grid, until the budget would be exceeded or nothing
// new is left.
class Planner {
 public:
  Planner(Grid fine, Grid coarse, double budget_seconds);
  // The next point, or nullopt when done. `elapsed_seconds` is the time spent so far; the cost of
  // a point is estimated from the points measured so far.
  std::optional<Point> Next(const std::vector<PointResult>& done, double elapsed_seconds);
  // Points that will be measured if nothing is refined (for the progress bar).
  size_t coarse_size() const { return coarse_.size(); }

 private:
  std::vector<Point> Neighbours(const Point& p) const;
  std::optional<Point> Refine(const std::vector<PointResult>& done);

  Grid fine_;
  std::vector<Point> coarse_;
  size_t next_coarse_ = 0;
  double budget_seconds_;
  absl::flat_hash_set<std::string> planned_;
};

struct Best {
  std::optional<PointResult> read, write;
  // The configuration measured for both read and write with the highest harmonic mean of the
  // two (the best for moving equal bytes each way, as an offloaded optimizer does).
  std::optional<PointResult> both_read, both_write;
};
Best PickBest(const std::vector<PointResult>& results);

struct SweepOutputs {
  std::string dir;                    // where the files go
  std::vector<std::string> warnings;  // carried into every output (e.g. BUFFERED)
  nlohmann::json meta;                // machine, file, options
};

// Writes results.csv, results.json, heatmap_<engine>_<op>.svg, and the config blocks
// best_read.json, best_write.json and best.json (the "both" pick), each
// {"aio": {...}, "strata": {"aio": {...}}} as aio::AioConfigToJson writes it: DeepSpeed's keys
// (intra_op_parallelism) and JSON booleans. Returns the paths written.
absl::StatusOr<std::vector<std::string>> WriteOutputs(const SweepOutputs& out,
                                                      const std::vector<PointResult>& results,
                                                      const Best& best);

// One heatmap: block size (rows) x queue depth (columns) -> GB/s, the best over the other axes;
// cells never measured are blank and failed ones marked. Returns SVG text.
std::string Heatmap(const std::vector<PointResult>& results, aio::EngineKind engine, Op op,
                    const std::vector<std::string>& warnings);

}  // namespace strata::aio_bench

#endif  // STRATA_TOOLS_AIO_BENCH_SWEEP_H_
