"""engine.save_checkpoint / load_checkpoint: resume bit for bit, crash-consistent saves, and
checkpoints that cannot be loaded named before anything changes (strata/checkpoints.py)."""
import copy
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import strata
from strata import checkpoints

sys.path.insert(0, os.path.dirname(__file__))
from references import assert_computes_as  # noqa: E402
from test_engine import (VOCAB, WIDTH, Net, Reference, batches, loss_of, make_config,  # noqa: E402
                         train)


def engine_for(tmp_path, offload, dtype, seed, name="run"):
    torch.manual_seed(seed)
    (tmp_path / name).mkdir(exist_ok=True)
    config = make_config(tmp_path / name, 3, offload, dtype, accumulation=2, clipping=1.0)
    config["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 6}}
    engine, _, _, _ = strata.initialize(model=Net(), config=config)
    return engine


def state_of(engine):
    """Every parameter's master weights and moments, and its weights in the training dtype."""
    out = []
    for e in engine.table.trained:
        t = [torch.empty(e.numel) for _ in range(3)]
        engine.runtime.read_optimizer_state(e.gid, *t)
        out += t
    return out + list(engine.module_state_dict().values())


def assert_refused_and_unchanged(engine, ckpt, match):
    """Loading `ckpt` into `engine` fails with `match` and changes nothing of it."""
    before = state_of(engine)
    steps = engine.global_steps
    with pytest.raises(checkpoints.CheckpointError, match=match):
        engine.load_checkpoint(ckpt)
    assert engine.global_steps == steps
    for a, b in zip(before, state_of(engine)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_resumed_run_is_bit_for_bit_the_run_that_never_stopped(tmp_path, offload, dtype):
    data = list(batches(28))  # 14 optimizer steps of 2 micro-batches
    whole = engine_for(tmp_path, offload, dtype, seed=0, name="whole")
    first = train(whole, data[:8])
    whole.save_checkpoint(tmp_path / "ckpt", client_state={"position": 8})
    lr_at_save = whole.get_lr()
    rest = train(whole, data[8:])
    # Another engine, made from other initial weights, loads the checkpoint and goes on.
    resumed = engine_for(tmp_path, offload, dtype, seed=1, name="resumed")
    path, client = resumed.load_checkpoint(tmp_path / "ckpt")
    assert path == str(tmp_path / "ckpt" / "global_step4") and client == {"position": 8}
    assert resumed.global_steps == 4 and resumed.get_lr() == lr_at_save
    again = train(resumed, data[client["position"]:])
    assert again == rest  # losses, exactly
    for a, b in zip(state_of(whole), state_of(resumed)):
        assert torch.equal(a, b)
    assert first  # the first part trained


def test_the_latest_file_names_the_newest_and_a_tag_can_be_chosen(tmp_path):
    engine = engine_for(tmp_path, "cpu", "fp32", seed=0)
    data = list(batches(8))
    train(engine, data[:4])
    engine.save_checkpoint(tmp_path / "ckpt")
    train(engine, data[4:])
    engine.save_checkpoint(tmp_path / "ckpt", tag="mine")
    assert (tmp_path / "ckpt" / "latest").read_text() == "mine"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step2", "latest", "mine"]
    engine.save_checkpoint(tmp_path / "ckpt", tag="mine")  # replaced whole
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step2", "latest", "mine"]
    other = engine_for(tmp_path, "cpu", "fp32", seed=1, name="other")
    path, _ = other.load_checkpoint(tmp_path / "ckpt", tag="global_step2")
    assert other.global_steps == 2 and path.endswith("global_step2")
    assert other.load_checkpoint(tmp_path / "empty") == (None, None)
    with pytest.raises(ValueError, match="tag"):
        engine.save_checkpoint(tmp_path / "ckpt", tag="../up")


def damaged(tmp_path, how):
    """A checkpoint of 2 steps, damaged as `how` says; the engine to load it into (at step 1)."""
    engine = engine_for(tmp_path, "nvme", "fp32", seed=0)
    data = list(batches(4))
    train(engine, data)
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    folder = ckpt / "global_step2"
    if how == "flipped byte":
        with open(folder / "optimizer_states.bin", "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0x10]))
    elif how == "missing file":
        os.remove(folder / "engine_states.pt")
    elif how == "truncated":
        os.truncate(folder / "optimizer_states.bin", 1000)
    elif how == "no meta":
        os.remove(folder / "meta.json")
    target = engine_for(tmp_path, "nvme", "fp32", seed=1, name="target")
    train(target, data[:2])
    return target, ckpt


@pytest.mark.parametrize("how, message", [
    ("flipped byte", r"optimizer_states.bin: emb.weight \(master\) does not match its digest"),
    ("missing file", r"engine_states.pt is missing"),
    ("truncated", r"optimizer_states.bin holds 1000 bytes"),
    ("no meta", r"meta.json is missing"),
])
def test_a_damaged_checkpoint_is_named_and_changes_nothing(tmp_path, how, message):
    target, ckpt = damaged(tmp_path, how)
    before = state_of(target)
    with pytest.raises(checkpoints.CheckpointError, match=message):
        target.load_checkpoint(ckpt)
    for a, b in zip(before, state_of(target)):
        assert torch.equal(a, b)
    assert target.global_steps == 1


class OtherNet(Net):
    """Net with one layer wider and one renamed: a checkpoint of it does not fit Net."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB + 3, WIDTH)
        self.extra = self.l2
        del self.l2


def test_a_checkpoint_of_another_model_names_every_difference(tmp_path):
    torch.manual_seed(0)
    (tmp_path / "run").mkdir()
    config = make_config(tmp_path / "run", 3, "cpu", "fp32", accumulation=2, clipping=1.0)
    engine, _, _, _ = strata.initialize(model=OtherNet(), config=config)
    engine.save_checkpoint(tmp_path / "ckpt")
    other = engine_for(tmp_path, "cpu", "fp32", seed=1, name="other")
    before = state_of(other)
    with pytest.raises(checkpoints.CheckpointError) as failed:
        other.load_checkpoint(tmp_path / "ckpt")
    text = str(failed.value)
    assert f"emb.weight: shape [{VOCAB + 3}, {WIDTH}] in the checkpoint" in text, text
    assert "missing: l2.weight" in text and "missing: l2.bias" in text, text
    assert "unexpected: extra.weight" in text and "unexpected: extra.bias" in text, text
    for a, b in zip(before, state_of(other)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("double_buffer_max", [0, 256 << 20])
def test_a_save_with_one_buffer_or_two_loads_the_same_state(tmp_path, monkeypatch,
                                                            double_buffer_max):
    """A save double-buffers (reads one parameter while the last is written) unless the largest
    state is over _DOUBLE_BUFFER_MAX, when the host holds it once: both give the same file."""
    monkeypatch.setattr(checkpoints, "_DOUBLE_BUFFER_MAX", double_buffer_max)
    engine = engine_for(tmp_path, "nvme", "fp32", seed=0)
    train(engine, list(batches(4)))
    engine.save_checkpoint(tmp_path / "ckpt")
    other = engine_for(tmp_path, "nvme", "fp32", seed=1, name="other")
    other.load_checkpoint(tmp_path / "ckpt")
    for a, b in zip(state_of(engine), state_of(other)):
        assert torch.equal(a, b)


def test_a_save_that_fails_reports_its_first_failure(tmp_path, monkeypatch):
    """A read of the optimizer's state fails while the writer thread's sync of the parameter
    before it has failed too: the save raises the read's error (the writer's had replaced it), and
    leaves no folder behind."""
    engine = engine_for(tmp_path, "cpu", "fp32", seed=0)
    monkeypatch.setattr(checkpoints, "_SYNC_EVERY", 0)

    def failing_sync(fd):
        raise OSError("sync failed")

    monkeypatch.setattr(os, "fdatasync", failing_sync)
    real_read = engine.runtime.read_optimizer_state
    calls = [0]

    class Runtime:
        def __getattr__(self, name):
            return getattr(real, name)

        def read_optimizer_state(self, *args):
            calls[0] += 1
            if calls[0] == 2:
                import time
                time.sleep(0.2)  # the writer's failure first
                raise RuntimeError("read failed")
            return real_read(*args)

    real = engine.runtime
    monkeypatch.setattr(engine, "runtime", Runtime())
    with pytest.raises(RuntimeError, match="read failed"):
        engine.save_checkpoint(tmp_path / "ckpt")
    assert [n for n in os.listdir(tmp_path / "ckpt") if not n.startswith("latest")] == []


def test_a_changed_meta_json_is_refused_even_where_it_still_parses(tmp_path):
    """Step counts, the loss scale and the learning rates live in meta.json: a change there that
    still parses (a flipped bit in a digit) is named, and nothing changes."""
    engine = engine_for(tmp_path, "cpu", "fp32", seed=0)
    train(engine, list(batches(4)))
    path = engine.save_checkpoint(tmp_path / "ckpt")
    meta_file = os.path.join(path, "meta.json")
    text = open(meta_file).read()
    steps = f'"global_steps": {engine.global_steps}'
    assert steps in text
    with open(meta_file, "w") as f:
        f.write(text.replace(steps, f'"global_steps": {engine.global_steps + 1}'))
    other = engine_for(tmp_path, "cpu", "fp32", seed=1, name="other")
    assert_refused_and_unchanged(other, tmp_path / "ckpt", "meta.json does not match its digest")


def test_of_two_killed_saves_of_a_tag_the_newer_one_is_loaded(tmp_path, monkeypatch):
    """A save of tag X killed before it cleared the old copy it moved aside, then another killed
    right after moving X aside: two asides and no X. The one that was X last is loaded (before,
    the older one was, when the random part of its name sorted first)."""
    engine = engine_for(tmp_path, "cpu", "fp32", seed=0)
    data = list(batches(12))
    ckpt = tmp_path / "ckpt"
    train(engine, data[:4])
    engine.save_checkpoint(ckpt, tag="X")  # step 2
    train(engine, data[4:8])
    with monkeypatch.context() as m:  # killed after `latest`, before clearing step 2's copy
        m.setattr(checkpoints, "_remove", lambda *a: None)
        engine.save_checkpoint(ckpt, tag="X")  # step 4
    train(engine, data[8:12])

    class Killed(Exception):
        pass

    def kill_at(point):
        if point == "old_renamed_aside":
            raise Killed()

    for attempt in range(2):  # the asides' order must not be luck: a second pair, named anew
        with monkeypatch.context() as m:
            m.setattr(checkpoints, "_point", kill_at)
            with pytest.raises(Killed):
                engine.save_checkpoint(ckpt, tag="X")  # step 6, killed with X moved aside
        assert not (ckpt / "X").exists()
        other = engine_for(tmp_path, "cpu", "fp32", seed=1, name=f"other{attempt}")
        other.load_checkpoint(ckpt, tag="X")
        assert other.global_steps == 4
        # Put back for the second attempt: step 4 as X again, step 2's copy aside.
        newest = checkpoints._replaced(str(ckpt), "X")[0]
        os.rename(ckpt / newest, ckpt / "X")
    # A removal killed half-way is not taken for a whole copy, and the next save clears it.
    os.rename(ckpt / "X", ckpt / ".deleting-0123abcd")
    os.remove(ckpt / ".deleting-0123abcd" / "meta.json")
    other = engine_for(tmp_path, "cpu", "fp32", seed=1, name="other2")
    other.load_checkpoint(ckpt, tag="X")
    assert other.global_steps == 2
    engine.save_checkpoint(ckpt, tag="X")
    assert sorted(os.listdir(ckpt)) == ["X", "latest"]


# Both kill tests' children: a checkpoint of step 2, whole (timed), then two more steps.
CHILD_SETUP = r"""
import os, random, signal, sys, threading, time
sys.path.insert(0, {tests!r})
from strata import checkpoints
from test_checkpoint import engine_for, train
from test_engine import batches
import pathlib
tmp = pathlib.Path({tmp!r})
engine = engine_for(tmp, "nvme", "fp32", seed=0)
data = list(batches(8))
train(engine, data[:4])
t0 = time.perf_counter()
engine.save_checkpoint(tmp / "ckpt")  # step 2: whole
took = time.perf_counter() - t0
train(engine, data[4:])
"""

CHILD = CHILD_SETUP + r"""
calls = [0]
def crash(name):
    calls[0] += 1
    if calls[0] == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoints._crash_point = crash
engine.save_checkpoint(tmp / "ckpt", tag={tag!r})  # step 4, killed part way
print("finished")
"""


# The moments of a save of Net (7 parameters): 1-7 each parameter's state written, 8 the files
# written, then (when the tag exists) 9 the old folder moved aside, then the rename, then `latest`.
KILLS = [("global_step4", k) for k in (1, 7, 8, 9, 10)] + \
    [("global_step2", k) for k in (1, 7, 8, 9, 10, 11)]


@pytest.mark.parametrize("tag, kill_at", KILLS)
def test_a_save_killed_at_any_moment_leaves_a_whole_checkpoint(tmp_path, tag, kill_at):
    # A new tag, or the tag of the checkpoint `latest` names (replaced): SIGKILL at each moment.
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(tests=here, tmp=str(tmp_path), kill_at=kill_at,
                                            tag=tag)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert child.returncode == -signal.SIGKILL, (child.stdout, child.stderr)
    loader = engine_for(tmp_path, "nvme", "fp32", seed=1, name="loader")
    path, _ = loader.load_checkpoint(tmp_path / "ckpt")  # whole: verified before loading
    # The new state is what `latest` names once `latest` moved to a new tag, or once the folder of
    # the tag it names was replaced; before, the previous checkpoint, whole.
    assert loader.global_steps == (4 if kill_at >= 10 else 2)
    # The next save cleans up what the killed one left.
    loader.save_checkpoint(tmp_path / "ckpt", tag=tag)
    assert sorted(n for n in os.listdir(tmp_path / "ckpt") if n.startswith(".")) == []


RANDOM_KILL = CHILD_SETUP + r"""
delay = random.Random({seed}).uniform(0, 1.2 * took)
threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
engine.save_checkpoint(tmp / "ckpt", tag={tag!r})  # step 4, killed wherever the delay falls
time.sleep(60)  # (killed here when the delay outlasted the save)
"""


@pytest.mark.parametrize("seed", range(6))
def test_a_save_killed_at_a_moment_chosen_by_a_seed_leaves_a_whole_checkpoint(tmp_path, seed):
    """SIGKILL after a delay drawn from the seed, anywhere in a save that replaces the tag
    `latest` names (inside a write, a sync or a rename, not only between them): what is left
    loads whole, and is the old state or the new one."""
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", RANDOM_KILL.format(tests=here, tmp=str(tmp_path), seed=seed,
                                                  tag="global_step2")],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert child.returncode == -signal.SIGKILL, (seed, child.stdout, child.stderr)
    loader = engine_for(tmp_path, "nvme", "fp32", seed=1, name="loader")
    loader.load_checkpoint(tmp_path / "ckpt")
    assert loader.global_steps in (2, 4), seed
    loader.save_checkpoint(tmp_path / "ckpt", tag="global_step2")
    assert sorted(n for n in os.listdir(tmp_path / "ckpt") if n.startswith(".")) == []


def test_a_save_syncs_every_file_and_folder_before_the_rename_that_publishes_it(tmp_path,
                                                                               monkeypatch):
    """A SIGKILL never loses what the page cache holds, so the kill tests cannot see a missing
    sync; a power loss would. The order is checked instead: each file of the checkpoint, and its
    folder, synced before the folder is renamed into place; the save folder synced after that
    rename and before `latest` moves; `latest`'s new content synced before its rename."""
    engine = engine_for(tmp_path, "cpu", "fp32", seed=0)
    train(engine, list(batches(4)))
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")  # so the next save replaces a folder
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("sync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def rename(a, b):
        events.append(("rename", os.path.basename(a), os.path.basename(b)))
        return real_rename(a, b)

    def replace(a, b):
        events.append(("rename", os.path.basename(a), os.path.basename(b)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    monkeypatch.undo()

    def at(event):
        return events.index(event)

    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == "t")
    partial = events[publish][1]
    for name in os.listdir(tmp_path / "ckpt" / "t"):
        assert at(("sync", name)) < publish, (name, events)
    assert at(("sync", partial)) < publish, events
    latest = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == "latest")
    synced_dir = [i for i, e in enumerate(events) if e == ("sync", "ckpt")]
    assert any(publish < i < latest for i in synced_dir), events
    assert at(("sync", events[latest][1])) < latest, events
    assert any(i > latest for i in synced_dir), events  # latest's rename made durable


class Whole(torch.nn.Module):
    """A tied weight (the head reuses the embedding), a buffer and a frozen parameter: what a
    state dict holds besides the trainable parameters under their own names."""

    def __init__(self):
        super().__init__()
        from test_engine import VOCAB, WIDTH
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("seen", torch.zeros(3))
        self.scale = torch.nn.Parameter(torch.full((WIDTH,), 0.5), requires_grad=False)

    def forward(self, x):
        self.seen += 1
        return self.head(torch.tanh(self.lin(self.emb(x)) * self.scale))


def whole_engine(tmp_path, name, seed, dtype="fp32"):
    torch.manual_seed(seed)
    model = Whole()
    strata.register_external_parameter(model.head, model.emb.weight)
    (tmp_path / name).mkdir(exist_ok=True)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path / name, 3, "nvme", dtype, 1, 0.0))
    return engine


def test_zero_to_fp32_of_a_bf16_run_is_fp32_throughout(tmp_path):
    """The frozen parameter and the buffer of a bf16 run came out in bf16 (found by the audit);
    every floating tensor of the consolidated state dict is fp32."""
    from strata import zero_to_fp32
    engine = whole_engine(tmp_path, "run", 0, "bf16")
    train(engine, batches(2))
    engine.save_checkpoint(tmp_path / "ckpt")
    zero_to_fp32.consolidate(tmp_path / "ckpt", tmp_path / "model.bin")
    state = torch.load(tmp_path / "model.bin")
    assert {name: t.dtype for name, t in state.items() if t.dtype != torch.float32} == {}


@pytest.mark.parametrize("shard_bytes", [None, 3000])
def test_zero_to_fp32_gives_a_state_dict_a_plain_module_loads(tmp_path, shard_bytes):
    engine = whole_engine(tmp_path, "run", 0)
    train(engine, batches(3))
    engine.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / ("shards" if shard_bytes else "model.bin")
    tool = os.path.join(os.environ["PYTHONPATH"].split(":")[0], "..", "tools",
                        "strata_zero_to_fp32")
    args = [tool, str(tmp_path / "ckpt"), str(out)]
    if shard_bytes:
        args += ["--shard-size", str(shard_bytes)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if shard_bytes:
        index = json.loads((out / "pytorch_model.bin.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1
        state = {}
        for f in files:
            state.update(torch.load(out / f))
        assert index["metadata"]["total_size"] == sum(
            t.numel() * 4 for t in {t.data_ptr(): t for t in state.values()}.values())
    else:
        state = torch.load(out)
    plain = Whole()
    plain.load_state_dict(state)  # strict: every name, nothing extra
    expected = engine.module_state_dict()  # the master weights (fp32 here)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, expected[name].float()), name
    assert plain.head.weight is plain.emb.weight
    assert torch.equal(plain.seen, torch.full((3,), 3.0))


CONSOLIDATE = r"""
import json, sys, threading
from strata import zero_to_fp32

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

base = rss()
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        done.wait(0.001)
t = threading.Thread(target=sample, daemon=True)
t.start()
zero_to_fp32.consolidate(sys.argv[1], sys.argv[2], shard_bytes=1 << 20)
done.set()
t.join()
print(json.dumps({"growth": max(peak[0], rss()) - base}))
"""


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(32))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_zero_to_fp32_in_shards_stays_near_one_shard_in_memory(tmp_path):
    """32 MiB of fp32 weights consolidated into 1 MiB shards: the process's resident memory,
    sampled throughout, grows by far less than the weights (the maps' pages are given back shard
    by shard; before, they all stayed resident until the call returned: +32 MiB)."""
    torch.manual_seed(0)
    (tmp_path / "run").mkdir()
    config = make_config(tmp_path / "run", 2, "cpu", "fp32", accumulation=1, clipping=0.0)
    config["strata"]["host_budget_bytes"] = 256 << 20
    engine, _, _, _ = strata.initialize(model=Wide(), config=config)
    engine.save_checkpoint(tmp_path / "ckpt")
    child = subprocess.run([sys.executable, "-c", CONSOLIDATE, str(tmp_path / "ckpt"),
                            str(tmp_path / "shards")], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == 0, child.stderr[-2000:]
    growth = json.loads(child.stdout.strip().splitlines()[-1])["growth"]
    assert growth < (12 << 20), growth  # the weights are 32 MiB


def test_zero_to_fp32_refuses_a_damaged_checkpoint_and_writes_nothing(tmp_path):
    engine = whole_engine(tmp_path, "run", 0)
    train(engine, batches(1))
    engine.save_checkpoint(tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / "global_step1" / "optimizer_states.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    from strata import zero_to_fp32
    assert zero_to_fp32.main([str(tmp_path / "ckpt"), str(tmp_path / "out.bin")]) == 2
    assert not (tmp_path / "out.bin").exists()
    assert zero_to_fp32.main([str(tmp_path / "nothing"), str(tmp_path / "out.bin")]) == 2


def test_buffers_and_frozen_parameters_come_back_with_a_checkpoint(tmp_path):
    engine = whole_engine(tmp_path, "run", 0)
    train(engine, batches(2))
    engine.save_checkpoint(tmp_path / "ckpt")
    other = whole_engine(tmp_path, "other", 1)
    with torch.no_grad():
        other.module.scale.fill_(3.0)
    other.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(other.module.seen, torch.full((3,), 2.0))
    assert torch.equal(other.module.scale, torch.full_like(other.module.scale, 0.5))


# --- what a fresh-eye audit found (each failed before its fix) ---------------------------------

def test_loading_only_the_module_moves_the_master_weights_too(tmp_path):
    # load_module_only, or load_optimizer_states=False: the next step goes on from the loaded
    # weights (the optimizer's master weights follow them), not from the engine's own.
    source = engine_for(tmp_path, "nvme", "fp32", seed=0, name="source")
    train(source, list(batches(4)))
    source.save_checkpoint(tmp_path / "ckpt")
    saved = source.module_state_dict()
    for flags in ({"load_module_only": True}, {"load_optimizer_states": False}):
        target = engine_for(tmp_path, "nvme", "fp32", seed=1, name=str(sorted(flags)))
        target.load_checkpoint(tmp_path / "ckpt", **flags)
        for name, value in target.module_state_dict().items():
            assert torch.equal(value, saved[name]), (flags, name)
        assert_computes_as(target, saved, Net, next(iter(batches(1)))[0])
        for group in target.optimizer.param_groups:
            group["lr"] = 1e-9
        train(target, list(batches(2)))
        for name, value in target.module_state_dict().items():
            assert torch.allclose(value, saved[name], atol=1e-6), (flags, name)


def test_a_save_inside_an_accumulation_window_keeps_the_last_steps_state_and_says_so(tmp_path):
    # As DeepSpeed's and plain PyTorch's (a trainer's validation or exception callback saves
    # where it is): the weights and optimizer state of the last step, the window's gradients not.
    engine = engine_for(tmp_path, "cpu", "fp32", seed=0)
    data = list(batches(3))
    train(engine, data[:2])  # one step
    x, y = data[2]
    engine.backward(loss_of(engine(x), y))
    engine.step()  # micro-batch 1 of 2
    with pytest.warns(strata.StrataWarning, match="inside a gradient-accumulation window "
                                                  r"\(micro-batch 1 of 2\)"):
        engine.save_checkpoint(tmp_path / "ckpt")
    resumed = engine_for(tmp_path, "cpu", "fp32", seed=1, name="resumed")
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.global_steps == engine.global_steps == 1
    assert resumed.micro_steps == engine.micro_steps == 3
    for name, value in engine.module_state_dict().items():
        assert torch.equal(resumed.module_state_dict()[name], value), name


@pytest.mark.parametrize("saved_inside,old_meta", [(False, False), (True, False), (False, True)])
def test_a_checkpoint_loaded_with_another_accumulation_starts_its_windows_afresh(tmp_path,
                                                                                saved_inside,
                                                                                old_meta):
    """Saved after 3 micro-batches of accumulation 1 (or 3 of accumulation 2: inside a window,
    said), loaded by an engine accumulating 2 (4): its windows are the micro-batches after the
    resume, as plain torch's loop with the new accumulation takes them. (It read the saved count,
    3, as inside its own window, and stepped after the next micro-batch alone.) `old_meta`: a
    meta.json from before its "accumulation" key: the config saved in it says it."""
    saved, loaded = (2, 4) if saved_inside else (1, 2)
    torch.manual_seed(0)
    model = Net()
    reference = Reference(copy.deepcopy(model), torch.float32, 1.0)
    source, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path / "source", 3, "cpu", "fp32", saved))
    data = list(batches(3 + 2 * loaded))
    train(source, data[:3])
    for i, (x, y) in enumerate(data[:3]):
        reference.micro_step(x, y, saved)
        if (i + 1) % saved == 0:
            reference.step()
    reference.opt.zero_grad()  # (a window left open is not saved)
    if saved_inside:
        with pytest.warns(strata.StrataWarning, match="inside a gradient-accumulation window"):
            source.save_checkpoint(tmp_path / "ckpt")
    else:
        source.save_checkpoint(tmp_path / "ckpt")
    if old_meta:
        meta_file = tmp_path / "ckpt" / "global_step3" / "meta.json"
        meta = json.loads(meta_file.read_text())
        del meta["accumulation"]
        meta["meta_digest"] = checkpoints._meta_digest(meta)
        meta_file.write_text(json.dumps(meta))
    torch.manual_seed(1)
    target, _, _, _ = strata.initialize(
        model=Net(), config=make_config(tmp_path / "target", 3, "cpu", "fp32", loaded))
    if saved_inside:
        with pytest.warns(strata.StrataWarning, match=r"saved inside a gradient-accumulation "
                                                      r"window \(micro-batch 1 of 2\); this "
                                                      r"engine accumulates 4: its first window "
                                                      "starts afresh"):
            target.load_checkpoint(tmp_path / "ckpt")
    else:
        target.load_checkpoint(tmp_path / "ckpt")
    steps = target.global_steps
    for i, (x, y) in enumerate(data[3:]):
        loss = loss_of(target(x), y)
        target.backward(loss)
        target.step()
        assert loss.item() == pytest.approx(reference.micro_step(x, y, loaded).item(), rel=1e-5)
        if (i + 1) % loaded == 0:
            reference.step()
    assert target.global_steps == steps + 2
    for name, value in reference.master.state_dict().items():
        torch.testing.assert_close(target.module_state_dict()[name], value, rtol=1e-5,
                                   atol=1e-6, msg=name)
    source.close()
    target.close()


def test_an_old_checkpoints_accumulation_is_read_from_its_saved_config():
    of = checkpoints._accumulation_of
    assert of({"gradient_accumulation_steps": 3}, 1) == 3
    assert of({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, 2) == 3
    assert of({"train_batch_size": 24}, 2) == 1 and of({}, 1) == 1  # (DeepSpeed's default)
    assert of({"train_batch_size": 25, "train_micro_batch_size_per_gpu": 4}, 2) is None
    assert of({"gradient_accumulation_steps": "3"}, 1) is None and of(None, 1) is None


def test_a_load_drops_the_gradients_summed_before_it(tmp_path):
    source = engine_for(tmp_path, "nvme", "fp32", seed=0, name="source")
    data = list(batches(8))
    train(source, data[:4])
    source.save_checkpoint(tmp_path / "ckpt")
    clean = engine_for(tmp_path, "nvme", "fp32", seed=1, name="clean")
    clean.load_checkpoint(tmp_path / "ckpt")
    busy = engine_for(tmp_path, "nvme", "fp32", seed=1, name="busy")
    train(busy, data[:1])  # half a window: gradients summed
    busy.load_checkpoint(tmp_path / "ckpt")
    assert not any(e.has_grad for e in busy.table.trained)
    assert train(busy, data[4:]) == train(clean, data[4:])


def test_another_optimizers_checkpoint_is_refused_and_changes_nothing(tmp_path):
    source = engine_for(tmp_path, "cpu", "fp32", seed=0, name="source")
    source.save_checkpoint(tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / "global_step0" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["optimizer"] = "adagrad"  # as a consistent checkpoint of another optimizer says
    meta["meta_digest"] = checkpoints._meta_digest(meta)
    meta_file.write_text(json.dumps(meta))
    target = engine_for(tmp_path, "cpu", "fp32", seed=1, name="target")
    before = state_of(target)
    with pytest.raises(checkpoints.CheckpointError, match="holds the state of adagrad"):
        target.load_checkpoint(tmp_path / "ckpt")
    for a, b in zip(before, state_of(target)):
        assert torch.equal(a, b)


def test_a_scheduler_state_that_does_not_fit_is_refused_before_anything_changes(tmp_path):
    source = engine_for(tmp_path, "cpu", "fp32", seed=0, name="source")
    train(source, list(batches(4)))
    source.save_checkpoint(tmp_path / "ckpt")
    states = tmp_path / "ckpt" / "global_step2" / "engine_states.pt"
    saved = torch.load(states)
    saved["lr_scheduler"] = {"step_size": 2}  # another scheduler's
    torch.save(saved, states)
    meta_file = tmp_path / "ckpt" / "global_step2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    import hashlib
    meta["files"]["engine_states.pt"]["digest"] = hashlib.blake2b(
        states.read_bytes(), digest_size=16).hexdigest()
    meta["meta_digest"] = checkpoints._meta_digest(meta)
    meta_file.write_text(json.dumps(meta))
    target = engine_for(tmp_path, "cpu", "fp32", seed=1, name="target")
    assert_refused_and_unchanged(target, tmp_path / "ckpt", "scheduler's state does not fit")


@pytest.mark.parametrize("tag", ["x ", " x", "latest.partial", "a.partial-1", "b.replaced-c",
                                 "-x", "", "a" * 201, "a/b", "é"])
def test_tags_that_would_confuse_a_later_load_are_refused(tmp_path, tag):
    engine = engine_for(tmp_path, "cpu", "fp32", seed=0)
    with pytest.raises(ValueError, match="accepted: 1 to 200 of"):
        engine.save_checkpoint(tmp_path / "ckpt", tag=tag)
