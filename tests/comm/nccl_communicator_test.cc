// The NCCL communicator on a GPU (world size 1, as one GPU allows), its results checked against
// Gloo's for the same inputs; without a device it is skipped, saying why.
#include "comm/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "comm/gloo_communicator.h"
#include "comm/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::comm {
namespace {

template <typename T>
T* Device(const std::vector<T>& host) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return p;
}

template <typename T>
std::vector<T> Host(const T* p, size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST(NcclCommunicatorTest, OnAGpuTheCollectivesGiveGloosResults) {
  auto server = TcpStoreServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(server.ok());
  auto store = TcpStore::Connect("127.0.0.1", (*server)->port(), Duration(5000));
  ASSERT_TRUE(store.ok());
  auto nccl = CreateNcclCommunicator(**store, {.rank = 0, .size = 1, .timeout = Duration(30000)});
  if (!nccl.ok() && nccl.status().code() == absl::StatusCode::kFailedPrecondition) {
    GTEST_SKIP() << nccl.status().message();
  }
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  auto gloo = CreateGlooCommunicator(**store, {.rank = 0, .size = 1});
  ASSERT_TRUE(gloo.ok()) << gloo.status();

  std::vector<float> values(4099);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 13) * 0.5f;
  // All-reduce.
  float* d = Device(values);
  ASSERT_TRUE((*nccl)->AllReduce({d, values.size()})->Wait().ok());
  std::vector<float> g = values;
  ASSERT_TRUE((*gloo)->AllReduce(absl::MakeSpan(g))->Wait().ok());
  EXPECT_EQ(Host(d, values.size()), g);
  // Reduce-scatter (one shard of the whole, at world size 1).
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), values.size() * sizeof(float)), cudaSuccess);
  ASSERT_TRUE((*nccl)->ReduceScatter({d, values.size()}, {out, values.size()})->Wait().ok());
  std::vector<float> g_out(values.size());
  ASSERT_TRUE((*gloo)->ReduceScatter(g, absl::MakeSpan(g_out))->Wait().ok());
  EXPECT_EQ(Host(out, values.size()), g_out);
  // All-gather and broadcast of bytes; a barrier.
  std::vector<std::byte> bytes(1001);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 3);
  std::byte* db = Device(bytes);
  std::byte* gathered = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&gathered), bytes.size()), cudaSuccess);
  ASSERT_TRUE((*nccl)->AllGather({db, bytes.size()}, {gathered, bytes.size()})->Wait().ok());
  std::vector<std::byte> g_gathered(bytes.size());
  ASSERT_TRUE((*gloo)->AllGather(bytes, absl::MakeSpan(g_gathered))->Wait().ok());
  EXPECT_EQ(Host(gathered, bytes.size()), g_gathered);
  ASSERT_TRUE((*nccl)->Broadcast({db, bytes.size()}, 0)->Wait().ok());
  EXPECT_EQ(Host(db, bytes.size()), bytes);
  EXPECT_TRUE((*nccl)->Barrier()->Wait().ok());
  // A bad shape is refused by name.
  auto bad = (*nccl)->ReduceScatter({d, 10}, {out, 3})->Wait();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  cudaFree(d);
  cudaFree(out);
  cudaFree(db);
  cudaFree(gathered);
}

}  // namespace
}  // namespace strata::comm
