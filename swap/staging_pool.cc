#include "swap/staging_pool.h"

#include "base/check.h"
#include "base/status.h"

namespace strata::swap {

StagingPool::StagingPool(tiering::MemoryResource* host, uint64_t buffer_bytes, int pairs)
    : host_(host), buffer_bytes_(buffer_bytes), pairs_(pairs) {
  STRATA_CHECK(host != nullptr && pairs >= 1 && buffer_bytes > 0 && buffer_bytes % 4096 == 0,
               "StagingPool: a host resource, pairs >= 1, buffers of whole 4 KiB pages");
}

StagingPool::~StagingPool() {
  MutexLock lock(&mu_);
  STRATA_CHECK(static_cast<int>(free_.size()) == (buffers_.empty() ? 0 : pairs_),
               "StagingPool destroyed while a lease is held");
  for (std::byte* b : buffers_) host_->Deallocate(b, buffer_bytes_);
}

absl::StatusOr<StagingPool::Lease> StagingPool::Take() {
  MutexLock lock(&mu_);
  if (buffers_.empty()) {
    std::vector<std::byte*> made;
    for (int i = 0; i < 2 * pairs_; ++i) {
      absl::StatusOr<void*> p = host_->Allocate(buffer_bytes_);
      if (!p.ok()) {
        for (std::byte* b : made) host_->Deallocate(b, buffer_bytes_);
        return Annotate(p.status(), "staging buffers");
      }
      made.push_back(static_cast<std::byte*>(*p));
    }
    buffers_ = std::move(made);
    for (int i = pairs_ - 1; i >= 0; --i) free_.push_back(i);
  }
  while (free_.empty()) cv_.Wait(&mu_);
  const int index = free_.back();
  free_.pop_back();
  return Lease(this, index);
}

void StagingPool::Give(int index) {
  MutexLock lock(&mu_);
  free_.push_back(index);
  cv_.Signal();
}

StagingPool::Lease::~Lease() {
  if (pool_ != nullptr) pool_->Give(index_);
}

absl::Span<std::byte> StagingPool::Lease::a() const {
  MutexLock lock(&pool_->mu_);
  return {pool_->buffers_[2 * index_], pool_->buffer_bytes_};
}

absl::Span<std::byte> StagingPool::Lease::b() const {
  MutexLock lock(&pool_->mu_);
  return {pool_->buffers_[2 * index_ + 1], pool_->buffer_bytes_};
}

}  // namespace strata::swap
