"""CPU optimizers for PyTorch backed by strata's vectorized kernels (optim_cpu/).

``CpuAdam`` takes DeepSpeed's ``DeepSpeedCPUAdam`` arguments; ``CpuAdamW`` takes
``torch.optim.AdamW``'s; ``CpuAdagrad`` takes ``torch.optim.Adagrad``'s (DeepSpeedCPUAdagrad's
are a subset); ``CpuLion`` takes DeepSpeed's ``DeepSpeedCPULion`` arguments. All are
``torch.optim.Optimizer`` s: parameter groups, ``state_dict`` / ``load_state_dict`` (a state saved
by torch's Adam, AdamW or Adagrad loads into ours and the other way round: the same state keys),
and learning-rate schedulers work as with torch's. The updates are torch's AdamW (or Adam with L2
decay, ``adamw_mode=False``) and Adagrad, and Lion as published, element by element in fp32
(optim_cpu/adam.h, adagrad.h, lion.h); they run in place on the tensors' own memory, on strata's
thread pool, with the widest vector ISA the CPU has.

Parameters must be float32 CPU tensors, contiguous (the master weights); gradients may be float32,
bfloat16 or float16. States are float32, or bfloat16 with ``fp32_optimizer_states=False`` (half
the memory; computed in fp32). Not supported, and refused by name: ``amsgrad``, ``maximize``,
sparse gradients, and parameters on a GPU (use strata's engine, which keeps the master weights on
the host).
"""

import torch

from strata import _strata

__all__ = ["CpuAdam", "CpuAdamW", "CpuAdagrad", "CpuLion"]


def _check(name, value, ok, accepted):
    if not ok(value):
        raise ValueError(f"{name} {value} is not accepted; accepted: {accepted}")


class _CpuOptimizer(torch.optim.Optimizer):
    """What strata's CPU optimizers share: the checks, the kernels per hyper-parameters, the
    step loop. A subclass names its state tensors (STATE_KEYS) and makes and calls its kernel."""

    STATE_KEYS = ()

    def __init__(self, params, defaults, fp32_optimizer_states, threads):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.threads = threads
        self._kernels = {}
        for group in self.param_groups:
            self._check_group(group)

    def _check_group(self, group):
        for index, p in enumerate(group["params"]):
            where = f"{type(self).__name__}: parameter {index} of a group (shape {list(p.shape)})"
            if p.device.type != "cpu":
                raise ValueError(f"{where} is on {p.device}; accepted: CPU tensors")
            if p.dtype != torch.float32:
                raise ValueError(f"{where} is {p.dtype}; accepted: torch.float32 (the master weights)")
        if group.get("amsgrad", False):
            raise ValueError(f"{type(self).__name__}: amsgrad=True is not supported")
        if group.get("maximize", False):
            raise ValueError(f"{type(self).__name__}: maximize=True is not supported")

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if hasattr(self, "_kernels"):
            self._check_group(self.param_groups[-1])

    @property
    def isa(self):
        """The vector ISA the kernels run on (e.g. 'avx512bf16')."""
        return self._kernel(self.param_groups[0]).isa

    def _kernel(self, group):
        key = self._kernel_key(group)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._make_kernel(group, key)
            self._kernels[key] = kernel
        return kernel

    def _state_for(self, p):
        state = self.state[p]
        dtype = torch.float32 if self.fp32_optimizer_states else torch.bfloat16
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            for key in self.STATE_KEYS:
                state[key] = self._initial_state(p, dtype)
        # A state loaded from elsewhere (torch's optimizer, a checkpoint) is made fit in place.
        for key in self.STATE_KEYS:
            t = state[key]
            if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16) or \
                    not t.is_contiguous():
                state[key] = t.to(device="cpu", dtype=dtype).contiguous()
        first = state[self.STATE_KEYS[0]].dtype
        for key in self.STATE_KEYS[1:]:
            if state[key].dtype != first:
                state[key] = state[key].to(first)
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]))
        return state

    def _initial_state(self, p, dtype):
        return torch.zeros(p.shape, dtype=dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every parameter with a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            kernel = self._kernel(group)
            lr = float(group["lr"])
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError(f"{type(self).__name__}: parameter {index} has a sparse "
                                     "gradient; accepted: dense gradients")
                if not grad.is_contiguous():
                    grad = grad.contiguous()
                state = self._state_for(p)
                state["step"] += 1
                kernel.step(int(state["step"].item()), p.detach(), grad.detach(),
                            *(state[key] for key in self.STATE_KEYS), lr=lr)
        return loss


class CpuAdam(_CpuOptimizer):
    """Adam / AdamW on the CPU with DeepSpeedCPUAdam's signature.

    adamw_mode=True (the default, as DeepSpeed's): decoupled weight decay, torch.optim.AdamW.
    adamw_mode=False: L2 weight decay added to the gradient, torch.optim.Adam.
    threads: the optimizer's threads (0: one per core this process may use).
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True,
                 threads=0):
        name = type(self).__name__
        if amsgrad:
            raise ValueError(f"{name}: amsgrad=True is not supported; accepted: amsgrad=False")
        _check(f"{name}: lr", lr, lambda v: v >= 0, "lr >= 0")
        _check(f"{name}: eps", eps, lambda v: v > 0, "eps > 0")
        for i, beta in enumerate(betas):
            _check(f"{name}: betas[{i}]", beta, lambda v: 0 <= v < 1, "0 <= beta < 1")
        _check(f"{name}: weight_decay", weight_decay, lambda v: v >= 0, "weight_decay >= 0")
        self.adamw_mode = adamw_mode
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=False, maximize=False)
        super().__init__(model_params, defaults, fp32_optimizer_states, threads)

    def _kernel_key(self, group):
        beta1, beta2 = group["betas"]
        return (float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                bool(group.get("bias_correction", True)))

    def _make_kernel(self, group, key):
        return _strata.Adam(lr=float(group["lr"]), beta1=key[0], beta2=key[1], eps=key[2],
                            weight_decay=key[3], adamw=self.adamw_mode, bias_correction=key[4],
                            threads=self.threads)


class CpuAdamW(CpuAdam):
    """torch.optim.AdamW's signature and defaults (weight_decay 1e-2), on strata's CPU kernels."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, threads=0):
        if maximize:
            raise ValueError("CpuAdamW: maximize=True is not supported; accepted: maximize=False")
        if capturable:
            raise ValueError("CpuAdamW: capturable=True is not supported (CUDA graphs); "
                             "accepted: capturable=False")
        # foreach and differentiable pick torch's implementation; strata has one of its own.
        super().__init__(params, lr=lr, bias_correction=True, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=True,
                         threads=threads)


class CpuAdagrad(_CpuOptimizer):
    """Adagrad on the CPU with torch.optim.Adagrad's signature (its state key is ``sum``)."""

    STATE_KEYS = ("sum",)

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, foreach=None, *, maximize=False, differentiable=False,
                 fp32_optimizer_states=True, threads=0):
        name = type(self).__name__
        _check(f"{name}: lr", lr, lambda v: v >= 0, "lr >= 0")
        _check(f"{name}: lr_decay", lr_decay, lambda v: v >= 0, "lr_decay >= 0")
        _check(f"{name}: weight_decay", weight_decay, lambda v: v >= 0, "weight_decay >= 0")
        _check(f"{name}: initial_accumulator_value", initial_accumulator_value,
               lambda v: v >= 0, "initial_accumulator_value >= 0")
        _check(f"{name}: eps", eps, lambda v: v > 0, "eps > 0")
        if maximize:
            raise ValueError(f"{name}: maximize=True is not supported; accepted: maximize=False")
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                        initial_accumulator_value=initial_accumulator_value, maximize=False)
        super().__init__(params, defaults, fp32_optimizer_states, threads)

    def _initial_state(self, p, dtype):
        value = self.param_groups[0]["initial_accumulator_value"]
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                value = group["initial_accumulator_value"]
        return torch.full(p.shape, float(value), dtype=dtype)

    def _kernel_key(self, group):
        return (float(group["lr_decay"]), float(group["weight_decay"]), float(group["eps"]))

    def _make_kernel(self, group, key):
        return _strata.Adagrad(lr=float(group["lr"]), lr_decay=key[0], weight_decay=key[1],
                               eps=key[2], threads=self.threads)


class CpuLion(_CpuOptimizer):
    """Lion (Chen et al. 2023) on the CPU with DeepSpeedCPULion's signature; its state key is
    ``exp_avg``."""

    STATE_KEYS = ("exp_avg",)

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
                 fp32_optimizer_states=True, threads=0):
        name = type(self).__name__
        _check(f"{name}: lr", lr, lambda v: v >= 0, "lr >= 0")
        for i, beta in enumerate(betas):
            _check(f"{name}: betas[{i}]", beta, lambda v: 0 <= v < 1, "0 <= beta < 1")
        _check(f"{name}: weight_decay", weight_decay, lambda v: v >= 0, "weight_decay >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states, threads)

    def _kernel_key(self, group):
        beta1, beta2 = group["betas"]
        return (float(beta1), float(beta2), float(group["weight_decay"]))

    def _make_kernel(self, group, key):
        return _strata.Lion(lr=float(group["lr"]), beta1=key[0], beta2=key[1],
                            weight_decay=key[2], threads=self.threads)
