"""bench/ab_strata: two builds of strata's Python front side by side on one of
bench/vs_deepspeed.py's rows, with plain PyTorch's floor, interleaved round by round.

    .venv/bin/python bench/ab_strata.py --a OLD_PYTHONPATH --b build/release/python \
        [--row zero3_cpu|zero2_cpu_2ranks|...] [--rounds 5] [--steps 4] [--phases 2] [--json out.json]

Where a change of the front (the engine's hooks, its parts) costs or saves time, the same row is
run by each front in a process of its own (vs_deepspeed.py's child: the same model, seed,
batches and config), the two fronts and the floor alternating in order each round, so that the
machine's weather falls on all three alike. A front is a folder that holds the `strata` package
(with its _strata extension): the build's build/release/python, or a copy of an older one.

Each report line gives the median step of each front (over every timed step of every round),
the ratios b / a and each front's rate against the floor's, and with --phases the forward,
backward and step-after-backward medians of each. The losses of the two fronts must be the same
(a refactoring changes no arithmetic); the run says so, or names the first difference.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vs_deepspeed  # noqa: E402


def run(front, system, config, args, index, scratch):
    """One child of vs_deepspeed.py with `front` first on its path; its report."""
    out = os.path.join(scratch, f"{system}_{index}_{len(os.listdir(scratch))}.json")
    nvme = os.path.join(scratch, "nvme")  # (the NVMe row's swap folder, emptied for each run)
    shutil.rmtree(nvme, ignore_errors=True)
    os.makedirs(nvme)
    config = json.loads(json.dumps(config).replace("@NVME@", nvme))
    spec = {"system": system, "config": config, "layers": args.layers, "width": args.width,
            "heads": args.heads, "context": args.context, "batch": args.batch,
            "device": "cpu", "warmup": 2, "steps": args.steps, "out": out,
            "phases": args.phases, "profile": False, "port": 29500 + index, "row": args.row,
            "clipping": args.clipping, "bf16": False,
            "world": vs_deepspeed.ranks_of(args.row) if system != "torch" else 1}
    with open(out + ".spec", "w", encoding="utf-8") as f:
        json.dump(spec, f)
    if spec["world"] > 1:  # (a job of ranks, as vs_deepspeed runs it: the front on its path)
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.path.abspath(front)
        try:
            report = vs_deepspeed.run_ranks(out + ".spec", out, spec["world"],
                                            args.child_timeout)
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        if "error" in report:
            sys.exit(f"ab_strata: {system} ({front}) failed: {report['error']}")
        return report
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.path.abspath(front))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vs_deepspeed.py"), "--child",
                           out + ".spec"], capture_output=True, text=True, env=env,
                          timeout=args.child_timeout)
    if proc.returncode != 0:
        sys.exit(f"ab_strata: {system} ({front}) failed:\n{proc.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def phase_medians(reports):
    found = [r["phases"] for r in reports if r.get("phases")]
    if not found:
        return None
    return {k: statistics.median(x for p in found for x in p[k]) for k in found[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, help="front A: a folder holding strata/")
    parser.add_argument("--b", required=True, help="front B: a folder holding strata/")
    parser.add_argument("--row", default="zero3_cpu",
                        help="one of vs_deepspeed.py's rows: zero2_cpu, zero3_cpu, zero3_nvme, "
                        "zero2_cpu_2ranks, zero3_cpu_2ranks (a job of 2 ranks; the floor one "
                        "process)")
    parser.add_argument("--dir", default=None,
                        help="scratch folder (the NVMe row's drive; default: the system's temp)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after 2)")
    parser.add_argument("--phases", type=int, default=0,
                        help="steps split into forward, backward and step after the timed ones")
    vs_deepspeed.add_model_arguments(parser)
    parser.add_argument("--clipping", type=float, default=1.0)
    parser.add_argument("--child-timeout", type=int, default=1800)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    rows = ("zero2_cpu", "zero3_cpu", "zero3_nvme", "zero2_cpu_2ranks", "zero3_cpu_2ranks")
    if args.row not in rows:
        sys.exit(f"ab_strata: --row {args.row}: accepted: {', '.join(rows)}")
    for front in (args.a, args.b):
        if not os.path.isdir(os.path.join(front, "strata")):
            sys.exit(f"ab_strata: {front} holds no strata package; accepted: a folder with "
                     "strata/ (build/release/python, or a copy of an older build's)")
    args.model_params, args.model_largest = vs_deepspeed.model_shape(args)
    # (what vs_deepspeed.row_config reads beside: its defaults, on the CPU, in fp32)
    args.aio, args.strata_extra = dict(vs_deepspeed.DEFAULT_AIO), None
    args.bf16, args.device, args.nvme_buffer_elements = False, "cpu", 1 << 24
    config = vs_deepspeed.row_config(args.row, args, "@NVME@")[1]
    floor_config = vs_deepspeed.row_config("zero2_cpu", args, "@NVME@")[0]
    scratch = tempfile.mkdtemp(prefix="ab_strata.", dir=args.dir)
    runs = {"a": [], "b": [], "floor": []}
    try:
        for index in range(args.rounds):
            # (the floor's child reads the CPU's ceilings through front b's extension)
            order = [("a", args.a), ("b", args.b), ("floor", args.b)]
            order = order[index % 3:] + order[:index % 3]
            for name, front in order:
                system = "torch" if name == "floor" else "strata"
                report = run(front, system, floor_config if name == "floor" else config, args,
                             index, scratch)
                runs[name].append(report)
                print(f"round {index + 1} {name}: median step "
                      f"{statistics.median(report['step_s']):.3f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    step = {k: statistics.median(t for r in v for t in r["step_s"]) for k, v in runs.items()}
    same = all(ra["losses"] == rb["losses"] for ra, rb in zip(runs["a"], runs["b"]))
    result = {
        "row": args.row, "rounds": args.rounds, "steps": args.steps,
        "step_s": step, "b_over_a": step["b"] / step["a"],
        "rate_vs_floor": {k: step["floor"] / step[k] for k in ("a", "b")},
        "round_ratios_b_over_a": [
            statistics.median(rb["step_s"]) / statistics.median(ra["step_s"])
            for ra, rb in zip(runs["a"], runs["b"])],
        "phases": {k: phase_medians(v) for k, v in runs.items()},
        "losses_same": same,
    }
    print(f"{args.row}: a {step['a']:.3f} s, b {step['b']:.3f} s "
          f"(b / a {result['b_over_a']:.3f}), floor {step['floor']:.3f} s; rate against the "
          f"floor's: a {result['rate_vs_floor']['a']:.2f}, b {result['rate_vs_floor']['b']:.2f}; "
          f"losses of a and b {'the same' if same else 'DIFFER'}")
    if result["phases"]["a"]:
        for k in ("a", "b", "floor"):
            p = result["phases"][k]
            print(f"  {k}: " + ", ".join(f"{n} {v:.3f} s" for n, v in p.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
