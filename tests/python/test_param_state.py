"""strata.safe_get_full_* / safe_set_full_* (DeepSpeed's deepspeed.utils functions): one
parameter's gradient, fp32 master weights and optimizer state, read where the engine keeps them
and set there, against plain torch's .grad, weights and AdamW state (the device tier is the
host-emulated one: no GPU here)."""
import copy
import json

import pytest
import torch

import strata
from launch import start_ranks

WIDTH = 16


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.l2 = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).pow(2).mean()


def config(tmp_path, stage):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 100}  # (l1, l2 weights partitioned)
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "strata": {"device": "emulated", "nvme_path": str(tmp_path / "nvme")}}


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, WIDTH, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_full_state_reads_as_torch_holds_it_and_a_set_one_trains_on(tmp_path, stage):
    """Between backward and step safe_get_full_grad is torch's .grad (after clip_grad_norm_, its
    clipped value); after the step the fp32 master weights are torch's weights and the moments
    torch's AdamW state; master weights and a moment set (a re-initialized row, a moment reset)
    train on as torch's with the same set."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    engine, optimizer, _, _ = strata.initialize(model=model, config=config(tmp_path, stage))
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    pairs = list(zip(engine.module.parameters(), reference.parameters()))
    for i, x in enumerate(batches(4)):
        engine.backward(engine(x))
        reference(x).backward()
        if i == 1:
            for net in (engine.module, reference):
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        for ours, theirs in pairs:
            torch.testing.assert_close(strata.safe_get_full_grad(ours), theirs.grad,
                                       rtol=1e-5, atol=1e-7)
        strata.safe_get_full_grad(pairs[0][0]).add_(1.0)  # (a copy: training unchanged)
        with pytest.raises(RuntimeError, match="safe_set_full_fp32_param between backward and "
                           "step"):
            strata.safe_set_full_fp32_param(pairs[0][0], pairs[0][1])
        engine.step()
        adamw.step()
        adamw.zero_grad()
        assert strata.safe_get_full_grad(pairs[0][0]) is None  # (dropped with the step)
        for ours, theirs in pairs:
            torch.testing.assert_close(strata.safe_get_full_fp32_param(ours), theirs.detach(),
                                       rtol=1e-5, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(strata.safe_get_full_optimizer_state(ours, key),
                                           adamw.state[theirs][key], rtol=1e-5, atol=1e-7)
        if i == 1:  # (an edit in place: the state read next has it, as torch's weights do)
            for net in (engine.module, reference):
                torch.nn.init.zeros_(net.l2.bias)
            assert not optimizer.state_dict()["state"][3]["master"].any()
            with torch.no_grad():
                for net in (engine.module, reference):
                    net.l2.bias.fill_(0.25)
            assert (strata.safe_get_full_fp32_param(pairs[-1][0]) == 0.25).all()
        if i == 2:
            w, b = pairs[0]
            new = strata.safe_get_full_fp32_param(w).clone()
            new[0] = 0.5
            strata.safe_set_full_fp32_param(w, new)
            strata.safe_set_full_optimizer_state(w, torch.zeros_like(new), "exp_avg")
            with torch.no_grad():
                b.copy_(new)
            adamw.state[b]["exp_avg"].zero_()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(engine.module_state_dict()[name], value, rtol=1e-5,
                                   atol=1e-6, msg=name)
    with pytest.raises(ValueError, match=r"optim_state_key 'momentum_buffer': the engine's "
                       r"optimizer \(adam\) keeps 'exp_avg', 'exp_avg_sq'"):
        strata.safe_get_full_optimizer_state(pairs[0][0], "momentum_buffer")
    with pytest.raises(ValueError, match=r"a value of 3 elements for l1.weight, whose whole has "
                       r"1024; accepted: its shape \(64, 16\)"):
        strata.safe_set_full_fp32_param(pairs[0][0], torch.zeros(3))
    with pytest.raises(ValueError, match=r"a value of shape \(16, 64\) .*accepted: a real "
                       r"tensor of its shape \(64, 16\)"):  # (transposed: refused, not flattened)
        strata.safe_set_full_fp32_param(pairs[0][0], torch.zeros(16, 64))
    with pytest.raises(ValueError, match=r"optim_state_key None: the engine's optimizer"):
        strata.safe_get_full_optimizer_state(pairs[0][0], None)
    with pytest.raises(ValueError, match=r"dtype torch.complex64 .*accepted: a real tensor"):
        strata.safe_set_full_fp32_param(pairs[0][0], torch.zeros(64, 16, dtype=torch.complex64))
    w = pairs[0][0]  # the local variants: in one process, all of it, flat
    assert torch.equal(strata.safe_get_local_optimizer_state(w, "exp_avg"),
                       strata.safe_get_full_optimizer_state(w, "exp_avg").reshape(-1))
    strata.safe_set_local_optimizer_state(w, torch.ones(1024), "exp_avg_sq")
    strata.safe_set_local_fp32_param(w, torch.full((1024,), 0.5))
    assert (strata.safe_get_full_optimizer_state(w, "exp_avg_sq") == 1).all()
    assert (engine.module_state_dict()["l1.weight"] == 0.5).all()  # (the weights too)
    plain = torch.nn.Parameter(torch.zeros(3))
    assert strata.safe_get_full_fp32_param(plain) is None  # (no engine's: as DeepSpeed's)
    with pytest.raises(ValueError, match="is not one a strata engine trains"):
        strata.safe_set_full_fp32_param(plain, torch.zeros(3))


@pytest.mark.parametrize("stage, offload", [(0, "cpu"), (1, "cpu"), (2, "cpu"), (3, "nvme")])
def test_a_gradient_set_between_backward_and_step_is_the_one_the_step_takes(tmp_path, stage,
                                                                          offload):
    """Gradient surgery (a projection, a mask) between backward and step, as plain torch's
    `p.grad = t` sets it: `.grad = t` itself (stages 0-2; refused by name at stage 3, where the
    gradient is the engine's partition) and safe_set_full_grad / safe_set_local_grad, which
    DeepSpeed's users call, at every stage; what is set after a clip_grad_norm_ stands. The
    weights and moments follow plain torch's AdamW with the same surgery. (At stage 3 the first
    step, staged during backward, is taken anew; from then on nothing is staged.)"""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    conf = config(tmp_path, stage)
    conf["zero_optimization"]["offload_optimizer"] = {"device": offload,
                                                      "nvme_path": str(tmp_path / "nvme")}
    engine, _, _, _ = strata.initialize(model=model, config=conf)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    named = list(zip(engine.module.named_parameters(), reference.parameters()))

    def surgery(name, g, i):  # l1's weight flipped and scaled, a row of l2's masked
        if name == "l1.weight":
            return -3.0 * g
        if name == "l2.weight" and i % 2:
            g = g.clone()
            g[3] = 0
        return g

    for i, x in enumerate(batches(3)):
        engine.backward(engine(x))
        reference(x).backward()
        if i == 2:  # (what is set after it is not clipped again)
            for net in (engine.module, reference):
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
        for (name, ours), theirs in named:
            theirs.grad = surgery(name, theirs.grad, i)
            if stage < 3 and i == 0:
                ours.grad = surgery(name, theirs.grad.clone(), -1)  # (as torch's: unmasked)
                ours.grad = theirs.grad.clone()  # (the last one given stands)
            elif name == "l2.bias":
                strata.safe_set_local_grad(ours, surgery(name, theirs.grad, i).reshape(-1))
            else:
                strata.safe_set_full_grad(ours, surgery(name, strata.safe_get_full_grad(ours), i))
            torch.testing.assert_close(strata.safe_get_full_grad(ours), theirs.grad)
        engine.step()
        adamw.step()
        adamw.zero_grad()
    for (name, ours), theirs in named:
        torch.testing.assert_close(strata.safe_get_full_fp32_param(ours), theirs.detach(),
                                   rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(strata.safe_get_full_optimizer_state(ours, "exp_avg"),
                                   adamw.state[theirs]["exp_avg"], rtol=1e-5, atol=1e-7,
                                   msg=name)
    assert engine._step.redone_steps == (1 if stage == 3 else 0)
    w = engine.module.l1.weight
    with pytest.raises(RuntimeError, match=r"safe_set_full_grad\(l1.weight\) with no backward "
                       r"since the last step: .*accepted: between backward and step\(\)"):
        strata.safe_set_full_grad(w, torch.zeros(64, 16))
    engine.backward(engine(batches(1)[0]))
    if stage == 3:
        with pytest.raises(RuntimeError, match=r"l1.weight: .grad = t on a parameter ZeRO stage "
                           r"3 partitions: .*accepted: strata.safe_set_full_grad\(param, t\)"):
            w.grad = torch.zeros(64, 16)
    with pytest.raises(ValueError, match=r"safe_set_full_grad: a value of shape \(16, 64\) .*"
                       r"accepted: a real tensor of its shape \(64, 16\)"):
        strata.safe_set_full_grad(w, torch.zeros(16, 64))
    with pytest.raises(ValueError, match=r"safe_set_local_grad: a value of 3 elements for "
                       r"l1.weight, whose shard on this rank has 1024"):
        strata.safe_set_local_grad(w, torch.zeros(3))
    with pytest.raises(ValueError, match="safe_set_full_grad: the parameter .* is not one a "
                       "strata engine trains"):
        strata.safe_set_full_grad(torch.nn.Parameter(torch.zeros(3)), torch.zeros(3))
    engine.step()


def test_state_read_after_it_stepped_during_backward_is_refused_and_fp16_grads_unscaled(
        tmp_path):
    """With strata.optimizer_during_backward at stage 3 the partitions step during backward:
    their master weights read between backward and step would be the step's result (torch's
    are the weights before optimizer.step()): refused by name. In fp16 the gradient read is
    unscaled (torch's .grad after GradScaler.unscale_), and one set is taken so (one past
    fp16's range once scaled is refused, as is `.grad = t` where it could be either)."""
    conf = config(tmp_path, 3)
    conf["strata"]["optimizer_during_backward"] = True
    engine, _, _, _ = strata.initialize(model=Net(), config=conf)
    first, second = batches(2)
    engine.backward(engine(first))  # (from the second step on they step during backward)
    engine.step()
    engine.backward(engine(second))
    weight = engine.module.l1.weight
    with pytest.raises(RuntimeError, match=r"safe_get_full_fp32_param\(l1.weight\) between "
                       r"backward and step, after it stepped during backward"):
        strata.safe_get_full_fp32_param(weight)
    engine.step()
    engine.close()
    conf = config(tmp_path / "fp16", 0)
    conf["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, _, _, _ = strata.initialize(model=Net().half(), config=conf)
    engine.backward(engine(batches(1)[0].half()))
    bias = engine.module.l2.bias
    assert engine.loss_scale == 256
    torch.testing.assert_close(strata.safe_get_full_grad(bias), bias.grad / 256)
    strata.safe_set_full_grad(bias, torch.full((WIDTH,), 0.25))  # (set unscaled, as read)
    assert (bias.grad == 64).all() and (strata.safe_get_full_grad(bias) == 0.25).all()
    with pytest.raises(ValueError, match=r"safe_set_full_grad\(l2.bias\): the value times 256 "
                       r".* past torch.float16's range"):  # (kept scaled in .grad, in fp16)
        strata.safe_set_full_grad(bias, torch.full((WIDTH,), 300.0))
    engine.close()
    # Where the engine keeps it outside .grad, `.grad = t` could be scaled or not: refused.
    conf = config(tmp_path / "fp16-2", 2)
    conf["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, _, _, _ = strata.initialize(model=Net().half(), config=conf)
    engine.backward(engine(batches(1)[0].half()))
    engine.module.l2.bias.grad = torch.zeros(WIDTH, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"l2.bias.grad = t between backward and step under "
                       r"fp16, .*accepted: strata.safe_set_full_grad\(param, t\)"):
        engine.step()


# Two ranks at stages 2 and 3: every rank's full values are the whole gradient (the mean of the
# ranks'), master weights and moments; each rank's local ones are its shard of them; a full
# gradient set is the one the step takes; full master weights set are every rank's shard of them,
# and the weights.
RANKS = r"""
import json, os, sys, torch
import strata
sys.path.insert(0, os.environ["TESTS"])
from test_param_state import Net, WithUnused, WIDTH
rank = int(os.environ["RANK"])
out = {}


def config_of(stage):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
            "strata": {"device": "emulated"}}


for stage in (2, 3):
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=WithUnused(), config=config_of(stage))
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    w = engine.module.l1.weight
    unused = engine.module.unused.bias  # (backward gives it no gradient: .grad = t gives one)
    engine.backward(engine(x))
    unused.grad = torch.full((4 * WIDTH,), 0.25)
    if rank == 0:
        strata.safe_get_local_grad(w)  # (its own shard: no collective, rank 1 not waited for)
    grad = strata.safe_get_full_grad(w)
    local = strata.safe_get_local_grad(w)
    strata.safe_set_full_grad(w, -2 * grad)  # (each rank takes its shard of it)
    got = strata.safe_get_full_grad(w)
    engine.step()
    master = strata.safe_get_full_fp32_param(w)
    moment = strata.safe_get_full_optimizer_state(w, "exp_avg")
    shard = strata.safe_get_local_fp32_param(w)
    half = master.numel() // 2  # (each rank's shard: half of it)
    torch.manual_seed(0)  # one process's gradient of the mean loss over both ranks' batches
    reference = Net()
    sum(reference(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(r)))
        for r in range(2)).div(2).backward()
    flat, master_flat = grad.reshape(-1), master.reshape(-1)
    out[stage] = {"grad": grad.sum().item(), "master": master.sum().item(),
                  "moment": moment.sum().item(),
                  "weights": engine.module_state_dict()["l1.weight"].sum().item(),
                  "local": (local - flat[rank * half:(rank + 1) * half]).abs().max().item(),
                  "shard": (shard - master_flat[rank * half:(rank + 1) * half]).abs().max().item(),
                  "sizes": [local.numel(), shard.numel()],
                  "mean": (grad - reference.l1.weight.grad).abs().max().item(),
                  # the first moment after the step: (1 - beta1) x the gradient set
                  "grad set": [(got + 2 * grad).abs().max().item(),
                               (moment + 0.1 * 2 * grad).abs().max().item(),
                               (strata.safe_get_full_optimizer_state(unused, "exp_avg") - 0.025)
                               .abs().max().item()]}
    new = torch.arange(master.numel(), dtype=torch.float32).view(master.shape)
    strata.safe_set_full_fp32_param(w, new)  # (every rank takes its shard of it)
    out[stage]["set"] = [(strata.safe_get_full_fp32_param(w) - new).abs().max().item(),
                         (engine.module_state_dict()["l1.weight"] - new).abs().max().item()]
    # A local set (the weights follow at the next step) stays, a .data read and a forward
    # between (the weights' old values were taken back as an edit).
    strata.safe_set_local_fp32_param(w, torch.full((half,), 0.5))
    if stage == 2:
        w.data.norm()
    with torch.no_grad():
        engine(x)
    out[stage]["local set"] = (strata.safe_get_local_fp32_param(w) - 0.5).abs().max().item()
    engine.close()
# A .grad given between two backwards through a retained graph, after the first one's reduce
# (stage 1, stage 3's small parameters): the second adds to it where it reaches it, as DDP's,
# and leaves it where it does not (before, the first backward's mean stayed beside it: counted
# twice, or added to the value given).
class TwoHeads(Net):
    def __init__(self):
        super().__init__()
        self.l3 = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        return self.l2(h).pow(2).mean(), self.l3(h).pow(2).mean()


for stage in (1, 3):
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=TwoHeads(), config=config_of(stage))
    first, second = engine(x)
    engine.backward(first + second, retain_graph=True)
    engine.module.l2.bias.grad = torch.full((WIDTH,), -0.2)  # (the second backward reaches it)
    engine.module.l3.bias.grad = torch.full((WIDTH,), 0.3)  # (it does not)
    engine.backward(2 * first)
    engine.step()
    torch.manual_seed(0)
    reference = TwoHeads()
    sum(reference(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(r)))[0]
        for r in range(2)).div(2).backward()
    moments = [strata.safe_get_full_optimizer_state(engine.module.get_submodule(name).bias,
                                                    "exp_avg") for name in ("l2", "l3")]
    out[f"retained {stage}"] = max(
        (moments[0] - 0.1 * (-0.2 + 2 * reference.l2.bias.grad)).abs().max().item(),
        (moments[1] - 0.1 * 0.3).abs().max().item())
    engine.close()
# Stage 1 in bf16 over 2 micro-batches: each rank's sum kept apart (fp32) until the window's
# reduce; a .grad given between the micro-batches could not replace it, and the full gradient
# is not known yet (each rank's sum is its own): refused by name (a set was taken with the
# rank's sum left beside it, added at the reduce; a read gave this rank's own sum).
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 1}, "strata": {"device": "emulated"}}
engine, _, _, _ = strata.initialize(model=Net().bfloat16(), config=config)
engine.backward(engine(x.bfloat16()))
bias = engine.module.l2.bias
for what, call in [("safe_get_full_grad", lambda: strata.safe_get_full_grad(bias)),
                   ("safe_get_local_grad", lambda: strata.safe_get_local_grad(bias)),
                   ("safe_set_full_grad",
                    lambda: strata.safe_set_full_grad(bias, torch.zeros(WIDTH)))]:
    try:
        call()
        out[what] = "not refused"
    except RuntimeError as error:
        out[what] = str(error)
engine.step()
engine.module.l2.bias.grad = torch.zeros(WIDTH, dtype=torch.bfloat16)
try:
    engine.backward(engine(x.bfloat16()))
    out["apart"] = "not refused"
except RuntimeError as error:
    out["apart"] = str(error)
print(json.dumps(out), flush=True)
sys.stdout.flush()
os._exit(0)
"""


def test_across_ranks_the_full_state_is_every_ranks_whole_and_the_local_its_shard():
    import os
    procs = start_ranks(2, RANKS, extra_env={"TESTS": os.path.dirname(__file__)})
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for out in outs:
        assert out.pop("apart").startswith("l2.bias.grad = t across ranks before the window's "
                                           "gradients are reduced"), out
        assert out.pop("retained 1") < 1e-8 and out.pop("retained 3") < 1e-8, out
        for what in ("safe_get_full_grad", "safe_get_local_grad", "safe_set_full_grad"):
            assert out.pop(what).startswith(f"{what}(l2.bias) across ranks before the window's "
                                            "gradients are reduced"), out
    for stage in ("2", "3"):
        a, b = outs[0][stage], outs[1][stage]
        for key in ("grad", "master", "moment"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (stage, key)
        assert a["master"] == pytest.approx(a["weights"], rel=1e-6)
        assert a["local set"] == b["local set"] == 0.0, stage
        for out in (a, b):
            assert out["local"] == 0 and out["shard"] == 0 and out["sizes"] == [512, 512], out
            assert out["set"] == [0, 0], out
            assert out["mean"] < 1e-6, out
            assert out["grad set"][0] == 0 and max(out["grad set"][1:]) < 1e-8, out


class WithUnused(Net):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(WIDTH, 4 * WIDTH)  # (backward gives it no gradient)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_given_by_hand_in_a_loop_of_one_s_own_are_torch_s(tmp_path, stage):
    """A loop of one's own: `.grad = t` between two backwards of one step replaces the sum so far
    and the second backward adds to it, as torch's adds to .grad (at stage 2 the engine's host
    sums: taken at the next forward, or, with no forward between (retain_graph), before
    autograd adds); at stage 3 a small parameter's .grad is torch's own, set or edited in place
    after backward (the step reads it after backward); a parameter backward gave no gradient is
    given one (at stage 3, partitioned: safe_set_full_grad); a .grad given after a
    clip_grad_norm_ is not clipped, as torch's."""
    torch.manual_seed(0)
    model = WithUnused()
    reference = copy.deepcopy(model)
    engine, optimizer, _, _ = strata.initialize(model=model, config=config(tmp_path, stage))
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    zeroth, first, second, third = batches(4)
    for net, opt in ((engine.module, optimizer), (reference, adamw)):
        net(zeroth).backward()
        net.l1.bias.grad = torch.full((4 * WIDTH,), 0.3)
        if stage == 3:
            net.l2.bias.grad.mul_(-1.0)
        opt.step()
        opt.zero_grad()
        net(first).backward()
        net.l1.bias.grad = torch.full((4 * WIDTH,), 0.1)
        net(second).backward()
        if stage == 3 and net is engine.module:
            strata.safe_set_full_grad(net.unused.weight, torch.full((4 * WIDTH, WIDTH), 0.1))
        else:
            net.unused.weight.grad = torch.full((4 * WIDTH, WIDTH), 0.1)
        opt.step()
        opt.zero_grad()
        loss = net(third)
        loss.backward(retain_graph=True)
        net.l2.bias.grad = torch.full((WIDTH,), -0.2)
        (2 * loss).backward()
        # After a clip, what is put in .grad is not clipped (at stage 3 the clip of the small
        # parameters' .grad waits for the step, with the partitions')
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
        net.l1.bias.grad = torch.full((4 * WIDTH,), 0.5)
        if stage == 3 and net is engine.module:  # (none from backward)
            strata.safe_set_full_grad(net.unused.weight, torch.full((4 * WIDTH, WIDTH), -0.25))
        else:
            net.unused.weight.grad = torch.full((4 * WIDTH, WIDTH), -0.25)
        opt.step()
        opt.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(engine.module_state_dict()[name], value, rtol=1e-5,
                                   atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_clip_left_to_the_step_reads_none_and_a_backward_after_it_is_refused(tmp_path, stage):
    """Where the engine applies a clip_grad_norm_ at the step (its gradients apart from .grad),
    .grad reads None after the clip (at stage 3 its small parameters' move out of .grad then: a
    read of one would be unclipped, where torch's is clipped); a backward after the clip in the
    same step is refused by name (torch's adds an unclipped gradient to clipped ones; the engine
    would clip both), by engine.backward and by a loss.backward() of the loop's; a gradient set
    after a clip of max_norm 0 is refused (nothing set after it could stand)."""
    engine, _, _, _ = strata.initialize(model=Net(), config=config(tmp_path, stage))
    first, second = batches(2)
    engine.backward(engine(first))
    torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1e-3)
    assert all(p.grad is None for p in engine.module.parameters())
    with pytest.raises(RuntimeError, match="backward after torch.nn.utils.clip_grad_norm_ in "
                       "the same step: .*accepted: clip_grad_norm_ after the step's last"):
        engine.backward(engine(second))
    engine.step()
    engine.zero_grad()
    engine(first).backward()  # (a loop of one's own)
    torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.0)
    with pytest.raises(RuntimeError, match=r"safe_set_full_grad\(l2.bias\) after "
                       "clip_grad_norm_ with max_norm 0"):
        strata.safe_set_full_grad(engine.module.l2.bias, torch.zeros(WIDTH))
    kept = [strata.safe_get_full_grad(p) for p in engine.module.parameters()]
    with pytest.raises(RuntimeError, match="backward after torch.nn.utils.clip_grad_norm_"):
        engine(second).backward()
    # (nothing of the refused backward kept: the gradients are the clipped ones, and the step
    # takes them, its lent weights given back)
    for before, p in zip(kept, engine.module.parameters()):
        assert p.grad is None and torch.equal(strata.safe_get_full_grad(p), before)
    engine.step()
