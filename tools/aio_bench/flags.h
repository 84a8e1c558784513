// tools/aio_bench/flags.h: command-line parsing for the aio tools on top of Abseil flags, with the
// tools' contract: a bad flag or value prints a message naming the flag and what is accepted, and
// the program exits with code 2 (absl::ParseCommandLine exits with 1). Flag names may be written
// with '-' or '_' (--allow-buffered is --allow_buffered); booleans take --x, --no-x (--nox,
// --no_x), --x=true|false. Every numeric flag has an accepted range, checked for the value given
// (and the default): garbage, NaN and values outside it are refused naming the flag and the range,
// never replaced by a default. Help shows the dashed spelling and the ranges. The benchmarks under
// bench/ use it too.
//
// Thread safety: call from main() before any other thread starts.
#ifndef STRATA_TOOLS_AIO_BENCH_FLAGS_H_
#define STRATA_TOOLS_AIO_BENCH_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "aio/config.h"

namespace strata::aio_bench {

// The accepted values of a numeric (int, int64_t, uint64_t or double) flag: [lo, hi].
struct FlagRange {
  std::string name;  // Abseil's name (underscores)
  double lo = 0, hi = 0;
};

// Parses argv into the Abseil flags defined in files whose path contains `flags_file_substr`
// (so only this tool's flags are accepted), then checks every numeric one against its range in
// `ranges`. --help prints `usage` and those flags, then exits 0. Positional arguments are an
// error. A numeric flag without a range, or a range naming no flag of the tool, is the
// programmer's mistake: the program aborts saying which.
void ParseFlagsOrExit(int argc, char** argv, absl::string_view usage,
                      absl::string_view flags_file_substr, const std::vector<FlagRange>& ranges);

// Whether flag `name` (Abseil's name, with underscores) was given on the command line: a value the
// user typed is checked strictly, never silently replaced by a default.
bool FlagGiven(absl::string_view name);

// Prints "<program>: <flag>: <message>" to stderr and exits with code 2.
[[noreturn]] void BadFlag(absl::string_view flag, absl::string_view message);

// Parsers for the values of list flags; each names `flag` in its error and exits 2 on error.
// Sizes take a K/M/G suffix (powers of 1024): "128K,1M,8M".
std::vector<uint64_t> ParseSizeList(absl::string_view flag, absl::string_view text, uint64_t lo,
                                    uint64_t hi);
uint64_t ParseSize(absl::string_view flag, absl::string_view text, uint64_t lo, uint64_t hi);
std::vector<int> ParseIntList(absl::string_view flag, absl::string_view text, int lo, int hi);
std::vector<aio::EngineKind> ParseEngineList(absl::string_view flag, absl::string_view text);

// "1M", "128K", "3000" (bytes that are not a whole number of KiB).
std::string SizeText(uint64_t bytes);

}  // namespace strata::aio_bench

#endif  // STRATA_TOOLS_AIO_BENCH_FLAGS_H_
