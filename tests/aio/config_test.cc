#include "aio/config.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace strata::aio {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(AioConfigTest, DefaultsAreDeepSpeeds) {
  AioConfig c;
  EXPECT_EQ(c.block_size, 1u << 20);
  EXPECT_EQ(c.queue_depth, 8);
  EXPECT_EQ(c.intra_op_parallelism, 1);
  EXPECT_FALSE(c.single_submit);
  EXPECT_TRUE(c.overlap_events);
  EXPECT_EQ(c.engine, EngineKind::kIoUring);
  EXPECT_TRUE(Validate(c).ok());
}

TEST(AioConfigTest, ReadsDeepSpeedAndStrataBlocks) {
  auto c = AioConfigFromJsonText(R"({
    "aio": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 2,
            "single_submit": true, "overlap_events": false, "use_gds": false},
    "strata": {"aio": {"engine": "libaio", "direct": false}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->block_size, 262144u);
  EXPECT_EQ(c->queue_depth, 32);
  EXPECT_EQ(c->intra_op_parallelism, 2);
  EXPECT_TRUE(c->single_submit);
  EXPECT_FALSE(c->overlap_events);
  EXPECT_EQ(c->engine, EngineKind::kLibAio);
  EXPECT_FALSE(c->direct);
}

TEST(AioConfigTest, OldThreadCountIsReadWithAWarning) {
  std::vector<std::string> warnings;
  auto c = AioConfigFromJsonText(R"({"aio": {"thread_count": 4}})", &warnings);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->intra_op_parallelism, 4);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("intra_op_parallelism"));
}

TEST(AioConfigTest, ThreadCountWithIntraOpParallelismIsRejected) {
  auto c = AioConfigFromJsonText(R"({"aio": {"thread_count": 4, "intra_op_parallelism": 2}})");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("aio.thread_count"));
}

struct BadCase {
  const char* json;
  const char* must_mention;
};

class AioConfigRejects : public ::testing::TestWithParam<BadCase> {};

TEST_P(AioConfigRejects, WithAMessageNamingKeyAndRange) {
  auto c = AioConfigFromJsonText(GetParam().json);
  ASSERT_FALSE(c.ok()) << GetParam().json;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(GetParam().must_mention)) << c.status();
}

INSTANTIATE_TEST_SUITE_P(
    BadValues, AioConfigRejects,
    ::testing::Values(
        BadCase{R"({"aio": {"queue_depth": 0}})",
                "aio.queue_depth: must be an integer in [1, 1024], got 0"},
        BadCase{R"({"aio": {"intra_op_parallelism": 0}})", "aio.intra_op_parallelism"},
        BadCase{R"({"aio": {"block_size": 6144}})", "block_size: must be a power of two"},
        BadCase{R"({"aio": {"block_size": 512}})", "aio.block_size: must be an integer in [4096"},
        BadCase{R"({"aio": {"block_size": 1048576.5}})", "a float is read only when it is a whole"},
        BadCase{R"({"aio": {"queue_depth": "auto"}})",
                "aio.queue_depth: \"auto\" is filled in by the Hugging Face / Lightning "
                "integration"},
        BadCase{R"({"aio": {"queue_dept": 8}})", "did you mean queue_depth?"},
        BadCase{R"({"aio": {"block_size": "1M"}})", "aio.block_size: must be an integer"},
        BadCase{R"({"aio": {"single_submit": "false"}})",
                "aio.single_submit: must be a JSON boolean"},
        BadCase{R"({"aio": {"use_gds": true}})", "aio.use_gds"},
        BadCase{R"({"aio": {"qd": 8}})", "aio.qd: unknown key; accepted keys: block_size"},
        BadCase{R"({"aio": 5})", "aio: must be a JSON object"},
        BadCase{R"({"strata": {"aio": {"engine": "spdk"}}})", "accepted: io_uring, libaio, posix"},
        BadCase{R"({"strata": {"aio": {"engine": "libaio", "sqpoll": true}}})",
                "strata.aio.sqpoll: only the io_uring engine"},
        BadCase{R"({"strata": {"aio": {"sqpol": true}}})", "strata.aio.sqpol: unknown key"},
        BadCase{R"({"aio": {"queue_depth": -3}})", "got -3"},
        BadCase{R"({"aio": {"queue_depth": 18446744073709551615}})", "aio.queue_depth"},
        BadCase{R"([1, 2])", "must be a JSON object"},
        BadCase{"{\n  \"aio\": {\n    \"queue_depth\": 8,\n  }\n}",
                "not valid JSON at line 4, column 3"}));

TEST(AioConfigTest, NumbersFollowOneRuleWithTheRuntimeConfig) {
  // DeepSpeed writes sizes as floats; a whole float is read exactly like the integer.
  auto c = AioConfigFromJsonText(R"({"aio": {"block_size": 1048576.0, "queue_depth": 3.2e1}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->block_size, 1048576u);
  EXPECT_EQ(c->queue_depth, 32);
}

TEST(AioConfigTest, ToJsonRoundTripsAndUsesDeepSpeedsKeys) {
  AioConfig c;
  c.block_size = 4 << 20;
  c.queue_depth = 16;
  c.intra_op_parallelism = 2;
  c.registered_buffers = true;
  nlohmann::json j = AioConfigToJson(c);
  EXPECT_TRUE(j["aio"].contains("intra_op_parallelism"));
  EXPECT_FALSE(j["aio"].contains("thread_count"));
  EXPECT_TRUE(j["aio"]["single_submit"].is_boolean());
  auto back = AioConfigFromJson(j);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->block_size, c.block_size);
  EXPECT_EQ(back->queue_depth, 16);
  EXPECT_EQ(back->intra_op_parallelism, 2);
  EXPECT_TRUE(back->registered_buffers);
}

TEST(AioConfigTest, ValidateNamesKeyForProgrammaticConfigs) {
  AioConfig c;
  c.queue_depth = 0;
  EXPECT_THAT(Validate(c).message(), HasSubstr("queue_depth"));
  c = AioConfig();
  c.intra_op_parallelism = 0;
  EXPECT_THAT(Validate(c).message(), HasSubstr("intra_op_parallelism: must be in [1, 256]"));
}

}  // namespace
}  // namespace strata::aio
