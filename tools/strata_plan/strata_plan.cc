// strata_plan: will this model fit on this machine, with this config — before buying hardware.
//
//   strata_plan --model config.json --hardware a100-80g-4nvme [--config ds_config.json]
//               [--sequence N] [--micro-batch N] [--checkpointing|--nocheckpointing] [--json F]
//
// --model: a Hugging Face config.json (sched/plan_model.h lists the keys read). --hardware: a
// hardware description (sched/plan_hardware.h), a path or the name of one shipped with strata
// (tools/strata_plan/hardware/, listed by --hardware=list). --config: a strata or DeepSpeed config
// (the zero_optimization, aio and strata blocks, bf16/fp16, train_micro_batch_size_per_gpu,
// gradient_accumulation_steps); without one, stage 0 in fp32.
// Prints the bytes each tier holds (sched/plan_memory.h says what strata keeps where) and whether
// it fits, naming the first tier that does not and by how much. Exit codes: 0 it fits, 1 it does
// not, 2 bad input (a flag, a file, a key: the message names it and what is accepted).
//
// This version answers "will it fit"; predicting the step's time is not in it yet.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/config_reader.h"
#include "nlohmann/json.hpp"
#include "sched/plan_hardware.h"
#include "sched/plan_memory.h"
#include "sched/plan_model.h"
#include "tools/aio_bench/flags.h"

ABSL_FLAG(std::string, model, "", "the model: a Hugging Face config.json (required)");
ABSL_FLAG(std::string, hardware, "",
          "the hardware: a description's path, or a shipped one's name (--hardware=list names "
          "them) (required)");
ABSL_FLAG(std::string, config, "",
          "a strata or DeepSpeed config (JSON); none: stage 0, fp32, micro-batch 1");
ABSL_FLAG(int64_t, sequence, 0, "tokens per sequence (0: the model's own, capped at 2048)");
ABSL_FLAG(int64_t, micro_batch, 0,
          "sequences per GPU per micro-step (0: the config's train_micro_batch_size_per_gpu, "
          "else 1)");
ABSL_FLAG(bool, checkpointing, true,
          "activation checkpointing (each layer's input kept, the rest recomputed)");
ABSL_FLAG(std::string, json, "", "also write the plan as JSON here");

namespace strata::sched::plan {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kUsage =
    "strata_plan: will this model fit on this machine with this config (bytes per tier)\n\n"
    "  strata_plan --model config.json --hardware NAME|FILE [--config ds_config.json]\n\n"
    "Exit codes: 0 it fits, 1 it does not, 2 bad input.";

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "strata_plan: %s\n", what.c_str());
  std::exit(2);
}

std::vector<fs::path> HardwareDirs() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("STRATA_PLAN_HARDWARE_DIR")) dirs.emplace_back(env);
  dirs.emplace_back(STRATA_PLAN_HARDWARE_DIR);  // the source tree's
  dirs.emplace_back(STRATA_PLAN_INSTALLED_HARDWARE_DIR);
  return dirs;
}

std::vector<std::string> ShippedNames() {
  std::vector<std::string> names;
  for (const fs::path& dir : HardwareDirs()) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
    }
    if (!names.empty()) break;
  }
  std::sort(names.begin(), names.end());
  return names;
}

Json ReadJsonFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) Fail(absl::StrCat("--", flag, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  auto j = config::Parse(text.str());
  if (!j.ok()) Fail(absl::StrCat("--", flag, " ", path, ": ", j.status().message()));
  return *j;
}

std::string HardwarePath(const std::string& given) {
  if (given.find('/') != std::string::npos || given.ends_with(".json")) return given;
  for (const fs::path& dir : HardwareDirs()) {
    const fs::path p = dir / (given + ".json");
    if (fs::exists(p)) return p.string();
  }
  std::vector<std::string> names = ShippedNames();
  const std::string closest = config::Closest(given, names);
  Fail(absl::StrCat("--hardware: no shipped description named ", given,
                    "; shipped: ", absl::StrJoin(names, ", "),
                    closest.empty() ? "" : absl::StrCat(" (did you mean ", closest, "?)"),
                    "; or give a file's path"));
}

std::string Gb(double bytes) { return absl::StrFormat("%.2f GB", bytes / 1e9); }

Json BytesJson(const Bytes& b) {
  return {{"params", b.params},           {"grads", b.grads},     {"optimizer", b.optimizer},
          {"activations", b.activations}, {"staging", b.staging}, {"total", b.total()}};
}

int Main() {
  if (absl::GetFlag(FLAGS_hardware) == "list") {
    for (const std::string& n : ShippedNames()) std::printf("%s\n", n.c_str());
    return 0;
  }
  if (absl::GetFlag(FLAGS_model).empty())
    aio_bench::BadFlag("--model", "required: a Hugging Face config.json");
  if (absl::GetFlag(FLAGS_hardware).empty()) {
    aio_bench::BadFlag("--hardware", "required: a description's path or a shipped name");
  }
  const Json model_json = ReadJsonFile("model", absl::GetFlag(FLAGS_model));
  const std::string hw_path = HardwarePath(absl::GetFlag(FLAGS_hardware));
  auto hw = HardwareFromJson(ReadJsonFile("hardware", hw_path));
  if (!hw.ok()) Fail(absl::StrCat(hw_path, ": ", hw.status().message()));
  std::vector<std::string> warnings;
  Json config_json = Json::object();
  if (!absl::GetFlag(FLAGS_config).empty()) {
    config_json = ReadJsonFile("config", absl::GetFlag(FLAGS_config));
  }
  auto training = TrainingFromConfig(config_json, &warnings);
  if (!training.ok()) Fail(absl::StrCat("--config: ", training.status().message()));
  if (absl::GetFlag(FLAGS_micro_batch) > 0)
    training->micro_batch = absl::GetFlag(FLAGS_micro_batch);
  training->activation_checkpointing = absl::GetFlag(FLAGS_checkpointing);
  auto model =
      TransformerFromHfConfig(model_json, absl::GetFlag(FLAGS_sequence), training->micro_batch);
  if (!model.ok()) Fail(absl::StrCat(absl::GetFlag(FLAGS_model), ": ", model.status().message()));
  auto plan = PlanMemory(*model, *hw, *training);
  if (!plan.ok()) Fail(std::string(plan.status().message()));
  for (const std::string& w : warnings) std::fprintf(stderr, "strata_plan: note: %s\n", w.c_str());

  const tiering::RuntimeConfig& rc = training->runtime;
  auto where = [](tiering::OffloadDevice d) {
    return d == tiering::OffloadDevice::kNone  ? "none"
           : d == tiering::OffloadDevice::kCpu ? "cpu"
                                               : "nvme";
  };
  std::printf(
      "model: %s, %.2fB parameters (%lld layers, hidden %lld, %lld heads, vocabulary "
      "%lld), sequence %lld x micro-batch %lld\n",
      model->name.c_str(), model->TotalParams() / 1e9, static_cast<long long>(model->layers),
      static_cast<long long>(model->hidden), static_cast<long long>(model->heads),
      static_cast<long long>(model->vocab), static_cast<long long>(model->sequence),
      static_cast<long long>(model->micro_batch));
  std::printf("hardware: %s (%d GPU x %s HBM, %s host RAM, %s)\n",
              hw->name.empty() ? hw_path.c_str() : hw->name.c_str(), hw->gpus,
              Gb(hw->hbm_bytes).c_str(), Gb(hw->host_bytes).c_str(),
              hw->has_nvme()
                  ? absl::StrCat(hw->nvme_drives, " NVMe drives, ", Gb(hw->nvme_bytes)).c_str()
                  : "no NVMe");
  std::printf(
      "config: ZeRO stage %d, %s, offload_param %s, offload_optimizer %s, activation "
      "checkpointing %s\n\n",
      rc.zero_stage, training->dtype_bytes == 2 ? "16-bit" : "fp32", where(rc.offload_param.device),
      where(rc.offload_optimizer.device), training->activation_checkpointing ? "on" : "off");
  std::printf("%-8s %12s %12s %12s %12s %12s %12s %12s\n", "tier", "params", "grads", "optimizer",
              "activations", "staging", "total", "capacity");
  const struct {
    const char* name;
    const Bytes& b;
    double have;
  } rows[] = {{"device", plan->device, hw->hbm_bytes},
              {"host", plan->host, hw->host_bytes},
              {"nvme", plan->nvme, hw->nvme_bytes}};
  for (const auto& r : rows) {
    std::printf("%-8s %12s %12s %12s %12s %12s %12s %12s\n", r.name, Gb(r.b.params).c_str(),
                Gb(r.b.grads).c_str(), Gb(r.b.optimizer).c_str(), Gb(r.b.activations).c_str(),
                Gb(r.b.staging).c_str(), Gb(r.b.total()).c_str(), Gb(r.have).c_str());
  }
  std::printf(
      "\n(device: per GPU; host and nvme: the node's. Activations per GPU: %s with "
      "checkpointing, %s without. Not counted: the CUDA context and workspace, the "
      "trainer process's own host memory.)\n",
      Gb(plan->activations_checkpointed).c_str(), Gb(plan->activations_full).c_str());
  if (plan->overflow) {
    std::printf("DOES NOT FIT: the %s tier needs %s of its %s (%s over)\n",
                plan->overflow->tier.c_str(), Gb(plan->overflow->need).c_str(),
                Gb(plan->overflow->have).c_str(),
                Gb(plan->overflow->need - plan->overflow->have).c_str());
  } else {
    std::printf("FITS\n");
  }
  if (const std::string out = absl::GetFlag(FLAGS_json); !out.empty()) {
    Json j = {{"model", {{"name", model->name}, {"parameters", model->TotalParams()}}},
              {"hardware", hw->name.empty() ? hw_path : hw->name},
              {"device", BytesJson(plan->device)},
              {"host", BytesJson(plan->host)},
              {"nvme", BytesJson(plan->nvme)},
              {"activations_checkpointed", plan->activations_checkpointed},
              {"activations_full", plan->activations_full},
              {"fits", !plan->overflow.has_value()}};
    if (plan->overflow) {
      j["overflow"] = {{"tier", plan->overflow->tier},
                       {"need", plan->overflow->need},
                       {"have", plan->overflow->have}};
    }
    std::ofstream f(out);
    f << j.dump(2) << "\n";
    if (!f) Fail(absl::StrCat("--json: cannot write ", out));
  }
  return plan->overflow ? 1 : 0;
}

}  // namespace
}  // namespace strata::sched::plan

int main(int argc, char** argv) {
  strata::aio_bench::ParseFlagsOrExit(argc, argv, strata::sched::plan::kUsage, "strata_plan",
                                      {{"sequence", 0, 1 << 24}, {"micro_batch", 0, 1 << 20}});
  return strata::sched::plan::Main();
}
