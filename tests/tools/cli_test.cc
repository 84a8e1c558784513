// The two programs as a user runs them: bad flags, a tiny sweep end to end, the test file's fate.
#include <sched.h>
#include <sys/statfs.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "aio/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/aio/test_util.h"

namespace {

using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;
using ::testing::Not;

struct Outcome {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

Outcome Execute(const std::string& command) {
  Outcome r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

const std::string kSweep = STRATA_SWEEP_BINARY;
const std::string kBench = STRATA_AIO_BENCH_BINARY;
const std::string kTiny =
    " --engines io_uring --block-sizes 1M --queue-depths 4 --threads 1 --size 64M --reps 1"
    " --rep-seconds 0.02 --warmup-seconds 0";

struct BadInput {
  std::string args, says;
};
// Runs `command` with each case's arguments: bad input, so exit code 2 and a message saying what
// was wrong.
void ExpectRefused(const std::string& command, const std::vector<BadInput>& cases) {
  for (const BadInput& c : cases) {
    Outcome r = Execute(command + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.says)) << c.args;
  }
}

bool IsMemoryFs(const std::string& dir) {
  struct statfs fs;
  return statfs(dir.c_str(), &fs) == 0 && static_cast<uint64_t>(fs.f_type) == 0x01021994;
}

TEST(SweepCliTest, BadPlacesAndValuesAreBadInputFoundBeforeMeasuring) {
  ScratchDir dir;
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"--nvme-dir " + dir.path() + "/missing",
            "--nvme-dir: " + dir.path() + "/missing: no such directory"},
           {"--nvme-dir /proc", "/proc is on proc, a kernel pseudo filesystem"},
           {"--nvme-dir /sys", "/sys is on sysfs, a kernel pseudo filesystem"},
           {"--nvme-dir " + dir.path() + " --reps -3",
            "--reps: must be an integer in [1, 1000], got -3"},
           {"--nvme-dir " + dir.path() + " --reps 0",
            "--reps: must be an integer in [1, 1000], got 0"},
           {"--nvme-dir " + dir.path() + " --reps three",
            "--reps: must be an integer in [1, 1000], got \"three\""},
           {"--nvme-dir " + dir.path() + " --rep-seconds -1",
            "--rep-seconds: must be a number in [0.01, 600], got -1"},
           {"--nvme-dir " + dir.path() + " --rep_seconds nan",
            "--rep-seconds: must be a number in [0.01, 600], got nan"},
           {"--nvme-dir " + dir.path() + " --warmup-seconds=-0.5",
            "--warmup-seconds: must be a number in [0, 600], got -0.5"},
           {"--nvme-dir " + dir.path() + " --out /proc/strata-out", "--out: /proc/strata-out"}}) {
    Outcome r = Execute(kSweep + " --quick " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << c.args;
    EXPECT_THAT(r.output, Not(HasSubstr("laying down"))) << c.args;  // nothing was measured
  }
  // A grid whose every point needs more buffer than this machine has is refused before anything.
  Outcome grid = Execute(kSweep + " --nvme-dir " + dir.path() +
                         " --block-sizes 64M --queue-depths 1024 --threads 256");
  EXPECT_EQ(grid.exit_code, 2) << grid.output;
  EXPECT_THAT(grid.output, HasSubstr("(64M x 1024 x 256) needs a"));
  EXPECT_THAT(grid.output, Not(HasSubstr("laying down")));
  // aio_bench's --json, like the sweep's --out, is checked before anything is laid down.
  Outcome json = Execute(kBench + " --dir " + dir.path() + " --json /proc/strata/r.json");
  EXPECT_EQ(json.exit_code, 2) << json.output;
  EXPECT_THAT(json.output, HasSubstr("--json: /proc/strata: cannot be made"));
  EXPECT_THAT(json.output, Not(HasSubstr("laying down")));
  Outcome r = Execute(kBench + " --dir /proc");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("pseudo filesystem"));
  // aio_bench checks its buffer against the memory this machine has before allocating it.
  r = Execute(kBench + " --dir " + dir.path() + " --block-size 64M --queue-depth 1024 --threads 8");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("MiB available (MemAvailable)"));
}

TEST(SweepCliTest, AMemoryFilesystemIsRefusedUnlessAllowedAndThenEveryOutputSaysSo) {
  if (!IsMemoryFs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  ScratchDir dir;  // the results go to the disk; the test file to memory
  // A folder of this test's own in /dev/shm: another run of the suite (ctest -j, a second
  // checkout) lays down its test file beside, not over (found when two runs met there).
  char shm_template[] = "/dev/shm/strata-cli-test-XXXXXX";
  ASSERT_NE(mkdtemp(shm_template), nullptr);
  const std::string shm = shm_template;
  struct Remove {
    std::string path;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } remove{shm};
  Outcome refused = Execute(kSweep + " --nvme-dir " + shm + kTiny);
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("--allow-memory-fs"));
  const std::string out = dir.path() + "/out";
  Outcome r = Execute(kSweep + " --nvme-dir " + shm + " --allow-memory-fs --out " + out + kTiny);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output,
              HasSubstr("WARNING (about the block above): MEMORY: " + shm + " is on tmpfs"));
  for (const char* name :
       {"results.csv", "results.json", "best.json", "heatmap_io_uring_read.svg"}) {
    std::ifstream in(out + "/" + name);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_THAT(text, HasSubstr("MEMORY")) << name;
  }
}

TEST(SweepCliTest, EveryToolTakesDashesAndUnderscoresAlike) {
  ScratchDir dir;
  for (const std::string flags :
       {" --no-uring-options --rep-seconds 0.02", " --no_uring_options --rep_seconds 0.02"}) {
    Outcome r = Execute(kSweep + " --nvme_dir " + dir.path() +
                        " --engines io_uring --block-sizes 1M --queue-depths 4 --threads 1"
                        " --size 64M --reps 1 --warmup-seconds 0" +
                        flags);
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
  }
}

TEST(SweepCliTest, BadFlagsExitWith2NamingTheFlagAndWhatIsAccepted) {
  ExpectRefused(
      kSweep,
      {{"", "--nvme-dir: is required"},
       {"--nvme_dir /tmp --queue-depths 0", "--queue-depths: \"0\" is not an integer in [1, 1024]"},
       {"--nvme_dir /tmp --block-sizes 24K", "--block-sizes: each must be a power of two"},
       {"--nvme_dir /tmp --nosuch", "--nosuch: unknown flag; accepted:"},
       {"--nvme_dir /tmp --budget -5", "--budget: must be a number in [0, 604800], got -5"},
       {"--nvme_dir /tmp --ops both_ways", "--ops: \"both_ways\": accepted: read, write"},
       {"--nvme_dir /tmp --quick=maybe", "--quick: bad value \"maybe\""},
       {"--nvme_dir /tmp stray", "stray: unexpected argument"}});
  ExpectRefused(kBench + " --dir /tmp ",
                {{"--queue_depth 0", "--queue-depth: must be an integer in [1, 1024], got 0"},
                 {"--threads=-2", "--threads: must be an integer in [1, 256], got -2"},
                 {"--reps 1e3x", "--reps: must be an integer in [1, 1000], got \"1e3x\""},
                 {"--warmup-seconds -1", "--warmup-seconds: must be a number in [0, 600], got -1"},
                 {"--direct false", "--direct: a boolean takes its value after '='"}});
}

#ifdef STRATA_BENCH_BINARY_DIR
TEST(BenchCliTest, EveryBenchmarkTakesEitherSpellingAndRefusesNumbersOutOfRange) {
  const std::string bin = std::string(STRATA_BENCH_BINARY_DIR) + "/";
  struct Case {
    std::string program, args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"aio_vs_fio", "--size_mb=-1", "--size-mb: must be an integer in [4, 1073741824]"},
           {"aio_vs_fio", "--size-mb=-1", "--size-mb: must be an integer in [4, 1073741824]"},
           {"aio_vs_fio", "--block-size 12288", "--block-size: must be a power of two"},
           {"sweep_vs_fio", "--rounds=-1", "--rounds: must be an integer in [1, 1000], got -1"},
           {"cpu_adam", "--rounds 0", "--rounds: must be an integer in [1, 1000], got 0"},
           {"cpu_adam", "--accuracy_steps -1", "--accuracy-steps: must be an integer in [0, "},
           {"nvme_store", "--partition_bytes 12", "--partition-bytes: must be an integer in [4096"},
           {"nvme_store", "--puts=-5", "--puts: must be an integer in [1, 1000000], got -5"},
           {"optimizer_swap", "--partition-params 1", "--partition-params: must be an integer"},
           {"optimizer_swap", "--params 2048 --partition_params 4096",
            "--params: must be at least --partition-params"},
           {"sched_step", "--layers 0", "--layers: must be an integer in [1, 10000], got 0"},
           {"sched_step", "--layers 7",
            "--layers: 7: the device budget (a quarter of the parameters, 7/4 layers' worth) "
            "cannot hold a layer's parameters and gradient at once (2 layers' worth); accepted: 8 "
            "or more"},
           {"sched_step", "--copy-gbps=0", "--copy-gbps: must be a number in [0.01, 1000]"},
           {"sched_step", "--policies=", "--policies: is empty; accepted: strata, lru"},
           {"sched_step", "--policies=strata,fifo",
            "--policies: names \"fifo\"; accepted: strata, lru, deepspeed_like"},
           {"sched_step", "--optimizer=during",
            "--optimizer: is \"during\"; accepted: after_backward, interleaved"},
           {"nvme_store", "--json /proc/strata/r.json", "--json: /proc/strata: cannot be made"}}) {
    Outcome r = Execute(bin + c.program + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.program << " " << c.args << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << c.program << " " << c.args;
  }
  for (const char* program :
       {"aio_vs_fio", "sweep_vs_fio", "cpu_adam", "nvme_store", "optimizer_swap", "sched_step"}) {
    Outcome r = Execute(bin + program + " --help");
    EXPECT_EQ(r.exit_code, 0) << program << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("--json=<text>")) << program;
    EXPECT_THAT(r.output, Not(::testing::ContainsRegex("--[a-z]+_"))) << program;  // dashes only
  }
}
#endif

TEST(SweepCliTest, HelpListsTheFlagsAndExitsZero) {
  Outcome r = Execute(kSweep + " --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--nvme-dir=<text>"));
  EXPECT_THAT(r.output, HasSubstr("--budget=<a number in [0, 604800]>"));
  EXPECT_THAT(r.output, HasSubstr("--reps=<an integer in [1, 1000]>"));
  EXPECT_THAT(r.output, HasSubstr("--[no-]uring-options"));
  EXPECT_THAT(r.output, Not(::testing::ContainsRegex("--[a-z]+_")));  // one spelling: dashes
}

TEST(SweepCliTest, ATinySweepWritesEveryOutputAndRemovesItsTestFile) {
  ScratchDir dir;
  Outcome r =
      Execute(kSweep + " --nvme_dir " + dir.path() +
              " --engines io_uring,libaio --block-sizes 1M --queue-depths 4 --threads 1"
              " --nouring-options --size 64M --reps 2 --rep-seconds 0.03 --warmup-seconds 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[4/4]"));  // not a terminal: plain lines
  EXPECT_THAT(r.output, HasSubstr("best both:"));
  EXPECT_THAT(r.output, HasSubstr("\"intra_op_parallelism\": 1"));
  const std::string out = dir.path() + "/strata-sweep";
  for (const char* name :
       {"results.csv", "results.json", "heatmap_io_uring_read.svg", "heatmap_libaio_write.svg",
        "best.json", "best_read.json", "best_write.json"}) {
    EXPECT_TRUE(std::filesystem::exists(out + "/" + name)) << name;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/strata-sweep.dat"));
  std::ifstream in(out + "/best.json");
  std::string block((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(strata::aio::AioConfigFromJsonText(block).ok()) << block;
  std::ifstream rj(out + "/results.json");
  const auto j = nlohmann::json::parse(rj);
  EXPECT_EQ(j["points"].size(), 4u);
}

TEST(SweepCliTest, AnExistingTestFileIsLeftAlone) {
  ScratchDir dir;
  { std::ofstream(dir.path() + "/strata-sweep.dat") << "mine"; }
  Outcome r = Execute(kSweep + " --nvme_dir " + dir.path() + " --quick");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--overwrite"));
  EXPECT_EQ(std::filesystem::file_size(dir.path() + "/strata-sweep.dat"), 4u);
}

TEST(AioBenchCliTest, MeasuresOneConfiguration) {
  ScratchDir dir;
  Outcome r = Execute(kBench + " --dir " + dir.path() +
                      " --size 32M --queue-depth 4 --reps 2 --rep-seconds 0.03 --warmup-seconds 0"
                      " --op write --json " +
                      dir.path() + "/r.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("GB/s"));
  EXPECT_THAT(r.output, HasSubstr("latency  p50"));
  EXPECT_THAT(r.output, HasSubstr("CPU"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/r.json"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/strata-aio-bench.dat"));
}

// strata_plan, as a user runs it: a plan that fits, one that does not, and bad input.
const std::string kPlan = STRATA_PLAN_BINARY;

class PlanCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Write("model.json",
          R"({"model_type": "llama", "num_hidden_layers": 40, "hidden_size": 5120,
              "num_attention_heads": 40, "intermediate_size": 13824, "vocab_size": 32000,
              "max_position_embeddings": 4096, "tie_word_embeddings": false})");
    Write("nvme.json", R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
              "offload_param": {"device": "nvme", "nvme_path": "/n"},
              "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}})");
    Write("plain.json", R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 0}})");
  }
  std::string Path(const std::string& name) const { return dir_.path() + "/" + name; }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(Path(name)) << text;
  }
  ScratchDir dir_;
};

TEST_F(PlanCliTest, AThirteenBModelFitsOneWorkstationGpuOnlyWithNvmeOffload) {
  Outcome fits = Execute(kPlan + " --model " + Path("model.json") +
                         " --hardware rtx4090-256g-2nvme --config " + Path("nvme.json") +
                         " --json " + Path("plan.json"));
  EXPECT_EQ(fits.exit_code, 0) << fits.output;
  EXPECT_THAT(fits.output, HasSubstr("13.02B parameters"));
  EXPECT_THAT(fits.output, HasSubstr("FITS"));
  EXPECT_THAT(fits.output, Not(HasSubstr("zero_optimization.stage")));  // the planner uses it
  std::ifstream in(Path("plan.json"));
  const nlohmann::json plan = nlohmann::json::parse(in);
  EXPECT_TRUE(plan["fits"].get<bool>());
  EXPECT_EQ(plan["model"]["parameters"].get<int64_t>(), 13015864320);
  EXPECT_GT(plan["nvme"]["optimizer"].get<double>(), 12 * 13.0e9);
  // The optimizer's state on NVMe crosses the disk every step, though the host could hold it.
  EXPECT_GE(plan["step"]["lanes"]["nvme read"]["bytes"].get<double>(), 12 * 13.0e9);
  EXPECT_GE(plan["step"]["lanes"]["nvme write"]["bytes"].get<double>(), 12 * 13.0e9);

  Outcome over = Execute(kPlan + " --model " + Path("model.json") +
                         " --hardware rtx4090-256g-2nvme --config " + Path("plain.json"));
  EXPECT_EQ(over.exit_code, 1) << over.output;
  EXPECT_THAT(over.output, HasSubstr("DOES NOT FIT: the device tier needs"));

  // No config at all: the default does not fit, and the answer is what does.
  Outcome none =
      Execute(kPlan + " --model " + Path("model.json") + " --hardware rtx4090-256g-2nvme");
  EXPECT_EQ(none.exit_code, 0) << none.output;
  EXPECT_THAT(none.output, HasSubstr("no --config: the default (ZeRO stage 0, nothing offloaded) "
                                     "does not fit: the device tier needs"));
  EXPECT_THAT(none.output, HasSubstr("the suggested config"));
  EXPECT_THAT(none.output, HasSubstr("FITS"));
}

// --largest: the largest Llama-shaped model the lent H200 machine holds with the state offloaded,
// its config.json written and planned as a --model; flags that do not go with it refused.
TEST_F(PlanCliTest, LargestNamesTheLargestModelThatFitsAndWritesItsConfig) {
  Write("cpu_nvme.json", R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}})");
  Outcome r =
      Execute(kPlan + " --largest --hardware h200-141g-128g --config " + Path("cpu_nvme.json") +
              " --vocab 256 --sequence 128 --save-model " + Path("largest.json"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--largest: the largest LlamaForCausalLM of examples/llama.py's "
                                  "shape that fits with this config"));
  // The optimizer's state on its 64 GiB disk bounds it, well within the GPU's memory.
  EXPECT_THAT(r.output, HasSubstr("does not fit: the nvme tier needs"));
  EXPECT_THAT(r.output, HasSubstr("within it: with this config the other tiers add nothing"));
  EXPECT_THAT(r.output, HasSubstr("built by bench/bigger_than_ram.py --layers "));
  EXPECT_THAT(r.output, HasSubstr("FITS"));
  std::ifstream in(Path("largest.json"));
  const nlohmann::json model = nlohmann::json::parse(in);
  EXPECT_EQ(model["model_type"], "llama");
  EXPECT_EQ(model["vocab_size"], 256);
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat(model["hidden_size"].get<int>(), " wide, ",
                                               model["num_hidden_layers"].get<int>(), " layers")));
  // Planned again as a --model, the same model fits with the same config.
  Outcome again = Execute(kPlan + " --model " + Path("largest.json") +
                          " --hardware h200-141g-128g --config " + Path("cpu_nvme.json"));
  EXPECT_EQ(again.exit_code, 0) << again.output;
  for (const char* bad :
       {" --largest --model x.json", " --model x.json --vocab 10", " --model x.json --vocab 32000",
        " --model x.json --save-model y.json", " --largest --vocab -1"}) {
    Outcome refused = Execute(kPlan + bad + " --hardware h200-141g-128g");
    EXPECT_EQ(refused.exit_code, 2) << bad << ": " << refused.output;
  }
}

TEST_F(PlanCliTest, ItPredictsTheStepDrawsItAndSuggestsAConfigThatReadsBack) {
  // NVMe offload with a host budget too small to keep the optimizer state: it crosses the disk.
  Write("nvme_low.json", R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": "/n"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}},
            "strata": {"host_budget_bytes": 40000000000}})");
  Outcome fits = Execute(kPlan + " --model " + Path("model.json") +
                         " --hardware rtx4090-256g-2nvme --config " + Path("nvme_low.json") +
                         " --svg " + Path("step.svg") + " --json " + Path("plan.json"));
  EXPECT_EQ(fits.exit_code, 0) << fits.output;
  EXPECT_THAT(fits.output, HasSubstr("predicted step (steady state"));
  EXPECT_THAT(fits.output, HasSubstr("model TFLOPs per GPU"));
  std::ifstream plan_in(Path("plan.json"));
  const nlohmann::json plan = nlohmann::json::parse(plan_in);
  EXPECT_GE(plan["step"]["seconds"].get<double>(),
            plan["step"]["lower_bound_seconds"].get<double>());
  EXPECT_GT(plan["step"]["lanes"]["nvme read"]["bytes"].get<double>(), 0);
  std::ifstream svg_in(Path("step.svg"));
  const std::string svg((std::istreambuf_iterator<char>(svg_in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(svg, HasSubstr("<svg xmlns"));
  EXPECT_THAT(svg, HasSubstr("RTX 4090 24 GB workstation, 256 GiB RAM"));
  EXPECT_THAT(svg, HasSubstr(">nvme read</text>"));

  Outcome suggest =
      Execute(kPlan + " --model " + Path("model.json") +
              " --hardware rtx4090-256g-2nvme --config " + Path("plain.json") + " --suggest");
  EXPECT_EQ(suggest.exit_code, 0) << suggest.output;
  const size_t brace = suggest.output.find("\n{");
  ASSERT_NE(brace, std::string::npos) << suggest.output;
  Write("suggested.json", suggest.output.substr(brace + 1));
  Outcome again = Execute(kPlan + " --model " + Path("model.json") +
                          " --hardware rtx4090-256g-2nvme --config " + Path("suggested.json"));
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_THAT(again.output, HasSubstr("FITS"));
}

TEST_F(PlanCliTest, BadInputIsNamedAndExitsTwo) {
  Write("bad_model.json", R"({"num_hidden_layers": 2, "hidden_size": 64})");
  Write("bad_hw.json", R"({"gpu": {"count": 1, "hbm_gib": 8, "tflops": 10},
                           "host": {"ram_gib": 8, "optimizer_gbps": 1},
                           "pcie": {"to_device_gbps": 1, "to_hostgbps": 1}})");
  Write("no_nvme.json", R"({"gpu": {"count": 1, "hbm_gib": 8, "tflops": 10},
                            "host": {"ram_gib": 8, "optimizer_gbps": 1},
                            "pcie": {"to_device_gbps": 1, "to_host_gbps": 1}})");
  Write("not_json.json", "{\"stage\": ");
  const std::string model = " --model " + Path("model.json");
  ExpectRefused(
      kPlan, {
                 {" --hardware a100-80g-4nvme", "--model: required"},
                 {model, "--hardware: required"},
                 {model + " --hardware a100-80g-4nvmee", "did you mean a100-80g-4nvme?"},
                 {" --model " + Path("bad_model.json") + " --hardware a100-80g-4nvme",
                  "num_attention_heads (or n_head): missing"},
                 {model + " --hardware " + Path("bad_hw.json"), "did you mean to_host_gbps?"},
                 {model + " --hardware " + Path("no_nvme.json") + " --config " + Path("nvme.json"),
                  "offload_param.device: nvme, but the hardware"},
                 {model + " --hardware a100-80g-4nvme --config " + Path("not_json.json"),
                  "not valid JSON at line 1"},
                 {model + " --hardware a100-80g-4nvme --config " + Path("missing.json"),
                  "--config: cannot read"},
                 {model + " --hardware a100-80g-4nvme --micro-batch -1",
                  "--micro-batch: must be an integer"},
             });
  Outcome list = Execute(kPlan + " --hardware=list");
  EXPECT_EQ(list.exit_code, 0);
  EXPECT_THAT(list.output, HasSubstr("dgx2-v100"));
}

TEST_F(PlanCliTest, CalibrateDescribesThisMachineAndPlansOnIt) {
  // A sweep's results.json as aio_bench_perf_sweep writes its "best" picks (the rest left out).
  Write("results.json", R"({"tool": "aio_bench_perf_sweep",
      "best": {"read": {"result": {"op": "read", "gb_per_s": {"median": 3.25}}},
               "write": {"result": {"op": "write", "gb_per_s": {"median": 1.5}}}}})");
  const std::string calibrate =
      kPlan + " --calibrate --gpu-tflops 100 --gpu-hbm-gib 24 --calibrate-adam-params 1048576";
  Outcome described = Execute(calibrate + " --sweep " + Path("results.json") + " --calibrate-dir " +
                              dir_.path() + " --save-hardware " + Path("me.json"));
  ASSERT_EQ(described.exit_code, 0) << described.output;
  std::ifstream in(Path("me.json"));
  const nlohmann::json me = nlohmann::json::parse(in);
  EXPECT_DOUBLE_EQ(me["nvme"]["read_gbps"].get<double>(), 3.25);
  EXPECT_DOUBLE_EQ(me["nvme"]["write_gbps"].get<double>(), 1.5);
  EXPECT_GT(me["nvme"]["capacity_tb"].get<double>(), 0);
  EXPECT_GT(me["nvme"]["commit_ms"].get<double>(), 0);  // measured: Puts into a scratch store
  EXPECT_THAT(me["source"].get<std::string>(), HasSubstr("a write-back's commit"));
  EXPECT_GT(me["host"]["optimizer_gbps"].get<double>(), 0.1);   // measured: a CPU Adam step
  EXPECT_GT(me["pcie"]["to_device_gbps"].get<double>(), 0.01);  // measured: the emulated engine
  EXPECT_GE(me["host"]["cores"].get<int>(), 1);
  // The cores this process may use: one under taskset (found by an audit: the machine's count).
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  int first = 0;
  while (!CPU_ISSET(first, &allowed)) ++first;
  Outcome pinned = Execute("taskset -c " + std::to_string(first) + " " + calibrate);
  ASSERT_EQ(pinned.exit_code, 0) << pinned.output;
  EXPECT_THAT(pinned.output, HasSubstr("\"cores\": 1,"));
  EXPECT_DOUBLE_EQ(me["gpu"]["tflops"].get<double>(), 100);
  EXPECT_THAT(me["source"].get<std::string>(), HasSubstr("host-emulated copy engine"));
  // The saved description reads back as --hardware, and --calibrate plans a model on itself.
  Outcome planned = Execute(kPlan + " --model " + Path("model.json") + " --hardware " +
                            Path("me.json") + " --config " + Path("nvme.json"));
  EXPECT_NE(planned.exit_code, 2) << planned.output;  // fits or not: this machine's RAM decides
  EXPECT_THAT(planned.output, HasSubstr("hardware: this machine (calibrated"));
  EXPECT_THAT(planned.output, HasSubstr(planned.exit_code == 0 ? "FITS" : "DOES NOT FIT"));
  Outcome both =
      Execute(calibrate + " --model " + Path("model.json") + " --config " + Path("plain.json"));
  EXPECT_NE(both.exit_code, 2) << both.output;
  EXPECT_THAT(both.output, HasSubstr("hardware: this machine (calibrated"));  // the plan's header
  EXPECT_THAT(both.output, HasSubstr("13.02B parameters"));

  Write("torn.json", "{\"best\": ");
  Write("no_write.json", R"({"best": {"read": {"result": {"gb_per_s": {"median": 3.0}}}}})");
  ExpectRefused(
      kPlan, {
                 {" --calibrate", "--gpu-tflops and --gpu-hbm-gib: both required"},
                 {" --calibrate --gpu-tflops 100 --gpu-hbm-gib 24 --hardware a100-80g-4nvme",
                  "not with --calibrate"},
                 {" --calibrate --gpu-tflops 100 --gpu-hbm-gib 24 --sweep " + Path("no_write.json"),
                  "best.write.result.gb_per_s.median: missing"},
                 {" --calibrate --gpu-tflops 100 --gpu-hbm-gib 24 --sweep " + Path("none.json"),
                  "cannot read"},
                 {" --calibrate --gpu-tflops 100 --gpu-hbm-gib 24 --calibrate-device gpu",
                  "emulated or cuda"},
                 {" --calibrate --gpu-tflops 100 --gpu-hbm-gib 24 --sweep " + Path("torn.json"),
                  "--sweep " + Path("torn.json") + ": not JSON"},
                 {" --calibrate --gpu-tflops 100 --gpu-hbm-gib 24 --sweep " + dir_.path(),
                  "the results.json file"},  // found by an audit: a folder aborted the tool
                 {" --calibrate --gpu-tflops 100 --gpu-hbm-gib 0.01",
                  "not one the planner accepts"},  // found by an audit: saved, then refused
                 {" --model " + Path("model.json") + " --hardware a100-80g-4nvme --sweep " +
                      Path("results.json"),
                  "--sweep: only with --calibrate"},  // found by an audit: silently ignored
             });
}

}  // namespace
