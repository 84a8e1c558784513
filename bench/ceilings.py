"""The compute-side ceilings the Python benchmarks print beside their figures (BENCH.md): strata's
CPU Adam over a model's optimizer state, and the host link's copy rates. The disk's are in
fio_ceiling.py. bench/train_step.py and bench/vs_deepspeed.py take them from here.

Thread safety: none needed (each call measures, on the calling thread).
"""
import statistics
import time

import torch

from strata import _strata


def cpu_adam_seconds(params, dtype=torch.float32, lr=1e-3, weight_decay=0.0, repeats=3):
    """Seconds strata's CPU Adam (optim_cpu, one thread per core) takes to step `params`
    parameters held in one flat chunk of fp32 master weights and moments, with a gradient in the
    training `dtype` and, when that is not fp32, the new weights' copy in it: the median of
    `repeats` steps after one."""
    adam = _strata.Adam(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
                        adamw=True, bias_correction=True)
    master = torch.randn(params) * 0.02
    moments = torch.zeros(2, params)
    grad = (torch.randn(params) * 1e-3).to(dtype)
    copy = torch.empty(params, dtype=dtype) if dtype != torch.float32 else None
    took = []
    for t in range(1, repeats + 2):
        t0 = time.perf_counter()
        adam.step(t, master, grad, moments[0], moments[1], lr, 1.0, False, copy)
        if t > 1:
            took.append(time.perf_counter() - t0)
    return statistics.median(took)


def link_rates(numel, dtype=torch.uint8, repeats=3):
    """The host link's bytes per second, (to the GPU, to the host), copying `numel` elements of
    `dtype` between pinned host memory and the current GPU: the median of `repeats` copies each
    way, after one, each waited for."""
    host = torch.empty(numel, dtype=dtype, pin_memory=True)
    device = torch.empty(numel, dtype=dtype, device="cuda")
    rates = []
    for dst, src in ((device, host), (host, device)):
        took = []
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            if i:
                took.append(time.perf_counter() - t0)
        rates.append(host.numel() * host.element_size() / statistics.median(took))
    return tuple(rates)
