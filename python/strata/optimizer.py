"""The optimizer the engine returns, and the optimizer's set-up from what initialize is given.

EngineOptimizer is torch's surface over the Runtime's optimizer (sched/runtime.h CreateOptimizer):
param_groups with their rates (for schedules), zero_grad, state_dict and load_state_dict in
torch's layout; its step() is the engine's. It refuses, in its groups, what the Runtime's
optimizer would not step with (check_groups). The functions read the optimizer's kind and
hyper-parameters from a client optimizer or the config (hyper_parameters), make the parameter
groups (param_groups), and take over a client optimizer and a schedule built on it (take_over,
adopt_schedule).

Thread safety: the engine's (one thread).
"""

import numbers
import struct
import weakref

import torch

from strata import checkpoints
from strata.parameters import read_state, set_weights

__all__ = ["EngineOptimizer", "adopt_schedule", "flatten_params", "hyper_parameters",
           "param_groups", "take_over"]


class _Group(dict):
    """A param group of the engine's optimizer: a rate set in it (lr, weight_decay, betas, as a
    schedule or a loop sets it) is said to `on_rate` (a weak reference to OptimizerStep.rate_set,
    which tells whether it was set between backward and step; weak: the step holds the
    optimizer)."""

    __slots__ = ("on_rate",)
    _RATES = frozenset(("lr", "weight_decay", "betas"))

    def _said(self, keys):
        if not self._RATES.isdisjoint(keys):
            on_rate = getattr(self, "on_rate", None)
            on_rate = on_rate() if on_rate is not None else None
            if on_rate is not None:
                on_rate()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._said((key,))

    def update(self, *args, **kwargs):
        given = dict(*args, **kwargs)
        super().update(given)
        self._said(given)

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, key, default=None):
        new = key not in self
        value = super().setdefault(key, default)
        if new:
            self._said((key,))
        return value

    def __reduce__(self):  # (a copy or a pickle is a plain dict: the watch stays the engine's)
        return dict, (dict(self),)


def betas_of(group):
    """A param group's betas as the optimizer steps with them (two floats, each at least 0 and
    below 1 once rounded to float32), or None where they are not that."""
    try:
        given = tuple(group["betas"])
    except TypeError:
        return None
    if len(given) != 2 or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) or
                                  torch.is_tensor(b) and b.numel() == 1 for b in given):
        return None
    values = tuple(float(b) for b in given)
    if not all(0.0 <= b < 1.0 and struct.unpack("f", struct.pack("f", b))[0] < 1.0
               for b in values):
        return None
    return values


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer the engine returns: torch's surface (param_groups with their lr, for
    schedulers; zero_grad; state_dict and load_state_dict in torch's layout) over the Runtime's
    optimizer. ``step()`` is the engine's."""

    def __init__(self, engine, groups, hyper):
        self._engine = weakref.ref(engine)  # the engine holds its optimizer, not the other way
        defaults = dict(lr=hyper["lr"], eps=hyper["eps"], weight_decay=hyper["weight_decay"])
        if hyper["kind"] != "adagrad":  # (Adagrad has none: a schedule cycling them is refused)
            defaults["betas"] = hyper["betas"]
        super().__init__(groups, defaults)
        # The betas, eps and decoupling the Runtime's optimizer was made with: it keeps eps and the
        # decoupling (check_groups); a group's betas are given with each step (a schedule
        # cycling momentum sets them), where the optimizer has betas (Adam's, Lion's).
        kind = hyper["kind"]
        self._made_with = (tuple(float(b) for b in hyper["betas"]) if kind != "adagrad" else None,
                           float(hyper["eps"]) if kind != "lion" else None,
                           bool(hyper["adamw"]) if kind == "adam" else None)
        self.param_groups[:] = [_Group(group) for group in self.param_groups]
        self._built = True

    def watch_rates(self, on_rate):
        """`on_rate()` (a bound method, held weakly) is called whenever a group's lr,
        weight_decay or betas is set."""
        for group in self.param_groups:
            group.on_rate = weakref.WeakMethod(on_rate)

    def add_param_group(self, param_group):
        """torch's, while the engine builds its groups; after, refused: the Runtime's optimizer
        was made over the engine's partitions, and a group added would never step."""
        if getattr(self, "_built", False):
            raise ValueError("optimizer.add_param_group after strata.initialize: the engine's "
                             "optimizer steps the parameters it was made with, and a group "
                             "added would never step; accepted: every parameter to train given "
                             "to initialize (in the optimizer's groups or model_parameters)")
        super().add_param_group(param_group)

    def step(self, closure=None):
        if "found_inf" in self.__dict__:  # set by torch.amp.GradScaler.step (below)
            raise RuntimeError(
                "torch.amp.GradScaler.step over strata's optimizer: the engine's gradients are "
                "not all in .grad, where the scaler would unscale them and check them for "
                "overflow; accepted: fp16 in the config (the engine's own dynamic loss scaling) "
                "with engine.backward(loss), or bf16")
        loss = closure() if closure is not None else None
        # (torch's step: the gradients it reads are those summed since the last zero_grad())
        self._engine_or_raise()._take_step(None, torch_sums=True)
        return loss

    # torch.amp.GradScaler.step, over an optimizer that says it scales by itself, sets its
    # grad_scale and found_inf on it and calls step() without its own unscaling and checks (which
    # would find no gradient in .grad at stages 2 and 3): a scaler is refused by name there.
    _step_supports_amp_scaling = True

    def _engine_or_raise(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine this optimizer steps is gone (closed or deleted)")
        return engine

    def zero_grad(self, set_to_none=True):
        self._engine_or_raise().zero_grad(set_to_none)

    # The state's tensors by optimizer, in torch's names (the Runtime keeps one state or two).
    _STATE_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",), "lion": ("exp_avg",)}

    def state_dict(self):
        """torch's layout ({"state": {index: {...}}, "param_groups": [...]}, parameters numbered
        in the groups' order), read from the Runtime's optimizer: each parameter's step count,
        its state in torch's names (exp_avg and exp_avg_sq for Adam), and its fp32 master
        weights ("master": the training dtype's weights are their rounding), all on the CPU, so
        that torch.save(optimizer.state_dict()) and load_state_dict() resume bit for bit (as
        accelerate's save_state and load_state do without strata.hf.for_accelerate). Across ranks:
        engine.save_checkpoint."""
        engine = self._engine_or_raise()
        if engine.ranks is not None:
            raise RuntimeError("optimizer.state_dict() across ranks: each rank holds a shard; "
                               "accepted: engine.save_checkpoint on every rank (accelerate's "
                               "save_state and prepare() read it: "
                               "strata.hf.for_accelerate(accelerator) first, whose prepare() "
                               "leaves the state where the engine keeps it and whose save_state "
                               "saves the engine's checkpoint)")
        engine._step.refuse_read_after_early_steps("optimizer.state_dict()")
        engine._take_edits()  # (the weights edited since the last step: in the master weights)
        engine.runtime.wait_for_early_steps()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        names = self._STATE_NAMES[engine.optimizer_kind]
        state = {}
        for e in engine.table.trained:
            master, first, second = read_state(engine.runtime, e)
            entry = {"step": torch.tensor(float(e.steps)), "master": master.view(e.shape)}
            for name, values in zip(names, (first, second)):
                entry[name] = values.view(e.shape)
            state[index[id(e.param)]] = entry
        groups = [dict({k: v for k, v in g.items() if k != "params"},
                       params=[index[id(p)] for p in g["params"]]) for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Loads state_dict()'s layout, or a torch optimizer's of the same kind over the same
        parameters (its state without master weights: they are then the parameters' weights as
        they are), all or none: every group's size, every state's names and shapes checked
        first, named when wrong. The groups' hyper-parameters (lr, weight_decay) are taken."""
        engine = self._engine_or_raise()
        if engine.ranks is not None:
            raise RuntimeError("optimizer.load_state_dict() across ranks: accepted: "
                               "engine.load_checkpoint")
        if engine._state.backward_since_step:
            raise RuntimeError("optimizer.load_state_dict() between backward and step (the "
                               "gradients are stepped from the state before it); accepted: "
                               "after step()")
        saved_groups = state_dict.get("param_groups", [])
        self.check_groups("optimizer.load_state_dict", ValueError, saved_groups)
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved_groups] != sizes:
            raise ValueError(f"optimizer.load_state_dict: the state's groups hold "
                             f"{[len(g['params']) for g in saved_groups]} parameters, this "
                             f"optimizer's {sizes}; accepted: a state of the same parameters")
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        names = self._STATE_NAMES[engine.optimizer_kind]
        state = {int(k): v for k, v in state_dict.get("state", {}).items()}
        for e in engine.table.trained:
            entry = state.get(index[id(e.param)])
            if entry is None:
                continue
            for name in ("step",) + names + (("master",) if "master" in entry else ()):
                value = entry.get(name)
                if value is None or (name != "step" and tuple(value.shape) != tuple(e.shape)):
                    raise ValueError(
                        f"optimizer.load_state_dict: {e.name}'s {name} is "
                        f"{'missing' if value is None else tuple(value.shape)}; accepted: "
                        f"{tuple(e.shape)} ({engine.optimizer_kind}: {', '.join(names)})")
        with checkpoints.loading_optimizer_state(engine._checkpoints, "optimizer.load_state_dict",
                                                 True):
            for e in engine.table.trained:
                entry = state.get(index[id(e.param)])
                if entry is not None and "master" in entry:
                    master = entry["master"].detach().reshape(-1).float().cpu()
                else:  # the master weights as they are (read only where not given)
                    master = read_state(engine.runtime, e)[0]
                if entry is not None:
                    moments = [torch.zeros(e.shard), torch.zeros(e.shard)]
                    for i, name in enumerate(names):
                        moments[i] = entry[name].detach().reshape(-1).float().cpu()
                else:  # never stepped: a fresh optimizer's state
                    moments = [torch.full((e.shard,), float(engine._initial_state)),
                               torch.zeros(e.shard)]
                engine.runtime.load_optimizer_state(e.gid, master.contiguous(),
                                                    moments[0].contiguous(),
                                                    moments[1].contiguous())
        for e in engine.table.trained:
            entry = state.get(index[id(e.param)])
            e.steps = int(entry["step"]) if entry is not None else 0
            if entry is not None and "master" in entry:
                set_weights(engine.runtime, e, entry["master"].reshape(-1).float())
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    @property
    def has_betas(self):
        """Whether the optimizer steps with betas (Adam's, Lion's; not Adagrad's): a group's are
        given with each of its steps."""
        return self._made_with[0] is not None

    def check_groups(self, where, error=RuntimeError, groups=None):
        """Refuses, in the param groups (the optimizer's, or `groups` about to be loaded), what the
        Runtime's optimizer would not step with: betas that are not two numbers in [0, 1) (a
        group's betas are given with each step: a schedule cycling momentum, OneCycleLR's, sets
        them), eps other than it was made with, amsgrad or maximize, L2 weight decay where it
        decouples it (torch's Adam) or the other way round. It keeps its own, and would step
        with them silently."""
        betas, eps, adamw = self._made_with
        for index, group in enumerate(self.param_groups if groups is None else groups):
            if betas is not None and "betas" in group and betas_of(group) is None:
                raise error(f"{where}: param group {index}'s betas are {group['betas']!r}; "
                            "accepted: two numbers, each at least 0 and below 1 (as float32, "
                            "which the optimizer steps with)")
            wrong = [f"eps {group['eps']} (made with {eps})" if "eps" in group and
                     eps is not None and float(group["eps"]) != eps else None,
                     "amsgrad" if group.get("amsgrad") else None,
                     "maximize" if group.get("maximize") else None,
                     f"decoupled_weight_decay {group['decoupled_weight_decay']} (made with "
                     f"{adamw})" if "decoupled_weight_decay" in group and
                     adamw is not None and
                     bool(group["decoupled_weight_decay"]) != adamw else None]
            wrong = [w for w in wrong if w]
            if wrong:
                raise error(f"{where}: param group {index} has {', '.join(wrong)}, which strata's "
                            "optimizer does not step with (it keeps what it was made with); "
                            "nothing was changed; accepted: the optimizer's own values")


def hyper_parameters(config, optimizer):
    """The optimizer's kind and hyper-parameters, from a client optimizer or the config."""
    hyper = dict(kind="adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 bias_correction=True, adamw=True, lr_decay=0.0,
                 initial_accumulator_value=0.0)
    if optimizer is not None and config.optimizer is not None:
        raise ValueError("strata.initialize: an optimizer was given both as an argument and "
                         "in the config's optimizer block; accepted: one of them")
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("strata.initialize: an optimizer factory is not supported; "
                             "accepted: a torch Adam/AdamW/Adagrad (or strata.optim's), or "
                             "the config's optimizer block")
        kinds = {"Adam": "adam", "AdamW": "adam", "CpuAdam": "adam", "CpuAdamW": "adam",
                 "DeepSpeedCPUAdam": "adam", "Adagrad": "adagrad", "CpuAdagrad": "adagrad",
                 "CpuLion": "lion"}
        name = type(optimizer).__name__
        if name not in kinds:
            raise ValueError(f"strata.initialize: optimizer {name} is not supported; "
                             "accepted: Adam, AdamW, Adagrad (torch's or strata.optim's), "
                             "strata.optim.CpuLion")
        group = optimizer.param_groups[0]
        if group.get("amsgrad", False):
            raise ValueError("strata.initialize: optimizer with amsgrad=True is not supported")
        hyper.update(kind=kinds[name], lr=float(group["lr"]),
                     weight_decay=float(group["weight_decay"]),
                     adamw=name in ("AdamW", "CpuAdamW") or getattr(optimizer, "adamw_mode",
                                                                   False),
                     bias_correction=bool(group.get("bias_correction", True)))
        for key in ("betas", "eps", "lr_decay", "initial_accumulator_value"):
            if key in group:
                hyper[key] = tuple(group[key]) if key == "betas" else float(group[key])
        return hyper
    if config.optimizer is not None:
        hyper.update(config.optimizer)
        return hyper
    raise ValueError("strata.initialize: no optimizer: give one, or an optimizer block in "
                     "the config (type Adam, AdamW, Adagrad or Lion)")


def param_groups(optimizer, model_parameters, hyper, trained):
    """The optimizer's parameter groups, each with its own lr, weight_decay and betas (the
    no-decay group of biases and norms most fine-tuning scripts make; each given with its
    group's steps): the client optimizer's groups, else the groups given as model_parameters
    (dicts with "params" and any of "lr", "weight_decay" and "betas", the config's values for
    the rest), else one group. Other hyper-parameters (eps, lr_decay) cannot differ between
    groups: the Runtime's optimizer has one set. Sets each trained entry's group_index."""
    if optimizer is not None:
        given, source = optimizer.param_groups, "the optimizer's param group"
    elif model_parameters is not None and any(isinstance(g, dict) for g in model_parameters):
        given, source = model_parameters, "model_parameters group"
    else:
        return [dict({"params": [e.param for e in trained], "lr": hyper["lr"],
                      "weight_decay": hyper["weight_decay"]},
                     **({"betas": tuple(hyper["betas"])} if hyper["kind"] != "adagrad" else {}))]
    by_param = {id(e.param): e for e in trained}
    groups = []
    for index, group in enumerate(given):
        if not isinstance(group, dict):
            raise ValueError(f"strata.initialize: {source} {index} is a "
                             f"{type(group).__name__}; accepted: every group a dict with "
                             "\"params\", or no groups (parameters alone)")
        for key in ("eps", "lr_decay"):
            if key in group and tuple(_as_tuple(group[key])) != tuple(_as_tuple(hyper[key])):
                raise ValueError(
                    f"strata.initialize: {source} {index} has {key} {group[key]} where the "
                    f"optimizer has {hyper[key]}; accepted: groups that differ in lr, "
                    "weight_decay and betas only")
        params = [p for p in group["params"] if id(p) in by_param]
        for p in params:
            by_param[id(p)].group_index = len(groups)
        ours = {"params": params, "lr": float(group.get("lr", hyper["lr"])),
                "weight_decay": float(group.get("weight_decay", hyper["weight_decay"]))}
        if hyper["kind"] != "adagrad":
            ours["betas"] = group.get("betas", tuple(hyper["betas"]))
        groups.append(ours)
    missing = [e.name for e in trained if not any(
        e.param is p for g in groups for p in g["params"])]
    if missing:
        raise ValueError(f"strata.initialize: trainable parameters not in the optimizer: "
                         f"{', '.join(missing[:5])}")
    return groups


def take_over(engine_optimizer, client):
    """The optimizer given to initialize is the engine's from then on, as DeepSpeed's wraps
    it: its param groups become the engine's optimizer's (each keeping the client's other
    keys: a schedule's initial_lr), so a schedule built on it before initialize and stepped
    by the user sets the rates the engine steps with; and its own step() is refused by name
    (it would step the parameters apart from the engine, or nothing)."""
    for index, (ours, theirs) in enumerate(zip(engine_optimizer.param_groups,
                                               client.param_groups)):
        ours.update({k: v for k, v in theirs.items() if k != "params" and k not in ours})
        client.param_groups[index] = ours

    def step(*args, **kwargs):
        raise RuntimeError(
            f"{type(client).__name__}.step() of the optimizer given to strata.initialize: "
            "the engine steps it now; accepted: the optimizer initialize returned "
            "(optimizer.step()), or engine.step()")
    client.step = step


def adopt_schedule(engine_optimizer, schedule, client):
    """A schedule built on the client's optimizer (transformers'
    get_linear_schedule_with_warmup(optimizer, ...) before initialize) sets the rates of
    that optimizer, which the engine does not step: it is moved onto the engine's optimizer,
    whose groups take the client's as the schedule left them (its initial_lr, and lr at the
    schedule's first step)."""
    bound = getattr(schedule, "optimizer", None)
    if bound is None or bound is engine_optimizer:
        return
    if bound is not client:
        raise ValueError("strata.initialize: lr_scheduler sets the rates of an optimizer that "
                         "was not given to initialize; accepted: a schedule of the optimizer "
                         "given, of the engine's optimizer (a callable taking it), or none")
    for ours, theirs in zip(engine_optimizer.param_groups, client.param_groups):
        ours.update({k: v for k, v in theirs.items() if k != "params"})

    def rebind(s):  # SequentialLR and ChainedScheduler step schedules of their own
        if getattr(s, "optimizer", None) is client:
            s.optimizer = engine_optimizer
        for inner in getattr(s, "_schedulers", ()):
            rebind(inner)
    rebind(schedule)


def flatten_params(params):
    for item in params:
        if isinstance(item, dict):
            yield from item["params"]
        else:
            yield item


def _as_tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)
