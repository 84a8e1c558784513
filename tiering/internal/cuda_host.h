// cudaHostRegister / cudaHostUnregister of host memory, implemented in tiering/cuda.cc (the only
// file of this module that sees STRATA_HAVE_CUDA). Without CUDA or a device: an error status.
#ifndef STRATA_TIERING_INTERNAL_CUDA_HOST_H_
#define STRATA_TIERING_INTERNAL_CUDA_HOST_H_

#include <cstddef>

#include "absl/status/status.h"

namespace strata::tiering::internal {

absl::Status CudaHostRegister(void* p, size_t bytes);
void CudaHostUnregister(void* p);

}  // namespace strata::tiering::internal

#endif  // STRATA_TIERING_INTERNAL_CUDA_HOST_H_
