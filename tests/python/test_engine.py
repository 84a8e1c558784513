"""strata.initialize's engine against plain PyTorch, step for step.

The device tier is the host-emulated one (no GPU here): its budget is set below the model's
parameters and gradients, so stage 3 must move partitions through it. The reference is plain
torch: torch.optim.AdamW with clip_grad_norm_, on an fp32 model; for bf16, the same mixed-precision
recipe written out by hand (a bf16 model computes, fp32 master weights step, the bf16 copy is the
rounded master)."""
import copy
import gc
import json
import subprocess
import sys
import textwrap
import time
import warnings

import re

import pytest
import torch

import strata
from strata import placeholders
from references import MixedPrecisionAdamW

VOCAB, WIDTH = 50, 32


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.l1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.ln = torch.nn.LayerNorm(2 * WIDTH)
        self.l2 = torch.nn.Linear(2 * WIDTH, VOCAB)

    def forward(self, x):
        return self.l2(self.ln(torch.relu(self.l1(self.emb(x)))))


def batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (4, 8), generator=gen)
        yield x, torch.roll(x, 1, 1)


def loss_of(logits, y):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def make_config(tmp_path, stage, offload, dtype, accumulation=2, clipping=1.0):
    nvme = str(tmp_path / "nvme")
    zero = {"stage": stage, "offload_optimizer": {"device": offload, "nvme_path": nvme},
            "stage3_param_persistence_threshold": 100}
    if stage == 3:
        zero["offload_param"] = {"device": offload, "nvme_path": nvme, "buffer_count": 2,
                                 "buffer_size": 65536}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": clipping,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": zero,
              # The partitioned parameters take 32 KiB of device pages in fp32, and their
              # gradients as many: the device budget holds three quarters of them.
              "strata": {"device": "emulated", "device_budget_bytes": 49152,
                         "host_budget_bytes": 64 << 20, "nvme_capacity_bytes": 64 << 20}}
    if offload == "nvme" and stage != 3:
        zero["offload_param"] = {"buffer_count": 2, "buffer_size": 65536}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train(engine, data):
    """One step of `engine` per (x, y) in `data`; their losses."""
    losses = []
    for x, y in data:
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def rates_over(engine, steps):
    """The engine's learning rate before each of `steps` steps (a micro-batch each); trains."""
    rates = []
    for x, y in batches(steps):
        rates.append(engine.get_lr()[0])
        engine.backward(loss_of(engine(x), y))
        engine.step()
    return rates


def faulty_runtimes(monkeypatch, error, skip=0):
    """From now on the engines' Runtimes are made with writes failing with `error` once their
    faults are armed (arm_faults), after `skip` writes; the list of those made."""
    from strata import _strata
    made = []
    real_runtime = _strata.Runtime

    def faulty_runtime(*args, **kwargs):
        rt = real_runtime(*args, inject_write_error=error, inject_write_skip=skip, **kwargs)
        made.append(rt)
        return rt

    monkeypatch.setattr(strata.engine._strata, "Runtime", faulty_runtime)
    return made


class Reference(MixedPrecisionAdamW):
    """Plain torch: AdamW over fp32 master weights, with the model computing in `dtype`."""

    def __init__(self, model, dtype, clipping):
        super().__init__(model, dtype, clipping)

    def micro_step(self, x, y, accumulation):
        loss = loss_of(self.model(x), y)
        self.backward(loss, accumulation)
        return loss


def train_both(tmp_path, stage, offload, dtype, steps=12, accumulation=2, clipping=1.0):
    torch.manual_seed(0)
    model = Net()
    reference = Reference(copy.deepcopy(model), torch.bfloat16 if dtype == "bf16" else
                          torch.float32, clipping)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, stage, offload, dtype, accumulation, clipping))
    losses = []
    for i, (x, y) in enumerate(batches(steps)):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_loss = reference.micro_step(x, y, accumulation)
        if (i + 1) % accumulation == 0:
            reference.step()
        losses.append((loss.item(), ref_loss.item()))
    return engine, reference, losses


def step_both(engine, reference, torch_optimizer, x, y, schedule=None):
    """One step of the engine and of plain torch on the same batch; their losses must agree."""
    loss = loss_of(engine(x), y)
    engine.backward(loss)
    engine.step()
    ref_loss = loss_of(reference(x), y)
    ref_loss.backward()
    torch_optimizer.step()
    torch_optimizer.zero_grad()
    if schedule is not None:
        schedule.step()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)


def engine_weights(engine):
    """The engine's current weights in the training dtype (stage 3: read from the partitions)."""
    out = []
    for e in engine.table.trained:
        if e.partitioned:
            t = torch.utils.dlpack.from_dlpack(engine.runtime.acquire(e.pid, "host")).clone()
            engine.runtime.release(e.pid, "host", False)
            out.append(t.view(e.shape))
        else:
            out.append(e.param.detach().clone())
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_matches_plain_torch(tmp_path, stage, offload, dtype):
    engine, reference, losses = train_both(tmp_path, stage, offload, dtype)
    # fp32: the same arithmetic but for fused multiply-adds in the optimizer; bf16: the same
    # recipe, where one bf16 rounding of a weight that lands differently moves later losses by
    # about 2^-8 relative.
    tolerance = 1e-5 if dtype == "fp32" else 2e-2
    for ours, theirs in losses:
        assert ours == pytest.approx(theirs, rel=tolerance, abs=tolerance)
    for ours, theirs in zip(engine_weights(engine), reference.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(),
                                   rtol=tolerance, atol=tolerance if dtype == "fp32" else 2e-2)
    # The model learned something, and the weights moved from where they started.
    assert losses[-1][0] < losses[0][0] + 0.5
    assert engine.global_steps == 6
    assert engine.last_step_stats["device"] == "emulated"
    # step()'s time, and what of it waited for the device and for the optimizer's commit.
    stats = engine.last_step_stats
    assert 0 <= stats["device_wait_seconds"] <= stats["step_seconds"]
    assert 0 <= stats["optimizer"]["seconds"] <= stats["step_seconds"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_trained_parameter_of_no_elements_is_left_to_torch_as_adamw_leaves_it(tmp_path, stage):
    """A parameter of no elements (requires_grad, in the optimizer handed over, used in forward)
    has nothing to step: the engine leaves it out of its partitions (it was refused with "partition
    N has 0 elements", naming no parameter) and trains the rest as torch's AdamW does."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)
            self.empty = torch.nn.Parameter(torch.zeros(0))

        def forward(self, x):
            return self.l(x) + self.empty.sum()

    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    data = [torch.randn(4, 8) for _ in range(3)]
    torch_adamw = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x in data:
        torch_adamw.zero_grad()
        plain(x).pow(2).sum().backward()
        torch_adamw.step()
    config = make_config(tmp_path, stage, "cpu", "fp32", accumulation=1, clipping=0.0)
    del config["optimizer"]
    engine, _, _, _ = strata.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    for x in data:
        engine.backward(engine(x).pow(2).sum())
        engine.step()
    ours = engine.module_state_dict()
    assert ours.keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # Not taken for a frozen one: a checkpoint leaving those out keeps it, and its fp32 state
    # dict loads strictly (it was left out, named "not trained" in a warning).
    engine.save_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
    engine.load_checkpoint(tmp_path / "ckpt")
    from strata import zero_to_fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero_to_fp32.consolidate(tmp_path / "ckpt", tmp_path / "fp32.pt")
    Net().load_state_dict(torch.load(tmp_path / "fp32.pt"))


def test_stage3_moves_partitions_through_a_device_budget_smaller_than_the_model(tmp_path):
    engine, _, _ = train_both(tmp_path, 3, "cpu", "fp32")
    stats = engine.stats()
    # Parameters came to the device more than once per step: the budget cannot hold them all.
    assert stats["bytes_moved"]["host_to_device"] > 6 * 28000
    assert stats["host_held_bytes"] <= 64 << 20
    assert engine.last_step_stats["runtime"]["mode"] == "planned"


def test_config_from_a_json_file_and_train_batch_size(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    del config["train_micro_batch_size_per_gpu"]
    config["train_batch_size"] = 8
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    engine, optimizer, loader, scheduler = strata.initialize(model=Net(), config=str(path))
    assert engine.micro_batch_size == 4 and engine.gradient_accumulation_steps() == 2
    assert loader is None and scheduler is None
    assert optimizer.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("low,high,seen", [
    # DeepSpeed's: made at iteration -1, stepped after each optimizer step.
    (0.0, 0.01, [0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01]),
    # DeepSpeed 0.19.8's WarmupLR gives warmup_min_lr before its first step, not 0.
    (0.001, 0.005, [0.001, 0.001, 0.002, 0.003, 0.004, 0.005]),
    # Without warmup_max_lr, up to the optimizer's lr (1e-2 here), as DeepSpeed's since 0.17.
    (0.0, None, [0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01])])
def test_a_warmup_schedule_from_the_config_drives_the_rate(tmp_path, low, high, seen):
    config = make_config(tmp_path, 2, "cpu", "fp32", accumulation=1)
    config["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": low, "warmup_max_lr": high, "warmup_num_steps": 4,
        "warmup_type": "linear"}}
    if high is None:
        del config["scheduler"]["params"]["warmup_max_lr"]
    engine, optimizer, _, scheduler = strata.initialize(model=Net(), config=config)
    rates = rates_over(engine, 6)
    assert rates == pytest.approx(seen)
    assert isinstance(scheduler, strata.lr_schedules.WarmupLR)


ONE_CYCLE = {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3,
             "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5,
             "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}


@pytest.mark.parametrize("stairs,seen", [
    # DeepSpeed's OneCycle: the minimum rate and momentum before its first step, up over 3
    # iterations and down over 2, then the decay (lr / (1 + 0.5 k/2), momentum x (1 + 0.01 k/2)).
    (0, [(1e-3, 0.85), (4e-3, 0.95 - 0.1 / 3), (7e-3, 0.95 - 0.2 / 3), (1e-2, 0.85),
         (5.5e-3, 0.9), (1e-3, 0.95), (8e-4, 0.95 * 1.005), (1e-3 / 1.5, 0.95 * 1.01)]),
    # 2 stairs a half cycle: flat between them.
    (2, [(1e-3, 0.85), (1e-3, 0.95), (5.5e-3, 0.9), (1e-2, 0.85), (5.5e-3, 0.9), (1e-3, 0.95),
         (8e-4, 0.95 * 1.005), (1e-3 / 1.5, 0.95 * 1.01)])])
def test_one_cycle_from_the_config_cycles_rate_and_momentum_as_deepspeed_s(tmp_path, stairs,
                                                                           seen):
    """DeepSpeed's OneCycle scheduler (it was refused: the engine's optimizer kept its betas):
    each step's rate and betas as DeepSpeed's gives them (its beta2 0.99 too), and the weights
    plain torch's AdamW's under the same schedule, at stage 3 with the state on NVMe (steps
    staged during backward take the betas of their step)."""
    params = dict(ONE_CYCLE, cycle_first_stair_count=stairs)
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1, clipping=0.0)
    config["scheduler"] = {"type": "OneCycle", "params": params}
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    engine, optimizer, _, scheduler = strata.initialize(model=model, config=config)
    assert isinstance(scheduler, strata.lr_schedules.OneCycle)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    theirs = strata.lr_schedules.OneCycle(torch_adamw, **params)
    rates = []
    for x, y in batches(len(seen)):
        beta1, beta2 = optimizer.param_groups[0]["betas"]
        assert beta2 == 0.99
        rates.append((engine.get_lr()[0], beta1))
        step_both(engine, reference, torch_adamw, x, y, schedule=theirs)
    flat = [v for pair in seen for v in pair]
    assert [v for pair in rates for v in pair] == pytest.approx(flat)
    for ours, plain in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours, plain.detach(), rtol=1e-5, atol=1e-6)
    try:  # DeepSpeed's own, where it is installed (the benchmarks' environment)
        from deepspeed.runtime.lr_schedules import OneCycle as DeepSpeeds
    except ImportError:
        return
    adamw = torch.optim.AdamW(Net().parameters(), lr=1e-2)
    theirs = DeepSpeeds(adamw, **params)
    given = []
    for _ in seen:
        given += [adamw.param_groups[0]["lr"], adamw.param_groups[0]["betas"][0]]
        theirs.step()
    assert given == pytest.approx(flat)


def test_one_cycle_refuses_step_sizes_by_name_and_cycles_no_momentum_without_betas(tmp_path):
    adamw = torch.optim.AdamW(Net().parameters(), lr=1e-2)
    for first, second in ((0, None), (4, -1)):
        with pytest.raises(ValueError, match=rf"cycle_first_step_size {first} and "
                                             rf"cycle_second_step_size {second}; accepted"):
            strata.lr_schedules.OneCycle(adamw, 1e-3, 1e-2, cycle_first_step_size=first,
                                         cycle_second_step_size=second)
    # The engine's Adagrad (no betas): the rate cycles, momentum is not taken, said once.
    config = make_config(tmp_path, 2, "cpu", "fp32", accumulation=1)
    config["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-2}}
    config["scheduler"] = {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 2}}
    with pytest.warns(UserWarning, match=r"OneCycle: cycle_momentum is not taken: "
                                         r"\w+ has no betas"):
        engine, optimizer, _, scheduler = strata.initialize(model=Net(), config=config)
    rates = rates_over(engine, 3)
    assert rates == pytest.approx([1e-3, 5.5e-3, 1e-2])
    assert "betas" not in optimizer.param_groups[0]
    engine.close()


@pytest.mark.parametrize("staircase,seen", [(False, [1e-3, 1.5e-3, 2e-3, 2.5e-3]),
                                            (True, [1e-3, 1e-3, 2e-3, 2e-3])])
def test_lr_range_test_from_the_config_raises_the_rate_as_deepspeed_s(tmp_path, staircase, seen):
    config = make_config(tmp_path, 2, "cpu", "fp32", accumulation=1)
    config["scheduler"] = {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2,
        "lr_range_test_staircase": staircase}}
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    rates = rates_over(engine, len(seen))
    assert rates == pytest.approx(seen)
    try:  # DeepSpeed's own, where it is installed (the benchmarks' environment)
        from deepspeed.runtime.lr_schedules import LRRangeTest as DeepSpeeds
    except ImportError:
        DeepSpeeds = None
    if DeepSpeeds is not None:
        adamw = torch.optim.AdamW(Net().parameters(), lr=1e-2)
        theirs = DeepSpeeds(adamw, **config["scheduler"]["params"])
        given = []
        for _ in seen:
            given.append(adamw.param_groups[0]["lr"])
            theirs.step()
        assert given == pytest.approx(seen)
    config["scheduler"]["params"]["lr_range_test_step_size"] = 0
    with pytest.raises(ValueError, match=r"lr_range_test_step_size 0; accepted: a whole number "
                                         r"above 0"):
        strata.initialize(model=Net(), config=config)


class Scale(torch.nn.Module):
    """y = x * w: computes in fp16 on a CPU (torch 1.13's CPU has no fp16 matmul)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(256))

    def forward(self, x):
        return (x * self.weight).float().sum()


@pytest.mark.parametrize("clipping", [0.0, 1e6])  # the check fused in the step, or the norm's
def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path, clipping):
    config = make_config(tmp_path, 3, "cpu", "fp16", accumulation=1, clipping=clipping)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    engine, _, _, _ = strata.initialize(model=Scale(), config=config)
    assert engine.loss_scale == 256
    x = torch.full((256,), 0.5, dtype=torch.float16)
    engine.backward(engine(x))
    engine.step()
    assert engine.global_steps == 1
    before = engine_weights(engine)[0].clone()
    # A loss whose gradient overflows fp16 once scaled: 1e3 * 256 per element is past 65504.
    engine.backward(engine(x) * 1e3)
    engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 2  # DeepSpeed counts skips
    assert engine.loss_scale == 128
    assert torch.equal(engine_weights(engine)[0], before)
    # The next good step goes on from the same state.
    engine.backward(engine(x))
    engine.step()
    assert engine.global_steps == 3 and engine.skipped_steps == 1
    assert not torch.equal(engine_weights(engine)[0], before)


@pytest.mark.parametrize("stage, offload", [(0, "cpu"), (2, "cpu"), (3, "nvme")])
def test_bf16_check_grad_overflow_skips_a_step_whose_gradients_are_not_finite(tmp_path, stage,
                                                                             offload):
    # No clipping: the check is the step's own (DeepSpeed's bf16.check_grad_overflow). Without
    # the key the step is taken, as plain torch takes it (its weights are no longer finite).
    finals = {}
    for check in (True, None):
        config = make_config(tmp_path / str(check), stage, offload, "bf16", accumulation=1,
                             clipping=0.0)
        if check is not None:
            config["bf16"]["check_grad_overflow"] = check
        torch.manual_seed(0)
        engine, _, _, _ = strata.initialize(model=Net().bfloat16(), config=config)
        inf = []  # (one element of the last layer's weight: the rest finite)
        engine.module.l2.weight.register_hook(
            lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])),
                                  torch.tensor(float("inf"), dtype=g.dtype)) if inf else g)
        for i, (x, y) in enumerate(batches(3)):
            loss = loss_of(engine(x), y)
            inf[:] = [True] if i == 1 else []
            if i == 1:
                before = [w.clone() for w in engine_weights(engine)]
            engine.backward(loss)
            engine.step()
            if i == 1:
                kept = all(torch.equal(a, b) for a, b in zip(before, engine_weights(engine)))
        finals[check] = (engine.skipped_steps, kept,
                         all(bool(w.isfinite().all()) for w in engine_weights(engine)))
        engine.close()
    assert finals == {True: (1, True, True), None: (0, False, False)}, finals
    with pytest.raises(strata.ConfigError, match=r"bf16\.check_grad_overflow: 'yes' is not"):
        strata.initialize(model=Net(), config={**config, "bf16": {"enabled": True,
                                                                   "check_grad_overflow": "yes"}})


def test_a_config_without_gradient_clipping_is_said_once_where_nothing_clips(tmp_path):
    # DeepSpeed 0.19.3 and later clip at 1.0 when the key is absent; the engine does not clip,
    # and says so at the first step nothing clipped (not where the loop clips, nor where the
    # config names the key).
    said = {}
    for case, stage in (("absent", 2), ("clip_grad_norm_", 2), ("clip_grad_norm_", 0), ("0", 2),
                        ("1.0", 2)):
        config = make_config(tmp_path / f"{case}{stage}", stage, "cpu", "fp32", accumulation=1)
        if case in ("0", "1.0"):
            config["gradient_clipping"] = float(case)
        else:
            del config["gradient_clipping"]
        engine, _, _, _ = strata.initialize(model=Net(), config=config)
        for x, y in batches(2):
            engine.backward(loss_of(engine(x), y))
            if case == "clip_grad_norm_":
                torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1e6)
            engine.step()
        said[case, stage] = [w for w in engine.warnings if w.startswith("gradient_clipping is")]
        engine.close()
    assert len(said["absent", 2]) == 1 and "DeepSpeed 0.19.3 and later clip at 1.0" in \
        said["absent", 2][0], said
    # (at stage 0 the loop's clip_grad_norm_ clips .grad in place)
    assert said["clip_grad_norm_", 2] == said["clip_grad_norm_", 0] == said["0", 2] == \
        said["1.0", 2] == [], said


def test_fp16_held_steps_are_the_steps_after_backward_and_an_overflow_skips_one(tmp_path):
    # fp16 with the state on NVMe and clipping under every norm: after the first step every step
    # is held (its state read during backward, released at clip / loss scale, which is not the
    # 1 / loss scale it was staged with), and each is the step taken after backward with no
    # read-ahead room, bit for bit; an overflowing step is skipped in both, the scale halved.
    results = []
    for read_ahead in ("auto", 0):
        config = make_config(tmp_path / str(read_ahead), 3, "nvme", "fp16", accumulation=1,
                             clipping=1e-3)
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
        config["strata"]["optimizer_read_ahead_bytes"] = read_ahead
        engine, _, _, _ = strata.initialize(model=Scale(), config=config)
        held, scales = [], []
        for i, factor in enumerate((1.0, 0.5, 1e3, 0.25, 2.0)):  # the third overflows
            x = torch.full((256,), 0.5 + i / 8, dtype=torch.float16)
            engine.backward(engine(x) * factor)
            engine.step()
            held.append(engine.last_step_stats["optimizer"].get("held", False))
            scales.append(engine.loss_scale)
        assert engine.skipped_steps == 1
        results.append((held, scales, engine_weights(engine)[0].clone()))
    (held_a, scales_a, weights_a), (held_b, scales_b, weights_b) = results
    assert held_a == [False, True, False, True, True]  # (the overflow's report has no flags)
    assert held_b == [False] * 5
    assert scales_a == scales_b == [256, 256, 128, 128, 128]
    assert torch.equal(weights_a, weights_b)


def test_the_read_ahead_room_is_taken_only_where_a_step_can_be_held(tmp_path):
    # "auto": an eighth of the host budget (capped at the state) with the state on NVMe and
    # clipping, or optimizer_commit "partition" stepping after backward; none without clipping,
    # with the state in host memory; a size given is taken as given.
    for stage, offload, clipping, block, room in (
            (3, "nvme", 1.0, {}, True), (3, "nvme", 0.0, {}, False), (3, "cpu", 1.0, {}, False),
            (2, "nvme", 1.0, {}, False),  # nothing is staged during backward below stage 3
            (3, "nvme", 0.0, {"optimizer_commit": "partition"}, True),
            (3, "nvme", 0.0, {"optimizer_read_ahead_bytes": 8192}, True)):
        path = tmp_path / f"{stage}{offload}{clipping}{len(block)}{room}"
        config = make_config(path, stage, offload, "fp32", accumulation=1, clipping=clipping)
        config["strata"].update(block)
        engine, _, _, _ = strata.initialize(model=Net(), config=config)
        got = engine.runtime.optimizer_read_ahead_bytes
        assert (got > 0) == room, (stage, offload, clipping, block)
        if "optimizer_read_ahead_bytes" in block:
            assert got == 8192
        engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accum", [None, "fp32", "bf16"])
def test_bf16_gradients_are_summed_in_grad_accum_dtype_fp32_by_default(tmp_path, stage, accum):
    # Four micro-batches: the first's gradient 1/4 per element, the others' 2^-11, which a bf16
    # sum drops (half an ulp of 1/4, rounded to even) and an fp32 sum keeps.
    config = make_config(tmp_path, stage, "cpu", "bf16", accumulation=4, clipping=1e6)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    engine, _, _, _ = strata.initialize(model=Scale(), config=config)
    for value in (1.0, 2.0 ** -9, 2.0 ** -9, 2.0 ** -9):
        engine.backward(engine(torch.full((256,), value, dtype=torch.bfloat16)))
        engine.step()
    per_element = 0.25 + 3 * 2.0 ** -11 if accum in (None, "fp32") else 0.25
    assert engine.last_step_stats["optimizer"]["grad_norm"] == pytest.approx(
        16 * per_element, rel=1e-6)


def test_grad_accum_dtype_names_what_it_accepts(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "bf16")
    config["data_types"] = {"grad_accum_dtype": "fp16"}
    with pytest.raises(strata.ConfigError, match=r"data_types.grad_accum_dtype: 'fp16' is not "
                                                 r"accepted with bfloat16 training; accepted: "
                                                 r"'bf16' or 'fp32'"):
        strata.initialize(model=Scale(), config=config)
    config["data_types"] = {"grad_dtype": "fp32"}
    with pytest.raises(strata.ConfigError, match="data_types.grad_dtype: unknown key"):
        strata.initialize(model=Scale(), config=config)


def test_the_loss_scale_follows_deepspeeds_dynamic_loss_scaler(tmp_path):
    config = make_config(tmp_path, 0, "cpu", "fp32")
    config["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3,
                      "hysteresis": 2}
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    scales = []
    for overflow in [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1]:
        engine._scaler.update(bool(overflow))
        scales.append(engine.loss_scale)
    # DeepSpeed's DynamicLossScaler.update_scale on the same pattern (hysteresis absorbs the
    # first overflow only; a halving leaves it spent until the window doubles the scale; the
    # doubling after loss_scale_window good steps, as 0.17 and later count them: one step later
    # than the older rule, which gave 256 at the 7th update).
    assert scales == [1024, 512, 256, 128, 128, 128, 128, 256, 256, 256, 128, 64]


def _square_step_beside(engine, reference, torch_adamw, x):
    """One step of the engine and of plain torch on the loss mean(model(x)^2); their losses held
    equal."""
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    ref_loss = reference(x).pow(2).mean()
    ref_loss.backward()
    torch_adamw.step()
    torch_adamw.zero_grad()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)


def test_stage3_trains_a_deep_model_through_a_budget_of_three_layers(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["strata"]["device_budget_bytes"] = 3 * 16384  # three of the eight 16 KiB weights
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
    engine, _, _, _ = strata.initialize(model=model, config=config)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    for _ in range(4):
        _square_step_beside(engine, reference, torch_adamw, x)
    assert engine.stats()["bytes_moved"]["host_to_device"] > 4 * 8 * 16384


def test_a_parameter_without_a_gradient_keeps_its_own_adam_step_count(tmp_path):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 16)

        def forward(self, x, both):
            return (self.b(self.a(x)) if both else self.a(x)).pow(2).mean()

    torch.manual_seed(0)
    model = Two()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    for both in (False, True, True):
        engine.backward(engine(x, both))
        engine.step()
        reference(x, both).backward()
        torch_adamw.step()
        torch_adamw.zero_grad(set_to_none=True)
    for ours, theirs in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)


def test_an_engine_dropped_by_the_trainer_is_collected_and_frees_its_store(tmp_path):
    import gc
    import weakref
    config = make_config(tmp_path, 3, "nvme", "fp32")
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is None
    # The store's lock went with it: a new engine on the same folder opens it.
    strata.initialize(model=Net(), config=config)


def test_a_lent_tensor_freed_after_its_runtime_is_dropped_is_safe(tmp_path):
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import gc, json, torch
        from torch.utils.dlpack import from_dlpack
        from strata import _strata
        cfg = {{"strata": {{"device": "emulated", "nvme_capacity_bytes": 1 << 26}}}}
        rt = _strata.Runtime(json.dumps(cfg), on_warning=lambda w: None)
        rt.register(0, "param", "float32", 1024, 0, "host", torch.arange(1024.0))
        t = from_dlpack(rt.lend(0, "device", None, True))
        del rt
        gc.collect()
        assert t[:3].tolist() == [0.0, 1.0, 2.0]
        del t  # the last reference: the Runtime goes now, under the GIL
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_misspelt_top_level_key_is_called_unknown_with_the_close_match(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    config["zero_optimisation"] = config.pop("zero_optimization")
    with pytest.raises(strata.InvalidArgumentError,
                       match="zero_optimisation: unknown key.*did you mean zero_optimization"):
        strata.initialize(model=Net(), config=config)


BAD_TRAINER_KEYS = [
    ("gradient_clipping", -1, "gradient_clipping: -1 is out of range"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps: 0 is out of range"),
    ("train_micro_batch_size_per_gpu", "4", "train_micro_batch_size_per_gpu: '4' is not a number"),
    ("optimizer", {"type": "SGD"}, "optimizer.type: 'SGD' is not supported"),
    ("optimizer", {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}},
     "optimizer.params.amsgrad: true is not supported"),
    ("optimizer", {"type": "Adam", "params": {"betas": [0.9]}}, "optimizer.params.betas"),
    ("scheduler", {"type": "OneCycleLR"}, "scheduler.type: 'OneCycleLR' is not supported"),
    ("bf16", {"enabled": "yes"}, "bf16.enabled: 'yes' is not accepted"),
    ("fp16", {"enabled": True, "loss_scale_windw": 10}, "fp16.loss_scale_windw: unknown key"),
    ("fp16", {"enabled": True, "fp16_master_weights_and_grads": True},
     "fp16.fp16_master_weights_and_grads: true is not supported"),
]


@pytest.mark.parametrize("key, value, message", BAD_TRAINER_KEYS)
def test_bad_trainer_keys_are_refused_naming_them(tmp_path, key, value, message):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    config[key] = value
    with pytest.raises(strata.ConfigError, match=message):
        strata.initialize(model=Net(), config=config)


@pytest.mark.parametrize("key, value, message", BAD_TRAINER_KEYS)
def test_check_config_refuses_what_initialize_refuses_without_a_model(tmp_path, key, value,
                                                                      message):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    strata.check_config(config)  # accepted as made
    config[key] = value
    with pytest.raises(strata.ConfigError, match=message):
        strata.check_config(config)


@pytest.mark.parametrize("block, key, value, message", [
    ("strata", "optimizer_thread", 2, "strata.optimizer_thread: unknown key .did you mean "
                                      "optimizer_threads"),
    ("strata", "optimizer_threads", -3, "strata.optimizer_threads: must be an integer in "
                                        r"\[0, 1024\], got -3"),
    ("strata", "device", "tpu", 'strata.device: "tpu": accepted: emulated, cuda'),
    ("zero_optimization", "stage", 7, r"zero_optimization.stage: must be an integer in \[0, 3\]"),
    (None, "zero_optimisation", {}, "zero_optimisation: unknown key.*did you mean "
                                    "zero_optimization"),
    # One pair of 64 KiB staging buffers (buffer_count 2) is more than a 64 KiB host budget.
    ("strata", "host_budget_bytes", 65536, r"the staging buffers \(2 of offload_param.buffer_size: "
                                          r"131072 bytes.*do not fit in strata.host_budget_bytes"),
])
def test_check_config_reads_the_runtimes_blocks_as_the_runtime_does(tmp_path, block, key, value,
                                                                    message):
    config = make_config(tmp_path, 3, "nvme", "fp32")
    (config[block] if block else config)[key] = value
    with pytest.raises(strata.InvalidArgumentError, match=message):
        strata.check_config(config)
    if key == "host_budget_bytes":  # with the model: the smallest budget it takes, in parts
        message = r"below the smallest this config and model take, \d+ bytes: the staging"
    with pytest.raises(ValueError, match=message):
        strata.initialize(model=Net(), config=config)
    # Nothing was made: the NVMe folder the config names is not there.
    assert not (tmp_path / "nvme").exists()


def test_check_config_says_what_initialize_says_of_the_config(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    config["wall_clock_breakdown"] = True
    config["zero_optimization"]["contiguous_gradients"] = True
    config["zero_optimization"]["overlap_comm"] = True  # acted on across ranks: not said
    config["zero_optimization"]["offload_optimizer"]["device"] = "none"
    config["activation_checkpointing"] = {"partition_activations": True}
    strata.checkpointing.reset()
    said = strata.check_config(config)
    assert not strata.checkpointing.is_configured()  # read, nothing set
    for start in ("wall_clock_breakdown: not used", "zero_optimization.contiguous_gradients: ",
                  'zero_optimization.offload_optimizer.device is "none"',
                  "activation_checkpointing.partition_activations: not supported"):
        assert sum(w.startswith(start) for w in said) == 1, (start, said)
    assert not any("overlap_comm" in w for w in said)
    with pytest.warns(UserWarning) as told:
        engine, _, _, _ = strata.initialize(model=Net(), config=config)
    strata.checkpointing.reset()
    assert set(said) <= set(engine.warnings) | {str(w.message) for w in told}


def test_check_config_divides_train_batch_size_over_the_ranks_torchrun_gives(tmp_path,
                                                                             monkeypatch):
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 2}
    monkeypatch.setenv("WORLD_SIZE", "2")
    strata.check_config(config)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(strata.ConfigError, match="train_batch_size: 16 is not a multiple of the "
                                                 "job's 3 ranks"):
        strata.check_config(config)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE 'two' .the environment's.: accepted: a "
                                         "whole number of ranks"):
        strata.check_config(config)


def test_check_config_reads_a_per_group_schedule():
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 2e-3]}}}
    strata.check_config(config)


def test_configures_keyword_arguments_stand_for_the_blocks_cpu_checkpointing():
    try:
        strata.checkpointing.configure(
            deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": "yes"}},
            cpu_checkpointing=True)
        assert strata.checkpointing.is_configured()
        with pytest.raises(ValueError, match="cpu_checkpointing: 'yes'; accepted: true or false"):
            strata.checkpointing.configure(
                deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": "yes"}})
    finally:
        strata.checkpointing.reset()


def test_check_config_reads_a_json_file_and_refuses_one_that_is_not_json(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(make_config(tmp_path, 3, "nvme", "fp32")))
    strata.check_config(str(path))
    assert not (tmp_path / "nvme").exists()  # an NVMe config accepted, its folder not made
    path.write_text("{")
    with pytest.raises(strata.ConfigError, match="is not JSON"):
        strata.check_config(str(path))


@pytest.mark.parametrize("key, value, message", [
    ("scheduler", {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
     r"scheduler.params \(WarmupLR\):.*warmup_num_step"),
    ("activation_checkpointing", {"cpu_checkpointin": True},
     "activation_checkpointing.cpu_checkpointin: unknown key"),
    ("activation_checkpointing", {"cpu_checkpointing": "yes"},
     "activation_checkpointing.cpu_checkpointing: 'yes'; accepted: true or false"),
])
def test_check_config_reads_the_scheduler_and_activation_checkpointing(tmp_path, key, value,
                                                                       message):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    config[key] = value
    with pytest.raises(ValueError, match=message):
        strata.check_config(config)
    with pytest.raises(ValueError, match=message):
        strata.initialize(model=Net(), config=config)


def test_deepspeed_keys_strata_does_not_act_on_are_named_once(tmp_path, capsys):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    config["wall_clock_breakdown"] = True
    config["zero_optimization"]["contiguous_gradients"] = True
    # Acted on across ranks (strata/ranks.py): not called ignored.
    config["zero_optimization"]["overlap_comm"] = True
    config["zero_optimization"]["reduce_bucket_size"] = 1000
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    said = [w for w in engine.warnings if "not supported by strata: ignored" in w]
    assert any(w.startswith("wall_clock_breakdown") for w in said)
    assert any(w.startswith("zero_optimization.contiguous_gradients") for w in said)
    assert len(said) == 2


def test_a_client_torch_optimizer_gives_the_hyper_parameters(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    del config["optimizer"]
    model = Net()
    client = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.8, 0.9), weight_decay=0.0)
    engine, optimizer, _, _ = strata.initialize(model=model, optimizer=client, config=config)
    assert optimizer.param_groups[0]["lr"] == 3e-3
    sgd = torch.optim.SGD(Net().parameters(), lr=1.0)
    with pytest.raises(ValueError, match="optimizer SGD is not supported"):
        strata.initialize(model=Net(), optimizer=sgd, config=config)
    with pytest.raises(ValueError, match="both as an argument and in the config"):
        strata.initialize(model=Net(), optimizer=client,
                          config=make_config(tmp_path / "b", 3, "cpu", "fp32"))


def test_a_tied_weight_used_outside_its_module_trains_once_registered(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, WIDTH)
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return torch.tanh(self.lin(self.emb(x))) @ self.emb.weight.t()

    torch.manual_seed(0)
    model = Tied()
    reference = copy.deepcopy(model)
    strata.register_external_parameter(model, model.emb.weight)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches(3):
        step_both(engine, reference, torch_adamw, x, y)


def test_module_state_dict_holds_whole_parameters_at_stage3(tmp_path):
    engine, reference, _ = train_both(tmp_path, 3, "cpu", "fp32", steps=4)
    # The parameters themselves: placeholders between uses, of their shape.
    assert all(not placeholders.holds_values(v) and v.dim() == 2
               for k, v in engine.module.named_parameters() if "weight" in k and k != "ln.weight")
    whole = engine.module_state_dict()
    # The module's own state_dict() gives them whole too, as plain torch's.
    for name, value in engine.module.state_dict().items():
        assert torch.equal(value.cpu(), whole[name]), name
    for (name, ours), theirs in zip(whole.items(), reference.model.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    # It loads into a fresh model of the same shape.
    fresh = Net()
    fresh.load_state_dict(whole)


def test_a_disk_that_fills_mid_step_ends_the_step_and_keeps_the_previous_state(tmp_path,
                                                                               monkeypatch):
    import errno
    made = faulty_runtimes(monkeypatch, errno.ENOSPC)
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1, clipping=0.0)
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    data = list(batches(4))
    for x, y in data[:2]:
        engine.backward(loss_of(engine(x), y))
        engine.step()

    def optimizer_state():
        out = []
        for e in engine.table.trained:
            m, a, v = torch.empty(e.numel), torch.empty(e.numel), torch.empty(e.numel)
            engine.runtime.read_optimizer_state(e.gid, m, a, v)
            out += [m, a, v]
        return out

    weights, state = engine.module_state_dict(), optimizer_state()
    made[0].arm_faults(True)  # the disk is full from here
    x, y = data[2]
    engine.backward(loss_of(engine(x), y))
    with pytest.raises(strata.Error, match="No space left on device") as failed:
        engine.step()
    assert failed.value.code == "RESOURCE_EXHAUSTED"
    made[0].arm_faults(False)
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, weights[name]), name
    for before, after in zip(state, optimizer_state()):
        assert torch.equal(before, after)
    # Room again: training goes on from the previous step's state.
    x, y = data[3]
    engine.backward(loss_of(engine(x), y))
    engine.step()
    assert not torch.equal(engine.module_state_dict()["l1.weight"], weights["l1.weight"])


def test_a_write_that_fails_behind_a_step_keeps_its_state_until_the_disk_takes_it(tmp_path,
                                                                                 monkeypatch):
    # strata.optimizer_write_behind (the default with the state on NVMe): step() returns once the
    # step is in memory; the disk fills while its writes are behind it. The step stands (its
    # weights are in use), the next step raises the disk's error saying the state is kept, and
    # with room again training goes on: bit for bit the run whose disk never filled. (A write that
    # fails before step() returns ends that step with nothing changed, as without write-behind:
    # the armed writes are skipped by 0, 1, ... until one run's failure lands behind a step.)
    import errno
    data = list(batches(4))

    def run(tmp, steps, made=None, skip=None):
        config = make_config(tmp, 3, "nvme", "fp32", accumulation=1, clipping=0.0)
        torch.manual_seed(0)
        engine, _, _, _ = strata.initialize(model=Net(), config=config)
        for i, (x, y) in enumerate(steps):
            engine.backward(loss_of(engine(x), y))
            if i == 2 and made is not None:
                made[-1].arm_faults(True)
            engine.step()
        return engine

    reference = engine_weights(run(tmp_path / "ref", data))
    seen = set()
    # Which write fails depends on timing too (the Runtime's own write-backs): a run whose step 3
    # was written whole before step() returned lands the failure in step 4, before it returns; the
    # skips are then tried again from a little earlier.
    skip = 0
    for attempt in range(120):
        monkeypatch.undo()
        made = faulty_runtimes(monkeypatch, errno.ENOSPC, skip=skip)
        engine = None
        try:
            engine = run(tmp_path / f"s{attempt}", data[:3], made)
            stood = True
        except strata.Error as error:  # before step() returned: nothing changed
            assert "No space left on device" in str(error)
            stood = False
        if stood:
            assert engine.last_step_stats["optimizer"]["written_behind"]
            x, y = data[3]
            engine.backward(loss_of(engine(x), y))
            try:
                engine.step()
                skip += 1
                continue  # the armed writes that failed were none of this run's optimizer's
            except strata.Error as error:
                if "optimizer step 4: nothing was changed" in str(error):  # past step 3's writes
                    assert "No space left on device" in str(error)
                    seen.add("in the next step")
                    skip = max(0, skip - 3)
                    continue
                assert "optimizer step 3: its new state, written behind" in str(error), error
                assert "kept in host memory" in str(error)
                assert "No space left on device" in str(error)
            assert engine.redone_steps == 0  # no step was dropped: it was never begun
            with pytest.raises(strata.Error, match="kept in host memory"):
                engine.runtime.flush_optimizer()
            made[-1].arm_faults(False)
            engine.runtime.flush_optimizer()
            engine.backward(loss_of(engine(x), y))  # the step that raised, taken again
            engine.step()
            for ours, theirs in zip(engine_weights(engine), reference):
                assert torch.equal(ours, theirs)
            seen.add("behind")
            break
        seen.add("before")
        skip += 1
    assert "behind" in seen, f"no failure landed behind a step (seen: {seen})"


class Checkpointed(torch.nn.Module):
    """Net's layers with the middle run through strata.checkpointing, and a dropout in it."""

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.drop = torch.nn.Dropout(0.1)

    def middle(self, h):
        return self.drop(self.net.ln(torch.relu(self.net.l1(h))))

    def forward(self, x, checkpoint=True):
        h = self.net.emb(x)
        h = strata.checkpointing.checkpoint(self.middle, h) if checkpoint else self.middle(h)
        return self.net.l2(h)


def _train_steps(config, data):
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    return engine, train(engine, data)


@pytest.mark.parametrize("stage, during, clipping", [(3, False, 1.0), (3, True, 0.0),
                                                     (2, False, 1.0), (1, True, 0.0)])
def test_optimizer_commit_partition_trains_bit_for_bit_as_the_whole_step(tmp_path, stage, during,
                                                                          clipping):
    """strata.optimizer_commit "partition": each NVMe partition's new state replaces its old one
    as it is written; the steps are the same arithmetic as the whole step's, after backward
    (clipping) or during it (optimizer_during_backward, no clipping); and so are they with
    zero_optimization.sub_group_size cutting the larger parameters' state in pieces."""
    data = list(batches(8))
    results = []
    for commit, sub_group in (("step", None), ("partition", None), ("step", 500),
                              ("partition", 500)):
        config = make_config(tmp_path / f"{commit}{sub_group}", stage, "nvme", "fp32",
                             accumulation=2, clipping=clipping)
        config["strata"].update(optimizer_commit=commit, optimizer_during_backward=during)
        if sub_group:
            config["zero_optimization"]["sub_group_size"] = sub_group
        engine, losses = _train_steps(config, data)
        assert engine._step.commit_each == (commit == "partition")
        report = engine.last_step_stats["optimizer"]
        results.append((losses, [w.clone() for w in engine_weights(engine)],
                        (report.get("staged"), report.get("held")), commit))
    losses_a, weights_a, _, _ = results[0]
    for losses_b, weights_b, (staged_b, held_b), commit in results[1:]:
        assert losses_a == losses_b
        for a, b in zip(weights_a, weights_b):
            assert torch.equal(a, b)
        if stage == 3 and commit == "partition":  # (below stage 3 the step is after backward)
            # Stepped during backward only where nothing can drop it; else held (its state read
            # during backward, stepped after it).
            assert staged_b
            assert held_b == (not during)


@pytest.mark.parametrize("skip, sub_group, homed", [
    (0, None, False), (4, None, False), (6, None, False), (2, 500, False), (5, 500, False),
    (2, 500, True), (5, 500, True)])
def test_optimizer_commit_partition_a_disk_full_mid_step_keeps_what_landed(tmp_path, monkeypatch,
                                                                          skip, sub_group, homed):
    """A step that fails part way with strata.optimizer_commit "partition" (the disk full after
    `skip` writes): the partitions whose state had landed keep that step (their step counts say
    so, and a warning how many), the others do not, and training goes on from there. With
    sub_group_size a parameter may fail with some of its pieces landed: it is not counted stepped,
    and the next step steps its other pieces. Either way, after it every parameter's weights (fp32)
    are its master weights, bit for bit: no landed copy is lost. `homed`: the parameters homed on
    NVMe (none within max_in_cpu), whose new weights are written into their partitions without
    the old ones read: the weights the next forward uses are the master weights too, those of a
    parameter stepped in part included (its other sub-groups' are written from them)."""
    import errno
    made = faulty_runtimes(monkeypatch, errno.ENOSPC, skip=skip)
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1, clipping=1.0)
    config["strata"]["optimizer_commit"] = "partition"
    if homed:
        config["zero_optimization"]["offload_param"]["max_in_cpu"] = 10
    if sub_group:
        config["zero_optimization"]["sub_group_size"] = sub_group
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    data = list(batches(4))
    for x, y in data[:2]:
        engine.backward(loss_of(engine(x), y))
        engine.step()
    assert {e.steps for e in engine.table.trained} == {2}
    made[0].arm_faults(True)
    x, y = data[2]
    engine.backward(loss_of(engine(x), y))
    warned = len(engine.warnings)
    released_written = []  # the host copies the engine releases written after the failed step
    real_release = engine._step.release_early_held
    engine._step.release_early_held = lambda attempt: (
        released_written.extend(e.gid for e in engine._step.early_held), real_release(attempt))
    with pytest.raises(strata.Error, match="No space left on device") as failed:
        engine.step()
    made[0].arm_faults(False)
    landed = [e for e in engine.table.trained if e.steps == 3]
    assert len(landed) + sum(e.steps == 2 for e in engine.table.trained) == len(engine.table.trained)
    if skip == 0:
        assert not landed  # the first write failed
    elif sub_group and not landed:  # the error names the parameter stepped in part
        assert re.search(r"1 partition had stepped in part \(\d+: \d of its \d sub-groups "
                         r"stepped to step 3", str(failed.value)), str(failed.value)
        # Its host copy keeps the landed sub-groups' new weights: released written once backward
        # is over, as the copies of partitions that stepped whole are (it was released clean, so
        # a later eviction could drop them).
        partly = engine.runtime.partly_stepped_optimizer_partitions()
        assert len(partly) == 1
        if homed:  # written by the optimizer's thread; all of it written again at once
            assert not engine._step.pending_refresh
        else:
            assert released_written == partly
    else:
        assert 0 < len(landed) < len(engine.table.trained), str(failed.value)
        assert any(f"after {len(landed)} parameters had stepped" in w and
                   "optimizer_commit" in w for w in engine.warnings[warned:])
    if homed:  # what a module called on its own computes with, before any engine.forward
        assert engine._step.refresh
        for e, weights, state in zip(engine.table.trained, engine_weights(engine),
                                     _optimizer_state(engine, mixed_steps=True)):
            assert torch.equal(weights.reshape(-1), state[:e.shard]), e.name
    # The next step steps every partition once more.
    x, y = data[3]
    engine.backward(loss_of(engine(x), y))
    engine.step()
    assert {e.steps for e in engine.table.trained} == ({3} if not landed else {3, 4})
    for e, weights, state in zip(engine.table.trained, engine_weights(engine),
                                 _optimizer_state(engine)):
        assert torch.equal(weights.reshape(-1), state[:e.shard]), e.name


@pytest.mark.parametrize("during", [False, True])
def test_optimizer_commit_partition_writes_nvme_homed_weights_without_reading_the_state_back(
        tmp_path, during):
    """Parameters homed on NVMe beyond offload_param.max_in_cpu: with the whole step's commit
    their new weights are read back from the committed master weights after the step (12 bytes a
    parameter); with strata.optimizer_commit "partition" the optimizer's thread writes them into
    their partitions as each state lands, and nothing is read back: after backward, or during
    it (no clipping, optimizer_during_backward). The same weights either way."""
    data = list(batches(6))
    results = {}
    for commit in ("step", "partition"):
        config = make_config(tmp_path / commit, 3, "nvme", "bf16", accumulation=1,
                             clipping=0.0 if during else 1.0)
        config["zero_optimization"]["offload_param"]["max_in_cpu"] = 10  # none kept in host
        config["strata"].update(optimizer_commit=commit, optimizer_during_backward=during)
        torch.manual_seed(0)
        engine, _, _, _ = strata.initialize(model=Net(), config=config)
        assert engine._step.refresh
        read_back = []
        real = engine._step.refresh_weights
        engine._step.refresh_weights = lambda entries: (read_back.append(  # (partitioned ones)
            [e.name for e in list(entries) + engine._step.pending_refresh if e.partitioned]),
            real(entries))
        losses = train(engine, data)
        results[commit] = (losses, [w.clone() for w in engine_weights(engine)],
                           sum(len(r) for r in read_back))
    (losses_a, weights_a, read_a), (losses_b, weights_b, read_b) = results.values()
    assert read_a > 0 and read_b == 0, (read_a, read_b)
    assert losses_a == losses_b
    for a, b in zip(weights_a, weights_b):
        assert torch.equal(a, b)


def _optimizer_state(engine, mixed_steps=False):
    out = []
    for e in engine.table.trained:
        m, a, v = torch.empty(e.shard), torch.empty(e.shard), torch.empty(e.shard)
        engine.runtime.read_optimizer_state(e.gid, m, a, v, mixed_steps=mixed_steps)
        out.append(torch.cat([m, a, v]))
    return out


@pytest.mark.parametrize("how", ["checkpoint", "pretrained"])
def test_optimizer_commit_partition_a_load_that_fails_part_way_is_refused_until_one_succeeds(
        tmp_path, monkeypatch, how):
    """strata.optimizer_commit "partition": a load of the optimizer state (load_checkpoint,
    load_pretrained) that fails after some partitions were written leaves them so: the engine then
    stages nothing during backward (nothing lands on the mixed state), refuses step() and
    save_checkpoint naming why, and a whole load puts it right."""
    import errno
    made = faulty_runtimes(monkeypatch, errno.ENOSPC, skip=2)
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1, clipping=0.0)
    config["strata"].update(optimizer_commit="partition", optimizer_during_backward=True)
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    data = list(batches(6))
    for x, y in data[:2]:
        engine.backward(loss_of(engine(x), y))
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    x, y = data[2]
    engine.backward(loss_of(engine(x), y))
    engine.step()
    torch.manual_seed(123)
    other = Net().state_dict()
    made[0].arm_faults(True)
    with pytest.raises(strata.Error, match="No space left on device"):
        if how == "checkpoint":
            engine.load_checkpoint(tmp_path / "ckpt")
        else:
            engine.load_pretrained(other)
    made[0].arm_faults(False)
    assert "failed part way" in engine._step.half_loaded
    before = _optimizer_state(engine)
    x, y = data[3]
    engine.backward(loss_of(engine(x), y))
    assert engine._step.staged is None  # nothing staged, so nothing landed during backward
    for b, a in zip(before, _optimizer_state(engine)):
        assert torch.equal(b, a)
    with pytest.raises(RuntimeError, match="step: .*failed part way"):
        engine.step()
    with pytest.raises(RuntimeError, match="save_checkpoint: .*failed part way"):
        engine.save_checkpoint(tmp_path / "again")
    engine.load_checkpoint(tmp_path / "ckpt")  # whole: training goes on
    assert engine._step.half_loaded is None
    engine.backward(loss_of(engine(x), y))
    engine.step()
    assert engine.global_steps == 3


@pytest.mark.parametrize("cpu_checkpointing", [False, True])
def test_activation_checkpointing_trains_as_without_it(tmp_path, cpu_checkpointing):
    torch.manual_seed(0)
    model = Checkpointed()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["activation_checkpointing"] = {"cpu_checkpointing": cpu_checkpointing,
                                          "number_checkpoints": 1}
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert strata.checkpointing.is_configured()
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for i, (x, y) in enumerate(batches(4)):
        torch.manual_seed(100 + i)  # the same dropout masks for both
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        torch.manual_seed(100 + i)
        ref_loss = loss_of(reference(x, checkpoint=False), y)
        ref_loss.backward()
        torch_adamw.step()
        torch_adamw.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    strata.checkpointing.reset()


def test_cpu_checkpointing_keeps_inputs_in_the_host_tier_within_its_budget(tmp_path):
    # The checkpoint's input (the embedding's output, 4 x 8 x 32 fp32 = 4 KiB) is a partition of
    # the host tier between forward and backward, counted in the pinned memory the Runtime holds,
    # and gone after backward; under no_grad nothing is kept; a budget without room for it is
    # named.
    torch.manual_seed(0)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["activation_checkpointing"] = {"cpu_checkpointing": True}
    engine, _, _, _ = strata.initialize(model=Checkpointed(), config=config)
    x, y = next(iter(batches(1)))
    held = engine.runtime.stats()["host_held_bytes"]
    ids = {2 * len(engine.table.trained)}
    loss = loss_of(engine(x), y)
    assert engine.runtime.stats()["host_held_bytes"] >= held + 4096
    with pytest.raises(strata.Error):  # registered: a second registration of its id is refused
        engine.runtime.register(min(ids), "other", "float32", 1, 0, "host")
    engine.backward(loss)
    engine.step()
    engine.runtime.register(min(ids), "other", "float32", 1, 0, "host")  # free again
    engine.runtime.unregister(min(ids))
    with torch.no_grad():
        before = engine.runtime.stats()["host_held_bytes"]
        engine(x)
        assert engine.runtime.stats()["host_held_bytes"] == before
    # A graph freed without its backward gives its inputs back.
    loss = loss_of(engine(x), y)
    del loss
    engine.runtime.register(min(ids), "other", "float32", 1, 0, "host")
    engine.runtime.unregister(min(ids))
    strata.checkpointing.reset()


def test_cpu_checkpointing_stays_within_the_host_budget_and_names_one_without_room(tmp_path):
    torch.manual_seed(0)
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1, clipping=0.0)
    config["activation_checkpointing"] = {"cpu_checkpointing": True}
    config["strata"]["host_budget_bytes"] = 8 << 20
    engine, _, _, _ = strata.initialize(model=Checkpointed(), config=config)
    # An input as large as the whole host budget cannot be kept there: named, with its size.
    big = torch.randn(2 << 20, requires_grad=True)  # 8 MiB
    with pytest.raises(strata.Error, match="cpu_checkpointing: a checkpointed input of 8388608 "
                                           "bytes does not fit the host tier"):
        strata.checkpointing.checkpoint(lambda t: t * 2, big)
    # Inputs that fill the tier push its other copies to NVMe: the budget is never passed.
    inputs = [torch.randn(256 << 10, requires_grad=True) for _ in range(12)]  # 12 MiB
    outs = [strata.checkpointing.checkpoint(lambda t: t * t, a) for a in inputs]
    assert engine.runtime.stats()["host_held_bytes"] <= 8 << 20
    torch.stack([o.sum() for o in outs]).sum().backward()  # brought back from NVMe as needed
    for a in inputs:
        assert torch.equal(a.grad, 2 * a.detach())
    strata.checkpointing.reset()


def test_activation_checkpointing_refuses_an_unknown_key():
    with pytest.raises(ValueError, match="activation_checkpointing.cpu_checkpoint: unknown key"):
        strata.checkpointing.configure(
            deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})


def test_steps_per_print_reports_every_n_steps_through_logging_not_stdout(tmp_path, capsys,
                                                                          caplog):
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1)
    config["steps_per_print"] = 2
    with pytest.warns(strata.StrataWarning, match="not used"):  # nvme_path with device cpu
        engine, _, _, _ = strata.initialize(model=Net(), config=config)
    with caplog.at_level("INFO", logger="strata"):
        for x, y in batches(5):
            engine.backward(loss_of(engine(x), y))
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "strata"]
    assert [l.split()[1] for l in lines] == ["2", "4"]
    assert "on the emulated device" in lines[0]
    # A library prints nothing: the user's stdout may be data.
    assert capsys.readouterr().out == ""


def test_checkpointing_gives_parameter_gradients_when_no_input_requires_grad():
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)  # as token ids or a frozen front end: no grad
    second(strata.checkpointing.checkpoint(first, x)).sum().backward()
    expected = torch.autograd.grad(second(first(x)).sum(), first.weight)[0]
    torch.testing.assert_close(first.weight.grad, expected)


def test_checkpointing_recomputes_under_the_forwards_autocast():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = strata.checkpointing.checkpoint(layer, x)
    out.float().sum().backward()
    ours = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    torch.testing.assert_close(ours, x.grad, rtol=0, atol=0)


def test_the_optimizers_nvme_traffic_is_in_the_bytes_moved(tmp_path):
    engine, _, _ = train_both(tmp_path, 3, "nvme", "fp32", steps=4, accumulation=1)
    moved = engine.stats()["bytes_moved"]
    state = sum(e.numel for e in engine.table.trained) * 12  # master, exp_avg, exp_avg_sq
    # Read by the first step; each step after it finds in the read-ahead room ("auto", as large as
    # the state here) what the step before committed there, and reads none of it again.
    assert engine.runtime.optimizer_read_ahead_bytes >= state
    assert state <= moved["nvme_to_host"] < 2 * state
    last = engine.last_step_stats["optimizer"]
    assert (last["bytes_read"], last["bytes_reused"]) == (0, state)
    # Written every step; the last step's, written behind it, is counted by the next.
    assert 3 * state <= moved["host_to_nvme"] < 4 * state
    assert engine.last_step_stats["optimizer"]["written_behind"]


def test_reading_the_weights_between_steps_keeps_the_plan(tmp_path):
    engine, _, _ = train_both(tmp_path, 3, "cpu", "fp32", steps=4, accumulation=1)
    engine.module_state_dict()
    for x, y in batches(1, seed=9):
        engine.backward(loss_of(engine(x), y))
        engine.step()
    assert engine.last_step_stats["runtime"]["mode"] == "planned"
    assert not any("differs from the recorded trace" in w for w in engine.warnings)


def test_param_groups_with_their_own_rates_and_a_client_scheduler(tmp_path):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)

    def groups(m):
        return [{"params": list(m.emb.parameters()) + list(m.l1.parameters()), "lr": 1e-2},
                {"params": list(m.ln.parameters()) + list(m.l2.parameters()), "lr": 3e-3}]

    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    del config["optimizer"]
    client = torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.01)
    engine, optimizer, _, scheduler = strata.initialize(
        model=model, optimizer=client, config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    torch_adamw = torch.optim.AdamW(groups(reference), lr=1e-2, weight_decay=0.01)
    torch_schedule = torch.optim.lr_scheduler.StepLR(torch_adamw, step_size=2, gamma=0.5)
    for x, y in batches(5):
        step_both(engine, reference, torch_adamw, x, y, schedule=torch_schedule)
    assert engine.get_lr() == pytest.approx([1e-2 * 0.25, 3e-3 * 0.25])


def test_training_data_gives_a_loader_of_the_micro_batch(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (20, 8)))
    config = make_config(tmp_path, 3, "cpu", "fp32")
    _, _, loader, _ = strata.initialize(model=Net(), config=config, training_data=data)
    first = next(iter(loader))
    assert first[0].shape == (4, 8)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_adagrad_and_lion_from_the_config_match_their_references(tmp_path, offload):
    from references import LionReference
    for block, make_reference in (
            ({"type": "Adagrad", "params": {"lr": 5e-2, "lr_decay": 0.01, "weight_decay": 0.02,
                                             "initial_accumulator_value": 0.1}},
             lambda ps: torch.optim.Adagrad(ps, lr=5e-2, lr_decay=0.01, weight_decay=0.02,
                                            initial_accumulator_value=0.1)),
            ({"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}},
             lambda ps: LionReference(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1))):
        torch.manual_seed(0)
        model = Net()
        reference = copy.deepcopy(model)
        (tmp_path / block["type"]).mkdir()
        config = make_config(tmp_path / block["type"], 3, offload, "fp32", accumulation=1,
                             clipping=0.0)
        config["optimizer"] = block
        engine, _, _, _ = strata.initialize(model=model, config=config)
        assert engine.optimizer_kind == block["type"].lower()
        torch_optimizer = make_reference(reference.parameters())
        for x, y in batches(4):
            step_both(engine, reference, torch_optimizer, x, y)
        for ours, theirs in zip(engine_weights(engine), reference.parameters()):
            torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)


def test_a_client_torch_adagrad_gives_the_kind_and_its_hyper_parameters(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "fp32")
    del config["optimizer"]
    model = Net()
    engine, optimizer, _, _ = strata.initialize(
        model=model, config=config,
        optimizer=torch.optim.Adagrad(model.parameters(), lr=0.02, lr_decay=0.1))
    assert engine.optimizer_kind == "adagrad"
    assert optimizer.param_groups[0]["lr"] == 0.02


# --- the step staged during backward (stage 3) ------------------------------------------------

def staged_run(tmp_path, clipping, steps=8, offload="nvme", hook=None, during_backward=False,
               held=None, strata_block=None):
    """train_both at stage 3 with `hook(engine, step)` called between backward and step (and
    strata.optimizer_during_backward as given, and `strata_block`'s keys); the per-step 'staged'
    flags of the optimizer's reports (and their 'held' flags appended to `held`)."""
    torch.manual_seed(0)
    model = Net()
    reference = Reference(copy.deepcopy(model), torch.float32, clipping)
    config = make_config(tmp_path, 3, offload, "fp32", 1, clipping)
    config["strata"]["optimizer_during_backward"] = during_backward
    config["strata"].update(strata_block or {})
    engine, _, _, _ = strata.initialize(model=model, config=config)
    staged = []
    for i, (x, y) in enumerate(batches(steps)):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        if hook is not None:
            hook(engine, reference, i)
        engine.step()
        staged.append(engine.last_step_stats["optimizer"].get("staged", False))
        if held is not None:
            held.append(engine.last_step_stats["optimizer"].get("held", False))
        ref_loss = reference.micro_step(x, y, 1)
        reference.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-5), i
    # The optimizer's accesses are out of the trace: whatever the steps did, the plan held.
    assert not any("differs from the recorded trace" in w for w in engine.warnings)
    for ours, theirs in zip(engine_weights(engine), reference.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(), rtol=1e-5, atol=1e-5)
    return engine, staged


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_the_step_staged_during_backward_commits_when_nothing_changes_it(tmp_path, offload):
    # No clipping, and clipping that never scales (a bound far above the norm): every step is
    # the one staged during backward, and equals torch's.
    for clipping in (0.0, 1e6):
        (tmp_path / str(clipping)).mkdir()
        engine, staged = staged_run(tmp_path / str(clipping), clipping, offload=offload)
        assert all(staged)
        assert engine.redone_steps == 0


def test_with_the_state_in_host_memory_and_nothing_to_learn_after_backward_it_steps_during_it(
        tmp_path):
    # strata.optimizer_during_backward, offload_optimizer cpu and no clipping: from the second
    # step on, each partition steps in place as backward makes its gradient final (its master
    # weights change before step() is called), and the steps equal torch's (staged_run checks).
    # With clipping, the host-resident state steps after backward, as the clip coefficient is
    # only known then; and so it does without the setting (its default).
    def before_step(engine, reference, i):
        if i == 0:
            return
        # The last block's weight (its gradient is final first) against torch's before its step.
        index, e = next((k, e) for k, e in reversed(list(enumerate(engine.table.trained)))
                        if e.partitioned)
        before = list(reference.model.parameters())[index].detach().reshape(-1)
        master, m, v = torch.empty(e.shard), torch.empty(e.shard), torch.empty(e.shard)
        deadline = time.monotonic() + 60
        while True:
            engine.runtime.read_optimizer_state(e.gid, master, m, v)
            if (master - before).abs().max() > 1e-4:  # one step of lr 1e-2 moved it
                break
            assert time.monotonic() < deadline, "no partition stepped during backward"
            time.sleep(0.01)

    engine, staged = staged_run(tmp_path, 0.0, offload="cpu", hook=before_step,
                                during_backward=True)
    assert all(staged) and engine.redone_steps == 0
    assert engine.last_step_stats["optimizer"]["host_early"]
    for name, clipping, during_backward in (("clipped", 1e6, True), ("default", 0.0, False)):
        (tmp_path / name).mkdir()
        engine, staged = staged_run(tmp_path / name, clipping, offload="cpu",
                                    during_backward=during_backward)
        assert all(staged) and not engine.last_step_stats["optimizer"]["host_early"], name


def test_a_second_backward_after_partitions_stepped_during_the_first_is_said(tmp_path):
    # Stepping during backward cannot be undone: a second backward through the boundary
    # micro-batch, after some partitions stepped with the first one's gradients, leaves them with
    # that step (said in a warning); the others take the summed gradients; none steps twice, and
    # the steps after it are staged no more (staging pauses for second gradients).
    torch.manual_seed(0)
    config = make_config(tmp_path, 3, "cpu", "fp32", 1, 0.0)
    config["strata"]["optimizer_during_backward"] = True
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    staged = []
    for i, (x, y) in enumerate(batches(4)):
        engine.backward(loss_of(engine(x), y))
        if i == 1:
            engine.runtime.wait_for_early_steps()  # the first backward's partitions have stepped
            engine.backward(loss_of(engine(x), y) * 0.5)
        engine.step()
        staged.append(engine.last_step_stats["optimizer"].get("staged", False))
    said = [w for w in engine.warnings if "had stepped during backward" in w]
    assert said and "changed after its step was staged" in said[0], engine.warnings
    assert all(e.steps == 4 for e in engine.table.trained), [(e.name, e.steps) for e in engine.table.trained]
    assert engine.redone_steps == 1
    # The second step was taken anew, the third after backward (staging paused), the fourth
    # staged again.
    assert staged == [True, False, False, True]


class _Failed(Exception):
    pass


def _failing_backward(engine, x, y):
    """A backward that fails at its last module (the embedding's gradient), once the others'
    partitions have stepped during it."""
    out = engine.module.emb(x)

    def fail(grad):
        engine.runtime.wait_for_early_steps()  # the others' partitions have stepped
        raise _Failed()

    out.register_hook(fail)
    m = engine.module
    with pytest.raises(_Failed):
        engine.backward(loss_of(m.l2(m.ln(torch.relu(m.l1(out)))), y))


@pytest.mark.parametrize("params_on", ["cpu", "nvme"])
def test_a_failed_backward_after_partitions_stepped_during_it_steps_none_twice(tmp_path,
                                                                               params_on):
    # strata.optimizer_during_backward: a backward that fails after some partitions stepped,
    # then the same batch again and step(): each parameter steps once in that window (the ones
    # that stepped are not staged again), the parameters' weights are their master weights' (with
    # parameters homed on NVMe, read back from them), and a checkpoint waits for the step.
    torch.manual_seed(0)
    config = make_config(tmp_path, 3, "cpu", "fp32", 1, 0.0)
    config["strata"]["optimizer_during_backward"] = True
    if params_on == "nvme":
        config["zero_optimization"]["offload_param"] = {
            "device": "nvme", "nvme_path": str(tmp_path / "nvme"), "max_in_cpu": 0,
            "buffer_count": 2, "buffer_size": 65536}
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    data = list(batches(3))
    engine.backward(loss_of(engine(data[0][0]), data[0][1]))
    engine.step()
    _failing_backward(engine, *data[1])
    assert any("had stepped during backward" in w for w in engine.warnings), engine.warnings
    with pytest.raises(RuntimeError, match="half taken"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.backward(loss_of(engine(data[1][0]), data[1][1]))
    engine.step()
    assert all(e.steps == 2 for e in engine.table.trained), [(e.name, e.steps) for e in engine.table.trained]
    engine(data[2][0])  # a forward: what is pending reaches the parameters
    for e, weights in zip(engine.table.trained, engine_weights(engine)):
        master = torch.empty(e.shard)
        engine.runtime.read_optimizer_state(e.gid, master, torch.empty(e.shard),
                                            torch.empty(e.shard))
        assert torch.equal(weights.reshape(-1).float(), master), e.name
    engine.save_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("offload, read_ahead", [("nvme", "auto"), ("nvme", 0), ("cpu", "auto")])
def test_a_step_that_clipping_scales_is_taken_anew_and_then_held(tmp_path, offload, read_ahead):
    # A bound under every norm: the first step's staged step is dropped and taken anew with the
    # clip coefficient; speculation then pauses (every later step clips too), and the plan holds.
    # With the state on NVMe and read-ahead room (strata.optimizer_read_ahead_bytes) each later
    # step is staged held: its state read during backward, stepped after it with the clipping
    # then known, as torch's step (staged_run compares them); without room, or with the state in
    # host memory (nothing to read), it is taken after backward.
    held = []
    engine, staged = staged_run(tmp_path, clipping=1e-3, offload=offload, held=held,
                                strata_block={"optimizer_read_ahead_bytes": read_ahead})
    holds = offload == "nvme" and read_ahead != 0
    assert (engine.runtime.optimizer_read_ahead_bytes > 0) == holds
    assert staged == [False] + [holds] * 7
    assert held == [False] + [holds] * 7
    assert engine.redone_steps == 1
    assert engine.last_redo_reason == "gradient clipping scales this step"


def change_lr_before_step_3(engine, reference, i):
    """A staged_run hook: both optimizers' learning rate set to 5e-3 between the fourth
    backward and its step."""
    if i == 3:
        for group in engine.optimizer.param_groups:
            group["lr"] = 5e-3
        for group in reference.opt.param_groups:
            group["lr"] = 5e-3


def test_a_learning_rate_changed_after_backward_is_the_one_stepped(tmp_path):
    engine, staged = staged_run(tmp_path, clipping=0.0, hook=change_lr_before_step_3)
    assert staged == [True, True, True, False, True, True, True, True]
    assert engine.redone_steps == 1
    assert "learning rate" in engine.last_redo_reason


def test_a_held_step_whose_learning_rate_changed_after_backward_is_taken_anew(tmp_path):
    # Held steps (clipping under every norm, the state on NVMe): nothing has stepped when the
    # change is seen, so the held step is dropped whole and taken anew at the new rate.
    held = []
    engine, staged = staged_run(tmp_path, clipping=1e-3, hook=change_lr_before_step_3, held=held)
    assert held == [False, True, True, False, True, True, True, True]
    assert engine.redone_steps == 2
    assert "learning rate" in engine.last_redo_reason


@pytest.mark.parametrize("stage", [2, 3])
def test_the_gradient_hook_takes_the_norm_of_a_window_of_one(tmp_path, stage):
    # One micro-batch a step: each gradient's norm is taken in its hook, where the gradient is
    # (on a GPU, without waiting), and the global norm from them is the one the host copies give;
    # with two micro-batches, or a second backward in the window, it is taken from the host
    # copies after backward (each hook sees one micro-batch's gradient, not the sum).
    torch.manual_seed(0)
    for accumulation, twice in ((1, False), (2, False), (1, True)):
        path = tmp_path / f"{accumulation}{twice}"
        engine, _, _, _ = strata.initialize(
            model=Net(), config=make_config(path, stage, "nvme", "fp32", accumulation, 1.0))
        for i, (x, y) in enumerate(batches(accumulation)):
            engine.backward(loss_of(engine(x), y))
            if twice:
                engine.backward(loss_of(engine(x), y) * 0.5)
            if i + 1 < accumulation:
                engine.step()
        taken = [e.grad_norm for e in engine.table.trained if e.grad_norm is not None]
        with_grads = [e for e in engine.table.trained if e.has_grad or e.host_grad is not None]
        if accumulation == 1 and not twice:
            assert len(taken) == len(with_grads) > 0
            hooked = engine._step.grad_norm(engine.loss_scale)
            for e in engine.table.trained:
                e.grad_norm = None
            assert hooked == pytest.approx(engine._step.grad_norm(engine.loss_scale), rel=1e-6)
        else:
            assert not taken
        engine.step()
        assert all(e.grad_norm is None for e in engine.table.trained)  # taken anew each step
        engine.close()


def test_a_second_backward_before_the_step_sums_the_gradients(tmp_path):
    # Two backward passes in the boundary micro-batch: the second changes gradients whose step
    # was staged; that step is dropped and the step takes the sum, as torch's would. Staging then
    # pauses while steps keep seeing second gradients (no step's work is thrown away again).
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, "nvme", "fp32", 1, 0.0))
    for x, y in batches(3):
        engine.backward(loss_of(engine(x), y))
        engine.backward(loss_of(engine(x), y) * 0.5)
        engine.step()
        (loss_of(reference(x), y) * 1.5).backward()
        torch_adamw.step()
        torch_adamw.zero_grad()
    assert engine.redone_steps == 1
    assert "changed after its step was staged" in engine.last_redo_reason
    assert not engine.last_step_stats["optimizer"].get("staged", False)
    for ours, theirs in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_staged_steps_with_accumulation_match_plain_torch(tmp_path, dtype):
    engine, reference, losses = train_both(tmp_path, 3, "nvme", dtype, accumulation=2,
                                           clipping=0.0)
    tolerance = 1e-5 if dtype == "fp32" else 2e-2
    for ours, theirs in losses:
        assert ours == pytest.approx(theirs, rel=tolerance, abs=tolerance)
    assert engine.redone_steps == 0 and engine.last_step_stats["optimizer"]["staged"]
    for ours, theirs in zip(engine_weights(engine), reference.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(),
                                   rtol=tolerance, atol=tolerance)


class FailingRuntime:
    """engine.runtime with one failure injected: the `nth` acquire matching `which(id, tier,
    traced)` raises `error`."""

    def __init__(self, runtime, which, nth, error):
        self._runtime, self._which, self._left, self._error = runtime, which, nth, error

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def acquire(self, id, tier, traced=True, overwrite=False):
        if self._left > 0 and self._which(id, tier, traced):
            self._left -= 1
            if self._left == 0:
                raise self._error
        return self._runtime.acquire(id, tier, traced=traced, overwrite=overwrite)


def assert_nothing_held(engine):
    """No gradient is left pinned or kept: each gradient partition can be dropped."""
    for e in engine.table.trained:
        assert not e.has_grad and e.param.grad is None, e.name
        if e.partitioned:
            engine.runtime.discard(e.gid)  # refused while pinned


def test_a_step_that_fails_part_way_raises_its_own_error_and_holds_nothing(tmp_path):
    # The third host gradient read for the clipping norm cannot be had: the step raises that
    # error (not one of the clean-up's), holds no pin, keeps no gradient, and training goes on.
    # (Two micro-batches a step: the norm is taken from the host copies, not in the hooks.)
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path, 3, "nvme", "fp32", 2, clipping=1e-3))
    real = engine.runtime
    data = list(batches(6))
    for i, (x, y) in enumerate(data):
        engine.backward(loss_of(engine(x), y))
        if i == 3:
            grads = {e.gid for e in engine.table.trained if e.partitioned}
            engine.runtime = FailingRuntime(real, lambda id, tier, traced: id in grads and
                                            tier == "host" and not traced, 3,
                                            RuntimeError("injected: no room for a gradient"))
            with pytest.raises(RuntimeError, match="injected: no room for a gradient"):
                engine.step()
            engine.runtime = real
            assert_nothing_held(engine)
        else:
            engine.step()
    assert engine.global_steps == 2


def test_a_step_that_cannot_be_staged_is_taken_after_backward(tmp_path):
    # The host copy of one parameter cannot be had while backward stages its step: backward goes
    # on, the staged step is dropped and the step taken after backward, equal to torch's.
    from strata import _strata
    torch.manual_seed(0)
    model = Net()
    reference = Reference(copy.deepcopy(model), torch.float32, 0.0)
    engine, _, _, _ = strata.initialize(  # parameters in host memory: staged into their copies
        model=model, config=make_config(tmp_path, 3, "cpu", "fp32", 1, 0.0))
    real = engine.runtime
    target = next(e for e in engine.table.trained if e.partitioned)
    for i, (x, y) in enumerate(batches(3)):
        if i == 1:
            engine.runtime = FailingRuntime(
                real, lambda id, tier, traced: id == target.pid and not traced, 1,
                _strata.Error("injected: the host tier is full"))
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        engine.runtime = real
        ref_loss = reference.micro_step(x, y, 1)
        reference.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-5)
        if i == 1:
            assert engine.redone_steps == 1
            assert f"staging the step of {target.name} failed" in engine.last_redo_reason
            assert "injected: the host tier is full" in engine.last_redo_reason
    assert engine.last_step_stats["optimizer"]["staged"]  # staging went on the step after
    for ours, theirs in zip(engine_weights(engine), reference.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(), rtol=1e-5, atol=1e-5)


def test_the_weights_can_be_read_between_backward_and_step(tmp_path):
    # A staged step is open: module_state_dict reads the committed (previous step's) weights.
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path, 3, "nvme", "fp32", 1, 0.0))
    data = list(batches(2))
    x, y = data[0]
    engine.backward(loss_of(engine(x), y))
    engine.step()
    before = engine.module_state_dict()
    x, y = data[1]
    engine.backward(loss_of(engine(x), y))
    assert engine._step.staged is not None
    during = engine.module_state_dict()
    for name, value in before.items():
        assert torch.equal(during[name], value), name
    engine.step()
    assert engine.last_step_stats["optimizer"]["staged"]
    assert not torch.equal(engine.module_state_dict()["l1.weight"], before["l1.weight"])


def test_weights_homed_on_nvme_that_cannot_be_written_after_a_step_are_written_before_the_next(
        tmp_path):
    # Parameters on NVMe beyond max_in_cpu take their new weights from the committed master
    # weights after the step; when one cannot be written then, the step says so and the next
    # forward writes it: training goes on equal to torch's.
    from strata import _strata
    torch.manual_seed(0)
    model = Net()
    reference = Reference(copy.deepcopy(model), torch.float32, 0.0)
    config = make_config(tmp_path, 3, "nvme", "fp32", 1, 0.0)
    config["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
    config["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
        "warmup_type": "linear"}}
    engine, _, _, _ = strata.initialize(model=model, config=config)
    real = engine.runtime
    target = [e for e in engine.table.trained if e.partitioned][-1]
    for i, (x, y) in enumerate(batches(5)):
        rate = engine.get_lr()[0]  # this step's rate (the schedule steps after each step)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        if i == 1:
            engine.runtime = FailingRuntime(
                real, lambda id, tier, traced: id == target.pid and not traced, 1,
                _strata.Error("injected: no room for the weights"))
            with pytest.raises(strata.Error, match=r"the optimizer step committed, but the new "
                                                   r"weights of \d+ parameters could not be "
                                                   r"written yet \(" + target.name):
                engine.step()
            engine.runtime = real
        else:
            engine.step()
        # The step's bookkeeping was done even when its weights were not all written.
        assert engine.global_steps == i + 1
        reference.opt.param_groups[0]["lr"] = rate
        ref_loss = reference.micro_step(x, y, 1)
        reference.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-5), i
    for ours, theirs in zip(engine_weights(engine), reference.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(), rtol=1e-5, atol=1e-5)


def test_an_nvme_path_whose_parents_do_not_exist_is_made(tmp_path):
    config = make_config(tmp_path / "a" / "b", 3, "nvme", "fp32")
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    engine.backward(loss_of(engine(next(batches(1))[0]), next(batches(1))[1]))
    assert (tmp_path / "a" / "b" / "nvme").is_dir()
    (tmp_path / "file").write_text("")
    config = make_config(tmp_path / "file", 3, "nvme", "fp32")
    with pytest.raises(strata.Error, match=r"nvme_path must be a directory that exists or can "
                                           r"be made: mkdir -p .*file/nvme"):
        strata.initialize(model=Net(), config=config)


def _decay_groups(model, lr=None):
    """The groups fine-tuning scripts make: decay for the weights, none for biases and norms
    (whose lr differs too, when `lr` is given)."""
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or n.startswith("ln")]
    decay = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    return [{"params": decay, "weight_decay": 0.1},
            dict({"params": no_decay, "weight_decay": 0.0}, **({"lr": lr} if lr else {}))]


def _train_beside(engine, reference, torch_optimizer, steps=4):
    for x, y in batches(steps):
        step_both(engine, reference, torch_optimizer, x, y)
        assert engine.get_lr() == pytest.approx([g["lr"] for g in torch_optimizer.param_groups])
    for ours, theirs in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_model_parameters_groups_keep_their_own_weight_decay_and_lr(tmp_path, stage):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, stage, "nvme", "fp32", accumulation=1, clipping=0.0)
    engine, _, _, _ = strata.initialize(model=model, config=config,
                                        model_parameters=_decay_groups(model, lr=5e-3))
    torch_adamw = torch.optim.AdamW(_decay_groups(reference, lr=5e-3), lr=1e-2,
                                    weight_decay=0.01)
    _train_beside(engine, reference, torch_adamw)


def test_a_client_optimizers_groups_keep_their_own_weight_decay_and_betas(tmp_path):
    """A client optimizer's groups keep their own weight decay and betas (each given with its
    group's steps; groups that differed in betas were refused); a group's eps, which the
    Runtime's optimizer holds once, is refused by name where it differs."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    del config["optimizer"]

    def groups_of(net):
        groups = _decay_groups(net)
        groups[1]["betas"] = (0.8, 0.9)
        return groups
    engine, _, _, _ = strata.initialize(
        model=model, config=config, optimizer=torch.optim.AdamW(groups_of(model), lr=1e-2))
    torch_adamw = torch.optim.AdamW(groups_of(reference), lr=1e-2)
    _train_beside(engine, reference, torch_adamw)
    groups = _decay_groups(Net())
    groups[1]["eps"] = 1e-6
    with pytest.raises(ValueError, match=r"the optimizer's param group 1 has eps 1e-06 where the "
                                         r"optimizer has 1e-08"):
        strata.initialize(model=Net(), config=config, optimizer=torch.optim.AdamW(groups))
    net = Net()
    client = torch.optim.AdamW(_decay_groups(net))
    client.param_groups[1]["betas"] = (0.9, 1.0)  # (torch's AdamW refuses it when made)
    with pytest.raises(ValueError, match=r"param group 1's betas are \(0.9, 1.0\); accepted: two "
                                         r"numbers, each at least 0 and below 1"):
        strata.initialize(model=net, config=config, optimizer=client)


def test_a_schedule_built_on_the_client_optimizer_drives_the_engines_rate(tmp_path):
    # transformers' get_linear_schedule_with_warmup(optimizer, ...) made before initialize: it
    # used to set the rates of an optimizer the engine never read.
    import transformers
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1, clipping=0.0)
    del config["optimizer"]
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = transformers.get_linear_schedule_with_warmup(client, 2, 6)
    engine, _, _, returned = strata.initialize(model=model, config=config, optimizer=client,
                                               lr_scheduler=schedule)
    assert returned is schedule and engine.get_lr() == [0.0]
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference_schedule = transformers.get_linear_schedule_with_warmup(torch_adamw, 2, 6)
    rates = []
    for x, y in batches(5):
        rates.append(engine.get_lr()[0])
        step_both(engine, reference, torch_adamw, x, y, reference_schedule)
        assert engine.get_lr() == pytest.approx(reference_schedule.get_last_lr())
    assert rates == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.005])
    for ours, theirs in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    # A schedule of some other optimizer is refused by name.
    other = torch.optim.AdamW(Net().parameters(), lr=1e-2)
    config = make_config(tmp_path / "other", 3, "cpu", "fp32")
    del config["optimizer"]
    with pytest.raises(ValueError, match="lr_scheduler sets the rates of an optimizer that was "
                                         "not given to initialize"):
        model = Net()
        strata.initialize(model=model, config=config, optimizer=torch.optim.AdamW(
            model.parameters()), lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))


def test_deepspeeds_engine_api_as_trainers_call_it(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "bf16", accumulation=2, clipping=1.0)
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    assert engine.gradient_accumulation_steps() == 2
    assert engine.zero_optimization_stage() == 3
    assert engine.bf16_enabled() and not engine.fp16_enabled()
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    with engine.no_sync():  # one process: nothing is reduced during backward anyway
        x, y = next(batches(1))
        engine.backward(loss_of(engine(x), y))
    engine.step()
    # step() without a backward is refused and counts nothing.
    with pytest.raises(RuntimeError, match=r"step: no backward\(\) since the last step\(\)"):
        engine.step()
    assert engine.micro_steps == 1 and engine.global_steps == 0
    # retain_graph: a second backward through the same graph adds to the gradients.
    x, y = next(batches(2, seed=5))
    loss = loss_of(engine(x), y)
    engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    assert engine.get_global_grad_norm() > 0
    engine.save_16bit_model(tmp_path / "out")
    engine.save_16bit_model(tmp_path / "out", "model.safetensors")
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin")
    whole = engine.module_state_dict()
    assert saved.keys() == whole.keys()
    assert all(saved[n].dtype == torch.bfloat16 and torch.equal(saved[n], whole[n]) for n in saved)
    from safetensors.torch import load_file
    assert all(torch.equal(t, whole[n]) for n, t in
               load_file(tmp_path / "out" / "model.safetensors").items())


@pytest.mark.parametrize("stage", [0, 2])
def test_a_second_backward_sums_into_the_kept_gradient_not_into_one_a_hook_kept(tmp_path,
                                                                                stage):
    # Stage 2 on the host keeps autograd's gradient tensor as its sum (no copy) and adds a second
    # backward's to it: the step must be plain torch's on the sum of both; and a tensor hook that
    # holds the gradient it saw must find it as it was (strata relies on autograd giving .grad a
    # copy of a gradient someone else holds).
    engine, _, reference, torch_optimizer = _beside_plain_torch(tmp_path, stage)
    seen = []
    engine.module.l1.weight.register_hook(lambda g: seen.append((g, g.clone())) or g)
    # No clipping, two steps: neither clipping nor Adam's first step sees the gradient's scale.
    for i, (x, y) in enumerate(batches(2)):
        loss = loss_of(engine(x), y)
        if i == 0:
            engine.backward(loss, retain_graph=True)
        engine.backward(loss)
        engine.step()
        ref_loss = loss_of(reference(x), y)
        ((2 if i == 0 else 1) * ref_loss).backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    assert len(seen) == 3 and all(torch.equal(g, kept) for g, kept in seen)
    for ours, theirs in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)


def test_backward_without_scaling_by_the_accumulation_steps(tmp_path):
    config = make_config(tmp_path, 0, "cpu", "fp32", accumulation=2, clipping=1e6)
    engine, _, _, _ = strata.initialize(model=Scale(), config=config)
    # Each micro-batch's gradient is 1 per element: summed over two micro-batches, halved (the
    # norm over 256 elements 16) or not (32).
    for scale_wrt_gas, norm in ((True, 16.0), (False, 32.0)):
        for _ in range(2):
            engine.backward(engine(torch.ones(256)), scale_wrt_gas=scale_wrt_gas)
            engine.step()
        assert engine.get_global_grad_norm() == pytest.approx(norm)


def _one_step(engine):
    x, y = next(batches(1))
    engine.backward(loss_of(engine(x), y))
    engine.step()


def test_the_last_reference_to_an_engine_frees_its_runtime_without_the_cycle_collector(
        tmp_path):
    import gc
    import weakref
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1)
    model = Net()
    gc.collect()
    gc.disable()
    try:
        engine, optimizer, _, _ = strata.initialize(model=model, config=config)
        _one_step(engine)
        engine_ref, runtime_ref = weakref.ref(engine), weakref.ref(engine.runtime)
        del engine, optimizer
        assert engine_ref() is None and runtime_ref() is None
    finally:
        gc.enable()
    # Its NVMe store is closed: another engine takes the same nvme_path at once.
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    _one_step(engine)


def test_close_gives_back_the_runtime_and_the_modules_hooks(tmp_path):
    import weakref
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1)
    model = Net()
    with strata.initialize(model=model, config=config)[0] as engine:
        _one_step(engine)
        runtime_ref = weakref.ref(engine.runtime)
        state = engine.module_state_dict()
    assert runtime_ref() is None
    # Its NVMe store went with it (strata.nvme_keep_files is false by default).
    assert not list((tmp_path / "nvme").rglob("swap-*")), list((tmp_path / "nvme").rglob("*"))
    # Its hooks are gone; one is left that refuses the placeholders (their shape, no bytes),
    # where forward would compute with zeros and state_dict() (save_pretrained) save zeros.
    assert len(model.l1._forward_pre_hooks) == 1 and not model.l1._forward_hooks
    assert "forward" not in model.l1.__dict__ and "load_state_dict" not in model.__dict__
    (x, _), = batches(1)
    with pytest.raises(RuntimeError, match=r"forward of Embedding \(weight\): its weights were "
                                           "partitioned by a strata engine that is closed"):
        model(x)
    with pytest.raises(RuntimeError, match=r"state_dict\(\) of .*engine.release\(\)"):
        model.state_dict()
    with pytest.raises(ValueError, match=r"initialize: 3 parameters of the model \(emb.weight"):
        strata.initialize(model=model, config=config)
    with pytest.raises(RuntimeError, match="the engine is closed"):
        _one_step(engine)
    engine.close()  # again: nothing
    # The module takes its weights back as a plain module, and a new engine the same folder.
    model.load_state_dict(state, assign=True)
    torch.testing.assert_close(model.state_dict(), state)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    _one_step(engine)


def test_a_closed_engines_parts_name_it(tmp_path):
    """After close every path says the engine is closed (its parts hold a stand-in that names
    it, not None): a save, the optimizer's load, and a step of a backward made before close; a
    backward through a graph whose engine was dropped refuses, where it would compute its
    gradients with the placeholders."""
    import gc
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1)
    engine, optimizer, _, _ = strata.initialize(model=Net(), config=config)
    _one_step(engine)
    saved = optimizer.state_dict()
    (x, y), = batches(1)
    loss = loss_of(engine(x), y)
    engine.close()
    for call in (lambda: engine.save_checkpoint(tmp_path / "c"),
                 lambda: optimizer.load_state_dict(saved),
                 lambda: (engine.backward(loss), engine.step())):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            call()
    dropped, _, _, _ = strata.initialize(model=Net(), config=config)
    loss = loss_of(dropped(x), y)
    del dropped
    gc.collect()
    with pytest.raises(RuntimeError, match="backward through a forward of a strata engine "
                                           "that is gone"):
        loss.backward()


class _InplaceRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.out = torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True), \
            torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class _InplaceAdd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        h += x
        return self.out(h)


class _Scale(torch.nn.Module):  # its output a view of what it computed with its parameter
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 80))

    def forward(self, x):
        return (x.reshape(x.shape[0], -1) * self.scale).view(x.shape)


class _InplaceOnAView(torch.nn.Module):  # that view changed in place by its parent
    def __init__(self):
        super().__init__()
        self.fc, self.scaled, self.out = torch.nn.Linear(16, 16), _Scale(), \
            torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.scaled(self.fc(x))
        torch.relu_(h)
        return self.out(h)


def test_stage3_a_retained_graphs_second_backward_lends_the_views_modules_again(tmp_path):
    # A module's output that is a view is hooked twice (the view, its base's node), run once a
    # backward: a retained graph's second backward must lend the module's parameters again.
    torch.manual_seed(0)
    model = _InplaceOnAView()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    engine, _, _, _ = strata.initialize(model=model, config=config)
    x = torch.randn(2, 5, 16)
    loss = engine(x).pow(2).mean()
    engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    ref_loss = reference(x).pow(2).mean()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    for (name, p), theirs in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(strata.safe_get_full_grad(p), theirs.grad, rtol=1e-5,
                                   atol=1e-7, msg=name)


class _WithAViewOfItsInput(torch.nn.Module):  # a second output its parent leaves unused
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        return torch.tanh(x @ self.w), x.view(x.shape)


class _WithAViewMadeBeforeItsWeight(_WithAViewOfItsInput):
    def forward(self, x):
        h = x * 1.0  # made in the module's forward, before its weight is used
        return torch.tanh(h @ self.w), h.view(h.shape)


class _Stacked(torch.nn.Module):  # layers whose second output is left unused
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0] + x
        return x


def _lent_at_each_gradient(tmp_path, layer, watched, budget=None):
    """Six `layer`s stacked at stage 3, one backward: the bytes lent as each layer's `watched`
    parameter's gradient is made (the gradients checked against plain torch's)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(layer() for _ in range(6))
    reference = copy.deepcopy(layers)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    if budget is not None:
        config["strata"]["device_budget_bytes"] = budget
    engine, _, _, _ = strata.initialize(model=_Stacked(layers), config=config)
    lent = []
    for each in engine.module.layers:
        getattr(each, watched).register_post_accumulate_grad_hook(
            lambda p: lent.append(engine._lending.table.lent_bytes()))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3))
    engine.backward(engine(x).pow(2).mean())
    _Stacked(reference)(x).pow(2).mean().backward()
    for p, theirs in zip(engine.module.parameters(), reference.parameters()):
        torch.testing.assert_close(strata.safe_get_full_grad(p), theirs.grad, rtol=1e-5, atol=1e-7)
    return lent


@pytest.mark.parametrize("layer", [_WithAViewOfItsInput, _WithAViewMadeBeforeItsWeight])
def test_stage3_a_view_of_a_modules_input_does_not_lend_it_again_late_in_backward(tmp_path,
                                                                                  layer):
    # The node that made a view output's base was hooked to lend the module's parameters before
    # its backward: where the view is of the module's input (or of a tensor the module made
    # before it used its weight), that node runs after the module's backward, and lent each
    # layer's weight again once its gradient had given it back, held to the end of backward (a
    # device budget of two layers ran out).
    assert _lent_at_each_gradient(tmp_path, layer, "w", budget=2 * 64 * 64 * 4) == \
        [64 * 64 * 4] * 6


class _Counted(torch.Tensor):
    """An input whose torch functions a library's tensor subclass sees (and counts)."""
    linears = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            _Counted.linears += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_stage3_a_linears_input_subclass_still_sees_its_torch_function(tmp_path):
    # nn.Linear at stage 3 skips the placeholder guard's dispatch for a plain tensor input: a
    # subclass's own __torch_function__ must still run for its input (skipped, it would not).
    # (Not yet as plain torch: beside the guarded weight, torch's default handler of the
    # subclass declines, and the Linear's output is a plain tensor; plain torch keeps the
    # subclass, and the next Linear sees it too.)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    engine, _, _, _ = strata.initialize(model=_InplaceRelu(), config=config)
    x = torch.randn(2, 5, 16).as_subclass(_Counted)
    _Counted.linears = 0
    engine.backward(engine(x).pow(2).mean())
    assert _Counted.linears >= 1
    with torch.no_grad():
        engine(x)
    assert _Counted.linears >= 2


class _Routed(torch.overrides.TorchFunctionMode):
    """A user's torch function mode that runs F.linear on an input of its own subclass."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and type(args[0]) is torch.Tensor:
            return func(args[0].as_subclass(_Counted), *args[1:], **kwargs)
        return func(*args, **kwargs)


def test_stage3_the_linears_skip_of_the_guard_leaves_modes_and_closed_engines_alone(tmp_path):
    # The skip ran a mode's handler with subclasses' dispatch off (the subclass it made saw
    # nothing), and a dropped engine's Linear, its forward called directly, computed with the
    # placeholder left (one element, expanded) where the guard refuses it by name.
    import gc
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False))
    engine, _, _, _ = strata.initialize(model=model, config=config)
    with torch.no_grad():
        engine(torch.randn(2, 16))
        _Counted.linears = 0
        with _Routed():
            engine(torch.randn(2, 16))
    assert _Counted.linears == 1
    del engine, _
    gc.collect()
    with torch.no_grad(), pytest.raises(RuntimeError, match="0.weight: linear.*closed"):
        model[0].forward(torch.randn(2, 16))


class _ViewOfWhatItsScaleMade(torch.nn.Module):  # its weight's gradient made before the view's
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 64))

    def forward(self, x):
        b = x * self.scale
        return torch.tanh(b @ self.w), b.view(b.shape)


def test_stage3_a_backward_lends_no_parameter_whose_gradient_it_made(tmp_path):
    # A view's base node that takes the module's scale runs after the module's weight's gradient
    # was made: it lent the weight again, held to the end of backward, a layer more each time.
    assert _lent_at_each_gradient(tmp_path, _ViewOfWhatItsScaleMade, "scale") == [64 * 4] * 6


class _ChangesASavedTensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.fc, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), \
            torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.pre(x)
        y = self.fc(h)
        h.mul_(2)  # fc saved h for its weight's gradient
        return self.out(y + h)


def test_stage3_a_saved_tensor_changed_in_place_is_refused_as_plain_torch_refuses_it(tmp_path):
    # Under the engine's saved-tensor hooks autograd does not check a saved tensor's version:
    # fc's weight's gradient was computed from the changed h, silently, where plain torch
    # refuses the backward.
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    plain = _ChangesASavedTensor()
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as theirs:
        plain(x).pow(2).mean().backward()
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    engine, _, _, _ = strata.initialize(model=_ChangesASavedTensor(), config=config)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: "
                                           r"\[torch.FloatTensor \[4, 16\]\] is at version 1; "
                                           r"expected version 0"):
        engine.backward(engine(x).pow(2).mean())
    assert "[torch.FloatTensor [4, 16]]" in str(theirs.value)


class _OutsideOwner(torch.nn.Module):  # a parent computes with its child's weight
    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.linear(self.fc(x), self.head.weight)


class _ParameterList(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16, 16) / 4)
                                         for _ in range(2))

    def forward(self, x):
        for w in self.ws:
            x = torch.tanh(x @ w)
        return x


class _TiedTransposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.fc = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(self.wte(x)) @ self.wte.weight.t()


class _CalledTwice(torch.nn.Module):  # one module twice in a forward
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class _BatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), \
            torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


@pytest.mark.parametrize("cls,autocast,dtype", [
    (_InplaceRelu, False, "fp32"), (_InplaceAdd, False, "fp32"), (_InplaceRelu, True, "fp32"),
    (_InplaceOnAView, False, "fp32"),
    (_OutsideOwner, False, "fp32"), (_ParameterList, False, "fp32"),
    (_TiedTransposed, False, "fp32"), (_CalledTwice, False, "fp32"), (_BatchNorm, False, "bf16")])
def test_stage3_runs_what_models_do_with_their_parameters_as_plain_torch(tmp_path, cls, autocast,
                                                                         dtype):
    # In-place ops on a linear's 3-D output, torch.autocast, parameters used outside their
    # owner's forward, bf16 with BatchNorm's float buffers: each crashed at stage 3, naming
    # nothing. A module's output that is a view, changed in place by its parent, lost the hook
    # that lends the module's parameters again for its backward (its gradient's shape refused).
    torch.manual_seed(0)
    model = cls()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    reference = MixedPrecisionAdamW(copy.deepcopy(model), torch_dtype, clipping=0.0)
    config = make_config(tmp_path, 3, "cpu", dtype, accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    engine, _, _, _ = strata.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        if cls is _TiedTransposed:
            x = torch.randint(0, 32, (2, 5), generator=gen)
        elif cls is _BatchNorm:
            x = torch.randn(6, 16, generator=gen).to(torch_dtype)
        else:
            x = torch.randn(2, 5, 16, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref_loss = reference.model(x).float().pow(2).mean()
        reference.backward(ref_loss, 1)
        reference.step()
        tolerance = 1e-5 if dtype == "fp32" and not autocast else 2e-2
        assert loss.item() == pytest.approx(ref_loss.item(), rel=tolerance)
    assert engine.last_step_stats["runtime"]["mode"] == "planned"


class _GeneratesFirst(torch.nn.Module):
    """Its head's weight read outside the head's forward only with gradients on, as TRL's GRPO
    generates (no gradients, the head through its own forward) before a training forward that
    reads lm_head.weight itself (its fused loss)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if torch.is_grad_enabled():
            return torch.nn.functional.linear(h, self.head.weight[:8])
        return self.head(h)


def test_a_parameter_used_outside_its_owner_only_in_training_is_found_after_generation(tmp_path):
    """The first forward ran without gradients and never read the head's weight outside the
    head; the first forward with gradients looks again and lends it (it was refused by name,
    as a read of the placeholder, and only strata.register_external_parameter got past)."""
    engine, _, reference, adamw = _beside_plain_torch(tmp_path, 3, _GeneratesFirst)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        with torch.no_grad():  # (generation)
            torch.testing.assert_close(engine(x), reference(x), rtol=1e-5, atol=1e-6)
        _square_step_beside(engine, reference, adamw, x)
    assert engine._lending.discovered_with_grad


class _ScoresAfterGenerating(torch.nn.Module):
    """As TRL's RLOO (and GRPO with num_iterations 2): generation (no gradients, the head through
    its own forward), then, still without gradients, the old log-probabilities through a fused
    head that reads the head's weight and bias itself, then training through that fused head."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, fused=False):
        h = torch.tanh(self.fc(x))
        if fused:  # (weight and bias placeholders given to one torch function)
            return torch.nn.functional.linear(h, self.head.weight, self.head.bias)[:, :8]
        return self.head(h)


@pytest.mark.parametrize("scored", [True, False])
def test_a_parameter_first_used_outside_its_owner_in_a_later_forward_is_lent_there(tmp_path,
                                                                                 scored):
    """Neither the first forward (generation) nor a first with gradients had met the head's
    weight read outside the head: a later forward of the model lends it as a torch function
    reads it, registered to the model (it was refused by name: RLOO stopped at its first step
    at stage 3 unless strata.register_external_parameter was called); first met without
    gradients (`scored`: RLOO's old log-probabilities) or in a training forward, whose backward
    needs it. Outside the model's forward a read is still refused."""
    engine, _, reference, adamw = _beside_plain_torch(tmp_path, 3, _ScoresAfterGenerating,
                                                      stage3_param_persistence_threshold=0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for i in range(3):
        with torch.no_grad():
            torch.testing.assert_close(engine(x), reference(x), rtol=1e-5, atol=1e-6)
            if scored:
                torch.testing.assert_close(engine(x, fused=True), reference(x, fused=True),
                                           rtol=1e-5, atol=1e-6)
        fused = scored or i > 0  # (else the first training forward reads it through the head)
        loss = engine(x, fused=fused).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref_loss = reference(x, fused=fused).pow(2).mean()
        ref_loss.backward()
        adamw.step()
        adamw.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for ours, theirs in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    assert engine.module.head.weight in engine.module._strata_external_parameters
    with pytest.raises(RuntimeError, match=r"head.weight: __getitem__\(\) of a parameter ZeRO "
                                           "stage 3 partitions, outside its module's forward"):
        engine.module.head.weight[:8]
    engine.close()


def test_a_weights_data_read_first_in_a_later_forward_is_lent_there_too(tmp_path):
    """`.data` (a property, not a torch function) read outside its module within the model's
    forward, first after the forwards that look for such uses: lent, as a torch function's read
    is (it was refused by name), and plain torch's values."""
    class ReadsData(_ScoresAfterGenerating):
        def forward(self, x, fused=False):
            if fused:
                return torch.tanh(self.fc(x)) @ self.head.weight.data.t()[:, :8]
            return super().forward(x)

    engine, _, reference, adamw = _beside_plain_torch(tmp_path, 3, ReadsData)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    _square_step_beside(engine, reference, adamw, x)  # (the head through its own forward)
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(engine(x, fused=True), reference(x, fused=True),
                                       rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"head.weight.data at ZeRO stage 3 outside"):
        engine.module.head.weight.data
    engine.close()


def test_a_late_read_past_the_device_budget_names_what_it_lends_and_the_way_out(tmp_path):
    """A weight first read outside its module in a later forward, while another module's own
    weight is lent, with no room for both: the full budget is named with the weight and what
    to do (raise the budget, or lend it around its reader alone)."""
    class Reader(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)
            self.head = [head]  # (not a submodule: read outside its own module)

        def forward(self, x, late):
            h = x @ self.w
            return torch.nn.functional.linear(h, self.head[0].weight) if late else h

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(64, 64)
            self.reader = Reader(self.head)

        def forward(self, x, late=False):
            h = self.reader(x, late)
            return h if late else self.head(h)

    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    config["strata"]["device_budget_bytes"] = 24576  # (room for one 64 x 64 weight)
    engine, _, _, _ = strata.initialize(model=Model(), config=config)
    x = torch.randn(2, 64)
    engine.backward(engine(x).sum())
    engine.step()
    with torch.no_grad(), pytest.raises(strata.Error, match=r"budget of 24576 bytes .* \(lending "
                                        r"head.weight, read outside its module's forward, .* "
                                        r"raise strata.device_budget_bytes, or strata."
                                        r"register_external_parameter"):
        engine(x, late=True)
    engine.close()


def test_sparse_embeddings_are_refused_by_name(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16, sparse=True), torch.nn.Linear(16, 4))
    with pytest.raises(ValueError, match="0 is a Embedding with sparse=True: sparse gradients "
                                         "are not supported"):
        strata.initialize(model=model, config=make_config(tmp_path, 3, "cpu", "fp32"))


def test_a_model_in_torch_s_data_parallel_wrapper_is_refused_by_name(tmp_path):
    # Its hooks would reduce the gradients a second time across ranks (DDP; at stage 3 torch's
    # reducer asserts on the partitions): the module inside is what strata takes.
    with pytest.raises(ValueError, match="wrapped in torch's DataParallel, whose hooks would "
                                         ".*accepted: the module inside it"):
        strata.initialize(model=torch.nn.DataParallel(Net()),
                          config=make_config(tmp_path, 3, "cpu", "fp32"))


def test_the_first_forward_leaves_nothing_lent_and_registers_no_module_as_its_own_user(tmp_path):
    # The first forward looks for parameters used outside their owner's forward; the engine's
    # own lending inside it is not such a use (it held every partition lent past its module).
    engine, _, _, _ = strata.initialize(model=Net(), config=make_config(tmp_path, 3, "cpu",
                                                                        "fp32"))
    x, y = next(batches(1))
    loss = loss_of(engine(x), y)
    assert not any(engine._lending.holders.values())
    assert not [e.name for e in engine.table.trained
                if e.partitioned and strata.parameters.data_of(e.param).numel()]
    assert not any(m.__dict__.get("_strata_external_parameters") for m in engine.module.modules())
    engine.backward(loss)
    engine.step()


def test_reading_a_parameters_dtype_or_device_outside_its_module_lends_nothing(tmp_path):
    # transformers' models read self.dtype (their first parameter's) in forward: no use of it.
    class ReadsDtype(Net):
        def forward(self, x):
            assert self.emb.weight.dtype == torch.float32 and self.l2.weight.device.type == "cpu"
            return super().forward(x)

    engine, _, _, _ = strata.initialize(model=ReadsDtype(), config=make_config(tmp_path, 3, "cpu",
                                                                               "fp32"))
    x, y = next(batches(1))
    engine.backward(loss_of(engine(x), y))
    engine.step()
    assert not any(m.__dict__.get("_strata_external_parameters") for m in engine.module.modules())


def test_a_modules_own_pre_hooks_see_its_weights_at_every_forward(tmp_path):
    # weight_norm, pruning and the like compute from the weights in a forward pre-hook: the
    # engine lends them first (they saw the empty placeholder from the second forward on).
    model = Net()
    seen = []
    model.l1.register_forward_pre_hook(lambda module, args: seen.append(module.weight.numel()))
    engine, _, _, _ = strata.initialize(model=model, config=make_config(tmp_path, 3, "cpu",
                                                                        "fp32"))
    for x, y in batches(3):
        engine.backward(loss_of(engine(x), y))
        engine.step()
    assert seen == [64 * 32] * 3


def test_after_close_the_module_trains_as_a_plain_module(tmp_path):
    model = Net()
    with strata.initialize(model=model, config=make_config(tmp_path, 2, "cpu", "fp32"))[0] \
            as engine:
        _one_step(engine)
    x, y = next(batches(1))
    loss_of(model(x), y).backward()  # the engine's gradient hooks are gone with it
    assert all(p.grad is not None for p in model.parameters())


def test_torch_compile_of_the_module_trains_as_plain_torch_and_a_compiled_model_is_refused(
        tmp_path):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    compiled = torch.compile(engine.module, backend="eager")  # left eager at stage 3
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches(3):
        _step_beside(engine, reference, torch_adamw, x, y, forward=compiled)
    with pytest.raises(ValueError, match="the model is torch.compile'd; accepted: the module "
                                         r"itself \(model._orig_mod\)"):
        strata.initialize(model=torch.compile(Net()), config=make_config(tmp_path / "b", 3,
                                                                         "cpu", "fp32"))


def test_the_first_call_through_the_module_finds_a_weight_used_outside_its_owner(tmp_path):
    # generate() or an eval loop may call engine.module before engine(...) ever runs.
    torch.manual_seed(0)
    model = _TiedTransposed()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32")
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    engine, _, _, _ = strata.initialize(model=model, config=config)
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(engine.module(ids), reference(ids))


def test_a_parameter_used_for_a_loss_kept_on_its_module_trains_as_plain_torch(tmp_path):
    # A mixture of experts' auxiliary loss: kept on the module, not in its output.
    class Side(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            self.aux = (self.w * self.w).mean()
            return x

    class WithAux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.side, self.out = Side(), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.out(self.side(x)).pow(2).mean() + self.side.aux

    torch.manual_seed(0)
    model = WithAux()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    engine, _, _, _ = strata.initialize(model=model, config=config)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        ref_loss = reference(x)
        ref_loss.backward()
        torch_adamw.step()
        torch_adamw.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert not any(engine._lending.holders.values())


@pytest.mark.parametrize("max_in_cpu", [0, 10**9])
def test_nvme_parameters_within_max_in_cpu_step_without_reading_the_state_back(tmp_path,
                                                                                 max_in_cpu):
    """Parameters homed on NVMe: within offload_param.max_in_cpu (DeepSpeed's default 1e9) the
    step writes their new weights into their host copies, reading the optimizer state once;
    beyond it they are read back from the committed master weights (the state read twice). Both
    train as plain torch."""
    torch.manual_seed(0)
    model = Net()
    reference = Reference(copy.deepcopy(model), torch.float32, 0.0)
    config = make_config(tmp_path, 3, "nvme", "fp32", 1, 0.0)
    config["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert engine._step.refresh == (max_in_cpu == 0)
    def storage_read():  # what this process read from the disk (O_DIRECT: what it asked for)
        with open("/proc/self/io", encoding="utf-8") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))

    state = 12 * sum(e.numel for e in engine.table.trained)  # master weights and two moments, fp32
    partitioned = 12 * sum(e.numel for e in engine.table.trained if e.partitioned)
    for i, (x, y) in enumerate(batches(4)):
        before = storage_read()
        loss = loss_of(engine(x), y)
        engine.backward(loss)  # (the step is staged during backward)
        engine.step()
        read = storage_read() - before
        # Every byte read is named in the step's report, by its cause (the disk reads each blob
        # in whole 4 KiB pages: these are small).
        named = engine.last_step_stats["nvme"]["read"]
        blobs = len(engine.table.trained) + (sum(e.partitioned for e in engine.table.trained)
                                       if engine._step.refresh else 0)
        assert 0 <= read - sum(named.values()) < 4096 * blobs, (named, read)
        if i > 0:  # (the first step's forward reads the parameters too)
            if max_in_cpu:
                assert read < state + partitioned // 2, (read, state)
                assert named["state_again"] == 0
            else:
                assert read >= state + partitioned // 2, (read, state)
                assert named["state_again"] == partitioned, named  # the master weights' blobs
        ref_loss = reference.micro_step(x, y, 1)
        reference.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for ours, theirs in zip(engine_weights(engine), reference.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(), rtol=1e-5, atol=1e-5)


def _step_beside_reference(engine, reference, x, y):
    """One step of the engine and one of `reference` (a references.Reference) on (x, y), their
    losses held equal."""
    loss = loss_of(engine(x), y)
    engine.backward(loss)
    engine.step()
    ref_loss = reference.micro_step(x, y, 1)
    reference.step()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)


def test_the_smallest_host_budget_is_said_refused_below_and_trains_at_it(tmp_path):
    """ZeRO-Infinity with the host budget below the optimizer state: the smallest budget the
    config and model take (the staging buffers, the optimizer's ring at its smallest sub-groups,
    the largest gradient partition and the parameter its new weights go into) is said by
    check_config, refused below by name, and trains at it as plain torch, each step reading the
    state once (optimizer_commit "auto" commits each partition: nothing read again)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 128), torch.nn.Linear(128, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, VOCAB))
    reference = Reference(copy.deepcopy(model), torch.float32, 1.0)
    config = make_config(tmp_path, 3, "nvme", "fp32", accumulation=1)
    config["strata"]["device_budget_bytes"] = 1 << 20
    config["strata"]["host_budget_bytes"] = 1 << 16  # below the staging buffers alone
    with pytest.raises(ValueError, match=r"host_budget_bytes \(65536\) is below the smallest "
                                         r"this config and model take, \d+ bytes: the staging "
                                         r"buffers 131072 .*\(1.weight\)"):
        strata.check_config(config, model)
    with pytest.raises(ValueError, match="is below the smallest"):
        strata.initialize(model=model, config=config)
    config["strata"]["host_budget_bytes"] = 1 << 30
    said = strata.check_config(config, model)
    least = int(next(w for w in said if "takes at least" in w).split("at least ")[1].split()[0])
    state = 12 * sum(p.numel() for p in model.parameters())
    assert least < state  # (the state beyond the host's room)
    config["strata"]["host_budget_bytes"] = least - 1  # every part counts: a byte less is refused
    with pytest.raises(ValueError, match=f"below the smallest this config and model take, {least}"):
        strata.check_config(config, model)
    config["strata"]["host_budget_bytes"] = least
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert engine.host_minimum["total"] == least and engine.runtime.optimizer_commit_each
    for i, (x, y) in enumerate(batches(3)):
        _step_beside_reference(engine, reference, x, y)
        read = engine.last_step_stats["nvme"]["read"]
        assert read["optimizer_state"] == state and read["state_again"] == 0, read
    for ours, theirs in zip(engine_weights(engine), reference.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs.detach().float(), rtol=1e-5, atol=1e-5)


def test_an_evaluation_between_steps_leaves_the_training_trace_alone(tmp_path):
    """A forward in eval mode under no_grad (validation between training steps, as Lightning
    runs it) lends the parameters outside the recorded trace: the next training step is still
    planned, nothing warns that the order changed, and training matches plain torch."""
    import warnings as warnings_module
    torch.manual_seed(0)
    model = Net()
    reference = Reference(copy.deepcopy(model), torch.float32, 0.0)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, "cpu", "fp32", 1, 0.0))
    held_out = torch.randint(0, VOCAB, (2, 8))
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        for i, (x, y) in enumerate(batches(6)):
            _step_beside_reference(engine, reference, x, y)
            if i >= 2:
                assert engine.last_step_stats["runtime"]["mode"] == "planned", i
            engine.eval()
            with torch.no_grad():  # the validation
                ours = engine(held_out)
                theirs = reference.model(held_out)
            engine.train()
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    differs = [str(w.message) for w in caught if "differs from the recorded trace" in str(w.message)]
    assert not differs, differs


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_parameter_unfrozen_after_initialize_is_refused_by_name(tmp_path, stage):
    """Gradual unfreezing: a parameter frozen when strata.initialize made the optimizer has no
    optimizer state; unfrozen later, it would get gradients and never be trained, where plain
    torch (its optimizer given every parameter) trains it. step() refuses it, naming it, and
    steps nothing; frozen again, training goes on."""
    torch.manual_seed(0)
    model = Net()
    model.l1.weight.requires_grad_(False)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, stage, "cpu", "fp32", accumulation=1))
    (x, y), (x2, y2) = batches(2)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    before = engine.module_state_dict()
    model.l1.weight.requires_grad_(True)
    engine.backward(loss_of(engine(x2), y2))
    with pytest.raises(RuntimeError, match=r"step: l1\.weight \(1 parameters\) were frozen"):
        engine.step()
    assert engine.global_steps == 1
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, before[name]), name
    model.l1.weight.requires_grad_(False)
    engine.step()  # the same micro-batch's gradients, the others' step
    assert engine.global_steps == 2


def _client_and_reference(tmp_path, make_schedule, stage=2, offload="cpu"):
    """An engine given a client AdamW and `make_schedule(optimizer)` built on it before
    initialize, and plain torch with the same schedule on its own AdamW."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, stage, offload, "fp32", accumulation=1, clipping=0.0)
    del config["optimizer"]
    client = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    schedule = make_schedule(client)
    engine, _, _, returned = strata.initialize(model=model, optimizer=client, config=config,
                                               lr_scheduler=schedule)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    return engine, returned, reference, torch_adamw, make_schedule(torch_adamw)


@pytest.mark.parametrize("kind", ["SequentialLR", "ChainedScheduler"])
def test_a_schedule_of_schedules_drives_the_rate_as_in_plain_torch(tmp_path, kind):
    """SequentialLR and ChainedScheduler step schedules of their own, each bound to the client's
    optimizer: every one of them sets the engine's rates, step by step as plain torch's."""
    lr = torch.optim.lr_scheduler

    def make(opt):
        warmup = lr.LinearLR(opt, start_factor=0.1, total_iters=2)
        decay = lr.ExponentialLR(opt, gamma=0.7)
        if kind == "SequentialLR":
            return lr.SequentialLR(opt, [warmup, decay], milestones=[2])
        return lr.ChainedScheduler([warmup, decay])

    engine, schedule, reference, torch_adamw, torch_schedule = _client_and_reference(tmp_path,
                                                                                     make)
    for x, y in batches(5):
        step_both(engine, reference, torch_adamw, x, y, schedule=torch_schedule)
        assert engine.get_lr() == pytest.approx(torch_schedule.get_last_lr())
    assert engine.get_lr()[0] < 0.5e-2


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "nvme")])
def test_a_schedule_cycling_the_betas_trains_as_plain_torch(tmp_path, stage, offload):
    """OneCycleLR cycles Adam's betas (cycle_momentum, its default): each step takes its group's
    betas as the schedule set them, bias corrections too, as torch's Adam (it was refused:
    strata's optimizer kept the betas it was made with). Betas set by hand outside [0, 1) are
    refused by name at the step, nothing stepped."""
    def cycling(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)

    engine, _, reference, torch_adamw, torch_schedule = _client_and_reference(
        tmp_path, cycling, stage, offload)
    seen = set()
    for x, y in batches(5):
        step_both(engine, reference, torch_adamw, x, y, schedule=torch_schedule)
        seen.add(engine.optimizer.param_groups[0]["betas"])
        assert engine.get_lr() == pytest.approx(torch_schedule.get_last_lr())
    assert len(seen) == 5  # (the betas changed every step)
    for ours, theirs in zip(engine_weights(engine), reference.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    (x, y), = batches(1, seed=3)
    engine.backward(loss_of(engine(x), y))
    good = engine.optimizer.param_groups[0]["betas"]
    # Set by hand between backward and step, refused by name at the step, nothing stepped: out
    # of range, below 1 but 1 in float32 (the optimizer's), not two numbers.
    for bad in [(1.0, 0.999), (-0.5, 0.999), (0.9, 0.99999999), (0.9,), ("0.9", "0.99"), 0.9]:
        engine.optimizer.param_groups[0]["betas"] = bad
        with pytest.raises(RuntimeError, match=rf"step: param group 0's betas are "
                                               rf"{re.escape(repr(bad))}; accepted: two numbers"):
            engine.step()
    engine.optimizer.param_groups[0]["betas"] = good
    engine.step()
    # Set before a forward: refused by name at the backward that stages steps (stage 3) or at
    # the step (a negative beta staged would have been stepped with the optimizer's own).
    for bad in ["ab", (-0.5, 0.999)]:
        engine.optimizer.param_groups[0]["betas"] = bad
        with pytest.raises((ValueError, RuntimeError),
                           match=rf"param group 0's betas are {re.escape(repr(bad))}; accepted"):
            engine.backward(loss_of(engine(x), y))
            engine.step()
    engine.close()
    # Adagrad has no betas: a schedule cycling them is refused as over torch's Adagrad (its
    # groups carried betas it never used).
    config = make_config(tmp_path / "adagrad", 2, "cpu", "fp32", accumulation=1)
    config["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-2}}
    adagrad, optimizer, _, _ = strata.initialize(model=Net(), config=config)
    assert "betas" not in optimizer.param_groups[0] and "betas" not in optimizer.defaults
    with pytest.raises(ValueError, match="cycle_momentum"):
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10)


def test_reduce_lr_on_plateau_steps_on_its_metric(tmp_path):
    """ReduceLROnPlateau steps on a metric: engine.step() leaves it to the user (plain torch's
    scheduler.step(val_loss), which sets the engine's rate), or steps it with lr_kwargs, as
    DeepSpeed's engine.step(lr_kwargs=...)."""
    def make(opt):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)

    engine, schedule, reference, torch_adamw, torch_schedule = _client_and_reference(tmp_path,
                                                                                     make)
    (x, y), (x2, y2), (x3, y3) = batches(3)
    step_both(engine, reference, torch_adamw, x, y)
    schedule.step(1.0)
    schedule.step(2.0)  # worse: the rate halves
    torch_schedule.step(1.0)
    torch_schedule.step(2.0)
    assert engine.get_lr() == pytest.approx([5e-3])
    step_both(engine, reference, torch_adamw, x2, y2)
    engine.backward(loss_of(engine(x3), y3))
    engine.step(lr_kwargs={"metrics": 3.0})  # worse again
    assert engine.get_lr() == pytest.approx([2.5e-3])


def test_a_half_precision_model_under_another_training_dtype_is_refused(tmp_path):
    """A bf16 model under an fp32 config would be cast to fp32 and trained so, where plain torch
    trains it in bf16: refused, naming both dtypes and the two ways out; a bf16 config takes it
    (mixed precision), and an fp32 model takes either."""
    config = make_config(tmp_path, 2, "cpu", "fp32")
    with pytest.raises(ValueError, match=r"parameters are torch.bfloat16 \(emb.weight, \.\.\.\) "
                                         r"and the config trains in float32.*\"bf16\": "
                                         r"\{\"enabled\": true\}.*model.float\(\)"):
        strata.initialize(model=Net().to(torch.bfloat16), config=config)
    with pytest.raises(ValueError, match=r"torch.float16 .* trains in torch.bfloat16"):
        strata.initialize(model=Net().to(torch.float16),
                          config=make_config(tmp_path, 2, "cpu", "bf16"))
    engine, _, _, _ = strata.initialize(model=Net().to(torch.bfloat16),
                                        config=make_config(tmp_path, 2, "cpu", "bf16"))
    engine.close()
    engine, _, _, _ = strata.initialize(model=Net(), config=make_config(tmp_path, 2, "cpu", "bf16"))
    engine.close()


def _assert_weights_as(engine, reference):
    """The engine's weights are plain torch's `reference` model's (fp32 rounding apart)."""
    ours = engine.module_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _beside_plain_torch(tmp_path, stage, model_class=Net, **zero):
    """An engine over a `model_class` (Net) at `stage` (one micro-batch a step, no config
    clipping, `zero` in its zero_optimization block) and plain torch's copy of the same model
    with its AdamW: (engine, its optimizer, model, AdamW)."""
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, stage, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["zero_optimization"].update(zero)
    engine, optimizer, _, _ = strata.initialize(model=model, config=config)
    return engine, optimizer, reference, torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                                           weight_decay=0.01)


def _step_beside(engine, reference, torch_adamw, x, y, forward=None):
    """One step of the engine and one of plain torch on (x, y), their losses held equal."""
    loss = loss_of((engine if forward is None else forward)(x), y)
    engine.backward(loss)
    engine.step()
    ref = loss_of(reference(x), y)
    ref.backward()
    torch_adamw.step()
    torch_adamw.zero_grad()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_grad_after_backward_drops_its_gradients_as_plain_torch(tmp_path, stage):
    """A plain loop that skips a batch after its backward (optimizer.zero_grad() or
    model.zero_grad() in place of the step) trains as plain torch's: the skipped batch's
    gradients are dropped, not summed into the next step's."""
    engine, optimizer, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    for i, (x, y) in enumerate(batches(5)):
        for net, opt in ((engine.module, optimizer), (reference, torch_adamw)):
            loss_of(net(x), y).backward()
            if i % 2:  # skipped
                (opt if i == 1 else net).zero_grad()
            else:
                opt.step()
                opt.zero_grad()
    _assert_weights_as(engine, reference)


def test_zero_grad_after_parameters_stepped_during_backward_is_refused(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["strata"]["optimizer_during_backward"] = True
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    data = list(batches(2))
    x, y = data[0]  # from the second step on, partitions step during backward
    engine.backward(loss_of(engine(x), y))
    engine.step()
    x, y = data[1]
    engine.backward(loss_of(engine(x), y))
    engine.runtime.wait_for_early_steps()
    with pytest.raises(RuntimeError, match="zero_grad after backward: parameters stepped"):
        engine.zero_grad()
    engine.step()


@pytest.mark.parametrize("how", ["item", "update"])
def test_rates_set_and_weights_read_between_backward_and_step_are_plain_torch_s_or_refused(
        tmp_path, how):
    """strata.optimizer_during_backward (stage 3, host optimizer state: the default on a GPU):
    a loop that sets its learning rate and weight decay between backward and step (plain torch's
    step takes them) trains as plain torch's, its first value the optimizer's own too: a rate
    set there (the engine's optimizer's groups say when one is set) ends stepping for good
    during backward for the rest of the run, before any partition did (before, from the second
    step on partitions stepped for good during backward with the old rates, 7e-3 off torch's
    weights, said only in a warning), set as an item or by group.update(...). Weights read whole
    between backward and step after partitions stepped during it (module_state_dict,
    state_dict(), GatheredParameters, optimizer.state_dict()) are refused by name: they were the
    step's result already (1e-2 off plain torch's, silently)."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = make_config(tmp_path, 3, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["strata"]["optimizer_during_backward"] = True
    engine, optimizer, _, _ = strata.initialize(model=model, config=config)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for i, (x, y) in enumerate(batches(4)):
        for net, opt in ((engine.module, optimizer), (reference, adamw)):
            loss_of(net(x), y).backward()
            rates = {"lr": 1e-2 * 0.5 ** i,  # (the optimizer's rate first)
                     "weight_decay": 0.01 + 0.1 * i}
            if how == "update":
                opt.param_groups[0].update(rates)
            else:
                for key, value in rates.items():
                    opt.param_groups[0][key] = value
            opt.step()
            opt.zero_grad()
    _assert_weights_as(engine, reference)
    assert not any("had stepped during backward" in w for w in engine.warnings), engine.warnings
    engine.close()
    if how == "update":
        return
    engine, optimizer, _, _ = strata.initialize(model=Net(), config=config)
    for i, (x, y) in enumerate(batches(2)):
        engine.backward(loss_of(engine(x), y))
        if i == 1:  # (from the second step on, partitions step during backward)
            engine.runtime.wait_for_early_steps()
            weight = engine.module.l1.weight
            for read in (engine.module_state_dict, engine.module.state_dict,
                         lambda: strata.GatheredParameters([weight]).__enter__()):
                with pytest.raises(RuntimeError, match=r"weights read whole \(.*\) between "
                                   r"backward and step, after it stepped during backward"):
                    read()
            with pytest.raises(RuntimeError, match=r"optimizer.state_dict\(\) between backward "
                                                   r"and step, after parameters stepped"):
                optimizer.state_dict()
        engine.step()
    assert engine.module_state_dict().keys() == engine.module.state_dict().keys()
    # A negative beta set before a backward that steps partitions for good: refused by name as
    # it stages them (the optimizer took a negative beta for its own: they stepped with those,
    # and only the step refused it).
    optimizer.param_groups[0]["betas"] = (-0.5, 0.999)
    (x, y), = batches(1, seed=5)
    with pytest.raises(ValueError, match=r"betas are \(-0.5, 0.999\); accepted: two numbers"):
        engine.backward(loss_of(engine(x), y))
    assert not engine._step.stepped_during_backward()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_backward_of_ones_own_after_a_step_with_no_zero_grad_is_refused(tmp_path, stage):
    """A plain loop with no zero_grad() between its steps sums each backward's gradients into
    the last step's (.grad is kept): the engine's step() drops them, so a backward of the
    user's after a step with no zero_grad() is refused by name at the step (and at
    clip_grad_norm_), not stepped with this backward's gradients alone. zero_grad() then drops
    them, as torch's would, and the loop goes on as plain torch's."""
    engine, optimizer, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    data = list(batches(4))
    for net, opt in ((engine.module, optimizer), (reference, torch_adamw)):
        loss_of(net(data[0][0]), data[0][1]).backward()
        opt.step()
        loss_of(net(data[1][0]), data[1][1]).backward()
        if net is engine.module:
            for call in (lambda: torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0),
                         opt.step):
                with pytest.raises(RuntimeError, match=r"loss.backward\(\) after a step\(\) "
                                   r"with no zero_grad\(\) between: plain torch adds"):
                    call()
        opt.zero_grad()
        loss_of(net(data[2][0]), data[2][1]).backward()
        opt.step()
        opt.zero_grad()
    # engine.step(), DeepSpeed's, drops the gradients as the engine's loop does: not refused
    loss_of(engine.module(data[3][0]), data[3][1]).backward()
    engine.step()
    loss_of(reference(data[3][0]), data[3][1]).backward()
    torch_adamw.step()
    _assert_weights_as(engine, reference)


class Branched(Net):
    """Net with a layer its forward skips where `side` is False."""

    def __init__(self):
        super().__init__()
        self.side = torch.nn.Linear(2 * WIDTH, 2 * WIDTH)

    def forward(self, x, side=True):
        h = torch.relu(self.l1(self.emb(x)))
        return self.l2(self.ln(h + self.side(h) if side else h))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_grad_set_to_none_false_trains_as_torch_or_is_refused_where_it_differs(tmp_path,
                                                                                  stage):
    """zero_grad(set_to_none=False) keeps each gradient as zeros, and torch steps a parameter
    with zeros where a step gives it no gradient (AdamW still moves it): with every parameter
    given a gradient each step the loop trains as torch's; a step that gives a parameter
    trained before none is refused by name, before anything is stepped; zero_grad() (set to
    None) after that, the parameter is left unstepped, as torch leaves it."""
    engine, optimizer, reference, torch_adamw = _beside_plain_torch(tmp_path, stage, Branched)
    for i, (x, y) in enumerate(batches(5)):
        side = i not in (2, 3)
        if i == 2:  # zeros kept, and a step that skips `side`: torch would step it with them
            optimizer.zero_grad(set_to_none=False)
            loss_of(engine.module(x, side), y).backward()
            before = engine.module_state_dict()
            with pytest.raises(RuntimeError, match=r"step: side.weight, side.bias \(2 "
                               r"parameters\) had a gradient in an earlier step and none in "
                               r"this one.*nothing was stepped. Accepted: zero_grad\(\)"):
                optimizer.step()
            for name, value in engine.module_state_dict().items():
                assert torch.equal(value, before[name]), name
        for net, opt in ((engine.module, optimizer), (reference, torch_adamw)):
            opt.zero_grad(set_to_none=i in (2, 3))
            loss_of(net(x, side), y).backward()
            opt.step()
    _assert_weights_as(engine, reference)


@pytest.mark.parametrize("stage,during", [(0, False), (2, False), (3, False), (3, True)])
def test_weights_edited_in_place_between_steps_are_stepped_from_as_plain_torch(tmp_path, stage,
                                                                               during):
    """Plain torch steps the weights as they are: an edit between steps (a clamp through .data,
    a pruning mask under no_grad, a tensor put in with p.data = ..., an initializer, a write
    through a .data tensor kept since an earlier step) is stepped from, where the engine's step
    wrote the weights anew from its master weights, undoing it silently. The weights the engine
    keeps whole (stages 0-2, stage 3's small ones) are taken into the master weights at the next
    forward (before backward: with strata.optimizer_during_backward some step during it) or
    step; at stage 3 a partitioned weight's .data is its placeholder outside forward, refused by
    name."""
    engine, optimizer, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    if during:
        engine.close()
        config = make_config(tmp_path / "during", stage, "cpu", "fp32", accumulation=1,
                             clipping=0.0)
        config["strata"]["optimizer_during_backward"] = True
        torch.manual_seed(0)
        engine, optimizer, _, _ = strata.initialize(model=Net(), config=config)
    kept, given = {}, {}
    mask = torch.rand(2 * WIDTH, generator=torch.Generator().manual_seed(2)) > 0.5

    def edit(net, i):
        with torch.no_grad():
            if i == 0:
                kept[net] = net.ln.bias.data
                net.ln.weight.data.clamp_(max=0.99)
                given[net] = torch.full_like(net.l2.bias, 0.05)
                net.l2.bias.data = given[net]
            elif i == 1:
                net.ln.bias.mul_(mask)
            elif i == 2:
                torch.nn.init.zeros_(net.l1.bias)
                kept[net].add_(0.5)  # (through .data handed out at step 0)
                given[net].mul_(0.5)  # (through the tensor given as .data at step 0)
            if stage != 3:  # (partitioned at stage 3)
                net.l1.weight.data[:, :4].zero_()

    for i, (x, y) in enumerate(batches(4)):
        for net, opt in ((engine.module, optimizer), (reference, torch_adamw)):
            edit(net, i)
            loss_of(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    for net in (engine.module, reference):  # (after the last step: saved as the module has it)
        torch.nn.init.zeros_(net.ln.bias)
    engine.save_checkpoint(tmp_path / "saved")
    engine.load_checkpoint(tmp_path / "saved")
    _assert_weights_as(engine, reference)
    if stage == 3:
        with pytest.raises(RuntimeError, match=r"l1.weight.data at ZeRO stage 3 outside its "
                           r"module's forward: .*placeholder.*strata.GatheredParameters"):
            engine.module.l1.weight.data.zero_()
        with pytest.raises(RuntimeError, match=r"l1.weight.data = tensor at ZeRO stage 3: .*"
                           r"accepted: module.load_state_dict"):
            engine.module.l1.weight.data = torch.zeros(2 * WIDTH, WIDTH)
        engine.module.to("cpu")  # (a move of the placeholders goes on, as torch's)
        with strata.GatheredParameters([engine.module.l1.weight], modifier_rank=0):
            engine.module.l1.weight.data[:, :4].zero_()  # (lent whole in the block)
        assert not engine.module_state_dict()["l1.weight"][:, :4].any()
    with pytest.raises(ValueError, match=r"l2.bias was replaced between steps by a tensor of "
                       r"shape \(1,\) .*; the engine trains it as \(50,\)"):
        engine.module.l2.bias.data = torch.zeros(1)  # (broadcast by the forward)
        (x, y), = batches(1)
        loss_of(engine.module(x), y).backward()
        optimizer.step()


class MaxNorm(torch.nn.Module):
    """An embedding that renorms the rows it looks up in place in its forward (max_norm)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH, max_norm=1.0)
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.out(self.emb(x))


@pytest.mark.parametrize("stage,threshold", [(0, 100), (3, 100), (3, 1 << 20)])
def test_a_forward_that_writes_its_weight_in_place_trains_as_torch_or_is_refused(tmp_path,
                                                                                 stage,
                                                                                 threshold):
    """nn.Embedding(max_norm=...) renorms its weight's rows in place in forward: kept whole
    (stages 0-2, stage 3 under the persistence threshold) the renorm is taken at the step, as
    plain torch steps the renormed weight; partitioned at stage 3 it lands in the copy lent to
    the forward and was lost with it, silently (3.6 from torch after 4 steps): refused by name.
    A write into a partitioned weight's placeholder between steps, and in a GatheredParameters
    block that does not modify, are refused too."""
    engine, _, reference, torch_adamw = _beside_plain_torch(
        tmp_path, stage, MaxNorm, stage3_param_persistence_threshold=threshold)
    if stage == 3 and threshold == 100:
        (x, y), = batches(1)
        engine.backward(loss_of(engine(x), y))
        with pytest.raises(RuntimeError, match=r"emb.weight written in place at ZeRO stage 3 .*"
                           r"max_norm.*stage3_param_persistence_threshold above its elements "
                           r"\(1600"):
            engine.step()
        engine.zero_grad()
        weight = engine.module.out.weight
        with pytest.raises(RuntimeError, match=r"out.weight: mul_\(\) of a parameter ZeRO stage 3 "
                           r"partitions, outside its module's forward"), torch.no_grad():
            weight.mul_(2)  # (its placeholder: refused as it is written)
        with pytest.raises(RuntimeError, match=r"GatheredParameters without modifier_rank: "
                           r"out.weight written in place in the block"):
            with strata.GatheredParameters([weight]), torch.no_grad():
                weight.mul_(2)
        with pytest.raises(RuntimeError, match=r"GatheredParameters without modifier_rank: "
                           r"out.weight written in place in the block"):
            with strata.GatheredParameters([weight]):
                weight.data.zero_()  # (through .data: its values differ from those lent)
        with strata.GatheredParameters([weight]):
            assert weight.data.abs().sum() > 0  # (a read through .data: not refused)
        with strata.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
            weight.mul_(2)
        engine.module_state_dict()  # (the modifying block's write taken: nothing refused)
        with strata.GatheredParameters([weight], modifier_rank=0):
            weight.data = torch.full((VOCAB, WIDTH), 0.5)  # (taken in a modifying block)
        with pytest.raises(KeyError):
            with strata.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
                weight.mul_(2)
                raise KeyError  # (what the block wrote is kept, as plain torch keeps it)
        assert (engine.module_state_dict()["out.weight"] == 1.0).all()
        return
    for x, y in batches(4):
        _step_beside(engine, reference, torch_adamw, x, y)
    _assert_weights_as(engine, reference)


def test_an_engine_dropped_without_close_leaves_no_watch_on_its_parameters(tmp_path):
    """The watch over edits marks the parameters (strata/edits.py): an engine dropped without
    close() (a trainer's, collected) takes its marks off too, so that nothing is kept for it.
    What it left of a partitioned parameter (a placeholder of its shape, zeros) is refused by
    name when read alone (it read as zeros), until the parameter is given its weights."""
    model = Net()
    strata.initialize(model=model, config=make_config(tmp_path, 3, "cpu", "fp32"))
    gc.collect()
    assert not [n for n, p in model.named_parameters() if "_strata_data_taken" in p.__dict__ or
                placeholders.partitioned_name(p) is not None]
    weight = model.l1.weight
    for read in (lambda: weight.norm(), lambda: weight.data):
        with pytest.raises(RuntimeError, match=r"l1.weight.*closed \(engine.close\(\), or its "
                                                r"last reference dropped\)"):
            read()
    assert weight.numel() == 2 * WIDTH * WIDTH
    weight.data = torch.ones(2 * WIDTH, WIDTH)  # (given its weights: torch's own again)
    assert type(weight) is torch.nn.Parameter and "_strata_partitioned" not in weight.__dict__
    assert weight.norm().item() == pytest.approx((2 * WIDTH * WIDTH) ** 0.5)


@pytest.mark.parametrize("stage", [1, 2])
def test_weights_read_through_data_each_step_train_bit_for_bit_as_unread_in_bf16(tmp_path, stage):
    """A read of .data (a log of the weights' norm) is taken for a possible write: the weights
    are compared with their master weights rounded to bf16 at the next step, and nothing is
    taken where nothing was written: bit for bit the run that never read them (a comparison
    whose rounding differed from the step's would take bf16 values into the master weights)."""
    weights = []
    for read in (False, True):
        torch.manual_seed(0)
        engine, _, _, _ = strata.initialize(
            model=Net(), config=make_config(tmp_path / str(read), stage, "cpu", "bf16",
                                            accumulation=1, clipping=0.0))
        for x, y in batches(4):
            engine.backward(loss_of(engine(x), y))
            engine.step()
            if read:
                _ = [p.data.float().norm() for p in engine.module.parameters()]
                # (each weight read is compared at the next forward: the test has a comparison)
                assert len(engine._edits.edited()) == len(engine._edits.entries) > 0
        weights.append(engine.module_state_dict())
        engine.close()
    for name, value in weights[0].items():
        assert torch.equal(weights[1][name], value), name


@pytest.mark.parametrize("stage", [0, 3])
def test_load_state_dict_mid_training_keeps_the_optimizers_state(tmp_path, stage):
    """module.load_state_dict between steps (a weight reset, an EMA swapped in) changes the
    weights and leaves the optimizer's moments and step counts, as in plain torch: the steps
    after it are plain torch's (they restarted Adam over the loaded weights)."""
    engine, _, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    for i, (x, y) in enumerate(batches(4)):
        if i == 2:
            loaded = {"l1.weight": torch.full_like(reference.l1.weight, 0.01)}
            engine.module.load_state_dict(loaded, strict=False)
            reference.load_state_dict(loaded, strict=False)
        _step_beside(engine, reference, torch_adamw, x, y)
    _assert_weights_as(engine, reference)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_clip_grad_norm_between_backward_and_step_clips_as_plain_torch(tmp_path, stage):
    """torch.nn.utils.clip_grad_norm_ called by the user between backward and step (as Trainer,
    Accelerate and plain loops do): the gradients are in the engine, not in .grad, where torch's
    would find none and clip nothing. It returns plain torch's norm and the step is clipped by it,
    step by step as plain torch's; over other parameters it is torch's own."""
    engine, _, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    for x, y in batches(4):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.5)
        engine.step()
        ref = loss_of(reference(x), y)
        ref.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch_adamw.step()
        torch_adamw.zero_grad()
        assert ref_norm.item() > 0.5  # it clipped
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-4)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    _assert_weights_as(engine, reference)


@pytest.mark.parametrize("stage", [0, 1])
def test_clip_grad_norm_clips_grad_in_place_where_the_gradients_are_in_grad(tmp_path, stage):
    """At stages 0-1 in one process the gradients of a loop of one's own are torch's .grad until
    the step: clip_grad_norm_ clips them there, as torch's, so that .grad read after it is
    clipped and what is added to .grad after it (DP-SGD's noise) is not clipped at the step
    (it was: the engine scaled the whole gradient at the step)."""
    engine, optimizer, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    gen = torch.Generator().manual_seed(4)
    for x, y in batches(3):
        noise = [torch.randn(p.shape, generator=gen) * 1e-2 for p in reference.parameters()]
        grads = []
        for net, opt in ((engine.module, optimizer), (reference, torch_adamw)):
            opt.zero_grad()
            loss_of(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
            grads.append([p.grad.clone() for p in net.parameters()])
            for p, n in zip(net.parameters(), noise):
                p.grad.add_(n)
            opt.step()
        for ours, theirs in zip(*grads):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    _assert_weights_as(engine, reference)


def test_clip_grad_norm_the_engine_cannot_honour_is_refused_by_name(tmp_path):
    engine, _, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path, 2, "cpu", "fp32", accumulation=2,
                                        clipping=0.0))
    (x, y), = batches(1)
    with pytest.raises(RuntimeError, match="no backward"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)
    engine.backward(loss_of(engine(x), y))
    with pytest.raises(RuntimeError, match=r"before the last micro-batch .* \(micro-step 1 of 2\)"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)
    with pytest.raises(ValueError, match=r"norm_type 1: accepted: 2.0"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0, norm_type=1)
    with pytest.raises(ValueError, match=r"of its trained parameters are not among those given"):
        torch.nn.utils.clip_grad_norm_(engine.module.l1.parameters(), 1.0)
    # After step() counted the micro-batch (DeepSpeed's loop; accelerate's accumulate() without
    # `if accelerator.sync_gradients:`): refused as within the window (it said "no backward()
    # since the last step()", and at stages 0-1 blamed a loss.backward() of the user's).
    engine.step()
    with pytest.raises(RuntimeError, match=r"within the accumulation window, after its "
                                           r"micro-batch 1 of 2 \(counted by step\(\)\): it "
                                           r"would clip a partial sum"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)


def test_a_linear_called_with_its_keyword_computes_at_stage_3(tmp_path):
    """nn.Linear's forward takes `input`; called so (self.l1(input=h)) at stage 3, where the
    engine lends its weight around its own forward, it computes as plain torch's."""
    class ByKeyword(Net):
        def forward(self, x):
            return self.l2(input=self.ln(torch.relu(self.l1(input=self.emb(x)))))

    torch.manual_seed(0)
    model = ByKeyword()
    reference = copy.deepcopy(model)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, "cpu", "fp32", accumulation=1,
                                        clipping=0.0))
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches(2):
        step_both(engine, reference, torch_adamw, x, y)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_plain_torch_loop_trains_through_the_engine_as_plain_torch(tmp_path, stage):
    """The loop people write: loss.backward() (two micro-batches summed, the loss divided by the
    user), torch.nn.utils.clip_grad_norm_, optimizer.step(), optimizer.zero_grad(), over the
    engine's module and optimizer: the engine takes the backward it did not run as its own (the
    loss as the user scaled it) and the step is plain torch's."""
    engine, optimizer, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    data = list(batches(6))
    for first, second in zip(data[::2], data[1::2]):
        for net, opt in ((engine.module, optimizer), (reference, torch_adamw)):
            for x, y in (first, second):
                (loss_of(net(x), y) / 2).backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            if net is reference:
                assert ours_norm.item() == pytest.approx(norm.item(), rel=1e-4)
            ours_norm = norm
    _assert_weights_as(engine, reference)
    assert engine.global_steps == 3


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_state_dict_resumes_bit_for_bit(tmp_path, stage):
    """torch.save(optimizer.state_dict()) and load_state_dict() (a plain loop's checkpoint,
    accelerate's save_state): torch's layout with the engine's moments, step counts and fp32
    master weights, so a new engine loading them (beside module.load_state_dict) steps on bit for
    bit; a torch AdamW's state over the same parameters loads too, and steps as torch's."""
    def make(subdir, model):
        config = make_config(tmp_path / subdir, stage, "cpu", "bf16", accumulation=1,
                             clipping=0.0)
        return strata.initialize(model=model, config=config)[:2]

    torch.manual_seed(0)
    engine, optimizer = make("a", Net())
    data = list(batches(4))
    for x, y in data[:2]:
        engine.backward(loss_of(engine(x), y))
        engine.step()
    weights, state = engine.module.state_dict(), optimizer.state_dict()
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert state["state"][0]["step"].item() == 2
    torch.manual_seed(5)
    resumed, resumed_optimizer = make("b", Net())
    resumed.module.load_state_dict(weights)
    resumed_optimizer.load_state_dict(state)
    for x, y in data[2:]:
        for e in (engine, resumed):
            e.backward(loss_of(e(x), y))
            e.step()
    ours = resumed.module_state_dict()
    for name, value in engine.module_state_dict().items():
        assert torch.equal(ours[name], value), name
    bad = dict(state, state={0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3)}})
    with pytest.raises(ValueError, match=r"emb.weight's exp_avg is \(3,\); accepted: "):
        resumed_optimizer.load_state_dict(bad)


def test_a_torch_adamw_state_loads_and_steps_as_torch(tmp_path):
    torch.manual_seed(0)
    reference = Net()
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    data = list(batches(4))
    for x, y in data[:2]:
        loss_of(reference(x), y).backward()
        torch_adamw.step()
        torch_adamw.zero_grad()
    engine, optimizer, _, _ = strata.initialize(
        model=copy.deepcopy(reference),
        config=make_config(tmp_path, 2, "cpu", "fp32", accumulation=1, clipping=0.0))
    optimizer.load_state_dict(torch_adamw.state_dict())
    for x, y in data[2:]:
        step_both(engine, reference, torch_adamw, x, y)
    _assert_weights_as(engine, reference)


def test_an_engine_dropped_unclosed_leaves_the_module_refusing_its_placeholders(tmp_path):
    """The last reference to an engine dropped without close() (a Trainer deleted, a notebook's
    variable rebound): the module's partitioned parameters are placeholders, and its forward and
    state_dict() (save_pretrained) refuse them by name, where they wrote empty tensors."""
    model = Net()
    engine, optimizer, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, "cpu", "fp32", accumulation=1))
    _one_step(engine)
    del engine, optimizer
    gc.collect()
    assert model.l1.weight.shape == (2 * WIDTH, WIDTH)  # its shape, not its bytes
    with pytest.raises(RuntimeError, match="strata engine that is closed .*engine.release"):
        model.state_dict()
    (x, _), = batches(1)
    with pytest.raises(RuntimeError, match="forward of Embedding"):
        model(x)


def test_a_second_engine_over_a_held_model_is_refused_by_name(tmp_path):
    model = Net()
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, "cpu", "fp32", accumulation=1))
    with pytest.raises(ValueError, match=r"held by a strata engine not closed .*close\(\) first"):
        strata.initialize(model=model, config=make_config(tmp_path / "b", 2, "cpu", "fp32"))
    engine.release()
    strata.initialize(model=model, config=make_config(tmp_path / "c", 2, "cpu", "fp32"))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_optimizer_given_to_initialize_is_the_engines(tmp_path, stage):
    """A schedule built on the optimizer given to initialize (transformers'
    get_linear_schedule_with_warmup before initialize) and stepped by the user sets the rates the
    engine steps with, as plain torch's (it left them at its first rate); that optimizer's own
    step(), add_param_group on the engine's and torch.amp.GradScaler over it are refused by
    name."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    client = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda s: (s + 1) / 3)
    config = make_config(tmp_path, stage, "cpu", "fp32", accumulation=1, clipping=0.0)
    del config["optimizer"]
    engine, optimizer, _, _ = strata.initialize(model=model, optimizer=client, config=config)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch_schedule = torch.optim.lr_scheduler.LambdaLR(torch_adamw, lambda s: (s + 1) / 3)
    for x, y in batches(3):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        schedule.step()
        ref = loss_of(reference(x), y)
        ref.backward()
        torch_adamw.step()
        torch_adamw.zero_grad()
        torch_schedule.step()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert engine.get_lr() == pytest.approx([1e-2 * 4 / 3])
    _assert_weights_as(engine, reference)
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) of the optimizer given to "
                                           r"strata.initialize"):
        client.step()
    with pytest.raises(ValueError, match="add_param_group after strata.initialize"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    scaler = torch.amp.GradScaler("cpu")
    (x, y), = batches(1)
    scaler.scale(loss_of(engine(x), y)).backward()
    with pytest.raises(RuntimeError, match="GradScaler.step over strata's optimizer"):
        scaler.step(optimizer)


def test_clip_grad_norm_imported_before_strata_comes_to_the_engine(tmp_path):
    """A script that binds torch's clip_grad_norm_ before importing strata (from torch.nn.utils
    import clip_grad_norm_, then import strata) holds torch's function object; at stage 2 it
    returns the engine's norm and clips the step, where it would find no .grad and return 0."""
    config = make_config(tmp_path, 2, "cpu", "fp32", accumulation=1, clipping=0.0)
    script = textwrap.dedent(f"""
        import torch
        from torch.nn.utils import clip_grad_norm_
        import strata
        engine, _, _, _ = strata.initialize(model=torch.nn.Linear(8, 8), config={config!r})
        engine.backward(engine(torch.ones(2, 8)).square().sum())
        print(float(clip_grad_norm_(engine.module.parameters(), 1e-3)))
        engine.close()
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) > 1.0


def test_clip_grad_norm_called_twice_or_with_other_parameters_is_plain_torchs(tmp_path):
    """A second clip_grad_norm_ in a step sees the first's clipping (torch clips .grad in place:
    a logging call with max_norm inf after the clip returns the clipped norm); parameters that are
    not the engine's count in the norm and are clipped in place, as torch's; two engines'
    parameters in one call, torch's other clipping functions over an engine's parameters and a
    backward of one's own with gradient_accumulation_steps > 1 are refused by name."""
    torch.manual_seed(0)
    model, extra = Net(), torch.nn.Linear(VOCAB, VOCAB)
    reference, ref_extra = copy.deepcopy(model), copy.deepcopy(extra)
    engine, optimizer, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, "cpu", "fp32", accumulation=1,
                                        clipping=0.0))
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for (x, y) in batches(3):
        norms, grads = [], []
        for net, head, opt in ((engine.module, extra, optimizer),
                               (reference, ref_extra, torch_adamw)):
            loss_of(head(net(x)), y).backward()
            params = list(net.parameters()) + list(head.parameters())
            norms.append((torch.nn.utils.clip_grad_norm_(params, 0.5).item(),
                          torch.nn.utils.clip_grad_norm_(params, float("inf")).item()))
            opt.step()
            opt.zero_grad()
            grads.append(head.weight.grad.clone())  # the head's, clipped in place
            head.zero_grad()
        assert norms[0] == pytest.approx(norms[1], rel=1e-4)
        assert norms[0][1] == pytest.approx(0.5, rel=1e-4) and norms[0][0] > 0.5
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    _assert_weights_as(engine, reference)
    other, _, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path / "b", 2, "cpu", "fp32", accumulation=1))
    with pytest.raises(ValueError, match="parameters of 2 strata engines at once"):
        torch.nn.utils.clip_grad_norm_(list(engine.module.parameters()) +
                                       list(other.module.parameters()), 1.0)
    for name, args in (("clip_grad_value_", (1.0,)),
                       ("clip_grads_with_norm_", (1.0, torch.tensor(2.0)))):
        with pytest.raises(ValueError, match=f"torch.nn.utils.{name} over a strata engine's"):
            getattr(torch.nn.utils, name)(engine.module.parameters(), *args)
    windowed, _, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path / "c", 2, "cpu", "fp32", accumulation=2))
    (x, y), = batches(1)
    loss_of(windowed.module(x), y).backward()
    with pytest.raises(RuntimeError, match=r"not taken under gradient_accumulation_steps 2"):
        windowed.step()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_clip_grad_value_is_torch_s_where_the_gradients_are_torch_s(tmp_path, stage):
    """torch.nn.utils.clip_grad_value_ and clip_grads_with_norm_ over the engine's parameters:
    at stages 0-1 in one process the gradients are torch's .grad until the step, so they are
    torch's (they were refused, saying wrongly that the gradients are not in .grad); at stage 2
    (kept apart) refused by name."""
    engine, optimizer, reference, torch_adamw = _beside_plain_torch(tmp_path, stage)
    for x, y in batches(2):
        for net, opt in ((engine.module, optimizer), (reference, torch_adamw)):
            loss_of(net(x), y).backward()
            if stage == 2 and net is engine.module:
                for name, args in (("clip_grad_value_", (1e-3,)),
                                   ("clip_grads_with_norm_", (1.0, torch.tensor(2.0)))):
                    with pytest.raises(ValueError, match=rf"{name} over a strata engine's "
                                       r"parameters where their gradients are not torch's "
                                       r"\.grad \(ZeRO stage 2 keeps them apart"):
                        getattr(torch.nn.utils, name)(net.parameters(), *args)
            else:
                torch.nn.utils.clip_grad_value_(net.parameters(), 1e-3)
                torch.nn.utils.clip_grads_with_norm_(net.parameters(), 1.0, torch.tensor(2.0))
            opt.step()
            opt.zero_grad()
    if stage != 2:
        _assert_weights_as(engine, reference)


def test_optimizer_settings_it_cannot_step_with_are_refused(tmp_path):
    """eps changed in a group, and a loaded state whose groups have another eps, amsgrad,
    maximize or L2 decay where the engine decouples it: refused by name, nothing changed."""
    engine, optimizer, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path, 2, "cpu", "fp32", accumulation=1))
    (x, y), = batches(1)
    state = optimizer.state_dict()
    for group_change, said in (({"eps": 1e-3}, r"eps 0.001 \(made with 1e-08\)"),
                               ({"amsgrad": True}, "amsgrad"), ({"maximize": True}, "maximize"),
                               ({"decoupled_weight_decay": False},
                                r"decoupled_weight_decay False \(made with True\)")):
        changed = dict(state, param_groups=[dict(g, **group_change)
                                            for g in state["param_groups"]])
        with pytest.raises(ValueError, match=f"param group 0 has {said}"):
            optimizer.load_state_dict(changed)
    optimizer.param_groups[0]["eps"] = 1e-2
    engine.backward(loss_of(engine(x), y))
    with pytest.raises(RuntimeError, match=r"step: param group 0 has eps 0.01"):
        engine.step()


def test_an_nvme_folder_held_by_an_engine_nothing_reaches_is_taken(tmp_path):
    """An engine in a reference cycle (a Lightning module and its engine make one) still holds its
    NVMe folder after the last reference to it is dropped, until the cycle collector runs: a new
    engine on the same folder (a second fit in a notebook) collects it rather than being
    refused; one that is still reached is refused, as before."""
    config = make_config(tmp_path, 3, "nvme", "fp32")
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    collecting = gc.isenabled()
    gc.disable()  # (so that only strata collects)
    try:
        engine.module.held_by = engine  # the cycle
        del engine
        second, _, _, _ = strata.initialize(model=Net(), config=config)
        with pytest.raises(strata.Error, match="in use by another strata store"):
            strata.initialize(model=Net(), config=config)
        second.close()
    finally:
        if collecting:
            gc.enable()


def test_a_stage_3_placeholder_answers_its_shape_and_refuses_its_values_by_name(tmp_path):
    """Outside forward a partitioned parameter holds an empty placeholder: its shape, numel()
    and dim() were the placeholder's (a parameter count, a decay group by p.dim() >= 2 and
    parameters_to_vector silently wrong) and its values read as none (p.norm() 0.0, a copy
    empty). Now its metadata is plain torch's, its values are refused by name, a submodule's
    load_state_dict loads through the engine, and close() leaves them refused by name."""
    engine, _, reference, torch_adamw = _beside_plain_torch(tmp_path, 3)
    for x, y in batches(2):
        _step_beside(engine, reference, torch_adamw, x, y)
    _assert_weights_as(engine, reference)
    model = engine.module
    weight = model.l1.weight
    assert isinstance(weight, torch.nn.Parameter) and not placeholders.holds_values(weight)
    assert sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in reference.parameters())
    assert [n for n, p in model.named_parameters() if p.dim() >= 2] == \
        [n for n, p in reference.named_parameters() if p.dim() >= 2]
    assert (weight.shape, weight.size(-1), weight.stride(), len(weight), weight.ndim) == \
        (reference.l1.weight.shape, WIDTH, (WIDTH, 1), 2 * WIDTH, 2)
    plain = reference.l1.weight
    for read in [lambda p: torch.zeros_like(p), lambda p: torch.zeros_like(input=p),
                 lambda p: p.nbytes, lambda p: p.type(), lambda p: torch.result_type(p, 1.0),
                 lambda p: p.new(2).shape, lambda p: p.dim_order()]:
        assert str(read(weight)) == str(read(plain))
    with pytest.raises(IndexError, match="Dimension out of range"):
        weight.size(2)
    assert "l1.weight, shape (64, 32)" in repr(weight)
    refused = r"(l1|emb).weight: {}\(\) of a parameter ZeRO stage 3 partitions, outside its "
    for what, read in [("norm", lambda: weight.norm()),
                       ("view", lambda: torch.nn.utils.parameters_to_vector(model.parameters())),
                       ("detach", lambda: weight.detach().clone()),
                       ("lerp_", lambda: torch.zeros(2 * WIDTH, WIDTH).lerp_(weight, 0.1)),
                       ("to", lambda: weight.to(torch.float64)),
                       ("as_subclass", lambda: weight.as_subclass(torch.Tensor)),
                       ("normal_", lambda: torch.nn.init.normal_(weight))]:  # (tensor=weight)
        with pytest.raises(RuntimeError, match=refused.format(what)):
            read()
    with pytest.raises(RuntimeError, match=refused.format("mul_")), torch.no_grad():
        weight.mul_(2)
    with strata.GatheredParameters([weight]):  # lent whole: any parameter
        assert weight.norm().item() == pytest.approx(reference.l1.weight.norm().item(), rel=1e-5)
    for _ in range(2):  # (the second block was taken as nested in the first: its write lost)
        with strata.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
            weight.mul_(0.5)
        assert not placeholders.holds_values(weight)
        with torch.no_grad():
            reference.l1.weight.mul_(0.5)
    _assert_weights_as(engine, reference)
    # A submodule's own state_dict and load_state_dict: the weights whole, loaded into the
    # partitions and master weights (torch's copied into the placeholder: a size mismatch).
    assert torch.equal(model.l1.state_dict()["weight"], engine.module_state_dict()["l1.weight"])
    loaded = {"weight": torch.randn(2 * WIDTH, WIDTH) * 0.1, "bias": torch.zeros(2 * WIDTH)}
    model.l1.load_state_dict(loaded)
    with torch.no_grad():
        reference.l1.load_state_dict(loaded)
    with pytest.raises(RuntimeError, match=r"Linear: missing keys \['bias'\]"):
        model.l1.load_state_dict({"weight": loaded["weight"]})
    model.to("cpu")  # (a move: the placeholders moved as they are)
    for x, y in batches(2, seed=2):
        _step_beside(engine, reference, torch_adamw, x, y)
    _assert_weights_as(engine, reference)
    engine.close()  # (what it left refused by name; release() gives torch's parameters back)
    with pytest.raises(RuntimeError, match=r"l1.weight: norm\(\): its weights were partitioned by "
                                           r"a strata engine that is closed"):
        weight.norm()


def test_gathered_parameters_give_stage_3_weights_whole_and_take_edits(tmp_path):
    """DeepSpeed's GatheredParameters: outside their module's forward, partitioned weights are
    placeholders; within the block they are whole (a logged norm is plain torch's), edits made
    with modifier_rank become the weights and master weights, and training goes on as plain
    torch's from them; without modifier_rank an edit is dropped, and refused by name (it was
    dropped silently, as DeepSpeed's drops it). Blocks nested over a weight an enclosing block
    holds leave it to that block (they were refused as "lent to its module"), a modifying one
    writing its edit back."""
    engine, _, reference, torch_adamw = _beside_plain_torch(tmp_path, 3)
    data = list(batches(4))
    for x, y in data[:2]:
        step_both(engine, reference, torch_adamw, x, y)
    weight = engine.module.l1.weight
    assert not placeholders.holds_values(weight)  # a placeholder between uses
    with pytest.raises(RuntimeError, match=r"GatheredParameters without modifier_rank: "
                       r"l1.weight written in place in the block"):
        with strata.GatheredParameters(weight):
            assert weight.norm().item() == pytest.approx(reference.l1.weight.norm().item(),
                                                         rel=1e-6)
            weight.data.mul_(0.0)  # dropped: no modifier_rank
    assert not placeholders.holds_values(weight)
    with strata.GatheredParameters(weight):  # (an enclosing block that reads: DeepSpeed's
        with strata.GatheredParameters(weight):  # nested blocks over it leave it to the outer)
            pass
        with strata.GatheredParameters([weight, engine.module.ln.weight], modifier_rank=0):
            weight.data.mul_(0.5)
        assert weight.numel() > 0  # (whole still, the enclosing block's, with the edit)
    with torch.no_grad():
        reference.l1.weight.mul_(0.5)
    for x, y in data[2:]:
        step_both(engine, reference, torch_adamw, x, y)
    _assert_weights_as(engine, reference)


def test_gathered_parameters_with_a_modifier_takes_edits_of_weights_kept_whole(tmp_path):
    # Stage 2 keeps its weights whole in the module: an edit made with modifier_rank becomes the
    # master weights too (else the next step puts the old ones back), training going on as plain
    # torch's from it.
    engine, _, reference, torch_adamw = _beside_plain_torch(tmp_path, 2)
    data = list(batches(4))
    for x, y in data[:2]:
        step_both(engine, reference, torch_adamw, x, y)
    with strata.GatheredParameters([engine.module.l1.weight], modifier_rank=0):
        engine.module.l1.weight.data.mul_(0.5)
    with torch.no_grad():
        reference.l1.weight.mul_(0.5)
    for x, y in data[2:]:
        step_both(engine, reference, torch_adamw, x, y)
    _assert_weights_as(engine, reference)


def test_an_optimizer_not_the_engine_s_over_its_parameters_is_refused_by_name(tmp_path):
    # At stage 2 the gradients are the engine's, not in .grad: torch's AdamW made over the
    # module (a script moved from DeepSpeed that kept its own) would step nothing.
    engine, optimizer, _, _ = _beside_plain_torch(tmp_path, 2)
    own = torch.optim.AdamW(engine.module.parameters(), lr=1e-2)
    (x, y), = batches(1)
    engine.backward(loss_of(engine(x), y))
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) over a strata engine's parameters: "
                                           "it is not the engine's optimizer.*step nothing"):
        own.step()
    engine.step()  # the engine's own, and other models' optimizers, as ever
    other = torch.nn.Linear(2, 2)
    torch.optim.SGD(other.parameters(), lr=0.1).step()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_in_the_middle_of_an_accumulation_window_is_refused_by_name(tmp_path, stage):
    # Stage 2 kept the window's host sums (a silent no-op); stage 3 named a backward of the
    # user's own, which there was not.
    config = make_config(tmp_path, stage, "cpu", "fp32", accumulation=2)
    engine, optimizer, _, _ = strata.initialize(model=Net(), config=config)
    (x, y), = batches(1)
    engine.backward(loss_of(engine(x), y))
    engine.step()  # the window's first micro-batch: nothing stepped
    with pytest.raises(RuntimeError, match="zero_grad in the middle of an accumulation window "
                                           r"\(after micro-batch 1 of 2"):
        optimizer.zero_grad()
    engine.backward(loss_of(engine(x), y))
    engine.step()
    optimizer.zero_grad()  # after the window's step: as ever
    assert engine.global_steps == 1


def test_a_deep_copy_of_the_module_an_engine_trains_is_refused_until_it_is_released(tmp_path):
    # The copy (a frozen reference model) would keep the engine's methods and hooks: its
    # load_state_dict loaded into the engine, its zero_grad dropped the engine's gradients.
    engine, _, _, _ = _beside_plain_torch(tmp_path, 2)
    with pytest.raises(TypeError, match="copy.deepcopy of a module a strata engine trains"):
        copy.deepcopy(engine.module)
    model = engine.release()
    assert copy.deepcopy(model).l1.weight.equal(model.l1.weight)


def test_refusals_of_the_loop_idioms_name_what_is_wrong(tmp_path):
    """optimizer.load_state_dict (module.load_state_dict, load_checkpoint) between backward and
    step, a state entry without its step, a non-finite norm with error_if_nonfinite, a window
    end the trainer and the engine disagree on, and a GatheredParameters over a parameter lent
    to its module: each refused by name."""
    engine, optimizer, _, _ = _beside_plain_torch(tmp_path, 3)
    (x, y), = batches(1)
    engine.backward(loss_of(engine(x), y))
    state = optimizer.state_dict()
    with pytest.raises(RuntimeError, match="load_state_dict.. between backward and step"):
        optimizer.load_state_dict(state)
    engine.step()
    # The module's load_state_dict too (it would drop the step's gradients: a step changing
    # nothing), at a stage that stages nothing during backward: the gradients kept, stepped.
    (tmp_path / "two").mkdir()
    two, _, reference, torch_adamw = _beside_plain_torch(tmp_path / "two", 2)
    two.save_checkpoint(tmp_path / "two" / "ckpt")
    two.backward(loss_of(two(x), y))
    with pytest.raises(RuntimeError, match="module.load_state_dict between backward and step: "
                                           "the gradients made since the last step"):
        two.module.load_state_dict(two.module_state_dict())
    # And load_checkpoint (it was refused only where a step was staged during backward: at stage
    # 2 on the CPU it dropped the gradients, and the step after it changed nothing); at stage 0
    # after a loop's own loss.backward() (.grad held, no hook ran). (In the middle of a window,
    # after a step(), a load drops the window's sums: test_checkpoint.py.)
    with pytest.raises(RuntimeError, match="load_checkpoint between backward and step: it would "
                                           "drop the gradients made since the last step"):
        two.load_checkpoint(tmp_path / "two" / "ckpt")
    two.step()
    zero, _, _, _ = _beside_plain_torch(tmp_path / "zero", 0)
    zero.save_checkpoint(tmp_path / "zero" / "ckpt")
    loss_of(zero.module(x), y).backward()
    with pytest.raises(RuntimeError, match="load_checkpoint between backward and step"):
        zero.load_checkpoint(tmp_path / "zero" / "ckpt")
    zero.close()
    loss_of(reference(x), y).backward()
    torch_adamw.step()
    _assert_weights_as(two, reference)
    stepless = dict(state, state={0: {k: v for k, v in state["state"][0].items()
                                      if k != "step"}})
    with pytest.raises(ValueError, match=r"emb.weight's step is missing"):
        optimizer.load_state_dict(stepless)
    loss = loss_of(engine(x), y)
    engine.backward(loss * float("inf"))
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0, error_if_nonfinite=True)
    engine.step()  # (the step skips nothing in fp32: the weights go non-finite, as torch's)
    windowed, _, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path / "w", 2, "cpu", "fp32", accumulation=2))
    windowed.backward(loss_of(windowed(x), y))
    windowed.step()
    with pytest.raises(RuntimeError, match=r"window \(micro-batch 2 of 2\) ends here and the "
                                           r"trainer's does not"):
        windowed.set_gradient_accumulation_boundary(False)
    lent = []

    def inside(module, args):
        with pytest.raises(RuntimeError, match="GatheredParameters: l1.weight is lent"):
            with strata.GatheredParameters([module.weight]):
                pass
        lent.append(True)

    handle = engine.module.l1.register_forward_pre_hook(inside)
    engine(x)
    handle.remove()
    assert lent


def test_optimizer_commit_auto_is_step_across_ranks(tmp_path, monkeypatch):
    """optimizer_commit "auto" is "partition" only in one process: across ranks (WORLD_SIZE) the
    Runtime is given "step", where a step failing part way on one rank would leave the ranks'
    shards apart; one given is kept."""
    from strata.config import TrainConfig
    from strata.runtime_settings import RuntimeSettings
    config = make_config(tmp_path, 3, "nvme", "fp32")
    monkeypatch.setenv("WORLD_SIZE", "2")
    settings = RuntimeSettings(TrainConfig.parse(config, world_size=2))
    assert json.loads(settings.runtime_json)["strata"]["optimizer_commit"] == "step"
    config["strata"]["optimizer_commit"] = "partition"
    settings = RuntimeSettings(TrainConfig.parse(config, world_size=2))
    assert json.loads(settings.runtime_json)["strata"]["optimizer_commit"] == "partition"
    monkeypatch.setenv("WORLD_SIZE", "1")
    del config["strata"]["optimizer_commit"]
    settings = RuntimeSettings(TrainConfig.parse(config, world_size=1))
    assert "optimizer_commit" not in json.loads(settings.runtime_json)["strata"]


def test_a_dtype_conversion_of_the_trained_module_is_refused_by_name(tmp_path):
    # model.half().float() after initialize was taken silently: the next step wrote the weights
    # anew from the fp32 master weights, the rounding lost (plain torch keeps it).
    engine, _, _, _ = strata.initialize(model=Net(), config=make_config(tmp_path, 2, "cpu",
                                                                        "fp32"))
    engine.module.to("cpu").float()  # (a move, its own dtype: as torch's)
    with pytest.raises(TypeError, match=r"Net.to\(torch.float16\) \(.half\(\), .float\(\), "
                                        r".bfloat16\(\)\) of a module a strata engine trains"):
        engine.module.half()
    with pytest.raises(TypeError, match=r"Linear.to\(torch.bfloat16\)"):
        engine.module.l1.bfloat16()
    assert engine.module.l1.weight.dtype == torch.float32
    assert engine.release().half().l1.weight.dtype == torch.float16
