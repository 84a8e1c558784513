// The Runtime on a real CUDA device with the trainer's own stream, or CUDA's legacy default stream
// (torch's default, whose handle is 0: passed as kLegacyDefaultStream): a device copy released
// with the stream whose queued work writes it is not written back before that work has run (the
// trainer never synchronizes the device). Skips, saying why, where there is no CUDA device.
#include <cuda_runtime_api.h>

#include <vector>

#include "gtest/gtest.h"
#include "sched/runtime.h"
#include "tests/aio/test_util.h"

namespace strata::sched {
namespace {

using ::strata::testing::ScratchDir;

class RuntimeCudaTest : public ::testing::TestWithParam<bool> {};  // the legacy default stream

TEST_P(RuntimeCudaTest, ADeviceCopyReleasedOnAStreamIsWrittenBackOnlyAfterTheStreamsWork) {
  const bool legacy = GetParam();
  constexpr uint64_t kBytes = 64 << 20;
  ScratchDir dir;
  RuntimeConfig config;
  config.emulated_device = false;
  config.device_budget_bytes = 4 * kBytes;
  config.host_budget_bytes = 4 * kBytes;
  config.nvme_path = dir.File("swap");
  config.nvme_capacity_bytes = 8 * kBytes;
  config.offload_param.buffer_size = 1 << 20;  // staging buffers within the host budget
  RuntimeOptions o;
  o.on_warning = [](absl::string_view) {};
  o.device_index = 0;
  auto rt = Runtime::Create(config, o);
  if (!rt.ok() && (rt.status().code() == absl::StatusCode::kFailedPrecondition ||
                   rt.status().code() == absl::StatusCode::kUnimplemented)) {
    GTEST_SKIP() << "no CUDA device here: " << rt.status();
  }
  ASSERT_TRUE(rt.ok()) << rt.status();
  tiering::PartitionDesc d;
  d.id = 1;
  d.bytes = kBytes;
  d.elements = kBytes / 4;
  ASSERT_TRUE((*rt)->Register(d, Tier::kDevice).ok());
  cudaStream_t stream = 0;  // the legacy default stream
  if (!legacy) ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto p = (*rt)->Acquire(1, Tier::kDevice);
  ASSERT_TRUE(p.ok()) << p.status();
  // Tens of milliseconds of queued work on the trainer's stream; the last write is 0x5a.
  for (int i = 0; i < 400; ++i)
    ASSERT_EQ(cudaMemsetAsync(*p, i & 0xff, kBytes, stream), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(*p, 0x5a, kBytes, stream), cudaSuccess);
  ASSERT_TRUE((*rt)
                  ->Release(1, Tier::kDevice, /*dirty=*/true,
                            legacy ? tiering::kLegacyDefaultStream : stream)
                  .ok());
  ASSERT_TRUE((*rt)->Evict(1, Tier::kDevice).ok());  // written back to the host first
  auto host = (*rt)->Acquire(1, Tier::kHost);
  ASSERT_TRUE(host.ok()) << host.status();
  const auto* bytes = reinterpret_cast<const unsigned char*>(*host);
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < kBytes; ++i) wrong += bytes[i] != 0x5a;
  EXPECT_EQ(wrong, 0u) << "the write-back read the copy before the stream's work had run";
  ASSERT_TRUE((*rt)->Release(1, Tier::kHost, false).ok());
  if (!legacy) cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(Streams, RuntimeCudaTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "legacy" : "own"; });

}  // namespace
}  // namespace strata::sched
