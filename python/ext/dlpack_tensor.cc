// python/ext/dlpack_tensor.cc: see dlpack_tensor.h.
#include "python/ext/dlpack_tensor.h"

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "dlpack/dlpack.h"

namespace strata::python {
namespace py = pybind11;
namespace {

constexpr const char* kCapsuleName = "dltensor";

absl::StatusOr<optim_cpu::DType> DTypeOf(const DLDataType& t, const std::string& what) {
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 32) return optim_cpu::DType::kF32;
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 16) return optim_cpu::DType::kF16;
  if (t.lanes == 1 && t.code == kDLBfloat && t.bits == 16) return optim_cpu::DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": element type (DLPack code ", static_cast<int>(t.code), ", ",
                   static_cast<int>(t.bits), " bits, ", t.lanes,
                   " lanes) is not accepted; accepted: float32, bfloat16, float16"));
}

DLDataType DLTypeOf(optim_cpu::DType t) {
  switch (t) {
    case optim_cpu::DType::kF32:
      return {kDLFloat, 32, 1};
    case optim_cpu::DType::kBF16:
      return {kDLBfloat, 16, 1};
    case optim_cpu::DType::kF16:
      return {kDLFloat, 16, 1};
  }
  return {kDLFloat, 32, 1};
}

// What LendTensor hands out: the managed tensor and the shape it points to, freed together.
struct Lent {
  DLManagedTensor managed{};
  int64_t shape[1] = {0};
  std::function<void()> on_free;
};

void DeleteLent(DLManagedTensor* m) {
  auto* lent = static_cast<Lent*>(m->manager_ctx);
  if (lent->on_free) lent->on_free();
  delete lent;
}

}  // namespace

absl::StatusOr<TensorView> BorrowTensor(py::handle object, const std::string& what) {
  py::object capsule;
  if (py::hasattr(object, "__dlpack__")) {
    capsule = object.attr("__dlpack__")();
  } else {
    capsule = py::reinterpret_borrow<py::object>(object);
  }
  if (!PyCapsule_IsValid(capsule.ptr(), kCapsuleName)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": a ", std::string(py::str(py::type::of(object).attr("__name__"))),
        " is not accepted; accepted: a tensor that speaks DLPack (a torch.Tensor, a numpy array) "
        "or an unused \"dltensor\" capsule"));
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
  const DLTensor& t = managed->dl_tensor;
  TensorView view;
  if (t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost) {
    view.device = DeviceKind::kCpu;
  } else if (t.device.device_type == kDLCUDA) {
    view.device = DeviceKind::kCuda;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": DLPack device type ", static_cast<int>(t.device.device_type),
                     " is not accepted; accepted: CPU, CUDA host, CUDA"));
  }
  view.device_id = t.device.device_id;
  auto dtype = DTypeOf(t.dtype, what);
  if (!dtype.ok()) return dtype.status();
  view.dtype = *dtype;
  size_t elements = 1;
  int64_t expected_stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    // A dimension of extent 1 may carry any stride; otherwise the layout must be row-major compact.
    if (t.strides != nullptr && t.shape[d] != 1 && t.strides[d] != expected_stride) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the tensor is not contiguous (dimension ", d, " has stride ", t.strides[d],
          ", expected ", expected_stride, "); accepted: contiguous tensors (call .contiguous())"));
    }
    expected_stride *= t.shape[d];
    elements *= static_cast<size_t>(t.shape[d]);
  }
  view.elements = elements;
  view.data = static_cast<char*>(t.data) + t.byte_offset;
  view.keep = std::move(capsule);
  return view;
}

py::capsule LendTensor(void* data, optim_cpu::DType dtype, size_t elements, DeviceKind device,
                       int device_id, std::function<void()> on_free) {
  auto lent = std::make_unique<Lent>();
  lent->on_free = std::move(on_free);
  lent->shape[0] = static_cast<int64_t>(elements);
  DLTensor& t = lent->managed.dl_tensor;
  t.data = data;
  t.device = {device == DeviceKind::kCuda ? kDLCUDA : kDLCPU, device_id};
  t.ndim = 1;
  t.dtype = DLTypeOf(dtype);
  t.shape = lent->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  lent->managed.manager_ctx = lent.get();
  lent->managed.deleter = DeleteLent;
  DLManagedTensor* managed = &lent.release()->managed;
  // A consumer (torch) renames the capsule and calls the deleter itself; an unconsumed capsule
  // frees what it holds when it is collected.
  return py::capsule(managed, kCapsuleName, [](PyObject* capsule) {
    if (PyCapsule_IsValid(capsule, kCapsuleName)) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
      m->deleter(m);
    }
  });
}

}  // namespace strata::python
