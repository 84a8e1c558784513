"""A model whose fp32 weights are more than twice the host budget: built under strata.init,
its pretrained weights streamed in from a torch.save file, trained a few steps, with the process's
peak resident memory measured and held under the bound (the issue's promise; strata/zero_init.py,
strata/pretrained.py, the engine's refresh of NVMe-homed weights)."""
import json
import os
import subprocess
import sys

import torch

LAYERS, WIDTH = 128, 512  # 128 x (512 x 512 + 512) = 33.6M parameters: 128 MiB of fp32 weights
HOST_BUDGET = 24 << 20
DEVICE_BUDGET = 8 << 20
MARGIN = 64 << 20  # the interpreter's and torch's working memory, and one layer being loaded


class Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def batches(n):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen))
            for _ in range(n)]


CHILD = r"""
import json, sys, threading, torch
sys.path.insert(0, {here!r})
import strata
from test_bigger_than_memory import Deep, batches, HOST_BUDGET, DEVICE_BUDGET

def rss(field="VmRSS:"):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

# torch's own one-time allocations (the BLAS's per-thread buffers, whose size depends on the CPU's
# kernel, the code pages its first ops fault in, and the modules torch 2 imports the first time a
# torch.optim.Optimizer is made: torch._dynamo and what it pulls in, about 80 MiB) belong in the
# base, not in strata's growth: one forward, backward and optimizer step of a layer of the same
# shape, outside strata, before measuring.
warm = torch.nn.Linear({width}, {width})
torch.nn.functional.mse_loss(torch.tanh(warm(batches(1)[0][0])), batches(1)[0][1]).backward()
torch.optim.SGD(warm.parameters(), lr=0.1).step()
del warm

config = {{
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
    "zero_optimization": {{
        "stage": 3, "stage3_param_persistence_threshold": 1000,
        "offload_param": {{"device": "nvme", "nvme_path": {nvme!r}, "buffer_count": 2,
                          "buffer_size": 1048576}},
        "offload_optimizer": {{"device": "nvme", "nvme_path": {nvme!r}}}}},
    "strata": {{"device": "emulated", "device_budget_bytes": DEVICE_BUDGET,
               # The disk holds the weights (128 MiB), the gradients written down (up to as
               # much) and the optimizer's state twice while a step commits (2 x 403 MB): 1 GiB
               # was within 2 MB of that, and failed when more gradients happened to be on disk.
               "host_budget_bytes": HOST_BUDGET, "nvme_capacity_bytes": 3 << 29,
               # freed blocks go back to the system: the resident memory is what is held
               "malloc_mmap_threshold_bytes": 256 << 10}}}}
base = rss()
base_anon = rss("RssAnon:")
peak = [base]
peak_anon = [base_anon]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        peak_anon[0] = max(peak_anon[0], rss("RssAnon:"))
        done.wait(0.002)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
with strata.init(config=config):
    model = Deep()
engine, _, _, _ = strata.initialize(model=model, config=config)
engine.load_pretrained({weights!r})
losses = []
for x, y in batches(3):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
done.set()
sampler.join()
print(json.dumps({{"losses": losses, "peak_growth": max(peak[0], rss()) - base,
                  "peak_anon_growth": max(peak_anon[0], rss("RssAnon:")) - base_anon}}))
"""


def test_a_model_twice_the_host_budget_is_built_loaded_and_trained_within_it(tmp_path):
    torch.manual_seed(0)
    pretrained = Deep()
    weights = sum(p.numel() for p in pretrained.parameters()) * 4
    assert weights >= 2 * HOST_BUDGET
    torch.save(pretrained.state_dict(), tmp_path / "pretrained.bin")
    # The same three steps in plain torch, everything in memory (this process is not measured).
    torch_adamw = torch.optim.AdamW(pretrained.parameters(), lr=1e-3, weight_decay=0.01)
    expected = []
    for x, y in batches(3):
        loss = torch.nn.functional.mse_loss(pretrained(x), y)
        loss.backward()
        torch_adamw.step()
        torch_adamw.zero_grad()
        expected.append(loss.item())
    del pretrained, torch_adamw
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(here=here, nvme=str(tmp_path / "nvme"),
                                            weights=str(tmp_path / "pretrained.bin"), width=WIDTH)],
        capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    print("bigger than memory:", report)
    for ours, theirs in zip(report["losses"], expected):
        assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (report["losses"], expected)
    bound = HOST_BUDGET + DEVICE_BUDGET + MARGIN
    assert bound < weights  # so that holding the weights whole anywhere fails the test
    assert report["peak_growth"] <= bound, (report, bound, weights)


def test_the_largest_model_strata_plan_names_is_the_one_examples_llama_builds(tmp_path):
    """strata_plan --largest (planner/plan_largest.h) names a member of examples/llama.py's family
    and the flags bench/bigger_than_ram.py builds it from: built from them by transformers (on the
    meta device), it has the planner's parameters and the config.json --save-model wrote."""
    import re
    plan = os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "..", "tools",
                        "strata_plan", "strata_plan")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "nvme",
                                                    "nvme_path": str(tmp_path)}}}))
    run = subprocess.run([plan, "--largest", "--hardware", "h200-141g-128g", "--config",
                          str(config), "--vocab", "256", "--sequence", "128", "--save-model",
                          str(tmp_path / "model.json")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    (line,) = [s for s in run.stdout.splitlines() if "built by bench/bigger_than_ram.py" in s]
    flags = line.split("bigger_than_ram.py ")[1].split()
    given = dict(zip(flags[::2], (int(v) for v in flags[1::2])))
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from llama import llama
    with torch.device("meta"):
        model = llama(given["--layers"], given["--width"], given["--heads"], given["--context"],
                      vocab=given["--vocab"])
    planned = int(re.search(r"B parameters \((\d+)\)", run.stdout).group(1))
    assert sum(p.numel() for p in model.parameters()) == planned
    saved = json.loads((tmp_path / "model.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings"):
        assert getattr(model.config, key) == saved[key], key
