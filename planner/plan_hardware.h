// planner/plan_hardware.h: the planner's hardware — a node (or `nodes` alike), described in JSON.
//
//   {"name": "...", "source": "where the figures come from",
//    "gpu":  {"count": 1, "hbm_gib": 80, "tflops": 312, "efficiency": 0.5, "hbm_gbps": 2039},
//    "host": {"ram_gib": 512, "cores": 64, "optimizer_gbps": 60},
//    "pcie": {"to_device_gbps": 24, "to_host_gbps": 24},
//    "nvme": {"drives": 4, "read_gbps": 6.5, "write_gbps": 5, "capacity_tb": 3.84,
//             "commit_ms": 0.05},
//    "gpu_link": {"kind": "nvlink", "bus_gbps": 120, "latency_us": 10, "sync_us": 0},
//    "nodes": 2, "network": {"gbps": 100, "latency_us": 5}}
//
// gpu.tflops: one GPU's dense 16-bit peak; gpu.efficiency: the fraction of it a transformer's
// kernels reach (default 0.5); gpu.hbm_gbps: HBM bandwidth, what an optimizer step on the GPU runs
// at (default 1500). host.optimizer_gbps: the CPU Adam step's memory traffic, 28 bytes
// per parameter (bench/cpu_adam's figure). pcie: one GPU's link, each direction. nvme: per drive
// (striped: the node's NVMe bandwidth is drives x each); nvme.commit_ms: a write-back's commit
// beyond its bytes, the store's syncs (default 0; tiering::MeasureCommitSeconds, which --calibrate
// runs; counted only where strata.nvme_keep_files keeps the files, the only store that syncs);
// "nvme" may be left out (no NVMe tier).
// The links the ranks' collectives take (planner/plan_comm.h; one rank per GPU): gpu_link, between
// the GPUs of a node: kind "nvlink", "pcie" or "loopback" (ranks as processes of one machine, their
// collectives over TCP through its kernel, as Gloo on loopback: they run on the cores the ranks
// compute on, so they never overlap the ranks' compute); bus_gbps, a ring collective's bus
// bandwidth (NCCL's convention, as nccl-tests and bench/comm print it: (n - 1) / n of the buffer
// each rank moves, over the time); latency_us, each collective's fixed cost; sync_us (default 0),
// what a rendezvous of the ranks costs beyond it where they reach it from computing (the skew of
// their compute, a waiting process's wake-up), which strata pays once a collective
// (planner/plan_comm.h). Without gpu_link, a node of several GPUs is taken to connect them over
// PCIe (kind "pcie", bus_gbps the smaller of pcie's two directions, latency_us 20) and
// `link_assumed` says so. nodes (default 1): the description is of one node, and that many alike
// train together; with more than one, network (required then) is what joins them: gbps, each node's
// network bandwidth (all its NICs), and latency_us, what it adds to each collective.
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

enum class LinkKind { kNvlink, kPcie, kLoopback };
const char* LinkKindName(LinkKind kind);  // "nvlink", "pcie", "loopback"

struct Hardware {
  std::string name, source;
  int gpus = 1;   // per node
  int nodes = 1;  // alike, each of `gpus` ranks
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
  // Between the GPUs of a node (gpu_link), and between nodes (network; with nodes > 1).
  LinkKind link_kind = LinkKind::kPcie;
  double link_bus_bytes_per_s = 0, link_latency_s = 0, link_sync_s = 0;
  bool link_assumed = false;  // gpu_link not given: PCIe's figures taken (see above)
  double network_bytes_per_s = 0, network_latency_s = 0;

  bool has_nvme() const { return nvme_drives > 0; }
  // The data-parallel ranks: one per GPU, over every node.
  int ranks() const { return gpus * nodes; }
  // A ring collective over every rank: its bus bandwidth, bytes per second (within a node the
  // link's; across nodes the smaller of it and a node's network, which each ring crosses once per
  // node and direction), and its fixed cost, seconds (the link's, plus the network's across nodes).
  double CollectiveBusBytesPerS() const;
  double CollectiveLatencyS() const;
  // A rendezvous of every rank reached from compute: the latency and the link's sync_us.
  double RendezvousS() const { return CollectiveLatencyS() + link_sync_s; }
};

absl::StatusOr<Hardware> HardwareFromJson(const nlohmann::json& j);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_HARDWARE_H_
