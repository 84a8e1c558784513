// aio_vs_fio: sequential O_DIRECT read and write of one file with strata's aio engine, each
// configuration interleaved with fio on the same file, same engine, block size and queue depth.
//
// Reported per (op, engine, queue depth): our GB/s against fio at the same configuration, and
// against the disk's ceiling (the best fio reaches in the same round over a few settings:
// io_uring with 2 jobs, io_uring with fixed buffers and matched batching, libaio with matched
// batching); CPU seconds per GB moved beside fio's; and a row with an ordinary unaligned heap
// buffer against our aligned path. See shared BENCH.md.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "aio/buffer.h"
#include "aio/engine.h"
#include "bench/common/fio.h"
#include "bench/common/report.h"

ABSL_FLAG(std::string, dir, ".", "directory for the scratch file (on the disk to measure)");
ABSL_FLAG(int64_t, size_mb, 2048, "scratch file size in MiB (at least 2048 for the issue's target)");
ABSL_FLAG(int, rounds, 5, "measured rounds after one warm-up round");
ABSL_FLAG(std::string, engines, "io_uring,libaio", "strata engines to measure");
ABSL_FLAG(std::string, queue_depths, "8,32", "queue depths to measure");
ABSL_FLAG(int64_t, block_size, 1 << 20, "aio block_size in bytes");
ABSL_FLAG(std::string, json, "", "write the report here");
ABSL_FLAG(bool, keep_file, false, "keep the scratch file");

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
// Requests of kChunk bytes; enough in flight to cover the queue depth plus one, so the buffer
// footprint stays close to fio's (queue_depth x block_size): on a virtual disk the copy out of a
// cache-hot buffer is measurably faster, and both sides should get the same chance at it.
constexpr uint64_t kChunk = 4 << 20;
constexpr int kMaxSlots = 64;

std::string g_scratch;  // removed on exit and on Ctrl-C
void RemoveScratch(int) {
  if (!g_scratch.empty()) unlink(g_scratch.c_str());
  _exit(130);
}

double CpuSeconds() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
         ru.ru_stime.tv_usec / 1e6;
}

struct Pass {
  double gb_per_s = 0;
  double cpu_seconds = 0;
};

// One sequential pass over the file with `engine`: requests of kChunk bytes, enough in flight,
// each into its own slot of `buffer` (which is aligned, or an ordinary heap buffer).
absl::StatusOr<Pass> RunOurs(aio::Engine& engine, const aio::File& file, uint64_t size,
                             bool write, std::byte* buffer) {
  const aio::AioConfig& c = engine.config();
  const uint64_t in_flight_bytes =
      c.block_size * static_cast<uint64_t>(c.queue_depth) * c.intra_op_parallelism;
  const size_t slots =
      std::min<uint64_t>(kMaxSlots, (in_flight_bytes + kChunk - 1) / kChunk + 1);
  std::deque<std::future<absl::Status>> in_flight;
  const double cpu0 = CpuSeconds();
  const auto t0 = Clock::now();
  absl::Status status;
  int slot = 0;
  for (uint64_t off = 0; off < size; off += kChunk) {
    if (in_flight.size() == slots) {
      status.Update(in_flight.front().get());
      in_flight.pop_front();
    }
    const uint64_t len = std::min(kChunk, size - off);
    std::byte* p = buffer + static_cast<uint64_t>(slot) * kChunk;
    slot = (slot + 1) % static_cast<int>(slots);
    in_flight.push_back(write ? engine.WriteAsync(file, off, {p, len})
                              : engine.ReadAsync(file, off, {p, len}));
  }
  for (auto& f : in_flight) status.Update(f.get());
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!status.ok()) return status;
  return Pass{size / seconds / 1e9, CpuSeconds() - cpu0};
}

struct Samples {
  std::vector<double> ours, fio, ratio, ceiling, ceiling_ratio, cpu_ours, cpu_fio;
};

int Main() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const uint64_t size = static_cast<uint64_t>(absl::GetFlag(FLAGS_size_mb)) << 20;
  const uint64_t bs = static_cast<uint64_t>(absl::GetFlag(FLAGS_block_size));
  const int rounds = absl::GetFlag(FLAGS_rounds);
  if (size < kChunk || size % kChunk != 0) {
    std::fprintf(stderr, "--size_mb must be a positive multiple of 16\n");
    return 2;
  }
  if (rounds < 1) {
    std::fprintf(stderr, "--rounds must be >= 1\n");
    return 2;
  }
  std::vector<aio::EngineKind> engines;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_engines), ',')) {
    auto kind = aio::ParseEngineKind(name);
    if (!kind.ok()) {
      std::fprintf(stderr, "--engines: %s\n", std::string(kind.status().message()).c_str());
      return 2;
    }
    engines.push_back(*kind);
  }
  std::vector<int> depths;
  for (absl::string_view d : absl::StrSplit(absl::GetFlag(FLAGS_queue_depths), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(d, &v) || v < 1 || v > 1024) {
      std::fprintf(stderr, "--queue_depths: \"%s\" is not in [1, 1024]\n", std::string(d).c_str());
      return 2;
    }
    depths.push_back(v);
  }
  const bool have_fio = FioAvailable();
  if (!have_fio) std::fprintf(stderr, "fio not found: rows carry no ceiling\n");

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const auto space = std::filesystem::space(dir, ec);
  if (ec || space.available < size + (256ull << 20)) {
    std::fprintf(stderr, "%s: need %llu MiB free for the scratch file, have %llu MiB\n",
                 dir.c_str(), static_cast<unsigned long long>(size >> 20),
                 static_cast<unsigned long long>(ec ? 0 : space.available >> 20));
    return 1;
  }
  g_scratch = std::filesystem::absolute(dir).string() + "/strata-aio-vs-fio.dat";
  std::signal(SIGINT, RemoveScratch);
  std::signal(SIGTERM, RemoveScratch);

  // Buffers: aligned slots, and an ordinary heap buffer shifted off any alignment.
  auto aligned = aio::AlignedBuffer::Allocate(kMaxSlots * kChunk);
  if (!aligned.ok()) {
    std::fprintf(stderr, "%s\n", aligned.status().ToString().c_str());
    return 1;
  }
  std::mt19937_64 rng(1);
  for (uint64_t i = 0; i < aligned->size() / 8; ++i) {
    const uint64_t v = rng();
    std::memcpy(aligned->data() + i * 8, &v, 8);
  }
  std::vector<std::byte> heap(kMaxSlots * kChunk + 64);
  std::memcpy(heap.data() + 7, aligned->data(), kMaxSlots * kChunk);

  // Engines, one per (kind, depth), created once.
  struct Config {
    aio::EngineKind kind;
    int depth;
    std::unique_ptr<aio::Engine> engine;
    aio::File file;
  };
  std::vector<Config> configs;
  for (aio::EngineKind kind : engines) {
    for (int depth : depths) {
      aio::AioConfig c;
      c.engine = kind;
      c.queue_depth = depth;
      c.block_size = bs;
      auto engine = aio::Engine::Create(c);
      if (!engine.ok()) {
        std::fprintf(stderr, "engine: %s\n", engine.status().ToString().c_str());
        return 1;
      }
      if ((*engine)->backend_name() != aio::EngineKindName(kind)) {
        std::fprintf(stderr, "skipping %s: not available here\n",
                     std::string(aio::EngineKindName(kind)).c_str());
        continue;
      }
      configs.push_back({kind, depth, *std::move(engine), aio::File()});
    }
  }
  if (configs.empty()) {
    std::fprintf(stderr, "no engine to measure\n");
    return 1;
  }
  aio::OpenOptions open_options;
  open_options.writable = open_options.create = true;
  for (Config& c : configs) {
    auto file = c.engine->Open(g_scratch, open_options);
    if (!file.ok()) {
      std::fprintf(stderr, "%s\n", file.status().ToString().c_str());
      RemoveScratch(0);
    }
    c.file = *std::move(file);
  }
  // Lay the file down whole (random bytes, so no layer can compress it).
  if (auto s = configs[0].file.Allocate(0, size); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
  }
  std::printf("writing the %llu MiB scratch file %s ...\n",
              static_cast<unsigned long long>(size >> 20), g_scratch.c_str());
  if (auto p = RunOurs(*configs[0].engine, configs[0].file, size, true, aligned->data()); !p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    RemoveScratch(0);
  }

  // The disk's ceiling: the best of these fio settings in each round.
  std::vector<FioJob> ceiling_jobs;
  for (const auto& [engine, jobs, fixed, batch] :
       std::vector<std::tuple<const char*, int, bool, bool>>{{"io_uring", 2, false, false},
                                                             {"io_uring", 1, true, true},
                                                             {"libaio", 1, false, true}}) {
    FioJob j;
    j.file = g_scratch;
    j.engine = engine;
    j.block_size = bs;
    j.queue_depth = 32;
    j.numjobs = jobs;
    j.size_bytes = size;
    j.fixedbufs = fixed;
    j.batch = batch;
    ceiling_jobs.push_back(j);
  }

  std::map<std::string, Samples> samples;  // key: figure name
  auto fio_or_zero = [&](const FioJob& job) -> FioResult {
    if (!have_fio) return {};
    auto r = RunFio(job);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return {};
    }
    return *r;
  };

  for (int round = 0; round <= rounds; ++round) {
    const bool warmup = round == 0;
    std::printf("%s\n", warmup ? "warm-up round" : absl::StrCat("round ", round, "/", rounds).c_str());
    std::fflush(stdout);
    for (bool write : {false, true}) {
      const char* op = write ? "write" : "read";
      double ceiling = 0;
      for (FioJob job : ceiling_jobs) {
        job.write = write;
        ceiling = std::max(ceiling, fio_or_zero(job).gb_per_s);
      }
      double aligned_qd_max = 0;  // ours, aligned, io_uring at the largest depth (for the heap row)
      for (size_t i = 0; i < configs.size(); ++i) {
        Config& c = configs[i];
        FioJob job;
        job.file = g_scratch;
        job.write = write;
        job.engine = std::string(aio::EngineKindName(c.kind));
        job.block_size = bs;
        job.queue_depth = c.depth;
        job.size_bytes = size;
        // Alternate who goes first, so drift within a round does not favour one side.
        FioResult fio;
        absl::StatusOr<Pass> ours;
        if ((round + i) % 2 == 0) {
          fio = fio_or_zero(job);
          ours = RunOurs(*c.engine, c.file, size, write, aligned->data());
        } else {
          ours = RunOurs(*c.engine, c.file, size, write, aligned->data());
          fio = fio_or_zero(job);
        }
        if (!ours.ok()) {
          std::fprintf(stderr, "%s\n", ours.status().ToString().c_str());
          RemoveScratch(0);
        }
        if (c.kind == aio::EngineKind::kIoUring && c.depth == depths.back()) {
          aligned_qd_max = ours->gb_per_s;
        }
        if (warmup) continue;
        Samples& s = samples[absl::StrCat(op, "_", job.engine, "_qd", c.depth)];
        s.ours.push_back(ours->gb_per_s);
        s.fio.push_back(fio.gb_per_s);
        if (fio.gb_per_s > 0) s.ratio.push_back(ours->gb_per_s / fio.gb_per_s);
        s.ceiling.push_back(ceiling);
        if (ceiling > 0) s.ceiling_ratio.push_back(ours->gb_per_s / ceiling);
        s.cpu_ours.push_back(ours->cpu_seconds / (size / 1e9));
        if (fio.bytes > 0) s.cpu_fio.push_back(fio.cpu_seconds / (fio.bytes / 1e9));
      }
      // An ordinary unaligned heap buffer, io_uring at the largest depth, against our aligned path.
      for (Config& c : configs) {
        if (c.kind != aio::EngineKind::kIoUring || c.depth != depths.back()) continue;
        auto ours = RunOurs(*c.engine, c.file, size, write, heap.data() + 7);
        if (!ours.ok()) {
          std::fprintf(stderr, "%s\n", ours.status().ToString().c_str());
          RemoveScratch(0);
        }
        if (warmup || aligned_qd_max <= 0) continue;
        Samples& s = samples[absl::StrCat(op, "_unaligned_heap_io_uring_qd", c.depth)];
        s.ours.push_back(ours->gb_per_s);
        s.fio.push_back(aligned_qd_max);
        s.ratio.push_back(ours->gb_per_s / aligned_qd_max);
        s.ceiling.push_back(ceiling);
        if (ceiling > 0) s.ceiling_ratio.push_back(ours->gb_per_s / ceiling);
        s.cpu_ours.push_back(ours->cpu_seconds / (size / 1e9));
      }
    }
  }

  Report report("aio_vs_fio", MachineInfo::Probe(dir));
  std::printf("\n%-36s %22s %22s %9s %9s %13s\n", "configuration", "ours GB/s med [min,max]",
              "ref GB/s med", "ours/ref", "ours/disk", "CPU s/GB o|f");
  for (auto& [name, s] : samples) {
    const bool heap_row = name.find("unaligned") != std::string::npos;
    const Summary ours = Summary::Of(s.ours), ref = Summary::Of(s.fio),
                  ratio = Summary::Of(s.ratio), disk = Summary::Of(s.ceiling),
                  disk_ratio = Summary::Of(s.ceiling_ratio), cpu_o = Summary::Of(s.cpu_ours),
                  cpu_f = Summary::Of(s.cpu_fio);
    std::printf("%-36s %6.3f [%5.3f,%5.3f] %22.3f %9.3f %9.3f %6.2f|%-6.2f\n", name.c_str(),
                ours.median, ours.min, ours.max, ref.median, ratio.median, disk_ratio.median,
                cpu_o.median, cpu_f.median);
    const std::string engine = name.find("libaio") != std::string::npos ? "libaio" : "io_uring";
    const std::string depth = name.substr(name.rfind("qd") + 2);
    nlohmann::json config = {{"engine", engine}, {"block_size", bs}, {"queue_depth", std::stoi(depth)},
                             {"file_bytes", size}, {"request_bytes", kChunk},
                             {"rounds", rounds}};
    Figure same{.name = name, .unit = "GB/s", .value = ours, .ceiling = ref,
                .ceiling_source = heap_row ? "strata aligned buffer, same engine and depth"
                                           : absl::StrCat("fio ", engine, " bs=", bs >> 10,
                                                          "k qd=", depth, " (same config)"),
                .ratio = ratio, .config = config};
    if (!heap_row && !have_fio) same.note = "fio missing: no ceiling";
    report.Add(same);
    Figure disk_figure{.name = name + "_vs_disk", .unit = "GB/s", .value = ours, .ceiling = disk,
                       .ceiling_source = "best fio over {io_uring numjobs=2, io_uring fixedbufs "
                                         "batch, libaio batch} at qd=32, same round",
                       .ratio = disk_ratio, .config = config};
    if (!have_fio) disk_figure.note = "fio missing: no ceiling";
    report.Add(disk_figure);
    if (!heap_row) {
      report.Add(Figure{.name = name + "_cpu", .unit = "CPU s/GB", .value = cpu_o,
                        .ceiling = cpu_f, .ceiling_source = "fio's CPU s/GB, same config",
                        .ratio = Summary::Of({cpu_f.median > 0 ? cpu_o.median / cpu_f.median : 0}),
                        .lower_is_better = true, .config = config});
    }
  }
  std::printf("\n");
  report.PrintClosingLines();
  int rc = 0;
  if (!absl::GetFlag(FLAGS_json).empty() && !report.WriteJson(absl::GetFlag(FLAGS_json))) rc = 1;
  for (Config& c : configs) c.file.Close();
  if (!absl::GetFlag(FLAGS_keep_file)) unlink(g_scratch.c_str());
  return rc;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "aio_vs_fio --dir DIR [--size_mb N] [--rounds N] [--json PATH]: strata's aio engine "
      "against fio on the same file");
  absl::ParseCommandLine(argc, argv);
  return strata::bench::Main();
}
