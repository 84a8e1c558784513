// optimizer_swap: one optimizer step of a model whose optimizer state lives on NVMe, pipelined
// (read k+1 | step k | write k-1), pipelined in sub-groups (each partition read, stepped and
// written in --sub-group-params pieces: zero_optimization.sub_group_size) and serial (read, step,
// write per partition), against the
// bound max(I/O time at the disk bandwidth fio measures on the same directory in the same round,
// the optimizer's time on the same data in memory). The I/O time is bytes read / fio's read
// GB/s + bytes written / fio's write GB/s: reads and writes share one disk. And a held step (a
// trainer's under gradient clipping: its state read ahead while backward runs, stepped once the
// clipping is known): staged, then a wait standing for backward (the reads' time at fio's rate
// and half as much again), then Release and Commit, timed from the Release against
// max(bytes written / fio's write GB/s, Adam in memory). See shared BENCH.md.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "aio/engine.h"
#include "bench/common/fio.h"
#include "bench/common/report.h"
#include "optim_cpu/adam.h"
#include "swap/optimizer_swapper.h"
#include "tiering/memory_resource.h"
#include "tiering/nvme_store.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/scratch.h"

ABSL_FLAG(std::string, dir, ".", "directory for the swap space (on the drive to measure)");
ABSL_FLAG(int64_t, params, int64_t{1} << 26, "model parameters (12 bytes of state each)");
ABSL_FLAG(int64_t, partition_params, int64_t{1} << 22, "parameters per partition");
ABSL_FLAG(int64_t, sub_group_params, int64_t{1} << 20,
          "the sub-grouped variant's sub-group, in parameters (smaller than a partition)");
ABSL_FLAG(int, rounds, 5, "measured rounds after one warm-up round");
ABSL_FLAG(bool, reserve_hugetlb, false,
          "raise vm.nr_hugepages for the run (root) so fio's buffers are huge pages like ours");
ABSL_FLAG(std::string, json, "", "write the report here");
ABSL_FLAG(bool, verify, true, "verify each partition's checksum when it is read back");

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int Main() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const uint64_t params = absl::GetFlag(FLAGS_params);
  const uint64_t per = absl::GetFlag(FLAGS_partition_params);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  if (params < per) aio_bench::BadFlag("--params", "must be at least --partition-params");
  const uint64_t n_parts = (params + per - 1) / per;
  const uint64_t state_bytes = params * 12;
  const std::string swap_dir = std::filesystem::absolute(dir).string() + "/strata-optimizer-swap";
  std::error_code ec;
  std::filesystem::remove_all(swap_dir, ec);

  aio::AioConfig ac;
  ac.queue_depth = 32;
  auto engine = aio::Engine::Create(ac);
  if (!engine.ok()) return 1;
  tiering::NvmeStoreOptions so;
  so.capacity_bytes = state_bytes * 8 + (256 << 20);  // four swappers, copy on write each
  so.verify_on_get = absl::GetFlag(FLAGS_verify);
  auto store = tiering::NvmeStore::Open(swap_dir, so, engine->get());
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 1;
  }
  optim_cpu::AdamConfig adam_config;
  adam_config.weight_decay = 0.01f;
  auto adam = optim_cpu::CpuAdam::Create(adam_config);
  tiering::PinnedHostResource pinned;
  // The rings, and the held swapper's read-ahead room (the whole state).
  tiering::PoolingResource host(&pinned, (1ull << 30) + state_bytes + (64 << 20));

  std::vector<std::pair<tiering::PartitionId, uint64_t>> pipelined_parts, serial_parts, cut_parts,
      held_parts;
  for (uint64_t k = 0; k < n_parts; ++k) {
    const uint64_t n = std::min(per, params - k * per);
    pipelined_parts.emplace_back(k, n);
    serial_parts.emplace_back(100000 + k, n);
    cut_parts.emplace_back(200000 + k, n);
    held_parts.emplace_back(300000 + k, n);
  }
  const uint64_t group = absl::GetFlag(FLAGS_sub_group_params);
  auto pipelined = swap::PipelinedOptimizerSwapper::Create(store->get(), adam->get(), &host,
                                                           {true, true, 0}, pipelined_parts);
  auto serial = swap::PipelinedOptimizerSwapper::Create(store->get(), adam->get(), &host,
                                                        {false, false, 0}, serial_parts);
  swap::OptimizerSwapperConfig cut_config{true, true, 0};
  cut_config.sub_group_elements = group;
  auto cut = swap::PipelinedOptimizerSwapper::Create(store->get(), adam->get(), &host, cut_config,
                                                     cut_parts);
  swap::OptimizerSwapperConfig held_config{true, true, 0};
  held_config.read_ahead_bytes = state_bytes + n_parts * 4096;  // every partition, whole pages
  auto held = swap::PipelinedOptimizerSwapper::Create(store->get(), adam->get(), &host, held_config,
                                                      held_parts);
  if (!pipelined.ok() || !serial.ok() || !cut.ok() || !held.ok()) return 1;

  // State and gradients; the in-memory copy for the optimizer-time bound.
  std::printf("initializing %llu partitions (%.2f GiB of optimizer state on NVMe, thrice) ...\n",
              static_cast<unsigned long long>(n_parts), state_bytes / double(1 << 30));
  std::fflush(stdout);
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0, 1);
  std::vector<std::vector<float>> grads(n_parts), mem_state(n_parts);
  for (uint64_t k = 0; k < n_parts; ++k) {
    const uint64_t n = pipelined_parts[k].second;
    std::vector<float> master(n);
    for (float& x : master) x = d(rng);
    grads[k].resize(n);
    for (float& x : grads[k]) x = 0.1f * d(rng);
    if (!(*pipelined)->Initialize(k, master).ok() ||
        !(*serial)->Initialize(100000 + k, master).ok() ||
        !(*cut)->Initialize(200000 + k, master).ok() ||
        !(*held)->Initialize(300000 + k, master).ok()) {
      std::fprintf(stderr, "initialize failed\n");
      return 1;
    }
    mem_state[k].assign(3 * n, 0.0f);
    std::copy(master.begin(), master.end(), mem_state[k].begin());
  }
  auto inputs = [&](tiering::PartitionId base) {
    std::vector<swap::StepInput> in(n_parts);
    for (uint64_t k = 0; k < n_parts; ++k) {
      in[k].id = base + k;
      in[k].grad = grads[k].data();
    }
    return in;
  };

  // fio on a scratch file of the state's size in the same directory.
  const bool have_fio = FioAvailable();
  const std::string fio_file = swap_dir + "/fio-scratch.dat";
  HugetlbReservation hugetlb;
  std::string why;
  const bool fio_huge = have_fio && (absl::GetFlag(FLAGS_reserve_hugetlb)
                                         ? hugetlb.Reserve(40 << 20, &why)
                                         : HugetlbReservation::FreeBytes() >= (40u << 20));
  FioJob job;
  job.file = fio_file;
  job.engine = "io_uring";
  job.block_size = 1 << 20;
  job.queue_depth = 32;
  job.size_bytes = state_bytes / (1 << 20) * (1 << 20);
  job.hugetlb = fio_huge;
  if (have_fio) {
    job.write = true;
    if (auto r = RunFio(job); !r.ok()) std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
  }

  std::vector<double> pipe_s, serial_s, cut_s, bound_s, io_s, adam_s, ratio, serial_ratio,
      cut_ratio, held_s, held_bound_s, held_ratio;
  for (int round = 0; round <= rounds; ++round) {
    const int64_t t = round + 1;
    // The bound's parts, measured in this round.
    double read_gbps = 0, write_gbps = 0;
    if (have_fio) {
      job.write = false;
      auto r = RunFio(job);
      job.write = true;
      auto w = RunFio(job);
      if (r.ok()) read_gbps = r->gb_per_s;
      if (w.ok()) write_gbps = w->gb_per_s;
    }
    auto a0 = Clock::now();
    for (uint64_t k = 0; k < n_parts; ++k) {
      const uint64_t n = pipelined_parts[k].second;
      optim_cpu::AdamChunk c;
      c.param = mem_state[k].data();
      c.exp_avg = mem_state[k].data() + n;
      c.exp_avg_sq = mem_state[k].data() + 2 * n;
      c.grad = grads[k].data();
      c.size = n;
      (void)(*adam)->Step(t, c);
    }
    const double adam_time = Since(a0);
    // Ours, alternating which goes first.
    swap::StepReport rp, rs, rc;
    auto run_p = [&] {
      auto r = (*pipelined)->Step(t, inputs(0));
      if (!r.ok()) std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      rp = r.ok() ? *r : swap::StepReport();
    };
    auto run_s = [&] {
      auto r = (*serial)->Step(t, inputs(100000));
      if (!r.ok()) std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      rs = r.ok() ? *r : swap::StepReport();
    };
    // Held: staged, a wait standing for backward while the state is read ahead, then timed from
    // the Release to the end of the Commit.
    double held_after = 0;
    auto run_h = [&] {
      held_after = 0;
      const auto in = inputs(300000);
      if (!(*held)->Begin(0, false, true).ok() || !(*held)->Stage(t, in).ok()) {
        std::fprintf(stderr, "held step: staging failed\n");
        (*held)->Abort();
        return;
      }
      const double gbps = read_gbps > 0 ? read_gbps : 1.0;
      std::this_thread::sleep_for(std::chrono::duration<double>(1.5 * state_bytes / 1e9 / gbps));
      const auto h0 = Clock::now();
      absl::StatusOr<swap::StepReport> r =
          (*held)->Release(1.0f).ok() ? (*held)->Commit() : absl::InternalError("release failed");
      held_after = Since(h0);
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        (*held)->Abort();
        held_after = 0;
      }
    };
    auto run_c = [&] {
      auto r = (*cut)->Step(t, inputs(200000));
      if (!r.ok()) std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      rc = r.ok() ? *r : swap::StepReport();
    };
    if (round % 2 == 0) {
      run_p();
      run_c();
      run_s();
      run_h();
    } else {
      run_h();
      run_s();
      run_c();
      run_p();
    }
    if (round == 0) continue;
    if (have_fio && (read_gbps <= 0 || write_gbps <= 0)) {
      std::fprintf(stderr, "round %d: fio failed; the round is not counted\n", round);
      continue;
    }
    const double io_time = read_gbps > 0 && write_gbps > 0 ? rp.bytes_read / 1e9 / read_gbps +
                                                                 rp.bytes_written / 1e9 / write_gbps
                                                           : 0;
    const double bound = std::max(io_time, adam_time);
    pipe_s.push_back(rp.seconds);
    serial_s.push_back(rs.seconds);
    cut_s.push_back(rc.seconds);
    bound_s.push_back(bound);
    io_s.push_back(io_time);
    adam_s.push_back(adam_time);
    const double write_time = write_gbps > 0 ? state_bytes / 1e9 / write_gbps : 0;
    const double held_bound = std::max(write_time, adam_time);
    if (held_after > 0) {
      held_s.push_back(held_after);
      held_bound_s.push_back(held_bound);
      if (held_bound > 0) held_ratio.push_back(held_after / held_bound);
    }
    if (bound > 0) {
      ratio.push_back(rp.seconds / bound);
      serial_ratio.push_back(rs.seconds / bound);
      cut_ratio.push_back(rc.seconds / bound);
    }
    std::printf(
        "round %d: pipelined %.3f s (reads %.3f, writes %.3f, Adam %.3f summed), in sub-groups "
        "%.3f s, serial %.3f s, bound %.3f s (I/O %.3f s at %.2f/%.2f GB/s read/write, Adam in "
        "memory %.3f s); held, after its Release %.3f s (bound %.3f s)\n",
        round, rp.seconds, rp.read_seconds, rp.write_seconds, rp.compute_seconds, rc.seconds,
        rs.seconds, bound, io_time, read_gbps, write_gbps, adam_time, held_after, held_bound);
    std::fflush(stdout);
  }
  std::filesystem::remove(fio_file, ec);

  Report report("optimizer_swap", MachineInfo::Probe(dir));
  nlohmann::json config = {{"params", params},
                           {"partition_params", per},
                           {"sub_group_params", group},
                           {"partitions", n_parts},
                           {"state_bytes", state_bytes},
                           {"block_size", ac.block_size},
                           {"queue_depth", ac.queue_depth},
                           {"fio_hugetlb", fio_huge},
                           {"rounds", rounds},
                           {"isa", std::string(optim_cpu::IsaName((*adam)->isa()))},
                           {"verify_on_get", absl::GetFlag(FLAGS_verify)}};
  const std::string source =
      "max(bytes read / fio read GB/s + bytes written / fio write GB/s, Adam on the same data in "
      "memory), same round";
  // Each step against the same bound, measured in its round.
  auto figure = [&](const char* name, const std::vector<double>& seconds,
                    const std::vector<double>& ratios, const std::vector<double>& bounds = {},
                    const std::string& bound_source = "") {
    Figure f{.name = name,
             .unit = "s",
             .value = Summary::Of(seconds),
             .ceiling = Summary::Of(bounds.empty() ? bound_s : bounds),
             .ceiling_source = bound_source.empty() ? source : bound_source,
             .ratio = Summary::Of(ratios),
             .lower_is_better = true,
             .config = config};
    if (!have_fio) f.note = "fio missing: no I/O bound";
    report.Add(f);
  };
  figure("pipelined_step", pipe_s, ratio);
  figure("sub_grouped_step", cut_s, cut_ratio);
  figure("serial_step", serial_s, serial_ratio);
  figure("held_step_after_release", held_s, held_ratio, held_bound_s,
         "max(bytes written / fio write GB/s, Adam on the same data in memory), same round: the "
         "state read ahead before the Release");
  std::printf("\nI/O bound %.3f s, Adam in memory %.3f s (medians)\n", Summary::Of(io_s).median,
              Summary::Of(adam_s).median);
  report.PrintClosingLines();
  if (!absl::GetFlag(FLAGS_json).empty() && !report.WriteJson(absl::GetFlag(FLAGS_json))) return 1;
  pipelined->reset();
  serial->reset();
  cut->reset();
  held->reset();
  store->reset();
  std::filesystem::remove_all(swap_dir, ec);
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  // Flags as the aio tools take them: --a-flag or --a_flag, bad values exit 2.
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv, "optimizer_swap --dir DIR [--params N] [--rounds 5] [--json PATH]",
      "bench/optimizer_swap.cc",
      {{"params", 1024, 1ull << 40},
       {"partition_params", 1024, 1ull << 36},
       {"sub_group_params", 1024, 1ull << 36},
       {"rounds", 1, 1000}});
  if (auto s = strata::aio_bench::PrepareOutputFile(absl::GetFlag(FLAGS_json)); !s.ok()) {
    strata::aio_bench::BadFlag("--json", s.message());  // found before measuring
  }
  return strata::bench::Main();
}
