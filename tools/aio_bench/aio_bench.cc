// aio_bench: measures one aio configuration on a test file in --dir and prints GB/s, IOPS,
// latency percentiles and CPU use (median of repeated runs after a warm-up, with min and max).
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "aio/buffer.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/measure.h"
#include "tools/aio_bench/scratch.h"

ABSL_FLAG(std::string, dir, "", "directory for the test file, on the drive to measure (required)");
ABSL_FLAG(std::string, size, "1G", "test file size (K, M, G suffixes)");
ABSL_FLAG(std::string, engine, "io_uring", "io_uring, libaio or posix");
ABSL_FLAG(std::string, block_size, "1M", "aio block_size: power of two, 4K..64M");
ABSL_FLAG(int, queue_depth, 8, "aio queue_depth");
ABSL_FLAG(int, threads, 1, "aio intra_op_parallelism");
ABSL_FLAG(bool, single_submit, false, "aio single_submit");
ABSL_FLAG(bool, overlap_events, true, "aio overlap_events");
ABSL_FLAG(bool, registered_buffers, false, "io_uring registered buffers");
ABSL_FLAG(bool, registered_files, false, "io_uring registered files");
ABSL_FLAG(bool, sqpoll, false, "io_uring SQPOLL");
ABSL_FLAG(std::string, op, "read", "read or write");
ABSL_FLAG(bool, direct, true, "O_DIRECT");
ABSL_FLAG(int, reps, 5, "measured runs (more when they spread widely)");
ABSL_FLAG(double, rep_seconds, 1.0, "seconds per run");
ABSL_FLAG(double, warmup_seconds, 0.5, "warm-up seconds");
ABSL_FLAG(bool, overwrite, false, "write over an existing test file");
ABSL_FLAG(bool, allow_buffered, false,
          "run on a filesystem that refuses O_DIRECT (figures then "
          "include the page cache)");
ABSL_FLAG(bool, allow_memory_fs, false,
          "measure a memory-backed filesystem (tmpfs, ramfs): the figures are then RAM's");
ABSL_FLAG(std::string, json, "", "also write the result as JSON here");

namespace strata::aio_bench {
namespace {

int Main() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) BadFlag("--dir", "is required: a directory on the drive to measure");
  Point point;
  aio::AioConfig& c = point.config;
  auto engine = aio::ParseEngineKind(absl::GetFlag(FLAGS_engine));
  if (!engine.ok()) BadFlag("--engine", engine.status().message());
  c.engine = *engine;
  c.block_size = ParseSize("--block-size", absl::GetFlag(FLAGS_block_size), 4096, 64 << 20);
  c.queue_depth = absl::GetFlag(FLAGS_queue_depth);
  c.intra_op_parallelism = absl::GetFlag(FLAGS_threads);
  c.single_submit = absl::GetFlag(FLAGS_single_submit);
  c.overlap_events = absl::GetFlag(FLAGS_overlap_events);
  c.registered_buffers = absl::GetFlag(FLAGS_registered_buffers);
  c.registered_files = absl::GetFlag(FLAGS_registered_files);
  c.sqpoll = absl::GetFlag(FLAGS_sqpoll);
  c.direct = absl::GetFlag(FLAGS_direct);
  if (auto s = aio::Validate(c); !s.ok()) {
    // The message names the config key; name the flag too.
    BadFlag("flags", s.message());
  }
  const std::string op = absl::GetFlag(FLAGS_op);
  if (op != "read" && op != "write") BadFlag("--op", "accepted: read, write");
  point.op = op == "read" ? Op::kRead : Op::kWrite;
  const uint64_t size = ParseSize("--size", absl::GetFlag(FLAGS_size), 4 << 20, 1ull << 50);
  MeasureOptions mo;
  mo.reps = absl::GetFlag(FLAGS_reps);
  mo.rep_seconds = absl::GetFlag(FLAGS_rep_seconds);
  mo.warmup_seconds = absl::GetFlag(FLAGS_warmup_seconds);
  if (size < RequestBytesFor(c)) {
    BadFlag("--size", "must hold at least one request (4 MiB, or the block size if larger)");
  }

  // The buffer a point keeps in flight must fit in the memory this machine has free.
  if (absl::Status s = CheckBufferFits(c, MemoryLimits::Probe()); !s.ok()) {
    BadFlag("--block-size, --queue-depth, --threads", s.message());
  }
  const uint64_t buffer_bytes = BufferBytesFor(c);
  if (absl::Status s = PrepareOutputFile(absl::GetFlag(FLAGS_json)); !s.ok()) {
    BadFlag("--json", s.message());
  }
  ScratchOptions so;
  so.overwrite = absl::GetFlag(FLAGS_overwrite);
  so.allow_buffered = absl::GetFlag(FLAGS_allow_buffered) || !c.direct;
  so.allow_memory_fs = absl::GetFlag(FLAGS_allow_memory_fs);
  if (absl::Status s = CheckMeasuredDirectory(dir, so, nullptr); !s.ok()) {
    BadFlag("--dir", s.message());
  }
  std::printf("laying down the %s test file in %s ...\n", SizeText(size).c_str(), dir.c_str());
  std::fflush(stdout);
  auto scratch = ScratchFile::Create(dir, "strata-aio-bench.dat", size, so);
  if (!scratch.ok()) {
    std::fprintf(stderr, "aio_bench: %s\n", std::string(scratch.status().message()).c_str());
    return 1;
  }
  if (!(*scratch)->warning().empty()) {
    std::fprintf(stderr, "WARNING: %s\n", (*scratch)->warning().c_str());
  }
  if (!(*scratch)->direct()) c.direct = false;
  auto buffer = aio::AlignedBuffer::Allocate(buffer_bytes, {.huge_pages = true});
  if (!buffer.ok()) {
    std::fprintf(stderr, "aio_bench: %s\n", std::string(buffer.status().message()).c_str());
    return 1;
  }
  PointResult r = MeasurePoint(point, (*scratch)->path(), size, buffer->data(), mo);
  if (!r.ok) {
    std::fprintf(stderr, "aio_bench: %s: %s\n", point.Describe().c_str(), r.error.c_str());
    return 1;
  }
  std::printf("%s on %s (%s, %s)\n", point.Describe().c_str(), (*scratch)->path().c_str(),
              SizeText(size).c_str(), c.direct ? "O_DIRECT" : "BUFFERED");
  std::printf(
      "GB/s     %.3f median [min %.3f, max %.3f] over %d runs of %.2f s after %.2f s "
      "warm-up\n",
      r.gb_per_s.median, r.gb_per_s.min, r.gb_per_s.max, mo.reps * (1 + r.rounds_repeated),
      mo.rep_seconds, mo.warmup_seconds);
  if (r.noisy) {
    std::printf(
        "NOISY    the runs still spread widely after %d more rounds of %d: the median is "
        "not a steady figure (a stalling drive, or another process)\n",
        r.rounds_repeated, mo.reps);
  } else if (r.rounds_repeated > 0) {
    std::printf("repeated %d more rounds of %d runs: the first spread widely\n", r.rounds_repeated,
                mo.reps);
  }
  std::printf("IOPS     %.0f (%s operations)\n", r.iops, SizeText(c.block_size).c_str());
  std::printf("latency  p50 %.0f us, p99 %.0f us, max %.0f us (per block, submit to complete)\n",
              r.latency_p50_us, r.latency_p99_us, r.latency_max_us);
  std::printf("CPU      %.2f cores (%.3f CPU s per GB)\n", r.cpu_cores,
              r.gb_per_s.median > 0 ? r.cpu_cores / r.gb_per_s.median : 0);
  for (const auto& w : r.engine_warnings) std::printf("engine: %s\n", w.c_str());
  if (!(*scratch)->warning().empty()) std::printf("WARNING: %s\n", (*scratch)->warning().c_str());
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    nlohmann::json j = r.ToJson();
    if (!(*scratch)->warning().empty()) j["warning"] = (*scratch)->warning();
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fputs((j.dump(2) + "\n").c_str(), f) < 0) {
      std::fprintf(stderr, "aio_bench: cannot write %s\n", path.c_str());
      return 1;
    }
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace strata::aio_bench

int main(int argc, char** argv) {
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv,
      "aio_bench --dir DIR [--engine io_uring] [--block-size 1M] [--queue-depth 8] [--threads 1] "
      "[--op read|write] ...\nMeasures one aio configuration on a test file in DIR (removed at "
      "exit).",
      "aio_bench/aio_bench.cc",
      {{"queue_depth", 1, 1024},
       {"threads", 1, 256},
       {"reps", 1, 1000},
       {"rep_seconds", 0.01, 600},
       {"warmup_seconds", 0, 600}});
  return strata::aio_bench::Main();
}
