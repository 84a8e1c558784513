"""The engine's parts, each alone where a seam allows: the loss scaler, the training state, the
parameter table, and the lending with a Runtime of the test's own (strata/engine.py composes
them)."""

import types

import pytest
import torch

from strata.lending import Lending
from strata.loss_scaler import LossScaler
from strata.parameters import Param, ParameterTable
from strata.training_state import Phase, TrainingState


def _fp16(**keys):
    c = dict(loss_scale=0.0, initial_scale_power=4, hysteresis=2, consecutive_hysteresis=False,
             loss_scale_window=3, min_loss_scale=2.0)
    c.update(keys)
    return types.SimpleNamespace(**c)


def test_loss_scaler_state_round_trips():
    """A checkpoint's loss scaler state, taken back, goes on as the one saved (mid-hysteresis).
    (DeepSpeed's rule itself: test_engine.py's test_the_loss_scale_follows_...)"""
    s = LossScaler(_fp16(), torch.float16)
    assert s.dynamic and s.scale == 16.0
    for overflow in (True, True, False, True):
        s.update(overflow)
    again = LossScaler(_fp16(), torch.float16)
    again.load_state_dict(s.state_dict())
    for overflow in (True, False, False, False):
        for t in (again, s):
            t.update(overflow)
        assert again.state_dict() == s.state_dict()
    assert s.scale == 2.0  # at min_loss_scale: the window not yet run out since the overflow


def test_an_overflow_at_the_loss_scale_s_minimum_is_an_error_not_a_skip_for_ever():
    # As DeepSpeed's DynamicLossScaler (raise_error_at_min_scale, its default): 16 -> 8 -> 4.
    s = LossScaler(_fp16(hysteresis=1, min_loss_scale=4.0), torch.float16)
    s.update(True)
    s.update(True)
    assert s.scale == 4.0
    with pytest.raises(RuntimeError, match=r"overflowed at the loss scale's minimum "
                                           r"\(fp16.min_loss_scale 4\)"):
        s.update(True)


def test_loss_scaler_static_and_unscaled():
    static = LossScaler(_fp16(loss_scale=128.0), torch.float16)
    for overflow in (True, True, True, False):
        static.update(overflow)
    assert (static.dynamic, static.scale) == (False, 128.0)
    bf16 = LossScaler(_fp16(), torch.bfloat16)
    bf16.update(True)
    assert bf16.scale == 1.0


def test_training_state_phases():
    s = TrainingState()
    assert not s.gradients_since_step and not s.backward_since_step
    s.gradient_made()  # the user's own backward
    assert s.phase is Phase.LOOSE and s.gradients_since_step and not s.backward_since_step
    s.phase = Phase.BACKWARD
    s.gradient_made()  # the engine's: stays its backward
    assert s.in_backward and s.backward_since_step and s.phase is Phase.BACKWARD
    s.phase = Phase.GRADIENTS
    assert not s.in_backward and s.backward_since_step


class _Runtime:
    """The lending's seam: lend() gives a copy of the partition's weights and counts it."""

    def __init__(self, weights):
        self.weights = weights
        self.lent = []

    def lend(self, pid, tier, stream=None, traced=True):
        assert tier == "device"
        self.lent.append((pid, traced))
        return self.weights[pid].clone()


def _lent_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference = [p.detach().clone() for p in model.parameters()]
    entries = [Param(n, p, 2 * i) for i, (n, p) in enumerate(model.named_parameters())]
    placeholder = torch.empty(0)
    weights = {}
    for e in entries:
        e.partitioned = True
        weights[e.pid] = e.param.detach().reshape(-1).clone()
        e.param.data = placeholder
    table = ParameterTable(entries, [], placeholder)
    table.placed()
    return model, reference, table, _Runtime(weights)


def test_the_bytes_lent_are_the_device_tiers_a_shard_across_ranks():
    """ParameterTable.lent_bytes: what the lent partitions hold of the device budget, a shard's
    bytes across ranks (the weights gathered whole are torch's, outside the budget); the error
    of a budget without room says it."""
    _, _, table, _ = _lent_model()
    first, second = table.trained[0], table.trained[2]
    first.param.data = torch.zeros(first.shape)
    assert table.lent_bytes() == first.numel * 4
    second.shard = 3  # (across 2 ranks: 16 elements, lent whole after the gather)
    second.param.data = torch.zeros(second.shape)
    assert table.lent_bytes() == first.numel * 4 + 3 * 4


def test_lending_lends_around_each_module_alone():
    """Each Linear's weights are lent for its forward and again for its backward, and given back
    after; the result is the whole model's."""
    model, reference, table, runtime = _lent_model()
    state = TrainingState()
    lending = Lending(table, None, state, runtime)
    lending.install(model, stage=3)
    x = torch.randn(3, 4)
    plain = torch.nn.functional.linear(
        torch.relu(torch.nn.functional.linear(x, reference[0], reference[1])),
        reference[2], reference[3])
    out = model(x)
    assert torch.equal(out, plain)
    assert all(e.param.data.numel() == 0 for e in table.trained)  # given back after forward
    assert sorted(pid for pid, _ in runtime.lent) == [0, 2, 4, 6]
    assert all(traced for _, traced in runtime.lent)
    state.phase = Phase.BACKWARD
    out.sum().backward()
    assert sorted(pid for pid, _ in runtime.lent) == [0, 0, 2, 2, 4, 4, 6, 6]  # again for it
    assert model[0].weight.grad is not None and model[0].weight.grad.shape == (8, 4)
    lending.drop_all()
    assert not any(lending.holders.values()) and table.lent_bytes() == 0
    # An evaluation's forward is not part of the step's trace.
    state.phase = Phase.IDLE
    model.eval()
    with torch.no_grad():
        model(x)
    assert [traced for _, traced in runtime.lent[-4:]] == [False] * 4
    lending.remove()
    assert "forward" not in model[0].__dict__ and not lending.handles


def test_lending_holds_the_lending_weakly():
    """Neither the model's hooks nor a forward's graph the user keeps (a loss not backwarded:
    its hooks lend again for backward) keep the lending, so not its Runtime, alive."""
    import weakref
    model, _, table, runtime = _lent_model()
    lending = Lending(table, None, TrainingState(), runtime)
    lending.install(model, stage=3)
    kept = model(torch.randn(2, 4)).sum()  # its graph holds the outputs' hooks
    ref = weakref.ref(lending)
    del lending
    assert ref() is None  # (by its last reference: no cycle for the collector to find)
    assert kept.grad_fn is not None  # (the graph was alive all along)
    with pytest.raises(RuntimeError):  # nothing lends now: the placeholders are empty
        model(torch.randn(1, 4))


class _GradientRuntime:
    """The gradients' seam: a gradient partition per id (acquire for the device, release,
    gradient_ready), each call kept."""

    def __init__(self):
        self.parts, self.calls = {}, []

    def acquire(self, gid, tier, overwrite=False):
        self.calls.append(("acquire", gid, overwrite))
        return self.parts.setdefault(gid, torch.zeros(4))

    def release(self, gid, tier, written, stream=None):
        self.calls.append(("release", gid, written))

    def gradient_ready(self, gid):
        self.calls.append(("ready", gid))


class _StepSeam:
    """Stands in for OptimizerStep: what the gradient hook asks of it."""

    def __init__(self):
        self.staged, self.second = [], []
        self.user_clip = None  # (no clip_grad_norm_ of the user's in this step)

    def stage_from_hook(self, e, grad=None, grad_stream=None):
        self.staged.append(e.name)

    def second_gradient(self, e):
        self.second.append(e.name)


def test_gradients_sum_into_the_partition_and_stage_the_step_alone():
    """Stage 3, two micro-batches a window: the first gradient is copied into the partition (its
    room taken without zeros), the second added; the boundary's sends it down and stages its
    step; a second gradient in the boundary micro-batch is told to the step, and the lent copy
    goes back as each is made."""
    from strata.gradients import Gradients, HostCopies
    from strata.notices import Notices
    weight = torch.nn.Parameter(torch.ones(4))
    e = Param("w", weight, 0)
    e.partitioned = True
    table = ParameterTable([e], [], torch.empty(0))
    table.placed()
    state = TrainingState(accumulation=2)
    runtime, step = _GradientRuntime(), _StepSeam()
    lending = Lending(table, None, state, runtime)
    gradients = Gradients(table, None, state, lending, step, HostCopies(torch.device("cpu"),
                                                                          torch.float32),
                          Notices(), stage=3, sum_apart=False, grad_accum_dtype=torch.float32,
                          device=torch.device("cpu"))
    gradients.runtime = runtime
    node = weight.expand_as(weight).grad_fn.next_functions[0][0]
    node.register_hook(gradients.hook(e))
    (weight * 2).sum().backward()  # micro-batch 1 of 2: not the boundary
    assert runtime.parts[1].tolist() == [2.0] * 4 and weight.grad is None
    assert ("acquire", 1, True) in runtime.calls and ("ready", 1) not in runtime.calls
    assert weight.numel() == 0  # the lent copy went back
    assert state.phase is Phase.LOOSE and step.staged == []
    weight.data = torch.ones(4)
    state.micro_steps = 1  # the boundary micro-batch
    (weight * 3).sum().backward()
    assert runtime.parts[1].tolist() == [5.0] * 4
    assert ("acquire", 1, False) in runtime.calls and runtime.calls[-1] == ("ready", 1)
    assert step.staged == ["w"] and e.sent_down
    weight.data = torch.ones(4)
    (weight * 1).sum().backward()  # a second backward through the boundary micro-batch
    assert step.second == ["w"]


def test_lending_gives_a_frozen_parameter_back_once_its_modules_input_gradient_is_made():
    """A frozen partitioned parameter has no gradient hook: the lending gives it back when the
    gradient of its module's input is made (the module's backward is done), not at the end of
    backward; the holds are all given back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[1].weight.requires_grad_(False)
    entries = []
    for i, (n, p) in enumerate(model.named_parameters()):
        e = Param(n, p, 2 * i, frozen=not p.requires_grad)
        e.partitioned = True
        entries.append(e)
    weights = {e.pid: e.param.detach().reshape(-1).clone() for e in entries}
    placeholder = torch.empty(0)
    for e in entries:
        e.param.data = placeholder
    table = ParameterTable([e for e in entries if not e.frozen],
                           [e for e in entries if e.frozen], placeholder)
    table.placed()
    state = TrainingState()
    lending = Lending(table, None, state, _Runtime(weights))
    lending.install(model, stage=3)
    frozen = model[1].weight
    seen = []
    # The first layer's weight gradient comes after its output's (the second layer's input's).
    model[0].weight.register_hook(lambda grad: seen.append(frozen.numel()))
    out = model(torch.randn(3, 4))
    state.phase = Phase.BACKWARD
    out.sum().backward()
    assert seen == [0]  # given back before the first layer's backward ran
    assert lending.holders[table.frozen[0].pid] == 0


def test_gradients_end_step_ends_the_window_and_drops_every_gradient():
    """end_step: the step's staged work ended and its window closed (in that order), each
    gradient partition discarded and every entry's gradient fields cleared; a discard that fails
    is raised after the rest (a failed step's, warned instead)."""
    from strata import _strata
    from strata.gradients import Gradients, HostCopies
    from strata.notices import Notices
    calls = []

    class Step:
        def end_staged(self, committed, reason):
            calls.append(("end_staged", committed, reason))

        def release_early_held(self, attempt):
            calls.append("release_early_held")

        def end_window(self):
            calls.append("end_window")

    class Runtime:
        def discard(self, gid):
            calls.append(("discard", gid))
            if gid == 3:
                raise _strata.Error("injected: the discard failed")

    entries = [Param(n, torch.nn.Parameter(torch.ones(2)), 2 * i) for i, n in enumerate("ab")]
    for e in entries:
        e.partitioned, e.has_grad, e.sent_down, e.grad_norm = True, True, True, torch.tensor(1.0)
    table = ParameterTable(entries, [], torch.empty(0))
    table.placed()
    notices = Notices(say=False)
    gradients = Gradients(table, None, TrainingState(), None, Step(),
                          HostCopies(torch.device("cpu"), torch.float32), notices, stage=3,
                          sum_apart=False, grad_accum_dtype=torch.float32,
                          device=torch.device("cpu"))
    gradients.runtime = Runtime()
    with pytest.raises(_strata.Error, match="injected"):
        gradients.end_step(failed=False)
    assert calls == [("end_staged", False, "gradients dropped"), "release_early_held",
                     "end_window", ("discard", 1), ("discard", 3)]
    assert not any(e.has_grad or e.sent_down or e.grad_norm is not None for e in entries)
    for e in entries:
        e.has_grad = True
    gradients.end_step(failed=True)  # the failed step's own error is the one raised
    assert any("after the failed step: injected" in m for m in notices.messages)


def test_weight_decay_defaults_as_deepspeed_makes_the_optimizer():
    # DeepSpeed's own Adam defaults to no decay; with torch_adam (AdamW's mode) it makes
    # torch.optim.AdamW, whose default is 0.01; torch.optim.Adam (adam_w_mode false) has none.
    from strata.config import TrainConfig

    def decay(params):
        raw = {"train_micro_batch_size_per_gpu": 1,
               "optimizer": {"type": "Adam", "params": params}}
        return TrainConfig.parse(TrainConfig.load(raw)).optimizer["weight_decay"]
    assert decay({}) == 0.0
    assert decay({"torch_adam": True}) == 0.01
    assert decay({"torch_adam": True, "adam_w_mode": False}) == 0.0
    assert decay({"torch_adam": True, "weight_decay": 0.1}) == 0.1
