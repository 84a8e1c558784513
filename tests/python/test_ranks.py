"""The engine across ranks (strata/ranks.py): 2 and 4 ranks as processes on loopback, on Gloo,
each stage giving the same weights after N steps as one process with the same global batch.
(test_ranks_failures.py: the job's failures, named, never a hang.)"""
import json
import os
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
# Every collective's buffer kept for the next (as those of tens of MB are): these tiny ones too,
# so that a weight handed on as a view of a buffer given back, or a gradient row left unzeroed,
# shows here.
strata.ranks.Collectives.KEPT_FROM = 0

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.l1 = torch.nn.Linear(32, 64)
        self.ln = torch.nn.LayerNorm(64)
        self.l2 = torch.nn.Linear(64, 50)
        with torch.no_grad():  # a parent's own initialization of a child's built weight
            self.l2.weight.copy_(self.l2.weight.flip(0))  # (strata.init: lent whole from the
            # shards, rank 0's written back)

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
          # STRATA_TEST_USER_CLIP: torch.nn.utils.clip_grad_norm_ at 0.5 instead, called by the
          # loop as a plain torch loop clips
          **({"gradient_clipping": 0.0}
             if __import__("os").environ.get("STRATA_TEST_USER_CLIP") else {}),
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "zero_optimization": zero,
          "strata": {"device": "emulated", "device_budget_bytes": 49152,
                     "host_budget_bytes": 64 << 20, "nvme_capacity_bytes": 64 << 20,
                     "comm_timeout_s": 60}}
if __import__("os").environ.get("STRATA_TEST_TRANSPORT"):  # strata.comm_transport
    config["strata"]["comm_transport"] = __import__("os").environ["STRATA_TEST_TRANSPORT"]
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
if __import__("os").environ.get("STRATA_TEST_FROZEN"):  # l1 not trained (a frozen base's part)
    model.l1.requires_grad_(False)
initial = {k: v.clone() for k, v in model.state_dict().items()}
group = None
if __import__("os").environ.get("STRATA_TEST_GROUP"):  # the trainer's torch.distributed group
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
engine, _, _, _ = strata.initialize(model=model, config=config, process_group=group)
if __import__("os").environ.get("STRATA_TEST_FROZEN"):
    # The frozen layer edited in GatheredParameters before training (its weight a partition, its
    # bias under the threshold, whole on each rank): rank 0's writes are every rank's (the
    # others' here are zeros, which must not land: the steps would differ).
    with strata.GatheredParameters([model.l1.weight, model.l1.bias], modifier_rank=0):
        if rank != 0:
            model.l1.weight.data.zero_()
            model.l1.bias.data.zero_()
    for p in ([model.l1.weight, model.l1.bias] if engine.ranks is not None else []):
        try:  # another modifier rank, refused by name before anything is gathered
            strata.GatheredParameters(p, modifier_rank=1)
        except ValueError as error:
            assert "modifier_rank=1) across ranks: accepted: modifier_rank=0" in str(error)
        else:
            raise AssertionError("GatheredParameters(modifier_rank=1) was taken across ranks")
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
            user_norm = None
            if engine.is_gradient_accumulation_boundary():  # what this rank holds
                held = sum(e.shard_grad.numel() for e in engine.table.trained
                           if e.shard_grad is not None)
                held += sum(e.host_grad.numel() for e in engine.table.trained
                            if e.host_grad is not None)
                # .grad: none left across ranks (the mean is in the owners' shards), as DeepSpeed's
                grads_left = sum(p.grad is not None for p in engine.module.parameters())
                if __import__("os").environ.get("STRATA_TEST_USER_CLIP"):
                    user_norm = float(torch.nn.utils.clip_grad_norm_(
                        engine.module.parameters(), 0.5))
            engine.step()
    norms.append(engine.last_step_stats["optimizer"]["grad_norm"] if user_norm is None
                 else user_norm)
    staged += bool(engine.last_step_stats["optimizer"].get("staged"))
state = engine.module_state_dict()  # every rank takes part
if rank == 0:
    torch.save(dict({k: v.float() for k, v in state.items()}, initial=initial, norms=norms), out)
print(json.dumps({"rank": rank, "steps": engine.global_steps, "held": held, "staged": staged,
                  "grads_left": grads_left,
                  "shards": {e.name: [e.numel, e.shard] for e in engine.table.entries()},
                  "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
                  "frozen_partitioned": [e.name for e in engine.table.frozen],
                  "in_backward": engine.ranks.reduce_scatters_in_backward if engine.ranks else 0,
                  "prefetched": engine.prefetched_gathers,
                  "collectives": engine.ranks.collectives.name if engine.ranks else None,
                  "warnings": [str(w) for w in engine.warnings],
                  "nvme": sorted(__import__("os").listdir(nvme)) if offload == "nvme" else []}))
if group is not None:  # as torch asks of whoever makes a group (see the exit test below)
    dist.destroy_process_group()
"""


def run_single(tmp_path, stage, offload, dtype, steps, split=1, clip=None, frozen=None):
    out = tmp_path / f"single{split}.pt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["STRATA_TEST_SPLIT"] = str(split)
    if frozen:
        env["STRATA_TEST_FROZEN"] = frozen
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
# backward and stands. "tcp": strata's collectives on Gloo over TCP (strata.comm_transport; the
# others on shared memory, the default for ranks on one host). Stage 0 runs as stage 1 across
# ranks (the same numbers as data parallel); (4, 1, ...) is stage 1's own. "userclip": the loop
# clips with torch.nn.utils.clip_grad_norm_ (the gradients reduced by then), the norm and step
# those of the one process clipping by the config.
@pytest.mark.parametrize("n, stage, offload, dtype, under_init, group", [
    (2, 0, "cpu", "fp32", False, "userclip"),
    (4, 1, "nvme", "fp32", False, "tcp"),
    (2, 2, "cpu", "fp32", False, "noclip"),
    (2, 3, "cpu", "fp32", False, False),
    (4, 3, "nvme", "fp32", False, "noclip"),
    (4, 2, "cpu", "bf16", False, False),
    (2, 3, "cpu", "bf16", False, False),
    (3, 3, "nvme", "fp32", True, False),
    # l1 frozen (a frozen base's part, as under LoRA), built as given and under strata.init: its
    # partition holds each rank's shard too, all-gathered as it is lent.
    (2, 3, "cpu", "fp32", False, "frozen"),
    (2, 3, "nvme", "fp32", True, "frozen"),
    # The collectives on a torch.distributed group the trainer hands (Gloo's here; NCCL's on
    # GPUs, the same calls): stage 3 reduce-scatters in backward, reduces the small parameters at
    # the step and gathers weights, all on it.
    (2, 3, "cpu", "fp32", False, True),
])
def test_ranks_train_as_one_process_with_the_same_global_batch(tmp_path, n, stage, offload, dtype,
                                                               under_init, group):
    env = {"STRATA_TEST_INIT": "1"} if under_init else {}
    transport = "shared memory"
    if group == "noclip":
        env["STRATA_TEST_CLIP"] = "0"
        group = False
    if group == "userclip":
        env["STRATA_TEST_USER_CLIP"] = "1"
        group = False
    if group == "frozen":
        env["STRATA_TEST_FROZEN"] = "1"
        group = False
    if group == "tcp":
        env["STRATA_TEST_TRANSPORT"] = "tcp"
        transport, group = "Gloo over TCP", False
    if group:
        env["STRATA_TEST_GROUP"] = "1"
    reports = train_as_one_process(tmp_path, n, stage, offload, dtype, env)
    assert all(r["collectives"] == ("torch.distributed's gloo process group over cpu buffers"
                                    if group else f"strata's collectives ({transport}) over host "
                                    "memory")
               for r in reports), reports
    if env.get("STRATA_TEST_CLIP") == "0":
        assert all(r["staged"] == 4 for r in reports), reports
    if env.get("STRATA_TEST_FROZEN"):  # (frozen ones stayed whole on each device before)
        assert all(r["frozen_partitioned"] == ["l1.weight"] for r in reports), reports


def train_as_one_process(tmp_path, n, stage, offload, dtype, env):
    """`n` ranks (the launcher's variables and `env`) train to the weights of one process with the
    same global batch (see the test above; test_cuda.py's on a GPU); returns the ranks' reports."""
    steps = 4
    clip = env.get("STRATA_TEST_CLIP")
    single = run_single(tmp_path, stage, offload, dtype, steps, clip=clip,
                        frozen=env.get("STRATA_TEST_FROZEN"))
    # bf16: the model's gradients are bf16 roundings over the part of the batch each rank takes,
    # not the whole micro-batch's; one process taking each micro-batch in the same parts makes the
    # same ones (measured: 0.7-11% of what training moved the weights from the unsplit run, and
    # 0-4% from the ranks'). The ranks are held to that process.
    split = run_single(tmp_path, stage, offload, dtype, steps, split=n, clip=clip) \
        if dtype == "bf16" \
        else None
    job, reports = run_job(tmp_path, n, stage, offload, dtype, steps, env)
    assert [r["steps"] for r in reports] == [steps] * n
    assert all(r["grads_left"] == 0 for r in reports), reports
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
    frozen = reports[0]["frozen"]
    for name, value in single.items():
        assert torch.equal(value, initial[name]) == (name in frozen), f"{name}: trained?"
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
        if stage <= 2:  # its gradients' shards only (stages 0-1: reduced after the last backward)
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
# BatchNorm's running statistics, each rank's from its own batches: rank 0's on every rank after
# each step, as DDP gives them, so that an eval forward is the same model everywhere.
bn = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
c, _, _, _ = strata.initialize(model=bn, config=config(1))
for _ in range(2):
    c.backward(c(torch.randn(4, 6) + rank).square().mean())
    c.step()
out["bn"] = [bn[1].running_mean.tolist(), bn[1].running_var.tolist(),
             int(bn[1].num_batches_tracked)]
bn.eval()
with torch.no_grad():
    out["eval"] = c(torch.ones(1, 6)).tolist()
# An edit within GatheredParameters(modifier_rank=0) of a weight kept whole (stage 2): rank 0's
# becomes every rank's weights and master weights, and the next step goes on from it.
with strata.GatheredParameters([a.module.l1.weight], modifier_rank=0):
    if rank == 0:
        a.module.l1.weight.data.fill_(0.25)
a.backward(a(torch.randn(2, 6)).square().mean())
a.step()
out["edited"] = (a.module.l1.weight - 0.25).abs().max().item()
print(json.dumps(out))
"""


EXIT_WITH_A_COLLECTIVE_IN_FLIGHT = r"""
import atexit, sys, time, torch, torch.distributed as dist
case = sys.argv[1]
if case == "stuck":  # how long strata's exit handler took (this one runs after it)
    atexit.register(lambda: print(f"settled after {time.monotonic() - issued:.1f} s", flush=True))
if case == "late":  # a trainer's handler registered before strata's: it runs after strata's
    def save_at_exit():
        whole = torch.empty(4)
        on.all_gather(torch.full((2,), float(dist.get_rank())), whole).wait()
        print("gathered at exit", whole.tolist(), flush=True)
    atexit.register(save_at_exit)
from strata import ranks
dist.init_process_group("gloo")
group = dist.group.WORLD  # (held to the end, as a trainer's script holds it)
on = ranks._OnGroup(group, torch.device("cpu"), made=case in ("made", "stuck"))
if case == "stuck":  # rank 1 never takes part, and outlives rank 0 by far
    if dist.get_rank() == 1:
        time.sleep(25)
        sys.exit(0)
    for _ in range(2):
        on.all_gather(torch.ones(1000), torch.empty(2000))
    issued = time.monotonic()
    print("issued", flush=True)
    sys.exit(0)
if dist.get_rank() == 1:
    time.sleep(1)  # rank 0's gather finishes as its script ends
on.all_gather(torch.ones(1000), torch.empty(2000))  # never waited for
if case == "handed":
    dist.destroy_process_group()  # as torch asks of the trainer that made it
"""


AFTER_EXIT = r"""
import sys, time, weakref, torch, torch.distributed as dist
from strata import ranks
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
on = ranks._OnGroup(dist.group.WORLD, torch.device("cpu"))
ranks._settle_groups_at_exit()  # as the interpreter's exit runs it: what follows is a later handler
ranks._KEEP_AFTER_EXIT_S = 0.05
alive = []
for _ in range(12):  # a consolidated save's gathers, say
    whole = torch.empty(1000)
    on.all_gather(torch.ones(1000), whole).wait()
    alive.append(weakref.ref(whole))
    del whole
    time.sleep(0.1)
print(sum(r() is not None for r in alive))
dist.destroy_process_group()
"""


def test_the_collectives_of_a_late_exit_handler_are_let_go_once_long_finished():
    """Those an exit handler issues after strata's has run are held until torch's thread is long
    done with them, not for good: a consolidated save at exit kept every gathered layer (an
    audit's finding, the process's memory growing by each)."""
    out = subprocess.run([sys.executable, "-c", AFTER_EXIT, str(free_port())], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) <= 2, out.stdout


@pytest.mark.parametrize("case", ["made", "handed", "late"])
def test_a_collective_in_flight_at_exit_ends_before_the_interpreter_does(case):
    """A torch group's work still running as the script ends (the group strata made on GPUs, or
    one the trainer handed and destroyed itself while strata held it) is given time to finish
    before the interpreter finalizes: Gloo's thread released the finished work's tensors during
    finalization and aborted the process ("terminate called without an active exception"; the
    handed case did so every time before, the made one mostly). "late": a trainer's exit handler
    that runs after strata's still gathers on the group."""
    procs = start_ranks(2, EXIT_WITH_A_COLLECTIVE_IN_FLIGHT, (case,))
    for p in procs:
        out, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        if case == "late":
            assert "gathered at exit [0.0, 0.0, 1.0, 1.0]" in out, (out, stderr[-3000:])


AFTER_THE_TRAINERS_DESTROY = r"""
import time, torch, torch.distributed as dist
from strata import ranks
dist.init_process_group("gloo")
on = ranks._OnGroup(dist.group.WORLD, torch.device("cpu"))
dist.destroy_process_group()
on.settle(time.monotonic() + 1)  # (as at exit: the destroyed group let go)
try:
    on.all_gather(torch.ones(2), torch.empty(2))
except RuntimeError as e:
    print("refused:", e)
"""


def test_a_collective_on_a_group_destroyed_and_let_go_is_refused_by_name():
    """Never torch's default group in its place (group=None would name it)."""
    (p,) = start_ranks(1, AFTER_THE_TRAINERS_DESTROY)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert "refused: strata: a collective on a torch.distributed group that was destroyed" in out, \
        (out, err[-3000:])


def test_the_exit_waits_for_collectives_that_never_finish_5_s_at_most():
    """Two gathers in flight that the other rank never joins (it lives on): strata's exit handler
    gives them 5 s in all, and leaves the group strata made alone (its destroy would wait for
    them). It waited for the other rank's end before (a wait given under a millisecond had no
    limit). (torch's own teardown of the group then still waits for that rank, as it always did.)"""
    procs = start_ranks(2, EXIT_WITH_A_COLLECTIVE_IN_FLIGHT, ("stuck",))
    try:
        assert procs[0].stdout.readline().strip() == "issued", procs[0].stderr.read()
        settled = procs[0].stdout.readline().strip()
        assert settled.startswith("settled after "), (settled, procs[0].stderr.read())
        assert 4.5 < float(settled.split()[2]) < 8, settled
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_every_dtype_comes_from_rank_0_two_engines_share_the_job_and_epochs_reshuffle():
    procs = start_ranks(2, MISC)
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0]["weights"] == outs[1]["weights"]  # the weights, the float64 and int buffers
    assert outs[0]["bn"] == outs[1]["bn"] and outs[0]["eval"] == outs[1]["eval"], outs
    assert outs[0]["bn"][2] == 2 and any(m != 0 for m in outs[0]["bn"][0]), outs
    assert outs[0]["edited"] == outs[1]["edited"] and 0 < outs[0]["edited"] < 0.02, outs
    assert [o["place"] for o in outs] == [[0, 2, 0, 4], [1, 2, 1, 4]]
    for o in outs:
        assert o["buckets"] == [100, False, 7777, True]
        assert o["trained"] == [2, 2]
        epochs = o["epochs"]
        assert len(epochs[0]) == 8 and epochs[0] != epochs[1] != epochs[2]  # reshuffled
    # The ranks' shares of an epoch are the whole of it, once.
    for e in range(3):
        assert sorted(outs[0]["epochs"][e] + outs[1]["epochs"][e]) == list(range(16))


def test_bad_bucket_timeout_and_transport_values_are_named_in_one_process_too(tmp_path):
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
    # Launched: the timeout is refused before the job is joined (it bounds the joining).
    child = subprocess.run([sys.executable, "-c", """
import torch, strata
strata.initialize(model=torch.nn.Linear(2, 2), config={
    'train_micro_batch_size_per_gpu': 1, 'optimizer': {'type': 'Adam'},
    'zero_optimization': {'stage': 2}, 'strata': {'comm_timeout_s': 1.5}})
"""], env=env, capture_output=True, text=True, timeout=60)
    assert "strata.comm_timeout_s: 1.5 is not accepted; accepted: whole seconds" in \
        child.stderr, child.stderr[-2000:]
    # The transport is exchanged first: one rank's bad value is named on both ranks at once (the
    # other no longer waits for it until comm_timeout_s), a bad value of any type as given.
    for values, says in ((('nccl', 'auto'), ('"nccl" is not accepted; accepted: "auto"',
                                             'rank 0 was given "nccl", which is not accepted')),
                         ((5, 5), ('"5" is not accepted', '"5" is not accepted'))):
        start = time.monotonic()
        procs = start_ranks(2, """
import os, sys, json, torch, strata
strata.initialize(model=torch.nn.Linear(2, 2), config={
    'train_micro_batch_size_per_gpu': 1, 'optimizer': {'type': 'Adam'},
    'zero_optimization': {'stage': 2},
    'strata': {'comm_timeout_s': 60,
               'comm_transport': json.loads(sys.argv[1 + int(os.environ['RANK'])])}})
""", [json.dumps(v) for v in values])
        for p, said in zip(procs, says):
            _, err = p.communicate(timeout=60)
            assert p.returncode != 0 and said in err, err[-2000:]
        assert time.monotonic() - start < 30  # not at the 60 s timeout


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


# 24 weights of 144 elements, over stage3_param_persistence_threshold (100): partitions, whose
# shards on 2 ranks (72 elements) are under it; a device budget of 16 pages (each shard takes one).
SMALL_SHARDS = r"""
import json, os, sys, torch
import strata
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(12, 12, bias=False) for _ in range(24)])
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam"},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                "offload_param": {"device": "cpu"}},
          "strata": {"device": "emulated", "device_budget_bytes": 16 * 4096,
                     "host_budget_bytes": 16 << 20, "comm_timeout_s": 60}}
engine, _, _, _ = strata.initialize(model=model, config=config)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 12)).square().mean())
    engine.step()
print(json.dumps({"steps": engine.global_steps,
                  "shards": sorted({e.shard for e in engine.table.trained})}))
"""


def test_shards_under_the_persistence_threshold_leave_the_device_like_the_others():
    """A parameter over stage3_param_persistence_threshold is partitioned; across ranks its
    shard may be under it, and is evicted from the device as any partition is (the Runtime kept
    each such shard there for good, and a budget the one process trains in filled up)."""
    procs = start_ranks(2, SMALL_SHARDS)
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"steps": 2, "shards": [72]}


def test_a_collectives_host_buffer_given_back_is_taken_again_by_one_that_fits():
    """Collectives.take / give: a plain host buffer of KEPT_FROM elements or more, given back, is
    handed out again to a request of its dtype that it holds at most twice over; the largest are
    kept, KEPT of them at most and no more bytes than the limit given; let_go frees them."""
    from strata.ranks import Collectives
    c = Collectives("test")
    n = Collectives.KEPT_FROM
    unlimited = 1 << 40
    first = c.take(2 * n)
    address = first.data_ptr()
    c.give(first[:n].view(2, -1), unlimited)  # (a view: its whole buffer goes back)
    again = c.take(2 * n)
    assert again.data_ptr() == address and again.shape == (2 * n,)
    c.give(again, unlimited)
    assert c.take(2 * n, dtype=torch.bfloat16).data_ptr() != address  # another dtype
    assert c.take(n // 2).data_ptr() != address  # held more than twice over: a new one
    assert c.take(n).data_ptr() == address  # held exactly twice over
    for size in range(1, Collectives.KEPT + 3):
        c.give(c.empty(size * n), unlimited)
    assert sorted(b.numel() for b in c._kept) == [size * n for size in range(3, 7)]
    c.give(c.take(n - 1), unlimited)  # (small: the allocator's heap serves those)
    assert all(b.numel() >= n for b in c._kept)
    c.give(c.empty(n), 9 * n * 4)  # the smallest dropped until 9 n fp32 elements hold the rest
    assert [b.numel() for b in c._kept] == [6 * n]
    c.let_go()
    assert c._kept == []


# Each rank's own branch (DDP's find_unused_parameters case): `extra` is used by rank 0 at every
# step and by rank 1 at even steps only, so that rank 1's rows of the reduce-scatter's buffer
# (kept from one step to the next) must be zeros where it has no gradient. Stage 1, and stage 3's
# parameters under the persistence threshold (reduced at the step), against torch's DDP; with
# zero_grad(set_to_none=False), which no rank refuses (each steps `extra` with the mean), and an
# edit in place between steps made on every rank (each takes its shard's: strata/edits.py).
BRANCH = r"""
import json, os, sys, torch, torch.distributed as dist
import strata
strata.ranks.Collectives.KEPT_FROM = 0  # (every buffer kept for the next collective)
rank = int(os.environ["RANK"])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.extra = torch.nn.Linear(16, 16)

    def forward(self, x, use_extra):
        h = self.body(x)
        return h + self.extra(h) if use_extra else h


def batches():
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 16, generator=gen) for _ in range(4)]


def uses(step):
    return rank == 0 or step % 2 == 0


torch.manual_seed(0)
reference = Net()
dist.init_process_group("gloo")
ddp = torch.nn.parallel.DistributedDataParallel(Net(), find_unused_parameters=True)
ddp.module.load_state_dict(reference.state_dict())
adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
for step, x in enumerate(batches()):
    adamw.zero_grad()
    if step == 2:  # an edit in place between steps, on every rank
        torch.nn.init.constant_(ddp.module.body.bias, 0.1)
    ddp(x, uses(step)).pow(2).mean().backward()
    adamw.step()
out = {}
for stage in (1, 3):
    model = Net()
    model.load_state_dict(reference.state_dict())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
              "strata": {"device": "emulated"}}
    engine, _, _, _ = strata.initialize(model=model, config=config)
    for step, x in enumerate(batches()):
        # (zeros kept: each rank steps `extra` with the mean as DDP does, refused by none)
        engine.zero_grad(set_to_none=False)
        if step == 2:  # (taken by each rank into its shard of the master weights)
            torch.nn.init.constant_(engine.module.body.bias, 0.1)
        engine.backward(engine(x, uses(step)).pow(2).mean())
        engine.step()
    ours = engine.module_state_dict()
    out[stage] = max((ours[k] - v).abs().max().item()
                     for k, v in ddp.module.state_dict().items())
    collectives = engine.ranks.collectives
    assert collectives._kept  # (buffers kept for the next collectives, let go at close)
    engine.close()
    assert collectives._kept == []
print(json.dumps(out), flush=True)
sys.stdout.flush()
os._exit(0)
"""


def test_a_branch_one_rank_skips_trains_as_ddp_finding_unused_parameters():
    procs = start_ranks(2, BRANCH)
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        apart = json.loads(stdout.strip().splitlines()[-1])
        assert apart["1"] < 1e-6 and apart["3"] < 1e-6, apart


# Stage 3 on 2 ranks with an evaluation's forward (eval mode, no gradients) after every second
# window: the gathers prefetched ahead of each module during it are not part of the step's trace
# (they were: the next step was recorded with them at its head and every step after an
# evaluation left the plan, alternately; the audit's).
EVAL_BETWEEN = r"""
import json, os, sys, torch
import strata
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
          "strata": {"device": "emulated"}}
engine, _, _, _ = strata.initialize(model=model, config=config)
gen = torch.Generator().manual_seed(1)
for i in range(16):
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    if i % 4 == 3:
        engine.eval()
        with torch.no_grad():
            engine(x)
        engine.train()
left = [w for w in engine.warnings if "differs from the recorded trace" in w]
print(json.dumps({"left": left, "prefetched": engine.prefetched_gathers}), flush=True)
sys.stdout.flush()
os._exit(0)
"""


def test_an_evaluation_between_steps_leaves_the_plan_of_the_steps_alone():
    for p in start_ranks(2, EVAL_BETWEEN):
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out = json.loads(stdout.strip().splitlines()[-1])
        # (at most the known one: the second step, the first to prefetch gathers)
        assert len(out["left"]) <= 1, out["left"]
        assert out["prefetched"] > 0, out
