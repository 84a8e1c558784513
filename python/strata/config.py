"""The trainer's part of a DeepSpeed config, read as DeepSpeed writes it.

``TrainConfig.parse(config)`` takes a dict or the path of a JSON file. It reads the keys the
engine acts on (below) and checks each value, naming the key by its full path and what is
accepted; the rest of the config (``zero_optimization``, ``aio``, ``strata``, and any other key)
goes to strata's C++ reader (tiering/runtime_config.h), which refuses a key that is neither
DeepSpeed's nor strata's, naming the closest known one, and warns of DeepSpeed keys strata does not
act on. Read here:

  train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
      (train_batch_size = micro batch x accumulation x the job's ranks; given all three, they
      must agree)
  gradient_clipping                  (0: off; absent: off, where DeepSpeed 0.19.3 and later clip
      at 1.0: the engine says so at the first step nothing clips)
  bf16.enabled with check_grad_overflow (absent: false, plain torch's: a step whose gradients
      are not finite is taken unless gradient_clipping takes their norm; true: skipped, as
      fp16's; DeepSpeed's default is true)
  fp16.enabled with loss_scale (0: dynamic), initial_scale_power (16),
      loss_scale_window (1000), hysteresis (2), min_loss_scale (1)
  optimizer.type Adam | AdamW | CPUAdam (DeepSpeed's spellings, any case) with optimizer.params
      lr, betas, eps, weight_decay, bias_correction, adam_w_mode, amsgrad=false; Adagrad with lr,
      lr_decay, eps, weight_decay, initial_accumulator_value; Lion with lr, betas, weight_decay
  scheduler.type WarmupLR | WarmupDecayLR | WarmupCosineLR | OneCycle | LRRangeTest and
      scheduler.params (strata.lr_schedules)
  data_types.grad_accum_dtype        fp32 (the default) | the training dtype (bf16, fp16): the
      dtype micro-batches' gradients are summed in between optimizer steps, at every stage
  steps_per_print, zero_allow_untested_optimizer
  activation_checkpointing (strata.checkpointing.configure reads it)
"""

import json
import os

import torch

__all__ = ["TORCH_DTYPES", "TrainConfig", "ConfigError"]

# The training dtypes a config names (bf16, fp16, else fp32; data_types.grad_accum_dtype), in
# torch's terms.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Keys this module reads; everything else goes to the C++ reader.
TRAINER_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "gradient_clipping", "bf16", "bfloat16", "fp16",
                "optimizer", "scheduler", "steps_per_print", "zero_allow_untested_optimizer",
                "activation_checkpointing", "data_types")


class ConfigError(ValueError):
    """A config value strata refuses; the message names the key and what is accepted."""


def _bad(path, what):
    raise ConfigError(f"config: {path}: {what}")


def _number(block, key, path, default, low=None, high=None, integer=False):
    if key not in block:
        return default
    value = block[key]
    full = f"{path}{key}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _bad(full, f"{value!r} is not a number; accepted: "
                   f"{'an integer' if integer else 'a number'}"
                   f"{'' if low is None else f' from {low}'}{'' if high is None else f' to {high}'}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            _bad(full, f"{value!r} is not a whole number")
        value = int(value)
    if value != value or (low is not None and value < low) or (high is not None and value > high):
        accepted = f"from {low} to {high}" if high is not None else f"{low} or more"
        _bad(full, f"{value!r} is out of range; accepted: {accepted}")
    return value


def _bool(block, key, path, default):
    if key not in block:
        return default
    if not isinstance(block[key], bool):
        _bad(f"{path}{key}", f"{block[key]!r} is not accepted; accepted: true or false")
    return block[key]


def _object(config, key):
    value = config.get(key, {})
    if not isinstance(value, dict):
        _bad(key, f"{value!r} is not accepted; accepted: a JSON object")
    return value


def _check_keys(block, path, known):
    for key in block:
        if key not in known:
            _bad(f"{path}{key}", f"unknown key; accepted here: {', '.join(sorted(known))}")


OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "cpuadam": "Adam", "adagrad": "Adagrad",
              "cpuadagrad": "Adagrad", "lion": "Lion", "cpulion": "Lion"}
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad",
              "torch_adam", "fused")
OPTIMIZER_KEYS = {"Adam": _ADAM_KEYS, "AdamW": _ADAM_KEYS,
                  "Adagrad": ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"),
                  "Lion": ("lr", "betas", "weight_decay")}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


class TrainConfig:
    """What the engine reads of a DeepSpeed config (see the module's docstring)."""

    def __init__(self):
        self.micro_batch = 1
        self.accumulation = 1
        self.clipping = 0.0
        self.check_grad_overflow = False  # bf16.check_grad_overflow
        self.dtype = "float32"  # or "bfloat16", "float16"
        self.grad_accum_dtype = "float32"  # or the training dtype (data_types.grad_accum_dtype)
        self.loss_scale = 0.0  # fp16: 0 is dynamic
        self.initial_scale_power = 16
        self.loss_scale_window = 1000
        self.hysteresis = 2
        self.min_loss_scale = 1.0
        self.consecutive_hysteresis = False
        self.optimizer = None  # {"kind", "lr", "betas", ...}: the optimizer block read, or None
        self.scheduler = None  # {"type": ..., "params": {...}} or None
        self.steps_per_print = 10
        self.activation_checkpointing = None  # the block, for strata.checkpointing
        self.runtime = {}  # what goes to the C++ reader
        self.source = {}  # the config as given

    @property
    def checks_overflow(self):
        """Whether every step looks for gradients that are not finite, and skips the step when
        one is: fp16 (its loss scale), bf16 with bf16.check_grad_overflow. (Otherwise only a step
        whose norm gradient_clipping takes is skipped so.)"""
        return self.dtype == "float16" or (self.dtype == "bfloat16" and self.check_grad_overflow)

    @staticmethod
    def load(config):
        """A dict, or the path of a JSON file (str or os.PathLike)."""
        if isinstance(config, (str, os.PathLike)):
            try:
                with open(config, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ConfigError(f"config: cannot read {os.fspath(config)!r}: {e.strerror}") from e
            try:
                config = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config: {os.fspath(config)!r} is not JSON: {e}") from e
        if not isinstance(config, dict):
            raise ConfigError(f"config: a {type(config).__name__} is not accepted; accepted: a dict "
                              "or the path of a JSON file")
        return config

    @classmethod
    def parse(cls, config, world_size=1):
        config = cls.load(config)
        c = cls()
        c.source = config  # as given (a checkpoint keeps it)
        c.micro_batch = _number(config, "train_micro_batch_size_per_gpu", "", None, 1, None, True)
        c.accumulation = _number(config, "gradient_accumulation_steps", "", None, 1, None, True)
        batch = _number(config, "train_batch_size", "", None, 1, None, True)
        given = batch
        if batch is not None and world_size > 1:
            if batch % world_size:
                _bad("train_batch_size", f"{batch} is not a multiple of the job's {world_size} "
                                         "ranks")
            batch //= world_size
        per_rank = "" if world_size == 1 else f" (over {world_size} ranks, {batch} a rank)"
        if batch is not None:
            if c.micro_batch is None and c.accumulation is None:
                c.micro_batch, c.accumulation = batch, 1
            elif c.micro_batch is None:
                if batch % c.accumulation:
                    _bad("train_batch_size", f"{given}{per_rank} is not a multiple of "
                                             f"gradient_accumulation_steps {c.accumulation}")
                c.micro_batch = batch // c.accumulation
            elif c.accumulation is None:
                if batch % c.micro_batch:
                    _bad("train_batch_size", f"{given}{per_rank} is not a multiple of "
                                             f"train_micro_batch_size_per_gpu {c.micro_batch}")
                c.accumulation = batch // c.micro_batch
            elif batch != c.micro_batch * c.accumulation:
                _bad("train_batch_size", f"{given} != train_micro_batch_size_per_gpu "
                                         f"{c.micro_batch} x gradient_accumulation_steps "
                                         f"{c.accumulation} x {world_size} "
                                         f"rank{'s' if world_size > 1 else ''}")
        c.micro_batch = c.micro_batch or 1
        c.accumulation = c.accumulation or 1
        c.clipping = float(_number(config, "gradient_clipping", "", 0.0, 0.0))
        c.steps_per_print = _number(config, "steps_per_print", "", 10, 1, None, True)
        _bool(config, "zero_allow_untested_optimizer", "", False)

        if "bf16" in config and "bfloat16" in config:
            _bad("bfloat16", "give bf16 or bfloat16 (DeepSpeed's older name), not both")
        bf16 = _object(config, "bf16") if "bf16" in config else _object(config, "bfloat16")
        if bf16:
            _check_keys(bf16, "bf16.", ("enabled", "immediate_grad_update", "check_grad_overflow"))
        fp16 = _object(config, "fp16")
        if fp16:
            _check_keys(fp16, "fp16.", ("enabled", "auto_cast", "loss_scale", "initial_scale_power",
                                        "loss_scale_window", "hysteresis",
                                        "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"))
        bf16_on = _bool(bf16, "enabled", "bf16.", False)
        fp16_on = _bool(fp16, "enabled", "fp16.", False)
        if bf16_on and fp16_on:
            _bad("fp16.enabled", "bf16 and fp16 are both enabled; accepted: one of them")
        check_grad_overflow = _bool(bf16, "check_grad_overflow", "bf16.", False)
        if bf16_on:
            c.dtype = "bfloat16"
            c.check_grad_overflow = check_grad_overflow
        if fp16_on:
            c.dtype = "float16"
            if _bool(fp16, "auto_cast", "fp16.", False):
                _bad("fp16.auto_cast", "true is not supported; accepted: false")
            if _bool(fp16, "fp16_master_weights_and_grads", "fp16.", False):
                _bad("fp16.fp16_master_weights_and_grads", "true is not supported (strata keeps "
                     "fp32 master weights and sums gradients in grad_accum_dtype); accepted: "
                     "false")
            c.loss_scale = float(_number(fp16, "loss_scale", "fp16.", 0.0, 0.0))
            c.initial_scale_power = _number(fp16, "initial_scale_power", "fp16.", 16, 0, 64, True)
            c.loss_scale_window = _number(fp16, "loss_scale_window", "fp16.", 1000, 1, None, True)
            c.hysteresis = _number(fp16, "hysteresis", "fp16.", 2, 1, None, True)
            c.min_loss_scale = float(_number(fp16, "min_loss_scale", "fp16.", 1.0, 0.0))
            if c.min_loss_scale <= 0:
                _bad("fp16.min_loss_scale", f"{c.min_loss_scale} is not accepted; accepted: > 0")
            c.consecutive_hysteresis = _bool(fp16, "consecutive_hysteresis", "fp16.", False)

        data_types = _object(config, "data_types")
        if data_types:
            _check_keys(data_types, "data_types.", ("grad_accum_dtype",))
            names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
            given = data_types.get("grad_accum_dtype", "fp32")
            given = "fp32" if given is None else given
            accepted = sorted({"fp32", {v: k for k, v in names.items()}[c.dtype]})
            if given not in accepted:
                _bad("data_types.grad_accum_dtype",
                     f"{given!r} is not accepted with {c.dtype} training; accepted: "
                     f"{' or '.join(repr(a) for a in accepted)}")
            c.grad_accum_dtype = names[given]

        if "optimizer" in config:
            opt = _object(config, "optimizer")
            _check_keys(opt, "optimizer.", ("type", "params"))
            kind = opt.get("type")
            if not isinstance(kind, str) or kind.lower() not in OPTIMIZERS:
                _bad("optimizer.type", f"{kind!r} is not supported; accepted: Adam, AdamW, "
                                       "CPUAdam, Adagrad, Lion")
            kind = OPTIMIZERS[kind.lower()]
            params = opt.get("params", {})
            if not isinstance(params, dict):
                _bad("optimizer.params", "accepted: a JSON object")
            p = "optimizer.params."
            _check_keys(params, p, OPTIMIZER_KEYS[kind])
            if params.get("amsgrad", False):
                _bad("optimizer.params.amsgrad", "true is not supported; accepted: false")
            betas = params.get("betas", [0.9, 0.999])
            if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and
                    all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
                _bad("optimizer.params.betas", f"{betas!r}; accepted: two numbers in [0, 1)")
            c.optimizer = {
                "kind": {"Adam": "adam", "AdamW": "adam", "Adagrad": "adagrad",
                         "Lion": "lion"}[kind],
                "lr": float(_number(params, "lr", p, 1e-2 if kind == "Adagrad" else 1e-3, 0.0)),
                "betas": (float(betas[0]), float(betas[1])),
                "eps": float(_number(params, "eps", p, 1e-10 if kind == "Adagrad" else 1e-8,
                                     0.0)),
                # 0, as DeepSpeed's own optimizers default to; but with torch_adam in AdamW's
                # mode DeepSpeed makes torch.optim.AdamW, whose default is 0.01
                "weight_decay": float(_number(
                    params, "weight_decay", p,
                    0.01 if kind in ("Adam", "AdamW") and params.get("torch_adam") is True and
                    (kind == "AdamW" or params.get("adam_w_mode", True) is True) else 0.0, 0.0)),
                "bias_correction": _bool(params, "bias_correction", p, True),
                "adamw": kind == "AdamW" or _bool(params, "adam_w_mode", p, True),
                "lr_decay": float(_number(params, "lr_decay", p, 0.0, 0.0)),
                "initial_accumulator_value": float(
                    _number(params, "initial_accumulator_value", p, 0.0, 0.0)),
            }
            if c.optimizer["eps"] <= 0:
                _bad("optimizer.params.eps", "accepted: a number > 0")

        if "scheduler" in config:
            sch = _object(config, "scheduler")
            _check_keys(sch, "scheduler.", ("type", "params"))
            if sch.get("type") not in SCHEDULERS:
                _bad("scheduler.type", f"{sch.get('type')!r} is not supported; accepted: "
                                       f"{', '.join(SCHEDULERS)}")
            params = sch.get("params", {})
            if not isinstance(params, dict):
                _bad("scheduler.params", "accepted: a JSON object")
            c.scheduler = {"type": sch["type"], "params": params}

        if "activation_checkpointing" in config:
            c.activation_checkpointing = {"activation_checkpointing":
                                          _object(config, "activation_checkpointing")}
        c.runtime = {k: v for k, v in config.items() if k not in TRAINER_KEYS}
        return c
