// cpu_adam: strata's CPU AdamW against a bandwidth kernel of the same shape on the same data and
// threads (reads p, g, m, v and writes p, m, v in place with trivial arithmetic; with bf16
// gradients and a bf16 copy out it reads a bf16 g and writes a bf16 copy too), interleaved, and
// against torch.optim.AdamW (the project's pinned torch, foreach on and off) as a peer when
// present. See shared BENCH.md.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "aio/buffer.h"
#include "bench/common/report.h"
#include "nlohmann/json.hpp"
#include "optim_cpu/adam.h"
#include "tools/aio_bench/flags.h"
#include "tools/aio_bench/scratch.h"

ABSL_FLAG(int64_t, params, int64_t{1} << 26, "parameters");
ABSL_FLAG(int, rounds, 5, "measured rounds after one warm-up round");
ABSL_FLAG(std::string, threads, "", "thread counts (default: 1 and all cores)");
ABSL_FLAG(std::string, torch_python, ".venv/bin/python",
          "python with torch for the peer row (default: the project's environment, from the "
          "repository root) "
          "(empty: no peer)");
ABSL_FLAG(std::string, json, "", "write the report here");
ABSL_FLAG(int, accuracy_steps, 300, "steps of the bf16-moments accuracy experiment (0: skip)");

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
using optim_cpu::DType;

// The ceiling: the same bytes as an fp32 Adam step, trivial arithmetic.
void BandwidthF32(float* p, const float* g, float* m, float* v, size_t b, size_t e) {
  for (size_t i = b; i < e; ++i) {
    const float gi = g[i];
    m[i] += gi;
    v[i] += gi;
    p[i] += 1e-3f * gi;
  }
}

// With a bf16 gradient in and a bf16 copy out.
void BandwidthBf16(float* p, const uint16_t* g, float* m, float* v, uint16_t* copy, size_t b,
                   size_t e) {
  for (size_t i = b; i < e; ++i) {
    const uint32_t bits = static_cast<uint32_t>(g[i]) << 16;
    float gi;
    std::memcpy(&gi, &bits, 4);
    m[i] += gi;
    v[i] += gi;
    const float pi = p[i] + 1e-3f * gi;
    p[i] = pi;
    uint32_t pb;
    std::memcpy(&pb, &pi, 4);
    copy[i] = static_cast<uint16_t>(pb >> 16);
  }
}

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct TorchResult {
  bool available = false;
  std::string why;
  double seconds = 0;  // median step
};

TorchResult RunTorch(const std::string& python, int64_t params, int threads, bool foreach) {
  TorchResult r;
  if (python.empty()) {
    r.why = "no peer (--torch-python empty)";
    return r;
  }
  const std::string script = std::string(STRATA_SOURCE_DIR) + "/bench/cpu_adam_torch.py";
  const std::string cmd = absl::StrCat(python, " ", script, " --params ", params, " --threads ",
                                       threads, " --foreach ", foreach ? 1 : 0, " 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while (pipe != nullptr && (n = fread(buf.data(), 1, buf.size(), pipe)) > 0)
    out.append(buf.data(), n);
  if (pipe != nullptr) pclose(pipe);
  const size_t brace = out.rfind('{');
  nlohmann::json j = brace == std::string::npos
                         ? nlohmann::json()
                         : nlohmann::json::parse(out.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    r.why = "peer failed: " + out.substr(0, 300);
    return r;
  }
  if (!j.value("available", false)) {
    r.why = "torch missing (" + j.value("why", std::string("?")) + ")";
    return r;
  }
  r.available = true;
  r.seconds = Summary::Of(j["seconds"].get<std::vector<double>>()).median;
  return r;
}

// The accuracy cost of bf16 moments: the same noisy quadratic problem, f(p) = sum a_i (p_i - c_i)^2
// / 2 with gradient a (p - c) + noise, optimized with fp32 moments and with bf16 moments from the
// same start; reports the relative L2 distance between the two parameter vectors and the two
// final losses.
void Bf16MomentsAccuracy(int steps, Report* report) {
  constexpr size_t kN = 1 << 20;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> ua(0.1f, 10.0f);
  std::normal_distribution<float> d(0, 1);
  std::vector<float> a(kN), c(kN), p32(kN), p16(kN), g(kN), m32(kN, 0), v32(kN, 0);
  std::vector<uint16_t> m16(kN, 0), v16(kN, 0);
  for (size_t i = 0; i < kN; ++i) {
    a[i] = ua(rng);
    c[i] = d(rng);
    p32[i] = p16[i] = d(rng);
  }
  optim_cpu::AdamConfig config;
  config.lr = 1e-2f;
  config.weight_decay = 0.0f;
  auto adam = optim_cpu::CpuAdam::Create(config);
  auto loss = [&](const std::vector<float>& p) {
    double l = 0;
    for (size_t i = 0; i < kN; ++i) l += 0.5 * a[i] * (double(p[i]) - c[i]) * (double(p[i]) - c[i]);
    return l / kN;
  };
  const double loss0 = loss(p32);
  for (int t = 1; t <= steps; ++t) {
    for (int which = 0; which < 2; ++which) {
      std::vector<float>& p = which == 0 ? p32 : p16;
      std::mt19937 noise(t);  // the same noise for both runs
      std::normal_distribution<float> nd(0, 0.5f);
      for (size_t i = 0; i < kN; ++i) g[i] = a[i] * (p[i] - c[i]) + nd(noise);
      optim_cpu::AdamChunk chunk;
      chunk.param = p.data();
      chunk.grad = g.data();
      chunk.size = kN;
      if (which == 0) {
        chunk.exp_avg = m32.data();
        chunk.exp_avg_sq = v32.data();
      } else {
        chunk.moment_dtype = DType::kBF16;
        chunk.exp_avg = m16.data();
        chunk.exp_avg_sq = v16.data();
      }
      (void)(*adam)->Step(t, chunk);
    }
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < kN; ++i) {
    diff += (double(p32[i]) - p16[i]) * (double(p32[i]) - p16[i]);
    norm += double(p32[i]) * p32[i];
  }
  const double rel = std::sqrt(diff / norm), l32 = loss(p32), l16 = loss(p16);
  std::printf(
      "bf16 moments, %d AdamW steps on a noisy quadratic (2^20 params): parameters differ "
      "from fp32 moments' by %.2e (relative L2); loss %.4e -> fp32 moments %.6e, bf16 "
      "moments %.6e (%.3f%%)\n",
      steps, rel, loss0, l32, l16, 100.0 * (l16 - l32) / l32);
  nlohmann::json cfg = {{"params", kN},
                        {"steps", steps},
                        {"lr", 1e-2},
                        {"grad_noise", 0.5},
                        {"initial_loss", loss0},
                        {"loss_fp32_moments", l32},
                        {"loss_bf16_moments", l16}};
  report->Add(Figure{.name = "bf16_moments_param_deviation",
                     .unit = "relative L2",
                     .value = Summary::Of({rel}),
                     .config = cfg,
                     .note = "accuracy, not speed: no ceiling"});
}

int Main() {
  const size_t n = static_cast<size_t>(absl::GetFlag(FLAGS_params));
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::vector<int> thread_counts;
  if (absl::GetFlag(FLAGS_threads).empty()) {
    thread_counts = {1};
    if (cores > 1) thread_counts.push_back(cores);
  } else {
    thread_counts = aio_bench::ParseIntList("--threads", absl::GetFlag(FLAGS_threads), 1, 1024);
  }

  // Data: huge-page backed, random; the same arrays serve the ceiling and Adam.
  auto alloc = [&](size_t bytes) {
    return *aio::AlignedBuffer::Allocate(bytes, {.huge_pages = true});
  };
  aio::AlignedBuffer pb = alloc(n * 4), gb = alloc(n * 4), mb = alloc(n * 4), vb = alloc(n * 4),
                     g16b = alloc(n * 2), copyb = alloc(n * 2);
  float* p = reinterpret_cast<float*>(pb.data());
  float* g = reinterpret_cast<float*>(gb.data());
  float* m = reinterpret_cast<float*>(mb.data());
  float* v = reinterpret_cast<float*>(vb.data());
  auto* g16 = reinterpret_cast<uint16_t*>(g16b.data());
  auto* copy = reinterpret_cast<uint16_t*>(copyb.data());
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0, 1);
  for (size_t i = 0; i < n; ++i) {
    p[i] = d(rng);
    g[i] = 0.1f * d(rng);
    uint32_t bits;
    std::memcpy(&bits, &g[i], 4);
    g16[i] = static_cast<uint16_t>(bits >> 16);
  }

  struct Case {
    std::string name;
    bool bf16;
    double bytes_per_param;
  };
  const std::vector<Case> cases = {{"adamw_fp32", false, 28},
                                   {"adamw_bf16_grad_bf16_copy", true, 28}};

  Report report("cpu_adam", MachineInfo::Probe("."));
  const std::string torch_python = absl::GetFlag(FLAGS_torch_python);
  std::printf("%zu parameters (%.2f GiB of fp32 state), %d rounds\n", n, n * 16.0 / (1 << 30),
              rounds);
  for (int threads : thread_counts) {
    optim_cpu::AdamConfig config;
    config.threads = threads;
    config.weight_decay = 0.01f;
    auto adam = optim_cpu::CpuAdam::Create(config);
    if (!adam.ok()) {
      std::fprintf(stderr, "%s\n", adam.status().ToString().c_str());
      return 1;
    }
    optim_cpu::ThreadPool& pool = (*adam)->pool();
    for (const Case& c : cases) {
      std::vector<double> ours_s, ceil_s, ratio;
      int64_t t = 1;
      for (int round = 0; round <= rounds; ++round) {
        double ours = 0, ceil = 0;
        auto run_ceiling = [&] {
          const auto t0 = Clock::now();
          pool.ParallelFor(n, 64, [&](size_t b, size_t e, int) {
            if (c.bf16) {
              BandwidthBf16(p, g16, m, v, copy, b, e);
            } else {
              BandwidthF32(p, g, m, v, b, e);
            }
          });
          ceil = Seconds(t0);
        };
        auto run_ours = [&] {
          optim_cpu::AdamChunk chunk;
          chunk.param = p;
          chunk.grad = c.bf16 ? static_cast<const void*>(g16) : static_cast<const void*>(g);
          chunk.grad_dtype = c.bf16 ? DType::kBF16 : DType::kF32;
          chunk.exp_avg = m;
          chunk.exp_avg_sq = v;
          if (c.bf16) {
            chunk.param_copy = copy;
            chunk.copy_dtype = DType::kBF16;
          }
          chunk.size = n;
          const auto t0 = Clock::now();
          auto r = (*adam)->Step(t++, chunk);
          ours = Seconds(t0);
          if (!r.ok()) std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        };
        if (round % 2 == 0) {
          run_ceiling();
          run_ours();
        } else {
          run_ours();
          run_ceiling();
        }
        // The bandwidth kernel drifts m and v upwards; keep v non-negative and finite for Adam.
        if (round == 0) continue;
        ours_s.push_back(ours);
        ceil_s.push_back(ceil);
        ratio.push_back(ceil / ours);
      }
      const double bytes = c.bytes_per_param * n;
      std::vector<double> ours_gbps, ceil_gbps;
      for (double s : ours_s) ours_gbps.push_back(bytes / s / 1e9);
      for (double s : ceil_s) ceil_gbps.push_back(bytes / s / 1e9);
      const Summary o = Summary::Of(ours_gbps), cl = Summary::Of(ceil_gbps), r = Summary::Of(ratio);
      const std::string name = absl::StrCat(c.name, "_", threads, "t");
      std::printf(
          "%-34s %s: %6.2f GB/s [%5.2f, %5.2f] = %.3f of the bandwidth kernel %6.2f GB/s "
          "(%.1f ms/step, %.2f Gparam/s)\n",
          name.c_str(), std::string(optim_cpu::IsaName((*adam)->isa())).c_str(), o.median, o.min,
          o.max, r.median, cl.median, Summary::Of(ours_s).median * 1e3,
          n / Summary::Of(ours_s).median / 1e9);
      nlohmann::json cfg = {{"params", n},
                            {"threads", threads},
                            {"isa", std::string(optim_cpu::IsaName((*adam)->isa()))},
                            {"bytes_per_param", c.bytes_per_param},
                            {"placement", pool.placement()},
                            {"rounds", rounds}};
      report.Add(Figure{
          .name = name,
          .unit = "GB/s",
          .value = o,
          .ceiling = cl,
          .ceiling_source = absl::StrCat("bandwidth kernel of Adam's shape (", c.bytes_per_param,
                                         " B/param), same data and threads"),
          .ratio = r,
          .config = cfg});
      if (!c.bf16) {
        // The peer: torch.optim.AdamW, foreach off and on; ours over the faster of the two.
        const TorchResult off = RunTorch(torch_python, static_cast<int64_t>(n), threads, false);
        const TorchResult on = RunTorch(torch_python, static_cast<int64_t>(n), threads, true);
        Figure peer{.name = name + "_vs_torch",
                    .unit = "s/step",
                    .value = Summary::Of(ours_s),
                    .lower_is_better = true,
                    .config = cfg};
        if (off.available || on.available) {
          double best = 1e30;
          std::string which;
          if (off.available && off.seconds < best) {
            best = off.seconds;
            which = "foreach=False";
          }
          if (on.available && on.seconds < best) {
            best = on.seconds;
            which = "foreach=True";
          }
          peer.ceiling = Summary::Of({best});
          peer.ceiling_source =
              "torch.optim.AdamW " + which + " (the faster), same size and threads";
          peer.ratio = Summary::Of({Summary::Of(ours_s).median / best});
          std::printf("%-34s torch AdamW foreach off %.1f ms, on %.1f ms: strata is %.1fx faster\n",
                      "", off.seconds * 1e3, on.seconds * 1e3, best / Summary::Of(ours_s).median);
        } else {
          peer.note = off.why;
          std::printf("%-34s torch peer: %s\n", "", off.why.c_str());
        }
        report.Add(peer);
      }
    }
  }
  if (absl::GetFlag(FLAGS_accuracy_steps) > 0) {
    Bf16MomentsAccuracy(absl::GetFlag(FLAGS_accuracy_steps), &report);
  }
  std::printf("\n");
  report.PrintClosingLines();
  if (!absl::GetFlag(FLAGS_json).empty() && !report.WriteJson(absl::GetFlag(FLAGS_json))) return 1;
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  // Flags as the aio tools take them: --a-flag or --a_flag, bad values exit 2.
  strata::aio_bench::ParseFlagsOrExit(
      argc, argv, "cpu_adam [--params N] [--threads 1,2] [--rounds 5] [--json PATH]",
      "bench/cpu_adam.cc",
      {{"params", 1024, 1ull << 40}, {"rounds", 1, 1000}, {"accuracy_steps", 0, 1000000}});
  if (auto s = strata::aio_bench::PrepareOutputFile(absl::GetFlag(FLAGS_json)); !s.ok()) {
    strata::aio_bench::BadFlag("--json", s.message());  // found before measuring
  }
  return strata::bench::Main();
}
