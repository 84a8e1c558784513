#include "tiering/memory_resource.h"

#include <hwloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "tiering/internal/cuda_host.h"

namespace strata::tiering {
namespace {

constexpr size_t kHugePage = 2u << 20;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

absl::StatusOr<void*> MapAnonymous(size_t bytes, absl::string_view who) {
  if (bytes == 0) return absl::InvalidArgumentError(absl::StrCat(who, ": allocation of 0 bytes"));
  void* p = mmap(nullptr, RoundUp(bytes, 4096), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat(who, ": mmap of ", bytes, " bytes failed: ", std::strerror(errno)));
  }
  return p;
}

}  // namespace

absl::StatusOr<void*> HostMemoryResource::Allocate(size_t bytes) {
  return MapAnonymous(bytes, name_);
}

void HostMemoryResource::Deallocate(void* p, size_t bytes) { munmap(p, RoundUp(bytes, 4096)); }

PinnedHostResource::PinnedHostResource(PinnedOptions options) : options_(std::move(options)) {}

absl::StatusOr<void*> PinnedHostResource::Allocate(size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(void* p, MapAnonymous(bytes, name()));
  const size_t mapped = RoundUp(bytes, 4096);
  if (options_.huge_pages && bytes >= kHugePage) madvise(p, mapped, MADV_HUGEPAGE);
  if (options_.numa_node >= 0) {
    hwloc_topology_t topology;
    if (hwloc_topology_init(&topology) == 0 && hwloc_topology_load(topology) == 0) {
      hwloc_obj_t node = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE,
                                               static_cast<unsigned>(options_.numa_node));
      if (node != nullptr) {
        hwloc_set_area_membind(topology, p, mapped, node->nodeset, HWLOC_MEMBIND_BIND,
                               HWLOC_MEMBIND_BYNODESET);
      }
      hwloc_topology_destroy(topology);
    }
  }
  if (options_.cuda_register) {
    if (absl::Status s = internal::CudaHostRegister(p, mapped);
        !s.ok() && !cuda_warned_.exchange(true)) {
      if (options_.on_warning) {
        options_.on_warning(
            absl::StrCat("pinned host memory: not registered with CUDA: ", s.message()));
      }
    }
  }
  if (mlock(p, mapped) != 0) {
    const int err = errno;
    // Used unlocked: the pages are faulted in now so that no fault lands in the I/O path.
    std::memset(p, 0, mapped);
    pinned_.store(false);
    if (!warned_.exchange(true) && options_.on_warning) {
      options_.on_warning(absl::StrCat(
          "pinned host memory: mlock of ", mapped, " bytes failed (", std::strerror(err),
          "); using unlocked memory. Raise RLIMIT_MEMLOCK (ulimit -l) or grant CAP_IPC_LOCK"));
    }
  }
  return p;
}

void PinnedHostResource::Deallocate(void* p, size_t bytes) {
  const size_t mapped = RoundUp(bytes, 4096);
  if (options_.cuda_register) internal::CudaHostUnregister(p);
  munlock(p, mapped);
  munmap(p, mapped);
}

PoolingResource::PoolingResource(MemoryResource* upstream, uint64_t budget_bytes)
    : upstream_(upstream), budget_(budget_bytes) {}

PoolingResource::~PoolingResource() {
  MutexLock lock(&mu_);
  for (auto& [size, blocks] : free_) {
    for (void* p : blocks) upstream_->Deallocate(p, size);
  }
}

absl::StatusOr<size_t> PoolingResource::ClassOf(size_t bytes) {
  constexpr size_t kPage = 4096, kMax = size_t{1} << 62;
  if (bytes == 0 || bytes > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("pooled allocation of ", bytes, " bytes: accepted 1..", kMax));
  }
  return (bytes + kPage - 1) / kPage * kPage;
}

void PoolingResource::TrimLocked(uint64_t needed) {
  for (auto it = free_.begin(); it != free_.end() && in_use_ + cached_ > budget_ - needed;) {
    auto& blocks = it->second;
    while (!blocks.empty() && in_use_ + cached_ > budget_ - needed) {
      upstream_->Deallocate(blocks.back(), it->first);
      blocks.pop_back();
      cached_ -= it->first;
    }
    if (blocks.empty()) {
      free_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<void*> PoolingResource::Allocate(size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(const size_t c, ClassOf(bytes));
  MutexLock lock(&mu_);
  auto it = free_.find(c);
  if (it != free_.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    cached_ -= c;
    in_use_ += c;
    ++reused_;
    return p;
  }
  if (c > budget_ || in_use_ > budget_ - c) {
    return absl::ResourceExhaustedError(
        absl::StrCat(upstream_->name(), " pool: a budget of ", budget_, " bytes, ", in_use_,
                     " in use, ", c, " asked (", bytes, " rounded to whole pages)"));
  }
  TrimLocked(c);
  // Upstream is called under the lock so that what is held never passes the budget, even for a
  // moment; pinning is slow, but it happens once per block (blocks are reused after that).
  STRATA_ASSIGN_OR_RETURN(void* p, upstream_->Allocate(c));
  in_use_ += c;
  return p;
}

void PoolingResource::Deallocate(void* p, size_t bytes) {
  const size_t c = *ClassOf(bytes);  // Allocate gave out this class
  MutexLock lock(&mu_);
  in_use_ -= c;
  free_[c].push_back(p);
  cached_ += c;
}

uint64_t PoolingResource::held_bytes() const {
  MutexLock lock(&mu_);
  return in_use_ + cached_;
}

uint64_t PoolingResource::in_use_bytes() const {
  MutexLock lock(&mu_);
  return in_use_;
}

uint64_t PoolingResource::cached_bytes() const {
  MutexLock lock(&mu_);
  return cached_;
}

uint64_t PoolingResource::reused() const {
  MutexLock lock(&mu_);
  return reused_;
}

int NumaNodeNearest(const std::string& path) {
  // The kernel's own answer: the first numa_node file up the sysfs path of the block device
  // (for NVMe, the PCI function of the controller). hwloc reads the same files; its IO discovery
  // is not needed for this (and its PCI plugin leaks).
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return -1;
  const std::string dev = absl::StrCat("/sys/dev/block/", major(st.st_dev), ":", minor(st.st_dev));
  char real[PATH_MAX];
  if (realpath(dev.c_str(), real) == nullptr) return -1;
  for (std::string dir = real; dir.size() > std::strlen("/sys/devices");
       dir = dir.substr(0, dir.rfind('/'))) {
    FILE* f = std::fopen((dir + "/numa_node").c_str(), "r");
    if (f == nullptr) continue;
    int node = -1;
    if (std::fscanf(f, "%d", &node) != 1) node = -1;
    std::fclose(f);
    return node;
  }
  return -1;
}

LimitingResource::LimitingResource(MemoryResource* upstream, uint64_t budget_bytes,
                                   std::string tier, OnExhausted on_exhausted, int max_retries)
    : upstream_(upstream),
      budget_(budget_bytes),
      tier_(std::move(tier)),
      on_exhausted_(std::move(on_exhausted)),
      max_retries_(max_retries) {}

bool LimitingResource::TryReserve(size_t bytes) {
  uint64_t used = used_.load();
  while (used <= budget_ && bytes <= budget_ - used) {
    if (used_.compare_exchange_weak(used, used + bytes)) return true;
  }
  return false;
}

absl::StatusOr<void*> LimitingResource::Allocate(size_t bytes) {
  int attempt = 0;
  while (!TryReserve(bytes)) {
    const uint64_t used = used_.load();
    const uint64_t free = used < budget_ ? budget_ - used : 0;
    const uint64_t short_by = bytes > free ? bytes - free : 0;
    if (attempt++ >= max_retries_ || !on_exhausted_ || !on_exhausted_(short_by)) {
      return absl::ResourceExhaustedError(absl::StrCat(tier_, " budget of ", budget_,
                                                       " bytes: ", used, " in use, ", bytes,
                                                       " asked (", short_by, " short)"));
    }
  }
  absl::StatusOr<void*> p = upstream_->Allocate(bytes);
  if (!p.ok()) used_.fetch_sub(bytes);
  return p;
}

void LimitingResource::Deallocate(void* p, size_t bytes) {
  upstream_->Deallocate(p, bytes);
  used_.fetch_sub(bytes);
}

absl::StatusOr<void*> StatisticsResource::Allocate(size_t bytes) {
  absl::StatusOr<void*> p = upstream_->Allocate(bytes);
  MutexLock lock(&mu_);
  if (!p.ok()) {
    ++counts_.failures;
    return p;
  }
  ++counts_.allocations;
  counts_.bytes_in_use += bytes;
  counts_.peak_bytes = std::max(counts_.peak_bytes, counts_.bytes_in_use);
  return p;
}

void StatisticsResource::Deallocate(void* p, size_t bytes) {
  upstream_->Deallocate(p, bytes);
  MutexLock lock(&mu_);
  ++counts_.deallocations;
  counts_.bytes_in_use -= bytes;
}

StatisticsResource::Counts StatisticsResource::counts() const {
  MutexLock lock(&mu_);
  return counts_;
}

}  // namespace strata::tiering
