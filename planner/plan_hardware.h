// planner/plan_hardware.h: the planner's hardware — one node, described in JSON.
//
//   {"name": "...", "source": "where the figures come from",
//    "gpu":  {"count": 1, "hbm_gib": 80, "tflops": 312, "efficiency": 0.5, "hbm_gbps": 2039},
//    "host": {"ram_gib": 512, "cores": 64, "optimizer_gbps": 60},
//    "pcie": {"to_device_gbps": 24, "to_host_gbps": 24},
//    "nvme": {"drives": 4, "read_gbps": 6.5, "write_gbps": 5, "capacity_tb": 3.84,
//             "commit_ms": 0.05}}
//
// gpu.tflops: one GPU's dense 16-bit peak; gpu.efficiency: the fraction of it a transformer's
// kernels reach (default 0.5); gpu.hbm_gbps: HBM bandwidth, what an optimizer step on the GPU runs
// at (default 1500). host.optimizer_gbps: the CPU Adam step's memory traffic, 28 bytes
// per parameter (bench/cpu_adam's figure). pcie: one GPU's link, each direction. nvme: per drive
// (striped: the node's NVMe bandwidth is drives x each); nvme.commit_ms: a write-back's commit
// beyond its bytes, the store's syncs (default 0; tiering::MeasureCommitSeconds, which --calibrate
// runs; counted only where strata.nvme_keep_files keeps the files, the only store that syncs);
// "nvme" may be left out (no NVMe tier).
// GB are 10^9 bytes, GiB 2^30, TB 10^12. A missing key, an unknown one (named with the closest
// known), or a value of the wrong type or out of range is InvalidArgument "hardware: <key>: ...".
//
// Thread safety: plain values and pure functions.
#ifndef STRATA_PLANNER_PLAN_HARDWARE_H_
#define STRATA_PLANNER_PLAN_HARDWARE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace strata::plan {

struct Hardware {
  std::string name, source;
  int gpus = 1;
  double hbm_bytes = 0;
  double gpu_flops = 0;  // dense 16-bit peak, per second
  double efficiency = 0.5;
  double hbm_bytes_per_s = 1.5e12;
  double host_bytes = 0;
  int cores = 1;
  double optimizer_bytes_per_s = 0;
  double pcie_to_device = 0, pcie_to_host = 0;  // bytes per second, one GPU's link
  int nvme_drives = 0;                          // 0: no NVMe tier
  double nvme_read = 0, nvme_write = 0;         // bytes per second, the node's (all drives)
  double nvme_bytes = 0;                        // capacity, all drives
  double nvme_commit_s = 0;                     // a write-back's commit beyond its bytes

  bool has_nvme() const { return nvme_drives > 0; }
};

absl::StatusOr<Hardware> HardwareFromJson(const nlohmann::json& j);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_HARDWARE_H_
