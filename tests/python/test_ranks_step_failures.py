"""The engine across ranks (strata/ranks.py) when a step fails on one rank: an overflow, a
staging, a commit's preparation or a commit: each rank takes the same step, or none, or names
the failure, never a hang. (test_ranks_failures.py: the job's other failures; a file apart so
that each ctest test stays well inside its time limit.)"""
import json
import time

import pytest
import torch

from launch import start_ranks

FP16 = r"""
import json, os, sys, torch
import strata
rank = int(os.environ["RANK"])
stage, dtype = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
half = {"fp16": {"enabled": True, "initial_scale_power": 8},
        "bf16": {"enabled": True, "check_grad_overflow": True}}[dtype]
config = {"train_micro_batch_size_per_gpu": 2, dtype: half,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
          "strata": {"device": "emulated", "host_budget_bytes": 16 << 20,
                     "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 60}}
engine, _, _, _ = strata.initialize(model=model, config=config)
gen = torch.Generator().manual_seed(rank)
staged = []
overflow = []
# At step 2 one element of rank 1's gradient of the last bias overflows: the one rank 1's shard
# holds (elements 2-3 of 4), so that rank 0's own shards stay finite.
model[2].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("inf"))
                            if overflow else g)
for step in range(4):
    overflow[:] = [True] if step == 2 and rank == 1 else []
    x = torch.randn(2, 16, generator=gen).to(next(model.parameters()).dtype)
    loss = engine(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    staged.append(bool(engine.last_step_stats["optimizer"].get("staged")))
state = engine.module_state_dict()
print(json.dumps({"skipped": engine.skipped_steps, "scale": engine.loss_scale, "staged": staged,
                  "sum": sum(v.double().sum().item() for v in state.values())}))
"""


@pytest.mark.parametrize("stage, dtype", [(2, "fp16"), (3, "fp16"), (3, "bf16")])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(stage, dtype):
    # The steps are staged during backward (no clipping): the ranks' norm decides before any
    # commits, so that a rank whose own shards are finite skips with the one that overflowed
    # (fp16's loss scale, or bf16 with bf16.check_grad_overflow).
    procs = start_ranks(2, FP16, (stage, dtype))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1], outs  # the same steps skipped, scale and weights on both
    assert outs[0]["skipped"] == 1, outs
    assert outs[0]["staged"] == [True, True, False, True], outs


INJECT = r"""
import json, os, sys, torch
import strata
from strata import _strata
rank = int(os.environ["RANK"])
where, stage = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
          "strata": {"device": "emulated", "host_budget_bytes": 16 << 20,
                     "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 60}}
engine, _, _, _ = strata.initialize(model=model, config=config)


class Failing:  # the Runtime, but `where` fails on rank 1 at step 1 (staging: in backward)
    def __init__(self, runtime):
        self.__dict__["runtime"] = runtime

    def __getattr__(self, name):
        value = getattr(self.runtime, name)
        if name == where and rank == 1 and engine.global_steps == 1 and \
                (where != "stage_optimizer_step" or engine._state.in_backward):
            def fail(*args, **kwargs):
                raise _strata.Error(f"injected: {name} failed")
            return fail
        return value


engine._step.runtime = Failing(engine._step.runtime)
gen = torch.Generator().manual_seed(1)
staged = []
for step in range(3):
    x = torch.randn(4, 16, generator=gen)[2 * rank:2 * rank + 2]
    engine.backward(engine(x).square().mean())
    engine.step()
    staged.append(bool(engine.last_step_stats["optimizer"].get("staged")))
state = engine.module_state_dict()
print(json.dumps({"staged": staged, "redone": engine.redone_steps,
                  "sum": sum(v.double().sum().item() for v in state.values())}))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_a_staging_that_fails_on_one_rank_makes_every_rank_take_the_step_anew(stage):
    procs = start_ranks(2, INJECT, ("stage_optimizer_step", stage))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0]["staged"] == outs[1]["staged"] == [True, False, True], outs
    assert outs[0]["sum"] == outs[1]["sum"], outs  # the same weights on both ranks


def test_a_commit_that_fails_on_one_rank_is_named_on_every_rank_at_once():
    start = time.monotonic()
    procs = start_ranks(2, INJECT, ("commit_optimizer_step", 2))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert "injected: commit_optimizer_step failed" in errs[1], errs[1][-2000:]
    assert "rank 0 of 2: the optimizer step committed here but failed on rank 1" in errs[0], \
        errs[0][-2000:]
    assert time.monotonic() - start < 50  # at once, not at the 60 s timeout


PREPARE = r"""
import json, os, sys, torch
import strata
from strata import _strata
rank = int(os.environ["RANK"])
where, stage, failing = sys.argv[1], int(sys.argv[2]), [int(r) for r in sys.argv[3]]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": stage},
          "strata": {"device": "emulated", "host_budget_bytes": 16 << 20,
                     "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 60}}
if where == "_local_norm":
    config["gradient_clipping"] = 1e3  # the norm taken, never scaling
engine, _, _, _ = strata.initialize(model=model, config=config)
real = engine._step.runtime
failed = []
if where == "_local_norm" and rank in failing:  # this rank's part of the gradients' norm fails
    local_norm = engine._step._local_norm

    def failing_norm():
        if engine.global_steps == 1 and not failed:
            failed.append(True)
            raise _strata.Error("injected: _local_norm failed")
        return local_norm()
    engine._step._local_norm = failing_norm


class Failing:  # the Runtime, but `where` fails once on the ranks `failing`, at step 1
    def __getattr__(self, name):
        if name == where and rank in failing and engine.global_steps == 1 and not failed and \
                not engine._state.in_backward:
            def fail(*args, **kwargs):
                failed.append(True)
                if name == "prepare_optimizer_step":
                    real.prepare_optimizer_step()  # the staged work done, then refused
                raise _strata.Error(f"injected: {name} failed")
            return fail
        return getattr(real, name)


engine._step.runtime = Failing()
gen = torch.Generator().manual_seed(1)
errors, sums = [], []
for step in range(3):
    x = torch.randn(4, 16, generator=gen)[2 * rank:2 * rank + 2]
    engine.backward(engine(x).square().mean())
    try:
        engine.step()
        errors.append(None)
    except _strata.Error as error:
        errors.append(str(error))
    sums.append(sum(v.double().sum().item() for v in engine.module_state_dict().values()))
print(json.dumps({"errors": errors, "sums": sums, "steps": engine.global_steps}))
"""


@pytest.mark.parametrize("where,stage,failing", [("prepare_optimizer_step", 2, "1"),
                                                 ("begin_optimizer_step", 1, "1"),
                                                 ("prepare_optimizer_step", 3, "01"),
                                                 ("_local_norm", 3, "1")])
def test_a_step_that_cannot_be_prepared_on_one_rank_is_committed_on_none(where, stage, failing):
    # The commit in two phases: rank 1's step fails once its staged work is done, before any
    # rank commits (or, stage 1's step taken after backward, as it begins: the others, waiting
    # in the first phase, learn of it there); every rank raises (rank 0 naming rank 1), its
    # state as before the step, and training goes on: the weights are those of plain torch never
    # given the failed step's batch. "01": both ranks fail, and each says the other did too.
    # "_local_norm": rank 1 cannot take its part of the gradients' norm (gradient_clipping):
    # the failure rides in the norm's own sum, so that rank 0 raises there too, not waiting in a
    # collective rank 1 never issues.
    procs = start_ranks(2, PREPARE, (where, stage, failing))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[1]["errors"][1] is not None and \
        f"injected: {where} failed" in outs[1]["errors"][1], outs[1]
    if failing == "01":
        for rank, out in enumerate(outs):
            assert f"injected: {where} failed (and rank {1 - rank} could not prepare theirs " \
                "either: no rank committed the step)" in out["errors"][1], out
    elif where == "_local_norm":
        assert outs[0]["errors"][1] is not None and (
            "rank 0 of 2: the gradients' norm could not be taken on 1 other rank (its error is "
            "that rank's): the step is dropped on every rank") in outs[0]["errors"][1], outs[0]
    else:
        assert outs[0]["errors"][1] is not None and (
            "rank 0 of 2: the optimizer step could not be prepared on rank 1 (its error is that "
            "rank's), so no rank committed it") in outs[0]["errors"][1], outs[0]
    for out in outs:
        assert out["errors"][0] is None and out["errors"][2] is None, out
        assert out["sums"][1] == out["sums"][0], out  # nothing changed by the failed step
        assert out["steps"] == 2, out
    assert outs[0]["sums"] == outs[1]["sums"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 16, generator=gen)
        if step == 1:
            continue  # the failed step's batch: in no rank's step
        adam.zero_grad()
        model(x).square().mean().backward()
        adam.step()
    expected = sum(v.double().sum().item() for v in model.state_dict().values())
    assert outs[0]["sums"][2] == pytest.approx(expected, rel=1e-5, abs=1e-5)
