#include "base/check.h"

#include <cstdio>
#include <cstdlib>

namespace strata::internal {

void CheckFailed(const char* file, int line, const char* condition, absl::string_view message) {
  std::fprintf(stderr, "%s:%d: STRATA_CHECK(%s) failed: %.*s\n", file, line, condition,
               static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata::internal
