// aio/buffer.h: AlignedBuffer, host memory suitable for O_DIRECT I/O.
//
// The memory comes from mmap, so it is page-aligned (and 2 MiB-aligned with huge pages), which
// satisfies every O_DIRECT memory alignment a file reports. It can be registered with io_uring
// (Engine::RegisterBuffer) and, when CUDA is built and a device is present, page-locked for
// device copies with cudaHostRegister (PinForCuda).
//
// Ownership: an AlignedBuffer owns its mapping and unmaps it (after cudaHostUnregister when
// pinned) on destruction. Thread safety: none needed for the handle; the bytes are the caller's
// to synchronize.
#ifndef STRATA_AIO_BUFFER_H_
#define STRATA_AIO_BUFFER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace strata::aio {

struct BufferOptions {
  // Try explicit huge pages (MAP_HUGETLB), then transparent huge pages (MADV_HUGEPAGE), then
  // ordinary pages; the size is rounded up to 2 MiB.
  bool huge_pages = false;
  // Touch every page at allocation so no page fault lands in the I/O path.
  bool prefault = true;
};

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  // Maps at least `size_bytes` (rounded up to the page size); the memory reads as zeros.
  // size_bytes == 0 is InvalidArgument; a failed mmap is ResourceExhausted with the errno.
  static absl::StatusOr<AlignedBuffer> Allocate(size_t size_bytes, BufferOptions options = {});

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }           // The size asked for.
  size_t mapped_size() const { return mapped_; }  // Rounded up to the page (or huge page).
  bool huge_pages() const { return huge_; }
  absl::Span<std::byte> span() const { return {data_, size_}; }

  // Page-locks the buffer for CUDA (cudaHostRegister). Unimplemented when strata was built
  // without CUDA; FailedPrecondition naming the CUDA error when there is no device.
  absl::Status PinForCuda();
  bool cuda_pinned() const { return cuda_pinned_; }

 private:
  void Release();

  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
  bool huge_ = false;
  bool cuda_pinned_ = false;
};

}  // namespace strata::aio

#endif  // STRATA_AIO_BUFFER_H_
