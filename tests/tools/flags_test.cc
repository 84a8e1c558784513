// The one flag parser every tool and benchmark uses: spellings, booleans, ranges (help is checked
// through the real tools in cli_test.cc).
#include "tools/aio_bench/flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_FLAG(int64_t, size_mb, 64, "scratch size");
ABSL_FLAG(double, rep_seconds, 0.5, "seconds per run");
ABSL_FLAG(bool, uring_options, true, "sweep io_uring's options");
ABSL_FLAG(std::string, out, "", "where results go");

namespace strata::aio_bench {
namespace {

using ::testing::ExitedWithCode;

const std::vector<FlagRange> kRanges = {{"size_mb", 4, 1024}, {"rep_seconds", 0.01, 600}};

void Parse(std::vector<std::string> args, const std::vector<FlagRange>& ranges = kRanges) {
  args.insert(args.begin(), "tool");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ParseFlagsOrExit(static_cast<int>(argv.size()), argv.data(), "tool [flags]",
                   "tests/tools/flags_test.cc", ranges);
}

TEST(FlagsTest, DashesAndUnderscoresNameTheSameFlag) {
  Parse({"--size-mb=8", "--rep_seconds", "0.25", "--no-uring-options", "--out", "x"});
  EXPECT_EQ(absl::GetFlag(FLAGS_size_mb), 8);
  EXPECT_EQ(absl::GetFlag(FLAGS_rep_seconds), 0.25);
  EXPECT_FALSE(absl::GetFlag(FLAGS_uring_options));
  EXPECT_TRUE(FlagGiven("rep_seconds"));
  Parse({"--size_mb", "16", "--rep-seconds=1", "--uring_options"});
  EXPECT_EQ(absl::GetFlag(FLAGS_size_mb), 16);
  EXPECT_EQ(absl::GetFlag(FLAGS_rep_seconds), 1.0);
  EXPECT_TRUE(absl::GetFlag(FLAGS_uring_options));
  for (const char* negated : {"--no_uring_options", "--nouring-options", "--uring-options=false"}) {
    Parse({"--uring-options", negated});
    EXPECT_FALSE(absl::GetFlag(FLAGS_uring_options)) << negated;
  }
}

TEST(FlagsDeathTest, ANumberOutsideItsRangeOrNotANumberExits2NamingTheRange) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"--size-mb=-1"}, "tool: --size-mb: must be an integer in \\[4, 1024\\], got -1"},
           {{"--size_mb", "0"}, "--size-mb: must be an integer in \\[4, 1024\\], got 0"},
           {{"--size-mb=abc"}, "--size-mb: must be an integer in \\[4, 1024\\], got \"abc\""},
           {{"--size-mb=1.5"}, "--size-mb: must be an integer in \\[4, 1024\\], got \"1.5\""},
           {{"--rep-seconds=-0.5"}, "--rep-seconds: must be a number in \\[0.01, 600\\], got -0.5"},
           {{"--rep-seconds=nan"}, "--rep-seconds: must be a number in \\[0.01, 600\\], got nan"},
           {{"--rep-seconds=inf"}, "--rep-seconds: must be a number in \\[0.01, 600\\], got inf"},
           {{"--rep-seconds="}, "--rep-seconds: must be a number in \\[0.01, 600\\], got \"\""},
           {{"--rep-seconds"}, "--rep-seconds: needs a value"},
           {{"--nosuch"}, "--nosuch: unknown flag; accepted: --out --rep-seconds"},
           {{"--no-out"}, "--no-out: unknown flag"},
           {{"--uring-options", "false"}, "--uring-options: a boolean takes its value after '='"},
           {{"--no-uring-options=true"}, "--no-uring-options: takes no value"},
           {{"stray"}, "stray: unexpected argument"}}) {
    EXPECT_EXIT(Parse(c.args), ExitedWithCode(2), c.message) << c.args[0];
  }
}

TEST(FlagsDeathTest, ANumericFlagWithoutARangeIsTheProgrammersMistake) {
  EXPECT_DEATH(Parse({}, {{"size_mb", 4, 1024}}), "numeric flag rep_seconds has no range");
  EXPECT_DEATH(Parse({}, {{"size_mb", 4, 1024}, {"rep_seconds", 0, 1}, {"out", 0, 1}}),
               "a range for out, which is not a numeric flag");
}

}  // namespace
}  // namespace strata::aio_bench
