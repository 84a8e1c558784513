// The factory of aio/backend.h: the only place outside the backends themselves where the feature
// macros STRATA_HAVE_LIBURING and STRATA_HAVE_LIBAIO appear.
#include "absl/strings/str_cat.h"
#include "aio/backend.h"
#include "aio/internal/backends.h"

namespace strata::aio {

absl::Status Backend::Unsupported(absl::string_view what) const {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no ", what));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(EngineKind kind,
                                                       const BackendOptions& options) {
  switch (kind) {
    case EngineKind::kIoUring:
#if STRATA_HAVE_LIBURING
      return internal::CreateUringBackend(options);
#else
      return absl::UnimplementedError("io_uring backend not built: liburing was not found");
#endif
    case EngineKind::kLibAio:
#if STRATA_HAVE_LIBAIO
      return internal::CreateLibAioBackend(options);
#else
      return absl::UnimplementedError("libaio backend not built: libaio was not found");
#endif
    case EngineKind::kPosix:
      return internal::CreatePosixBackend(options);
  }
  return absl::InvalidArgumentError("unknown engine kind");
}

}  // namespace strata::aio
