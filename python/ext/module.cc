// python/ext/module.cc: strata._strata, the extension under the `strata` Python package (pybind11).
//
// It exposes strata's C++ API to the package's Python code; tensors cross as DLPack
// (dlpack_tensor.h), never copied, and the extension does not link libtorch. What is here:
//   Optimizer   Adam, Adagrad or Lion (optim_cpu/chunk_optimizer.h, made by Adam(), Adagrad(),
//               Lion()) stepping tensors in place: strata.optim's optimizers
//   check_runtime_config  a config read as a Runtime reads it, nothing made (strata.check_config)
//   minimum_host_budget   the smallest host budget a config and a model's sizes take
//   Runtime     sched::Runtime (sched/runtime.h: partitions, tiers, the scheduler, the optimizer
//               over host or NVMe state): what strata.initialize's engine drives. Tiers are
//               "device", "host", "nvme"; dtypes "float32", "bfloat16", "float16"; roles "param",
//               "grad", "other". Acquire lends the partition's memory as a DLPack capsule
//               (a 1-D tensor of its elements), valid until the matching release; Lend's is
//               released when its tensor is freed. On the CUDA tier a device copy's release
//               takes the stream its kernels were queued on (an integer cudaStream_t), so the
//               Runtime does not reuse or read the copy before that work has run.
// A failing call raises strata._strata.Error (a RuntimeError) with the Status's message and the
// attributes `code` (the canonical code's name, e.g. "RESOURCE_EXHAUSTED") and `errno` (0 when the
// status carries none); an InvalidArgument raises InvalidArgumentError, which is also a ValueError.
// The long calls (an optimizer step, a move between tiers) release the GIL.
//
// Thread safety: an Optimizer is used by one thread at a time (its calls hold the GIL except while
// the step runs, and the step serializes on the optimizer's pool). A Runtime is thread-safe, as
// sched::Runtime is; its warnings callback runs on whichever thread warns, taking the GIL.
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "aio/fault_injection.h"
#include "base/mutex.h"
#include "base/status.h"
#include "comm/job.h"
#include "nlohmann/json.hpp"
#include "optim_cpu/adam.h"
#include "optim_cpu/chunk_optimizer.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/ext/dlpack_tensor.h"
#include "sched/runtime.h"
#include "tiering/runtime_config.h"

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

void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

TensorView HostTensor(py::handle object, const std::string& what) {
  TensorView v = Take(BorrowTensor(object, what));
  if (v.device != DeviceKind::kCpu) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": a CUDA tensor is not accepted; accepted: CPU tensors (the CPU "
                     "optimizer steps host memory)")));
  }
  return v;
}

// Checks a step's tensors: `param` float32 (the master weights), every other as many elements.
void CheckStepTensors(const TensorView& p,
                      std::initializer_list<std::pair<const TensorView*, const char*>> others) {
  if (p.dtype != optim_cpu::DType::kF32) {
    Raise(absl::InvalidArgumentError(
        "param: its element type is not accepted; accepted: float32 (the master weights)"));
  }
  for (const auto& [view, what] : others) {
    if (view->elements != p.elements) {
      Raise(absl::InvalidArgumentError(absl::StrCat(what, ": ", view->elements,
                                                    " elements for a param of ", p.elements,
                                                    "; accepted: as many as the param")));
    }
  }
}

optim_cpu::StepOptions StepOptionsOf(float lr, float grad_scale, bool check_overflow,
                                     float weight_decay = -1, float beta1 = -1, float beta2 = -1) {
  optim_cpu::StepOptions options;
  options.lr = lr;
  options.weight_decay = weight_decay;
  options.beta1 = beta1;
  options.beta2 = beta2;
  options.grad_scale = grad_scale;
  options.check_overflow = check_overflow;
  return options;
}

// The hyper-parameters both Optimizer and Runtime::CreateOptimizer take from Python.
optim_cpu::AdamConfig AdamConfigOf(float lr, float beta1, float beta2, float eps,
                                   float weight_decay, bool adamw, bool bias_correction) {
  optim_cpu::AdamConfig c;
  c.lr = lr;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  c.adamw = adamw;
  c.bias_correction = bias_correction;
  return c;
}

// A CPU optimizer (optim_cpu/chunk_optimizer.h: Adam, Adagrad or Lion) stepping tensors in place.
// Adam's state is exp_avg and exp_avg_sq; Adagrad's sum and Lion's exp_avg are the one `state`.
class Optimizer {
 public:
  explicit Optimizer(const optim_cpu::OptimizerConfig& config)
      : optimizer_(Take(optim_cpu::MakeChunkOptimizer(config))) {}

  // One step t of one tensor, in place; returns true when the gradient held an inf or nan and
  // check_overflow asked for the scan (then nothing was changed). `param_copy` (optional)
  // receives the new weights in its own dtype.
  bool Step(int64_t t, py::handle param, py::handle grad, py::handle state1, py::handle state2,
            float lr, float grad_scale, bool check_overflow, py::handle param_copy) {
    const bool adam = optimizer_->kind() == optim_cpu::OptimizerKind::kAdam;
    const TensorView p = HostTensor(param, "param");
    const TensorView g = HostTensor(grad, "grad");
    const TensorView m = HostTensor(state1, adam ? "exp_avg" : "state");
    if (adam == state2.is_none()) {
      Raise(absl::InvalidArgumentError(
          adam ? "exp_avg_sq is missing; accepted: Adam's two moments, exp_avg and exp_avg_sq"
               : "a second state was given; accepted: one state tensor (Adagrad's sum, Lion's "
                 "exp_avg)"));
    }
    TensorView v;
    if (adam) {
      v = HostTensor(state2, "exp_avg_sq");
      if (m.dtype != v.dtype) {
        Raise(absl::InvalidArgumentError(
            "exp_avg and exp_avg_sq: their element types differ; accepted: both float32 or both "
            "bfloat16"));
      }
      CheckStepTensors(p, {{&g, "grad"}, {&m, "exp_avg"}, {&v, "exp_avg_sq"}});
    } else {
      CheckStepTensors(p, {{&g, "grad"}, {&m, "state"}});
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
      CheckStepTensors(p, {{&copy, "param_copy"}});
      chunk.param_copy = copy.data;
      chunk.copy_dtype = copy.dtype;
    }
    const optim_cpu::StepOptions options = StepOptionsOf(lr, grad_scale, check_overflow);
    absl::StatusOr<optim_cpu::StepResult> r;
    {
      py::gil_scoped_release unlocked;
      r = optimizer_->Step(t, chunk, options);
    }
    return Take(std::move(r)).overflow;
  }

  bool HasNonFinite(py::handle grad) {
    const TensorView g = HostTensor(grad, "grad");
    py::gil_scoped_release unlocked;
    return optimizer_->HasNonFinite(g.data, g.dtype, g.elements);
  }

  std::string Isa() const { return std::string(optim_cpu::IsaName(optimizer_->isa())); }

 private:
  std::unique_ptr<optim_cpu::ChunkOptimizer> optimizer_;
};

Optimizer MakeAdam(float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw,
                   bool bias_correction, int threads, const std::string& isa) {
  optim_cpu::OptimizerConfig c;
  c.adam = AdamConfigOf(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction);
  c.adam.threads = threads;
  c.adam.isa = isa;
  return Optimizer(c);
}

Optimizer MakeAdagrad(float lr, float lr_decay, float weight_decay, float eps, int threads) {
  optim_cpu::OptimizerConfig c;
  c.kind = optim_cpu::OptimizerKind::kAdagrad;
  c.adagrad.lr = lr;
  c.adagrad.lr_decay = lr_decay;
  c.adagrad.weight_decay = weight_decay;
  c.adagrad.eps = eps;
  c.adagrad.threads = threads;
  return Optimizer(c);
}

Optimizer MakeLion(float lr, float beta1, float beta2, float weight_decay, int threads) {
  optim_cpu::OptimizerConfig c;
  c.kind = optim_cpu::OptimizerKind::kLion;
  c.lion.lr = lr;
  c.lion.beta1 = beta1;
  c.lion.beta2 = beta2;
  c.lion.weight_decay = weight_decay;
  c.lion.threads = threads;
  return Optimizer(c);
}

using tiering::ElementType;
using tiering::Role;
using tiering::Tier;

// A stream as Python gives it: None, none; an integer cudaStream_t, where 0 is CUDA's legacy
// default stream (torch's default stream), which the Runtime takes as kLegacyDefaultStream (0 there
// would mean none).
tiering::StreamHandle StreamOf(std::optional<uintptr_t> given) {
  if (!given.has_value()) return nullptr;
  if (*given == 0) return tiering::kLegacyDefaultStream;
  return reinterpret_cast<tiering::StreamHandle>(*given);
}

Tier TierNamed(const std::string& name, bool memory_only) {
  if (name == "device") return Tier::kDevice;
  if (name == "host") return Tier::kHost;
  if (name == "nvme" && !memory_only) return Tier::kNvme;
  Raise(absl::InvalidArgumentError(absl::StrCat(
      "tier \"", name,
      "\" is not accepted; accepted: ", memory_only ? "device, host" : "device, host, nvme")));
}

optim_cpu::DType DTypeNamed(const std::string& name) {
  if (name == "float32") return optim_cpu::DType::kF32;
  if (name == "bfloat16") return optim_cpu::DType::kBF16;
  if (name == "float16") return optim_cpu::DType::kF16;
  Raise(absl::InvalidArgumentError(
      absl::StrCat("dtype \"", name, "\" is not accepted; accepted: float32, bfloat16, float16")));
}

size_t DTypeBytes(optim_cpu::DType t) { return t == optim_cpu::DType::kF32 ? 4 : 2; }

Role RoleNamed(const std::string& name) {
  if (name == "param") return Role::kParam;
  if (name == "grad") return Role::kGrad;
  if (name == "other") return Role::kOther;
  Raise(absl::InvalidArgumentError(
      absl::StrCat("role \"", name, "\" is not accepted; accepted: param, grad, other")));
}

py::object JsonToPython(const std::string& json) {
  return py::module_::import("json").attr("loads")(json);
}

// sched::Runtime over tensors.
// (id, grad, param_copy or None) triples as StepInputs; the tensors' views go into `keep`, which
// must outlive the inputs' use. `grad_optional`: a None grad is left null (a staged step's
// gradient partition).
std::vector<swap::StepInput> StepInputs(const py::list& inputs, bool grad_optional,
                                        std::vector<TensorView>* keep) {
  std::vector<swap::StepInput> in;
  in.reserve(inputs.size());
  keep->reserve(2 * inputs.size());
  for (const py::handle item : inputs) {
    const auto triple = item.cast<py::tuple>();
    if (triple.size() != 3) {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          "each input is (id, grad", grad_optional ? " or None" : "", ", param_copy or None)")));
    }
    swap::StepInput s;
    s.id = triple[0].cast<uint64_t>();
    if (!(grad_optional && triple[1].is_none())) {
      keep->push_back(HostTensor(triple[1], absl::StrCat("grad of ", s.id)));
      s.grad = keep->back().data;
      s.grad_dtype = keep->back().dtype;
    }
    if (grad_optional && py::isinstance<py::int_>(triple[2]) &&
        !py::isinstance<py::bool_>(triple[2])) {
      if (triple[2].cast<int64_t>() < 0) {
        Raise(absl::InvalidArgumentError(
            absl::StrCat("the param copy of ", s.id, " names partition ", triple[2].cast<int64_t>(),
                         "; accepted: a partition id (0 or more)")));
      }
      // A partition id: the new weights go into that partition once the state has landed
      // (optimizer_commit "partition"; sched::Runtime::StageOptimizerStep).
      s.copy_to_sink = true;
      s.sink_target = triple[2].cast<uint64_t>();
    } else if (!triple[2].is_none()) {
      keep->push_back(HostTensor(triple[2], absl::StrCat("param_copy of ", s.id)));
      s.param_copy = keep->back().data;
      s.copy_dtype = keep->back().dtype;
    }
    in.push_back(s);
  }
  return in;
}

// A partition's optimizer state as three float32 host tensors.
std::array<TensorView, 3> StateTensors(const std::string& what, py::handle master,
                                       py::handle exp_avg, py::handle exp_avg_sq) {
  std::array<TensorView, 3> out = {HostTensor(master, "master"), HostTensor(exp_avg, "exp_avg"),
                                   HostTensor(exp_avg_sq, "exp_avg_sq")};
  for (const TensorView& t : out) {
    if (t.dtype != optim_cpu::DType::kF32) {
      Raise(absl::InvalidArgumentError(absl::StrCat(what, ": accepted: float32 tensors")));
    }
  }
  return out;
}

// XXH3-128 of a contiguous host tensor's bytes, as 32 hex digits (checkpoints' digests).
std::string Digest(py::handle tensor) {
  const TensorView v = Take(BorrowTensor(tensor, "tensor"));
  if (v.device != DeviceKind::kCpu) {
    Raise(absl::InvalidArgumentError("digest: accepted: a CPU tensor"));
  }
  const size_t bytes = v.elements * (v.dtype == optim_cpu::DType::kF32 ? 4 : 2);
  XXH128_hash_t h;
  {
    py::gil_scoped_release unlocked;
    h = XXH3_128bits(v.data, bytes);
  }
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

// A DeepSpeed config's text read as a Runtime reads it (tiering::RuntimeConfigFromJsonText),
// nothing made: the reader's warnings; a bad key or value raises, naming it and what is accepted.
std::vector<std::string> CheckRuntimeConfig(const std::string& config_json) {
  std::vector<std::string> warnings;
  Take(tiering::RuntimeConfigFromJsonText(config_json, &warnings));
  return warnings;
}

py::dict MinimumHostBudget(const std::string& config_json, uint64_t optimizer_elements,
                           uint64_t widest, uint64_t largest_partition_bytes,
                           uint64_t staged_copy_bytes, uint64_t largest_param_bytes) {
  // Read with room for its staging buffers (a budget below them is what is asked about here),
  // then given its own budget back.
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) Take(tiering::RuntimeConfigFromJsonText(config_json));  // names the error
  uint64_t budget = tiering::RuntimeConfig{}.host_budget_bytes;
  nlohmann::json& block = j["strata"];
  if (!block.is_object()) block = nlohmann::json::object();
  if (block.contains("host_budget_bytes") && block["host_budget_bytes"].is_number_unsigned()) {
    budget = block["host_budget_bytes"].get<uint64_t>();
  } else if (block.contains("host_budget_bytes") && block["host_budget_bytes"].is_number() &&
             block["host_budget_bytes"].get<double>() >= 1) {  // 6.1e6, as the Runtime reads it
    budget = static_cast<uint64_t>(block["host_budget_bytes"].get<double>());
  }
  block["host_budget_bytes"] = uint64_t{1} << 50;
  tiering::RuntimeConfig c = Take(tiering::RuntimeConfigFromJson(j));
  c.host_budget_bytes = budget;
  const tiering::RuntimeConfig::HostMinimum m = c.MinimumHost(
      optimizer_elements, widest, largest_partition_bytes, staged_copy_bytes, largest_param_bytes);
  py::dict d;
  d["staging"] = m.staging;
  d["optimizer"] = m.optimizer;
  d["partition"] = m.partition;
  d["total"] = m.total();
  d["budget"] = c.host_budget_bytes;  // the config's strata.host_budget_bytes
  return d;
}

py::dict ReportDict(const swap::StepReport& report) {
  py::dict d;
  d["overflow"] = report.overflow;
  d["seconds"] = report.seconds;
  d["commit_seconds"] = report.commit_seconds;
  d["read_seconds"] = report.read_seconds;
  d["write_seconds"] = report.write_seconds;
  d["compute_seconds"] = report.compute_seconds;
  d["bytes_read"] = report.bytes_read;
  d["bytes_written"] = report.bytes_written;
  d["bytes_reused"] = report.bytes_reused;
  d["written_behind"] = report.written_behind;
  d["behind_bytes_written"] = report.behind_bytes_written;
  d["behind_wait_seconds"] = report.behind_wait_seconds;
  return d;
}

class PyRuntime {
 public:
  // `inject_write_error` (a test seam, 0 by default): every write the aio engine makes fails with
  // that errno while the faults are armed (ArmFaults; disarmed until then), but the first
  // `inject_write_skip` writes made armed.
  PyRuntime(const std::string& config_json, int rank, int device_index, int workers,
            py::object on_warning, int inject_write_error, int64_t inject_write_skip) {
    std::vector<std::string> warnings;
    tiering::RuntimeConfig config =
        Take(tiering::RuntimeConfigFromJsonText(config_json, &warnings));
    sched::RuntimeOptions options;
    options.rank = rank;
    options.device_index = device_index;
    options.workers = workers;
    if (inject_write_error < 0 || inject_write_error >= 4096) {
      Raise(absl::InvalidArgumentError(absl::StrCat("inject_write_error ", inject_write_error,
                                                    " is not accepted; accepted: 0 (none) or an "
                                                    "errno from 1 to 4095")));
    }
    if (inject_write_skip < 0) {
      Raise(absl::InvalidArgumentError(absl::StrCat("inject_write_skip ", inject_write_skip,
                                                    " is not accepted; accepted: 0 or more")));
    }
    if (inject_write_error != 0) {
      aio::FaultRule rule = aio::FaultRule::Error(inject_write_error);
      rule.only = aio::OpKind::kWrite;
      rule.skip = static_cast<uint64_t>(inject_write_skip);
      faults_ = std::make_shared<aio::FaultInjector>(/*seed=*/1, std::vector{rule});
      faults_->Arm(false);
      options.engine_options.wrap_backend = aio::FaultInjector::ForEngine(faults_);
    }
    if (!on_warning.is_none()) {
      auto callback = std::make_shared<py::object>(std::move(on_warning));
      // Called on the Runtime's threads too: the GIL is taken for the call; an exception the
      // callback raises is reported by Python as unraisable, never carried into the Runtime.
      options.on_warning = [callback](absl::string_view w) {
        py::gil_scoped_acquire gil;
        try {
          (*callback)(std::string(w));
        } catch (py::error_already_set& e) {
          e.discard_as_unraisable("strata: the on_warning callback");
        }
      };
      callback_ = std::move(callback);
      for (const std::string& w : warnings) options.on_warning(w);
    } else {
      // No callback: the config's warnings through Python's warnings (never on stdout); the
      // Runtime's later ones go to its default, stderr (sched::RuntimeOptions::on_warning).
      for (const std::string& w : warnings) {
        if (PyErr_WarnEx(PyExc_UserWarning, w.c_str(), 1) != 0) throw py::error_already_set();
      }
    }
    absl::StatusOr<std::unique_ptr<sched::Runtime>> made;
    {
      py::gil_scoped_release unlocked;
      made = sched::Runtime::Create(config, std::move(options));
    }
    runtime_ = Take(std::move(made));
    device_id_ = std::max(runtime_->cuda_device(), 0);  // the device its tensors are on
  }

  ~PyRuntime() {
    // The Runtime's destructor flushes and joins the workers, whose warnings may take the GIL. A
    // tensor lent by Lend and still alive keeps this object (and the Runtime) until it is freed;
    // one made from Acquire's capsule does not: it must not be used after its release.
    py::gil_scoped_release unlocked;
    runtime_.reset();
  }

  void Register(uint64_t id, const std::string& role, const std::string& dtype, uint64_t elements,
                int group, const std::string& tier, py::object initial) {
    tiering::PartitionDesc d;
    d.id = id;
    d.role = RoleNamed(role);
    const optim_cpu::DType t = DTypeNamed(dtype);
    d.dtype = static_cast<ElementType>(t);
    d.elements = elements;
    d.bytes = elements * DTypeBytes(t);
    d.group = group;
    const Tier where = TierNamed(tier, /*memory_only=*/false);
    TensorView v;
    if (!initial.is_none()) {
      v = HostTensor(initial, "initial");
      if (v.elements != elements || v.dtype != t) {
        Raise(absl::InvalidArgumentError(
            absl::StrCat("register ", id, ": initial holds ", v.elements, " elements of ",
                         optim_cpu::DTypeName(v.dtype), "; accepted: ", elements, " of ", dtype)));
      }
    }
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->Register(
          d, where, {static_cast<const std::byte*>(v.data), v.data == nullptr ? 0 : d.bytes});
    }
    Check(s);
    shapes_[id] = {t, elements};
  }

  // The partition's copy in `tier`, pinned, as a DLPack capsule of its elements (`overwrite`:
  // the caller writes all of it, sched::Runtime::Acquire).
  py::capsule Acquire(uint64_t id, const std::string& tier, bool traced, bool overwrite) {
    const Tier t = TierNamed(tier, /*memory_only=*/true);
    absl::StatusOr<std::byte*> p;
    {
      py::gil_scoped_release unlocked;
      p = runtime_->Acquire(id, t, traced ? sched::Access::kTraced : sched::Access::kOutOfTrace,
                            overwrite);
    }
    std::byte* address = Take(std::move(p));
    const Shape shape = shapes_.at(id);  // registered: the Acquire succeeded
    const bool cuda = t == Tier::kDevice && !runtime_->config().emulated_device;
    return LendTensor(address, shape.dtype, shape.elements,
                      cuda ? DeviceKind::kCuda : DeviceKind::kCpu, cuda ? device_id_ : 0);
  }

  // As Acquire, but the partition is released (clean) when the tensor made from the capsule is
  // freed, whenever that is: a view autograd saved for backward keeps it pinned, never pointing
  // at memory the Runtime has reused. A release that fails then is kept for TakeDeferredErrors.
  // `stream` (the CUDA tier: the cudaStream_t the tensor's kernels are queued on, as an integer,
  // 0 being CUDA's legacy default stream, torch's default; None: none) is the release's: the copy
  // is not reused before the work queued there by the time the tensor is freed has run. `traced`
  // false: an access the scheduler does not see (an evaluation's forward), as Acquire's.
  py::capsule Lend(uint64_t id, const std::string& tier, std::optional<uintptr_t> given,
                   bool traced) {
    const tiering::StreamHandle stream = StreamOf(given);
    const Tier t = TierNamed(tier, /*memory_only=*/true);
    const sched::Access access = traced ? sched::Access::kTraced : sched::Access::kOutOfTrace;
    absl::StatusOr<std::byte*> p;
    {
      py::gil_scoped_release unlocked;
      p = runtime_->Acquire(id, t, access);
    }
    std::byte* address = Take(std::move(p));
    const Shape shape = shapes_.at(id);
    const bool cuda = t == Tier::kDevice && !runtime_->config().emulated_device;
    // The tensor keeps this Runtime's Python object (and so the Runtime) alive: its last
    // reference is dropped under the GIL, so the Runtime and the Python objects it holds (the
    // warnings callback) are destroyed as Python objects are, whichever thread frees the tensor.
    PyObject* keep = py::cast(this, py::return_value_policy::reference).release().ptr();
    sched::Runtime* runtime = runtime_.get();
    Deferred* deferred = deferred_.get();
    return LendTensor(
        address, shape.dtype, shape.elements, cuda ? DeviceKind::kCuda : DeviceKind::kCpu,
        cuda ? device_id_ : 0, [runtime, deferred, id, t, keep, stream, access] {
          const absl::Status s = runtime->Release(id, t, /*dirty=*/false, stream, access);
          if (!s.ok()) {
            MutexLock lock(&deferred->mu);
            deferred->errors.push_back(std::string(s.message()));
          }
          if (Py_IsInitialized()) {  // at exit the interpreter may be gone
            py::gil_scoped_acquire gil;
            Py_DECREF(keep);
          }
        });
  }

  void ArmFaults(bool armed) {
    if (faults_ == nullptr) {
      Raise(absl::FailedPreconditionError(
          "arm_faults: this Runtime was made without inject_write_error"));
    }
    faults_->Arm(armed);
  }

  std::vector<std::string> TakeDeferredErrors() {
    MutexLock lock(&deferred_->mu);
    std::vector<std::string> errors;
    errors.swap(deferred_->errors);
    return errors;
  }

  void Release(uint64_t id, const std::string& tier, bool dirty, std::optional<uintptr_t> given,
               bool traced) {
    const Tier t = TierNamed(tier, /*memory_only=*/true);
    const tiering::StreamHandle stream = StreamOf(given);
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->Release(id, t, dirty, stream,
                            traced ? sched::Access::kTraced : sched::Access::kOutOfTrace);
    }
    Check(s);
  }

  std::vector<uint64_t> StoredPartitions() const {
    std::vector<uint64_t> ids;
    for (const auto& r : runtime_->StoredPartitions()) ids.push_back(r.id);
    return ids;
  }

  void Unregister(uint64_t id) {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->Unregister(id);
    }
    Check(s);
    shapes_.erase(id);
  }

  void Discard(uint64_t id) {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->Discard(id);
    }
    Check(s);
  }

  void GradientReady(uint64_t id) {
    py::gil_scoped_release unlocked;
    runtime_->GradientReady(id);
  }

  void Flush() {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->Flush();
    }
    Check(s);
  }

  py::object EndStep() {
    sched::StepReport r;
    {
      py::gil_scoped_release unlocked;
      r = runtime_->EndStep();
    }
    return JsonToPython(r.ToJson());
  }

  py::dict Stats() const {
    const sched::RuntimeStats s = runtime_->stats();
    py::dict d;
    d["acquire_wait_seconds"] = s.acquire_wait_seconds;
    d["acquires"] = s.acquires;
    d["acquire_hits"] = s.acquire_hits;
    d["evictions"] = s.evictions;
    d["write_backs"] = s.write_backs;
    d["write_back_failures"] = s.write_back_failures;
    d["steps"] = s.steps;
    d["host_held_bytes"] = s.host_held_bytes;
    static constexpr const char* kTiers[] = {"device", "host", "nvme"};
    py::dict peak, budget;
    for (int t = 0; t < tiering::kTierCount; ++t) {
      peak[kTiers[t]] = s.peak_bytes[t];
      budget[kTiers[t]] = s.budget_bytes[t];
    }
    d["peak_bytes"] = peak;  // per tier: the most it held at once
    d["budget_bytes"] = budget;
    py::dict moved;
    for (int f = 0; f < tiering::kTierCount; ++f) {
      for (int t = 0; t < tiering::kTierCount; ++t) {
        if (s.bytes_moved[f][t] != 0) {
          moved[py::str(absl::StrCat(kTiers[f], "_to_", kTiers[t]))] = s.bytes_moved[f][t];
        }
      }
    }
    d["bytes_moved"] = moved;
    return d;
  }

  std::vector<std::string> Warnings() const { return runtime_->warnings(); }

  bool EmulatedDevice() const { return runtime_->config().emulated_device; }
  int CudaDevice() const { return runtime_->cuda_device(); }
  // offload_param.max_in_cpu as the Runtime read it (elements; 0 without parameters on NVMe):
  // the parameters registered within it keep a host copy (sched/runtime.h).
  int64_t MaxInCpu() const {
    const auto& op = runtime_->config().offload_param;
    return op.device == tiering::OffloadDevice::kNvme ? op.max_in_cpu : 0;
  }
  uint64_t HostBudgetBytes() const { return runtime_->config().host_budget_bytes; }
  bool OptimizerDuringBackward() const { return runtime_->config().OptimizerDuringBackward(); }
  bool OptimizerCommitEach() const { return runtime_->config().optimizer_commit_each; }

  // `kind`: "adam" (AdamW with adamw), "adagrad" (lr_decay, weight_decay as L2, eps) or "lion"
  // (beta1, beta2, weight_decay decoupled); `copy_dtype`: the dtype of the param copies the steps
  // will write.
  void CreateOptimizer(const std::string& kind, float lr, float beta1, float beta2, float eps,
                       float weight_decay, bool adamw, bool bias_correction, float lr_decay,
                       const std::vector<std::pair<uint64_t, uint64_t>>& partitions,
                       const std::string& copy_dtype, int64_t copy_elements) {
    optim_cpu::OptimizerConfig c;
    if (kind == "adam") {
      c.adam = AdamConfigOf(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction);
    } else if (kind == "adagrad") {
      c.kind = optim_cpu::OptimizerKind::kAdagrad;
      c.adagrad.lr = lr;
      c.adagrad.lr_decay = lr_decay;
      c.adagrad.weight_decay = weight_decay;
      c.adagrad.eps = eps;
    } else if (kind == "lion") {
      c.kind = optim_cpu::OptimizerKind::kLion;
      c.lion.lr = lr;
      c.lion.beta1 = beta1;
      c.lion.beta2 = beta2;
      c.lion.weight_decay = weight_decay;
    } else {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          "optimizer kind \"", kind, "\" is not accepted; accepted: adam, adagrad, lion")));
    }
    const optim_cpu::DType copy = DTypeNamed(copy_dtype);
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->CreateOptimizer(
          c, partitions, copy,
          copy_elements < 0 ? std::nullopt : std::optional<uint64_t>(copy_elements));
    }
    Check(s);
  }

  void InitializeOptimizerState(uint64_t id, py::handle master, float initial_state) {
    const TensorView v = HostTensor(master, "master");
    if (v.dtype != optim_cpu::DType::kF32) {
      Raise(absl::InvalidArgumentError("master: accepted: float32 (the master weights)"));
    }
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->InitializeOptimizerState(id, {static_cast<const float*>(v.data), v.elements},
                                             initial_state);
    }
    Check(s);
  }

  // One optimizer step t over (id, grad, param_copy or None) triples; returns the step's report.
  py::dict OptimizerStep(int64_t t, const py::list& inputs, float lr, float grad_scale,
                         bool check_overflow, float weight_decay, float beta1, float beta2) {
    std::vector<TensorView> keep;
    std::vector<swap::StepInput> in = StepInputs(inputs, /*grad_optional=*/false, &keep);
    const optim_cpu::StepOptions options =
        StepOptionsOf(lr, grad_scale, check_overflow, weight_decay, beta1, beta2);
    absl::StatusOr<swap::StepReport> r;
    {
      py::gil_scoped_release unlocked;
      r = runtime_->OptimizerStep(t, std::move(in), options);
    }
    return ReportDict(Take(std::move(r)));
  }

  // The step in parts (sched::Runtime::BeginOptimizerStep and the rest): the tensors staged are
  // held until the step is committed or aborted.
  void BeginOptimizerStep(bool host_early, bool hold) {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->BeginOptimizerStep(host_early, hold);
    }
    Check(s);
  }

  void ReleaseOptimizerStep(float grad_scale) {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->ReleaseOptimizerStep(grad_scale);
    }
    Check(s);
  }

  uint64_t OptimizerReadAheadBytes() { return runtime_->OptimizerReadAheadBytes(); }

  // (id, grad or None, param_copy or None or a partition id) triples; a None grad is the gradient
  // partition `id`, taken from the host tier by the optimizer's thread; a partition id takes the
  // new weights once the state has landed (optimizer_commit "partition").
  // grad_stream: the stream (an int handle, as release's) where the given gradients are still
  // being copied to host memory (sched::Runtime::StageOptimizerStep); None: they are in place.
  void StageOptimizerStep(int64_t t, const py::list& inputs, float lr, float grad_scale,
                          bool check_overflow, float weight_decay, float beta1, float beta2,
                          std::optional<uintptr_t> grad_stream) {
    std::vector<TensorView> keep;
    std::vector<swap::StepInput> in = StepInputs(inputs, /*grad_optional=*/true, &keep);
    const optim_cpu::StepOptions options =
        StepOptionsOf(lr, grad_scale, check_overflow, weight_decay, beta1, beta2);
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->StageOptimizerStep(t, std::move(in), options, StreamOf(grad_stream));
    }
    Check(s);
    for (TensorView& v : keep) staged_.push_back(std::move(v));
  }

  py::dict CommitOptimizerStep() {
    absl::StatusOr<swap::StepReport> r;
    {
      py::gil_scoped_release unlocked;
      r = runtime_->CommitOptimizerStep();
    }
    staged_.clear();
    return ReportDict(Take(std::move(r)));
  }

  void PrepareOptimizerStep() {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->PrepareOptimizerStep();
    }
    Check(s);
  }

  void WaitForEarlySteps() {
    py::gil_scoped_release unlocked;
    runtime_->WaitForEarlySteps();
  }

  void FlushOptimizer() {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->FlushOptimizer();
    }
    Check(s);
  }

  // The optimizer partitions whose new weights went into their partition (a partition id given
  // as the param copy) since the last call.
  std::vector<uint64_t> TakeCopiedPartitions() { return runtime_->TakeCopiedPartitions(); }
  std::vector<uint64_t> PartlySteppedOptimizerPartitions() {
    return runtime_->PartlySteppedOptimizerPartitions();
  }

  // The ids of the host-resident partitions that had stepped in place (host_early).
  std::vector<uint64_t> AbortOptimizerStep() {
    std::vector<uint64_t> stepped;
    {
      py::gil_scoped_release unlocked;
      stepped = runtime_->AbortOptimizerStep();
    }
    staged_.clear();
    return stepped;
  }

  // A checkpoint's optimizer state, all or none (sched::Runtime::BeginLoadOptimizerState).
  void BeginLoadOptimizerState() {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->BeginLoadOptimizerState();
    }
    Check(s);
  }

  void LoadOptimizerState(uint64_t id, py::handle master, py::handle exp_avg,
                          py::handle exp_avg_sq) {
    const auto [p, m, v] = StateTensors("load_optimizer_state", master, exp_avg, exp_avg_sq);
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->LoadOptimizerState(id, {static_cast<const float*>(p.data), p.elements},
                                       {static_cast<const float*>(m.data), m.elements},
                                       {static_cast<const float*>(v.data), v.elements});
    }
    Check(s);
  }

  void CommitLoadOptimizerState() {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->CommitLoadOptimizerState();
    }
    Check(s);
  }

  void AbortLoadOptimizerState() {
    py::gil_scoped_release unlocked;
    runtime_->AbortLoadOptimizerState();
  }

  void ReadOptimizerState(uint64_t id, py::handle master, py::handle exp_avg, py::handle exp_avg_sq,
                          bool mixed_steps) {
    const auto [p, m, v] = StateTensors("read_optimizer_state", master, exp_avg, exp_avg_sq);
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = runtime_->ReadOptimizerState(id, {static_cast<float*>(p.data), p.elements},
                                       {static_cast<float*>(m.data), m.elements},
                                       {static_cast<float*>(v.data), v.elements}, mixed_steps);
    }
    Check(s);
  }

 private:
  // Failures of releases made when a lent tensor was freed (on whichever thread freed it).
  struct Deferred {
    Mutex mu;
    std::vector<std::string> errors ABSL_GUARDED_BY(mu);
  };
  std::unique_ptr<sched::Runtime> runtime_;
  std::vector<TensorView> staged_;  // the tensors of the step being staged
  std::unique_ptr<Deferred> deferred_ = std::make_unique<Deferred>();
  std::shared_ptr<py::object> callback_;
  std::shared_ptr<aio::FaultInjector> faults_;
  struct Shape {
    optim_cpu::DType dtype;
    uint64_t elements;
  };
  // What Register was told of each partition (sched::Runtime keeps bytes, not element types).
  absl::flat_hash_map<uint64_t, Shape> shapes_;
  int device_id_ = 0;
};

// A collective of the job and the tensors it reads and writes, held until it is done. wait()
// raises its error, and can be interrupted (Ctrl-C: Python's signal handlers run between waits of
// 50 ms): the job's communicators are then aborted (`abort`), so that the peers' collectives fail
// at once and every later one here is refused at once; the interrupted collective may run on until
// the timeout, so its tensors, and the job (held by `abort`), are kept (Abandoned) until it ends.
class JobWork {
 public:
  // `aborted`: set once the job's communicators were aborted (by any of its works).
  JobWork(std::shared_ptr<comm::Work> work, std::vector<py::object> held,
          std::function<void()> abort, std::shared_ptr<std::atomic<bool>> aborted)
      : work_(std::move(work)),
        held_(std::move(held)),
        abort_(std::move(abort)),
        aborted_(std::move(aborted)) {}
  JobWork(const JobWork&) = default;
  JobWork(JobWork&&) = default;
  JobWork& operator=(JobWork&&) = delete;
  // Dropped before it is done: waits, so that the collective never writes a freed tensor; once
  // the job was aborted (another work's wait interrupted), it is abandoned instead: a collective
  // on Gloo that waits for a peer cannot be woken and would hold the process until the timeout
  // (an audit's finding: a Ctrl-C left the gradients' reduce-scatter on the side communicator
  // holding the process for comm_timeout_s).
  ~JobWork() {
    if (work_ == nullptr || held_.empty() || interrupted_) return;  // (Abandoned holds them)
    if (aborted_->load() && !work_->done()) {
      Abandon();
      return;
    }
    py::gil_scoped_release unlocked;
    work_->Wait().IgnoreError();
  }
  void Wait() {
    for (;;) {
      bool finished;
      {
        py::gil_scoped_release unlocked;
        finished = work_->WaitFor(std::chrono::milliseconds(50));
      }
      if (finished) break;
      if (PyErr_CheckSignals() != 0) {
        aborted_->store(true);
        abort_();
        Abandoned().push_back(std::make_unique<JobWork>(*this));
        interrupted_ = true;
        throw py::error_already_set();
      }
    }
    absl::Status s = work_->Wait();
    held_.clear();
    Check(s);
  }
  bool Done() const { return work_->done(); }
  // Given up without waiting (the ranks were found to disagree on what it exchanges: it may
  // never complete): its tensors are kept (Abandoned) until it ends, and dropping it no longer
  // waits for it.
  void Abandon() {
    if (interrupted_ || held_.empty() || work_->done()) return;
    Abandoned().push_back(std::make_unique<JobWork>(*this));
    interrupted_ = true;
  }
  // Works given up by an interrupted wait (or Abandon), with their tensors; those done are let go
  // as new collectives are issued.
  static std::vector<std::unique_ptr<JobWork>>& Abandoned() {
    static auto* abandoned = new std::vector<std::unique_ptr<JobWork>>();
    return *abandoned;
  }
  static void ForgetFinished() {
    auto& a = Abandoned();
    a.erase(std::remove_if(a.begin(), a.end(), [](const auto& w) { return w->Done(); }), a.end());
  }

 private:
  std::shared_ptr<comm::Work> work_;
  std::vector<py::object> held_;
  std::function<void()> abort_;
  std::shared_ptr<std::atomic<bool>> aborted_;
  bool interrupted_ = false;  // a wait for it was interrupted: Abandoned keeps it
};

// The job a launcher started (comm/job.h), for the Python front: who this rank is, and the
// collectives over CPU tensors (waited for with the GIL released).
class PyJob {
 public:
  PyJob(int64_t timeout_ms, const std::string& transport) {
    auto env = comm::JobEnvFromEnvironment();
    Check(env.status());
    absl::StatusOr<comm::Job> job;
    {
      py::gil_scoped_release unlocked;
      // (checked by JoinJob once the ranks have exchanged it: a bad one named on every rank)
      // Ctrl-C while the ranks meet ends the joining (else it waits for the whole timeout): the
      // signal's exception is raised once the store's wait returns.
      job = comm::JoinJob(*env, comm::Duration(timeout_ms), transport, []() -> absl::Status {
        py::gil_scoped_acquire locked;
        if (PyErr_CheckSignals() != 0) return absl::CancelledError("interrupted");
        return absl::OkStatus();
      });
    }
    if (PyErr_Occurred() != nullptr) throw py::error_already_set();
    Check(job.status());
    job_ = std::make_shared<comm::Job>(*std::move(job));
  }
  int rank() const { return job_->env.rank; }
  int world_size() const { return job_->env.world_size; }
  int local_rank() const { return job_->env.local_rank; }
  bool launched() const { return job_->env.launched; }
  const std::string& transport() const { return job_->transport; }

  // Each collective waits for itself, or with async_op returns a JobWork to wait for (holding its
  // tensors until it is done).
  py::object AllReduce(py::object tensor, bool async_op) {
    const TensorView t = Float32(tensor, "all_reduce");
    return Finish(job_->comm->AllReduce({static_cast<float*>(t.data), t.elements}), async_op,
                  {tensor});
  }
  py::object ReduceScatter(py::object input, py::object output, bool async_op, bool side) {
    const TensorView in = Float32(input, "reduce_scatter: input");
    const TensorView out = Float32(output, "reduce_scatter: output");
    return Finish(Comm(side).ReduceScatter({static_cast<const float*>(in.data), in.elements},
                                           {static_cast<float*>(out.data), out.elements}),
                  async_op, {input, output});
  }
  py::object AllGather(py::object input, py::object output, bool async_op, bool side) {
    const TensorView in = HostTensor(input, "all_gather: input");
    const TensorView out = HostTensor(output, "all_gather: output");
    if (in.dtype != out.dtype) {
      Raise(absl::InvalidArgumentError("all_gather: accepted: input and output of one dtype"));
    }
    return Finish(Comm(side).AllGather(Bytes(in), Bytes(out)), async_op, {input, output});
  }
  py::object Broadcast(py::object tensor, int root, bool async_op) {
    const TensorView t = HostTensor(tensor, "broadcast");
    return Finish(job_->comm->Broadcast(Bytes(t), root), async_op, {tensor});
  }
  void Barrier() { Finish(job_->comm->Barrier(), false, {}); }

 private:
  static TensorView Float32(py::handle tensor, const char* what) {
    TensorView t = HostTensor(tensor, what);
    if (t.dtype != optim_cpu::DType::kF32) {
      Raise(absl::InvalidArgumentError(absl::StrCat(what, ": accepted: float32 (sums)")));
    }
    return t;
  }
  static absl::Span<std::byte> Bytes(const TensorView& t) {
    return {static_cast<std::byte*>(t.data), t.elements * DTypeBytes(t.dtype)};
  }
  // The job's communicator, or (side) its second one, whose collectives run beside the first's.
  comm::Communicator& Comm(bool side) { return side ? *job_->side : *job_->comm; }
  py::object Finish(std::shared_ptr<comm::Work> work, bool async_op, std::vector<py::object> held) {
    JobWork::ForgetFinished();
    JobWork w(
        std::move(work), std::move(held),
        [job = job_] {
          job->comm->Abort();
          job->side->Abort();
        },
        aborted_);
    if (async_op) return py::cast(std::move(w));
    w.Wait();
    return py::none();
  }
  std::shared_ptr<comm::Job> job_;  // shared with its collectives' abort (JobWork)
  std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);
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
  py::class_<PyJob>(m, "Job",
                    "The job a launcher started (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, "
                    "LOCAL_RANK; none set: a job of one process) and its collectives over CPU "
                    "tensors: through shared memory between ranks on one host, else on Gloo "
                    "over TCP (comm/job.h)")
      .def(py::init<int64_t, const std::string&>(), py::arg("timeout_ms") = 60000,
           py::arg("transport") = "auto")
      .def_property_readonly("rank", &PyJob::rank)
      .def_property_readonly("world_size", &PyJob::world_size)
      .def_property_readonly("local_rank", &PyJob::local_rank)
      .def_property_readonly("launched", &PyJob::launched)
      .def_property_readonly("transport", &PyJob::transport,
                             "what the collectives travel by: \"shared memory\" or \"tcp\"")
      .def("all_reduce", &PyJob::AllReduce, py::arg("tensor"), py::arg("async_op") = false,
           "float32 sum over the ranks, in place")
      .def("reduce_scatter", &PyJob::ReduceScatter, py::arg("input"), py::arg("output"),
           py::arg("async_op") = false, py::arg("side") = false,
           "output = the float32 sum over the ranks of their input's shard `rank` (input: "
           "world_size shards of output's size); side: on the job's second communicator, "
           "beside the first's collectives (each keeps its own order)")
      .def("all_gather", &PyJob::AllGather, py::arg("input"), py::arg("output"),
           py::arg("async_op") = false, py::arg("side") = false,
           "output = every rank's input, in rank order")
      .def("broadcast", &PyJob::Broadcast, py::arg("tensor"), py::arg("root"),
           py::arg("async_op") = false)
      .def("barrier", &PyJob::Barrier);
  py::class_<JobWork>(m, "JobWork", "a collective issued with async_op=True")
      .def("wait", &JobWork::Wait, "waits for it; raises its error")
      .def("done", &JobWork::Done)
      .def("abandon", &JobWork::Abandon,
           "gives it up without waiting: its tensors are kept until it ends");

  py::class_<Optimizer>(m, "Optimizer",
                        "a CPU optimizer (Adam, Adagrad or Lion) stepping CPU tensors in place; "
                        "made by Adam(), Adagrad() or Lion()")
      .def("step", &Optimizer::Step, py::arg("t"), py::arg("param"), py::arg("grad"),
           py::arg("state"), py::arg("state2") = py::none(), py::arg("lr") = -1.0f,
           py::arg("grad_scale") = 1.0f, py::arg("check_overflow") = false,
           py::arg("param_copy") = py::none())
      .def("has_non_finite", &Optimizer::HasNonFinite, py::arg("grad"))
      .def_property_readonly("isa", &Optimizer::Isa);
  m.def("check_runtime_config", &CheckRuntimeConfig,
        "a DeepSpeed config's JSON text read as a Runtime reads it, nothing made: its warnings "
        "(a list of str); a bad key or value raises InvalidArgumentError",
        py::arg("config_json"));
  m.def("minimum_host_budget", &MinimumHostBudget,
        "tiering::RuntimeConfig::MinimumHost for a config's JSON text: the smallest "
        "strata.host_budget_bytes a run takes, {staging, optimizer, partition, total}, and the "
        "config's (budget)",
        py::arg("config_json"), py::arg("optimizer_elements"), py::arg("widest"),
        py::arg("largest_partition_bytes"), py::arg("staged_copy_bytes") = 0,
        py::arg("largest_param_bytes") = 0);
  m.def("digest", &Digest,
        "XXH3-128 of a contiguous CPU tensor's bytes (float32, bfloat16 or float16), in hex",
        py::arg("tensor"));
  m.def("Adam", &MakeAdam, "optim_cpu::CpuAdam: Adam/AdamW (state: exp_avg, exp_avg_sq)",
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw"), py::arg("bias_correction"), py::arg("threads") = 0, py::arg("isa") = "");
  m.def("Adagrad", &MakeAdagrad, "optim_cpu::CpuAdagrad: Adagrad (state: sum)", py::arg("lr"),
        py::arg("lr_decay"), py::arg("weight_decay"), py::arg("eps"), py::arg("threads") = 0);
  m.def("Lion", &MakeLion, "optim_cpu::CpuLion: Lion (state: exp_avg)", py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("threads") = 0);

  py::class_<PyRuntime>(m, "Runtime", "sched::Runtime: partitions in tiers, moved ahead of need")
      .def(py::init<const std::string&, int, int, int, py::object, int, int64_t>(),
           py::arg("config_json"), py::arg("rank") = -1, py::arg("device_index") = -1,
           py::arg("workers") = 4, py::arg("on_warning") = py::none(),
           py::arg("inject_write_error") = 0, py::arg("inject_write_skip") = 0)
      .def("arm_faults", &PyRuntime::ArmFaults, py::arg("armed"))
      .def("register", &PyRuntime::Register, py::arg("id"), py::arg("role"), py::arg("dtype"),
           py::arg("elements"), py::arg("group"), py::arg("tier"), py::arg("initial") = py::none())
      .def("acquire", &PyRuntime::Acquire, py::arg("id"), py::arg("tier"), py::arg("traced") = true,
           py::arg("overwrite") = false)
      // traced has no default: a lend in an evaluation's forward left untraced by one caller
      // once put that evaluation's accesses into the next step's trace.
      .def("lend", &PyRuntime::Lend, py::arg("id"), py::arg("tier"), py::arg("stream"),
           py::arg("traced"))
      .def("take_deferred_errors", &PyRuntime::TakeDeferredErrors)
      .def("release", &PyRuntime::Release, py::arg("id"), py::arg("tier"), py::arg("dirty"),
           py::arg("stream") = py::none(), py::arg("traced") = true)
      .def("discard", &PyRuntime::Discard, py::arg("id"))
      .def("stored_partitions", &PyRuntime::StoredPartitions)
      .def("unregister", &PyRuntime::Unregister, py::arg("id"))
      .def("gradient_ready", &PyRuntime::GradientReady, py::arg("id"))
      .def("flush", &PyRuntime::Flush)
      .def("end_step", &PyRuntime::EndStep)
      .def("stats", &PyRuntime::Stats)
      .def("warnings", &PyRuntime::Warnings)
      .def_property_readonly("emulated_device", &PyRuntime::EmulatedDevice)
      .def_property_readonly("cuda_device", &PyRuntime::CudaDevice,
                             "The CUDA device of the device tier; -1 on the emulated one.")
      .def_property_readonly("max_in_cpu", &PyRuntime::MaxInCpu)
      .def_property_readonly("host_budget_bytes", &PyRuntime::HostBudgetBytes)
      .def_property_readonly("optimizer_during_backward", &PyRuntime::OptimizerDuringBackward)
      .def_property_readonly("optimizer_commit_each", &PyRuntime::OptimizerCommitEach)
      .def("create_optimizer", &PyRuntime::CreateOptimizer, py::arg("kind") = "adam",
           py::arg("lr") = 1e-3f, py::arg("beta1") = 0.9f, py::arg("beta2") = 0.999f,
           py::arg("eps") = 1e-8f, py::arg("weight_decay") = 0.0f, py::arg("adamw") = true,
           py::arg("bias_correction") = true, py::arg("lr_decay") = 0.0f,
           py::arg("partitions") = std::vector<std::pair<uint64_t, uint64_t>>{},
           py::arg("copy_dtype") = "bfloat16", py::arg("copy_elements") = -1)
      .def("initialize_optimizer_state", &PyRuntime::InitializeOptimizerState, py::arg("id"),
           py::arg("master"), py::arg("initial_state") = 0.0f)
      .def("optimizer_step", &PyRuntime::OptimizerStep, py::arg("t"), py::arg("inputs"),
           py::arg("lr") = -1.0f, py::arg("grad_scale") = 1.0f, py::arg("check_overflow") = false,
           py::arg("weight_decay") = -1.0f, py::arg("beta1") = -1.0f, py::arg("beta2") = -1.0f)
      .def("begin_optimizer_step", &PyRuntime::BeginOptimizerStep, py::arg("host_early") = false,
           py::arg("hold") = false)
      .def("release_optimizer_step", &PyRuntime::ReleaseOptimizerStep, py::arg("grad_scale"))
      .def_property_readonly("optimizer_read_ahead_bytes", &PyRuntime::OptimizerReadAheadBytes)
      .def("stage_optimizer_step", &PyRuntime::StageOptimizerStep, py::arg("t"), py::arg("inputs"),
           py::arg("lr") = -1.0f, py::arg("grad_scale") = 1.0f, py::arg("check_overflow") = false,
           py::arg("weight_decay") = -1.0f, py::arg("beta1") = -1.0f, py::arg("beta2") = -1.0f,
           py::arg("grad_stream") = py::none())
      .def("prepare_optimizer_step", &PyRuntime::PrepareOptimizerStep)
      .def("commit_optimizer_step", &PyRuntime::CommitOptimizerStep)
      .def("abort_optimizer_step", &PyRuntime::AbortOptimizerStep)
      .def("take_copied_partitions", &PyRuntime::TakeCopiedPartitions)
      .def("partly_stepped_optimizer_partitions", &PyRuntime::PartlySteppedOptimizerPartitions)
      .def("wait_for_early_steps", &PyRuntime::WaitForEarlySteps)
      .def("flush_optimizer", &PyRuntime::FlushOptimizer)
      .def("begin_load_optimizer_state", &PyRuntime::BeginLoadOptimizerState)
      .def("load_optimizer_state", &PyRuntime::LoadOptimizerState, py::arg("id"), py::arg("master"),
           py::arg("exp_avg"), py::arg("exp_avg_sq"))
      .def("commit_load_optimizer_state", &PyRuntime::CommitLoadOptimizerState)
      .def("abort_load_optimizer_state", &PyRuntime::AbortLoadOptimizerState)
      .def("read_optimizer_state", &PyRuntime::ReadOptimizerState, py::arg("id"), py::arg("master"),
           py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("mixed_steps") = false);
}
