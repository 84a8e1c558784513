// Scalar kernels: the reference path and the fallback for CPUs without AVX2.
#include <cmath>

#include "optim_cpu/internal/adam_impl.h"

namespace strata::optim_cpu::internal {
namespace {

struct ScalarOps {
  using V = float;
  static constexpr size_t N = 1;
  static V Set(float x) { return x; }
  static V Add(V a, V b) { return a + b; }
  static V Mul(V a, V b) { return a * b; }
  static V Div(V a, V b) { return a / b; }
  static V Sqrt(V a) { return std::sqrt(a); }
  static V Fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V Sign(V a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : 0.0f); }
  static V LoadF32(const float* p) { return *p; }
  static void StoreF32(float* p, V v) { *p = v; }
  static V LoadBF16(const uint16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static void StoreBF16(uint16_t* p, V v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    *p = Bf16FromBits(bits);
  }
  static V LoadF16(const uint16_t* p) {
    _Float16 h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(h);
  }
  static void StoreF16(uint16_t* p, V v) {
    const _Float16 h = static_cast<_Float16>(v);
    std::memcpy(p, &h, 2);
  }
};

}  // namespace

Kernels ScalarKernels() { return {&UpdateKernelFor<ScalarOps>, &NonFinite}; }

}  // namespace strata::optim_cpu::internal
