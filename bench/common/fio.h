// bench/common/fio.h: runs fio (the disk's reference) on a file and reads back what it measured.
//
// Thread safety: none needed; each call forks one fio process and waits for it.
#ifndef STRATA_BENCH_COMMON_FIO_H_
#define STRATA_BENCH_COMMON_FIO_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace strata::bench {

struct FioJob {
  std::string file;
  bool write = false;
  std::string engine = "io_uring";  // io_uring | libaio
  uint64_t block_size = 1 << 20;
  int queue_depth = 8;
  int numjobs = 1;               // >1: the file is split into numjobs contiguous parts
  uint64_t size_bytes = 0;       // whole file
  bool fixedbufs = false;        // io_uring registered buffers
  bool batch = false;            // iodepth_batch_submit / _complete_max matched to the depth
  std::string Describe() const;  // "fio io_uring bs=1M qd=8"
};

struct FioResult {
  double gb_per_s = 0;      // bytes moved / runtime, 1e9 bytes per GB
  double cpu_seconds = 0;   // user + system, summed over jobs
  double bytes = 0;
};

// Whether fio is on PATH.
bool FioAvailable();

// Runs one fio job (O_DIRECT, sequential). Fails with fio's stderr when fio does.
absl::StatusOr<FioResult> RunFio(const FioJob& job);

}  // namespace strata::bench

#endif  // STRATA_BENCH_COMMON_FIO_H_
