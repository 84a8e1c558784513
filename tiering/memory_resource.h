// tiering/memory_resource.h: where a tier's bytes come from, composed from small adaptors (RMM's
// memory resources are the model).
//
// Resources:
//  - HostMemoryResource: ordinary memory (mmap). The host-emulated device tier uses it (with its
//    own LimitingResource budget), so every test runs without a GPU.
//  - PinnedHostResource: page-locked host memory: mlock where RLIMIT_MEMLOCK (or CAP_IPC_LOCK)
//    allows, else ordinary memory with a warning (pinned() says which); bound to a NUMA node with
//    hwloc when asked; huge pages when asked. (Under ASan/TSan mlock is intercepted as a no-op.)
// Adaptors (each wraps an upstream it does not own):
//  - LimitingResource: a hard budget. An allocation that would exceed it calls the on-exhausted
//    callback (which may evict and free, then return true to retry) up to a few times, then fails
//    with ResourceExhausted naming the tier, the budget, what is in use and what was asked.
//  - StatisticsResource: bytes in use, peak, and allocation counts.
//  - PoolingResource: a budget over what it holds: hands out blocks of whole pages, keeps freed
//    blocks for the next allocation of the same page count (so pinned memory is pinned once and
//    reused, never pinned per request), and never holds more than its budget from upstream —
//    blocks in use, cached blocks and rounding together (it returns cached blocks upstream to make
//    room before it refuses).
//
// Thread safety: all resources and adaptors here are thread-safe. Deallocate must get the size
// that Allocate was given.
#ifndef STRATA_TIERING_MEMORY_RESOURCE_H_
#define STRATA_TIERING_MEMORY_RESOURCE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/mutex.h"

namespace strata::tiering {

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // `bytes` > 0. The memory is page-aligned (so it serves O_DIRECT).
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Deallocate(void* p, size_t bytes) = 0;
  virtual absl::string_view name() const = 0;
};

class HostMemoryResource final : public MemoryResource {
 public:
  explicit HostMemoryResource(std::string name = "host memory") : name_(std::move(name)) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Deallocate(void* p, size_t bytes) override;
  absl::string_view name() const override { return name_; }

 private:
  std::string name_;
};

struct PinnedOptions {
  int numa_node = -1;      // bind to this NUMA node (hwloc); -1: where the first touch lands
  bool huge_pages = true;  // transparent huge pages for allocations of 2 MiB and more
  // Also register the memory with CUDA (cudaHostRegister) for device copies, when strata is built
  // with CUDA and a device is present; otherwise this is skipped with a warning.
  bool cuda_register = false;
  // Called once with the reason when memory cannot be locked and is used unlocked instead.
  std::function<void(absl::string_view)> on_warning;
};

class PinnedHostResource final : public MemoryResource {
 public:
  explicit PinnedHostResource(PinnedOptions options = {});
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Deallocate(void* p, size_t bytes) override;
  absl::string_view name() const override { return "pinned host memory"; }
  // False once an allocation could not be locked (and was used unlocked).
  bool pinned() const { return pinned_.load(); }

 private:
  PinnedOptions options_;
  std::atomic<bool> pinned_{true};
  std::atomic<bool> warned_{false};
  std::atomic<bool> cuda_warned_{false};
};

class PoolingResource final : public MemoryResource {
 public:
  // Everything taken from upstream (in use + cached) stays within budget_bytes.
  PoolingResource(MemoryResource* upstream, uint64_t budget_bytes);
  ~PoolingResource() override;  // returns the cached blocks upstream
  // ResourceExhausted naming the budget, what is in use and what was asked when the block does
  // not fit even after the cache is returned upstream; InvalidArgument for 0 or > 2^62 bytes.
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Deallocate(void* p, size_t bytes) override;
  absl::string_view name() const override { return upstream_->name(); }
  uint64_t budget_bytes() const { return budget_; }
  uint64_t held_bytes() const;    // in use + cached: what upstream has handed out
  uint64_t in_use_bytes() const;  // blocks handed out, counted as whole pages
  uint64_t cached_bytes() const;
  uint64_t reused() const;

  // The block size that serves `bytes`: whole 4 KiB pages. InvalidArgument for 0 or > 2^62.
  static absl::StatusOr<size_t> ClassOf(size_t bytes);

 private:
  // Returns cached blocks upstream until `needed` more bytes fit in the budget (or the cache is
  // empty).
  void TrimLocked(uint64_t needed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  MemoryResource* const upstream_;
  const uint64_t budget_;
  mutable Mutex mu_;
  absl::flat_hash_map<size_t, std::vector<void*>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t cached_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
};

class LimitingResource final : public MemoryResource {
 public:
  // Called with the bytes that do not fit; returns true when it freed something and the
  // allocation should be retried. It must not allocate from this resource.
  using OnExhausted = std::function<bool(size_t bytes_short)>;

  LimitingResource(MemoryResource* upstream, uint64_t budget_bytes, std::string tier,
                   OnExhausted on_exhausted = nullptr, int max_retries = 8);
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Deallocate(void* p, size_t bytes) override;
  absl::string_view name() const override { return tier_; }

  uint64_t budget_bytes() const { return budget_; }
  uint64_t used_bytes() const { return used_.load(); }

 private:
  bool TryReserve(size_t bytes);

  MemoryResource* const upstream_;
  const uint64_t budget_;
  const std::string tier_;
  const OnExhausted on_exhausted_;
  const int max_retries_;
  std::atomic<uint64_t> used_{0};
};

class StatisticsResource final : public MemoryResource {
 public:
  explicit StatisticsResource(MemoryResource* upstream) : upstream_(upstream) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Deallocate(void* p, size_t bytes) override;
  absl::string_view name() const override { return upstream_->name(); }

  struct Counts {
    uint64_t bytes_in_use = 0, peak_bytes = 0, allocations = 0, deallocations = 0, failures = 0;
  };
  Counts counts() const;

 private:
  MemoryResource* const upstream_;
  mutable Mutex mu_;
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

// The NUMA node nearest the block device that holds `path` (from sysfs, as hwloc finds it), or
// -1 when the kernel does not say (a virtual disk, one node). PinnedHostResource binds there.
int NumaNodeNearest(const std::string& path);

// Device memory on CUDA device `device` (stream-ordered allocation). Unimplemented when built
// without CUDA; FailedPrecondition when there is no such device.
absl::StatusOr<std::unique_ptr<MemoryResource>> CreateCudaDeviceResource(int device);

}  // namespace strata::tiering

#endif  // STRATA_TIERING_MEMORY_RESOURCE_H_
