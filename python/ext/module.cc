// python/ext/module.cc: strata._strata, the extension under the `strata` Python package (pybind11).
//
// It exposes strata's C++ API to the package's Python code; tensors cross as DLPack
// (dlpack_tensor.h), never copied, and the extension does not link libtorch. What is here:
//   Adam        optim_cpu::CpuAdam stepping tensors in place (strata.optim's optimizers)
// A failing call raises strata._strata.Error (a RuntimeError) with the Status's message and the
// attributes `code` (the canonical code's name, e.g. "RESOURCE_EXHAUSTED") and `errno` (0 when the
// status carries none); an InvalidArgument raises InvalidArgumentError, which is also a ValueError.
// The long calls (an optimizer step) release the GIL.
//
// Thread safety: an Adam is used by one thread at a time (its calls hold the GIL except while the
// step runs, and the step serializes on the optimizer's pool).
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "optim_cpu/adam.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/ext/dlpack_tensor.h"

namespace strata::python {
namespace py = pybind11;
namespace {

PyObject* g_error = nullptr;
PyObject* g_invalid_argument = nullptr;

// Raises the Status as the module's exception (see the file's comment). Never returns.
[[noreturn]] void Raise(const absl::Status& s) {
  PyObject* type = s.code() == absl::StatusCode::kInvalidArgument ? g_invalid_argument : g_error;
  py::object error = py::reinterpret_borrow<py::object>(type)(std::string(s.message()));
  error.attr("code") = absl::StatusCodeToString(s.code());
  error.attr("errno") = StatusErrno(s);
  PyErr_SetObject(type, error.ptr());
  throw py::error_already_set();
}

template <typename T>
T Take(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

TensorView HostTensor(py::handle object, const std::string& what) {
  TensorView v = Take(BorrowTensor(object, what));
  if (v.device != DeviceKind::kCpu) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what, ": a CUDA tensor is not accepted; accepted: CPU tensors (the CPU "
                           "optimizer steps host memory)")));
  }
  return v;
}

// optim_cpu::CpuAdam over tensors.
class Adam {
 public:
  Adam(float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw,
       bool bias_correction, int threads, const std::string& isa) {
    optim_cpu::AdamConfig c;
    c.lr = lr;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.eps = eps;
    c.weight_decay = weight_decay;
    c.adamw = adamw;
    c.bias_correction = bias_correction;
    c.threads = threads;
    c.isa = isa;
    adam_ = Take(optim_cpu::CpuAdam::Create(c));
  }

  // One step t of one tensor, in place; returns true when the gradient held an inf or nan and
  // check_overflow asked for the scan (then nothing was changed).
  bool Step(int64_t t, py::handle param, py::handle grad, py::handle exp_avg,
            py::handle exp_avg_sq, float lr, float grad_scale, bool check_overflow,
            py::handle param_copy) {
    const TensorView p = HostTensor(param, "param");
    const TensorView g = HostTensor(grad, "grad");
    const TensorView m = HostTensor(exp_avg, "exp_avg");
    const TensorView v = HostTensor(exp_avg_sq, "exp_avg_sq");
    if (p.dtype != optim_cpu::DType::kF32) {
      Raise(absl::InvalidArgumentError(
          "param: its element type is not accepted; accepted: float32 (the master weights)"));
    }
    if (m.dtype != v.dtype) {
      Raise(absl::InvalidArgumentError(
          "exp_avg and exp_avg_sq: their element types differ; accepted: both float32 or both "
          "bfloat16"));
    }
    for (const auto& [view, what] : {std::pair{&g, "grad"}, std::pair{&m, "exp_avg"},
                                     std::pair{&v, "exp_avg_sq"}}) {
      if (view->elements != p.elements) {
        Raise(absl::InvalidArgumentError(absl::StrCat(what, ": ", view->elements,
                                                      " elements for a param of ", p.elements,
                                                      "; accepted: as many as the param")));
      }
    }
    optim_cpu::AdamChunk chunk;
    chunk.param = static_cast<float*>(p.data);
    chunk.grad = g.data;
    chunk.grad_dtype = g.dtype;
    chunk.exp_avg = m.data;
    chunk.exp_avg_sq = v.data;
    chunk.moment_dtype = m.dtype;
    chunk.size = p.elements;
    TensorView copy;
    if (!param_copy.is_none()) {
      copy = HostTensor(param_copy, "param_copy");
      if (copy.elements != p.elements) {
        Raise(absl::InvalidArgumentError(
            absl::StrCat("param_copy: ", copy.elements, " elements for a param of ", p.elements,
                         "; accepted: as many as the param")));
      }
      chunk.param_copy = copy.data;
      chunk.copy_dtype = copy.dtype;
    }
    optim_cpu::StepOptions options;
    options.lr = lr;
    options.grad_scale = grad_scale;
    options.check_overflow = check_overflow;
    absl::StatusOr<optim_cpu::StepResult> r;
    {
      py::gil_scoped_release unlocked;
      r = adam_->Step(t, chunk, options);
    }
    return Take(std::move(r)).overflow;
  }

  bool HasNonFinite(py::handle grad) {
    const TensorView g = HostTensor(grad, "grad");
    py::gil_scoped_release unlocked;
    return adam_->HasNonFinite(g.data, g.dtype, g.elements);
  }

  std::string Isa() const { return std::string(optim_cpu::IsaName(adam_->isa())); }

 private:
  std::unique_ptr<optim_cpu::CpuAdam> adam_;
};

}  // namespace
}  // namespace strata::python

PYBIND11_MODULE(_strata, m) {
  namespace py = pybind11;
  using namespace strata::python;  // NOLINT: the module's own classes
  m.doc() = "strata's C++ runtime for the strata package (tensors cross as DLPack)";
  g_error = PyErr_NewException("strata._strata.Error", PyExc_RuntimeError, nullptr);
  py::tuple bases = py::make_tuple(py::handle(g_error), py::handle(PyExc_ValueError));
  g_invalid_argument =
      PyErr_NewException("strata._strata.InvalidArgumentError", bases.ptr(), nullptr);
  m.attr("Error") = py::handle(g_error);
  m.attr("InvalidArgumentError") = py::handle(g_invalid_argument);

  py::class_<Adam>(m, "Adam", "optim_cpu::CpuAdam: Adam/AdamW in place on CPU tensors")
      .def(py::init<float, float, float, float, float, bool, bool, int, const std::string&>(),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
           py::arg("threads") = 0, py::arg("isa") = "")
      .def("step", &Adam::Step, py::arg("t"), py::arg("param"), py::arg("grad"),
           py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr") = -1.0f,
           py::arg("grad_scale") = 1.0f, py::arg("check_overflow") = false,
           py::arg("param_copy") = py::none())
      .def("has_non_finite", &Adam::HasNonFinite, py::arg("grad"))
      .def_property_readonly("isa", &Adam::Isa);
}
