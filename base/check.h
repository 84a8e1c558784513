// base/check.h: STRATA_CHECK for programmer errors (a broken invariant, a misaligned buffer passed
// to an internal call). A condition of the world (disk full, bad config value) is a Status, never a
// CHECK. A failed check prints file, line, the condition and the message to stderr and aborts.
//
// Thread safety: safe from any thread.
#ifndef STRATA_BASE_CHECK_H_
#define STRATA_BASE_CHECK_H_

#include "absl/strings/string_view.h"

namespace strata::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              absl::string_view message);
}  // namespace strata::internal

#define STRATA_CHECK(cond, message)                                          \
  do {                                                                       \
    if (!(cond)) [[unlikely]]                                                \
      ::strata::internal::CheckFailed(__FILE__, __LINE__, #cond, (message)); \
  } while (false)

#endif  // STRATA_BASE_CHECK_H_
