// nvme_store: what a write-back costs the NVMe store as the store fills, beside its ceiling.
//
// A write-back is a Put: the new bytes go to a fresh extent and are synced, then one manifest
// record is appended to the log and synced. The ceiling is the same two steps with nothing of the
// store's around them, measured in the same run on the same directory: a write of the partition's
// bytes plus fdatasync, then a write of one 4 KiB block plus fdatasync (the least a crash-safe
// copy-on-write can do). The store's figure should stay near it however many partitions the store
// already holds (a store that rewrote its whole manifest per commit grew linearly). Also printed:
// reopening the store (the manifest only; partitions are verified lazily) as it grows.
// See shared BENCH.md.
#include "tiering/nvme_store.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "aio/buffer.h"
#include "aio/engine.h"
#include "bench/common/report.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/scratch.h"

ABSL_FLAG(std::string, dir, ".", "directory for the store (on the drive to measure)");
ABSL_FLAG(int64_t, partition_bytes, 256 << 10, "bytes per partition written back");
ABSL_FLAG(std::string, sizes, "64,1024,8192", "store sizes (partitions held) to measure at");
ABSL_FLAG(int, puts, 200, "measured write-backs at each size");
ABSL_FLAG(std::string, json, "", "write the report here");

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int Main() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const uint64_t bytes = absl::GetFlag(FLAGS_partition_bytes);
  const int puts = absl::GetFlag(FLAGS_puts);
  std::vector<uint64_t> sizes;
  for (int n : aio_bench::ParseIntList("--sizes", absl::GetFlag(FLAGS_sizes), 1, 1 << 20)) {
    sizes.push_back(static_cast<uint64_t>(n));
  }
  std::sort(sizes.begin(), sizes.end());
  const std::string root = std::filesystem::absolute(dir).string() + "/strata-nvme-store-bench";
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  std::filesystem::create_directories(root, ec);

  auto engine = aio::Engine::Create(aio::AioConfig{});
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  auto buffer = aio::AlignedBuffer::Allocate(bytes);
  if (!buffer.ok()) return 1;
  std::fill(buffer->data(), buffer->data() + bytes, std::byte{0x5a});
  const absl::Span<const std::byte> data(buffer->data(), bytes);

  // The ceiling's files: a data file and a log, plain, next to the store.
  aio::OpenOptions oo;
  oo.writable = oo.create = oo.truncate = true;
  auto raw_file = (*engine)->Open(root + "/raw.bin", oo);
  auto raw_log = (*engine)->Open(root + "/raw.log", oo);
  if (!raw_file.ok() || !raw_log.ok() || !raw_file->Allocate(0, bytes * 8).ok()) return 1;
  uint64_t raw_round = 0;
  auto ceiling_once = [&]() -> double {
    const auto t0 = Clock::now();
    const uint64_t i = raw_round++;
    if (!(*engine)->WriteSync(*raw_file, (i % 8) * bytes, data).ok() || !raw_file->Sync().ok() ||
        !(*engine)->WriteSync(*raw_log, (i % 1024) * 4096, data.subspan(0, 4096)).ok() ||
        !raw_log->Sync().ok()) {
      return -1;
    }
    return Since(t0);
  };

  Report report("nvme_store", MachineInfo::Probe(dir));
  tiering::NvmeStoreOptions so;
  so.capacity_bytes = (sizes.back() + 2) * ((bytes + 4095) / 4096 * 4096) + (64 << 20);
  so.on_warning = [](absl::string_view w) { std::fprintf(stderr, "%s\n", std::string(w).c_str()); };
  const std::string path = root + "/store";
  uint64_t held = 0;
  std::vector<double> reopen_ms;
  for (uint64_t n : sizes) {
    auto store = tiering::NvmeStore::Open(path, so, engine->get());
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      return 1;
    }
    // Fill to n partitions through one batch (one commit), then time single write-backs, each
    // beside one ceiling sample taken just before it (the two see the same disk weather).
    auto batch = (*store)->NewBatch();
    for (; held < n; ++held) {
      if (absl::Status s = batch->Stage(held, data); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
    }
    if (!batch->Commit().ok()) return 1;
    std::vector<double> put_us, ceiling_us, ratio;
    for (int i = 0; i < puts; ++i) {
      const double c = ceiling_once();
      const auto t0 = Clock::now();
      absl::Status s = (*store)->Put(static_cast<uint64_t>(i) % n, data);
      const double t = Since(t0);
      if (!s.ok() || c < 0) {
        std::fprintf(stderr, "%s\n", s.ok() ? "the ceiling's write failed" : s.ToString().c_str());
        return 1;
      }
      put_us.push_back(t * 1e6);
      ceiling_us.push_back(c * 1e6);
      ratio.push_back(t / c);
    }
    Figure f;
    f.name = absl::StrCat("put_with_", n, "_partitions");
    f.unit = "us";
    f.lower_is_better = true;
    f.value = Summary::Of(put_us);
    f.ceiling = Summary::Of(ceiling_us);
    f.ratio = Summary::Of(ratio);
    f.ceiling_source = "data write+fdatasync, then a 4 KiB write+fdatasync";
    f.config = {{"partition_bytes", bytes}, {"partitions", n}, {"puts", puts}};
    report.Add(f);
    // Reopening: the snapshot, the log replayed (and compacted); no partition reread.
    store->reset();
    const auto t0 = Clock::now();
    auto reopened = tiering::NvmeStore::Open(path, so, engine->get());
    if (!reopened.ok()) return 1;
    Figure r;
    r.name = absl::StrCat("reopen_with_", n, "_partitions");
    r.unit = "ms";
    r.lower_is_better = true;
    r.value = Summary::Of({Since(t0) * 1e3});
    r.note = "no ceiling: shows that reopening does not reread the partitions";
    r.config = {{"partitions", n}};
    report.Add(r);
  }
  report.PrintClosingLines();
  std::filesystem::remove_all(root, ec);
  if (!absl::GetFlag(FLAGS_json).empty() && !report.WriteJson(absl::GetFlag(FLAGS_json))) return 1;
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  // Flags as the aio tools take them: --a-flag or --a_flag, bad values exit 2.
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv, "nvme_store: NVMe store write-back cost vs its ceiling", "bench/nvme_store.cc",
      {{"partition_bytes", 4096, 1ull << 34}, {"puts", 1, 1000000}});
  if (auto s = strata::aio_bench::PrepareOutputFile(absl::GetFlag(FLAGS_json)); !s.ok()) {
    strata::aio_bench::BadFlag("--json", s.message());  // found before measuring
  }
  return strata::bench::Main();
}
