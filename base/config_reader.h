// base/config_reader.h: reading strata's and DeepSpeed's JSON config blocks, one rule for every
// module (aio/config.cc, tiering/runtime_config.cc).
//
// The rule. A key that is present is checked and read; absent, the caller's default stands. An
// integer key takes a JSON integer, read exactly (2^56 + 1 stays 2^56 + 1), or a float that is a
// whole number exactly representable as one (DeepSpeed writes 1e8 and 1048576.0); a fraction, a
// value out of range or a string is refused naming the key and the accepted range. Hugging Face's
// and Lightning's "auto" (filled in from the trainer's arguments before a config reaches DeepSpeed)
// gets its own message saying what to write instead. A key a block does not know is an error that
// names the closest known key. Text that is not JSON is refused naming the line and column, and a
// key given twice in one object (which a JSON reader would resolve silently) naming the key.
// Every error is InvalidArgument "config: <key>: <what was wrong and what is accepted>".
//
// Thread safety: pure functions.
#ifndef STRATA_BASE_CONFIG_READER_H_
#define STRATA_BASE_CONFIG_READER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace strata::config {

using Json = nlohmann::json;

// InvalidArgument "config: <key>: <what>".
absl::Status Bad(absl::string_view key, absl::string_view what);

// Parses config text; not JSON: "config: not valid JSON at line L, column C: <parser's reason>";
// a key given twice in one object: "config: <dotted key>: given twice ...".
absl::StatusOr<Json> Parse(absl::string_view text);

// The candidate `key` most likely meant: the nearest by edit distance when near enough to be a
// misspelling (at most a third of the key's length, at least one edit), else the longest one that
// starts with it or that it starts with (4 characters or more); "" when none is.
std::string Closest(absl::string_view key, const std::vector<std::string>& candidates);

// `block` must be an object whose keys are all in `accepted`; `name` is the block's dotted path.
absl::Status CheckKeys(const Json& block, absl::string_view name,
                       const std::vector<std::string>& accepted);

// block[key], when present, as an integer in [lo, hi] (the rule above); `prefix` is the block's
// dotted path with a trailing dot ("aio.").
absl::StatusOr<std::optional<int64_t>> IntAt(const Json& block, absl::string_view prefix,
                                             const char* key, int64_t lo, int64_t hi);
template <typename T>
absl::Status ReadInt(const Json& block, absl::string_view prefix, const char* key, int64_t lo,
                     int64_t hi, T* out) {
  absl::StatusOr<std::optional<int64_t>> v = IntAt(block, prefix, key, lo, hi);
  if (!v.ok()) return v.status();
  if (v->has_value()) *out = static_cast<T>(**v);
  return absl::OkStatus();
}
absl::Status ReadBool(const Json& block, absl::string_view prefix, const char* key, bool* out);
// A strata setting that is true, false or "auto" (leaves `out` unset: the setting decides);
// `auto_is` says what "auto" does, in the error for anything else.
absl::Status ReadBoolOrAuto(const Json& block, absl::string_view prefix, const char* key,
                            absl::string_view auto_is, std::optional<bool>* out);
absl::Status ReadString(const Json& block, absl::string_view prefix, const char* key,
                        std::string* out);
// A number in [lo, hi], e.g. a ratio.
absl::Status ReadNumber(const Json& block, absl::string_view prefix, const char* key, double lo,
                        double hi, double* out);

}  // namespace strata::config

#endif  // STRATA_BASE_CONFIG_READER_H_
