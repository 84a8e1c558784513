"""The engine across ranks (strata/ranks.py) trains as one process does: 2, 3 and 4 ranks as
processes on loopback, on Gloo, each stage giving the same weights after N steps as one process
with the same global batch. (test_ranks.py: the rest of the job's behaviour; test_ranks_failures.py:
its failures, named, never a hang. Files apart, so that each is a ctest test of about a minute.)"""
import json
import os
import subprocess
import sys

import pytest
import torch

from launch import start_ranks

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
