"""bench/train_ranks: the demo model's training step on 2 ranks beside 1 rank, the same global
batch, ZeRO stage 3 across ranks on strata's own collectives (shared memory between ranks on one
host, or Gloo over loopback with --transport tcp: strata/ranks.py) (BENCH.md).

    PYTHONPATH=build/release/python .venv/bin/python bench/train_ranks.py [--json out.json] \
        [--rounds 3] [--steps 6] [--batch 8] [--ranks 2] [--stage 3]

Each round runs the demo GPT (examples/gpt.py) for --steps steps after two warm-ups, first as one
process taking the global batch, then as --ranks processes on this machine each taking its slice,
and reports each one's median step. The ceiling is perfect scaling: the one-process step divided
by the ranks (each rank computing and stepping its share, the collectives free). Every process
computes with one BLAS thread (the model's compute on a GPU leaves the host's cores to strata), so
--ranks beyond the machine's cores is not scaling but sharing. The optimizer's state is in host
memory (offload_optimizer "cpu"), the device tier the emulated one: no disk in the step.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from launch import free_port  # noqa: E402

RANK = r"""
import json, os, sys, time, statistics
import torch
sys.path.insert(0, {examples!r})
import strata
from gpt import GPT, loss_of
steps, batch, stage, overlap, bucket = {steps}, {batch}, {stage}, {overlap}, {bucket}
transport = {transport!r}
beside = {beside}
world = int(os.environ.get("WORLD_SIZE", 1))
rank = int(os.environ.get("RANK", 0))
torch.manual_seed(0)
model = GPT(6, 256, 8, 128)
plain = GPT(6, 256, 8, 128) if beside else None  # plain torch's, on the same batch
config = {{"train_batch_size": batch,
          "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
          "zero_optimization": {{"stage": stage, "offload_optimizer": {{"device": "cpu"}},
                                "stage3_param_persistence_threshold": 10000,
                                "overlap_comm": overlap, "reduce_bucket_size": bucket,
                                "allgather_bucket_size": bucket}},
          "strata": {{"device": "emulated", "host_budget_bytes": 1 << 30,
                     "nvme_capacity_bytes": 1 << 30, "comm_transport": transport}}}}
engine, _, _, _ = strata.initialize(model=model, config=config)
gen = torch.Generator().manual_seed(1)
x = torch.randint(0, 256, (batch, 128), generator=gen)
y = torch.roll(x, -1, 1)
per = batch // world
x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
job = engine.ranks.job if beside and engine.ranks is not None else None
if job is not None:  # the link between the ranks: a 16-byte all-gather, and a bucket's
    tiny, tiny_all = torch.zeros(4), torch.zeros(4 * world)
    shard, whole = torch.zeros(bucket // world), torch.zeros(bucket // world * world)
    part = torch.zeros(bucket // world)
    # A module's compute and its weights' gather beside it, as the step reaches its collectives:
    # the MLP's first matrix on this rank's tokens, the gather of a shard of it.
    tokens, fc = torch.randn(per * 128, 256), torch.randn(256, 1024)
    fc_shard, fc_whole = torch.zeros(256 * 1024 // world), torch.zeros(256 * 1024)


def rendezvous():  # a 16-byte all-gather reached from a module's compute, a gather beside it
    work = job.all_gather(fc_shard, fc_whole, async_op=True)
    tokens @ fc
    work.wait()
    return timed(lambda: job.all_gather(tiny, tiny_all))


def timed(f):
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


times, computes, link = [], [], []
for i in range(steps + 2):
    if beside:  # plain torch's forward and backward, and the link, just before the engine's step
        compute = timed(lambda: (loss_of(plain(x), y).backward(),
                                 plain.zero_grad(set_to_none=True)))
        if job is not None:
            # The link's own (the best of several one after another: the ranks both running)
            # and a rendezvous's in the step's pattern (the mean: what the step pays).
            latency = min(timed(lambda: job.all_gather(tiny, tiny_all)) for _ in range(9))
            met = statistics.mean(rendezvous() for _ in range(16))
            link.append((latency, met,
                         min(timed(lambda: job.all_gather(shard, whole)) for _ in range(3)),
                         min(timed(lambda: job.reduce_scatter(whole, part, side=True))
                             for _ in range(3))))
        if i >= 2:
            computes.append(compute)
    start = time.perf_counter()
    engine.backward(loss_of(engine(x), y))
    engine.step()
    if i >= 2:
        times.append(time.perf_counter() - start)
print(json.dumps({{"rank": rank, "step_s": statistics.median(times),
                  "compute_s": statistics.median(computes) if beside else None,
                  "link": [statistics.median(c) for c in zip(*link[2:])] or None}}))
"""


def run(ranks, args):
    """The job's step on `ranks` processes: its slowest rank's median, seconds."""
    return _run(ranks, args, beside=False)[0]


def run_beside(ranks, args):
    """The job's step on `ranks` processes, and each rank also times, just before each of the engine's steps, plain torch's forward and backward of the
    same model on its share of the batch, and (across ranks) on the job's collectives a 16-byte
    all-gather (the best of 9 one after another), the same reached from a module's compute with
    a gather beside it (the mean of 16: a rendezvous as the step's collectives are reached), an
    all-gather of a bucket (--bucket elements of fp32, whole) and a reduce-scatter of one (the
    best of 3 each);
    returned: (step, that compute, (those four, seconds) or None), each the slowest rank's median
    (bench/plan_vs_ranks.py: the ranks' "GPU" and link under the load the step ran under)."""
    return _run(ranks, args, beside=True)


def _run(ranks, args, beside):
    """(step, compute, link) as run_beside says; without `beside`, compute 0 and link None."""
    script = RANK.format(examples=os.path.join(HERE, "..", "examples"), steps=args.steps,
                         batch=args.batch, stage=args.stage, overlap=args.overlap_comm == "on",
                         bucket=args.bucket, beside=beside, transport=args.transport)
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(base)
        if ranks > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                       WORLD_SIZE=str(ranks), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    step = compute = 0.0
    link = None
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            sys.exit(f"train_ranks: a rank failed: {err[-2000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        step = max(step, result["step_s"])  # the job's step is its slowest rank's
        compute = max(compute, result["compute_s"] or 0.0)
        if result["link"]:
            link = [max(a, b) for a, b in zip(link or result["link"], result["link"])]
    return step, compute, link


def job_arguments(parser, name):
    """The job's flags (and --json, --rounds) on `parser`; parse_args checked for `name`'s
    messages (bench/plan_vs_ranks.py runs the same job)."""
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="the global batch")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--overlap-comm", choices=("on", "off"), default="on",
                        help="zero_optimization.overlap_comm (DeepSpeed's default at stage 3: on)")
    parser.add_argument("--bucket", type=int, default=1 << 20,
                        help="reduce_bucket_size and allgather_bucket_size, elements")
    parser.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto",
                        help="strata.comm_transport (auto: shared memory, the ranks being on "
                             "this host)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.ranks < 2 or args.batch % args.ranks:
        sys.exit(f"{name}: --rounds and --steps at least 1, --ranks at least 2, and --batch "
                 "a multiple of --ranks")
    return args


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = job_arguments(parser, "train_ranks")
    rows = []
    for round_index in range(args.rounds):
        one = run(1, args)
        many = run(args.ranks, args)
        ceiling = one / args.ranks
        rows.append({"one_rank_s": one, "ranks_s": many, "ceiling_s": ceiling,
                     "of_ceiling": ceiling / many})
        print(f"round {round_index}: 1 rank {one * 1e3:.0f} ms a step; {args.ranks} ranks "
              f"{many * 1e3:.0f} ms ({one / many:.2f}x); perfect scaling {ceiling * 1e3:.0f} ms: "
              f"{ceiling / many:.2f} of it", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"train_ranks/step_{args.ranks}_ranks: {med['ranks_s'] * 1e3:.1f} ms = "
          f"{med['of_ceiling']:.2f} of perfect scaling ({med['ceiling_s'] * 1e3:.1f} ms: 1 rank's "
          f"{med['one_rank_s'] * 1e3:.1f} ms / {args.ranks}); ZeRO stage {args.stage}, global "
          f"batch {args.batch}, overlap_comm {args.overlap_comm}, buckets of {args.bucket} "
          f"elements, transport {args.transport}, {os.cpu_count()} cores (higher is better)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bench": "train_ranks", "machine": platform.node(),
                       "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rounds": rows,
                       "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
