// aio/probe.h: what this kernel and these limits allow, read once when an Engine is created.
//
// io_uring: can a ring be set up (io_uring_disabled, seccomp and old kernels say no), its feature
// bits, and whether the opcodes the Engine uses (READ, WRITE, READ_FIXED, WRITE_FIXED) are there.
// libaio: can an io_context be set up (aio-max-nr exhausted says no). Limits: RLIMIT_MEMLOCK and
// CAP_IPC_LOCK (registered buffers are charged to the locked-memory limit without the capability).
//
// Thread safety: ProbeSystem() is safe to call from any thread; SystemProbe is a plain value.
#ifndef STRATA_AIO_PROBE_H_
#define STRATA_AIO_PROBE_H_

#include <cstdint>
#include <string>

namespace strata::aio {

struct SystemProbe {
  bool io_uring_usable = false;
  std::string io_uring_reason;  // Why not, when not usable.
  uint32_t io_uring_features = 0;
  bool io_uring_fixed_rw = false;  // READ_FIXED/WRITE_FIXED opcodes.
  bool libaio_usable = false;
  std::string libaio_reason;
  int64_t aio_max_nr = -1;  // /proc/sys/fs/aio-max-nr and aio-nr, -1 when unreadable.
  int64_t aio_nr = -1;
  uint64_t memlock_limit_bytes = 0;  // RLIMIT_MEMLOCK soft limit (UINT64_MAX: unlimited).
  bool cap_ipc_lock = false;

  // Bytes that may be registered (pinned) under the limits: unlimited with CAP_IPC_LOCK.
  uint64_t LockableBytes() const;
  std::string ToString() const;
};

SystemProbe ProbeSystem();

}  // namespace strata::aio

#endif  // STRATA_AIO_PROBE_H_
