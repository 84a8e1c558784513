// strata_plan: will this model fit on this machine, with this config — before buying hardware.
//
//   strata_plan --model config.json --hardware a100-80g-4nvme [--config ds_config.json]
//               [--sequence N] [--micro-batch N] [--checkpointing|--nocheckpointing] [--json F]
//               [--tile-params N]
//
// --model: a Hugging Face config.json (planner/plan_model.h lists the keys read). --hardware: a
// hardware description (planner/plan_hardware.h), a path or the name of one shipped with strata
// (tools/strata_plan/hardware/, listed by --hardware=list). --config: a strata or DeepSpeed config
// (the zero_optimization, aio and strata blocks, bf16/fp16, train_micro_batch_size_per_gpu,
// gradient_accumulation_steps); without one, stage 0 in fp32.
// Prints the bytes each tier holds (planner/plan_memory.h says what strata keeps where) and whether
// it fits, naming the first tier that does not and by how much. Exit codes: 0 it fits, 1 it does
// not, 2 bad input (a flag, a file, a key: the message names it and what is accepted).
//
// When it fits, the step is predicted (planner/plan_time.h: the step replayed through the
// scheduler's plan on modelled lanes, planner/plan_step.h): its time beside its lower bound, each
// lane's busy time and bytes, what the trainer waited on, tokens per second and model TFLOPs per
// GPU; --svg draws the predicted step's lanes.
//
// --largest names, instead of planning --model, the largest Llama-shaped model that fits with the
// config (with --suggest, with any configuration it searches), planner/plan_largest.h: its shape,
// parameters and training state beside the GPU's memory, the member one step wider and the tier
// that refuses it, bench/bigger_than_ram.py's flags to build it; --save-model writes its
// config.json. Then it is planned as a --model would be.
//
// --calibrate describes this machine by measurement instead of --hardware (calibrate.h says what
// is measured and how; --gpu-tflops and --gpu-hbm-gib are required, --sweep gives NVMe from
// aio_bench_perf_sweep's results.json): it prints the description, writes it to --save-hardware
// when given, and plans --model on it when one is given.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/config_reader.h"
#include "nlohmann/json.hpp"
#include "planner/plan_hardware.h"
#include "planner/plan_largest.h"
#include "planner/plan_memory.h"
#include "planner/plan_model.h"
#include "planner/plan_time.h"
#include "tools/aio_bench/flags.h"
#include "tools/strata_plan/calibrate.h"

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
ABSL_FLAG(int64_t, tile_params, 0,
          "memory-centric tiling: the layers' matrices cut into tiles of at most this many "
          "parameters, each lent alone, as strata.tile_linears(model, N) does (0: not tiled)");
ABSL_FLAG(bool, checkpointing, true,
          "activation checkpointing (each layer's input kept, the rest recomputed)");
ABSL_FLAG(std::string, json, "", "also write the plan as JSON here");
ABSL_FLAG(bool, suggest, false,
          "search for the fastest configuration that fits (stage, offload, micro-batch, "
          "checkpointing, prefetch bucket) and print it as a config block to paste");
ABSL_FLAG(bool, largest, false,
          "instead of --model: the largest Llama-shaped model (examples/llama.py's shape) that "
          "fits with --config (with --suggest: with any configuration searched)");
ABSL_FLAG(int64_t, vocab, 0, "with --largest: the models' vocabulary (0: Llama-2's, 32000)");
ABSL_FLAG(std::string, save_model, "", "with --largest: write its config.json here");
ABSL_FLAG(bool, calibrate, false,
          "describe this machine by measurement instead of --hardware (CPU Adam, the copy link, "
          "NVMe from --sweep); needs --gpu-tflops and --gpu-hbm-gib");
ABSL_FLAG(std::string, sweep, "",
          "with --calibrate: aio_bench_perf_sweep's results.json for the NVMe tier (none: no "
          "NVMe tier)");
ABSL_FLAG(std::string, calibrate_dir, ".",
          "with --calibrate and --sweep: a folder on the NVMe tier's file system (its capacity)");
ABSL_FLAG(std::string, calibrate_device, "emulated",
          "with --calibrate: the copy link to time: emulated (the host-emulated engine, no GPU) or "
          "cuda (GPU 0)");
ABSL_FLAG(double, gpu_tflops, 0, "with --calibrate: one GPU's dense 16-bit TFLOPS");
ABSL_FLAG(double, gpu_hbm_gib, 0, "with --calibrate: one GPU's HBM in GiB");
ABSL_FLAG(int32_t, gpus, 1, "with --calibrate: GPUs in the node");
ABSL_FLAG(std::string, save_hardware, "", "with --calibrate: also write the description here");
ABSL_FLAG(int64_t, calibrate_adam_params, int64_t{64} << 20,
          "with --calibrate: parameters in the CPU Adam step timed");
ABSL_FLAG(std::string, svg, "",
          "write a timeline of one predicted step here (SVG: a lane each for the GPU, the CPU "
          "optimizer, PCIe each way, NVMe reads and writes)");

namespace strata::plan {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kUsage =
    "strata_plan: will this model fit on this machine with this config (bytes per tier)\n\n"
    "  strata_plan --model config.json --hardware NAME|FILE [--config ds_config.json] "
    "[--suggest] [--svg F]\n"
    "  strata_plan --largest --hardware NAME|FILE [--config ds_config.json] [--suggest] "
    "[--vocab V] [--sequence N] [--save-model F]\n"
    "  strata_plan --calibrate --gpu-tflops T --gpu-hbm-gib G [--sweep results.json] "
    "[--save-hardware F] [--model config.json ...]\n\n"
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

std::string Seconds(double s) {
  return s >= 1 ? absl::StrFormat("%.2f s", s) : absl::StrFormat("%.1f ms", s * 1e3);
}

std::string XmlEscaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// One predicted step as an SVG picture: a row per lane (the collectives' only across ranks), a box
// per move or computation.
std::string TimelineSvg(const Prediction& p, const std::string& title, bool collectives) {
  constexpr double kLeft = 130, kWidth = 1000, kRow = 28, kTop = 48;
  const int lanes = collectives ? kLaneCount : kComm;
  double end = p.step_s;
  for (const Prediction::Span& s : p.timeline) end = std::max(end, s.end);
  const double scale = kWidth / std::max(end, 1e-12);
  static constexpr const char* kColors[] = {"#4c78a8", "#f58518", "#54a24b", "#b279a2",
                                            "#e45756", "#9d755d", "#72b7b2"};
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<text x=\"10\" y=\"20\" "
      "font-size=\"14\">%s</text>\n",
      kLeft + kWidth + 20, kTop + lanes * kRow + 40, XmlEscaped(title));
  for (int l = 0; l < lanes; ++l) {
    const double y = kTop + l * kRow;
    absl::StrAppendFormat(&svg,
                          "<text x=\"10\" y=\"%.0f\">%s</text>\n<rect x=\"%.0f\" y=\"%.0f\" "
                          "width=\"%.0f\" height=\"%.0f\" fill=\"#f4f4f4\"/>\n",
                          y + kRow * 0.6, LaneName(static_cast<Lane>(l)), kLeft, y + 2, kWidth,
                          kRow - 4);
  }
  for (const Prediction::Span& s : p.timeline) {
    const double x = kLeft + std::max(0.0, s.start) * scale;
    const double w = std::max(0.5, (s.end - std::max(0.0, s.start)) * scale);
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.2f\" y=\"%.0f\" width=\"%.2f\" height=\"%.0f\" "
                          "fill=\"%s\"><title>partition %d: %s to %s</title></rect>\n",
                          x, kTop + static_cast<int>(s.lane) * kRow + 4, w, kRow - 8,
                          kColors[s.lane], static_cast<int>(s.id), Seconds(s.start),
                          Seconds(s.end));
  }
  const double step_x = kLeft + p.step_s * scale;
  absl::StrAppendFormat(&svg,
                        "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" "
                        "stroke=\"black\" stroke-dasharray=\"4\"/>\n<text x=\"%.1f\" "
                        "y=\"%.0f\">step ends: %s (lower bound %s)</text>\n</svg>\n",
                        step_x, kTop - 6, step_x, kTop + lanes * kRow, kLeft,
                        kTop + lanes * kRow + 24, Seconds(p.step_s), Seconds(p.bound.seconds()));
  return svg;
}

void WriteFile(const std::string& flag, const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  if (!f) Fail(absl::StrCat("--", flag, ": cannot write ", path));
}

// What the step's lower bound says bounds it (its largest term).
std::string BoundBy(const Bound& b, LinkKind link) {
  switch (b.limit) {
    case kGpu:
      return link == LinkKind::kLoopback && b.comm_s > 0
                 ? "the GPU's compute and the collectives (on the same cores)"
                 : "the GPU's compute";
    case kCpu:
      return "the CPU optimizer";
    case kToDevice:
    case kToHost:
      return "PCIe between host and GPU";
    case kNvmeRead:
    case kNvmeWrite:
      return "the NVMe drives";
    case kComm:
      return "the collectives between the ranks";
    case kLaneCount:
      break;
  }
  return "?";
}

// Across ranks: the collectives' bytes and time a step, the links they took, what bounds the step.
void PrintCollectives(const Hardware& hw, const TimePlan& time) {
  const CommTotals& c = time.comm;
  const Prediction& p = time.step;
  std::printf(
      "collectives across %d ranks, each rank's a step: %s on the wire (all-gathers %s, "
      "reduce-scatters %s), %d collectives, %s on the links (the trainer waited %s on them, "
      "%s of it the ranks agreeing at the step)\n",
      hw.ranks(), Gb(c.bytes()).c_str(), Gb(c.gathered_bytes).c_str(),
      Gb(c.scattered_bytes).c_str(), c.gathers + c.scatters, Seconds(c.seconds).c_str(),
      Seconds(p.waits_s[kComm]).c_str(), Seconds(c.agree_s).c_str());
  std::printf("links: %s between a node's GPUs, %.2f GB/s bus, %.0f us a collective%s%s%s\n",
              LinkKindName(hw.link_kind), hw.link_bus_bytes_per_s / 1e9, hw.link_latency_s * 1e6,
              hw.link_sync_s > 0
                  ? absl::StrFormat(", %.0f us more a rendezvous", hw.link_sync_s * 1e6).c_str()
                  : "",
              hw.link_assumed ? " (no gpu_link in the description: PCIe's figures assumed)" : "",
              hw.nodes > 1 ? absl::StrFormat("; the network between %d nodes %.1f GB/s a node, "
                                             "%.0f us",
                                             hw.nodes, hw.network_bytes_per_s / 1e9,
                                             hw.network_latency_s * 1e6)
                                 .c_str()
                           : "");
  std::printf("bound by: %s (the largest term of the lower bound)\n",
              BoundBy(p.bound, hw.link_kind).c_str());
}

Json BytesJson(const Bytes& b) {
  return {{"params", b.params},           {"grads", b.grads},     {"optimizer", b.optimizer},
          {"activations", b.activations}, {"staging", b.staging}, {"total", b.total()}};
}

// --largest: the search's answer printed (and its config.json written with --save-model); the
// member's config.json, planned next as a --model is.
Json LargestModel(const Hardware& hw, const Training& training) {
  LargestOptions o;
  if (absl::GetFlag(FLAGS_vocab) != 0) o.vocab = absl::GetFlag(FLAGS_vocab);
  o.sequence = absl::GetFlag(FLAGS_sequence) > 0 ? absl::GetFlag(FLAGS_sequence) : 2048;
  o.suggest = absl::GetFlag(FLAGS_suggest);
  auto found = FindLargest(hw, training, o);
  if (!found.ok() && found.status().code() == absl::StatusCode::kNotFound) {
    std::printf("--largest: %s\n", std::string(found.status().message()).c_str());
    std::exit(1);
  }
  if (!found.ok()) Fail(std::string(found.status().message()));
  const double state = TrainingStateBytes(found->model, found->training);
  const double gpu = hw.hbm_bytes * hw.ranks();
  std::printf(
      "--largest: the largest LlamaForCausalLM of examples/llama.py's shape that fits with %s "
      "(%d planned): %lld wide, %lld layers, %lld heads, vocabulary %lld: %.2fB parameters "
      "(%lld)\n",
      o.suggest ? "the configuration --suggest finds" : "this config", found->tried,
      static_cast<long long>(found->width), static_cast<long long>(found->layers),
      static_cast<long long>(found->heads), static_cast<long long>(o.vocab),
      found->model.TotalParams() / 1e9, static_cast<long long>(found->model.TotalParams()));
  std::printf(
      "--largest: its training state (weights and gradients in the training dtype%s, Adam's "
      "moments) %s = %.2fx the GPUs' memory (%s)%s\n",
      found->training.dtype_bytes == 4 ? "" : ", fp32 master weights", Gb(state).c_str(),
      state / gpu, Gb(gpu).c_str(),
      state >= 1.5 * gpu ? ""
      : state > gpu      ? ": beyond it, but not by 1.5x: with this config, the host memory and "
                           "disk allow no more"
                         : ": within it: with this config the other tiers add nothing beyond "
                           "the GPU's memory");
  if (found->wider_refused.has_value()) {
    const auto& r = *found->wider_refused;
    std::printf(
        "--largest: the next, %lld wide, does not fit%s: the %s tier needs %s of its %s%s\n",
        static_cast<long long>(found->width + 256),
        o.suggest ? " (no configuration searched fits; with the config given" : "", r.tier.c_str(),
        Gb(r.need).c_str(), Gb(r.have).c_str(), o.suggest ? ")" : "");
  } else {
    std::printf("--largest: the widest tried fits (the family's end, not the machine's)\n");
  }
  std::printf(
      "--largest: built by bench/bigger_than_ram.py --layers %lld --width %lld --heads %lld "
      "--vocab %lld --context %lld\n\n",
      static_cast<long long>(found->layers), static_cast<long long>(found->width),
      static_cast<long long>(found->heads), static_cast<long long>(o.vocab),
      static_cast<long long>(o.sequence));
  if (!absl::GetFlag(FLAGS_save_model).empty()) {
    WriteFile("save-model", absl::GetFlag(FLAGS_save_model), found->hf_config.dump(2) + "\n");
  }
  return found->hf_config;
}

int Main() {
  if (absl::GetFlag(FLAGS_hardware) == "list") {
    for (const std::string& n : ShippedNames()) std::printf("%s\n", n.c_str());
    return 0;
  }
  std::string hw_path;
  Json hw_json;
  Json model_json;
  const bool largest = absl::GetFlag(FLAGS_largest);
  if (largest && !absl::GetFlag(FLAGS_model).empty()) {
    aio_bench::BadFlag("--model", "not with --largest, which names the model");
  }
  if (!largest) {
    for (const auto& [name, given] : std::vector<std::pair<const char*, bool>>{
             {"--vocab", absl::GetFlag(FLAGS_vocab) != 0},
             {"--save-model", !absl::GetFlag(FLAGS_save_model).empty()}}) {
      if (given) aio_bench::BadFlag(name, "only with --largest");
    }
  }
  if (!absl::GetFlag(FLAGS_model).empty()) {
    model_json = ReadJsonFile("model", absl::GetFlag(FLAGS_model));  // before any measuring
  }
  if (!absl::GetFlag(FLAGS_calibrate)) {
    // A flag of --calibrate's given without it would be ignored: refuse it instead.
    for (const auto& [name, given] : std::vector<std::pair<const char*, bool>>{
             {"--sweep", !absl::GetFlag(FLAGS_sweep).empty()},
             {"--save-hardware", !absl::GetFlag(FLAGS_save_hardware).empty()},
             {"--gpu-tflops", absl::GetFlag(FLAGS_gpu_tflops) != 0},
             {"--gpu-hbm-gib", absl::GetFlag(FLAGS_gpu_hbm_gib) != 0},
             {"--gpus", absl::GetFlag(FLAGS_gpus) != 1},
             {"--calibrate-dir", absl::GetFlag(FLAGS_calibrate_dir) != "."},
             {"--calibrate-device", absl::GetFlag(FLAGS_calibrate_device) != "emulated"},
             {"--calibrate-adam-params",
              absl::GetFlag(FLAGS_calibrate_adam_params) != int64_t{64} << 20}}) {
      if (given) aio_bench::BadFlag(name, "only with --calibrate");
    }
  }
  if (absl::GetFlag(FLAGS_calibrate)) {
    if (!absl::GetFlag(FLAGS_hardware).empty()) {
      aio_bench::BadFlag("--hardware", "not with --calibrate, which measures this machine");
    }
    const std::string device = absl::GetFlag(FLAGS_calibrate_device);
    if (device != "emulated" && device != "cuda") {
      aio_bench::BadFlag("--calibrate-device", "emulated or cuda");
    }
    plan_tool::CalibrateOptions o;
    o.sweep_results = absl::GetFlag(FLAGS_sweep);
    o.dir = absl::GetFlag(FLAGS_calibrate_dir);
    o.cuda = device == "cuda";
    o.gpus = absl::GetFlag(FLAGS_gpus);
    o.gpu_tflops = absl::GetFlag(FLAGS_gpu_tflops);
    o.gpu_hbm_gib = absl::GetFlag(FLAGS_gpu_hbm_gib);
    o.adam_params = static_cast<uint64_t>(absl::GetFlag(FLAGS_calibrate_adam_params));
    auto measured = plan_tool::CalibrateHardware(o);
    if (!measured.ok()) Fail(absl::StrCat("--calibrate: ", measured.status().message()));
    hw_json = *measured;
    hw_path = "--calibrate";
    std::printf("%s\n", hw_json.dump(2).c_str());
    if (!absl::GetFlag(FLAGS_save_hardware).empty()) {
      WriteFile("save-hardware", absl::GetFlag(FLAGS_save_hardware), hw_json.dump(2) + "\n");
    }
    if (absl::GetFlag(FLAGS_model).empty() && !largest) return 0;
  } else {
    if (absl::GetFlag(FLAGS_model).empty() && !largest)
      aio_bench::BadFlag("--model", "required: a Hugging Face config.json (or --largest)");
    if (absl::GetFlag(FLAGS_hardware).empty()) {
      aio_bench::BadFlag("--hardware",
                         "required: a description's path or a shipped name (or --calibrate)");
    }
    hw_path = HardwarePath(absl::GetFlag(FLAGS_hardware));
    hw_json = ReadJsonFile("hardware", hw_path);
  }
  auto hw = HardwareFromJson(hw_json);
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
  if (largest) model_json = LargestModel(*hw, *training);
  auto model =
      TransformerFromHfConfig(model_json, absl::GetFlag(FLAGS_sequence), training->micro_batch);
  if (!model.ok()) Fail(absl::StrCat(absl::GetFlag(FLAGS_model), ": ", model.status().message()));
  model->tile_params = absl::GetFlag(FLAGS_tile_params);
  auto plan = PlanMemory(*model, *hw, *training);
  if (!plan.ok()) Fail(std::string(plan.status().message()));
  for (const std::string& w : warnings) std::fprintf(stderr, "strata_plan: note: %s\n", w.c_str());
  std::optional<Json> suggested;
  // No config and the default (ZeRO stage 0, nothing offloaded) does not fit: the search runs as
  // with --suggest, so that the answer says what does fit.
  const bool search_for_one = absl::GetFlag(FLAGS_config).empty() && plan->overflow.has_value();
  if (search_for_one && !absl::GetFlag(FLAGS_suggest)) {
    std::printf(
        "no --config: the default (ZeRO stage 0, nothing offloaded) does not fit: the %s tier "
        "needs %s of its %s. The fastest configuration that fits, as --suggest finds it:\n\n",
        plan->overflow->tier.c_str(), Gb(plan->overflow->need).c_str(),
        Gb(plan->overflow->have).c_str());
  }
  if (absl::GetFlag(FLAGS_suggest) || search_for_one) {
    auto s = Suggest(*model, *hw, *training);
    if (!s.ok()) {
      std::printf("--suggest: %s\n", std::string(s.status().message()).c_str());
      return 1;
    }
    std::printf("--suggest: the fastest of %d configurations that fit (%d tried):\n\n", s->fitting,
                s->tried);
    *model = s->model;
    *training = s->training;
    *plan = s->memory;
    suggested = SuggestionConfig(*s);
  }

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
  std::printf("hardware: %s (%s%d GPU x %s HBM, %s host RAM, %s)\n",
              hw->name.empty() ? hw_path.c_str() : hw->name.c_str(),
              hw->nodes > 1 ? absl::StrCat(hw->nodes, " nodes x ").c_str() : "", hw->gpus,
              Gb(hw->hbm_bytes).c_str(), Gb(hw->host_bytes).c_str(),
              hw->has_nvme()
                  ? absl::StrCat(hw->nvme_drives, " NVMe drives, ", Gb(hw->nvme_bytes)).c_str()
                  : "no NVMe");
  std::printf(
      "config: ZeRO stage %d%s, %s, offload_param %s, offload_optimizer %s, activation "
      "checkpointing %s\n\n",
      rc.zero_stage,
      training->StageRun(hw->ranks()) != rc.zero_stage ? " (run as stage 1 across ranks)" : "",
      training->dtype_bytes == 2 ? "16-bit" : "fp32", where(rc.offload_param.device),
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
  const auto& least = plan->host_minimum;
  std::printf(
      "smallest strata.host_budget_bytes of a process: %s (staging buffers %s, the optimizer's "
      "room at its smallest %s, the largest gradient partition and what goes beside it %s)\n",
      Gb(least.total()).c_str(), Gb(least.staging).c_str(), Gb(least.optimizer).c_str(),
      Gb(least.partition).c_str());
  if (plan->overflow) {
    std::printf("DOES NOT FIT: the %s tier needs %s of its %s (%s over)\n",
                plan->overflow->tier.c_str(), Gb(plan->overflow->need).c_str(),
                Gb(plan->overflow->have).c_str(),
                Gb(plan->overflow->need - plan->overflow->have).c_str());
  } else {
    std::printf("FITS\n");
  }
  std::optional<TimePlan> time;
  if (!plan->overflow) {
    auto t = PlanTime(*model, *hw, *training, *plan);
    if (!t.ok()) {
      std::printf("\nthe step is not predicted: %s\n", std::string(t.status().message()).c_str());
    } else {
      time = *std::move(t);
      const Prediction& p = time->step;
      std::printf(
          "\npredicted step (steady state, the scheduler planning): %s; lower bound %s "
          "(%.2fx)\n",
          Seconds(p.step_s).c_str(), Seconds(p.bound.seconds()).c_str(),
          p.step_s / p.bound.seconds());
      std::printf("%-16s %12s %8s %12s %14s\n", "lane", "busy", "of step", "moved",
                  "trainer waited");
      const bool across = hw->ranks() > 1;  // the collectives' lane is used
      for (int l = 0; l < (across ? kLaneCount : kComm); ++l) {
        std::printf("%-16s %12s %7.0f%% %12s %14s\n", LaneName(static_cast<Lane>(l)),
                    Seconds(p.busy_s[l]).c_str(), 100 * p.busy_s[l] / p.step_s,
                    l <= kCpu ? "" : Gb(p.bytes[l]).c_str(),
                    p.waits_s[l] > 0 ? Seconds(p.waits_s[l]).c_str() : "");
      }
      if (across) PrintCollectives(*hw, *time);
      std::printf(
          "throughput: %.0f tokens/s for the job (%lld per GPU per step), %.1f model TFLOPs per "
          "GPU (%.0f%% of its peak)\n",
          time->tokens_per_s, static_cast<long long>(time->model.tokens_per_gpu),
          time->model_tflops_per_gpu, 100 * time->model_tflops_per_gpu * 1e12 / hw->gpu_flops);
      if (const std::string svg = absl::GetFlag(FLAGS_svg); !svg.empty()) {
        WriteFile("svg", svg,
                  TimelineSvg(p,
                              absl::StrFormat("%s on %s: one predicted step", model->name,
                                              hw->name.empty() ? hw_path : hw->name),
                              hw->ranks() > 1));
      }
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_json); !out.empty()) {
    Json j = {{"model",
               {{"name", model->name},
                {"parameters", model->TotalParams()},
                {"tile_params", model->tile_params}}},
              {"hardware", hw->name.empty() ? hw_path : hw->name},
              {"device", BytesJson(plan->device)},
              {"host", BytesJson(plan->host)},
              {"nvme", BytesJson(plan->nvme)},
              {"activations_checkpointed", plan->activations_checkpointed},
              {"activations_full", plan->activations_full},
              {"host_minimum_bytes", plan->host_minimum.total()},
              {"fits", !plan->overflow.has_value()}};
    if (plan->overflow) {
      j["overflow"] = {{"tier", plan->overflow->tier},
                       {"need", plan->overflow->need},
                       {"have", plan->overflow->have}};
    }
    if (time) {
      const Prediction& p = time->step;
      Json lanes = Json::object();
      for (int l = 0; l < (hw->ranks() > 1 ? kLaneCount : kComm); ++l) {
        lanes[LaneName(static_cast<Lane>(l))] = {
            {"busy_s", p.busy_s[l]}, {"bytes", p.bytes[l]}, {"trainer_waited_s", p.waits_s[l]}};
      }
      j["step"] = {{"seconds", p.step_s},
                   {"lower_bound_seconds", p.bound.seconds()},
                   {"lanes", lanes},
                   {"tokens_per_s", time->tokens_per_s},
                   {"model_flops_per_gpu", time->model_flops_per_gpu},
                   {"model_tflops_per_gpu", time->model_tflops_per_gpu}};
      if (hw->ranks() > 1) {
        const CommTotals& c = time->comm;
        j["step"]["collectives"] = {{"ranks", hw->ranks()},
                                    {"bytes_per_rank", c.bytes()},
                                    {"all_gather_bytes", c.gathered_bytes},
                                    {"reduce_scatter_bytes", c.scattered_bytes},
                                    {"all_gathers", c.gathers},
                                    {"reduce_scatters", c.scatters},
                                    {"seconds", c.seconds},
                                    {"agree_seconds", c.agree_s},
                                    {"link", LinkKindName(hw->link_kind)},
                                    {"link_assumed", hw->link_assumed}};
        j["step"]["bound_by"] = BoundBy(p.bound, hw->link_kind);
      }
    }
    WriteFile("json", out, j.dump(2) + "\n");
  }
  if (suggested) {
    const std::string tiled =
        model->tile_params > 0 ? absl::StrCat("; the model tiled, as strata.tile_linears(model, ",
                                              model->tile_params, ") does")
                               : "";
    std::printf(
        "\nthe suggested config (activation checkpointing %s: it is the model code's "
        "choice, not a config key%s):\n%s\n",
        training->activation_checkpointing ? "on" : "off", tiled.c_str(),
        suggested->dump(2).c_str());
  }
  return plan->overflow ? 1 : 0;
}

}  // namespace
}  // namespace strata::plan

int main(int argc, char** argv) {
  strata::aio_bench::ParseFlagsOrExit(argc, argv, strata::plan::kUsage, "strata_plan",
                                      {{"sequence", 0, 1 << 24},
                                       {"micro_batch", 0, 1 << 20},
                                       {"tile_params", 0, int64_t{1} << 50},
                                       {"gpu_tflops", 0, 1e6},
                                       {"gpu_hbm_gib", 0, 1e6},
                                       {"gpus", 1, 1024},
                                       {"calibrate_adam_params", 1 << 16, int64_t{1} << 32},
                                       {"vocab", 0, 1 << 24}});
  return strata::plan::Main();
}
