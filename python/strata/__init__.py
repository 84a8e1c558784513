"""strata: a memory-tiering offload runtime for training models larger than the GPU.

The package is strata's front for PyTorch. What is here today:

* ``strata.initialize(model=..., config=...)``: DeepSpeed's shape, returning (engine, optimizer,
  dataloader, lr_scheduler); the engine runs ZeRO stages 0-3 on one process over strata's Runtime
  (strata.engine says how), with DeepSpeed's config keys (strata.config says which).
  ``strata.check_config(config)`` checks a config as initialize reads it, before a model is built.

* ``strata.init(config)``: a context that builds a model without materializing it (each large
  parameter a partition as it is made), as DeepSpeed's zero.Init (strata.zero_init says how);
  ``engine.save_checkpoint``/``load_checkpoint`` and ``engine.load_pretrained`` stream state in and
  out one tensor at a time (strata.checkpoints, strata.pretrained), and ``strata.zero_to_fp32``
  consolidates a checkpoint.

* ``strata.optim``: ``CpuAdam``, ``CpuAdamW``, ``CpuAdagrad`` and ``CpuLion``,
  ``torch.optim.Optimizer`` s over CPU tensors backed by strata's vectorized CPU kernels (drop-ins
  for torch's AdamW and Adagrad, as DeepSpeed's DeepSpeedCPUAdam, DeepSpeedCPUAdagrad and
  DeepSpeedCPULion are).

* ``strata.safe_get_full_grad(p)``, ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``,
  ``safe_set_full_grad``, ``safe_set_full_fp32_param``, ``safe_set_full_optimizer_state`` and
  their ``_local_`` variants:
  DeepSpeed's deepspeed.utils functions of the same names, one parameter's gradient, fp32 master
  weights and optimizer state read or set whole where the engine keeps them (strata.param_state).

* ``strata.TiledLinear`` and ``strata.tile_linears``: memory-centric tiling (strata.tiling), a
  linear layer cut into tiles lent one at a time, so the device needs a tile, not a layer.

* ``strata.hf`` (imported on its own: it imports transformers): ``strata.hf.Trainer`` and
  ``with_strata(cls)``, transformers' Trainer (TRL's SFTTrainer too) trained through strata.

Importing strata puts stand-ins for torch.nn.utils' clipping functions in place: over an
engine's parameters ``clip_grad_norm_`` is the engine's (its gradients are not in ``.grad``), over
any others each is torch's own.

Messages: warnings through Python's ``warnings`` (``strata.StrataWarning``), the engine's step
lines through the ``strata`` logger (``logging.getLogger("strata")``, INFO); nothing is printed on
stdout.

Errors from strata's C++ core are ``strata.Error`` (a ``RuntimeError``) with ``code`` (the
status's name, e.g. ``"RESOURCE_EXHAUSTED"``) and ``errno``; bad arguments are
``strata.InvalidArgumentError``, which is also a ``ValueError``.
"""

import torch as _torch

# torch 2.4 and later (the module hooks with keyword arguments, post-accumulate-grad hooks and
# torch.utils.checkpoint's non-reentrant default the front relies on); CI tests the pinned one.
_TORCH = tuple(int(part) for part in _torch.__version__.split("+")[0].split(".")[:2])
if _TORCH < (2, 4):
    raise ImportError(f"strata needs torch 2.4 or later; this is torch {_torch.__version__} "
                      "(scripts/python-env.sh makes the project's environment, with torch 2.11.0)")

from strata._strata import Error, InvalidArgumentError  # noqa: E402
from strata import checkpointing
from strata import optim
from strata import lr_schedules
from strata.config import ConfigError
from strata.engine import (Engine, StrataWarning, check_config, from_pretrained, initialize,
                           register_external_parameter)
from strata.gathered import GatheredParameters
from strata.param_state import (safe_get_full_fp32_param, safe_get_full_grad,
                                safe_get_full_optimizer_state, safe_get_local_fp32_param,
                                safe_get_local_grad, safe_get_local_optimizer_state,
                                safe_set_full_fp32_param, safe_set_full_grad,
                                safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                safe_set_local_grad, safe_set_local_optimizer_state)
from strata.tiling import TiledLinear, tile_linears
from strata.zero_init import init

__all__ = ["check_config", "checkpointing", "ConfigError", "Engine", "Error", "from_pretrained",
           "GatheredParameters",
           "InvalidArgumentError", "init",
           "initialize", "lr_schedules", "optim", "register_external_parameter",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "StrataWarning", "TiledLinear", "tile_linears"]
