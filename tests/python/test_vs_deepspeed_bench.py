"""bench/vs_deepspeed.py's driver on a tiny model: the report it writes when DeepSpeed is not
installed (strata's rows and the floor still measured, DeepSpeed's row kept with why), as a user
without DeepSpeed runs it. DeepSpeed is hidden by a package of that name that fails to import."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(ROOT, "bench", "vs_deepspeed.py")


def run_bench(tmp_path, *flags):
    hidden = tmp_path / "hidden"
    (hidden / "deepspeed").mkdir(parents=True)
    (hidden / "deepspeed" / "__init__.py").write_text(
        "raise ImportError('deepspeed hidden by the test')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hidden)] + [p for p in
                                                         [env.get("PYTHONPATH")] if p])
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, BENCH, "--dir", str(tmp_path / "scratch"), "--rounds", "1",
         "--steps", "1", "--layers", "1", "--width", "64", "--heads", "2", "--context", "16",
         "--batch", "2", "--json", str(out), *flags],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out, encoding="utf-8") as f:
        return json.load(f), proc.stdout


@pytest.mark.parametrize("floor", [True, False])
def test_without_deepspeed_the_nvme_row_and_the_floor_are_still_reported(tmp_path, floor):
    report, stdout = run_bench(tmp_path, "--rows", "zero3_nvme", "--png",
                               str(tmp_path / "chart.png"), *([] if floor else ["--no-floor"]))
    (row,) = report["rows"]
    assert "not installed" in row["deepspeed"]["error"]
    assert "DeepSpeed failed here" in stdout
    ours = row["strata"]
    assert "error" not in ours and ours["step_s"] > 0 and len(ours["losses"]) == 3
    assert (tmp_path / "chart.png").stat().st_size > 0
    call = ours["step_call_s"]
    assert 0 <= call["gradients_landed"] <= call["step"]
    assert 0 <= call["optimizer_commit"] <= call["step"]
    assert "strata's step() after backward (medians)" in stdout
    if not floor:
        assert report["floor"] is None and "rate_of_floor" not in ours
        return
    plain = report["floor"]
    assert plain["step_s"] > 0 and len(plain["losses"]) == 5  # four warm-up steps and one
    assert ours["rate_of_floor"] == pytest.approx(plain["step_s"] / ours["step_s"])
    # strata's ZeRO-Infinity steps are plain torch's arithmetic: the same losses, step by step.
    assert ours["losses"] == pytest.approx(plain["losses"][:3], rel=1e-5)
    assert "the floor (plain PyTorch, nothing offloaded)" in stdout
