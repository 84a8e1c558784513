"""bench/vs_deepspeed.py's driver on a tiny model: the report it writes when DeepSpeed is not
installed (strata's rows and the floor still measured, DeepSpeed's row kept with why), as a user
without DeepSpeed runs it. DeepSpeed is hidden by a package of that name that fails to import."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(ROOT, "bench", "vs_deepspeed.py")


HIDDEN = "raise ImportError('deepspeed hidden by the test')\n"
# A DeepSpeed that imports but fails in deepspeed.initialize, then prints more at exit (as
# torch.distributed's NCCL warns when its process group was not destroyed): the error a lent GPU
# gave on 2026-11-27, its JIT builder failing on TORCH_CUDA_ARCH_LIST "9.0a".
FAILING = """import atexit, sys
atexit.register(lambda: print("[rank0]:[W1127 13:13:52.455578133 ProcessGroupNCCL.cpp:1575] "
                              "Warning: WARNING: destroy_process_group() was not called",
                              file=sys.stderr))
def initialize(**kwargs):
    raise ValueError("invalid literal for int() with base 10: '0a'")
"""


def run_bench(tmp_path, *flags, deepspeed=HIDDEN):
    hidden = tmp_path / "hidden"
    (hidden / "deepspeed").mkdir(parents=True, exist_ok=True)
    (hidden / "deepspeed" / "__init__.py").write_text(deepspeed)
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
    assert 0 <= call["device_wait"] <= call["step"]
    assert 0 <= call["optimizer_commit"] <= call["step"]
    assert "strata's step() after backward:" in stdout
    if not floor:
        assert report["floor"] is None and "rate_of_floor" not in ours
        return
    plain = report["floor"]
    assert plain["step_s"] > 0 and len(plain["losses"]) == 5  # four warm-up steps and one
    assert ours["rate_of_floor"] == pytest.approx(plain["step_s"] / ours["step_s"])
    # strata's ZeRO-Infinity steps are plain torch's arithmetic: the same losses, step by step.
    assert ours["losses"] == pytest.approx(plain["losses"][:3], rel=1e-5)
    assert "the floor (plain PyTorch, nothing offloaded)" in stdout
    # The bound: its parts measured in the floor's process, the disk's beside them on this row.
    parts = plain["bound_parts"]
    assert parts["params"] > 0 and parts["forward_backward_s"] > 0 and parts["cpu_adam_s"] > 0
    bound = row["bound"]
    assert set(bound) == {"forward_backward_s", "cpu_adam_s", "disk_s", "bound_s"}, bound
    assert bound["bound_s"] == max(v for k, v in bound.items() if k != "bound_s")
    assert bound["disk_s"] == pytest.approx(
        12 * parts["params"] * (1e-9 / row["bound_disk"]["gbs"][0] +
                                1e-9 / row["bound_disk"]["gbs"][1]))
    assert row["bound_disk"]["tool"] == "fio io_uring bs=1M qd=8"
    assert ours["of_bound"] == pytest.approx(ours["step_s"] / bound["bound_s"])
    assert f"vs_deepspeed/zero3_nvme: the bound {bound['bound_s']:.3f} s a step = max(" in stdout


def test_the_disk_rates_come_from_aio_bench_where_fio_is_missing(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import fio_ceiling
    import strata
    build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__))))
    aio_bench = os.path.join(build, "tools", "aio_bench", "aio_bench")
    monkeypatch.setattr(fio_ceiling.shutil, "which", lambda name: None)  # no fio here
    bps, tool = fio_ceiling.disk_bandwidth(str(tmp_path), False, aio_bench,
                                           {"block_size": 1 << 19, "queue_depth": 4},
                                           size_bytes=32 << 20)
    assert bps > 0 and tool == "aio_bench io_uring bs=512K qd=4"
    assert os.listdir(tmp_path) == []  # its test file went with it
    assert fio_ceiling.disk_bandwidth(str(tmp_path), True, None) == (None, None)
    assert fio_ceiling.disk_bandwidth(str(tmp_path), True,
                                      str(tmp_path / "no_aio_bench")) == (None, None)


def test_deepspeeds_failure_is_reported_by_its_exception_not_by_what_it_printed_after(tmp_path):
    report, stdout = run_bench(tmp_path, "--rows", "zero2_cpu", "--no-floor",
                               deepspeed=FAILING)
    error = report["rows"][0]["deepspeed"]["error"]
    assert error.startswith("Traceback (most recent call last)")
    assert "ValueError: invalid literal for int() with base 10: '0a'" in error
    said = [line for line in stdout.splitlines()
            if "zero2_cpu deepspeed:" in line or "DeepSpeed failed here:" in line]
    assert len(said) == 2, stdout
    for line in said:
        assert line.endswith("ValueError: invalid literal for int() with base 10: '0a'"), line


def bench_module():
    spec = importlib.util.spec_from_file_location("vs_deepspeed", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NCCL_AT_EXIT = ("[rank0]:[W1127 13:13:52.455578133 ProcessGroupNCCL.cpp:1575] Warning: WARNING: "
                "destroy_process_group() was not called before program exit")
# What a failed child printed: (its output, the line naming its error, its traceback's first line).
OUTPUTS = {
    "then NCCL's warning": (
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "ValueError: bad\n" + NCCL_AT_EXIT, "ValueError: bad"),
    "each line of rank 0's, as on the H100": (
        "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"b.py\", line 710, in f\n"
        "[rank0]:     ccs = sorted(ccs)\n[rank0]:           ^^^^^^\n"
        "[rank0]: ValueError: invalid literal for int() with base 10: '0a'\n" + NCCL_AT_EXIT,
        "[rank0]: ValueError: invalid literal for int() with base 10: '0a'"),
    "then a destructor's at exit": (
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "torch.OutOfMemoryError: CUDA out of memory\n"
        "Exception ignored in: <function Engine.__del__ at 0x7f>\n"
        "Traceback (most recent call last):\n  File \"e.py\", line 9, in __del__\n"
        "AttributeError: 'Engine' object has no attribute 'runtime'",
        "torch.OutOfMemoryError: CUDA out of memory"),
    "named otherwise than an Error": (
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "torch._dynamo.exc.Unsupported: call_function\n" + NCCL_AT_EXIT,
        "torch._dynamo.exc.Unsupported: call_function"),
    "without a traceback": ("RuntimeError: no GPU\n" + NCCL_AT_EXIT, "RuntimeError: no GPU"),
}


@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_a_failed_childs_error_is_its_exception(case):
    bench = bench_module()
    output, said = OUTPUTS[case]
    error = bench.child_error(output, 1)
    assert said in error
    assert bench.error_line(error) == said
    if "Traceback" in output:
        # From the raised exception's traceback on (what was printed after it stays).
        assert error.splitlines()[0].endswith("Traceback (most recent call last):")


def test_a_long_traceback_keeps_its_first_line_its_last_frames_and_the_exception():
    bench = bench_module()
    frames = [f'  File "f{i}.py", line {i}, in f' for i in range(60)]
    output = "\n".join(["Traceback (most recent call last):"] + frames + ["KeyError: 'x'"])
    error = bench.child_error(output, 1).splitlines()
    assert error == ["Traceback (most recent call last):"] + frames[-9:] + ["KeyError: 'x'"]
    assert bench.error_line("\n".join(error)) == "KeyError: 'x'"
    assert bench.child_error("", 3) == "exit 3"


def test_a_long_message_keeps_the_line_naming_the_exception():
    # As torch reports a JIT build that failed: the compiler's whole output in the message.
    bench = bench_module()
    frames = [f'  File "f{i}.py", line {i}, in f' for i in range(20)]
    said = "RuntimeError: Error building extension 'async_io'"
    output = "\n".join(["Traceback (most recent call last):"] + frames + [said] +
                       [f"deepspeed_aio_common.cpp:{i}: error: x" for i in range(80)])
    error = bench.child_error(output, 1)
    assert len(error.splitlines()) == 40 and said in error
    assert bench.error_line(error) == said


def test_a_child_killed_by_a_signal_says_so_not_its_last_line():
    bench = bench_module()
    output = "Traceback (most recent call last):\n  File \"x.py\"\nValueError: caught, logged\n" \
             "[INFO] step 3"
    error = bench.child_error(output, -9)
    assert bench.error_line(error).startswith("the child was stopped: killed by SIGKILL")
    assert error.splitlines()[-1] == "[INFO] step 3"


def test_a_child_past_its_time_limit_is_kept_as_the_rows_error_and_the_run_goes_on(tmp_path):
    report, stdout = run_bench(tmp_path, "--rows", "zero2_cpu", "--no-floor",
                               "--child-timeout", "1")
    error = report["rows"][0]["strata"]["error"]
    assert error.startswith("the child was stopped: ran past --child-timeout 1 s and was killed")
    assert "strata failed: the child was stopped: ran past --child-timeout 1 s" in stdout


def test_a_strata_setting_given_for_an_ab_goes_to_stratas_copy_alone_and_is_said(tmp_path):
    report, stdout = run_bench(tmp_path, "--rows", "zero2_cpu", "--no-floor", "--strata",
                               '{"optimizer_threads": 1}')
    assert report["config"]["strata_extra"] == {"optimizer_threads": 1}
    assert "differs from DeepSpeed's by --strata" in stdout
    assert "error" not in report["rows"][0]["strata"]
    # It reaches strata's engine in the child: a host budget the config reader takes but no
    # model fits fails strata's row there, naming the budget.
    report, _ = run_bench(tmp_path, "--rows", "zero2_cpu", "--no-floor", "--strata",
                          '{"host_budget_bytes": 4096}')
    assert "is below the smallest this config and model take" in \
        report["rows"][0]["strata"]["error"]


@pytest.mark.parametrize("given, said", [
    ('{"optimizer_threads": -3}', "strata.optimizer_threads: must be an integer in [0, 1024]"),
    ('{"optimizer_thread": 2}', "strata.optimizer_thread: unknown key (did you mean "
                                "optimizer_threads?)"),
])
def test_a_strata_setting_strata_refuses_stops_the_run_before_any_round(tmp_path, given, said):
    proc = subprocess.run([sys.executable, BENCH, "--dir", str(tmp_path / "scratch"), "--rows",
                           "zero2_cpu,zero3_nvme", "--no-floor", "--strata", given],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "strata refuses the zero2_cpu row's config (with --strata's keys)" in proc.stderr
    assert said in proc.stderr
    assert "round 0" not in proc.stdout  # no row ran
    assert not (tmp_path / "scratch").exists()  # checked before anything was made


@pytest.mark.parametrize("given", ["{nope", "[1]"])
def test_a_strata_setting_that_is_not_a_json_object_is_refused(tmp_path, given):
    proc = subprocess.run([sys.executable, BENCH, "--dir", str(tmp_path), "--strata", given],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "accepted: a JSON object of strata block keys" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None,
                    reason="DeepSpeed is installed in this environment: accelerate, which the "
                           "trainer row's strata side imports, would find it past the package "
                           "that hides it here (its metadata stays)")
def test_the_trainer_row_trains_strata_through_transformers_trainer(tmp_path):
    """The trainer row: strata.hf.Trainer with the row's TrainingArguments and "auto" config
    (checked filled before the rounds), its steps timed by a callback; DeepSpeed's side kept
    with why (not installed here)."""
    report, stdout = run_bench(tmp_path, "--rows", "trainer")
    (row,) = report["rows"]
    assert "not installed" in row["deepspeed"]["error"]
    ours = row["strata"]
    assert "error" not in ours, ours
    assert len(ours["losses"]) == 3 and ours["step_s"] > 0  # two warm-up steps and one
    assert all(loss > 0 for loss in ours["losses"])
    assert "trainer    strata" in stdout
