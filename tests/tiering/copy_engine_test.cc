#include "tiering/copy_engine.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"
#include "tiering/memory_resource.h"

namespace strata::tiering {
namespace {

TEST(HostCopyEngineTest, CopiesCompleteInOrderWithTheirBytes) {
  HostCopyEngine engine;
  const auto src = strata::testing::RandomBytes(1 << 20, 1);
  std::vector<std::vector<std::byte>> dst(8, std::vector<std::byte>(src.size()));
  std::vector<int> order;
  Mutex mu;
  std::vector<std::future<absl::Status>> futures;
  for (int i = 0; i < 8; ++i) {
    std::promise<absl::Status> p;
    futures.push_back(p.get_future());
    engine.Copy(dst[i].data(), src.data(), src.size(),
                i % 2 ? CopyDirection::kHostToDevice : CopyDirection::kDeviceToHost,
                [&, i, p = std::move(p)](absl::Status s) mutable {
                  {
                    MutexLock lock(&mu);
                    order.push_back(i);
                  }
                  p.set_value(std::move(s));
                });
  }
  for (auto& f : futures) EXPECT_TRUE(f.get().ok());
  for (const auto& d : dst) EXPECT_EQ(d, src);
  MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(HostCopyEngineTest, ABandwidthCapPacesTheCopies) {
  HostCopyEngine engine(/*bytes_per_second=*/100ull << 20);  // 100 MiB/s
  std::vector<std::byte> src(4 << 20), dst(4 << 20);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(engine.CopyAsync(dst.data(), src.data(), src.size(), CopyDirection::kHostToDevice)
                  .get()
                  .ok());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(seconds, 0.039);  // 4 MiB at 100 MiB/s is 40 ms
}

TEST(HostCopyEngineTest, ZerosComeInOrderWithTheCopiesAndDoNotCrossTheCappedLink) {
  // 1 MiB/s: a copy of 1 MiB takes a second; 64 MiB of zeros would take a minute if paced.
  HostCopyEngine engine(/*bytes_per_second=*/1 << 20);
  const auto src = strata::testing::RandomBytes(1 << 20, 3);
  std::vector<std::byte> dst(64 << 20, std::byte{7});
  auto copied = engine.CopyAsync(dst.data(), src.data(), src.size(), CopyDirection::kHostToDevice);
  auto zeroed = engine.ZeroAsync(dst.data(), 4096);  // queued behind the copy: overwrites its start
  ASSERT_TRUE(copied.get().ok());
  ASSERT_TRUE(zeroed.get().ok());
  EXPECT_EQ(std::count(dst.begin(), dst.begin() + 4096, std::byte{0}), 4096);
  EXPECT_TRUE(std::equal(dst.begin() + 4096, dst.begin() + src.size(), src.begin() + 4096));
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(engine.ZeroAsync(dst.data(), dst.size()).get().ok());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_EQ(std::count(dst.begin(), dst.end(), std::byte{0}), static_cast<ptrdiff_t>(dst.size()));
}

TEST(CudaCopyEngineTest, RoundTripThroughDeviceMemoryWhenThereIsADevice) {
  for (int streams : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(streams, " streams"));
    auto engine = CreateCudaCopyEngine(0, streams);
    if (!engine.ok()) GTEST_SKIP() << "no CUDA device: " << engine.status().message();
    auto device = CreateCudaDeviceResource(0);
    ASSERT_TRUE(device.ok()) << device.status();
    const auto src = strata::testing::RandomBytes(8 << 20, 2);
    std::vector<std::byte> back(src.size());
    auto d = (*device)->Allocate(src.size());
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_TRUE(
        (*engine)->CopyAsync(*d, src.data(), src.size(), CopyDirection::kHostToDevice).get().ok());
    ASSERT_TRUE(
        (*engine)->CopyAsync(back.data(), *d, src.size(), CopyDirection::kDeviceToHost).get().ok());
    EXPECT_EQ(back, src);
    // Zeros made on the device (the copy before them waited for).
    ASSERT_TRUE((*engine)->ZeroAsync(*d, src.size() / 2).get().ok());
    ASSERT_TRUE(
        (*engine)->CopyAsync(back.data(), *d, src.size(), CopyDirection::kDeviceToHost).get().ok());
    EXPECT_EQ(std::count(back.begin(), back.begin() + src.size() / 2, std::byte{0}),
              static_cast<ptrdiff_t>(src.size() / 2));
    EXPECT_TRUE(
        std::equal(back.begin() + src.size() / 2, back.end(), src.begin() + src.size() / 2));
    // Both directions in flight at once (on two streams they overlap): each lands whole.
    auto e = (*device)->Allocate(src.size());
    ASSERT_TRUE(e.ok()) << e.status();
    const auto other = strata::testing::RandomBytes(src.size(), 3);
    ASSERT_TRUE((*engine)
                    ->CopyAsync(*e, other.data(), other.size(), CopyDirection::kHostToDevice)
                    .get()
                    .ok());
    ASSERT_TRUE(
        (*engine)->CopyAsync(*d, src.data(), src.size(), CopyDirection::kHostToDevice).get().ok());
    std::vector<std::byte> from_e(src.size());
    auto down = (*engine)->CopyAsync(*d, other.data(), other.size(), CopyDirection::kHostToDevice);
    auto up = (*engine)->CopyAsync(from_e.data(), *e, other.size(), CopyDirection::kDeviceToHost);
    ASSERT_TRUE(down.get().ok());
    ASSERT_TRUE(up.get().ok());
    EXPECT_EQ(from_e, other);
    ASSERT_TRUE(
        (*engine)->CopyAsync(back.data(), *d, src.size(), CopyDirection::kDeviceToHost).get().ok());
    EXPECT_EQ(back, other);
    (*device)->Deallocate(*e, src.size());
    (*device)->Deallocate(*d, src.size());
  }
}

TEST(CudaCopyEngineTest, OneOrTwoStreamsAreAccepted) {
  for (int streams : {0, 3, -1}) {
    auto engine = CreateCudaCopyEngine(0, streams);
    ASSERT_FALSE(engine.ok());
    // Built without CUDA the factory says that first.
    if (engine.status().code() == absl::StatusCode::kUnimplemented) continue;
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument) << engine.status();
    EXPECT_THAT(engine.status().message(), ::testing::HasSubstr("accepted: 1 or 2"));
  }
}

}  // namespace
}  // namespace strata::tiering
