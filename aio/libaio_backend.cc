// The libaio backend (Linux native AIO through libaio). One io_context per backend sized to the
// queue depth; a fixed pool of iocbs, one per op in flight. An op that io_submit refuses comes
// back as a result carrying the -errno (so every op yields exactly one result).
#include <libaio.h>

#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "aio/internal/backends.h"
#include "base/status.h"

#if !STRATA_HAVE_LIBAIO
#error "libaio_backend.cc is built only with libaio"
#endif

namespace strata::aio::internal {
namespace {

class LibAioBackend final : public Backend {
 public:
  ~LibAioBackend() override {
    if (ctx_ != nullptr) io_destroy(ctx_);
  }

  static absl::StatusOr<std::unique_ptr<Backend>> Create(const BackendOptions& options) {
    auto backend = std::unique_ptr<LibAioBackend>(new LibAioBackend(options.queue_depth));
    const int ret = io_setup(options.queue_depth, &backend->ctx_);
    if (ret < 0) {
      backend->ctx_ = nullptr;
      return ErrnoStatus(-ret, "io_setup",
                         absl::StrCat("(nr_events ", options.queue_depth,
                                      "; see /proc/sys/fs/aio-max-nr and aio-nr)"));
    }
    return std::unique_ptr<Backend>(std::move(backend));
  }

  absl::string_view name() const override { return "libaio"; }

  absl::Status Submit(absl::Span<const Op> ops) override {
    std::vector<iocb*> batch;
    batch.reserve(ops.size());
    for (const Op& op : ops) {
      if (free_.empty()) {
        return absl::InternalError("libaio: more ops than queue depth in flight");
      }
      iocb* cb = free_.back();
      free_.pop_back();
      if (op.kind == OpKind::kRead) {
        io_prep_pread(cb, op.fd, op.buf, op.length, static_cast<long long>(op.offset));
      } else {
        io_prep_pwrite(cb, op.fd, op.buf, op.length, static_cast<long long>(op.offset));
      }
      cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(op.tag));
      batch.push_back(cb);
    }
    size_t done = 0;
    while (done < batch.size()) {
      const int ret = io_submit(ctx_, static_cast<long>(batch.size() - done), &batch[done]);
      if (ret == -EINTR || ret == -EAGAIN) continue;
      if (ret < 0) {
        // The first unsubmitted op fails with this errno; the rest are tried again.
        Refuse(batch[done], ret);
        ++done;
        continue;
      }
      done += static_cast<size_t>(ret);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<size_t> Reap(absl::Span<OpResult> out, size_t min_results) override {
    size_t n = 0;
    while (n < out.size() && !refused_.empty()) {
      out[n++] = refused_.back();
      refused_.pop_back();
    }
    if (n == out.size()) return n;
    const long min = static_cast<long>(min_results > n ? min_results - n : 0);
    events_.resize(out.size() - n);
    int ret;
    do {
      ret = io_getevents(ctx_, min, static_cast<long>(events_.size()), events_.data(), nullptr);
    } while (ret == -EINTR);
    if (ret < 0) return ErrnoStatus(-ret, "io_getevents", "context");
    for (int i = 0; i < ret; ++i) {
      iocb* cb = events_[i].obj;
      out[n++] = OpResult{static_cast<uint64_t>(reinterpret_cast<uintptr_t>(cb->data)),
                          static_cast<int64_t>(static_cast<long>(events_[i].res))};
      free_.push_back(cb);
    }
    return n;
  }

 private:
  explicit LibAioBackend(int depth) : iocbs_(static_cast<size_t>(depth)) {
    for (iocb& cb : iocbs_) free_.push_back(&cb);
  }

  void Refuse(iocb* cb, int ret) {
    refused_.push_back(OpResult{static_cast<uint64_t>(reinterpret_cast<uintptr_t>(cb->data)), ret});
    free_.push_back(cb);
  }

  io_context_t ctx_ = nullptr;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<OpResult> refused_;
  std::vector<io_event> events_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateLibAioBackend(const BackendOptions& options) {
  return LibAioBackend::Create(options);
}

}  // namespace strata::aio::internal
