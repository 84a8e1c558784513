"""Ranks as processes on loopback, as torchrun starts them (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK), for the tests of comm/ and of the engine across ranks."""
import os
import random
import socket
import subprocess
import sys


_PORTS = random.Random(os.getpid())  # (one sequence a process: each call draws anew)


def free_port():
    """A port free a moment ago whose next one (strata's store, MASTER_PORT + 1) is free too,
    drawn below the kernel's ephemeral range: the neighbours of a port the kernel handed out for a
    connection are handed out next (CI saw MASTER_PORT + 1 taken). A process's calls draw on one
    sequence: a test does not take the port its predecessor's ranks may still be leaving (drawn
    afresh each call, every call of a process began with the same port)."""
    for _ in range(1000):
        port = _PORTS.randrange(20000, 32000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports in 20000-32000")


def start_ranks(n, script, args=(), extra_env=None, port=None):
    """`n` processes running `script` (Python source) as ranks 0..n-1 of one job."""
    port = port or free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(n), LOCAL_RANK=str(r), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def assert_same(a, b, exact, what):
    """Two state dicts alike: bit for bit when `exact`, else within fp32's rounding of a sum taken
    in another order (`what` names the comparison in a failure)."""
    import torch
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), f"{what}: {name}"
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=2e-5,
                                       msg=f"{what}: {name}")
