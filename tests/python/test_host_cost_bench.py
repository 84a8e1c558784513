"""bench/host_cost.py on a tiny model, as a user runs it: its report (forward and backward beside
plain PyTorch's, the host time a lending module, the losses' agreement) and its refusals."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(ROOT, "bench", "host_cost.py")


def run(*flags):
    return subprocess.run([sys.executable, BENCH, *flags], capture_output=True, text=True,
                          timeout=300)


def test_the_report_says_each_figure_beside_plain_pytorch(tmp_path):
    out = tmp_path / "report.json"
    proc = run("--layers", "2", "--width", "32", "--heads", "2", "--context", "8",
               "--rounds", "2", "--steps", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "losses agree" in proc.stdout
    report = json.loads(out.read_text())
    assert report["bench"] == "host_cost" and report["losses_agree"]
    figures = {f["name"]: f for f in report["figures"]}
    assert set(figures) == {"forward_vs_plain", "backward_vs_plain", "host_us_per_module"}
    for name in ("forward_vs_plain", "backward_vs_plain"):
        assert figures[name]["value"] > 0 and figures[name]["ceiling"] == 1.0
        assert f"host_cost/{name}: " in proc.stdout
    # Every decoder layer's 7 linears and 2 norms, the embedding, the final norm, the head.
    assert figures["host_us_per_module"]["config"]["lending_modules"] == 2 * 9 + 3
    # The two trained the same batches from the same weights: 2 warm-ups and 2 rounds of 2 each.
    assert len(report["losses"]["plain"]) == len(report["losses"]["strata"]) == 6


def test_bad_flags_are_refused_by_name():
    proc = run("--layers", "0")
    assert proc.returncode != 0 and "--layers 0; accepted: 1 or more" in proc.stderr
    proc = run("--device", "tpu")
    assert proc.returncode != 0 and "invalid choice: 'tpu'" in proc.stderr
