// python/ext/dlpack_tensor.h: tensors crossing between Python and strata without a copy, as DLPack
// (dlpack/dlpack.h, Debian's libdlpack-dev), so the extension never links libtorch.
//
// In: BorrowTensor reads any object that speaks DLPack (a torch tensor or a numpy array through
// `__dlpack__`, or a "dltensor" capsule) as a TensorView: its address, element type, element
// count and device. The capsule is not consumed: the caller's object keeps the memory alive, and
// the view is valid while the caller holds that object (for the length of one call).
// Out: LendTensor wraps memory that strata owns (a partition acquired from the Runtime) as a
// "dltensor" capsule that torch.utils.dlpack.from_dlpack turns into a tensor over the same bytes.
// The capsule does not own the bytes: the tensor made from it must not be used after the partition
// is released (the trainer front drops its views before it releases).
//
// Thread safety: call with the GIL held.
#ifndef STRATA_PYTHON_EXT_DLPACK_TENSOR_H_
#define STRATA_PYTHON_EXT_DLPACK_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "optim_cpu/common.h"
#include "pybind11/pybind11.h"

namespace strata::python {

enum class DeviceKind { kCpu, kCuda };

struct TensorView {
  void* data = nullptr;
  optim_cpu::DType dtype = optim_cpu::DType::kF32;
  size_t elements = 0;
  DeviceKind device = DeviceKind::kCpu;  // kDLCPU and kDLCUDAHost are both kCpu
  int device_id = 0;
  pybind11::object keep;  // the capsule read, held for the view's life
};

// `what` names the argument in errors (InvalidArgument: not DLPack, not contiguous, an element type
// other than float32, bfloat16 or float16, a device other than CPU or CUDA).
absl::StatusOr<TensorView> BorrowTensor(pybind11::handle object, const std::string& what);

// A 1-D tensor of `elements` of `dtype` at `data` on the given device. `on_free` (when set) runs
// once the consumer frees the tensor (or the capsule is collected unconsumed), on whichever thread
// frees it, without the GIL necessarily held: it must not touch Python.
pybind11::capsule LendTensor(void* data, optim_cpu::DType dtype, size_t elements, DeviceKind device,
                             int device_id, std::function<void()> on_free = nullptr);

}  // namespace strata::python

#endif  // STRATA_PYTHON_EXT_DLPACK_TENSOR_H_
