"""strata: a memory-tiering offload runtime for training models larger than the GPU.

The package is strata's front for PyTorch. What is here today:

* ``strata.optim``: ``CpuAdam`` and ``CpuAdamW``, ``torch.optim.Optimizer`` s over CPU tensors
  backed by strata's vectorized CPU Adam (a drop-in for ``torch.optim.AdamW``, as DeepSpeed's
  ``DeepSpeedCPUAdam`` is).

Errors from strata's C++ core are ``strata.Error`` (a ``RuntimeError``) with ``code`` (the
status's name, e.g. ``"RESOURCE_EXHAUSTED"``) and ``errno``; bad arguments are
``strata.InvalidArgumentError``, which is also a ``ValueError``.
"""

from strata._strata import Error, InvalidArgumentError
from strata import optim

__all__ = ["Error", "InvalidArgumentError", "optim"]
