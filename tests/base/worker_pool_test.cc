// The worker pool (base/worker_pool.h): background jobs never take the last worker.
#include "base/worker_pool.h"

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <vector>

#include "gtest/gtest.h"

namespace strata {
namespace {

using std::chrono::seconds;

// Jobs that hold their worker until Open().
class Gate {
 public:
  std::function<void()> Held() {
    return [this] {
      const int now = ++running_;
      int seen = most_.load();
      while (now > seen && !most_.compare_exchange_weak(seen, now)) {
      }
      open_.wait();
      --running_;
    };
  }
  void Open() { opened_.set_value(); }
  int most() const { return most_.load(); }

 private:
  std::promise<void> opened_;
  std::shared_future<void> open_ = opened_.get_future().share();
  std::atomic<int> running_{0}, most_{0};
};

TEST(WorkerPoolTest, AJobPostedBehindBackgroundJobsFindsAWorker) {
  Gate gate;
  WorkerPool pool(2);
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(pool.Post(
        gate.Held(), [] {}, /*background=*/true));
  std::promise<void> ran;
  ASSERT_TRUE(pool.Post([&] { ran.set_value(); }, [] {}));
  // With every worker taken by a write-back waiting on the disk, it would wait for them all.
  EXPECT_EQ(ran.get_future().wait_for(seconds(30)), std::future_status::ready);
  EXPECT_LE(gate.most(), 1) << "background jobs on more than workers - 1 threads";
  gate.Open();
}

TEST(WorkerPoolTest, BackgroundJobsRunAfterTheOthersQueued) {
  Gate gate;
  std::mutex mu;
  std::vector<char> order;
  auto note = [&](char c) {
    return [&, c] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(c);
    };
  };
  {
    WorkerPool pool(1);  // one worker: background jobs may use it, after the rest
    ASSERT_TRUE(pool.Post(gate.Held(), [] {}));
    ASSERT_TRUE(pool.Post(
        note('b'), [] {}, /*background=*/true));
    ASSERT_TRUE(pool.Post(note('u'), [] {}));
    std::promise<void> last;
    ASSERT_TRUE(pool.Post([&] { last.set_value(); }, [] {}, /*background=*/true));
    gate.Open();
    ASSERT_EQ(last.get_future().wait_for(seconds(30)), std::future_status::ready);
  }
  EXPECT_EQ(order, (std::vector<char>{'u', 'b'}));
}

TEST(WorkerPoolTest, StopCancelsWhatIsQueuedAndRefusesMore) {
  Gate gate;
  std::atomic<int> ran{0}, cancelled{0};
  WorkerPool pool(1);
  ASSERT_TRUE(pool.Post(gate.Held(), [] {}));
  for (bool background : {false, true}) {
    ASSERT_TRUE(pool.Post([&] { ++ran; }, [&] { ++cancelled; }, background));
  }
  std::thread stopper([&] { pool.Stop(); });
  // Once Stop has begun, nothing more is queued (and its cancel is not run).
  int queued = 2;
  while (pool.Post([&] { ++ran; }, [&] { ++cancelled; })) {
    ++queued;
    std::this_thread::yield();
  }
  gate.Open();  // the running job ends; Stop joins the worker
  stopper.join();
  EXPECT_EQ(ran.load(), 0);
  EXPECT_EQ(cancelled.load(), queued);
}

}  // namespace
}  // namespace strata
