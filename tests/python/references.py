"""Reference optimizers written out in plain torch, for the tests to compare against."""
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
