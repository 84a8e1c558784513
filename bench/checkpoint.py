"""bench/checkpoint: saving and loading a checkpoint whose optimizer state lives on NVMe, beside
fio moving the same bytes in the same run, and the peak host memory of each (BENCH.md).

    PYTHONPATH=build/release/python .venv/bin/python bench/checkpoint.py --dir SCRATCH \
        [--json out.json] [--rounds 3] [--layers 8] [--width 512]

The engine (ZeRO stage 3, parameters in pinned host memory, the optimizer's state on NVMe under
--dir) holds a GPT-style model (examples/gpt.py). Each round:
  * save: engine.save_checkpoint reads every partition's state from the NVMe store and writes it to
    the checkpoint's file (synced), with its digests; the ceiling is fio reading the same number
    of bytes plus fio writing them (1 MiB blocks, depth 8, O_DIRECT, end_fsync);
  * load: the page cache is dropped (as root; otherwise said), then engine.load_checkpoint checks
    every digest, loads the state into the NVMe store (all or none) and sets the weights; the
    ceiling is fio reading the bytes plus writing them.
The figure is the ceiling's time over ours (1.0 = at the ceiling); peak host memory is the most
the process's resident set grew over its size before the call (sampled every 2 ms), beside the
state's size.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from gpt import GPT  # noqa: E402
from fio_ceiling import fio_bandwidth  # noqa: E402

import strata  # noqa: E402


def fio_seconds(directory, nbytes, write):
    """fio's time to move `nbytes` one way, synced (None without fio)."""
    bandwidth = fio_bandwidth(directory, write, nbytes, end_fsync=True)
    return nbytes / bandwidth if bandwidth else None


def rss_bytes():
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def timed_with_peak(fn):
    """(seconds, peak growth of the resident set) of fn()."""
    base = rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
    return seconds, max(peak[0], rss_bytes()) - base


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="utf-8") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="scratch folder on the drive to measure")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    if args.rounds < 1 or args.layers < 1 or args.width < 8 or args.width % 8:
        sys.exit("checkpoint: --rounds and --layers at least 1, --width a multiple of 8")
    os.makedirs(args.dir, exist_ok=True)
    nvme = os.path.join(args.dir, "checkpoint_nvme")
    ckpt = os.path.join(args.dir, "checkpoint_out")
    shutil.rmtree(nvme, ignore_errors=True)
    os.makedirs(nvme)
    torch.manual_seed(0)
    model = GPT(args.layers, args.width, 8, 128)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * params
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 10000,
            "offload_param": {"device": "cpu", "buffer_count": 2, "buffer_size": 4 << 20},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "strata": {"device": "emulated", "device_budget_bytes": 64 << 20,
                   "host_budget_bytes": 4 * state_bytes + (256 << 20),
                   "nvme_capacity_bytes": 3 * state_bytes + (256 << 20)}}
    engine, _, _, _ = strata.initialize(model=model, config=config)
    rows = []
    dropped = True
    for i in range(args.rounds):
        shutil.rmtree(ckpt, ignore_errors=True)
        save_s, save_peak = timed_with_peak(lambda: engine.save_checkpoint(ckpt, tag="bench"))
        dropped = drop_caches() and dropped
        load_s, load_peak = timed_with_peak(lambda: engine.load_checkpoint(ckpt, tag="bench"))
        read_s = fio_seconds(args.dir, state_bytes, write=False)
        write_s = fio_seconds(args.dir, state_bytes, write=True)
        if os.path.exists(os.path.join(args.dir, "fio.bin")):
            os.remove(os.path.join(args.dir, "fio.bin"))
        ceiling = read_s + write_s if read_s and write_s else None
        rows.append({"save_s": save_s, "load_s": load_s, "save_peak_bytes": save_peak,
                     "load_peak_bytes": load_peak, "fio_read_s": read_s, "fio_write_s": write_s,
                     "ceiling_s": ceiling,
                     "save_ratio": ceiling / save_s if ceiling else None,
                     "load_ratio": ceiling / load_s if ceiling else None})
        print(f"round {i}: save {save_s:.2f} s, load {load_s:.2f} s, fio read+write "
              f"{ceiling if ceiling is not None else float('nan'):.2f} s; peak host growth: save "
              f"{save_peak / 2**20:.0f} MiB, load {load_peak / 2**20:.0f} MiB")
    del engine
    shutil.rmtree(nvme, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)

    med = statistics.median
    print()
    print(f"model: GPT {params / 1e6:.1f}M parameters; optimizer state {state_bytes / 2**20:.0f} "
          f"MiB on NVMe (host-emulated device){'' if dropped else '; the page cache could not be dropped (not root): loads may read from memory'}")
    if any(r["ceiling_s"] is None for r in rows):
        print("checkpoint: fio is missing: no ceiling (apt-get install fio)")
        return
    save_ratio = med(r["save_ratio"] for r in rows)
    load_ratio = med(r["load_ratio"] for r in rows)
    ceiling = med(r["ceiling_s"] for r in rows)
    print(f"checkpoint/save_s: {med(r['save_s'] for r in rows):.3f} s = {save_ratio:.3f} of fio "
          f"reading and writing the same bytes ({ceiling:.3f} s; rounds "
          f"{min(r['save_ratio'] for r in rows):.3f}-{max(r['save_ratio'] for r in rows):.3f});"
          f" target 0.8")
    print(f"checkpoint/load_s: {med(r['load_s'] for r in rows):.3f} s = {load_ratio:.3f} of the "
          f"same ceiling (rounds {min(r['load_ratio'] for r in rows):.3f}-"
          f"{max(r['load_ratio'] for r in rows):.3f}); target 0.8")
    print(f"checkpoint/peak_host_growth: save {max(r['save_peak_bytes'] for r in rows) / 2**20:.0f}"
          f" MiB, load {max(r['load_peak_bytes'] for r in rows) / 2**20:.0f} MiB, beside "
          f"{state_bytes / 2**20:.0f} MiB of state")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bench": "checkpoint", "params": params, "state_bytes": state_bytes,
                       "page_cache_dropped": dropped, "rounds": rows,
                       "figures": [{"name": "save_s", "ratio": save_ratio,
                                    "ceiling_source": "fio read + fio write of the state's bytes"},
                                   {"name": "load_s", "ratio": load_ratio,
                                    "ceiling_source": "fio read + fio write of the state's bytes"}]},
                      f, indent=1)


if __name__ == "__main__":
    main()
