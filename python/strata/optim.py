"""CPU optimizers for PyTorch backed by strata's vectorized kernels (optim_cpu/).

``CpuAdam`` takes DeepSpeed's ``DeepSpeedCPUAdam`` arguments; ``CpuAdamW`` takes
``torch.optim.AdamW``'s. Both are ``torch.optim.Optimizer`` s: parameter groups, ``state_dict`` /
``load_state_dict`` (a state saved by ``torch.optim.AdamW`` loads, and the other way round), and
learning-rate schedulers work as with torch's. The update is torch's AdamW (or Adam with L2 decay,
``adamw_mode=False``) element by element in fp32 (optim_cpu/adam.h); it runs in place on the
tensors' own memory, on strata's thread pool, with the widest vector ISA the CPU has.

Parameters must be float32 CPU tensors, contiguous (the master weights); gradients may be float32,
bfloat16 or float16. Moments are float32, or bfloat16 with ``fp32_optimizer_states=False`` (half
the memory; computed in fp32). Not supported, and refused by name: ``amsgrad``, ``maximize``,
sparse gradients, and parameters on a GPU (use strata's engine, which keeps the master weights on
the host).
"""

import torch

from strata import _strata

__all__ = ["CpuAdam", "CpuAdamW"]


class CpuAdam(torch.optim.Optimizer):
    """Adam / AdamW on the CPU with DeepSpeedCPUAdam's signature.

    adamw_mode=True (the default, as DeepSpeed's): decoupled weight decay, torch.optim.AdamW.
    adamw_mode=False: L2 weight decay added to the gradient, torch.optim.Adam.
    threads: the optimizer's threads (0: one per core this process may use).
    """

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True,
                 threads=0):
        if amsgrad:
            raise ValueError("CpuAdam: amsgrad=True is not supported; accepted: amsgrad=False")
        if not 0.0 <= lr:
            raise ValueError(f"CpuAdam: lr {lr} is not accepted; accepted: lr >= 0")
        if not 0.0 < eps:
            raise ValueError(f"CpuAdam: eps {eps} is not accepted; accepted: eps > 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"CpuAdam: betas[{i}] {beta} is not accepted; accepted: 0 <= beta < 1")
        if not 0.0 <= weight_decay:
            raise ValueError(
                f"CpuAdam: weight_decay {weight_decay} is not accepted; accepted: weight_decay >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=False, maximize=False)
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
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
        beta1, beta2 = group["betas"]
        key = (float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
               bool(group.get("bias_correction", True)))
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = _strata.Adam(lr=float(group["lr"]), beta1=key[0], beta2=key[1], eps=key[2],
                                  weight_decay=key[3], adamw=self.adamw_mode,
                                  bias_correction=key[4], threads=self.threads)
            self._kernels[key] = kernel
        return kernel

    def _state_for(self, p):
        state = self.state[p]
        moments = torch.float32 if self.fp32_optimizer_states else torch.bfloat16
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=moments)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=moments)
        # A state loaded from elsewhere (torch.optim.AdamW's, a checkpoint) is made fit in place.
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16) or \
                    not t.is_contiguous():
                state[key] = t.to(device="cpu", dtype=moments).contiguous()
        if state["exp_avg"].dtype != state["exp_avg_sq"].dtype:
            state["exp_avg_sq"] = state["exp_avg_sq"].to(state["exp_avg"].dtype)
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]))
        return state

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
                kernel.step(int(state["step"].item()), p.detach(), grad.detach(), state["exp_avg"],
                            state["exp_avg_sq"], lr=lr)
        return loss


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
