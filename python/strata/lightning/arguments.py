"""DeepSpeedStrategy's arguments: their table, their checks, and the DeepSpeed config they
build (the keys DeepSpeedStrategy writes).

Part of strata.lightning (its module docstring says what the Trainer gets).
"""

import copy
import datetime
import functools
import inspect
import logging
import math
import os


from strata.config import ConfigError, TrainConfig

logger = logging.getLogger("strata")

_CONFIG_ENV = "PL_DEEPSPEED_CONFIG_PATH"  # DeepSpeedStrategy's, so that its users' scripts run


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
