// base/worker_pool.h: worker threads kept for a component's life and their queue of jobs (the
// Runtime's moves; the optimizer swapper's reads and writes), so that no thread is made per job.
//
// Jobs run in the order they were posted, each on the first worker free, except background jobs
// (the Runtime's early write-backs, which wait on the disk): they run only when no other job is
// queued, and on at most workers - 1 threads at once (1 with a single worker), so that a prefetch
// posted behind several of them always finds a worker.
//
// Thread safety: Post may be called from any thread, the workers' own included. Stop (or the
// destructor) joins the workers and runs the `cancel` of every job still queued, on the calling
// thread; a job running then finishes first.
#ifndef STRATA_BASE_WORKER_POOL_H_
#define STRATA_BASE_WORKER_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "base/mutex.h"

namespace strata {

class WorkerPool {
 public:
  explicit WorkerPool(int workers);  // workers >= 1
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `run`; `cancel` runs instead if the pool stops first. False (nothing queued, `cancel`
  // not run) once Stop has begun.
  bool Post(std::function<void()> run, std::function<void()> cancel, bool background = false);
  void Stop();

 private:
  struct Job {
    std::function<void()> run;
    std::function<void()> cancel;
  };
  void Loop();

  const int background_limit_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<Job> background_ ABSL_GUARDED_BY(mu_);
  int background_running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace strata

#endif  // STRATA_BASE_WORKER_POOL_H_
