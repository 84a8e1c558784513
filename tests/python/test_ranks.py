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

from launch import start_ranks

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

model = Net()
initial = {k: v.clone() for k, v in model.state_dict().items()}
rank, world = int(__import__("os").environ.get("RANK", 0)), \
    int(__import__("os").environ.get("WORLD_SIZE", 1))
if rank > 0:  # rank 0's weights reach every rank: the others start elsewhere
    torch.manual_seed(1000 + rank)
    model = Net()
GLOBAL = 8
zero = {"stage": stage, "offload_optimizer": {"device": offload, "nvme_path": nvme},
        "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 3000,
        "allgather_bucket_size": 3000}
if stage == 3:
    zero["offload_param"] = {"device": offload, "nvme_path": nvme, "buffer_count": 2,
                             "buffer_size": 65536}
config = {"train_batch_size": GLOBAL * 2, "gradient_accumulation_steps": 2,
          "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "zero_optimization": zero,
          "strata": {"device": "emulated", "device_budget_bytes": 49152,
                     "host_budget_bytes": 64 << 20, "nvme_capacity_bytes": 64 << 20,
                     "comm_timeout_s": 60}}
if dtype == "bf16":
    config["bf16"] = {"enabled": True}
engine, _, _, _ = strata.initialize(model=model, config=config)
assert engine.micro_batch_size == GLOBAL // world
gen = torch.Generator().manual_seed(1)
per = GLOBAL // world
norms = []  # the global gradient norm of each step (Adam would hide a gradient's scale)
for step in range(steps):
    for micro in range(2):
        x = torch.randint(0, 50, (GLOBAL, 8), generator=gen)
        y = torch.roll(x, 1, 1)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = torch.nn.functional.cross_entropy(engine(x).float().reshape(-1, 50), y.reshape(-1))
        engine.backward(loss)
        engine.step()
    norms.append(engine.last_step_stats["optimizer"]["grad_norm"])
state = engine.module_state_dict()  # every rank takes part
if rank == 0:
    torch.save(dict({k: v.float() for k, v in state.items()}, initial=initial, norms=norms), out)
print(json.dumps({"rank": rank, "steps": engine.global_steps,
                  "nvme": sorted(__import__("os").listdir(nvme)) if offload == "nvme" else []}))
"""


def run_single(tmp_path, stage, offload, dtype, steps):
    out = tmp_path / "single.pt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    child = subprocess.run(
        [sys.executable, "-c", TRAIN, str(stage), offload, dtype, str(steps), str(out),
         str(tmp_path / "nvme1")], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return torch.load(out)


def run_job(tmp_path, n, stage, offload, dtype, steps):
    out = tmp_path / f"ranks{n}.pt"
    procs = start_ranks(n, TRAIN, (stage, offload, dtype, steps, out, tmp_path / f"nvme{n}r"))
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return torch.load(out), reports


@pytest.mark.parametrize("n, stage, offload, dtype", [
    (2, 1, "cpu", "fp32"),
    (2, 2, "cpu", "fp32"),
    (2, 3, "cpu", "fp32"),
    (4, 3, "nvme", "fp32"),
    (4, 2, "cpu", "bf16"),
    (2, 3, "cpu", "bf16"),
])
def test_ranks_train_as_one_process_with_the_same_global_batch(tmp_path, n, stage, offload, dtype):
    steps = 4
    single = run_single(tmp_path, stage, offload, dtype, steps)
    job, reports = run_job(tmp_path, n, stage, offload, dtype, steps)
    assert [r["steps"] for r in reports] == [steps] * n
    initial = single.pop("initial")
    job.pop("initial")
    # The gradients the ranks reduce are the mean over the global batch, as one process's: Adam
    # and clipping are blind to a gradient's scale, its norm is not.
    torch.testing.assert_close(torch.tensor(job.pop("norms")), torch.tensor(single.pop("norms")),
                               rtol=1e-4 if dtype == "fp32" else 2e-2, atol=0)
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
            # bf16: each rank's gradients are bf16 roundings over its slice of the batch, not the
            # whole batch's, and Adam's step turns a near-zero gradient's sign into a full step
            # of lr either way: the ranks' weights depart from one process's by less than a
            # tenth of what training moved them.
            moved = (value - initial[name]).norm()
            apart = (job[name] - value).norm()
            assert apart < 0.1 * moved, f"{name}: {apart:.3g} apart, training moved it {moved:.3g}"
    if offload == "nvme":
        # Each rank's NVMe state in its own subfolder of the configured nvme_path.
        assert reports[0]["nvme"] == [f"rank{r}" for r in range(n)]
