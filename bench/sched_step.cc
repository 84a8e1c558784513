// sched_step: one training step of a transformer-shaped model under the prefetching scheduler,
// beside the trace's lower bound (see shared BENCH.md).
//
// The model: `layers` layers, each with a parameter partition, a gradient partition and an
// optimizer-state partition (3x the parameter's bytes). One step, on the trainer thread:
//   forward   for each layer: acquire the parameters on the device, compute, release;
//   backward  for each layer, last first: parameters and gradient on the device, compute, release
//             the gradient dirty (GradientReady: it leaves the device in the background); the
//             gradient was discarded after the last step's optimizer used it, so it comes back as
//             zeros made on the device, nothing read (as zero_grad leaves a gradient);
//   optimizer for each layer, last first: optimizer state, gradient and parameters on the host,
//             compute, release the state and the parameters dirty (the new weights flow down),
//             discard the gradient —
//             after backward (--optimizer=after_backward, DeepSpeed's order, the default) or
//             during it, each layer right after backward has computed the next layer down
//             (--optimizer=interleaved, as strata's trainer front steps partitions).
// Compute is modelled (a sleep on the trainer thread per layer and phase, each shortened by what
// the sleeps before it overshot). The device tier is
// host-emulated, its copy engine capped at --copy_gbps (a PCIe-like link), or with --device=cuda
// GPU 0's memory and a CUDA copy engine (pinned host <-> HBM; each direction of the link timed on
// its own, as PCIe carries both at once); the device budget is a
// quarter of the parameters, the host budget half of everything (plus the staging buffers), the
// rest lives in the NVMe store under --dir.
//
// The ceiling is the trace's lower bound per step, the longer of two counts (sched/
// step_bound.h says what each counts and where it errs low): over the whole step, max(compute,
// Belady's bytes across the copy link / its bandwidth, across the disk / its bandwidth), the link
// counted on the device tier with its budget (the host's reads of dirty device copies and its
// writes that leave device copies stale included), the disk on all memory-tier accesses with the
// device and host budgets together; and phase by phase (PhaseLowerBounds), the sum of
// each phase's max(compute, link time, disk time). The bandwidths are measured in the same run (the
// copy engine timed on a large copy; the disk by fio reads and writes at the store's block size and
// depth, or strata's aio engine where fio is not installed, as the output says; a write-back's
// commit, the store's syncs, by timing Puts of 4 KiB, for the planner only). The figure is
// the median step time after the first two steps; strata's scheduler is printed beside on-demand +
// LRU and a DeepSpeed-like policy (device-only prefetch of a fixed bucket, at most two in flight,
// no read-ahead from NVMe), each as a ratio to the bound.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "aio/buffer.h"
#include "aio/engine.h"
#include "base/status.h"
#include "bench/common/fio.h"
#include "bench/common/report.h"
#include "planner/plan_step.h"
#include "planner/step_bound.h"
#include "sched/runtime.h"
#include "tiering/copy_engine.h"
#include "tiering/link_bandwidth.h"
#include "tiering/nvme_store.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/scratch.h"

ABSL_FLAG(std::string, dir, ".", "directory for the NVMe store (on the drive to measure)");
ABSL_FLAG(int, layers, 24, "transformer layers");
ABSL_FLAG(int64_t, param_bytes, 1 << 20, "bytes of one layer's parameters (and its gradient)");
ABSL_FLAG(int, steps, 6, "training steps per policy (the first two are not counted)");
ABSL_FLAG(int, rounds, 3, "rounds: each measures the bound's bandwidths, then runs each policy");
ABSL_FLAG(double, copy_gbps, 2.0, "the emulated device link's cap, GB/s");
ABSL_FLAG(std::string, device, "emulated",
          "the device tier: emulated (host memory, a capped copy thread) or cuda (GPU 0)");
ABSL_FLAG(double, forward_ms, 1.0, "modelled compute per layer: forward");
ABSL_FLAG(double, backward_ms, 2.0, "modelled compute per layer: backward");
ABSL_FLAG(double, optimizer_ms, 2.0, "modelled compute per layer: optimizer");
ABSL_FLAG(std::string, optimizer, "after_backward",
          "when the optimizer steps: after_backward (every layer once backward has ended, as "
          "DeepSpeed does) or interleaved (each layer during backward, one layer behind its "
          "gradient, as strata's trainer front does)");
ABSL_FLAG(std::vector<std::string>, policies,
          std::vector<std::string>({"strata", "lru", "deepspeed_like"}),
          "the policies to run, in each round (comma-separated): strata, lru, deepspeed_like; "
          "NAME@2 runs NAME with the copy engine's two streams, one per direction "
          "(strata.copy_streams 2; the default is one)");
ABSL_FLAG(std::string, json, "", "write the report here");

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
using plan::Access;
using plan::Group;
using plan::kBackward;
using plan::kOptimizer;
using plan::kPhaseCount;
using plan::Lanes;
using sched::Policy;
using sched::Runtime;
using tiering::PartitionDesc;
using tiering::PartitionId;
using tiering::Role;
using tiering::Tier;

// A policy's name, with "@2" after it for the CUDA copy engine's two streams (one per direction)
// instead of one (strata.copy_streams): "strata@2".
std::optional<Policy> PolicyNamed(absl::string_view name) {
  if (absl::EndsWith(name, "@2") || absl::EndsWith(name, "@1")) name.remove_suffix(2);
  if (name == "strata") return Policy::kTrace;
  if (name == "lru") return Policy::kLru;
  if (name == "deepspeed_like") return Policy::kDeepSpeedLike;
  return std::nullopt;
}

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One step as the trainer thread runs it (Group, Access: planner/step_bound.h): groups of
// accesses, each acquired together, computed on for a modelled time, and released; a group's
// gradient, if any, is then handed to GradientReady, and a stepped gradient discarded.
// The step's phases (forward, backward, optimizer) run one after another on the trainer thread,
// which the bound uses (below). With --optimizer=interleaved the optimizer steps each layer right
// after backward has produced the layer before's gradient (the gradient one layer behind, so that
// it has come down meanwhile), as strata's trainer front does; with after_backward (DeepSpeed's
// order) it steps every layer once backward has ended.
struct Model {
  int layers;
  uint64_t param_bytes;
  std::vector<PartitionDesc> parts;
  PartitionId Param(int l) const { return 3 * l; }
  PartitionId Grad(int l) const { return 3 * l + 1; }
  PartitionId State(int l) const { return 3 * l + 2; }
  uint64_t Bytes(PartitionId id) const { return parts[id].bytes; }
};

Model MakeModel(int layers, uint64_t param_bytes) {
  Model m{layers, param_bytes, {}};
  for (int l = 0; l < layers; ++l) {
    for (int k = 0; k < 3; ++k) {
      PartitionDesc d;
      d.id = 3 * l + k;
      d.role = k == 0 ? Role::kParam : k == 1 ? Role::kGrad : Role::kMaster;
      d.bytes = k == 2 ? 3 * param_bytes : param_bytes;
      d.elements = param_bytes / 2;  // bf16 parameters
      d.group = l;
      m.parts.push_back(d);
    }
  }
  return m;
}

std::vector<Group> MakeStep(const Model& m, bool interleaved) {
  const double fwd = absl::GetFlag(FLAGS_forward_ms) / 1e3;
  const double bwd = absl::GetFlag(FLAGS_backward_ms) / 1e3;
  const double opt = absl::GetFlag(FLAGS_optimizer_ms) / 1e3;
  std::vector<Group> step;
  for (int l = 0; l < m.layers; ++l) step.push_back({{{m.Param(l), Tier::kDevice, false}}, fwd});
  auto optimizer = [&](int l) {
    step.push_back({{{m.State(l), Tier::kHost, true},
                     {m.Grad(l), Tier::kHost, false},
                     {m.Param(l), Tier::kHost, true}},
                    opt,
                    interleaved ? kBackward : kOptimizer,
                    std::nullopt,
                    m.Grad(l)});
  };
  for (int l = m.layers - 1; l >= 0; --l) {
    step.push_back({{{m.Param(l), Tier::kDevice, false}, {m.Grad(l), Tier::kDevice, true}},
                    bwd,
                    kBackward,
                    m.Grad(l)});
    if (interleaved && l + 1 < m.layers) optimizer(l + 1);
  }
  if (interleaved) {
    optimizer(0);
  } else {
    for (int l = m.layers - 1; l >= 0; --l) optimizer(l);
  }
  return step;
}

// The copy link's bandwidth, each way (tiering/link_bandwidth.h: the emulated engine capped as the
// run's, or the CUDA engine's stream), as the Lanes' to_device, to_host and link_duplex.
Lanes MeasureLinkBps(uint64_t cap, bool cuda) {
  auto measured = tiering::MeasureLinkBandwidth(cuda, cap);
  if (!measured.ok()) return {};
  Lanes link;
  link.to_device = measured->to_device;
  link.to_host = measured->to_host;
  link.link_duplex = measured->duplex;
  return link;
}

// The disk's read and write bandwidth at the store's block size and queue depth: by fio, the
// disk's reference (BENCH.md), when it is installed; else through strata's own aio engine (said in
// the output).
struct DiskBps {
  double read = 0, write = 0;
  bool by_fio = false;
};
// Disk rates before and after a run within this factor of each other: the round can test the
// planner's 15%.
constexpr double kSteadyDisk = 1.15;

DiskBps MeasureDiskBps(aio::Engine& engine, const aio::AioConfig& aio, const std::string& path,
                       uint64_t bytes) {
  DiskBps d;
  if (FioAvailable()) {
    FioJob job;
    job.file = path;
    job.block_size = aio.block_size;
    job.queue_depth = aio.queue_depth;
    job.size_bytes = bytes;
    job.write = true;
    auto w = RunFio(job);
    job.write = false;
    auto r = w.ok() ? RunFio(job) : w;
    std::filesystem::remove(path);
    if (w.ok() && r.ok()) return {r->gb_per_s * 1e9, w->gb_per_s * 1e9, true};
    std::fprintf(stderr, "sched_step: fio failed (%s); measuring with strata's engine\n",
                 (w.ok() ? r.status() : w.status()).ToString().c_str());
  }
  aio::OpenOptions oo;
  oo.writable = oo.create = oo.truncate = true;
  auto file = engine.Open(path, oo);
  auto buffer = aio::AlignedBuffer::Allocate(bytes);
  if (!file.ok() || !buffer.ok()) return d;
  std::memset(buffer->data(), 0x3c, bytes);
  auto t0 = Clock::now();
  if (!engine.WriteSync(*file, 0, {buffer->data(), bytes}).ok() || !file->Sync().ok()) return d;
  d.write = bytes / Since(t0);
  t0 = Clock::now();
  if (!engine.ReadSync(*file, 0, {buffer->data(), bytes}).ok()) return {};
  d.read = bytes / Since(t0);
  std::filesystem::remove(path);
  return d;
}

// The modelled compute, a sleep per group. A sleep overshoots (by ~0.1 ms on these machines,
// ~10% of the compute the bound counts over a step's 72 groups), so each group's sleep is shortened
// by what the sleeps before it overshot: the modelled compute sums to what the bound counts, as a
// GPU's kernels would, without a spin taking a core from the runtime's threads.
class ComputeModel {
 public:
  void Run(double seconds) {
    const Clock::duration want =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)) -
        overshot_;
    if (want <= Clock::duration::zero()) {
      overshot_ = -want;
      return;
    }
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(want);
    overshot_ = Clock::now() - t0 - want;
  }

 private:
  Clock::duration overshot_{};
};

struct Run {
  std::vector<double> step_seconds;  // steps after the first two
  sched::StepReport last;
  std::string error;
};

Run RunPolicy(const Model& m, const std::vector<Group>& step_groups, Policy policy,
              const tiering::RuntimeConfig& config) {
  Run run;
  sched::RuntimeOptions ro;
  ro.on_warning = [](absl::string_view) {};
  ro.policy = policy;
  auto rt = Runtime::Create(config, ro);
  if (!rt.ok()) {
    run.error = rt.status().ToString();
    return run;
  }
  for (const PartitionDesc& d : m.parts) {
    if (absl::Status s = (*rt)->Register(d, Tier::kNvme); !s.ok()) {
      run.error = s.ToString();
      return run;
    }
  }
  ComputeModel compute;
  auto use = [&](const Group& g) {
    for (const Access& a : g.accesses) {
      auto p = (*rt)->Acquire(a.id, a.tier);
      if (!p.ok()) return p.status();
      // The bytes change (the rest is modelled), where the host can write them: on the CUDA
      // tier a device copy's pointer is device memory, and the dirty release alone makes the
      // runtime write it back.
      if (a.dirty && (config.emulated_device || a.tier != Tier::kDevice)) (*p)[0] = std::byte{1};
    }
    compute.Run(g.compute_s);
    for (const Access& a : g.accesses) {
      STRATA_RETURN_IF_ERROR((*rt)->Release(a.id, a.tier, a.dirty));
    }
    if (g.gradient_ready) (*rt)->GradientReady(*g.gradient_ready);
    if (g.discard) STRATA_RETURN_IF_ERROR((*rt)->Discard(*g.discard));
    return absl::OkStatus();
  };
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int step = 0; step < steps; ++step) {
    const auto t0 = Clock::now();
    absl::Status s;
    for (const Group& g : step_groups) {
      if (s = use(g); !s.ok()) break;
    }
    run.last = (*rt)->EndStep();
    if (!s.ok()) {
      run.error = s.ToString();
      return run;
    }
    if (step >= 2) run.step_seconds.push_back(Since(t0));
  }
  return run;
}

int Main() {
  const std::string dir = std::filesystem::absolute(absl::GetFlag(FLAGS_dir)).string();
  const Model m = MakeModel(absl::GetFlag(FLAGS_layers),
                            static_cast<uint64_t>(absl::GetFlag(FLAGS_param_bytes)));
  uint64_t params = 0, all = 0;
  for (const PartitionDesc& d : m.parts) {
    all += (d.bytes + 4095) / 4096 * 4096;
    if (d.role == Role::kParam) params += (d.bytes + 4095) / 4096 * 4096;
  }
  tiering::RuntimeConfig config;
  config.aio.block_size = 1 << 20;
  config.device_budget_bytes = params / 4;
  config.offload_param.buffer_size = 1 << 20;
  config.offload_param.buffer_count = 4;
  config.host_budget_bytes = all / 2 + 4 * (1 << 20);
  config.nvme_capacity_bytes = 3 * all + (64 << 20);
  config.copy_bandwidth_bytes_per_s = static_cast<uint64_t>(absl::GetFlag(FLAGS_copy_gbps) * 1e9);
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  config.emulated_device = !cuda;
  if (cuda) {
    if (auto probe = tiering::CreateCudaCopyEngine(0); !probe.ok()) {
      std::fprintf(stderr, "sched_step: --device=cuda: %s\n", probe.status().ToString().c_str());
      return 1;
    }
  }
  config.eviction_policy = "trace";
  const std::string root = dir + "/strata-sched-step-bench";
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  std::filesystem::create_directories(root, ec);
  config.nvme_path = root + "/swap";

  const bool interleaved = absl::GetFlag(FLAGS_optimizer) == "interleaved";
  // The step as a trace (planner/plan_step.h): every partition's home is the NVMe store; the memory
  // tiers' room is the device budget and half of everything in the host (the rest of the host
  // budget is the staging buffers).
  plan::StepTrace trace;
  trace.partitions = m.parts;
  trace.home.assign(m.parts.size(), Tier::kNvme);
  trace.groups = MakeStep(m, interleaved);
  const std::vector<Group>& step_groups = trace.groups;
  const plan::Budgets budgets{config.device_budget_bytes, all / 2};
  auto engine = aio::Engine::Create(config.aio);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::vector<std::pair<std::string, Policy>> policies;
  for (const std::string& name : absl::GetFlag(FLAGS_policies)) {
    policies.emplace_back(name, *PolicyNamed(name));
  }
  std::map<std::string, std::vector<double>> seconds, bounds, ratios;
  std::map<std::string, sched::StepReport> last;
  std::vector<double> copy_bps_all, read_bps_all, write_bps_all, commit_s_all;
  bool disk_by_fio = true;
  std::vector<double> link_s_all, by_phase_all, predicted_all, honesty, unsteady;
  plan::Bound bound_detail;
  plan::Prediction prediction;  // the last round's
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (const auto& [name, policy] : policies) {
      // The bound's bandwidths, measured around the policy's run (the same weather).
      const Lanes link_bps = MeasureLinkBps(config.copy_bandwidth_bytes_per_s, cuda);
      const double copy_bps = link_bps.to_device;
      // The disk is measured before and after the policy runs: a virtual disk's rate can swing
      // twofold within a minute, so the bound and the prediction take the mean of the two (the
      // rate that moves the bytes in the mean of their times), and a round whose two measures
      // differ by more than the check's 15% cannot test it (counted apart below).
      const DiskBps before = MeasureDiskBps(**engine, config.aio, root + "/disk.bin", 64 << 20);
      // A write-back's commit in the store (the planner's Lanes::nvme_commit_s).
      auto commit = tiering::MeasureCommitSeconds(root + "/commit", engine->get());
      if (!commit.ok()) {
        std::fprintf(stderr, "sched_step: %s\n", commit.status().ToString().c_str());
        return 1;
      }
      const double commit_s = *commit;
      commit_s_all.push_back(commit_s);
      std::filesystem::remove_all(config.nvme_path, ec);
      tiering::RuntimeConfig run_config = config;
      run_config.copy_streams = absl::EndsWith(name, "@2") ? 2 : 1;
      Run run = RunPolicy(m, step_groups, policy, run_config);
      if (!run.error.empty()) {
        std::fprintf(stderr, "sched_step: %s: %s\n", name.c_str(), run.error.c_str());
        return 1;
      }
      std::filesystem::remove_all(config.nvme_path, ec);
      const DiskBps after = MeasureDiskBps(**engine, config.aio, root + "/disk.bin", 64 << 20);
      disk_by_fio = disk_by_fio && before.by_fio && after.by_fio;
      if (copy_bps <= 0 || before.read <= 0 || before.write <= 0 || after.read <= 0 ||
          after.write <= 0) {
        std::fprintf(stderr, "sched_step: measuring the bound's bandwidths failed\n");
        return 1;
      }
      auto mean_rate = [](double x, double y) { return 2 / (1 / x + 1 / y); };
      const double read_bps = mean_rate(before.read, after.read);
      const double write_bps = mean_rate(before.write, after.write);
      const double swing = std::max({before.read / after.read, after.read / before.read,
                                     before.write / after.write, after.write / before.write});
      copy_bps_all.push_back(copy_bps);
      read_bps_all.push_back(read_bps);
      write_bps_all.push_back(write_bps);
      Lanes lanes = link_bps;
      lanes.nvme_read = read_bps;
      lanes.nvme_write = write_bps;
      lanes.nvme_commit_s = commit_s;
      lanes.staging_bytes = static_cast<uint64_t>(config.offload_param.buffer_size);
      lanes.staging_count = static_cast<int>(config.offload_param.buffer_count);
      // The step's bound: the whole step's traffic (Belady's), or phase by phase what each
      // phase must move within itself, whichever is longer.
      const plan::Bound b = plan::StepLowerBound(trace, lanes, budgets);
      const double bound = b.seconds();
      bound_detail = b;
      link_s_all.push_back(lanes.LinkSeconds(b.link.loaded, b.link.written));
      by_phase_all.push_back(b.by_phase_s);
      // The planner's prediction of the same step on the same bandwidths (strata's policy only:
      // the replay does not model the others' limits).
      if (policy == Policy::kTrace) {
        sched::SchedulerConfig sc;
        sc.prefetch_bucket_elements = static_cast<uint64_t>(config.stage3_prefetch_bucket_size);
        auto predicted = plan::PredictStep(trace, lanes, budgets, sc);
        if (!predicted.ok()) {
          std::fprintf(stderr, "sched_step: the planner: %s\n",
                       predicted.status().ToString().c_str());
          return 1;
        }
        predicted_all.push_back(predicted->step_s);
        prediction = *predicted;
        const double ratio = Summary::Of(run.step_seconds).median / predicted->step_s;
        (swing <= kSteadyDisk ? honesty : unsteady).push_back(ratio);
        std::printf(
            "round %d: the disk before the run %.2f GB/s read, %.2f written; after %.2f "
            "and %.2f (%s); predicted %.1f ms, measured %.2fx\n",
            round, before.read / 1e9, before.write / 1e9, after.read / 1e9, after.write / 1e9,
            swing <= kSteadyDisk ? "steady" : "NOT steady", predicted->step_s * 1e3, ratio);
      }
      for (double s : run.step_seconds) {
        seconds[name].push_back(s);
        bounds[name].push_back(bound);
        ratios[name].push_back(s / bound);
      }
      last[name] = run.last;
      std::printf("round %d %-15s median step %.1f ms, bound %.1f ms; last step: %s\n", round,
                  name.c_str(), Summary::Of(run.step_seconds).median * 1e3, bound * 1e3,
                  run.last.ToJson().c_str());
    }
  }
  std::filesystem::remove_all(root, ec);
  const plan::Traffic& link = bound_detail.link;
  const plan::Traffic& disk = bound_detail.disk;
  const auto& phases = bound_detail.phases;
  std::printf(
      "bound per step: compute %.1f ms; copy link %.1f MB at %.2f GB/s = %.1f ms; disk %.1f MB "
      "read at %.2f GB/s + %.1f MB written at %.2f GB/s = %.1f ms (disk measured by %s)\n",
      bound_detail.compute_s * 1e3, (link.loaded + link.written) / 1e6,
      Summary::Of(copy_bps_all).median / 1e9, Summary::Of(link_s_all).median * 1e3,
      disk.loaded / 1e6, Summary::Of(read_bps_all).median / 1e9, disk.written / 1e6,
      Summary::Of(write_bps_all).median / 1e9,
      (disk.loaded / Summary::Of(read_bps_all).median +
       disk.written / Summary::Of(write_bps_all).median) *
          1e3,
      disk_by_fio ? "fio" : "strata's aio engine: fio is not installed");
  std::printf("bound by phase (what each phase must move within itself): %.1f ms;",
              Summary::Of(by_phase_all).median * 1e3);
  for (int p = 0; p < kPhaseCount; ++p) {
    static constexpr const char* kNames[] = {"forward", "backward", "optimizer"};
    if (phases[p].compute_s == 0) continue;
    std::printf(" %s: compute %.1f ms, disk %.1f MB read + %.1f MB written, link %.1f MB;",
                kNames[p], phases[p].compute_s * 1e3, phases[p].disk.loaded / 1e6,
                phases[p].disk.written / 1e6,
                (phases[p].link.loaded + phases[p].link.written) / 1e6);
  }
  std::printf(" the optimizer %s\n", interleaved ? "interleaved with backward" : "after backward");
  if (!predicted_all.empty()) {
    // The planner's honesty check (planner/plan_step.h): its replay of this step on the bandwidths
    // measured around each round, beside what the runtime measured in that round; only rounds
    // whose disk held steady can test a 15% claim.
    if (honesty.empty()) {
      std::printf(
          "planner: predicted %.1f ms per step (median of %zu rounds); the disk's rate "
          "moved by more than %.0f%% across every round (measured %.2fx the prediction, "
          "median): the 15%% check could not be made\n",
          Summary::Of(predicted_all).median * 1e3, predicted_all.size(), (kSteadyDisk - 1) * 100,
          Summary::Of(unsteady).median);
    } else {
      const Summary h = Summary::Of(honesty);
      std::printf(
          "planner: predicted %.1f ms per step (median of %zu rounds); strata measured %.2fx the "
          "prediction (median of the %zu rounds the disk held steady; %.2f-%.2f), %s the 15%% the "
          "planner promises (%zu rounds apart: the disk moved); the store's commit per "
          "write-back, measured: %.2f ms (median)\n",
          Summary::Of(predicted_all).median * 1e3, predicted_all.size(), h.median, honesty.size(),
          h.min, h.max, h.median >= 0.85 && h.median <= 1.15 ? "within" : "NOT within",
          unsteady.size(), Summary::Of(commit_s_all).median * 1e3);
    }
    // Where the prediction spends the step, to set beside the runtime's report above.
    std::printf("planner, last round: %.1f ms; the trainer waited", prediction.step_s * 1e3);
    for (int l = 0; l < plan::kLaneCount; ++l) {
      const auto lane = static_cast<plan::Lane>(l);
      if (prediction.waits_s[l] > 0) {
        std::printf(" %.1f ms on %s,", prediction.waits_s[l] * 1e3, plan::LaneName(lane));
      }
    }
    std::printf(" moved");
    for (int l = plan::kToDevice; l < plan::kLaneCount; ++l) {
      const auto lane = static_cast<plan::Lane>(l);
      std::printf(" %.1f MB %s (busy %.1f ms)%s", prediction.bytes[l] / 1e6, plan::LaneName(lane),
                  prediction.busy_s[l] * 1e3, l + 1 < plan::kLaneCount ? "," : "\n");
    }
  }
  Report report("sched_step", MachineInfo::Probe(dir));
  for (const auto& [name, policy] : policies) {
    Figure f;
    f.name = absl::StrCat("step_", name);
    f.unit = "ms";
    f.lower_is_better = true;
    std::vector<double> ms;
    for (double s : seconds[name]) ms.push_back(s * 1e3);
    std::vector<double> bound_ms;
    for (double s : bounds[name]) bound_ms.push_back(s * 1e3);
    f.value = Summary::Of(ms);
    f.ceiling = Summary::Of(bound_ms);
    f.ratio = Summary::Of(ratios[name]);
    f.ceiling_source =
        "the trace's lower bound: max(compute, link bytes / copy GB/s, disk bytes / disk GB/s) "
        "over the step, or summed over its phases, whichever is longer";
    f.config = {{"layers", m.layers},
                {"param_bytes", m.param_bytes},
                {"device_budget_bytes", config.device_budget_bytes},
                {"host_budget_bytes", config.host_budget_bytes},
                {"device", cuda ? "cuda" : "emulated"},
                {"copy_gbps",
                 cuda ? Summary::Of(copy_bps_all).median / 1e9 : absl::GetFlag(FLAGS_copy_gbps)},
                {"compute_ms", bound_detail.compute_s * 1e3},
                {"optimizer", interleaved ? "interleaved" : "after_backward"},
                {"bound_by_phase_ms", Summary::Of(by_phase_all).median * 1e3},
                {"disk_measured_by", disk_by_fio ? "fio" : "strata's aio engine"},
                {"last_step", nlohmann::json::parse(last[name].ToJson())}};
    if (policy == Policy::kTrace && !predicted_all.empty()) {
      f.config["predicted_ms"] = Summary::Of(predicted_all).median * 1e3;
      f.config["measured_over_predicted"] =
          honesty.empty() ? nlohmann::json(nullptr) : nlohmann::json(Summary::Of(honesty).median);
      f.config["rounds_disk_steady"] = honesty.size();
    }
    report.Add(f);
  }
  report.PrintClosingLines();
  if (!absl::GetFlag(FLAGS_json).empty() && !report.WriteJson(absl::GetFlag(FLAGS_json))) return 1;
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv, "sched_step: a transformer-shaped training step under the scheduler vs its bound",
      "bench/sched_step.cc",
      {{"layers", 1, 10000},
       {"param_bytes", 4096, 1ull << 34},
       {"steps", 3, 1000},
       {"rounds", 1, 1000},
       {"copy_gbps", 0.01, 1000},
       {"forward_ms", 0, 10000},
       {"backward_ms", 0, 10000},
       {"optimizer_ms", 0, 10000}});
  if (const std::string o = absl::GetFlag(FLAGS_optimizer);
      o != "after_backward" && o != "interleaved") {
    strata::aio_bench::BadFlag("--optimizer",
                               "is \"" + o + "\"; accepted: after_backward, interleaved");
  }
  const std::vector<std::string> policies = absl::GetFlag(FLAGS_policies);
  if (policies.empty()) {
    strata::aio_bench::BadFlag("--policies", "is empty; accepted: strata, lru, deepspeed_like");
  }
  for (const std::string& p : policies) {
    if (!strata::bench::PolicyNamed(p)) {
      strata::aio_bench::BadFlag(
          "--policies",
          "names \"" + p +
              "\"; accepted: strata, lru, deepspeed_like, each with @1 or @2 after it "
              "or not");
    }
  }
  if (const std::string d = absl::GetFlag(FLAGS_device); d != "emulated" && d != "cuda") {
    strata::aio_bench::BadFlag("--device", "is \"" + d + "\"; accepted: emulated, cuda");
  }
  // The device budget is a quarter of the parameters, and backward holds a layer's parameters
  // and its gradient on the device at once: two layers' worth.
  if (const int layers = absl::GetFlag(FLAGS_layers); layers < 8) {
    strata::aio_bench::BadFlag(
        "--layers",
        absl::StrCat(layers, ": the device budget (a quarter of the parameters, ", layers,
                     "/4 layers' worth) cannot hold a layer's parameters and gradient at once "
                     "(2 layers' worth); accepted: 8 or more"));
  }
  if (auto s = strata::aio_bench::PrepareOutputFile(absl::GetFlag(FLAGS_json)); !s.ok()) {
    strata::aio_bench::BadFlag("--json", s.message());
  }
  return strata::bench::Main();
}
