// tools/strata_plan/calibrate.h: a hardware description (planner/plan_hardware.h) of this machine,
// measured — strata_plan --calibrate.
//
// What is measured, and how: the host's memory and cores (the OS's counts); the CPU optimizer's
// bandwidth, a CPU Adam step (optim_cpu, bf16 gradients in and bf16 parameters out, 28 bytes per
// parameter as bench/cpu_adam counts it) over `adam_params` parameters (64M by default, as
// bench/cpu_adam: a working set far beyond the caches), the median of three; the copy
// link, each way (tiering/link_bandwidth.h: the CUDA copy engine when `cuda`, else the
// host-emulated engine uncapped, which is memcpy's speed and not a PCIe link — said in "source");
// NVMe, the best read and write GB/s of aio_bench_perf_sweep's results.json (its "best" picks),
// counted as one drive, its capacity the space available under `dir`, a write-back's commit
// timed there (tiering::MeasureCommitSeconds), the sweep's own warnings
// (a buffered or memory-backed run) carried into "source". Not measured (strata
// times no GEMM): the GPU's count, HBM and dense 16-bit TFLOPS, taken from the options.
//
// Thread safety: a free function; it runs the measurements one after another.
#ifndef STRATA_TOOLS_STRATA_PLAN_CALIBRATE_H_
#define STRATA_TOOLS_STRATA_PLAN_CALIBRATE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace strata::plan_tool {

struct CalibrateOptions {
  std::string sweep_results;  // aio_bench_perf_sweep's results.json; empty: no NVMe tier
  std::string dir = ".";      // the NVMe tier's file system, for its capacity and commit
  bool cuda = false;          // time the CUDA copy engine (GPU 0), else the host-emulated one
  int gpus = 1;
  double gpu_hbm_gib = 0, gpu_tflops = 0;  // required (> 0)
  uint64_t adam_params = uint64_t{64} << 20;
};

// NVMe's best read and write, bytes per second, from a sweep's results.json. InvalidArgument
// naming the key when the file lacks best.read.result.gb_per_s.median or its write twin.
absl::StatusOr<std::pair<double, double>> NvmeFromSweep(const nlohmann::json& results);

// The description, as JSON that plan::HardwareFromJson reads (checked with it).
// InvalidArgument for bad options (named) or a description it would refuse; the measurements' own
// errors otherwise.
absl::StatusOr<nlohmann::json> CalibrateHardware(const CalibrateOptions& options);

}  // namespace strata::plan_tool

#endif  // STRATA_TOOLS_STRATA_PLAN_CALIBRATE_H_
