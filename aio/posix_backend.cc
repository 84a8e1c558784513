// The posix backend: pread/pwrite on the worker thread. Submit queues the ops; Reap executes them
// in order (one system call each, no retry of short transfers: that is the Engine's job). Used
// for filesystems that refuse O_DIRECT (tmpfs), where the kernel has neither io_uring nor libaio,
// and as the reference in tests.
#include <unistd.h>

#include <cerrno>
#include <deque>

#include "aio/internal/backends.h"

namespace strata::aio::internal {
namespace {

class PosixBackend final : public Backend {
 public:
  absl::string_view name() const override { return "posix"; }

  absl::Status Submit(absl::Span<const Op> ops) override {
    pending_.insert(pending_.end(), ops.begin(), ops.end());
    return absl::OkStatus();
  }

  // Executes pending ops, in order, up to out.size() of them (so at least min_results when that
  // many are pending); never blocks otherwise.
  absl::StatusOr<size_t> Reap(absl::Span<OpResult> out, size_t /*min_results*/) override {
    size_t n = 0;
    while (n < out.size() && !pending_.empty()) {
      const Op op = pending_.front();
      pending_.pop_front();
      const ssize_t ret = op.kind == OpKind::kRead
                              ? pread(op.fd, op.buf, op.length, static_cast<off_t>(op.offset))
                              : pwrite(op.fd, op.buf, op.length, static_cast<off_t>(op.offset));
      out[n++] = OpResult{op.tag, ret < 0 ? -static_cast<int64_t>(errno) : ret};
    }
    return n;
  }

 private:
  std::deque<Op> pending_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreatePosixBackend(const BackendOptions&) {
  return std::unique_ptr<Backend>(new PosixBackend());
}

}  // namespace strata::aio::internal
