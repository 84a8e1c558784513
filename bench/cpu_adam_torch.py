#!/usr/bin/env python3
"""The peer of bench/cpu_adam: torch.optim.AdamW on the CPU, same size and thread count.

Prints one JSON object: {"available": bool, "seconds": [...per step...], "torch": version}.
Optional at run time: without torch it says so and exits 0.
"""
import argparse
import json
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--params", type=int, required=True)
parser.add_argument("--threads", type=int, required=True)
parser.add_argument("--foreach", type=int, choices=[0, 1], required=True)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

try:
    import torch
except ImportError as e:  # the row then says the peer is missing
    print(json.dumps({"available": False, "why": str(e)}))
    sys.exit(0)

torch.set_num_threads(args.threads)
p = torch.nn.Parameter(torch.randn(args.params, dtype=torch.float32))
p.grad = torch.randn(args.params, dtype=torch.float32) * 0.1
opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=bool(args.foreach))
opt.step()  # warm-up: allocates the moments
seconds = []
for _ in range(args.steps):
    t0 = time.perf_counter()
    opt.step()
    seconds.append(time.perf_counter() - t0)
print(json.dumps({"available": True, "seconds": seconds, "torch": torch.__version__}))
