"""Lightning's Trainer on strata: ``Trainer(strategy=StrataStrategy(...))``.

    import strata.lightning                      # also registers the strategy names below
    from strata.lightning import StrataStrategy

    trainer = Trainer(strategy=StrataStrategy(stage=3, offload_optimizer=True,
                                              offload_parameters=True),
                      precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(model)                           # model: any LightningModule
    trainer.test(model)

What a script written for Lightning's ``DeepSpeedStrategy`` changes is one line: the strategy
(``DeepSpeedStrategy`` -> ``StrataStrategy``, or ``strategy="deepspeed_stage_3_offload"`` ->
``strategy="strata_stage_3_offload"``). The strategy takes DeepSpeedStrategy's arguments with
their meanings: each one given either lands in the DeepSpeed config strata reads (the same keys
DeepSpeedStrategy writes) or, where strata does not act on it, is named in a StrataWarning. An
argument left out takes strata's default. ``config`` (a dict, a JSON path, or
PL_DEEPSPEED_CONFIG_PATH) is a DeepSpeed config with strata's own ``strata`` block; the arguments
given are applied over it, and an argument that disagrees with the config's value for the same key
is refused naming both. The Trainer fills in what it owns: ``gradient_accumulation_steps``
(accumulate_grad_batches), ``train_micro_batch_size_per_gpu`` (logging_batch_size_per_gpu, else
the train loader's batch size), ``gradient_clipping`` (gradient_clip_val), ``bf16``/``fp16``
(precision), and any of them written ``"auto"``.

Registered names (after ``import strata.lightning``): strata, strata_stage_1, strata_stage_2,
strata_stage_2_offload, strata_stage_3, strata_stage_3_offload, strata_stage_3_offload_nvme
(DeepSpeed's, with strata's defaults; strata steps the optimizer on the CPU at every stage).

The Trainer as users drive it:

* precision "32-true", "bf16-mixed" and "16-mixed" (and the "-true" spellings): the engine's
  training dtype, fp32 master weights in strata's optimizer (as DeepSpeed's bf16/fp16); "16-mixed"
  with DeepSpeed's dynamic loss scaling (the loss-scale arguments), also on the CPU, where Lightning
  itself would turn it into bf16. Floating inputs are cast to the training dtype, as
  DeepSpeedStrategy casts them.
* accumulate_grad_batches: the engine's gradient_accumulation_steps, the optimizer stepping where
  Lightning steps (the end of an epoch ends a window, as in plain Lightning); gradient_clip_val:
  the engine's clipping by the global norm ("value" clipping is refused).
* configure_model under ZeRO stage 3 builds the model under ``strata.init`` (each large parameter a
  partition as it is made, never materialized whole); configure_optimizers returning
  torch.optim.Adam/AdamW/Adagrad (their hyper-parameters, stepped by strata's CPU optimizer) or
  strata.optim's, with Lightning's LR scheduler configs (interval, frequency, monitor), or the
  config's optimizer and scheduler blocks; fit, validate, test, predict; manual optimization.
* checkpoints: ``trainer.save_checkpoint`` and ModelCheckpoint write strata's checkpoint folder
  (the engine's, under the tag "checkpoint", with Lightning's own state inside), and
  ``fit(ckpt_path=folder)`` resumes it bit for bit (the optimizer's state, the loss scaler and
  counters, Lightning's loops, callbacks and schedulers); validate/test/predict(ckpt_path=folder)
  take its weights. ``load_full_weights=True`` takes a one-file checkpoint's weights (a Lightning
  .ckpt or a collated file). ``convert_zero_checkpoint_to_fp32_state_dict`` collates a folder into
  one fp32 state dict that ``LightningModule.load_from_checkpoint`` reads.
* ``devices=N`` on the CPU: N ranks (Lightning launches them; torchrun's too), ZeRO across them
  over strata's Gloo (strata/ranks.py), Lightning's own collectives over torch.distributed's Gloo.
  ``accelerator="gpu"``: strata's CUDA device tier (strata.device "cuda"), one GPU (across ranks
  the engine runs on the emulated tier only, so devices > 1 on a GPU is refused).

After a run the module's weights stay in its engine (the engine is kept with the module, as
DeepSpeed's ZeRO-3 keeps parameters partitioned): the module still runs (stage 3 lends its
parameters around each module, as in training), later validate/test/predict calls, in this Trainer
or another, use them, and a later fit starts a new engine (and optimizer) from them.
``module_state_dict(model)`` gives the weights whole; ``release(model)`` puts them back into the
module as plain tensors and closes its engine.

Not acted on (warned when given): pin_memory=False,
contiguous_gradients, allgather_partitions, reduce_scatter, zero_allow_untested_optimizer,
partition_activations, contiguous_memory_optimization, synchronize_checkpoint_boundary,
exclude_frozen_parameters, offload_optimizer=False (strata always steps on the CPU), a
remote_device other than the parameters' tier, max_in_cpu without parameters on NVMe, the
loss-scale arguments outside "16-mixed", and the bucket and overlap_comm arguments in one process
(they act across ranks).

Both packages are served: ``StrataStrategy`` and ``StrataPrecision`` here are built on
``lightning.pytorch`` (on ``pytorch_lightning`` where only that is installed);
``for_package("pytorch_lightning")`` gives the classes for the other (the registered names are
added to its registry too).

Messages: StrataWarning through ``warnings`` (on rank 0), the rest through the "strata" logger.
Thread safety: a strategy is driven by its Trainer's thread, as Lightning's.
"""

import atexit
import contextlib
import copy
import datetime
import functools
import importlib
import importlib.util
import inspect
import io
import logging
import math
import os
import random
import socket
import sys
import types
import warnings
import weakref

import torch

from strata import engine_state as _engine_state
from strata import zero_init as _zero_init
from strata.config import ConfigError, TrainConfig
from strata.engine import StrataWarning
from strata.runtime_settings import RuntimeSettings

__all__ = ["StrataStrategy", "StrataPrecision", "convert_zero_checkpoint_to_fp32_state_dict",
           "module_state_dict", "release", "for_package"]

logger = logging.getLogger("strata")

# The tag strata's checkpoint folder holds Lightning's checkpoint under (DeepSpeedStrategy's).
TAG = "checkpoint"
# The key of Lightning's own state in the engine's client_state (packed: see _pack).
_CLIENT_KEY = "lightning"
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                     "STRATA_STORE_PORT")
_ONE_PROCESS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                          "NODE_RANK")
_PRECISIONS = {"32-true": "float32", "32": "float32", "bf16-mixed": "bfloat16",
               "bf16-true": "bfloat16", "16-mixed": "float16", "16-true": "float16"}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CONFIG_ENV = "PL_DEEPSPEED_CONFIG_PATH"  # DeepSpeedStrategy's, so that its users' scripts run


# --- the arguments ----------------------------------------------------------------------------

def _default_timeout():
    return datetime.timedelta(minutes=30)  # torch.distributed's default, as Lightning's


# Arguments strata does not act on: name -> (why, the value that asks for nothing strata does not
# do anyway, or _ANY: every value given is warned of). contiguous_gradients=True, say, is what
# strata does; False is not honoured.
_ANY = object()
_NOT_ACTED_ON = {
    "contiguous_gradients": ("strata keeps each gradient in a partition of its own", True),
    "allgather_partitions": ("strata always all-gathers the updated weights", True),
    "reduce_scatter": ("strata always reduce-scatters gradients across ranks", True),
    "zero_allow_untested_optimizer": ("strata steps Adam, AdamW, Adagrad and Lion and refuses "
                                      "other optimizers whatever this says", False),
    "partition_activations": ("it partitions activations across model-parallel ranks, which "
                              "strata does not have (cpu_checkpointing acts)", False),
    "contiguous_memory_optimization": ("it lays out model-parallel partitioned activations, "
                                       "which strata does not have", False),
    "synchronize_checkpoint_boundary": ("strata's activation checkpoints need no device "
                                        "synchronization of their own", False),
    "exclude_frozen_parameters": ("strata's checkpoint keeps frozen parameters (with the "
                                  "buffers)", False),
}
_LOSS_SCALE_ARGUMENTS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                         "min_loss_scale")
_COLLECTIVE_ARGUMENTS = ("allgather_bucket_size", "reduce_bucket_size", "overlap_comm")


def _records_given(init):
    """Wraps __init__ so that self._given holds the names of the arguments the caller gave."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as error:
            raise TypeError(f"StrataStrategy: {error}; accepted: DeepSpeedStrategy's arguments "
                            f"({', '.join(list(signature.parameters)[1:])})") from None
        self._given = set(bound.arguments) - {"self"}
        init(self, *args, **kwargs)
    return wrapper


def _bad(name, value, accepted):
    raise ValueError(f"StrataStrategy: {name}={value!r} is not accepted; accepted: {accepted}")


def _check_bool(name, value):
    if not isinstance(value, bool):
        _bad(name, value, "True or False")


def _check_int(name, value, low, high=None, power_of_two=False):
    """An integer (a whole float such as 5e8 too) from low to high; returns it as an int."""
    whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    if isinstance(value, bool) or not (isinstance(value, int) or whole):
        _bad(name, value, f"an integer from {low}" + (f" to {high}" if high is not None else ""))
    value = int(value)
    if value < low or (high is not None and value > high) or \
            (power_of_two and value & (value - 1)):
        _bad(name, value, ("a power of two " if power_of_two else "") + f"from {low}" +
             (f" to {high}" if high is not None else ""))
    return value


def _check_number(name, value, low, strictly=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
            value < low or (strictly and value == low):
        _bad(name, value, f"a number {'>' if strictly else '>='} {low}")
    return value


def _check_device(name, value):
    if value not in ("cpu", "nvme"):
        _bad(name, value, "'cpu' or 'nvme'")


def _check_arguments(a):
    """Every argument's type and range, naming the argument (`a`: name -> value)."""
    for name in ("zero_optimization", "offload_optimizer", "offload_parameters", "single_submit",
                 "overlap_events", "pin_memory", "contiguous_gradients", "overlap_comm",
                 "allgather_partitions", "reduce_scatter", "zero_allow_untested_optimizer",
                 "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                 "synchronize_checkpoint_boundary", "load_full_weights",
                 "exclude_frozen_parameters"):
        _check_bool(name, a[name])
    a["stage"] = _check_int("stage", a["stage"], 0, 3)
    if a["remote_device"] not in (None, "cpu", "nvme"):
        _bad("remote_device", a["remote_device"], "None (the device), 'cpu' or 'nvme'")
    _check_device("offload_params_device", a["offload_params_device"])
    _check_device("offload_optimizer_device", a["offload_optimizer_device"])
    if not isinstance(a["nvme_path"], (str, os.PathLike)) or not os.fspath(a["nvme_path"]):
        _bad("nvme_path", a["nvme_path"], "the path of a folder (str or os.PathLike)")
    # The ranges strata's config reader takes (tiering/runtime_config.h, aio/config.h).
    a["params_buffer_count"] = _check_int("params_buffer_count", a["params_buffer_count"], 1,
                                          1 << 20)
    a["params_buffer_size"] = _check_int("params_buffer_size", a["params_buffer_size"], 4096,
                                         256 << 20)
    a["max_in_cpu"] = _check_int("max_in_cpu", a["max_in_cpu"], 0, 1 << 50)
    a["optimizer_buffer_count"] = _check_int("optimizer_buffer_count",
                                             a["optimizer_buffer_count"], 1, 1 << 20)
    a["block_size"] = _check_int("block_size", a["block_size"], 4096, 64 << 20, True)
    a["queue_depth"] = _check_int("queue_depth", a["queue_depth"], 1, 1024)
    a["thread_count"] = _check_int("thread_count", a["thread_count"], 1, 256)
    a["sub_group_size"] = _check_int("sub_group_size", a["sub_group_size"], 1)
    a["allgather_bucket_size"] = _check_int("allgather_bucket_size", a["allgather_bucket_size"], 1)
    a["reduce_bucket_size"] = _check_int("reduce_bucket_size", a["reduce_bucket_size"], 1)
    if a["logging_batch_size_per_gpu"] != "auto":
        a["logging_batch_size_per_gpu"] = _check_int(
            "logging_batch_size_per_gpu", a["logging_batch_size_per_gpu"], 1)
    level = a["logging_level"]
    if isinstance(level, str):
        if not isinstance(logging.getLevelName(level.upper()), int):
            _bad("logging_level", level, "a logging level (logging.INFO, 20, 'INFO', ...)")
        a["logging_level"] = logging.getLevelName(level.upper())
    elif isinstance(level, bool) or not isinstance(level, int) or level < 0:
        _bad("logging_level", level, "a logging level (logging.INFO, 20, 'INFO', ...)")
    _check_number("loss_scale", a["loss_scale"], 0)
    a["initial_scale_power"] = _check_int("initial_scale_power", a["initial_scale_power"], 0, 64)
    a["loss_scale_window"] = _check_int("loss_scale_window", a["loss_scale_window"], 1)
    a["hysteresis"] = _check_int("hysteresis", a["hysteresis"], 1)
    _check_number("min_loss_scale", a["min_loss_scale"], 0, strictly=True)
    timeout = a["timeout"]
    if timeout is not None and (not isinstance(timeout, datetime.timedelta) or
                                not 1 <= timeout.total_seconds() <= 7 * 24 * 3600):
        _bad("timeout", timeout, "a datetime.timedelta from 1 second to 7 days, or None")
    if a["process_group_backend"] not in (None, "gloo", "nccl"):
        _bad("process_group_backend", a["process_group_backend"],
             "None (Gloo on the CPU, NCCL on a GPU), 'gloo' or 'nccl'")


def _load_config(config):
    """The config as a dict (a copy): a dict, a JSON path, PL_DEEPSPEED_CONFIG_PATH, or {}."""
    if config is None and os.environ.get(_CONFIG_ENV):
        config = os.environ[_CONFIG_ENV]
        logger.info("StrataStrategy: the config is %s (%s)", config, _CONFIG_ENV)
    if config is None:
        return {}, False
    if isinstance(config, (str, os.PathLike)) and not os.path.isfile(config):
        raise ValueError(f"StrataStrategy: config={os.fspath(config)!r}: no such file; accepted: "
                         "a dict, or the path of a JSON file")
    if not isinstance(config, (dict, str, os.PathLike)):
        _bad("config", config, "a dict, or the path of a JSON file")
    return copy.deepcopy(TrainConfig.load(config)), True


def _put(config, dotted, value, argument, given=True):
    """Sets config[dotted] = value for the argument `argument`; a value the config already holds
    there and that differs is refused, naming both. An argument not given (its default) leaves
    the config's value."""
    *path, key = dotted.split(".")
    block = config
    for part in path:
        block = block.setdefault(part, {})
        if not isinstance(block, dict):
            raise ConfigError(f"config: {part}: accepted: a JSON object")
    if not given and key in block and block[key] != "auto":
        return
    if key in block and block[key] != "auto" and block[key] != value:
        raise ValueError(f"StrataStrategy: {argument} and the config's {dotted} "
                         f"({block[key]!r}) disagree; accepted: one of them, or the same value")
    block[key] = value


def _build_config(strategy, a, given, has_config, config):
    """The DeepSpeed config the arguments make, over `config` (see the module's docstring):
    each argument given sets its key (as DeepSpeedStrategy writes it); without a config, the
    ZeRO stage is the argument's default (2), as DeepSpeedStrategy's."""
    warn = strategy._warn_argument
    applied = set(given) if has_config else set(given) | {"zero_optimization", "stage"}
    if not a["zero_optimization"]:
        if "stage" in given and a["stage"] != 0:
            raise ValueError(f"StrataStrategy: zero_optimization=False with stage={a['stage']}; "
                             "accepted: one of them (zero_optimization=False is stage 0)")
        if "zero_optimization" in applied:
            _put(config, "zero_optimization.stage", 0, "zero_optimization=False")
    elif "stage" in applied:
        _put(config, "zero_optimization.stage", a["stage"], f"stage={a['stage']}")
    stage = _get(config, "zero_optimization.stage") or 0
    nvme = os.fspath(a["nvme_path"])

    if "offload_optimizer" in given and not a["offload_optimizer"]:
        warn("offload_optimizer", "strata always steps the optimizer on the CPU: its state is "
                                  "kept in host memory, as offload_optimizer=True with "
                                  "offload_optimizer_device='cpu'")
    if a["offload_optimizer"] or "offload_optimizer_device" in given:
        device = _device_for(config, "offload_optimizer", a, given, "offload_optimizer_device")
        if device == "nvme":
            _put(config, "zero_optimization.offload_optimizer.nvme_path", nvme,
                 f"nvme_path={nvme!r}", "nvme_path" in given)
    elif not isinstance(_get(config, "zero_optimization.offload_optimizer.device"), str):
        # Left out: strata's own place for it, host memory (not DeepSpeed's device, which strata
        # does not have; a config that says "none" is told so by the engine).
        _put(config, "zero_optimization.offload_optimizer.device", "cpu", "offload_optimizer",
             given=False)
    if "optimizer_buffer_count" in given:
        _put(config, "zero_optimization.offload_optimizer.buffer_count",
             a["optimizer_buffer_count"], f"optimizer_buffer_count={a['optimizer_buffer_count']}")
    # As DeepSpeedStrategy writes it, its default too (1e12: no parameter is cut).
    _put(config, "zero_optimization.sub_group_size", a["sub_group_size"],
         f"sub_group_size={a['sub_group_size']}", "sub_group_size" in given)

    if a["offload_parameters"] and stage != 3:
        warn("offload_parameters", f"parameters are offloaded at ZeRO stage 3 only (this is "
                                   f"stage {stage}): they stay on the device")
    elif a["offload_parameters"]:
        device = _device_for(config, "offload_param", a, given, "offload_params_device")
        if device == "nvme":
            _put(config, "zero_optimization.offload_param.nvme_path", nvme, f"nvme_path={nvme!r}",
                 "nvme_path" in given)
    elif "offload_params_device" in given:
        warn("offload_params_device", "offload_parameters is not True: parameters stay on the "
                                      "device")
    # The staging buffers serve every NVMe move (parameters' and the optimizer's), so they are
    # written whatever offload_parameters says.
    for name, key in (("params_buffer_count", "buffer_count"), ("params_buffer_size",
                                                                  "buffer_size")):
        if name in given:
            _put(config, f"zero_optimization.offload_param.{key}", a[name], f"{name}={a[name]}")
    if "max_in_cpu" in given:
        # Parameters homed on NVMe within it keep a host copy (while the host budget has room).
        if _get(config, "zero_optimization.offload_param.device") == "nvme":
            _put(config, "zero_optimization.offload_param.max_in_cpu", a["max_in_cpu"],
                 f"max_in_cpu={a['max_in_cpu']}")
        else:
            warn("max_in_cpu", "it acts on parameters offloaded to NVMe, and these are not "
                               "(offload_params_device='nvme' with offload_parameters=True)")
    if "nvme_path" in given and not _uses_nvme(config):
        warn("nvme_path", "nothing is offloaded to NVMe (offload_params_device and "
                          "offload_optimizer_device are not 'nvme')")

    if "remote_device" in given and a["remote_device"] is not None:
        tier = _get(config, "zero_optimization.offload_param.device") or "none"
        if stage != 3:
            warn("remote_device", "models are built partitioned at ZeRO stage 3 only")
        elif a["remote_device"] != tier:
            warn("remote_device", f"strata builds each parameter where it trains from (the "
                                  f"offload_param device, {tier!r}), not elsewhere first")
    if "pin_memory" in given and not a["pin_memory"]:
        warn("pin_memory", "strata's host tier is always pinned memory")
    for name, (why, harmless) in _NOT_ACTED_ON.items():
        if name in given and (harmless is _ANY or a[name] != harmless):
            warn(name, f"not acted on by strata: {why}")

    for name, key in (("allgather_bucket_size", "allgather_bucket_size"),
                      ("reduce_bucket_size", "reduce_bucket_size"),
                      ("overlap_comm", "overlap_comm")):
        if name in given:
            _put(config, f"zero_optimization.{key}", a[name], f"{name}={a[name]}")

    aio = {"block_size": "block_size", "queue_depth": "queue_depth",
           "single_submit": "single_submit", "overlap_events": "overlap_events",
           "thread_count": "intra_op_parallelism"}
    for name, key in aio.items():
        if name in given:
            _put(config, f"aio.{key}", a[name], f"{name}={a[name]}")

    if "cpu_checkpointing" in given:
        _put(config, "activation_checkpointing.cpu_checkpointing", a["cpu_checkpointing"],
             f"cpu_checkpointing={a['cpu_checkpointing']}")
    if "logging_batch_size_per_gpu" in given and a["logging_batch_size_per_gpu"] != "auto":
        _put(config, "train_micro_batch_size_per_gpu", a["logging_batch_size_per_gpu"],
             f"logging_batch_size_per_gpu={a['logging_batch_size_per_gpu']}")
    if "timeout" in given and a["timeout"] is not None and \
            "comm_timeout_s" not in config.get("strata", {}):
        # strata's collectives wait as long as torch.distributed's (Lightning's) do.
        _put(config, "strata.comm_timeout_s", max(1, int(a["timeout"].total_seconds())),
             f"timeout={a['timeout']}")
    return config


def _device_for(config, block, a, given, argument):
    """Writes the offload block's device: the argument's when given (a config that says otherwise
    is refused), else the config's own, else the argument's default. Returns it."""
    dotted = f"zero_optimization.{block}.device"
    if argument not in given and isinstance(_get(config, dotted), str):
        return _get(config, dotted)
    device = a[argument]
    _put(config, dotted, device, f"{argument}={device!r}")
    return device


def _get(config, dotted):
    """config[dotted], or None where a block on the way is missing or not a dict."""
    value = config
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _uses_nvme(config):
    return any(_get(config, f"zero_optimization.{k}.device") == "nvme"
               for k in ("offload_param", "offload_optimizer"))


# --- processes --------------------------------------------------------------------------------

@contextlib.contextmanager
def _one_process_environment(world_size):
    """In a run of one process, strata must not take the launcher's variables (Lightning or a
    cluster may have set some) for a job of several: they are hidden while strata joins."""
    if world_size > 1:
        yield
        return
    saved = {k: os.environ.pop(k) for k in _LAUNCH_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _free_port(avoid=()):
    """A port free a moment ago, below the kernel's ephemeral range (whose ports the kernel hands
    to connections), for strata's rendezvous store (STRATA_STORE_PORT)."""
    low, high = 20000, 32000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            high = min(high, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(1000):
        port = rng.randrange(low, max(low + 1, high))
        if port in avoid:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"StrataStrategy: no free port in {low}-{high} for strata's store; "
                       "accepted: set STRATA_STORE_PORT to a free port")


# --- Lightning's checkpoint inside strata's -----------------------------------------------------

def _pack(checkpoint):
    """Lightning's checkpoint dict as bytes in a tensor: the engine's engine_states.pt keeps it
    whatever objects it holds, and it is read back by Lightning's own rules (_unpack)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return {_CLIENT_KEY: torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}


def _unpack(client_state, where, weights_only=None):
    if not isinstance(client_state, dict) or _CLIENT_KEY not in client_state:
        raise ValueError(f"StrataStrategy: {where} is a strata checkpoint that a Trainer did not "
                         "save (no Lightning state in it); accepted: a folder saved by "
                         "StrataStrategy (trainer.save_checkpoint, ModelCheckpoint), or "
                         "engine.load_checkpoint for the engine's own")
    data = client_state[_CLIENT_KEY].numpy().tobytes()
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def _checkpoint_folder(path):
    """The checkpoint's folder and tag: `path` may be the save folder (with `latest`) or a tag's
    folder in it."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, _engine_state.LATEST)):
        return path, None
    if os.path.isfile(os.path.join(path, _engine_state.META)):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path))
    return None, None


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None,
                                               weights_only=False):
    """Collates a strata checkpoint folder saved by the Trainer (``epoch=0-step=10.ckpt/``) into
    one file, as Lightning's utility of the same name: Lightning's checkpoint (hyper-parameters,
    loops, callbacks, ...) with ``state_dict`` the model's fp32 weights (the optimizer's master
    weights; buffers and frozen parameters as saved), written by torch.save.
    ``LightningModule.load_from_checkpoint(output_file)`` reads it, and
    ``StrataStrategy(load_full_weights=True)`` takes its weights. The optimizer's state is not in
    it: keep the folder to resume training. Every digest is verified first (a damaged file is
    named, nothing is written). Returns the file's checkpoint dict."""
    from strata import zero_to_fp32
    folder, found_tag = _checkpoint_folder(checkpoint_dir)
    if folder is None:
        raise _engine_state.CheckpointError(
            f"convert_zero_checkpoint_to_fp32_state_dict: {os.fspath(checkpoint_dir)} is not a "
            "strata checkpoint folder (no `latest`, no meta.json); accepted: the folder "
            "trainer.save_checkpoint or ModelCheckpoint wrote")
    path, state = zero_to_fp32._state_dict(folder, tag if tag is not None else found_tag)
    state = zero_to_fp32._materialize(state)
    client = torch.load(os.path.join(path, _engine_state.ENGINE))["client_state"]
    checkpoint = _unpack(client, path, weights_only=weights_only)
    checkpoint["state_dict"] = {name: t.clone() for name, t in state.items()}
    for key in ("optimizer_states",):
        checkpoint.pop(key, None)
    output_file = os.fspath(output_file)
    parent = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(parent, exist_ok=True)
    torch.save(checkpoint, output_file)
    return checkpoint


# --- the engine kept with its module ------------------------------------------------------------

class _Held:
    """What a LightningModule keeps of the engine that holds its weights (module.__dict__). A
    module held so is not copied or pickled: its weights are in the engine."""

    def __init__(self, engine, runtime_json):
        self.engine = engine
        self.runtime_json = runtime_json

    def __deepcopy__(self, memo):
        raise TypeError("a module trained by StrataStrategy keeps its weights in its strata "
                        "engine; accepted: strata.lightning.release(model) first (the weights "
                        "back in the module), or copy strata.lightning.module_state_dict(model)")

    def __reduce__(self):
        self.__deepcopy__(None)


_ENGINES = weakref.WeakSet()  # every engine made here, closed at exit (their swap files go)


@atexit.register
def _close_engines():
    for engine in list(_ENGINES):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - at exit, nothing is left to tell
            pass


def _closed(engine):
    try:
        engine.runtime  # noqa: B018 - a closed engine's raises
    except RuntimeError:
        return True
    return False


def _held(module):
    held = module.__dict__.get("_strata_engine") if module is not None else None
    if held is not None and _closed(held.engine):  # closed by its user
        module.__dict__.pop("_strata_engine", None)
        return None
    return held


def module_state_dict(model):
    """The module's state dict with every parameter whole (the engine's weights, in the training
    dtype, on the CPU), or model.state_dict() for a module no engine holds. Across ranks every
    rank must call it."""
    held = _held(model)
    return held.engine.module_state_dict() if held is not None else model.state_dict()


def release(model):
    """Puts the weights of the engine holding `model` back into the module's own parameters
    (plain tensors on the engine's device, in the training dtype; tied parameters stay tied) and
    closes the engine (its memory and swap files go). Across ranks every rank must call it.
    Returns the model. A module no engine holds is returned as it is."""
    held = _held(model)
    if held is None:
        return model
    held.engine.release()
    model.__dict__.pop("_strata_engine", None)
    return model


# --- the precision plugin -----------------------------------------------------------------------

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
        dtype = _TORCH_DTYPES[self.dtype_name]
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
        self._after_closure(model, optimizer)
        engine = self._engine()
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
        """The engine clips by the global norm (gradient_clip_val, in its config)."""


def _check_precision(precision):
    text = str(precision)
    if text not in _PRECISIONS:
        raise ValueError(f"StrataStrategy: precision={precision!r} is not supported; accepted: "
                         "'32-true', 'bf16-mixed', '16-mixed' (and 'bf16-true', '16-true': the "
                         "same training, fp32 master weights in strata's optimizer)")
    return "32-true" if text == "32" else text


# --- the model Lightning sees -------------------------------------------------------------------

class _EngineModule(torch.nn.Module):
    """What the Trainer holds as its model (trainer.model): the LightningModule under the engine;
    calling it runs the engine's forward (Lightning redirects training_step and the others
    through it)."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        self.__dict__["engine"] = engine

    def forward(self, *args, **kwargs):
        return self.__dict__["engine"].forward(*args, **kwargs)


# --- the strategy --------------------------------------------------------------------------------

class _StrategyMixin:
    """StrataStrategy's behaviour over Lightning's DDPStrategy (see the module's docstring)."""

    strategy_name = "strata"

    @_records_given
    def __init__(self, accelerator=None, zero_optimization=True, stage=2, remote_device=None,
                 offload_optimizer=False, offload_parameters=False, offload_params_device="cpu",
                 nvme_path="/local_nvme", params_buffer_count=5, params_buffer_size=100_000_000,
                 max_in_cpu=1_000_000_000, offload_optimizer_device="cpu",
                 optimizer_buffer_count=4, block_size=1048576, queue_depth=8,
                 single_submit=False, overlap_events=True, thread_count=1, pin_memory=False,
                 sub_group_size=1_000_000_000_000, contiguous_gradients=True, overlap_comm=True,
                 allgather_partitions=True, reduce_scatter=True,
                 allgather_bucket_size=200_000_000, reduce_bucket_size=200_000_000,
                 zero_allow_untested_optimizer=True, logging_batch_size_per_gpu="auto",
                 config=None, logging_level=logging.WARN, parallel_devices=None,
                 cluster_environment=None, loss_scale=0, initial_scale_power=16,
                 loss_scale_window=1000, hysteresis=2, min_loss_scale=1,
                 partition_activations=False, cpu_checkpointing=False,
                 contiguous_memory_optimization=False, synchronize_checkpoint_boundary=False,
                 load_full_weights=False, precision_plugin=None, process_group_backend=None,
                 timeout=_default_timeout(), exclude_frozen_parameters=False):
        """DeepSpeedStrategy's arguments (see the module's docstring for what strata does with
        each): ZeRO ``stage`` 0-3; ``offload_optimizer`` and ``offload_optimizer_device``
        ('cpu'/'nvme': where the optimizer's master weights and moments live);
        ``offload_parameters`` and ``offload_params_device`` (stage 3: where the parameters
        live between uses); ``nvme_path``; ``params_buffer_count``/``params_buffer_size`` (the
        NVMe staging buffers), ``optimizer_buffer_count``; the aio block (``block_size``,
        ``queue_depth``, ``single_submit``, ``overlap_events``, ``thread_count``); the buckets
        and ``overlap_comm`` across ranks; the fp16 loss-scale arguments; ``cpu_checkpointing``;
        ``config``; ``logging_batch_size_per_gpu``; ``logging_level`` (the "strata" logger's);
        ``load_full_weights``; and Lightning's own (accelerator, parallel_devices,
        cluster_environment, precision_plugin, process_group_backend, timeout)."""
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        given = self._given
        _check_arguments(arguments)
        if precision_plugin is None:
            precision_plugin = self._flavor.StrataPrecision()
        elif not isinstance(precision_plugin, _PrecisionMixin):
            precision_plugin = self._flavor.StrataPrecision(
                _check_precision(getattr(precision_plugin, "precision", precision_plugin)))
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._forward_redirection = self._flavor.ForwardRedirection()
        self.warnings = []  # every warning the strategy gave (each rank keeps them)
        self.arguments = arguments
        base, has_config = _load_config(config)
        self.config = _build_config(self, arguments, given, has_config, base)
        self.load_full_weights = load_full_weights
        if "logging_level" in given:
            logger.setLevel(arguments["logging_level"])
        self._engine = None  # the engine of this strategy's current run
        self._full_weights = None  # a one-file checkpoint's state dict, for load_model_state_dict
        self._loaded_full_weights = False  # the run's checkpoint was one file (weights only)
        self._saved_environment = {}  # the launcher's variables as they were (setup_distributed)
        # As they were when the strategy was made: a run of one process puts back what Lightning
        # set meanwhile (MASTER_ADDR, MASTER_PORT, LOCAL_RANK, NODE_RANK), or a later
        # strata.initialize in this process would take them for a launched job's.
        self._environment_at_start = {k: os.environ.get(k) for k in _ONE_PROCESS_VARIABLES}

    # --- messages ---

    def _warn_argument(self, name, why):
        value = self.arguments[name]
        self._warn(f"StrataStrategy({name}={value!r}): {why}")

    def _warn(self, message):
        if message in self.warnings:
            return
        self.warnings.append(message)
        if _this_is_rank_zero():
            warnings.warn(message, StrataWarning, stacklevel=_caller_level())

    # --- what the engine is ---

    @property
    def engine(self):
        """The strata engine (strata.engine.Engine) of this strategy's last run (kept after it, with
        the module), or None."""
        if self._engine is not None and _closed(self._engine):
            self._engine = None  # closed since (release, or a later fit's new engine)
        return self._engine

    @property
    def zero_stage(self):
        return _get(self.config, "zero_optimization.stage") or 0

    @property
    def restore_checkpoint_after_setup(self):
        return True

    @property
    def handles_gradient_accumulation(self):
        # Lightning decides where a window ends (the end of an epoch ends one); the engine is
        # told so before each backward (engine.set_gradient_accumulation_boundary).
        return False

    @property
    def lightning_restore_optimizer(self):
        if self._loaded_full_weights and self._fitting():
            self._warn("StrataStrategy(load_full_weights=True): a one-file checkpoint holds "
                       "weights only: the optimizer starts afresh (resume from the checkpoint "
                       "folder to restore its state)")
        return False  # the engine restores it from its own checkpoint

    def _fitting(self):
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer is not None and trainer.state.fn == self._flavor.TrainerFn.FITTING

    # --- processes ---

    def _configure_launcher(self):
        super()._configure_launcher()
        launcher = self._launcher
        if launcher is None:
            return
        launch = launcher.launch

        def launch_with_a_store_port(function, *args, **kwargs):
            environment = self.cluster_environment
            if self.num_processes * self.num_nodes > 1 and environment is not None and \
                    not environment.creates_processes_externally and \
                    "STRATA_STORE_PORT" not in os.environ:
                # Lightning's launcher gives the processes it starts this environment: strata's
                # store takes a port of its own, not MASTER_PORT + 1 (which may be in use).
                avoid = {int(os.environ["MASTER_PORT"]) + 1} if "MASTER_PORT" in os.environ \
                    else ()
                os.environ["STRATA_STORE_PORT"] = str(_free_port(avoid))
            return launch(function, *args, **kwargs)
        launcher.launch = launch_with_a_store_port

    def setup_environment(self):
        self._resolve_precision()
        accelerator = type(self.accelerator).__name__ if self.accelerator is not None else None
        device = self.root_device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"StrataStrategy: accelerator {accelerator} ({device.type}) is not "
                             "supported; accepted: 'cpu' (strata's emulated device tier) or "
                             "'gpu'/'cuda' (its CUDA tier)")
        if device.type == "cuda" and self.num_processes * self.num_nodes > 1:
            raise ValueError(
                f"StrataStrategy: accelerator='gpu' with {self.num_processes * self.num_nodes} "
                "processes: across ranks strata's engine runs on the emulated device tier (its "
                "collectives on Gloo over host memory); the CUDA tier across ranks (NCCL) is not "
                "wired into the engine yet; accepted: devices=1 on a GPU, or accelerator='cpu'")
        super().setup_environment()
        trainer = getattr(self.lightning_module, "_trainer", None)
        connector = getattr(trainer, "_accelerator_connector", None)
        if self.world_size == 1 and connector is not None:
            # One process trains on the user's loaders as given, as plain single-device
            # Lightning does (a DDP-family strategy would put a shuffling DistributedSampler in
            # the train loader even at one process).
            connector.use_distributed_sampler = False

    def setup_distributed(self):
        self._flavor.reset_seed()
        self.set_world_ranks()
        if self.world_size == 1:
            return  # one process: no process group (Lightning's collectives pass through)
        environment = self.cluster_environment
        # strata's job reads torchrun's variables (strata/ranks.py), as DeepSpeed's does; they are
        # put back as they were at teardown (the job, once joined, does not read them again).
        self._saved_environment = {k: os.environ.get(k) for k in _LAUNCH_VARIABLES[:5]}
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        os.environ["RANK"] = str(self.global_rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        self._process_group_backend = self._get_process_group_backend()
        kwargs = {"timeout": self._timeout}
        if "device_id" in inspect.signature(self._flavor.init_dist_connection).parameters:
            kwargs["device_id"] = None
        self._flavor.init_dist_connection(environment, self._process_group_backend, **kwargs)

    # --- precision ---

    @property
    def precision_plugin(self):
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin):
        # The Trainer gives a strategy it made from a registered name its own plugin for the
        # precision flag (having turned "16-mixed" on the CPU into "bf16-mixed"): strata's takes
        # that precision.
        if plugin is not None and not isinstance(plugin, _PrecisionMixin):
            plugin = self._flavor.StrataPrecision(
                _check_precision(getattr(plugin, "precision", plugin)))
        self._precision_plugin = plugin

    def _resolve_precision(self):
        """The Trainer's precision flag, as given (Lightning would turn "16-mixed" on the CPU into
        "bf16-mixed"; strata's engine runs fp16 there)."""
        plugin = self.precision_plugin
        if not isinstance(plugin, _PrecisionMixin):
            raise ValueError(f"StrataStrategy: the precision plugin is "
                             f"{type(plugin).__name__}; accepted: Trainer(precision=...) or "
                             "StrataStrategy(precision_plugin=StrataPrecision(...))")
        plugin._strategy = weakref.ref(self)
        trainer = getattr(self.lightning_module, "_trainer", None)
        connector = getattr(trainer, "_accelerator_connector", None)
        flag = getattr(connector, "_precision_flag", None)
        if not plugin._from_trainer:
            # Given to the strategy: a Trainer(precision=...) other than the default must agree.
            if isinstance(flag, str) and flag in _PRECISIONS and flag != "32-true" and \
                    _check_precision(flag) != plugin.precision:
                raise ValueError(f"StrataStrategy: precision_plugin is {plugin.precision!r} and "
                                 f"Trainer(precision={flag!r}); accepted: one of them")
            return plugin.precision
        if not isinstance(flag, str):
            raise RuntimeError("StrataStrategy: the Trainer's precision could not be read; "
                               "accepted: StrataStrategy(precision_plugin=StrataPrecision("
                               "'bf16-mixed')) (or another precision)")
        plugin.precision = _check_precision(flag)
        plugin._from_trainer = False
        return plugin.precision

    # --- the config ---

    def _trainer_config(self, trainer, training):
        """The config with what the Trainer owns filled in (see the module's docstring)."""
        config = copy.deepcopy(self.config)
        precision = self._resolve_precision()
        dtype = _PRECISIONS[precision]
        # Where it computes.
        block = config.setdefault("strata", {})
        if not isinstance(block, dict):
            raise ConfigError("config: strata: accepted: a JSON object")
        want = "cuda" if self.root_device.type == "cuda" else "emulated"
        if block.get("device", want) != want:
            raise ValueError(f"StrataStrategy: the config's strata.device is "
                             f"{block['device']!r} and the Trainer runs on {self.root_device}; "
                             f"accepted: {want!r} (or leave it out)")
        block["device"] = want
        # The dtype: the Trainer's precision; the config's bf16/fp16 blocks may say the same.
        for name, on in (("bf16", dtype == "bfloat16"), ("fp16", dtype == "float16")):
            key = "bfloat16" if name == "bf16" and "bfloat16" in config else name
            block = config.get(key)
            if block is None:
                if on:
                    config[key] = {"enabled": True}
                continue
            if not isinstance(block, dict):
                raise ConfigError(f"config: {key}: accepted: a JSON object")
            enabled = block.get("enabled", "auto")
            if enabled == "auto":
                block["enabled"] = on
            elif enabled != on:
                raise ValueError(
                    f"StrataStrategy: the config's {key}.enabled is {enabled!r} and the "
                    f"Trainer's precision is {precision!r}; accepted: precision="
                    f"{'bf16-mixed' if name == 'bf16' else '16-mixed'!r} with {key}.enabled "
                    f"true, or leave {key}.enabled out of the config (the Trainer's is used)")
        scaling = [n for n in _LOSS_SCALE_ARGUMENTS if n in self._given]
        if dtype == "float16":
            fp16 = config["fp16"]
            for name in _LOSS_SCALE_ARGUMENTS:
                if name in self._given or name not in fp16:
                    _put(config, f"fp16.{name}", self.arguments[name],
                         f"{name}={self.arguments[name]}")
        else:
            for name in scaling:
                self._warn_argument(name, f"loss scaling is for precision '16-mixed' (this run "
                                          f"is {precision!r})")
        # Accumulation, micro-batch, clipping: the Trainer's.
        accumulation = trainer.accumulate_grad_batches
        value = config.get("gradient_accumulation_steps", "auto")
        if value != "auto" and value != accumulation:
            raise ValueError(f"StrataStrategy: the config's gradient_accumulation_steps is "
                             f"{value!r} and Trainer(accumulate_grad_batches={accumulation}); "
                             "accepted: leave it out of the config (the Trainer's is used)")
        config["gradient_accumulation_steps"] = accumulation
        if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            config["train_micro_batch_size_per_gpu"] = self._loader_batch_size(trainer)
        if config.get("train_batch_size") == "auto":
            config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * \
                accumulation * self.world_size
        clip = trainer.gradient_clip_val
        algorithm = trainer.gradient_clip_algorithm
        if clip and str(getattr(algorithm, "value", algorithm)) == "value":
            raise ValueError("StrataStrategy: gradient_clip_algorithm='value' is not supported; "
                             "accepted: 'norm' (strata clips by the global norm)")
        value = config.get("gradient_clipping", "auto")
        if value != "auto" and clip and float(value) != float(clip):
            raise ValueError(f"StrataStrategy: the config's gradient_clipping is {value!r} and "
                             f"Trainer(gradient_clip_val={clip}); accepted: one of them")
        config["gradient_clipping"] = float(clip or 0.0) if value == "auto" else value
        if not training:
            for key in ("optimizer", "scheduler"):
                config.pop(key, None)
        return config

    def _loader_batch_size(self, trainer):
        """The train loader's batch size (DeepSpeedStrategy's "auto"), else 1."""
        try:
            source = trainer.fit_loop._data_source
            if source.is_defined():
                loader = source.dataloader()
                size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
                if isinstance(size, int) and size > 0:
                    return size
        except Exception:  # noqa: BLE001 - no loader yet: the default
            pass
        return 1

    def _runtime_json(self, config):
        parsed = TrainConfig.parse(config, world_size=self.world_size)
        return RuntimeSettings(parsed).blocks_json

    # --- building the model ---

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init=None):
        if self.zero_stage == 3:
            yield  # strata.init builds it (model_sharded_context)
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextlib.contextmanager
    def model_sharded_context(self):
        """ZeRO stage 3: configure_model builds the model under strata.init (each large parameter
        a partition as it is made). Not when an engine holds the module already (Lightning calls
        configure_model in every run; the user's is then a no-op)."""
        module = self.lightning_module
        if self.zero_stage != 3 or _held(module) is not None:
            yield
            return
        trainer = module.trainer
        config = self._trainer_config(trainer, training=True)
        with _one_process_environment(self.world_size):
            context = _zero_init.init(config=config)
        # The parameters built under it hold it (and its Runtime, which the engine adopts); when
        # configure_model builds nothing, it goes when the block ends.
        with context:
            yield

    # --- set-up ---

    def setup(self, trainer):
        self._resolve_precision()
        self._loaded_full_weights = False
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == self._flavor.TrainerFn.FITTING
        held = _held(module)
        if fitting and any(isinstance(c, self._flavor.GradientAccumulationScheduler)
                           for c in trainer.callbacks):
            raise RuntimeError("StrataStrategy: GradientAccumulationScheduler changes "
                               "accumulate_grad_batches between epochs, and strata's engine "
                               "keeps one accumulation for its run; accepted: "
                               "Trainer(accumulate_grad_batches=N)")
        if fitting:
            if held is not None:
                # A new fit: a new engine and optimizer, from the weights the last one left.
                release(module)
            engine = self._initialize(trainer, module, training=True)
        elif held is not None:
            engine = held.engine
            config = self._trainer_config(trainer, training=False)
            if self._runtime_json(config) != held.runtime_json:
                self._warn("StrataStrategy: this module's weights are held by the engine of an "
                           "earlier run, whose config differs from this strategy's: that engine "
                           "evaluates it (strata.lightning.release(model) first to use this "
                           "one's)")
            self.optimizers, self.lr_scheduler_configs = [], []
        else:
            engine = self._initialize(trainer, module, training=False)
        self._engine = engine
        self.model = _EngineModule(engine)
        self.setup_precision_plugin()
        self.barrier()

    def setup_optimizers(self, trainer):
        """The engine makes the optimizer (setup)."""
        self.optimizers, self.lr_scheduler_configs = [], []

    def _initialize(self, trainer, module, training):
        """A strata engine for `module`: for training with the config's optimizer or
        configure_optimizers', else (evaluation) with an optimizer that never steps."""
        import strata
        config = self._trainer_config(trainer, training)
        held_json = self._runtime_json(config)
        if not training:  # its optimizer never steps: no read-ahead room unless asked for
            block = config.setdefault("strata", {})
            if isinstance(block, dict):
                block.setdefault("optimizer_read_ahead_bytes", 0)
        flavor = self._flavor
        optimizer, scheduler_config, scheduler = None, None, None
        if not training:
            trainable = [p for p in module.parameters() if p.requires_grad]
            if not trainable:
                raise ValueError("StrataStrategy: the model has no trainable parameters: strata's "
                                 "engine (which evaluation runs on too) needs at least one; "
                                 "accepted: a model with a parameter that requires grad")
            # The engine always has an optimizer; evaluation's never steps.
            optimizer = torch.optim.AdamW(trainable, lr=0.0, weight_decay=0.0)
        elif "optimizer" in config:
            if flavor.is_overridden("configure_optimizers", module):
                self._warn("StrataStrategy: the config has an optimizer block: it is used, and "
                           "configure_optimizers is not called (as DeepSpeedStrategy does)")
        else:
            optimizers, schedulers = flavor.init_optimizers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError(f"StrataStrategy: configure_optimizers returned "
                                 f"{len(optimizers)} optimizers and {len(schedulers)} "
                                 "schedulers; accepted: one optimizer and at most one scheduler")
            optimizer = optimizers[0]
            if isinstance(optimizer, flavor.MockOptimizer):
                raise ValueError("StrataStrategy: configure_optimizers returned None; accepted: "
                                 "an optimizer (torch.optim.Adam/AdamW/Adagrad, strata.optim's), "
                                 "or an optimizer block in the config")
            if schedulers:
                scheduler_config = schedulers[0]
                scheduler = scheduler_config.scheduler
        if flavor.is_overridden("configure_gradient_clipping", module) and training:
            self._warn("StrataStrategy: configure_gradient_clipping is overridden, but strata "
                       "clips inside its optimizer step: set Trainer(gradient_clip_val=...) "
                       "(the hook is still called)")
        self._warn_collectives_in_one_process()
        with _one_process_environment(self.world_size):
            engine, _, _, _ = strata.initialize(model=module, optimizer=optimizer,
                                                lr_scheduler=scheduler, config=config)
        _ENGINES.add(engine)
        module.__dict__["_strata_engine"] = _Held(engine, held_json)
        # Lightning's modules track their device (self.device) through .to(); the engine placed
        # the parameters itself.
        for sub in module.modules():
            if hasattr(sub, "_device"):
                sub._device = engine.device
        if training:
            self.optimizers = [engine.optimizer]
            _track_steps(engine.optimizer)
            if engine.lr_scheduler is not None and scheduler_config is None:
                # The config's scheduler: stepped by Lightning after each optimizer step.
                scheduler_config = flavor.LRSchedulerConfig(engine.lr_scheduler, interval="step")
            elif scheduler_config is not None:
                scheduler_config.scheduler = engine.lr_scheduler
            engine.lr_scheduler = None  # Lightning steps it (interval, frequency, monitor)
            self.lr_scheduler_configs = [scheduler_config] if scheduler_config else []
        else:
            self.optimizers, self.lr_scheduler_configs = [], []
        return engine

    def _warn_collectives_in_one_process(self):
        if self.world_size == 1:
            for name in _COLLECTIVE_ARGUMENTS:
                if name in self._given:
                    self._warn_argument(name, "it acts across ranks; this run is one process")

    # --- the loop ---

    def model_to_device(self):
        """The engine places the module (setup)."""

    # --- checkpoints ---

    def optimizer_state(self, optimizer):
        """Nothing for Lightning's checkpoint dict: the engine's checkpoint holds the optimizer's
        whole state (save_checkpoint), which optimizer.state_dict() would read again (and across
        ranks refuses: each rank holds a shard)."""
        return {}

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        """Strata's checkpoint folder at `filepath` (the engine's save_checkpoint under the tag
        "checkpoint"), Lightning's state inside it; every rank takes part."""
        if storage_options is not None:
            raise TypeError("StrataStrategy: trainer.save_checkpoint(..., storage_options=...) "
                            "is not supported (strata writes its checkpoint folder itself)")
        filepath = self.broadcast(os.fspath(filepath))
        engine = self.engine
        if engine is None:
            raise RuntimeError("StrataStrategy: no engine to save (the strategy is not set up)")
        client = {k: v for k, v in checkpoint.items()
                  if k not in ("state_dict", "optimizer_states")}
        engine.save_checkpoint(filepath, tag=TAG, client_state=_pack(client))

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        """A strata checkpoint folder (the engine loads it; when fitting, the optimizer's state
        too), or with load_full_weights a one-file checkpoint (its weights)."""
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        engine = self.engine
        if os.path.isfile(path):
            if not self.load_full_weights:
                raise ValueError(f"StrataStrategy: {path} is a file, not a strata checkpoint "
                                 "folder; accepted: the folder trainer.save_checkpoint wrote, "
                                 "or StrataStrategy(load_full_weights=True) to take a one-file "
                                 "checkpoint's weights")
            checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
            state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) \
                else None
            if not isinstance(state, dict):
                raise ValueError(f"StrataStrategy: {path} holds no state dict; accepted: a "
                                 "Lightning checkpoint or a torch.save'd state dict")
            self._full_weights = state
            self._loaded_full_weights = True
            return checkpoint if "state_dict" in checkpoint else {"state_dict": state}
        folder, tag = _checkpoint_folder(path)
        if folder is None:
            raise FileNotFoundError(f"StrataStrategy: {path} is not a strata checkpoint folder "
                                    "(no `latest`, no meta.json); accepted: a folder "
                                    "trainer.save_checkpoint or ModelCheckpoint wrote")
        _, client = engine.load_checkpoint(folder, tag=tag,
                                           load_optimizer_states=self._fitting(),
                                           load_lr_scheduler_states=False)
        return _unpack(client, path, weights_only)

    def load_model_state_dict(self, checkpoint, strict=True):
        """A one-file checkpoint's weights stream into the engine (the optimizer starts afresh
        over them); a folder's were loaded with it."""
        if self._full_weights is not None:
            state, self._full_weights = self._full_weights, None
            self.engine.module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint):
        """Loaded with the folder."""

    def remove_checkpoint(self, filepath):
        if self.is_global_zero:
            import shutil
            path = os.fspath(filepath)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)

    # --- the end of a run ---

    def teardown(self):
        """The engine stays with the module (its weights are in it); the module is not moved to
        the CPU (on the CUDA tier its placeholders stay on the device)."""
        self._flavor.optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()
        saved, self._saved_environment = self._saved_environment, {}
        if self.world_size == 1:
            saved = dict(self._environment_at_start)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.lightning_module is not None:
            self.model = self.lightning_module

    @classmethod
    def register_strategies(cls, strategy_registry):
        names = (
            ("strata", "strata's ZeRO offload (stage 2, the optimizer on the CPU)", {}),
            ("strata_stage_1", "strata, ZeRO stage 1", {"stage": 1}),
            ("strata_stage_2", "strata, ZeRO stage 2", {"stage": 2}),
            ("strata_stage_2_offload", "strata, ZeRO stage 2, the optimizer offloaded to the CPU",
             {"stage": 2, "offload_optimizer": True}),
            ("strata_stage_3", "strata, ZeRO stage 3", {"stage": 3}),
            ("strata_stage_3_offload", "strata, ZeRO stage 3, the optimizer and the parameters "
                                       "offloaded to the CPU",
             {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
            ("strata_stage_3_offload_nvme", "strata, ZeRO stage 3, the optimizer and the "
                                            "parameters offloaded to NVMe (nvme_path "
                                            "/local_nvme)",
             {"stage": 3, "offload_optimizer": True, "offload_parameters": True,
              "remote_device": "nvme", "offload_params_device": "nvme",
              "offload_optimizer_device": "nvme"}),
        )
        for name, description, arguments in names:
            strategy_registry.register(name, cls, description=description, override=True,
                                       **arguments)


def _track_steps(optimizer):
    """torch's LR schedulers look for their optimizer's step() having been called (a wrapper
    they put on it when made, on the optimizer the user made): the engine's optimizer gets the
    same mark, and optimizer_step sets what they read."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)
    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def _caller_level():
    """The stacklevel of warnings.warn that names the first frame outside this module (the
    user's line, or Lightning's that called the strategy)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _this_is_rank_zero():
    """Whether this process is rank 0 of its job (from the launchers' variables)."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value not in (None, "", "0"):
            return False
    return True


# --- the classes for one Lightning package -----------------------------------------------------

class _Flavor:
    """Lightning's pieces the strategy uses, from one package (lightning.pytorch or
    pytorch_lightning, whose classes are distinct)."""

    def __init__(self, package):
        pl = importlib.import_module(package)
        fabric = "lightning.fabric" if package == "lightning.pytorch" else "lightning_fabric"
        self.package = package
        self.pl = pl
        strategies = importlib.import_module(f"{package}.strategies")
        self.DDPStrategy = strategies.DDPStrategy
        self.StrategyRegistry = strategies.StrategyRegistry
        strategy_module = importlib.import_module(f"{package}.strategies.strategy")
        self.ForwardRedirection = strategy_module._ForwardRedirection
        self.Precision = importlib.import_module(f"{package}.plugins.precision").Precision
        self.TrainerFn = importlib.import_module(f"{package}.trainer.states").TrainerFn
        self.GradientAccumulationScheduler = importlib.import_module(
            f"{package}.callbacks").GradientAccumulationScheduler
        self.is_overridden = importlib.import_module(
            f"{package}.utilities.model_helpers").is_overridden
        optimizer = importlib.import_module(f"{package}.core.optimizer")
        self.init_optimizers = optimizer._init_optimizers_and_lr_schedulers
        self.MockOptimizer = optimizer._MockOptimizer
        self.LRSchedulerConfig = importlib.import_module(
            f"{package}.utilities.types").LRSchedulerConfig
        self.init_dist_connection = importlib.import_module(
            f"{fabric}.utilities.distributed")._init_dist_connection
        self.reset_seed = importlib.import_module(f"{fabric}.utilities.seed").reset_seed
        self.optimizers_to_device = importlib.import_module(
            f"{fabric}.utilities.optimizer")._optimizers_to_device
        flavor = self
        self.StrataPrecision = type("StrataPrecision", (_PrecisionMixin, self.Precision), {
            "__module__": __name__, "__doc__": _PrecisionMixin.__doc__})
        self.StrataStrategy = type("StrataStrategy", (_StrategyMixin, self.DDPStrategy), {
            "__module__": __name__, "__doc__": _StrategyMixin.__doc__, "_flavor": flavor})
        self.StrataStrategy.register_strategies(self.StrategyRegistry)


_FLAVORS = {}


def for_package(package="lightning.pytorch"):
    """The strata classes for one Lightning package ("lightning.pytorch" or
    "pytorch_lightning"): a namespace with StrataStrategy and StrataPrecision (the registered
    names are added to that package's registry)."""
    if package not in ("lightning.pytorch", "pytorch_lightning"):
        raise ValueError(f"strata.lightning.for_package: {package!r}; accepted: "
                         "'lightning.pytorch' or 'pytorch_lightning'")
    if package not in _FLAVORS:
        try:
            flavor = _Flavor(package)
        except ImportError as error:
            raise ImportError(f"strata.lightning: {package} is not installed ({error}); "
                              "python/requirements.txt pins lightning 2.6") from None
        _FLAVORS[package] = types.SimpleNamespace(StrataStrategy=flavor.StrataStrategy,
                                                  StrataPrecision=flavor.StrataPrecision,
                                                  flavor=flavor)
    return _FLAVORS[package]


def _primary():
    for package in ("lightning.pytorch", "pytorch_lightning"):
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            try:
                return for_package(package)
            except ImportError:
                continue
    raise ImportError("strata.lightning needs Lightning 2.6 (lightning or pytorch_lightning); "
                      "python/requirements.txt pins it (scripts/python-env.sh installs it)")


_classes = _primary()
StrataStrategy = _classes.StrataStrategy
StrataPrecision = _classes.StrataPrecision
if "pytorch_lightning" in sys.modules and _classes.flavor.package != \
        "pytorch_lightning":
    for_package("pytorch_lightning")  # a script that imported it first gets the names there too
