// Constructors of the concrete backends; only backend_factory.cc calls them.
#ifndef STRATA_AIO_INTERNAL_BACKENDS_H_
#define STRATA_AIO_INTERNAL_BACKENDS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "aio/backend.h"

namespace strata::aio::internal {

absl::StatusOr<std::unique_ptr<Backend>> CreateUringBackend(const BackendOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> CreateLibAioBackend(const BackendOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> CreatePosixBackend(const BackendOptions& options);

}  // namespace strata::aio::internal

#endif  // STRATA_AIO_INTERNAL_BACKENDS_H_
