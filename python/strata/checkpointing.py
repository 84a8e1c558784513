"""Activation checkpointing, as DeepSpeed's ``deepspeed.checkpointing``.

    from strata import checkpointing
    checkpointing.configure(cpu_checkpointing=True)       # or from a config's block, below
    y = checkpointing.checkpoint(block, x)                # instead of y = block(x)

``checkpoint(function, *args)`` runs `function` without keeping its activations; backward runs it
again (with the random-number state of the first run, so dropout draws the same mask) and
differentiates that. Only the inputs are kept: with ``cpu_checkpointing`` they are kept in host
memory and brought back for backward (DeepSpeed's checkpoint_in_cpu). Under ZeRO stage 3 the
function's modules have their parameters lent again for the recomputation, as for any forward.

Where the host copies live: with an engine (``strata.initialize``), each floating-point input is a
partition of the engine's host tier, within ``strata.host_budget_bytes`` (pinned memory the
Runtime accounts for; a checkpoint whose inputs do not fit raises strata.Error naming the budget),
dropped once backward has brought it back, or when the graph is freed without a backward. Other
inputs (token ids, masks) and checkpoints run without an engine keep torch's host copies, outside
strata's budget. Under ``torch.no_grad`` nothing is kept.

The config's ``activation_checkpointing`` block (DeepSpeed's keys) is read by ``configure``:
cpu_checkpointing is acted on; partition_activations, contiguous_memory_optimization,
number_checkpoints, synchronize_checkpoint_boundary and profile are DeepSpeed's multi-GPU or
profiling knobs, accepted and warned of once.

Thread safety: the settings are per process, as DeepSpeed's.
"""

import contextlib
import warnings

import torch

__all__ = ["checkpoint", "configure", "is_configured", "read_config", "reset", "use_host_store"]

_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
         "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
_settings = {"cpu_checkpointing": False, "configured": False}
# Where cpu_checkpointing keeps floating-point inputs: an engine's host tier (set by the engine;
# an object with keep(tensor) -> held or None, and bring(held, device) -> tensor), else None.
_store = {"host": None}


def use_host_store(store):
    """Makes `store` (an engine's host tier, or None) where cpu_checkpointing keeps inputs."""
    _store["host"] = store


def host_store_of(engine):
    """Whether cpu_checkpointing keeps inputs in `engine`'s host tier now."""
    store = _store.get("host")
    return store is not None and store.engine() is engine


def read_config(deepspeed_config, cpu_override=None):
    """A config's activation_checkpointing block read, nothing set: (cpu_checkpointing, what is
    said of the keys strata does not act on). `cpu_override` (configure's keyword arguments), when
    not None, stands for the block's cpu_checkpointing. A bad block raises ValueError naming it."""
    if not isinstance(deepspeed_config, dict):
        raise ValueError("checkpointing.configure: deepspeed_config: accepted: a dict")
    block = deepspeed_config.get("activation_checkpointing", {})
    if not isinstance(block, dict):
        raise ValueError("config: activation_checkpointing: accepted: a JSON object")
    for key in block:
        if key not in _KEYS:
            raise ValueError(f"config: activation_checkpointing.{key}: unknown key; accepted "
                             f"here: {', '.join(_KEYS)}")
    cpu = block.get("cpu_checkpointing", False) if cpu_override is None else cpu_override
    if not isinstance(cpu, bool):
        raise ValueError(f"config: activation_checkpointing.cpu_checkpointing: {cpu!r}; accepted: "
                         "true or false")
    said = [f"activation_checkpointing.{key}: not supported by strata (one process): ignored"
            for key in ("partition_activations", "contiguous_memory_optimization",
                        "synchronize_checkpoint_boundary", "profile", "number_checkpoints")
            if block.get(key)]
    return cpu, said


def configure(mpu_=None, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None, cpu_checkpointing=None):
    """DeepSpeed's signature. ``deepspeed_config`` may be a config dict (its
    activation_checkpointing block is read) or None."""
    if mpu_ is not None:
        raise ValueError("checkpointing.configure: mpu (model parallelism) is not supported")
    override = cpu_checkpointing if cpu_checkpointing is not None else checkpoint_in_cpu
    cpu, said = read_config({} if deepspeed_config is None else deepspeed_config, override)
    for message in said:
        warnings.warn(message, stacklevel=2)
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("num_checkpoints", num_checkpoints),
                        ("synchronize", synchronize), ("profile", profile)):
        if value:
            warnings.warn(f"checkpointing.configure: {name} is not supported by strata (one "
                          "process): ignored", stacklevel=2)
    _settings["cpu_checkpointing"] = cpu
    _settings["configured"] = True


def is_configured():
    return _settings["configured"]


def reset():
    """Back to the defaults (no CPU checkpointing)."""
    _settings["cpu_checkpointing"] = False
    _settings["configured"] = False


def _autocast_state():
    """(cpu enabled, cpu dtype, cuda enabled, cuda dtype) of the calling thread."""
    return (torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype(),
            torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype())


class _Checkpoint(torch.autograd.Function):
    # `anchor`: a tensor that requires grad, so that backward runs (and the function's parameters
    # get their gradients) even when no input requires grad (token ids, a frozen front end).
    @staticmethod
    def forward(ctx, function, cpu, store, anchor, *args):
        ctx.function = function
        ctx.cpu = cpu
        ctx.autocast = _autocast_state()
        ctx.rng_cpu = torch.get_rng_state()
        ctx.rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and \
            torch.cuda.is_initialized() else None
        ctx.kinds = []  # per argument: (how it is kept, its device, whether it requires grad)
        ctx.held = []  # inputs kept in the engine's host tier
        tensors, others = [], []
        for a in args:
            if not torch.is_tensor(a):
                ctx.kinds.append(("other", None, False))
                others.append(a)
                continue
            held = store.keep(a) if store is not None else None
            if held is not None:
                ctx.kinds.append(("held", a.device, a.requires_grad))
                ctx.held.append(held)
            else:
                ctx.kinds.append(("tensor", a.device, a.requires_grad))
                tensors.append(a.detach().to("cpu") if cpu else a.detach())
        ctx.store = store
        ctx.other_args = others
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        others = iter(ctx.other_args)
        held = iter(ctx.held)
        inputs = []
        for how, device, requires_grad in ctx.kinds:
            if how == "other":
                inputs.append(next(others))
                continue
            t = ctx.store.bring(next(held), device) if how == "held" else \
                next(saved).to(device).detach()
            t.requires_grad_(requires_grad)
            inputs.append(t)
        devices = []
        if ctx.rng_cuda is not None:
            devices = list(range(len(ctx.rng_cuda)))
        cpu_on, cpu_dtype, cuda_on, cuda_dtype = ctx.autocast
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng_cpu)
            if ctx.rng_cuda is not None:
                torch.cuda.set_rng_state_all(ctx.rng_cuda)
            # The recomputation runs as the forward did: under its autocast, if any.
            with torch.enable_grad(), \
                    torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_on), \
                    (torch.autocast("cuda", dtype=cuda_dtype) if cuda_on
                     else contextlib.nullcontext()):
                outputs = ctx.function(*inputs)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None) + tuple(t.grad if torch.is_tensor(t) and kind[2] else None
                                          for t, kind in zip(inputs, ctx.kinds))


def checkpoint(function, *args):
    """Runs function(*args), keeping only its inputs for backward (see the module's docstring).
    Tensor arguments are passed positionally; the result is a tensor or a tuple of tensors."""
    cpu = _settings["cpu_checkpointing"]
    # Read here: inside the Function's forward, grad mode is always off.
    store = _store["host"] if cpu and torch.is_grad_enabled() else None
    return _Checkpoint.apply(function, cpu, store, _ANCHOR, *args)


_ANCHOR = torch.empty(0, requires_grad=True)
