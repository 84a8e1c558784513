#include "tiering/runtime_config.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/config_reader.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "tiering/residency.h"

namespace strata::tiering {
namespace {

using Json = nlohmann::json;
using config::Bad;
using config::ReadBool;
using config::ReadBoolOrAuto;
using config::ReadInt;
using config::ReadString;

// DeepSpeed's own top-level keys (the names its runtime/config.py and the configs it builds read;
// a few, such as fp32_allreduce, compile and quantize_training, from releases that still read
// them): strata reads aio, zero_optimization and its strata block, and leaves the rest to the
// trainer (a warning says so). Anything else is unknown: an error naming the closest key.
const std::vector<std::string>& DeepSpeedTopLevelKeys() {
  static const std::vector<std::string> keys = {"train_batch_size",
                                                "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps",
                                                "optimizer",
                                                "scheduler",
                                                "fp16",
                                                "bf16",
                                                "bfloat16",
                                                "amp",
                                                "torch_autocast",
                                                "gradient_clipping",
                                                "prescale_gradients",
                                                "gradient_predivide_factor",
                                                "sparse_gradients",
                                                "zero_optimization",
                                                "zero_allow_untested_optimizer",
                                                "zero_force_ds_cpu_optimizer",
                                                "aio",
                                                "activation_checkpointing",
                                                "flops_profiler",
                                                "wall_clock_breakdown",
                                                "memory_breakdown",
                                                "steps_per_print",
                                                "dump_state",
                                                "tensorboard",
                                                "wandb",
                                                "csv_monitor",
                                                "comet",
                                                "comms_logger",
                                                "autotuning",
                                                "elasticity",
                                                "data_efficiency",
                                                "curriculum_learning",
                                                "data_types",
                                                "communication_data_type",
                                                "seq_parallel_comm_data_type",
                                                "compression_training",
                                                "checkpoint",
                                                "pipeline",
                                                "sparse_attention",
                                                "nebula",
                                                "disable_allgather",
                                                "dataloader_drop_last",
                                                "hybrid_engine",
                                                "timers",
                                                "eigenvalue",
                                                "quantize_training",
                                                "progressive_layer_drop",
                                                "compile",
                                                "weight_quantization",
                                                "fp32_allreduce",
                                                "graph_harvesting",
                                                "use_data_before_expert_parallelism",
                                                "tensor_parallel",
                                                "strata"};
  return keys;
}

// The stage-3 knobs strata reads, each under both of DeepSpeed's spellings (the field name and its
// stage3_ alias; DeepSpeed takes either, as one setting).
struct Stage3Knob {
  const char* alias;
  const char* field;
  int64_t RuntimeConfig::*member;
};
const std::vector<Stage3Knob>& Stage3Knobs() {
  static const std::vector<Stage3Knob> knobs = {
      {"stage3_prefetch_bucket_size", "prefetch_bucket_size",
       &RuntimeConfig::stage3_prefetch_bucket_size},
      {"stage3_max_live_parameters", "max_live_parameters",
       &RuntimeConfig::stage3_max_live_parameters},
      {"stage3_max_reuse_distance", "max_reuse_distance",
       &RuntimeConfig::stage3_max_reuse_distance},
      {"stage3_param_persistence_threshold", "param_persistence_threshold",
       &RuntimeConfig::stage3_param_persistence_threshold},
  };
  return knobs;
}

// zero_optimization keys strata reads (the rest of DeepSpeedZeroKeys is left to the trainer).
bool ReadByStrata(absl::string_view key) {
  if (key == "stage" || key == "offload_param" || key == "offload_optimizer" ||
      key == "sub_group_size") {
    return true;
  }
  for (const Stage3Knob& k : Stage3Knobs()) {
    if (key == k.alias || key == k.field) return true;
  }
  return false;
}

// DeepSpeed's zero_optimization keys (its DeepSpeedZeroConfig: field names, their stage3_ aliases
// and the deprecated names it still takes).
const std::vector<std::string>& DeepSpeedZeroKeys() {
  static const std::vector<std::string> keys = {"stage",
                                                "offload_param",
                                                "offload_optimizer",
                                                "stage3_prefetch_bucket_size",
                                                "prefetch_bucket_size",
                                                "stage3_max_live_parameters",
                                                "max_live_parameters",
                                                "stage3_max_reuse_distance",
                                                "max_reuse_distance",
                                                "stage3_param_persistence_threshold",
                                                "param_persistence_threshold",
                                                "stage3_model_persistence_threshold",
                                                "model_persistence_threshold",
                                                "stage3_gather_16bit_weights_on_model_save",
                                                "gather_16bit_weights_on_model_save",
                                                "stage3_gather_fp16_weights_on_model_save",
                                                "stage3_module_granularity_threshold",
                                                "module_granularity_threshold",
                                                "stage3_use_all_reduce_for_fetch_params",
                                                "use_all_reduce_for_fetch_params",
                                                "contiguous_gradients",
                                                "reduce_scatter",
                                                "reduce_bucket_size",
                                                "use_multi_rank_bucket_allreduce",
                                                "allgather_partitions",
                                                "allgather_bucket_size",
                                                "overlap_comm",
                                                "load_from_fp32_weights",
                                                "elastic_checkpoint",
                                                "sub_group_size",
                                                "cpu_offload",
                                                "cpu_offload_param",
                                                "cpu_offload_use_pin_memory",
                                                "ignore_unused_parameters",
                                                "legacy_stage1",
                                                "round_robin_gradients",
                                                "zero_hpz_partition_size",
                                                "zero_quantized_weights",
                                                "zero_quantized_nontrainable_weights",
                                                "zero_quantized_gradients",
                                                "zeropp_loco_param",
                                                "mics_shard_size",
                                                "mics_hierarchical_params_gather",
                                                "memory_efficient_linear",
                                                "pipeline_loading_checkpoint",
                                                "override_module_apply",
                                                "log_trace_cache_warnings"};
  return keys;
}

// DeepSpeed's keys of each offload block (DeepSpeedZeroOffloadParamConfig and
// DeepSpeedZeroOffloadOptimizerConfig; DeepSpeed refuses any other).
const std::vector<std::string>& OffloadParamKeys() {
  static const std::vector<std::string> keys = {"device",       "nvme_path",   "pin_memory",
                                                "buffer_count", "buffer_size", "max_in_cpu"};
  return keys;
}
const std::vector<std::string>& OffloadOptimizerKeys() {
  static const std::vector<std::string> keys = {"device",       "nvme_path",     "pin_memory",
                                                "buffer_count", "pipeline_read", "pipeline_write",
                                                "fast_init",    "ratio"};
  return keys;
}

// Keys strata checks but does not act on yet: each warns when present. Later work removes an
// entry when it wires the key (the optimizer step on the Runtime: offload_optimizer's; ZeRO
// across ranks: the stage). What the Runtime does read: the aio blocks, offload_param.device
// (NVMe parameters skip the host on the way down but for those within max_in_cpu),
// offload_param.max_in_cpu, offload_param.buffer_size and buffer_count
// (its staging pool), stage3_prefetch_bucket_size (the scheduler's window), the nvme_paths (the
// store's folder) and the strata block.
struct NotYetUsed {
  const char* key;
  const char* why;
};
const std::vector<NotYetUsed>& NotYetUsedKeys() {
  static const std::vector<NotYetUsed> keys = {
      {"zero_optimization.stage", "strata does not partition across ranks yet"},
      {"zero_optimization.offload_param.pin_memory", "strata's host tier is always pinned"},
      {"zero_optimization.offload_optimizer.pin_memory", "strata's host tier is always pinned"},
      {"zero_optimization.offload_optimizer.fast_init",
       "the optimizer's state is written once, by InitializeOptimizerState"},
      {"zero_optimization.offload_optimizer.ratio",
       "partial optimizer offload is not supported yet"},
  };
  return keys;
}

// Reads one offload block; `keys` are the ones DeepSpeed accepts in it (a key the block does not
// have is absent, so its reader below leaves the default).
absl::Status Offload(const Json& zero, const char* name, const std::vector<std::string>& keys,
                     OffloadConfig* out) {
  auto it = zero.find(name);
  if (it == zero.end()) return absl::OkStatus();
  const std::string block = absl::StrCat("zero_optimization.", name);
  STRATA_RETURN_IF_ERROR(config::CheckKeys(*it, block, keys));
  const std::string p = block + ".";
  std::string device = "none";
  STRATA_RETURN_IF_ERROR(ReadString(*it, p, "device", &device));
  if (device == "none") {
    out->device = OffloadDevice::kNone;
  } else if (device == "cpu") {
    out->device = OffloadDevice::kCpu;
  } else if (device == "nvme") {
    out->device = OffloadDevice::kNvme;
  } else {
    return Bad(p + "device", absl::StrCat("\"", device, "\": accepted: none, cpu, nvme"));
  }
  STRATA_RETURN_IF_ERROR(ReadString(*it, p, "nvme_path", &out->nvme_path));
  STRATA_RETURN_IF_ERROR(ReadBool(*it, p, "pin_memory", &out->pin_memory));
  STRATA_RETURN_IF_ERROR(ReadInt(*it, p, "buffer_count", 0, 1 << 20, &out->buffer_count));
  STRATA_RETURN_IF_ERROR(
      ReadInt(*it, p, "buffer_size", kMinBufferSize, kMaxBufferSize, &out->buffer_size));
  STRATA_RETURN_IF_ERROR(ReadInt(*it, p, "max_in_cpu", 0, int64_t{1} << 50, &out->max_in_cpu));
  STRATA_RETURN_IF_ERROR(ReadBool(*it, p, "pipeline_read", &out->pipeline_read));
  STRATA_RETURN_IF_ERROR(ReadBool(*it, p, "pipeline_write", &out->pipeline_write));
  STRATA_RETURN_IF_ERROR(ReadBool(*it, p, "fast_init", &out->fast_init));
  STRATA_RETURN_IF_ERROR(config::ReadNumber(*it, p, "ratio", 0, 1, &out->ratio));
  if (out->device == OffloadDevice::kNvme && out->nvme_path.empty()) {
    return Bad(p + "nvme_path", "is required when device is \"nvme\"");
  }
  return absl::OkStatus();
}

// Whether the dotted key is present in `root`.
bool Present(const Json& root, absl::string_view dotted) {
  const Json* at = &root;
  for (absl::string_view part : absl::StrSplit(dotted, '.')) {
    if (!at->is_object()) return false;
    auto it = at->find(std::string(part));
    if (it == at->end()) return false;
    at = &*it;
  }
  return true;
}

}  // namespace

int RuntimeConfig::OptimizerThreads(int cores) const {
  return optimizer_threads != 0 ? static_cast<int>(optimizer_threads) : cores;
}

int RuntimeConfig::OptimizerThreadsWhileStaging(int cores) const {
  if (optimizer_threads != 0 || !OptimizerDuringBackward()) return 0;
  return std::max(1, cores - 2);
}

std::string RuntimeConfig::SwapPath() const {
  if (!nvme_path.empty()) return nvme_path;
  if (offload_param.device == OffloadDevice::kNvme) return offload_param.nvme_path;
  if (offload_optimizer.device == OffloadDevice::kNvme) return offload_optimizer.nvme_path;
  return "";
}

int RuntimeConfig::StagingPairs() const {
  return static_cast<int>(std::max<int64_t>(1, offload_param.buffer_count / 2));
}

uint64_t RuntimeConfig::StagingBufferBytes() const {
  const uint64_t size = static_cast<uint64_t>(std::max(offload_param.buffer_size, kMinBufferSize));
  return (size + kPageBytes - 1) / kPageBytes * kPageBytes;
}

RuntimeConfig::HostMinimum RuntimeConfig::MinimumHost(uint64_t optimizer_elements, uint64_t widest,
                                                      uint64_t largest_partition_bytes,
                                                      uint64_t staged_copy_bytes,
                                                      uint64_t largest_param_bytes) const {
  auto pages = [](uint64_t bytes) { return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes; };
  HostMinimum m;
  if (!SwapPath().empty())
    m.staging = 2 * static_cast<uint64_t>(StagingPairs()) * StagingBufferBytes();
  if (offload_optimizer.device == OffloadDevice::kCpu) {
    m.optimizer = pages(12 * optimizer_elements);
  }
  m.partition = pages(largest_partition_bytes);
  if (offload_optimizer.device == OffloadDevice::kNvme && widest > 0) {
    const bool pipelined = offload_optimizer.pipeline_read || offload_optimizer.pipeline_write;
    const int ring = static_cast<int>(
        std::clamp<int64_t>(offload_optimizer.buffer_count, pipelined ? 3 : 1, 64));
    RuntimeConfig at = *this;  // "auto"'s commit at a budget this small (checked below)
    at.host_budget_bytes = m.staging + m.partition;
    bool each = at.CommitEach(12 * optimizer_elements);
    // The ring at the sub-groups the Runtime takes for the room left beside the staging buffers
    // (SubGroupFor: at most a quarter of it, at least 1024 elements): the smallest room that
    // holds that ring, the copies and the partition.
    uint64_t copies = 0;
    auto ring_bytes = [&](uint64_t room) {
      const uint64_t g = SubGroupFor(widest, ring, each, room > copies ? room - copies : 0);
      return static_cast<uint64_t>(ring) * (pages(12 * g) + (each ? pages(4 * g) : 0));
    };
    const uint64_t held = m.partition;
    auto smallest = [&](bool each_now) {  // (the room beside the staging buffers)
      each = each_now;
      copies = each ? 0 : pages(staged_copy_bytes);
      m.partition = held + (each ? pages(largest_param_bytes) : 0);
      uint64_t room = ring_bytes(0) + copies + m.partition;
      for (int i = 0; i < 64 && ring_bytes(room) + copies + m.partition > room; ++i) {
        room = ring_bytes(room) + copies + m.partition;
      }
      return std::max(room, ring_bytes(room) + copies + m.partition);
    };
    uint64_t room = smallest(each);
    at.host_budget_bytes = m.staging + room;
    if (each != at.CommitEach(12 * optimizer_elements)) {
      // At that budget "auto" answers otherwise (the state fits it: "step", with its staged
      // copies): the smallest budget is that answer's.
      room = smallest(!each);
    }
    m.optimizer = room - m.partition;
  }
  return m;
}

absl::Status RuntimeConfig::CheckStagingFits() const {
  const uint64_t staging = 2 * static_cast<uint64_t>(StagingPairs()) * StagingBufferBytes();
  if (SwapPath().empty() || staging <= host_budget_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "config: the staging buffers (", 2 * StagingPairs(), " of offload_param.buffer_size: ",
      staging, " bytes; buffer_count ", offload_param.buffer_count, " gives ", StagingPairs(),
      " pair(s), at least one) do not fit in strata.host_budget_bytes (", host_budget_bytes,
      "); lower buffer_size or buffer_count, or raise the host budget"));
}

absl::StatusOr<RuntimeConfig> RuntimeConfigFromJson(const Json& root,
                                                    std::vector<std::string>* warnings) {
  auto warn = [&](std::string w) {
    if (warnings != nullptr) warnings->push_back(std::move(w));
  };
  if (!root.is_object()) return Bad("(top level)", "the config must be a JSON object");
  for (const auto& [key, value] : root.items()) {
    const auto& known = DeepSpeedTopLevelKeys();
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      const std::string closest = config::Closest(key, known);
      return Bad(
          key, absl::StrCat("unknown key (not DeepSpeed's, not strata's)",
                            closest.empty() ? "" : absl::StrCat("; did you mean ", closest, "?")));
    }
    if (key != "aio" && key != "zero_optimization" && key != "strata") {
      warn(absl::StrCat(key, ": not used by strata (DeepSpeed's; left to the trainer)"));
    }
  }
  RuntimeConfig c;
  STRATA_ASSIGN_OR_RETURN(c.aio, aio::AioConfigFromJson(root, warnings));
  if (auto z = root.find("zero_optimization"); z != root.end()) {
    const std::string p = "zero_optimization.";
    STRATA_RETURN_IF_ERROR(config::CheckKeys(*z, "zero_optimization", DeepSpeedZeroKeys()));
    STRATA_RETURN_IF_ERROR(ReadInt(*z, p, "stage", 0, 3, &c.zero_stage));
    STRATA_RETURN_IF_ERROR(Offload(*z, "offload_param", OffloadParamKeys(), &c.offload_param));
    STRATA_RETURN_IF_ERROR(
        Offload(*z, "offload_optimizer", OffloadOptimizerKeys(), &c.offload_optimizer));
    for (const Stage3Knob& k : Stage3Knobs()) {
      if (z->contains(k.alias) && z->contains(k.field)) {
        return Bad(p + k.field, absl::StrCat("give either ", k.field, " or ", k.alias,
                                             " (DeepSpeed reads both as one setting), not both"));
      }
      const char* key = z->contains(k.field) ? k.field : k.alias;
      STRATA_RETURN_IF_ERROR(ReadInt(*z, p, key, 0, int64_t{1} << 50, &(c.*k.member)));
    }
    STRATA_RETURN_IF_ERROR(
        ReadInt(*z, p, "sub_group_size", 1, int64_t{1} << 50, &c.sub_group_size));
    for (const auto& [key, value] : z->items()) {
      if (!ReadByStrata(key)) {
        warn(absl::StrCat(p, key, ": not used by strata (DeepSpeed's; left to the trainer)"));
      }
    }
    if (c.offload_param.device != OffloadDevice::kNone && c.zero_stage != 3) {
      // DeepSpeed ignores it below stage 3, and configs shared between stages carry it.
      warn(absl::StrCat(p, "offload_param.device: ignored at stage ", c.zero_stage,
                        " (parameters are offloaded at stage 3 only)"));
      c.offload_param.device = OffloadDevice::kNone;
    }
  }
  if (auto s = root.find("strata"); s != root.end()) {
    STRATA_RETURN_IF_ERROR(config::CheckKeys(
        *s, "strata",
        {"aio", "device", "device_budget_bytes", "host_budget_bytes", "nvme_capacity_bytes",
         "nvme_keep_files", "nvme_path", "copy_bandwidth_bytes_per_s", "eviction_policy",
         "malloc_mmap_threshold_bytes", "comm_timeout_s", "comm_transport", "optimizer_threads",
         "copy_streams", "optimizer_during_backward", "optimizer_commit",
         "optimizer_read_ahead_bytes", "optimizer_write_behind", "device_index"}));
    const std::string p = "strata.";
    std::string device = "emulated";
    STRATA_RETURN_IF_ERROR(ReadString(*s, p, "device", &device));
    if (device != "emulated" && device != "cuda") {
      return Bad(p + "device", absl::StrCat("\"", device, "\": accepted: emulated, cuda"));
    }
    c.emulated_device = device == "emulated";
    if (auto d = s->find("device_index");
        d != s->end() && !(d->is_string() && d->get<std::string>() == "local_rank")) {
      if (!d->is_number_integer() || d->get<int64_t>() < 0 || d->get<int64_t>() > 1023) {
        return Bad(p + "device_index",
                   absl::StrCat(d->dump(),
                                ": accepted: \"local_rank\" (the default: the GPU "
                                "numbered LOCAL_RANK among those the process sees) or a GPU's "
                                "number, 0 to 1023"));
      }
      c.device_index = static_cast<int>(d->get<int64_t>());
    }
    constexpr int64_t kMax = int64_t{1} << 62;
    STRATA_RETURN_IF_ERROR(ReadInt(*s, p, "device_budget_bytes", 1, kMax, &c.device_budget_bytes));
    STRATA_RETURN_IF_ERROR(ReadInt(*s, p, "host_budget_bytes", 1, kMax, &c.host_budget_bytes));
    STRATA_RETURN_IF_ERROR(ReadInt(*s, p, "nvme_capacity_bytes", 1, kMax, &c.nvme_capacity_bytes));
    STRATA_RETURN_IF_ERROR(ReadBool(*s, p, "nvme_keep_files", &c.nvme_keep_files));
    STRATA_RETURN_IF_ERROR(ReadString(*s, p, "nvme_path", &c.nvme_path));
    STRATA_RETURN_IF_ERROR(
        ReadInt(*s, p, "copy_bandwidth_bytes_per_s", 0, kMax, &c.copy_bandwidth_bytes_per_s));
    STRATA_RETURN_IF_ERROR(ReadString(*s, p, "eviction_policy", &c.eviction_policy));
    STRATA_RETURN_IF_ERROR(ReadInt(*s, p, "malloc_mmap_threshold_bytes", 0, int64_t{32} << 20,
                                   &c.malloc_mmap_threshold_bytes));
    STRATA_RETURN_IF_ERROR(ReadInt(*s, p, "comm_timeout_s", 1, 7 * 24 * 3600, &c.comm_timeout_s));
    if (auto t = s->find("comm_transport"); t != s->end()) {
      c.comm_transport = t->is_string() ? t->get<std::string>() : t->dump();
    }
    if (c.comm_transport != "auto" && c.comm_transport != "shm" && c.comm_transport != "tcp") {
      return Bad(p + "comm_transport",
                 absl::StrCat("\"", c.comm_transport,
                              "\": accepted: auto (shared memory when every rank is on this "
                              "host, else TCP), shm, tcp"));
    }
    STRATA_RETURN_IF_ERROR(ReadInt(*s, p, "optimizer_threads", 0, 1024, &c.optimizer_threads));
    STRATA_RETURN_IF_ERROR(ReadInt(*s, p, "copy_streams", 1, 2, &c.copy_streams));
    STRATA_RETURN_IF_ERROR(ReadBoolOrAuto(
        *s, p, "optimizer_during_backward",
        "true where strata.device is \"cuda\" at ZeRO stage 2 or 3", &c.optimizer_during_backward));
    if (auto r = s->find("optimizer_read_ahead_bytes"); r != s->end()) {
      if (!r->is_string() || r->get<std::string>() != "auto") {
        uint64_t bytes = 0;
        if (!r->is_number() ||
            !ReadInt(*s, p, "optimizer_read_ahead_bytes", 0, kMax, &bytes).ok()) {
          return Bad(
              p + "optimizer_read_ahead_bytes",
              absl::StrCat(r->dump(), ": accepted: bytes, an integer from 0 (none) to ", kMax,
                           ", or \"auto\" (the default: an eighth of "
                           "host_budget_bytes)"));
        }
        c.optimizer_read_ahead_bytes = bytes;
      }
    }
    STRATA_RETURN_IF_ERROR(ReadBoolOrAuto(*s, p, "optimizer_write_behind",
                                          "true with optimizer_commit \"step\"",
                                          &c.optimizer_write_behind));
    std::string commit = "auto";
    if (auto it = s->find("optimizer_commit"); it != s->end()) {
      commit = it->is_string() ? it->get<std::string>() : it->dump();
    }
    if (commit != "step" && commit != "partition" && commit != "auto") {
      return Bad(p + "optimizer_commit",
                 absl::StrCat("\"", commit,
                              "\": accepted: step (a second copy of the NVMe state while a step "
                              "commits), partition (each partition's state replaced as it is "
                              "written), auto (partition where the NVMe state is larger than "
                              "host_budget_bytes, else step)"));
    }
    c.optimizer_commit_auto = commit == "auto";
    c.optimizer_commit_each = commit == "partition";
    if (c.optimizer_write_behind.value_or(false) &&
        c.offload_optimizer.device != OffloadDevice::kNvme) {
      warn(absl::StrCat(p,
                        "optimizer_write_behind: true is for optimizer state on NVMe "
                        "(offload_optimizer.device \"nvme\"); host-resident state is written "
                        "nowhere, so it does nothing here"));
    }
    if (c.optimizer_commit_each && c.optimizer_write_behind.value_or(false)) {
      return Bad(p + "optimizer_write_behind",
                 "true with optimizer_commit \"partition\" (which lands each partition's state as "
                 "it is written); accepted there: false or \"auto\"");
    }
    if (c.optimizer_commit_each && c.offload_optimizer.device != OffloadDevice::kNvme) {
      warn(absl::StrCat(p,
                        "optimizer_commit: \"partition\" is for optimizer state on NVMe "
                        "(offload_optimizer.device \"nvme\"); host-resident state steps in "
                        "place, so it does nothing here"));
    }
    if (c.eviction_policy != "trace" && c.eviction_policy != "lru") {
      return Bad(p + "eviction_policy",
                 absl::StrCat("\"", c.eviction_policy, "\": accepted: lru, trace"));
    }
  }
  for (const NotYetUsed& k : NotYetUsedKeys()) {
    if (Present(root, k.key)) {
      warn(absl::StrCat(k.key, ": accepted but not yet used by strata (", k.why, ")"));
    }
  }
  // One store per process, at SwapPath(): every nvme_path given but not used is named.
  const std::string used = c.SwapPath();
  const char* chosen_by = !c.nvme_path.empty() ? "strata.nvme_path"
                          : c.offload_param.device == OffloadDevice::kNvme
                              ? "offload_param.nvme_path; set strata.nvme_path to choose"
                              : "offload_optimizer.nvme_path; set strata.nvme_path to choose";
  for (const auto& [name, offload] :
       {std::pair<const char*, const OffloadConfig*>{"offload_param", &c.offload_param},
        {"offload_optimizer", &c.offload_optimizer}}) {
    if (offload->nvme_path.empty()) continue;
    const std::string key = absl::StrCat("zero_optimization.", name, ".nvme_path");
    if (offload->device != OffloadDevice::kNvme) {
      warn(absl::StrCat(key, " (", offload->nvme_path, ") is not used: ", name,
                        ".device is not \"nvme\""));
    } else if (offload->nvme_path != used) {
      warn(absl::StrCat(key, " (", offload->nvme_path,
                        ") is not used: strata keeps one NVMe store per process, at ", used, " (",
                        chosen_by, ")"));
    }
  }
  STRATA_RETURN_IF_ERROR(c.CheckStagingFits());
  return c;
}

absl::StatusOr<RuntimeConfig> RuntimeConfigFromJsonText(absl::string_view text,
                                                        std::vector<std::string>* warnings) {
  STRATA_ASSIGN_OR_RETURN(const Json root, config::Parse(text));
  return RuntimeConfigFromJson(root, warnings);
}

}  // namespace strata::tiering
