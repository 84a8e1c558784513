"""strata under transformers' Trainer (and the trainers built on it, TRL's SFTTrainer among them).

    from strata.hf import Trainer          # transformers.Trainer, trained through strata
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...,
                      strata_config="ds_config.json")   # a DeepSpeed config, "auto" values too
    trainer.train()

or, for another Trainer subclass, ``strata.hf.with_strata(SFTTrainer)(..., strata_config=...)``.

The user's TrainingArguments stay as they are; strata takes the places DeepSpeed takes in
transformers' integration:
  - "auto" values in the config are filled from the arguments as transformers fills DeepSpeed's
    (micro batch, accumulation, the optimizer block's lr / betas / eps / weight decay, the
    scheduler block's warmup and total steps, bf16, the bucket sizes from the model's hidden
    size); a value set in the config that disagrees with the arguments is refused by name;
  - the engine is made when training starts (create_optimizer): over the optimizer Trainer
    makes from its arguments (its groups: no weight decay for biases and norms), unless the
    config has an optimizer block, which strata makes as DeepSpeed would;
  - each micro-batch's training step is Trainer's own (or its subclass's: TRL's trainers have
    theirs), its accelerator.backward the engine's backward (for_accelerate; the loss as Trainer
    computes and normalizes it), the window's end set from Trainer's (a short last window of an
    epoch too); Trainer's clipping
    (max_grad_norm: torch.nn.utils.clip_grad_norm_, which the engine answers) and its
    optimizer.step() and schedule are Trainer's own, so the config's gradient_clipping must be
    "auto" (or agree: then Trainer clips alone);
  - the model is not moved to the device by Trainer (the engine places it: a model larger than
    the GPU is never whole there), so evaluating before training starts is refused by the
    device mismatch it meets;
  - save_model writes the weights whole at every stage (module.state_dict() gathers), peft
    adapters as adapters; checkpoints keep the engine's whole training state (its own checkpoint
    under the checkpoint folder, "strata") and resume bit for bit.
Across ranks (torchrun, accelerate launch) each rank trains its shards (strata.ranks), on the
micro-batches Trainer's data loader gives it; Trainer's accelerator never wraps the model in DDP
(the engine reduces the gradients: for_accelerate, which Accelerate loops of one's own call too),
and save_model gathers the weights on every rank.
Refused, saying what to do instead: fp16 (Trainer's GradScaler would step around the engine;
bf16 or fp32).

Thread safety: the Trainer's (one thread).
"""

import copy
import json
import os
import sys
import weakref

import torch
import transformers

import strata
from strata import config as config_module
from strata import guards
from strata import lr_schedules
from strata.optimizer import EngineOptimizer

__all__ = ["Trainer", "StrataTrainerMixin", "with_strata", "fill_auto", "for_accelerate"]

ENGINE_TAG = "strata"  # the engine's checkpoint inside Trainer's checkpoint folder
SCHEDULER_NAME = "scheduler.pt"


def _config_of(config):
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"strata.hf: strata_config is a {type(config).__name__}; accepted: a "
                        "DeepSpeed config as a dict or the path of its JSON file")
    return copy.deepcopy(config)


def fill_auto(config, args, model=None, num_training_steps=None):
    """`config` (a DeepSpeed config dict, copied) with its "auto" values filled from `args` (a
    TrainingArguments), as transformers fills DeepSpeed's; values set that disagree with the
    arguments are refused, naming both, as transformers refuses them (the scheduler block's
    too: its rates and steps). The scheduler block's steps need num_training_steps
    (left "auto" without it). Trainer clips by max_grad_norm itself, so gradient_clipping ends 0."""
    c = copy.deepcopy(config)

    def fill(block, key, value, path):
        if key not in block:
            return
        if block[key] == "auto":
            block[key] = value
        elif value is not None and block[key] != value:
            raise ValueError(f"strata.hf: the config's {path}{key} is {block[key]!r} and the "
                             f"TrainingArguments give {value!r}; accepted: \"auto\" (filled "
                             "from them), or the same value in both")

    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill(c, "train_micro_batch_size_per_gpu", micro, "")
    fill(c, "gradient_accumulation_steps", accumulation, "")
    fill(c, "train_batch_size", micro * accumulation * args.world_size, "")
    c.setdefault("train_micro_batch_size_per_gpu", micro)
    c.setdefault("gradient_accumulation_steps", accumulation)
    fill(c, "gradient_clipping", args.max_grad_norm, "")  # (refuses a value that disagrees)
    c["gradient_clipping"] = 0.0  # Trainer clips, through clip_grad_norm_ (module docstring)
    for key, on in (("bf16", args.bf16), ("fp16", args.fp16)):
        block = c.get(key)
        if block is not None:
            fill(block, "enabled", bool(on), f"{key}.")
        elif on:
            c[key] = {"enabled": True}
    optimizer = c.get("optimizer", {}).get("params")
    if optimizer is not None:
        for key, value in (("lr", args.learning_rate), ("eps", args.adam_epsilon),
                           ("weight_decay", args.weight_decay),
                           ("betas", [args.adam_beta1, args.adam_beta2])):
            fill(optimizer, key, value, "optimizer.params.")
    scheduler = c.get("scheduler", {}).get("params")
    if scheduler is not None and num_training_steps is not None:
        for key, value in (("warmup_min_lr", 0.0), ("warmup_max_lr", args.learning_rate),
                           ("warmup_num_steps", args.get_warmup_steps(num_training_steps)),
                           ("total_num_steps", num_training_steps)):
            fill(scheduler, key, value, "scheduler.params.")
    zero = c.get("zero_optimization", {})
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    for key, size in (("reduce_bucket_size", lambda h: h * h),
                      ("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
                      ("stage3_param_persistence_threshold", lambda h: 10 * h)):
        if zero.get(key) == "auto":
            if hidden is None:
                del zero[key]  # strata's default
            else:
                zero[key] = size(hidden)
    left = [path for path in _autos(c) if not path.startswith("scheduler.")
            or num_training_steps is not None]
    if left:
        raise ValueError(f"strata.hf: {', '.join(left)} is \"auto\" and nothing in the "
                         "TrainingArguments fills it; accepted: a value")
    return c


def for_accelerate(accelerator):
    """`accelerator` (accelerate's Accelerator) made to prepare and train strata engines' modules
    and optimizers as it does DeepSpeed's, and returned:
      - a module an engine trains is never wrapped in DDP (across ranks the engine reduces its
        gradients itself; DDP's reducer would reduce them a second time, at stage 3 over
        placeholders);
      - an engine's optimizer is wrapped without placing its state (the placement reads the
        state whole and writes it back: the NVMe tier's too; across ranks each rank holds a
        shard of it, and the read is refused);
      - accelerator.backward(loss), with one engine's module prepared (still held: not let go
        by free_memory()), is the engine's backward, as
        DeepSpeed's is there: the loss scaled by 1/gradient_accumulation_steps as accelerate
        scales it, the window's end from accelerate's (accumulate()'s sync_gradients), and a
        micro-batch that does not end the window ended (accelerate skips optimizer.step() there).
        The engine's gradient_accumulation_steps must be the Accelerator's;
      - accelerator.save_state / load_state keep each prepared engine's training state as its
        own checkpoint (engine.save_checkpoint: each rank's shard, the state never read whole)
        in the state's folder, "strata" (the next engine's "strata_1", ...), as accelerate keeps
        DeepSpeed's; the engines' modules and optimizers are left out of accelerate's own files
        (its weights and optimizer files), the rest (schedulers, samplers, random states,
        custom objects) saved and loaded by accelerate. save_state's keywords go to
        save_checkpoint (client_state, save_latest, exclude_frozen_parameters; others
        refused), load_state's to load_checkpoint
        (load_optimizer_states, load_lr_scheduler_states, load_module_only; the others are
        accelerate's, for the models it loads itself). Every rank calls them, as under
        DeepSpeed.
    Other models and optimizers are prepared and trained as accelerate does. strata.hf's Trainer
    does this to its own; a loop of one's own calls it once, after making its Accelerator."""
    if getattr(accelerator, "_strata_prepares", False):
        return accelerator
    prepare_model, prepare_optimizer = accelerator.prepare_model, accelerator.prepare_optimizer
    backward = accelerator.backward
    save_state, load_state = accelerator.save_state, accelerator.load_state
    engines = weakref.WeakKeyDictionary()  # engine: its module as prepared (a weak reference)
    kept = {}  # the save or load under way: its engines (tag, engine) and keywords

    def prepare_model_for_strata(model, device_placement=None, evaluation_mode=False):
        engine = guards.engine_of(list(model.parameters()), "accelerator.prepare")
        if engine is not None and accelerator.num_processes > 1:
            owned = {id(e.param) for e in engine.table.entries()}
            outside = [name for name, p in model.named_parameters()
                       if p.requires_grad and id(p) not in owned]
            if outside:  # (a head around the engine's module: TRL's value head, say)
                raise ValueError(
                    f"accelerator.prepare: {len(outside)} trained parameters of the model are "
                    f"not the strata engine's ({', '.join(outside[:3])}): across ranks nothing "
                    "would reduce their gradients (an engine's module is not wrapped in DDP); "
                    "accepted: strata.initialize over the whole model")
        prepared = prepare_model(model, device_placement=device_placement,
                                 evaluation_mode=evaluation_mode or engine is not None)
        if engine is not None:
            engines[engine] = weakref.ref(prepared)
        return prepared

    def prepare_optimizer_for_strata(optimizer, device_placement=None):
        if isinstance(optimizer, EngineOptimizer):
            device_placement = False
        return prepare_optimizer(optimizer, device_placement=device_placement)

    def backward_for_strata(loss, **kwargs):
        # (those still prepared: accelerator.free_memory() lets go of them)
        live = [engine for engine, prepared in list(engines.items())
                if engine._runtime is not None
                and any(model is prepared() for model in accelerator._models)]
        if not live:
            return backward(loss, **kwargs)
        if len(live) > 1:
            raise ValueError(f"accelerator.backward with {len(live)} strata engines' modules "
                             "prepared: it is one engine's backward; accepted: each engine's "
                             "engine.backward(loss)")
        unknown = sorted(set(kwargs) - {"retain_graph"})
        if unknown:
            raise ValueError(f"accelerator.backward({', '.join(unknown)}=...) over a strata "
                             "engine's module: the engine's backward takes retain_graph alone; "
                             "accepted: accelerator.backward(loss) or with retain_graph=")
        (engine,) = live
        steps = accelerator.gradient_accumulation_steps
        # Within strata.hf's training step the window is Trainer's (it sets sync_gradients
        # itself, and ends a micro-batch that does not end the window); else accumulate()'s.
        windowed = getattr(accelerator, "_strata_window", None) is engine
        if not windowed:
            if steps != engine.gradient_accumulation_steps():
                raise ValueError(
                    f"accelerator.backward: the Accelerator accumulates {steps} micro-batches a "
                    f"step and the engine's config {engine.gradient_accumulation_steps()} "
                    "(gradient_accumulation_steps): the loss would be scaled and the window "
                    "ended by one and not the other; accepted: the same number in both")
            engine.set_gradient_accumulation_boundary(accelerator.sync_gradients)
        engine.backward(loss / steps, retain_graph=kwargs.get("retain_graph", False),
                        scale_wrt_gas=False)  # (scaled as accelerate scales it)
        if not windowed and not engine.is_gradient_accumulation_boundary():
            engine.step()  # the micro-batch ends; the window's step is optimizer.step()
    def kept_by_engines(call, given, accepted, run):
        """`run()` (accelerate's save_state or load_state) with the prepared engines' modules
        and optimizers out of its lists, their engines and `given` keywords kept for the hooks
        below, which accelerate calls with the state's folder."""
        unknown = sorted(set(given) - set(accepted))
        if unknown:
            raise ValueError(f"accelerator.{call}({', '.join(unknown)}=...) with a strata "
                             f"engine prepared: its keywords go to the engine's checkpoint; "
                             f"accepted: {', '.join(accepted)}")
        models, optimizers = accelerator._models, accelerator._optimizers
        found, others, other_optimizers = [], [], []
        for model in models:
            engine = guards.engine_of(list(model.parameters()), f"accelerator.{call}")
            if engine is None:
                others.append(model)
            elif engine not in found:
                found.append(engine)
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if not isinstance(inner, EngineOptimizer):
                other_optimizers.append(optimizer)
            elif inner._engine_or_raise() not in found:
                found.append(inner._engine_or_raise())
        kept.update(engines=[(ENGINE_TAG if i == 0 else f"{ENGINE_TAG}_{i}", engine)
                             for i, engine in enumerate(found)], given=given)
        accelerator._models, accelerator._optimizers = others, other_optimizers
        try:
            return run()
        finally:
            accelerator._models, accelerator._optimizers = models, optimizers
            kept.clear()

    def save_state_for_strata(output_dir=None, safe_serialization=True, **kwargs):
        return kept_by_engines("save_state", kwargs,
                               ("client_state", "save_latest", "exclude_frozen_parameters"),
                               lambda: save_state(output_dir, safe_serialization))

    def load_state_for_strata(input_dir=None, load_kwargs=None, **kwargs):
        # The engines' keywords go to their checkpoints; the others (map_location, strict...)
        # to accelerate, for the models it loads itself.
        ours = ("load_optimizer_states", "load_lr_scheduler_states", "load_module_only")
        return kept_by_engines(
            "load_state", {k: v for k, v in kwargs.items() if k in ours}, ours,
            lambda: load_state(input_dir, load_kwargs,
                               **{k: v for k, v in kwargs.items() if k not in ours}))

    def save_engines(models, weights, output_dir):
        for tag, engine in kept.get("engines", ()):
            engine.save_checkpoint(output_dir, tag=tag, **kept["given"])

    def load_engines(models, input_dir):
        for tag, engine in kept.get("engines", ()):
            if not os.path.isdir(os.path.join(input_dir, tag)):
                raise FileNotFoundError(
                    f"accelerator.load_state: {input_dir} holds no strata checkpoint ({tag}/) "
                    "for a prepared engine: it was saved by an Accelerator without "
                    "strata.hf.for_accelerate (or with fewer engines prepared); accepted: a "
                    "state saved through for_accelerate with the same engines prepared")
            engine.load_checkpoint(input_dir, tag=tag, **kept["given"])

    accelerator.prepare_model = prepare_model_for_strata
    accelerator.prepare_optimizer = prepare_optimizer_for_strata
    accelerator.backward = backward_for_strata
    accelerator.save_state, accelerator.load_state = save_state_for_strata, load_state_for_strata
    accelerator.register_save_state_pre_hook(save_engines)
    accelerator.register_load_state_pre_hook(load_engines)
    accelerator._strata_prepares = True
    return accelerator


def _autos(value, path=""):
    if value == "auto":
        yield path.rstrip(".")
    elif isinstance(value, dict):
        for key, inner in value.items():
            yield from _autos(inner, f"{path}{key}.")


class StrataTrainerMixin:
    """The Trainer methods strata takes over (the module's docstring); mix it in before a
    transformers.Trainer subclass. ``strata_engine`` is the engine once training has started."""

    def __init__(self, *args, strata_config=None, **kwargs):
        if strata_config is None:
            raise ValueError("strata.hf: strata_config is missing; accepted: a DeepSpeed config "
                             "(a dict or the path of its JSON file) for strata")
        self.strata_config = _config_of(strata_config)
        scheduler = self.strata_config.get("scheduler")
        if isinstance(scheduler, dict) and scheduler.get("type") not in config_module.SCHEDULERS:
            raise ValueError(f"strata.hf: scheduler.type {scheduler.get('type')!r} is not "
                             f"supported; accepted: {', '.join(config_module.SCHEDULERS)}, or no "
                             "scheduler block (TrainingArguments' lr_scheduler_type then)")
        self.strata_engine = None
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        # The launcher's WORLD_SIZE too: TrainingArguments say 1 process where they were made
        # without a distributed backend (no args given, or on a CPU without use_cpu).
        if training_args is not None and getattr(training_args, "deepspeed", None):
            # (Trainer would make DeepSpeed's engine from it, where DeepSpeed is installed.)
            raise ValueError("strata.hf: TrainingArguments.deepspeed is set: Trainer would train "
                             "through DeepSpeed; accepted: the DeepSpeed config as "
                             "strata_config=, and TrainingArguments without deepspeed")
        if training_args is not None and training_args.fp16:
            raise ValueError("strata.hf: fp16 (TrainingArguments.fp16): Trainer's gradient "
                             "scaler would step the optimizer around the engine; accepted: "
                             "bf16=True, or fp32")
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self):
        """Trainer's accelerator, made to prepare the engine's module and optimizer
        (for_accelerate)."""
        super().create_accelerator_and_postprocess()
        for_accelerate(self.accelerator)

    def save_model(self, output_dir=None, _internal_call=False):
        """Trainer's save_model, its weights gathered on every rank (at stage 3 across ranks a
        collective each rank takes part in) and written by the process that saves; the others
        join the gathers and keep nothing (engine.state_dict_to_save)."""
        self._strata_state_dict = None
        engine = self.strata_engine
        if engine is not None and engine.ranks is not None:
            self._strata_state_dict = engine.state_dict_to_save(self.model,
                                                                keep=self.args.should_save)
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._strata_state_dict = None

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is None:
            state_dict = getattr(self, "_strata_state_dict", None)
        super()._save(output_dir, state_dict)

    def _move_model_to_device(self, model, device):
        """Not moved: the engine places the model when training starts (strata.initialize: at
        stage 3 its parameters go to their partitions, never whole on the GPU), as Trainer
        leaves DeepSpeed's to DeepSpeed. Trainer's move of the whole model to the GPU first is
        what offloading a model larger than the GPU must not do."""

    def create_optimizer(self, model=None):
        """The engine, made over the model and the optimizer Trainer makes from its arguments
        (or the config's optimizer block); self.optimizer becomes the engine's."""
        if self.strata_engine is not None:
            self.optimizer = self.strata_engine.optimizer
            return self.optimizer
        config = fill_auto(self.strata_config, self.args, self.model)
        config.pop("scheduler", None)  # made by create_scheduler, stepped by Trainer
        client = None
        if "optimizer" not in config:
            client = super().create_optimizer(model)
        engine, _, _, _ = strata.initialize(model=self.model, optimizer=client, config=config)
        self.strata_engine = engine
        self.optimizer = engine.optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        """The config's scheduler block (its "auto" steps filled) when it has one, else
        Trainer's from its arguments; either on the engine's optimizer, stepped by Trainer after
        each optimizer step, as DeepSpeed steps its own."""
        if self.lr_scheduler is None and "scheduler" in self.strata_config:
            filled = fill_auto(self.strata_config, self.args, self.model, num_training_steps)
            self.lr_scheduler = lr_schedules.make(filled["scheduler"], self.optimizer)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The training step of Trainer (or of the subclass: TRL's trainers have their own),
        through the engine: the window's end from Trainer's, its loss as it computes and
        normalizes it, its accelerator.backward the engine's (for_accelerate); a micro-batch
        that does not end the window ends here (the window's step is Trainer's
        optimizer.step())."""
        engine = self.strata_engine
        engine.set_gradient_accumulation_boundary(self.accelerator.gradient_state.sync_gradients)
        self.accelerator._strata_window = engine
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.accelerator._strata_window = None
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None,
                        **gen_kwargs):
        """Trainer's (or the subclass's) prediction step; Seq2SeqTrainer's generate, across
        ranks at stage 3, with synced_gpus on unless given (it passes its own default, which
        sees DeepSpeed's ZeRO-3 only): a rank whose sequences end first goes on running
        forwards, each one's gathers joined, until every rank's have."""
        engine = self.strata_engine
        if isinstance(self, transformers.Seq2SeqTrainer) and engine is not None and \
                engine.ranks is not None and engine.stage == 3:
            if not gen_kwargs and hasattr(self, "_gen_kwargs"):
                gen_kwargs = self._gen_kwargs.copy()  # (as Seq2SeqTrainer takes them)
            gen_kwargs = dict(gen_kwargs)
            gen_kwargs.setdefault("synced_gpus", True)
        return super().prediction_step(model, inputs, prediction_loss_only,
                                       ignore_keys=ignore_keys, **gen_kwargs)

    def _save_optimizer_and_scheduler(self, output_dir):
        """The engine's whole training state (its checkpoint, under output_dir/strata) and the
        schedule's."""
        # A peft model's frozen base is left out, as Trainer leaves it out of DeepSpeed's (a
        # resume builds the model, its base with it, first).
        peft = sys.modules.get("peft")
        self.strata_engine.save_checkpoint(
            output_dir, tag=ENGINE_TAG, save_latest=False,
            exclude_frozen_parameters=peft is not None and isinstance(self.model, peft.PeftModel))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        if not os.path.isdir(os.path.join(checkpoint, ENGINE_TAG)) and \
                not os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
            # Trainer's own checkpoints hold optimizer.pt unless saved with save_only_model.
            raise FileNotFoundError(
                f"strata.hf: {checkpoint} holds no strata checkpoint ({ENGINE_TAG}/) and no "
                "optimizer state: a checkpoint saved with save_only_model=True holds the "
                "weights alone (Trainer without strata would resume with a fresh optimizer and "
                "schedule); accepted: checkpoints saved with save_only_model=False, or the "
                "weights alone (from_pretrained) and a fresh optimizer, not resumed")
        if not os.path.isdir(os.path.join(checkpoint, ENGINE_TAG)):
            raise FileNotFoundError(
                f"strata.hf: {checkpoint} holds no strata checkpoint ({ENGINE_TAG}/): it was not "
                "saved by a Trainer training through strata; accepted: such a checkpoint, or "
                "the model's weights alone (from_pretrained) and a fresh optimizer")
        self.strata_engine.load_checkpoint(checkpoint, tag=ENGINE_TAG,
                                           load_lr_scheduler_states=False)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


def with_strata(trainer_class):
    """`trainer_class` (transformers.Trainer or a subclass: TRL's SFTTrainer...) trained through
    strata: a subclass taking strata_config=."""
    return type(f"Strata{trainer_class.__name__}", (StrataTrainerMixin, trainer_class), {
        "__doc__": f"{trainer_class.__name__} trained through strata (strata.hf)."})


class Trainer(StrataTrainerMixin, transformers.Trainer):
    """transformers.Trainer trained through strata (the module's docstring)."""
