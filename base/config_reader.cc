#include "base/config_reader.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace strata::config {
namespace {

bool IsAuto(const Json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

absl::Status AutoRefused(const std::string& name, absl::string_view accepted) {
  return Bad(name, absl::StrCat(
                       "\"auto\" is filled in by the Hugging Face / Lightning integration from the "
                       "trainer's arguments before the config reaches DeepSpeed; strata reads the "
                       "config as it is given, so write the value itself: ",
                       accepted));
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

}  // namespace

absl::Status Bad(absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("config: ", key, ": ", what));
}

absl::StatusOr<Json> Parse(absl::string_view text) {
  // The parser keeps the last of a key given twice in one object, silently: each open object's
  // keys are tracked (with the object's dotted path) to refuse that.
  struct Open {
    std::string path;
    bool is_object;
    std::set<std::string> keys;
  };
  std::vector<Open> open;
  std::string key;
  std::string duplicate;
  auto track = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start: {
        std::string path;
        if (!open.empty()) {
          path = !open.back().is_object     ? open.back().path + "[]"
                 : open.back().path.empty() ? key
                                            : absl::StrCat(open.back().path, ".", key);
        }
        open.push_back({std::move(path), event == Json::parse_event_t::object_start, {}});
        break;
      }
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        open.pop_back();
        break;
      case Json::parse_event_t::key:
        key = parsed.get<std::string>();
        if (!open.back().keys.insert(key).second && duplicate.empty()) {
          duplicate = open.back().path.empty() ? key : absl::StrCat(open.back().path, ".", key);
        }
        break;
      default:
        break;
    }
    return true;
  };
  try {
    Json parsed = Json::parse(text.begin(), text.end(), track);
    if (!duplicate.empty()) {
      return Bad(duplicate,
                 "given twice in one object (a JSON reader keeps one of the values without a "
                 "word; DeepSpeed refuses duplicate keys): give it once");
    }
    return parsed;
  } catch (const Json::parse_error& e) {
    // e.byte is 1-based: the position of the character the parser stopped at.
    const size_t at = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    size_t line = 1, column = 1;
    for (size_t i = 0; i < at; ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    std::string why = e.what();
    if (auto colon = why.rfind(": "); colon != std::string::npos) why = why.substr(colon + 2);
    return absl::InvalidArgumentError(
        absl::StrCat("config: not valid JSON at line ", line, ", column ", column, ": ", why));
  } catch (const Json::exception& e) {
    // A number beyond a double (1e400) is out_of_range, with the number in its message.
    std::string why = e.what();
    if (auto colon = why.rfind("] "); colon != std::string::npos) why = why.substr(colon + 2);
    return absl::InvalidArgumentError(absl::StrCat("config: not valid JSON: ", why));
  }
}

std::string Closest(absl::string_view key, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::max<size_t>(1, key.size() / 3) + 1;
  for (const std::string& c : candidates) {
    const size_t d = EditDistance(key, c);
    if (d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  if (!best.empty() || key.size() < 4) return best;
  // A candidate cut short (host_budget for host_budget_bytes), or one with more after it.
  for (const std::string& c : candidates) {
    if (absl::StartsWith(c, key) || (c.size() >= 4 && absl::StartsWith(key, c))) {
      if (c.size() > best.size()) best = c;
    }
  }
  return best;
}

absl::Status CheckKeys(const Json& block, absl::string_view name,
                       const std::vector<std::string>& accepted) {
  if (!block.is_object())
    return Bad(name, absl::StrCat("must be a JSON object, got ", block.dump()));
  for (const auto& [key, value] : block.items()) {
    if (std::find(accepted.begin(), accepted.end(), key) != accepted.end()) continue;
    const std::string closest = Closest(key, accepted);
    return Bad(absl::StrCat(name, ".", key),
               absl::StrCat("unknown key",
                            closest.empty() ? "" : absl::StrCat(" (did you mean ", closest, "?)"),
                            "; accepted keys: ", absl::StrJoin(accepted, ", ")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<int64_t>> IntAt(const Json& block, absl::string_view prefix,
                                             const char* key, int64_t lo, int64_t hi) {
  auto it = block.find(key);
  if (it == block.end()) return std::optional<int64_t>();
  const std::string name = absl::StrCat(prefix, key);
  const std::string range = absl::StrCat("an integer in [", lo, ", ", hi, "]");
  if (IsAuto(*it)) return AutoRefused(name, range);
  auto out_of_range = [&] {
    return Bad(name, absl::StrCat("must be ", range, ", got ", it->dump()));
  };
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (hi < 0 || v > static_cast<uint64_t>(hi) || static_cast<int64_t>(v) < lo) {
      return out_of_range();
    }
    return std::optional<int64_t>(static_cast<int64_t>(v));
  }
  if (it->is_number_integer()) {
    const int64_t v = it->get<int64_t>();
    if (v < lo || v > hi) return out_of_range();
    return std::optional<int64_t>(v);
  }
  if (it->is_number_float()) {
    // Whole and exactly an integer (|v| <= 2^53 keeps every whole double exact).
    const double v = it->get<double>();
    constexpr double kExact = 9007199254740992.0;  // 2^53
    if (!std::isfinite(v) || std::floor(v) != v || std::fabs(v) > kExact) {
      return Bad(name, absl::StrCat("must be ", range,
                                    " (a float is read only when it is a whole "
                                    "number of at most 2^53), got ",
                                    it->dump()));
    }
    if (v < static_cast<double>(lo) || v > static_cast<double>(hi)) return out_of_range();
    return std::optional<int64_t>(static_cast<int64_t>(v));
  }
  return out_of_range();
}

absl::Status ReadBool(const Json& block, absl::string_view prefix, const char* key, bool* out) {
  auto it = block.find(key);
  if (it == block.end()) return absl::OkStatus();
  const std::string name = absl::StrCat(prefix, key);
  if (IsAuto(*it)) return AutoRefused(name, "true or false");
  if (!it->is_boolean()) {
    return Bad(name, absl::StrCat("must be a JSON boolean (true or false), got ", it->dump()));
  }
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status ReadBoolOrAuto(const Json& block, absl::string_view prefix, const char* key,
                            absl::string_view auto_is, std::optional<bool>* out) {
  auto it = block.find(key);
  if (it == block.end() || IsAuto(*it)) return absl::OkStatus();
  if (!it->is_boolean()) {
    return Bad(
        absl::StrCat(prefix, key),
        absl::StrCat(it->dump(), ": accepted: true, false, \"auto\" (the default: ", auto_is, ")"));
  }
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status ReadString(const Json& block, absl::string_view prefix, const char* key,
                        std::string* out) {
  auto it = block.find(key);
  if (it == block.end()) return absl::OkStatus();
  if (!it->is_string()) {
    return Bad(absl::StrCat(prefix, key), absl::StrCat("must be a string, got ", it->dump()));
  }
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status ReadNumber(const Json& block, absl::string_view prefix, const char* key, double lo,
                        double hi, double* out) {
  auto it = block.find(key);
  if (it == block.end()) return absl::OkStatus();
  const std::string name = absl::StrCat(prefix, key);
  const std::string range = absl::StrCat("a number in [", lo, ", ", hi, "]");
  if (IsAuto(*it)) return AutoRefused(name, range);
  if (!it->is_number() || !(it->get<double>() >= lo) || !(it->get<double>() <= hi)) {
    return Bad(name, absl::StrCat("must be ", range, ", got ", it->dump()));
  }
  *out = it->get<double>();
  return absl::OkStatus();
}

}  // namespace strata::config
