#include "base/status.h"

#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace strata {

absl::Status ErrnoStatus(int errno_value, absl::string_view op, absl::string_view path,
                         std::optional<uint64_t> offset, std::optional<uint64_t> length) {
  std::string message = absl::StrCat(op, " ", path);
  if (offset) absl::StrAppend(&message, " @ ", *offset);
  if (length) absl::StrAppend(&message, " len ", *length);
  char buf[128];
  // GNU strerror_r returns the message pointer (it may or may not use buf).
  const char* text = strerror_r(errno_value, buf, sizeof(buf));
  absl::StrAppend(&message, ": ", text, " (errno ", errno_value, ")");
  absl::Status status(absl::ErrnoToStatusCode(errno_value), message);
  status.SetPayload(kErrnoPayloadUrl, absl::Cord(absl::StrCat(errno_value)));
  return status;
}

int StatusErrno(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kErrnoPayloadUrl);
  int value = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &value)) return 0;
  return value;
}

namespace {

// `message` with `from`'s code, and a copy of each of its payloads (Cords share their bytes too).
absl::Status Rebuilt(const absl::Status& from, absl::string_view message) {
  absl::Status out(from.code(), message);
  from.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, absl::Cord(std::string(payload)));
  });
  return out;
}

}  // namespace

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return Rebuilt(status, absl::StrCat(context, ": ", status.message()));
}

absl::Status Unshared(const absl::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return Rebuilt(status, status.message());
}

}  // namespace strata
