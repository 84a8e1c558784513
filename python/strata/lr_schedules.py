"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
LRRangeTest), with its parameter names, defaults and formulas, over any optimizer with
``param_groups``.

As DeepSpeed's, a schedule made at iteration -1 sets the rate of iteration -1 (0: the first
optimizer step runs at rate 0), and each ``step()`` moves to the next iteration; the engine steps
it after each optimizer step. ``get_last_lr()``,
``state_dict()`` and ``load_state_dict()`` work as torch's schedulers'.
"""

import math
import warnings

__all__ = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "make"]


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


class OneCycle:
    """The 1cycle policy, as DeepSpeed's OneCycle: over cycle_first_step_size iterations lr
    rises from cycle_min_lr to cycle_max_lr while momentum (Adam's beta1) falls from
    cycle_max_mom to cycle_min_mom, then over cycle_second_step_size (default: as many) back
    (in stair_count flat stairs each, when given); after the cycle lr is cycle_min_lr, divided
    by 1 + decay_lr_rate x (iterations past the cycle / decay_step_size), and momentum
    cycle_max_mom times 1 + decay_mom_rate x the same (no decay where decay_step_size or the
    rate is 0). As DeepSpeed's, the betas it sets are (momentum, 0.99): the optimizer's beta2
    is replaced by 0.99; with an optimizer without betas (Adagrad) momentum is not cycled, said
    in a warning."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None,
                 cycle_first_stair_count=0, cycle_second_stair_count=None, decay_step_size=0,
                 cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        self.optimizer = optimizer
        groups = len(optimizer.param_groups)
        self.first = float(cycle_first_step_size)
        self.second = self.first if cycle_second_step_size is None \
            else float(cycle_second_step_size)
        if self.first <= 0 or self.second < 0:
            raise ValueError(f"scheduler.params: cycle_first_step_size {cycle_first_step_size} "
                             f"and cycle_second_step_size {cycle_second_step_size}; accepted: "
                             "the first above 0, the second at least 0")
        self.total = self.first + self.second
        self.first_stairs = int(cycle_first_stair_count)
        self.second_stairs = self.first_stairs if cycle_second_stair_count is None \
            else int(cycle_second_stair_count)
        self.decay_step_size = float(decay_step_size)
        self.min_lrs = WarmupLR._per_group(cycle_min_lr, groups, "cycle_min_lr")
        self.max_lrs = WarmupLR._per_group(cycle_max_lr, groups, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.min_moms = WarmupLR._per_group(cycle_min_mom, groups, "cycle_min_mom")
        self.max_moms = WarmupLR._per_group(cycle_max_mom, groups, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and not getattr(optimizer, "has_betas",
                                               "betas" in getattr(optimizer, "defaults", {})):
            warnings.warn(f"OneCycle: cycle_momentum is not taken: {type(optimizer).__name__} "
                          "has no betas (as DeepSpeed's, momentum is not cycled)",
                          stacklevel=2)
            self.cycle_momentum = False
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:  # (as DeepSpeed's: the minimum rate and momentum)
            self._set(list(self.min_lrs), [(m, 0.99) for m in self.min_moms])

    def _set(self, lrs, betas):
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        if self.cycle_momentum:
            for group, value in zip(self.optimizer.param_groups, betas):
                group["betas"] = value
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _scale(self):
        """Where in the cycle the next iteration is: 0 at its ends, 1 at its peak."""
        i = self.last_batch_iteration + 1
        x = 1.0 + i / self.total - math.floor(1 + i / self.total)
        rising = x <= self.first / self.total
        stairs = self.first_stairs if rising else self.second_stairs
        if stairs <= 0:
            return x * self.total / self.first if rising else \
                (x - 1) / (self.first / self.total - 1)
        at = i % self.total  # (stairs counted from the whole iteration, as DeepSpeed's)
        position = at * stairs / self.first if at <= self.first else \
            (self.total - at) * stairs / self.second
        return math.floor(position) / stairs

    def get_lr(self):
        if self.last_batch_iteration < self.total:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        past = (self.last_batch_iteration - self.total + 1) / self.decay_step_size
        return [low / (1 + self.decay_lr_rate * past) for low in self.min_lrs]

    def get_mom(self):
        """The betas of each group (momentum, 0.99), or None without cycle_momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total:
            scale = self._scale()
            return [(high - (high - low) * scale, 0.99)
                    for low, high in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return [(high, 0.99) for high in self.max_moms]
        past = (self.last_batch_iteration - self.total + 1) / self.decay_step_size
        return [(high * (1 + self.decay_mom_rate * past), 0.99) for high in self.max_moms]

    get_last_lr = WarmupLR.get_last_lr
    state_dict = WarmupLR.state_dict
    load_state_dict = WarmupLR.load_state_dict

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._set(self.get_lr(), self.get_mom())


class LRRangeTest:
    """The learning-rate range test, as DeepSpeed's LRRangeTest: lr is lr_range_test_min_lr
    times 1 + lr_range_test_step_rate x (iterations / lr_range_test_step_size), whole steps of
    it with lr_range_test_staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False,
                 last_batch_iteration=-1):
        self.optimizer = optimizer
        self.min_lrs = WarmupLR._per_group(lr_range_test_min_lr, len(optimizer.param_groups),
                                           "lr_range_test_min_lr")
        if isinstance(lr_range_test_step_size, bool) or \
                not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"scheduler.params.lr_range_test_step_size "
                             f"{lr_range_test_step_size!r}; accepted: a whole number above 0")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            WarmupLR._apply(self)

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]

    get_last_lr = WarmupLR.get_last_lr
    _apply = WarmupLR._apply
    step = WarmupLR.step
    state_dict = WarmupLR.state_dict
    load_state_dict = WarmupLR.load_state_dict


def make(spec, optimizer):
    """The schedule a config's scheduler block names: {"type": ..., "params": {...}}."""
    kinds = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
             "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
             "LRRangeTest": LRRangeTest}
    try:
        return kinds[spec["type"]](optimizer, **spec["params"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"config: scheduler.params ({spec['type']}): {e}; accepted: "
                         f"{spec['type']}'s parameters as DeepSpeed names them (OneCycle's "
                         "cycle_min_lr and cycle_max_lr are required), numbers for the rates "
                         "and step counts, warmup_type log or linear") from e
