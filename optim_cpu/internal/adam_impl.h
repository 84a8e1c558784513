// The Adam kernel written once over an "Ops" type that each ISA's translation unit provides:
//   using V = <vector of float>; static constexpr size_t N = lanes;
//   Set(float), Add, Mul, Div, Sqrt, Fma(a, b, c) = a * b + c (fused),
//   LoadF32/StoreF32, LoadBF16/StoreBF16, LoadF16/StoreF16 (uint16_t storage).
// Include only from a kernels_<isa>.cc. Everything here is in an anonymous namespace: each ISA's
// translation unit is compiled with its own flags and must get its own copies (shared inline
// functions would be merged by the linker, and a scalar caller could end up in AVX-512 code).
#ifndef STRATA_OPTIM_CPU_INTERNAL_ADAM_IMPL_H_
#define STRATA_OPTIM_CPU_INTERNAL_ADAM_IMPL_H_

#include <cstdint>
#include <cstring>

#include "optim_cpu/internal/kernels.h"

namespace strata::optim_cpu::internal {
namespace {

constexpr int kNoCopy = -1;

inline size_t DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

template <class O, DType T>
inline typename O::V Load(const void* base, size_t i) {
  if constexpr (T == DType::kF32) {
    return O::LoadF32(static_cast<const float*>(base) + i);
  } else if constexpr (T == DType::kBF16) {
    return O::LoadBF16(static_cast<const uint16_t*>(base) + i);
  } else {
    return O::LoadF16(static_cast<const uint16_t*>(base) + i);
  }
}

template <class O, DType T>
inline void Store(void* base, size_t i, typename O::V v) {
  if constexpr (T == DType::kF32) {
    O::StoreF32(static_cast<float*>(base) + i, v);
  } else if constexpr (T == DType::kBF16) {
    O::StoreBF16(static_cast<uint16_t*>(base) + i, v);
  } else {
    O::StoreF16(static_cast<uint16_t*>(base) + i, v);
  }
}

// One vector of elements starting at i. The formula is the one in optim_cpu/adam.h.
template <class O, DType G, DType M, int C>
inline void AdamVector(const AdamArgs& a, float* p, const void* g, void* m, void* v, void* out,
                       size_t i) {
  using V = typename O::V;
  V gv = O::Mul(Load<O, G>(g, i), O::Set(a.grad_scale));
  V pv = O::LoadF32(p + i);
  if (a.l2 != 0.0f) gv = O::Fma(O::Set(a.l2), pv, gv);
  if (a.adamw) pv = O::Mul(pv, O::Set(a.decay));
  V mv = Load<O, M>(m, i);
  V vv = Load<O, M>(v, i);
  mv = O::Fma(O::Set(a.beta1), mv, O::Mul(O::Set(a.one_minus_beta1), gv));
  vv = O::Fma(O::Set(a.beta2), vv, O::Mul(O::Mul(O::Set(a.one_minus_beta2), gv), gv));
  const V denom = O::Add(O::Div(O::Sqrt(vv), O::Set(a.bc2_sqrt)), O::Set(a.eps));
  pv = O::Fma(O::Set(-a.step_size), O::Div(mv, denom), pv);
  O::StoreF32(p + i, pv);
  Store<O, M>(m, i, mv);
  Store<O, M>(v, i, vv);
  if constexpr (C != kNoCopy) Store<O, static_cast<DType>(C)>(out, i, pv);
}

template <class O, DType G, DType M, int C>
void AdamRange(const AdamArgs& a, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + O::N <= end; i += O::N) {
    AdamVector<O, G, M, C>(a, a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.param_copy, i);
  }
  if (i == end) return;
  // The tail goes through the same vector code on zero-padded copies.
  const size_t r = end - i;
  alignas(64) float p[O::N] = {};
  alignas(64) unsigned char g[O::N * 4] = {}, m[O::N * 4] = {}, v[O::N * 4] = {},
                                     out[O::N * 4] = {};
  const size_t gb = DTypeBytes(G), mb = DTypeBytes(M);
  std::memcpy(p, a.param + i, r * 4);
  std::memcpy(g, static_cast<const unsigned char*>(a.grad) + i * gb, r * gb);
  std::memcpy(m, static_cast<unsigned char*>(a.exp_avg) + i * mb, r * mb);
  std::memcpy(v, static_cast<unsigned char*>(a.exp_avg_sq) + i * mb, r * mb);
  AdamVector<O, G, M, C>(a, p, g, m, v, out, 0);
  std::memcpy(a.param + i, p, r * 4);
  std::memcpy(static_cast<unsigned char*>(a.exp_avg) + i * mb, m, r * mb);
  std::memcpy(static_cast<unsigned char*>(a.exp_avg_sq) + i * mb, v, r * mb);
  if constexpr (C != kNoCopy) {
    const size_t cb = DTypeBytes(static_cast<DType>(C));
    std::memcpy(static_cast<unsigned char*>(a.param_copy) + i * cb, out, r * cb);
  }
}

template <class O, DType G, DType M>
void AdamRangeCopy(const AdamArgs& a, size_t begin, size_t end) {
  if (a.param_copy == nullptr) return AdamRange<O, G, M, kNoCopy>(a, begin, end);
  if (a.copy_dtype == DType::kBF16) {
    return AdamRange<O, G, M, static_cast<int>(DType::kBF16)>(a, begin, end);
  }
  return AdamRange<O, G, M, static_cast<int>(DType::kF16)>(a, begin, end);
}

template <class O, DType G>
void AdamRangeMoments(const AdamArgs& a, size_t begin, size_t end) {
  if (a.moment_dtype == DType::kBF16) return AdamRangeCopy<O, G, DType::kBF16>(a, begin, end);
  return AdamRangeCopy<O, G, DType::kF32>(a, begin, end);
}

template <class O>
void AdamKernelFor(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case DType::kF32:
      return AdamRangeMoments<O, DType::kF32>(a, begin, end);
    case DType::kBF16:
      return AdamRangeMoments<O, DType::kBF16>(a, begin, end);
    case DType::kF16:
      return AdamRangeMoments<O, DType::kF16>(a, begin, end);
  }
}

// Inf/nan: all exponent bits set. Plain loops over blocks, which the ISA's flags vectorize.
template <typename U, U kExponent>
bool AnyNonFinite(const U* x, size_t begin, size_t end) {
  constexpr size_t kBlock = 1024;
  for (size_t b = begin; b < end; b += kBlock) {
    const size_t e = b + kBlock < end ? b + kBlock : end;
    U bad = 0;
    for (size_t i = b; i < e; ++i) bad |= static_cast<U>((x[i] & kExponent) == kExponent);
    if (bad) return true;
  }
  return false;
}

inline bool NonFinite(const void* grad, DType dtype, size_t begin, size_t end) {
  switch (dtype) {
    case DType::kF32:
      return AnyNonFinite<uint32_t, 0x7f800000u>(static_cast<const uint32_t*>(grad), begin, end);
    case DType::kBF16:
      return AnyNonFinite<uint16_t, 0x7f80>(static_cast<const uint16_t*>(grad), begin, end);
    case DType::kF16:
      return AnyNonFinite<uint16_t, 0x7c00>(static_cast<const uint16_t*>(grad), begin, end);
  }
  return false;
}

// Round-to-nearest-even fp32 -> bf16 on the bits (a nan becomes the quiet nan 0x7fc0).
inline uint16_t Bf16FromBits(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace
}  // namespace strata::optim_cpu::internal

#endif  // STRATA_OPTIM_CPU_INTERNAL_ADAM_IMPL_H_
