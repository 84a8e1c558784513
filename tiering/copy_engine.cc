#include "tiering/copy_engine.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace strata::tiering {

std::future<absl::Status> CopyEngine::CopyAsync(void* dst, const void* src, size_t bytes,
                                                CopyDirection direction) {
  std::promise<absl::Status> promise;
  std::future<absl::Status> future = promise.get_future();
  Copy(dst, src, bytes, direction,
       [p = std::move(promise)](absl::Status s) mutable { p.set_value(std::move(s)); });
  return future;
}

std::future<absl::Status> CopyEngine::ZeroAsync(void* dst, size_t bytes) {
  std::promise<absl::Status> promise;
  std::future<absl::Status> future = promise.get_future();
  Zero(dst, bytes, [p = std::move(promise)](absl::Status s) mutable { p.set_value(std::move(s)); });
  return future;
}

HostCopyEngine::HostCopyEngine(uint64_t bytes_per_second)
    : bytes_per_second_(bytes_per_second), thread_([this] { Run(); }) {}

HostCopyEngine::~HostCopyEngine() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void HostCopyEngine::Copy(void* dst, const void* src, size_t bytes, CopyDirection, Done done) {
  {
    MutexLock lock(&mu_);
    jobs_.push_back(Job{dst, src, bytes, std::move(done)});
  }
  cv_.Signal();
}

void HostCopyEngine::Zero(void* dst, size_t bytes, Done done) {
  {
    MutexLock lock(&mu_);
    jobs_.push_back(Job{dst, nullptr, bytes, std::move(done)});
  }
  cv_.Signal();
}

void HostCopyEngine::Run() {
  using Clock = std::chrono::steady_clock;
  // With a cap, copies are paced as a link of that bandwidth would: each ends no earlier than
  // bytes / bandwidth after the link became free.
  Clock::time_point link_free = Clock::now();
  while (true) {
    Job job;
    {
      MutexLock lock(&mu_);
      while (jobs_.empty() && !stop_) cv_.Wait(&mu_);
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    if (job.src == nullptr) {
      std::memset(job.dst, 0, job.bytes);  // on the device's side of the link
      std::move(job.done)(absl::OkStatus());
      continue;
    }
    const Clock::time_point start = std::max(link_free, Clock::now());
    std::memcpy(job.dst, job.src, job.bytes);
    if (bytes_per_second_ > 0) {
      link_free = start + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(double(job.bytes) / bytes_per_second_));
      std::this_thread::sleep_until(link_free);  // the modelled transfer time
    }
    std::move(job.done)(absl::OkStatus());
  }
}

}  // namespace strata::tiering
