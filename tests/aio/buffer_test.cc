#include "aio/buffer.h"

#include <cstdint>
#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::aio {
namespace {

TEST(AlignedBufferTest, IsPageAlignedZeroedAndMovable) {
  auto b = AlignedBuffer::Allocate(10000);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 4096, 0u);
  EXPECT_EQ(b->size(), 10000u);
  EXPECT_EQ(b->mapped_size(), 12288u);
  for (size_t i = 0; i < b->size(); ++i) ASSERT_EQ(b->data()[i], std::byte{0});
  std::memset(b->data(), 0xab, b->size());
  AlignedBuffer moved = *std::move(b);
  EXPECT_EQ(moved.data()[9999], std::byte{0xab});
}

TEST(AlignedBufferTest, HugePagesAreTwoMegabyteAligned) {
  auto b = AlignedBuffer::Allocate(3 << 20, {.huge_pages = true});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % (2 << 20), 0u);
  EXPECT_EQ(b->mapped_size(), 4u << 20);
  b->data()[(3 << 20) - 1] = std::byte{1};
}

TEST(AlignedBufferTest, ZeroSizeIsInvalid) {
  EXPECT_EQ(AlignedBuffer::Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AlignedBufferTest, PinForCudaNeedsCudaAndADevice) {
  auto b = AlignedBuffer::Allocate(1 << 20);
  ASSERT_TRUE(b.ok());
  absl::Status s = b->PinForCuda();
  if (s.code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << s.message();
  if (!s.ok()) GTEST_SKIP() << "no usable CUDA device: " << s.message();
  EXPECT_TRUE(b->cuda_pinned());
}

}  // namespace
}  // namespace strata::aio
