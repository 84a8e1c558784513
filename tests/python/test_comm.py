"""strata._strata.Job: joining a launched job from its environment (torchrun's variables) and the
collectives over CPU tensors, with ranks as processes on loopback, beside a torch.distributed
process group on the same MASTER_PORT (comm/job.h)."""
import json
import os
import subprocess
import sys

import pytest

from launch import free_port, start_ranks

RANK = r"""
import json, sys, torch
import torch.distributed as dist
from strata import _strata
if {with_torch}:
    # The trainer's own process group first, on MASTER_PORT: strata's store must not collide.
    dist.init_process_group("gloo")
job = _strata.Job(timeout_ms=30000)
r, n = job.rank, job.world_size
out = {{"rank": r, "world_size": n, "local_rank": job.local_rank, "launched": job.launched}}
x = torch.full((1000,), float(r + 1))
job.all_reduce(x)
out["all_reduce"] = x[0].item()
mine = torch.arange(6, dtype=torch.bfloat16) + 10 * r
everyone = torch.empty(6 * n, dtype=torch.bfloat16)
job.all_gather(mine, everyone)
out["all_gather"] = everyone.float().tolist()
shards = torch.arange(4 * n, dtype=torch.float32) + r
own = torch.empty(4)
job.reduce_scatter(shards, own)
out["reduce_scatter"] = own.tolist()
b = torch.full((3,), float(r))
job.broadcast(b, n - 1)
out["broadcast"] = b.tolist()
job.barrier()
try:
    job.all_reduce(torch.zeros(3, dtype=torch.bfloat16))
except _strata.InvalidArgumentError as e:
    out["refused"] = str(e)
if {with_torch}:
    t = torch.ones(2)
    dist.all_reduce(t)  # torch's group still works beside strata's
    out["torch"] = t.tolist()
    # As torch asks of its users: a Gloo group left to the interpreter's exit can abort the
    # process there ("terminate called without an active exception"; seen under load).
    dist.destroy_process_group()
print(json.dumps(out))
"""


def run_ranks(n, with_torch, extra_env=None):
    procs = start_ranks(n, RANK.format(with_torch=with_torch), extra_env=extra_env)
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("n, with_torch", [(2, False), (3, True)])
def test_ranks_meet_and_every_collective_agrees(n, with_torch):
    for out in run_ranks(n, with_torch):
        r = out["rank"]
        assert (out["world_size"], out["local_rank"], out["launched"]) == (n, r, True)
        assert out["all_reduce"] == n * (n + 1) / 2
        assert out["all_gather"] == [10 * q + i for q in range(n) for i in range(6)]
        # shard r of rank p is (4r .. 4r+3) + p: summed over p
        assert out["reduce_scatter"] == [n * (4 * r + i) + n * (n - 1) / 2 for i in range(4)]
        assert out["broadcast"] == [float(n - 1)] * 3
        assert "all_reduce: accepted: float32" in out["refused"]
        if with_torch:
            assert out["torch"] == [float(n)] * 2


def test_a_missing_variable_is_named():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", RANK="0")
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    child = subprocess.run([sys.executable, "-c", "from strata import _strata; _strata.Job(1000)"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode != 0
    assert "WORLD_SIZE is not set" in child.stderr, child.stderr[-2000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_ends_the_joining_of_a_rank_whose_peers_never_come(rank):
    """Rank 0 waits in its store for the others, rank 1 retries its way to rank 0's: a Ctrl-C
    ends either at once with KeyboardInterrupt (it waited for the whole timeout, 60 s here)."""
    import signal
    import time
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK=str(rank),
               WORLD_SIZE="2", LOCAL_RANK=str(rank))
    child = subprocess.Popen([sys.executable, "-c", "from strata import _strata\n"
                              "print('joining', flush=True)\n_strata.Job(timeout_ms=60000)"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "joining"
        time.sleep(1.0)
        start = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=90)
        assert time.monotonic() - start < 10, err[-2000:]
        assert err.strip().splitlines()[-1] == "KeyboardInterrupt", err[-2000:]
    finally:
        child.kill()
        child.communicate()


WAITS = r"""
import os, sys, time, torch
from strata import _strata
job = _strata.Job(timeout_ms=60000, transport=sys.argv[1])
if job.rank == 1:
    time.sleep(3)  # not there when rank 0 waits; then finds it gone
    start = time.monotonic()
    try:
        job.all_reduce(torch.ones(4))
    except _strata.Error as error:
        print(f"rank 1 failed after {time.monotonic() - start:.2f} s: {error}", flush=True)
    sys.exit(0)
print("waiting", flush=True)
start = time.monotonic()
x = torch.ones(1 << 20)
# A reduce-scatter on the side communicator in flight too, never waited for (as the engine's
# gradients' bucket at a Ctrl-C): dropped at exit, it must not hold the process either.
side = job.reduce_scatter(torch.ones(1 << 20), torch.ones(1 << 19), async_op=True, side=True)
work = job.all_reduce(x, async_op=True)
try:
    work.wait()
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.2f} s", flush=True)
print(f"done: {work.done()}", flush=True)  # asked again: an answer, not a crash
start = time.monotonic()
try:
    job.all_reduce(torch.ones(4))  # refused at once, not queued behind the interrupted one
except _strata.Error as error:
    print(f"then refused after {time.monotonic() - start:.2f} s: {error}", flush=True)
# and the process ends as usual (the interrupted collective does not hold up its exit)
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ctrl_c_interrupts_a_rank_waiting_in_a_collective_and_the_job_ends_at_once(transport):
    import signal
    import time
    procs = start_ranks(2, WAITS, (transport,))
    try:
        line = procs[0].stdout.readline()
        assert line.strip() == "waiting", line + procs[0].stderr.read()
        time.sleep(1.0)
        start = time.monotonic()
        procs[0].send_signal(signal.SIGINT)
        out0, err0 = procs[0].communicate(timeout=30)
        out1, err1 = procs[1].communicate(timeout=30)
        assert time.monotonic() - start < 15, (out0, out1)  # not the 60 s timeout
        lines = out0.strip().splitlines()
        assert lines[0].startswith("interrupted after ") and float(lines[0].split()[2]) < 3, out0
        # An answer, not a crash: on Gloo the interrupted collective is still blocked (it waits
        # for a peer until the timeout); on shared memory the abort ends it too, at once or a
        # moment later (either answer).
        assert lines[1] in (("done: False",) if transport == "tcp" else
                            ("done: False", "done: True")), out0
        assert lines[2].startswith("then refused after ") and float(lines[2].split()[3]) < 1 \
            and "the communicator was aborted (a wait for a collective was interrupted)" in \
            lines[2], out0
        assert procs[0].returncode == 0, err0[-2000:]
        assert out1.startswith("rank 1 failed after ") and float(out1.split()[4]) < 5, out1
    finally:
        for p in procs:
            p.kill()
            p.communicate()
