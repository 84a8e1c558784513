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
module's forward and again before its backward (a hook on the forward's outputs), dropped after. A lent tensor is released when torch frees it, so a view
autograd saved for backward keeps its partition pinned rather than pointing at reused memory. Its
gradient is accumulated into a gradient partition on the device as autograd makes it (the
parameter's ``.grad`` is never kept), which leaves the device in the background at the
accumulation boundary (GradientReady). Smaller parameters stay on the device as plain tensors.
The Runtime records the first step's accesses and prefetches ahead of need from the second.

Stages 0-2: parameters stay on the device; gradients are torch's ``.grad`` (stage 2 moves each to
the host as it is made, summing micro-batches there in grad_accum_dtype, fp32 by default, as the
other stages do when it is not the training dtype).

The step, at each accumulation boundary. At stage 3 each parameter's step is staged during
backward, as autograd makes its gradient final (Runtime.stage_optimizer_step: the Runtime's
optimizer thread reads its NVMe state, steps it and writes it to fresh extents, the new weights to
a staging buffer; nothing visible changes), and committed after backward, when it is the step to
take: no clipping scales it (the global norm of the host gradients under gradient_clipping), the
learning rate and loss scale are the ones it was staged with, and no gradient changed after it was
staged. Otherwise it is dropped and the step taken anew after backward (redone_steps counts them;
staging pauses after a step that clipping scaled), so the result always equals the unoverlapped
step. Stages 0-2 step after backward. Either way the commit changes everything or nothing (but
with strata.optimizer_commit "partition", below): the
optimizer steps each partition with grad_scale = clip / loss_scale, writing the new weights in the
training dtype into the parameter's host copy (stage 3) or the device tensor, and the gradients
are discarded. fp16 with dynamic loss scaling (DeepSpeed's rule: halve on overflow after
`hysteresis` overflows, double after loss_scale_window good steps, never under min_loss_scale)
skips a step whose gradients overflowed, changing nothing else. A step that fails (a disk that
fills while the optimizer state is written) raises strata.Error and changes nothing: the weights
and the optimizer state stay the previous step's (the NVMe state commits whole or not at all), and
that step's gradients are dropped. With strata.optimizer_commit "partition" each NVMe partition's
new state commits as it is written: a step that fails part way leaves the partitions that had
landed stepped (a warning says how many; each keeps its own step count), and the others step at
the next step. The optimizer's accesses are out of the Runtime's trace, so the
plan for forward and backward holds whatever the step did.

Without a GPU the device tier is the host-emulated one (strata.device "emulated", the default)
and the model computes on the CPU; ``engine.device_kind`` and every report say which ran.

The engine is split by concern, as FSDP2's state is: this module is the facade (set-up, the loop,
DeepSpeed's API, reports, the engine's life), composing objects that own their state, each handed
what it uses: the parameter table (strata/parameters.py), the training state the hooks check
(strata/training_state.py), the loss scaler (strata/loss_scaler.py), the lending of stage 3's
parameters around modules (strata/lending.py), the gradients (strata/gradients.py), the
optimizer step (strata/step.py), the checkpoint store (strata/checkpoints.py) and the torch
optimizer it returns (strata/optimizer.py). docs/design.md walks one parameter through a step.

Thread safety: an engine is driven by one thread, as DeepSpeed's.
"""

import contextlib
import json
import logging
import os
import sys
import time
import types
import warnings
import weakref

import torch
# torch imports torch._dynamo the first time an optimizer is made, and that first import keeps
# the frames that made the optimizer alive: the engine's __init__ (and so the engine) would never
# be freed by its last reference. Imported here, at the module's import, it keeps none of ours.
import torch._dynamo  # noqa: F401, E402
from torch.utils.dlpack import from_dlpack

from strata import _strata
from strata import checkpointing
from strata import checkpoints
from strata import guards
from strata import zero_init as init_module
from strata import pretrained
from strata import tiling
from strata import lr_schedules
from strata import optimizer as optimizer_module
from strata import ranks as ranks_module
from strata.config import TORCH_DTYPES, TrainConfig
from strata.edits import Edits
from strata.gathered import GatheredParameters
from strata.gradients import BACKWARD_AFTER_CLIP, Gradients, HostCopies
from strata.loss_scaler import LossScaler
from strata.lending import Lending, register_external_parameter, weakly
from strata.parameters import ParameterTable, read_frozen, read_state
from strata.runtime_settings import CLOSED, RuntimeSettings as _RuntimeSettings, make_runtime
from strata.notices import Notices, StrataWarning
from strata.step import OptimizerStep
from strata.training_state import Phase, TrainingState

__all__ = ["check_config", "initialize", "Engine", "GatheredParameters",
           "register_external_parameter", "StrataWarning"]

# The engine's messages: warnings through `warnings` (StrataWarning), the step lines
# (steps_per_print) through this logger at INFO; nothing is printed.
logger = logging.getLogger("strata")


_DTYPES = TORCH_DTYPES
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_TRAINER_WARNING = "(DeepSpeed's; left to the trainer)"
# Said at the first step nothing clips where the config leaves gradient_clipping out.
_UNCLIPPED = ("gradient_clipping is not in the config and nothing clipped this step: the engine "
              "does not clip (plain torch's, and DeepSpeed's before 0.19.3), where DeepSpeed "
              "0.19.3 and later clip at 1.0 when the key is absent; accepted: gradient_clipping "
              "1.0 for DeepSpeed's, 0 to train unclipped (either is not said again), or "
              "torch.nn.utils.clip_grad_norm_ in the loop")
_ENGINE_KEYS = tuple(f"zero_optimization.{k}:" for k in (
    "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm"))


def _as_engine_says(message):
    """A warning of the Runtime's config reader as the engine gives it, or None for the keys the
    engine itself acts on (the bucket keys across ranks: strata/ranks.py)."""
    if message.endswith(_TRAINER_WARNING):
        message = message[:-len(_TRAINER_WARNING)] + "(DeepSpeed's; not supported by strata: " \
                                                     "ignored)"
    return None if message.startswith(_ENGINE_KEYS) else message


def check_config(config, model=None):
    """A DeepSpeed config (a dict or the path of a JSON file) checked as ``strata.initialize``
    reads it in this process, without a Runtime or a device (nothing is made): its keys
    and values, the strata block's, the scheduler's and activation_checkpointing's included
    (``WORLD_SIZE``, where torchrun sets it, the ranks train_batch_size is divided over). Returns
    what initialize says of the config itself (keys strata does not act on, values it takes
    otherwise: each a str); a bad key or value raises a ValueError (most often
    strata.ConfigError or strata.InvalidArgumentError) naming it and what is accepted. Not
    checked: what depends on the model or the machine (budgets against the model's sizes, the
    NVMe folder, the GPU) nor what ZeRO across ranks accepts, which initialize checks when it has
    them. The scheduler block is read even where initialize will be given a client lr_scheduler
    (and then ignore it). With `model` (its parameters may be on torch's meta device: nothing of
    it is read but its sizes), the smallest strata.host_budget_bytes the config takes with it
    is said (host_minimum: the staging buffers, the optimizer's room at its smallest, the
    largest gradient partition), and a budget below it refused, naming each part."""
    parsed = TrainConfig.parse(TrainConfig.load(config), world_size=_world_size())
    settings = _RuntimeSettings(parsed)
    need = host_minimum(parsed, model) if model is not None else None  # (before the staging's)
    runtime_blocks = json.loads(settings.runtime_json)
    ranks_module.bucket_settings(runtime_blocks.get("zero_optimization", {}), settings.stage)
    said = [w for w in (_as_engine_says(w) for w in
                        _strata.check_runtime_config(settings.runtime_json)) if w is not None]
    if parsed.activation_checkpointing is not None:
        said += checkpointing.read_config(parsed.activation_checkpointing)[1]
    if parsed.scheduler is not None:
        # Its parameters, on a stand-in optimizer with a group for each value a per-group list
        # gives (the model's groups are not known here).
        lists = [v for v in (parsed.scheduler.get("params") or {}).values()
                 if isinstance(v, (list, tuple))]
        groups = [{"params": [torch.zeros(1, requires_grad=True)]}
                  for _ in range(max([len(v) for v in lists] + [1]))]
        lr = (parsed.optimizer or {}).get("lr", 1e-3)
        lr_schedules.make(parsed.scheduler, torch.optim.SGD(groups, lr=lr))
    if need is not None:
        said.append(f"strata.host_budget_bytes: this model takes at least {need['total']} bytes "
                    f"of it (the staging buffers {need['staging']}, the optimizer's room at its "
                    f"smallest {need['optimizer']}, the largest gradient partition and what goes "
                    f"beside it {need['partition']}); the config gives {need['budget']}")
    return settings.warnings + said


def _world_size():
    """The job's ranks as torchrun says (WORLD_SIZE), 1 where it is unset."""
    given = os.environ.get("WORLD_SIZE", "") or "1"
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"WORLD_SIZE {given!r} (the environment's): accepted: a whole number of "
                         "ranks, 1 or more")
    return int(given)


def _data_parallel_wrapper(model):
    """The name of torch's data-parallel wrapper `model` is (DDP, FSDP, DataParallel), or None."""
    wrappers = [torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        wrappers.append(FullyShardedDataParallel)
    except ImportError:  # (a torch built without distributed)
        pass
    for wrapper in wrappers:
        if isinstance(model, wrapper):
            return wrapper.__name__
    return None


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None, process_group=None):
    """DeepSpeed's ``deepspeed.initialize`` shape: returns (engine, optimizer, dataloader,
    lr_scheduler). ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a dict or
    the path of a JSON file. ``optimizer`` may be a torch Adam/AdamW (or strata.optim's), whose
    hyper-parameters the engine takes; a config's ``optimizer`` block is used otherwise.
    ``training_data`` gives a DataLoader of train_micro_batch_size_per_gpu. Across ranks,
    ``process_group`` (strata's own) is a torch.distributed group of the job's every rank for the
    gradients' and weights' collectives (a trainer's NCCL group, say); without it they run on
    NCCL's default group on GPUs (made if torch.distributed has none, as DeepSpeed's initialize
    does) and on strata's own otherwise (shared memory between ranks on one host, else Gloo over
    TCP: strata/ranks.py)."""
    if model is None:
        raise ValueError("strata.initialize: model is required")
    wrapper = _data_parallel_wrapper(model)
    if wrapper is not None:
        raise ValueError(f"strata.initialize: the model is wrapped in torch's {wrapper}, whose "
                         "hooks would reduce the gradients across ranks a second time (and at "
                         "stage 3 meet partitions); strata reduces them itself: accepted: the "
                         "module inside it (model.module)")
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
                    lr_scheduler=lr_scheduler, ranks=ranks, process_group=process_group)
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
            self._next = engine.table.next_id
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


# The engines not closed: torch.nn.utils.clip_grad_norm_ over their parameters comes to them.
def _delegated(part, name, doc, settable=False):
    """An Engine property (DeepSpeed's name, or a figure of its own) over `name` of the engine's
    part `part` (the training state's counts are settable: a checkpoint's load sets them)."""
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):
        setattr(getattr(self, part), name, value)
    return property(get, put if settable else None, doc=doc)


def _refuse_model(model):
    """Refuses a model strata.initialize cannot take as it is: tensors on the meta device, one an
    engine not closed holds, one with a closed engine's placeholders left; takes a closed
    engine's refusing hooks off the others."""
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if t.device.type == "meta"]
    if on_meta:
        raise ValueError(
            f"strata.initialize: {len(on_meta)} tensors of the model are on the meta device "
            f"and hold no values ({', '.join(on_meta[:5])}{', ...' if len(on_meta) > 5 else ''})"
            "; accepted: a model built on the CPU, or under strata.init (which partitions "
            "each parameter as it is made); load pretrained weights after initialize")
    holder = guards.engine_holding(model)
    if holder is not None:
        raise ValueError(
            "strata.initialize: the model's parameters are held by a strata engine not "
            f"closed (made {holder._made_at}); two engines would each step them and lend "
            "them apart; accepted: that engine's close() first (or its release(), which "
            "gives the module its weights back whole), then initialize again")
    # (A model built under strata.init keeps its partitions in what built it, which names
    # a second engine itself.)
    left = guards.left_placeholders(model, recurse=True) \
        if init_module.built_under(model) is None else []
    if left:
        raise ValueError(f"strata.initialize: {len(left)} parameters of the model "
                         f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): "
                         f"{guards.PLACEHOLDERS_LEFT}")
    guards.unguard(model)


def _refuse_unsupported(model):
    """Refuses what the engine cannot train: a partition resized after strata.init built it, a
    torch.compile'd model, sparse embeddings."""
    changed = init_module.reshaped(model)
    if changed:
        name, made, now = changed[0]
        raise ValueError(
            f"strata.initialize: {name} was built under strata.init as a partition of shape "
            f"{made} and has shape {now} now (resize_token_embeddings, or another change of "
            "its size after the build, which read the partition's placeholder, not its "
            "weights); accepted: the model built with its final sizes under strata.init "
            "(e.g. the config's vocab_size set before), or resized before it is partitioned")
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


def _check_model_dtype(model, dtype):
    """Refuses a model in a half precision other than the config's training dtype: strata would
    cast it to `dtype` and train it so (a bf16 model under an fp32 config trains in fp32), where
    plain torch trains it in its own dtype. An fp32 model takes any training dtype (DeepSpeed's
    bf16 and fp16 cast it, with fp32 master weights)."""
    found = {}
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype not in (torch.float32, dtype):
            found.setdefault(p.dtype, name)
    if found:
        (half, name), = list(found.items())[:1]
        key = {torch.bfloat16: '"bf16": {"enabled": true}',
               torch.float16: '"fp16": {"enabled": true}'}.get(half)
        trains = {torch.float32: "float32 (no bf16 or fp16 block)"}.get(dtype, str(dtype))
        mixed = (f"{key} in the config (mixed precision: {half} compute, fp32 master weights, "
                 "as DeepSpeed's), or " if key else "")
        raise ValueError(
            f"strata.initialize: the model's parameters are {half} ({name}, ...) and the config "
            f"trains in {trains}: strata would cast the model and train it in that dtype, where "
            f"plain torch trains it in {half}; accepted: {mixed}the model cast to the config's "
            "dtype before strata.initialize (model.float(), model.bfloat16())")


class Engine:
    """The training engine ``strata.initialize`` returns (see the module's docstring)."""

    def __init__(self, model, config, optimizer=None, model_parameters=None, lr_scheduler=None,
                 ranks=None, process_group=None):
        self.module = model
        self.config = config
        self._made_at = time.strftime("%H:%M:%S")  # named where a second engine is refused
        self.ranks = ranks  # strata/ranks.py: None in a job of one process
        # DeepSpeed's engine's: this process's place in the job.
        self.global_rank = ranks.rank if ranks is not None else 0
        self.world_size = ranks.size if ranks is not None else 1
        self.local_rank = ranks.job.local_rank if ranks is not None else 0
        self.dtype = _DTYPES[config.dtype]
        _check_model_dtype(model, self.dtype)
        # What micro-batches' gradients are summed in (data_types.grad_accum_dtype, fp32 by
        # default), at every stage: partitioned ones in their gradient partition, the others in
        # a host sum (e.host_grad) when it differs from the training dtype.
        self.grad_accum_dtype = _DTYPES[config.grad_accum_dtype]
        self._sum_apart = config.accumulation > 1 and self.grad_accum_dtype != self.dtype
        self.micro_batch_size = config.micro_batch
        # Where the engine is in its loop and its counts (strata/training_state.py): step()
        # without a backward is refused; a gradient made outside engine.backward is the user's.
        self._state = TrainingState(config.accumulation)
        self._notices = Notices(say=self.global_rank == 0)  # its warnings (engine.warnings)
        self._scaler = LossScaler(config, self.dtype)  # fp16's (strata/loss_scaler.py)
        self._step_applied = False  # the last boundary's step changed the weights
        self._global_grad_norm = None  # the last step's, when it computed one
        self.last_step_stats = {}

        _refuse_model(model)
        settings = _RuntimeSettings(config)
        for message in settings.warnings:
            self._warn(message)
        setup_error = None  # across ranks, named on every rank (_check_ranks)
        try:
            self.host_minimum = host_minimum(config, model)  # refused here when below it
        except ValueError as error:
            if ranks is None:
                raise
            setup_error, self.host_minimum = str(error), 0
        _leave_room_beside_read_ahead(settings, self.host_minimum)
        self.stage = settings.stage
        self._param_tier = settings.param_tier
        # The optimizer state in host memory (offload_optimizer "cpu"): its partitions may step in
        # place during backward when nothing learnt after backward can change the step (step.py).
        self._optimizer_on_host = settings.optimizer_device == "cpu"
        self._persistence_threshold = settings.threshold
        built = init_module.built_under(model)
        if built is not None:  # (what the context lends given back: the partitions are ours)
            built.settle(model)
        runtime_blocks = json.loads(settings.runtime_json)
        # The bucket keys, checked in one process too.
        ranks_module.bucket_settings(runtime_blocks.get("zero_optimization", {}), self.stage)
        if ranks is not None:
            setups = self._check_ranks(runtime_blocks, settings, setup_error)
        if ranks is None and process_group is not None and process_group.size() > 1:
            raise ValueError(
                f"strata.initialize: process_group of {process_group.size()} ranks, but this "
                "process was not launched as a rank of a job (MASTER_ADDR, MASTER_PORT, RANK, "
                "WORLD_SIZE and LOCAL_RANK, as torchrun sets them); accepted: a job torchrun or "
                "DeepSpeed's launcher started")
        if built is not None and built.settings.blocks_json != settings.blocks_json:
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
        # Where the model computes: the CPU beside the emulated device tier, else the GPU of the
        # device tier (as DeepSpeed's engine, strata moves the module there and makes it torch's
        # current device).
        self.device = torch.device("cpu") if self.device_kind == "emulated" else \
            torch.device("cuda", self.runtime.cuda_device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if ranks is not None:
            collectives, notice = ranks_module.choose_collectives(
                ranks, self.device, setups, process_group,
                runtime_blocks.get("strata", {}).get("comm_timeout_s", 1800))
            # A group handed on some ranks only would send their collectives elsewhere.
            ranks.agree(f"the gradients' and weights' collectives on {collectives.name}")
            ranks.use(collectives, self.device)
            if notice is not None:
                self._warn(notice)
        if ranks is not None:  # every rank starts from rank 0's weights
            ranks.broadcast_module(
                model, skip=lambda t: init_module.partition_of(t) is not None)  # (those are)
        self._said_unclipped = False  # _UNCLIPPED said
        if config.activation_checkpointing is not None:
            checkpointing.configure(deepspeed_config=config.activation_checkpointing)
        # cpu_checkpointing keeps checkpointed inputs in this engine's host tier.
        checkpointing.use_host_store(_HostActivations(self))

        hyper = optimizer_module.hyper_parameters(config, optimizer)
        # (one of no elements has nothing to step: left to torch, as plain AdamW leaves it)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.numel()]
        # Frozen when the optimizer was made: one unfrozen later has no optimizer state and would
        # never be trained (step() refuses it by name).
        self._frozen_at_start = [(n, p) for n, p in model.named_parameters()
                                 if not p.requires_grad]
        if model_parameters is not None:  # (a generator is read twice below)
            model_parameters = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g
                                for g in (model_parameters if not torch.is_tensor(model_parameters)
                                          else [model_parameters])]
            wanted = {id(p) for p in optimizer_module.flatten_params(model_parameters)}
            named = [(n, p) for n, p in named if id(p) in wanted]
        if not named:
            raise ValueError("strata.initialize: the model has no trainable parameters")
        _refuse_unsupported(model)
        # The placeholder of a partitioned parameter: on the compute device, so that swapping
        # .data never changes a parameter's device (torch would drop its gradient node).
        self.table = ParameterTable.from_model(
            model, named, self.stage, self._persistence_threshold, ranks, built,
            torch.empty(0, dtype=self.dtype, device=self.device))
        groups = optimizer_module.param_groups(optimizer, model_parameters, hyper,
                                               self.table.trained)

        self.optimizer_kind = hyper["kind"]
        self._initial_state = hyper["initial_accumulator_value"]  # a fresh optimizer's first state
        # Parameters homed on NVMe take their new weights from the committed master weights, one
        # at a time, rather than all at once in host memory (OptimizerStep.refresh_weights: it reads each
        # parameter's whole optimizer state back, 12 bytes per element), unless they are within
        # offload_param.max_in_cpu (DeepSpeed's parameter elements kept in CPU memory: the Runtime
        # keeps their host copies) and their copies fit a quarter of the host budget twice: then
        # the step writes their new weights into their host copies, as for parameters homed there.
        refresh = self._param_tier == "nvme" and not self._params_in_cpu()
        self.runtime.create_optimizer(
            kind=hyper["kind"], lr=hyper["lr"], beta1=hyper["betas"][0],
            beta2=hyper["betas"][1], eps=hyper["eps"], weight_decay=hyper["weight_decay"],
            adamw=hyper["adamw"], bias_correction=hyper["bias_correction"],
            lr_decay=hyper["lr_decay"], partitions=[(e.gid, e.shard) for e in self.table.trained],
            copy_dtype=config.dtype, copy_elements=self._staged_copy_elements(refresh))
        with torch.no_grad():
            for e in self.table.trained:
                # One parameter at a time (a partition's from its tier: never the whole model).
                self.runtime.initialize_optimizer_state(
                    e.gid, self._initial_weights(e), initial_state=hyper["initial_accumulator_value"])
        # Buffers go to the device. A module's floating buffers take the training dtype when it
        # has parameters of its own (BatchNorm's running statistics compute with its weight);
        # those of a module without parameters (a rotary embedding's inv_freq) keep theirs.
        for module in model.modules():
            own = any(p is not None for p in module._parameters.values())
            for b in module._buffers.values():
                if b is not None:
                    b.data = b.data.to(device=self.device, dtype=self.dtype
                                       if own and b.is_floating_point() else b.dtype)
        # What close() takes off: hooks, forwards and other methods set on module instances.
        # strata.optimizer_commit "partition" with the state on NVMe: each partition's new state
        # lands as it is written, so a step once begun is not dropped (step.py).
        commit_each = self.runtime.optimizer_commit_each and not self._optimizer_on_host
        if commit_each and self.ranks is not None:
            raise ValueError(
                "strata.optimizer_commit \"partition\" across ranks: a step that failed part "
                "way on one rank would leave its shards stepped and the others' not; accepted: "
                "\"step\" (what \"auto\" takes there) in a job of several processes")
        # The engine's parts, each owning its state, handed what it uses (the Runtime below).
        self._copies = HostCopies(self.device, self.grad_accum_dtype)
        self._step = OptimizerStep(
            self.table, ranks, self._state, self._scaler, self._copies, self._notices, config,
            dtype=self.dtype, device=self.device, refresh=refresh,
            optimizer_on_host=self._optimizer_on_host,
            read_ahead=self.runtime.optimizer_read_ahead_bytes > 0, commit_each=commit_each)
        self._lending = Lending(self.table, ranks, self._state, None)
        self._gradients = Gradients(
            self.table, ranks, self._state, self._lending, self._step, self._copies,
            self._notices, stage=self.stage, sum_apart=self._sum_apart,
            grad_accum_dtype=self.grad_accum_dtype, device=self.device)
        self._hand_runtime(self._runtime)
        self._hook_handles, self._patched_methods = [], []
        self._place_parameters(model)
        self.table.placed()
        self._lending.install(model, self.stage)
        # Before the lending's own hooks, whatever calls the module (_before_forward).
        self._hook_handles.append(model.register_forward_pre_hook(
            weakly(self._before_forward), prepend=True))
        for module in model.modules():
            if any(p is not None and id(p) in self.table.partitioned_by_id
                   for p in module._parameters.values()):
                # state_dict() gives their weights whole, as plain torch's does.
                self._hook_handles.append(module.register_state_dict_post_hook(
                    weakly(self._whole_in_state_dict)))
                module._save_to_state_dict = types.MethodType(guards.save_to_state_dict, module)
                self._patched_methods.append((module, "_save_to_state_dict"))
        # The module's own load_state_dict would set placeholders and tensors the optimizer's
        # master weights overwrite at the next step: it loads through the engine instead.
        model.load_state_dict = types.MethodType(guards.load_state_dict_through(engine), model)
        for name, module in model.named_modules():  # (a submodule's own, too)
            if name and any(id(p) in self.table.partitioned_by_id for p in module.parameters()):
                module.load_state_dict = types.MethodType(
                    guards.load_state_dict_through(engine, f"{name}."), module)
                self._patched_methods.append((module, "load_state_dict"))
        # model.zero_grad() (Trainer's, a plain loop's) drops the engine's gradients too.
        model.zero_grad = types.MethodType(guards.zero_grad_through(engine), model)
        self._patched_methods.append((model, "zero_grad"))
        # model.to(dtype) (.half(), .float()), a submodule's too, would be undone by the next
        # step: refused.
        for module in model.modules():
            module._apply = types.MethodType(guards.convert_through(engine), module)
            self._patched_methods.append((module, "_apply"))
        # A copy (a frozen reference or teacher, TRL's create_reference_model) would keep the
        # engine's methods, hooks and (stage 3) partitions, and follow the engine: refused.
        model.__deepcopy__ = guards.refuse_deepcopy
        self._patched_methods.append((model, "__deepcopy__"))
        self._count_real_sizes(model)

        self.optimizer = optimizer_module.EngineOptimizer(self, groups, hyper)
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer_module.take_over(self.optimizer, optimizer)
        self.lr_scheduler = lr_scheduler
        if self.lr_scheduler is None and config.scheduler is not None:
            self.lr_scheduler = lr_schedules.make(config.scheduler, self.optimizer)
        elif callable(self.lr_scheduler) and not hasattr(self.lr_scheduler, "step"):
            self.lr_scheduler = self.lr_scheduler(self.optimizer)
        elif self.lr_scheduler is not None:
            optimizer_module.adopt_schedule(self.optimizer, self.lr_scheduler, optimizer)
        self.optimizer.check_groups("strata.initialize", ValueError)

        self._step.optimizer = self.optimizer  # (its groups: each parameter's rates)
        self.optimizer.watch_rates(self._step.rate_set)
        self._checkpoints = checkpoints.CheckpointStore(
            self.table, ranks, self._state, self._scaler, self._step, self._gradients,
            self._notices, optimizer=self.optimizer, optimizer_kind=self.optimizer_kind,
            module=model, config=config, dtype=self.dtype)
        self._checkpoints.runtime = self._runtime
        # state_dict()'s weights read so far, for the dict it fills (_whole_in_state_dict).
        self._whole_read = (lambda: None, None)
        self._joining = None  # the gathers joined so far (_join_gathers), or None
        self._keys_only = False  # state_dict() calls for their keys alone (keys_only)
        guards.LIVE.add(self)
        # An engine whose last reference is dropped (never closed) leaves what close() leaves:
        # placeholders of the partitioned parameters' shapes, refused by the module by name.
        # (The model held weakly: a module holding its engine, as a Lightning module does, must
        # not be kept alive by this, nor its engine with it.)
        self._dropped = weakref.finalize(
            self, guards.leave_placeholders, weakref.ref(model),
            [(e.param, e.shape) for e in self.table.entries() if e.partitioned],
            self.dtype, self.device)
        self._dropped.atexit = False
        # The weights the engine keeps whole in the module, edited in place between steps, are
        # taken at the next step (strata/edits.py): the step would otherwise undo the edit.
        self._edits = Edits(self.table.entries(), self.ranks)

    # --- set-up -------------------------------------------------------------------------------

    def _count_real_sizes(self, model):
        """Counts of parameters see a partitioned one's real size, not its placeholder's 0: it
        carries ds_numel, as DeepSpeed's ZeRO-3 parameters do (peft's trainable count and
        Trainer's read it), and a transformers model's num_parameters() counts by it (the
        module's own, patched on the instance; close() takes it off). Across ranks a
        transformers model's generate keeps every rank's forwards going until every rank has
        finished (guards.generate_through), as transformers does under DeepSpeed's ZeRO-3."""
        for e in self.table.entries():
            if e.partitioned:
                e.param.ds_numel = e.numel
        if any(e.partitioned for e in self.table.entries()):
            self._fit_peft(model)
        hf = sys.modules.get("transformers")
        if hf is None or not any(e.partitioned for e in self.table.entries()):
            return
        for module in model.modules():
            if isinstance(module, hf.PreTrainedModel):
                module.num_parameters = types.MethodType(guards.num_parameters, module)
                self._patched_methods.append((module, "num_parameters"))
                # (not over a generate the instance has of its own: close() would lose it)
                if self.ranks is not None and isinstance(module, hf.GenerationMixin) and \
                        "generate" not in module.__dict__:
                    guards.generate_through(weakref.ref(self), module)
                    self._patched_methods += [(module, "generate"),
                                              (module, "_has_unfinished_sequences")]

    def _fit_peft(self, model):
        """peft's wrappers at stage 3 (patched on the instances; close() takes them off):
          - merge_and_unload (and merge_adapter, unload) edit or take the base layers' weights,
            which stage 3 keeps as partitions (placeholders outside forward): refused by name,
            naming engine.release(), where they failed in a shape error or merged nothing;
          - save_pretrained without a state_dict saves the adapters from state_dict_to_save:
            the frozen base's weights are not read (peft's own took module.state_dict(), every
            weight of the base read whole, once for each adapter, to keep the adapters')."""
        peft = sys.modules.get("peft")
        if peft is None:
            return
        for module in model.modules():
            if isinstance(module, peft.PeftModel):
                module.save_pretrained = types.MethodType(
                    guards.save_pretrained_through(weakref.ref(self)), module)
                self._patched_methods.append((module, "save_pretrained"))

        def refused(name):
            def call(*args, **kwargs):
                raise RuntimeError(
                    f"peft's {name} at ZeRO stage 3: the base layers' weights are the engine's "
                    "partitions, not in the module; accepted: model = engine.release() (closes "
                    f"the engine and gives the module its weights back whole), then "
                    f"model.{name}()")
            return call
        for module in model.modules():
            if isinstance(module, (peft.PeftModel, peft.tuners.tuners_utils.BaseTuner)):
                for name in ("merge_and_unload", "merge_adapter", "unload"):
                    if hasattr(module, name):
                        setattr(module, name, refused(name))
                        self._patched_methods.append((module, name))

    def _warn(self, message):
        self._notices.warn(message)

    def _runtime_warning(self, message):
        message = _as_engine_says(message)
        if message is not None:
            self._warn(message)

    def _check_ranks(self, runtime, settings, error):
        """What the engine does across ranks (strata/ranks.py), and what it refuses; the ranks'
        set-ups agreed on first (every rank's, returned: ranks_module.agree_on_setup), `error`
        (what stops this rank, or None) named on every rank."""
        setups = ranks_module.agree_on_setup(
            self.ranks, ranks_module.setup_of(
                settings, self.dtype, error,
                ranks_module.training_of(self.config, runtime.get("zero_optimization", {}))))
        if self.stage == 0 and self.ranks.rank == 0:
            # DeepSpeed's stage 0 across ranks all-reduces the gradients and steps the whole
            # optimizer on every rank; stage 1's reduce-scatter, step of a shard and all-gather
            # of the new weights give the same numbers, each rank holding a shard of the state.
            logger.info("zero_optimization.stage 0 across %d ranks runs as stage 1: the same "
                        "numbers as data parallel, each rank holding 1/%d of the optimizer's "
                        "state", self.ranks.size, self.ranks.size)
        self.ranks.configure(runtime.get("zero_optimization", {}), self.stage,
                             runtime.get("strata", {}).get("host_budget_bytes", 4 << 30))
        for message in self.ranks.warnings:
            self._warn(message)
        return setups

    def _will_partition(self, e):
        return init_module.partition_of(e.param) is not None or \
            (self.stage == 3 and e.numel >= self._persistence_threshold)

    def _staged_copy_elements(self, refresh):
        """Elements whose new weights a step stages in host memory: all, or (parameters homed on
        NVMe, read back from the master weights instead) the unpartitioned ones' (-1: all)."""
        if not refresh:
            return -1
        return sum(e.shard for e in self.table.trained if not self._will_partition(e))

    def _params_in_cpu(self):
        """Whether the partitioned parameters are all within offload_param.max_in_cpu as the
        Runtime read it (DeepSpeed's default 1e9 elements: the Runtime keeps their host copies)
        and their copies, twice (the host copies and the step's staged new weights), within half
        of the host budget."""
        elements = sum(e.numel for e in self.table.trained if self._will_partition(e))
        element = torch.tensor([], dtype=self.dtype).element_size()
        return elements <= self.runtime.max_in_cpu and \
            2 * elements * element <= self.runtime.host_budget_bytes // 2

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
        trainable = {id(e.param) for e in self.table.trained}
        frozen = {id(e.param) for e in self.table.frozen}
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in trainable and id(p) not in frozen:
                    p.data = p.data.to(device=self.device, dtype=self.dtype)
            for e in self.table.frozen:
                e.group = owner.get(id(e.param), 0)
                e.partitioned = True
                if init_module.partition_of(e.param) is None:
                    initial = e.param.detach().to(device="cpu", dtype=self.dtype).reshape(-1) \
                        .contiguous()
                    if self.ranks is not None:  # its tiers hold this rank's shard only
                        initial = self.ranks.own_shard(initial, e.shard)
                    self.runtime.register(e.pid, "param", _DTYPE_NAMES[self.dtype], e.shard,
                                          e.group, self._param_tier, initial)
                e.param.data = self.table.placeholder
            for e in self.table.trained:
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
                hooked = e.partitioned or self.stage in (2, 3) or self._sum_apart
                # Where the engine holds the gradient apart from .grad (stage 2, a host sum), a
                # .grad given by hand is taken before a backward adds to it (across ranks, once
                # the window is reduced, engine.backward takes them all first).
                takes_given = not e.partitioned and (self.stage == 2 or self._sum_apart)
                if hooked or takes_given:
                    # The AccumulateGrad node's hook runs once the gradient is in .grad. The node
                    # is made now, while the parameter has its shape and dtype (autograd checks
                    # gradients against them), and kept alive here.
                    with torch.enable_grad():
                        node = e.param.expand_as(e.param).grad_fn.next_functions[0][0]
                    if hooked:
                        self._hook_handles.append(node.register_hook(self._gradients.hook(e)))
                    if takes_given:
                        self._hook_handles.append(
                            node.register_prehook(self._gradients.prehook(e)))
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
                e.param.data = self.table.placeholder

    # --- the loop -----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.runtime  # noqa: B018 - a closed engine says so, not the module's placeholders
        return self.module(*args, **kwargs)  # (_before_forward prepares it)

    def _before_forward(self, module, args):
        """The module's first forward pre-hook: a forward however it is called (engine(), a
        loop's model(...), Trainer's, Lightning's, generate) is prepared."""
        self._prepare_forward()

    def _prepare_forward(self):
        """What a forward of the module needs first: a step's new weights not written yet
        written, and across ranks the lending's gathers following the recorded order."""
        self.runtime  # noqa: B018 - a closed engine says so, not the module's placeholders
        self._take_assigned_grads()  # (before the next backward adds to them, as torch's)
        if self._step.pending_refresh:  # a step's new weights not written yet (OptimizerStep.refresh_weights)
            self._step.refresh_weights(list(self._step.pending_refresh))
        if self._state.phase is Phase.IDLE:
            # Edited since the last step: taken before backward (whose staged steps read the
            # master weights; with strata.optimizer_during_backward some step for good there).
            self._take_edits()
        self._lending.begin_forward()

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Backward of the micro-batch's loss, scaled by 1/gradient_accumulation_steps (as
        DeepSpeed's; not with scale_wrt_gas=False) and by the fp16 loss scale. retain_graph as
        torch's (a second backward through the same graph adds to the gradients)."""
        if self._step.user_clip is not None:
            raise RuntimeError(BACKWARD_AFTER_CLIP)
        scaled = loss.float() / self._state.accumulation if scale_wrt_gas else loss.float()
        if self.loss_scale != 1.0:
            scaled = scaled * self.loss_scale
        if self.ranks is not None and self._state.gradients_since_step and \
                not self._gradients.unreduced:
            # A backward after the window's reduce (through a retained graph): a .grad given
            # since is the user's, taken now (a parameter this backward does not reach keeps
            # it, as torch's; the reduce would take it as this rank's own sum).
            self._take_assigned_grads()
        self._state.phase = Phase.BACKWARD
        self._gradients.unreduced = self.ranks is not None  # (a failed backward: at step())
        try:
            scaled.backward(retain_graph=retain_graph)
            self._copies.end_backward()
            if self.ranks is not None:
                self.ranks.finish_gradients()
                if self._state.is_boundary():
                    # Stage 1's gradients and stage 3's unpartitioned ones reduced now, as
                    # DeepSpeed's backward reduces them: clip_grad_norm_ between backward and step
                    # takes the norm of the mean over the ranks (.grad is None from here).
                    self._gradients.reduce()
            self._lending.end_backward()
        except BaseException:
            if self.ranks is not None:
                # The gradients autograd made before the failure are kept, as in one process
                # (whatever the buckets: those not reduced yet are now), every rank alike; if the
                # ranks cannot (one failed alone, or the job did), they are dropped.
                try:
                    self.ranks.finish_gradients()
                except Exception:  # noqa: BLE001 - the backward's own error is the one raised
                    self.ranks.drop_gradients()
            self._step.end_staged(committed=False)
            raise
        finally:
            self._state.phase = Phase.GRADIENTS
            self._lending.drop_all()
        self._raise_deferred()
        return loss

    def _adopt_backward(self, where, torch_sums=True):
        """A backward the user ran without the engine (loss.backward(), as a plain torch loop
        does) made gradients since the last step: it is taken as the engine's own, its loss
        unscaled (the engine divides nothing it did not see, as plain torch's), backwards before
        one step summing, as plain torch's do. Refused where the engine must scale the loss
        (fp16), the ranks must finish the gradients together, or the engine counts a window's
        micro-batches by its step() (gradient_accumulation_steps above 1). `torch_sums`: the
        caller is torch's (optimizer.step(), clip_grad_norm_), which would read gradients summed
        since the last zero_grad() (not zero_grad(), nor engine.step(), DeepSpeed's, which drops
        them as the engine does)."""
        if self._state.backward_since_step:
            return
        # (stages 0-1 keep torch's .grad, unhooked)
        if not self._state.gradients_since_step and not any(
                e.param.grad is not None for e in self.table.trained if not e.partitioned):
            return
        if self.dtype == torch.float16 or self.ranks is not None or self._state.accumulation > 1:
            why = "fp16 (the engine scales the loss)" if self.dtype == torch.float16 else \
                f"across {self.world_size} ranks (the ranks finish the gradients together)" \
                if self.ranks is not None else \
                (f"gradient_accumulation_steps {self._state.accumulation} (the engine counts a "
                 "window's micro-batches by its step(), where a loop of one's own steps once a "
                 "window: set it to 1 and accumulate in the loop)")
            raise RuntimeError(f"{where}: gradients came from a backward the engine did not run "
                               f"(loss.backward()), which is not taken under {why}; accepted: "
                               "engine.backward(loss)")
        if not self._state.zeroed and torch_sums:
            raise RuntimeError(
                f"{where}: loss.backward() after a step() with no zero_grad() between: plain "
                "torch adds its gradients to those the last step used (.grad keeps them until "
                "zero_grad), where the engine's step() dropped them; accepted: "
                "optimizer.zero_grad() (or model.zero_grad()) after each step() or before each "
                "backward, as a plain torch loop has it (.grad set to None by hand does not "
                "reach the engine's gradients), or engine.step(), which drops them, as "
                "DeepSpeed's")
        self._copies.end_backward()
        self._lending.drop_all()
        self._state.phase = Phase.GRADIENTS

    # --- DeepSpeed's engine API, as trainers call it ------------------------------------------

    def gradient_accumulation_steps(self):
        return self._state.accumulation

    def gradient_clipping(self):
        """The config's gradient_clipping (0: none), by which the step clips by the global norm."""
        return self._step.config.clipping

    def zero_optimization_stage(self):
        return self.stage

    def bf16_enabled(self):
        return self.dtype == torch.bfloat16

    bfloat16_enabled = bf16_enabled  # DeepSpeed's engine has both names

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
        and at stages 0-1 across ranks (reduced after the window's last backward), nothing is
        reduced before the window's end anyway; stages 2 and 3 partition gradients as they are
        made, so it is refused there, as DeepSpeed refuses it."""
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
        return self.micro_batch_size * self._state.accumulation * self.world_size

    def train_micro_batch_size_per_gpu(self):
        return self.micro_batch_size

    def is_gradient_accumulation_boundary(self):
        return self._state.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's: whether the micro-batch about to run ends the accumulation window, for a
        trainer that ends one early (a short last window of an epoch: Lightning's, transformers'
        Trainer's): the window's count moves to its last micro-batch. Called before the
        micro-batch's forward. Refused when the trainer says a window goes on past its length
        (the two disagree)."""
        accumulation = self._state.accumulation
        position = self.micro_steps % accumulation
        if is_boundary and position != accumulation - 1:
            self.micro_steps += accumulation - 1 - position
        elif not is_boundary and position == accumulation - 1 and accumulation > 1:
            raise RuntimeError(f"set_gradient_accumulation_boundary: the engine's accumulation "
                               f"window (micro-batch {position + 1} of {accumulation}) ends here "
                               "and the trainer's does not: the two disagree; accepted: "
                               "gradient_accumulation_steps the same in both")

    def zero_grad(self, set_to_none=True):
        """As torch's: the gradients made since the last step() are dropped (a batch skipped
        after its backward), and the accumulation window starts again; after step() there are
        none (each step() drops what it stepped with). The module's own zero_grad() and the
        optimizer's come here. Refused where some parameters stepped for good during this
        backward with them (strata.optimizer_during_backward): that cannot be undone. What torch's
        .grad would hold after it is kept (TrainingState.zero_grad): a backward of the user's
        after a step() with none between, and zeros kept (set_to_none=False) for a parameter
        a step gives no gradient, are refused where plain torch would step otherwise."""
        done = self.micro_steps % self._state.accumulation
        if self._state.phase is Phase.IDLE and done and self._window_holds_gradients():
            # After a step() that ended a micro-batch but not the window: the window's gradients
            # so far are summed in the engine (the stage-2 host sums kept them, the other stages
            # named a backward of the user's own: audits' findings). A checkpoint saved inside
            # the window holds none of them: loaded, the window goes on without them.
            raise RuntimeError(
                f"zero_grad in the middle of an accumulation window (after micro-batch {done} of "
                f"{self._state.accumulation}, gradient_accumulation_steps): it would drop the "
                "gradients the window has summed so far; accepted: zero_grad after the window's "
                "last step() (engine.step() steps once a window), or "
                "gradient_accumulation_steps 1 to accumulate in the loop")
        self._adopt_backward("zero_grad", torch_sums=False)  # (it drops them all, as torch's)
        self._state.zero_grad(set_to_none)
        if not self._state.gradients_since_step:
            return
        if self._step.stepped_during_backward():
            raise RuntimeError(
                "zero_grad after backward: parameters stepped for good during this backward "
                "with the gradients it would drop (strata.optimizer_during_backward); accepted: "
                "zero_grad after step() or before backward, or strata.optimizer_during_backward "
                "false to drop a micro-batch's gradients")
        self._gradients.end_step(failed=False)
        for e in self.table.trained:
            e.param.grad = None
        self._state.phase = Phase.IDLE
        self.micro_steps -= self.micro_steps % self._state.accumulation

    def _window_holds_gradients(self):
        """Whether any gradient of the accumulation window is held (in the engine's sums, its
        partitions, its shards, or .grad)."""
        return any(e.gradient_held() or e.param.grad is not None for e in self.table.trained)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self, lr_kwargs=None):
        """Ends a micro-batch; at an accumulation boundary, the optimizer step (see the module's
        docstring) and the learning-rate schedule's step, given `lr_kwargs` as DeepSpeed's engine
        gives them (lr_scheduler.step(**lr_kwargs)). A ReduceLROnPlateau steps on a metric: the
        engine steps it only with lr_kwargs (``engine.step(lr_kwargs={"metrics": loss})``); else
        it is the user's to step, as in plain torch (``scheduler.step(val_loss)``). Refused,
        counting nothing, when no backward ran since the last step()."""
        self._take_step(lr_kwargs, torch_sums=False)

    def _take_step(self, lr_kwargs, torch_sums):
        """step(lr_kwargs); `torch_sums` as _adopt_backward's: True for torch's
        optimizer.step()."""
        if self._step.half_loaded is not None:
            raise RuntimeError(f"step: {self._step.half_loaded}")
        self._adopt_backward("step", torch_sums)
        self._take_assigned_grads()
        if not self._state.backward_since_step:
            raise RuntimeError("step: no backward() since the last step(); accepted: "
                               "engine.backward(loss) then engine.step() for each micro-batch")
        boundary = self.is_gradient_accumulation_boundary()
        # (checked where the window steps: nothing is stepped before)
        unfrozen = [n for n, p in self._frozen_at_start if p.requires_grad] if boundary else []
        if unfrozen:
            raise RuntimeError(
                f"step: {', '.join(unfrozen[:5])}{' and more' if len(unfrozen) > 5 else ''} "
                f"({len(unfrozen)} parameters) were frozen (requires_grad False) when "
                "strata.initialize made the optimizer, and require gradients now: the optimizer "
                "has no state for them and would never train them (plain torch's would, had it "
                "been given them); nothing was stepped. Accepted: set requires_grad before "
                "strata.initialize, or freeze them again; to unfreeze part way through training, "
                "make a new engine with them trainable from engine.module_state_dict()")
        if boundary:
            self.optimizer.check_groups("step")
            graded = self._graded_now()
        self._state.phase = Phase.IDLE
        self._state.zeroed = False
        self.micro_steps += 1
        if not boundary:
            return
        if not ("gradient_clipping" in self.config.source or self._step.user_clips or
                self._said_unclipped):
            self._notices.warn(_UNCLIPPED)
            self._said_unclipped = True
        start = time.perf_counter()
        self._copies.land()
        # Waiting for the device: on a GPU below stage 3, backward's queued work and the
        # gradients' copies to the host (stage 3's reach the host through the Runtime, in the
        # commit); nothing on the host.
        device_wait = time.perf_counter() - start
        if self.stage == 3:
            for e in self.table.trained:
                if e.partitioned and e.has_grad and not e.sent_down:
                    self.runtime.gradient_ready(e.gid)
        try:
            if self._gradients.unreduced:  # the window's last backward failed (every rank)
                self._gradients.reduce()
            self._take_edits()
            stepped, report = self._step.finish_staged()
            if stepped is None:  # nothing staged, or the staged step could not stand
                stepped, report = self._step.step_anew()
        except BaseException:
            self._gradients.end_step(failed=True)
            raise
        self._gradients.end_step(failed=False)
        self._edits.written()
        self._state.graded.update(graded)
        if self.ranks is not None:
            self.ranks.sync_buffers(self.module)  # rank 0's buffers everywhere, as DDP's
        self.global_steps += 1  # as DeepSpeed's: skipped steps count too
        self._step_applied = bool(stepped)
        self._global_grad_norm = report.get("grad_norm") if report else None
        if stepped:
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    # torch's schedules look for their optimizer's step() having run first: the
                    # engine's ran, within this step(), and the schedule follows it.
                    warnings.filterwarnings("ignore", r".*`optimizer\.step\(\)`", UserWarning)
                    if lr_kwargs is not None:
                        self.lr_scheduler.step(**lr_kwargs)
                    elif not isinstance(self.lr_scheduler,
                                        torch.optim.lr_scheduler.ReduceLROnPlateau):
                        self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        runtime_report = self.runtime.end_step()
        self._raise_deferred()
        self._step.optimizer_read += runtime_report["optimizer_state_read_bytes"]
        self.last_step_stats = {
            "device": self.device_kind, "stepped": stepped, "loss_scale": self.loss_scale,
            "optimizer": report, "runtime": runtime_report,
            "nvme": _nvme_by_cause(report, runtime_report),
            "step_seconds": time.perf_counter() - start, "device_wait_seconds": device_wait}
        if self.global_steps % self.config.steps_per_print == 0 and self.global_rank == 0:
            waits = ", ".join(f"{k} {v * 1e3:.0f} ms"
                              for k, v in runtime_report["wait_by_cause"].items() if v > 0)
            logger.info("step %d (skipped %d), lr %.3g, loss scale %g, optimizer %.0f ms, waited "
                        "%.0f ms%s on the %s device", self.global_steps, self.skipped_steps,
                        self.get_lr()[0], self.loss_scale,
                        self.last_step_stats["step_seconds"] * 1e3,
                        runtime_report["wait_seconds"] * 1e3, f" ({waits})" if waits else "",
                        self.device_kind)

        if self._step.refresh_error is not None:
            error, self._step.refresh_error = self._step.refresh_error, None
            raise error


    @torch.compiler.disable  # (called from the forward's pre-hook, which dynamo traces)
    def _take_edits(self):
        """The weights written in place since the last step (strata/edits.py) taken into the
        master weights before this forward or step: a step staged during backward from the
        master weights before them is taken anew."""
        self._edits.lost_writes()
        edited = self._edits.edited()
        if not edited:
            return
        self.runtime.wait_for_early_steps()
        if self._step.staged is not None:
            self._step.drop_staged(f"{edited[0].name}{' and more' if len(edited) > 1 else ''} "
                                   "may have been written in place since the last step")
        taken = self._edits.take(edited, self.runtime, self._checkpoints)
        if taken:
            logger.debug("step %d: the weights of %s, written in place since the last step, "
                         "taken into the master weights", self.global_steps + 1,
                         ", ".join(taken))

    def _graded_now(self):
        """The trained parameters (entries) this rank steps with a gradient at the step about to
        be taken. Refused, before any is stepped, where the last zero_grad() kept gradients as
        zeros (set_to_none=False) and some parameter given one in an earlier step has none now:
        torch would step it with its zeros, where the engine steps only the parameters with a
        gradient (across ranks, every rank refuses when one finds such a parameter)."""
        early = self._step.stepped_early
        now = {e for e in self.table.trained if e.shard and (
            e.gradient_held() or e.param.grad is not None or e.staged is not None or e in early)}
        if not self._state.zeros_kept:
            return now
        missing = [e.name for e in self.table.trained if e in self._state.graded and e not in now]
        count = len(missing)
        if self.ranks is not None:
            count = int(self.ranks.all_reduce_sum([float(count)])[0])
        if count:
            named = (f"{', '.join(missing[:5])}{' and more' if len(missing) > 5 else ''} "
                     f"({len(missing)} parameters)") if missing else \
                f"{count} parameters (named on another rank)"
            raise RuntimeError(
                f"step: {named} had a gradient in an earlier step and none in this one, and the "
                "last zero_grad(set_to_none=False) keeps such gradients as zeros: plain torch "
                "would step them with a zero gradient (Adam's moments and weight decay still "
                "move them), where the engine steps only the parameters with a gradient"
                f"{'' if early else '; nothing was stepped'}. Accepted: zero_grad() "
                "(set_to_none=True, torch's default: a parameter with no gradient is not "
                "stepped, as the engine does)")
        return now

    def _take_assigned_grads(self, only=None):
        """Gradients the user gave by hand between backward and step (`p.grad = t`, plain torch's
        way to replace one; to entry `only`, or to any) where the engine would not read them as
        torch's (Gradients.take_given): each taken as its gradient, as strata.safe_set_full_grad
        takes one, at the step, clip_grad_norm_, safe_get_*_grad / safe_set_*_grad and the
        next forward (and before a backward adds to it: Gradients.prehook at stage 2 and with
        grad_accum_dtype apart; across ranks engine.backward after the window's reduce), so that
        a backward after it adds to the gradient given, as torch's adds to .grad. Stage 3's
        partitioned parameters refuse `.grad = t` (strata/placeholders.py); across ranks, a
        .grad given before the window's gradients are reduced (stage 1, stage 3's small
        parameters) is reduced with them."""
        if self._state.gradients_since_step:
            self._gradients.take_given(only)

    def _gradients_apart(self):
        """Why the gradients are not torch's .grad, unscaled, until the step, or None where they
        are (stages 0-1 in one process, summed there, not fp16): torch's clip_grad_value_ and
        clip_grads_with_norm_ over them are plain torch's there (guards.py)."""
        if self.stage >= 2:
            return f"ZeRO stage {self.stage} keeps them apart from .grad"
        if self.ranks is not None:
            return f"across {self.world_size} ranks they are reduced into each rank's shard"
        if self._sum_apart:
            return (f"grad_accum_dtype {self.grad_accum_dtype} (not the training dtype "
                    f"{self.dtype}) keeps the micro-batches' sum apart from .grad")
        if self.dtype == torch.float16:
            return "fp16 scales them by the loss scale"
        return None

    def _owns_any(self, params):
        """Whether any of `params` is one of the engine's trained parameters (guards.py)."""
        return self._step.owns_any(params)

    def _clip_grad_norm(self, params, max_norm, norm_type, error_if_nonfinite):
        """torch.nn.utils.clip_grad_norm_ over the engine's parameters (guards.py routes it
        here): OptimizerStep.clip_by_user, a backward of the user's own and gradients given by
        hand (_take_assigned_grads) taken first."""
        self._take_assigned_grads()
        return self._step.clip_by_user(params, max_norm, norm_type, error_if_nonfinite,
                                       self._adopt_backward)

    def _attempt_quietly(self, fn, *args):
        """fn(*args); a strata error it raises is kept as a warning (closing goes on)."""
        try:
            fn(*args)
        except _strata.Error as error:
            self._warn(f"closing: {error}")

    def _raise_deferred(self):
        errors = self.runtime.take_deferred_errors()
        if errors:
            raise _strata.Error("strata: releasing a lent parameter failed: " + "; ".join(errors))

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's save_checkpoint: the training state under save_dir/tag (default
        "global_stepN"), crash-consistent, `latest` moved last (strata/checkpoints.py says
        what is kept and how). exclude_frozen_parameters: the parameters not trained (a LoRA's
        base) are not saved, and a load keeps the model's own (as DeepSpeed's; Trainer's
        checkpoints of a peft model). Returns the tag's folder."""
        self._checkpoints.lr_scheduler = self.lr_scheduler
        self._take_edits()  # (weights edited since the last step: saved as the module has them)
        return checkpoints.save(self._checkpoints, save_dir, tag, client_state, save_latest,
                                exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        """DeepSpeed's load_checkpoint: returns (the tag's folder, client_state), or (None, None)
        when there is no `latest` and no tag. Everything is checked before anything changes;
        load_module_strict is always on (a parameter missing or extra is named)."""
        del load_module_strict
        self._checkpoints.lr_scheduler = self.lr_scheduler
        return checkpoints.load(self._checkpoints, load_dir, tag, load_optimizer_states,
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
        # Between backward and step with strata.optimizer_during_backward, parameters step as
        # backward goes: what has stepped is read whole, never while it is being written.
        self.runtime.wait_for_early_steps()
        self._edits.lost_writes()  # (a write into a placeholder since the last step: refused)
        self._announce_gather("engine.module_state_dict()")
        by_param = {id(e.param): e for e in self.table.trained if e.partitioned}
        frozen = {id(e.param): e for e in self.table.frozen}
        out, done = {}, {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            e = by_param.get(id(value), frozen.get(id(value)))
            if e is None:
                out[name] = value.detach().to("cpu").clone()
            elif e.pid in done:  # a tied parameter: the same tensor under both names
                out[name] = done[e.pid]
            else:
                out[name] = done[e.pid] = self._whole_weights(e)
        for name, child in self.module.named_modules():  # a TiledLinear's: its Linear's
            if isinstance(child, tiling.TiledLinear):
                tiling.join_tiles(child, out, f"{name}." if name else "")
        return out

    def state_dict_to_save(self, module=None, keep=True, adapters=None,
                           save_embedding_layers="auto"):
        """What saving `module` (the engine's module, or a module within it) writes:
        module.state_dict(), the partitioned weights whole; for a peft model
        (peft.PeftModel), the adapters' entries alone, as peft's save_pretrained keeps them
        (its selection made over the parameters themselves, then only those read whole) beside
        the entries not partitioned: a frozen base's partitioned weights are not read.
        `adapters` and `save_embedding_layers` are peft's save_pretrained's
        (selected_adapters; None: every adapter). Across ranks every rank calls it (the
        trained weights partitioned are gathered); keep=False, on the ranks that do not save:
        the gathers joined, in the same order, nothing else read and nothing kept (None)."""
        module = self.module if module is None else module
        peft = sys.modules.get("peft")
        frozen_partitioned = any(e.partitioned for e in self.table.frozen)
        if peft is not None and frozen_partitioned and isinstance(module, peft.PeftModel):
            return self._adapters_to_save(peft, module, keep, adapters, save_embedding_layers)
        return module.state_dict() if keep else self._join_gathers(module)

    @contextlib.contextmanager
    def keys_only(self):
        """Within it, module.state_dict() leaves a partitioned parameter's entry the placeholder
        it is, its weights not read (not gathered, across ranks): for code that takes those
        entries' keys and their values from a state dict it was handed, as peft's save does
        (ModulesToSaveWrapper.adapter_state_dict lists a saved module's keys with the module's
        own state_dict()). Across ranks a gather there would be the saving rank's alone."""
        before, self._keys_only = self._keys_only, True
        try:
            yield
        finally:
            self._keys_only = before

    def _join_gathers(self, module):
        """module.state_dict()'s gathers joined, as the saving rank's call makes them, and
        nothing else read or kept (_whole_in_state_dict); None."""
        self._joining = set()
        try:
            module.state_dict()
        finally:
            self._joining = None

    def _adapters_to_save(self, peft, module, keep, adapters, save_embedding_layers):
        """state_dict_to_save for a peft model (its docstring). An entry peft's selection
        computes rather than takes (none of the adapters' parameters) means it needs the
        weights themselves: module.state_dict() then, as without strata."""
        held = module.state_dict(keep_vars=True)  # (the parameters themselves: nothing read)
        held_ids = {id(v) for v in held.values()}
        chosen = set()
        computed = False
        with warnings.catch_warnings(), self.keys_only():  # (peft warns again in the save)
            warnings.simplefilter("ignore")
            for name in list(module.peft_config) if adapters is None else adapters:
                kept = peft.get_peft_model_state_dict(
                    module, state_dict=held, adapter_name=name,
                    save_embedding_layers=save_embedding_layers)
                computed = computed or any(id(v) not in held_ids for v in kept.values())
                chosen.update(id(v) for v in kept.values())
        if computed:
            return module.state_dict() if keep else self._join_gathers(module)
        self.runtime.wait_for_early_steps()
        self._announce_gather("save_pretrained (peft's adapters)")
        out, done = {}, {}
        for key, value in held.items():
            e = self.table.partitioned_by_id.get(id(value))
            if e is None:
                if keep:
                    out[key] = value.detach()
            elif id(value) in chosen:
                if e.pid not in done:  # (a tied parameter: read once)
                    whole = self._whole_weights(e)  # (keep=False: across ranks, a gather)
                    done[e.pid] = whole if keep else None
                if keep:
                    out[key] = done[e.pid]
        return out if keep else None

    def _announce_gather(self, call):
        """Across ranks with parameters partitioned (each rank holds a shard of a trained one's
        master weights, of a frozen one's weights), `call` gathers them: every rank must make
        it. The ranks agree on it first, so that a call on one rank alone (a save guarded by
        `if rank == 0`) ends that rank with an error naming the call, not the gather of
        some parameter that the other ranks never joined."""
        if self.ranks is not None and self.table.partitioned_by_id:
            self.ranks.agree(f"{call}, which gathers the weights partitioned across the ranks: "
                             "every rank must call it (not the saving rank alone); the ranks "
                             "that save write what it returns")

    def _whole_weights(self, e):
        """A partitioned parameter's weights whole, in the training dtype on the CPU: a trained
        one's read from its fp32 master weights (across ranks, every rank's shard: every rank
        must call this), a frozen one's from its partition."""
        if e.frozen:
            return read_frozen(self.runtime, e, self.ranks)
        self._step.refuse_read_after_early_steps(
            f"{e.name}: its weights read whole (module_state_dict, state_dict(), "
            "GatheredParameters, save_pretrained)", e)
        master = read_state(self.runtime, e)[0]
        if self.ranks is not None:  # every rank's shard (every rank must call this)
            whole = []
            self.ranks.gather([(e, master, whole.append)])
            master = whole[0].to("cpu", copy=True)  # (gathered to the GPU the model is on)
        return master.to(self.dtype).view(e.shape)

    def _whole_in_state_dict(self, module, state_dict, prefix, local_metadata):
        """A post-hook of module.state_dict() on each module that owns partitioned parameters
        (stage 3): their entries, placeholders without their bytes, become their weights whole
        (_whole_weights), so that state_dict() gives what plain torch's does and whatever saves
        from it (transformers' save_pretrained, peft's adapter save) writes the weights, not
        empty tensors. With keep_vars=True (the entry is the parameter itself) they are left as
        they are. A tied parameter is read once a state_dict() call (the weights read for the
        dict being filled, kept while it is)."""
        if self._keys_only:
            return
        read = None
        for name, p in module._parameters.items():
            e = self.table.partitioned_by_id.get(id(p)) if p is not None else None
            key = prefix + name
            if e is None or key not in state_dict or state_dict[key] is p:
                continue
            if read is None:
                filling, read = self._whole_read
                if filling() is not state_dict:
                    self.runtime.wait_for_early_steps()
                    self._announce_gather("module.state_dict() (save_pretrained's, "
                                          "save_model's)")
                    read = weakref.WeakValueDictionary()  # (the dict holds the tensors)
                    self._whole_read = (weakref.ref(state_dict), read)
            if self._joining is not None:  # (state_dict_to_save(keep=False): across ranks)
                if e.pid not in self._joining:
                    self._joining.add(e.pid)
                    self._whole_weights(e)
                continue
            whole = read.get(e.pid)
            if whole is None:
                whole = read[e.pid] = self._whole_weights(e)
            state_dict[key] = whole

    # --- the engine's life ----------------------------------------------------------------------

    @property
    def runtime(self):
        """The Runtime behind the engine (sched/runtime.h); closed engines have none."""
        if self._runtime is None:
            raise RuntimeError("strata: the engine is closed; accepted: a new strata.initialize")
        return self._runtime

    @runtime.setter
    def runtime(self, runtime):  # a seam: tests put a Runtime that fails where they want
        self._hand_runtime(runtime)

    def _hand_runtime(self, runtime):
        """The Runtime (None: closed), to the engine and each of its parts (closed: CLOSED,
        which names the closed engine wherever a part still reaches for it)."""
        self._runtime = runtime
        for part in (self._lending, self._gradients, self._step,
                     getattr(self, "_checkpoints", None)):
            if part is not None:
                part.runtime = runtime if runtime is not None else CLOSED

    # DeepSpeed's engine's counts and figures, kept by the engine's parts.

    global_steps = _delegated("_state", "global_steps", "Accumulation boundaries passed "
                              "(skipped steps included), as DeepSpeed's.", settable=True)
    micro_steps = _delegated("_state", "micro_steps", "step() calls that ended a micro-batch (a "
                             "checkpoint loaded with another accumulation: rounded down to a "
                             "window's start).",
                             settable=True)
    skipped_steps = _delegated("_state", "skipped_steps", "Boundaries whose step was skipped "
                               "(an fp16 overflow).", settable=True)
    warnings = _delegated("_notices", "messages", "The warnings the engine gave (each once; said "
                          "on rank 0 only).")
    redone_steps = _delegated("_step", "redone_steps", "Steps staged during backward, dropped "
                              "and taken anew after it.")
    last_redo_reason = _delegated("_step", "last_redo_reason", "Why the last of them was.")
    loss_scale = _delegated("_scaler", "scale", "The loss scale (fp16's; 1.0 in bf16 and fp32), "
                            "as DeepSpeed's engine's.")
    prefetched_gathers = _delegated("_lending", "prefetched_gathers", "Across ranks: the "
                                    "all-gathers started ahead that their module used.")

    def close(self):
        """Gives back what the engine holds: its Runtime (the device and pinned host memory of
        its tiers, its NVMe store, whose swap files are removed unless strata.nvme_keep_files),
        the hooks on the module, the module's patched methods. Idempotent. A step staged and not
        committed is dropped; the module's partitioned parameters are left placeholders of their
        shape without their bytes, and its forward and state_dict() refuse them by name (take
        module_state_dict() or save a checkpoint first: ``module.load_state_dict(state,
        assign=True)`` then gives the plain module its weights back; release() closes and gives
        them back whole). The last reference to an engine closes it as well (nothing holds an engine but its user); ``with engine:`` closes it at the
        end of the block."""
        if self._runtime is None:
            return
        guards.LIVE.discard(self)
        self._dropped.detach()
        try:
            self._step.end_staged(committed=False, reason="the engine closed")
        finally:
            self._lending.remove()
            self._step.release_early_held(self._attempt_quietly)
            for handle in self._hook_handles:
                handle.remove()
            guards.leave_placeholders(
                weakref.ref(self.module), [(e.param, e.shape) for e in self.table.entries()
                              if e.partitioned], self.dtype, self.device)
            self._edits.forget()
            for e in self.table.entries():
                e.param.__dict__.pop("_strata_node", None)
                e.param.__dict__.pop("ds_numel", None)
                e.param.__dict__.pop("__deepcopy__", None)  # (strata.init's: copied plain now)
            for module, name in self._patched_methods:
                module.__dict__.pop(name, None)
            self.module.__dict__.pop("load_state_dict", None)
            if checkpointing.host_store_of(self):
                checkpointing.use_host_store(None)
            if self.ranks is not None:
                self.ranks.collectives.let_go()  # (the buffers kept for the next collectives)
            built = init_module.built_under(self.module)
            if built is not None:
                built.release()
            self._hand_runtime(None)

    def release(self):
        """Closes the engine and gives the module its weights back whole in its own parameters
        (plain tensors on the engine's device, in the training dtype; tied ones stay tied): a
        plain torch module again, for what the engine does not lend (peft's merge_and_unload at
        stage 3, weights edited in place). Across ranks every rank must call it. Returns the
        module."""
        state = self.module_state_dict()
        model = self.module
        for name, child in model.named_modules():  # a TiledLinear's weight whole: its tiles'
            if isinstance(child, tiling.TiledLinear):
                tiling.cut_whole(child, state, f"{name}." if name else "")
        self.close()
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                p.data = state[name].to(self.device).view(p.shape).clone()
        guards.unguard(model)
        init_module.forget(model)  # (built under strata.init: plain now, for a new engine too)
        return model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def stats(self):
        """The Runtime's statistics since the engine was made (waits, bytes per tier pair), the
        optimizer's NVMe traffic included in bytes_moved (its state read into the host and
        written back: nvme_to_host, host_to_nvme; a step's state written behind it,
        strata.optimizer_write_behind, is counted with the next step that commits)."""
        s = self.runtime.stats()
        s["device"] = self.device_kind
        moved = s["bytes_moved"]
        for key, count in (("nvme_to_host", self._step.optimizer_read),
                           ("host_to_nvme", self._step.optimizer_written)):
            if count:
                moved[key] = moved.get(key, 0) + count
        return s


# The parameters that closed engines left placeholders (their shape, no bytes): id(parameter)
# -> (a weak reference to it, the placeholder's data_ptr); and the modules holding one, with the
# hooks that refuse them.



def _nvme_by_cause(report, runtime_report):
    """The step's NVMe bytes by cause, {"read": {...}, "written": {...}}, each byte in one:
    optimizer_state (the step's reads and writes of the NVMe-resident optimizer state; writes
    behind a step counted with the next), state_again (the state read outside the step: the new
    weights of parameters homed on NVMe read back from their master weights, a checkpoint's),
    weights (the parameters' partitions: lent for forward and backward, and written back),
    gradients (gradient partitions evicted to NVMe during backward and read back for the step),
    other (anything else the Runtime holds: activations kept by cpu_checkpointing)."""
    report = report or {}
    read = {"optimizer_state": report.get("bytes_read", 0),
            "state_again": runtime_report["optimizer_state_read_bytes"]}
    written = {"optimizer_state": report.get("bytes_written", 0) +
               report.get("behind_bytes_written", 0)}
    for side, by_role in ((read, runtime_report["nvme_read_by_role"]),
                          (written, runtime_report["nvme_written_by_role"])):
        side["weights"] = by_role.get("param", 0)
        side["gradients"] = by_role.get("grad", 0)
        side["other"] = sum(v for k, v in by_role.items() if k not in ("param", "grad"))
    return {"read": read, "written": written}


def host_minimum(config, model):
    """The smallest strata.host_budget_bytes `config` (a parsed TrainConfig) takes with `model`
    in this process (tiering::RuntimeConfig::MinimumHost: the staging buffers, the optimizer's
    room at its smallest, the largest gradient partition at stage 3 (and its parameter's under
    optimizer_commit "partition"), from the model's sizes;
    across ranks each rank's shards), {staging, optimizer, partition, total, budget (the
    config's)}; refused, naming each part, where the config's budget is below it (else the
    staging buffers, the optimizer's room or a partition's move is refused later, naming only
    itself). Staged copies (optimizer_commit "step") are counted for every trained parameter but,
    with parameters homed on NVMe, the partitioned ones (their new weights are read back)."""
    settings = _RuntimeSettings(config)
    world = _world_size()
    trained = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    shards = [-(-p.numel() // world) for p in trained]
    threshold = settings.threshold if settings.stage == 3 else float("inf")

    def partitioned(p):
        return p.numel() >= threshold or init_module.partition_of(p) is not None
    grad_bytes = _DTYPES[config.grad_accum_dtype].itemsize
    element = _DTYPES[config.dtype].itemsize
    largest, name = max(((-(-p.numel() // world) * grad_bytes, n)
                         for n, p in model.named_parameters() if p.requires_grad and
                         partitioned(p)), default=(0, None))
    # Parameters homed in host memory (offload_param "cpu" at stage 3) are all held there.
    homed = sum(-(-p.numel() // world) * element for p in {
        id(p): p for p in model.parameters() if partitioned(p)}.values()) \
        if settings.stage == 3 and settings.param_tier == "host" else 0
    # The staged new weights under "step": with parameters homed on NVMe, the unpartitioned
    # ones' (the others are read back from their master weights); else all.
    staged = sum(-(-p.numel() // world) for p in trained
                 if not (settings.param_tier == "nvme" and partitioned(p))) * element
    # The optimizer's state in host memory is set aside a partition at a time, in whole pages.
    elements = sum(-(-12 * n // 4096) * 4096 // 12 + 1 for n in shards) \
        if settings.optimizer_device == "cpu" else sum(shards)
    need = _strata.minimum_host_budget(
        settings.runtime_json, elements, max(shards, default=0), largest + homed, staged,
        largest // grad_bytes * element)
    if need["budget"] < need["total"]:
        raise ValueError(
            f"strata.host_budget_bytes ({need['budget']}) is below the smallest this config and "
            f"model take, {need['total']} bytes: the staging buffers {need['staging']} "
            f"(offload_param.buffer_count x buffer_size), the optimizer's room at its smallest "
            f"{need['optimizer']} (offload_optimizer \"{settings.optimizer_device}\": "
            f"{'its state' if settings.optimizer_device == 'cpu' else 'its ring'}), and the "
            f"largest gradient partition {need['partition']}{f' ({name})' if name else ''} "
            "(with its parameter's, where each partition's new weights are written into it, and "
            "the parameters homed in host memory); "
            f"accepted: strata.host_budget_bytes of at least {need['total']}, or fewer or smaller "
            "staging buffers")
    return need


def _leave_room_beside_read_ahead(settings, need):
    """strata.optimizer_read_ahead_bytes "auto" (an eighth of the host budget) takes no room
    where the budget holds less than a quarter of itself beyond its minimum (`need`,
    host_minimum's), so that the gradients and the parameter partitions their new weights go
    into find their room (the Runtime sets the room aside before it knows the partitions)."""
    runtime = json.loads(settings.runtime_json)
    block = runtime.setdefault("strata", {})
    if not isinstance(block, dict) or block.get("optimizer_read_ahead_bytes", "auto") != "auto":
        return
    spare = max(0, need["budget"] - need["total"])
    if spare < need["budget"] // 4:
        # None: a partition read ahead keeps its gradient pinned until the step after backward,
        # so read-ahead room taken near the minimum leaves too little for the gradients and the
        # parameters their new weights go into (and the ring grows by a quarter of the spare).
        block["optimizer_read_ahead_bytes"] = 0
        settings.runtime_json = json.dumps(runtime, sort_keys=True)


def from_pretrained(cls, path, config, **initialize_kwargs):
    """A `transformers` model class's ``from_pretrained`` through strata, for a model larger than
    the host: the model's config is read from the folder `path` (its config.json), the model is
    built under ``strata.init(config)`` without initializing weights it is about to load (as
    transformers does under DeepSpeed), ``strata.initialize(model=..., config=config,
    **initialize_kwargs)`` makes the engine, and the folder's weights (safetensors or torch.save,
    one file or shards) stream into it (engine.load_pretrained, strict). Returns initialize's
    (engine, optimizer, dataloader, lr_scheduler)."""
    import transformers
    hf_config = transformers.AutoConfig.from_pretrained(os.fspath(path))
    skip_init = getattr(getattr(transformers, "initialization", None), "no_init_weights", None)
    with init_module.init(config=config):
        if skip_init is not None:
            with skip_init():
                model = cls._from_config(hf_config)
        else:
            model = cls._from_config(hf_config)
    out = initialize(model=model, config=config, **initialize_kwargs)
    out[0].load_pretrained(path)
    return out
