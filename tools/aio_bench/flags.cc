#include "tools/aio_bench/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace strata::aio_bench {
namespace {

std::string g_program = "aio_bench";
std::set<std::string> g_given;  // flags set on the command line (Abseil names)

std::vector<absl::CommandLineFlag*> OwnFlags(absl::string_view file_substr) {
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->Filename().find(std::string(file_substr)) != std::string::npos) {
      flags.push_back(flag);
    }
  }
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  return flags;
}

void PrintHelp(absl::string_view usage, const std::vector<absl::CommandLineFlag*>& flags) {
  std::printf("%s\n\nflags:\n", std::string(usage).c_str());
  for (const auto* f : flags) {
    std::printf("  --%s (default %s)\n      %s\n",
                absl::StrReplaceAll(f->Name(), {{"_", "-"}}).c_str(),
                f->DefaultValue().empty() ? "\"\"" : f->DefaultValue().c_str(), f->Help().c_str());
  }
}

}  // namespace

void BadFlag(absl::string_view flag, absl::string_view message) {
  std::fprintf(stderr, "%s: %s: %s\n", g_program.c_str(), std::string(flag).c_str(),
               std::string(message).c_str());
  std::exit(2);
}

void ParseFlagsOrExit(int argc, char** argv, absl::string_view usage,
                      absl::string_view flags_file_substr) {
  if (argc > 0) {
    g_program = argv[0];
    g_program = g_program.substr(g_program.rfind('/') + 1);
  }
  const std::vector<absl::CommandLineFlag*> own = OwnFlags(flags_file_substr);
  std::vector<std::string> names;
  for (const auto* f : own) names.push_back("--" + absl::StrReplaceAll(f->Name(), {{"_", "-"}}));
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull") {
      PrintHelp(usage, own);
      std::exit(0);
    }
    if (!absl::ConsumePrefix(&arg, "--")) {
      BadFlag(arg, "unexpected argument; flags look like --name=value (see --help)");
    }
    std::string name, value;
    bool has_value = false;
    if (auto eq = arg.find('='); eq != absl::string_view::npos) {
      name = std::string(arg.substr(0, eq));
      value = std::string(arg.substr(eq + 1));
      has_value = true;
    } else {
      name = std::string(arg);
    }
    absl::StrReplaceAll({{"-", "_"}}, &name);
    absl::CommandLineFlag* flag = nullptr;
    for (auto* f : own) {
      if (f->Name() == name) flag = f;
    }
    bool negated = false;
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      // --nox, --no-x, --no_x
      absl::string_view rest = absl::string_view(name).substr(2);
      absl::ConsumePrefix(&rest, "_");
      for (auto* f : own) {
        if (f->Name() == rest && f->IsOfType<bool>()) flag = f;
      }
      negated = flag != nullptr;
    }
    const std::string shown = "--" + absl::StrReplaceAll(name, {{"_", "-"}});
    if (flag == nullptr) {
      BadFlag(shown, absl::StrCat("unknown flag; accepted: ", absl::StrJoin(names, " ")));
    }
    if (flag->IsOfType<bool>()) {
      if (!has_value) value = negated ? "false" : "true";
    } else if (!has_value) {
      if (i + 1 >= argc) BadFlag(shown, "needs a value");
      value = argv[++i];
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      BadFlag(shown, absl::StrCat("bad value \"", value, "\": ", error));
    }
    g_given.insert(std::string(flag->Name()));
  }
}

bool FlagGiven(absl::string_view name) { return g_given.count(std::string(name)) > 0; }

uint64_t ParseSize(absl::string_view flag, absl::string_view text, uint64_t lo, uint64_t hi) {
  std::string t = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  uint64_t mult = 1;
  if (!t.empty() && (t.back() == 'B')) t.pop_back();
  if (!t.empty() && (t.back() == 'I')) t.pop_back();  // "KiB"
  if (!t.empty()) {
    switch (t.back()) {
      case 'K':
        mult = 1ull << 10;
        break;
      case 'M':
        mult = 1ull << 20;
        break;
      case 'G':
        mult = 1ull << 30;
        break;
      default:
        break;
    }
    if (mult != 1) t.pop_back();
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(t, &v) || v * mult / mult != v || v * mult < lo || v * mult > hi) {
    BadFlag(flag, absl::StrCat("\"", text, "\" is not a size in [", SizeText(lo), ", ",
                               SizeText(hi), "] (sizes take K, M or G: 128K, 1M)"));
  }
  return v * mult;
}

std::vector<uint64_t> ParseSizeList(absl::string_view flag, absl::string_view text, uint64_t lo,
                                    uint64_t hi) {
  std::vector<uint64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    out.push_back(ParseSize(flag, part, lo, hi));
  }
  if (out.empty()) BadFlag(flag, "needs at least one value");
  return out;
}

std::vector<int> ParseIntList(absl::string_view flag, absl::string_view text, int lo, int hi) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < lo || v > hi) {
      BadFlag(flag, absl::StrCat("\"", part, "\" is not an integer in [", lo, ", ", hi, "]"));
    }
    out.push_back(v);
  }
  if (out.empty()) BadFlag(flag, "needs at least one value");
  return out;
}

std::vector<aio::EngineKind> ParseEngineList(absl::string_view flag, absl::string_view text) {
  std::vector<aio::EngineKind> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    auto kind = aio::ParseEngineKind(absl::StripAsciiWhitespace(part));
    if (!kind.ok()) BadFlag(flag, kind.status().message());
    out.push_back(*kind);
  }
  if (out.empty()) BadFlag(flag, "needs at least one engine (io_uring, libaio, posix)");
  return out;
}

std::string SizeText(uint64_t bytes) {
  if (bytes >= (1ull << 30) && bytes % (1ull << 30) == 0) return absl::StrCat(bytes >> 30, "G");
  if (bytes >= (1ull << 20) && bytes % (1ull << 20) == 0) return absl::StrCat(bytes >> 20, "M");
  if (bytes >= 1024 && bytes % 1024 == 0) return absl::StrCat(bytes >> 10, "K");
  return absl::StrCat(bytes);
}

}  // namespace strata::aio_bench
