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
  bool hugetlb = false;          // buffers in reserved 2 MiB huge pages (--mem=mmaphuge)
  double runtime_seconds = 0;    // > 0: time-based, looping over the file for this long
  double ramp_seconds = 0;       // with runtime: warm-up not counted
  std::string Describe() const;  // "fio io_uring bs=1M qd=8"
};

struct FioResult {
  double gb_per_s = 0;     // bytes moved / runtime, 1e9 bytes per GB
  double cpu_seconds = 0;  // user + system, summed over jobs
  double bytes = 0;
};

// Whether fio is on PATH.
bool FioAvailable();

// 2 MiB hugetlb pages for fio's --mem=mmaphuge. Reserve() raises vm.nr_hugepages (root only) so
// that `bytes` are free, and the destructor puts the old value back. Without a reservation fio's
// buffers are 4 KiB pages, which on some devices is a weaker ceiling than the disk (BENCH notes).
class HugetlbReservation {
 public:
  HugetlbReservation() = default;
  ~HugetlbReservation();
  HugetlbReservation(const HugetlbReservation&) = delete;
  HugetlbReservation& operator=(const HugetlbReservation&) = delete;
  // Returns false (with the reason in *why) when the pages cannot be had.
  bool Reserve(uint64_t bytes, std::string* why);
  static uint64_t FreeBytes();
  // Puts the old value back from a signal handler (async-signal-safe: open/write only).
  static void RestoreFromSignal();

 private:
  long previous_ = -1;
};

// Runs one fio job (O_DIRECT, sequential). Fails with fio's stderr when fio does.
absl::StatusOr<FioResult> RunFio(const FioJob& job);

}  // namespace strata::bench

#endif  // STRATA_BENCH_COMMON_FIO_H_
