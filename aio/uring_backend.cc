// The io_uring backend (liburing). One ring per backend, sized to the queue depth; the completion
// queue is twice that, so it cannot overflow while the Engine keeps at most queue_depth in flight.
#include <liburing.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "aio/internal/backends.h"
#include "base/status.h"

#if !STRATA_HAVE_LIBURING
#error "uring_backend.cc is built only with liburing"
#endif

namespace strata::aio::internal {
namespace {

class UringBackend final : public Backend {
 public:
  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  static absl::StatusOr<std::unique_ptr<Backend>> Create(const BackendOptions& options) {
    auto backend = std::unique_ptr<UringBackend>(new UringBackend());
    io_uring_params params = {};
    if (options.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = static_cast<unsigned>(options.sqpoll_idle_ms);
    }
    const int ret = io_uring_queue_init_params(static_cast<unsigned>(options.queue_depth),
                                               &backend->ring_, &params);
    if (ret < 0) {
      return ErrnoStatus(
          -ret, "io_uring_queue_init",
          absl::StrCat("(entries ", options.queue_depth, options.sqpoll ? ", SQPOLL" : "", ")"));
    }
    return std::unique_ptr<Backend>(std::move(backend));
  }

  absl::string_view name() const override { return "io_uring"; }

  absl::Status Submit(absl::Span<const Op> ops) override {
    for (const Op& op : ops) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) {
        return absl::InternalError("io_uring: submission queue full (more ops than queue depth)");
      }
      const int fd = op.file_slot >= 0 ? op.file_slot : op.fd;
      if (op.kind == OpKind::kRead) {
        if (op.buf_index >= 0) {
          io_uring_prep_read_fixed(sqe, fd, op.buf, op.length, op.offset, op.buf_index);
        } else {
          io_uring_prep_read(sqe, fd, op.buf, op.length, op.offset);
        }
      } else {
        if (op.buf_index >= 0) {
          io_uring_prep_write_fixed(sqe, fd, op.buf, op.length, op.offset, op.buf_index);
        } else {
          io_uring_prep_write(sqe, fd, op.buf, op.length, op.offset);
        }
      }
      if (op.file_slot >= 0) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, op.tag);
    }
    // io_uring_submit hands over every queued SQE; it is retried on the transient errors (the
    // SQEs stay queued in the ring meanwhile).
    unsigned left = static_cast<unsigned>(ops.size());
    while (left > 0) {
      const int ret = io_uring_submit(&ring_);
      if (ret == -EINTR || ret == -EAGAIN || ret == -EBUSY) continue;
      if (ret < 0) return ErrnoStatus(-ret, "io_uring_submit", "ring");
      left -= std::min(left, static_cast<unsigned>(ret));
      if (ret == 0 && (ring_.flags & IORING_SETUP_SQPOLL)) break;  // the poller took them
    }
    return absl::OkStatus();
  }

  absl::StatusOr<size_t> Reap(absl::Span<OpResult> out, size_t min_results) override {
    if (min_results > 0) {
      io_uring_cqe* cqe = nullptr;
      int ret;
      do {
        ret = io_uring_wait_cqe_nr(&ring_, &cqe, static_cast<unsigned>(min_results));
      } while (ret == -EINTR || ret == -EAGAIN);
      if (ret < 0) return ErrnoStatus(-ret, "io_uring_wait_cqe", "ring");
    }
    size_t n = 0;
    io_uring_cqe* cqe = nullptr;
    while (n < out.size() && io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
      out[n++] = OpResult{io_uring_cqe_get_data64(cqe), cqe->res};
      io_uring_cqe_seen(&ring_, cqe);
    }
    return n;
  }

  absl::Status RegisterBufferTable(int count) override {
    const int ret = io_uring_register_buffers_sparse(&ring_, static_cast<unsigned>(count));
    if (ret < 0) return ErrnoStatus(-ret, "io_uring_register_buffers_sparse", "ring");
    return absl::OkStatus();
  }

  absl::Status UpdateBuffer(int index, iovec iov) override {
    __u64 tag = 0;
    const int ret =
        io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(index), &iov, &tag, 1);
    if (ret < 0) {
      return ErrnoStatus(-ret, "io_uring_register_buffers_update",
                         absl::StrCat("buffer index ", index), std::nullopt, iov.iov_len);
    }
    return absl::OkStatus();
  }

  absl::Status RegisterFileTable(int count) override {
    const int ret = io_uring_register_files_sparse(&ring_, static_cast<unsigned>(count));
    if (ret < 0) return ErrnoStatus(-ret, "io_uring_register_files_sparse", "ring");
    return absl::OkStatus();
  }

  absl::Status UpdateFile(int slot, int fd) override {
    const int ret = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
    if (ret < 0) {
      return ErrnoStatus(-ret, "io_uring_register_files_update", absl::StrCat("slot ", slot));
    }
    return absl::OkStatus();
  }

 private:
  UringBackend() = default;
  io_uring ring_ = {};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateUringBackend(const BackendOptions& options) {
  return UringBackend::Create(options);
}

}  // namespace strata::aio::internal
