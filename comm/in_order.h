// comm/in_order.h: what every Communicator shares: its Work, the thread of its own that runs its
// collectives one at a time in the order issued, the communicator broken after the first that
// fails (communicator.h), and the ranks' agreement on the world size when they meet.
//
// Thread safety: InOrder::Issue and Abort may be called from any thread; a task runs on InOrder's
// thread only, so what the tasks alone touch needs no lock. Work is thread-safe.
#ifndef STRATA_COMM_IN_ORDER_H_
#define STRATA_COMM_IN_ORDER_H_

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "base/mutex.h"
#include "comm/communicator.h"
#include "comm/tcp_store.h"

namespace strata::comm {

class WorkImpl final : public Work {
 public:
  absl::Status Wait() override;
  bool WaitFor(std::chrono::milliseconds timeout) override;
  bool done() const override;
  void Complete(absl::Status s);

 private:
  mutable Mutex mu_;
  CondVar cv_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// A Work already done with `s` (a call refused on the spot).
std::shared_ptr<Work> FailedWork(absl::Status s);

// Each rank publishes the world size it was given under `prefix` and compares it with rank 0's,
// then with every other rank's it counts, before anything waits for ranks that would never come:
// FailedPrecondition naming both (`who`: what meets, the message's start).
absl::Status AgreeOnWorldSize(TcpStore& store, const std::string& prefix, int rank, int size,
                              Duration timeout, const char* who);

// Publishes `mine` under `prefix` and returns every rank's, in rank order. Rank 0 (whose process
// serves the store) returns only once every rank has read them all, so that a rank that ends at
// once on what it read (an error) leaves the others able to read it too.
absl::StatusOr<std::vector<std::string>> Exchange(TcpStore& store, const std::string& prefix,
                                                  int rank, int size, const std::string& mine,
                                                  Duration timeout);

class InOrder {
 public:
  // `who`: "rank r of n", the start of every message. `on_start` runs first on the thread (a
  // communicator's per-thread set-up), `on_stop` last.
  explicit InOrder(std::string who, std::function<void()> on_start = nullptr,
                   std::function<void()> on_stop = nullptr);
  // Runs what was issued (each fails at once once the communicator is broken), then joins.
  ~InOrder();
  InOrder(const InOrder&) = delete;
  InOrder& operator=(const InOrder&) = delete;

  // Queues `run` (a collective named `what`); its Status completes the Work. A failure breaks
  // the communicator: that collective's Work has its error, and every later one fails at once
  // with it ("... (the communicator is broken from here)"). After Abort, refused at once.
  std::shared_ptr<Work> Issue(std::string what, std::function<absl::Status()> run);
  // Every later collective is refused at once, and any queued fails (naming the abort).
  void Abort() { aborted_.store(true); }
  // Cancelled, naming this rank, `what` and the abort: what a collective the abort ends says.
  absl::Status Aborted(const std::string& what) const;

 private:
  struct Task {
    std::string what;
    std::function<absl::Status()> run;
    std::shared_ptr<WorkImpl> work;
  };
  void Run();

  const std::string who_;
  std::function<void()> on_start_, on_stop_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_;  // the thread's only
  std::atomic<bool> aborted_{false};
  std::thread thread_;
};

}  // namespace strata::comm

#endif  // STRATA_COMM_IN_ORDER_H_
