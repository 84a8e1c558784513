"""strata.optim.CpuAdam / CpuAdamW against torch.optim.Adam / AdamW, step for step."""
import copy

import pytest
import torch

import strata
from references import LionReference
from strata.optim import CpuAdam, CpuAdamW

# strata's kernels use fused multiply-adds where torch's CPU path rounds twice: the same update to
# within a few ulps per step, so after 20 steps the weights agree to these tolerances.
RTOL, ATOL = 1e-5, 1e-6


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))


def train(model, optimizer, steps=20, grad_dtype=None, scheduler=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        y = torch.randn(16, 7, generator=gen)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if grad_dtype is not None:
            # Gradients as a bf16 trainer would hand them over: rounded to grad_dtype.
            for p in model.parameters():
                p.grad = p.grad.to(grad_dtype)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def assert_same_weights(a, b, rtol=RTOL, atol=ATOL):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_cpu_adamw_matches_torch_adamw():
    ours, theirs = make_model(), make_model()
    train(ours, CpuAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1))
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1))
    assert_same_weights(ours, theirs)
    # Training moved the weights: the comparison is not of two untouched models.
    assert not torch.allclose(ours[0].weight, make_model()[0].weight, atol=1e-3)


def test_cpu_adam_without_adamw_mode_matches_torch_adam_with_l2():
    ours, theirs = make_model(), make_model()
    train(ours, CpuAdam(ours.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=False))
    train(theirs, torch.optim.Adam(theirs.parameters(), lr=1e-2, weight_decay=0.05))
    assert_same_weights(ours, theirs)


def test_cpu_adam_defaults_are_deepspeed_cpu_adams():
    opt = CpuAdam(make_model().parameters())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 0)
    assert opt.adamw_mode
    assert CpuAdamW(make_model().parameters()).param_groups[0]["weight_decay"] == 1e-2


def test_bias_correction_off_matches_the_formula():
    model = make_model()
    opt = CpuAdam(model.parameters(), lr=1e-2, bias_correction=False)
    before = copy.deepcopy(model)
    train(model, opt, steps=1)
    # One step from zero moments without bias correction: p -= lr * (0.1 g) / (sqrt(0.001 g^2) + eps),
    # g recomputed from train's first draw.
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 33, generator=gen), torch.randn(16, 7, generator=gen)
    torch.nn.functional.mse_loss(before(x), y).backward()
    for p0, p1 in zip(before.parameters(), model.parameters()):
        g = p0.grad
        expected = p0 - 1e-2 * (0.1 * g) / (torch.sqrt(0.001 * g * g) + 1e-8)
        torch.testing.assert_close(p1, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_match_torch_on_the_same_values(grad_dtype):
    # torch keeps a parameter's gradient in its own dtype, so half-precision gradients of fp32
    # master weights (what strata's engine hands over from a bf16 or fp16 model) reach the kernel
    # directly; torch's AdamW gets the same rounded values widened to fp32.
    kernel = strata._strata.Adam(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                 adamw=True, bias_correction=True)
    gen = torch.Generator().manual_seed(3)
    ours = torch.randn(4099, generator=gen)
    theirs = torch.nn.Parameter(ours.clone())
    m, v = torch.zeros(4099), torch.zeros(4099)
    reference = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1)
    for t in range(1, 11):
        g = torch.randn(4099, generator=gen).to(grad_dtype)
        kernel.step(t, ours, g, m, v)
        theirs.grad = g.float()
        reference.step()
    torch.testing.assert_close(ours, theirs.detach(), rtol=RTOL, atol=ATOL)


def test_bf16_moments_stay_close_to_fp32_ones():
    ours, theirs = make_model(), make_model()
    opt = CpuAdamW(ours.parameters(), lr=1e-2)
    opt.fp32_optimizer_states = False
    train(ours, opt)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2))
    assert opt.state[ours[0].weight]["exp_avg"].dtype == torch.bfloat16
    # bf16 moments carry 8 bits of mantissa: the weights drift by about lr * 2^-8 per step at most.
    assert_same_weights(ours, theirs, rtol=0, atol=20 * 1e-2 * 2 ** -8)


def test_a_learning_rate_scheduler_drives_the_step():
    ours, theirs = make_model(), make_model()
    o = CpuAdamW(ours.parameters(), lr=1e-2)
    t = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    train(ours, o, scheduler=torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.3))
    train(theirs, t, scheduler=torch.optim.lr_scheduler.StepLR(t, step_size=5, gamma=0.3))
    assert o.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.3 ** 4)
    assert_same_weights(ours, theirs)


def test_param_groups_keep_their_own_hyper_parameters():
    ours, theirs = make_model(), make_model()

    def groups(m):
        return [{"params": m[0].parameters(), "weight_decay": 0.2, "betas": (0.8, 0.99)},
                {"params": m[2].parameters(), "lr": 3e-3}]

    train(ours, CpuAdamW(groups(ours), lr=1e-2, weight_decay=0.0))
    train(theirs, torch.optim.AdamW(groups(theirs), lr=1e-2, weight_decay=0.0))
    assert_same_weights(ours, theirs)


def test_a_torch_adamw_state_dict_loads_and_training_goes_on_the_same():
    ours, theirs = make_model(), make_model()
    t = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    train(theirs, t, steps=5)
    ours.load_state_dict(theirs.state_dict())
    o = CpuAdamW(ours.parameters(), lr=1e-2)
    # A copy, as a state dict read from a file is: torch 2's load_state_dict keeps the tensors it
    # is given (torch 1.13 copied them), so both optimizers would step the same moments.
    o.load_state_dict(copy.deepcopy(t.state_dict()))
    train(ours, o, steps=5, seed=7)
    train(theirs, t, steps=5, seed=7)
    assert_same_weights(ours, theirs)
    # And back: our state dict loads into torch's optimizer.
    t2 = torch.optim.AdamW(make_model().parameters(), lr=1e-2)
    t2.load_state_dict(o.state_dict())
    assert int(t2.state_dict()["state"][0]["step"]) == 10


def test_parameters_without_gradients_are_left_alone():
    model = make_model()
    model[2].weight.requires_grad_(False)
    frozen = model[2].weight.clone()
    train(model, CpuAdamW([p for p in model.parameters()], lr=1e-2))
    assert torch.equal(model[2].weight, frozen)


def test_bad_arguments_are_refused_by_name():
    params = list(make_model().parameters())
    with pytest.raises(ValueError, match="amsgrad"):
        CpuAdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):
        CpuAdamW(params, maximize=True)
    with pytest.raises(ValueError, match="lr -1"):
        CpuAdam(params, lr=-1)
    with pytest.raises(ValueError, match=r"betas\[1\] 1.0"):
        CpuAdam(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps 0"):
        CpuAdam(params, eps=0)
    with pytest.raises(ValueError, match="torch.float16; accepted: torch.float32"):
        CpuAdam([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))])


def test_a_non_contiguous_parameter_is_refused_at_step_naming_it():
    p = torch.nn.Parameter(torch.randn(4, 3).t())
    opt = CpuAdamW([p])
    p.grad = torch.ones(3, 4)
    with pytest.raises(strata.InvalidArgumentError, match="param: the tensor is not contiguous"):
        opt.step()


def test_the_core_errors_are_value_errors_and_strata_errors():
    assert issubclass(strata.InvalidArgumentError, ValueError)
    assert issubclass(strata.InvalidArgumentError, strata.Error)
    assert issubclass(strata.Error, RuntimeError)
    kernel = strata._strata.Adam(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 adamw=True, bias_correction=True)
    p = torch.zeros(8)
    with pytest.raises(strata.InvalidArgumentError, match="grad: 4 elements for a param of 8") as e:
        kernel.step(1, p, torch.zeros(4), torch.zeros(8), torch.zeros(8))
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(strata.InvalidArgumentError, match="a list is not accepted"):
        kernel.step(1, [0.0], torch.zeros(8), torch.zeros(8), torch.zeros(8))
    with pytest.raises(strata.InvalidArgumentError, match="element type"):
        kernel.step(1, p, torch.zeros(8, dtype=torch.int32), torch.zeros(8), torch.zeros(8))
    with pytest.raises(strata.Error, match="lr"):
        strata._strata.Adam(lr=-1.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            adamw=True, bias_correction=True)


def test_an_overflowing_gradient_is_found_and_changes_nothing():
    kernel = strata._strata.Adam(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 adamw=True, bias_correction=True)
    p, m, v = torch.ones(100), torch.zeros(100), torch.zeros(100)
    g = torch.ones(100)
    g[57] = float("inf")
    assert kernel.has_non_finite(g)
    assert kernel.step(1, p, g, m, v, check_overflow=True)
    assert torch.equal(p, torch.ones(100)) and torch.equal(m, torch.zeros(100))
    g[57] = 1.0
    assert not kernel.step(1, p, g, m, v, check_overflow=True)
    assert not torch.equal(p, torch.ones(100))


def test_the_step_writes_a_half_precision_copy_in_the_same_pass():
    kernel = strata._strata.Adam(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 adamw=True, bias_correction=True)
    p = torch.randn(1000)
    copy_out = torch.zeros(1000, dtype=torch.bfloat16)
    kernel.step(1, p, torch.randn(1000), torch.zeros(1000), torch.zeros(1000),
                param_copy=copy_out)
    assert torch.equal(copy_out, p.to(torch.bfloat16))


def test_cpu_adagrad_matches_torch_adagrad():
    ours, theirs = make_model(), make_model()
    kwargs = dict(lr=5e-2, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1)
    train(ours, strata.optim.CpuAdagrad(ours.parameters(), **kwargs))
    train(theirs, torch.optim.Adagrad(theirs.parameters(), **kwargs))
    assert_same_weights(ours, theirs)


def test_a_torch_adagrad_state_dict_loads_into_cpu_adagrad():
    ours, theirs = make_model(), make_model()
    t = torch.optim.Adagrad(theirs.parameters(), lr=5e-2)
    train(theirs, t, steps=5)
    ours.load_state_dict(theirs.state_dict())
    o = strata.optim.CpuAdagrad(ours.parameters(), lr=5e-2)
    o.load_state_dict(copy.deepcopy(t.state_dict()))  # a copy, as from a file (above)
    train(ours, o, steps=5, seed=7)
    train(theirs, t, steps=5, seed=7)
    assert_same_weights(ours, theirs)


def test_cpu_lion_matches_the_published_update():
    ours, theirs = make_model(), make_model()
    kwargs = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    train(ours, strata.optim.CpuLion(ours.parameters(), **kwargs))
    train(theirs, LionReference(theirs.parameters(), **kwargs))
    assert_same_weights(ours, theirs)
    assert strata.optim.CpuLion(make_model().parameters()).param_groups[0]["betas"] == \
        (0.9, 0.999)  # DeepSpeedCPULion's default


def test_adagrad_and_lion_refuse_bad_arguments_by_name():
    params = list(make_model().parameters())
    with pytest.raises(ValueError, match="lr_decay -1 is not accepted"):
        strata.optim.CpuAdagrad(params, lr_decay=-1)
    with pytest.raises(ValueError, match="eps 0 is not accepted"):
        strata.optim.CpuAdagrad(params, eps=0)
    with pytest.raises(ValueError, match="maximize"):
        strata.optim.CpuAdagrad(params, maximize=True)
    with pytest.raises(ValueError, match=r"betas\[0\] 1.5 is not accepted"):
        strata.optim.CpuLion(params, betas=(1.5, 0.99))
    with pytest.raises(ValueError, match="torch.float16; accepted: torch.float32"):
        strata.optim.CpuLion([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))])


def test_a_kernel_is_given_exactly_its_optimizers_states():
    adam = strata._strata.Adam(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                               adamw=True, bias_correction=True)
    lion = strata._strata.Lion(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0)
    p, g = torch.zeros(8), torch.ones(8)
    with pytest.raises(strata.InvalidArgumentError, match="exp_avg_sq is missing"):
        adam.step(1, p, g, torch.zeros(8))
    with pytest.raises(strata.InvalidArgumentError, match="a second state was given"):
        lion.step(1, p, g, torch.zeros(8), torch.zeros(8))
    with pytest.raises(strata.InvalidArgumentError, match="state: 4 elements for a param of 8"):
        lion.step(1, p, g, torch.zeros(4))
