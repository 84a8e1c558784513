"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR), with its
parameter names, defaults and formulas, over any optimizer with ``param_groups``.

As DeepSpeed's, a schedule made at iteration -1 sets the rate of iteration -1 (0: the first
optimizer step runs at rate 0), and each ``step()`` moves to the next iteration; the engine steps
it after each optimizer step. ``get_last_lr()``,
``state_dict()`` and ``load_state_dict()`` work as torch's schedulers'.
"""

import math

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "make"]


def _warmup_gamma(iteration, warmup_num_steps, warmup_type):
    if iteration < warmup_num_steps:
        if warmup_type == "log":
            return math.log(iteration + 1) / math.log(warmup_num_steps)
        return iteration / warmup_num_steps
    return 1.0


def _check_type(warmup_type):
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type {warmup_type!r} is not accepted; "
                         "accepted: log, linear")


class WarmupLR:
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then
    stays at warmup_max_lr. Without warmup_max_lr, each group's lr as the optimizer has it (as
    DeepSpeed's since 0.17; WarmupDecayLR keeps 0.001)."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        _check_type(warmup_type)
        self.optimizer = optimizer
        groups = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = self._per_group(warmup_min_lr, groups, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, groups, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        self._apply()

    def _apply(self):
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    @staticmethod
    def _per_group(value, groups, name):
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise ValueError(f"scheduler.params.{name}: {len(value)} values for {groups} "
                                 "parameter groups; accepted: one, or one per group")
            return [float(v) for v in value]
        return [float(value)] * groups

    def _gamma(self):
        return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self):
        if self.last_batch_iteration < 0:  # before its first step: the minimum, as DeepSpeed's
            return list(self.min_lrs)
        gamma = self._gamma()
        return [small + delta * gamma for small, delta in zip(self.min_lrs, self.delta_lrs)]

    def get_last_lr(self):
        return self._last_lr

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.step(state["last_batch_iteration"])


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = int(total_num_steps)
        if self.total_num_steps < warmup_num_steps:
            raise ValueError(f"scheduler.params.total_num_steps {total_num_steps} is less than "
                             f"warmup_num_steps {warmup_num_steps}; accepted: at least as many")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) /
                   max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR:
    """The optimizer's lr times a ratio: from warmup_min_ratio up to 1 over warmup_num_steps, then
    a cosine down to cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1):
        _check_type(warmup_type)
        self.optimizer = optimizer
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        if self.total_num_steps < self.warmup_num_steps:
            raise ValueError(f"scheduler.params.total_num_steps {total_num_steps} is less than "
                             f"warmup_num_steps {warmup_num_steps}; accepted: at least as many")
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        self._apply()

    def get_lr_ratio(self):
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            gamma = _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        done = i - self.warmup_num_steps + 1
        total = max(1, self.total_num_steps - self.warmup_num_steps)
        ratio = self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (
            1.0 + math.cos(math.pi * min(done, total) / total))
        return max(0.0, ratio)

    def get_lr(self):
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    get_last_lr = WarmupLR.get_last_lr
    _apply = WarmupLR._apply
    step = WarmupLR.step
    state_dict = WarmupLR.state_dict
    load_state_dict = WarmupLR.load_state_dict


def make(spec, optimizer):
    """The schedule a config's scheduler block names: {"type": ..., "params": {...}}."""
    kinds = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
             "WarmupCosineLR": WarmupCosineLR}
    try:
        return kinds[spec["type"]](optimizer, **spec["params"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"config: scheduler.params ({spec['type']}): {e}; accepted: "
                         "numbers for the rates and step counts, warmup_type log or "
                         "linear") from e
