// One rule for reading config values, shared by aio/ and tiering/: exact integers, whole floats,
// "auto" explained, unknown keys with the closest known one, JSON errors with line and column.
#include "base/config_reader.h"

#include <cstdint>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::config {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<std::optional<int64_t>> IntOf(const char* json, int64_t lo, int64_t hi) {
  return IntAt(*Parse(json), "b.", "k", lo, hi);
}

TEST(ConfigReaderTest, IntegersAreExactAndWholeFloatsAreAccepted) {
  constexpr int64_t kBig = (int64_t{1} << 56) + 1;
  EXPECT_EQ(**IntOf(R"({"k": 72057594037927937})", 0, int64_t{1} << 62), kBig);
  EXPECT_EQ(**IntOf(R"({"k": 1e8})", 0, int64_t{1} << 40), 100000000);
  EXPECT_EQ(**IntOf(R"({"k": 1048576.0})", 0, int64_t{1} << 40), 1048576);
  EXPECT_FALSE(IntOf(R"({})", 0, 1)->has_value());
  // A float beyond 2^53 may not be the integer its text says: refused, not rounded.
  EXPECT_THAT(IntOf(R"({"k": 7.2057594037927937e16})", 0, int64_t{1} << 62).status().message(),
              HasSubstr("a whole number of at most 2^53"));
  EXPECT_THAT(IntOf(R"({"k": 2.5})", 0, 10).status().message(), HasSubstr("b.k: must be"));
  EXPECT_THAT(IntOf(R"({"k": 18446744073709551615})", 0, 10).status().message(),
              HasSubstr("must be an integer in [0, 10], got 18446744073709551615"));
  EXPECT_THAT(IntOf(R"({"k": -1})", 0, 10).status().message(), HasSubstr("got -1"));
  EXPECT_THAT(IntOf(R"({"k": "8"})", 0, 10).status().message(), HasSubstr("got \"8\""));
  EXPECT_THAT(IntOf(R"({"k": "auto"})", 0, 10).status().message(),
              HasSubstr("b.k: \"auto\" is filled in by the Hugging Face / Lightning integration"));
}

TEST(ConfigReaderTest, TheClosestKeyIsNamedOnlyWhenItIsClose) {
  const std::vector<std::string> keys = {"zero_optimization", "train_batch_size", "aio"};
  EXPECT_EQ(Closest("zero_optimisation", keys), "zero_optimization");
  EXPECT_EQ(Closest("train_batch", keys), "train_batch_size");
  EXPECT_EQ(Closest("learning_rate", keys), "");
  absl::Status s = CheckKeys(*Parse(R"({"zero_optimisation": {}})"), "(top)", keys);
  EXPECT_THAT(s.message(), HasSubstr("(top).zero_optimisation: unknown key (did you mean "
                                     "zero_optimization?)"));
}

TEST(ConfigReaderTest, InvalidJsonNamesLineAndColumn) {
  auto bad = Parse("{\n  \"aio\": {\n    \"queue_depth\": 8,\n  }\n}");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("not valid JSON at line 4, column 3"));
  EXPECT_THAT(Parse("").status().message(), HasSubstr("line 1, column 1"));
}

TEST(ConfigReaderTest, ANumberBeyondADoubleIsRefusedNotThrown) {
  // nlohmann reports it as out_of_range, not as a parse error.
  auto bad = Parse("{\"aio\": {\"queue_depth\": 1e400}}");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("config: not valid JSON"));
  EXPECT_THAT(bad.status().message(), HasSubstr("1e400"));
}

TEST(ConfigReaderTest, AKeyGivenTwiceIsRefusedNamingIt) {
  auto twice = Parse(R"({"zero_optimization": {"offload_param": {"buffer_size": 1e8,
                         "device": "nvme", "buffer_size": 4096}}})");
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.status().message(),
              HasSubstr("config: zero_optimization.offload_param.buffer_size: given twice"));
  EXPECT_THAT(Parse(R"({"aio": {}, "aio": {}})").status().message(),
              HasSubstr("config: aio: given"));
  EXPECT_THAT(Parse(R"({"a": [{"k": 1, "k": 2}]})").status().message(), HasSubstr("a[].k: given"));
  // The same key in different objects is not a duplicate.
  EXPECT_TRUE(Parse(R"({"a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 1}, {"k": 2}]})").ok());
}

}  // namespace
}  // namespace strata::config
