"""bench/host_cost: what stage 3's lending costs the host, beside plain PyTorch in the same run.

    PYTHONPATH=build/release/python .venv/bin/python bench/host_cost.py \
        [--device cpu|cuda] [--layers 16] [--width 64] [--heads 4] [--context 16] [--batch 1]
        [--rounds 5] [--steps 6] [--json out.json]

A ZeRO-3 engine whose device budget holds the whole model (every parameter partitioned: the
persistence threshold 0) against plain PyTorch on the same model, batches and seed, each
training with AdamW: forward and backward timed apart (each waited for on a GPU), the two systems
interleaved round by round. What strata adds there is its host work (its hooks around each
module, the lends and gives back of each parameter, the gradient hooks; on the CPU the
host-emulated device tier's copies of a few kB each) and, on a GPU, the gradients' copies to the
host, which the step needs: they go during backward, and the timed backward waits for them (no
weights cross the link). The optimizer steps after backward, in step(), which is not timed (the
CPU optimizer is a bound of its own).
The default model is narrow and deep (16 layers 64 wide, 147 modules that lend parameters), so
that plain PyTorch's own compute is small and the figure is that host work, per lending module;
on a GPU, a model as wide as the trainer's (--width 2048 --layers 8) gives issue 49's figure:
forward and backward against plain PyTorch's with the model held in the device budget (its
target: within 1.2x).

Reported, the median of the rounds' ratios: strata's forward over plain PyTorch's, its backward
over plain PyTorch's, and the host time it adds per lending module in forward and backward
together (microseconds; the ceiling is plain PyTorch's 0, so that figure has no ratio). The
losses of the two must agree
(fp32: every step's within 1e-5 relative; bf16 on a GPU: the first step's within 1e-2); the run
says so, and its figures are void where they do not.
"""
import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from llama import llama, loss_of  # noqa: E402

import strata  # noqa: E402


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def timed_step(forward, backward, step, cuda):
    """(forward s, backward s, loss) of one training step, each phase waited for."""
    _sync(cuda)
    t0 = time.perf_counter()
    loss = forward()
    _sync(cuda)
    t1 = time.perf_counter()
    backward(loss)
    _sync(cuda)
    t2 = time.perf_counter()
    step()
    return t1 - t0, t2 - t1, float(loss)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps a round, each system")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    for name in ("layers", "width", "heads", "context", "batch", "rounds", "steps"):
        if getattr(args, name) < 1:
            sys.exit(f"host_cost: --{name} {getattr(args, name)}; accepted: 1 or more")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("host_cost: --device cuda: no CUDA device here; accepted: --device cpu")
    torch.manual_seed(0)
    base = llama(args.layers, args.width, args.heads, args.context)
    dtype = torch.bfloat16 if cuda else torch.float32
    params = sum(p.numel() for p in base.parameters())
    modules = sum(1 for m in base.modules() if any(True for _ in m.parameters(recurse=False)))
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        x = torch.randint(0, 256, (args.batch, args.context), generator=gen)
        batches.append((x.to(args.device), torch.roll(x, -1, 1).to(args.device)))

    plain = copy.deepcopy(base).to(device=args.device, dtype=dtype)
    adam = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    element = 2 if cuda else 4
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0},
        # The whole model, its gradients and a copy in flight, with room to spare: nothing is
        # evicted, so nothing crosses the link in the timed steps.
        "strata": {"device": "cuda" if cuda else "emulated",
                   "device_budget_bytes": 4 * params * element + (64 << 20),
                   "host_budget_bytes": max(1 << 30, 2 * params * (2 * element + 12)),
                   # The optimizer steps in step(), not timed: stepping during backward, its
                   # threads would share the cores with the hooks measured here (on a machine
                   # of few cores), where the CPU optimizer is a bound of its own.
                   "optimizer_during_backward": False}}
    if cuda:
        config["bf16"] = {"enabled": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the config's notes: not this bench's subject)
        engine, _, _, _ = strata.initialize(model=copy.deepcopy(base), config=config)

    def plain_step():
        adam.step()
        adam.zero_grad(set_to_none=True)

    systems = {
        "plain": lambda x, y: (lambda: loss_of(plain, x, y), lambda loss: loss.backward(),
                               plain_step),
        "strata": lambda x, y: (lambda: loss_of(engine, x, y), engine.backward, engine.step)}
    times = {s: {"forward": [], "backward": []} for s in systems}
    losses = {s: [] for s in systems}
    ratios = {"forward": [], "backward": [], "us_per_module": []}
    for name in systems:  # two warm-up steps each, not timed
        for i in range(2):
            x, y = batches[i % len(batches)]
            losses[name].append(timed_step(*systems[name](x, y), cuda)[2])
    for r in range(args.rounds):
        round_times = {}
        for name in (("plain", "strata") if r % 2 == 0 else ("strata", "plain")):
            fwd, bwd = [], []
            for i in range(args.steps):
                x, y = batches[(2 + r * args.steps + i) % len(batches)]
                f, b, loss = timed_step(*systems[name](x, y), cuda)
                fwd.append(f)
                bwd.append(b)
                losses[name].append(loss)
            times[name]["forward"] += fwd
            times[name]["backward"] += bwd
            round_times[name] = (statistics.median(fwd), statistics.median(bwd))
        (pf, pb), (sf, sb) = round_times["plain"], round_times["strata"]
        ratios["forward"].append(sf / pf)
        ratios["backward"].append(sb / pb)
        ratios["us_per_module"].append((sf + sb - pf - pb) / modules * 1e6)
        print(f"round {r + 1}: forward plain {pf * 1e3:.2f} ms, strata {sf * 1e3:.2f} ms; "
              f"backward plain {pb * 1e3:.2f} ms, strata {sb * 1e3:.2f} ms", flush=True)
    engine.close()

    # fp32: every step's loss; bf16 (a GPU): the first step's, where both computed with the same
    # weights (plain PyTorch's AdamW steps its bf16 weights, strata fp32 master weights: later
    # steps drift apart by the rounding, not by what is measured here).
    tolerance = 1e-5 if not cuda else 1e-2
    compared = len(losses["plain"]) if not cuda else 1
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["plain"][:compared],
                                                                 losses["strata"][:compared]))
    agree = worst <= tolerance
    med = {k: statistics.median(v) for k, v in ratios.items()}
    spread = {k: (min(v), max(v)) for k, v in ratios.items()}
    medians = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}
    shape = {"layers": args.layers, "width": args.width, "heads": args.heads,
             "context": args.context, "batch": args.batch, "params": params,
             "lending_modules": modules, "device": args.device, "dtype": str(dtype),
             "rounds": args.rounds, "steps": args.steps}
    figures = [
        {"name": "forward_vs_plain", "value": med["forward"], "unit": "x", "ceiling": 1.0,
         "ceiling_source": "plain PyTorch's forward, the model in memory", "better": "lower",
         "ratio": med["forward"], "min": spread["forward"][0], "max": spread["forward"][1],
         "config": shape},
        {"name": "backward_vs_plain", "value": med["backward"], "unit": "x", "ceiling": 1.0,
         "ceiling_source": "plain PyTorch's backward, the model in memory", "better": "lower",
         "ratio": med["backward"], "min": spread["backward"][0], "max": spread["backward"][1],
         "config": shape},
        {"name": "host_us_per_module", "value": med["us_per_module"], "unit": "us",
         "ceiling": 0.0, "ceiling_source": "plain PyTorch (no lending)", "better": "lower",
         "ratio": None, "min": spread["us_per_module"][0], "max": spread["us_per_module"][1],
         "config": shape}]
    print(f"{params / 1e6:.2f}M parameters, {modules} modules lending them, {args.device}, "
          f"{dtype}; medians over {args.rounds} rounds of {args.steps} steps:")
    print("| system | forward | backward |")
    print("| --- | --- | --- |")
    for s in systems:
        print(f"| {s} | {medians[s]['forward'] * 1e3:.2f} ms | "
              f"{medians[s]['backward'] * 1e3:.2f} ms |")
    print(f"losses {'agree' if agree else 'DIFFER'} ({'every step' if not cuda else 'the first'}"
          f": worst relative difference {worst:.1e}, tolerance {tolerance:g}); last "
          f"{losses['plain'][-1]:.5f} / {losses['strata'][-1]:.5f}")
    for f in figures[:2]:
        print(f"host_cost/{f['name']}: {f['value']:.2f} x = {f['ratio']:.2f} of "
              f"{f['ceiling_source']} [{f['min']:.2f}, {f['max']:.2f}]")
    print(f"host_cost/host_us_per_module: {med['us_per_module']:.0f} us a lending module, "
          f"forward and backward [{spread['us_per_module'][0]:.0f}, "
          f"{spread['us_per_module'][1]:.0f}] (plain PyTorch: 0; no ratio)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bench": "host_cost", "figures": figures, "losses_agree": agree,
                       "losses": losses, "medians_s": medians,
                       "machine": {"cpu": platform.processor() or platform.machine(),
                                   "cores": os.cpu_count(), "node": platform.node(),
                                   "device": torch.cuda.get_device_name() if cuda else "cpu"}},
                      f, indent=1)
    if not agree:
        sys.exit("host_cost: the losses differ: the figures are void")


if __name__ == "__main__":
    main()
