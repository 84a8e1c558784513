// The probe: the feature macros appear here, as in the factory, because probing a backend means
// calling its library.
#include "aio/probe.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#if STRATA_HAVE_LIBURING
#include <liburing.h>
#endif
#if STRATA_HAVE_LIBAIO
#include <libaio.h>
#endif

namespace strata::aio {
namespace {

int64_t ReadProcNumber(const char* path) {
  std::ifstream in(path);
  int64_t value = -1;
  if (!(in >> value)) return -1;
  return value;
}

bool HasCapIpcLock() {
  __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;
}

}  // namespace

uint64_t SystemProbe::LockableBytes() const {
  return cap_ipc_lock ? std::numeric_limits<uint64_t>::max() : memlock_limit_bytes;
}

std::string SystemProbe::ToString() const {
  std::string out = absl::StrCat(
      "io_uring: ", io_uring_usable ? "usable" : absl::StrCat("unusable (", io_uring_reason, ")"));
  if (io_uring_usable) {
    absl::StrAppend(&out, absl::StrFormat(", features 0x%x", io_uring_features),
                    io_uring_fixed_rw ? ", fixed buffers" : ", no fixed buffers");
  }
  absl::StrAppend(
      &out, "; libaio: ", libaio_usable ? "usable" : absl::StrCat("unusable (", libaio_reason, ")"),
      "; aio-nr ", aio_nr, " of aio-max-nr ", aio_max_nr, "; RLIMIT_MEMLOCK ",
      memlock_limit_bytes == std::numeric_limits<uint64_t>::max()
          ? std::string("unlimited")
          : absl::StrCat(memlock_limit_bytes, " B"),
      cap_ipc_lock ? " (CAP_IPC_LOCK held)" : "");
  return out;
}

SystemProbe ProbeSystem() {
  SystemProbe probe;
  rlimit limit = {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0) {
    probe.memlock_limit_bytes = limit.rlim_cur == RLIM_INFINITY
                                    ? std::numeric_limits<uint64_t>::max()
                                    : static_cast<uint64_t>(limit.rlim_cur);
  }
  probe.cap_ipc_lock = HasCapIpcLock();
  probe.aio_max_nr = ReadProcNumber("/proc/sys/fs/aio-max-nr");
  probe.aio_nr = ReadProcNumber("/proc/sys/fs/aio-nr");

#if STRATA_HAVE_LIBURING
  io_uring ring;
  io_uring_params params = {};
  const int ret = io_uring_queue_init_params(2, &ring, &params);
  if (ret < 0) {
    probe.io_uring_reason = absl::StrCat("io_uring_queue_init: ", std::strerror(-ret));
  } else {
    probe.io_uring_features = params.features;
    io_uring_probe* ops = io_uring_get_probe_ring(&ring);
    if (ops == nullptr) {
      probe.io_uring_reason = "the kernel has no IORING_REGISTER_PROBE (older than 5.6)";
    } else {
      const bool rw = io_uring_opcode_supported(ops, IORING_OP_READ) &&
                      io_uring_opcode_supported(ops, IORING_OP_WRITE);
      probe.io_uring_fixed_rw = io_uring_opcode_supported(ops, IORING_OP_READ_FIXED) &&
                                io_uring_opcode_supported(ops, IORING_OP_WRITE_FIXED);
      probe.io_uring_usable = rw;
      if (!rw) probe.io_uring_reason = "the kernel lacks IORING_OP_READ/IORING_OP_WRITE";
      io_uring_free_probe(ops);
    }
    io_uring_queue_exit(&ring);
  }
#else
  probe.io_uring_reason = "strata was built without liburing";
#endif

#if STRATA_HAVE_LIBAIO
  io_context_t ctx = nullptr;
  const int aio_ret = io_setup(1, &ctx);
  if (aio_ret < 0) {
    probe.libaio_reason = absl::StrCat("io_setup: ", std::strerror(-aio_ret),
                                       aio_ret == -EAGAIN ? " (aio-nr reached aio-max-nr)" : "");
  } else {
    probe.libaio_usable = true;
    io_destroy(ctx);
  }
#else
  probe.libaio_reason = "strata was built without libaio";
#endif
  return probe;
}

}  // namespace strata::aio
