#include "tiering/link_bandwidth.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "base/status.h"
#include "tiering/copy_engine.h"
#include "tiering/memory_resource.h"

namespace strata::tiering {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

absl::StatusOr<LinkBandwidth> MeasureLinkBandwidth(bool cuda, uint64_t emulated_cap, size_t bytes) {
  LinkBandwidth link;
  if (!cuda) {
    HostCopyEngine engine(emulated_cap);
    std::vector<std::byte> a(bytes, std::byte{1}), b(bytes);
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(
        engine.CopyAsync(b.data(), a.data(), bytes, CopyDirection::kHostToDevice).get());
    link.to_device = link.to_host = bytes / Since(t0);
    return link;
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CopyEngine> engine, CreateCudaCopyEngine(0));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<MemoryResource> device, CreateCudaDeviceResource(0));
  PinnedOptions po;
  po.cuda_register = true;
  PinnedHostResource host(po);
  STRATA_ASSIGN_OR_RETURN(void* d, device->Allocate(bytes));
  auto h = host.Allocate(bytes);
  if (!h.ok()) {
    device->Deallocate(d, bytes);
    return h.status();
  }
  link.duplex = true;
  absl::Status failed;
  for (auto dir : {CopyDirection::kHostToDevice, CopyDirection::kDeviceToHost}) {
    const bool down = dir == CopyDirection::kHostToDevice;
    double best = 0;
    for (int i = 0; i < 3 && failed.ok(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      failed = engine->CopyAsync(down ? d : *h, down ? *h : d, bytes, dir).get();
      best = std::max(best, bytes / Since(t0));
    }
    (down ? link.to_device : link.to_host) = best;
  }
  device->Deallocate(d, bytes);
  host.Deallocate(*h, bytes);
  STRATA_RETURN_IF_ERROR(failed);
  return link;
}

}  // namespace strata::tiering
