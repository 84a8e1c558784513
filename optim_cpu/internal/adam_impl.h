// The optimizer kernels written once over an "Ops" type that each ISA's translation unit
// provides:
//   using V = <vector of float>; static constexpr size_t N = lanes;
//   Set(float), Add, Mul, Div, Sqrt, Fma(a, b, c) = a * b + c (fused), Sign (-1, 0, +1),
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

// One vector of elements starting at i, for rule R. The formulas are the headers'.
template <class O, Rule R, DType G, DType S, int C>
inline void UpdateVector(const UpdateArgs& a, float* p, const void* g, void* s1, void* s2,
                         void* out, size_t i) {
  using V = typename O::V;
  V gv = O::Mul(Load<O, G>(g, i), O::Set(a.grad_scale));
  V pv = O::LoadF32(p + i);
  if (a.l2 != 0.0f) gv = O::Fma(O::Set(a.l2), pv, gv);
  if (a.decoupled) pv = O::Mul(pv, O::Set(a.decay));
  if constexpr (R == Rule::kAdam) {
    V mv = Load<O, S>(s1, i);
    V vv = Load<O, S>(s2, i);
    mv = O::Fma(O::Set(a.beta1), mv, O::Mul(O::Set(a.one_minus_beta1), gv));
    vv = O::Fma(O::Set(a.beta2), vv, O::Mul(O::Mul(O::Set(a.one_minus_beta2), gv), gv));
    const V denom = O::Add(O::Div(O::Sqrt(vv), O::Set(a.bc2_sqrt)), O::Set(a.eps));
    pv = O::Fma(O::Set(-a.step_size), O::Div(mv, denom), pv);
    Store<O, S>(s1, i, mv);
    Store<O, S>(s2, i, vv);
  } else if constexpr (R == Rule::kAdagrad) {
    V sv = Load<O, S>(s1, i);
    sv = O::Fma(gv, gv, sv);
    const V std_dev = O::Add(O::Sqrt(sv), O::Set(a.eps));
    pv = O::Fma(O::Set(-a.step_size), O::Div(gv, std_dev), pv);
    Store<O, S>(s1, i, sv);
  } else {  // Lion
    V mv = Load<O, S>(s1, i);
    const V c = O::Fma(O::Set(a.beta1), mv, O::Mul(O::Set(a.one_minus_beta1), gv));
    pv = O::Fma(O::Set(-a.step_size), O::Sign(c), pv);
    mv = O::Fma(O::Set(a.beta2), mv, O::Mul(O::Set(a.one_minus_beta2), gv));
    Store<O, S>(s1, i, mv);
  }
  O::StoreF32(p + i, pv);
  if constexpr (C != kNoCopy) Store<O, static_cast<DType>(C)>(out, i, pv);
}

template <class O, Rule R, DType G, DType S, int C>
void UpdateRange(const UpdateArgs& a, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + O::N <= end; i += O::N) {
    UpdateVector<O, R, G, S, C>(a, a.param, a.grad, a.state1, a.state2, a.param_copy, i);
  }
  if (i == end) return;
  // The tail goes through the same vector code on zero-padded copies.
  const size_t r = end - i;
  alignas(64) float p[O::N] = {};
  alignas(64) unsigned char g[O::N * 4] = {}, s1[O::N * 4] = {}, s2[O::N * 4] = {},
                                     out[O::N * 4] = {};
  const size_t gb = DTypeBytes(G), sb = DTypeBytes(S);
  auto at = [](const void* base, size_t index, size_t bytes) {
    return static_cast<const unsigned char*>(base) + index * bytes;
  };
  auto at_mut = [](void* base, size_t index, size_t bytes) {
    return static_cast<unsigned char*>(base) + index * bytes;
  };
  std::memcpy(p, a.param + i, r * 4);
  std::memcpy(g, at(a.grad, i, gb), r * gb);
  std::memcpy(s1, at(a.state1, i, sb), r * sb);
  if constexpr (R == Rule::kAdam) std::memcpy(s2, at(a.state2, i, sb), r * sb);
  UpdateVector<O, R, G, S, C>(a, p, g, s1, s2, out, 0);
  std::memcpy(a.param + i, p, r * 4);
  std::memcpy(at_mut(a.state1, i, sb), s1, r * sb);
  if constexpr (R == Rule::kAdam) std::memcpy(at_mut(a.state2, i, sb), s2, r * sb);
  if constexpr (C != kNoCopy) {
    const size_t cb = DTypeBytes(static_cast<DType>(C));
    std::memcpy(at_mut(a.param_copy, i, cb), out, r * cb);
  }
}

template <class O, Rule R, DType G, DType S>
void UpdateRangeCopy(const UpdateArgs& a, size_t begin, size_t end) {
  if (a.param_copy == nullptr) return UpdateRange<O, R, G, S, kNoCopy>(a, begin, end);
  if (a.copy_dtype == DType::kBF16) {
    return UpdateRange<O, R, G, S, static_cast<int>(DType::kBF16)>(a, begin, end);
  }
  if (a.copy_dtype == DType::kF32) {
    return UpdateRange<O, R, G, S, static_cast<int>(DType::kF32)>(a, begin, end);
  }
  return UpdateRange<O, R, G, S, static_cast<int>(DType::kF16)>(a, begin, end);
}

template <class O, Rule R, DType G>
void UpdateRangeState(const UpdateArgs& a, size_t begin, size_t end) {
  if (a.state_dtype == DType::kBF16) return UpdateRangeCopy<O, R, G, DType::kBF16>(a, begin, end);
  return UpdateRangeCopy<O, R, G, DType::kF32>(a, begin, end);
}

template <class O, Rule R>
void UpdateRangeGrad(const UpdateArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case DType::kF32:
      return UpdateRangeState<O, R, DType::kF32>(a, begin, end);
    case DType::kBF16:
      return UpdateRangeState<O, R, DType::kBF16>(a, begin, end);
    case DType::kF16:
      return UpdateRangeState<O, R, DType::kF16>(a, begin, end);
  }
}

template <class O>
void UpdateKernelFor(const UpdateArgs& a, size_t begin, size_t end) {
  switch (a.rule) {
    case Rule::kAdam:
      return UpdateRangeGrad<O, Rule::kAdam>(a, begin, end);
    case Rule::kAdagrad:
      return UpdateRangeGrad<O, Rule::kAdagrad>(a, begin, end);
    case Rule::kLion:
      return UpdateRangeGrad<O, Rule::kLion>(a, begin, end);
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
