"""The engine on the CUDA device tier (`strata.device` "cuda"), against plain PyTorch on the same GPU.

Every case here needs a CUDA device and skips, saying so, where there is none (the development
machines): scripts/device-check.sh runs them on a lent GPU machine, where a skip counts as a
failure. The other suites run the same engine on the host-emulated device tier; these check what
only a GPU exercises: the model computing on the device, partitions lent into device memory
through pinned staging buffers, gradients copied back, bf16 on the GPU, a device budget below the
model's parameters, strata.init, generate() and checkpoints.
"""
import copy

import pytest
import torch
import transformers

import strata
from references import MixedPrecisionAdamW

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False): these run on a GPU machine "
           "(scripts/device-check.sh)")

VOCAB, WIDTH = 64, 64


class Net(torch.nn.Module):
    def __init__(self, blocks=4):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.LayerNorm(2 * WIDTH), torch.nn.ReLU(),
            torch.nn.Linear(2 * WIDTH, WIDTH)) for _ in range(blocks))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (4, 16), generator=gen)
        yield x.cuda(), torch.roll(x, 1, 1).cuda()


def loss_of(logits, y):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))


def param_bytes(model, element):
    return sum(p.numel() for p in model.parameters()) * element


def quarter_budget(model, element, fraction=4):
    """A `fraction`th of the parameters' bytes, or room for the largest one with its fp32
    gradient and half as much again."""
    largest = max(p.numel() for p in model.parameters())
    return max(param_bytes(model, element) // fraction, largest * (element + 4) * 3 // 2)


def make_config(tmp_path, stage, offload, dtype, budget, accumulation=2):
    nvme = str(tmp_path / "nvme")
    zero = {"stage": stage, "offload_optimizer": {"device": offload, "nvme_path": nvme},
            "stage3_param_persistence_threshold": 100}
    if stage == 3 or offload == "nvme":
        zero["offload_param"] = {"buffer_count": 2, "buffer_size": 1 << 16}
    if stage == 3:
        zero["offload_param"].update(device=offload, nvme_path=nvme)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": zero,
              "strata": {"device": "cuda", "device_budget_bytes": budget,
                         "host_budget_bytes": 64 << 20, "nvme_capacity_bytes": 64 << 20}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_on_cuda_matches_plain_torch_on_the_same_gpu(tmp_path, stage, offload, dtype):
    torch.manual_seed(0)
    model = Net()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    element = 2 if dtype == "bf16" else 4
    model_bytes = param_bytes(model, element)
    # Stage 3: the device holds half the parameters (and their gradients) at once.
    budget = quarter_budget(model, element, 2) if stage == 3 else 64 << 20
    reference = MixedPrecisionAdamW(copy.deepcopy(model).cuda(), torch_dtype, clipping=1.0,
                                    lr=1e-3)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, stage, offload, dtype, budget))
    assert engine.device_kind == "cuda" and engine.device.type == "cuda"
    losses = []
    for i, (x, y) in enumerate(batches(8)):
        logits = engine(x)
        assert logits.is_cuda
        loss = loss_of(logits, y)
        engine.backward(loss)
        engine.step()
        ref_loss = loss_of(reference.model(x), y)
        reference.backward(ref_loss, 2)
        if (i + 1) % 2 == 0:
            reference.step()
        losses.append((loss.item(), ref_loss.item()))
    # fp32: cuBLAS on both sides, the optimizer's fused multiply-adds apart; bf16: one rounding
    # of a weight landing differently moves later losses by about 2^-8 relative.
    tolerance = 1e-4 if dtype == "fp32" else 2e-2
    for ours, theirs in losses:
        assert ours == pytest.approx(theirs, rel=tolerance, abs=tolerance)
    state = engine.module_state_dict()
    for name, theirs in reference.master.state_dict().items():
        torch.testing.assert_close(state[name].float().cpu(), theirs.float().cpu(),
                                   rtol=tolerance, atol=tolerance if dtype == "fp32" else 2e-2)
    assert engine.last_step_stats["device"] == "cuda"
    stats = engine.stats()
    if stage == 3:
        assert stats["budget_bytes"]["device"] == budget < model_bytes
        assert 0 < stats["peak_bytes"]["device"] <= budget
        into_device = sum(v for k, v in stats["bytes_moved"].items() if k.endswith("_to_device"))
        assert into_device >= 4 * model_bytes // 2, stats["bytes_moved"]
    engine.close()


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def llama_batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (2, 16), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, -4:] = 0
        out.append(dict(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                        labels=ids.masked_fill(mask == 0, -100).cuda()))
    return out


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_a_transformers_llama_trains_in_bf16_on_cuda_through_a_quarter_budget(tmp_path, offload):
    torch.manual_seed(0)
    model = llama()
    reference = MixedPrecisionAdamW(copy.deepcopy(model).cuda(), torch.bfloat16, clipping=1.0,
                                    lr=1e-3)
    plain = copy.deepcopy(model).cuda()
    budget = quarter_budget(model, 2)
    assert budget < param_bytes(model, 2) // 2
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, offload, "bf16", budget, accumulation=1))
    losses = []
    for kwargs in llama_batches(4):
        out = engine(**kwargs)
        engine.backward(out.loss)
        engine.step()
        ref = reference.model(**kwargs).loss
        reference.backward(ref, 1)
        reference.step()
        losses.append((out.loss.item(), ref.item()))
    for ours, theirs in losses:
        assert ours == pytest.approx(theirs, rel=2e-2, abs=2e-2)
    stats = engine.stats()
    assert 0 < stats["peak_bytes"]["device"] <= budget
    # generate() under no_grad with offloaded parameters gives the plain model's tokens.
    plain.load_state_dict({k: v.float() for k, v in engine.module_state_dict().items()})
    plain = plain.to(torch.bfloat16)
    prompt = llama_batches(1, seed=5)[0]["input_ids"][:1, :6]
    engine.eval()
    with torch.no_grad():
        ours = engine.module.generate(prompt, max_new_tokens=6, do_sample=False)
        theirs = plain.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.cpu(), theirs.cpu())
    engine.close()


def test_strata_init_builds_on_the_cuda_tier_and_trains(tmp_path):
    config = make_config(tmp_path, 3, "cpu", "bf16", 1 << 20, accumulation=1)
    torch.manual_seed(0)
    with strata.init(config=config):
        model = llama()
    engine, _, _, _ = strata.initialize(model=model, config=config)
    first = None
    for kwargs in llama_batches(6):
        out = engine(**kwargs)
        engine.backward(out.loss)
        engine.step()
        first = out.loss.item() if first is None else first
    assert out.loss.item() < first
    engine.close()


def test_a_checkpoint_on_cuda_resumes_bit_for_bit(tmp_path):
    def run(resume_from=None, save_to=None):
        torch.manual_seed(0)
        engine, _, _, _ = strata.initialize(
            model=Net(), config=make_config(tmp_path / "run", 3, "nvme", "bf16",
                                            quarter_budget(Net(), 2, 2), accumulation=1))
        data = list(batches(6))
        if resume_from:
            engine.load_checkpoint(resume_from)
            data = data[3:]
        losses = []
        for i, (x, y) in enumerate(data):
            loss = loss_of(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if save_to and i == 2:
                engine.save_checkpoint(save_to)
        engine.close()
        return losses

    whole = run(save_to=str(tmp_path / "ckpt"))
    resumed = run(resume_from=str(tmp_path / "ckpt"))
    assert resumed == whole[3:]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_state_dict_on_the_gpu_loads_as_torch_s_load_state_dict_takes_it(tmp_path, stage):
    """module.load_state_dict with the state dict's tensors on the GPU (torch.load's map_location
    "cuda", another model's state_dict()): torch copies them where its parameters are; strata
    takes them into its partitions and its optimizer's master weights (host memory), and the
    next step is plain torch's from those weights."""
    torch.manual_seed(0)
    wanted = {k: v.detach().clone() for k, v in Net().cuda().state_dict().items()}
    torch.manual_seed(1)
    model = Net()
    config = make_config(tmp_path, stage, "cpu", "fp32", quarter_budget(model, 4),
                         accumulation=1)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    engine.module.load_state_dict(wanted)
    state = engine.module_state_dict()
    for name, value in wanted.items():
        assert torch.equal(state[name].float().cpu(), value.cpu()), name
    source = Net()
    source.load_state_dict(wanted)
    reference = MixedPrecisionAdamW(source.cuda(), torch.float32, clipping=1.0, lr=1e-3)
    for x, y in batches(2):
        engine.backward(loss_of(engine(x), y))
        engine.step()
        reference.backward(loss_of(reference.model(x), y), 1)
        reference.step()
    state = engine.module_state_dict()
    for name, theirs in reference.master.state_dict().items():
        torch.testing.assert_close(state[name].float().cpu(), theirs.float().cpu(),
                                   rtol=1e-4, atol=1e-4, msg=name)
    engine.close()


@pytest.mark.parametrize("stage,accumulation", [(3, 1), (2, 2), (2, 1)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lent_copies_wait_for_the_kernels_queued_on_the_trainers_stream(tmp_path, dtype, stage,
                                                                       accumulation):
    """The GPU runs behind the host: a kernel that sleeps (torch.cuda._sleep) is queued on torch's
    stream (the default stream, whose handle is 0) before each block computes, forward and
    backward, so the host queues a block's work and frees its lent weights, or releases its
    gradient partition, well before the GPU has run it. Released without the stream, the Runtime
    would reuse a weight's device memory for the next prefetch, or copy a gradient to the host,
    before the kernels that read or write them; at stage 2 the gradients go to pinned host memory
    on the gradients' stream, and a host reading them before they land would sum stale values;
    with one micro-batch a step, each is staged as its copy is queued and the optimizer steps it
    during backward (no clipping: in place, for good) once a fence on that stream has passed: a
    step that read it early would step on what the pinned buffer held before. The losses and
    weights would part from plain torch's."""
    torch.manual_seed(0)
    model = Net()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    element = 2 if dtype == "bf16" else 4
    reference = MixedPrecisionAdamW(copy.deepcopy(model).cuda(), torch_dtype, clipping=0.0,
                                    lr=1e-3)
    config = make_config(tmp_path, stage, "cpu", dtype, quarter_budget(model, element, 2),
                         accumulation=accumulation)
    config["gradient_clipping"] = 0.0
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert torch.cuda.current_stream().cuda_stream == 0  # the case torch users are in

    def behind(*unused):
        torch.cuda._sleep(20_000_000)  # tens of milliseconds of the GPU's time

    for block in engine.module.blocks:
        block.register_forward_pre_hook(behind)
        block.register_full_backward_pre_hook(behind)
    tolerance = 1e-4 if dtype == "fp32" else 2e-2
    losses = []  # compared at the end: a .item() per micro-batch would let the GPU catch up
    for i, (x, y) in enumerate(batches(4 * accumulation)):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref = loss_of(reference.model(x), y)
        reference.backward(ref, accumulation)
        if (i + 1) % accumulation == 0:
            reference.step()
        losses.append((loss.detach(), ref.detach()))
        if stage == 2 and accumulation == 1 and i > 0:  # the path this case is for
            taken = engine.last_step_stats["optimizer"]
            assert taken["staged"] and taken["host_early"], taken
    for ours, theirs in losses:
        assert ours.item() == pytest.approx(theirs.item(), rel=tolerance, abs=tolerance)
    state = engine.module_state_dict()
    for name, theirs in reference.master.state_dict().items():
        torch.testing.assert_close(state[name].float().cpu(), theirs.float().cpu(),
                                   rtol=tolerance, atol=tolerance if dtype == "fp32" else 2e-2)
    engine.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_stage_2_steps_staged_during_backward_match_plain_torch_with_clipping(tmp_path, offload):
    """Stage 2, one micro-batch a step, gradient clipping: each gradient is staged as its copy to
    the host is queued (speculatively: the clipping is known only after backward). A step that
    clipping scales is dropped and taken anew, and the next one is not speculated; either way the
    result is plain torch's, step by step."""
    torch.manual_seed(0)
    model = Net()
    reference = MixedPrecisionAdamW(copy.deepcopy(model).cuda(), torch.float32, clipping=0.5,
                                    lr=1e-3)
    config = make_config(tmp_path, 2, offload, "fp32", 64 << 20, accumulation=1)
    config["gradient_clipping"] = 0.5
    engine, _, _, _ = strata.initialize(model=model, config=config)
    staged = 0
    for x, y in batches(8):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        staged += bool((engine.last_step_stats["optimizer"] or {}).get("staged"))
        ref = loss_of(reference.model(x), y)
        reference.backward(ref, 1)
        reference.step()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-4, abs=1e-4)
    assert staged + engine.redone_steps > 0, "nothing was staged during backward"
    state = engine.module_state_dict()
    for name, theirs in reference.master.state_dict().items():
        torch.testing.assert_close(state[name].float().cpu(), theirs.float().cpu(),
                                   rtol=1e-4, atol=1e-4)
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_set_between_backward_and_step_on_cuda_are_plain_torch_s(tmp_path, stage):
    """Gradient surgery on the CUDA tier (the head's gradient doubled and flipped): at stage 2
    `.grad = t` while the gradients are on their way to pinned host memory (taken once they have
    landed), at stage 3 strata.safe_set_full_grad into the gradient partitions (the head's bias,
    a small parameter, keeps .grad on the device). The step takes what was set, as plain torch's
    AdamW on the same GPU does; from the second step nothing is staged (or stepped, as
    strata.optimizer_during_backward would) during backward."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model).cuda()
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    config = make_config(tmp_path, stage, "cpu", "fp32", 64 << 20, accumulation=1)
    config["gradient_clipping"] = 0.0
    engine, _, _, _ = strata.initialize(model=model, config=config)
    named = list(zip(engine.module.named_parameters(), reference.parameters()))
    for x, y in batches(4):
        engine.backward(loss_of(engine(x), y))
        loss_of(reference(x), y).backward()
        for (name, ours), theirs in named:
            if name.startswith("head"):
                theirs.grad = -2 * theirs.grad
                if stage == 2:
                    ours.grad = theirs.grad.clone()
                else:
                    strata.safe_set_full_grad(ours, theirs.grad)
            torch.testing.assert_close(strata.safe_get_full_grad(ours).float().cpu(),
                                       theirs.grad.cpu(), rtol=1e-4, atol=1e-5, msg=name)
        engine.step()
        adamw.step()
        adamw.zero_grad()
    state = engine.module_state_dict()
    for name, theirs in reference.state_dict().items():
        torch.testing.assert_close(state[name].float().cpu(), theirs.cpu(), rtol=1e-4,
                                   atol=1e-4, msg=name)
    engine.close()


# Across ranks on GPUs (strata/ranks.py): tests/python/test_ranks_train.py's job, its model
# computing on the GPU. On one GPU the ranks share it (strata.device_index 0): NCCL refuses that,
# so their gradients and weights go through strata's Gloo, staged through pinned host memory, said
# once.
# With a GPU for each rank, NCCL's default group, which strata makes.
@pytest.mark.parametrize("stage, offload, dtype", [
    (1, "cpu", "fp32"), (2, "cpu", "fp32"), (3, "cpu", "fp32"), (2, "nvme", "fp32"),
    (3, "nvme", "fp32"), (1, "cpu", "bf16"), (2, "cpu", "bf16"), (3, "cpu", "bf16"),
])
def test_ranks_on_gpus_train_as_one_process(tmp_path, monkeypatch, stage, offload, dtype):
    from test_ranks_train import train_as_one_process
    monkeypatch.setenv("STRATA_TEST_DEVICE", "cuda")
    shared = torch.cuda.device_count() < 2
    reports = train_as_one_process(tmp_path, 2, stage, offload, dtype,
                                   {"STRATA_TEST_DEVICE_INDEX": "0"} if shared else {})
    if shared:
        assert all(r["collectives"] == "strata's collectives (shared memory) over host memory "
                                       "(a GPU's buffers staged through pinned memory)" for r in reports), reports
        assert sum("share a GPU" in w for w in reports[0]["warnings"]) == 1, reports[0]
    else:
        assert all(r["collectives"] == "torch.distributed's nccl process group (made by strata) "
                                       "over cuda buffers" for r in reports), reports


# strata.init across ranks: a parameter built under it, lent whole and given new values on the GPU
# (p.data = t.cuda() in a modifying block), written back as rank 0's: the ranks' broadcast takes
# host memory (it refused the GPU's tensor, on every rank).
INIT_ACROSS_RANKS = r"""
import os, torch, strata
rank, device = int(os.environ["RANK"]), "cuda"
config = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "strata": {"device": "cuda", "device_index": 0,  # (the ranks share GPU 0)
                     "host_budget_bytes": 64 << 20, "device_budget_bytes": 16 << 20}}
with strata.init(config=config):
    model = torch.nn.Linear(64, 32)
with strata.GatheredParameters([model.weight], modifier_rank=0):
    model.weight.data = torch.full((32, 64), 1.0 + rank, device=device)
engine, _, _, _ = strata.initialize(model=model, config=config)
assert torch.equal(engine.module_state_dict()["weight"], torch.full((32, 64), 1.0)), rank
engine.close()
print("ok")
"""


def test_a_weight_given_on_the_gpu_while_building_across_ranks_is_rank_0_s():
    from launch import start_ranks
    for p in start_ranks(2, INIT_ACROSS_RANKS):
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and out.strip().endswith("ok"), err[-3000:]


NCCL_ONE_RANK = r"""
import torch, torch.distributed as dist
from strata import _strata
from strata import ranks as ranks_module
device = torch.device("cuda", 0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
ranks = ranks_module.Ranks(_strata.Job(timeout_ms=30000))
ranks.use(ranks_module._OnGroup(dist.group.WORLD, device), device)

class E:
    def __init__(self, name, numel):
        self.name, self.numel, self.shard = name, numel, numel
a, b = E("a", 5), E("b", 3)
# The gradients reduce-scattered from the GPU (one rank: the mean is the gradient itself), their
# shards handed to the host optimizer; weights all-gathered to the GPU.
ga, gb = torch.arange(5.0, device=device), torch.arange(3.0, device=device) + 10
got = ranks.reduce_gradients([a, b], lambda e: ga if e is a else gb)
assert got[a].device.type == "cpu" and torch.equal(got[a], ga.cpu()), got
assert torch.equal(got[b], gb.cpu()), got
seen = {}
ranks.add_gradient(a, ga * 2, True, lambda e, shard, boundary: seen.setdefault(e.name, shard))
ranks.finish_gradients()
assert seen["a"].device == device and torch.equal(seen["a"], ga * 2), seen
out = {}
ranks.gather([(a, torch.ones(5, dtype=torch.bfloat16), lambda w: out.setdefault("a", w)),
              (b, torch.full((3,), 2.0, dtype=torch.bfloat16, device=device),
               lambda w: out.setdefault("b", w))])
assert out["a"].device == device and out["a"].dtype == torch.bfloat16 and \
    torch.equal(out["a"].float().cpu(), torch.ones(5)), out
assert torch.equal(out["b"].float().cpu(), torch.full((3,), 2.0)), out
print("ok")
"""


def test_nccl_collectives_run_the_ranks_buckets_with_one_rank():
    """strata's collectives on torch.distributed's NCCL group, over the GPU's buffers: a job of one
    rank (every call NCCL's, the results checkable alone)."""
    import os
    import subprocess
    import sys
    from launch import free_port
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")
    child = subprocess.run([sys.executable, "-c", NCCL_ONE_RANK], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), child.stderr[-3000:]
