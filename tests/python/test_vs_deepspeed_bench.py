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


def run_bench(tmp_path, *flags, deepspeed=HIDDEN, env=None):
    hidden = tmp_path / "hidden"
    (hidden / "deepspeed").mkdir(parents=True, exist_ok=True)
    (hidden / "deepspeed" / "__init__.py").write_text(deepspeed)
    env = dict(os.environ, **(env or {}))
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


# ---- the rows across ranks -----------------------------------------------------------------

# A stand-in for DeepSpeed across ranks: plain data-parallel PyTorch on Gloo (the gradients
# averaged over the ranks, clipped by their norm, torch's AdamW: the arithmetic of ZeRO-2 with
# the config's optimizer), joining the job from the launcher's variables as deepspeed.initialize
# does. Each rank writes what it was given to $FAKE_DS_LOG/rank<r>.json.
DATA_PARALLEL = """import json, os
import torch
import torch.distributed as dist
__version__ = "data-parallel stand-in"

def initialize(model, model_parameters, config):
    dist.init_process_group("gloo")
    return Engine(model, config), None, None, None

class Engine:
    def __init__(self, model, config):
        self.model, self.config = model, config
        self.optimizer = torch.optim.AdamW(model.parameters(), **config["optimizer"]["params"])
        self.log = {"config": config, "batches": [],
                    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                           "LOCAL_SIZE", "MASTER_ADDR",
                                                           "OMP_NUM_THREADS")},
                    "world": dist.get_world_size(), "rank": dist.get_rank()}

    def __call__(self, **kwargs):
        self.log["batches"].append(kwargs["input_ids"].tolist())
        with open(os.path.join(os.environ["FAKE_DS_LOG"], f"rank{dist.get_rank()}.json"),
                  "w") as f:
            json.dump(self.log, f)
        return self.model(**kwargs)

    def backward(self, loss):
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config["gradient_clipping"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
"""


def test_a_row_across_ranks_splits_the_global_batch_and_reports_the_job(tmp_path):
    """zero2_cpu_2ranks, both systems as 2 ranks: each rank is given its half of each global
    batch (the one-process rows' batch, from the same seed) and the launcher's variables; the row
    reports each step as the slowest rank's, the losses as the ranks' mean (strata's agree with
    data-parallel PyTorch's), and memory summed over the ranks."""
    import torch
    log = tmp_path / "ds_log"
    log.mkdir()
    report, stdout = run_bench(tmp_path, "--rows", "zero2_cpu_2ranks", "--no-floor",
                               deepspeed=DATA_PARALLEL, env={"FAKE_DS_LOG": str(log)})
    (row,) = report["rows"]
    ours, theirs = row["strata"], row["deepspeed"]
    assert "error" not in ours and "error" not in theirs, (ours.get("error"), theirs.get("error"))
    # What DeepSpeed's side was given: the same job on every rank, its slice of each batch.
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(3)]  # --batch 2
    for rank in (0, 1):
        given = json.loads((log / f"rank{rank}.json").read_text())
        assert given["world"] == 2 and given["rank"] == rank
        assert given["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                "OMP_NUM_THREADS": os.environ.get(
                                    "OMP_NUM_THREADS", str(max(1, os.cpu_count() // 2)))}
        assert given["config"]["train_batch_size"] == 2
        assert given["config"]["train_micro_batch_size_per_gpu"] == 1
        assert given["batches"] == [b[rank:rank + 1].tolist() for b in batches]
    for side in (ours, theirs):
        assert side["ranks"] == 2 and len(side["rank_losses"]) == 2
        # Each rank trained its own half: their losses differ; the row's are their mean.
        assert side["rank_losses"][0] != side["rank_losses"][1]
        assert side["losses"] == pytest.approx([(a + b) / 2 for a, b in
                                                zip(*side["rank_losses"])], rel=1e-12)
        ((rank0, rank1),) = side["rank_step_s"]  # one round, one timed step a rank
        assert side["step_s"] == max(rank0[-1], rank1[-1])
        assert side["peak_rss_bytes"] == sum(side["rank_peak_rss_bytes"])
        assert min(side["rank_peak_rss_bytes"]) > 0
    assert not row["void"] and row["loss_difference"] < 1e-5
    assert row["speedup"] == pytest.approx(theirs["step_s"] / ours["step_s"])
    (figure,) = report["figures"]
    assert figure["ranks"] == 2
    assert ours["collectives"] == "strata's collectives (shared memory) over host memory"
    assert "vs_deepspeed/zero2_cpu_2ranks: 2 ranks on this machine (strata: strata's collectives " \
        "(shared memory) over host memory; DeepSpeed: torch.distributed Gloo over loopback), the " \
        "global batch 2 (1 a rank)" in stdout


# A DeepSpeed whose rank 1 fails in deepspeed.initialize while rank 0 hangs (as in a collective
# that rank 1 never joins), having started a process of its own; rank 1 fails once rank 0 has
# said so through a FIFO. Each process carries $FAKE_DS_LOG in its command line.
HANGING = """import os, subprocess, sys, time
__version__ = "hanging stand-in"

def initialize(**kwargs):
    fifo = os.path.join(os.environ["FAKE_DS_LOG"], "started")
    if os.environ["RANK"] == "0":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                          os.environ["FAKE_DS_LOG"]])
        with open(fifo, "w") as f:
            f.write("started")
        time.sleep(300)
    with open(fifo) as f:
        f.read()
    raise ValueError("rank 1 refuses")
"""


def bench_args(**given):
    """The driver's arguments run_one reads, for the tiny model."""
    import types
    args = dict(layers=1, width=64, heads=2, context=16, batch=4, device="cpu", steps=1,
                phases=0, profile=False, clipping=1.0, bf16=False, child_timeout=120,
                nvme_placeholder="@NVME@", strata_extra=None)
    args.update(given)
    return types.SimpleNamespace(**args)


def left_behind(marker):
    """The live processes (zombies aside) whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if marker in cmdline and state != "Z" and int(pid) != os.getpid():
            found.append((int(pid), cmdline.replace("\0", " ")))
    return found


@pytest.mark.parametrize("timeout_s", [120, 1])
def test_a_job_of_ranks_that_fails_or_runs_too_long_leaves_no_process_behind(
        tmp_path, monkeypatch, timeout_s):
    """Rank 1 fails while rank 0 hangs: the job ends at once, rank 0 and the process it started
    killed, and the row keeps rank 1's error; past --child-timeout, every rank is killed and the
    error says so."""
    import time
    bench = bench_module()
    hidden = tmp_path / "hidden" / "deepspeed"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(HANGING)
    log = tmp_path / "ds_log"
    log.mkdir()
    os.mkfifo(log / "started")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(hidden.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("FAKE_DS_LOG", str(log))
    args = bench_args(child_timeout=timeout_s)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    config = bench.row_config("zero3_cpu_2ranks", args, args.nvme_placeholder)[0]
    start = time.monotonic()
    report = bench.run_one("deepspeed", "zero3_cpu_2ranks", config, args, 0, str(scratch))
    took = time.monotonic() - start
    assert left_behind(str(tmp_path)) == []
    if timeout_s == 1:
        assert report["error"].startswith(
            "the child was stopped: ran past --child-timeout 1 s and was killed, with the "
            "job's 2 ranks"), report["error"]
        return
    assert took < 100, took  # not rank 0's 300 s
    assert report["rank"] == 1
    assert bench.error_line(report["error"]) == "[rank1]: ValueError: rank 1 refuses"
    assert all(line.startswith("[rank1]: ") for line in report["error"].splitlines())


@pytest.mark.parametrize("flags, said", [
    (["--device", "cuda"], "strata across ranks runs on its emulated device tier only"),
    (["--batch", "3"], "--batch 3 is the global batch and the rows zero3_cpu_2ranks split it "
                       "over their ranks; accepted: a multiple of 2"),
])
def test_a_row_across_ranks_refuses_what_it_cannot_run_before_any_round(tmp_path, flags, said):
    proc = subprocess.run([sys.executable, BENCH, "--dir", str(tmp_path / "scratch"), "--rows",
                           "zero2_cpu,zero3_cpu_2ranks", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert said in proc.stderr
    assert not (tmp_path / "scratch").exists()


def test_the_ranks_of_a_row_and_its_config_across_them():
    bench = bench_module()
    assert [bench.ranks_of(r) for r in ("zero2_cpu", "zero2_cpu_2ranks", "zero3_cpu_2ranks")] \
        == [1, 2, 2]
    assert bench.row_stage("zero2_cpu_2ranks") == 2 and bench.row_stage("zero3_cpu_2ranks") == 3
    args = bench_args(batch=8)
    one = bench.row_config("zero3_cpu", args, "@NVME@")[0]
    two = bench.row_config("zero3_cpu_2ranks", args, "@NVME@")[0]
    assert two["train_batch_size"] == 8 and two["train_micro_batch_size_per_gpu"] == 4
    assert "train_batch_size" not in one and one["train_micro_batch_size_per_gpu"] == 8
    assert two["zero_optimization"] == one["zero_optimization"]
