#include "comm/in_order.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace strata::comm {

absl::Status WorkImpl::Wait() {
  MutexLock lock(&mu_);
  while (!done_) cv_.Wait(&mu_);
  return Unshared(status_);  // the waiter's own: the issuing thread may free this Work's
}

bool WorkImpl::WaitFor(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  while (!done_) {
    const auto left = until - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds(0)) return false;
    cv_.WaitFor(&mu_, left);
  }
  return true;
}

bool WorkImpl::done() const {
  MutexLock lock(&mu_);
  return done_;
}

void WorkImpl::Complete(absl::Status s) {
  {
    MutexLock lock(&mu_);
    status_ = std::move(s);
    done_ = true;
  }
  cv_.SignalAll();
}

std::shared_ptr<Work> FailedWork(absl::Status s) {
  auto w = std::make_shared<WorkImpl>();
  w->Complete(std::move(s));
  return w;
}

absl::Status AgreeOnWorldSize(TcpStore& store, const std::string& prefix, int rank, int size,
                              Duration timeout, const char* who) {
  const std::string mine = std::to_string(size);
  STRATA_RETURN_IF_ERROR(
      store.Set(absl::StrCat(prefix, "size/", rank), {mine.begin(), mine.end()}));
  // Rank 0's first (a rank told too large a size would wait for ranks that never come), then
  // every other rank's this rank counts: rank 0 names one told another size too.
  // Rank 0's process serves the store: on a mismatch it waits for the other to have read its
  // size (each says so) before it returns, and may end.
  for (int j = 0; j < size; ++j) {
    if (j == rank) continue;
    auto theirs = store.Get(absl::StrCat(prefix, "size/", j), timeout);
    if (!theirs.ok()) return theirs.status();
    if (j == 0) {
      const std::string read = "read";
      store.Set(absl::StrCat(prefix, "size/read/", rank), {read.begin(), read.end()}).IgnoreError();
    }
    const std::string their_size(theirs->begin(), theirs->end());
    if (their_size != mine) {
      if (rank == 0) store.Get(absl::StrCat(prefix, "size/read/", j), timeout).IgnoreError();
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": this rank (", rank, ") was given world size ", size, " but rank ", j,
                       " was given ", their_size, ": WORLD_SIZE must be the same on every rank"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Exchange(TcpStore& store, const std::string& prefix,
                                                  int rank, int size, const std::string& mine,
                                                  Duration timeout) {
  STRATA_RETURN_IF_ERROR(store.Set(absl::StrCat(prefix, rank), {mine.begin(), mine.end()}));
  std::vector<std::string> all;
  for (int j = 0; j < size; ++j) {
    auto theirs = store.Get(absl::StrCat(prefix, j), timeout);
    if (!theirs.ok()) return theirs.status();
    all.emplace_back(theirs->begin(), theirs->end());
  }
  // Told to rank 0, which may end as soon as it has heard it, before its answer reaches this
  // rank: a failure here is not one (the values are read).
  const std::string read = "read";
  store.Set(absl::StrCat(prefix, "read/", rank), {read.begin(), read.end()}).IgnoreError();
  if (rank == 0) {
    for (int j = 1; j < size; ++j) {
      auto done = store.Get(absl::StrCat(prefix, "read/", j), timeout);
      if (!done.ok()) return done.status();
    }
  }
  return all;
}

InOrder::InOrder(std::string who, std::function<void()> on_start, std::function<void()> on_stop)
    : who_(std::move(who)), on_start_(std::move(on_start)), on_stop_(std::move(on_stop)) {
  thread_ = std::thread([this] { Run(); });
}

InOrder::~InOrder() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

std::shared_ptr<Work> InOrder::Issue(std::string what, std::function<absl::Status()> run) {
  if (aborted_.load()) return FailedWork(Aborted(what));  // not queued behind a blocked one
  auto work = std::make_shared<WorkImpl>();
  {
    MutexLock lock(&mu_);
    queue_.push_back({std::move(what), std::move(run), work});
  }
  cv_.Signal();
  return work;
}

absl::Status InOrder::Aborted(const std::string& what) const {
  return absl::CancelledError(
      absl::StrCat(who_, ": ", what,
                   ": the communicator was aborted (a wait for a collective was interrupted)"));
}

void InOrder::Run() {
  if (on_start_) on_start_();
  while (true) {
    Task task;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !stopping_) cv_.Wait(&mu_);
      if (queue_.empty()) break;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    if (broken_.ok() && aborted_.load()) broken_ = Aborted(task.what);
    if (!broken_.ok()) {
      task.work->Complete(broken_);
      continue;
    }
    absl::Status s = task.run();
    if (!s.ok()) {
      broken_ = absl::Status(s.code(),
                             absl::StrCat(s.message(), " (the communicator is broken from here)"));
    }
    task.work->Complete(std::move(s));
  }
  if (on_stop_) on_stop_();
}

}  // namespace strata::comm
