"""bench/vs_deepspeed: strata against DeepSpeed itself, the same model, batches and config, in one run.

    PYTHONPATH=build/release/python .venv/bin/python bench/vs_deepspeed.py --dir SCRATCH \
        [--json out.json] [--png out.png] [--rounds 3] [--steps 4] [--rows zero2_cpu,...] \
        [--device cpu|cuda]

DeepSpeed (bench/requirements-deepspeed.txt: 0.19.8, a source package) is installed into the
project's environment by `scripts/python-env.sh --deepspeed` (make bench does it); it builds the
ops it uses (CPU Adam, async I/O) with ninja on first use, as it does for its users.

--device cpu (the default): both compute on the CPU, DeepSpeed with DS_ACCELERATOR=cpu (its
communication on Gloo where oneCCL is absent), strata on its host-emulated device tier (no strata
block: its defaults).
--device cuda (torch must see a CUDA device; it stops at once, saying so, where none is): both
compute on GPU 0. DeepSpeed with its CUDA accelerator (one process, torch.distributed on NCCL);
its async I/O op (the NVMe row) is built with the CUDA toolkit (CUDA_HOME) and needs libaio's
headers and library where gcc finds them (CPATH, LIBRARY_PATH). strata gets, in its copy of the
config only, a strata block: device "cuda"; device_budget_bytes at stage 3 a quarter of the
model's parameters in the training dtype (or, if more, room for the largest one with its fp32
gradient and half as much again: tests/python/test_cuda.py's rule), so that those rows offload
for real, and at stages 1-2 (where the parameters stay on the device) the whole model's
parameters; host_budget_bytes twice the training state (parameters, gradients, fp32 master
weights and moments), at least 1 GiB, as bench/train_step.py sizes it; on the NVMe row,
nvme_capacity_bytes room for the optimizer state twice over, at least the default 16 GiB. The
batches are made on the CPU from the same seeds and moved to the GPU before each step's clock
starts; the GPU is synchronized before the clock starts and before it stops.

One transformers LlamaForCausalLM (examples/llama.py), the same seed, batches and DeepSpeed JSON
config, handed verbatim to `deepspeed.initialize` and to `strata.initialize`, for each row:
  zero2_cpu      ZeRO-2, offload_optimizer cpu (ZeRO-Offload)
  zero3_cpu      ZeRO-3, offload_param and offload_optimizer cpu
  zero3_nvme     ZeRO-3, both on NVMe (ZeRO-Infinity), one aio block for both (--aio-block: the
                 sweep's best.json; else the one below)
  zero3_nvme_half, zero3_nvme_quarter
                 the same with strata's host_budget_bytes a half (a quarter) of the fp32
                 optimizer state, so that the state is read from NVMe every step, and the
                 parameters' staging buffers (offload_param.buffer_size, both systems) the
                 largest parameter's elements; DeepSpeed has no host budget: its memory is what it
                 takes, measured beside. Each system's bytes read and written a step, beside the
                 state's size
  zenflow        DeepSpeed's ZenFlow (ZeRO-2 + cpu offload, overlap_step) beside strata's default
                 for that config (ZenFlow updates the unimportant gradients' columns late: its
                 losses are not the same arithmetic and are not held to the tolerance)
  super_offload  DeepSpeed's asynchronous CPU-offload optimizer (ZeRO-3, super_offload) beside
                 strata's default (the same arithmetic: held to the tolerance)
  trainer        transformers' Trainer, the same TrainingArguments (max_grad_norm the config's
                 clipping, a WarmupLR block, "auto" values as Trainer users write them):
                 TrainingArguments(deepspeed=config) beside strata.hf.Trainer(strata_config=
                 config); ZeRO-2, offload_optimizer cpu. Its step is Trainer's, timed by a
                 callback (on_step_begin to on_step_end); the loss is the model's own (labels the
                 inputs), not the other rows'.
  zero2_cpu_2ranks, zero3_cpu_2ranks
                 zero2_cpu and zero3_cpu across 2 ranks (below)
Each system runs in a process of its own (its memory measured alone), two warm-up steps and then
--steps timed ones; the rows and the two systems interleave round by round, the order of the two
alternating. Each row reports: the step time (median of the rounds' medians, and the spread of
every timed step), peak resident memory (VmHWM), peak locked memory (VmLck, sampled every 5 ms),
the bytes the process read from and wrote to storage per step (/proc/self/io: under the NVMe
folder, as nothing else is read or written during the steps), and both systems' losses, which
must agree within --tolerance (else the row's comparison is void and says so), and how each of
strata's timed optimizer steps was taken (held, staged during backward, or after it; and written
behind it, strata.optimizer_write_behind, with how long the next step waited for those writes; the
window of /proc/self/io then holds the writes behind the last warm-up step and not those behind
the last timed one: the same bytes in a steady run; the bytes of optimizer state a step found
in strata's read-ahead room as the step before committed it, and did not read; and how long
strata's step() after backward took, and of it how long it waited for the device (on a GPU below
stage 3: backward's queued work and the gradients' copies to the host) and for the optimizer's
commit: engine.last_step_stats). A row DeepSpeed
cannot run is kept with its exact error. The NVMe row also gives each system's disk floor: its own
bytes read and written a step at fio's read and write rates in the scratch folder (bench/
fio_ceiling.py, measured once a round; left out where fio is missing). On cuda each row also
reports each system's peak GPU memory: torch's (torch.cuda.max_memory_allocated), strata's own
device tier beside it (engine.stats() peak_bytes["device"], a CUDA memory pool of its own that
torch does not count), and the whole GPU's in use (total less free, cudaMemGetInfo, after each
step: the CUDA context, torch's cache and strata's pool included); the report and the table name
the GPU (torch.cuda.get_device_name).
Where a row's step goes: --phases N takes N more steps after the timed ones, each split into
forward, backward and the step after backward, each waited for (the GPU synchronized) before the
next starts; --profile one more step under torch.profiler (the top ops by self time on the host,
and on cuda on the GPU, with how long the GPU was busy). Neither touches the timed figures.

The floor: plain PyTorch on the same model, batches and optimizer (torch's AdamW with the
config's lr, weight decay and betas, clip_grad_norm_ as gradient_clipping, bf16 weights with
--bf16), everything on the compute device and nothing offloaded, run once a round in a process of
its own beside the rows (--no-floor leaves it out), after four warm-up steps rather than two
(torch's AdamW and allocator take three or four steps to settle here). An offloading system can
come in under it by a faster optimizer step (both systems' CPU Adam against torch's AdamW) and by
this machine's spread: where a row's figures sit near it, that row is at the model's own compute
here, and the ratio between the two systems there is about how far the slower one is from the
floor. Printed beside each row as each system's step rate / the floor's, and once with its own
split under --phases. With --bf16 the floor's weights are bf16 (no fp32 master weights): its
losses are not compared then.

The bound (with the floor): each row's step cannot be shorter than max(the forward + backward
of plain PyTorch on the compute device; strata's CPU Adam stepping the model's fp32 master weights
and moments in one chunk on every core; on cuda, the host link's bytes a step at its measured
rates: the gradients down and the new weights up in the training dtype, at stage 3 the weights up
once more for backward but for what the row's device budget keeps; on the NVMe row, the optimizer
state read and written once at the disk's rates), each part measured in the floor's process of
each round after its timed steps (bound_parts). Printed beside each row as each system's step over
the bound (1 is at it). The NVMe row's disk rates are fio's where fio is installed, else
strata's aio_bench at the row's aio block (--aio-bench: its path), and say which. --clipping sets
the config's gradient_clipping (default 1.0; 0: none, where strata can step its optimizer during
backward exactly).

Across ranks (a row named <row>_<N>ranks: <row> on N ranks; --device cpu only, as strata
across ranks runs on its emulated device tier, docs/ranks.md): each system runs as N processes of
one job on this machine, as torchrun starts them (MASTER_ADDR 127.0.0.1, a free MASTER_PORT,
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE N; each rank's OMP_NUM_THREADS the cores shared among
the ranks, at least 1, where the environment does not set it: torchrun sets 1). strata joins the
job itself (its own store on MASTER_PORT + 1; its collectives through shared memory, as all the
ranks are on one host, unless --strata '{"comm_transport": "tcp"}': Gloo over loopback; the
report names them); DeepSpeed's deepspeed.initialize joins it
with torch.distributed on Gloo (its CPU accelerator's choice where oneCCL is absent). The global
batch is --batch, the same as the one-process rows' and the floor's: the config's
train_batch_size is --batch and train_micro_batch_size_per_gpu --batch / N (one accumulation
step), and each rank takes its slice of each batch made from the same seed (rank r the r-th N-th
of its rows). Reported per system: the step time, each timed step the slowest rank's (the job's:
the ranks meet in the collectives), then the median as above; the losses, the ranks' mean each
step (the global batch's loss, held to --tolerance and comparable with the one-process row's);
peak resident and locked memory and the bytes read and written summed over the ranks (each
rank's VmHWM beside); --phases, --profile and strata's optimizer-step figures are rank 0's. The
floor and the bound are the one-process ones (the same global batch on every core). The N ranks
start together, each in a session of its own; when one fails (its report not written) the
others are killed with every process of their sessions, and the row keeps the failed rank's
exact error, each of its lines marked [rank<r>]; past --child-timeout the whole job is killed.
A rank that exits with an error after writing its whole report (DeepSpeed's ZeRO-3 rank once
aborted at exit here: "terminate called without an active exception") keeps its figures, and the
row says how it exited.

Every figure is printed as strata / DeepSpeed; a step-rate ratio above 1 means strata is faster.
"""
import argparse
import json
import os
import platform
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fio_ceiling import disk_bandwidth  # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from launch import free_port  # noqa: E402
ROWS = ["zero2_cpu", "zero3_cpu", "zero3_nvme", "zero3_nvme_half", "zero3_nvme_quarter",
        "zenflow", "super_offload", "trainer", "zero2_cpu_2ranks", "zero3_cpu_2ranks"]
# A row across ranks: "<row>_<N>ranks" is <row> on N ranks (the module's docstring).
ACROSS_RANKS = re.compile(r"^(?P<row>.+)_(?P<ranks>\d+)ranks$")
# The launcher's variables, set anew for each rank of a row across ranks.
LAUNCH_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")
# ZeRO-Infinity with strata's host budget below the optimizer state: that share of it.
STATE_SHARE = {"zero3_nvme_half": 0.5, "zero3_nvme_quarter": 0.25}
# Rows whose DeepSpeed side is not the same arithmetic as plain AdamW.
APPROXIMATE = {"zenflow"}
# On cuda, each child's peak GPU memory (the module docstring says what each counts).
GPU_KEYS = ("gpu_peak_bytes", "gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes",
            "gpu_peak_used_bytes", "gpu_strata_tier_peak_bytes")
DEFAULT_AIO = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1,
               "single_submit": False, "overlap_events": True}


def ranks_of(row):
    """The ranks `row` runs on: N for "<row>_<N>ranks", else 1."""
    across = ACROSS_RANKS.match(row)
    return int(across["ranks"]) if across else 1


def one_process_row(row):
    """The row that `row` runs across ranks ("zero2_cpu" for "zero2_cpu_2ranks"), else `row`."""
    across = ACROSS_RANKS.match(row)
    return across["row"] if across else row


def row_config(row, args, nvme):
    """The DeepSpeed JSON config of `row`: (DeepSpeed's, strata's). Verbatim the same but for the
    zenflow and super_offload rows, where strata gets the config without DeepSpeed's option (its
    default for it), and on cuda, where strata's copy alone gets a strata block (strata_block).
    A row across N ranks is its one-process row's config with train_batch_size --batch and the
    micro batch --batch / N."""
    world = ranks_of(row)
    zero = {"stage": row_stage(row),
            "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    place = "nvme" if one_process_row(row).startswith("zero3_nvme") else "cpu"
    zero["offload_optimizer"] = {"device": place, "pin_memory": True}
    if zero["stage"] == 3:
        zero["offload_param"] = {"device": place, "pin_memory": True}
        zero["stage3_prefetch_bucket_size"] = 50_000_000
        zero["stage3_param_persistence_threshold"] = 10_000
    if place == "nvme":
        zero["offload_optimizer"].update(nvme_path=nvme, pipeline_read=True, pipeline_write=True)
        # (Below the state, buffers of the largest parameter: DeepSpeed's parameter swapper
        # needs one to hold it, and strata's host budget holds them.)
        zero["offload_param"].update(
            nvme_path=nvme, buffer_count=5,
            buffer_size=args.model_largest if row in STATE_SHARE else args.nvme_buffer_elements)
    config = {"train_micro_batch_size_per_gpu": args.batch // world,
              "gradient_accumulation_steps": 1,
              "gradient_clipping": args.clipping, "steps_per_print": 1 << 30,
              "wall_clock_breakdown": False,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": zero}
    if world > 1:  # micro batch x accumulation x the ranks
        config["train_batch_size"] = args.batch
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if place == "nvme":
        config["aio"] = dict(args.aio)
    ours = json.loads(json.dumps(config))
    if args.device == "cuda":
        ours["strata"] = strata_block(zero["stage"], place, args)
    if row in STATE_SHARE:  # strata's host budget: that share of the fp32 optimizer state
        ours.setdefault("strata", {})["host_budget_bytes"] = \
            int(STATE_SHARE[row] * 12 * args.model_params)
    extra = getattr(args, "strata_extra", None)
    if extra:  # --strata: strata's copy alone, said in the report
        ours.setdefault("strata", {}).update(extra)
    if row == "trainer":  # as a Trainer user writes it: Trainer fills the "auto" values
        for c in (config, ours):
            c.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                     gradient_clipping="auto")
            c["optimizer"]["params"] = {k: "auto" for k in ("lr", "betas", "eps",
                                                             "weight_decay")}
            c["scheduler"] = {"type": "WarmupLR", "params": {
                "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
            if args.bf16:
                c["bf16"] = {"enabled": "auto"}
    if row == "zenflow":
        config["zero_optimization"]["zenflow"] = {
            "topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step",
            "select_interval": 4, "overlap_step": True, "full_warm_up_rounds": 0}
    if row == "super_offload":
        config["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    return config, ours


def model_shape(args):
    """(parameters, the largest parameter's elements) of the model the rows train, counted on
    torch's meta device (nothing allocated)."""
    import torch
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from llama import llama
    with torch.device("meta"):
        model = llama(args.layers, args.width, args.heads, args.context)
    sizes = [p.numel() for p in model.parameters()]
    return sum(sizes), max(sizes)


def strata_block(stage, place, args):
    """strata's own block on cuda (the module docstring says why each size)."""
    element = 2 if args.bf16 else 4  # the training dtype's bytes
    params, largest = args.model_params, args.model_largest
    if stage == 3:
        device = max(params * element // 4, largest * (element + 4) * 3 // 2)
    else:
        device = params * element
    block = {"device": "cuda", "device_budget_bytes": device,
             "host_budget_bytes": max(1 << 30, 2 * params * (2 * element + 12))}
    if place == "nvme":
        block["nvme_capacity_bytes"] = max(16 << 30, 2 * params * (2 * 12 + element))
    return block


# ---- the child: one system, one row ----------------------------------------------------------

class LockedPeak:
    """VmLck's peak, sampled every 5 ms on a thread (the kernel keeps no peak of it)."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, status_kib("VmLck"))

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib("VmLck"))
        return self.peak


def status_kib(key):
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def io_bytes():
    """(read_bytes, write_bytes) this process made the block layer read and write."""
    out = {}
    with open("/proc/self/io", encoding="utf-8") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out["read_bytes"], out["write_bytes"]


def next_batch(spec, gen, cuda):
    """The next batch of token ids from `gen`, on the GPU (synchronized) with cuda; across ranks
    this rank's slice of it (every rank draws the whole batch from `gen`)."""
    import torch
    x = torch.randint(0, 256, (spec["batch"], spec["context"]), generator=gen)
    world = spec.get("world", 1)
    if world > 1:
        per = spec["batch"] // world
        x = x[spec["rank"] * per:(spec["rank"] + 1) * per]
    if cuda:
        x = x.cuda()
        torch.cuda.synchronize()
    return x


def train_step(engine, x):
    """One training step of `engine` on batch `x`: its loss."""
    import torch
    from llama import loss_of
    loss = loss_of(engine, x, torch.roll(x, -1, 1))
    engine.backward(loss)
    engine.step()
    return loss


def split_phases(engine, spec, gen, cuda):
    """After the timed steps, spec["phases"] more, each split into forward, backward and step
    (the engine's call after backward), the GPU synchronized before each clock reading, so that a
    phase is what it runs until its work is done: {phase: [seconds a step]}. Not the timed steps:
    waiting between phases takes away what one phase would overlap with the next (write-behind's
    writes still overlap the forward: they run on strata's own threads)."""
    import torch
    from llama import loss_of

    def now():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    split = {"forward": [], "backward": [], "step": []}
    for _ in range(spec["phases"]):
        x = next_batch(spec, gen, cuda)
        t0 = now()
        loss = loss_of(engine, x, torch.roll(x, -1, 1))
        t1 = now()
        engine.backward(loss)
        t2 = now()
        engine.step()
        t3 = now()
        for key, seconds in zip(split, (t1 - t0, t2 - t1, t3 - t2)):
            split[key].append(seconds)
    return split


def profile_step(engine, spec, gen, cuda, top=15):
    """One more step under torch.profiler (the CPU's ops, and the GPU's kernels and copies on
    cuda): the `top` ops by self time on the host and on the device, and on cuda how long the GPU
    was busy (the union of its kernels' and copies' spans) against the step's wall time. The
    profiler sees torch's ops on every thread that runs them, not strata's C++ threads (its
    optimizer, copy engine and I/O), nor DeepSpeed's C++ ops' inner threads."""
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    x = next_batch(spec, gen, cuda)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        train_step(engine, x)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()

    def ranked(key):
        rows = sorted(averages, key=lambda a: getattr(a, key), reverse=True)[:top]
        return [{"op": a.key, "calls": a.count, "self_ms": getattr(a, key) / 1e3}
                for a in rows if getattr(a, key) > 0]
    out = {"wall_s": wall, "host_ops": ranked("self_cpu_time_total")}
    if cuda:
        out["device_ops"] = ranked("self_device_time_total")
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, end = 0.0, None
        for start, stop in spans:  # microseconds; overlapping spans counted once
            if end is None or start > end:
                busy += stop - start
                end = stop
            elif stop > end:
                busy += stop - end
                end = stop
        out["gpu_busy_s"] = busy / 1e6
    return out


def bound_parts(engine, spec, gen, cuda):
    """The floor's child measures the parts of each row's bound (the module's docstring), after
    its timed steps and its report's peaks: plain PyTorch's forward + backward on the compute
    device (the median of three, each waited for; a step after each, not timed); strata's CPU
    Adam (optim_cpu, one thread per core) stepping the model's parameters in one flat chunk of
    fp32 master weights and moments, with the training dtype's gradient and (bf16) new weights'
    copy, the median of three after one; and on cuda the host link's rates, pinned host memory to
    and from the GPU at the size of the parameters in the training dtype (the median of three
    copies each way, after one)."""
    import torch
    from ceilings import cpu_adam_seconds, link_rates
    from llama import loss_of

    def now():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    fb = []
    for _ in range(3):
        x = next_batch(spec, gen, cuda)
        t0 = now()
        loss = loss_of(engine, x, torch.roll(x, -1, 1))
        engine.backward(loss)
        fb.append(now() - t0)
        engine.step()
    params = sum(p.numel() for p in engine.model.parameters())
    dtype = next(engine.model.parameters()).dtype
    engine.model.to("cpu")  # the optimizer's arrays beside the model's, not both on the GPU
    del engine
    opt = spec["config"]["optimizer"]["params"]
    parts = {"params": params, "element_bytes": torch.tensor([], dtype=dtype).element_size(),
             "forward_backward_s": statistics.median(fb),
             "cpu_adam_s": cpu_adam_seconds(params, dtype, opt["lr"],
                                            opt.get("weight_decay", 0.0))}
    if cuda:
        parts["h2d_bytes_per_s"], parts["d2h_bytes_per_s"] = link_rates(params, dtype)
    return parts


def bound_of(row, parts, block, disk_bps=None):
    """Row `row`'s bound a step from the floor's `parts` (bound_parts) and strata's `block` on cuda
    (its device budget): max(the GPU's forward + backward, the CPU Adam over the state, the host
    link's bytes at its measured rates[, the NVMe row's optimizer state read and written at the
    disk's rates]). The link's bytes: the gradients down and the new weights up (the parameters in
    the training dtype each); at stage 3 the weights come up for forward and again for backward,
    less what the device budget keeps between them. Returns {"bound_s", and each part's s}."""
    n, b = parts["params"], parts["element_bytes"]
    out = {"forward_backward_s": parts["forward_backward_s"], "cpu_adam_s": parts["cpu_adam_s"]}
    if "h2d_bytes_per_s" in parts:
        up = n * b
        if row_stage(row) == 3:
            up += max(0, n * b - (block or {}).get("device_budget_bytes", 0))
        out["host_link_s"] = n * b / parts["d2h_bytes_per_s"] + up / parts["h2d_bytes_per_s"]
    if row.startswith("zero3_nvme") and disk_bps:
        state = 12 * n  # fp32 master weights and both moments, read and written once a step
        out["disk_s"] = state / disk_bps[0] + state / disk_bps[1]
    out["bound_s"] = max(out.values())
    return out


def row_stage(row):
    return 2 if one_process_row(row) in ("zero2_cpu", "zenflow", "trainer") else 3


class PlainTorch:
    """The floor (the module's docstring): `model` in plain PyTorch on `device`, nothing offloaded,
    called as the engines are (engine(x), engine.backward(loss), engine.step())."""

    def __init__(self, model, config, device):
        import torch
        dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else None
        self.model = model.to(device=device, dtype=dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(),
                                           **config["optimizer"]["params"])
        self.clipping = config.get("gradient_clipping", 0.0)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        import torch
        if self.clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def trainer_arguments(spec, output_dir, deepspeed=None):
    """The trainer row's TrainingArguments: as the other rows (batch, lr, weight decay, the
    config's clipping as max_grad_norm, bf16), one micro-batch a step, a log line a step."""
    import transformers
    return transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1, max_steps=spec["warmup"] + spec["steps"],
        learning_rate=1e-3, weight_decay=0.01, max_grad_norm=spec["clipping"],
        warmup_steps=1, bf16=spec["bf16"], logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=spec["device"] != "cuda", seed=0, disable_tqdm=True,
        dataloader_num_workers=0, deepspeed=deepspeed)


def trainer_child(spec, model, system, cuda):
    """The trainer row (the module's docstring): (losses, timed step seconds, the /proc/self/io
    window's start and end)."""
    import torch
    import transformers
    gen = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for _ in range(spec["warmup"] + spec["steps"])
            for ids in torch.randint(0, 256, (spec["batch"], spec["context"]), generator=gen)]
    times, window = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            if state.global_step == spec["warmup"]:
                window.append(io_bytes())
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            if state.global_step > spec["warmup"]:
                times.append(time.perf_counter() - self.t0)

    output = tempfile.mkdtemp(prefix="trainer_row.")
    if system == "deepspeed":
        trainer = transformers.Trainer(
            model=model, args=trainer_arguments(spec, output, deepspeed=spec["config"]),
            train_dataset=rows, callbacks=[Clock()])
    else:
        import strata.hf
        trainer = strata.hf.Trainer(model=model, args=trainer_arguments(spec, output),
                                    train_dataset=rows, callbacks=[Clock()],
                                    strata_config=spec["config"])
    trainer.train()
    window.append(io_bytes())
    shutil.rmtree(output, ignore_errors=True)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, times, window


def run_report(spec, losses, times, io_window, locked, cuda, gpu_used):
    """A child's report: its losses, timed steps, the storage bytes a timed step read and wrote
    (/proc/self/io at the window's start and end), peak resident and locked memory, versions,
    and on cuda the GPU's name and peaks (gpu_used: the whole GPU's bytes in use at the most)."""
    import torch
    (start, end), steps = io_window, spec["steps"]
    report = {"losses": losses, "step_s": times,
              "read_bytes_per_step": (end[0] - start[0]) / steps,
              "write_bytes_per_step": (end[1] - start[1]) / steps,
              "peak_rss_bytes": status_kib("VmHWM") * 1024,
              "peak_locked_bytes": locked.stop() * 1024,
              "versions": {"torch": torch.__version__}}
    if cuda:
        report.update(device_name=torch.cuda.get_device_name(),
                      gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(),
                      gpu_peak_used_bytes=gpu_used)
    return report


def trainer_report(spec, model, system, cuda, locked):
    """The trainer row's child: trains through Trainer (trainer_child) and writes the report the
    other rows write (their fields; strata's engine stats aside)."""
    import torch
    import transformers
    trainer, losses, times, window = trainer_child(spec, model, system, cuda)
    gpu_used = 0
    if cuda:
        free, total = torch.cuda.mem_get_info()
        gpu_used = total - free
    report = run_report(spec, losses, times, window, locked, cuda, gpu_used)
    report["versions"]["transformers"] = transformers.__version__
    if cuda:
        tier = trainer.strata_engine.stats()["peak_bytes"].get("device", 0) \
            if system == "strata" else 0
        report.update(gpu_strata_tier_peak_bytes=tier,
                      gpu_peak_bytes=report["gpu_peak_allocated_bytes"] + tier)
    if system == "strata":
        trainer.strata_engine.close()
    write_report(spec, report)


def write_report(spec, report):
    """Writes a child's report whole or not at all (the driver takes a report that exists as
    whole: a rank that fails after it keeps its figures)."""
    part = spec["out"] + ".part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(part, spec["out"])


def child(spec):
    locked = LockedPeak()
    system = spec["system"]
    cuda = spec["device"] == "cuda"
    world = spec.get("world", 1)
    if world > 1:  # a rank of a job the driver started (run_ranks): its env says which
        spec["rank"] = int(os.environ["RANK"])
        spec["out"] = f"{spec['out']}.rank{spec['rank']}"
    if system == "deepspeed":
        if cuda:
            os.environ["DS_ACCELERATOR"] = "cuda"  # its CUDA accelerator, NCCL on one GPU
        else:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if world == 1:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import torch
    from llama import llama
    torch.manual_seed(0)
    model = llama(spec["layers"], spec["width"], spec["heads"], spec["context"])
    if spec.get("row") == "trainer":
        trainer_report(spec, model, system, cuda, locked)
        return
    if system == "deepspeed":
        import deepspeed
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=spec["config"])
    elif system == "torch":
        engine = PlainTorch(model, spec["config"], "cuda" if cuda else "cpu")
    else:
        import strata
        engine, _, _, _ = strata.initialize(model=model, config=spec["config"])
    gen = torch.Generator().manual_seed(1)
    losses, times, how, behind_waits, reused = [], [], [], [], []
    step_calls = []  # strata: (step() s, of it waiting for the device s, for the commit s)
    by_cause = []  # strata: its NVMe bytes read a step by cause (last_step_stats["nvme"])
    start_io = None
    gpu_used = 0  # the whole GPU's bytes in use, after each step (cudaMemGetInfo: total - free)
    for step in range(spec["warmup"] + spec["steps"]):
        if step == spec["warmup"]:
            start_io = io_bytes()
        x = next_batch(spec, gen, cuda)
        t0 = time.perf_counter()
        loss = train_step(engine, x)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= spec["warmup"]:
            times.append(elapsed)
            if system == "strata":  # how its optimizer step was taken (docs/engine.md)
                taken = engine.last_step_stats["optimizer"] or {}
                how.append("held" if taken.get("held") else
                           "staged" if taken.get("staged") else "after backward")
                if taken.get("written_behind"):  # strata.optimizer_write_behind
                    how[-1] += ", written behind"
                    behind_waits.append(taken.get("behind_wait_seconds", 0.0))
                reused.append(taken.get("bytes_reused", 0))
                stats = engine.last_step_stats
                by_cause.append(stats["nvme"]["read"])
                step_calls.append((stats["step_seconds"], stats["device_wait_seconds"],
                                   taken.get("seconds", 0.0)))
        if cuda:
            free, total = torch.cuda.mem_get_info()
            gpu_used = max(gpu_used, total - free)
    end_io = io_bytes()
    phases = split_phases(engine, spec, gen, cuda) if spec.get("phases") else None
    profile = None
    if spec.get("profile"):
        try:  # a profile that cannot be taken (this torch's profiler) leaves the row's figures
            profile = profile_step(engine, spec, gen, cuda)
        except Exception as error:  # noqa: BLE001 (said in the report)
            profile = {"error": f"{type(error).__name__}: {error}"}
    report = run_report(spec, losses, times, (start_io, end_io), locked, cuda, gpu_used)
    if phases is not None:
        report["phases"] = phases
    if profile is not None:
        report["profile"] = profile
    if system == "deepspeed":
        import deepspeed
        report["versions"]["deepspeed"] = deepspeed.__version__
    elif system == "torch":
        report["bound_parts"] = bound_parts(engine, spec, gen, cuda)
    elif system == "strata":
        import strata
        report["optimizer_steps"] = how
        report["behind_wait_s"] = behind_waits
        report["reused_bytes_per_step"] = sum(reused) / max(len(reused), 1)
        report["read_by_cause"] = {k: statistics.median(c[k] for c in by_cause)
                                   for k in (by_cause[0] if by_cause else {})}
        report["step_calls"] = step_calls
        if engine.ranks is not None:  # where its collectives ran (shared memory, TCP, a group)
            report["collectives"] = engine.ranks.collectives.name
        report["stats"] = {k: v for k, v in engine.stats().items()
                           if k in ("bytes_moved", "peak_bytes", "budget_bytes", "device")}
        if cuda:  # its device tier: a CUDA memory pool of its own, not torch's
            report["gpu_strata_tier_peak_bytes"] = report["stats"]["peak_bytes"].get("device", 0)
        engine.close()
    if cuda:  # torch's peak, and strata's tier's beside it (not at the same moment: an upper bound)
        report["gpu_peak_bytes"] = report["gpu_peak_allocated_bytes"] + \
            report.get("gpu_strata_tier_peak_bytes", 0)
    write_report(spec, report)
    if system == "deepspeed" and world > 1:
        import torch.distributed
        if torch.distributed.is_initialized():  # (its group left as the job ends)
            torch.distributed.destroy_process_group()


# ---- the driver --------------------------------------------------------------------------------

def run_one(system, row, config, args, round_index, scratch):
    """Runs one system on one row in a child process (a row across ranks: a job of child
    processes, run_ranks); its report, or {"error": ...}."""
    nvme = os.path.join(scratch, f"nvme_{system}")
    shutil.rmtree(nvme, ignore_errors=True)
    os.makedirs(nvme)
    config = json.loads(json.dumps(config).replace(json.dumps(args.nvme_placeholder)[1:-1], nvme))
    out = os.path.join(scratch, f"{system}_{row}_{round_index}.json")
    spec = {"system": system, "config": config, "layers": args.layers, "width": args.width,
            "heads": args.heads, "context": args.context, "batch": args.batch,
            "device": args.device, "warmup": 4 if system == "torch" else 2,
            "steps": args.steps, "out": out,
            "phases": args.phases, "profile": args.profile,
            "port": 29500 + round_index, "row": row, "clipping": args.clipping,
            "bf16": args.bf16, "world": ranks_of(row) if system != "torch" else 1}
    spec_path = out + ".spec"
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    if spec["world"] > 1:
        try:
            return run_ranks(spec_path, out, spec["world"], args.child_timeout)
        finally:
            shutil.rmtree(nvme, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec_path],
                              capture_output=True, text=True, env=env,
                              timeout=args.child_timeout)
    except subprocess.TimeoutExpired as expired:  # the row is kept, saying so; the run goes on
        output = expired.stderr or expired.stdout or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        return {"error": stopped(f"ran past --child-timeout {args.child_timeout:g} s and was "
                                 "killed", output), "returncode": None}
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"error": child_error(proc.stderr or proc.stdout, proc.returncode),
                "returncode": proc.returncode}
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def run_ranks(spec_path, out, world, timeout_s):
    """Runs the child of `spec_path` as `world` ranks of one job on loopback (the module's
    docstring: the launcher's variables, OMP_NUM_THREADS), each in a session of its own with its
    output in a file beside `out`, and waits for all of them, at most `timeout_s` in all. A rank
    that exits without its report (`out`.rank<r>) ends the job: every rank's session is killed
    (SIGKILL: the processes a rank started go with it) and waited for, and the row's error is
    that rank's, each line marked [rank<r>]; past `timeout_s` likewise, the error saying so. A
    rank that exits with an error after writing its report keeps it. Returns the ranks' reports
    merged (merge_ranks), or {"error": ..., "returncode": ..., "rank": ...}."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    env.update(PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    outs = [f"{out}.rank{r}" for r in range(world)]
    logs = [f"{out}.rank{r}.log" for r in range(world)]
    procs, exits, failed = [], {}, None
    exited = queue.Queue()  # (rank, its exit status), as each rank's waiter sees it exit
    try:
        for r in range(world):
            with open(logs[r], "w", encoding="utf-8") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--child", spec_path],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
            threading.Thread(target=lambda r=r: exited.put((r, procs[r].wait())),
                             daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while len(exits) < world:
            try:
                r, code = exited.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                failed = "timeout"
                break
            exits[r] = code
            if not os.path.exists(outs[r]):
                failed = r
                break
    finally:
        if failed is not None or len(exits) < world:  # (an exception here too: none left behind)
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in procs:
                p.wait()
    printed = []
    for r in range(world):
        with open(logs[r], encoding="utf-8", errors="replace") as f:
            printed.append("\n".join(line if RANK_PREFIX.match(line) else f"[rank{r}]: {line}"
                                     for line in f.read().splitlines()))
    if failed == "timeout":
        return {"error": stopped(
            f"ran past --child-timeout {timeout_s:g} s and was killed, with the job's {world} "
            "ranks", "\n".join("\n".join(p.splitlines()[-3:]) for p in printed)),
            "returncode": None}
    if failed is not None:
        error = child_error(printed[failed], exits[failed])
        if error.startswith(STOPPED):  # (a signal: say which rank it killed)
            error = f"{STOPPED}rank {failed} of {world} {error[len(STOPPED):]}"
        return {"error": error, "returncode": exits[failed], "rank": failed}
    reports = []
    for r in range(world):
        with open(outs[r], encoding="utf-8") as f:
            reports.append(json.load(f))
        if exits[r] != 0:
            reports[-1]["exit"] = (
                f"rank {r} exited with {exit_name(exits[r])} after writing its report; its "
                f"last line: {printed[r].splitlines()[-1] if printed[r] else '(none)'}")
    return merge_ranks(reports)


def exit_name(code):
    """A process's exit status in words: "exit 1", "SIGABRT"."""
    if code >= 0:
        return f"exit {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def merge_ranks(reports):
    """One job's report from its ranks' (in rank order; the module's docstring): each timed
    step the slowest rank's, the losses the ranks' mean, memory and storage bytes summed over the
    ranks; the rest rank 0's. Each rank's step times, losses and peak RSS kept beside
    (rank_step_s, rank_losses, rank_peak_rss_bytes), and how a rank exited after its report
    (exits)."""
    merged = dict(reports[0])
    merged.pop("exit", None)
    merged["step_s"] = [max(step) for step in zip(*(r["step_s"] for r in reports))]
    merged["losses"] = [statistics.fmean(step) for step in zip(*(r["losses"] for r in reports))]
    for key in ("peak_rss_bytes", "peak_locked_bytes", "read_bytes_per_step",
                "write_bytes_per_step"):
        merged[key] = sum(r[key] for r in reports)
    merged.update(ranks=len(reports), rank_step_s=[r["step_s"] for r in reports],
                  rank_losses=[r["losses"] for r in reports],
                  rank_peak_rss_bytes=[r["peak_rss_bytes"] for r in reports],
                  exits=[r["exit"] for r in reports if "exit" in r])
    return merged


# "[rank0]: " before each line a torch.distributed process prints.
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
# A line that names an exception ("ValueError: ...", "torch.OutOfMemoryError: ..."), for output
# without a traceback.
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt|Exit)\b")


def _bare(line):
    return RANK_PREFIX.sub("", line)


def _raised(lines):
    """The indices of the tracebacks in `lines` of exceptions that were raised: not those Python
    prints at exit after "Exception ignored in: ..." (a destructor's), which come after the
    error."""
    return [i for i, line in enumerate(lines)
            if _bare(line).startswith("Traceback (most recent call last)") and
            not (i > 0 and _bare(lines[i - 1]).startswith("Exception ignored"))]


def _exception_at(lines, header):
    """The index of the line naming the exception of the traceback starting at `header`: the
    first line after it that is not one of its frames (indented), or None."""
    return next((i for i in range(header + 1, len(lines))
                 if _bare(lines[i]).strip() and not _bare(lines[i])[0].isspace()), None)


# The first line of the error of a child stopped from outside (a signal, --child-timeout).
STOPPED = "the child was stopped: "


def stopped(why, output):
    """The error of a child stopped from outside: why, then the last lines it printed (not the
    cause: it was stopped where it was)."""
    return "\n".join([STOPPED + why + "; the last lines it printed:"] +
                      output.strip().splitlines()[-6:])


def child_error(output, returncode):
    """The exact error of a child that failed, as the system gave it: its output from the last
    raised exception's traceback on (where longer than 40 lines: its first line, the 9 frames
    before the exception, and the exception's line with the 29 after it, a long message's), else
    its last 6 lines; a child a signal killed says which."""
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return stopped(f"killed by {name}", output)
    lines = output.strip().splitlines()
    if not lines:
        return f"exit {returncode}"
    raised = _raised(lines)
    if not raised:
        return "\n".join(lines[-6:])
    kept = lines[raised[-1]:]
    if len(kept) > 40:
        at = _exception_at(kept, 0)
        kept = kept[:1] + (kept[-39:] if at is None else kept[max(1, at - 9):at + 30])
    return "\n".join(kept)


def error_line(error):
    """The line of `error` that names the exception: the first after the last raised exception's
    traceback that is not one of its frames (what a process printed after it, NCCL's warnings at
    exit or a destructor's exception, is not the error); a stopped child's first line; without a
    traceback the last line naming an exception, else the last line."""
    lines = error.strip().splitlines() or [error]
    if lines[0].startswith(STOPPED):
        return lines[0]
    raised = _raised(lines)
    at = _exception_at(lines, raised[-1]) if raised else None
    if at is not None:
        return lines[at].strip()
    return next((line.strip() for line in reversed(lines)
                 if EXCEPTION_LINE.match(_bare(line)) and
                 not _bare(line).startswith("Exception ignored")), lines[-1].strip())


def check_strata_configs(rows, args):
    """strata's copy of each row's config read as strata.initialize reads it, before any round: a
    key strata refuses (a misspelt --strata one) stops the run here, not in every strata row after
    its model is built."""
    try:
        import strata
    except ImportError as error:
        sys.exit(f"vs_deepspeed: strata cannot be imported ({error}); accepted: strata built "
                 "(make build) with build/release/python on PYTHONPATH")
    for row in rows:
        try:
            ours = row_config(row, args, args.nvme_placeholder)[1]
            if row == "trainer":  # its "auto" values as strata.hf fills them
                import strata.hf
                ours = strata.hf.fill_auto(ours, trainer_arguments(
                    {"batch": args.batch, "warmup": 2, "steps": args.steps, "bf16": args.bf16,
                     "clipping": args.clipping, "device": args.device},
                    tempfile.gettempdir()), num_training_steps=2 + args.steps)
            given_world = os.environ.get("WORLD_SIZE")
            os.environ["WORLD_SIZE"] = str(ranks_of(row))  # as the row's ranks read it
            try:
                strata.check_config(ours)
            finally:
                if given_world is None:
                    del os.environ["WORLD_SIZE"]
                else:
                    os.environ["WORLD_SIZE"] = given_world
        except ValueError as error:
            given = " (with --strata's keys)" if args.strata_extra else ""
            sys.exit(f"vs_deepspeed: strata refuses the {row} row's config{given}: {error}")


def say_round(round_index, row, system, report):
    """One run's line as the rounds go: its median step, or its error's line."""
    what = error_line(report["error"]) if "error" in report else \
        f"{statistics.median(report['step_s']):.3f} s a step"
    print(f"round {round_index} {row:>16} {system:>9}: {what}", flush=True)


def summarize(runs):
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"], **({"rank": runs[0]["rank"]} if "rank" in runs[0]
                                              else {})}
    medians = [statistics.median(r["step_s"]) for r in ok]
    every = [t for r in ok for t in r["step_s"]]
    extra = {k: max(r.get(k, 0) for r in ok) for k in GPU_KEYS if k in ok[0]}
    if extra:
        extra["device_name"] = ok[0]["device_name"]
    if "phases" in ok[0]:  # the median of every split step's, phase by phase, over the rounds
        extra["phases_s"] = {k: statistics.median(t for r in ok for t in r["phases"][k])
                             for k in ok[0]["phases"]}
    if "profile" in ok[0]:
        extra["profiles"] = [r["profile"] for r in ok]
    if "bound_parts" in ok[0]:  # the floor's: each part's median over the rounds
        extra["bound_parts"] = {k: statistics.median(r["bound_parts"][k] for r in ok)
                                for k in ok[0]["bound_parts"]}
    if ok[0].get("step_calls"):  # strata's step() and its waits, medians over every timed step
        calls = [c for r in ok for c in r["step_calls"]]
        extra["step_call_s"] = {k: statistics.median(c[i] for c in calls) for i, k in
                                enumerate(("step", "device_wait", "optimizer_commit"))}
    if "ranks" in ok[0]:  # across ranks (merge_ranks): each rank's peak the most over the rounds,
        # its step times each round's, its losses the first round's
        extra.update(ranks=ok[0]["ranks"], rank_losses=ok[0]["rank_losses"],
                     rank_step_s=[r["rank_step_s"] for r in ok],
                     rank_peak_rss_bytes=[max(r["rank_peak_rss_bytes"][i] for r in ok)
                                          for i in range(ok[0]["ranks"])],
                     exits=[x for r in ok for x in r["exits"]])
        if "collectives" in ok[0]:
            extra["collectives"] = ok[0]["collectives"]
    return {**extra, "step_s": statistics.median(medians), "round_step_s": medians,
            "min_s": min(every),
            "max_s": max(every),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
            "peak_locked_bytes": max(r["peak_locked_bytes"] for r in ok),
            "read_bytes_per_step": statistics.median(r["read_bytes_per_step"] for r in ok),
            "write_bytes_per_step": statistics.median(r["write_bytes_per_step"] for r in ok),
            "losses": ok[0]["losses"], "rounds": len(ok),
            "optimizer_steps": {how: sum(r.get("optimizer_steps", []).count(how) for r in ok)
                                for how in sorted({h for r in ok
                                                   for h in r.get("optimizer_steps", [])})},
            "behind_wait_s": [w for r in ok for w in r.get("behind_wait_s", [])],
            "reused_bytes_per_step": statistics.median(r.get("reused_bytes_per_step", 0)
                                                       for r in ok),
            "read_by_cause": ok[0].get("read_by_cause", {}),
            "errors": [r["error"] for r in runs if "error" in r]}


def fmt_bytes(b):
    return f"{b / 2**20:.0f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def ratio(a, b):
    return a / b if b else float("inf") if a else 1.0


def chart(rows, path, floor=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["row"] for r in rows if "error" not in r["strata"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for ax, key, label, scale in ((axes[0], "step_s", "step time (s), lower is better", 1),
                                  (axes[1], "peak_rss_bytes", "peak resident memory (GiB)",
                                   2**30)):
        xs = range(len(names))
        ours = [next(r for r in rows if r["row"] == n)["strata"][key] / scale for n in names]
        theirs = [next(r for r in rows if r["row"] == n)["deepspeed"].get(key, 0) / scale
                  for n in names]
        ax.bar([x - width / 2 for x in xs], ours, width, label="strata")
        ax.bar([x + width / 2 for x in xs], theirs, width, label="DeepSpeed 0.19.8")
        if floor is not None and "error" not in floor:
            ax.axhline(floor[key] / scale, color="gray", linestyle="--",
                       label="plain PyTorch, nothing offloaded")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=20)
        ax.set_title(label)
        ax.legend()
    for r in rows:
        if "error" in r["deepspeed"] and r["row"] in names:
            i = names.index(r["row"])
            axes[0].text(i + width / 2, 0, "error", rotation=90, ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_model_arguments(parser):
    """The model's shape and the batch (examples/llama.py), the rows' and bench/ab_strata.py's."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        with open(sys.argv[2], encoding="utf-8") as f:
            child(json.load(f))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="scratch folder (the NVMe rows' drive)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--png", help="draw the table as a chart here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after 2)")
    parser.add_argument("--rows", default=None,
                        help="comma-separated, of: " + ", ".join(ROWS) + " (default: all; on "
                             "cuda all but those across ranks)")
    add_model_arguments(parser)
    parser.add_argument("--bf16", action="store_true", help="both in bf16 (default fp32)")
    parser.add_argument("--clipping", type=float, default=1.0,
                        help="the config's gradient_clipping (0: none), both systems' and the "
                             "floor's")
    parser.add_argument("--aio-bench", default=None,
                        help="strata's aio_bench binary: the NVMe row's disk rates where fio is "
                             "missing, at the row's aio block")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="the losses' agreement, relative (default 1e-4 fp32, 2e-2 bf16)")
    parser.add_argument("--aio-block", help="aio_bench_perf_sweep's best.json: its aio block")
    parser.add_argument("--nvme-buffer-elements", type=int, default=1 << 24,
                        help="offload_param.buffer_size of the NVMe row (elements)")
    parser.add_argument("--child-timeout", type=int, default=1800)
    parser.add_argument("--phases", type=int, default=0,
                        help="after the timed steps, this many more split into forward, "
                             "backward and step, each waited for (a profile, not the timed "
                             "figure)")
    parser.add_argument("--profile", action="store_true",
                        help="one more step under torch.profiler: the top ops by self time "
                             "(host, and on cuda the GPU's) and on cuda how long the GPU was busy")
    parser.add_argument("--strata", dest="strata_extra", default=None, metavar="JSON",
                        help="keys added to strata's copy of the config's strata block (an A/B "
                             "of one of its settings, e.g. '{\"optimizer_threads\": 14}'); the "
                             "rows then differ from DeepSpeed's config by these, and say so; "
                             "each row's config is checked with them (strata.check_config) "
                             "before the first round")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="leave out the floor (plain PyTorch, nothing offloaded, once a "
                             "round)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where both compute: the CPU (DeepSpeed's cpu accelerator, strata's "
                             "host-emulated device tier) or GPU 0 (DeepSpeed's CUDA accelerator, "
                             "strata.device cuda)")
    args = parser.parse_args()
    if args.rows is None:
        args.rows = ",".join(r for r in ROWS if args.device == "cpu" or ranks_of(r) == 1)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        sys.exit(f"vs_deepspeed: --rows {args.rows}: unknown {bad}; accepted: {', '.join(ROWS)}")
    across = [r for r in rows if ranks_of(r) > 1]
    if across and args.device != "cpu":
        sys.exit(f"vs_deepspeed: --rows {','.join(across)} with --device {args.device}: strata "
                 "across ranks runs on its emulated device tier only (docs/ranks.md); accepted: "
                 "those rows with --device cpu")
    uneven = [r for r in across if args.batch % ranks_of(r)]
    if uneven:
        sys.exit(f"vs_deepspeed: --batch {args.batch} is the global batch and the rows "
                 f"{','.join(uneven)} split it over their ranks; accepted: a multiple of "
                 f"{max(ranks_of(r) for r in uneven)}")
    if args.rounds < 1 or args.steps < 1:
        sys.exit("vs_deepspeed: --rounds and --steps must be at least 1")
    if args.strata_extra is not None:
        try:
            args.strata_extra = json.loads(args.strata_extra)
        except ValueError as error:
            sys.exit(f"vs_deepspeed: --strata {args.strata_extra!r}: not JSON ({error}); "
                     "accepted: a JSON object of strata block keys")
        if not isinstance(args.strata_extra, dict):
            sys.exit(f"vs_deepspeed: --strata: {args.strata_extra!r}; accepted: a JSON object "
                     "of strata block keys")
    if args.phases < 0:
        sys.exit(f"vs_deepspeed: --phases {args.phases}: accepted: 0 (no split) or more steps")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"vs_deepspeed: --device cuda: torch {torch.__version__} (built for CUDA "
                 f"{torch.version.cuda or 'none'}) sees no CUDA device here "
                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                 "accepted: --device cpu, or a machine with a GPU")
    args.model_params, args.model_largest = model_shape(args)
    missing = None
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        # The peer is optional: strata's rows run, DeepSpeed's say why they did not.
        missing = (f"DeepSpeed is not installed in this environment ({e}); install it with: "
                   "bash scripts/python-env.sh --deepspeed")
        print(f"vs_deepspeed: {missing}", flush=True)
    args.tolerance = args.tolerance or (2e-2 if args.bf16 else 1e-4)
    args.aio = dict(DEFAULT_AIO)
    if args.aio_block:
        with open(args.aio_block, encoding="utf-8") as f:
            args.aio = json.load(f).get("aio", args.aio)
    args.nvme_placeholder = "@NVME@"
    check_strata_configs(rows, args)
    os.makedirs(args.dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="vs_deepspeed.", dir=args.dir)

    runs = {(row, s): [] for row in rows for s in ("strata", "deepspeed")}
    floor_runs = []  # plain PyTorch's, once a round: first in even rounds, last in odd ones
    disk = []  # (read, write) bytes/s in the scratch folder, once a round (the NVMe row)
    disk_tool = None  # what measured them: fio, else aio_bench

    def run_floor(round_index):
        # (the trainer row's config leaves its values to Trainer: the floor takes another's)
        plain = one_process_row(next((r for r in rows if r != "trainer"), "zero2_cpu"))
        report = run_one("torch", "floor", row_config(plain, args, args.nvme_placeholder)[0],
                         args, round_index, scratch)
        floor_runs.append(report)
        say_round(round_index, "floor", "torch", report)

    for round_index in range(args.rounds):
        if args.floor and round_index % 2 == 0:
            run_floor(round_index)
        if any(r.startswith("zero3_nvme") for r in rows):
            (read_bps, tool), (write_bps, _) = (
                disk_bandwidth(args.dir, write, args.aio_bench, args.aio)
                for write in (False, True))
            fio_file = os.path.join(args.dir, "fio.bin")
            if os.path.exists(fio_file):
                os.remove(fio_file)
            if read_bps is not None and write_bps is not None:
                disk.append((read_bps, write_bps))
                disk_tool = tool
        for row in rows:
            ds_config, our_config = row_config(row, args, args.nvme_placeholder)
            order = ("strata", "deepspeed") if round_index % 2 == 0 else ("deepspeed", "strata")
            for system in order:
                if system == "deepspeed" and missing:
                    if not runs[(row, system)]:
                        runs[(row, system)].append({"error": missing})
                    continue
                if system == "deepspeed" and runs[(row, system)] and \
                        "error" in runs[(row, system)][-1]:
                    continue  # the same error again: kept once
                report = run_one(system, row, ds_config if system == "deepspeed" else our_config,
                                 args, round_index, scratch)
                runs[(row, system)].append(report)
                say_round(round_index, row, system, report)
        if args.floor and round_index % 2 == 1:
            run_floor(round_index)
    shutil.rmtree(scratch, ignore_errors=True)
    floor = summarize(floor_runs) if floor_runs else None

    cuda = args.device == "cuda"
    table = []
    for row in rows:
        ours, theirs = summarize(runs[(row, "strata")]), summarize(runs[(row, "deepspeed")])
        entry = {"row": row, "strata": ours, "deepspeed": theirs}
        if cuda:
            entry["strata_block"] = row_config(row, args, args.nvme_placeholder)[1]["strata"]
        if "error" not in ours and "error" not in theirs:
            worst = max(abs(a - b) / max(abs(b), 1e-12)
                        for a, b in zip(ours["losses"], theirs["losses"]))
            entry["loss_difference"] = worst
            entry["void"] = row not in APPROXIMATE and worst > args.tolerance
            entry["speedup"] = theirs["step_s"] / ours["step_s"]
            if len(ours["round_step_s"]) == len(theirs["round_step_s"]):  # no round failed
                entry["round_speedups"] = [t / o for o, t in zip(ours["round_step_s"],
                                                                  theirs["round_step_s"])]
            if row.startswith("zero3_nvme") and disk:
                # The disk's floor for each system: its own bytes read and written a step at fio's
                # rates (the median of the rounds'), reads and writes one after the other.
                read_bps = statistics.median(d[0] for d in disk)
                write_bps = statistics.median(d[1] for d in disk)
                for side in (ours, theirs):
                    side["disk_floor_s"] = side["read_bytes_per_step"] / read_bps + \
                        side["write_bytes_per_step"] / write_bps
                entry["fio_gbs"] = [read_bps / 1e9, write_bps / 1e9]
                entry["disk_tool"] = disk_tool
        if floor is not None and "error" not in floor:
            # Each system's step rate as a fraction of the floor's (1: at the model's compute).
            for side in (ours, theirs):
                if "error" not in side:
                    side["rate_of_floor"] = floor["step_s"] / side["step_s"]
            if "bound_parts" in floor:
                disk_bps = (statistics.median(d[0] for d in disk),
                            statistics.median(d[1] for d in disk)) if disk else None
                entry["bound"] = bound_of(row, floor["bound_parts"], entry.get("strata_block"),
                                          disk_bps)
                if row.startswith("zero3_nvme") and disk_bps:
                    entry["bound_disk"] = {"gbs": [r / 1e9 for r in disk_bps], "tool": disk_tool}
                for side in (ours, theirs):
                    if "error" not in side:
                        side["of_bound"] = side["step_s"] / entry["bound"]["bound_s"]
        table.append(entry)

    # The GPU's name, asked once the children are done (a CUDA context here would hold memory of
    # the GPU the children measure).
    gpu = torch.cuda.get_device_name() if cuda else None
    print()
    where = (f"on {gpu} (strata: strata.device cuda; DeepSpeed: its CUDA accelerator), "
             f"{os.cpu_count()} CPU cores, torch {torch.__version__} (CUDA {torch.version.cuda})"
             if cuda else
             f"on the CPU ({os.cpu_count()} cores, torch {torch.__version__} with "
             f"{torch.get_num_threads()} threads)")
    print(f"model: transformers LlamaForCausalLM {args.layers} layers x {args.width} "
          f"({args.model_params / 1e6:.1f}M parameters), batch {args.batch} x {args.context}, "
          f"{'bf16' if args.bf16 else 'fp32'}, {where}; {args.rounds} rounds of 2 + "
          f"{args.steps} steps" + (f" (the floor 4 + {args.steps})" if args.floor else ""))
    if args.strata_extra:
        print(f"strata's config differs from DeepSpeed's by --strata: "
              f"{json.dumps(args.strata_extra)} in its strata block")
    if cuda:
        element = 2 if args.bf16 else 4
        for e in table:
            block = e["strata_block"]
            print(f"strata's block, {e['row']}: device budget "
                  f"{fmt_bytes(block['device_budget_bytes'])} "
                  f"({block['device_budget_bytes'] / (args.model_params * element):.2f} of the "
                  f"parameters' {fmt_bytes(args.model_params * element)}), host budget "
                  f"{fmt_bytes(block['host_budget_bytes'])}")
    print(f"{'row':>16} {'step s strata':>14} {'DeepSpeed':>10} {'rate x':>7} "
          f"{'peak RSS':>19} {'peak VmLck':>19} {'read/step':>19} {'written/step':>19} "
          + (f"{'peak GPU':>19} {'GPU in use':>19} " if cuda else "") + f"{'losses':>14}")
    for e in table:
        ours, theirs = e["strata"], e["deepspeed"]
        if "error" in ours:
            print(f"{e['row']:>16} strata failed: {error_line(ours['error'])}")
            continue
        if "error" in theirs:
            print(f"{e['row']:>16} {ours['step_s']:>14.3f}  DeepSpeed failed here: "
                  f"{error_line(theirs['error'])}")
            continue

        def pair(key):
            return f"{fmt_bytes(ours[key])}/{fmt_bytes(theirs[key])}"
        losses = ("VOID " if e["void"] else "") + f"{e['loss_difference']:.1e}" + \
            (" (approx.)" if e["row"] in APPROXIMATE else "")
        print(f"{e['row']:>16} {ours['step_s']:>14.3f} {theirs['step_s']:>10.3f} "
              f"{e['speedup']:>7.2f} {pair('peak_rss_bytes'):>19} "
              f"{pair('peak_locked_bytes'):>19} {pair('read_bytes_per_step'):>19} "
              f"{pair('write_bytes_per_step'):>19} "
              + (f"{pair('gpu_peak_bytes'):>19} {pair('gpu_peak_used_bytes'):>19} "
                 if cuda else "") + f"{losses:>14}")
    if floor is not None:
        if "error" in floor:
            print(f"vs_deepspeed: the floor (plain PyTorch) failed: {error_line(floor['error'])}")
        else:
            split = (" (split: " + ", ".join(f"{k} {v:.3f} s" for k, v in
                                             floor["phases_s"].items()) + ")"
                     if "phases_s" in floor else "")
            print(f"vs_deepspeed: the floor, plain PyTorch with nothing offloaded: "
                  f"{floor['step_s']:.3f} s a step [{floor['min_s']:.3f}, {floor['max_s']:.3f}]"
                  f"{split}, peak RSS {fmt_bytes(floor['peak_rss_bytes'])}")
    for e in table:
        if "speedup" in e and not e["void"]:
            print(f"vs_deepspeed/{e['row']}: strata {e['speedup']:.2f}x DeepSpeed's step rate "
                  f"(step {e['strata']['step_s']:.3f} s [{e['strata']['min_s']:.3f}, "
                  f"{e['strata']['max_s']:.3f}] vs {e['deepspeed']['step_s']:.3f} s "
                  f"[{e['deepspeed']['min_s']:.3f}, {e['deepspeed']['max_s']:.3f}]"
                  + (", round by round " + ", ".join(f"{x:.2f}x" for x in e["round_speedups"])
                     if "round_speedups" in e else "") + "); peak RSS "
                  f"{ratio(e['strata']['peak_rss_bytes'], e['deepspeed']['peak_rss_bytes']):.2f}"
                  "x DeepSpeed's")
        world = ranks_of(e["row"])
        ran = [(name, e[system]) for system, name in (("strata", "strata"),
                                                       ("deepspeed", "DeepSpeed"))
               if "ranks" in e[system]]
        if world > 1 and ran:
            ours = e["strata"].get("collectives")
            print(f"vs_deepspeed/{e['row']}: {world} ranks on this machine"
                  f"{f' (strata: {ours}; DeepSpeed: torch.distributed Gloo over loopback)' if ours else ''}"
                  ", the global "
                  f"batch {args.batch} ({args.batch // world} a rank); a step is the slowest "
                  "rank's, the losses the ranks' mean; peak RSS summed over the ranks: " +
                  ", ".join(f"{name} {fmt_bytes(side['peak_rss_bytes'])} (" +
                            " + ".join(fmt_bytes(b) for b in side["rank_peak_rss_bytes"]) + ")"
                            for name, side in ran) +
                  (f": strata {ratio(ran[0][1]['peak_rss_bytes'], ran[1][1]['peak_rss_bytes']):.2f}"
                   "x DeepSpeed's" if len(ran) == 2 else ""))
            for name, side in ran:
                for said in side["exits"]:
                    print(f"vs_deepspeed/{e['row']}: {name}: {said}")
        if "speedup" in e and cuda:
            ours, theirs = e["strata"], e["deepspeed"]
            print(f"vs_deepspeed/{e['row']}: peak GPU memory strata "
                  f"{fmt_bytes(ours['gpu_peak_bytes'])} (torch's "
                  f"{fmt_bytes(ours['gpu_peak_allocated_bytes'])} + its device tier's "
                  f"{fmt_bytes(ours['gpu_strata_tier_peak_bytes'])}), DeepSpeed "
                  f"{fmt_bytes(theirs['gpu_peak_bytes'])}: "
                  f"{ratio(ours['gpu_peak_bytes'], theirs['gpu_peak_bytes']):.2f}x; the whole GPU "
                  f"in use {fmt_bytes(ours['gpu_peak_used_bytes'])} / "
                  f"{fmt_bytes(theirs['gpu_peak_used_bytes'])}")
        if "fio_gbs" in e:
            print(f"vs_deepspeed/{e['row']}: the disk's floor (its bytes a step at "
                  f"{e.get('disk_tool') or 'fio'}'s "
                  f"{e['fio_gbs'][0]:.2f} GB/s read, {e['fio_gbs'][1]:.2f} GB/s write): strata "
                  f"{e['strata']['disk_floor_s']:.3f} s ({e['strata']['disk_floor_s'] / e['strata']['step_s']:.2f} "
                  f"of its step), DeepSpeed {e['deepspeed']['disk_floor_s']:.3f} s "
                  f"({e['deepspeed']['disk_floor_s'] / e['deepspeed']['step_s']:.2f} of its step)")
        if e["row"].startswith("zero3_nvme") and "error" not in e["strata"] and \
                "error" not in e["deepspeed"]:
            state = 12 * args.model_params
            print(f"vs_deepspeed/{e['row']}: the fp32 optimizer state is {fmt_bytes(state)}"
                  + (f", strata's host budget {fmt_bytes(STATE_SHARE[e['row']] * state)}"
                     if e["row"] in STATE_SHARE else "") + ": read a step strata "
                  f"{e['strata']['read_bytes_per_step'] / state:.2f}x it, DeepSpeed "
                  f"{e['deepspeed']['read_bytes_per_step'] / state:.2f}x; written strata "
                  f"{e['strata']['write_bytes_per_step'] / state:.2f}x, DeepSpeed "
                  f"{e['deepspeed']['write_bytes_per_step'] / state:.2f}x; strata's reads by "
                  "cause (its report, the first round's median): " + ", ".join(
                      f"{k} {fmt_bytes(v)}" for k, v in e["strata"]["read_by_cause"].items()))
        if e.get("strata", {}).get("optimizer_steps"):
            print(f"vs_deepspeed/{e['row']}: strata's timed optimizer steps: " + ", ".join(
                f"{n} {how}" for how, n in e["strata"]["optimizer_steps"].items()) +
                " (held: its NVMe state read during backward, stepped after it; staged: "
                "speculated during backward and committed; written behind: its state's writes "
                "finished under the next forward)")
            if e["strata"].get("reused_bytes_per_step"):
                print(f"vs_deepspeed/{e['row']}: strata's optimizer state found in its read-ahead "
                      "room as the step before committed it, and not read again: "
                      f"{fmt_bytes(e['strata']['reused_bytes_per_step'])} a step (beside the "
                      f"{fmt_bytes(e['strata']['read_bytes_per_step'])} it read)")
            call = e["strata"].get("step_call_s")
            if call:
                print(f"vs_deepspeed/{e['row']}: strata's step() after backward: "
                      f"{call['step']:.3f} s; in it, waiting for the device (backward's queued "
                      f"work and the gradients' copies to the host) {call['device_wait']:.3f} s, "
                      f"for the optimizer's commit {call['optimizer_commit']:.3f} s (each the "
                      "median over the timed steps: the parts need not add up)")
            waits = e["strata"].get("behind_wait_s")
            if waits:
                print(f"vs_deepspeed/{e['row']}: strata's next step waited for the writes behind "
                      f"the last one: median {statistics.median(waits):.3f} s, at most "
                      f"{max(waits):.3f} s")
        for system in ("strata", "deepspeed"):
            side = e[system]
            if "phases_s" in side:
                print(f"vs_deepspeed/{e['row']}: {system}'s step split (--phases, each phase "
                      "waited for; medians): " + ", ".join(
                          f"{k} {v:.3f} s" for k, v in side["phases_s"].items()))
            for p in side.get("profiles", [])[:1]:  # the first round's
                if "error" in p:
                    print(f"vs_deepspeed/{e['row']}: {system}'s step could not be profiled: "
                          f"{p['error']}")
                    continue
                busy = (f", the GPU busy {p['gpu_busy_s']:.3f} s of it"
                        if "gpu_busy_s" in p else "")
                print(f"vs_deepspeed/{e['row']}: {system}'s profiled step {p['wall_s']:.3f} s"
                      f"{busy}; top ops by self time on the host: " + "; ".join(
                          f"{o['op']} {o['self_ms']:.1f} ms ({o['calls']})"
                          for o in p["host_ops"][:8]))
                if "device_ops" in p:
                    print(f"vs_deepspeed/{e['row']}: {system}'s top ops on the GPU: " + "; ".join(
                        f"{o['op']} {o['self_ms']:.1f} ms ({o['calls']})"
                        for o in p["device_ops"][:8]))
        if floor is not None and "rate_of_floor" in e["strata"]:
            theirs = (f", DeepSpeed at {e['deepspeed']['rate_of_floor']:.2f}x"
                      if "rate_of_floor" in e["deepspeed"] else "")
            # (the trainer row's loss is the model's own, not the floor's: not compared)
            drift = "" if args.bf16 or e["row"] == "trainer" else \
                "; strata's losses differ from its by {:.1e}".format(
                max(abs(a - b) / max(abs(b), 1e-12)
                    for a, b in zip(e["strata"]["losses"], floor["losses"])))
            print(f"vs_deepspeed/{e['row']}: the floor (plain PyTorch, nothing offloaded) "
                  f"{floor['step_s']:.3f} s a step: strata at {e['strata']['rate_of_floor']:.2f}x "
                  f"its step rate{theirs}{drift}")
        if "bound" in e:
            b = e["bound"]
            names = {"forward_backward_s": "the GPU's forward + backward" if cuda else
                     "forward + backward", "cpu_adam_s": "strata's CPU Adam over the state",
                     "host_link_s": "the host link's bytes", "disk_s": "the optimizer state "
                     "read and written at the disk's rates"}
            sides = "; ".join(f"{system} {e[system]['step_s']:.3f} s = "
                              f"{e[system]['of_bound']:.2f}x the bound"
                              for system in ("strata", "deepspeed") if "of_bound" in e[system])
            print(f"vs_deepspeed/{e['row']}: the bound {b['bound_s']:.3f} s a step = max(" +
                  ", ".join(f"{names[k]} {v:.4f} s" for k, v in b.items() if k != "bound_s") +
                  f"): {sides}" + (f" (the disk at {e['bound_disk']['tool']}'s "
                                   f"{e['bound_disk']['gbs'][0]:.2f} GB/s read, "
                                   f"{e['bound_disk']['gbs'][1]:.2f} GB/s write)"
                                   if "bound_disk" in e else ""))
        if e.get("void"):
            print(f"vs_deepspeed/{e['row']}: VOID: the losses differ by "
                  f"{e['loss_difference']:.1e} (tolerance {args.tolerance:.0e})")
    if args.png:
        chart(table, args.png, floor)
    figures = []
    for e in table:
        if "speedup" not in e:
            continue
        ours, theirs = e["strata"], e["deepspeed"]
        figures.append({"name": f"{e['row']}_step_rate", "value": e["speedup"], "unit": "x",
                        "peer": "DeepSpeed 0.19.8, interleaved in the same run",
                        "peer_ratio": e["speedup"], "void": e["void"],
                        "loss_difference": e["loss_difference"],
                        "peak_rss_ratio": ratio(ours["peak_rss_bytes"], theirs["peak_rss_bytes"]),
                        "strata_step_s": ours["step_s"], "deepspeed_step_s": theirs["step_s"],
                        "ranks": ranks_of(e["row"])})
        for side, key in ((ours, "strata_rate_of_floor"), (theirs, "deepspeed_rate_of_floor")):
            if "rate_of_floor" in side:
                figures[-1][key] = side["rate_of_floor"]
        if cuda:
            figures[-1]["peak_gpu_ratio"] = ratio(ours["gpu_peak_bytes"], theirs["gpu_peak_bytes"])
        if "bound" in e:  # each system's step over the bound: 1 is at it (lower is better)
            figures[-1].update(bound_s=e["bound"]["bound_s"],
                               strata_of_bound=ours.get("of_bound"),
                               deepspeed_of_bound=theirs.get("of_bound"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bench": "vs_deepspeed", "figures": figures, "rows": table,
                       "floor": floor, "config": {
                k: v for k, v in vars(args).items() if k not in ("nvme_placeholder",)},
                "machine": {"cpu": platform.processor() or platform.machine(),
                            "cores": os.cpu_count(), "torch": torch.__version__,
                            "device": f"{gpu} (strata: strata.device cuda; DeepSpeed: its CUDA "
                                      "accelerator, NCCL)" if cuda else
                                      "cpu (strata: the host-emulated device tier; DeepSpeed: "
                                      "DS_ACCELERATOR=cpu)",
                            **({"gpu": gpu, "cuda": torch.version.cuda} if cuda else {})}},
                      f, indent=1)


if __name__ == "__main__":
    main()
