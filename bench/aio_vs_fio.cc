// aio_vs_fio: sequential O_DIRECT read and write of one file with strata's aio engine, each
// configuration interleaved with fio on the same file, same engine, block size and queue depth.
//
// Rows, for read and for write:
//  - <engine>_qd<N>: our GB/s from an aligned buffer of 4 KiB pages against fio at the same
//    engine, block size and depth (fio's buffers are 4 KiB pages too): is our engine as lean as
//    fio? CPU seconds per GB beside fio's.
//  - <engine>_qd<top>_hugepages: the same from a buffer of 2 MiB pages, against fio with hugetlb
//    buffers (--mem=mmaphuge) when huge pages can be had (--reserve_hugetlb). On this project's
//    virtio disk a 1 MiB transfer from 4 KiB pages is split in two (max_segments 254) and pins
//    256 pages; from huge pages it is one segment: ~2.5x the read bandwidth for both programs.
//  - unaligned_heap_io_uring_qd<top>: an ordinary, misaligned heap buffer (served through the
//    engine's huge-page staging buffers) against our aligned huge-page path.
// Every row is also given against the disk's ceiling: the best fio reaches in the same round
// over all of this table's fio runs plus io_uring with 2 jobs and io_uring with fixed buffers and
// matched batching. See shared BENCH.md.
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
#include <optional>
#include <random>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "aio/buffer.h"
#include "aio/engine.h"
#include "bench/common/fio.h"
#include "bench/common/report.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/scratch.h"

ABSL_FLAG(std::string, dir, ".", "directory for the scratch file (on the disk to measure)");
ABSL_FLAG(int64_t, size_mb, 2048,
          "scratch file size in MiB (at least 2048 for the issue's target)");
ABSL_FLAG(int, rounds, 5, "measured rounds after one warm-up round");
ABSL_FLAG(std::string, engines, "io_uring,libaio", "strata engines to measure");
ABSL_FLAG(std::string, queue_depths, "8,32", "queue depths to measure");
ABSL_FLAG(int64_t, block_size, 1 << 20, "aio block_size in bytes (a power of two)");
ABSL_FLAG(std::string, json, "", "write the report here");
ABSL_FLAG(bool, keep_file, false, "keep the scratch file");
ABSL_FLAG(bool, reserve_hugetlb, false,
          "raise vm.nr_hugepages for the run (root) so fio can use huge-page buffers too, then "
          "put it back");

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
// Requests of kChunk bytes; enough in flight to cover the queue depth plus one, so the buffer
// footprint stays close to fio's (queue_depth x block_size): on a virtual disk the copy out of a
// cache-hot buffer is measurably faster, and both sides should get the same chance at it.
constexpr uint64_t kChunk = 4 << 20;
constexpr int kMaxSlots = 64;

std::string g_scratch;  // removed on exit, on error and on Ctrl-C

void Cleanup() {
  if (!g_scratch.empty()) unlink(g_scratch.c_str());
  HugetlbReservation::RestoreFromSignal();
}
void OnSignal(int) {
  Cleanup();
  _exit(130);
}
[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "aio_vs_fio: %s\n", message.c_str());
  Cleanup();
  _exit(1);
}

struct Pass {
  double gb_per_s = 0;
  double cpu_seconds = 0;
};

// One sequential pass over the file with `engine`: requests of kChunk bytes, enough in flight,
// each into its own slot of `buffer` (which is aligned, or an ordinary heap buffer).
size_t SlotsFor(const aio::Engine& engine) {
  const aio::AioConfig& c = engine.config();
  const uint64_t in_flight_bytes =
      c.block_size * static_cast<uint64_t>(c.queue_depth) * c.intra_op_parallelism;
  return std::min<uint64_t>(kMaxSlots, (in_flight_bytes + kChunk - 1) / kChunk + 1);
}

absl::StatusOr<Pass> RunOurs(aio::Engine& engine, const aio::File& file, uint64_t size, bool write,
                             std::byte* buffer) {
  const size_t slots = SlotsFor(engine);
  std::deque<std::future<absl::Status>> in_flight;
  const double cpu0 = ProcessCpuSeconds();
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
  return Pass{size / seconds / 1e9, ProcessCpuSeconds() - cpu0};
}

// Which buffer a row moves data through.
enum class BufferKind { kPages4k, kHugePages, kUnalignedHeap };

struct Row {
  std::string name;
  size_t config = 0;  // index into the engines
  BufferKind buffer = BufferKind::kPages4k;
  std::optional<FioJob> fio;  // fio at the same configuration (and the same kind of buffer)
  std::string reference;      // for rows without fio: the name of the row they are compared to
};

struct Values {
  std::vector<double> ours, ref, ratio, disk, disk_ratio, cpu_ours, cpu_fio;
};

int Main() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const uint64_t size = static_cast<uint64_t>(absl::GetFlag(FLAGS_size_mb)) << 20;
  const uint64_t bs = static_cast<uint64_t>(absl::GetFlag(FLAGS_block_size));
  const int rounds = absl::GetFlag(FLAGS_rounds);
  if (size % kChunk != 0) aio_bench::BadFlag("--size-mb", "must be a multiple of 4");
  if ((bs & (bs - 1)) != 0) aio_bench::BadFlag("--block-size", "must be a power of two");
  const std::vector<aio::EngineKind> engines =
      aio_bench::ParseEngineList("--engines", absl::GetFlag(FLAGS_engines));
  const std::vector<int> depths =
      aio_bench::ParseIntList("--queue-depths", absl::GetFlag(FLAGS_queue_depths), 1, 1024);
  const int top_depth = *std::max_element(depths.begin(), depths.end());
  const bool have_fio = FioAvailable();
  if (!have_fio) std::fprintf(stderr, "fio not found: rows carry no fio ceiling\n");

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
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  // Buffers are mapped afresh for every pass, as fio maps its own for every run: which physical
  // pages a 4 KiB-page buffer gets decides how many of them the block layer can merge into one
  // segment, and a buffer kept for the whole run would keep one draw of that lottery.
  std::vector<std::byte> pattern(kMaxSlots * kChunk);
  std::mt19937_64 rng(1);
  for (uint64_t i = 0; i < pattern.size() / 8; ++i) {
    const uint64_t v = rng();
    std::memcpy(pattern.data() + i * 8, &v, 8);
  }
  std::vector<std::byte> heap(kMaxSlots * kChunk + 64);
  std::memcpy(heap.data() + 7, pattern.data(), pattern.size());
  // Runs one pass of ours through a buffer of `kind`.
  auto pass_through = [&](aio::Engine& engine, const aio::File& file, bool write,
                          BufferKind kind) -> absl::StatusOr<Pass> {
    if (kind == BufferKind::kUnalignedHeap) {
      return RunOurs(engine, file, size, write, heap.data() + 7);
    }
    const uint64_t bytes = SlotsFor(engine) * kChunk;
    auto buffer =
        aio::AlignedBuffer::Allocate(bytes, {.huge_pages = kind == BufferKind::kHugePages});
    if (!buffer.ok()) return buffer.status();
    if (write) std::memcpy(buffer->data(), pattern.data(), bytes);
    return RunOurs(engine, file, size, write, buffer->data());
  };

  // Engines, one per (kind, depth), created once.
  struct Config {
    aio::EngineKind kind;
    int depth;
    std::unique_ptr<aio::Engine> engine;
    aio::File file;
  };
  std::vector<Config> configs;
  aio::OpenOptions open_options;
  open_options.writable = open_options.create = true;
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
      auto file = (*engine)->Open(g_scratch, open_options);
      if (!file.ok()) Fail(file.status().ToString());
      configs.push_back({kind, depth, *std::move(engine), *std::move(file)});
    }
  }
  if (configs.empty()) {
    std::fprintf(stderr, "no engine to measure\n");
    return 1;
  }
  // Huge pages for fio, so that the huge-page rows have a like-for-like reference. Reserved after
  // our own buffers are mapped: those take hugetlb pages first when any are free.
  HugetlbReservation hugetlb;
  bool fio_hugetlb = false;
  std::string hugetlb_note;
  if (have_fio) {
    const uint64_t need = 2 * bs * top_depth + (8ull << 20);
    fio_hugetlb = absl::GetFlag(FLAGS_reserve_hugetlb) ? hugetlb.Reserve(need, &hugetlb_note)
                                                       : HugetlbReservation::FreeBytes() >= need;
    if (!fio_hugetlb && hugetlb_note.empty()) {
      hugetlb_note = "no free hugetlb pages (pass --reserve-hugetlb as root)";
    }
    if (!fio_hugetlb) std::fprintf(stderr, "fio without huge pages: %s\n", hugetlb_note.c_str());
  }

  // Lay the file down whole (random bytes, so no layer can compress it).
  if (auto s = configs[0].file.Allocate(0, size); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
  }
  std::printf("writing the %llu MiB scratch file %s ...\n",
              static_cast<unsigned long long>(size >> 20), g_scratch.c_str());
  if (auto p = pass_through(*configs[0].engine, configs[0].file, true, BufferKind::kPages4k);
      !p.ok()) {
    Fail(p.status().ToString());
  }

  auto fio_job = [&](aio::EngineKind kind, int depth) {
    FioJob j;
    j.file = g_scratch;
    j.engine = std::string(aio::EngineKindName(kind));
    j.block_size = bs;
    j.queue_depth = depth;
    j.size_bytes = size;
    return j;
  };
  // Rows: every (engine, depth) with 4 KiB-page buffers against fio as it comes; each engine at
  // the top depth with huge pages against fio with hugetlb buffers; and the unaligned heap buffer
  // against our own aligned huge-page path.
  std::vector<Row> rows;
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    const std::string base = absl::StrCat(aio::EngineKindName(c.kind), "_qd", c.depth);
    rows.push_back({base, i, BufferKind::kPages4k, fio_job(c.kind, c.depth), ""});
    if (c.depth == top_depth) {
      Row r{base + "_hugepages", i, BufferKind::kHugePages, std::nullopt, ""};
      if (fio_hugetlb) {
        r.fio = fio_job(c.kind, c.depth);
        r.fio->hugetlb = true;
      }
      rows.push_back(r);
    }
    if (c.kind == aio::EngineKind::kIoUring && c.depth == top_depth) {
      // Beside the aligned huge-page path: the engine stages an unaligned buffer through its
      // huge-page staging buffers, so that is the path it can at best equal.
      rows.push_back({"unaligned_heap_" + base, i, BufferKind::kUnalignedHeap, std::nullopt,
                      base + "_hugepages"});
    }
  }
  // Extra settings for the disk's ceiling (the fio runs of the rows count too).
  std::vector<FioJob> ceiling_jobs;
  {
    FioJob two = fio_job(aio::EngineKind::kIoUring, top_depth);
    two.numjobs = 2;
    two.hugetlb = fio_hugetlb;
    FioJob fixed = fio_job(aio::EngineKind::kIoUring, top_depth);
    fixed.fixedbufs = fixed.batch = true;
    fixed.hugetlb = fio_hugetlb;
    ceiling_jobs = {two, fixed};
  }
  std::string ceiling_source = "best fio in the same round over this table's fio runs and {";
  for (size_t i = 0; i < ceiling_jobs.size(); ++i) {
    absl::StrAppend(&ceiling_source, i ? ", " : "", ceiling_jobs[i].Describe());
  }
  ceiling_source += "}";

  auto fio_or_zero = [&](const FioJob& job) -> FioResult {
    if (!have_fio) return {};
    auto r = RunFio(job);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return {};
    }
    return *r;
  };

  std::map<std::string, Values> values;  // by figure name ("read_io_uring_qd8", ...)
  for (int round = 0; round <= rounds; ++round) {
    const bool warmup = round == 0;
    std::printf("%s\n",
                warmup ? "warm-up round" : absl::StrCat("round ", round, "/", rounds).c_str());
    std::fflush(stdout);
    for (bool write : {false, true}) {
      const std::string op = write ? "write_" : "read_";
      double ceiling = 0;
      for (FioJob job : ceiling_jobs) {
        job.write = write;
        ceiling = std::max(ceiling, fio_or_zero(job).gb_per_s);
      }
      std::map<std::string, Pass> ours;
      std::map<std::string, FioResult> fio;
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& row = rows[i];
        Config& c = configs[row.config];
        auto run_ours = [&] {
          auto pass = pass_through(*c.engine, c.file, write, row.buffer);
          if (!pass.ok()) Fail(pass.status().ToString());
          ours[row.name] = *pass;
        };
        auto run_fio = [&] {
          if (!row.fio) return;
          FioJob job = *row.fio;
          job.write = write;
          fio[row.name] = fio_or_zero(job);
          ceiling = std::max(ceiling, fio[row.name].gb_per_s);
        };
        // Alternate who goes first, so drift within a round favours neither side.
        if ((round + i) % 2 == 0) {
          run_fio();
          run_ours();
        } else {
          run_ours();
          run_fio();
        }
      }
      if (warmup) continue;
      for (const Row& row : rows) {
        Values& v = values[op + row.name];
        const Pass& o = ours[row.name];
        v.ours.push_back(o.gb_per_s);
        v.cpu_ours.push_back(o.cpu_seconds / (size / 1e9));
        const double ref = row.fio ? fio[row.name].gb_per_s : ours[row.reference].gb_per_s;
        if (row.fio || !row.reference.empty()) v.ref.push_back(ref);
        if (ref > 0) v.ratio.push_back(o.gb_per_s / ref);
        if (row.fio && fio[row.name].bytes > 0) {
          v.cpu_fio.push_back(fio[row.name].cpu_seconds / (fio[row.name].bytes / 1e9));
        }
        v.disk.push_back(ceiling);
        if (ceiling > 0) v.disk_ratio.push_back(o.gb_per_s / ceiling);
      }
    }
  }

  Report report("aio_vs_fio", MachineInfo::Probe(dir));
  std::printf("\n%-36s %24s %12s %9s %9s %14s\n", "configuration", "ours GB/s med [min,max]",
              "ref GB/s", "ours/ref", "ours/disk", "CPU s/GB us|fio");
  for (bool write : {false, true}) {
    for (const Row& row : rows) {
      const std::string name = (write ? "write_" : "read_") + row.name;
      const Values& v = values[name];
      const Config& c = configs[row.config];
      const Summary ours = Summary::Of(v.ours), ref = Summary::Of(v.ref),
                    ratio = Summary::Of(v.ratio), disk = Summary::Of(v.disk),
                    disk_ratio = Summary::Of(v.disk_ratio), cpu_o = Summary::Of(v.cpu_ours),
                    cpu_f = Summary::Of(v.cpu_fio);
      std::printf("%-36s %6.3f [%6.3f,%6.3f] %12.3f %9.3f %9.3f %7.3f|%-6.3f\n", name.c_str(),
                  ours.median, ours.min, ours.max, ref.median, ratio.median, disk_ratio.median,
                  cpu_o.median, cpu_f.median);
      const char* buffer = row.buffer == BufferKind::kPages4k     ? "aligned, 4 KiB pages"
                           : row.buffer == BufferKind::kHugePages ? "aligned, 2 MiB pages"
                                                                  : "unaligned heap";
      nlohmann::json config = {{"op", write ? "write" : "read"},
                               {"engine", std::string(aio::EngineKindName(c.kind))},
                               {"block_size", bs},
                               {"queue_depth", c.depth},
                               {"buffer", buffer},
                               {"file_bytes", size},
                               {"request_bytes", kChunk},
                               {"rounds", rounds}};
      Figure same{.name = name,
                  .unit = "GB/s",
                  .value = ours,
                  .ceiling = ref,
                  .ratio = ratio,
                  .config = config};
      if (row.fio) {
        same.ceiling_source = row.fio->Describe() + " (same config)";
      } else if (!row.reference.empty()) {
        same.ceiling_source = "strata " + row.reference + ", aligned huge-page buffer";
      } else {
        same.note = "no fio at this config: " + hugetlb_note;
      }
      if (row.fio && !have_fio) same.note = "fio missing: no ceiling";
      report.Add(same);
      Figure disk_figure{.name = name + "_vs_disk",
                         .unit = "GB/s",
                         .value = ours,
                         .ceiling = disk,
                         .ceiling_source = ceiling_source,
                         .ratio = disk_ratio,
                         .config = config};
      if (!have_fio) disk_figure.note = "fio missing: no ceiling";
      report.Add(disk_figure);
      if (row.fio && have_fio) {
        report.Add(
            Figure{.name = name + "_cpu",
                   .unit = "CPU s/GB",
                   .value = cpu_o,
                   .ceiling = cpu_f,
                   .ceiling_source = "fio's CPU s/GB, same config",
                   .ratio = Summary::Of({cpu_f.median > 0 ? cpu_o.median / cpu_f.median : 0}),
                   .lower_is_better = true,
                   .config = config});
      }
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
  // Flags as the aio tools take them: --a-flag or --a_flag, bad values exit 2.
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv,
      "aio_vs_fio --dir DIR [--size-mb N] [--rounds N] [--json PATH]: strata's aio engine "
      "against fio on the same file",
      "bench/aio_vs_fio.cc",
      {{"size_mb", 4, 1 << 30}, {"rounds", 1, 1000}, {"block_size", 4096, 64 << 20}});
  if (auto s = strata::aio_bench::PrepareOutputFile(absl::GetFlag(FLAGS_json)); !s.ok()) {
    strata::aio_bench::BadFlag("--json", s.message());  // found before measuring
  }
  return strata::bench::Main();
}
