#include "aio/internal/stream_copy.h"

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace strata::aio::internal {
namespace {

// Every length around the thresholds and the 16-byte store width, from and to every alignment:
// the bytes arrive whole, and nothing before or after the destination is touched.
TEST(StreamCopyTest, CopiesAnyLengthBetweenAnyAlignments) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{63}, size_t{4095}, size_t{4096},
                   size_t{4097}, size_t{4096 + 63}, size_t{65536 + 17}, size_t{1} << 20}) {
    for (size_t src_shift : {0, 1, 7, 16, 63}) {
      for (size_t dst_shift : {0, 3, 8, 15, 64}) {
        std::vector<std::byte> src(n + 64), dst(n + 128, std::byte{0xEE});
        for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 131 + 7);
        StreamCopy(dst.data() + dst_shift, src.data() + src_shift, n);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= dst_shift && i < dst_shift + n;
          const std::byte want = inside ? src[i - dst_shift + src_shift] : std::byte{0xEE};
          ASSERT_EQ(dst[i], want) << "n " << n << " src+" << src_shift << " dst+" << dst_shift
                                  << " byte " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::aio::internal
