// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; run only where cpuid says so).
#include <immintrin.h>

#include "optim_cpu/internal/adam_impl.h"

namespace strata::optim_cpu::internal {
namespace {

struct Avx2Ops {
  using V = __m256;
  static constexpr size_t N = 8;
  static V Set(float x) { return _mm256_set1_ps(x); }
  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Div(V a, V b) { return _mm256_div_ps(a, b); }
  static V Sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Sign(V a) {
    const V zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    return _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), one),
                         _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), one));
  }
  static V LoadF32(const float* p) { return _mm256_loadu_ps(p); }
  static void StoreF32(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V LoadBF16(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void StoreBF16(uint16_t* p, V v) {
    // Round to nearest even on the bits, as Bf16FromBits; nan -> 0x7fc0.
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    rounded = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
    const __m256i hi = _mm256_srli_epi32(rounded, 16);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static V LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreF16(uint16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

Kernels Avx2Kernels() { return {&UpdateKernelFor<Avx2Ops>, &NonFinite}; }

}  // namespace strata::optim_cpu::internal
