#include "aio/buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::aio {
namespace {
constexpr size_t kHugePage = 2u << 20;
size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept { *this = std::move(other); }

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    huge_ = std::exchange(other.huge_, false);
    cuda_pinned_ = std::exchange(other.cuda_pinned_, false);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { Release(); }

void AlignedBuffer::Release() {
  if (data_ == nullptr) return;
#if STRATA_HAVE_CUDA
  if (cuda_pinned_) cudaHostUnregister(data_);
#endif
  munmap(data_, mapped_);
  data_ = nullptr;
  cuda_pinned_ = false;
}

absl::StatusOr<AlignedBuffer> AlignedBuffer::Allocate(size_t size_bytes, BufferOptions options) {
  if (size_bytes == 0) {
    return absl::InvalidArgumentError("AlignedBuffer::Allocate: size_bytes must be > 0");
  }
  AlignedBuffer buffer;
  buffer.size_ = size_bytes;
  void* p = MAP_FAILED;
  if (options.huge_pages) {
    buffer.mapped_ = RoundUp(size_bytes, kHugePage);
    p = mmap(nullptr, buffer.mapped_, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    buffer.huge_ = p != MAP_FAILED;
    if (p == MAP_FAILED) {
      // No reserved huge pages: take a 2 MiB-aligned region and ask for transparent ones.
      const size_t span = buffer.mapped_ + kHugePage;
      void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw != MAP_FAILED) {
        auto base = reinterpret_cast<uintptr_t>(raw);
        const uintptr_t aligned = RoundUp(base, kHugePage);
        if (aligned > base) munmap(raw, aligned - base);
        const uintptr_t end = base + span, used_end = aligned + buffer.mapped_;
        if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
        p = reinterpret_cast<void*>(aligned);
        buffer.huge_ = madvise(p, buffer.mapped_, MADV_HUGEPAGE) == 0;
      }
    }
  } else {
    buffer.mapped_ = RoundUp(size_bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    p = mmap(nullptr, buffer.mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (p == MAP_FAILED) {
    const int err = errno;
    return absl::ResourceExhaustedError(absl::StrCat("AlignedBuffer::Allocate: mmap of ",
                                                     buffer.mapped_,
                                                     " bytes failed: ", std::strerror(err)));
  }
  buffer.data_ = static_cast<std::byte*>(p);
  if (options.prefault) std::memset(buffer.data_, 0, buffer.mapped_);
  return buffer;
}

absl::Status AlignedBuffer::PinForCuda() {
#if STRATA_HAVE_CUDA
  if (cuda_pinned_) return absl::OkStatus();
  const cudaError_t err = cudaHostRegister(data_, mapped_, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error state of this thread
    return absl::FailedPreconditionError(absl::StrCat("cudaHostRegister of ", mapped_,
                                                      " bytes failed: ", cudaGetErrorName(err),
                                                      " (", cudaGetErrorString(err), ")"));
  }
  cuda_pinned_ = true;
  return absl::OkStatus();
#else
  return absl::UnimplementedError("PinForCuda: strata was built without CUDA");
#endif
}

}  // namespace strata::aio
