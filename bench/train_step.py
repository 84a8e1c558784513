"""bench/train_step: the demo model's training step (a transformers LlamaForCausalLM,
examples/llama.py) under strata against its lower bound, beside
plain PyTorch; and strata.optim.CpuAdam against torch.optim.AdamW from Python (BENCH.md).

    PYTHONPATH=build/release/python .venv/bin/python bench/train_step.py --dir SCRATCH \
        [--json out.json] [--rounds 3] [--steps 6] [--adam-params 67108864]

Each round measures, side by side:
  * plain PyTorch: forward + backward of the batch with everything in memory (compute_s), and its
    whole step with torch.optim.AdamW (the reference, not a target);
  * the optimizer's own floor: strata's CPU Adam stepping as many parameters in memory
    (adam_s, bench/ceilings.py), and the disk moving the optimizer state once each way (the state on NVMe is read and
    written every step) at fio's read and write bandwidth (io_s; fio at 1 MiB, depth 8, O_DIRECT;
    where fio is missing, strata's aio_bench at the same point: --aio-bench, its path);
  * strata: the engine's step (ZeRO stage 3, parameters offloaded to the host, the optimizer on
    NVMe, the device budget under the model's state), the median of --steps after two warm-ups.
With --variants, more strata configurations (optimizer threads / copy streams) are measured in
each round beside the first; with --profile, the first one's step is also split into its phases
(each waited for before the next) and profiled.
The step's lower bound is max(compute_s, adam_s, io_s): every part overlapped with the others
(the link is not in it: the emulated device's copies are memcpy, capped by nothing). The model
computes with --compute-threads BLAS threads (default 1, plain PyTorch and strata alike): on a
GPU the model leaves the host's cores to strata's optimizer and I/O, and one compute thread keeps
that shape on a CPU-only machine; 0 lets the BLAS take every core, where strata's work competes
with the model's for them (both figures are in docs/performance.md). strata's
figure is the bound over its step (1.0 = at the bound); the ratio reported is the median of the
rounds' ratios.

Then CpuAdam against torch.optim.AdamW (foreach=False, torch's default for CPU tensors) on one tensor
of --adam-params parameters, fp32, the same thread count: the speedup, step time over step time.
"""
import argparse
import contextlib
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time


def _argument(name, default):
    """--NAME as given, read before torch loads its BLAS."""
    for i, arg in enumerate(sys.argv):
        if arg == name and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


# The BLAS reads its thread count once, when it loads: the script runs itself again with it set.
# On a GPU the model computes there: torch's host threads are left as they are.
_THREADS = _argument("--compute-threads", "0" if _argument("--device", "") == "cuda" else "1")
if _THREADS.isdigit() and _THREADS != "0" and os.environ.get("OPENBLAS_NUM_THREADS") != _THREADS:
    os.execve(sys.executable, [sys.executable] + sys.argv,
              dict(os.environ, OPENBLAS_NUM_THREADS=_THREADS, OMP_NUM_THREADS=_THREADS))

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from llama import llama, loss_of  # noqa: E402
from ceilings import cpu_adam_seconds, link_rates  # noqa: E402
from fio_ceiling import disk_bandwidth  # noqa: E402

import strata  # noqa: E402


def batch(gen, args):
    x = torch.randint(0, 256, (args.batch, args.context), generator=gen)
    y = torch.roll(x, -1, 1)
    return (x.cuda(), y.cuda()) if args.device == "cuda" else (x, y)


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_time(fn, steps):
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def phases(engine, x, y, steps):
    """The step's phases, each waited for on the GPU before the next starts (so nothing of one
    overlaps the next, unlike a real step): the medians over `steps` of forward, backward and
    engine.step(), in seconds, and the last step's stats."""
    times = {"forward": [], "backward": [], "step": []}
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        loss = loss_of(engine, x, y)
        _sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        _sync()
        t2 = time.perf_counter()
        engine.step()
        _sync()
        t3 = time.perf_counter()
        for key, value in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            times[key].append(value)
    return {k: statistics.median(v) for k, v in times.items()}


def profile_step(step, cuda, path, split=None):
    """One `step` under torch.profiler (CPU, and CUDA on a GPU): the ops by their own host time
    and by device time, and the GPU's busy time against the step's, written to `path` (with
    `split`, the phases() of the step, first); the trace to `path`.trace.json."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync()
    wall = time.perf_counter() - t0
    averages = prof.key_averages()
    with open(path, "w", encoding="utf-8") as f:
        if split:
            f.write("the step's phases, each waited for before the next (median ms): "
                    + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in split.items()) + "\n")
        f.write(f"one step under the profiler: {wall * 1e3:.1f} ms\n")
        if cuda:
            busy = sum(e.self_device_time_total for e in averages) / 1e6
            f.write(f"the GPU's kernels and copies: {busy * 1e3:.1f} ms "
                    f"({busy / wall:.0%} of the step)\n\n")
            f.write(averages.table(sort_by="self_cuda_time_total", row_limit=25))
            f.write("\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
    prof.export_chrome_trace(path + ".trace.json")


def planner_prediction(args, base, config, plan_binary):
    """strata_plan's prediction of this run on this machine (--calibrate: its CPU Adam and copy
    link measured here; the GPU's TFLOPS given): its JSON's "step" block, or an error line."""
    folder = os.path.join(args.dir, "train_step_plan")
    os.makedirs(folder, exist_ok=True)
    model_json = os.path.join(folder, "config.json")
    config_json = os.path.join(folder, "ds_config.json")
    plan_json = os.path.join(folder, "plan.json")
    base.config.to_json_file(model_json)
    with open(config_json, "w", encoding="utf-8") as f:
        json.dump(config, f)
    hbm_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    command = [plan_binary, "--calibrate", "--calibrate-device", "cuda",
               "--gpu-tflops", str(args.gpu_tflops), "--gpu-hbm-gib", f"{hbm_gib:.1f}",
               "--model", model_json, "--config", config_json, "--sequence", str(args.context),
               "--micro-batch", str(args.batch), "--nocheckpointing", "--json", plan_json]
    run = subprocess.run(command, capture_output=True, text=True)
    print(run.stdout[-4000:])
    if run.returncode != 0 or not os.path.exists(plan_json):
        return {"error": f"strata_plan exited {run.returncode}: {run.stderr[-2000:]}"}
    with open(plan_json, encoding="utf-8") as f:
        plan = json.load(f)
    return plan.get("step") or {"error": "strata_plan predicted no step: " + json.dumps(plan)[:2000]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="scratch folder on the drive to measure")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--device", choices=["emulated", "cuda"], default="emulated",
                        help="strata's device tier: the host-emulated one (the model computes on "
                             "the CPU in fp32) or GPU 0 (the model computes there in bf16, plain "
                             "PyTorch under autocast with the whole model in HBM)")
    parser.add_argument("--optimizer", choices=["cpu", "nvme"], default="nvme",
                        help="where the optimizer state lives (offload_optimizer.device)")
    parser.add_argument("--device-budget-mb", type=float, default=16)
    parser.add_argument("--budget-of-state", type=float, default=0,
                        help="the device budget as this fraction of the training state "
                             "(parameters, gradients, master weights and moments); 0: "
                             "--device-budget-mb")
    parser.add_argument("--gpu-tflops", type=float, default=989,
                        help="with --device cuda and --plan: the GPU's dense bf16 TFLOPS for the "
                             "planner (989: an H100 SXM)")
    parser.add_argument("--profile", help="write torch.profiler's tables of one strata step (round "
                                          "0, after the timed steps) here, and its trace beside "
                                          "it (.trace.json) and the engine's last_step_stats "
                                          "(.stats.json): where the step's time goes")
    parser.add_argument("--optimizer-threads", type=int, default=0,
                        help="strata.optimizer_threads (0: one per core, all but two when the "
                             "optimizer steps during backward)")
    parser.add_argument("--copy-streams", type=int, default=1, choices=[1, 2],
                        help="strata.copy_streams: the CUDA copy engine's streams")
    parser.add_argument("--during-backward", choices=["auto", "true", "false"], default="auto",
                        help="strata.optimizer_during_backward: whether the host-resident "
                             "optimizer state steps during backward (auto, its default: on a GPU)")
    parser.add_argument("--variants", default="",
                        help="more strata configurations measured in each round beside the "
                             "first, comma-separated THREADS/STREAMS[/DURING] (optimizer "
                             "threads, copy streams, DURING 1 or 0: optimizer_during_backward "
                             "on or off, left out: auto), e.g. 14/1,14/2/1")
    parser.add_argument("--aio-bench", default=None,
                        help="strata's aio_bench: the disk's rates where fio is missing")
    parser.add_argument("--plan", help="strata_plan's path: print its prediction of this run "
                                       "(--calibrate on this machine) beside the measure")
    parser.add_argument("--adam-params", type=int, default=1 << 26)
    parser.add_argument("--compute-threads", type=int, default=1,
                        help="threads of the model's compute (the BLAS's and torch's), plain "
                             "PyTorch's and strata's alike: 1 (the default) leaves the other "
                             "cores to strata, as a model computing on a GPU does; 0: the "
                             "BLAS's default (every core)")
    args = parser.parse_args()
    for name in ("rounds", "steps", "batch", "adam_params"):
        if getattr(args, name) < 1:
            sys.exit(f"train_step: --{name.replace('_', '-')} must be at least 1")
    if args.compute_threads < 0:
        sys.exit("train_step: --compute-threads must be 0 (the BLAS's default) or more")
    try:
        variants = [tuple(int(v) for v in spec.split("/")) for spec in args.variants.split(",")
                    if spec]
        variants = [v if len(v) == 3 else v + (-1,) for v in variants]  # DURING left: auto
        if any(len(v) != 3 or v[0] < 0 or v[1] not in (1, 2) or v[2] not in (-1, 0, 1)
               for v in variants):
            raise ValueError
    except ValueError:
        sys.exit(f"train_step: --variants {args.variants!r}: accepted: comma-separated "
                 "THREADS/STREAMS[/DURING], THREADS 0 or more, STREAMS 1 or 2, DURING 0 or 1 "
                 "(left out: auto) (e.g. 14/1,14/2/1)")
    during_arg = {"auto": "auto", "true": True, "false": False}[args.during_backward]
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("train_step: --device cuda: torch sees no CUDA device")
    if not 0 <= args.budget_of_state < 1:
        sys.exit("train_step: --budget-of-state must be in [0, 1)")
    os.makedirs(args.dir, exist_ok=True)
    nvme = os.path.join(args.dir, "train_step_nvme")

    torch.manual_seed(0)
    base = llama(args.layers, args.width, args.heads, args.context)
    params = sum(p.numel() for p in base.parameters())
    state_bytes = params * 12  # master weights and two moments, fp32
    element = 2 if cuda else 4  # the training dtype: bf16 on a GPU, fp32 on the emulated tier
    training_state = params * (2 * element + 12)  # parameters, gradients, optimizer
    budget = int(args.budget_of_state * training_state) if args.budget_of_state else \
        int(args.device_budget_mb * (1 << 20))
    tokens = args.batch * args.context
    flops = 6 * params * tokens  # forward and backward, the attention scores left out
    link = link_rates(256 << 20) if cuda else None
    gen = torch.Generator().manual_seed(1)
    rows = []
    prediction = None
    for round_index in range(args.rounds):
        # plain PyTorch, everything in memory
        plain = copy.deepcopy(base).to(args.device if cuda else "cpu")
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        x, y = batch(gen, args)

        def forward_backward():
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else \
                    contextlib.nullcontext():
                loss = loss_of(plain, x, y)
            loss.backward()

        def plain_step():
            forward_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        plain_step()
        compute_s = median_time(lambda: (forward_backward(), plain.zero_grad(set_to_none=True)),
                                args.steps)
        plain_s = median_time(plain_step, args.steps)
        del plain, opt
        if cuda:
            torch.cuda.empty_cache()

        # the optimizer's floor: the CPU Adam in memory, and the disk moving the state
        adam_s = cpu_adam_seconds(params, torch.bfloat16 if cuda else torch.float32,
                                  repeats=args.steps)
        read_gbs, write_gbs = (
            None if b is None else b / 1e9 for b, _ in (
                disk_bandwidth(args.dir, write, args.aio_bench) for write in (False, True))) \
            if args.optimizer == "nvme" else (None, None)
        if os.path.exists(os.path.join(args.dir, "fio.bin")):
            os.remove(os.path.join(args.dir, "fio.bin"))
        io_s = (state_bytes / (read_gbs * 1e9) + state_bytes / (write_gbs * 1e9)) \
            if read_gbs and write_gbs and args.optimizer == "nvme" else 0.0
        # The link (a GPU only): the parameters lent for forward and again for backward, the
        # gradients back, in the training dtype, each direction at its own measured rate.
        link_s = max(2 * params * element / link[0], params * element / link[1]) if cuda else 0.0

        # strata
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu", "buffer_count": 4, "buffer_size": 1 << 22},
                "offload_optimizer": {"device": args.optimizer, "nvme_path": nvme,
                                      "pipeline_read": True, "pipeline_write": True},
                "stage3_param_persistence_threshold": 10000},
            "strata": {"device": args.device, "device_budget_bytes": budget,
                       "host_budget_bytes": max(1 << 30, 2 * training_state),
                       "nvme_capacity_bytes": max(1 << 30, 2 * training_state),
                       "optimizer_threads": args.optimizer_threads,
                       "copy_streams": args.copy_streams,
                       "optimizer_during_backward": during_arg}}
        if cuda:
            config["bf16"] = {"enabled": True}
        if round_index == 0 and cuda and args.plan:
            prediction = planner_prediction(args, base, config, args.plan)

        def measure(threads, streams, during, profile):
            """strata's median step with these optimizer threads, copy streams and
            optimizer_during_backward (and, with `profile`, its phases and profile); (seconds,
            the last step's waits by cause)."""
            shutil.rmtree(nvme, ignore_errors=True)
            os.makedirs(nvme)
            config["strata"].update(optimizer_threads=threads, copy_streams=streams,
                                    optimizer_during_backward=during)
            engine, _, _, _ = strata.initialize(model=copy.deepcopy(base), config=config)

            def strata_step():
                engine.backward(loss_of(engine, x, y))
                engine.step()

            strata_step()
            strata_step()
            seconds = median_time(strata_step, args.steps)
            if profile:
                split = phases(engine, x, y, args.steps)
                profile_step(strata_step, cuda, args.profile, split)
                with open(args.profile + ".stats.json", "w", encoding="utf-8") as f:
                    json.dump(engine.last_step_stats, f, indent=1, default=str)
                print("strata's phases, each waited for before the next: "
                      + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items()))
            waits = engine.last_step_stats["runtime"]["wait_by_cause"]
            engine.close()
            del engine
            shutil.rmtree(nvme, ignore_errors=True)
            return seconds, waits

        strata_s, waits = measure(args.optimizer_threads, args.copy_streams, during_arg,
                                  round_index == 0 and args.profile)
        variant_s = {}
        for threads, streams, during in variants:
            name = f"{threads}/{streams}/{during}"
            variant_s[name], _ = measure(threads, streams,
                                         "auto" if during < 0 else bool(during), False)
            print(f"round {round_index}: strata with {threads or 'the default count of'} optimizer "
                  f"threads, {streams} copy stream{'s' if streams > 1 else ''}, the optimizer "
                  f"{['as auto says', 'after', 'during'][during + 1]} backward: "
                  f"{variant_s[name] * 1e3:.0f} ms")

        bound_s = max(compute_s, adam_s, io_s, link_s)
        rows.append({"compute_s": compute_s, "adam_s": adam_s, "io_s": io_s, "link_s": link_s,
                     "read_gbs": read_gbs, "write_gbs": write_gbs, "plain_s": plain_s,
                     "strata_s": strata_s, "bound_s": bound_s, "ratio": bound_s / strata_s,
                     "waits": waits, "variants_s": variant_s})
        print(f"round {round_index}: strata {strata_s * 1e3:.0f} ms, bound {bound_s * 1e3:.0f} ms "
              f"(compute {compute_s * 1e3:.0f}, CpuAdam {adam_s * 1e3:.0f}, disk "
              f"{io_s * 1e3:.0f}, link {link_s * 1e3:.0f}), plain PyTorch {plain_s * 1e3:.0f} ms")

    # CpuAdam against torch.optim.AdamW at --adam-params
    n = args.adam_params
    ours_p = torch.nn.Parameter(torch.randn(n))
    ours_p.grad = torch.randn(n) * 0.1
    theirs_p = torch.nn.Parameter(ours_p.detach().clone())
    theirs_p.grad = ours_p.grad.clone()
    # The same threads as torch's (CpuAdam's default is one per core).
    ours = strata.optim.CpuAdamW([ours_p], lr=1e-3, threads=torch.get_num_threads())
    theirs = torch.optim.AdamW([theirs_p], lr=1e-3, foreach=False)
    ours.step()
    theirs.step()
    adam_rows = []  # interleaved, one step each, at least 5 after the warm-up
    for _ in range(max(5, args.rounds)):
        a = median_time(ours.step, 1)
        b = median_time(theirs.step, 1)
        adam_rows.append((a, b, b / a))
    del ours, theirs, ours_p, theirs_p

    med = statistics.median
    ratio = med(r["ratio"] for r in rows)
    strata_steps = 1 / med(r["strata_s"] for r in rows)
    bound_steps = 1 / med(r["bound_s"] for r in rows)
    plain_steps = 1 / med(r["plain_s"] for r in rows)
    speedup = med(r[2] for r in adam_rows)
    no_fio = args.optimizer == "nvme" and any(r["read_gbs"] is None for r in rows)
    print()
    if no_fio:
        print("train_step: fio is missing and no --aio-bench was given (or it failed): the disk "
              "term is left out of the bound (apt-get install fio)")
    if training_state <= budget:
        print("train_step: warning: the model's state fits the device budget: strata moves "
              "little; raise the model or lower --device-budget-mb")
    print(f"model: transformers LlamaForCausalLM {params / 1e6:.2f}M parameters, batch {args.batch} x {args.context}; "
          f"device budget {budget / 2**20:.1f} MiB = {budget / training_state:.3f} of the training "
          f"state ({training_state / 2**20:.0f} MiB); optimizer on {args.optimizer}; "
          + (f"{torch.cuda.get_device_name()}, bf16 (plain PyTorch: autocast, the whole model "
             f"in HBM); link measured {link[0] / 1e9:.1f} GB/s to the device, "
             f"{link[1] / 1e9:.1f} GB/s back" if cuda else
             f"host-emulated device, model on the CPU with "
             f"{args.compute_threads or 'the BLAS default of'} compute thread"
             f"{'' if args.compute_threads == 1 else 's'}, OPENBLAS_NUM_THREADS="
             f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"))
    print(f"{'round':>5} {'strata ms':>10} {'bound ms':>9} {'compute':>8} {'CpuAdam':>8} "
          f"{'disk':>6} {'link':>6} {'plain ms':>9} {'ratio':>6}")
    for i, r in enumerate(rows):
        print(f"{i:>5} {r['strata_s'] * 1e3:>10.0f} {r['bound_s'] * 1e3:>9.0f} "
              f"{r['compute_s'] * 1e3:>8.0f} {r['adam_s'] * 1e3:>8.0f} {r['io_s'] * 1e3:>6.0f} "
              f"{r['link_s'] * 1e3:>6.0f} {r['plain_s'] * 1e3:>9.0f} {r['ratio']:>6.2f}")
    print(f"CpuAdam vs torch.optim.AdamW at {n} parameters, {torch.get_num_threads()} "
          f"thread{'' if torch.get_num_threads() == 1 else 's'} each: "
          + ", ".join(f"{a * 1e3:.0f} vs {b * 1e3:.0f} ms" for a, b, _ in adam_rows))
    ratios = [r["ratio"] for r in rows]
    speedups = [r[2] for r in adam_rows]
    print(f"train_step/steps_per_s: {strata_steps:.3f} steps/s = {ratio:.3f} of the step's lower "
          f"bound max(compute, CpuAdam, disk, link) ({bound_steps:.3f} steps/s; rounds "
          f"{min(ratios):.3f}-{max(ratios):.3f})")
    print(f"train_step/plain_pytorch_steps_per_s: {plain_steps:.3f} steps/s (everything in "
          f"memory, a reference, not a ceiling; strata runs {strata_steps / plain_steps:.2f}x of "
          f"it)")
    print(f"train_step/tokens_per_s: {strata_steps * tokens:.0f} tokens/s, "
          f"{strata_steps * flops / 1e12:.2f} model TFLOPs (6 x parameters x tokens); plain "
          f"PyTorch {plain_steps * tokens:.0f} tokens/s, {plain_steps * flops / 1e12:.2f} TFLOPs")
    if prediction is not None:
        if "error" in prediction:
            print(f"train_step/planner: no prediction: {prediction['error']}")
        else:
            print(f"train_step/planner: predicted {prediction['seconds'] * 1e3:.0f} ms a step "
                  f"(its bound {prediction['lower_bound_seconds'] * 1e3:.0f} ms); measured "
                  f"{1e3 / strata_steps:.0f} ms = {prediction['seconds'] * strata_steps:.2f}x "
                  "the prediction's rate")
    print(f"train_step/cpu_adam_vs_torch_adamw: {speedup:.2f}x torch.optim.AdamW "
          f"(foreach=False) at {n} parameters (rounds {min(speedups):.2f}-{max(speedups):.2f})")

    if args.json:
        fs = subprocess.run(["stat", "-f", "-c", "%T", args.dir], capture_output=True,
                            text=True).stdout.strip()
        cpu = platform.machine()
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")),
                           cpu)
        except OSError:
            pass
        report = {
            "bench": "train_step",
            "figures": [
                {"name": "steps_per_s", "value": strata_steps, "unit": "steps/s",
                 "ceiling": bound_steps,
                 "ceiling_source": "1 / max(plain PyTorch forward+backward, CpuAdam in memory, "
                                   "optimizer state / fio GB/s each way, parameters and "
                                   "gradients / the measured link (a GPU only))"
                                   + (" (fio missing: no disk term)" if no_fio else ""),
                 "ratio": ratio, "min_ratio": min(ratios), "max_ratio": max(ratios),
                 "config": vars(args)},
                {"name": "plain_pytorch_steps_per_s", "value": plain_steps, "unit": "steps/s",
                 "note": "reference, not a ceiling: everything in memory"},
                {"name": "cpu_adam_vs_torch_adamw", "value": speedup, "unit": "x",
                 "peer": "torch.optim.AdamW foreach=False, interleaved in the same run",
                 "peer_ratio": speedup, "min": min(speedups), "max": max(speedups),
                 "note": "a peer ratio; CpuAdam against its bandwidth ceiling is bench/cpu_adam",
                 "config": {"params": n, "threads": torch.get_num_threads()}}],
            "rounds": rows,
            "adam_rounds": [{"cpu_adam_s": a, "torch_adamw_s": b} for a, b, _ in adam_rows],
            "tokens_per_s": strata_steps * tokens, "model_tflops": strata_steps * flops / 1e12,
            "plain_tokens_per_s": plain_steps * tokens,
            "planner": prediction,
            "link_gbs": None if link is None else [link[0] / 1e9, link[1] / 1e9],
            "machine": {"cpu": cpu, "cores": os.cpu_count(), "fs": fs,
                        "device": torch.cuda.get_device_name() if cuda else "host-emulated",
                        "torch": torch.__version__}}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
