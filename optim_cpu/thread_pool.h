// optim_cpu/thread_pool.h: a persistent pool of worker threads for the CPU optimizers.
//
// Threads are created once and placed with hwloc: worker i is bound to the i-th core (one PU per
// core first, so two workers never share a core while a core is free), unless binding is off or
// hwloc cannot do it (then they float, and bound() says so). ParallelFor splits [0, n) into
// contiguous ranges, one per worker, runs them and returns when all are done; the calling thread
// waits (it does not run a range itself). A pool of one thread runs the range on the caller.
//
// Thread safety: ParallelFor may be called from one thread at a time (it is serialized: a second
// caller waits for the first). The pool must outlive every call.
#ifndef STRATA_OPTIM_CPU_THREAD_POOL_H_
#define STRATA_OPTIM_CPU_THREAD_POOL_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "base/mutex.h"

namespace strata::optim_cpu {

class ThreadPool {
 public:
  // threads: 1..1024; 0 means one per core (Cores()).
  static absl::StatusOr<std::unique_ptr<ThreadPool>> Create(int threads, bool bind = true);
  // The machine's cores: hwloc's count, else hardware_concurrency (at least 1).
  static int Cores();
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }
  bool bound() const { return bound_; }
  const std::string& placement() const { return placement_; }  // e.g. "bound to cores 0,1"

  // Runs fn(begin, end, worker) over `n` items split into contiguous ranges whose boundaries are
  // multiples of `granule` (so vector kernels see whole vectors except at n), one range for each
  // of the first `workers` threads (0, or more than size(): all of them); the others stay idle.
  void ParallelFor(size_t n, size_t granule, const std::function<void(size_t, size_t, int)>& fn,
                   int workers = 0);

 private:
  ThreadPool() = default;
  void WorkerLoop(int index);

  int size_ = 1;
  bool bound_ = false;
  std::string placement_;
  std::vector<std::thread> threads_;

  Mutex call_mu_;  // serializes ParallelFor callers
  Mutex mu_;
  CondVar work_cv_;
  CondVar done_cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  const std::function<void(size_t, size_t, int)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t n_ ABSL_GUARDED_BY(mu_) = 0;
  size_t granule_ ABSL_GUARDED_BY(mu_) = 1;
  int workers_ ABSL_GUARDED_BY(mu_) = 1;  // the call's: threads from index workers_ on sit out
};

}  // namespace strata::optim_cpu

#endif  // STRATA_OPTIM_CPU_THREAD_POOL_H_
