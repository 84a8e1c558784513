"""fio as the disk's ceiling for the Python benchmarks (BENCH.md): one sequential pass at 1 MiB
blocks, depth 8, O_DIRECT, io_uring, over a scratch file in the folder measured. Where fio is
missing (the lent GPU machines have none), disk_bandwidth takes the project's own aio_bench at the
same point, or at the aio block a run uses (the sweep's best point), and says which it was.

Thread safety: none needed (runs a subprocess).
"""
import json
import os
import shutil
import subprocess
import tempfile


def fio_bandwidth(directory, write, size_bytes=256 << 20, end_fsync=False):
    """fio's bytes per second reading or writing `size_bytes` (rounded up to whole MiB) of
    directory/fio.bin, synced at the end when `end_fsync`; None when fio is missing or fails."""
    if shutil.which("fio") is None:
        return None
    size = max(1, (size_bytes + (1 << 20) - 1) >> 20) << 20
    cmd = ["fio", "--name=ceiling", f"--filename={os.path.join(directory, 'fio.bin')}",
           f"--size={size}", "--bs=1M", "--iodepth=8", "--direct=1", "--ioengine=io_uring",
           f"--rw={'write' if write else 'read'}", f"--end_fsync={int(end_fsync)}",
           "--output-format=json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return json.loads(out.stdout)["jobs"][0]["write" if write else "read"]["bw_bytes"]


def aio_bench_bandwidth(aio_bench, directory, write, size_bytes=256 << 20, aio=None):
    """strata's aio_bench (the binary at `aio_bench`): bytes per second reading or writing a test
    file of `size_bytes` in `directory` (its own, removed after), the median of its runs, at the
    `aio` block's block_size, queue_depth and thread_count (default: fio's point above: 1 MiB,
    depth 8, one thread), io_uring, O_DIRECT; None when it fails."""
    aio = aio or {}
    block = int(aio.get("block_size", 1 << 20))
    with tempfile.TemporaryDirectory(dir=directory, prefix="aio_bench.") as scratch:
        report = os.path.join(scratch, "report.json")
        cmd = [aio_bench, f"--dir={scratch}", f"--size={max(size_bytes, block) >> 20}M",
               "--engine=io_uring", f"--block-size={block >> 10}K",
               f"--queue-depth={int(aio.get('queue_depth', 8))}",
               f"--threads={int(aio.get('thread_count', aio.get('intra_op_parallelism', 1)))}",
               f"--op={'write' if write else 'read'}", "--reps=3", "--rep-seconds=0.5",
               "--warmup-seconds=0.2", f"--json={report}"]
        try:
            subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
            with open(report, encoding="utf-8") as f:
                result = json.load(f)
        except (subprocess.SubprocessError, OSError, ValueError):
            return None
    if result.get("status") != "ok":
        return None
    return result["gb_per_s"]["median"] * 1e9


def disk_bandwidth(directory, write, aio_bench=None, aio=None, size_bytes=256 << 20):
    """(bytes per second, the tool that measured it): fio's (fio_bandwidth), else aio_bench's at
    the `aio` block's point (aio_bench_bandwidth) where `aio_bench` names the binary; (None, None)
    when neither ran."""
    bps = fio_bandwidth(directory, write, size_bytes)
    if bps is not None:
        return bps, "fio io_uring bs=1M qd=8"
    if aio_bench and os.path.exists(aio_bench):
        bps = aio_bench_bandwidth(aio_bench, directory, write, size_bytes, aio)
        if bps is not None:
            aio = aio or {}
            return bps, (f"aio_bench io_uring bs={int(aio.get('block_size', 1 << 20)) >> 10}K "
                         f"qd={int(aio.get('queue_depth', 8))}")
    return None, None
