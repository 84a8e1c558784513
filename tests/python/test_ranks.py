"""The engine across ranks (strata/ranks.py): 2 and 4 ranks as processes on loopback, on Gloo,
each stage giving the same weights after N steps as one process with the same global batch; and
the job's failures (a missing variable, a wrong world size, a killed rank) named, never a hang."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from launch import assert_same, free_port, start_ranks

# One run of the trainer: one process (no launcher's variables) or one rank of a job. Each rank
# takes its slice of every global micro-batch; the weights after the steps are written by rank 0.
TRAIN = r"""
import json, sys, torch
import strata
stage, offload, dtype, steps, out, nvme = sys.argv[1:7]
stage, steps = int(stage), int(steps)
torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.l1 = torch.nn.Linear(32, 64)
        self.ln = torch.nn.LayerNorm(64)
        self.l2 = torch.nn.Linear(64, 50)

    def forward(self, x):
        return self.l2(self.ln(torch.relu(self.l1(self.emb(x)))))

rank, world = int(__import__("os").environ.get("RANK", 0)), \
    int(__import__("os").environ.get("WORLD_SIZE", 1))
GLOBAL = 12  # divided by 1, 2, 3 and 4 ranks
# One process may take each micro-batch in SPLIT parts, one after another (accumulated): the parts
# the ranks of a job of SPLIT take at once.
SPLIT = int(__import__("os").environ.get("STRATA_TEST_SPLIT", 1))
zero = {"stage": stage, "offload_optimizer": {"device": offload, "nvme_path": nvme},
        "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 3000,
        "allgather_bucket_size": 3000}
if stage == 3:
    zero["offload_param"] = {"device": offload, "nvme_path": nvme, "buffer_count": 2,
                             "buffer_size": 65536}
elif offload == "nvme":  # the NVMe optimizer's staging buffers, within the host budget
    zero["offload_param"] = {"buffer_count": 2, "buffer_size": 65536}
config = {"train_batch_size": GLOBAL * 2, "gradient_accumulation_steps": 2 * SPLIT,
          "gradient_clipping": float(__import__("os").environ.get("STRATA_TEST_CLIP", 0.5)),
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "zero_optimization": zero,
          "strata": {"device": "emulated", "device_budget_bytes": 49152,
                     "host_budget_bytes": 64 << 20, "nvme_capacity_bytes": 64 << 20,
                     "comm_timeout_s": 60}}
if __import__("os").environ.get("STRATA_TEST_DEVICE") == "cuda":  # tests/python/test_cuda.py's
    config["strata"]["device"] = "cuda"
    if __import__("os").environ.get("STRATA_TEST_DEVICE_INDEX"):  # ranks sharing one GPU
        config["strata"]["device_index"] = int(__import__("os").environ["STRATA_TEST_DEVICE_INDEX"])
if dtype == "bf16":
    config["bf16"] = {"enabled": True}
# Rank 0's weights reach every rank: the others start elsewhere. Built as given, or under
# strata.init (STRATA_TEST_INIT), each rank's partitions then holding its shard of rank 0's.
torch.manual_seed(0 if rank == 0 else 1000 + rank)
if __import__("os").environ.get("STRATA_TEST_INIT"):
    with strata.init(config=config):
        model = Net()
else:
    model = Net()
initial = {k: v.clone() for k, v in model.state_dict().items()}
group = None
if __import__("os").environ.get("STRATA_TEST_GROUP"):  # the trainer's torch.distributed group
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
engine, _, _, _ = strata.initialize(model=model, config=config, process_group=group)
assert engine.micro_batch_size == GLOBAL // world // SPLIT
gen = torch.Generator().manual_seed(1)
per = GLOBAL // world // SPLIT
norms = []  # the global gradient norm of each step (Adam would hide a gradient's scale)
staged = 0  # steps staged during backward that stood
for step in range(steps):
    for micro in range(2):
        xs = torch.randint(0, 50, (GLOBAL, 8), generator=gen)
        ys = torch.roll(xs, 1, 1)
        for part in range(SPLIT):
            lo = (rank * SPLIT + part) * per
            x, y = xs[lo:lo + per].to(engine.device), ys[lo:lo + per].to(engine.device)
            loss = torch.nn.functional.cross_entropy(engine(x).float().reshape(-1, 50),
                                                     y.reshape(-1))
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():  # what this rank holds
                held = sum(e.shard_grad.numel() for e in engine.table.trained
                           if e.shard_grad is not None)
                held += sum(e.host_grad.numel() for e in engine.table.trained
                            if e.host_grad is not None)
            engine.step()
    norms.append(engine.last_step_stats["optimizer"]["grad_norm"])
    staged += bool(engine.last_step_stats["optimizer"].get("staged"))
state = engine.module_state_dict()  # every rank takes part
if rank == 0:
    torch.save(dict({k: v.float() for k, v in state.items()}, initial=initial, norms=norms), out)
print(json.dumps({"rank": rank, "steps": engine.global_steps, "held": held, "staged": staged,
                  "shards": {e.name: [e.numel, e.shard] for e in engine.table.trained},
                  "in_backward": engine.ranks.reduce_scatters_in_backward if engine.ranks else 0,
                  "prefetched": engine.prefetched_gathers,
                  "collectives": engine.ranks.collectives.name if engine.ranks else None,
                  "warnings": [str(w) for w in engine.warnings],
                  "nvme": sorted(__import__("os").listdir(nvme)) if offload == "nvme" else []}))
"""


def run_single(tmp_path, stage, offload, dtype, steps, split=1, clip=None):
    out = tmp_path / f"single{split}.pt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["STRATA_TEST_SPLIT"] = str(split)
    if clip is not None:
        env["STRATA_TEST_CLIP"] = clip
    child = subprocess.run(
        [sys.executable, "-c", TRAIN, str(stage), offload, dtype, str(steps), str(out),
         str(tmp_path / "nvme1")], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return torch.load(out)


def run_job(tmp_path, n, stage, offload, dtype, steps, extra_env=None):
    out = tmp_path / f"ranks{n}.pt"
    procs = start_ranks(n, TRAIN, (stage, offload, dtype, steps, out, tmp_path / f"nvme{n}r"),
                        extra_env=extra_env)
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return torch.load(out), reports


# "noclip": no gradient_clipping (the others clip at 0.5, which scales these steps: a step staged
# during backward is then dropped and taken anew): at stages 2 and 3 every step is staged during
# backward and stands.
@pytest.mark.parametrize("n, stage, offload, dtype, under_init, group", [
    (2, 1, "cpu", "fp32", False, False),
    (4, 1, "nvme", "fp32", False, False),
    (2, 2, "cpu", "fp32", False, "noclip"),
    (2, 3, "cpu", "fp32", False, False),
    (4, 3, "nvme", "fp32", False, "noclip"),
    (4, 2, "cpu", "bf16", False, False),
    (2, 3, "cpu", "bf16", False, False),
    (3, 3, "nvme", "fp32", True, False),
    # The collectives on a torch.distributed group the trainer hands (Gloo's here; NCCL's on
    # GPUs, the same calls): stage 3 reduce-scatters in backward, reduces the small parameters at
    # the step and gathers weights, all on it.
    (2, 3, "cpu", "fp32", False, True),
])
def test_ranks_train_as_one_process_with_the_same_global_batch(tmp_path, n, stage, offload, dtype,
                                                               under_init, group):
    env = {"STRATA_TEST_INIT": "1"} if under_init else {}
    if group == "noclip":
        env["STRATA_TEST_CLIP"] = "0"
        group = False
    if group:
        env["STRATA_TEST_GROUP"] = "1"
    reports = train_as_one_process(tmp_path, n, stage, offload, dtype, env)
    assert all(r["collectives"] == ("torch.distributed's gloo process group over cpu buffers"
                                    if group else "strata's Gloo over host memory")
               for r in reports), reports
    if env.get("STRATA_TEST_CLIP") == "0":
        assert all(r["staged"] == 4 for r in reports), reports


def train_as_one_process(tmp_path, n, stage, offload, dtype, env):
    """`n` ranks (the launcher's variables and `env`) train to the weights of one process with the
    same global batch (see the test above; test_cuda.py's on a GPU); returns the ranks' reports."""
    steps = 4
    clip = env.get("STRATA_TEST_CLIP")
    single = run_single(tmp_path, stage, offload, dtype, steps, clip=clip)
    # bf16: the model's gradients are bf16 roundings over the part of the batch each rank takes,
    # not the whole micro-batch's; one process taking each micro-batch in the same parts makes the
    # same ones (measured: 0.7-11% of what training moved the weights from the unsplit run, and
    # 0-4% from the ranks'). The ranks are held to that process.
    split = run_single(tmp_path, stage, offload, dtype, steps, split=n, clip=clip) \
        if dtype == "bf16" \
        else None
    job, reports = run_job(tmp_path, n, stage, offload, dtype, steps, env)
    assert [r["steps"] for r in reports] == [steps] * n
    initial = single.pop("initial")
    job.pop("initial")
    # The gradients the ranks reduce are the mean over the global batch, as one process's: Adam
    # and clipping are blind to a gradient's scale, its norm is not.
    if clip != "0":  # (no norm is taken without clipping)
        torch.testing.assert_close(torch.tensor(job.pop("norms")),
                                   torch.tensor((split or single)["norms"]),
                                   rtol=1e-4 if dtype == "fp32" else 1e-2, atol=0)
    job.pop("norms", None)
    single.pop("norms")
    for name, value in single.items():
        assert not torch.equal(value, initial[name]), f"{name} did not train"
        if dtype == "fp32":
            # The ranks sum the same gradients in another order: a few ulps per step.
            diff = (job[name] - value).abs()
            torch.testing.assert_close(
                job[name], value, rtol=1e-4, atol=2e-5,
                msg=f"{name} after {steps} steps: {int((diff > 0).sum())} of {diff.numel()} "
                    f"differ, by at most {diff.max().item():.3g}")
        else:
            # Within a tenth of what training moved them (stage 2 sums the parts' bf16 gradients
            # in fp32 in both; stage 3 in one process adds them into its bf16 gradient
            # partition one by one, across ranks once in fp32).
            moved = (value - initial[name]).norm()
            apart = (job[name] - split[name]).norm()
            assert apart < 0.1 * moved, f"{name}: {apart:.3g} apart, training moved it {moved:.3g}"
    for r in reports:  # each rank owns a shard of every parameter, and holds no more
        assert all(shard == -(-numel // n) for numel, shard in r["shards"].values()), r["shards"]
        if stage == 2:  # its gradients' shards only (stage 1 keeps whole ones until the step)
            assert r["held"] == sum(shard for _, shard in r["shards"].values()), r
        if stage >= 2:  # reduce-scattered while backward ran (buckets of 3000 elements)
            assert r["in_backward"] > 0, r
        if stage == 3:
            # From the second micro-batch, of its 6 gathers (emb, l1, l2 forward and backward)
            # 4 were started ahead: not the first, nor l2's backward (its weights are still lent
            # to its forward when that gather's turn comes).
            assert r["prefetched"] == (2 * steps - 1) * 4, r
    if offload == "nvme":
        # Each rank's NVMe state in its own subfolder of the configured nvme_path.
        assert reports[0]["nvme"] == [f"rank{r}" for r in range(n)]
    return reports


SMALL = r"""
import os, signal, sys, time, torch
import strata
stage = int(sys.argv[1])
kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
          "strata": {"device": "emulated", "host_budget_bytes": 16 << 20,
                     "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 20}}
engine, _, _, _ = strata.initialize(model=model, config=config)
print("ready", flush=True)
for step in range(4):
    if step == kill_at and int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = engine(torch.randn(2, 16)).square().mean()
    engine.backward(loss)
    engine.step()
print("done", flush=True)
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_a_killed_rank_ends_the_others_with_an_error_not_a_hang(stage):
    procs = start_ranks(2, SMALL, (stage, 2))
    start = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0, out0
    assert "done" not in out0
    # Named: which collective failed, and that it was the other rank that went away.
    last = err0.strip().splitlines()[-1]
    assert last.startswith("strata._strata.Error: rank 0 of 2: ") and any(
        f"{c} failed (timeout 20000 ms; a rank died or stopped answering?)" in last
        for c in ("reduce-scatter", "all-gather", "all-reduce")), err0[-3000:]
    assert time.monotonic() - start < 60  # well inside the timeout: a closed peer is seen at once


def test_stage_0_across_ranks_is_refused_naming_what_is_accepted():
    procs = start_ranks(2, SMALL, (0,))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        assert "zero_optimization.stage 0 across 2 ranks: accepted: 1, 2 or 3" in err, err[-2000:]


SETUP = r"""
import os, sys, torch
import strata
rank = int(os.environ["RANK"])
strata_block = {"device": "emulated", "host_budget_bytes": 16 << 20,
                "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 60}
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam"},
          "zero_optimization": {"stage": 2}, "strata": strata_block}
if sys.argv[1] == "dtype" and rank == 1:
    config["bf16"] = {"enabled": True}
if sys.argv[1].startswith("gpu"):  # this machine's GPUs (none on CI): LOCAL_RANK's is beyond
    strata_block["device"] = "cuda"
if sys.argv[1] == "budget" and rank == 1:  # below what the run takes, on this rank only
    strata_block["host_budget_bytes"] = 4096
group = None
if sys.argv[1] == "group":  # the trainer's group, handed on rank 0 only
    import torch.distributed as dist
    dist.init_process_group("gloo")
    group = dist.group.WORLD if rank == 0 else None
if sys.argv[1] == "gpu_init":  # strata.init makes a Runtime on the GPU first
    with strata.init(config=config):
        pass
strata.initialize(model=torch.nn.Linear(4, 4), config=config, process_group=group)
"""


@pytest.mark.parametrize("case, message", [
    ("dtype", "the ranks' set-ups differ (dtype: rank 0 float32, rank 1 bfloat16); accepted: the "
              "same config on every rank"),
    ("gpu", "across ranks: rank 0: strata.device \"cuda\": LOCAL_RANK 0 names GPU 0, but this "
            "process sees 0 GPUs"),
    ("gpu_init", "across ranks: rank 0: strata.device \"cuda\": LOCAL_RANK 0 names GPU 0"),
    ("budget", "across ranks: rank 1: "),
    ("group", "rank 1 differs from rank 0 (this rank: the gradients' and weights' collectives on"),
])
def test_ranks_whose_set_ups_differ_or_cannot_go_on_are_named_on_every_rank(case, message):
    if case.startswith("gpu") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU for LOCAL_RANK 0")
    start = time.monotonic()
    procs = start_ranks(2, SETUP, (case,))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        assert message in err, err[-2000:]
        if case.startswith("gpu"):  # each rank's reason, on every rank
            assert "rank 1: strata.device \"cuda\": LOCAL_RANK 1 names GPU 1" in err, err[-2000:]
        if case == "budget":
            assert "strata.host_budget_bytes" in err, err[-2000:]
    assert time.monotonic() - start < 50  # named at once, not at the timeout (60 s)


class _Job:
    rank, world_size, local_rank = 1, 2, 1


def test_a_long_reason_in_a_rank_s_set_up_is_cut_to_fit_not_garbled():
    from strata import ranks as ranks_module

    class Alone:  # a job of one rank: the exchange hands back this rank's own bytes
        rank, world_size, local_rank = 0, 1, 0

        def all_gather(self, send, out, async_op=False):
            out.copy_(send)

    ranks = ranks_module.Ranks(Alone())
    with pytest.raises(ValueError, match="across ranks: rank 0: CUDA_VISIBLE_DEVICES GPU-0"):
        ranks_module.agree_on_setup(ranks, {"stage": "3", "error": "CUDA_VISIBLE_DEVICES " +
                                            ",".join(f"GPU-{i}" * 20 for i in range(50))})


class _Group:
    def __init__(self, size=2, rank=1):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_the_collectives_are_chosen_by_the_device_the_gpus_and_the_group_handed(monkeypatch):
    from strata import ranks as ranks_module
    ranks = ranks_module.Ranks(_Job())
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    # The emulated device: the job's Gloo, unless the trainer hands a group.
    assert ranks_module.choose_collectives(ranks, cpu, [{}, {}]) == (ranks.collectives, None)
    backends = {}
    monkeypatch.setattr(ranks_module, "_backend_of", lambda g: backends[g])
    gloo, nccl = _Group(), _Group()
    backends.update({gloo: "gloo", nccl: "nccl"})
    chosen, notice = ranks_module.choose_collectives(ranks, cpu, [{}, {}], gloo)
    assert (chosen.group, chosen.device.type, chosen.pinned, notice) == (gloo, "cpu", False, None)
    # On a GPU: a handed NCCL group over the GPU's buffers; a Gloo one through pinned memory.
    chosen, _ = ranks_module.choose_collectives(ranks, gpu, [{}, {}], nccl)
    assert (chosen.group, chosen.device, chosen.pinned) == (nccl, gpu, False)
    chosen, _ = ranks_module.choose_collectives(ranks, gpu, [{}, {}], gloo)
    assert (chosen.group, chosen.device.type, chosen.pinned) == (gloo, "cpu", True)
    # A group that is not the job's, in the launcher's order, is named.
    with pytest.raises(ValueError, match="rank 0 of 2 in the group handed, but rank 1 of 2 as "
                                         "the launcher says"):
        ranks_module.choose_collectives(ranks, gpu, [{}, {}], _Group(2, 0))
    # Ranks sharing a GPU (NCCL refuses them), or a torch without NCCL: the job's Gloo, staged
    # through pinned memory, said once.
    shared = [{"gpu": "node/GPU-a"}, {"gpu": "node/GPU-a"}]
    chosen, notice = ranks_module.choose_collectives(ranks, gpu, shared)
    assert chosen.job is ranks.job and chosen.pinned
    assert "ranks 0, 1 share a GPU (node/GPU-a), which NCCL refuses" in notice
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    chosen, notice = ranks_module.choose_collectives(
        ranks, gpu, [{"gpu": "node/GPU-a"}, {"gpu": "node/GPU-b"}])
    assert chosen.pinned and "this torch has no NCCL" in notice
    # A group made for both devices takes each one's backend; one without Gloo is refused on
    # the emulated tier, whose buffers are the host's.
    both, only_nccl = _Group(), _Group()
    backends.update({both: "cpu:gloo,cuda:nccl", only_nccl: "nccl"})
    chosen, _ = ranks_module.choose_collectives(ranks, gpu, [{}, {}], both)
    assert chosen.name == "torch.distributed's nccl process group over cuda buffers"
    with pytest.raises(ValueError, match="its backend 'nccl' does not run on host tensors"):
        ranks_module.choose_collectives(ranks, cpu, [{}, {}], only_nccl)
    # A default group without NCCL on a GPU is refused by name (strata does not make a second).
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    backends[dist.group.WORLD] = "gloo"
    with pytest.raises(ValueError, match="default group is 'gloo', without NCCL"):
        ranks_module.choose_collectives(ranks, gpu, [{"gpu": "a"}, {"gpu": "b"}])


FP16 = r"""
import json, os, sys, torch
import strata
rank = int(os.environ["RANK"])
stage = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
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
    x = torch.randn(2, 16, generator=gen).half()
    loss = engine(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    staged.append(bool(engine.last_step_stats["optimizer"].get("staged")))
state = engine.module_state_dict()
print(json.dumps({"skipped": engine.skipped_steps, "scale": engine.loss_scale, "staged": staged,
                  "sum": sum(v.double().sum().item() for v in state.values())}))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(stage):
    # The steps are staged during backward (no clipping): the ranks' norm decides before any
    # commits, so that a rank whose own shards are finite skips with the one that overflowed.
    procs = start_ranks(2, FP16, (stage,))
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


def test_ranks_that_disagree_on_the_world_size_are_told_so():
    port = free_port()
    procs = []
    for rank, size in ((0, 2), (1, 3)):  # the second process says the job has three ranks
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-c", SMALL, "2"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    _, err1 = procs[1].communicate(timeout=120)
    assert procs[1].returncode != 0
    assert "was given world size 3 but rank 0 was given 2: WORLD_SIZE must be the same on every " \
           "rank" in err1, err1[-2000:]
    # Rank 0 waits for a rank 1 of its job that never comes: it fails at comm_timeout_s (20 s).
    _, err0 = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0
    assert time.monotonic() - start < 90
    assert "gloo: rank 0 of 2 could not connect to the others" in err0 and \
        "no answer within 20000 ms" in err0, err0[-2000:]


def test_a_missing_launcher_variable_is_named_by_initialize():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               LOCAL_RANK="0")
    env.pop("WORLD_SIZE", None)
    child = subprocess.run([sys.executable, "-c", SMALL, "2"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode != 0
    assert "WORLD_SIZE is not set" in child.stderr, child.stderr[-2000:]


def test_a_train_batch_size_the_ranks_do_not_divide_is_refused():
    from strata.config import TrainConfig, ConfigError
    with pytest.raises(ConfigError, match="train_batch_size: 10 is not a multiple of the job's 4 "
                                          "ranks"):
        TrainConfig.parse({"train_batch_size": 10}, world_size=4)
    c = TrainConfig.parse({"train_batch_size": 16, "gradient_accumulation_steps": 2},
                          world_size=4)
    assert (c.micro_batch, c.accumulation) == (2, 2)
    with pytest.raises(ConfigError, match=r"train_batch_size: 8 \(over 4 ranks, 2 a rank\) is "
                                          "not a multiple of gradient_accumulation_steps 3"):
        TrainConfig.parse({"train_batch_size": 8, "gradient_accumulation_steps": 3},
                          world_size=4)
    with pytest.raises(ConfigError, match="16 != train_micro_batch_size_per_gpu 4 x "
                                          "gradient_accumulation_steps 2 x 4 ranks"):
        TrainConfig.parse({"train_batch_size": 16, "gradient_accumulation_steps": 2,
                           "train_micro_batch_size_per_gpu": 4}, world_size=4)


DIVERGE = r"""
import os, sys, torch
import strata
stage = int(sys.argv[1])
# "sum": the same model on every rank, only the order its backward makes gradients final differs.
same_sum = sys.argv[2:] == ["sum"]
rank = int(os.environ["RANK"])

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x, step):
        if same_sum:  # the sum's terms made in another order on rank 1
            return self.a(x) + self.b(x) if rank == 0 else self.b(x) + self.a(x)
        # From the second step rank 1 runs its layers the other way round (stage 3), or leaves
        # one out (an expert no token was routed to, at stage 2).
        if rank == 1 and step >= 1:
            return self.b(x) if stage == 2 else self.a(self.b(x))
        return self.b(self.a(x))

torch.manual_seed(0)
# With "sum" the layers stay whole on every rank (under the persistence threshold): their
# optimizer steps shards, all-gathered after the step.
config = {"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": stage,
                                "stage3_param_persistence_threshold": 1000 if same_sum else 10,
                                "reduce_bucket_size": 1},
          "strata": {"device": "emulated", "host_budget_bytes": 16 << 20,
                     "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 60}}
engine, _, _, _ = strata.initialize(model=Net(), config=config)
for step in range(3):
    engine.backward(engine(torch.randn(2, 16), step).square().mean())
    engine.step()
print("done", float(sum(p.double().sum() for p in engine.module_state_dict().values())))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_whose_order_differs_is_named_on_every_rank_without_a_hang(stage):
    # Stage 3 gathers each module's weights as it runs: the order of use is the collectives'.
    # Stage 2 reduces each gradient as backward makes it, on the job's second communicator (each
    # digest on the first: a rank that differs is still named at once, not at the timeout).
    procs = start_ranks(2, DIVERGE, (stage,))
    start = time.monotonic()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode != 0 and "done" not in out
        last = err.strip().splitlines()[-1]
        assert "the ranks issue different collectives at collective" in last and \
            "rank 1 differs from rank 0" in last and \
            "accepted: the same model on every rank" in last, err[-2000:]
    assert time.monotonic() - start < 50  # at once, not at the 60 s timeout


def test_ranks_whose_backward_orders_gradients_differently_step_alike():
    # The step after backward stages the parameters in each rank's own order of gradients only in
    # one process: across ranks, in the parameters' order (the new weights' all-gathers follow it).
    procs = start_ranks(2, DIVERGE, (3, "sum"))
    weights = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "done" in out, err[-2000:]
        weights.append(out.split()[-1])
    assert weights[0] == weights[1]


# Checkpoints across ranks: "save" trains 2 steps, saves, trains 2 more; "resume" starts from other
# weights, loads, and trains the same last 2 steps. Rank 0 writes the weights it sees at each mark.
MISC = r"""
import json, os, sys, torch
import strata
rank = int(os.environ["RANK"])
torch.manual_seed(rank)  # every rank builds other weights: rank 0's must win

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 8)
        self.l2 = torch.nn.Linear(8, 2)
        self.register_buffer("counts", torch.randint(0, 1000, (5,)))  # int64

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

def config(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": dict({"stage": stage, "stage3_param_persistence_threshold": 10},
                                      **zero),
            "strata": {"device": "emulated", "host_budget_bytes": 16 << 20,
                       "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 30}}

out = {}
# Rank 0's weights and buffers, of every dtype (a float64 one beside the int64 one), reach every
# rank. (A float64 model under this fp32 config is refused: it would train in fp32.)
model = Net()
model.register_buffer("scale", torch.randn(3, dtype=torch.float64))
a, _, loader, _ = strata.initialize(model=model, config=config(2, reduce_bucket_size=100),
                                    training_data=list(range(16)))
out["weights"] = {k: v.double().sum().item() for k, v in a.module_state_dict().items()}
out["place"] = [a.global_rank, a.world_size, a.local_rank, a.train_batch_size()]
out["epochs"] = [[int(i) for batch in loader for i in batch] for _ in range(3)]
# A second engine in the same process, with buckets of its own.
b, _, _, _ = strata.initialize(model=Net(), config=config(3, reduce_bucket_size=7777,
                                                         overlap_comm=1))
out["buckets"] = [a.ranks.reduce_bucket, a.ranks.overlap, b.ranks.reduce_bucket, b.ranks.overlap]
for engine in (a, b):
    for _ in range(2):
        x = torch.randn(2, 6)
        engine.backward(engine(x).square().mean())
        engine.step()
out["trained"] = [a.global_steps, b.global_steps]
print(json.dumps(out))
"""


def test_every_dtype_comes_from_rank_0_two_engines_share_the_job_and_epochs_reshuffle():
    procs = start_ranks(2, MISC)
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0]["weights"] == outs[1]["weights"]  # the weights, the float64 and int buffers
    assert [o["place"] for o in outs] == [[0, 2, 0, 4], [1, 2, 1, 4]]
    for o in outs:
        assert o["buckets"] == [100, False, 7777, True]
        assert o["trained"] == [2, 2]
        epochs = o["epochs"]
        assert len(epochs[0]) == 8 and epochs[0] != epochs[1] != epochs[2]  # reshuffled
    # The ranks' shares of an epoch are the whole of it, once.
    for e in range(3):
        assert sorted(outs[0]["epochs"][e] + outs[1]["epochs"][e]) == list(range(16))


def test_bad_bucket_and_timeout_values_are_named_in_one_process_too(tmp_path):
    import strata
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam"},
            "strata": {"host_budget_bytes": 1 << 24, "nvme_capacity_bytes": 1 << 24}}
    for zero, message in (({"overlap_comm": "yes"}, "overlap_comm: 'yes' is not accepted"),
                          ({"reduce_bucket_size": 0}, "reduce_bucket_size: 0 is not accepted")):
        with pytest.raises(ValueError, match=message):
            strata.initialize(model=torch.nn.Linear(2, 2),
                              config=dict(base, zero_optimization=dict(zero, stage=2)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="2", LOCAL_RANK="0")
    child = subprocess.run(
        [sys.executable, "-c", "import torch, strata; strata.initialize(model=torch.nn.Linear(2,"
         " 2), config={'train_micro_batch_size_per_gpu': 1, 'optimizer': {'type': 'Adam'}, "
         "'zero_optimization': {'stage': 2}, 'strata': {'comm_timeout_s': 1.5}})"],
        env=env, capture_output=True, text=True, timeout=60)
    assert "strata.comm_timeout_s: 1.5 is not accepted; accepted: whole seconds" in child.stderr, \
        child.stderr[-2000:]


# A backward that fails mid-way (in every rank alike) and training that goes on: the gradients
# autograd made before the failure stay, as in one process, whatever the buckets.
FAILING = r"""
import json, os, sys, torch
import strata
stage, bucket, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
fail = [False]

class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if fail[0]:
            raise RuntimeError("boom")
        return grad

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.c(self.b(Boom.apply(self.a(x))))

torch.manual_seed(0)
config = {"train_batch_size": 8, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10,
                                "reduce_bucket_size": bucket},
          "strata": {"device": "emulated", "host_budget_bytes": 16 << 20,
                     "nvme_capacity_bytes": 16 << 20, "comm_timeout_s": 60}}
engine, _, _, _ = strata.initialize(model=Net(), config=config)
gen = torch.Generator().manual_seed(2)
per = 4 // world
for step in range(3):
    for micro in range(2):
        x = torch.randn(4, 16, generator=gen)[rank * per:(rank + 1) * per]
        fail[0] = step == 1 and micro == 1
        try:
            engine.backward(engine(x).square().mean())
        except RuntimeError as error:
            assert "boom" in str(error)
        engine.step()
state = engine.module_state_dict()
if rank == 0:
    torch.save(state, out)
"""


@pytest.mark.parametrize("stage, bucket", [(2, 100000), (3, 100000), (3, 1)])
def test_gradients_made_before_a_failed_backward_are_kept_as_in_one_process(tmp_path, stage,
                                                                           bucket):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    single = subprocess.run([sys.executable, "-c", FAILING, str(stage), str(bucket),
                             str(tmp_path / "one.pt")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert single.returncode == 0, single.stderr[-2000:]
    for p in start_ranks(2, FAILING, (stage, bucket, tmp_path / "two.pt")):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    assert_same(torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt"), False,
                "after a failed backward")


def test_optimizer_commit_partition_across_ranks_is_refused_naming_what_is_accepted(tmp_path):
    # A step that failed part way on one rank would leave its shards stepped and the others' not.
    script = SMALL.replace(
        '"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},',
        '"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10, '
        f'"offload_optimizer": {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}, '
        '"offload_param": {"buffer_count": 2, "buffer_size": 65536}}, '
        '"aio": {"block_size": 65536},').replace(
        '"comm_timeout_s": 20}', '"comm_timeout_s": 20, "optimizer_commit": "partition"}')
    assert "optimizer_commit" in script and "nvme_path" in script
    procs = start_ranks(2, script, (2,))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        assert 'strata.optimizer_commit "partition" across ranks' in err and \
            'accepted: "step"' in err, err[-2000:]
