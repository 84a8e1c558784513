"""strata.initialize and the training engine: DeepSpeed's loop on strata's Runtime.

    engine, optimizer, _, scheduler = strata.initialize(model=model, config=ds_config)
    for batch in data:
        loss = engine(batch)          # forward
        engine.backward(loss)
        engine.step()                 # the optimizer steps at each accumulation boundary

One device per process. Launched as several ranks (torchrun's variables set), the engine trains
data-parallel with ZeRO across them (strata/ranks.py: each rank owns a shard of every parameter's
optimizer state and gradient, and at stage 3 of its partitioned weights); what follows describes
one rank. Every trainable parameter has fp32 master weights and Adam moments in
the Runtime's optimizer (sched/runtime.h CreateOptimizer): in pinned host memory
(offload_optimizer.device "cpu") or on NVMe ("nvme", stepped through the pipelined swapper). strata
always steps on the CPU, so offload_optimizer.device "none" is taken as "cpu", with a warning.

ZeRO stage 3: each parameter with at least stage3_param_persistence_threshold elements is a
strata partition in the training dtype, kept where offload_param.device says (none: the device
tier; cpu: pinned host; nvme: NVMe) and lent to the module as its ``.data`` just before the
module's forward and again before its backward (a hook on the forward's outputs: torch 1.13 has no
module pre-backward hook), dropped after. A lent tensor is released when torch frees it, so a view
autograd saved for backward keeps its partition pinned rather than pointing at reused memory. Its
gradient is accumulated into a gradient partition on the device as autograd makes it (the
parameter's ``.grad`` is never kept), which leaves the device in the background at the
accumulation boundary (GradientReady). Smaller parameters stay on the device as plain tensors.
The Runtime records the first step's accesses and prefetches ahead of need from the second.

Stages 0-2: parameters stay on the device; gradients are torch's ``.grad`` (stage 2 moves each to
the host as it is made, summing micro-batches there in fp32).

The step, at each accumulation boundary. At stage 3 each parameter's step is staged during
backward, as autograd makes its gradient final (Runtime.stage_optimizer_step: the Runtime's
optimizer thread reads its NVMe state, steps it and writes it to fresh extents, the new weights to
a staging buffer; nothing visible changes), and committed after backward, when it is the step to
take: no clipping scales it (the global norm of the host gradients under gradient_clipping), the
learning rate and loss scale are the ones it was staged with, and no gradient changed after it was
staged. Otherwise it is dropped and the step taken anew after backward (redone_steps counts them;
staging pauses after a step that clipping scaled), so the result always equals the unoverlapped
step. Stages 0-2 step after backward. Either way the commit changes everything or nothing: the
optimizer steps each partition with grad_scale = clip / loss_scale, writing the new weights in the
training dtype into the parameter's host copy (stage 3) or the device tensor, and the gradients
are discarded. fp16 with dynamic loss scaling (DeepSpeed's rule: halve on overflow after
`hysteresis` overflows, double after loss_scale_window good steps, never under min_loss_scale)
skips a step whose gradients overflowed, changing nothing else. A step that fails (a disk that
fills while the optimizer state is written) raises strata.Error and changes nothing: the weights
and the optimizer state stay the previous step's (the NVMe state commits whole or not at all), and
that step's gradients are dropped. The optimizer's accesses are out of the Runtime's trace, so the
plan for forward and backward holds whatever the step did.

Without a GPU the device tier is the host-emulated one (strata.device "emulated", the default)
and the model computes on the CPU; ``engine.device_kind`` and every report say which ran.

Thread safety: an engine is driven by one thread, as DeepSpeed's.
"""

import contextlib
import json
import logging
import math
import os
import time
import types
import warnings
import weakref

import torch
# torch imports torch._dynamo the first time an optimizer is made, and that first import keeps
# the frames that made the optimizer alive: the engine's __init__ (and so the engine) would never
# be freed by its last reference. Imported here, at the module's import, it keeps none of ours.
import torch._dynamo  # noqa: F401, E402
from torch.utils import _pytree
from torch.utils.dlpack import from_dlpack

from strata import _strata
from strata import checkpointing
from strata import engine_state
from strata import zero_init as init_module
from strata import pretrained
from strata import lr_schedules
from strata import ranks as ranks_module
from strata.config import TrainConfig
from strata.runtime_settings import RuntimeSettings as _RuntimeSettings, make_runtime

__all__ = ["initialize", "Engine", "register_external_parameter", "StrataWarning"]

# The engine's messages: warnings through `warnings` (StrataWarning), the step lines
# (steps_per_print) through this logger at INFO; nothing is printed.
logger = logging.getLogger("strata")


class StrataWarning(UserWarning):
    """What the engine warns of: a key it does not act on, a value it changed, a plan it left."""


def register_external_parameter(module, parameter):
    """Says that `module`'s forward uses `parameter`, which another module owns (a tied weight
    used functionally, as ``h @ self.wte.weight.t()``), as DeepSpeed's
    ``deepspeed.zero.register_external_parameter``: at stage 3 the parameter is then lent for the
    whole of `module`'s forward. Call it before ``strata.initialize``."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise ValueError("register_external_parameter: accepted: a torch.nn.Parameter")
    external = module.__dict__.setdefault("_strata_external_parameters", [])
    if not any(p is parameter for p in external):
        external.append(parameter)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_TRAINER_WARNING = "(DeepSpeed's; left to the trainer)"
_ENGINE_KEYS = tuple(f"zero_optimization.{k}:" for k in (
    "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm"))


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None):
    """DeepSpeed's ``deepspeed.initialize`` shape: returns (engine, optimizer, dataloader,
    lr_scheduler). ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a dict or
    the path of a JSON file. ``optimizer`` may be a torch Adam/AdamW (or strata.optim's), whose
    hyper-parameters the engine takes; a config's ``optimizer`` block is used otherwise.
    ``training_data`` gives a DataLoader of train_micro_batch_size_per_gpu."""
    if model is None:
        raise ValueError("strata.initialize: model is required")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("strata.initialize: config is required (a dict or a JSON path)")
    if mpu is not None:
        raise ValueError("strata.initialize: mpu (model parallelism) is not supported")
    raw = TrainConfig.load(config)
    ranks = ranks_module.join(raw)
    engine = Engine(model, TrainConfig.parse(raw, world_size=ranks.size if ranks else 1),
                    optimizer=optimizer, model_parameters=model_parameters,
                    lr_scheduler=lr_scheduler, ranks=ranks)
    loader = None
    if training_data is not None:
        if ranks is not None:  # each rank its share of every epoch, as DeepSpeed's loader
            loader = _EpochLoader(
                training_data, batch_size=engine.micro_batch_size, collate_fn=collate_fn,
                sampler=torch.utils.data.distributed.DistributedSampler(
                    training_data, num_replicas=ranks.size, rank=ranks.rank, shuffle=True))
        else:
            loader = torch.utils.data.DataLoader(training_data, batch_size=engine.micro_batch_size,
                                                 collate_fn=collate_fn, shuffle=True)
    return engine, engine.optimizer, loader, engine.lr_scheduler


class _EpochLoader(torch.utils.data.DataLoader):
    """Across ranks: a DataLoader over a DistributedSampler that shuffles anew each epoch (each
    pass over it is the next epoch, as one process's shuffling loader), the ranks in step."""

    def __init__(self, *args, **kwargs):
        self._epoch = 0
        super().__init__(*args, **kwargs)

    def __iter__(self):
        self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        return super().__iter__()


class _Param:
    """What the engine keeps of one trainable parameter."""

    __slots__ = ("name", "param", "shape", "numel", "shard", "pid", "gid", "partitioned", "group",
                 "has_grad", "host_grad", "group_index", "steps", "sent_down", "staged",
                 "shard_grad", "frozen")

    def __init__(self, name, param, pid, shard=None, frozen=False):
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        # Elements of its optimizer state (and, partitioned, of its partitions) on this rank: all
        # of them, or across ranks its shard's (strata/ranks.py).
        self.shard = self.numel if shard is None else shard
        self.shard_grad = None  # across ranks: this rank's shard of the mean gradient (fp32)
        self.pid = pid  # the parameter's partition (stage 3, large parameters): even
        self.gid = pid + 1  # its gradient's partition and its optimizer state
        self.partitioned = False
        self.group = 0
        self.has_grad = False
        self.host_grad = None  # stage 2: the fp32 sum of the micro-batches' gradients
        self.group_index = 0  # which optimizer param group
        self.steps = 0  # optimizer steps taken with a gradient (Adam's t, as torch's per tensor)
        self.sent_down = False  # GradientReady told for this step's gradient
        self.staged = None  # (lr, param copy target) once its step is staged (_Staged)
        # A frozen parameter partitioned at stage 3: lent around its modules as any other, with no
        # gradient, no optimizer state (gid unused), never written back.
        self.frozen = frozen


class _Staged:
    """The optimizer step being staged during backward (Runtime.begin_optimizer_step): each
    partitioned parameter's step is staged as autograd makes its gradient final, speculatively
    with no clipping and no overflow; engine.step() commits it when that was right, else aborts
    it and steps again."""

    def __init__(self, scale):
        self.scale = scale  # the loss scale the gradients were made with
        self.entries = []  # staged _Param entries, their targets pinned in the host tier


class _HostActivations:
    """Where strata.checkpointing's cpu_checkpointing keeps a checkpoint's floating-point inputs:
    partitions of the engine's host tier (role "other", ids after the parameters'), so that they
    count in strata.host_budget_bytes. Holds the engine weakly: once it is gone, checkpoints keep
    torch's host copies again."""

    def __init__(self, engine):
        self.engine = weakref.ref(engine)
        self._free = []  # ids given back
        self._next = None  # the next id never used

    def keep(self, tensor):
        engine = self.engine()
        if engine is None or tensor.dtype not in _DTYPE_NAMES or tensor.numel() == 0:
            return None
        if self._next is None:
            self._next = engine._next_id
        pid = self._free.pop() if self._free else self._next
        if pid == self._next:
            self._next += 1
        flat = tensor.detach().reshape(-1).to("cpu")
        try:
            engine.runtime.register(pid, "other", _DTYPE_NAMES[tensor.dtype], flat.numel(), 0,
                                    "host", flat.contiguous())
        except _strata.Error as error:
            self._free.append(pid)
            raise _strata.Error(
                f"cpu_checkpointing: a checkpointed input of {flat.numel() * flat.element_size()} "
                f"bytes does not fit the host tier (strata.host_budget_bytes): {error}") from None
        return _HeldActivation(self, engine.runtime, pid, tensor.shape)

    def bring(self, held, device):
        """The input back on `device`; its partition is dropped."""
        part = from_dlpack(held.runtime.acquire(held.pid, "host", traced=False))
        try:
            return part.view(held.shape).to(device, copy=True)
        finally:
            del part
            held.runtime.release(held.pid, "host", False, traced=False)
            held.drop()


class _HeldActivation:
    """One kept input: its partition is unregistered when backward has brought it back, or when
    the graph holding it is freed without a backward."""

    def __init__(self, store, runtime, pid, shape):
        self.store, self.runtime, self.pid, self.shape = store, runtime, pid, shape

    def drop(self):
        if self.pid is not None:
            pid, self.pid = self.pid, None
            self.runtime.unregister(pid)
            self.store._free.append(pid)

    def __del__(self):
        try:
            self.drop()
        except Exception:  # the Runtime is being torn down: its partitions go with it
            pass


class _Optimizer(torch.optim.Optimizer):
    """The optimizer the engine returns: torch's surface (param_groups with their lr, for
    schedulers; zero_grad; state_dict of the hyper-parameters) over the Runtime's optimizer.
    ``step()`` is the engine's."""

    def __init__(self, engine, groups, defaults):
        self._engine = weakref.ref(engine)  # the engine holds its optimizer, not the other way
        super().__init__(groups, defaults)

    def _engine_or_raise(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine this optimizer steps is gone (closed or deleted)")
        return engine

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._engine_or_raise().step()
        return loss

    def zero_grad(self, set_to_none=True):
        self._engine_or_raise().zero_grad()


class Engine:
    """The training engine ``strata.initialize`` returns (see the module's docstring)."""

    def __init__(self, model, config, optimizer=None, model_parameters=None, lr_scheduler=None,
                 ranks=None):
        self.module = model
        self.config = config
        self.ranks = ranks  # strata/ranks.py: None in a job of one process
        # DeepSpeed's engine's: this process's place in the job.
        self.global_rank = ranks.rank if ranks is not None else 0
        self.world_size = ranks.size if ranks is not None else 1
        self.local_rank = ranks.job.local_rank if ranks is not None else 0
        self.dtype = _DTYPES[config.dtype]
        # What micro-batches' gradients are summed in (data_types.grad_accum_dtype, fp32 by
        # default), at every stage: partitioned ones in their gradient partition, the others in
        # a host sum (e.host_grad) when it differs from the training dtype.
        self.grad_accum_dtype = _DTYPES[config.grad_accum_dtype]
        self._sum_apart = config.accumulation > 1 and self.grad_accum_dtype != self.dtype
        self.micro_batch_size = config.micro_batch
        self._accumulation = config.accumulation
        self._backward_since_step = False  # step() without a backward is refused
        self._step_applied = False  # the last boundary's step changed the weights
        self._global_grad_norm = None  # the last step's, when it computed one
        self.warnings = []
        self.global_steps = 0  # accumulation boundaries passed (skipped steps included)
        self.skipped_steps = 0
        self.micro_steps = 0
        self._optimizer_read = self._optimizer_written = 0  # the optimizer's NVMe bytes
        self.last_step_stats = {}

        on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                   if t.device.type == "meta"]
        if on_meta:
            raise ValueError(
                f"strata.initialize: {len(on_meta)} tensors of the model are on the meta device "
                f"and hold no values ({', '.join(on_meta[:5])}{', ...' if len(on_meta) > 5 else ''})"
                "; accepted: a model built on the CPU, or under strata.init (which partitions "
                "each parameter as it is made); load pretrained weights after initialize")
        settings = _RuntimeSettings(config)
        for message in settings.warnings:
            self._warn(message)
        self.stage = settings.stage
        self._param_tier = settings.param_tier
        self._persistence_threshold = settings.threshold
        built = init_module.built_under(model)
        runtime_blocks = json.loads(settings.runtime_json)
        # The bucket keys, checked in one process too.
        ranks_module.bucket_settings(runtime_blocks.get("zero_optimization", {}), self.stage)
        if ranks is not None:
            self._check_ranks(runtime_blocks)
        if built is not None and built.settings.runtime_json != settings.runtime_json:
            raise ValueError("strata.initialize: the model was built under strata.init with "
                             "another config; accepted: the same zero_optimization and strata "
                             "blocks")
        # The callback holds the engine weakly: the Runtime (a C++ object the garbage collector
        # cannot see into) must not keep its engine alive.
        engine = weakref.ref(self)

        def on_warning(w):
            return engine() is not None and engine()._runtime_warning(w)

        if built is not None:
            self._runtime = built.adopt(on_warning)  # its partitions are the model's parameters
        else:
            self._runtime, stale = make_runtime(settings, on_warning)
            if stale:
                self._warn(stale)
        self.device_kind = "emulated" if self.runtime.emulated_device else "cuda"
        if ranks is not None and self.device_kind != "emulated":
            raise ValueError("strata.initialize: across ranks the engine runs on the emulated "
                             "device tier (strata.device \"emulated\"), its collectives on Gloo "
                             "over host memory; the CUDA device tier across ranks (NCCL) is not "
                             "wired into the engine yet")
        if ranks is not None:  # every rank starts from rank 0's weights
            ranks.broadcast_module(
                model, skip=lambda t: init_module.partition_of(t) is not None)  # (those are)
        if config.activation_checkpointing is not None:
            checkpointing.configure(deepspeed_config=config.activation_checkpointing)
        # cpu_checkpointing keeps checkpointed inputs in this engine's host tier.
        checkpointing.use_host_store(_HostActivations(self))
        # Where the model computes: the CPU beside the emulated device tier, else the GPU of the
        # device tier (as DeepSpeed's engine, strata moves the module there).
        self.device = torch.device("cpu") if self.device_kind == "emulated" else \
            torch.device("cuda", torch.cuda.current_device())

        hyper = self._hyper_parameters(config, optimizer)
        self._params = []
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if model_parameters is not None:  # (a generator is read twice below)
            model_parameters = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g
                                for g in (model_parameters if not torch.is_tensor(model_parameters)
                                          else [model_parameters])]
            wanted = {id(p) for p in _flatten_params(model_parameters)}
            named = [(n, p) for n, p in named if id(p) in wanted]
        if not named:
            raise ValueError("strata.initialize: the model has no trainable parameters")
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise ValueError("strata.initialize: the model is torch.compile'd; accepted: the "
                             "module itself (model._orig_mod): the engine lends parameters "
                             "around each module's forward, which a compiled graph bypasses")
        for path, module in model.named_modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
                raise ValueError(
                    f"strata.initialize: {path or type(module).__name__} is a "
                    f"{type(module).__name__} with sparse=True: sparse gradients are not "
                    "supported (the optimizer steps dense partitions); accepted: sparse=False")
        # Ids: a parameter built under strata.init keeps its partition's; the others take pairs
        # after every id in use.
        next_id = built.next_id if built is not None else 0
        for name, p in named:
            pid = init_module.partition_of(p)
            if pid is None:
                pid, next_id = next_id, next_id + 2
            self._params.append(_Param(name, p, pid, None if ranks is None
                                       else ranks.shard_elements(p.numel())))
        # The parameters not trained (requires_grad False, or left out of model_parameters): at
        # stage 3 the large ones (and any built under strata.init) are partitions too.
        self._frozen = []
        trained = {id(p) for _, p in named}
        for name, p in model.named_parameters():
            if id(p) in trained or self.stage != 3:
                continue
            pid = init_module.partition_of(p)
            if pid is None and p.numel() < self._persistence_threshold:
                continue
            if ranks is not None:
                if pid is None:  # across ranks frozen parameters stay whole on each device
                    continue
                raise ValueError(
                    f"strata.initialize: {name} was built under strata.init and is not trained "
                    f"(frozen): across {ranks.size} ranks a frozen parameter's partition is not "
                    "supported yet; accepted: freeze it in one process, or build the model "
                    "without strata.init")
            if pid is None:
                pid, next_id = next_id, next_id + 2
            self._frozen.append(_Param(name, p, pid, frozen=True))
        self._next_id = next_id  # the first id no partition uses (cpu_checkpointing's start)
        by_param = {id(e.param): e for e in self._params}
        groups = self._param_groups(optimizer, model_parameters, hyper, by_param)

        self.optimizer_kind = hyper["kind"]
        self._initial_state = hyper["initial_accumulator_value"]  # a fresh optimizer's first state
        self.runtime.create_optimizer(
            kind=hyper["kind"], lr=hyper["lr"], beta1=hyper["betas"][0],
            beta2=hyper["betas"][1], eps=hyper["eps"], weight_decay=hyper["weight_decay"],
            adamw=hyper["adamw"], bias_correction=hyper["bias_correction"],
            lr_decay=hyper["lr_decay"], partitions=[(e.gid, e.shard) for e in self._params],
            copy_dtype=config.dtype, copy_elements=self._staged_copy_elements())
        with torch.no_grad():
            for e in self._params:
                # One parameter at a time (a partition's from its tier: never the whole model).
                self.runtime.initialize_optimizer_state(
                    e.gid, self._initial_weights(e), initial_state=hyper["initial_accumulator_value"])
        # The placeholder of a partitioned parameter: on the compute device, so that swapping
        # .data never changes a parameter's device (torch would drop its gradient node).
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        # Buffers go to the device. A module's floating buffers take the training dtype when it
        # has parameters of its own (BatchNorm's running statistics compute with its weight);
        # those of a module without parameters (a rotary embedding's inv_freq) keep theirs.
        for module in model.modules():
            own = any(p is not None for p in module._parameters.values())
            for b in module._buffers.values():
                if b is not None:
                    b.data = b.data.to(device=self.device, dtype=self.dtype
                                       if own and b.is_floating_point() else b.dtype)
        self._hook_handles, self._patched_forward = [], []  # what close() takes off
        self._place_parameters(model)
        self._install_module_hooks(model)
        # The module's own load_state_dict would set placeholders and tensors the optimizer's
        # master weights overwrite at the next step: it loads through the engine instead.
        model.load_state_dict = types.MethodType(_load_state_dict_through(engine), model)

        self.optimizer = _Optimizer(self, groups, dict(lr=hyper["lr"], betas=hyper["betas"],
                                                       eps=hyper["eps"],
                                                       weight_decay=hyper["weight_decay"]))
        self.lr_scheduler = lr_scheduler
        if self.lr_scheduler is None and config.scheduler is not None:
            self.lr_scheduler = lr_schedules.make(config.scheduler, self.optimizer)
        elif callable(self.lr_scheduler) and not hasattr(self.lr_scheduler, "step"):
            self.lr_scheduler = self.lr_scheduler(self.optimizer)
        elif self.lr_scheduler is not None:
            self._adopt_schedule(self.lr_scheduler, optimizer)

        self.loss_scale = 1.0
        self._dynamic_scale = False
        if self.dtype == torch.float16:
            self._dynamic_scale = config.loss_scale == 0
            self.loss_scale = 2.0 ** config.initial_scale_power if self._dynamic_scale \
                else config.loss_scale
        self._hysteresis_left = config.hysteresis
        self._scale_iteration = 0
        self._last_overflow = -1
        # The step staged during backward (stage 3): on until a step needs clipping, then off
        # until one does not.
        self._staged = None
        # Across ranks the step is taken after backward (the ranks agree on its norm first).
        self._speculate = ranks is None
        self._gather_order = None  # across ranks: the modules' fetches, once recorded
        self._recording = []
        self._cursor = None
        self._prefetched = None  # (module, its entries, the gather started for it)
        self.prefetched_gathers = 0  # gathers started ahead that their module used
        # Parameters homed on NVMe take their new weights from the committed master weights, one
        # at a time, rather than all at once in host memory (_refresh_weights).
        self._refresh = self._param_tier == "nvme"
        self._pending_refresh = []
        self._refresh_error = None  # a step's new weights not all written: step() raises it
        self._redo_reason = None  # the staged step was dropped during this backward
        self._fired = set()  # parameters whose gradient hook ran in the boundary micro-batch
        self._second_gradient = False  # one of them ran twice: staging pauses for a step
        self.redone_steps = 0  # staged steps dropped and taken anew
        self.last_redo_reason = None

    # --- set-up -------------------------------------------------------------------------------

    def _warn(self, message):
        if message not in self.warnings:
            self.warnings.append(message)
            if self.global_rank == 0:  # every rank keeps it; rank 0 says it
                warnings.warn(f"strata: {message}", StrataWarning, stacklevel=2)

    def _runtime_warning(self, message):
        if message.endswith(_TRAINER_WARNING):
            message = message[:-len(_TRAINER_WARNING)] + "(DeepSpeed's; not supported by strata: " \
                                                         "ignored)"
        if message.startswith(_ENGINE_KEYS):
            return  # the engine acts on these (the bucket keys across ranks: strata/ranks.py)
        self._warn(message)

    @staticmethod
    def _hyper_parameters(config, optimizer):
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

    def _param_groups(self, optimizer, model_parameters, hyper, by_param):
        """The optimizer's parameter groups, each with its own lr and weight_decay (the no-decay
        group of biases and norms most fine-tuning scripts make): the client optimizer's groups,
        else the groups given as model_parameters (dicts with "params" and any of "lr" and
        "weight_decay", the config's values for the rest), else one group. Other
        hyper-parameters (betas, eps, lr_decay) cannot differ between groups: the Runtime's
        optimizer has one set."""
        if optimizer is not None:
            given, source = optimizer.param_groups, "the optimizer's param group"
        elif model_parameters is not None and any(isinstance(g, dict) for g in model_parameters):
            given, source = model_parameters, "model_parameters group"
        else:
            return [{"params": [e.param for e in self._params], "lr": hyper["lr"],
                     "weight_decay": hyper["weight_decay"]}]
        groups = []
        for index, group in enumerate(given):
            if not isinstance(group, dict):
                raise ValueError(f"strata.initialize: {source} {index} is a "
                                 f"{type(group).__name__}; accepted: every group a dict with "
                                 "\"params\", or no groups (parameters alone)")
            for key in ("betas", "eps", "lr_decay"):
                if key in group and tuple(_as_tuple(group[key])) != tuple(_as_tuple(hyper[key])):
                    raise ValueError(
                        f"strata.initialize: {source} {index} has {key} {group[key]} where the "
                        f"optimizer has {hyper[key]}; accepted: groups that differ in lr and "
                        "weight_decay only")
            params = [p for p in group["params"] if id(p) in by_param]
            for p in params:
                by_param[id(p)].group_index = len(groups)
            groups.append({"params": params, "lr": float(group.get("lr", hyper["lr"])),
                           "weight_decay": float(group.get("weight_decay",
                                                           hyper["weight_decay"]))})
        missing = [e.name for e in self._params if not any(
            e.param is p for g in groups for p in g["params"])]
        if missing:
            raise ValueError(f"strata.initialize: trainable parameters not in the optimizer: "
                             f"{', '.join(missing[:5])}")
        return groups

    def _adopt_schedule(self, schedule, client):
        """A schedule built on the client's optimizer (transformers'
        get_linear_schedule_with_warmup(optimizer, ...) before initialize) sets the rates of
        that optimizer, which the engine does not step: it is moved onto the engine's optimizer,
        whose groups take the client's as the schedule left them (its initial_lr, and lr at the
        schedule's first step)."""
        bound = getattr(schedule, "optimizer", None)
        if bound is None or bound is self.optimizer:
            return
        if bound is not client:
            raise ValueError("strata.initialize: lr_scheduler sets the rates of an optimizer that "
                             "was not given to initialize; accepted: a schedule of the optimizer "
                             "given, of the engine's optimizer (a callable taking it), or none")
        for ours, theirs in zip(self.optimizer.param_groups, client.param_groups):
            ours.update({k: v for k, v in theirs.items() if k != "params"})
        schedule.optimizer = self.optimizer

    def _hyper_of(self, e):
        """(lr, weight_decay) of e's group now (a schedule may have changed them)."""
        group = self.optimizer.param_groups[e.group_index]
        return float(group["lr"]), float(group["weight_decay"])

    def _check_ranks(self, runtime):
        """What the engine does across ranks (strata/ranks.py), and what it refuses."""
        if self.stage not in (1, 2, 3):
            raise ValueError(f"strata.initialize: zero_optimization.stage {self.stage} across "
                             f"{self.ranks.size} ranks: accepted: 1, 2 or 3 (each rank owns a "
                             "shard of the optimizer's state)")
        self.ranks.configure(runtime.get("zero_optimization", {}), self.stage,
                             runtime.get("strata", {}).get("host_budget_bytes", 4 << 30))
        for message in self.ranks.warnings:
            self._warn(message)

    def _will_partition(self, e):
        return init_module.partition_of(e.param) is not None or \
            (self.stage == 3 and e.numel >= self._persistence_threshold)

    def _staged_copy_elements(self):
        """Elements whose new weights a step stages in host memory: all, or (parameters homed on
        NVMe, read back from the master weights instead) the unpartitioned ones' (-1: all)."""
        if self._param_tier != "nvme":
            return -1
        return sum(e.shard for e in self._params if not self._will_partition(e))

    def _initial_weights(self, e):
        """e's weights in fp32 on the host: the tensor's, or its partition's (built under
        strata.init)."""
        if init_module.partition_of(e.param) is None:
            flat = e.param.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
            return flat if self.ranks is None else self.ranks.own_shard(flat, e.shard)
        held = from_dlpack(self.runtime.acquire(e.pid, "host", traced=False))
        try:
            return held.to(torch.float32)
        finally:
            del held
            self.runtime.release(e.pid, "host", False, traced=False)

    def _place_parameters(self, model):
        """Casts the parameters to the training dtype; at stage 3 makes the large ones strata
        partitions (their module's index is their group); hooks the gradients of those (and, at
        stage 2, of all) as they are made."""
        owner = {}
        for module_index, module in enumerate(model.modules()):
            for p in module._parameters.values():
                if p is not None:
                    owner.setdefault(id(p), module_index)
        trainable = {id(e.param) for e in self._params}
        frozen = {id(e.param) for e in self._frozen}
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in trainable and id(p) not in frozen:
                    p.data = p.data.to(device=self.device, dtype=self.dtype)
            for e in self._frozen:
                e.group = owner.get(id(e.param), 0)
                e.partitioned = True
                if init_module.partition_of(e.param) is None:
                    self.runtime.register(
                        e.pid, "param", _DTYPE_NAMES[self.dtype], e.shard, e.group,
                        self._param_tier,
                        e.param.detach().to(device="cpu", dtype=self.dtype).reshape(-1)
                        .contiguous())
                e.param.data = self._empty
            for e in self._params:
                e.group = owner.get(id(e.param), 0)
                built = init_module.partition_of(e.param) is not None
                e.partitioned = self._will_partition(e)
                if e.partitioned and not built:
                    initial = e.param.detach().to(device="cpu", dtype=self.dtype).reshape(-1) \
                        .contiguous()
                    if self.ranks is not None:  # its tiers hold this rank's shard only
                        initial = self.ranks.own_shard(initial, e.shard)
                    # Its shape, dtype and device without its bytes (one element, expanded), so
                    # that a model larger than the device is never whole there.
                    e.param.data = torch.zeros((), device=self.device, dtype=self.dtype) \
                        .expand(e.shape)
                else:
                    e.param.data = e.param.data.to(device=self.device, dtype=self.dtype)
                if e.partitioned or self.stage in (2, 3) or self._sum_apart:
                    # The AccumulateGrad node's hook runs once the gradient is in .grad. The node
                    # is made now, while the parameter has its shape and dtype (autograd checks
                    # gradients against them), and kept alive here.
                    with torch.enable_grad():
                        node = e.param.expand_as(e.param).grad_fn.next_functions[0][0]
                    self._hook_handles.append(node.register_hook(self._gradient_hook(e)))
                    e.param._strata_node = node
                if not e.partitioned:
                    continue
                if not built:
                    self.runtime.register(e.pid, "param", _DTYPE_NAMES[self.dtype], e.shard, e.group,
                                          self._param_tier, initial)
                # The gradient's partition starts with no bytes: its first acquire makes zeros.
                self.runtime.register(e.gid, "grad", _DTYPE_NAMES[self.grad_accum_dtype],
                                      e.shard, e.group, "host")
                self.runtime.discard(e.gid)
                e.param.data = self._empty

    def _install_module_hooks(self, model):
        self._discovered = False  # _ExternalUses has run (the first forward)
        self._discovering = None  # the _ExternalUses of the forward running now
        self._internal_depth = 0  # > 0 while the engine's own hooks run (_internal)
        self._by_module = {}
        partitioned = {id(e.param): e for e in self._params + self._frozen if e.partitioned}
        self._partitioned_by_id = partitioned
        self._holders = {}
        for module in model.modules():
            used = list(module._parameters.values()) + \
                list(getattr(module, "_strata_external_parameters", ()))
            own = [partitioned[id(p)] for p in used if p is not None and id(p) in partitioned]
            if own:
                self._lend_around(module, own)
        if self.stage == 3:
            # torch.compile of the model would run a graph that bypasses the lending (silently
            # wrong from its second step): dynamo is told to leave the model's forward eager.
            model.forward = torch.compiler.disable(model.forward)
            if model not in self._patched_forward:
                self._patched_forward.append(model)
            # The first forward, however it is called (engine(), generate()).
            self._hook_handles += [
                model.register_forward_pre_hook(_weakly(self._begin_discovery), prepend=True),
                model.register_forward_hook(_weakly(self._end_discovery), always_call=True)]

    def _begin_discovery(self, module, args):
        """The model's first forward finds the partitioned parameters a module uses that it does
        not own (_ExternalUses), and registers each with the module that used it."""
        if not self._discovered and self._discovering is None:
            self._discovering = _ExternalUses(self)
            self._discovering.__enter__()

    def _end_discovery(self, module, args, output):
        if self._discovering is not None:
            discovering, self._discovering = self._discovering, None
            discovering.__exit__(None, None, None)
            self._discovered = True

    def _lend_around(self, module, entries):
        """Lends `entries` (partitioned parameters) around `module`'s forward and backward: hooks
        it (once) and adds them to what it lends."""
        if module not in self._by_module:
            self._by_module[module] = []
            # The hooks hold the engine weakly: the module must not keep its engine alive (the
            # last reference to an engine frees its Runtime, pinned memory and disk).
            # Lending runs before the module's other pre-hooks (they see its weights, as in plain
            # torch); a post-hook registered after the engine's sees them given back.
            self._hook_handles += [
                module.register_forward_pre_hook(_weakly(self._before_forward), with_kwargs=True,
                                                 prepend=True),
                module.register_forward_hook(_weakly(self._after_forward))]
            if type(module) is torch.nn.Linear:
                module.forward = types.MethodType(_zero3_linear_forward, module)
                self._patched_forward.append(module)
        self._by_module[module] += [e for e in entries if e not in self._by_module[module]]

    @contextlib.contextmanager
    def _internal(self):
        """The engine's own torch calls (lending, gathering): _ExternalUses lets them be."""
        self._internal_depth += 1
        try:
            yield
        finally:
            self._internal_depth -= 1

    def _use_external(self, param, module):
        """`module`'s forward used `param`, a partitioned parameter it does not own (found by
        _ExternalUses): it is registered as external to `module`, lent around it from now on, and
        lent now, until `module`'s forward ends."""
        e = self._partitioned_by_id[id(param)]
        register_external_parameter(module, param)
        self._lend_around(module, [e])
        self._holders[e.pid] = self._holders.get(e.pid, 0) + 1
        if e.param.data.numel() == 0:
            e.param.data = from_dlpack(self.runtime.lend(e.pid, "device")).view(e.shape)

    # --- stage 3: parameters lent around each module's forward and backward -------------------

    # A parameter is lent while some module's forward that uses it runs (an outer module's
    # external parameter stays lent through the inner module's forward): `_holders` counts them.

    def _fetch(self, module):
        prefetched = self._take_prefetched(module)
        gather = []
        for e in self._by_module[module]:
            held = self._holders.get(e.pid, 0)
            if held == 0 and e.param.data.numel() == 0 and e not in prefetched[0]:
                try:
                    lent = from_dlpack(self.runtime.lend(e.pid, "device"))
                except _strata.Error as error:
                    if error.code != "RESOURCE_EXHAUSTED":
                        raise
                    lent_now = sum(x.numel * x.param.element_size() for x in
                                   self._params + self._frozen if x.partitioned and
                                   x.param.data.numel())
                    told = _strata.Error(
                        f"{error} (lending {e.name} to {type(module).__name__}: "
                        f"{lent_now} bytes of parameters are lent now; a view autograd saved, "
                        "or gradient checkpointing recomputing a whole block in backward, holds "
                        "its module's parameters at once: raise strata.device_budget_bytes to "
                        "hold them)")
                    told.code, told.errno = error.code, getattr(error, "errno", 0)
                    raise told from None
                if self.ranks is None:
                    e.param.data = lent.view(e.shape)
                else:  # its shard, gathered whole with the module's others (then given back)
                    gather.append((e, lent, self._sink(e)))
            self._holders[e.pid] = held + 1
        if self.ranks is not None:
            self.ranks.finish_gather(prefetched[1])
            if gather:
                self.ranks.gather(gather)
            self._prefetch_after(module)

    # Across ranks, the all-gathers follow the order the first micro-batch fetched the modules in
    # (forward, then backward): while a module computes, the next one's weights are gathered
    # (issued on every rank at the same point, so the ranks' collectives stay in one order). A
    # micro-batch whose order differs (on every rank alike) gathers on demand for its rest.

    def _sink(self, e):
        def sink(whole):
            if e.param.data.numel() == 0:  # (a prefetch dropped unused hands its copy to nobody)
                e.param.data = whole.view(e.shape)
        return sink

    def _take_prefetched(self, module):
        """({entries} the gather started ahead for `module` covers, its collectives); a gather
        started for another module is waited for and dropped."""
        pending, self._prefetched = self._prefetched, None
        if pending is None:
            return set(), []
        target, entries, started = pending
        if target is module:
            self.prefetched_gathers += 1
            return entries, started
        for work, _, _ in started:
            work.wait()
        return set(), []

    def _prefetch_after(self, module):
        if self._gather_order is None:  # the first micro-batch: recording the order
            self._recording.append(module)
            return
        if self._cursor is None or self._cursor >= len(self._gather_order) or \
                self._gather_order[self._cursor] is not module:
            self._cursor = None  # another order: on demand until the next forward
            return
        self._cursor += 1
        if self._cursor == len(self._gather_order):
            return
        following = self._gather_order[self._cursor]
        items = []
        for e in self._by_module[following]:
            if self._holders.get(e.pid, 0) == 0 and e.param.data.numel() == 0:
                items.append((e, from_dlpack(self.runtime.lend(e.pid, "device")), self._sink(e)))
        if items:
            self._prefetched = (following, {e for e, _, _ in items},
                                self.ranks.start_gather(items))

    def _drop(self, module, frozen_only=False):
        for e in self._by_module.get(module, ()):
            if frozen_only and not e.frozen:
                continue
            held = self._holders.get(e.pid, 0) - 1
            self._holders[e.pid] = max(held, 0)
            if held <= 0:
                e.param.data = self._empty

    def _drop_all(self):
        self._holders.clear()
        for e in self._params + self._frozen:
            if e.partitioned:
                e.param.data = self._empty

    def _before_forward(self, module, args, kwargs):
        with self._internal():
            self._fetch(module)
        if torch.is_grad_enabled() and any(e.frozen for e in self._by_module[module]):
            # A frozen parameter has no gradient hook to give it back in backward: it goes back
            # once the gradient of the module's input is made (its backward is done then).
            for t in _tensors((args, kwargs)):
                if t.requires_grad:
                    done = []

                    def after_backward(grad, module=module, done=done):
                        if not done:
                            done.append(True)
                            self._drop(module, frozen_only=True)

                    t.register_hook(after_backward)
                    break

    def _after_forward(self, module, inputs, output):
        hooked = False
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, module=module: self._before_backward(module))
                    hooked = True
            if not hooked and any(not e.frozen for e in self._by_module[module]):
                # No output carries a gradient back into the module, yet it has trained
                # parameters: what it computed with them went elsewhere (an auxiliary loss kept
                # on the module), where no hook could lend them again for backward. They stay
                # lent until their gradients are made (the gradient hook gives each back), or
                # until backward ends.
                return
        with self._internal():
            self._drop(module)

    def _before_backward(self, module):
        self._fetch(module)

    def _gradient_hook(self, e):
        # The hook lives on a C++ autograd node the garbage collector cannot see into: it holds
        # the engine weakly, or the engine would never be collected.
        engine = weakref.ref(self)

        def hook(*unused):
            self = engine()
            if self is None:
                return
            grad = e.param.grad
            if grad is None:
                return
            boundary = self.is_gradient_accumulation_boundary()
            if boundary:
                if e.staged is not None or e in self._fired:
                    # A second gradient in the boundary micro-batch (a second backward through
                    # it): a step staged from the first cannot stand, and its hold on the gradient
                    # goes before the gradient is added to.
                    self._second_gradient = True
                    if e.staged is not None:
                        self._drop_staged(f"the gradient of {e.name} changed after its step was "
                                          "staged")
                self._fired.add(e)
            if e.partitioned:
                e.param.grad = None
                # Its gradient is the last thing backward needed of it (autograd sums the uses of
                # a shared parameter before this hook): the lent copy goes back now.
                self._holders.pop(e.pid, None)
                e.param.data = self._empty
                if self.ranks is not None:  # reduce-scattered into the owners' shards
                    self.ranks.add_gradient(e, grad, boundary, self._add_gradient_shard)
                    return
                self._add_to_gradient_partition(e, grad.reshape(-1), boundary)
                if boundary:  # its optimizer step is staged
                    self._stage(e)
            elif self.stage == 2 and self.ranks is not None:
                # Reduce-scattered as it is made: this rank keeps only its shard's mean.
                e.param.grad = None
                self.ranks.add_gradient(e, grad, boundary, self._add_gradient_shard)
            elif self.stage == 2 or self._sum_apart:
                # To the host as it is made, summed there in grad_accum_dtype (stage 2; other
                # stages when that is not the training dtype).
                e.param.grad = None
                if e.host_grad is None:
                    e.host_grad = torch.zeros(e.numel, dtype=self.grad_accum_dtype)
                e.host_grad.add_(grad.reshape(-1).to(device="cpu", dtype=self.grad_accum_dtype))
                e.has_grad = True
            elif boundary and grad.device.type == "cpu":
                # Stage 3's small parameters keep torch's .grad; its final value is staged (a
                # copy: a second backward would add to .grad while the optimizer reads it). On a
                # GPU the copy to the host would make the host wait for the device in the middle
                # of backward: those are staged after backward instead.
                self._stage(e, grad.detach().reshape(-1).clone())
        return hook

    def _add_gradient_shard(self, e, shard, boundary):
        """Across ranks: this rank's shard of e's mean gradient, summed into its gradient (stage 2:
        e.shard_grad in fp32; stage 3: its gradient partition, which at the boundary leaves the
        device)."""
        if not e.partitioned:
            e.shard_grad = shard if e.shard_grad is None else e.shard_grad.add_(shard)
            e.has_grad = True
            return
        self._add_to_gradient_partition(e, shard, boundary)

    def _add_to_gradient_partition(self, e, values, boundary):
        """Sums `values` into e's gradient partition on the device; in its last micro-batch
        (`boundary`) the gradient leaves the device now, in the background, while backward goes
        on."""
        with torch.no_grad():
            part = from_dlpack(self.runtime.acquire(e.gid, "device"))
            part.add_(values)
            del part
        self.runtime.release(e.gid, "device", True)
        e.has_grad = True
        if boundary:
            self.runtime.gradient_ready(e.gid)
            e.sent_down = True

    # --- the step staged during backward ------------------------------------------------------

    def _stage(self, e, grad=None, clip=1.0, always=False):
        """Stages e's optimizer step (its gradient is final; `clip`: the clipping coefficient):
        the Runtime's optimizer thread reads its NVMe state, steps it and writes it to fresh
        extents (during backward, when staged from the gradient hook); the new weights reach the
        parameter when the step commits. A partitioned parameter's gradient is its gradient
        partition (taken from the host tier by that thread, one at a time) and its new weights go
        into its host copy, pinned until then (with parameters homed on NVMe, they are read back
        from the committed master weights instead, one at a time: _refresh_weights); another's are
        given (`grad`). Without `always`, nothing is staged while staging is paused."""
        staged = self._staged
        if staged is None:
            if not always and (not self._speculate or self._redo_reason is not None):
                return
            self.runtime.begin_optimizer_step()
            staged = self._staged = _Staged(self.loss_scale)
        lr, weight_decay = self._hyper_of(e)
        try:
            target = None
            if not e.partitioned:
                target = self._weights_target(e)
            elif not self._refresh:
                target = from_dlpack(self.runtime.acquire(e.pid, "host", traced=False))
            e.staged = ((lr, weight_decay), target)
            staged.entries.append(e)
            self.runtime.stage_optimizer_step(
                e.steps + 1, [(e.gid, grad, target)], lr=lr, grad_scale=clip / staged.scale,
                check_overflow=self.dtype == torch.float16, weight_decay=weight_decay)
        except _strata.Error as error:
            if always:
                raise
            # Staging is the step done early; when it cannot be (the host tier has no room for
            # the parameter's copy, say), the step is taken after backward, as unstaged.
            self._drop_staged(f"staging the step of {e.name} failed: {error}")

    def _weights_target(self, e):
        """Where the optimizer writes an unpartitioned parameter's new weights (in the training
        dtype): the parameter itself when it is a contiguous CPU tensor, else a copy made for
        it (_write_back_weights puts it in place)."""
        if self.ranks is not None:  # this rank's shard, all-gathered after the step
            return torch.empty(e.shard, dtype=self.dtype)
        if e.param.device.type == "cpu" and e.param.is_contiguous():
            return e.param.data.reshape(-1)
        return torch.empty(e.numel, dtype=self.dtype)

    def _drop_staged(self, reason):
        """The staged step cannot stand: aborted; this step is taken anew after backward."""
        self.redone_steps += 1
        self.last_redo_reason = self._redo_reason = reason
        self._end_staged(committed=False)

    def _end_staged(self, committed):
        """Ends the staged step: aborted unless `committed`; the partitioned parameters' host
        copies released (written when committed), the others' new weights put in place."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        if not committed:
            self.runtime.abort_optimizer_step()
        gather = []
        for e in staged.entries:
            target = e.staged[1]
            e.staged = None
            if e.partitioned:
                if target is not None:
                    del target
                    self.runtime.release(e.pid, "host", committed, traced=False)
            elif committed and self.ranks is not None:
                gather.append((e, target, lambda whole, e=e: e.param.data.copy_(
                    whole.view(e.shape))))
            elif committed:
                self._write_back_weights(e, target)
        if gather:  # every rank's new shards, whole on every rank
            with torch.no_grad():
                self.ranks.gather(gather)

    # --- the loop -----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.runtime  # noqa: B018 - a closed engine says so, not the module's placeholders
        if self._pending_refresh:  # a step's new weights not written yet (_refresh_weights)
            self._refresh_weights(list(self._pending_refresh))
        if self.ranks is not None:
            self._take_prefetched(None)  # one started for a backward that did not come
            self._cursor = 0
            if self._gather_order is None:  # recorded from the forward whose backward comes
                self._recording = []
        return self.module(*args, **kwargs)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Backward of the micro-batch's loss, scaled by 1/gradient_accumulation_steps (as
        DeepSpeed's; not with scale_wrt_gas=False) and by the fp16 loss scale. retain_graph as
        torch's (a second backward through the same graph adds to the gradients)."""
        scaled = loss.float() / self._accumulation if scale_wrt_gas else loss.float()
        if self.loss_scale != 1.0:
            scaled = scaled * self.loss_scale
        self._backward_since_step = True
        try:
            scaled.backward(retain_graph=retain_graph)
            if self.ranks is not None:
                self.ranks.finish_gradients()
                if self._gather_order is None:
                    self._gather_order = self._recording
        except BaseException:
            if self.ranks is not None:
                # The gradients autograd made before the failure are kept, as in one process
                # (whatever the buckets: those not reduced yet are now), every rank alike; if the
                # ranks cannot (one failed alone, or the job did), they are dropped.
                try:
                    self.ranks.finish_gradients()
                except Exception:  # noqa: BLE001 - the backward's own error is the one raised
                    self.ranks.drop_gradients()
            self._end_staged(committed=False)
            raise
        finally:
            self._drop_all()
        self._raise_deferred()
        return loss

    # --- DeepSpeed's engine API, as trainers call it ------------------------------------------

    def gradient_accumulation_steps(self):
        return self._accumulation

    def zero_optimization_stage(self):
        return self.stage

    def bf16_enabled(self):
        return self.dtype == torch.bfloat16

    def fp16_enabled(self):
        return self.dtype == torch.float16

    def get_global_grad_norm(self):
        """The global gradient norm of the last optimizer step (unscaled, over every rank), as
        DeepSpeed's; None when that step did not compute one (gradient_clipping 0 and no fp16
        across ranks: strata does not read every gradient once more only to report it)."""
        return self._global_grad_norm

    def was_step_applied(self):
        """Whether the last accumulation boundary's step changed the weights (False after an
        fp16 overflow skipped it)."""
        return self._step_applied

    def no_sync(self):
        """DeepSpeed's: a context in which gradients are not reduced across ranks. In one process,
        and at stage 1 across ranks (which reduces at the step), nothing is reduced during
        backward anyway; stages 2 and 3 partition gradients as they are made, so it is refused
        there, as DeepSpeed refuses it."""
        if self.ranks is not None and self.stage in (2, 3):
            raise RuntimeError(f"no_sync: ZeRO stage {self.stage} reduce-scatters gradients as "
                               "backward makes them and cannot hold them back; accepted: stage "
                               "1, or one process")
        return contextlib.nullcontext()

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin"):
        """DeepSpeed's: the model's weights whole in the training dtype (module_state_dict: the
        partitions gathered) written to save_dir/save_filename, by torch.save, or as safetensors
        when the name ends in .safetensors (a tied weight once). Across ranks every rank must
        call it; rank 0 writes. Returns True."""
        state = self.module_state_dict()
        if self.global_rank != 0:
            return True
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(os.fspath(save_dir), save_filename)
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file
            seen = set()
            state = {n: t.contiguous() for n, t in state.items()
                     if not (t.data_ptr() in seen or seen.add(t.data_ptr()))}
            save_file(state, path, metadata={"format": "pt"})
        else:
            torch.save(state, path)
        return True

    def train_batch_size(self):
        """DeepSpeed's: micro batch x gradient accumulation x ranks."""
        return self.micro_batch_size * self._accumulation * self.world_size

    def train_micro_batch_size_per_gpu(self):
        return self.micro_batch_size

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self._accumulation == 0

    def zero_grad(self):
        """Gradients are dropped at each optimizer step; between steps they accumulate."""

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self):
        """Ends a micro-batch; at an accumulation boundary, the optimizer step (see the module's
        docstring) and the learning-rate schedule's step. Refused, counting nothing, when no
        backward ran since the last step()."""
        if not self._backward_since_step:
            raise RuntimeError("step: no backward() since the last step(); accepted: "
                               "engine.backward(loss) then engine.step() for each micro-batch")
        self._backward_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        start = time.perf_counter()
        if self.stage == 3:
            for e in self._params:
                if e.partitioned and e.has_grad and not e.sent_down:
                    self.runtime.gradient_ready(e.gid)
        try:
            stepped, report = self._finish_staged()
            if stepped is None:  # nothing staged, or the staged step could not stand
                stepped, report = self._step_anew()
        except BaseException:
            self._end_gradients(failed=True)
            raise
        self._end_gradients(failed=False)
        self.global_steps += 1  # as DeepSpeed's: skipped steps count too
        self._step_applied = bool(stepped)
        self._global_grad_norm = report.get("grad_norm") if report else None
        if stepped:
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    # torch's schedules look for their optimizer's step() having run first: the
                    # engine's ran, within this step(), and the schedule follows it.
                    warnings.filterwarnings("ignore", r".*`optimizer\.step\(\)`", UserWarning)
                    self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        runtime_report = self.runtime.end_step()
        self._raise_deferred()
        self.last_step_stats = {
            "device": self.device_kind, "stepped": stepped, "loss_scale": self.loss_scale,
            "optimizer": report, "runtime": runtime_report,
            "step_seconds": time.perf_counter() - start}
        if self.global_steps % self.config.steps_per_print == 0 and self.global_rank == 0:
            waits = ", ".join(f"{k} {v * 1e3:.0f} ms"
                              for k, v in runtime_report["wait_by_cause"].items() if v > 0)
            logger.info("step %d (skipped %d), lr %.3g, loss scale %g, optimizer %.0f ms, waited "
                        "%.0f ms%s on the %s device", self.global_steps, self.skipped_steps,
                        self.get_lr()[0], self.loss_scale,
                        self.last_step_stats["step_seconds"] * 1e3,
                        runtime_report["wait_seconds"] * 1e3, f" ({waits})" if waits else "",
                        self.device_kind)

        if self._refresh_error is not None:
            error, self._refresh_error = self._refresh_error, None
            raise error
    # --- the optimizer step --------------------------------------------------------------------

    def _unstaged(self):
        """(entry, host gradient or None: its partition's) for each parameter with a gradient
        whose step is not staged."""
        for e in self._params:
            if e.staged is not None:
                continue
            if e.partitioned:
                if e.has_grad:
                    yield e, None
            elif self.ranks is not None:
                if e.shard_grad is not None:
                    yield e, e.shard_grad
            elif e.host_grad is not None:
                yield e, e.host_grad
            elif e.param.grad is not None:
                g = e.param.grad.detach().reshape(-1).to("cpu")
                yield e, g if g.is_contiguous() else g.contiguous()

    def _grad_norm(self, scale):
        """As torch.nn.utils.clip_grad_norm_: the norm of the gradients' norms, in fp32, of the
        unscaled gradients (inf when one is not finite); a partition's gradient is read from the
        host tier one at a time."""
        norms = []
        for e in self._params:
            if e.partitioned:
                if not e.has_grad:
                    continue
                g = from_dlpack(self.runtime.acquire(e.gid, "host", traced=False))
                try:
                    norms.append(torch.linalg.vector_norm(g, 2, dtype=torch.float32))
                finally:
                    del g
                    self.runtime.release(e.gid, "host", False, traced=False)
            elif self.ranks is not None:
                if e.shard_grad is not None:
                    norms.append(torch.linalg.vector_norm(e.shard_grad, 2, dtype=torch.float32))
            elif e.host_grad is not None:
                norms.append(torch.linalg.vector_norm(e.host_grad, 2, dtype=torch.float32))
            elif e.param.grad is not None:
                norms.append(torch.linalg.vector_norm(e.param.grad, 2, dtype=torch.float32))
        total = torch.linalg.vector_norm(torch.stack(norms), 2).item() if norms else 0.0
        if self.ranks is not None:  # the shards' norms, over every rank
            total = math.sqrt(self.ranks.all_reduce_sum([total * total])[0])
        return total / scale if math.isfinite(total) else math.inf

    def _finish_staged(self):
        """Commits the step staged during backward when it is the step to take: no clipping
        (the global norm under gradient_clipping), the loss scale and learning rates it was
        staged with, no gradient changed after it. Returns (stepped, report), or (None, None)
        when the step must be taken anew (the staged one aborted; counted in redone_steps)."""
        staged = self._staged
        if staged is None:
            return None, None
        # What backward did not stage: the unpartitioned parameters on a GPU, and partitioned
        # ones with no gradient in this micro-batch (their partition holds the earlier ones').
        for e, g in list(self._unstaged()):
            self._stage(e, g)
        if self._staged is None:  # a staging failed
            return None, None
        reason = None
        if staged.scale != self.loss_scale:
            reason = "the loss scale changed"
        for e in staged.entries:
            if reason is None and \
                    e.staged[0] != self._hyper_of(e):
                reason = f"the learning rate or weight decay of {e.name}'s group changed"
        norm = None
        if reason is None and self.config.clipping > 0:
            norm = self._grad_norm(staged.scale)
            if math.isfinite(norm) and self.config.clipping / (norm + 1e-6) < 1.0:
                reason = "gradient clipping scales this step"
                self._speculate = False  # likely again next step: not staged then
        if reason is not None:
            self._drop_staged(reason)
            return None, None
        if norm is not None and not math.isfinite(norm):
            self._end_staged(committed=False)
            self._update_scale(overflow=True)
            return False, {"overflow": True, "grad_norm": norm}
        return self._commit(norm, staged=True)

    def _step_anew(self):
        """The step after backward: the global norm and clip coefficient (gradient_clipping),
        then every parameter's step staged with them and committed."""
        norm = None
        if self.ranks is not None:
            self._reduce_gradients()
        # Across ranks in fp16 the norm is taken anyway: every rank must see an overflow that
        # any rank's shard holds, and skip the step with the others.
        if self.config.clipping > 0 or (self.ranks is not None and self.dtype == torch.float16):
            norm = self._grad_norm(self.loss_scale)
            if not math.isfinite(norm):
                self._update_scale(overflow=True)
                return False, {"overflow": True, "grad_norm": norm}
        clip = 1.0
        if norm is not None and self.config.clipping > 0:
            clip = min(1.0, self.config.clipping / (norm + 1e-6))
        # Stage the next step during backward unless it clipped (never across ranks).
        self._speculate = clip == 1.0 and self.ranks is None
        for e, g in list(self._unstaged()):
            self._stage(e, g, clip=clip, always=True)
        if self._staged is None:
            return True, {"overflow": False, "grad_norm": norm, "seconds": 0.0, "bytes_read": 0,
                          "bytes_written": 0}
        return self._commit(norm, staged=False)

    def _reduce_gradients(self):
        """Across ranks: the unpartitioned parameters' gradients reduce-scattered into their
        owners' shards (e.shard_grad, the mean over the ranks)."""
        def gradient_of(e):
            if e.host_grad is not None:
                return e.host_grad
            if e.param.grad is not None:
                return e.param.grad.detach().reshape(-1).to("cpu")
            return None

        # Stage 2 reduced them during backward; stage 1 and stage 3's unpartitioned ones now.
        entries = [e for e in self._params if not e.partitioned and self.stage != 2]
        if not entries:
            return
        for e, shard in self.ranks.reduce_gradients(entries, gradient_of).items():
            e.shard_grad = shard

    def _commit(self, norm, staged):
        """Commits the open staged step (all or nothing): the new weights reach the parameters,
        the step counts advance and the loss scale follows (an overflow skips the step)."""
        r = self.runtime.commit_optimizer_step()
        if r["overflow"]:  # nothing was changed
            self._end_staged(committed=False)
            self._update_scale(overflow=True)
            return False, {"overflow": True, "grad_norm": None}
        entries = list(self._staged.entries)
        for e in entries:
            e.steps += 1
        self._end_staged(committed=True)
        if self._refresh:
            try:
                self._refresh_weights(entries)
            except _strata.Error as error:  # raised by step() once its bookkeeping is done
                self._refresh_error = error
        self._optimizer_read += r["bytes_read"]
        self._optimizer_written += r["bytes_written"]
        if self._dynamic_scale:
            self._update_scale(overflow=False)
        return True, {"overflow": False, "grad_norm": norm, "seconds": r["commit_seconds"],
                      "staged_seconds": r["seconds"], "bytes_read": r["bytes_read"],
                      "bytes_written": r["bytes_written"], "staged": staged}

    def _refresh_weights(self, entries):
        """Parameters homed on NVMe: their new weights are their committed master weights in the
        training dtype, read back one parameter at a time (never all in host memory at once).
        The weights are a copy of the master weights: one that cannot be written now (a failed
        read or write) is written before the next forward, and the step's error says so."""
        pending = [e for e in entries if e.partitioned]
        self._pending_refresh = pending
        # One buffer for every parameter's state, not three tensors each: a megabyte tensor made
        # and freed per parameter is kept resident by glibc's heap once its mmap threshold has
        # risen, so that the process's resident memory drifts above what is in use.
        state = torch.empty(3 * max((e.shard for e in pending), default=0))
        while pending:
            e = pending[0]
            master, m, v = state[:3 * e.shard].view(3, e.shard)
            try:
                self.runtime.read_optimizer_state(e.gid, master, m, v)
                engine_state._set_weights(self, e, master)
            except Exception as error:
                raise _strata.Error(
                    f"the optimizer step committed, but the new weights of {len(pending)} "
                    f"parameters could not be written yet ({e.name}: {error}); they are written "
                    "from the master weights before the next forward") from error
            pending.pop(0)

    def _end_gradients(self, failed):
        """The step is over (taken, skipped or `failed`): a staged step left is aborted and every
        gradient dropped. Each part is tried; a failure among them raises the first one, unless
        the step `failed` (its error is the one to see: these are kept in engine.warnings)."""
        errors = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except _strata.Error as error:
                errors.append(error)

        attempt(self._end_staged, False)
        self._redo_reason = None
        # Staged again from the next step unless this one was clipped or saw a second gradient.
        self._speculate = self._speculate and not self._second_gradient
        self._second_gradient = False
        self._fired.clear()
        for e in self._params:
            if e.partitioned and e.has_grad:
                attempt(self.runtime.discard, e.gid)
            e.has_grad = False
            e.sent_down = False
            e.host_grad = None
            e.shard_grad = None
            e.param.grad = None
        if errors:
            if not failed:
                raise errors[0]
            for error in errors:
                self._warn(f"after the failed step: {error}")

    def _write_back_weights(self, e, target):
        """After the step: a copy written elsewhere than the parameter (a GPU parameter, or a
        non-contiguous one) is copied into it."""
        if not e.partitioned and target.data_ptr() != e.param.data_ptr():
            e.param.data.copy_(target.view(e.shape))

    def _update_scale(self, overflow):
        """DeepSpeed's DynamicLossScaler.update_scale: an overflow halves the scale (never under
        min_loss_scale) once `hysteresis` overflows have been absorbed; loss_scale_window steps
        after the last overflow, the scale doubles (consecutive_hysteresis: every good step
        restores the hysteresis; else only a doubling does)."""
        if not self._dynamic_scale:
            return
        c = self.config
        if overflow:
            if c.hysteresis == 1 or self._hysteresis_left == 1:
                self.loss_scale = max(self.loss_scale / 2, c.min_loss_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._scale_iteration
        else:
            if c.consecutive_hysteresis:
                self._hysteresis_left = c.hysteresis
            if (self._scale_iteration - self._last_overflow) % c.loss_scale_window == 0:
                if not c.consecutive_hysteresis:
                    self._hysteresis_left = c.hysteresis
                self.loss_scale *= 2
        self._scale_iteration += 1

    def _raise_deferred(self):
        errors = self.runtime.take_deferred_errors()
        if errors:
            raise _strata.Error("strata: releasing a lent parameter failed: " + "; ".join(errors))

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """DeepSpeed's save_checkpoint: the training state under save_dir/tag (default
        "global_stepN"), crash-consistent, `latest` moved last (strata/engine_state.py says
        what is kept and how). Returns the tag's folder."""
        return engine_state.save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        """DeepSpeed's load_checkpoint: returns (the tag's folder, client_state), or (None, None)
        when there is no `latest` and no tag. Everything is checked before anything changes;
        load_module_strict is always on (a parameter missing or extra is named)."""
        del load_module_strict
        return engine_state.load(self, load_dir, tag, load_optimizer_states,
                                 load_lr_scheduler_states, load_module_only)

    def load_pretrained(self, source, strict=True):
        """Streams pretrained weights into the model: a torch.save state dict, or a folder of
        shards with pytorch_model.bin.index.json, one tensor at a time (strata/pretrained.py).
        Every missing, unexpected or wrongly shaped tensor is named before anything changes; the
        optimizer starts afresh over the loaded weights. Returns (missing, unexpected) names."""
        return pretrained.load(self, source, strict)

    # --- reports ------------------------------------------------------------------------------

    def module_state_dict(self):
        """The model's state dict with every parameter whole (in the training dtype, on the CPU),
        as DeepSpeed's engine.module_state_dict with stage3_gather_16bit_weights_on_model_save: at
        stage 3 the module's own state_dict() holds empty placeholders for the partitioned
        parameters. They are read from the optimizer's fp32 master weights (which the parameters
        are the rounding of), so reading them is not an access of the step's trace."""
        by_param = {id(e.param): e for e in self._params if e.partitioned}
        frozen = {id(e.param): e for e in self._frozen}
        out, done = {}, {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            e = by_param.get(id(value))
            if id(value) in frozen:
                out[name] = self._read_frozen(frozen[id(value)])
            elif e is None:
                out[name] = value.detach().to("cpu").clone()
            elif e.pid in done:  # a tied parameter: the same tensor under both names
                out[name] = done[e.pid]
            else:
                master = torch.empty(e.shard)
                self.runtime.read_optimizer_state(e.gid, master, torch.empty(e.shard),
                                                  torch.empty(e.shard))
                if self.ranks is not None:  # every rank's shard (every rank must call this)
                    whole = []
                    self.ranks.gather([(e, master, whole.append)])
                    master = whole[0].clone()
                out[name] = done[e.pid] = master.to(self.dtype).view(e.shape)
        return out

    def _read_frozen(self, e):
        """A frozen partitioned parameter's weights (its partition's host copy, copied)."""
        held = from_dlpack(self.runtime.acquire(e.pid, "host", traced=False))
        try:
            return held.view(e.shape).clone()
        finally:
            del held
            self.runtime.release(e.pid, "host", False, traced=False)

    def _write_frozen(self, e, values):
        """Sets a frozen partitioned parameter's weights (converted to the training dtype)."""
        held = from_dlpack(self.runtime.acquire(e.pid, "host", traced=False))
        try:
            with torch.no_grad():
                held.copy_(values.reshape(-1))
        finally:
            del held
            self.runtime.release(e.pid, "host", True, traced=False)

    # --- the engine's life ----------------------------------------------------------------------

    @property
    def runtime(self):
        """The Runtime behind the engine (sched/runtime.h); closed engines have none."""
        if self._runtime is None:
            raise RuntimeError("strata: the engine is closed; accepted: a new strata.initialize")
        return self._runtime

    @runtime.setter
    def runtime(self, runtime):  # a seam: tests put a Runtime that fails where they want
        self._runtime = runtime

    def close(self):
        """Gives back what the engine holds: its Runtime (the device and pinned host memory of
        its tiers, its NVMe store, whose swap files are removed unless strata.nvme_keep_files),
        the hooks on the module, the module's patched methods. Idempotent. A step staged and not
        committed is dropped; the module's partitioned parameters are left placeholders of their
        shape without their bytes (take
        module_state_dict() or save a checkpoint first: ``module.load_state_dict(state,
        assign=True)`` then gives the plain module its weights back). The last reference to an engine closes
        it as well (nothing holds an engine but its user); ``with engine:`` closes it at the
        end of the block."""
        if self._runtime is None:
            return
        try:
            self._end_staged(committed=False)
        finally:
            self._drop_all()
            for e in self._params + self._frozen:  # each its shape again, without its bytes
                if e.partitioned:
                    e.param.data = torch.zeros((), dtype=self.dtype, device=self.device) \
                        .expand(e.shape)
            for handle in self._hook_handles:
                handle.remove()
            for e in self._params:
                e.param.__dict__.pop("_strata_node", None)
            for module in self._patched_forward:
                module.__dict__.pop("forward", None)
            self.module.__dict__.pop("load_state_dict", None)
            if checkpointing.host_store_of(self):
                checkpointing.use_host_store(None)
            built = init_module.built_under(self.module)
            if built is not None:
                built.release()
            self._runtime = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def stats(self):
        """The Runtime's statistics since the engine was made (waits, bytes per tier pair), the
        optimizer's NVMe traffic included in bytes_moved (its state read into the host and
        written back: nvme_to_host, host_to_nvme)."""
        s = self.runtime.stats()
        s["device"] = self.device_kind
        moved = s["bytes_moved"]
        for key, count in (("nvme_to_host", self._optimizer_read),
                           ("host_to_nvme", self._optimizer_written)):
            if count:
                moved[key] = moved.get(key, 0) + count
        return s


class _Zero3Linear(torch.autograd.Function):
    """F.linear that saves the weight parameter itself for backward, not the transposed view
    F.linear's autograd saves: a view would keep the lent partition pinned from forward to
    backward (every layer's at once), where the parameter is lent again before its backward.

    Its output is a tensor of its own, not a view (a model may change it in place: ReLU(inplace),
    ``h += x``). Under torch.autocast it computes in the autocast dtype, as F.linear would, and
    its backward does too (the weight is cast again there, not kept cast)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.cast = cast
        ctx.save_for_backward(x, weight, bias)
        with torch.autocast(device, enabled=False):
            if cast is not None:
                x, weight = x.to(cast), weight.to(cast)
                bias = bias.to(cast) if bias is not None else None
            flat = x.reshape(-1, x.shape[-1])
            out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=flat.dtype, device=x.device)
            if bias is None:
                torch.mm(flat, weight.t(), out=out.view(-1, weight.shape[0]))
            else:
                torch.addmm(bias, flat, weight.t(), out=out.view(-1, weight.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        cast = ctx.cast
        w = weight.to(cast) if cast is not None else weight
        xs = x.to(cast) if cast is not None else x
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(w).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(xs.reshape(-1, xs.shape[-1])) \
                .to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b


def _zero3_linear_forward(module, x):
    return _Zero3Linear.apply(x, module.weight, module.bias)


# What a placeholder answers as its parameter would (a parent reading self.dtype is no use of the
# weights): _ExternalUses lends nothing for these.
_METADATA = {getattr(torch.Tensor, name).__get__ for name in (
    "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_cuda",
    "is_sparse", "is_meta", "is_quantized")}


class _ExternalUses(torch.overrides.TorchFunctionMode):
    """During an engine's first forward at stage 3: each torch function given a partitioned
    parameter that is not lent (a parameter used outside its owner's forward: F.linear(x,
    self.fc.weight) in a parent, an nn.ParameterList indexed by its parent, a tied head used as
    ``h @ wte.weight.t()``) lends it, registered as external to the innermost module whose
    forward runs (Engine._use_external), as register_external_parameter would. A later forward
    that uses a parameter so in a module that did not in the first needs
    register_external_parameter."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.stack = []
        self.handles = []

    def __enter__(self):
        def enter(module, args):
            self.stack.append(module)

        def leave(module, args, out):  # (returns None: the output stays the module's)
            if self.stack:
                self.stack.pop()

        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                        torch.nn.modules.module.register_module_forward_hook(leave)]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        engine = self.engine
        if engine._internal_depth or func in _METADATA:
            return func(*args, **kwargs)
        for leaf in _pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.nn.Parameter) and id(leaf) in engine._partitioned_by_id \
                    and leaf.data.numel() == 0:
                engine._use_external(leaf, self.stack[-1] if self.stack else engine.module)
        return func(*args, **kwargs)


def _weakly(method):
    """`method` (a bound method of the engine) called through a weak reference: nothing once the
    engine is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


def _load_state_dict_through(engine_ref):
    def load_state_dict(module, state_dict, strict=True, assign=False):
        """As torch's, for a module an engine trains: the weights stream into its partitions and
        the optimizer's master weights (engine.load_pretrained's rules: every missing,
        unexpected or wrongly shaped tensor named before anything changes; the optimizer starts
        afresh over the loaded weights)."""
        engine = engine_ref()
        if engine is None:
            raise RuntimeError("load_state_dict: the engine training this module is gone")
        if assign:
            raise ValueError("load_state_dict: assign=True is not supported for a module an "
                             "engine trains (its parameters are the engine's partitions); "
                             "accepted: assign=False")
        missing, unexpected = pretrained.load(engine, dict(state_dict), strict)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
    return load_state_dict


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _flatten_params(params):
    for item in params:
        if isinstance(item, dict):
            yield from item["params"]
        else:
            yield item


def _as_tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)
