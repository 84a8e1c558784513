// tiering/link_bandwidth.h: the copy link's bandwidth, each way, measured on this machine.
//
// Emulated (no GPU): one large copy through a host copy engine capped at `emulated_cap` bytes per
// second (0: uncapped, memcpy's speed); its one thread carries both directions, so the link is not
// duplex. CUDA: pinned host <-> device memory on a CUDA copy engine's stream, each direction timed
// on its own (the best of three; the first warms the link up), duplex as PCIe is.
//
// Thread safety: a free function; it makes and frees its own engine and buffers.
#ifndef STRATA_TIERING_LINK_BANDWIDTH_H_
#define STRATA_TIERING_LINK_BANDWIDTH_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace strata::tiering {

struct LinkBandwidth {
  double to_device = 0, to_host = 0;  // bytes per second
  bool duplex = false;                // both directions at once at these rates
};

// `bytes` per copy. Errors: the CUDA engine, device memory or pinned memory could not be made, or
// a copy failed.
absl::StatusOr<LinkBandwidth> MeasureLinkBandwidth(bool cuda, uint64_t emulated_cap = 0,
                                                   size_t bytes = size_t{64} << 20);

}  // namespace strata::tiering

#endif  // STRATA_TIERING_LINK_BANDWIDTH_H_
