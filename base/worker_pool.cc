#include "base/worker_pool.h"

#include <algorithm>
#include <utility>

namespace strata {

WorkerPool::WorkerPool(int workers) : background_limit_(std::max(1, workers - 1)) {
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { Loop(); });
}

WorkerPool::~WorkerPool() { Stop(); }

bool WorkerPool::Post(std::function<void()> run, std::function<void()> cancel, bool background) {
  MutexLock lock(&mu_);
  if (stop_) return false;
  (background ? background_ : jobs_).push_back({std::move(run), std::move(cancel)});
  cv_.SignalAll();  // the worker woken must be one that may take it
  return true;
}

void WorkerPool::Stop() {
  std::deque<Job> cancelled;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    cancelled.swap(jobs_);
    for (Job& j : background_) cancelled.push_back(std::move(j));
    background_.clear();
    cv_.SignalAll();
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  for (Job& j : cancelled) j.cancel();
}

void WorkerPool::Loop() {
  for (;;) {
    Job j;
    bool background = false;
    {
      MutexLock lock(&mu_);
      while (!stop_ && jobs_.empty() &&
             (background_.empty() || background_running_ >= background_limit_)) {
        cv_.Wait(&mu_);
      }
      if (stop_) return;
      background = jobs_.empty();
      std::deque<Job>& from = background ? background_ : jobs_;
      j = std::move(from.front());
      from.pop_front();
      if (background) ++background_running_;
    }
    j.run();
    if (background) {
      MutexLock lock(&mu_);
      --background_running_;
      cv_.SignalAll();
    }
  }
}

}  // namespace strata
