// base/status.h: the status helpers every strata module uses.
//
// - STRATA_RETURN_IF_ERROR(expr) and STRATA_ASSIGN_OR_RETURN(lhs, expr): Debian's Abseil
//   (20220623) has no status macros, so they are defined once, here.
// - ErrnoStatus(): the one place where an errno becomes an absl::Status. The message is built
//   from its parts ("pread /nvme/p17.swp @ 1048576 len 4194304: Input/output error"), the code
//   comes from absl::ErrnoToStatusCode, and the raw errno is kept as a payload so a caller can
//   tell ENOSPC from EIO with StatusErrno().
//
// Thread safety: all functions are pure and safe to call from any thread.
#ifndef STRATA_BASE_STATUS_H_
#define STRATA_BASE_STATUS_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata {

// The payload URL under which ErrnoStatus keeps the raw errno (decimal text).
inline constexpr absl::string_view kErrnoPayloadUrl = "strata/errno";

// Status for a failed OS call `op` on `path`. offset/length are printed when given.
absl::Status ErrnoStatus(int errno_value, absl::string_view op, absl::string_view path,
                         std::optional<uint64_t> offset = std::nullopt,
                         std::optional<uint64_t> length = std::nullopt);

// The raw errno kept by ErrnoStatus, or 0 when the status carries none.
int StatusErrno(const absl::Status& status);

// Returns `status` with `context` prepended to its message ("context: message"); code and
// payloads are kept. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

// A copy of `status` (code, message, payloads) that shares no state with it. absl::Status copies
// share one reference-counted message; Debian's Abseil is not built for ThreadSanitizer, so TSan
// does not see that count's atomics and reports the thread that frees the message as racing the
// one that last read it. A Status handed from one thread to another (a Work's, an I/O request's)
// is handed as Unshared, so each thread frees only its own.
absl::Status Unshared(const absl::Status& status);

}  // namespace strata

#define STRATA_STATUS_CONCAT_INNER_(a, b) a##b
#define STRATA_STATUS_CONCAT_(a, b) STRATA_STATUS_CONCAT_INNER_(a, b)

#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status strata_status_ = (expr);          \
    if (!strata_status_.ok()) return strata_status_; \
  } while (false)

#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_STATUS_CONCAT_(strata_statusor_, __LINE__), lhs, expr)

#endif  // STRATA_BASE_STATUS_H_
