"""The engine across ranks (strata/ranks.py), when something is wrong: the job's failures (a
killed rank, a wrong world size, a missing variable), ranks whose set-ups or orders differ: each
named on every rank, never a hang; and the choice of where the collectives run.
(test_ranks_step_failures.py: a step that fails on one rank; test_ranks_train.py: the ranks
training as one process.)"""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from launch import free_port, start_ranks

SMALL = r"""
import os, signal, sys, time, torch
import strata
stage = int(sys.argv[1])
kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
alone = sys.argv[3] if len(sys.argv) > 3 else None  # rank 0 alone calls it after the steps
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
if alone is not None and os.environ["RANK"] == "0":  # as a save guarded by `if rank == 0`
    {"state_dict": lambda: engine.module.state_dict(),
     "save_checkpoint": lambda: engine.save_checkpoint(sys.argv[4]),
     "load_checkpoint": lambda: engine.load_checkpoint(sys.argv[4], "none")}[alone]()
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
    # Named: which collective failed, and that it was the other rank that went away (its process
    # ended: seen on the shared memory between them, the default on one host, within ~100 ms).
    last = err0.strip().splitlines()[-1]
    assert last.startswith("strata._strata.Error: rank 0 of 2: ") and any(
        f"{c} failed: rank 1 has died (its process ended)" in last
        for c in ("reduce-scatter", "all-gather", "all-reduce")), err0[-3000:]
    assert time.monotonic() - start < 60  # well inside the timeout: a dead peer is seen at once


@pytest.mark.parametrize("call, named", [
    ("state_dict", "module.state_dict() (save_pretrained's, save_model's), which gathers the "
                   "weights partitioned across the ranks: every rank must call it"),
    ("save_checkpoint", "engine.save_checkpoint(), of which each rank writes its shard "),
    ("load_checkpoint", "engine.load_checkpoint(), of which each rank reads its shard ")])
def test_a_collective_call_on_one_rank_alone_is_named_with_what_to_do(tmp_path, call, named):
    """module.state_dict() at stage 3 gathers the weights, a checkpoint holds each rank's shard:
    rank 0 making one of these calls alone (guarded by `if rank == 0`) ends with an error
    naming the call, not a collective the other rank never joined."""
    procs = start_ranks(2, SMALL, (3, -1, call, tmp_path))
    out0, err0 = procs[0].communicate(timeout=120)
    out1, _ = procs[1].communicate(timeout=60)
    assert procs[1].returncode == 0 and "done" in out1
    assert procs[0].returncode != 0 and "done" not in out0
    last = err0.strip().splitlines()[-1]
    assert last.startswith(f"strata._strata.Error: rank 0 of 2: about to issue {named}"), \
        err0[-3000:]


BUILT = r"""
import os, torch
import strata
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
          "strata": {"device": "emulated", "host_budget_bytes": 16 << 20, "comm_timeout_s": 20}}
with strata.init(config=config):
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4))
    model[int(os.environ["RANK"])].weight.norm()  # (a log line: each rank reads another weight)
print("done", flush=True)
"""


def test_ranks_that_read_different_weights_under_strata_init_are_named_with_what_to_do():
    procs = start_ranks(2, BUILT, ())
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "done" not in out
        last = err.strip().splitlines()[-1]
        assert "the all-gather of a (64, 16) parameter (partition" in last or \
            "the all-gather of a (4, 64) parameter (partition" in last, err[-3000:]
        assert "a model built under strata.init: every rank runs the same code on its " \
               "weights" in last, err[-3000:]


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
if sys.argv[1] == "train":  # rank 1 would step its shards with another rate and clipping
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu",
                                                        "nvme_path": f"/drive{rank}"}
    if rank == 1:
        config["optimizer"]["params"] = {"lr": 1e-4}
        config["gradient_clipping"] = 1.0
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
    # (each rank's own nvme_path is not a difference)
    ("train", "the ranks' set-ups differ (gradient_clipping: rank 0 0.0, rank 1 1.0; optimizer: "
              "rank 0 "),
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
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode != 0
            assert message in err, err[-2000:]
            if case.startswith("gpu"):  # each rank's reason, on every rank
                assert "rank 1: strata.device \"cuda\": LOCAL_RANK 1 names GPU 1" in err, \
                    err[-2000:]
            if case == "budget":
                assert "strata.host_budget_bytes" in err, err[-2000:]
    finally:  # (a rank left waiting, its peer failed, would outlive the test on its port)
        for p in procs:
            p.kill()
            p.wait()
    assert time.monotonic() - start < 50  # named at once, not at the timeout (60 s)


class _Job:
    rank, world_size, local_rank, transport = 1, 2, 1, "shared memory"


def test_a_long_reason_in_a_rank_s_set_up_is_cut_to_fit_not_garbled():
    from strata import ranks as ranks_module

    class Alone:  # a job of one rank: the exchange hands back this rank's own bytes
        rank, world_size, local_rank, transport = 0, 1, 0, "tcp"

        def all_gather(self, send, out, async_op=False):
            out.copy_(send)

    ranks = ranks_module.Ranks(Alone())
    with pytest.raises(ValueError, match="across ranks: rank 0: CUDA_VISIBLE_DEVICES GPU-0"):
        ranks_module.agree_on_setup(ranks, {"stage": "3", "error": "CUDA_VISIBLE_DEVICES " +
                                            ",".join(f"GPU-{i}" * 20 for i in range(50))})
    # Characters JSON escapes (6 bytes for one) still fit: the all-gather's sizes stay equal (a
    # review's finding: the buffer grew past its size).
    with pytest.raises(ValueError, match='across ranks: rank 0: é"é'):
        ranks_module.agree_on_setup(ranks, {"stage": "3", "error": 'é"' * 3000})


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
    # Rank 0 reads rank 1's too: named there as well, at once (not at comm_timeout_s, 20 s).
    _, err0 = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0
    assert time.monotonic() - start < 15
    assert "the job: this rank (0) was given world size 2 but rank 1 was given 3" in err0, \
        err0[-2000:]


def test_master_addr_and_port_without_rank_or_world_size_train_alone_and_say_so():
    """accelerate's launch of one process sets MASTER_ADDR and MASTER_PORT alone (some clusters
    export them to every process): torch trains alone there, and so does strata, saying once
    that a job of several processes needs RANK and WORLD_SIZE (it was refused: "WORLD_SIZE is not
    set")."""
    script = (
        "import warnings, torch, strata\n"
        "config = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW'},\n"
        "          'zero_optimization': {'stage': 2}, 'strata': {'device': 'emulated'}}\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(2):\n"
        "        engine, _, _, _ = strata.initialize(model=torch.nn.Linear(4, 4), config=config)\n"
        "        assert engine.ranks is None\n"
        "        engine.backward(engine(torch.ones(2, 4)).sum())\n"
        "        engine.step()\n"
        "        engine.close()\n"
        "told = [str(w.message) for w in seen if 'neither RANK nor WORLD_SIZE' in str(w.message)]\n"
        "assert len(told) == 1, told\n"
        "assert told[0].startswith('strata: MASTER_ADDR, MASTER_PORT set'), told\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]


def test_a_torch_group_without_rank_and_world_size_in_the_environment_is_refused():
    """torch's spawn recipe (init_process_group(rank=, world_size=) in each process, RANK and
    WORLD_SIZE never in the environment): strata cannot join that job from the environment, and
    training alone would differ from data parallel: refused by name on every rank."""
    script = (
        "import os, sys, torch, torch.distributed as dist, strata\n"
        "rank, world = int(os.environ.pop('RANK')), int(os.environ.pop('WORLD_SIZE'))\n"
        "os.environ.pop('LOCAL_RANK')\n"
        "dist.init_process_group('gloo', rank=rank, world_size=world)\n"
        "config = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW'},\n"
        "          'zero_optimization': {'stage': 2}, 'strata': {'device': 'emulated'}}\n"
        "try:\n"
        "    strata.initialize(model=torch.nn.Linear(4, 4), config=config)\n"
        "except ValueError as error:\n"
        "    print(error, flush=True)\n"
        "sys.stdout.flush()\n"
        # (rank 0 holds the group's store: gone before the other rank's init had finished, under
        # load, that rank failed in torch's init with 'Connection reset by peer')
        "dist.barrier()\n"
        "os._exit(0)\n")
    for p in start_ranks(2, script):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        assert "torch.distributed is initialized with 2 ranks" in stdout, stdout + stderr[-2000:]
        assert "RANK and WORLD_SIZE are not in the environment" in stdout, stdout


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


def test_a_gpu_beyond_those_visible_is_named_in_one_process_too(monkeypatch):
    import strata
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam"},
              "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
              "strata": {"device": "cuda", "device_index": 2, "host_budget_bytes": 1 << 26}}
    with pytest.raises(ValueError, match="strata.device_index 2 names GPU 2, but this process "
                                         "sees 0 GPUs"):
        strata.initialize(model=torch.nn.Linear(2, 2), config=config)
