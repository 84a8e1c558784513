// The Runtime's configuration from DeepSpeed-style JSON: what is read, what is reported as
// DeepSpeed's and left to the trainer, what is accepted but not yet used, and bad input named.
#include "tiering/runtime_config.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::tiering {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::string All(const std::vector<std::string>& warnings) {
  std::string all;
  for (const auto& w : warnings) all += w + "\n";
  return all;
}

TEST(RuntimeConfigTest, ReadsADeepSpeedZero3NvmeConfigAndReportsWhatItDoesNotUse) {
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({
    "train_batch_size": 16,
    "fp16": {"enabled": true},
    "zero_optimization": {
      "stage": 3,
      "overlap_comm": true,
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                        "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                            "buffer_count": 4, "fast_init": false, "pipeline_read": true},
      "stage3_prefetch_bucket_size": 5e8,
      "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": 1e9},
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
            "single_submit": false, "overlap_events": true},
    "strata": {"host_budget_bytes": 8589934592, "eviction_policy": "lru"}})",
                                     &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_stage, 3);
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c->offload_param.buffer_size, 100000000);
  EXPECT_EQ(c->offload_param.max_in_cpu, 1000000000);
  EXPECT_TRUE(c->offload_optimizer.pipeline_read);
  EXPECT_EQ(c->stage3_prefetch_bucket_size, 500000000);
  EXPECT_EQ(c->host_budget_bytes, 8589934592u);
  EXPECT_EQ(c->SwapPath(), "/local_nvme");
  const std::string all = All(warnings);
  EXPECT_THAT(all, HasSubstr("aio.thread_count is DeepSpeed's old name"));
  EXPECT_THAT(all, HasSubstr("train_batch_size: not used by strata"));
  EXPECT_THAT(all, HasSubstr("zero_optimization.overlap_comm: not used by strata"));
  // Keys strata reads but does not act on yet: each is named.
  for (const char* key : {"zero_optimization.stage:", "zero_optimization.offload_param.pin_memory:",
                          "zero_optimization.offload_optimizer.pin_memory:",
                          "zero_optimization.offload_optimizer.fast_init:"}) {
    EXPECT_THAT(all, HasSubstr(absl::StrCat(key, " accepted but not yet used by strata"))) << key;
  }
  // What is used is not reported.
  EXPECT_THAT(all, Not(HasSubstr("offload_param.buffer_size")));
  EXPECT_THAT(all, Not(HasSubstr("offload_param.buffer_count")));
  EXPECT_THAT(all, Not(HasSubstr("max_in_cpu")));
  EXPECT_THAT(all, Not(HasSubstr("stage3_prefetch_bucket_size")));
  EXPECT_THAT(all, Not(HasSubstr("stage3_max_live_parameters")));
  EXPECT_THAT(all, Not(HasSubstr("stage3_max_reuse_distance")));
  EXPECT_THAT(all, Not(HasSubstr("offload_optimizer.buffer_count")));
  EXPECT_THAT(all, Not(HasSubstr("offload_optimizer.pipeline_read")));
  EXPECT_THAT(all, Not(HasSubstr("offload_param.nvme_path")));
  EXPECT_THAT(all, Not(HasSubstr("eviction_policy")));
}

TEST(RuntimeConfigTest, IntegersAreReadExactlyAndDeepSpeedsFloatsWhenWhole) {
  auto c = RuntimeConfigFromJsonText(
      R"({"strata": {"nvme_capacity_bytes": 72057594037927937, "host_budget_bytes": 4.0e9}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->nvme_capacity_bytes, (uint64_t{1} << 56) + 1);  // not rounded through a double
  EXPECT_EQ(c->host_budget_bytes, 4000000000u);
  auto fraction = RuntimeConfigFromJsonText(R"({"strata": {"host_budget_bytes": 1e9.5}})");
  EXPECT_FALSE(fraction.ok());
}

TEST(RuntimeConfigTest, StagingBuffersBeyondTheHostBudgetAreRefusedWhereThereIsAStore) {
  // buffer_count 5: two pairs of 1 MiB buffers, 4 MiB, in a host budget of 2 MiB.
  const std::string staged = R"({"zero_optimization": {"stage": 3, "offload_param": {
      "device": "nvme", "nvme_path": "/nvme0", "buffer_count": 5, "buffer_size": 1048576}},
      "strata": {"host_budget_bytes": 2097152}})";
  auto bad = RuntimeConfigFromJsonText(staged);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("the staging buffers (4 of offload_param.buffer_size: 4194304 bytes; "
                        "buffer_count 5 gives 2 pair(s), at least one) do not fit in "
                        "strata.host_budget_bytes (2097152)"));
  // One pair fits; without an NVMe store nothing is staged.
  auto pair = RuntimeConfigFromJsonText(
      absl::StrReplaceAll(staged, {{"\"buffer_count\": 5", "\"buffer_count\": 2"}}));
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_EQ(pair->StagingPairs(), 1);
  EXPECT_EQ(pair->StagingBufferBytes(), 1048576u);
  auto no_store = RuntimeConfigFromJsonText(
      absl::StrReplaceAll(staged, {{"\"device\": \"nvme\", \"nvme_path\": \"/nvme0\", ", ""}}));
  EXPECT_TRUE(no_store.ok()) << no_store.status();
  // A buffer below kMinBufferSize is one of kMinBufferSize; sizes round up to whole pages.
  RuntimeConfig c;
  c.offload_param.buffer_size = 100;
  EXPECT_EQ(c.StagingBufferBytes(), 4096u);
  c.offload_param.buffer_size = 4097;
  EXPECT_EQ(c.StagingBufferBytes(), 8192u);
}

TEST(RuntimeConfigTest, TwoNvmePathsAreReportedWithTheOneUsed) {
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/nvme0"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme1"}}})",
                                     &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->offload_param.nvme_path, "/nvme0");
  EXPECT_EQ(c->offload_optimizer.nvme_path, "/nvme1");
  EXPECT_EQ(c->SwapPath(), "/nvme0");
  const std::string all = All(warnings);
  EXPECT_THAT(all, HasSubstr("zero_optimization.offload_optimizer.nvme_path (/nvme1) is not used: "
                             "strata keeps one NVMe store per process, at /nvme0 "
                             "(offload_param.nvme_path; set strata.nvme_path to choose)"));
  EXPECT_THAT(all, Not(HasSubstr("offload_param.nvme_path (/nvme0)")));
}

TEST(RuntimeConfigTest, AnNvmePathThatStrataNvmePathOverridesIsReported) {
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/nvme0"}},
      "strata": {"nvme_path": "/fast"}})",
                                     &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->SwapPath(), "/fast");
  EXPECT_THAT(All(warnings),
              HasSubstr("zero_optimization.offload_param.nvme_path (/nvme0) is not used: strata "
                        "keeps one NVMe store per process, at /fast (strata.nvme_path)"));
}

TEST(RuntimeConfigTest, AnNvmePathOfABlockNotOnNvmeIsReported) {
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "nvme_path": "/local_nvme"}}})",
                                     &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->SwapPath(), "");
  EXPECT_THAT(All(warnings),
              HasSubstr("zero_optimization.offload_param.nvme_path (/local_nvme) is not used: "
                        "offload_param.device is not \"nvme\""));
}

TEST(RuntimeConfigTest, ParameterOffloadBelowStage3IsIgnoredAndSaidAsDeepSpeedDoes) {
  // Configs shared between stages carry offload_param (DeepSpeed reads it at stage 3 only).
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({"zero_optimization": {"stage": 2,
      "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})",
                                     &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNone);
  EXPECT_THAT(All(warnings), HasSubstr("zero_optimization.offload_param.device: ignored at stage "
                                       "2 (parameters are offloaded at stage 3 only)"));
}

TEST(RuntimeConfigTest, DeepSpeedsOtherSpellingsAreItsOwnKeys) {
  std::vector<std::string> warnings;
  // DeepSpeed's names as its config code spells them: bfloat16 (bf16's old name),
  // seq_parallel_comm_data_type, the stage-3 knobs under their field names, cpu_offload_param.
  auto c = RuntimeConfigFromJsonText(R"({"bfloat16": {"enabled": true},
      "seq_parallel_comm_data_type": "fp32",
      "zero_optimization": {"stage": 3, "prefetch_bucket_size": 5e8,
                            "max_live_parameters": 7, "param_persistence_threshold": 1e5,
                            "cpu_offload_param": false, "zeropp_loco_param": {}}})",
                                     &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->stage3_prefetch_bucket_size, 500000000);
  EXPECT_EQ(c->stage3_max_live_parameters, 7);
  EXPECT_EQ(c->stage3_param_persistence_threshold, 100000);
  const std::string all = All(warnings);
  EXPECT_THAT(all, HasSubstr("bfloat16: not used by strata (DeepSpeed's; left to the trainer)"));
  EXPECT_THAT(all, HasSubstr("seq_parallel_comm_data_type: not used by strata"));
  EXPECT_THAT(all, Not(HasSubstr("param_persistence_threshold")));
  EXPECT_THAT(all, HasSubstr("zero_optimization.cpu_offload_param: not used by strata"));
  EXPECT_THAT(all, Not(HasSubstr("zero_optimization.prefetch_bucket_size:")));  // the window
  EXPECT_THAT(all, Not(HasSubstr("max_live_parameters")));
  EXPECT_THAT(all, Not(HasSubstr("prefetch_bucket_size: not used by strata")));
}

// zero_optimization.sub_group_size: read (DeepSpeed's default 1e9), not warned of; 0 or a
// fraction refused naming what is accepted.
TEST(RuntimeConfigTest, SubGroupSizeIsReadWithDeepSpeedsDefault) {
  std::vector<std::string> warnings;
  auto plain = RuntimeConfigFromJsonText(R"({"zero_optimization": {"stage": 3}})", &warnings);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->sub_group_size, 1000000000);
  auto c = RuntimeConfigFromJsonText(
      R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e6}})", &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sub_group_size, 1000000);
  EXPECT_THAT(All(warnings), Not(HasSubstr("sub_group_size")));
  for (const char* bad : {"0", "2.5", "\"big\"", "-1"}) {
    auto b = RuntimeConfigFromJsonText(
        absl::StrCat(R"({"zero_optimization": {"sub_group_size": )", bad, "}}"), &warnings);
    EXPECT_FALSE(b.ok()) << bad;
    EXPECT_THAT(b.status().message(), HasSubstr("zero_optimization.sub_group_size")) << bad;
  }
}

TEST(RuntimeConfigTest, OffloadParamKeysAreReadOnlyWhereDeepSpeedHasThem) {
  // offload_param has no optimizer keys and offload_optimizer no buffer_size or max_in_cpu:
  // DeepSpeed refuses them, and strata would read them into nothing.
  for (const char* json : {R"({"zero_optimization": {"offload_param": {"pipeline_read": true}}})",
                           R"({"zero_optimization": {"offload_param": {"ratio": 0.5}}})",
                           R"({"zero_optimization": {"offload_optimizer": {"buffer_size": 1e8}}})",
                           R"({"zero_optimization": {"offload_optimizer": {"max_in_cpu": 1e9}}})",
                           R"({"zero_optimization": {"offload_optimizer": {"pipeline": true}}})"}) {
    auto c = RuntimeConfigFromJsonText(json);
    ASSERT_FALSE(c.ok()) << json;
    EXPECT_THAT(c.status().message(), HasSubstr("unknown key")) << json;
  }
}

TEST(RuntimeConfigTest, EveryValueDeepSpeedAcceptsIsAccepted) {
  // DeepSpeed's ranges: ratio in [0, 1], buffer_count from 0.
  auto c = RuntimeConfigFromJsonText(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "buffer_count": 0},
      "offload_optimizer": {"device": "cpu", "ratio": 0.0, "buffer_count": 0}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->offload_optimizer.ratio, 0.0);
  EXPECT_EQ(c->offload_param.buffer_count, 0);
  EXPECT_THAT(
      RuntimeConfigFromJsonText(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})")
          .status()
          .message(),
      HasSubstr("offload_optimizer.ratio: must be a number in [0, 1], got 1.5"));
}

TEST(RuntimeConfigTest, TraceEvictionIsTheDefaultAndLruIsAccepted) {
  EXPECT_EQ(RuntimeConfig().eviction_policy, "trace");
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({"strata": {"eviction_policy": "lru"}})", &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eviction_policy, "lru");
  EXPECT_THAT(All(warnings), Not(HasSubstr("eviction_policy")));
}

TEST(RuntimeConfigTest, TheMallocMmapThresholdIsGlibcsOwnUnlessSet) {
  EXPECT_EQ(RuntimeConfig().malloc_mmap_threshold_bytes, 0u);  // glibc's own, as torch's
  auto c = RuntimeConfigFromJsonText(R"({"strata": {"malloc_mmap_threshold_bytes": 0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->malloc_mmap_threshold_bytes, 0u);
  EXPECT_THAT(RuntimeConfigFromJsonText(R"({"strata": {"malloc_mmap_threshold_bytes": 67108864}})")
                  .status()
                  .message(),
              HasSubstr("malloc_mmap_threshold_bytes"));
}

TEST(RuntimeConfigTest, CommTransportIsAutoShmOrTcp) {
  EXPECT_EQ(RuntimeConfig().comm_transport, "auto");
  for (const char* ok : {"auto", "shm", "tcp"}) {
    auto c =
        RuntimeConfigFromJsonText(absl::StrCat(R"({"strata": {"comm_transport": ")", ok, R"("}})"));
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->comm_transport, ok);
  }
  for (const char* bad :
       {R"({"strata": {"comm_transport": "nccl"}})", R"({"strata": {"comm_transport": 1}})"}) {
    EXPECT_THAT(RuntimeConfigFromJsonText(bad).status().message(),
                HasSubstr("strata.comm_transport"))
        << bad;
  }
  // Another type is named as given, with what is accepted (it said "must be a string").
  EXPECT_THAT(RuntimeConfigFromJsonText(R"({"strata": {"comm_transport": 5}})").status().message(),
              HasSubstr("\"5\": accepted: auto"));
  EXPECT_THAT(
      RuntimeConfigFromJsonText(R"({"strata": {"comm_transport": "nccl"}})").status().message(),
      HasSubstr("accepted: auto"));
}

TEST(RuntimeConfigTest, OptimizerCommitIsStepOrPartition) {
  EXPECT_FALSE(RuntimeConfig().optimizer_commit_each);
  auto step = RuntimeConfigFromJsonText(R"({"strata": {"optimizer_commit": "step"}})");
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->optimizer_commit_each);
  auto partition = RuntimeConfigFromJsonText(R"({"strata": {"optimizer_commit": "partition"}})");
  ASSERT_TRUE(partition.ok()) << partition.status();
  EXPECT_TRUE(partition->optimizer_commit_each);
  for (const char* bad : {R"({"strata": {"optimizer_commit": "layer"}})",
                          R"({"strata": {"optimizer_commit": true}})"}) {
    EXPECT_THAT(RuntimeConfigFromJsonText(bad).status().message(),
                AllOf(HasSubstr("strata.optimizer_commit"), HasSubstr("accepted: step"),
                      HasSubstr("partition")))
        << bad;
  }
  // Host-resident state: said to do nothing.
  std::vector<std::string> warnings;
  auto on_cpu = RuntimeConfigFromJsonText(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "strata": {"optimizer_commit": "partition"}})",
      &warnings);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_THAT(warnings, ::testing::Contains(HasSubstr("optimizer_commit")));
}

TEST(RuntimeConfigTest, OptimizerCommitAutoIsPartitionWhereTheNvmeStateIsBeyondTheHostBudget) {
  auto c = RuntimeConfigFromJsonText(R"({
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                              "nvme_path": "/tmp/x"},
                            "offload_param": {"buffer_count": 2, "buffer_size": 65536}},
      "strata": {"host_budget_bytes": 1000000}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->optimizer_commit_auto);
  EXPECT_FALSE(c->CommitEach(1000000));
  EXPECT_TRUE(c->CommitEach(1000001));
  RuntimeConfig step = *c;  // given: what it says
  step.optimizer_commit_auto = false;
  EXPECT_FALSE(step.CommitEach(1 << 30));
  RuntimeConfig behind = *c;  // optimizer_write_behind true is a "step" option
  behind.optimizer_write_behind = true;
  EXPECT_FALSE(behind.CommitEach(1 << 30));
  RuntimeConfig on_cpu = *c;
  on_cpu.offload_optimizer.device = OffloadDevice::kCpu;
  EXPECT_FALSE(on_cpu.CommitEach(1 << 30));
  auto named = RuntimeConfigFromJsonText(R"({"strata": {"optimizer_commit": "auto"}})");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE(named->optimizer_commit_auto);
}

// The sub-groups the optimizer takes: sub_group_size at most, smaller where its ring would take
// more than a quarter of the host room (whole 1024-element multiples, at least 1024); and the
// smallest host budget, in parts, at which the Runtime's own choices fit.
TEST(RuntimeConfigTest, SubGroupsFitTheHostRoomAndTheSmallestBudgetIsTheirs) {
  RuntimeConfig c;
  EXPECT_EQ(c.SubGroupFor(5000, 4, false, 1 << 30), 5000u);  // the largest partition, whole
  EXPECT_EQ(c.SubGroupFor(1 << 20, 4, false, 4 * 48 * 4096), 4096u);  // 48 bytes an element
  EXPECT_EQ(c.SubGroupFor(1 << 20, 4, true, 4 * 64 * 4096), 4096u);   // 64 with copy buffers
  EXPECT_EQ(c.SubGroupFor(1 << 20, 4, true, 100), 1024u);             // never under 1024
  EXPECT_EQ(c.SubGroupFor(100, 4, true, 100), 100u);                  // nor over the partition
  c.sub_group_size = 2048;
  EXPECT_EQ(c.SubGroupFor(1 << 20, 4, true, 1 << 30), 2048u);  // the config's, a ceiling

  auto nvme = RuntimeConfigFromJsonText(R"({
      "zero_optimization": {"stage": 3,
          "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 4},
          "offload_param": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 4,
                            "buffer_size": 65536}},
      "strata": {"host_budget_bytes": 1000000}})");
  ASSERT_TRUE(nvme.ok()) << nvme.status();
  const uint64_t widest = 1 << 20, grad = 4 << 20, param = 4 << 20;
  const RuntimeConfig::HostMinimum m = nvme->MinimumHost(8 << 20, widest, grad, 0, param);
  EXPECT_EQ(m.staging, 4u * 65536);
  EXPECT_EQ(m.partition, grad + param);  // "auto" commits each partition this small
  // The ring at the sub-groups the Runtime would take in the room left beside the staging
  // buffers: it fits there with the partitions, a quarter of that room at most.
  const uint64_t room = m.total() - m.staging;
  const uint64_t g = nvme->SubGroupFor(widest, 4, true, room);
  EXPECT_EQ(m.optimizer, 4 * (12 * g + 4 * g));
  EXPECT_LE(m.optimizer + m.partition, room);
  EXPECT_LE(4 * m.optimizer, room);
  // Host-resident state: the state itself.
  RuntimeConfig cpu = *nvme;
  cpu.offload_optimizer.device = OffloadDevice::kCpu;
  EXPECT_EQ(cpu.MinimumHost(1000, 100, 0, 0).optimizer, 12288u);
}

TEST(RuntimeConfigTest, OptimizerReadAheadIsBytesOrAuto) {
  EXPECT_FALSE(RuntimeConfig().optimizer_read_ahead_bytes.has_value());  // "auto"
  auto automatic =
      RuntimeConfigFromJsonText(R"({"strata": {"optimizer_read_ahead_bytes": "auto"}})");
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_FALSE(automatic->optimizer_read_ahead_bytes.has_value());
  for (const auto& [text, want] : std::vector<std::pair<const char*, uint64_t>>{
           {R"({"strata": {"optimizer_read_ahead_bytes": 0}})", 0},
           {R"({"strata": {"optimizer_read_ahead_bytes": 1e9}})", 1000000000}}) {
    auto c = RuntimeConfigFromJsonText(text);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->optimizer_read_ahead_bytes, want) << text;
  }
  for (const char* bad : {R"({"strata": {"optimizer_read_ahead_bytes": -1}})",
                          R"({"strata": {"optimizer_read_ahead_bytes": "lots"}})",
                          R"({"strata": {"optimizer_read_ahead_bytes": 1.5}})"}) {
    EXPECT_THAT(RuntimeConfigFromJsonText(bad).status().message(),
                AllOf(HasSubstr("strata.optimizer_read_ahead_bytes"), HasSubstr("accepted: bytes"),
                      HasSubstr("\"auto\"")))
        << bad;
  }
}

TEST(RuntimeConfigTest, OptimizerWriteBehindIsABoolOrAutoAndNotWithPartitionCommits) {
  EXPECT_TRUE(RuntimeConfig().OptimizerWriteBehind());  // "auto" with commit "step": on
  const char* nvme =
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
          "nvme_path": "/tmp"}})";
  for (const auto& [strata, want] : std::vector<std::pair<std::string, bool>>{
           {R"("optimizer_write_behind": "auto")", true},
           {R"("optimizer_write_behind": true)", true},
           {R"("optimizer_write_behind": false)", false},
           {R"("optimizer_commit": "partition")", false},
           {R"("optimizer_commit": "partition", "optimizer_write_behind": "auto")", false},
           {R"("optimizer_commit": "partition", "optimizer_write_behind": false)", false}}) {
    const std::string text = absl::StrCat("{", nvme, R"(, "strata": {)", strata, "}}");
    auto c = RuntimeConfigFromJsonText(text);
    ASSERT_TRUE(c.ok()) << c.status() << text;
    EXPECT_EQ(c->OptimizerWriteBehind(), want) << text;
  }
  for (const char* bad : {R"("optimizer_write_behind": "yes")", R"("optimizer_write_behind": 1)"}) {
    const std::string text = absl::StrCat("{", nvme, R"(, "strata": {)", bad, "}}");
    EXPECT_THAT(RuntimeConfigFromJsonText(text).status().message(),
                AllOf(HasSubstr("strata.optimizer_write_behind"),
                      HasSubstr("accepted: true, false, \"auto\"")))
        << text;
  }
  const std::string both = absl::StrCat(
      "{", nvme,
      R"(, "strata": {"optimizer_commit": "partition", "optimizer_write_behind": true}})");
  EXPECT_THAT(RuntimeConfigFromJsonText(both).status().message(),
              AllOf(HasSubstr("strata.optimizer_write_behind"),
                    HasSubstr("accepted there: false or \"auto\"")));
  std::vector<std::string> warnings;
  auto on_cpu = RuntimeConfigFromJsonText(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "strata": {"optimizer_write_behind": true}})",
      &warnings);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_THAT(warnings, ::testing::Contains(HasSubstr("optimizer_write_behind: true is for")));
}

TEST(RuntimeConfigTest, OptimizerThreadsCopyStreamsAndDuringBackwardAreReadAndChecked) {
  EXPECT_EQ(RuntimeConfig().optimizer_threads, 0);  // one per core
  EXPECT_EQ(RuntimeConfig().copy_streams, 1);
  EXPECT_FALSE(RuntimeConfig().optimizer_during_backward.has_value());  // "auto"
  EXPECT_FALSE(RuntimeConfig().OptimizerDuringBackward());  // auto on the emulated device: off
  for (const char* auto_on_cuda :
       {R"({"zero_optimization": {"stage": 3}, "strata": {"device": "cuda"}})",
        R"({"zero_optimization": {"stage": 2}, "strata": {"device": "cuda"}})",
        R"({"zero_optimization": {"stage": 3},
            "strata": {"device": "cuda", "optimizer_during_backward": "auto"}})"}) {
    auto a = RuntimeConfigFromJsonText(auto_on_cuda);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a->OptimizerDuringBackward()) << auto_on_cuda;
    EXPECT_EQ(a->OptimizerThreads(16), 16) << "the pool: one thread per core";
    EXPECT_EQ(a->OptimizerThreadsWhileStaging(16), 14)
        << "all but two cores while it steps during backward";
    EXPECT_EQ(a->OptimizerThreadsWhileStaging(2), 1);
  }
  // Below stage 2 nothing steps during backward: "auto" is off on cuda too, every core steps
  // after backward; asked for, it is on (two cores left all the same while backward runs).
  for (int stage : {0, 1}) {
    auto below = RuntimeConfigFromJsonText(absl::StrCat(
        R"({"zero_optimization": {"stage": )", stage, R"(}, "strata": {"device": "cuda"}})"));
    ASSERT_TRUE(below.ok()) << below.status();
    EXPECT_FALSE(below->OptimizerDuringBackward()) << "stage " << stage;
    EXPECT_EQ(below->OptimizerThreads(16), 16) << "stage " << stage;
    EXPECT_EQ(below->OptimizerThreadsWhileStaging(16), 0) << "stage " << stage;
    auto asked = RuntimeConfigFromJsonText(
        absl::StrCat(R"({"zero_optimization": {"stage": )", stage,
                     R"(}, "strata": {"device": "cuda", "optimizer_during_backward": true}})"));
    ASSERT_TRUE(asked.ok()) << asked.status();
    EXPECT_TRUE(asked->OptimizerDuringBackward()) << "stage " << stage;
  }
  auto off = RuntimeConfigFromJsonText(
      R"({"strata": {"device": "cuda", "optimizer_during_backward": false}})");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->OptimizerDuringBackward());
  EXPECT_EQ(off->OptimizerThreads(16), 16) << "one per core";
  EXPECT_EQ(off->OptimizerThreadsWhileStaging(16), 0) << "the whole pool";
  auto c = RuntimeConfigFromJsonText(
      R"({"strata": {"optimizer_threads": 14, "copy_streams": 2,
                     "optimizer_during_backward": true}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer_threads, 14);
  EXPECT_EQ(c->copy_streams, 2);
  EXPECT_TRUE(c->OptimizerDuringBackward());  // on the emulated device too, when asked
  EXPECT_EQ(c->OptimizerThreads(16), 14) << "the configured count";
  EXPECT_EQ(c->OptimizerThreadsWhileStaging(16), 0) << "the configured pool, always whole";
  for (const char* bad : {R"({"strata": {"optimizer_during_backward": "yes"}})",
                          R"({"strata": {"optimizer_during_backward": 1}})"}) {
    EXPECT_THAT(RuntimeConfigFromJsonText(bad).status().message(),
                AllOf(HasSubstr("strata.optimizer_during_backward"), HasSubstr("\"auto\"")))
        << bad;
  }
  for (const char* bad :
       {R"({"strata": {"optimizer_threads": -1}})", R"({"strata": {"optimizer_threads": 1025}})",
        R"({"strata": {"optimizer_threads": "all"}})"}) {
    EXPECT_THAT(RuntimeConfigFromJsonText(bad).status().message(),
                HasSubstr("strata.optimizer_threads"))
        << bad;
  }
  for (const char* bad :
       {R"({"strata": {"copy_streams": 0}})", R"({"strata": {"copy_streams": 3}})"}) {
    EXPECT_THAT(RuntimeConfigFromJsonText(bad).status().message(), HasSubstr("strata.copy_streams"))
        << bad;
  }
}

TEST(RuntimeConfigTest, TheDeviceIndexIsLocalRanksUnlessANumberIsGiven) {
  EXPECT_EQ(RuntimeConfig().device_index, -1);
  auto local = RuntimeConfigFromJsonText(R"({"strata": {"device_index": "local_rank"}})");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->device_index, -1);
  auto given = RuntimeConfigFromJsonText(R"({"strata": {"device": "cuda", "device_index": 3}})");
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->device_index, 3);
  for (const char* bad :
       {R"({"strata": {"device_index": -1}})", R"({"strata": {"device_index": 1024}})",
        R"({"strata": {"device_index": 1.5}})", R"({"strata": {"device_index": "auto"}})"}) {
    EXPECT_THAT(RuntimeConfigFromJsonText(bad).status().message(),
                AllOf(HasSubstr("strata.device_index"), HasSubstr("\"local_rank\"")))
        << bad;
  }
}

TEST(RuntimeConfigTest, NvmeFilesAreRemovedUnlessKeepFilesIsSet) {
  EXPECT_FALSE(RuntimeConfig().nvme_keep_files);
  std::vector<std::string> warnings;
  auto c = RuntimeConfigFromJsonText(R"({"strata": {"nvme_keep_files": true}})", &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->nvme_keep_files);
  EXPECT_THAT(All(warnings), Not(HasSubstr("nvme_keep_files")));
}

struct Bad {
  const char* json;
  const char* message;
};
class RuntimeConfigRejects : public ::testing::TestWithParam<Bad> {};

TEST_P(RuntimeConfigRejects, NamingTheKeyAndWhatIsAccepted) {
  auto c = RuntimeConfigFromJsonText(GetParam().json);
  ASSERT_FALSE(c.ok()) << GetParam().json;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(GetParam().message)) << c.status();
}

INSTANTIATE_TEST_SUITE_P(
    BadValues, RuntimeConfigRejects,
    ::testing::Values(
        Bad{R"({"strata": {"host_budget_bytes": 0}})",
            "strata.host_budget_bytes: must be an integer in [1,"},
        Bad{R"({"strata": {"device_budget_bytes": -5}})", "strata.device_budget_bytes"},
        Bad{R"({"strata": {"device": "tpu"}})", "accepted: emulated, cuda"},
        Bad{R"({"strata": {"eviction": "lru"}})", "strata.eviction: unknown key"},
        Bad{R"({"strata": {"eviction_policy": "fifo"}})", "accepted: lru, trace"},
        Bad{R"({"strata": {"nvme_keep_files": "yes"}})",
            "strata.nvme_keep_files: must be a JSON boolean (true or false), got \"yes\""},
        Bad{R"({"strata": {"nvme_keep_file": true}})", "did you mean nvme_keep_files?"},
        Bad{R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
            "offload_param.nvme_path: is required when device is \"nvme\""},
        Bad{R"({"zero_optimization": {"stage": 5}})",
            "zero_optimization.stage: must be an integer in [0, 3]"},
        Bad{R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
            "accepted: none, cpu, nvme"},
        Bad{R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 1.5}}})",
            "offload_optimizer.buffer_count: must be an integer"},
        Bad{R"({"zero_optimization": {"offload_optimizer": {"nvme": "/x"}}})",
            "offload_optimizer.nvme: unknown key"},
        Bad{R"({"zero_optimization": {"offload_param": {"buffer_size": 1e12}}})",
            "offload_param.buffer_size: must be an integer in [4096, 268435456]"},
        Bad{R"({"zero_optimization": {"offload_param": {"buffer_size": "auto"}}})",
            "write the value itself: an integer in [4096, 268435456]"},
        Bad{R"({"zero_optimisation": {"stage": 3}})",
            "zero_optimisation: unknown key (not DeepSpeed's, not strata's); did you mean "
            "zero_optimization?"},
        Bad{R"({"zero_optimization": {"stage3_prefetch_bucketsize": 5e8}})",
            "did you mean stage3_prefetch_bucket_size?"},
        Bad{R"({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 1}})",
            "give either prefetch_bucket_size or stage3_prefetch_bucket_size"},
        Bad{R"({"seq_parallel_communication_data_type": "fp32"})",
            "did you mean seq_parallel_comm_data_type?"},
        Bad{R"({"strata": {"host_budget": 5}})", "did you mean host_budget_bytes?"},
        Bad{R"({"train_batch_size": 8,
                "aio": {"block_size": 1048576,}})",
            "not valid JSON at line 2, column 47"},
        Bad{R"({"aio": {"queue_depth": 0}})", "aio.queue_depth"}));

}  // namespace
}  // namespace strata::tiering
