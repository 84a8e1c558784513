// sched/runtime_internal.h: small helpers the Runtime's source files share (runtime.cc, the
// partitions' moves; runtime_optimizer.cc, the optimizer it owns). Not part of the interface.
//
// Thread safety: pure functions and constants.
#ifndef STRATA_SCHED_RUNTIME_INTERNAL_H_
#define STRATA_SCHED_RUNTIME_INTERNAL_H_

#include <cstdint>

#include "tiering/residency.h"

namespace strata::sched::internal {

using tiering::PartitionId;
using tiering::Residency;
using tiering::Tier;

inline int I(Tier t) { return static_cast<int>(t); }

// The store keys the optimizer's state with the top bit set, apart from the partitions' ids.
inline constexpr PartitionId kOptimizerKey = PartitionId{1} << 63;

// `bytes` in whole pages, as the host tier counts them.
inline uint64_t Pages(uint64_t bytes) {
  return (bytes + tiering::kPageBytes - 1) / tiering::kPageBytes * tiering::kPageBytes;
}

}  // namespace strata::sched::internal

#endif  // STRATA_SCHED_RUNTIME_INTERNAL_H_
