"""strata._strata.Runtime from Python: partitions through every tier, the optimizer, errors.

The device tier here is the host-emulated one (strata.device "emulated": ordinary memory with its
own budget), as on every machine without a GPU."""
import json

import pytest
import torch
from torch.utils.dlpack import from_dlpack

import strata
from strata import _strata


def config(tmp_path, device_budget=1 << 20, host_budget=64 << 20, max_in_cpu=10**9):
    return json.dumps({
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2,
                              "buffer_size": 65536, "max_in_cpu": max_in_cpu},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "strata": {"device": "emulated", "device_budget_bytes": device_budget,
                   "host_budget_bytes": host_budget, "nvme_capacity_bytes": 256 << 20}})


@pytest.mark.parametrize("max_in_cpu", [0, 10**9])
def test_bytes_go_down_and_come_back_through_every_tier(tmp_path, max_in_cpu):
    warnings = []
    rt = _strata.Runtime(config(tmp_path, max_in_cpu=max_in_cpu), on_warning=warnings.append)
    assert rt.emulated_device
    assert any("emulated" in w for w in warnings)
    rt.register(0, "param", "bfloat16", 5000, 0, "nvme",
                torch.arange(5000, dtype=torch.float32).to(torch.bfloat16))
    on_device = from_dlpack(rt.acquire(0, "device"))
    assert on_device.dtype == torch.bfloat16 and on_device.shape == (5000,)
    assert torch.equal(on_device, torch.arange(5000, dtype=torch.float32).to(torch.bfloat16))
    on_device.mul_(2)
    del on_device
    rt.release(0, "device", True)
    on_host = from_dlpack(rt.acquire(0, "host"))
    assert torch.equal(on_host.float(), 2 * torch.arange(5000, dtype=torch.float32).to(
        torch.bfloat16).float())
    del on_host
    rt.release(0, "host", False)
    report = rt.end_step()
    if max_in_cpu:  # a parameter within max_in_cpu: through the host tier, whose copy stays
        assert report["bytes_moved"]["nvme_to_host"] == 10000
        assert report["bytes_moved"]["host_to_device"] == 10000
    else:  # straight to the device, staged
        assert report["bytes_moved"]["nvme_to_device"] == 10000
    assert report["bytes_moved"]["device_to_host"] == 10000
    assert rt.stats()["steps"] == 1


def test_without_a_callback_the_configs_warnings_are_python_warnings_not_stdout(tmp_path,
                                                                             capfd):
    with pytest.warns(UserWarning, match="zero_optimization.stage: accepted but not yet used"):
        _strata.Runtime(config(tmp_path))
    assert capfd.readouterr().out == ""


def test_a_discarded_gradient_comes_back_as_zeros(tmp_path):
    rt = _strata.Runtime(config(tmp_path))
    rt.register(1, "grad", "float32", 100, 0, "device", torch.ones(100))
    rt.discard(1)
    g = from_dlpack(rt.acquire(1, "device"))
    assert torch.equal(g, torch.zeros(100))
    del g
    rt.release(1, "device", False)


def test_the_optimizer_steps_state_on_nvme_like_torch_adamw(tmp_path):
    rt = _strata.Runtime(config(tmp_path))
    rt.create_optimizer(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True,
                        bias_correction=True, partitions=[(3, 777)])
    start = torch.randn(777, generator=torch.Generator().manual_seed(0))
    rt.initialize_optimizer_state(3, start)
    reference = torch.nn.Parameter(start.clone())
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    copy_out = torch.zeros(777, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 6):
        g = torch.randn(777, generator=gen)
        # From step 3 the betas given with each step (a schedule's: torch's Adam reads its
        # group's at each step), bias correction with them.
        betas = (0.9, 0.999) if t < 3 else (0.85 - 0.05 * t, 0.99)
        torch_adamw.param_groups[0]["betas"] = betas
        report = rt.optimizer_step(t, [(3, g, copy_out)], **(
            {} if t < 3 else {"beta1": betas[0], "beta2": betas[1]}))
        # Written behind the step (strata.optimizer_write_behind's default): its bytes are
        # reported by the next step.
        assert not report["overflow"] and report["written_behind"]
        assert report["bytes_written"] == 0
        assert report["behind_bytes_written"] == (0 if t == 1 else 777 * 12)
        reference.grad = g
        torch_adamw.step()
    master, m, v = torch.zeros(777), torch.zeros(777), torch.zeros(777)
    rt.read_optimizer_state(3, master, m, v)
    torch.testing.assert_close(master, reference.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(copy_out, master.to(torch.bfloat16))
    with pytest.raises(strata.InvalidArgumentError, match=r"beta1 1.5: accepted 0 <= beta1 < 1"):
        rt.optimizer_step(6, [(3, g, copy_out)], beta1=1.5)


def test_bad_arguments_name_what_is_wrong(tmp_path):
    with pytest.raises(strata.InvalidArgumentError, match="zero_optimization"):
        _strata.Runtime('{"zero_optimisation": {}}')
    rt = _strata.Runtime(config(tmp_path))
    with pytest.raises(strata.InvalidArgumentError, match='tier "disk" is not accepted'):
        rt.register(0, "param", "float32", 10, 0, "disk")
    with pytest.raises(strata.InvalidArgumentError, match='dtype "int8" is not accepted'):
        rt.register(0, "param", "int8", 10, 0, "host")
    with pytest.raises(strata.InvalidArgumentError, match="initial holds 4 elements"):
        rt.register(0, "param", "float32", 10, 0, "host", torch.zeros(4))
    with pytest.raises(strata.InvalidArgumentError, match='tier "nvme" is not accepted'):
        rt.acquire(0, "nvme")
    with pytest.raises(strata.Error, match="not registered") as e:
        rt.acquire(9, "device")
    assert e.value.code == "NOT_FOUND"


def test_a_partition_larger_than_the_device_budget_is_refused(tmp_path):
    rt = _strata.Runtime(config(tmp_path, device_budget=64 << 10))
    rt.register(0, "param", "float32", 1 << 16, 0, "host")
    with pytest.raises(strata.Error) as e:
        rt.acquire(0, "device")
    assert e.value.code == "RESOURCE_EXHAUSTED"


def test_the_runtime_says_the_max_in_cpu_and_host_budget_it_read(tmp_path):
    rt = _strata.Runtime(config(tmp_path, host_budget=32 << 20, max_in_cpu=12345))
    assert rt.max_in_cpu == 12345 and rt.host_budget_bytes == 32 << 20
    # Without parameters on NVMe nothing is kept for them: 0.
    cpu = json.loads(config(tmp_path / "cpu"))
    cpu["zero_optimization"]["offload_param"]["device"] = "cpu"
    assert _strata.Runtime(json.dumps(cpu)).max_in_cpu == 0
