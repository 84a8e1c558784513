#include "tiering/runtime_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::tiering {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("config: ", key, ": ", what));
}

absl::Status OnlyKeys(const Json& block, absl::string_view name,
                      const std::vector<std::string>& accepted) {
  if (!block.is_object())
    return Bad(name, absl::StrCat("must be a JSON object, got ", block.dump()));
  for (const auto& [key, value] : block.items()) {
    if (std::find(accepted.begin(), accepted.end(), key) == accepted.end()) {
      return Bad(absl::StrCat(name, ".", key),
                 absl::StrCat("unknown key; accepted keys: ", absl::StrJoin(accepted, ", ")));
    }
  }
  return absl::OkStatus();
}

// An integer (or an integral float, as DeepSpeed writes 1e8) in [lo, hi].
template <typename T>
absl::Status Int(const Json& block, absl::string_view prefix, const char* key, int64_t lo,
                 int64_t hi, T* out) {
  auto it = block.find(key);
  if (it == block.end()) return absl::OkStatus();
  const std::string name = absl::StrCat(prefix, key);
  double v = 0;
  if (it->is_number_integer()) {
    v = static_cast<double>(it->get<int64_t>());
  } else if (it->is_number_float() && std::floor(it->get<double>()) == it->get<double>()) {
    v = it->get<double>();
  } else {
    return Bad(name, absl::StrCat("must be an integer in [", lo, ", ", hi, "], got ", it->dump()));
  }
  if (v < static_cast<double>(lo) || v > static_cast<double>(hi)) {
    return Bad(name, absl::StrCat("must be in [", lo, ", ", hi, "], got ", it->dump()));
  }
  *out = static_cast<T>(v);
  return absl::OkStatus();
}

absl::Status Bool(const Json& block, absl::string_view prefix, const char* key, bool* out) {
  auto it = block.find(key);
  if (it == block.end()) return absl::OkStatus();
  if (!it->is_boolean()) {
    return Bad(absl::StrCat(prefix, key), absl::StrCat("must be a JSON boolean, got ", it->dump()));
  }
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status String(const Json& block, absl::string_view prefix, const char* key,
                    std::string* out) {
  auto it = block.find(key);
  if (it == block.end()) return absl::OkStatus();
  if (!it->is_string()) {
    return Bad(absl::StrCat(prefix, key), absl::StrCat("must be a string, got ", it->dump()));
  }
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status Offload(const Json& zero, const char* name, OffloadConfig* out) {
  auto it = zero.find(name);
  if (it == zero.end()) return absl::OkStatus();
  const std::string block = absl::StrCat("zero_optimization.", name);
  STRATA_RETURN_IF_ERROR(
      OnlyKeys(*it, block,
               {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                "pipeline_read", "pipeline_write", "pipeline", "fast_init", "ratio"}));
  const std::string p = block + ".";
  std::string device = "none";
  STRATA_RETURN_IF_ERROR(String(*it, p, "device", &device));
  if (device == "none") {
    out->device = OffloadDevice::kNone;
  } else if (device == "cpu") {
    out->device = OffloadDevice::kCpu;
  } else if (device == "nvme") {
    out->device = OffloadDevice::kNvme;
  } else {
    return Bad(p + "device", absl::StrCat("\"", device, "\": accepted: none, cpu, nvme"));
  }
  STRATA_RETURN_IF_ERROR(String(*it, p, "nvme_path", &out->nvme_path));
  STRATA_RETURN_IF_ERROR(Bool(*it, p, "pin_memory", &out->pin_memory));
  STRATA_RETURN_IF_ERROR(Int(*it, p, "buffer_count", 1, 1 << 20, &out->buffer_count));
  STRATA_RETURN_IF_ERROR(Int(*it, p, "buffer_size", 1, int64_t{1} << 40, &out->buffer_size));
  STRATA_RETURN_IF_ERROR(Int(*it, p, "max_in_cpu", 0, int64_t{1} << 50, &out->max_in_cpu));
  STRATA_RETURN_IF_ERROR(Bool(*it, p, "pipeline_read", &out->pipeline_read));
  STRATA_RETURN_IF_ERROR(Bool(*it, p, "pipeline_write", &out->pipeline_write));
  bool pipeline = false;
  STRATA_RETURN_IF_ERROR(Bool(*it, p, "pipeline", &pipeline));
  if (pipeline) out->pipeline_read = out->pipeline_write = true;
  STRATA_RETURN_IF_ERROR(Bool(*it, p, "fast_init", &out->fast_init));
  if (auto r = it->find("ratio"); r != it->end()) {
    if (!r->is_number() || r->get<double>() <= 0 || r->get<double>() > 1) {
      return Bad(p + "ratio", absl::StrCat("must be a number in (0, 1], got ", r->dump()));
    }
    out->ratio = r->get<double>();
  }
  if (out->device == OffloadDevice::kNvme && out->nvme_path.empty()) {
    return Bad(p + "nvme_path", "is required when device is \"nvme\"");
  }
  return absl::OkStatus();
}

}  // namespace

std::string RuntimeConfig::SwapPath() const {
  if (!nvme_path.empty()) return nvme_path;
  if (offload_optimizer.device == OffloadDevice::kNvme) return offload_optimizer.nvme_path;
  if (offload_param.device == OffloadDevice::kNvme) return offload_param.nvme_path;
  return "";
}

absl::StatusOr<RuntimeConfig> RuntimeConfigFromJson(const Json& root,
                                                    std::vector<std::string>* warnings) {
  auto warn = [&](std::string w) {
    if (warnings != nullptr) warnings->push_back(std::move(w));
  };
  if (!root.is_object()) return Bad("(top level)", "the config must be a JSON object");
  RuntimeConfig c;
  STRATA_ASSIGN_OR_RETURN(c.aio, aio::AioConfigFromJson(root, warnings));
  for (const auto& [key, value] : root.items()) {
    if (key != "aio" && key != "zero_optimization" && key != "strata") {
      warn(absl::StrCat(key, ": not used by strata (DeepSpeed's; left to the trainer)"));
    }
  }
  if (auto z = root.find("zero_optimization"); z != root.end()) {
    if (!z->is_object()) return Bad("zero_optimization", "must be a JSON object");
    const std::string p = "zero_optimization.";
    STRATA_RETURN_IF_ERROR(Int(*z, p, "stage", 0, 3, &c.zero_stage));
    STRATA_RETURN_IF_ERROR(Offload(*z, "offload_param", &c.offload_param));
    STRATA_RETURN_IF_ERROR(Offload(*z, "offload_optimizer", &c.offload_optimizer));
    STRATA_RETURN_IF_ERROR(Int(*z, p, "stage3_prefetch_bucket_size", 0, int64_t{1} << 50,
                               &c.stage3_prefetch_bucket_size));
    STRATA_RETURN_IF_ERROR(Int(*z, p, "stage3_max_live_parameters", 0, int64_t{1} << 50,
                               &c.stage3_max_live_parameters));
    STRATA_RETURN_IF_ERROR(
        Int(*z, p, "stage3_max_reuse_distance", 0, int64_t{1} << 50, &c.stage3_max_reuse_distance));
    const std::vector<std::string> read = {"stage",
                                           "offload_param",
                                           "offload_optimizer",
                                           "stage3_prefetch_bucket_size",
                                           "stage3_max_live_parameters",
                                           "stage3_max_reuse_distance"};
    for (const auto& [key, value] : z->items()) {
      if (std::find(read.begin(), read.end(), key) == read.end()) {
        warn(absl::StrCat(p, key, ": not used by strata (DeepSpeed's; left to the trainer)"));
      }
    }
    if (c.offload_param.device != OffloadDevice::kNone && c.zero_stage != 3) {
      return Bad(p + "offload_param",
                 absl::StrCat("parameter offload needs stage 3, the stage is ", c.zero_stage));
    }
  }
  if (auto s = root.find("strata"); s != root.end()) {
    STRATA_RETURN_IF_ERROR(OnlyKeys(
        *s, "strata",
        {"aio", "device", "device_budget_bytes", "host_budget_bytes", "nvme_capacity_bytes",
         "nvme_path", "copy_bandwidth_bytes_per_s", "eviction_policy"}));
    const std::string p = "strata.";
    std::string device = "emulated";
    STRATA_RETURN_IF_ERROR(String(*s, p, "device", &device));
    if (device != "emulated" && device != "cuda") {
      return Bad(p + "device", absl::StrCat("\"", device, "\": accepted: emulated, cuda"));
    }
    c.emulated_device = device == "emulated";
    constexpr int64_t kMax = int64_t{1} << 56;
    STRATA_RETURN_IF_ERROR(Int(*s, p, "device_budget_bytes", 1, kMax, &c.device_budget_bytes));
    STRATA_RETURN_IF_ERROR(Int(*s, p, "host_budget_bytes", 1, kMax, &c.host_budget_bytes));
    STRATA_RETURN_IF_ERROR(Int(*s, p, "nvme_capacity_bytes", 1, kMax, &c.nvme_capacity_bytes));
    STRATA_RETURN_IF_ERROR(String(*s, p, "nvme_path", &c.nvme_path));
    STRATA_RETURN_IF_ERROR(
        Int(*s, p, "copy_bandwidth_bytes_per_s", 0, kMax, &c.copy_bandwidth_bytes_per_s));
    STRATA_RETURN_IF_ERROR(String(*s, p, "eviction_policy", &c.eviction_policy));
    if (c.eviction_policy != "trace" && c.eviction_policy != "lru") {
      return Bad(p + "eviction_policy",
                 absl::StrCat("\"", c.eviction_policy, "\": accepted: trace, lru"));
    }
  }
  return c;
}

absl::StatusOr<RuntimeConfig> RuntimeConfigFromJsonText(absl::string_view text,
                                                        std::vector<std::string>* warnings) {
  Json root = Json::parse(text.begin(), text.end(), nullptr, false);
  if (root.is_discarded()) return Bad("(top level)", "not valid JSON");
  return RuntimeConfigFromJson(root, warnings);
}

}  // namespace strata::tiering
