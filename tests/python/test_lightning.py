"""strata.lightning.StrataStrategy: Lightning's Trainer on strata, against plain Lightning.

The same LightningModule, seed and batches train under strategy "auto" (plain Lightning) and
under StrataStrategy; the logged losses (what a Logger receives) and the final weights are held to
the bounds docs/lightning.md states. Then: checkpoints and resume, the collated fp32 file, evaluation,
configure_model under strata.init, two processes against one, each DeepSpeedStrategy argument
(acted on, or warned of by name), bad inputs, and the CUDA tier (skipped without a GPU).
"""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402

import strata  # noqa: E402
import strata.lightning as sl  # noqa: E402
from strata import placeholders  # noqa: E402
from strata.lightning import StrataStrategy  # noqa: E402

VOCAB, WIDTH, CONTEXT = 64, 32, 16
# Parameters of 100 elements or more are stage 3's partitions (the model's are 512-4096).
THRESHOLD = {"zero_optimization": {"stage3_param_persistence_threshold": 100}}


class Net(pl.LightningModule):
    """A minGPT-shaped LightningModule: token and position embeddings, pre-LayerNorm MLP blocks
    with residuals, a head; AdamW with weight decay."""

    def __init__(self, lr=3e-3, scheduler=None, optimizer="adamw"):
        super().__init__()
        self.save_hyperparameters()
        self.build()

    def build(self):
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(
            nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
            nn.Linear(2 * WIDTH, WIDTH)) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

    def loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        kind = {"adamw": torch.optim.AdamW, "cpu_adam": strata.optim.CpuAdam}
        optimizer = kind[self.hparams.optimizer](self.parameters(), lr=self.hparams.lr,
                                                 weight_decay=0.01)
        if self.hparams.scheduler == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        return optimizer


class LazyNet(Net):
    """The same model built in configure_model (as the seeds' minGPT: under strata.init at
    stage 3)."""

    def build(self):
        self.tokens = None

    def configure_model(self):
        if self.tokens is None:
            Net.build(self)


class Recorder(Logger):
    """The metrics Lightning logs, step by step."""

    def __init__(self):
        super().__init__()
        self.metrics = []

    name, version = "recorder", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def losses(self, key="train_loss"):
        return [m[key] for m in self.metrics if key in m]


def dataset(count=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (count, CONTEXT), generator=gen)
    return torch.utils.data.TensorDataset(x, torch.roll(x, 1, 1))


def loader(count=64, batch=8, seed=0):
    return torch.utils.data.DataLoader(dataset(count, seed), batch_size=batch)


def trainer(strategy, recorder=None, **kwargs):
    options = dict(accelerator="cpu", devices=1, max_epochs=2, logger=recorder or False,
                   log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def fit(strategy, model_class=Net, seed=0, model_kwargs=None, **kwargs):
    """(model, trainer, logged train losses) of one fit over 2 epochs of 8 batches (Lightning
    logs at each optimizer step)."""
    torch.manual_seed(seed)
    model = model_class(**(model_kwargs or {}))
    recorder = Recorder()
    t = trainer(strategy, recorder, **kwargs)
    t.fit(model, loader(), loader(16, seed=1))
    return model, t, recorder.losses()


_PLAIN = {}


class GradientNorms(pl.Callback):
    """Plain Lightning's global gradient norm before each optimizer step (before clipping)."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.float().norm() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.stack(grads).norm().item())


def plain(precision="32-true", **kwargs):
    """Plain Lightning's run (cached: several tests hold strata to it)."""
    key = (precision, tuple(sorted(kwargs.items())))
    if key not in _PLAIN:
        norms = GradientNorms()
        model, _, losses = fit("auto", precision=precision, callbacks=[norms], **kwargs)
        _PLAIN[key] = (losses, {k: v.detach().float().clone() for k, v in
                                model.state_dict().items()}, norms.norms)
    return _PLAIN[key]


@pytest.fixture(autouse=True)
def close_engines():
    """Every engine a test made is closed after it (its swap files go)."""
    yield
    for engine in list(sl._ENGINES):
        engine.close()


def strata_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, strata.StrataWarning)]


# --- against plain Lightning ----------------------------------------------------------------------

# docs/lightning.md's bounds: fp32 logged losses within 1e-5 of plain Lightning's (rounding of the summation
# order; measured 1e-6), final weights within 1e-5; bf16-mixed (strata: bf16 weights and fp32
# master weights; plain: fp32 weights under autocast) within 5e-3 (measured 3e-4); 16-mixed
# against plain fp32 within 5e-3 (measured 7e-5).
@pytest.mark.parametrize("stage, device, precision", [
    (2, "cpu", "32-true"),
    (2, "nvme", "32-true"),
    (3, "cpu", "32-true"),
    (3, "nvme", "32-true"),
    (2, "cpu", "bf16-mixed"),
    (3, "nvme", "bf16-mixed"),
])
def test_logged_losses_agree_with_plain_lightning(tmp_path, stage, device, precision):
    common = dict(precision=precision, accumulate_grad_batches=3, gradient_clip_val=0.5)
    expected, expected_weights, norms = plain(**common)
    strategy = StrataStrategy(stage=stage, offload_optimizer=True, offload_parameters=stage == 3,
                              offload_optimizer_device=device, offload_params_device=device,
                              nvme_path=str(tmp_path), config=THRESHOLD)
    model, t, losses = fit(strategy, **common)
    # 2 epochs of 8 batches, windows of 3: each epoch ends a window early (3, 3, 2), as plain
    # Lightning's does. The logger gets the loss of each optimizer step.
    assert t.global_step == 6 and t.strategy.engine.global_steps == 6
    assert len(losses) == len(expected) == 6
    tolerance = 1e-5 if precision == "32-true" else 5e-3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0,
                               atol=tolerance)
    weights = sl.module_state_dict(model)
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name].float(), value, rtol=0,
                                   atol=1e-5 if precision == "32-true" else 2e-2, msg=name)
    engine = t.strategy.engine
    # The last step's gradient: the mean over its window (Lightning divides each micro-batch's
    # loss by accumulate_grad_batches; the engine does not divide again).
    assert engine.get_global_grad_norm() == pytest.approx(
        norms[-1], rel=1e-4 if precision == "32-true" else 5e-2)
    assert engine.stage == stage and engine.dtype == (torch.float32 if precision == "32-true"
                                                      else torch.bfloat16)
    moved = engine.stats()["bytes_moved"]
    if stage == 3:  # parameters lent from their tier to the device tier around each module
        assert moved.get("host_to_device", 0) + moved.get("nvme_to_device", 0) > 0, moved
        assert all(not placeholders.holds_values(p) for p in model.blocks.parameters()
                   if p.dim() == 2)
    if device == "nvme":  # the optimizer's state went to NVMe and back, under nvme_path
        assert moved.get("host_to_nvme", 0) > 0 and moved.get("nvme_to_host", 0) > 0, moved
        assert os.listdir(tmp_path)


def test_fp16_on_the_cpu_agrees_with_plain_fp32():
    # Lightning would make "16-mixed" bf16 on the CPU; strata's engine trains in fp16 there.
    expected, _, _ = plain(accumulate_grad_batches=2)
    model, t, losses = fit(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD),
                           precision="16-mixed", accumulate_grad_batches=2)
    engine = t.strategy.engine
    assert engine.dtype == torch.float16 and engine.skipped_steps == 0
    assert engine.loss_scale == 2.0 ** 16  # initial_scale_power's default, no overflow
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=5e-3)


def test_fp16_dynamic_loss_scaling_skips_overflowing_steps():
    # 2^30 times the loss overflows fp16's gradients: the step is skipped and the scale halved
    # (hysteresis 1) until it fits, then training goes on (the loss-scale arguments act).
    model, t, losses = fit(StrataStrategy(initial_scale_power=30, hysteresis=1,
                                          loss_scale_window=1000, min_loss_scale=1),
                           precision="16-mixed", max_epochs=3)
    engine = t.strategy.engine
    assert 8 < engine.skipped_steps < engine.global_steps == 24
    assert engine.loss_scale == 2.0 ** (30 - engine.skipped_steps)
    # A skipped step changes nothing: epoch 2 starts on epoch 1's weights (the same batches give
    # the same losses); then it trains (epoch 3's losses fall below epoch 1's).
    assert losses[8:11] == losses[0:3]
    assert sum(losses[16:]) / 8 < sum(losses[:8]) / 8 - 0.05


def test_lr_scheduler_cpu_adam_and_manual_optimization_agree_with_plain_lightning():
    # strata.optim.CpuAdam (DeepSpeedCPUAdam's arguments, decoupled weight decay) from
    # configure_optimizers, with Lightning's scheduler config: plain Lightning steps the same
    # optimizer on the CPU.
    kwargs = {"scheduler": "step", "optimizer": "cpu_adam"}
    _, _, expected = fit("auto", model_kwargs=kwargs)
    model, t, losses = fit(StrataStrategy(stage=2), model_kwargs=kwargs)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-5)
    # StepLR(2, 0.5) stepped after each of 16 optimizer steps, by Lightning, on strata's optimizer
    assert t.strategy.engine.get_lr() == pytest.approx([3e-3 * 0.5 ** 8])

    class Manual(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = self.loss(batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            # Lightning's clipping in manual optimization (the engine's, by this value; it was
            # left out silently before an audit found it).
            self.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
            optimizer.step()
            self.log("train_loss", loss)

    _, _, expected = fit("auto", Manual)
    _, t, losses = fit(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD), Manual)
    assert t.strategy.engine.global_steps == 16
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-5)

    class HookClips(Net):  # a configure_gradient_clipping of one's own, no gradient_clip_val
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=1e-3,
                                gradient_clip_algorithm="norm")

    _, _, expected = fit("auto", HookClips)
    _, t, losses = fit(StrataStrategy(stage=2), HookClips)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"torch.nn.utils.clip_grad_value_ over a strata "
                                         r"engine's parameters where their gradients are not "
                                         r"torch's \.grad \(ZeRO stage 2"):
        t.strategy.precision_plugin.clip_gradients(t.strategy.engine.optimizer, 1.0, "value")
    # Clipping by value: Lightning's clip_gradients clips .grad before each step, plain
    # Lightning's where the gradients are torch's .grad (stage 1 in one process, accumulating
    # two batches a step; it was refused); at stage 2 refused by name before training starts.
    clip = {"gradient_clip_val": 1e-3, "gradient_clip_algorithm": "value",
            "accumulate_grad_batches": 2}
    _, _, expected = fit("auto", **clip)
    _, t, losses = fit(StrataStrategy(stage=1), **clip)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-5)
    _, _, unclipped = fit(StrataStrategy(stage=1), accumulate_grad_batches=2)
    assert max(abs(a - b) for a, b in zip(unclipped, expected)) > 1e-4  # (it clips)
    with pytest.raises(ValueError, match=r"gradient_clip_algorithm='value' where the gradients "
                                         r"are not torch's \.grad \(ZeRO stage 2 keeps them"):
        fit(StrataStrategy(stage=2), **clip)


def test_config_optimizer_and_scheduler_blocks_are_used():
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
              "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 32,
                  "warmup_type": "linear"}}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, t, losses = fit(StrataStrategy(config=config))
    assert any("configure_optimizers is not called" in m for m in strata_warnings(record))
    # WarmupLR stepped by Lightning after each of the 16 optimizer steps (DeepSpeed's formula:
    # made at iteration -1, its 16th step sets the rate of iteration 15 of 32).
    assert t.strategy.engine.get_lr() == pytest.approx([1e-3 * 15 / 32])
    assert t.strategy.engine.optimizer_kind == "adam"


# --- checkpoints -----------------------------------------------------------------------------------

def _resume_strategy(tmp_path, name):
    return StrataStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                          offload_optimizer_device="nvme", nvme_path=str(tmp_path / name),
                          config=THRESHOLD)


def test_checkpoint_folder_and_resume_bit_for_bit(tmp_path):
    common = dict(precision="bf16-mixed", accumulate_grad_batches=3)
    whole, _, whole_losses = fit(_resume_strategy(tmp_path, "a"), max_epochs=3, **common)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    _, first, _ = fit(_resume_strategy(tmp_path, "b"), max_epochs=2, callbacks=[checkpoints],
                      enable_checkpointing=True, **common)
    folder = tmp_path / "ckpt" / "epoch=1-step=6.ckpt"
    assert sorted(os.listdir(folder)) == ["checkpoint", "latest"]  # strata's folder
    assert os.path.isfile(folder / "checkpoint" / "optimizer_states.bin")
    # A model with other initial weights, resumed from the folder: epoch 3 is the whole run's.
    torch.manual_seed(7)
    resumed = Net()
    recorder = Recorder()
    t = trainer(_resume_strategy(tmp_path, "c"), recorder, max_epochs=3, **common)
    t.fit(resumed, loader(), loader(16, seed=1), ckpt_path=folder)
    assert t.global_step == 9 and t.current_epoch == 3
    assert len(whole_losses) == 9
    assert recorder.losses() == whole_losses[-3:]  # bit for bit
    mine, theirs = sl.module_state_dict(resumed), sl.module_state_dict(whole)
    for name, value in theirs.items():
        assert torch.equal(mine[name], value), name


class FrozenTokens(Net):
    """Net with its token embedding frozen (a frozen base's part)."""

    def build(self):
        super().build()
        self.tokens.requires_grad_(False)


def test_exclude_frozen_parameters_leaves_them_out_of_the_checkpoint(tmp_path):
    """StrataStrategy(exclude_frozen_parameters=True), as DeepSpeedStrategy's: the checkpoint
    leaves the frozen embedding out (meta.json names it), and a load keeps the model's own."""
    strategy = StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD,
                              exclude_frozen_parameters=True)
    model, t, _ = fit(strategy, FrozenTokens, max_epochs=1)
    t.save_checkpoint(tmp_path / "lean")
    meta = json.loads((tmp_path / "lean" / "checkpoint" / "meta.json").read_text())
    assert meta["frozen_excluded"] == ["tokens.weight"]
    torch.manual_seed(5)
    other = FrozenTokens()
    own = other.tokens.weight.detach().clone()
    t = trainer(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD),
                max_epochs=2)
    t.fit(other, loader(), loader(16, seed=1), ckpt_path=tmp_path / "lean")
    assert torch.equal(sl.module_state_dict(other)["tokens.weight"], own)


def test_collated_fp32_checkpoint_loads_in_lightning_and_in_the_strategy(tmp_path):
    model, t, _ = fit(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD),
                      model_kwargs={"lr": 2e-3})
    t.save_checkpoint(tmp_path / "run.ckpt")
    out = tmp_path / "collated.pt"
    checkpoint = sl.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "run.ckpt", out)
    assert "optimizer_states" not in checkpoint and checkpoint["global_step"] == 16
    reloaded = Net.load_from_checkpoint(out)  # Lightning's own loader, hyper-parameters too
    assert reloaded.hparams.lr == 2e-3
    weights = sl.module_state_dict(model)  # fp32 training: the master weights themselves
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, weights[name]), name
    expected = t.validate(model, loader(16, seed=1), verbose=False)[0]["val_loss"]
    # The one file's weights, taken by a new strategy for a new model (load_full_weights).
    torch.manual_seed(3)
    fresh = Net()
    evaluator = trainer(StrataStrategy(stage=3, offload_parameters=True, load_full_weights=True,
                                       config=THRESHOLD))
    got = evaluator.validate(fresh, loader(16, seed=1), ckpt_path=out, verbose=False)
    assert got[0]["val_loss"] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="load_full_weights=True"):
        trainer(StrataStrategy()).validate(Net(), loader(16, seed=1), ckpt_path=out)


def test_validate_test_predict_after_fit_and_from_a_checkpoint_folder(tmp_path):
    model, t, _ = fit(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD))
    # The weights stay in the engine after fit: evaluated by it, they give plain PyTorch's loss.
    held = sl.module_state_dict(model)
    torch.manual_seed(5)
    reference = Net()
    reference.load_state_dict(held)
    batches = list(loader(16, seed=1))
    batch = batches[0]
    with torch.no_grad():  # Lightning's val_loss: the mean over the two batches
        expected = sum(reference.loss(b).item() for b in batches) / len(batches)
    got = t.validate(model, loader(16, seed=1), verbose=False)[0]["val_loss"]
    assert got == pytest.approx(expected, abs=1e-5)
    t.save_checkpoint(tmp_path / "folder")
    # A new model and Trainer take the folder's weights for validate, test and predict.
    torch.manual_seed(9)
    fresh = Net()
    evaluator = trainer(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD))
    again = evaluator.validate(fresh, loader(16, seed=1), ckpt_path=tmp_path / "folder",
                               verbose=False)
    assert again[0]["val_loss"] == pytest.approx(expected, abs=1e-5)
    tested = evaluator.test(fresh, loader(16, seed=1), verbose=False)
    assert tested[0]["test_loss"] == pytest.approx(expected, abs=1e-5)
    assert evaluator.strategy.engine.stats()["bytes_moved"].get("host_to_device", 0) > 0
    predictions = evaluator.predict(fresh, loader(16, seed=1))
    with torch.no_grad():
        assert torch.equal(predictions[0], reference(batch[0]).argmax(-1))


def test_only_a_training_engine_takes_a_read_ahead_room(tmp_path):
    # The optimizer state on NVMe with clipping: a fit's engine takes the read-ahead room that
    # lets its clipped steps read their state during backward; an evaluation engine, whose
    # optimizer never steps, takes none.
    def strategy(where):
        return StrataStrategy(stage=3, offload_optimizer=True, offload_optimizer_device="nvme",
                              nvme_path=str(tmp_path / where), config=THRESHOLD)
    _, fitted, _ = fit(strategy("fit"), max_epochs=1, gradient_clip_val=1.0)
    assert fitted.strategy.engine.runtime.optimizer_read_ahead_bytes > 0
    torch.manual_seed(0)
    evaluator = trainer(strategy("eval"), gradient_clip_val=1.0)
    evaluator.validate(Net(), loader(16, seed=1), verbose=False)
    assert evaluator.strategy.engine.runtime.optimizer_read_ahead_bytes == 0


def test_release_gives_the_weights_back_and_a_second_fit_starts_afresh():
    model, t, _ = fit(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD),
                      max_epochs=1)
    first = t.strategy.engine
    held = sl.module_state_dict(model)
    with pytest.raises(TypeError, match="release"):
        __import__("copy").deepcopy(model)
    # A new fit: a new engine (and optimizer) from the weights the first left.
    t2 = trainer(StrataStrategy(stage=2), max_epochs=1)
    t2.fit(model, loader())
    with pytest.raises(RuntimeError, match="the engine is closed"):
        first.runtime
    assert t2.strategy.engine is not first
    sl.release(model)
    assert "_strata_engine" not in model.__dict__ and t2.strategy.engine is None
    assert all(p.numel() > 0 for p in model.parameters())
    with torch.no_grad():  # a plain module again
        model(torch.zeros(1, CONTEXT, dtype=torch.long))
    assert not torch.equal(model.head.weight, held["head.weight"])  # the second fit trained


def test_configure_model_builds_under_strata_init():
    expected, _, _ = plain(model_class=LazyNet)
    built = []

    class Probe(LazyNet):
        def configure_model(self):
            fresh = self.tokens is None
            super().configure_model()
            if fresh:  # inside configure_model, under strata.init: partitions as made
                built.append(strata.zero_init.built_under(self))

    model, t, losses = fit(StrataStrategy(stage=3, offload_parameters=True, config=THRESHOLD),
                           Probe)
    assert built and built[0] is not None
    assert t.strategy.engine.stats()["bytes_moved"].get("host_to_device", 0) > 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-5)
    # Lightning calls configure_model in every run: validate builds nothing new.
    t.validate(model, loader(16, seed=1), verbose=False)
    assert len(built) == 1


# --- ranks ---------------------------------------------------------------------------------------

RANKS = textwrap.dedent(r"""
    import json, os, sys, warnings
    import torch
    sys.path.insert(0, sys.argv[1])
    import test_lightning as T
    import strata.lightning as sl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from strata.lightning import StrataStrategy
    devices, out = int(sys.argv[2]), sys.argv[3]

    class Sharded(T.Net):
        # Rank r takes every devices-th sample: the ranks' batch k together is one process's.
        def train_dataloader(self):
            data = T.dataset()
            sampler = torch.utils.data.distributed.DistributedSampler(
                data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank,
                shuffle=False)
            return torch.utils.data.DataLoader(data, batch_size=8 // devices, sampler=sampler)

    torch.manual_seed(0)
    model = Sharded()
    recorder = T.Recorder()
    strategy = StrataStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                              allgather_bucket_size=3000, reduce_bucket_size=3000,
                              overlap_comm=False,
                              config={**T.THRESHOLD, "strata": {"comm_timeout_s": 120}})
    # The job of two saves a checkpoint at the end of each epoch (each rank its shards).
    saving = [ModelCheckpoint(dirpath=os.path.dirname(out), save_top_k=-1)] if devices > 1 \
        else []
    trainer = T.trainer(strategy, recorder, devices=devices, accumulate_grad_batches=2,
                        gradient_clip_val=0.5, callbacks=saving, enable_checkpointing=bool(saving))
    trainer.fit(model)
    engine = trainer.strategy.engine
    weights = sl.module_state_dict(model)  # every rank takes part
    if trainer.global_rank == 0:
        ranks = engine.ranks
        torch.save({"losses": recorder.losses(), "weights": weights,
                    "world": trainer.world_size, "steps": engine.global_steps,
                    "buckets": [ranks.reduce_bucket, ranks.allgather_bucket, ranks.overlap]
                    if ranks else None}, out)
""")


def _run_ranks(tmp_path, devices):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    out = tmp_path / f"out{devices}.pt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "NODE_RANK", "STRATA_STORE_PORT")}
    package = os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package] + [p for p in env.get("PYTHONPATH", "")
                                                     .split(os.pathsep) if p])
    child = subprocess.run([sys.executable, str(script), os.path.dirname(__file__), str(devices),
                            str(out)], env=env, capture_output=True, text=True, timeout=540,
                           cwd=tmp_path)
    assert child.returncode == 0, child.stderr[-4000:]
    return torch.load(out)


def test_two_processes_give_the_result_of_one(tmp_path):
    one = _run_ranks(tmp_path, 1)
    two = _run_ranks(tmp_path, 2)  # Lightning's launcher starts the second process
    assert (one["world"], two["world"]) == (1, 2)
    assert one["steps"] == two["steps"] == 8
    # The arguments for the collectives act across ranks.
    assert one["buckets"] is None and two["buckets"] == [3000, 3000, False]
    # The logged loss is the mean over the ranks (sync_dist), of the same global batch.
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]),
                               rtol=0, atol=1e-5)
    for name, value in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], value, rtol=1e-4, atol=2e-5, msg=name)
    # The checkpoint the two ranks wrote after epoch 1 resumes in one process: epoch 2 is the
    # one-process run's.
    folder = tmp_path / "epoch=0-step=4.ckpt"
    assert sorted(os.listdir(folder / "checkpoint")) == [
        "engine_states.pt", "meta.json", "optimizer_states.rank0.bin",
        "optimizer_states.rank1.bin"]
    torch.manual_seed(3)
    model = Net()
    recorder = Recorder()
    t = trainer(StrataStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                               config=THRESHOLD), recorder, accumulate_grad_batches=2,
                gradient_clip_val=0.5)
    t.fit(model, loader(), ckpt_path=folder)
    torch.testing.assert_close(torch.tensor(recorder.losses()), torch.tensor(one["losses"][4:]),
                               rtol=0, atol=1e-5)


# --- the arguments -------------------------------------------------------------------------------

def test_acted_arguments_reach_the_engine(tmp_path):
    strategy = StrataStrategy(
        stage=3, offload_optimizer=True, offload_parameters=True,
        offload_params_device="nvme", offload_optimizer_device="nvme", remote_device="nvme",
        nvme_path=str(tmp_path), params_buffer_count=4, params_buffer_size=1 << 16,
        max_in_cpu=10_000, sub_group_size=1000,
        optimizer_buffer_count=2, block_size=1 << 16, queue_depth=4, single_submit=True,
        overlap_events=False, thread_count=2, pin_memory=True, cpu_checkpointing=True,
        logging_batch_size_per_gpu=4, logging_level="INFO", config=THRESHOLD,
        timeout=__import__("datetime").timedelta(minutes=5))
    assert not strategy.warnings  # every one of these is acted on
    _, t, _ = fit(strategy, max_epochs=1)
    engine = t.strategy.engine
    given = engine.config.source  # the DeepSpeed config the engine was made with
    assert given["aio"] == {"block_size": 1 << 16, "queue_depth": 4, "single_submit": True,
                            "overlap_events": False, "intra_op_parallelism": 2}
    zero = given["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": str(tmp_path),
                                     "buffer_count": 4, "buffer_size": 1 << 16,
                                     "max_in_cpu": 10_000}
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(tmp_path),
                                         "buffer_count": 2}
    assert zero["sub_group_size"] == 1000  # the NVMe optimizer steps in pieces of it
    assert max(e.numel for e in engine.table.trained if e.partitioned) > 1000
    assert given["strata"]["comm_timeout_s"] == 300
    moved = engine.stats()["bytes_moved"]  # (NVMe to device directly, or through the host)
    assert moved.get("nvme_to_device", 0) + moved.get("nvme_to_host", 0) > 0, moved
    assert moved.get("host_to_nvme", 0) > 0, moved
    assert os.listdir(tmp_path)  # the NVMe store lives under nvme_path
    assert engine.train_micro_batch_size_per_gpu() == 4  # logging_batch_size_per_gpu
    assert strata.checkpointing._settings["cpu_checkpointing"]  # cpu_checkpointing
    assert strata.lightning.logger.level == 20  # logging_level
    strata.checkpointing.reset()
    strata.lightning.logger.setLevel("NOTSET")


def test_lightning_arguments_and_the_config_take_effect(tmp_path):
    from lightning.pytorch.plugins.environments import LightningEnvironment
    environment = LightningEnvironment()
    t = trainer(StrataStrategy(parallel_devices=[torch.device("cpu")] * 2,
                               cluster_environment=environment, process_group_backend="gloo"))
    assert t.num_devices == 2 and t.world_size == 2
    assert t.strategy.cluster_environment is environment
    assert t.strategy.process_group_backend == "gloo"
    # precision_plugin: strata's precision given to the strategy instead of Trainer(precision=)
    _, t, _ = fit(StrataStrategy(precision_plugin=sl.StrataPrecision("bf16-mixed")),
                  max_epochs=1)
    assert t.strategy.engine.dtype == torch.bfloat16
    # zero_optimization=False: stage 0
    _, t, _ = fit(StrataStrategy(zero_optimization=False), max_epochs=1)
    assert t.strategy.engine.stage == 0
    # A static loss scale and the dynamic scale's arguments reach the engine.
    _, t, _ = fit(StrataStrategy(loss_scale=128), precision="16-mixed", max_epochs=1)
    assert t.strategy.engine.loss_scale == 128.0 and t.strategy.engine.config.loss_scale == 128
    _, t, _ = fit(StrataStrategy(loss_scale_window=7, hysteresis=3, min_loss_scale=4),
                  precision="16-mixed", max_epochs=1)
    config = t.strategy.engine.config
    assert (config.loss_scale_window, config.hysteresis, config.min_loss_scale) == (7, 3, 4.0)
    # config as a JSON path, with strata's own block: its budgets are the Runtime's.
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},'
                    ' "stage3_param_persistence_threshold": 100},'
                    ' "strata": {"device_budget_bytes": 1048576, "host_budget_bytes": 67108864}}')
    _, t, _ = fit(StrataStrategy(config=str(path)), max_epochs=1)
    engine = t.strategy.engine
    assert engine.stage == 3
    assert engine.stats()["budget_bytes"] == {"device": 1 << 20, "host": 64 << 20, "nvme": 0}


def test_training_step_returning_none_is_refused_at_an_optimizer_step():
    class Skips(Net):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == 1 else super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="training_step returned None"):
        trainer(StrataStrategy()).fit(Skips(), loader())


def test_a_model_without_trainable_parameters_is_refused_by_evaluation():
    model = Net()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        trainer(StrataStrategy()).validate(model, loader(16, seed=1))


def test_auto_batch_size_and_the_trainer_owned_keys():
    _, t, _ = fit(StrataStrategy(config={"train_batch_size": "auto",
                                         "gradient_clipping": "auto"}),
                  accumulate_grad_batches=2, gradient_clip_val=0.25, max_epochs=1)
    config = t.strategy.engine.config
    assert config.micro_batch == 8 and config.accumulation == 2 and config.clipping == 0.25
    assert config.source["train_batch_size"] == 16


@pytest.mark.parametrize("arguments, named", [
    ({"max_in_cpu": 10}, "max_in_cpu"),  # without parameters on NVMe
    ({"contiguous_gradients": False}, "contiguous_gradients"),
    ({"allgather_partitions": False}, "allgather_partitions"),
    ({"reduce_scatter": False}, "reduce_scatter"),
    ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer"),
    ({"partition_activations": True}, "partition_activations"),
    ({"contiguous_memory_optimization": True}, "contiguous_memory_optimization"),
    ({"synchronize_checkpoint_boundary": True}, "synchronize_checkpoint_boundary"),
    ({"offload_optimizer": False}, "offload_optimizer"),
    ({"pin_memory": False}, "pin_memory"),
    ({"stage": 2, "offload_parameters": True}, "offload_parameters"),
    ({"stage": 3, "offload_params_device": "nvme"}, "offload_params_device"),
    ({"stage": 3, "offload_parameters": True, "remote_device": "nvme"}, "remote_device"),
    ({"nvme_path": "/nowhere"}, "nvme_path"),
])
def test_arguments_strata_does_not_act_on_are_warned_by_name(arguments, named):
    with pytest.warns(strata.StrataWarning, match=rf"StrataStrategy\({named}="):
        strategy = StrataStrategy(**arguments)
    assert any(m.startswith(f"StrataStrategy({named}=") for m in strategy.warnings)


def test_arguments_without_effect_in_this_run_are_warned_by_name():
    strategy = StrataStrategy(loss_scale=128, hysteresis=3, reduce_bucket_size=5e8,
                              allgather_bucket_size=1000, overlap_comm=True)
    with pytest.warns(strata.StrataWarning) as record:
        fit(strategy, precision="bf16-mixed", max_epochs=1)
    said = " ".join(strata_warnings(record))
    for name in ("loss_scale", "hysteresis"):  # loss scaling is fp16's
        assert f"StrataStrategy({name}=" in said and "'16-mixed'" in said
    for name in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
        assert f"StrataStrategy({name}=" in said and "across ranks" in said


def test_defaults_warn_of_nothing_but_the_emulated_device():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(StrataStrategy(), max_epochs=1)
    said = strata_warnings(record)
    assert said and all("emulated" in m for m in said), said


@pytest.mark.parametrize("arguments, message", [
    ({"stage": 4}, "stage=4 is not accepted; accepted: from 0 to 3"),
    ({"stage": "3"}, "stage='3' is not accepted; accepted: an integer from 0 to 3"),
    ({"offload_params_device": "gpu"}, "offload_params_device='gpu' .* 'cpu' or 'nvme'"),
    ({"offload_optimizer": "yes"}, "offload_optimizer='yes' .* True or False"),
    ({"remote_device": "disk"}, "remote_device='disk'"),
    ({"block_size": 1000}, "block_size=1000 .* a power of two from 4096"),
    ({"queue_depth": 0}, "queue_depth=0"),
    ({"thread_count": 1.5}, "thread_count=1.5"),
    ({"params_buffer_size": 100}, "params_buffer_size=100 .* from 4096 to 268435456"),
    ({"reduce_bucket_size": -1}, "reduce_bucket_size=-1"),
    ({"logging_batch_size_per_gpu": 0}, "logging_batch_size_per_gpu=0"),
    ({"logging_level": "LOUD"}, "logging_level='LOUD'"),
    ({"min_loss_scale": 0}, "min_loss_scale=0 .* > 0"),
    ({"timeout": 5}, "timeout=5 .*timedelta"),
    ({"nvme_path": 3}, "nvme_path=3"),
    ({"config": [1]}, r"config=\[1\] .* a dict, or the path of a JSON file"),
    ({"config": "/no/such/config.json"}, "no such file"),
    ({"stage": 3, "config": {"zero_optimization": {"stage": 2}}},
     r"stage=3 and the config's zero_optimization.stage \(2\) disagree"),
    ({"zero_optimization": False, "stage": 3}, "zero_optimization=False with stage=3"),
    ({"precision_plugin": "64-true"}, "precision='64-true' is not supported"),
])
def test_bad_arguments_are_refused_naming_them(arguments, message):
    with pytest.raises(ValueError, match=message):
        StrataStrategy(**arguments)


def test_arguments_given_apply_over_the_config_and_defaults_leave_it():
    config = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"},
                                    "reduce_bucket_size": 1000},
              "strata": {"host_budget_bytes": 1 << 26}}
    strategy = StrataStrategy(stage=3, offload_parameters=True, queue_depth=16, config=config)
    zero = strategy.config["zero_optimization"]
    # Given: stage, offload_parameters, queue_depth; left at their defaults: the devices and
    # nvme_path, which the config says (DeepSpeedStrategy's defaults would be 'cpu' and
    # /local_nvme).
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "nvme", "nvme_path": "/x"}
    assert zero["reduce_bucket_size"] == 1000 and strategy.config["aio"] == {"queue_depth": 16}
    assert strategy.config["strata"] == {"host_budget_bytes": 1 << 26}
    assert config["zero_optimization"] == {"offload_param": {"device": "nvme", "nvme_path": "/x"},
                                           "reduce_bucket_size": 1000}  # the user's, untouched
    # Without a config, DeepSpeedStrategy's default stage (2).
    assert StrataStrategy().config["zero_optimization"]["stage"] == 2
    assert "stage" not in StrataStrategy(config={}).config.get("zero_optimization", {})


def test_unknown_argument_is_refused_listing_the_accepted_ones():
    with pytest.raises(TypeError, match="offload_param.*accepted: DeepSpeedStrategy's arguments"):
        StrataStrategy(offload_param=True)


@pytest.mark.parametrize("strategy, trainer_kwargs, message", [
    (lambda: StrataStrategy(config={"gradient_accumulation_steps": 4}),
     {"accumulate_grad_batches": 2}, "gradient_accumulation_steps is 4 and Trainer"),
    (lambda: StrataStrategy(config={"bf16": {"enabled": True}}), {},
     "bf16.enabled is True and the Trainer's precision is '32-true'"),
    (lambda: StrataStrategy(config={"gradient_clipping": 2.0}), {"gradient_clip_val": 1.0},
     "gradient_clipping is 2.0 and Trainer"),
    (lambda: StrataStrategy(), {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
     "gradient_clip_algorithm='value' where the gradients are not torch's .grad"),
    (lambda: StrataStrategy(), {"precision": "64-true"}, "precision='64-true' is not supported"),
    (lambda: StrataStrategy(precision_plugin=sl.StrataPrecision("bf16-mixed")),
     {"precision": "16-mixed"}, "precision_plugin is 'bf16-mixed' and Trainer"),
    (lambda: StrataStrategy(config={"strata": {"device": "cuda"}}), {},
     "strata.device is 'cuda' and the Trainer runs on cpu"),
    (lambda: StrataStrategy(config={"zero_optimisation": {"stage": 2}}), {},
     "zero_optimisation.*did you mean zero_optimization"),
])
def test_config_and_trainer_conflicts_are_refused(strategy, trainer_kwargs, message):
    with pytest.raises(ValueError, match=message):
        trainer(strategy(), **trainer_kwargs).fit(Net(), loader())


def test_gradient_accumulation_scheduler_is_refused():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    with pytest.raises(RuntimeError, match="accumulate_grad_batches between epochs"):
        trainer(StrataStrategy(), callbacks=[GradientAccumulationScheduler({1: 2})]).fit(
            Net(), loader())


def test_optimizer_strata_cannot_step_is_refused():
    class Sgd(Net):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="optimizer SGD is not supported; accepted: Adam"):
        trainer(StrataStrategy()).fit(Sgd(), loader())


@pytest.mark.parametrize("name, stage, param_device, optimizer_device", [
    ("strata", 2, None, "cpu"),
    ("strata_stage_1", 1, None, "cpu"),
    ("strata_stage_2_offload", 2, None, "cpu"),
    ("strata_stage_3", 3, None, "cpu"),
    ("strata_stage_3_offload", 3, "cpu", "cpu"),
    ("strata_stage_3_offload_nvme", 3, "nvme", "nvme"),
])
def test_registered_names(name, stage, param_device, optimizer_device):
    t = trainer(name)
    strategy = t.strategy
    assert isinstance(strategy, StrataStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("offload_param", {}).get("device") == param_device
    assert zero["offload_optimizer"]["device"] == optimizer_device
    if optimizer_device == "nvme":  # DeepSpeedStrategy's default folder
        assert zero["offload_optimizer"]["nvme_path"] == "/local_nvme"


def test_pytorch_lightning_package_gets_its_own_classes():
    ptl = pytest.importorskip("pytorch_lightning")
    classes = sl.for_package("pytorch_lightning")

    class Tiny(ptl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)),
                                       batch_size=4)
    for strategy in (classes.StrataStrategy(stage=3, offload_parameters=True,
                                            config={"zero_optimization": {
                                                "stage3_param_persistence_threshold": 10}}),
                     "strata_stage_3_offload"):
        model = Tiny()
        t = ptl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
        t.fit(model, data)
        assert isinstance(t.strategy, classes.StrataStrategy)
        assert t.strategy.engine.global_steps == 4


# --- the CUDA tier -------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device (torch.cuda.is_available() is False): "
                           "accelerator='gpu' runs strata's CUDA tier on a GPU machine")
def test_gpu_accelerator_uses_the_cuda_tier_and_agrees_with_plain_lightning():
    common = dict(accelerator="gpu", precision="bf16-mixed", accumulate_grad_batches=2)
    _, _, expected = fit("auto", **common)
    model, t, losses = fit(StrataStrategy(stage=3, offload_optimizer=True,
                                          offload_parameters=True, config=THRESHOLD), **common)
    engine = t.strategy.engine
    assert engine.device_kind == "cuda" and engine.device.type == "cuda"
    assert model.device.type == "cuda"
    assert engine.stats()["bytes_moved"].get("host_to_device", 0) > 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=5e-3)


def test_a_hook_before_the_optimizer_step_is_told_the_gradients_are_the_engines():
    """on_before_optimizer_step of one's own (a callback reading .grad, as Lightning's grad_norm
    does) sees None where the engine holds the gradients (stage 2): said once, naming the hook
    and what to use instead (the audit's: grad norms silently never logged, an edit of .grad
    silently not taken). No hook of one's own: nothing said."""
    class ReadsGradients(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.seen = [p.grad for p in pl_module.parameters() if p.grad is not None]

    for callbacks, told in (([ReadsGradients()], True), ([], False)):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fit(StrataStrategy(stage=2), callbacks=callbacks, max_epochs=1)
        said = [w for w in strata_warnings(record) if "on_before_optimizer_step" in w]
        assert len(said) == told, said
        if told:
            assert "(ReadsGradients) runs while the engine holds" in said[0], said
            assert callbacks[0].seen == []  # (what it saw: no .grad)
            assert "clip_grad_norm_(self.parameters(), float('inf'))" in said[0], said


def test_checkpoints_saved_inside_an_accumulation_window_keep_the_run_going(tmp_path):
    """A monitored ModelCheckpoint whose validation falls inside an accumulation window
    (val_check_interval not a multiple of it), and OnExceptionCheckpoint when the run fails
    mid-window: both save, as under plain Lightning, with a warning that the window's gradients
    are not kept; the user's exception is the one raised (from the audit: both failed with the
    engine's refusal to save mid-window)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    folder = tmp_path / "monitored"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t = trainer(StrataStrategy(), max_epochs=1, accumulate_grad_batches=3,
                    val_check_interval=4, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=1)])
        torch.manual_seed(0)
        t.fit(Net(), loader(), loader(16, seed=1))
    assert os.listdir(folder), "no checkpoint was saved"
    assert any("inside a gradient-accumulation window" in w for w in strata_warnings(record))

    # Resumed from the checkpoint of the first validation (after micro-batch 1 of the second
    # window), the window ends with the micro-batches that follow, as plain Lightning's resumed
    # from its own checkpoint of that batch does (the audit's: the engine refused the zero_grad
    # Lightning makes as it resumes, for a window it held no gradients of).
    resumed = {}
    for name, strategy in (("plain", lambda: "auto"), ("strata", StrataStrategy)):
        folder = tmp_path / f"every_{name}"
        t = trainer(strategy(), max_epochs=1, accumulate_grad_batches=3, val_check_interval=4,
                    enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=-1, filename="{step}")])
        torch.manual_seed(0)
        t.fit(Net(), loader(), loader(16, seed=1))
        recorder = Recorder()
        t = trainer(strategy(), recorder, max_epochs=1, accumulate_grad_batches=3,
                    val_check_interval=4)
        torch.manual_seed(0)
        t.fit(Net(), loader(), loader(16, seed=1), ckpt_path=folder / "step=1.ckpt")
        resumed[name] = recorder.losses()
    assert len(resumed["plain"]) == 2, resumed  # (the second window's step and the third's)
    assert resumed["strata"] == pytest.approx(resumed["plain"], rel=1e-5)

    class Boom(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            if index == 3:  # the second micro-batch of the second window
                raise RuntimeError("boom")

    folder = tmp_path / "on_exception"
    t = trainer(StrataStrategy(), max_epochs=1, accumulate_grad_batches=3,
                enable_checkpointing=True, callbacks=[Boom(), OnExceptionCheckpoint(dirpath=folder)])
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(Net(), loader())
    assert "on_exception.ckpt" in os.listdir(folder)


def test_a_one_process_run_leaves_no_launch_variables_behind(tmp_path):
    """After a fit in one process the variables Lightning set (MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK, NODE_RANK) are as they were, so a later strata.initialize in the same process is
    not taken for a launched job's (found running test files in one process)."""
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")
    before = {k: os.environ.get(k) for k in names}
    torch.manual_seed(0)
    t = trainer(StrataStrategy(), max_epochs=1)
    t.fit(Net(), loader())
    assert {k: os.environ.get(k) for k in names} == before
    model = nn.Linear(4, 4)
    engine, _, _, _ = strata.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    engine.close()
