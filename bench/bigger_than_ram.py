"""bench/bigger_than_ram: a model whose fp32 training state is larger than this machine's RAM
(or, with --device cuda, than its GPU's memory), trained in bf16 with the host budget at a few
GiB, its state on the disk.

    PYTHONPATH=build/release/python .venv/bin/python bench/bigger_than_ram.py --dir SCRATCH \
        [--layers 36 --width 2048 --heads 16 | --largest --plan STRATA_PLAN] \
        [--host-budget-gib 4] [--json out.json]

What it does, and reports (BENCH.md):
  * before anything is allocated, what the run needs (disk: the NVMe store and a checkpoint;
    memory: the host and device budgets and a margin for torch) against what the machine has
    (free space under --dir, MemAvailable), refusing with the figures when it is short;
  * the disk's ceiling, fio reading and writing 1 MiB blocks at depth 8 under --dir (this virtual
    disk's rate moves twofold within minutes: measured in the same run), or where fio is missing
    (the lent GPU machines), strata's aio_bench at the same point (--aio-bench);
  * run A, in a child process: a transformers LlamaForCausalLM built under strata.init (its
    weights go to their partitions as they are made, never whole in memory), ZeRO-3 with the
    parameters and the optimizer on NVMe (strata.optimizer_commit "partition": the state once on
    the disk), --steps steps, a checkpoint after step --save-after; each step's time, bytes read
    and written by the process (/proc/self/io) and peak resident memory (VmHWM, reset before
    each step);
  * run B, in a fresh child: the same model, the checkpoint loaded, the steps after it: its losses
    must be run A's, bit for bit (the resumed run is the run that did not stop);
  * the step against the disk's lower bound (its bytes at the measured rates, read and write one
    after the other: one device) and against strata_plan's prediction for this machine (--plan: its
    CPU Adam and copy link calibrated here, the disk measured, the compute from a bf16 matmul
    timed here, as the planner's "GPU").
  * with --deepspeed, DeepSpeed ZeRO-Infinity on the same model and config (its "strata" block
    left out; sub_group_size set, as DeepSpeed's default of 1e9 elements pins buffers the size of
    the model; --ds-zero adds keys of its own), built under deepspeed.zero.Init, in a child of
    its own after strata's runs (their files removed first): its steps' time, bytes and peak
    memory, or its exact error. --deepspeed-only runs it alone, to try DeepSpeed's settings.
  * --param-device cpu: offload_param "cpu" for both (the bf16 weights in host memory, the
    optimizer state on NVMe): the configuration DeepSpeed 0.19.8 finishes here (with parameters
    on NVMe its parameter swapper fails at step 2, its issue 3062).
  * --largest (with --plan): the model is the largest of examples/llama.py's family that
    strata_plan --largest finds for this run's config on this machine (planner/plan_largest.h):
    the description --calibrate's, the disk measured, its host memory the host budget and its
    disk the optimizer state's share of the free space (--largest-disk-gib caps it) beside what
    else the run puts there (the checkpoint, the gradients' spill, the weights).
  * --device cuda: the model computes on GPU 0 (strata.device "cuda", its device tier within
    --device-budget-gib of the GPU's memory; DeepSpeed with its CUDA accelerator), the GPU
    synchronized before each step's clock starts and before it stops; each step also reports the
    peak GPU memory (torch's, strata's own device pool beside it, and the whole GPU's in use), and
    the preflight sets the training state beside the GPU's memory. The planner's "GPU" is then the
    GPU's bf16 matmul rate, measured, with its memory, and its link calibrated on it.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from fio_ceiling import disk_bandwidth  # noqa: E402 (the disk's ceiling)
from vs_deepspeed import io_bytes, status_kib  # noqa: E402 (the /proc figures, read alike)

GIB = 1 << 30


def status_bytes(key):
    """A /proc/self/status field (VmHWM, VmRSS) in bytes."""
    return status_kib(key) * 1024


def reset_peak():
    """Resets VmHWM to the current resident size (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")


def timed_step(engine, loss_of, tokens, step, name):
    """One training step of `engine` on `tokens` (inputs and next-token targets), its figures:
    (loss, {"step", "seconds", "read", "written", "peak_rss"}, and on a GPU "peak_gpu": torch's,
    strata's own device pool and the whole GPU's in use), printed as `name` step N."""
    import torch
    cuda = engine.device.type == "cuda"
    x, y = tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device)
    reset_peak()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    r0, w0 = io_bytes()
    t0 = time.perf_counter()
    loss = loss_of(engine, x, y)
    engine.backward(loss)
    engine.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    r1, w1 = io_bytes()
    record = {"step": step, "seconds": seconds, "read": r1 - r0, "written": w1 - w0,
              "peak_rss": status_bytes("VmHWM")}
    gpu = ""
    if cuda:
        free, total = torch.cuda.mem_get_info()
        pool = engine.stats()["peak_bytes"].get("device", 0) if hasattr(engine, "stats") else 0
        record["peak_gpu"] = {"torch": torch.cuda.max_memory_allocated(), "strata_pool": pool,
                              "in_use": total - free}
        gpu = (f", peak GPU {record['peak_gpu']['torch'] / GIB:.2f} GiB torch's + "
               f"{pool / GIB:.2f} GiB strata's pool ({(total - free) / GIB:.2f} GiB in use)")
    print(f"{name}step {step}: loss {loss.item():.6f}, {seconds:.1f} s, read "
          f"{(r1 - r0) / GIB:.1f} GiB, written {(w1 - w0) / GIB:.1f} GiB, peak RSS "
          f"{record['peak_rss'] / GIB:.2f} GiB{gpu}", flush=True)
    return loss.item(), record


def shape(args):
    """(parameter count, largest parameter's elements) of the model, built on the meta device."""
    import torch
    from llama import llama
    with torch.device("meta"):
        model = llama(args.layers, args.width, args.heads, args.context, vocab=args.vocab)
    sizes = [p.numel() for p in model.parameters()]
    return sum(sizes), max(sizes)


def config_for(args, nvme, largest):
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": ({"device": "nvme", "nvme_path": nvme, "buffer_count": 4,
                               "buffer_size": largest} if args.param_device == "nvme"
                              else {"device": "cpu"}),
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3},
            # Parameters in use at once, a fifth of the device budget (2-byte weights): the
            # planner's model of what the device holds.
            "stage3_max_live_parameters": args.device_budget_gib * GIB // 10,
        },
        "strata": {"device": "cuda" if args.device == "cuda" else "emulated",
                   "device_budget_bytes": args.device_budget_gib * GIB,
                   "host_budget_bytes": args.host_budget_gib * GIB,
                   "nvme_capacity_bytes": args.nvme_capacity_gib * GIB,
                   "optimizer_commit": args.commit,
                   # freed blocks go back to the system: the resident memory is what is held
                   "malloc_mmap_threshold_bytes": 256 << 10},
    }


def needs(args, params, largest):
    """(disk bytes, memory bytes, lines saying why) the run needs."""
    state = 12 * params  # fp32 master weights and Adam's two moments
    copies = 1 if args.commit == "partition" else 2
    disk = {
        "the optimizer's state on NVMe": copies * state + (12 * largest if copies == 1 else 0),
        "the bf16 weights on NVMe": 2 * params,
        "fp32 gradients the host budget spills to NVMe (at most)": 4 * params,
        "the checkpoint (master weights and moments)": state,
        "fio's scratch file and slack": 512 << 20,
    }
    memory = {"the host budget": args.host_budget_gib * GIB}
    if args.device == "cpu":
        memory["the device budget (the emulated device is host memory)"] = \
            args.device_budget_gib * GIB
    memory["torch, the model's activations and the interpreter (margin)"] = args.margin_gib * GIB
    return disk, memory


def preflight(args, params, largest):
    disk, memory = needs(args, params, largest)
    stat = os.statvfs(args.dir)
    free = stat.f_bavail * stat.f_frsize
    with open("/proc/meminfo", encoding="utf-8") as f:
        available = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
    lines = [f"the model: {params / 1e9:.2f}B parameters; its fp32 training state (weights, "
             f"gradients, Adam's moments: 16 bytes a parameter) {16 * params / GIB:.1f} GiB, this "
             f"machine's RAM {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f}"
             " GiB"]
    for what, parts, have in (("disk under " + args.dir, disk, free),
                              ("memory", memory, available)):
        total = sum(parts.values())
        lines.append(f"{what}: needs {total / GIB:.1f} GiB, has {have / GIB:.1f} GiB")
        lines += [f"    {v / GIB:6.1f} GiB  {k}" for k, v in parts.items()]
        if total > have:
            sys.exit("\n".join(lines) + f"\nbigger_than_ram: the {what.split()[0]} is short by "
                     f"{(total - have) / GIB:.1f} GiB; refused before anything was allocated "
                     "(a smaller --layers, or more room)")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("bigger_than_ram: --device cuda, but torch sees no CUDA device")
        total = torch.cuda.get_device_properties(0).total_memory
        lines.append(f"the GPU ({torch.cuda.get_device_name(0)}): {total / GIB:.1f} GiB; the "
                     f"training state is {16 * params / total:.2f}x its memory; the device "
                     f"budget {args.device_budget_gib} GiB")
        if args.device_budget_gib * GIB > total:
            sys.exit("\n".join(lines) + "\nbigger_than_ram: --device-budget-gib is more than "
                     "the GPU's memory")
    for line in lines:
        print(line)
    return sum(disk.values())


CHILD = r"""
import json, sys, time
sys.path.insert(0, {examples!r})
sys.path.insert(0, {bench!r})
import torch
import strata
from llama import llama, loss_of
import bigger_than_ram as b

args = json.loads({args!r})
torch.manual_seed(0)
torch.set_num_threads(args["threads"])
config = json.loads({config!r})
gen = torch.Generator().manual_seed(7)
data = [torch.randint(0, args["vocab"], (args["batch"], args["context"] + 1), generator=gen)
        for _ in range(args["steps"])]
out = {{"steps": [], "losses": {{}}}}
t0 = time.perf_counter()
with strata.init(config=config):
    model = llama(args["layers"], args["width"], args["heads"], args["context"],
                  vocab=args["vocab"])
engine, _, _, _ = strata.initialize(model=model, config=config)
out["build_s"] = time.perf_counter() - t0
first = 1
if args["resume"]:
    t0 = time.perf_counter()
    engine.load_checkpoint(args["checkpoint"])
    out["load_s"] = time.perf_counter() - t0
    first = engine.global_steps + 1
for step in range(first, args["steps"] + 1):
    out["losses"][str(step)], record = b.timed_step(engine, loss_of, data[step - 1], step, "")
    record["stepped"] = engine.last_step_stats["stepped"]
    out["steps"].append(record)
    if step == args["save_after"] and not args["resume"]:
        b.reset_peak()
        t0 = time.perf_counter()
        engine.save_checkpoint(args["checkpoint"])
        out["save_s"] = time.perf_counter() - t0
        out["save_peak_rss"] = b.status_bytes("VmHWM")
        print(f"checkpoint after step {{step}}: {{out['save_s']:.1f}} s", flush=True)
out["warnings"] = list(engine.warnings)
engine.close()
with open(args["result"], "w") as f:
    json.dump(out, f)
"""


DS_CHILD = r"""
import json, os, sys, time
args = json.loads({args!r})
os.environ.setdefault("DS_ACCELERATOR", "cuda" if args["device"] == "cuda" else "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
sys.path.insert(0, {examples!r})
sys.path.insert(0, {bench!r})
import torch
import deepspeed
from llama import llama, loss_of
import bigger_than_ram as b

config = json.loads({config!r})
torch.manual_seed(0)
torch.set_num_threads(args["threads"])
gen = torch.Generator().manual_seed(7)
data = [torch.randint(0, args["vocab"], (args["batch"], args["context"] + 1), generator=gen)
        for _ in range(args["steps"])]
out = {{"steps": [], "losses": {{}}, "deepspeed": deepspeed.__version__}}
t0 = time.perf_counter()
with deepspeed.zero.Init(config_dict_or_path=config):
    model = llama(args["layers"], args["width"], args["heads"], args["context"],
                  vocab=args["vocab"])
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=config)
out["build_s"] = time.perf_counter() - t0
for step in range(1, args["steps"] + 1):
    out["losses"][str(step)], record = b.timed_step(engine, loss_of, data[step - 1], step,
                                                    "deepspeed ")
    out["steps"].append(record)
with open(args["result"], "w") as f:
    json.dump(out, f)
"""


def run_deepspeed(args, config, result):
    """DeepSpeed's run of the same model and config (its exact error when it fails)."""
    ds_config = {k: v for k, v in config.items() if k != "strata"}
    ds_config["zero_optimization"] = dict(ds_config["zero_optimization"],
                                          sub_group_size=args.ds_sub_group_size,
                                          **json.loads(args.ds_zero))
    code = DS_CHILD.format(examples=os.path.join(HERE, "..", "examples"), bench=HERE,
                           args=json.dumps(dict(vars(args), result=result)),
                           config=json.dumps(ds_config))
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), text=True,
                              capture_output=True, timeout=args.ds_timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"did not finish in {args.ds_timeout} s",
                "output": (e.stdout or "")[-2000:] if isinstance(e.stdout, str) else ""}
    print("\n".join(line for line in proc.stdout.splitlines() if "deepspeed step" in line))
    if proc.returncode != 0 or not os.path.exists(result):
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-12:]
        return {"error": f"exited {proc.returncode}: " + "\n".join(tail)}
    with open(result, encoding="utf-8") as f:
        out = json.load(f)
    out["wall_s"] = time.perf_counter() - started
    return out


def deepspeed_run(args, nvme, largest):
    """DeepSpeed's run (run_deepspeed) in a folder of its own, strata's files removed first."""
    shutil.rmtree(nvme, ignore_errors=True)
    shutil.rmtree(os.path.join(args.dir, "checkpoint"), ignore_errors=True)
    ds_nvme = nvme + "_deepspeed"
    shutil.rmtree(ds_nvme, ignore_errors=True)
    ds = run_deepspeed(args, config_for(args, ds_nvme, largest),
                       os.path.join(args.dir, "run_deepspeed.json"))
    shutil.rmtree(ds_nvme, ignore_errors=True)
    return ds


def run_child(args, config, resume, result):
    child_args = dict(vars(args), resume=resume, result=result,
                      checkpoint=os.path.join(args.dir, "checkpoint"))
    code = CHILD.format(examples=os.path.join(HERE, "..", "examples"), bench=HERE,
                        args=json.dumps(child_args), config=json.dumps(config))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), text=True)
    if proc.returncode != 0:
        sys.exit(f"bigger_than_ram: run {'B' if resume else 'A'} exited {proc.returncode}")
    with open(result, encoding="utf-8") as f:
        out = json.load(f)
    out["wall_s"] = time.perf_counter() - started
    return out


def matmul_tflops(threads, device="cpu"):
    """This CPU's (or GPU's) bf16 matmul rate (the planner's "GPU"), TFLOPS."""
    import torch
    torch.set_num_threads(threads)
    n, reps = (2048, 5) if device == "cpu" else (8192, 20)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


_calibrated = {}  # this run's strata_plan --calibrate description and matmul rate


def disk_rates(args):
    """The disk's (read, write) bytes per second under --dir: fio's, else strata's aio_bench at
    fio's point (--aio-bench: the lent GPU machines have no fio); None for each it could not
    measure. What measured them goes in args.disk_tool."""
    read_bps, tool = disk_bandwidth(args.dir, False, args.aio_bench)
    write_bps, _ = disk_bandwidth(args.dir, True, args.aio_bench)
    args.disk_tool = tool or "nothing"
    return read_bps, write_bps


def describe(args, read_bps, write_bps, free_bytes):
    """This machine's description for strata_plan (its path), or an error line: --calibrate here,
    the disk from fio in the same run, the "GPU" this device's bf16 matmul measured."""
    import torch
    folder = os.path.join(args.dir, "plan")
    os.makedirs(folder, exist_ok=True)
    hardware = os.path.join(folder, "hardware.json")
    if "hw" not in _calibrated:  # measured once a run (--largest describes the machine first)
        tflops = matmul_tflops(args.threads, args.device)
        hbm_gib = args.device_budget_gib
        if args.device == "cuda":
            hbm_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        calibrate = subprocess.run(
            [args.plan, "--calibrate", "--gpu-tflops", f"{tflops:.4f}", "--gpu-hbm-gib",
             f"{hbm_gib:.1f}", "--calibrate-device",
             "cuda" if args.device == "cuda" else "emulated", "--save-hardware", hardware],
            capture_output=True, text=True)
        if calibrate.returncode != 0 or not os.path.exists(hardware):
            return {"error": f"strata_plan --calibrate exited {calibrate.returncode}: "
                             f"{calibrate.stderr[-1000:]}"}
        with open(hardware, encoding="utf-8") as f:
            _calibrated.update(hw=json.load(f), tflops=tflops)
    hw, tflops = json.loads(json.dumps(_calibrated["hw"])), _calibrated["tflops"]
    hw["nvme"] = {"drives": 1, "read_gbps": read_bps / 1e9, "write_gbps": write_bps / 1e9,
                  "capacity_tb": free_bytes / 1e12}
    hw["gpu"]["efficiency"] = 1.0  # the rate given is the one measured
    hw["source"] = (hw.get("source", "") + f"; NVMe from {args.disk_tool} in the same run; the "
                    f"'GPU' is this "
                    f"{'GPU' if args.device == 'cuda' else 'CPU'}'s bf16 matmul, {tflops:.3f} "
                    "TFLOPS measured")
    with open(hardware, "w", encoding="utf-8") as f:
        json.dump(hw, f)
    return hardware, tflops


def planner(args, config, read_bps, write_bps, free_bytes):
    """strata_plan's step for this run on this machine, or an error line."""
    import torch
    from llama import llama
    folder = os.path.join(args.dir, "plan")
    os.makedirs(folder, exist_ok=True)
    with torch.device("meta"):
        model = llama(args.layers, args.width, args.heads, args.context, vocab=args.vocab)
    model.config.to_json_file(os.path.join(folder, "config.json"))
    with open(os.path.join(folder, "ds_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    described = describe(args, read_bps, write_bps, free_bytes)
    if isinstance(described, dict):
        return described
    hardware, tflops = described
    plan_json = os.path.join(folder, "plan.json")
    run = subprocess.run(
        [args.plan, "--model", os.path.join(folder, "config.json"), "--hardware", hardware,
         "--config", os.path.join(folder, "ds_config.json"), "--sequence", str(args.context),
         "--micro-batch", str(args.batch), "--nocheckpointing", "--json", plan_json],
        capture_output=True, text=True)
    print(run.stdout[-3000:])
    if not os.path.exists(plan_json):
        return {"error": f"strata_plan exited {run.returncode}: {run.stderr[-1000:]}"}
    with open(plan_json, encoding="utf-8") as f:
        plan = json.load(f)
    step = plan.get("step") or {"error": "no step predicted"}
    step["tflops_given"] = tflops
    return step


def largest_model(args, nvme):
    """--largest: the largest model of examples/llama.py's family strata_plan finds for this run's
    config on this machine (planner/plan_largest.h), its shape set in args; returns fio's (read,
    write) rates, measured for it. The description is
    --calibrate's with the disk from fio, its host memory the host budget (what strata may hold
    there), and its disk the share of the free space the optimizer's state may take beside the
    rest this run puts there (needs(): the checkpoint, the gradients' spill, the weights)."""
    read_bps, write_bps = disk_rates(args)
    if not (read_bps and write_bps):
        sys.exit("bigger_than_ram: --largest needs the disk's rates for the planner: fio, or "
                 "strata's aio_bench (--aio-bench PATH)")
    stat = os.statvfs(args.dir)
    free = stat.f_bavail * stat.f_frsize
    if args.largest_disk_gib:
        free = min(free, args.largest_disk_gib * GIB)
    disk, _ = needs(args, 1, 0)  # bytes a parameter, and the fixed slack
    slack = disk.pop("fio's scratch file and slack")
    state = 12 * (1 if args.commit == "partition" else 2) + \
        (2 if args.param_device == "nvme" else 0)  # what the planner's NVMe tier holds
    described = describe(args, read_bps, write_bps, max(0, free - slack) * state /
                         sum(disk.values()))
    if isinstance(described, dict):
        sys.exit(f"bigger_than_ram: {described['error']}")
    hardware, _ = described
    with open(hardware, encoding="utf-8") as f:
        hw = json.load(f)
    hw["host"]["ram_gib"] = args.host_budget_gib
    hw["source"] += "; the host memory: the run's host budget; the disk: the optimizer's share"
    with open(hardware, "w", encoding="utf-8") as f:
        json.dump(hw, f)
    folder = os.path.dirname(hardware)
    config = config_for(args, nvme, 0)
    if not args.nvme_capacity_gib:  # (sized for the model once it is known)
        del config["strata"]["nvme_capacity_bytes"]
    # The parameters' staging buffers are sized for the model once it is known (the planner's
    # default until then).
    config["zero_optimization"]["offload_param"].pop("buffer_size", None)
    with open(os.path.join(folder, "ds_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    run = subprocess.run(
        [args.plan, "--largest", "--hardware", hardware, "--config",
         os.path.join(folder, "ds_config.json"), "--vocab", str(args.vocab), "--sequence",
         str(args.context), "--micro-batch", str(args.batch), "--nocheckpointing",
         "--save-model", os.path.join(folder, "largest.json")], capture_output=True, text=True)
    print("\n".join(s for s in run.stdout.splitlines() if s.startswith("--largest")))
    if run.returncode != 0:
        sys.exit(f"bigger_than_ram: strata_plan --largest exited {run.returncode}: "
                 f"{(run.stdout + run.stderr)[-1500:]}")
    with open(os.path.join(folder, "largest.json"), encoding="utf-8") as f:
        found = json.load(f)
    args.layers, args.width = found["num_hidden_layers"], found["hidden_size"]
    args.heads = found["num_attention_heads"]
    return read_bps, write_bps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="scratch folder on the disk (the NVMe tier)")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-after", type=int, default=2)
    parser.add_argument("--host-budget-gib", type=int, default=4)
    parser.add_argument("--device-budget-gib", type=int, default=1)
    parser.add_argument("--nvme-capacity-gib", type=int, default=0,
                        help="strata.nvme_capacity_bytes in GiB (0: what the run needs)")
    parser.add_argument("--margin-gib", type=int, default=3)
    parser.add_argument("--commit", choices=["partition", "step"], default="partition",
                        help="strata.optimizer_commit")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--plan", help="strata_plan's path: its prediction beside the step")
    parser.add_argument("--aio-bench", help="strata's aio_bench binary: the disk's rates where "
                                            "fio is missing")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model computes: this CPU beside strata's emulated "
                             "device tier, or GPU 0 (strata.device \"cuda\")")
    parser.add_argument("--deepspeed", action="store_true",
                        help="also run DeepSpeed ZeRO-Infinity on the same model and config")
    parser.add_argument("--ds-sub-group-size", type=int, default=100_000_000)
    parser.add_argument("--param-device", choices=["nvme", "cpu"], default="nvme",
                        help="offload_param's device (both systems): cpu holds the bf16 "
                             "weights in host memory, the optimizer state still on NVMe")
    parser.add_argument("--deepspeed-only", action="store_true",
                        help="DeepSpeed's run alone (fio before it), to try its settings")
    parser.add_argument("--ds-zero", default="{}", metavar="JSON",
                        help="more zero_optimization keys for DeepSpeed's run only (its "
                             "workarounds: stage3_prefetch_bucket_size 0, say)")
    parser.add_argument("--ds-timeout", type=int, default=3600)
    parser.add_argument("--largest", action="store_true",
                        help="the model: the largest of examples/llama.py's family strata_plan "
                             "--largest finds for this run on this machine (needs --plan); "
                             "--layers, --width and --heads ignored")
    parser.add_argument("--largest-disk-gib", type=int, default=0,
                        help="with --largest: the disk space it may plan for (0: the free "
                             "space under --dir)")
    args = parser.parse_args()
    if not 1 <= args.save_after < args.steps:
        sys.exit("bigger_than_ram: --save-after must be at least 1 and below --steps (the "
                 "resumed run takes the steps after it)")
    if args.largest and not args.plan:
        sys.exit("bigger_than_ram: --largest needs --plan (strata_plan's path)")
    os.makedirs(args.dir, exist_ok=True)
    nvme = os.path.join(args.dir, "nvme")
    rates = largest_model(args, nvme) if args.largest else None
    params, largest = shape(args)
    need = preflight(args, params, largest)
    if args.nvme_capacity_gib == 0:
        args.nvme_capacity_gib = -(-int(need - 12 * params - (512 << 20)) // GIB) + 1
    shutil.rmtree(nvme, ignore_errors=True)
    shutil.rmtree(os.path.join(args.dir, "checkpoint"), ignore_errors=True)
    config = config_for(args, nvme, largest)

    read_bps, write_bps = rates or disk_rates(args)
    print(f"{args.disk_tool} under {args.dir}: read {read_bps / 1e9:.2f} GB/s, write "
          f"{write_bps / 1e9:.2f} GB/s" if read_bps and write_bps
          else "the disk's rates: not measured (fio missing or failed, and no --aio-bench or it "
               "failed)")
    stat = os.statvfs(args.dir)
    prediction = (planner(args, config, read_bps, write_bps, stat.f_bavail * stat.f_frsize)
                  if args.plan and read_bps and write_bps and not args.deepspeed_only else None)

    if args.deepspeed_only:  # a try of DeepSpeed's settings, without strata's runs before it
        ds = deepspeed_run(args, nvme, largest)
        if "error" in ds:
            sys.exit(f"bigger_than_ram/deepspeed: DeepSpeed {ds['error']}")
        for s in ds["steps"]:
            print(f"bigger_than_ram/deepspeed: step {s['step']} {s['seconds']:.1f} s, read "
                  f"{s['read'] / GIB:.1f} GiB, written {s['written'] / GIB:.1f} GiB, peak RSS "
                  f"{s['peak_rss'] / GIB:.2f} GiB")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"params": params, "disk_read_bps": read_bps,
                           "disk_write_bps": write_bps, "disk_tool": args.disk_tool,
                           "deepspeed": ds}, f, indent=1)
        return
    a = run_child(args, config, False, os.path.join(args.dir, "run_a.json"))
    b = run_child(args, config, True, os.path.join(args.dir, "run_b.json"))
    read_bps_after, write_bps_after = disk_rates(args)

    resumed = {s: (a["losses"][s], b["losses"][s]) for s in b["losses"]}
    matches = all(x == y for x, y in resumed.values()) and bool(resumed)
    steady = [s for s in a["steps"] if s["step"] > 1] or a["steps"]
    step_s = sorted(s["seconds"] for s in steady)[len(steady) // 2]
    read = sorted(s["read"] for s in steady)[len(steady) // 2]
    written = sorted(s["written"] for s in steady)[len(steady) // 2]
    peak = max(s["peak_rss"] for s in a["steps"] + b["steps"])
    report = {"params": params, "fp32_state_bytes": 16 * params, "config": config,
              "disk_read_bps": [read_bps, read_bps_after],
              "disk_write_bps": [write_bps, write_bps_after], "disk_tool": args.disk_tool,
              "run_a": a, "run_b": b,
              "resumed_losses": resumed, "resume_matches": matches, "step_s": step_s,
              "read_per_step": read, "written_per_step": written, "peak_rss": peak,
              "prediction": prediction}
    where = "on GPU 0" if args.device == "cuda" else f"on this CPU ({os.cpu_count()} cores)"
    print(f"\nmodel: transformers LlamaForCausalLM, {params / 1e9:.2f}B parameters ({args.layers} "
          f"layers x {args.width}), batch {args.batch} x {args.context}, bf16, {where}; fp32 "
          f"training state {16 * params / GIB:.1f} GiB")
    print(f"bigger_than_ram/peak_rss: {peak / GIB:.2f} GiB (host budget {args.host_budget_gib} "
          + (f"GiB; device budget {args.device_budget_gib} GiB on the GPU)" if args.device == "cuda"
             else f"GiB + device budget {args.device_budget_gib} GiB, the emulated device being "
                  "host memory)"))
    if args.device == "cuda":
        gpu = [s["peak_gpu"] for s in a["steps"] + b["steps"]]
        report["peak_gpu"] = {k: max(g[k] for g in gpu) for k in gpu[0]}
        print(f"bigger_than_ram/peak_gpu: torch's {report['peak_gpu']['torch'] / GIB:.2f} GiB, "
              f"strata's device pool {report['peak_gpu']['strata_pool'] / GIB:.2f} GiB, the GPU "
              f"in use {report['peak_gpu']['in_use'] / GIB:.2f} GiB")
    if read_bps and write_bps:
        rates = [(r, w) for r, w in ((read_bps, write_bps), (read_bps_after, write_bps_after))
                 if r and w]
        floors = [read / r + written / w for r, w in rates]
        report["disk_floor_s"] = floors
        print(f"bigger_than_ram/step_s: {step_s:.1f} s a step (median of steps 2-{args.steps}); "
              f"its disk floor (read {read / GIB:.1f} GiB, written {written / GIB:.1f} GiB at "
              f"{args.disk_tool}'s rates before and after the runs) "
              f"{min(floors):.1f}-{max(floors):.1f} s: "
              f"strata {min(floors) / step_s:.2f}-{max(floors) / step_s:.2f} of the floor's "
              "rate")
    if prediction is not None:
        if "error" in prediction:
            print(f"bigger_than_ram/planner: {prediction['error']}")
        else:
            print(f"bigger_than_ram/planner: predicted {prediction['seconds']:.1f} s a step "
                  f"(its bound {prediction['lower_bound_seconds']:.1f} s); "
                  f"measured {step_s:.1f} s = {prediction['seconds'] / step_s:.2f}x the "
                  "prediction's rate")
    print(f"bigger_than_ram/resume: steps {', '.join(sorted(resumed))} after the checkpoint "
          f"{'match' if matches else 'DO NOT match'} the run that did not stop: "
          + "; ".join(f"{s}: {x!r} vs {y!r}" for s, (x, y) in sorted(resumed.items())))
    print(f"build {a['build_s']:.0f} s, checkpoint save {a.get('save_s', 0):.0f} s, load "
          f"{b.get('load_s', 0):.0f} s")
    if args.deepspeed:
        ds = deepspeed_run(args, nvme, largest)
        report["deepspeed"] = ds
        if "error" in ds:
            print(f"bigger_than_ram/deepspeed: DeepSpeed {ds['error']}")
        else:
            ds_steady = [s for s in ds["steps"] if s["step"] > 1] or ds["steps"]
            ds_step = sorted(s["seconds"] for s in ds_steady)[len(ds_steady) // 2]
            ds_peak = max(s["peak_rss"] for s in ds["steps"])
            print(f"bigger_than_ram/deepspeed: strata {ds_step / step_s:.2f}x DeepSpeed's step "
                  f"rate ({step_s:.1f} s vs {ds_step:.1f} s); peak RSS {peak / GIB:.2f} vs "
                  f"{ds_peak / GIB:.2f} GiB ({peak / ds_peak:.2f}x); losses not comparable: each "
                  "system initializes the weights its own way under its init context (strata "
                  f"{a['losses']['1']:.4f}, DeepSpeed {ds['losses']['1']:.4f} at step 1)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if not matches:
        sys.exit(1)


if __name__ == "__main__":
    main()
