#include "planner/plan_time.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "planner/plan_comm.h"

namespace strata::plan {
namespace {

using tiering::OffloadDevice;
using tiering::PartitionDesc;
using tiering::Role;

Tier HomeOf(OffloadDevice d) {
  return d == OffloadDevice::kNone  ? Tier::kDevice
         : d == OffloadDevice::kCpu ? Tier::kHost
                                    : Tier::kNvme;
}

}  // namespace

absl::StatusOr<StepModel> ModelStep(const Transformer& m, const Hardware& hw, const Training& t,
                                    const MemoryPlan& mem) {
  const tiering::RuntimeConfig& rc = t.runtime;
  const double n = hw.gpus;     // on the node: its host, disks and CPU shared by them
  const double w = hw.ranks();  // every node's: what ZeRO partitions over
  const double d = t.dtype_bytes;
  const Tier p_home = rc.zero_stage >= 3 ? HomeOf(rc.offload_param.device) : Tier::kDevice;
  const Tier s_home = HomeOf(rc.offload_optimizer.device);
  const bool offloaded_opt = s_home != Tier::kDevice;
  const Tier g_home = offloaded_opt ? Tier::kHost : Tier::kDevice;
  const double p_share = p_home != Tier::kDevice ? 1 / w : 1;
  const double s_share = t.StageRun(hw.ranks()) >= 1 ? 1 / w : 1;
  const double g_share = rc.zero_stage >= 2 || offloaded_opt ? 1 / w : 1;
  const double opt_per_param = t.dtype_bytes == 4 ? 8 : 12;
  const int64_t ga = t.gradient_accumulation;
  // Whether the CPU optimizer steps each unit during backward, as its gradient is final, or all
  // of them after backward, as the trainer's front does it: during backward at stage 3 in one
  // process, for state on NVMe (the staged step), and for state in host memory only with
  // strata.optimizer_during_backward (its "auto" default is on for a GPU, which the planner
  // models) when nothing learnt after backward can change the step (no clipping, no fp16 loss
  // scale). With strata.optimizer_commit "partition" a step once begun cannot be dropped, so the
  // NVMe state too steps during backward only where host-resident state would. Across ranks, at
  // stages 2 and 3, the NVMe state's step is staged as each shard's gradient is reduced, unless
  // clipping or "partition" keeps it for after backward; host-resident state steps after it.
  const bool may_step_early =
      rc.optimizer_during_backward.value_or(true) && t.gradient_clipping <= 0 && !t.fp16;
  const bool during_backward =
      w == 1 ? rc.zero_stage == 3 &&
                   ((s_home == Tier::kNvme && (!mem.commit_each || may_step_early)) ||
                    (s_home == Tier::kHost && may_step_early))
             : rc.zero_stage >= 2 && s_home == Tier::kNvme && !mem.commit_each &&
                   t.gradient_clipping <= 0;

  // Parameters with no host copy (mem.weights_from_master) take their new weights from the
  // committed master weights, read back after the step; with strata.optimizer_commit "partition"
  // the optimizer's thread writes them into their partitions as each state lands instead (the
  // front's CopySink, during backward or after it), reading nothing back.
  const bool read_back = mem.weights_from_master && !mem.commit_each;

  StepModel out;
  // Budgets.
  double device_homed = 0;
  if (p_home == Tier::kDevice) device_homed += mem.device.params;
  if (g_home == Tier::kDevice) device_homed += mem.device.grads;
  if (s_home == Tier::kDevice) device_homed += mem.device.optimizer;
  double device = hw.hbm_bytes - mem.device.activations - device_homed;
  double host = hw.host_bytes - mem.host.total();
  if (p_home == Tier::kNvme || s_home == Tier::kNvme) host += mem.host.params;  // staged copies
  host /= n;
  if (t.device_budget) device = std::min(device, static_cast<double>(*t.device_budget));
  if (t.host_budget) host = std::min(host, static_cast<double>(*t.host_budget));
  if (device <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the device has no room left for parameters in use (HBM ", hw.hbm_bytes / 1e9,
                     " GB, activations and what lives there ",
                     (mem.device.activations + device_homed) / 1e9, " GB)"));
  }
  out.budgets = {static_cast<uint64_t>(device), static_cast<uint64_t>(std::max(0.0, host))};

  // Lanes.
  out.lanes.to_device = hw.pcie_to_device;
  out.lanes.to_host = hw.pcie_to_host;
  out.lanes.link_duplex = true;
  out.lanes.nvme_read = hw.nvme_read / n;
  out.lanes.nvme_write = hw.nvme_write / n;
  // The store syncs each commit only where its files are kept (NvmeStoreOptions::durable).
  out.lanes.nvme_commit_s = rc.nvme_keep_files ? hw.nvme_commit_s : 0.0;
  out.lanes.staging_bytes = static_cast<uint64_t>(rc.offload_param.buffer_size);
  out.lanes.staging_count = static_cast<int>(rc.offload_param.buffer_count);
  out.lanes.comm_shares_cores = hw.link_kind == LinkKind::kLoopback;
  out.scheduler.prefetch_bucket_elements = static_cast<uint64_t>(rc.stage3_prefetch_bucket_size);

  // Partitions: per unit (the layers, or with tiling each layer's tiles, then the embeddings and
  // head) P, G, S; with gradient accumulation and an offloaded optimizer, a host accumulation
  // buffer A per unit.
  const int64_t tiles = m.LayerUnits();
  const int64_t body = m.layers * tiles;
  const int64_t units = body + 1;
  const double unit_params = static_cast<double>(m.LayerParams()) / static_cast<double>(tiles);
  const bool accumulate = offloaded_opt && ga > 1;
  StepTrace& tr = out.trace;
  auto add = [&](Role role, double params, double bytes_per, Tier home, int64_t unit) {
    static constexpr const char* kWhat[] = {"parameters", "gradient", "optimizer state",
                                            "accumulated gradient"};
    const int what = role == Role::kParam ? 0 : role == Role::kGrad ? 1 : 2;
    tr.names.push_back(absl::StrCat(
        "the ",
        kWhat[what == 1 && tr.partitions.size() >= 3 * static_cast<size_t>(units) ? 3 : what],
        " of ",
        unit >= body ? std::string("the embeddings and head")
        : tiles == 1 ? absl::StrCat("layer ", unit)
                     : absl::StrCat("layer ", unit / tiles, "'s tile ", unit % tiles)));
    PartitionDesc p;
    p.id = tr.partitions.size();
    p.role = role;
    p.elements = static_cast<uint64_t>(params);
    p.bytes = std::max<uint64_t>(1, static_cast<uint64_t>(params * bytes_per));
    p.group = static_cast<int>(unit);
    tr.partitions.push_back(p);
    tr.home.push_back(home);
  };
  for (int64_t u = 0; u < units; ++u) {
    const double x = u < body ? unit_params : static_cast<double>(m.OuterParams());
    add(Role::kParam, x * p_share, d, p_home, u);
    add(Role::kGrad, x * g_share, d, g_home, u);
    add(Role::kMaster, x * s_share, opt_per_param, s_home, u);
  }
  // The optimizer's state on NVMe is read and written back every step, whatever room the host
  // has (the Runtime keeps none of it in host memory: sched/runtime.cc CreateOptimizer).
  tr.streamed.assign(tr.partitions.size(), false);
  if (s_home == Tier::kNvme) {
    for (int64_t u = 0; u < units; ++u) tr.streamed[3 * u + 2] = true;
  }
  if (accumulate) {
    for (int64_t u = 0; u < units; ++u) {
      const double x = u < body ? unit_params : static_cast<double>(m.OuterParams());
      add(Role::kGrad, x * g_share, d, Tier::kHost, u);
      tr.streamed.push_back(false);
    }
  }
  auto P = [](int64_t u) { return static_cast<PartitionId>(3 * u); };
  auto G = [](int64_t u) { return static_cast<PartitionId>(3 * u + 1); };
  auto S = [](int64_t u) { return static_cast<PartitionId>(3 * u + 2); };
  auto A = [&](int64_t u) { return static_cast<PartitionId>(3 * units + u); };

  // Compute.
  const double tokens = static_cast<double>(m.sequence) * static_cast<double>(m.micro_batch);
  const double rate = hw.gpu_flops * hw.efficiency;
  const double layer_fwd = (2.0 * static_cast<double>(m.LayerActiveMatrixParams()) * tokens +
                            4.0 * m.sequence * static_cast<double>(m.hidden) * tokens) /
                           rate / static_cast<double>(tiles);  // a unit's: a layer or a tile
  const double head_fwd = 2.0 * static_cast<double>(m.vocab) * m.hidden * tokens / rate;
  const double bwd_factor = t.activation_checkpointing ? 3 : 2;
  auto params_of = [&](int64_t u) { return tr.partitions[S(u)].elements; };
  auto cpu_opt = [&](int64_t u) { return 28.0 * params_of(u) / (hw.optimizer_bytes_per_s / n); };
  auto gpu_opt = [&](int64_t u) { return 28.0 * params_of(u) / hw.hbm_bytes_per_s; };
  const int64_t head = body;
  StepCollectives comm(m, hw, t);  // between the ranks (planner/plan_comm.h)

  std::vector<Group> after_backward;  // the optimizer's groups when it steps after backward
  for (int64_t micro = 0; micro < ga; ++micro) {
    const bool last = micro + 1 == ga;
    tr.groups.push_back({{{P(head), Tier::kDevice, false}}, 0, kForward});  // the embeddings
    tr.groups.back().before = comm.GatherEmbeddings();
    for (int64_t l = 0; l < body; ++l) {
      tr.groups.push_back({{{P(l), Tier::kDevice, false}}, layer_fwd, kForward});
      tr.groups.back().before = comm.GatherUnit(/*ahead=*/true);
    }
    tr.groups.push_back({{{P(head), Tier::kDevice, false}}, head_fwd, kForward});
    tr.groups.back().before = comm.GatherHead(/*backward=*/false);
    auto backward = [&](int64_t u, double seconds) {
      Group g{{{P(u), Tier::kDevice, false}, {G(u), Tier::kDevice, true}}, seconds, kBackward};
      if (offloaded_opt) g.gradient_ready = G(u);
      g.before = u == head ? comm.GatherHead(/*backward=*/true) : comm.GatherUnit(/*ahead=*/true);
      g.after = u == head ? comm.OuterGradients() : comm.UnitGradients();
      if (u == 0) {  // backward's end: the open bucket, waited for
        for (const Exchange& x : comm.EndBackward()) g.after.push_back(x);
      }
      tr.groups.push_back(g);
      if (!offloaded_opt) return;
      Group cpu;
      cpu.phase = kBackward;
      cpu.on_cpu = true;
      cpu.discard = G(u);
      if (!last) {  // add it into the accumulation buffer
        cpu.accesses = {{G(u), Tier::kHost, false}, {A(u), Tier::kHost, true}};
        cpu.compute_s = 3 * d * params_of(u) / (hw.optimizer_bytes_per_s / n);
        tr.groups.push_back(cpu);
        return;
      }
      cpu.accesses = {{S(u), Tier::kHost, true}, {G(u), Tier::kHost, false}};
      if (accumulate) cpu.accesses.push_back({A(u), Tier::kHost, false});
      // The new weights, into the parameters' host copies (taken from the master weights after
      // the commit instead when they are read back: below).
      if (!read_back) cpu.accesses.push_back({P(u), Tier::kHost, true});
      cpu.compute_s = cpu_opt(u);
      std::vector<Group>& into = during_backward ? tr.groups : after_backward;
      if (!during_backward) cpu.phase = kOptimizer;
      into.push_back(cpu);
      if (accumulate) {
        Group drop;
        drop.phase = cpu.phase;
        drop.on_cpu = true;
        drop.discard = A(u);
        into.push_back(drop);
      }
    };
    backward(head, 2 * head_fwd);
    for (int64_t l = body - 1; l >= 0; --l) backward(l, bwd_factor * layer_fwd);
  }
  // At the step, the gradients reduced there, the trainer waiting; then, on the CPU optimizer's
  // lane, the step (and the next forward) waits for it.
  if (std::vector<Exchange> reduce = comm.AtStep(); !reduce.empty()) {
    Group g;
    g.phase = kOptimizer;
    g.before = std::move(reduce);
    tr.groups.push_back(g);
  }
  tr.groups.insert(tr.groups.end(), after_backward.begin(), after_backward.end());
  if (offloaded_opt && read_back) {
    // After the commit, each parameter's committed state read back whole and its new weights
    // written to its partition, one at a time (the front's _refresh_weights).
    for (int64_t u = units - 1; u >= 0; --u) {
      Group g{{{S(u), Tier::kHost, false}, {P(u), Tier::kHost, true}},
              (4 + d) * params_of(u) / (hw.optimizer_bytes_per_s / n),
              kOptimizer};
      g.on_cpu = true;
      tr.groups.push_back(g);
    }
  }
  if (!offloaded_opt) {
    for (int64_t u = units - 1; u >= 0; --u) {
      Group g{
          {{S(u), Tier::kDevice, true}, {G(u), Tier::kDevice, false}, {P(u), Tier::kDevice, true}},
          gpu_opt(u),
          kOptimizer};
      g.discard = G(u);
      tr.groups.push_back(g);
    }
  }
  // After the step: the new weights of the parameters not partitioned, once the optimizer is done.
  if (std::vector<Exchange> gather = comm.AfterStep(); !gather.empty()) {
    Group g;
    g.phase = kOptimizer;
    g.waits_for_cpu = true;
    g.before = std::move(gather);
    tr.groups.push_back(g);
  }
  out.tokens_per_gpu = tokens * static_cast<double>(ga);
  return out;
}

absl::StatusOr<TimePlan> PlanTime(const Transformer& m, const Hardware& hw, const Training& t,
                                  const MemoryPlan& mem) {
  TimePlan plan;
  STRATA_ASSIGN_OR_RETURN(plan.model, ModelStep(m, hw, t, mem));
  auto step =
      PredictStep(plan.model.trace, plan.model.lanes, plan.model.budgets, plan.model.scheduler);
  if (!step.ok()) {
    return absl::Status(step.status().code(),
                        absl::StrCat("the step replay: ", step.status().message(),
                                     "; give that tier more room (strata.device_budget_bytes, "
                                     "strata.host_budget_bytes, a smaller micro-batch)"));
  }
  plan.step = *std::move(step);
  plan.comm = SumCollectives(plan.model.trace.groups);
  plan.tokens_per_s = hw.ranks() * plan.model.tokens_per_gpu / plan.step.step_s;
  plan.model_flops_per_gpu = 3 * m.ForwardFlopsPerToken() * plan.model.tokens_per_gpu;
  plan.model_tflops_per_gpu = plan.model_flops_per_gpu / plan.step.step_s / 1e12;
  return plan;
}

absl::StatusOr<Suggestion> Suggest(const Transformer& model, const Hardware& hw,
                                   const Training& base) {
  std::optional<Suggestion> best;
  int tried = 0, fitting = 0;
  const std::vector<OffloadDevice> places =
      hw.has_nvme() ? std::vector<OffloadDevice>{OffloadDevice::kNone, OffloadDevice::kCpu,
                                                 OffloadDevice::kNvme}
                    : std::vector<OffloadDevice>{OffloadDevice::kNone, OffloadDevice::kCpu};
  // (Stage 0 across ranks runs as stage 1: not tried there.)
  for (int stage = hw.ranks() > 1 ? 1 : 0; stage <= 3; ++stage) {
    for (OffloadDevice opt : places) {
      if (stage == 0 && opt != OffloadDevice::kNone) continue;
      for (OffloadDevice param : places) {
        if (stage < 3 && param != OffloadDevice::kNone) continue;
        for (int64_t micro = 1; micro <= 64; micro *= 2) {
          for (bool ckpt : {true, false}) {
            for (int64_t bucket : {int64_t{50000000}, int64_t{200000000}, int64_t{1000000000}}) {
              if (stage < 3 && bucket != 50000000) continue;  // stage 3's knob
              Training t = base;
              t.runtime.zero_stage = stage;
              t.runtime.offload_optimizer.device = opt;
              t.runtime.offload_param.device = param;
              t.runtime.stage3_prefetch_bucket_size = bucket;
              t.micro_batch = micro;
              t.activation_checkpointing = ckpt;
              Transformer m = model;
              m.micro_batch = micro;
              // With the optimizer on NVMe and the base's commit "step", strata.optimizer_commit
              // "partition" too (half the NVMe room; steps that cannot be dropped): after it, as
              // a heavier candidate.
              const bool also_each =
                  opt == OffloadDevice::kNvme && !base.runtime.optimizer_commit_each;
              for (int each = 0; each <= (also_each ? 1 : 0); ++each) {
                if (each == 1) {
                  t.runtime.optimizer_commit_auto = false;
                  t.runtime.optimizer_commit_each = true;
                }
                ++tried;
                auto mem = PlanMemory(m, hw, t);
                if (!mem.ok() || mem->overflow) continue;
                auto time = PlanTime(m, hw, t, *mem);
                if (!time.ok()) continue;
                ++fitting;
                // Candidates come lightest first (lower stages, less offloaded): a heavier one
                // must be 2% faster to replace it.
                if (!best || time->tokens_per_s > 1.02 * best->time.tokens_per_s) {
                  Training chosen = t;  // optimizer_commit "auto" answered, as it ran
                  chosen.runtime.optimizer_commit_auto = false;
                  chosen.runtime.optimizer_commit_each = mem->commit_each;
                  best = Suggestion{chosen, m, *mem, *std::move(time)};
                }
              }
            }
          }
        }
      }
    }
  }
  if (!best) {
    return absl::NotFoundError(absl::StrCat("no configuration fits: tried ", tried,
                                            " (every ZeRO stage, offload choice, micro-batch "
                                            "1-64, with and without activation checkpointing, "
                                            "both strata.optimizer_commit modes)"));
  }
  best->tried = tried;
  best->fitting = fitting;
  return *std::move(best);
}

nlohmann::json SuggestionConfig(const Suggestion& s) {
  using Json = nlohmann::json;
  const tiering::RuntimeConfig& rc = s.training.runtime;
  auto name = [](OffloadDevice d) {
    return d == OffloadDevice::kNone ? "none" : d == OffloadDevice::kCpu ? "cpu" : "nvme";
  };
  Json zero = {{"stage", rc.zero_stage}};
  if (rc.offload_optimizer.device != OffloadDevice::kNone) {
    Json o = {{"device", name(rc.offload_optimizer.device)}, {"pin_memory", true}};
    if (rc.offload_optimizer.device == OffloadDevice::kNvme) {
      o["nvme_path"] = "/local_nvme";
      o["buffer_count"] = rc.offload_optimizer.buffer_count;
    }
    zero["offload_optimizer"] = o;
  }
  if (rc.zero_stage == 3) {
    if (rc.offload_param.device != OffloadDevice::kNone) {
      Json p = {{"device", name(rc.offload_param.device)}, {"pin_memory", true}};
      if (rc.offload_param.device == OffloadDevice::kNvme) {
        p["nvme_path"] = "/local_nvme";
        p["buffer_count"] = rc.offload_param.buffer_count;
        p["buffer_size"] = rc.offload_param.buffer_size;
      }
      zero["offload_param"] = p;
    }
    zero["stage3_prefetch_bucket_size"] = rc.stage3_prefetch_bucket_size;
  }
  if (rc.sub_group_size != tiering::RuntimeConfig{}.sub_group_size) {
    zero["sub_group_size"] = rc.sub_group_size;
  }
  Json out = {{"train_micro_batch_size_per_gpu", s.training.micro_batch},
              {"gradient_accumulation_steps", s.training.gradient_accumulation},
              {"zero_optimization", zero},
              {"strata",
               {{"device", "cuda"},  // the planner's machine has GPUs
                {"device_budget_bytes", s.time.model.budgets.device},
                {"host_budget_bytes", s.time.model.budgets.host}}}};
  if (!rc.optimizer_commit_auto && rc.optimizer_commit_each)
    out["strata"]["optimizer_commit"] = "partition";
  if (s.training.dtype_bytes == 2) out[s.training.fp16 ? "fp16" : "bf16"] = {{"enabled", true}};
  return out;
}

}  // namespace strata::plan
