// A request failed by one worker while another watches it: the first error is what every worker
// sees once the request reads as failed.
#include <atomic>
#include <thread>

#include "absl/status/status.h"
#include "aio/internal/worker.h"
#include "gtest/gtest.h"

namespace strata::aio::internal {
namespace {

TEST(RequestTest, TheFirstErrorStaysAndLaterOnesAreDropped) {
  Request request;
  EXPECT_FALSE(request.failed());
  EXPECT_TRUE(request.status().ok());
  request.Fail(absl::ResourceExhaustedError("no space"));
  request.Fail(absl::CancelledError("an earlier piece of the request failed"));
  EXPECT_TRUE(request.failed());
  EXPECT_EQ(request.status().code(), absl::StatusCode::kResourceExhausted);
}

// A worker that finds the request failed cancels its own piece, and that cancellation is kept
// only when no error is there yet. Were the flag published before the error, a watcher could find
// the flag and no error (a CI run once reported CANCELLED instead of ENOSPC that way).
TEST(RequestTest, AWorkerThatSeesTheFlagFindsTheError) {
  constexpr int kTrials = 20000;
  int missed = 0;
  for (int i = 0; i < kTrials; ++i) {
    Request request;
    std::atomic<bool> go{false};
    std::thread failing([&] {
      while (!go.load(std::memory_order_acquire)) {
      }
      request.Fail(absl::ResourceExhaustedError("no space"));
    });
    go.store(true, std::memory_order_release);
    while (!request.failed()) {
    }
    request.Fail(absl::CancelledError("an earlier piece of the request failed"));
    if (request.status().code() != absl::StatusCode::kResourceExhausted) ++missed;
    failing.join();
  }
  EXPECT_EQ(missed, 0) << "of " << kTrials << " trials";
}

}  // namespace
}  // namespace strata::aio::internal
