"""fio as the disk's ceiling for the Python benchmarks (BENCH.md): one sequential pass at 1 MiB
blocks, depth 8, O_DIRECT, io_uring, over a scratch file in the folder measured.

Thread safety: none needed (runs a subprocess).
"""
import json
import os
import shutil
import subprocess


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
