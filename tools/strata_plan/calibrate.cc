#include "tools/strata_plan/calibrate.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "aio/engine.h"
#include "base/status.h"
#include "optim_cpu/adam.h"
#include "planner/plan_hardware.h"
#include "tiering/link_bandwidth.h"
#include "tiering/nvme_store.h"

namespace strata::plan_tool {
namespace {

using Json = nlohmann::json;

// The CPU Adam step's bytes per second: bf16 gradients in, bf16 parameter copies out, fp32
// parameters and moments updated in place (28 bytes per parameter).
absl::StatusOr<double> AdamBytesPerSecond(uint64_t n) {
  STRATA_ASSIGN_OR_RETURN(auto adam, optim_cpu::CpuAdam::Create(optim_cpu::AdamConfig{}));
  std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  std::vector<uint16_t> grad(n, 0x3c00), copy(n);  // bf16 0.0078125
  optim_cpu::AdamChunk chunk;
  chunk.param = p.data();
  chunk.grad = grad.data();
  chunk.grad_dtype = optim_cpu::DType::kBF16;
  chunk.exp_avg = m.data();
  chunk.exp_avg_sq = v.data();
  chunk.param_copy = copy.data();
  chunk.copy_dtype = optim_cpu::DType::kBF16;
  chunk.size = n;
  std::vector<double> rates;
  for (int64_t t = 1; t <= 4; ++t) {  // the first touches the pages
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(adam->Step(t, chunk).status());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t > 1) rates.push_back(28.0 * static_cast<double>(n) / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];  // the median of three
}

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char day[16];
  std::strftime(day, sizeof day, "%Y-%m-%d", std::gmtime(&now));
  return day;
}

}  // namespace

absl::StatusOr<std::pair<double, double>> NvmeFromSweep(const Json& results) {
  auto gbps = [&](const char* op) -> absl::StatusOr<double> {
    const Json::json_pointer at(absl::StrCat("/best/", op, "/result/gb_per_s/median"));
    if (!results.contains(at) || !results.at(at).is_number() || results.at(at).get<double>() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("best.", op,
                       ".result.gb_per_s.median: missing or not a positive number (accepted: "
                       "aio_bench_perf_sweep's results.json, whose best ",
                       op, " point was measured)"));
    }
    return results.at(at).get<double>() * 1e9;
  };
  STRATA_ASSIGN_OR_RETURN(const double read, gbps("read"));
  STRATA_ASSIGN_OR_RETURN(const double write, gbps("write"));
  return std::make_pair(read, write);
}

absl::StatusOr<Json> CalibrateHardware(const CalibrateOptions& o) {
  if (o.gpu_tflops <= 0 || o.gpu_hbm_gib <= 0) {
    return absl::InvalidArgumentError(
        "--gpu-tflops and --gpu-hbm-gib: both required and positive with --calibrate (strata "
        "does not time the GPU's compute; give one GPU's dense 16-bit TFLOPS and its HBM in GiB)");
  }
  if (o.gpus < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--gpus is ", o.gpus, "; at least 1"));
  }
  std::optional<std::pair<double, double>> nvme;
  std::vector<std::string> sweep_warnings;
  if (!o.sweep_results.empty()) {
    std::error_code ec;
    std::ifstream in;
    if (std::filesystem::is_regular_file(o.sweep_results, ec)) in.open(o.sweep_results);
    if (!in.is_open() || !in) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sweep ", o.sweep_results,
          ": cannot read (accepted: the results.json file in aio_bench_perf_sweep's --out "
          "folder)"));
    }
    const Json results = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (results.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sweep ", o.sweep_results,
                       ": not JSON (accepted: aio_bench_perf_sweep's results.json)"));
    }
    auto picked = NvmeFromSweep(results);
    if (!picked.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(o.sweep_results, ": ", picked.status().message()));
    }
    nvme = *picked;
    if (results.contains("warnings") && results["warnings"].is_array()) {
      for (const Json& w : results["warnings"]) {
        if (w.is_string()) sweep_warnings.push_back(w.get<std::string>());
      }
    }
  }
  const double ram = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  // The cores this process may run on (taskset, a container's cpuset), as the optimizer's pool.
  cpu_set_t allowed;
  const int cores = sched_getaffinity(0, sizeof allowed, &allowed) == 0
                        ? std::max(1, CPU_COUNT(&allowed))
                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  STRATA_ASSIGN_OR_RETURN(const double adam, AdamBytesPerSecond(o.adam_params));
  STRATA_ASSIGN_OR_RETURN(const tiering::LinkBandwidth link, tiering::MeasureLinkBandwidth(o.cuda));
  std::string source = absl::StrFormat(
      "measured by strata_plan --calibrate on %s: host RAM from the OS, cores this process may "
      "use; CPU Adam %.1f "
      "GB/s (28 B/param, %llu parameters, median of 3); the copy link %s, %.1f GB/s to the device "
      "and %.1f to the host",
      Today(), adam / 1e9, static_cast<unsigned long long>(o.adam_params),
      o.cuda ? "timed on the CUDA copy engine (pinned host <-> GPU 0)"
             : "timed on the host-emulated copy engine, uncapped (memcpy's speed, one thread for "
               "both directions: no GPU was used)",
      link.to_device / 1e9, link.to_host / 1e9);
  double commit_s = 0;
  if (nvme) {
    // A write-back's commit in the store (its syncs), timed in the NVMe tier's file system.
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<aio::Engine> engine,
                            aio::Engine::Create(aio::AioConfig{}));
    STRATA_ASSIGN_OR_RETURN(
        commit_s, tiering::MeasureCommitSeconds(
                      absl::StrCat(o.dir, "/strata-commit-probe-", getpid()), engine.get()));
    absl::StrAppendFormat(&source,
                          "; NVMe %.2f GB/s read, %.2f write from %s (one drive; capacity: the "
                          "space available under %s); a write-back's commit %.2f ms (the "
                          "store's syncs: the median of 9 Puts of 4 KiB under %s)",
                          nvme->first / 1e9, nvme->second / 1e9, o.sweep_results, o.dir,
                          commit_s * 1e3, o.dir);
    for (const std::string& w : sweep_warnings) {
      absl::StrAppend(&source, "; the sweep warned: ", w);
    }
  } else {
    source += "; no NVMe tier (no sweep results given)";
  }
  absl::StrAppendFormat(&source, "; given: %d GPU(s) of %g GiB HBM at %g TFLOPS", o.gpus,
                        o.gpu_hbm_gib, o.gpu_tflops);
  Json j = {
      {"name", absl::StrCat("this machine (calibrated ", Today(), ")")},
      {"source", source},
      {"gpu", {{"count", o.gpus}, {"hbm_gib", o.gpu_hbm_gib}, {"tflops", o.gpu_tflops}}},
      {"host", {{"ram_gib", ram / (1 << 30)}, {"cores", cores}, {"optimizer_gbps", adam / 1e9}}},
      {"pcie", {{"to_device_gbps", link.to_device / 1e9}, {"to_host_gbps", link.to_host / 1e9}}}};
  if (nvme) {
    std::error_code ec;
    const auto space = std::filesystem::space(o.dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("--calibrate-dir ", o.dir, ": ", ec.message()));
    }
    j["nvme"] = {{"drives", 1},
                 {"read_gbps", nvme->first / 1e9},
                 {"write_gbps", nvme->second / 1e9},
                 {"capacity_tb", static_cast<double>(space.available) / 1e12},
                 {"commit_ms", commit_s * 1e3}};
  }
  // What --hardware would refuse is refused here, before it is saved.
  if (auto hw = plan::HardwareFromJson(j); !hw.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the measured description is not one the planner accepts: ", hw.status().message()));
  }
  return j;
}

}  // namespace strata::plan_tool
