// The AVX-512 kernels again, with AVX512-BF16's VCVTNEPS2BF16 for the bf16 stores (flags and
// STRATA_NATIVE_BF16=1 set in CMakeLists.txt).
#include "optim_cpu/kernels_avx512.cc"  // NOLINT: one source, two instruction sets
