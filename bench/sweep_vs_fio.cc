// sweep_vs_fio: the quick sweep of aio_bench_perf_sweep with fio run over the same grid, on the
// same file, point by point (the order alternated), for several rounds. Figures:
//  - at the sweep's best read and best write configurations: the sweep's GB/s over fio's at that
//    configuration (is what the sweep measured real, and as fast as fio gets there?);
//  - the sweep's best over the best fio finds anywhere on the grid (did the sweep find the top?).
// fio uses hugetlb buffers when huge pages can be had (--reserve_hugetlb), as the sweep's buffers
// are huge-page backed; without them the note says so. See shared BENCH.md.
#include <algorithm>
#include <cstdio>
#include <map>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "aio/buffer.h"
#include "bench/common/fio.h"
#include "bench/common/report.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/measure.h"
#include "tools/aio_bench/scratch.h"
#include "tools/aio_bench/sweep.h"

ABSL_FLAG(std::string, dir, ".", "directory for the test file (on the drive to measure)");
ABSL_FLAG(int, rounds, 3, "rounds of the whole interleaved grid");
ABSL_FLAG(std::string, size, "512M", "test file size");
ABSL_FLAG(bool, reserve_hugetlb, false,
          "raise vm.nr_hugepages for the run (root) so fio can use huge-page buffers like the "
          "sweep's, then put it back");
ABSL_FLAG(std::string, json, "", "write the report here");

namespace strata::bench {
namespace {

using aio_bench::Op;
using aio_bench::Point;
using aio_bench::PointResult;

int Main() {
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const uint64_t size =
      aio_bench::ParseSize("--size", absl::GetFlag(FLAGS_size), 64 << 20, 1ull << 50) / (8 << 20) *
      (8 << 20);
  const std::string dir = absl::GetFlag(FLAGS_dir);
  if (!FioAvailable()) {
    std::fprintf(stderr, "sweep_vs_fio: fio not found; it is this benchmark's ceiling\n");
    return 1;
  }
  auto scratch = aio_bench::ScratchFile::Create(dir, "strata-sweep-vs-fio.dat", size, {});
  if (!scratch.ok()) {
    std::fprintf(stderr, "sweep_vs_fio: %s\n", std::string(scratch.status().message()).c_str());
    return 1;
  }
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const aio_bench::Grid grid = aio_bench::Grid::Quick(cores);
  const std::vector<Point> points = grid.Points();
  uint64_t need = 0;
  for (const Point& p : points) need = std::max(need, aio_bench::BufferBytesFor(p.config));
  auto buffer = aio::AlignedBuffer::Allocate(need, {.huge_pages = true});
  if (!buffer.ok()) return 1;
  // After our buffer is mapped, so it does not take fio's huge pages.
  HugetlbReservation hugetlb;
  std::string why;
  uint64_t fio_need = 0;
  for (const Point& p : points) {
    fio_need = std::max(fio_need, p.config.block_size * p.config.queue_depth *
                                      static_cast<uint64_t>(p.config.intra_op_parallelism));
  }
  fio_need += 16ull << 20;
  const bool fio_huge = absl::GetFlag(FLAGS_reserve_hugetlb)
                            ? hugetlb.Reserve(fio_need, &why)
                            : HugetlbReservation::FreeBytes() >= fio_need;
  if (!fio_huge && why.empty()) why = "no free hugetlb pages (pass --reserve-hugetlb as root)";
  if (!fio_huge) std::fprintf(stderr, "fio without huge pages: %s\n", why.c_str());

  aio_bench::MeasureOptions mo;  // the sweep's --quick settings
  mo.reps = 3;
  mo.rep_seconds = 0.12;
  mo.warmup_seconds = 0.05;
  // Per round: ours and fio's GB/s per point.
  std::vector<std::map<std::string, double>> ours(rounds), fio(rounds);
  for (int round = 0; round < rounds; ++round) {
    std::printf("round %d/%d (%zu points, each by the sweep and by fio)\n", round + 1, rounds,
                points.size());
    std::fflush(stdout);
    for (size_t i = 0; i < points.size(); ++i) {
      const Point& p = points[i];
      FioJob job;
      job.file = (*scratch)->path();
      job.write = p.op == Op::kWrite;
      job.engine = std::string(aio::EngineKindName(p.config.engine));
      job.block_size = p.config.block_size;
      job.queue_depth = p.config.queue_depth;
      job.numjobs = p.config.intra_op_parallelism;
      job.size_bytes = size;
      job.hugetlb = fio_huge;
      job.runtime_seconds = mo.reps * mo.rep_seconds;
      job.ramp_seconds = mo.warmup_seconds;
      auto run_ours = [&] {
        PointResult r = aio_bench::MeasurePoint(p, (*scratch)->path(), size, buffer->data(), mo);
        ours[round][p.Describe()] = r.ok ? r.gb_per_s.median : 0;
        if (!r.ok) std::fprintf(stderr, "%s: %s\n", p.Describe().c_str(), r.error.c_str());
      };
      auto run_fio = [&] {
        auto r = RunFio(job);
        fio[round][p.Describe()] = r.ok() ? r->gb_per_s : 0;
        if (!r.ok()) std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
      };
      if ((round + i) % 2 == 0) {
        run_ours();
        run_fio();
      } else {
        run_fio();
        run_ours();
      }
    }
  }

  // The sweep's best per op: the point with the highest median over rounds.
  Report report("sweep_vs_fio", MachineInfo::Probe(dir));
  const std::string fio_desc = fio_huge ? "fio, same configuration, hugetlb buffers"
                                        : "fio, same configuration, 4 KiB-page buffers";
  for (Op op : {Op::kRead, Op::kWrite}) {
    std::string best;
    double best_median = -1;
    for (const Point& p : points) {
      if (p.op != op) continue;
      std::vector<double> v;
      for (int r = 0; r < rounds; ++r) v.push_back(ours[r][p.Describe()]);
      const double m = Summary::Of(v).median;
      if (m > best_median) {
        best_median = m;
        best = p.Describe();
      }
    }
    std::vector<double> o, f, ratio;
    for (int r = 0; r < rounds; ++r) {
      o.push_back(ours[r][best]);
      f.push_back(fio[r][best]);
      if (fio[r][best] > 0) ratio.push_back(ours[r][best] / fio[r][best]);
    }
    // fio's best on the grid, found the way the sweep finds its own: the point with the highest
    // median over the rounds (a per-round maximum over dozens of noisy points would favour fio).
    std::string fio_best_point;
    double fio_best_median = 0;
    for (const Point& p : points) {
      if (p.op != op) continue;
      std::vector<double> v;
      for (int r = 0; r < rounds; ++r) v.push_back(fio[r][p.Describe()]);
      if (Summary::Of(v).median > fio_best_median) {
        fio_best_median = Summary::Of(v).median;
        fio_best_point = p.Describe();
      }
    }
    const char* name = op == Op::kRead ? "read" : "write";
    nlohmann::json config = {{"best", best},
                             {"rounds", rounds},
                             {"grid", "quick"},
                             {"file_bytes", size},
                             {"fio_hugetlb", fio_huge}};
    Figure at_best{.name = absl::StrCat("best_", name, "_vs_fio_same_config"),
                   .unit = "GB/s",
                   .value = Summary::Of(o),
                   .ceiling = Summary::Of(f),
                   .ceiling_source = fio_desc + " (" + best + ")",
                   .ratio = Summary::Of(ratio),
                   .config = config};
    if (!fio_huge) at_best.note = why;
    report.Add(at_best);
    config["fio_best"] = fio_best_point;
    report.Add(
        Figure{.name = absl::StrCat("best_", name, "_vs_fio_best_on_grid"),
               .unit = "GB/s",
               .value = Summary::Of({best_median}),
               .ceiling = Summary::Of({fio_best_median}),
               .ceiling_source = "fio's best point on the quick grid (highest median over "
                                 "the rounds: " +
                                 fio_best_point + ")",
               .ratio = Summary::Of({fio_best_median > 0 ? best_median / fio_best_median : 0}),
               .config = config});
    std::printf("%-5s best %-40s sweep %.3f GB/s, fio there %.3f; fio's best %s %.3f\n", name,
                best.c_str(), best_median, Summary::Of(f).median, fio_best_point.c_str(),
                fio_best_median);
  }
  // Every point side by side (medians over the rounds), largest gaps first.
  struct Side {
    std::string point;
    double ours, fio;
  };
  std::vector<Side> sides;
  for (const Point& p : points) {
    std::vector<double> o, f;
    for (int r = 0; r < rounds; ++r) {
      o.push_back(ours[r][p.Describe()]);
      f.push_back(fio[r][p.Describe()]);
    }
    sides.push_back({p.Describe(), Summary::Of(o).median, Summary::Of(f).median});
  }
  std::sort(sides.begin(), sides.end(), [](const Side& a, const Side& b) {
    return a.ours / std::max(a.fio, 1e-9) < b.ours / std::max(b.fio, 1e-9);
  });
  std::printf("\nthe ten points where the sweep is furthest below fio (medians over rounds):\n");
  for (size_t i = 0; i < sides.size() && i < 10; ++i) {
    std::printf("  %-40s sweep %6.3f  fio %6.3f  = %.3f\n", sides[i].point.c_str(), sides[i].ours,
                sides[i].fio, sides[i].fio > 0 ? sides[i].ours / sides[i].fio : 0);
  }
  std::printf("\n");
  report.PrintClosingLines();
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    nlohmann::json j = report.ToJson();
    for (const Side& side : sides) {
      j["points"].push_back(
          {{"point", side.point}, {"sweep_gb_per_s", side.ours}, {"fio_gb_per_s", side.fio}});
    }
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fputs((j.dump(2) + "\n").c_str(), f) < 0) return 1;
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  // Flags as the aio tools take them: --a-flag or --a_flag, bad values exit 2.
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv, "sweep_vs_fio --dir DIR [--rounds 3] [--reserve-hugetlb] [--json PATH]",
      "bench/sweep_vs_fio.cc", {{"rounds", 1, 1000}});
  if (auto s = strata::aio_bench::PrepareOutputFile(absl::GetFlag(FLAGS_json)); !s.ok()) {
    strata::aio_bench::BadFlag("--json", s.message());  // found before measuring
  }
  return strata::bench::Main();
}
