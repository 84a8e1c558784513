"""Reference optimizers and training written out in plain torch, for the tests to compare
against."""
import copy

import torch


class LionReference(torch.optim.Optimizer):
    """Lion as published (lion-pytorch's update), written out: the formula optim_cpu/lion.h
    states, in plain torch."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = (beta1 * m + (1 - beta1) * p.grad).sign()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def assert_computes_as(engine, state_dict, model_class, x):
    """The engine's forward on `x` equals a plain `model_class` with `state_dict`'s: the weights
    the engine computes with (its partitions), not only the master weights its state dict shows."""
    import torch

    reference = model_class()
    reference.load_state_dict(state_dict)
    with torch.no_grad():
        ours = engine(x).float()
        theirs = reference(x).float()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), (ours - theirs).abs().max()


class MixedPrecisionAdamW:
    """Plain torch's training step: AdamW over fp32 master weights (`model`), with a copy of the
    model computing in `dtype` (the mixed-precision recipe written out: gradients made in
    `dtype`, summed over micro-batches in fp32, clipped by clip_grad_norm_, the copy the rounding
    of the master weights). For fp32 it is torch.optim.AdamW on the model itself."""

    def __init__(self, model, dtype, clipping, lr=1e-2, weight_decay=0.01):
        self.master = model
        self.model = copy.deepcopy(model).to(dtype)
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=lr, weight_decay=weight_decay)
        self.clipping = clipping

    def backward(self, loss, accumulation):
        """A micro-batch's backward, its loss divided by the accumulation steps (as the engine's);
        the gradients are summed into the master weights' in fp32."""
        (loss / accumulation).backward()
        for m, p in zip(self.master.parameters(), self.model.parameters()):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad.float())
                p.grad = None

    def step(self):
        if self.clipping:
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.clipping)
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.master.parameters(), self.model.parameters()):
                p.copy_(m)
