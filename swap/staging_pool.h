// swap/staging_pool.h: the pinned staging buffers that chunked moves borrow.
//
// A move between NVMe and the device tier never holds the whole partition in host memory: it goes
// through two equal buffers, chunk by chunk (the disk fills one while the copy engine drains the
// other). The pool holds `pairs` such pairs, allocated once (at the first Take) from a host memory
// resource (the Runtime's pinned pool, so they count against the host budget) and reused by every
// chunked move; `pairs` chunked moves run at once and a further one waits for a pair.
//
// Take blocks until a pair is free and hands it out whole (both buffers at once, so two moves never
// hold one buffer each and wait for each other). The lease gives the pair back when destroyed.
//
// Thread safety: thread-safe. The pool must outlive its leases.
#ifndef STRATA_SWAP_STAGING_POOL_H_
#define STRATA_SWAP_STAGING_POOL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "tiering/memory_resource.h"

namespace strata::swap {

class StagingPool {
 public:
  // `buffer_bytes`: each buffer, a whole number of 4 KiB pages (> 0); `pairs` >= 1. The memory is
  // allocated from `host` at the first Take (a failure there is that Take's status).
  StagingPool(tiering::MemoryResource* host, uint64_t buffer_bytes, int pairs);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  class Lease {
   public:
    Lease(Lease&& other) noexcept : pool_(other.pool_), index_(other.index_) {
      other.pool_ = nullptr;
    }
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    absl::Span<std::byte> a() const;
    absl::Span<std::byte> b() const;

   private:
    friend class StagingPool;
    Lease(StagingPool* pool, int index) : pool_(pool), index_(index) {}
    StagingPool* pool_;
    int index_;
  };

  // A free pair, waiting for one when all are lent.
  absl::StatusOr<Lease> Take();

  uint64_t buffer_bytes() const { return buffer_bytes_; }
  int pairs() const { return pairs_; }
  // Bytes the pool holds or will hold: 2 x pairs x buffer_bytes.
  uint64_t total_bytes() const { return 2 * static_cast<uint64_t>(pairs_) * buffer_bytes_; }

 private:
  void Give(int index);

  tiering::MemoryResource* const host_;
  const uint64_t buffer_bytes_;
  const int pairs_;
  Mutex mu_;
  CondVar cv_;
  std::vector<std::byte*> buffers_ ABSL_GUARDED_BY(mu_);  // 2 per pair; empty until the first Take
  std::vector<int> free_ ABSL_GUARDED_BY(mu_);            // pair indices
};

}  // namespace strata::swap

#endif  // STRATA_SWAP_STAGING_POOL_H_
