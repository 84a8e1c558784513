"""The Runtime an engine (or strata.init) makes from a parsed config: the runtime's JSON (with
offload_optimizer "none" taken as "cpu", as strata steps on the CPU), the stage, where partitioned
parameters live and the persistence threshold; and making the Runtime itself.

Thread safety: none needed (values made once).
"""

import gc
import json
import os

from strata import _strata

__all__ = ["CLOSED", "RuntimeSettings", "make_runtime"]


class RuntimeSettings:
    """What a config says of the Runtime (`config`: a strata.config.TrainConfig)."""

    def __init__(self, config):
        self.warnings = []
        runtime = json.loads(json.dumps(config.runtime))
        zero = runtime.setdefault("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ValueError("config: zero_optimization: accepted: a JSON object")
        self.stage = zero.get("stage", 0)
        offload = zero.setdefault("offload_optimizer", {})
        if not isinstance(offload, dict):
            raise ValueError("config: zero_optimization.offload_optimizer: accepted: a JSON object")
        if offload.get("device", "none") == "none":
            offload["device"] = "cpu"
            self.warnings.append(
                "zero_optimization.offload_optimizer.device is \"none\": strata steps the "
                "optimizer on the CPU, so its state is kept in pinned host memory (as \"cpu\")")
        self.optimizer_device = offload["device"]  # "cpu" or "nvme", as the Runtime takes it
        param_offload = zero.get("offload_param", {}) or {}
        self.param_tier = {"none": "device", "cpu": "host", "nvme": "nvme"}.get(
            param_offload.get("device", "none"), "device")
        threshold = zero.get("stage3_param_persistence_threshold",
                             zero.get("param_persistence_threshold", 100000))
        self.threshold = threshold if isinstance(threshold, (int, float)) else 100000
        self.dtype = config.dtype
        self.several = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1  # a job of processes
        block = runtime.get("strata")
        self.cuda = isinstance(block, dict) and block.get("device") == "cuda"
        self._device_index = block.get("device_index", "local_rank") \
            if isinstance(block, dict) else "local_rank"
        # The config's own blocks (what strata.init and an engine must agree on), then the
        # Runtime's JSON with what "auto" decides from the rest of the config.
        self.blocks_json = json.dumps(runtime, sort_keys=True)
        self._read_ahead_where_held(runtime, config)
        if self.several and \
                (not isinstance(block, dict) or block.get("optimizer_commit", "auto") == "auto"):
            # optimizer_commit "auto" is "step" across ranks: "partition" is one process's (a
            # step failing part way on one rank would leave the ranks' shards apart).
            runtime.setdefault("strata", {})["optimizer_commit"] = "step"
        if isinstance(threshold, (int, float)):
            # The Runtime never evicts from the device a parameter partition of fewer elements
            # than the threshold (its rule for callers of the C API). The front keeps the small
            # parameters out of the Runtime itself (whole on the device, unpartitioned), so the
            # rule is not needed here, and across ranks it is wrong: a partition is a shard, and
            # the shard of a parameter over the threshold may be under it, to stay on the device
            # for good, filling its budget. (The key given is the one set: both given are named
            # by the Runtime.)
            zero["param_persistence_threshold" if "param_persistence_threshold" in zero
                 else "stage3_param_persistence_threshold"] = 0
        self.runtime_json = json.dumps(runtime, sort_keys=True)

    def cuda_device(self):
        """The GPU this process computes on and its device tier is on (strata.device "cuda"):
        strata.device_index, else LOCAL_RANK (each rank of a node its own, as launchers arrange),
        else 0; None on the emulated device. A GPU beyond those the process sees
        (torch.cuda.device_count()) is a ValueError naming their count."""
        if not self.cuda:
            return None
        given = self._device_index
        if given == "local_rank":
            raw = os.environ.get("LOCAL_RANK", "") or "0"
            if not raw.isdigit():
                raise ValueError(f"LOCAL_RANK {raw!r} (the environment's): accepted: the rank's "
                                 "number on its node, 0 or more")
            index, source = int(raw), f"LOCAL_RANK {raw}"
        else:
            _strata.check_runtime_config(self.runtime_json)  # names a device_index not accepted
            index, source = given, f"strata.device_index {given}"
        import torch
        visible = torch.cuda.device_count()
        if index >= visible:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen = "unset" if shown is None else repr(shown)
            raise ValueError(
                f"strata.device \"cuda\": {source} names GPU {index}, but this process sees "
                f"{visible} GPU{'' if visible == 1 else 's'} (CUDA_VISIBLE_DEVICES {seen}); "
                "accepted: at most as many ranks on a node as its GPUs (torchrun "
                "--nproc_per_node), or strata.device_index naming a GPU this process sees "
                "(ranks may share one: their device buffers then go through Gloo)")
        return index

    def _read_ahead_where_held(self, runtime, config):
        """strata.optimizer_read_ahead_bytes "auto" (unset) takes no room where the engine never
        holds a step (step.py: _may_hold): below stage 3 (nothing is staged during backward), the
        state in host memory, several processes, or a step nothing decides after backward (no
        gradient_clipping, and optimizer_commit "partition" only where it steps during backward:
        optimizer_during_backward, not fp16 nor
        bf16.check_grad_overflow)."""
        block = runtime.get("strata", {})
        if not isinstance(block, dict) or block.get("optimizer_read_ahead_bytes", "auto") != "auto":
            return
        during = block.get("optimizer_during_backward", "auto")
        if during == "auto":
            during = block.get("device", "emulated") == "cuda"
        partition = block.get("optimizer_commit") == "partition"
        held = config.clipping > 0 or (partition and not (during is True and
                                                          not config.checks_overflow))
        if self.stage != 3 or self.optimizer_device != "nvme" or self.several or not held:
            runtime.setdefault("strata", {})["optimizer_read_ahead_bytes"] = 0


def make_runtime(settings, on_warning):
    """(a Runtime for `settings`, a warning or None). The NVMe folder is swap space, not a
    checkpoint: what an earlier run left there is dropped, and said. A folder still held by an
    engine nothing reaches any more (a reference cycle, as a Lightning module and its engine make,
    not yet collected: a second fit in a notebook) is freed by a collection, and tried again."""
    device = settings.cuda_device()

    def made():
        return _strata.Runtime(settings.runtime_json, on_warning=on_warning,
                               device_index=-1 if device is None else device)

    try:
        runtime = made()
    except _strata.Error as error:
        if "in use by another strata store of this process" not in str(error):
            raise
        gc.collect()  # the engine holding it closes if nothing reaches it (its finalizer)
        runtime = made()
    stale = runtime.stored_partitions()
    for pid in stale:
        runtime.unregister(pid)
    message = None
    if stale:
        message = (f"the NVMe swap folder held {len(stale)} partitions of an earlier run: swap is "
                   "not a checkpoint, they were dropped")
    return runtime, message


class _Closed:
    """What an engine's parts hold in place of the Runtime once the engine is closed: any use
    says so by name (RuntimeError), as the engine's own `runtime` does."""

    def __bool__(self):
        return False

    def __getattr__(self, name):
        raise RuntimeError("strata: the engine is closed; accepted: a new strata.initialize")


CLOSED = _Closed()
