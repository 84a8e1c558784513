"""strata's main job: fine-tune a transformers Llama model on one device with strata, beside
plain PyTorch.

    .venv/bin/python examples/finetune.py --work build/release/scratch/finetune \
        [--aio-block build/release/scratch/strata-sweep/best.json] [--steps 150]

(`make demo` runs the quick aio sweep first and passes its best block here.) The model is
examples/llama.py's (transformers' LlamaForCausalLM from a small config, byte tokens), the text the licences Debian ships (/usr/share/common-licenses, read as bytes)
or any file given with --text. strata runs ZeRO stage 3: parameters offloaded to pinned host
memory and lent to the device tier around each module, the optimizer's fp32 master weights and
moments on NVMe under --work, the device budget a fraction of the model's state
(parameters + gradients + optimizer state over --device-budget-mb is printed, with a warning when
it is under 4). Then the same model, the same seed and the same batches train in plain PyTorch with
torch.optim.AdamW. Printed: a progress bar with loss, step time and the time waited by cause; the
two loss curves side by side and their largest difference; the bytes each pair of tiers moved;
and a PNG of both curves (loss_curves.png in --work) and a JSON summary (summary.json).

Without a GPU the device tier is the host-emulated one and the model computes on the CPU in fp32
(the reference is then fp32 too, so the curves agree to rounding); with --device cuda it is the
GPU, in bf16.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import llama, loss_of  # noqa: E402

import strata  # noqa: E402


def read_text(paths):
    data = bytearray()
    for path in paths:
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    with open(full, "rb") as f:
                        data += f.read()
        else:
            with open(path, "rb") as f:
                data += f.read()
    if len(data) < 4096:
        sys.exit(f"finetune: the text is {len(data)} bytes; it needs at least 4096")
    return torch.tensor(list(data), dtype=torch.long)


def batches(text, steps, batch, context, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(text) - context - 1, (batch,), generator=gen)
        x = torch.stack([text[s:s + context] for s in starts])
        y = torch.stack([text[s + 1:s + context + 1] for s in starts])
        yield x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="scratch folder (NVMe swap, outputs)")
    parser.add_argument("--aio-block", help="an aio config block (aio_bench_perf_sweep's best.json)")
    parser.add_argument("--text", nargs="*", default=["/usr/share/common-licenses"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device-budget-mb", type=float, default=16)
    parser.add_argument("--device", choices=["emulated", "cuda"], default="emulated")
    parser.add_argument("--persistence-threshold", type=int, default=10000,
                        help="stage3_param_persistence_threshold: smaller parameters stay put")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the plain-PyTorch run")
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1:
        sys.exit("finetune: --steps and --batch must be at least 1")
    if min(args.layers, args.width, args.heads, args.context) < 1:
        sys.exit("finetune: --layers, --width, --heads and --context must be at least 1")
    if args.width % args.heads:
        sys.exit("finetune: --width must be a multiple of --heads")
    if not args.device_budget_mb > 0:
        sys.exit("finetune: --device-budget-mb must be more than 0")

    nvme = os.path.join(args.work, "nvme")
    shutil.rmtree(nvme, ignore_errors=True)
    os.makedirs(nvme, exist_ok=True)
    text = read_text(args.text)
    torch.manual_seed(args.seed)
    model = llama(args.layers, args.width, args.heads, args.context)
    reference = copy.deepcopy(model)
    params = sum(p.numel() for p in model.parameters())
    cuda = args.device == "cuda"
    dtype_bytes = 2 if cuda else 4
    # parameters and gradients in the training dtype, master weights and two moments in fp32
    state_bytes = params * (2 * dtype_bytes + 12)
    budget = int(args.device_budget_mb * (1 << 20))

    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": args.steps,  # the progress bar reports each step
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "buffer_count": 4, "buffer_size": 1 << 22},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pipeline_read": True,
                                  "pipeline_write": True},
            "stage3_param_persistence_threshold": args.persistence_threshold},
        "strata": {"device": args.device, "device_budget_bytes": budget,
                   "host_budget_bytes": max(1 << 30, 4 * state_bytes),
                   "nvme_capacity_bytes": max(1 << 28, 4 * state_bytes)},
    }
    if cuda:
        config["bf16"] = {"enabled": True}
    if args.aio_block:
        try:
            with open(args.aio_block, encoding="utf-8") as f:
                block = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"finetune: --aio-block {args.aio_block}: {e}")
        if not isinstance(block, dict):
            sys.exit(f"finetune: --aio-block {args.aio_block}: accepted: a JSON object with an "
                     "\"aio\" block (aio_bench_perf_sweep's best.json)")
        for w in block.pop("strata_sweep_warnings", []):
            print(f"finetune: the sweep warned: {w}")
        config["aio"] = block.get("aio", {})
        config["strata"]["aio"] = block.get("strata", {}).get("aio", {})

    print(f"model: transformers LlamaForCausalLM {args.layers} layers x {args.width} wide, {params / 1e6:.2f}M parameters; "
          f"{len(text) / 1e6:.2f} MB of text")
    print(f"state: {state_bytes / 2**20:.1f} MiB (parameters, gradients, optimizer) over a device "
          f"budget of {budget / 2**20:.1f} MiB = {state_bytes / budget:.1f}x")
    if state_bytes < 4 * budget:
        print("finetune: warning: the state is under 4x the device budget: strata moves little")

    try:
        engine, _, _, _ = strata.initialize(model=model, config=config)
    except (strata.Error, ValueError) as e:
        sys.exit(f"finetune: {e}")
    device_name = "the host-emulated device tier (no GPU: the model computes on the CPU in " \
        "fp32)" \
        if engine.device_kind == "emulated" else f"CUDA device {torch.cuda.current_device()}"
    print(f"strata: ZeRO stage 3 on {device_name}; optimizer state on NVMe under {nvme}")
    if engine.device_kind == "emulated":
        print(f"strata: torch computes with {torch.get_num_threads()} thread(s)")

    # A progress bar on a terminal; plain lines in a log file (no carriage returns).
    tqdm = None
    if sys.stderr.isatty():
        from tqdm import tqdm
    losses, step_seconds, waits = [], [], {}
    bar = tqdm(total=args.steps, desc="strata", unit="step") if tqdm else None
    start = time.perf_counter()
    for i, (x, y) in enumerate(batches(text, args.steps, args.batch, args.context, args.seed)):
        t0 = time.perf_counter()
        if cuda:
            x, y = x.cuda(), y.cuda()
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        step_seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
        report = engine.last_step_stats["runtime"]
        for cause, s in report["wait_by_cause"].items():
            waits[cause] = waits.get(cause, 0.0) + s
        waited = report["wait_seconds"]
        if bar:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", step=f"{step_seconds[-1] * 1e3:.0f}ms",
                            waited=f"{waited * 1e3:.0f}ms")
            bar.update(1)
        elif i % 10 == 0 or i == args.steps - 1:
            print(f"step {i}: loss {losses[-1]:.4f}, {step_seconds[-1] * 1e3:.0f} ms, "
                  f"waited {waited * 1e3:.0f} ms")
    if bar:
        bar.close()
    strata_seconds = time.perf_counter() - start
    stats = engine.stats()

    ref_losses = []
    ref_seconds = None
    if not args.no_reference:
        torch.manual_seed(args.seed)
        reference = reference.cuda() if cuda else reference
        opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.01)
        bar = tqdm(total=args.steps, desc="plain PyTorch", unit="step") if tqdm else None
        start = time.perf_counter()
        for x, y in batches(text, args.steps, args.batch, args.context, args.seed):
            if cuda:
                x, y = x.cuda(), y.cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else \
                    contextlib.nullcontext():
                loss = loss_of(reference, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_losses.append(loss.item())
            if bar:
                bar.set_postfix(loss=f"{ref_losses[-1]:.3f}")
                bar.update(1)
        if bar:
            bar.close()
        ref_seconds = time.perf_counter() - start

    print()
    print("step   strata loss   PyTorch loss")
    for i in sorted(set([0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4,
                         len(losses) - 1])):
        theirs = f"{ref_losses[i]:.4f}" if ref_losses else "-"
        print(f"{i:4d}   {losses[i]:11.4f}   {theirs:>12}")
    finite = all(math.isfinite(v) for v in losses + ref_losses)
    largest = max(abs(a - b) for a, b in zip(losses, ref_losses)) if ref_losses else None
    if not finite:
        largest = math.inf
    if largest is not None:
        print(f"largest difference of the two curves: {largest:.2e} (loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f})")
    median = sorted(step_seconds[2:] or step_seconds)[len(step_seconds[2:] or step_seconds) // 2]
    print(f"strata: {strata_seconds:.1f} s, median step {median * 1e3:.0f} ms; waited by cause: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in waits.items()))
    if ref_seconds is not None:
        print(f"plain PyTorch (everything in memory): {ref_seconds:.1f} s")
    print("bytes moved between tiers: " + ", ".join(
        f"{k.replace('_to_', ' -> ')} {v / 2**20:.1f} MiB"
        for k, v in sorted(stats["bytes_moved"].items())))

    summary = {"device": engine.device_kind, "parameters": params, "state_bytes": state_bytes,
               "device_budget_bytes": budget, "steps": args.steps, "strata_losses": losses,
               "pytorch_losses": ref_losses, "largest_difference": largest,
               "strata_seconds": strata_seconds, "pytorch_seconds": ref_seconds,
               "median_step_seconds": median, "waits": waits,
               "bytes_moved": stats["bytes_moved"]}
    with open(os.path.join(args.work, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(losses, label=f"strata (ZeRO-3, {engine.device_kind} device, optimizer on NVMe)")
        if ref_losses:
            ax.plot(ref_losses, "--", label="plain PyTorch, torch.optim.AdamW")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (cross-entropy, bytes)")
        ax.set_title(f"Llama {params / 1e6:.1f}M, state {state_bytes / budget:.1f}x the device budget")
        ax.legend()
        fig.tight_layout()
        png = os.path.join(args.work, "loss_curves.png")
        fig.savefig(png, dpi=100)
        print(f"loss curves: {png}")
    except ImportError:
        print("finetune: matplotlib is missing: no PNG (scripts/python-env.sh installs it)")
    print(f"summary: {os.path.join(args.work, 'summary.json')}")
    if not finite:
        sys.exit("finetune: a loss was not finite")


if __name__ == "__main__":
    main()
