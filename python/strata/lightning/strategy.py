"""The strategy: Lightning's Trainer driving a strata engine (DeepSpeedStrategy's arguments and
hooks).

Part of strata.lightning (its module docstring says what the Trainer gets).
"""

import contextlib
import copy
import functools
import inspect
import logging
import os
import sys
import warnings
import weakref

import torch

from strata import zero_init as _zero_init
from strata.config import ConfigError, TrainConfig
from strata.engine import StrataWarning
from strata.runtime_settings import RuntimeSettings
from strata.lightning.arguments import (_COLLECTIVE_ARGUMENTS, _LOSS_SCALE_ARGUMENTS,
    _build_config, _check_arguments, _default_timeout, _get, _load_config, _put, _records_given)
from strata.lightning.checkpoints import TAG, _checkpoint_folder, _pack, _unpack
from strata.lightning.engines import _ENGINES, _Held, _closed, _held, release
from strata.lightning.launch import (_LAUNCH_VARIABLES, _ONE_PROCESS_VARIABLES, _free_port,
    _one_process_environment)
from strata.lightning.precision import _PRECISIONS, _PrecisionMixin, _check_precision

logger = logging.getLogger("strata")


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
        self.exclude_frozen_parameters = exclude_frozen_parameters
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
        if want == "cuda" and self.root_device.index is not None:
            # The Trainer's GPU for this process (devices=[1, 2] gives local rank 0 GPU 1).
            block.setdefault("device_index", self.root_device.index)
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
            # By value: Lightning's clip_gradients clips .grad before each step (torch's
            # clip_grad_value_, where the gradients are torch's .grad: checked once the engine
            # is made, _check_value_clipping); the engine's own clipping is by norm.
            clip = None
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
        if flavor.is_overridden("configure_gradient_clipping", module) and training and \
                float(config.get("gradient_clipping", 0) or 0) > 0:
            self._warn("StrataStrategy: configure_gradient_clipping is overridden and "
                       "Trainer(gradient_clip_val=...) is set: the engine clips by "
                       "gradient_clip_val inside its step whatever the hook does (its own "
                       "self.clip_gradients calls clip through the engine too); leave "
                       "gradient_clip_val unset for the hook alone to clip")
        self._warn_collectives_in_one_process()
        with _one_process_environment(self.world_size):
            engine, _, _, _ = strata.initialize(model=module, optimizer=optimizer,
                                                lr_scheduler=scheduler, config=config)
        _ENGINES.add(engine)
        if training:
            _check_value_clipping(trainer, engine)
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
        engine.save_checkpoint(filepath, tag=TAG, client_state=_pack(client),
                               exclude_frozen_parameters=self.exclude_frozen_parameters)

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
    """The stacklevel of warnings.warn that names the first frame outside this package (the
    user's line, or Lightning's that called the strategy)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


def _this_is_rank_zero():
    """Whether this process is rank 0 of its job (from the launchers' variables)."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value not in (None, "", "0"):
            return False
    return True


def _check_value_clipping(trainer, engine):
    """Trainer(gradient_clip_algorithm="value"): Lightning clips .grad by value before each
    step, which is plain Lightning's where the gradients are torch's .grad until the step
    (stages 0-1 in one process, not fp16, no grad_accum_dtype sum apart); elsewhere refused by
    name before training starts, not at the first step."""
    algorithm = trainer.gradient_clip_algorithm
    apart = engine._gradients_apart()
    if trainer.gradient_clip_val and \
            str(getattr(algorithm, "value", algorithm)) == "value" and apart is not None:
        engine.close()
        raise ValueError(
            "StrataStrategy: gradient_clip_algorithm='value' where the gradients are not "
            f"torch's .grad ({apart}): clipping by value would clip nothing, or the scaled "
            "values; accepted: 'norm' (the engine clips by the global norm), or value clipping "
            "at stage 0 or 1 in one process, not fp16 (in bf16 accumulating micro-batches, "
            "with grad_accum_dtype bf16)")
