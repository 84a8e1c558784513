#include "planner/plan_hardware.h"

#include <algorithm>
#include <optional>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/config_reader.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::plan {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("hardware: ", key, ": ", what));
}

// The config reader's errors say "config: "; a hardware file's say "hardware: ".
absl::Status AsHardware(absl::Status s) {
  if (s.ok()) return s;
  std::string m(s.message());
  if (m.rfind("config: ", 0) == 0) m = m.substr(8);
  return absl::InvalidArgumentError(absl::StrCat("hardware: ", m));
}

absl::StatusOr<const Json*> Block(const Json& j, const char* name, bool required,
                                  const std::vector<std::string>& keys) {
  auto it = j.find(name);
  if (it == j.end()) {
    if (!required) return nullptr;
    return Bad(name, absl::StrCat("missing; an object with the keys ", absl::StrJoin(keys, ", ")));
  }
  if (!it->is_object()) return Bad(name, absl::StrCat(it->dump(), " is not an object"));
  if (absl::Status s = config::CheckKeys(*it, name, keys); !s.ok()) return AsHardware(s);
  return &*it;
}

// block[key] in [lo, hi] (an integer for an integral T, the config reader's rule); required
// unless `fallback` is given.
template <typename T>
absl::StatusOr<T> Field(const Json& block, const char* block_name, const char* key, T lo, T hi,
                        std::optional<T> fallback) {
  const std::string prefix = absl::StrCat(block_name, ".");
  if (!block.contains(key)) {
    if (fallback) return *fallback;
    return Bad(absl::StrCat(prefix, key),
               absl::StrCat("missing; ", std::is_integral_v<T> ? "an integer" : "a number", " in [",
                            lo, ", ", hi, "]"));
  }
  T v{};
  absl::Status s;
  if constexpr (std::is_integral_v<T>) {
    s = config::ReadInt(block, prefix, key, lo, hi, &v);
  } else {
    s = config::ReadNumber(block, prefix, key, lo, hi, &v);
  }
  if (!s.ok()) return AsHardware(s);
  return v;
}
absl::StatusOr<double> Number(const Json& block, const char* block_name, const char* key, double lo,
                              double hi, std::optional<double> fallback) {
  return Field<double>(block, block_name, key, lo, hi, fallback);
}
absl::StatusOr<int> Count(const Json& block, const char* block_name, const char* key, int lo,
                          int hi, std::optional<int> fallback) {
  return Field<int>(block, block_name, key, lo, hi, fallback);
}

// The links between GPUs (gpu_link) and between nodes (nodes, network) into `h`, whose gpu and
// pcie blocks are read.
absl::Status ReadLinks(const Json& j, Hardware& h) {
  const Json* link = nullptr;
  STRATA_ASSIGN_OR_RETURN(
      link, Block(j, "gpu_link", false, {"kind", "bus_gbps", "latency_us", "sync_us"}));
  if (link == nullptr) {
    // The GPUs of a node talk over PCIe (through the host's root complex or a PCIe switch): what
    // every multi-GPU machine has; NVLink must be said.
    h.link_assumed = h.gpus > 1;
    h.link_kind = LinkKind::kPcie;
    h.link_bus_bytes_per_s = std::min(h.pcie_to_device, h.pcie_to_host);
    h.link_latency_s = 20e-6;
  } else {
    const auto kind = link->find("kind");
    static constexpr LinkKind kKinds[] = {LinkKind::kNvlink, LinkKind::kPcie, LinkKind::kLoopback};
    const LinkKind* found = nullptr;
    if (kind != link->end() && kind->is_string()) {
      for (const LinkKind& k : kKinds) {
        if (kind->get<std::string>() == LinkKindName(k)) found = &k;
      }
    }
    if (found == nullptr) {
      return Bad("gpu_link.kind",
                 absl::StrCat(kind == link->end() ? "missing" : kind->dump() + " is not accepted",
                              "; accepted: \"nvlink\", \"pcie\" or \"loopback\""));
    }
    h.link_kind = *found;
    double bus_gbps = 0, latency_us = 0;
    STRATA_ASSIGN_OR_RETURN(bus_gbps,
                            Number(*link, "gpu_link", "bus_gbps", 0.001, 1e5, std::nullopt));
    STRATA_ASSIGN_OR_RETURN(latency_us,
                            Number(*link, "gpu_link", "latency_us", 0, 1e6, std::nullopt));
    double sync_us = 0;
    STRATA_ASSIGN_OR_RETURN(sync_us, Number(*link, "gpu_link", "sync_us", 0, 1e6, 0.0));
    h.link_bus_bytes_per_s = bus_gbps * 1e9;
    h.link_latency_s = latency_us / 1e6;
    h.link_sync_s = sync_us / 1e6;
  }
  if (absl::Status s = config::ReadInt(j, "", "nodes", 1, 1 << 16, &h.nodes); !s.ok()) {
    return AsHardware(s);
  }
  const Json* network = nullptr;
  STRATA_ASSIGN_OR_RETURN(network, Block(j, "network", h.nodes > 1, {"gbps", "latency_us"}));
  if (network != nullptr) {
    double gbps = 0, latency_us = 0;
    STRATA_ASSIGN_OR_RETURN(gbps, Number(*network, "network", "gbps", 0.001, 1e5, std::nullopt));
    STRATA_ASSIGN_OR_RETURN(latency_us,
                            Number(*network, "network", "latency_us", 0, 1e6, std::nullopt));
    h.network_bytes_per_s = gbps * 1e9;
    h.network_latency_s = latency_us / 1e6;
  }
  return absl::OkStatus();
}

}  // namespace

const char* LinkKindName(LinkKind kind) {
  switch (kind) {
    case LinkKind::kNvlink:
      return "nvlink";
    case LinkKind::kPcie:
      return "pcie";
    case LinkKind::kLoopback:
      return "loopback";
  }
  return "?";
}

double Hardware::CollectiveBusBytesPerS() const {
  return nodes > 1 ? std::min(link_bus_bytes_per_s, network_bytes_per_s) : link_bus_bytes_per_s;
}

double Hardware::CollectiveLatencyS() const {
  return link_latency_s + (nodes > 1 ? network_latency_s : 0);
}

absl::StatusOr<Hardware> HardwareFromJson(const Json& j) {
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        "hardware: the description must be a JSON object with the blocks gpu, host, pcie and "
        "(optionally) nvme, gpu_link, network");
  }
  if (absl::Status s = config::CheckKeys(
          j, "hardware",
          {"name", "source", "gpu", "host", "pcie", "nvme", "gpu_link", "nodes", "network"});
      !s.ok()) {
    return AsHardware(s);
  }
  Hardware h;
  for (const char* text : {"name", "source"}) {
    if (auto it = j.find(text); it != j.end()) {
      if (!it->is_string()) return Bad(text, absl::StrCat(it->dump(), " is not a string"));
      (std::string(text) == "name" ? h.name : h.source) = it->get<std::string>();
    }
  }
  const Json* gpu = nullptr;
  STRATA_ASSIGN_OR_RETURN(
      gpu, Block(j, "gpu", true, {"count", "hbm_gib", "tflops", "efficiency", "hbm_gbps"}));
  STRATA_ASSIGN_OR_RETURN(h.gpus, Count(*gpu, "gpu", "count", 1, 1024, 1));
  double hbm_gib = 0, tflops = 0;
  STRATA_ASSIGN_OR_RETURN(hbm_gib, Number(*gpu, "gpu", "hbm_gib", 0.25, 1 << 20, std::nullopt));
  STRATA_ASSIGN_OR_RETURN(tflops, Number(*gpu, "gpu", "tflops", 0.001, 1e6, std::nullopt));
  STRATA_ASSIGN_OR_RETURN(h.efficiency, Number(*gpu, "gpu", "efficiency", 0.01, 1, 0.5));
  double hbm_gbps = 0;
  STRATA_ASSIGN_OR_RETURN(hbm_gbps, Number(*gpu, "gpu", "hbm_gbps", 1, 1e6, 1500.0));
  h.hbm_bytes_per_s = hbm_gbps * 1e9;
  h.hbm_bytes = hbm_gib * (1 << 30);
  h.gpu_flops = tflops * 1e12;

  const Json* host = nullptr;
  STRATA_ASSIGN_OR_RETURN(host, Block(j, "host", true, {"ram_gib", "cores", "optimizer_gbps"}));
  double ram_gib = 0, opt_gbps = 0;
  STRATA_ASSIGN_OR_RETURN(ram_gib, Number(*host, "host", "ram_gib", 0.25, 1 << 24, std::nullopt));
  STRATA_ASSIGN_OR_RETURN(h.cores, Count(*host, "host", "cores", 1, 1 << 16, 1));
  STRATA_ASSIGN_OR_RETURN(opt_gbps,
                          Number(*host, "host", "optimizer_gbps", 0.001, 1e5, std::nullopt));
  h.host_bytes = ram_gib * (1 << 30);
  h.optimizer_bytes_per_s = opt_gbps * 1e9;

  const Json* pcie = nullptr;
  STRATA_ASSIGN_OR_RETURN(pcie, Block(j, "pcie", true, {"to_device_gbps", "to_host_gbps"}));
  double down = 0, up = 0;
  STRATA_ASSIGN_OR_RETURN(down, Number(*pcie, "pcie", "to_device_gbps", 0.001, 1e5, std::nullopt));
  STRATA_ASSIGN_OR_RETURN(up, Number(*pcie, "pcie", "to_host_gbps", 0.001, 1e5, std::nullopt));
  h.pcie_to_device = down * 1e9;
  h.pcie_to_host = up * 1e9;

  const Json* nvme = nullptr;
  STRATA_ASSIGN_OR_RETURN(
      nvme,
      Block(j, "nvme", false, {"drives", "read_gbps", "write_gbps", "capacity_tb", "commit_ms"}));
  if (nvme != nullptr) {
    double read = 0, write = 0, tb = 0;
    STRATA_ASSIGN_OR_RETURN(h.nvme_drives, Count(*nvme, "nvme", "drives", 1, 1024, 1));
    STRATA_ASSIGN_OR_RETURN(read, Number(*nvme, "nvme", "read_gbps", 0.001, 1e4, std::nullopt));
    STRATA_ASSIGN_OR_RETURN(write, Number(*nvme, "nvme", "write_gbps", 0.001, 1e4, std::nullopt));
    STRATA_ASSIGN_OR_RETURN(tb, Number(*nvme, "nvme", "capacity_tb", 0.001, 1e6, std::nullopt));
    h.nvme_read = read * 1e9 * h.nvme_drives;
    h.nvme_write = write * 1e9 * h.nvme_drives;
    h.nvme_bytes = tb * 1e12 * h.nvme_drives;
    double commit_ms = 0;
    STRATA_ASSIGN_OR_RETURN(commit_ms, Number(*nvme, "nvme", "commit_ms", 0, 1000, 0.0));
    h.nvme_commit_s = commit_ms / 1e3;
  }
  STRATA_RETURN_IF_ERROR(ReadLinks(j, h));
  return h;
}

}  // namespace strata::plan
