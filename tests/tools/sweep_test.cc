// Unit tests of the sweep's parts that need no disk: flags, the grid, the budget planner, the
// choice of the best configuration, and the outputs.
#include "tools/aio_bench/sweep.h"

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "aio/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"
#include "tools/aio_bench/flags.h"

namespace strata::aio_bench {
namespace {

using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;

TEST(FlagsTest, SizesTakeSuffixes) {
  EXPECT_EQ(ParseSize("--x", "128K", 1, 1ull << 40), 128u << 10);
  EXPECT_EQ(ParseSize("--x", "1M", 1, 1ull << 40), 1u << 20);
  EXPECT_EQ(ParseSize("--x", "8m", 1, 1ull << 40), 8u << 20);
  EXPECT_EQ(ParseSize("--x", "2GiB", 1, 1ull << 40), 2ull << 30);
  EXPECT_EQ(ParseSize("--x", "3000", 1, 1ull << 40), 3000u);
  EXPECT_EQ(ParseSizeList("--x", "128K, 1M,8M", 1, 1ull << 40),
            (std::vector<uint64_t>{128 << 10, 1 << 20, 8 << 20}));
  EXPECT_EQ(SizeText(1 << 20), "1M");
  EXPECT_EQ(SizeText(128 << 10), "128K");
  EXPECT_EQ(SizeText(3000), "3000");
}

TEST(FlagsDeathTest, BadValuesExitWithCode2NamingTheFlag) {
  EXPECT_EXIT(ParseSize("--block-sizes", "3X", 4096, 1 << 26), ::testing::ExitedWithCode(2),
              "--block-sizes: \"3X\" is not a size in \\[4K, 64M\\]");
  EXPECT_EXIT(ParseIntList("--queue-depths", "4,0", 1, 1024), ::testing::ExitedWithCode(2),
              "--queue-depths: \"0\" is not an integer in \\[1, 1024\\]");
  EXPECT_EXIT(ParseEngineList("--engines", "spdk"), ::testing::ExitedWithCode(2),
              "--engines: .*accepted: io_uring, libaio, posix");
}

TEST(GridTest, QuickAndFullHaveTheDocumentedShape) {
  const Grid quick = Grid::Quick(2);
  EXPECT_EQ(quick.Points().size(), 2u * 3 * 3 * 2 * 2);
  const Grid full = Grid::Full(2);
  // io_uring with 3 option sets, libaio plain; 7 block sizes, 7 depths, 2 thread counts, 2 ops.
  EXPECT_EQ(full.Points().size(), (3u + 1) * 7 * 7 * 2 * 2);
  EXPECT_EQ(full.block_sizes.front(), 128u << 10);
  EXPECT_EQ(full.block_sizes.back(), 8u << 20);
  EXPECT_EQ(full.queue_depths.front(), 1);
  EXPECT_EQ(full.queue_depths.back(), 64);
  for (const Point& p : full.Points()) ASSERT_TRUE(aio::Validate(p.config).ok()) << p.Describe();
}

// A synthetic drive: bandwidth peaks at bs=2M, qd=16, 2 threads, io_uring, read; 2 s per point.
PointResult Synthetic(const Point& p) {
  PointResult r;
  r.point = p;
  r.ok = true;
  const double b = std::log2(static_cast<double>(p.config.block_size) / (2 << 20));
  const double q = std::log2(p.config.queue_depth / 16.0);
  const double t = p.config.intra_op_parallelism - 2;
  const double engine = p.config.engine == aio::EngineKind::kIoUring ? 1.0 : 0.9;
  const double gb =
      engine * (p.op == Op::kRead ? 4 : 7) / (1 + 0.2 * b * b + 0.1 * q * q + 0.3 * t * t);
  r.gb_per_s = bench::Summary::Of({gb});
  r.seconds = 2;
  return r;
}

TEST(PlannerTest, StaysWithinBudgetNeverRepeatsAndFindsThePeakByRefining) {
  const Grid fine = Grid::Full(4);
  Planner planner(fine, Grid::Quick(4), /*budget_seconds=*/400);
  std::vector<PointResult> done;
  std::set<std::string> seen;
  double elapsed = 0;
  while (auto p = planner.Next(done, elapsed)) {
    ASSERT_TRUE(seen.insert(p->Describe()).second) << "repeated " << p->Describe();
    done.push_back(Synthetic(*p));
    elapsed += 2;
  }
  EXPECT_LE(elapsed, 400);
  EXPECT_GT(done.size(), Grid::Quick(4).Points().size());  // it refined
  const Best best = PickBest(done);
  ASSERT_TRUE(best.read.has_value());
  EXPECT_EQ(best.read->point.config.block_size, 2u << 20);  // not in the coarse grid
  EXPECT_EQ(best.read->point.config.queue_depth, 16);
  EXPECT_EQ(best.read->point.config.intra_op_parallelism, 2);
}

TEST(PlannerTest, CoarseGridStartsAtItsCentreSoASmallBudgetStillSpreads) {
  Planner planner(Grid::Full(2), Grid::Quick(2), /*budget_seconds=*/60);
  auto first = planner.Next({}, 0);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->config.block_size, 1u << 20);
  EXPECT_EQ(first->config.queue_depth, 16);
  EXPECT_EQ(first->config.intra_op_parallelism, 1);
}

TEST(PlannerTest, TinyBudgetMeasuresNothingItCannotFinish) {
  Planner planner(Grid::Full(2), Grid::Quick(2), /*budget_seconds=*/0.5);
  EXPECT_FALSE(planner.Next({}, 0).has_value());  // a point is estimated at 1 s before any ran
}

PointResult Result(aio::EngineKind e, uint64_t bs, int qd, Op op, double gb, bool ok = true) {
  PointResult r;
  r.point.config.engine = e;
  r.point.config.block_size = bs;
  r.point.config.queue_depth = qd;
  r.point.op = op;
  r.ok = ok;
  if (ok) {
    r.gb_per_s = bench::Summary::Of({gb, gb * 0.9, gb * 1.1});
  } else {
    r.error = "io_setup: Resource temporarily unavailable";
  }
  return r;
}

TEST(PickBestTest, BothIsTheHighestHarmonicMeanOfOneConfiguration) {
  using aio::EngineKind;
  std::vector<PointResult> results = {
      Result(EngineKind::kIoUring, 1 << 20, 8, Op::kRead, 4.0),
      Result(EngineKind::kIoUring, 1 << 20, 8, Op::kWrite, 2.0),  // hm 2.67
      Result(EngineKind::kIoUring, 4 << 20, 32, Op::kRead, 3.0),
      Result(EngineKind::kIoUring, 4 << 20, 32, Op::kWrite, 3.5),  // hm 3.23: best both
      Result(EngineKind::kLibAio, 1 << 20, 8, Op::kWrite, 5.0),    // best write, no read pair
      Result(EngineKind::kLibAio, 1 << 20, 64, Op::kRead, 9.0, false)};
  const Best best = PickBest(results);
  EXPECT_DOUBLE_EQ(best.read->gb_per_s.median, 4.0);
  EXPECT_EQ(best.write->point.config.engine, EngineKind::kLibAio);
  EXPECT_EQ(best.both_read->point.config.block_size, 4u << 20);
  EXPECT_EQ(best.both_write->point.op, Op::kWrite);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(OutputsTest, EveryPointIsWrittenAndTheBlockIsOneStrataAndDeepSpeedRead) {
  using aio::EngineKind;
  ScratchDir dir;
  std::vector<PointResult> results = {
      Result(EngineKind::kIoUring, 1 << 20, 8, Op::kRead, 4.0),
      Result(EngineKind::kIoUring, 1 << 20, 8, Op::kWrite, 2.0),
      Result(EngineKind::kLibAio, 1 << 20, 64, Op::kRead, 0, false)};
  results[0].point.config.intra_op_parallelism = 2;
  results[1].point.config.intra_op_parallelism = 2;
  results[1].rounds_repeated = 2;  // measured again and still wide
  results[1].noisy = true;
  SweepOutputs out;
  out.dir = dir.File("out");
  auto written = WriteOutputs(out, results, PickBest(results));
  ASSERT_TRUE(written.ok()) << written.status();
  for (const char* name :
       {"results.csv", "results.json", "heatmap_io_uring_read.svg", "heatmap_io_uring_write.svg",
        "heatmap_libaio_read.svg", "best_read.json", "best_write.json", "best.json"}) {
    EXPECT_TRUE(std::filesystem::exists(out.dir + "/" + name)) << name;
  }
  const std::string csv = Slurp(out.dir + "/results.csv");
  EXPECT_THAT(csv, HasSubstr("libaio,read,1048576,64,1,false,true,false,false,false,true,failed"));
  EXPECT_THAT(csv, HasSubstr("io_setup: Resource temporarily unavailable"));
  EXPECT_THAT(csv, HasSubstr(",direct,status,rounds_repeated,noisy,gb_per_s_median,"));
  EXPECT_THAT(csv,
              HasSubstr("io_uring,write,1048576,8,2,false,true,false,false,false,true,ok,2,true,"));
  EXPECT_THAT(csv,
              HasSubstr("io_uring,read,1048576,8,2,false,true,false,false,false,true,ok,0,false,"));
  const auto json = nlohmann::json::parse(Slurp(out.dir + "/results.json"));
  ASSERT_EQ(json["points"].size(), 3u);
  EXPECT_EQ(json["points"][2]["status"], "failed");
  EXPECT_FALSE(json["points"][2].contains("gb_per_s"));  // nothing reported that was not measured

  const std::string block = Slurp(out.dir + "/best_read.json");
  const auto b = nlohmann::json::parse(block);
  EXPECT_EQ(b["aio"]["intra_op_parallelism"], 2);
  EXPECT_FALSE(b["aio"].contains("thread_count"));
  EXPECT_TRUE(b["aio"]["single_submit"].is_boolean());
  EXPECT_TRUE(b["aio"]["overlap_events"].is_boolean());
  auto parsed = aio::AioConfigFromJsonText(block);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->intra_op_parallelism, 2);
  EXPECT_THAT(Slurp(out.dir + "/heatmap_libaio_read.svg"), HasSubstr("failed"));
  EXPECT_THAT(Slurp(out.dir + "/heatmap_io_uring_read.svg"), HasSubstr("4.00"));
}

TEST(OutputsTest, AWarningIsCarriedIntoEveryOutput) {
  ScratchDir dir;
  std::vector<PointResult> results = {Result(aio::EngineKind::kIoUring, 1 << 20, 8, Op::kRead, 4)};
  SweepOutputs out;
  out.dir = dir.File("out");
  out.warnings = {"BUFFERED: /x refuses O_DIRECT"};
  auto written = WriteOutputs(out, results, PickBest(results));
  ASSERT_TRUE(written.ok()) << written.status();
  for (const std::string& path : *written) {
    EXPECT_THAT(Slurp(path), HasSubstr("BUFFERED: /x refuses O_DIRECT")) << path;
  }
}

}  // namespace
}  // namespace strata::aio_bench
