"""examples/finetune.py, the main job, at a size that runs in seconds: it trains with strata and
with plain PyTorch, writes its summary and PNG, and the two curves agree."""
import json
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def run(tmp_path, *extra):
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "finetune.py"), "--work", str(tmp_path),
         "--steps", "4", "--layers", "2", "--width", "32", "--heads", "2", "--context", "16",
         "--batch", "2", "--device-budget-mb", "0.125", "--persistence-threshold", "100",
         *extra],
        capture_output=True, text=True, timeout=300)


def test_the_demo_trains_beside_plain_pytorch_and_writes_its_outputs(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "emulated"
    assert summary["state_bytes"] >= 4 * summary["device_budget_bytes"]
    assert len(summary["strata_losses"]) == 4 and len(summary["pytorch_losses"]) == 4
    assert summary["largest_difference"] < 1e-3
    assert summary["bytes_moved"]["host_to_device"] > 0
    assert summary["bytes_moved"]["host_to_nvme"] > 0  # the optimizer's state on NVMe
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000
    assert "host-emulated device tier" in done.stdout


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps and --batch must be at least 1"),
    (["--heads", "3"], "--width must be a multiple of --heads"),
    (["--text", "/nonexistent-strata-text"], "No such file"),
    (["--device-budget-mb", "0"], "--device-budget-mb must be more than 0"),
    (["--heads", "0"], "must be at least 1"),
    (["--aio-block", "/nonexistent-strata-block.json"], "--aio-block /nonexistent"),
])
def test_bad_flags_are_refused_naming_them(tmp_path, flags, message):
    done = run(tmp_path, *flags)
    assert done.returncode != 0
    assert message in done.stderr
