// aio_bench_perf_sweep: sweeps aio configurations (engine x block size x queue depth x threads x
// read/write x io_uring options) on a test file in --nvme_dir and writes every point, heatmaps and
// the best configuration as a config block that strata and DeepSpeed both accept.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "aio/buffer.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/measure.h"
#include "tools/aio_bench/scratch.h"
#include "tools/aio_bench/sweep.h"

ABSL_FLAG(std::string, nvme_dir, "", "directory on the drive to tune (required)");
ABSL_FLAG(std::string, out, "", "where results go (default NVME_DIR/strata-sweep)");
ABSL_FLAG(bool, quick, false, "a coarse grid that finishes in under a minute on 2 cores");
ABSL_FLAG(double, budget, 0,
          "bound the sweep to this many seconds: the coarse grid first, then "
          "refine around the best (0: no bound, measure the whole grid)");
ABSL_FLAG(std::string, size, "", "test file size (default 1G, 512M with --quick)");
ABSL_FLAG(std::string, engines, "", "override the grid: engines (io_uring,libaio,posix)");
ABSL_FLAG(std::string, block_sizes, "", "override the grid: block sizes (e.g. 256K,1M,4M)");
ABSL_FLAG(std::string, queue_depths, "", "override the grid: queue depths (e.g. 4,16,64)");
ABSL_FLAG(std::string, threads, "", "override the grid: thread counts (e.g. 1,2)");
ABSL_FLAG(std::string, ops, "read,write", "read, write or both");
ABSL_FLAG(bool, uring_options, true,
          "also sweep io_uring's registered buffers/files and SQPOLL "
          "(full grid only)");
ABSL_FLAG(int, reps, 3, "measured runs per point (more when they spread widely)");
ABSL_FLAG(double, rep_seconds, 0.5, "seconds per run (0.12 with --quick unless given)");
ABSL_FLAG(double, warmup_seconds, 0.2,
          "warm-up seconds per point (0.05 with --quick unless given)");
ABSL_FLAG(bool, allow_memory_fs, false,
          "measure a memory-backed filesystem (tmpfs, ramfs): the figures are then RAM's");
ABSL_FLAG(bool, overwrite, false, "write over an existing test file");
ABSL_FLAG(bool, allow_buffered, false,
          "run on a filesystem that refuses O_DIRECT (every output "
          "then carries a warning)");

namespace strata::aio_bench {
namespace {

using Clock = std::chrono::steady_clock;

std::string Clock2(double seconds) {
  const int s = static_cast<int>(std::max(0.0, seconds) + 0.5);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

int Main() {
  const std::string dir = absl::GetFlag(FLAGS_nvme_dir);
  if (dir.empty()) BadFlag("--nvme-dir", "is required: a directory on the drive to tune");
  const bool quick = absl::GetFlag(FLAGS_quick);
  const double budget = absl::GetFlag(FLAGS_budget);
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));

  Grid fine = Grid::Full(cores);
  if (!absl::GetFlag(FLAGS_uring_options)) fine.uring_options = {UringOptions{}};
  Grid grid = quick ? Grid::Quick(cores) : fine;
  auto apply_overrides = [&](Grid* g) {
    if (!absl::GetFlag(FLAGS_engines).empty()) {
      g->engines = ParseEngineList("--engines", absl::GetFlag(FLAGS_engines));
    }
    if (!absl::GetFlag(FLAGS_block_sizes).empty()) {
      g->block_sizes =
          ParseSizeList("--block-sizes", absl::GetFlag(FLAGS_block_sizes), 4096, 64 << 20);
      for (uint64_t bs : g->block_sizes) {
        if ((bs & (bs - 1)) != 0) BadFlag("--block-sizes", "each must be a power of two");
      }
    }
    if (!absl::GetFlag(FLAGS_queue_depths).empty()) {
      g->queue_depths = ParseIntList("--queue-depths", absl::GetFlag(FLAGS_queue_depths), 1, 1024);
    }
    if (!absl::GetFlag(FLAGS_threads).empty()) {
      g->threads = ParseIntList("--threads", absl::GetFlag(FLAGS_threads), 1, 256);
    }
    const std::string ops = absl::GetFlag(FLAGS_ops);
    if (ops == "read,write" || ops == "write,read" || ops == "both") {
      g->ops = {Op::kRead, Op::kWrite};
    } else if (ops == "read") {
      g->ops = {Op::kRead};
    } else if (ops == "write") {
      g->ops = {Op::kWrite};
    } else {
      BadFlag("--ops", absl::StrCat("\"", ops, "\": accepted: read, write, read,write"));
    }
  };
  apply_overrides(&grid);
  apply_overrides(&fine);
  const bool narrowed =
      !absl::GetFlag(FLAGS_engines).empty() || !absl::GetFlag(FLAGS_block_sizes).empty() ||
      !absl::GetFlag(FLAGS_queue_depths).empty() || !absl::GetFlag(FLAGS_threads).empty() ||
      absl::GetFlag(FLAGS_ops) != "read,write";
  MeasureOptions mo;
  mo.reps = absl::GetFlag(FLAGS_reps);
  mo.rep_seconds = absl::GetFlag(FLAGS_rep_seconds);
  mo.warmup_seconds = absl::GetFlag(FLAGS_warmup_seconds);
  if (quick && !FlagGiven("rep_seconds")) mo.rep_seconds = 0.12;
  if (quick && !FlagGiven("warmup_seconds")) mo.warmup_seconds = 0.05;
  const std::string size_text =
      absl::GetFlag(FLAGS_size).empty() ? (quick ? "512M" : "1G") : absl::GetFlag(FLAGS_size);
  uint64_t size = ParseSize("--size", size_text, 64 << 20, 1ull << 50);
  size = size / (8 << 20) * (8 << 20);  // whole requests at every block size up to 8M
  const std::string out_dir =
      absl::GetFlag(FLAGS_out).empty() ? dir + "/strata-sweep" : absl::GetFlag(FLAGS_out);

  ScratchOptions so;
  so.overwrite = absl::GetFlag(FLAGS_overwrite);
  so.allow_buffered = absl::GetFlag(FLAGS_allow_buffered);
  so.allow_memory_fs = absl::GetFlag(FLAGS_allow_memory_fs);
  // Bad places are bad input (exit 2), found before anything is laid down or measured.
  if (absl::Status s = CheckMeasuredDirectory(dir, so, nullptr); !s.ok()) {
    BadFlag("--nvme-dir", s.message());
  }
  if (absl::Status s = PrepareOutputDirectory(out_dir); !s.ok()) BadFlag("--out", s.message());
  // A point whose buffer does not fit in memory fails with the reason; a grid where none fits is
  // bad input. One buffer serves every point: the most any point that fits needs.
  Grid coarse = Grid::Quick(cores);
  apply_overrides(&coarse);
  const MemoryLimits memory = MemoryLimits::Probe();
  uint64_t buffer_bytes = 0;
  for (const Grid* g : {&grid, &fine, &coarse}) {
    if (g != &grid && budget == 0) continue;
    for (const Point& p : g->Points()) {
      if (CheckBufferFits(p.config, memory).ok()) {
        buffer_bytes = std::max(buffer_bytes, BufferBytesFor(p.config));
      }
    }
  }
  if (buffer_bytes == 0) {
    BadFlag("--block-sizes, --queue-depths, --threads",
            CheckBufferFits(grid.Points().front().config, memory).message());
  }
  std::printf("aio_bench_perf_sweep: laying down a %s test file in %s ...\n",
              SizeText(size).c_str(), dir.c_str());
  std::fflush(stdout);
  auto scratch = ScratchFile::Create(dir, "strata-sweep.dat", size, so);
  if (!scratch.ok()) {
    std::fprintf(stderr, "aio_bench_perf_sweep: %s\n",
                 std::string(scratch.status().message()).c_str());
    return 1;
  }
  std::vector<std::string> warnings;
  if (!(*scratch)->warning().empty()) {
    warnings.push_back((*scratch)->warning());
    std::fprintf(stderr, "WARNING: %s\n", (*scratch)->warning().c_str());
  }
  if (!(*scratch)->direct()) grid.direct = fine.direct = false;

  auto buffer = aio::AlignedBuffer::Allocate(buffer_bytes, {.huge_pages = true});
  if (!buffer.ok()) {
    std::fprintf(stderr, "aio_bench_perf_sweep: %s\n",
                 std::string(buffer.status().message()).c_str());
    return 1;
  }

  std::vector<Point> planned = grid.Points();
  std::optional<Planner> planner;
  coarse.direct = grid.direct;
  if (budget > 0) planner.emplace(fine, coarse, budget);
  const size_t shown_total = planner ? planner->coarse_size() : planned.size();
  const bool tty = isatty(STDOUT_FILENO);
  std::printf("%s: %zu points%s, each %.2f s warm-up + %d x %.2f s; results in %s\n",
              budget > 0 ? absl::StrCat("budget ", Clock2(budget)).c_str()
                         : (quick ? (narrowed ? "narrowed quick grid" : "quick grid")
                                  : (narrowed ? "narrowed grid" : "full grid")),
              shown_total, budget > 0 ? " first, then refinement around the best" : "",
              mo.warmup_seconds, mo.reps, mo.rep_seconds, out_dir.c_str());
  std::vector<PointResult> results;
  const auto start = Clock::now();
  size_t index = 0;
  while (true) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    std::optional<Point> next;
    if (planner) {
      next = planner->Next(results, elapsed);
    } else if (index < planned.size()) {
      next = planned[index];
    }
    if (!next) break;
    ++index;
    double per_point = 0;
    for (const auto& r : results) per_point += r.seconds;
    per_point = results.empty() ? mo.warmup_seconds + mo.reps * mo.rep_seconds + 0.05
                                : per_point / results.size();
    const double eta =
        planner ? budget - elapsed : per_point * static_cast<double>(planned.size() - index + 1);
    const std::string total =
        planner ? absl::StrCat(std::max(shown_total, index), "+") : absl::StrCat(planned.size());
    if (tty) {
      const double frac = planner ? std::min(1.0, elapsed / budget)
                                  : static_cast<double>(index - 1) / planned.size();
      const int filled = static_cast<int>(frac * 30);
      std::printf("\r\033[K[%s%s] %zu/%s %s  ETA %s", std::string(filled, '#').c_str(),
                  std::string(30 - filled, '.').c_str(), index, total.c_str(),
                  next->Describe().c_str(), Clock2(eta).c_str());
      std::fflush(stdout);
    }
    PointResult r;
    if (absl::Status s = CheckBufferFits(next->config, memory); !s.ok()) {
      r.point = *next;
      r.error = std::string(s.message());
    } else {
      r = MeasurePoint(*next, (*scratch)->path(), size, buffer->data(), mo);
    }
    if (!tty) {
      if (r.ok) {
        std::printf("[%zu/%s] %s: %.3f GB/s [%.3f, %.3f]\n", index, total.c_str(),
                    next->Describe().c_str(), r.gb_per_s.median, r.gb_per_s.min, r.gb_per_s.max);
      } else {
        std::printf("[%zu/%s] %s: FAILED: %s\n", index, total.c_str(), next->Describe().c_str(),
                    r.error.c_str());
      }
      std::fflush(stdout);
    }
    results.push_back(std::move(r));
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  if (tty) std::printf("\r\033[K");

  const Best best = PickBest(results);
  SweepOutputs outputs;
  outputs.dir = out_dir;
  outputs.warnings = warnings;
  const bench::MachineInfo machine = bench::MachineInfo::Probe(dir);
  outputs.meta = {{"machine",
                   {{"cpu", machine.cpu},
                    {"cores", machine.cores},
                    {"fs", machine.fs},
                    {"device", machine.device}}},
                  {"nvme_dir", dir},
                  {"file_bytes", size},
                  {"mode", budget > 0 ? "budget" : (quick ? "quick" : "full")},
                  {"budget_seconds", budget},
                  {"elapsed_seconds", elapsed},
                  {"reps", mo.reps},
                  {"rep_seconds", mo.rep_seconds},
                  {"warmup_seconds", mo.warmup_seconds},
                  {"date", static_cast<int64_t>(std::time(nullptr))}};
  auto written = WriteOutputs(outputs, results, best);

  // The table: the five best points of each op.
  size_t failed = 0;
  for (const auto& r : results) failed += !r.ok;
  std::printf("measured %zu points in %s (%zu failed)\n\n", results.size(), Clock2(elapsed).c_str(),
              failed);
  for (Op op : grid.ops) {
    std::vector<const PointResult*> ok;
    for (const auto& r : results) {
      if (r.ok && r.point.op == op) ok.push_back(&r);
    }
    std::sort(ok.begin(), ok.end(),
              [](auto* a, auto* b) { return a->gb_per_s.median > b->gb_per_s.median; });
    std::printf("%-5s %-44s %8s %17s %9s %9s %6s\n", OpName(op), "configuration", "GB/s",
                "[min, max]", "p50 us", "p99 us", "CPU");
    for (size_t i = 0; i < ok.size() && i < 5; ++i) {
      const PointResult& r = *ok[i];
      std::printf("      %-44s %8.3f [%6.3f, %6.3f] %9.0f %9.0f %6.2f%s\n",
                  r.point.Describe().c_str(), r.gb_per_s.median, r.gb_per_s.min, r.gb_per_s.max,
                  r.latency_p50_us, r.latency_p99_us, r.cpu_cores,
                  r.noisy                 ? "  noisy: wide spread after repeats"
                  : r.rounds_repeated > 0 ? "  (repeated: spread was wide)"
                                          : "");
    }
    std::printf("\n");
  }
  auto noisy = [](const std::optional<PointResult>& r) { return r->noisy ? " (noisy)" : ""; };
  if (best.read)
    std::printf("best read:  %s, %.3f GB/s%s\n", best.read->point.Describe().c_str(),
                best.read->gb_per_s.median, noisy(best.read));
  if (best.write)
    std::printf("best write: %s, %.3f GB/s%s\n", best.write->point.Describe().c_str(),
                best.write->gb_per_s.median, noisy(best.write));
  if (best.both_read) {
    std::printf("best both:  %s, read %.3f GB/s, write %.3f GB/s\n",
                best.both_read->point.ConfigKey().c_str(), best.both_read->gb_per_s.median,
                best.both_write->gb_per_s.median);
  }
  for (const auto& w : warnings) std::printf("WARNING: %s\n", w.c_str());
  if (!written.ok()) {
    std::fprintf(stderr, "aio_bench_perf_sweep: %s\n",
                 std::string(written.status().message()).c_str());
    return 1;
  }
  std::printf("\nfiles:\n");
  for (const auto& p : *written) std::printf("  %s\n", p.c_str());
  const std::optional<PointResult>& pick = best.both_read ? best.both_read
                                           : best.read    ? best.read
                                                          : best.write;
  if (!pick) {
    std::fprintf(stderr, "aio_bench_perf_sweep: no point succeeded\n");
    return 1;
  }
  std::printf("\nconfig block (best for both; paste into your strata or DeepSpeed config):\n%s\n",
              aio::AioConfigToJson(pick->point.config).dump(2).c_str());
  // The block is what a user copies: the warning goes with it.
  for (const auto& w : warnings) std::printf("WARNING (about the block above): %s\n", w.c_str());
  return 0;
}

}  // namespace
}  // namespace strata::aio_bench

int main(int argc, char** argv) {
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv,
      "aio_bench_perf_sweep --nvme-dir DIR [--quick | --budget SECONDS] [--out DIR]\nSweeps aio "
      "configurations on a test file in DIR (removed at exit) and writes results.csv, "
      "results.json, heatmaps and the best config block.",
      "aio_bench/aio_bench_perf_sweep.cc",
      {{"budget", 0, 7 * 86400},
       {"reps", 1, 1000},
       {"rep_seconds", 0.01, 600},
       {"warmup_seconds", 0, 600}});
  return strata::aio_bench::Main();
}
