"""bench/plan_vs_ranks: strata_plan's prediction of the step across ranks beside the step
bench/train_ranks.py measures, on this machine (BENCH.md).

    PYTHONPATH=build/release/python .venv/bin/python bench/plan_vs_ranks.py [--json out.json] \
        [--plan build/release/tools/strata_plan/strata_plan] [--rounds 3] [--steps 6] \
        [--batch 8] [--ranks 2] [--stage 3] [--overlap-comm on|off] [--transport auto|shm|tcp]

The job is train_ranks.py's: the demo GPT (examples/gpt.py: 6 layers, width 256, context 128),
ZeRO stage 3 with the optimizer in host memory, the emulated device tier, --ranks processes on
this machine over strata's own collectives (--transport: shared memory by default, the ranks
being on one host; tcp: Gloo on loopback), each computing with one BLAS thread. The machine description
the planner is given is this machine's, made in the same run:
  - host memory, cores, the CPU Adam and the copy link: strata_plan --calibrate (once);
  - the "GPU": each rank computes on the CPU, so its rate is the demo GPT's forward and backward
    in plain torch (no strata) on the rank's share of the batch, timed by each rank of the job
    itself just before each of the engine's steps (train_ranks.run_beside: the same moment,
    the same load, the other ranks computing beside it), expressed in the planner's FLOPs (3
    forwards, the header of planner/plan_model.h; strata_plan's JSON gives them) at efficiency 1
    (as bench/bigger_than_ram.py gives the planner the CPU's matmul rate);
  - the link between the ranks ("gpu_link", kind "loopback": the collectives run on the cores
    the ranks compute on): the job's own collectives, timed by its ranks just before each of the
    engine's steps too: a collective's latency (the best 16-byte all-gather of several one after
    another), what a rendezvous costs beyond it when the ranks reach it from computing (the mean
    of the same all-gather after a module's matmul with a gather beside it, as the step's
    collectives are reached: the ranks' skew and wake-ups on this VM; "sync_us"), and the bus
    bandwidth of an all-gather and a reduce-scatter of a bucket (the best of three).
Each round runs the job on one process and on --ranks, each timing its compute (and link) beside
its steps; then plans the job on the round's description. Prints predicted beside measured and
their ratio (measured / predicted), per round and the median; the one-process step is planned too (the
precedent: the planner's single-process predictions beside measured steps in
docs/performance.md), with the whole batch on its one "GPU".
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_ranks  # noqa: E402

# The demo GPT as the planner reads it: GPT-2's family (fused q, k and v; biases; LayerNorm; tied
# embeddings; learned positions), the shape train_ranks.py trains.
MODEL = {"model_type": "gpt2", "n_layer": 6, "n_embd": 256, "n_head": 8, "n_inner": None,
         "vocab_size": 256, "n_positions": 128}
CONTEXT = 128

def link_of(measured, ranks, bucket):
    """The link between the ranks from what train_ranks.run_beside timed: a collective's
    latency (the best 16-byte all-gather of several one after another: the link's own, both ranks
    running), a rendezvous's cost beyond it (the mean of the same reached from a module's compute
    with a gather beside it: sync_us, what the step's collectives pay on this machine), and the bus
    bandwidth (NCCL's convention: (n - 1) / n of the whole buffer per rank, over the time beyond
    the latency) of an all-gather and a reduce-scatter of a bucket's fp32 elements (the best of
    three each); one bus for both, the harmonic mean (the rate that moves equal bytes of each, as
    a stage-3 step does)."""
    latency, met, gather_s, scatter_s = measured
    if min(gather_s, scatter_s) <= latency:
        return None  # a bucket no slower than 16 bytes: the machine's weather, not the link
    wire = (ranks - 1) / ranks * 4 * (bucket // ranks * ranks)
    gather_bus = wire / (gather_s - latency)
    scatter_bus = wire / (scatter_s - latency)
    return {"latency_s": latency, "sync_s": max(0.0, met - latency),
            "gather_bus_bps": gather_bus, "scatter_bus_bps": scatter_bus,
            "bus_bps": 2 / (1 / gather_bus + 1 / scatter_bus)}


def ds_config(args, ranks):
    """train_ranks.py's config, as one rank takes it (its micro-batch)."""
    return {"train_micro_batch_size_per_gpu": args.batch // ranks,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": args.stage, "offload_optimizer": {"device": "cpu"},
                                  "stage3_param_persistence_threshold": 10000,
                                  "overlap_comm": args.overlap_comm == "on",
                                  "reduce_bucket_size": args.bucket,
                                  "allgather_bucket_size": args.bucket},
            "strata": {"device": "emulated", "host_budget_bytes": 1 << 30,
                       "nvme_capacity_bytes": 1 << 30}}


def calibrate(args, folder):
    """This machine's host, CPU Adam and copy link (strata_plan --calibrate); the GPU's figures are
    each round's."""
    path = os.path.join(folder, "calibrated.json")
    run = subprocess.run([args.plan, "--calibrate", "--gpu-tflops", "1", "--gpu-hbm-gib", "4",
                          "--save-hardware", path], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"plan_vs_ranks: strata_plan --calibrate exited {run.returncode}: "
                 f"{run.stderr[-2000:]}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def predict(args, folder, calibrated, ranks, compute_s, measured_link):
    """strata_plan's step for the job on `ranks` processes, on this round's description: the
    'GPU' rated so that the planner's own FLOPs of a rank's step take `compute_s`."""
    hw = json.loads(json.dumps(calibrated))
    hw["gpu"].update(count=ranks, tflops=1.0, efficiency=1.0)
    flops = plan(args, folder, hw, ranks)["model_flops_per_gpu"]  # (whatever the rates)
    tflops = flops / compute_s / 1e12
    hw["gpu"]["tflops"] = tflops
    hw["source"] += (f"; the 'GPU' is {ranks} process(es) of this CPU, the demo GPT's forward and "
                     f"backward in plain torch timed in the same round: {tflops:.4f} TFLOPS")
    if ranks > 1:
        hw["gpu_link"] = {"kind": "loopback", "bus_gbps": measured_link["bus_bps"] / 1e9,
                          "latency_us": measured_link["latency_s"] * 1e6,
                          "sync_us": measured_link["sync_s"] * 1e6}
        hw["source"] += (f"; the link: strata's collectives (transport {args.transport}) between "
                         "the ranks, timed in the same round")
    step = plan(args, folder, hw, ranks)
    step["tflops_given"] = tflops
    return step


def plan(args, folder, hw, ranks):
    """strata_plan's step (its JSON's, with its printed text) for the job on `ranks` processes
    on the description `hw`."""
    paths = {name: os.path.join(folder, f"{name}{ranks}.json")
             for name in ("hardware", "model", "config", "plan")}
    if os.path.exists(paths["plan"]):
        os.remove(paths["plan"])
    for name, value in (("hardware", hw), ("model", MODEL), ("config", ds_config(args, ranks))):
        with open(paths[name], "w", encoding="utf-8") as f:
            json.dump(value, f)
    run = subprocess.run([args.plan, "--model", paths["model"], "--hardware", paths["hardware"],
                          "--config", paths["config"], "--sequence", str(CONTEXT),
                          "--nocheckpointing", "--json", paths["plan"]],
                         capture_output=True, text=True)
    if not os.path.exists(paths["plan"]):
        sys.exit(f"plan_vs_ranks: strata_plan exited {run.returncode}: {run.stderr[-2000:]}")
    with open(paths["plan"], encoding="utf-8") as f:
        step = json.load(f).get("step")
    if step is None:
        sys.exit(f"plan_vs_ranks: strata_plan predicted no step: {run.stdout[-2000:]}")
    step["text"] = run.stdout
    return step


def load():
    with open("/proc/loadavg", encoding="utf-8") as f:
        return float(f.read().split()[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default=os.path.join(HERE, "..", "build", "release", "tools",
                                                       "strata_plan", "strata_plan"))
    parser.add_argument("--show-plan", action="store_true", help="print strata_plan's output")
    args = train_ranks.job_arguments(parser, "plan_vs_ranks")
    folder = tempfile.mkdtemp(prefix="plan_vs_ranks.")
    calibrated = calibrate(args, folder)
    rows = []
    for round_index in range(args.rounds):
        row = {"load_before": load()}
        row["measured_1_s"], row["compute_1_s"], _ = train_ranks.run_beside(1, args)
        row["measured_n_s"], row["compute_n_s"], measured = train_ranks.run_beside(args.ranks,
                                                                                   args)
        row["link"] = link_of(measured, args.ranks, args.bucket)
        row["load_after"] = load()
        if row["link"] is None:
            print(f"round {round_index}: void: the link's bucket took no longer than its 16 bytes "
                  f"({measured}); load {row['load_before']:.1f} -> {row['load_after']:.1f}",
                  flush=True)
            continue
        one = predict(args, folder, calibrated, 1, row["compute_1_s"], None)
        many = predict(args, folder, calibrated, args.ranks, row["compute_n_s"], row["link"])
        if args.show_plan:
            print(many["text"])
        row["predicted_1_s"], row["predicted_n_s"] = one["seconds"], many["seconds"]
        row["collectives"] = many.get("collectives")
        row["ratio_1"] = row["measured_1_s"] / row["predicted_1_s"]
        row["ratio_n"] = row["measured_n_s"] / row["predicted_n_s"]
        rows.append(row)
        c = row["collectives"]
        print(f"round {round_index} (load {row['load_before']:.1f} -> {row['load_after']:.1f}): "
              f"{args.ranks} ranks predicted {row['predicted_n_s'] * 1e3:.0f} ms (compute "
              f"{row['compute_n_s'] * 1e3:.0f}, the collectives on the link "
              f"{c['seconds'] * 1e3:.0f}, the ranks agreeing at the step "
              f"{c['agree_seconds'] * 1e3:.0f}), "
              f"measured {row['measured_n_s'] * 1e3:.0f} ms ({row['ratio_n']:.2f}x); 1 rank "
              f"predicted {row['predicted_1_s'] * 1e3:.0f} ms (compute "
              f"{row['compute_1_s'] * 1e3:.0f}), measured {row['measured_1_s'] * 1e3:.0f} ms "
              f"({row['ratio_1']:.2f}x); the link {row['link']['latency_s'] * 1e6:.0f} us "
              f"(+{row['link']['sync_s'] * 1e6:.0f} us a rendezvous), "
              f"{row['link']['bus_bps'] / 1e9:.2f} GB/s bus; the collectives "
              f"{c['bytes_per_rank'] / 1e6:.1f} MB a rank, {c['all_gathers']} all-gathers and "
              f"{c['reduce_scatters']} reduce-scatters", flush=True)
    if not rows:
        sys.exit("plan_vs_ranks: every round void")
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("predicted_n_s", "measured_n_s", "ratio_n", "predicted_1_s", "measured_1_s",
                     "ratio_1")}
    ratios = [r["ratio_n"] for r in rows]
    print(f"plan_vs_ranks/step_{args.ranks}_ranks: measured {med['measured_n_s'] * 1e3:.1f} ms = "
          f"{med['ratio_n']:.2f}x of strata_plan's {med['predicted_n_s'] * 1e3:.1f} ms (rounds "
          f"{min(ratios):.2f}-{max(ratios):.2f}; target within 15%: "
          f"{'met' if abs(med['ratio_n'] - 1) <= 0.15 else 'not met'}); ZeRO stage {args.stage}, "
          f"global batch {args.batch}, transport {args.transport}, {os.cpu_count()} cores")
    print(f"plan_vs_ranks/step_1_rank: measured {med['measured_1_s'] * 1e3:.1f} ms = "
          f"{med['ratio_1']:.2f}x of strata_plan's {med['predicted_1_s'] * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            figures = [{"name": f"step_{n}", "value": med[f"measured_{k}_s"] * 1e3, "unit": "ms",
                        "ceiling": med[f"predicted_{k}_s"] * 1e3,
                        "ceiling_source": "strata_plan's prediction on this machine's description "
                                          "made in the same run", "ratio": med[f"ratio_{k}"],
                        "better": "lower", "config": {"ranks": int(n.split("_")[0])}}
                       for n, k in ((f"{args.ranks}_ranks", "n"), ("1_rank", "1"))]
            json.dump({"bench": "plan_vs_ranks", "figures": figures,
                       "machine": {"node": platform.node(), "cpu": platform.processor(),
                                   "cores": os.cpu_count()},
                       "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                       "calibrated": calibrated, "rounds": rows, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
