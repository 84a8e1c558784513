#include "tools/aio_bench/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
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

std::string Dashed(absl::string_view name) {
  return absl::StrCat("--", absl::StrReplaceAll(name, {{"_", "-"}}));
}

// "an integer", "a number", or "" for a flag that is not numeric.
std::string NumericKind(const absl::CommandLineFlag& f) {
  if (f.IsOfType<int>() || f.IsOfType<int64_t>() || f.IsOfType<uint64_t>()) return "an integer";
  if (f.IsOfType<double>()) return "a number";
  return "";
}

std::string NumberText(double x) {
  if (x == static_cast<double>(static_cast<int64_t>(x))) return absl::StrCat(int64_t(x));
  return absl::StrCat(x);
}

std::string Accepted(const absl::CommandLineFlag& f, const FlagRange& r) {
  return absl::StrCat(NumericKind(f), " in [", NumberText(r.lo), ", ", NumberText(r.hi), "]");
}

void PrintHelp(absl::string_view usage, const std::vector<absl::CommandLineFlag*>& flags,
               const std::map<std::string, FlagRange>& ranges) {
  std::printf("%s\n\nflags (shown with dashes; underscores work too):\n",
              std::string(usage).c_str());
  for (const auto* f : flags) {
    std::string shown = Dashed(f->Name());
    if (f->IsOfType<bool>()) {
      shown = absl::StrCat("--[no-]", shown.substr(2));
    } else if (auto r = ranges.find(std::string(f->Name())); r != ranges.end()) {
      absl::StrAppend(&shown, "=<", Accepted(*f, r->second), ">");
    } else {
      absl::StrAppend(&shown, "=<text>");
    }
    std::printf("  %s (default %s)\n      %s\n", shown.c_str(),
                f->DefaultValue().empty() ? "\"\"" : f->DefaultValue().c_str(), f->Help().c_str());
  }
}

[[noreturn]] void ProgrammerError(absl::string_view message) {
  std::fprintf(stderr, "%s: internal error: %s\n", g_program.c_str(), std::string(message).c_str());
  std::abort();
}

}  // namespace

void BadFlag(absl::string_view flag, absl::string_view message) {
  std::fprintf(stderr, "%s: %s: %s\n", g_program.c_str(), std::string(flag).c_str(),
               std::string(message).c_str());
  std::exit(2);
}

void ParseFlagsOrExit(int argc, char** argv, absl::string_view usage,
                      absl::string_view flags_file_substr, const std::vector<FlagRange>& ranges) {
  if (argc > 0) {
    g_program = argv[0];
    g_program = g_program.substr(g_program.rfind('/') + 1);
  }
  const std::vector<absl::CommandLineFlag*> own = OwnFlags(flags_file_substr);
  auto find = [&](absl::string_view name) -> absl::CommandLineFlag* {
    for (auto* f : own) {
      if (f->Name() == name) return f;
    }
    return nullptr;
  };
  std::map<std::string, FlagRange> range_of;
  for (const FlagRange& r : ranges) {
    const absl::CommandLineFlag* f = find(r.name);
    if (f == nullptr || NumericKind(*f).empty()) {
      ProgrammerError(absl::StrCat("a range for ", r.name, ", which is not a numeric flag"));
    }
    range_of[r.name] = r;
  }
  std::vector<std::string> names;
  for (const auto* f : own) {
    names.push_back(Dashed(f->Name()));
    if (!NumericKind(*f).empty() && range_of.count(std::string(f->Name())) == 0) {
      ProgrammerError(absl::StrCat("numeric flag ", f->Name(), " has no range"));
    }
  }
  const absl::CommandLineFlag* valueless_bool = nullptr;  // the previous argument, if one
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull") {
      PrintHelp(usage, own, range_of);
      std::exit(0);
    }
    if (!absl::ConsumePrefix(&arg, "--")) {
      if (valueless_bool != nullptr) {
        const std::string shown = Dashed(valueless_bool->Name());
        BadFlag(shown, absl::StrCat("a boolean takes its value after '=' (", shown, "=", arg,
                                    ") or is written ", shown, " / --no-", shown.substr(2)));
      }
      BadFlag(arg, "unexpected argument; flags look like --name=value (see --help)");
    }
    valueless_bool = nullptr;
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
    absl::CommandLineFlag* flag = find(name);
    bool negated = false;
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      // --nox, --no-x, --no_x
      absl::string_view rest = absl::string_view(name).substr(2);
      absl::ConsumePrefix(&rest, "_");
      flag = find(rest);
      if (flag != nullptr && !flag->IsOfType<bool>()) flag = nullptr;
      negated = flag != nullptr;
    }
    const std::string shown = Dashed(name);
    if (flag == nullptr) {
      BadFlag(shown, absl::StrCat("unknown flag; accepted: ", absl::StrJoin(names, " ")));
    }
    if (flag->IsOfType<bool>()) {
      if (negated && has_value) BadFlag(shown, "takes no value");
      if (!has_value) {
        value = negated ? "false" : "true";
        valueless_bool = flag;
      }
    } else if (!has_value) {
      if (i + 1 >= argc) BadFlag(shown, "needs a value");
      value = argv[++i];
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      if (auto r = range_of.find(std::string(flag->Name())); r != range_of.end()) {
        BadFlag(shown,
                absl::StrCat("must be ", Accepted(*flag, r->second), ", got \"", value, "\""));
      }
      BadFlag(shown, absl::StrCat("bad value \"", value, "\": ", error));
    }
    g_given.insert(std::string(flag->Name()));
  }
  // Every numeric flag, given or not, within its range (NaN is outside every range).
  for (const auto& [name, r] : range_of) {
    const absl::CommandLineFlag* f = find(name);
    double v = 0;
    if (!absl::SimpleAtod(f->CurrentValue(), &v) || !(v >= r.lo && v <= r.hi)) {
      BadFlag(Dashed(name), absl::StrCat("must be ", Accepted(*f, r), ", got ", f->CurrentValue()));
    }
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
