// AVX-512 kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c, and for
// the bf16 variant also -mavx512bf16 with STRATA_NATIVE_BF16=1; run only where cpuid says so).
#include <immintrin.h>

#include "optim_cpu/internal/adam_impl.h"

namespace strata::optim_cpu::internal {
namespace {

struct Avx512Ops {
  using V = __m512;
  static constexpr size_t N = 16;
  static V Set(float x) { return _mm512_set1_ps(x); }
  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Div(V a, V b) { return _mm512_div_ps(a, b); }
  static V Sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Sign(V a) {
    const V zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    return _mm512_sub_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), one),
                         _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), one));
  }
  static V LoadF32(const float* p) { return _mm512_loadu_ps(p); }
  static void StoreF32(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V LoadBF16(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void StoreBF16(uint16_t* p, V v) {
#if STRATA_NATIVE_BF16
    // VCVTNEPS2BF16: round to nearest even.
    const __m256bh h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(h));
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
  }
  static V LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void StoreF16(uint16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

#if STRATA_NATIVE_BF16
Kernels Avx512Bf16Kernels() { return {&UpdateKernelFor<Avx512Ops>, &NonFinite}; }
#else
Kernels Avx512Kernels() { return {&UpdateKernelFor<Avx512Ops>, &NonFinite}; }
#endif

}  // namespace strata::optim_cpu::internal
