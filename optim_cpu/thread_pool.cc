#include "optim_cpu/thread_pool.h"

#include <hwloc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace strata::optim_cpu {
namespace {

// Range of worker `i` of `workers` over n items, boundaries at multiples of granule.
std::pair<size_t, size_t> RangeOf(size_t n, size_t granule, int workers, int i) {
  const size_t units = (n + granule - 1) / granule;
  const size_t per = units / workers, extra = units % workers;
  const size_t begin_unit = i * per + std::min<size_t>(i, extra);
  const size_t end_unit = begin_unit + per + (static_cast<size_t>(i) < extra ? 1 : 0);
  return {std::min(n, begin_unit * granule), std::min(n, end_unit * granule)};
}

}  // namespace

int ThreadPool::Cores() {
  hwloc_topology_t topology;
  int n = 0;
  if (hwloc_topology_init(&topology) == 0) {
    if (hwloc_topology_load(topology) == 0) n = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_CORE);
    hwloc_topology_destroy(topology);
  }
  return n > 0 ? n : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(int threads, bool bind) {
  if (threads < 0 || threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("optim_cpu threads: must be in [0, 1024] (0: one per core), got ", threads));
  }
  auto pool = std::unique_ptr<ThreadPool>(new ThreadPool());
  hwloc_topology_t topology;
  std::vector<hwloc_obj_t> cores;
  const bool have_topology =
      hwloc_topology_init(&topology) == 0 && hwloc_topology_load(topology) == 0;
  if (have_topology) {
    const int n = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_CORE);
    for (int i = 0; i < n; ++i) cores.push_back(hwloc_get_obj_by_type(topology, HWLOC_OBJ_CORE, i));
  }
  if (threads == 0) {
    threads = !cores.empty() ? static_cast<int>(cores.size())
                             : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
  pool->size_ = threads;
  // Cpusets to bind to: one per core, round-robin when there are more threads than cores.
  std::vector<hwloc_bitmap_t> sets;
  if (bind && have_topology && !cores.empty()) {
    for (int i = 0; i < threads; ++i) {
      hwloc_bitmap_t set = hwloc_bitmap_dup(cores[i % cores.size()]->cpuset);
      hwloc_bitmap_singlify(set);  // one PU of the core
      sets.push_back(set);
    }
  }
  if (threads > 1) {
    std::vector<std::string> placed;
    std::atomic<int> bound{0};
    for (int i = 0; i < threads; ++i) {
      pool->threads_.emplace_back([p = pool.get(), i] { p->WorkerLoop(i); });
      if (!sets.empty() && hwloc_set_thread_cpubind(topology, pool->threads_.back().native_handle(),
                                                    sets[i], 0) == 0) {
        ++bound;
        placed.push_back(absl::StrCat(hwloc_bitmap_first(sets[i])));
      }
    }
    pool->bound_ = bound == threads;
    pool->placement_ = pool->bound_ ? absl::StrCat("bound to PUs ", absl::StrJoin(placed, ","))
                                    : "not bound (hwloc could not place the threads)";
  } else {
    pool->placement_ = "caller's thread";
  }
  if (!bind) pool->placement_ = "not bound (binding off)";
  for (hwloc_bitmap_t s : sets) hwloc_bitmap_free(s);
  if (have_topology) hwloc_topology_destroy(topology);
  return pool;
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  work_cv_.SignalAll();
  for (auto& t : threads_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(size_t, size_t, int)>* fn;
    size_t n, granule;
    int workers;
    {
      MutexLock lock(&mu_);
      while (generation_ == seen && !stop_) work_cv_.Wait(&mu_);
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_;
      granule = granule_;
      workers = workers_;
    }
    if (index < workers) {
      const auto [begin, end] = RangeOf(n, granule, workers, index);
      if (begin < end) (*fn)(begin, end, index);
    }
    MutexLock lock(&mu_);
    if (--pending_ == 0) done_cv_.SignalAll();
  }
}

void ThreadPool::ParallelFor(size_t n, size_t granule,
                             const std::function<void(size_t, size_t, int)>& fn, int workers) {
  if (n == 0) return;
  if (granule == 0) granule = 1;
  if (threads_.empty()) {
    fn(0, n, 0);
    return;
  }
  MutexLock call(&call_mu_);
  MutexLock lock(&mu_);
  fn_ = &fn;
  n_ = n;
  granule_ = granule;
  workers_ = workers <= 0 || workers > size_ ? size_ : workers;
  pending_ = size_;
  ++generation_;
  work_cv_.SignalAll();
  while (pending_ > 0) done_cv_.Wait(&mu_);
  fn_ = nullptr;
}

}  // namespace strata::optim_cpu
