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
  the engine's clipping by the global norm ("value" clipping: Lightning's, of .grad, at stages 0-1
  in one process, refused elsewhere); self.clip_gradients
  (manual optimization, a configure_gradient_clipping of one's own) clips through the engine.
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
  over strata's own collectives (shared memory between ranks on one host: strata/ranks.py),
  Lightning's own collectives over torch.distributed's Gloo. ``accelerator="gpu"``: strata's CUDA
  device tier (strata.device "cuda"), each rank on the GPU Lightning gives it
  (strata.device_index), the gradients and weights on NCCL (docs/ranks.md).

After a run the module's weights stay in its engine (the engine is kept with the module, as
DeepSpeed's ZeRO-3 keeps parameters partitioned): the module still runs (stage 3 lends its
parameters around each module, as in training), later validate/test/predict calls, in this Trainer
or another, use them, and a later fit starts a new engine (and optimizer) from them.
``module_state_dict(model)`` gives the weights whole; ``release(model)`` puts them back into the
module as plain tensors and closes its engine.

Not acted on (warned when given): pin_memory=False,
contiguous_gradients, allgather_partitions, reduce_scatter, zero_allow_untested_optimizer,
partition_activations, contiguous_memory_optimization, synchronize_checkpoint_boundary,
offload_optimizer=False (strata always steps on the CPU), a
remote_device other than the parameters' tier, max_in_cpu without parameters on NVMe, the
loss-scale arguments outside "16-mixed", and the bucket and overlap_comm arguments in one process
(they act across ranks).

Both packages are served: ``StrataStrategy`` and ``StrataPrecision`` here are built on
``lightning.pytorch`` (on ``pytorch_lightning`` where only that is installed);
``for_package("pytorch_lightning")`` gives the classes for the other (the registered names are
added to its registry too).

Messages: StrataWarning through ``warnings`` (on rank 0), the rest through the "strata" logger.
Thread safety: a strategy is driven by its Trainer's thread, as Lightning's.

The package: ``arguments`` (DeepSpeedStrategy's arguments and the config they build), ``launch``
(the launch environment), ``checkpoints`` (Lightning's checkpoint inside strata's, and collation),
``engines`` (the engines kept with their modules), ``precision`` (the precision plugin),
``strategy`` (the strategy) and ``packages`` (the classes for one Lightning package: plain
classes on each package's own base classes, made once per package by ``for_package``).
"""

import logging
import sys

from strata.lightning.checkpoints import convert_zero_checkpoint_to_fp32_state_dict
from strata.lightning.engines import _ENGINES, module_state_dict, release  # noqa: F401
from strata.lightning.packages import _primary, for_package

__all__ = ["StrataStrategy", "StrataPrecision", "convert_zero_checkpoint_to_fp32_state_dict",
           "module_state_dict", "release", "for_package"]

logger = logging.getLogger("strata")

_classes = _primary()
StrataStrategy = _classes.StrataStrategy
StrataPrecision = _classes.StrataPrecision
if "pytorch_lightning" in sys.modules and _classes.flavor.package != "pytorch_lightning":
    for_package("pytorch_lightning")  # a script that imported it first gets the names there too
