"""The precision plugin: the engine's training dtype and its backward and optimizer step.

Part of strata.lightning (its module docstring says what the Trainer gets).
"""

import contextlib

import torch

from strata.config import TORCH_DTYPES

_PRECISIONS = {"32-true": "float32", "32": "float32", "bf16-mixed": "bfloat16",
               "bf16-true": "bfloat16", "16-mixed": "float16", "16-true": "float16"}


class _PrecisionMixin:
    """The training dtype is the engine's (fp32 master weights in strata's optimizer); backward
    and the optimizer step are the engine's. `precision` None: the Trainer's (resolved by the
    strategy)."""

    def __init__(self, precision=None):
        super().__init__()
        self._from_trainer = precision is None
        self.precision = "32-true"
        if precision is not None:
            self.precision = _check_precision(precision)
        self._strategy = None  # the strategy driving it (weakly)
        self._backwards = 0  # backwards since the engine's last step()
        self._stepping = False  # inside optimizer_step (the closure's backward ends a window)

    @property
    def dtype_name(self):
        return _PRECISIONS[self.precision]

    def _engine(self):
        strategy = self._strategy() if self._strategy is not None else None
        engine = strategy.engine if strategy is not None else None
        if engine is None:
            raise RuntimeError("StrataPrecision: no strata engine (the strategy was not set up "
                               "for training)")
        return engine

    def convert_module(self, module):
        return module  # the engine casts the parameters

    def convert_input(self, data):
        dtype = TORCH_DTYPES[self.dtype_name]
        if dtype == torch.float32:
            return data
        from torch.utils._pytree import tree_map
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and
                        t.is_floating_point() else t, data)

    def tensor_init_context(self):
        return contextlib.nullcontext()

    def module_init_context(self):
        return contextlib.nullcontext()

    def forward_context(self):
        return contextlib.nullcontext()

    def backward(self, tensor, model, optimizer, *args, **kwargs):
        """The engine's backward of the loss Lightning made (already divided by
        accumulate_grad_batches, as plain Lightning's: the engine does not divide again). In
        automatic optimization a backward outside optimizer_step is a micro-batch inside an
        accumulation window: the engine's step() counts it at once."""
        engine = self._engine()
        automatic = model.automatic_optimization
        engine.set_gradient_accumulation_boundary(self._stepping or not automatic)
        engine.backward(tensor, *args, scale_wrt_gas=False, **kwargs)
        self._backwards += 1
        if automatic and not self._stepping:
            engine.step()
            self._backwards = 0

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("StrataStrategy: LBFGS is not supported; accepted: Adam, AdamW, "
                             "Adagrad (torch's or strata.optim's), strata.optim.CpuLion")
        self._stepping = True
        try:
            result = closure()
        finally:
            self._stepping = False
        engine = self._engine()
        _tell_hidden_gradients(engine, model)
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise ValueError("StrataStrategy: training_step returned None at an optimizer step "
                             "(no backward): the engine cannot step the micro-batches before "
                             "it without one; accepted: a loss from every training_step, as "
                             "DeepSpeedStrategy requires (or manual optimization)")
        if self._backwards == 0:
            # Manual optimization's step() with no backward since the last: nothing to step, as
            # a torch optimizer steps nothing without gradients.
            return result
        engine.step()
        self._backwards = 0
        engine.optimizer._opt_called = True  # for torch's schedules stepped by Lightning
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
        """Lightning's clipping. The Trainer's gradient_clip_val is the engine's config (it
        clips inside its step, by the global norm): a call with that value adds nothing.
        Another (manual optimization's self.clip_gradients, a configure_gradient_clipping of
        one's own) clips through the engine as torch.nn.utils.clip_grad_norm_ over its
        parameters does: the step that follows is clipped by it, as plain Lightning's clipping
        of .grad in place clips it. By value: torch's clip_grad_value_ over .grad, where the
        gradients are torch's .grad until the step (stages 0-1 in one process, not fp16, no
        grad_accum_dtype sum apart; refused by name elsewhere)."""
        if not clip_val or float(clip_val) <= 0:
            return
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
                        or "norm")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, float(clip_val))
            return
        if algorithm != "norm":
            raise ValueError(f"StrataStrategy: clip_gradients(gradient_clip_algorithm="
                             f"{algorithm!r}) is not supported; accepted: 'norm' or 'value'")
        engine = self._engine()
        if float(clip_val) == engine.gradient_clipping():
            return  # the engine's step clips by it
        torch.nn.utils.clip_grad_norm_(params, float(clip_val))


def _check_precision(precision):
    text = str(precision)
    if text not in _PRECISIONS:
        raise ValueError(f"StrataStrategy: precision={precision!r} is not supported; accepted: "
                         "'32-true', 'bf16-mixed', '16-mixed' (and 'bf16-true', '16-true': the "
                         "same training, fp32 master weights in strata's optimizer)")
    return "32-true" if text == "32" else text


def _tell_hidden_gradients(engine, model):
    """Where an on_before_optimizer_step of the user's own (the LightningModule's, a callback's)
    is about to run while the engine holds gradients that are not in .grad (reduced into its
    shards or partitions, as under DeepSpeedStrategy), says once what it sees there: .grad None
    (Lightning's grad_norm logs nothing) or, at stage 3, only the small parameters' (a partial
    norm), and what reads or sets them instead."""
    def own(obj):
        hook = getattr(type(obj), "on_before_optimizer_step", None)
        where = getattr(hook, "__module__", "") or ""
        return hook is not None and not where.startswith(("lightning.", "pytorch_lightning."))

    trainer = getattr(model, "_trainer", None)
    users = [type(model).__name__] if own(model) else []
    users += [type(c).__name__ for c in (getattr(trainer, "callbacks", None) or []) if own(c)]
    if not users:
        return
    held = [e for e in engine.table.trained if e.param.grad is None and e.gradient_held()]
    if held:
        engine._warn(
            f"StrataStrategy: on_before_optimizer_step ({', '.join(users)}) runs while the engine "
            f"holds {len(held)} of the {len(engine.table.trained)} trained parameters' gradients "
            "outside .grad (reduced into its shards or partitions, as DeepSpeedStrategy's are): "
            ".grad reads None there (Lightning's grad_norm leaves them out); accepted: the "
            "global norm from torch.nn.utils.clip_grad_norm_(self.parameters(), float('inf')) "
            "(the engine's), strata.safe_get_full_grad(p) / safe_set_full_grad(p, t) for one "
            "parameter's gradient, gradient_clip_val to clip")

