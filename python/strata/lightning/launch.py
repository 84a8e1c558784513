"""The launch environment: the variables a run of one process must not take from a launcher,
and a free port.

Part of strata.lightning (its module docstring says what the Trainer gets).
"""

import contextlib
import os
import random
import socket



_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                     "STRATA_STORE_PORT")
_ONE_PROCESS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                          "NODE_RANK")


@contextlib.contextmanager
def _one_process_environment(world_size):
    """In a run of one process, strata must not take the launcher's variables (Lightning or a
    cluster may have set some) for a job of several: they are hidden while strata joins."""
    if world_size > 1:
        yield
        return
    saved = {k: os.environ.pop(k) for k in _LAUNCH_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _free_port(avoid=()):
    """A port free a moment ago, below the kernel's ephemeral range (whose ports the kernel hands
    to connections), for strata's rendezvous store (STRATA_STORE_PORT)."""
    low, high = 20000, 32000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            high = min(high, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(1000):
        port = rng.randrange(low, max(low + 1, high))
        if port in avoid:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"StrataStrategy: no free port in {low}-{high} for strata's store; "
                       "accepted: set STRATA_STORE_PORT to a free port")
