"""The engine across ranks (strata/ranks.py): ranks as processes on loopback, on Gloo: the
collectives at exit, dtypes and epochs from rank 0, bad settings named, a failed backward, shards
under the persistence threshold, a branch one rank skips, an evaluation between steps.
(test_ranks_train.py: each stage trains as one process with the same global batch;
test_ranks_failures.py: the job's failures, named, never a hang.)"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from launch import assert_same, free_port, start_ranks


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


def reports_of(script, timeout=180):
    """Two ranks running `script`, each ending well: the JSON each printed last."""
    reports = []
    for p in start_ranks(2, script):
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-3000:]
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return reports


def test_every_dtype_comes_from_rank_0_two_engines_share_the_job_and_epochs_reshuffle():
    outs = reports_of(MISC)
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
    for report in reports_of(SMALL_SHARDS, timeout=120):
        assert report == {"steps": 2, "shards": [72]}


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
    for apart in reports_of(BRANCH):
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
    for out in reports_of(EVAL_BETWEEN):
        # (at most the known one: the second step, the first to prefetch gathers)
        assert len(out["left"]) <= 1, out["left"]
        assert out["prefetched"] > 0, out


# At stage 3 a parameter read outside its owner's forward that the first forwards did not meet is
# lent as it is read (TRL's fused LM head, first in a later pass: strata/lending.py's
# lend_external), by every rank at the same point; the model then lends it first, so the gathers'
# recorded order is recorded anew (it was kept, and every later forward gathered on demand).
LATE_EXTERNAL = r"""
import json, os, sys, torch
import strata
torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x, fused=False):
        h = torch.relu(self.l2(torch.relu(self.l1(x))))
        if fused:  # the head's weight read outside the head's forward
            return torch.nn.functional.linear(h, self.head.weight, self.head.bias)
        return self.head(h)

config = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "strata": {"device": "emulated", "comm_timeout_s": 60}}
engine, _, _, _ = strata.initialize(model=Net(), config=config)
gen = torch.Generator().manual_seed(1)
prefetched = []
for step in range(6):
    x = torch.randn(4, 16, generator=gen)
    engine.backward(engine(x, fused=step >= 2).square().mean())
    engine.step()
    prefetched.append(engine.prefetched_gathers)
print(json.dumps({"prefetched": prefetched}), flush=True)
sys.stdout.flush()
os._exit(0)
"""


def test_a_parameter_lent_where_a_later_forward_reads_it_keeps_the_ranks_prefetching():
    for report in reports_of(LATE_EXTERNAL):
        counts = report["prefetched"]
        # As many gathers started ahead a step as before the late use, but the head's (the
        # model's own from then on, its first); it was one a step, on demand for the rest.
        assert counts[5] - counts[4] >= counts[1] - counts[0] - 1 > 0, counts
