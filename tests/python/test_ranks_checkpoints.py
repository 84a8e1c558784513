"""The engine's checkpoints across ranks (strata/checkpoints.py over strata/ranks.py): 2 ranks as
processes on loopback, on Gloo; a checkpoint resumed bit for bit, loaded on another number of
ranks and from one process, a rank killed during a save, a load one rank cannot make, pretrained
weights streamed in, and ranks that save different tags; a frozen weight among the trained ones
(at stage 3 a partition holding each rank's shard). Apart from test_ranks.py so that each
file stays well inside its ctest limit on a loaded machine."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from launch import assert_same, start_ranks


CKPT = r"""
import json, os, sys, torch
import strata
mode, stage, ckpt, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
torch.manual_seed(0 if mode == "save" else 7)
model = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 40), torch.nn.ReLU(),
                            torch.nn.LayerNorm(40), torch.nn.Linear(40, 50))
model[1].weight.requires_grad_(False)  # frozen: at stage 3 a partition of each rank's shard
zero = {"stage": stage, "stage3_param_persistence_threshold": 100,
        "offload_optimizer": {"device": "nvme", "nvme_path": ckpt + f"-swap-{mode}{world}"},
        "offload_param": {"buffer_count": 2, "buffer_size": 65536}}
config = {"train_batch_size": 8, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
          "zero_optimization": zero,
          "strata": {"device": "emulated", "host_budget_bytes": 32 << 20,
                     "nvme_capacity_bytes": 32 << 20, "comm_timeout_s": 30}}
engine, _, _, _ = strata.initialize(model=model, config=config)
gen = torch.Generator().manual_seed(3)
per = 8 // world
marks = {}

def step():
    x = torch.randint(0, 50, (8, 6), generator=gen)
    x, y = x[rank * per:(rank + 1) * per], torch.roll(x, 1, 1)[rank * per:(rank + 1) * per]
    loss = torch.nn.functional.cross_entropy(engine(x).float().reshape(-1, 50), y.reshape(-1))
    engine.backward(loss)
    engine.step()

def mark(name):
    marks[name] = {k: v.float() for k, v in engine.module_state_dict().items()}

if mode == "save":
    step(); step()
    engine.save_checkpoint(ckpt, client_state={"rank": rank})
    mark("at_save")
elif mode == "kill":  # a second save, during which rank 1 dies
    step(); step()
    engine.save_checkpoint(ckpt, tag="first", client_state={"rank": rank})
    step()
    from strata import checkpoints
    if rank == 1:
        checkpoints._crash_point = lambda at: at == "parameter_written" and os.kill(os.getpid(), 9)
    try:
        engine.save_checkpoint(ckpt, tag="second")
    except Exception as error:
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        sys.exit(0)
    sys.exit("the save of a job whose rank died did not fail")
elif mode == "refused":  # a load one rank cannot make: nothing changes on any rank
    mark("before")
    try:
        engine.load_checkpoint(ckpt)
    except Exception as error:
        mark("after_refused")
        if rank == 0:
            torch.save(marks, out)
        print(json.dumps({"error": f"{type(error).__name__}: {error}",
                          "steps": engine.global_steps}))
        sys.exit(0)
    sys.exit("a damaged checkpoint loaded")
elif mode == "pretrained":  # weights streamed from a torch.save file, the optimizer afresh
    for _ in range(2):
        torch.randint(0, 50, (8, 6), generator=gen)
    assert engine.load_pretrained(ckpt) == ([], [])
    mark("at_save")
else:
    for _ in range(2):  # the data of the steps before the save
        torch.randint(0, 50, (8, 6), generator=gen)
    path, client = engine.load_checkpoint(ckpt)
    assert client == {"rank": 0}, client  # rank 0's, as DeepSpeed's
    assert engine.global_steps == 2
    mark("at_save")
step(); step()
mark("after")
if rank == 0:
    torch.save(marks, out)
print("ok")
"""


def run_ckpt(tmp_path, mode, n, stage, name, source=None):
    out = tmp_path / f"{name}.pt"
    args = (mode, stage, source or tmp_path / "ckpt", out)
    if n == 1:
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        procs = [subprocess.Popen([sys.executable, "-c", CKPT, *map(str, args)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    else:
        procs = start_ranks(n, CKPT, args)
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_of_two_ranks_resumes_bit_for_bit(tmp_path, stage):
    saved = run_ckpt(tmp_path, "save", 2, stage, "saved")
    folder = tmp_path / "ckpt" / "global_step2"
    assert sorted(os.listdir(folder)) == ["engine_states.pt", "meta.json",
                                          "optimizer_states.rank0.bin",
                                          "optimizer_states.rank1.bin"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    resumed = run_ckpt(tmp_path, "resume", 2, stage, "resumed")
    assert_same(resumed["at_save"], saved["at_save"], True, "loaded")
    assert_same(resumed["after"], saved["after"], True, "two steps after the load")
    # The consolidation tool reads every rank's shards.
    from strata import zero_to_fp32
    zero_to_fp32.consolidate(tmp_path / "ckpt", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt")
    assert_same(whole, saved["at_save"], True, "zero_to_fp32")
    zero_to_fp32.consolidate(tmp_path / "ckpt", tmp_path / "sharded", shard_bytes=4000)
    index = json.loads((tmp_path / "sharded" / "pytorch_model.bin.index.json").read_text())
    got = {}
    for file in set(index["weight_map"].values()):
        got.update(torch.load(tmp_path / "sharded" / file))
    assert_same(got, saved["at_save"], True, "zero_to_fp32 --shard-size")


@pytest.mark.parametrize("n", [1, 4])
def test_a_checkpoint_of_two_ranks_loads_on_another_number_of_ranks(tmp_path, n):
    saved = run_ckpt(tmp_path, "save", 2, 3, "saved")
    resumed = run_ckpt(tmp_path, "resume", n, 3, "resumed")
    assert_same(resumed["at_save"], saved["at_save"], True, f"loaded by {n}")
    assert_same(resumed["after"], saved["after"], False, f"two steps after, on {n}")


def test_a_checkpoint_of_one_process_loads_on_two_ranks(tmp_path):
    saved = run_ckpt(tmp_path, "save", 1, 3, "saved")
    resumed = run_ckpt(tmp_path, "resume", 2, 3, "resumed")
    assert_same(resumed["at_save"], saved["at_save"], True, "loaded by 2")
    assert_same(resumed["after"], saved["after"], False, "two steps after, on 2")


def test_a_rank_killed_during_a_save_leaves_latest_and_no_half_written_folder(tmp_path):
    procs = start_ranks(2, CKPT, ("kill", 3, tmp_path / "ckpt", tmp_path / "unused.pt"))
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 0, err0[-3000:]
    error = json.loads(out0.strip().splitlines()[-1])["error"]
    assert error.startswith("Error: rank 0 of 2: all-reduce failed"), error
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "first"
    assert sorted(os.listdir(ckpt)) == ["first", "latest"]  # the partial folder removed
    # What latest names loads, on both ranks.
    run_ckpt(tmp_path, "resume", 2, 3, "resumed")


def test_a_load_one_rank_cannot_make_changes_nothing_on_any_rank(tmp_path):
    run_ckpt(tmp_path, "save", 2, 3, "saved")
    damaged = tmp_path / "ckpt" / "global_step2" / "optimizer_states.rank1.bin"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0x10
    damaged.write_bytes(bytes(data))
    procs = start_ranks(2, CKPT, ("refused", 3, tmp_path / "ckpt", tmp_path / "refused.pt"))
    errors = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        errors.append(json.loads(out.strip().splitlines()[-1]))
    assert "optimizer_states.rank1.bin" in errors[1]["error"] and \
        "does not match its digest" in errors[1]["error"], errors[1]
    assert errors[0]["error"] == "CheckpointError: load_checkpoint: rank 1 could not load it " \
                                "(each says why); nothing was changed", errors[0]
    assert [e["steps"] for e in errors] == [0, 0]
    marks = torch.load(tmp_path / "refused.pt")
    assert_same(marks["after_refused"], marks["before"], True, "after a refused load")


def test_pretrained_weights_stream_into_two_ranks(tmp_path):
    saved = run_ckpt(tmp_path, "save", 1, 3, "saved")
    torch.save(saved["at_save"], tmp_path / "pretrained.pt")
    single = run_ckpt(tmp_path, "pretrained", 1, 3, "single", tmp_path / "pretrained.pt")
    ranks = run_ckpt(tmp_path, "pretrained", 2, 3, "ranks", tmp_path / "pretrained.pt")
    assert_same(ranks["at_save"], saved["at_save"], True, "loaded by 2")
    assert_same(ranks["after"], single["after"], False, "two steps after, 2 ranks beside 1")


def test_ranks_that_save_different_tags_are_told_and_nothing_is_saved(tmp_path):
    script = CKPT.replace('engine.save_checkpoint(ckpt, client_state={"rank": rank})',
                          'engine.save_checkpoint(ckpt, tag=f"tag{rank}", client_state={})')
    procs = start_ranks(2, script, ("save", 3, tmp_path / "ckpt", tmp_path / "x.pt"))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        assert "save_checkpoint: rank 1 gave another tag than rank 0's 'tag0'" in err and \
            "accepted: the same tag on every rank; nothing was saved" in err, err[-2000:]
    assert os.listdir(tmp_path / "ckpt") == []


def test_a_rank_that_dies_once_the_checkpoint_is_whole_is_told_of_as_such(tmp_path):
    script = CKPT.replace('at == "parameter_written" and os.kill',
                          'at == "before_outcome" and os.kill')
    assert script != CKPT
    procs = start_ranks(2, script, ("kill", 3, tmp_path / "ckpt", tmp_path / "x.pt"))
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=60)
    error = json.loads(out0.strip().splitlines()[-1])["error"]
    # Rank 1 died after writing its part: rank 0 finished the checkpoint, then could not tell it.
    assert error.startswith("CheckpointError: save_checkpoint: 'second' was saved whole and "
                            "latest names it, but the other ranks could not be told"), error
    assert (tmp_path / "ckpt" / "latest").read_text() == "second"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["first", "latest", "second"]


# A frozen base of 64 MiB (four 2048 x 2048 fp32 weights) at stage 3 across 2 ranks, saved and
# loaded: the most bytes of frozen weights read whole and alive at once on each rank during the
# save, and the bytes each rank read() during the load.
BASE = r"""
import json, os, sys, torch, weakref
import strata
from strata import checkpoints
ckpt, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)],
                            torch.nn.Linear(2048, 8))
for layer in model[:4]:
    layer.requires_grad_(False)
config = {"train_batch_size": 4, "optimizer": {"type": "AdamW"},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}},
          "strata": {"device": "emulated", "host_budget_bytes": 256 << 20,
                     "device_budget_bytes": 64 << 20, "comm_timeout_s": 60}}
engine, _, _, _ = strata.initialize(model=model, config=config)
engine.backward(engine(torch.randn(2, 2048)).square().mean())
engine.step()
alive, most = [0], [0]
read_frozen = checkpoints.read_frozen

def counted(*args):
    whole = read_frozen(*args)
    size = whole.numel() * whole.element_size()
    alive[0] += size
    most[0] = max(most[0], alive[0])
    weakref.finalize(whole, lambda: alive.__setitem__(0, alive[0] - size))
    return whole
checkpoints.read_frozen = counted

def read_bytes():
    with open("/proc/self/io") as f:
        return int(f.read().split("rchar:")[1].split()[0])
before = read_bytes()
if mode == "save":
    engine.save_checkpoint(ckpt)
else:
    engine.load_checkpoint(ckpt)
print(json.dumps({"rank": rank, "most_alive_mib": most[0] / 2**20,
                  "read_mib": (read_bytes() - before) / 2**20}))
"""


def test_a_frozen_base_is_never_whole_on_the_ranks_that_do_not_keep_it(tmp_path):
    """Saved, rank 1 gathers each frozen weight and lets it go (rank 0 keeps the base for
    engine_states.pt); loaded, each rank reads engine_states.pt once, a block at a time, for its
    digest (mapped, not read, for its tensors): neither holds a whole copy of the base it does not
    keep."""
    report = {}
    for mode in ("save", "load"):
        procs = start_ranks(2, BASE, (tmp_path / "ckpt", mode))
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            got = json.loads(out.strip().splitlines()[-1])
            report[mode, got["rank"]] = got
    # The base is 64 MiB, each weight 16: rank 1 held them all at once before, rank 0 keeps them.
    assert report["save", 1]["most_alive_mib"] == 16, report
    assert report["save", 0]["most_alive_mib"] == 64, report
    # engine_states.pt (64 MiB and a little) read once for its digest; twice whole before.
    assert all(report["load", r]["read_mib"] < 96 for r in (0, 1)), report
