"""strata.init: a model built without materializing its large parameters, adopted by
strata.initialize, loaded and trained as one built whole (strata/zero_init.py)."""
import math
import os
import subprocess
import sys

import pytest
import torch

import strata

sys.path.insert(0, os.path.dirname(__file__))
from references import assert_computes_as  # noqa: E402
from test_engine import VOCAB, Net, batches, loss_of, make_config, step_both  # noqa: E402


def config_for(tmp_path, offload="nvme", stage=3):
    return make_config(tmp_path, stage, offload, "fp32", accumulation=1, clipping=0.0)


def built_both(config, build):
    """`build()` under strata.init and plainly, from the same seed."""
    torch.manual_seed(0)
    with strata.init(config=config):
        model = build()
    torch.manual_seed(0)
    return model, build()


def assert_same_weights(engine, reference):
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_a_model_built_under_init_trains_as_one_built_whole(tmp_path, offload):
    config = config_for(tmp_path, offload)
    torch.manual_seed(0)
    with strata.init(config=config):
        model = Net()
    # Its large parameters hold no bytes of their own now.
    assert all(p.storage().nbytes() <= 4 for p in model.parameters() if p.numel() >= 100)
    torch.manual_seed(0)
    reference = Net()  # the same initializers, the same random draws
    engine, _, _, _ = strata.initialize(model=model, config=config)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    assert_same_weights(engine, reference)
    for x, y in batches(3):
        step_both(engine, reference, torch_adamw, x, y)


def test_built_under_init_then_pretrained_weights_streamed_in(tmp_path):
    torch.manual_seed(5)
    pretrained = Net()
    torch.save(pretrained.state_dict(), tmp_path / "pretrained.bin")
    config = config_for(tmp_path)
    with strata.init(config=config):
        model = Net()
    engine, _, _, _ = strata.initialize(model=model, config=config)
    engine.load_pretrained(tmp_path / "pretrained.bin")
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, pretrained.state_dict()[name]), name
    assert_computes_as(engine, pretrained.state_dict(), Net, next(iter(batches(1)))[0])


class Tied(torch.nn.Module):
    """A language model's head tied to its embedding, as models do in their __init__: the head's
    own weight is made, partitioned, then replaced."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.replaced = strata.zero_init.partition_of(self.head.weight)  # its id only
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def test_a_weight_replaced_while_building_gives_its_partition_back(tmp_path):
    """Before, the replaced weight's partition stayed registered for the run (found by the audit:
    8 MB held for nothing in its case)."""
    config = config_for(tmp_path, "cpu")
    with strata.init(config=config):
        model = Tied()
    assert model.replaced is not None
    engine, _, _, _ = strata.initialize(model=model, config=config)
    with pytest.raises(strata._strata.Error, match="not registered"):
        engine.runtime.acquire(model.replaced, "host", traced=False)
    own = strata.zero_init.partition_of(model.emb.weight)
    engine.runtime.acquire(own, "host", traced=False)  # the tied weight's own is there
    engine.runtime.release(own, "host", False, traced=False)


def test_a_model_on_the_meta_device_is_refused_by_name(tmp_path):
    class OnMeta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(32, 64, device="meta")

    with pytest.raises(ValueError, match=r"on the meta device and hold no values \(l1.weight, "
                                         r"l1.bias\)"):
        strata.initialize(model=OnMeta(), config=config_for(tmp_path, "cpu"))


def test_a_model_built_under_init_is_adopted_by_a_config_that_differs_only_in_clipping(tmp_path):
    # strata.init and initialize agree on the zero_optimization and strata blocks; what "auto"
    # decides from the rest (strata.optimizer_read_ahead_bytes, from gradient_clipping) does not
    # make them differ. The Runtime is init's: made without clipping, it holds no read-ahead room.
    config = config_for(tmp_path)
    with strata.init(config=config):
        model = Net()
    clipped = config_for(tmp_path)
    clipped["gradient_clipping"] = 1.0
    engine, _, _, _ = strata.initialize(model=model, config=clipped)
    assert engine.runtime.optimizer_read_ahead_bytes == 0
    x, y = next(iter(batches(1)))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def test_misuse_is_named(tmp_path):
    config = config_for(tmp_path)
    with strata.init(config=config):
        with pytest.raises(RuntimeError, match="a context is open already"):
            with strata.init(config=config):
                pass
        model = Net()
    other = config_for(tmp_path)
    other["strata"]["device_budget_bytes"] = 1 << 20
    with pytest.raises(ValueError, match="built under strata.init with another config"):
        strata.initialize(model=model, config=other)
    strata.initialize(model=model, config=config)
    with pytest.raises(ValueError, match="has an engine already"):
        strata.initialize(model=model, config=config)
    # Another stage builds normally.
    with strata.init(config=config_for(tmp_path / "..", stage=2)):
        whole = Net()
    assert all(strata.zero_init.partition_of(p) is None for p in whole.parameters())
    # The patch is gone after the context.
    assert not hasattr(torch.nn.Linear.__init__, "_strata_wrapped")


BUILD = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import strata
from test_engine import make_config
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
class Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048) for _ in range(8))
import pathlib
tmp = pathlib.Path({tmp!r})
tmp.mkdir(exist_ok=True)
config = make_config(tmp, 3, "nvme", "fp32", 1, 0.0)
config["strata"]["nvme_capacity_bytes"] = 256 << 20
# Freed blocks given back to the system (not kept in glibc's heap): what is resident is what holds.
config["strata"]["malloc_mmap_threshold_bytes"] = 256 << 10
import threading
before = rss()
peak = [before]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        done.wait(0.001)
sampler = threading.Thread(target=sample)
sampler.start()
if {under_init}:
    with strata.init(config=config):
        model = Big()
else:
    model = Big()
done.set()
sampler.join()
print(rss() - before, max(peak[0], rss()) - before)
"""


def test_building_under_init_holds_about_one_layer_not_the_model(tmp_path):
    # 8 layers of 2048 x 2048: 128 MiB of fp32 weights, 16 MiB a layer. Built whole, the process
    # grows by the model; under strata.init, by about one layer's weights at a time (its tensor
    # and its copy in the training dtype), the rest sent to NVMe as each layer is made.
    here = os.path.dirname(os.path.abspath(__file__))
    grown = {}
    for under_init in (False, True):
        out = subprocess.run(
            [sys.executable, "-c", BUILD.format(tests=here, tmp=str(tmp_path / str(under_init)),
                                                under_init=under_init)],
            capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        grown[under_init] = [int(v) for v in out.stdout.split()]
    model_bytes = 8 * 2048 * 2049 * 4
    assert grown[False][0] >= model_bytes * 0.95, grown
    # What stays: the Runtime's own buffers (the aio engine's staging, the pinned pools) and about
    # one layer: measured 46 MiB here, against the model's 128 MiB.
    assert grown[True][1] < model_bytes / 2, grown


def test_parameters_set_after_super_init_are_kept(tmp_path):
    class Filled(torch.nn.Linear):
        def __init__(self):
            super().__init__(64, 64)
            with torch.no_grad():
                self.weight.fill_(0.25)  # after nn.Linear's own __init__

    config = config_for(tmp_path)
    with strata.init(config=config):
        model = torch.nn.Sequential(Filled())
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert torch.equal(engine.module_state_dict()["0.weight"], torch.full((64, 64), 0.25))


class Nano(torch.nn.Module):
    """A model that initializes its children's weights in its own __init__, after they were built
    (nanoGPT's and timm's way): self.apply, nn.init over named_parameters, zeros_ (which the
    placeholders took silently), a row zeroed through a view, a weight read into another, and a
    norm read for a log."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
            for _ in range(2))
        self.head = torch.nn.Linear(32, VOCAB)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("2.weight"):  # (the residual projections, scaled down)
                torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(4))
        torch.nn.init.zeros_(self.blocks[1][0].weight)
        self.emb.weight.data[0].zero_()
        with torch.no_grad():
            self.head.weight.copy_(self.head.weight * 0.5 + self.blocks[0][0].weight[:VOCAB])
        self.logged = float(self.blocks[0][2].weight.norm())

    @staticmethod
    def _init(m):
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, 0.0, 0.02)
            torch.nn.init.zeros_(m.bias)
        elif isinstance(m, torch.nn.Embedding):
            torch.nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_a_parents_initialization_of_its_childrens_weights_reaches_their_partitions(tmp_path):
    # Before, normal_ on a partitioned weight raised torch's "more than one element of the
    # written-to tensor refers to a single memory location", and zeros_ was lost silently.
    config = config_for(tmp_path, "cpu")
    model, reference = built_both(config, Nano)
    assert model.logged == reference.logged
    # Nothing is left lent once the context closed.
    assert all(p.storage().nbytes() <= 4 for p in model.parameters() if p.numel() >= 100)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert_same_weights(engine, reference)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches(2):
        step_both(engine, reference, torch_adamw, x, y)


def test_a_layer_cloned_while_building_is_a_partition_of_its_own(tmp_path):
    # torch's TransformerEncoder deep-copies the layer it is given: the copies held the
    # placeholders' zeros, and trained from them silently.
    def build():
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    config = config_for(tmp_path, "cpu")
    model, reference = built_both(config, build)
    pids = [strata.zero_init.partition_of(p) for p in model.parameters() if p.numel() >= 100]
    assert None not in pids and len(set(pids)) == len(pids), pids
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert_same_weights(engine, reference)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), reference(x), rtol=0, atol=1e-6)


def test_a_model_built_under_init_copied_or_edited_before_initialize(tmp_path):
    config = config_for(tmp_path, "cpu")
    model, reference = built_both(config, Net)
    # A copy made after the context (a reference model, a teacher) holds the values, plain.
    copy_ = __import__("copy").deepcopy(model)
    for name, value in copy_.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name
    assert all(strata.zero_init.partition_of(p) is None for p in copy_.parameters())
    # GatheredParameters: the weights whole in the block; modifier_rank=0 keeps what it writes.
    with strata.GatheredParameters(model.l1.weight):
        assert torch.equal(model.l1.weight, reference.l1.weight)
        model.l1.weight.data.zero_()  # dropped: no modifier_rank
    with strata.GatheredParameters([model.l2.weight], modifier_rank=0):
        model.l2.weight.data.mul_(0.5)
    with torch.no_grad():
        reference.l2.weight.mul_(0.5)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert_same_weights(engine, reference)
    engine.backward(loss_of(engine(next(iter(batches(1)))[0]), next(iter(batches(1)))[1]))
    engine.step()
    for name, value in copy_.state_dict().items():  # (the copy is its own: not trained)
        if name != "l2.weight":
            assert torch.equal(value, reference.state_dict()[name]), name
    with pytest.raises(TypeError, match="copy.deepcopy of a parameter a strata engine trains"):
        __import__("copy").deepcopy(model.l1.weight)


def test_values_of_another_shape_given_while_building_are_refused_by_name(tmp_path):
    class Resized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(32, 64)
            self.inner.weight.data = torch.zeros(8, 8)

    with pytest.raises(ValueError, match=r"shape \(64, 32\) was given values of shape \(8, 8\)"):
        with strata.init(config=config_for(tmp_path, "cpu")):
            Resized()


class Chained(torch.nn.Module):
    """Initializers made of several torch calls on one weight (trunc_normal_: uniform_, erfinv_,
    mul_, add_, clamp_), a scale after them, a parameter made from another (parametrizations'
    nn.Parameter(p)), a weight given a tensor then written through it, one weight's storage given
    to another, and a layer copied while a view of its weight is alive."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 32)
        self.d = torch.nn.Linear(32, 32)
        torch.nn.init.trunc_normal_(self.a.weight, std=0.02)
        with torch.no_grad():
            self.a.weight.mul_(0.3)
        self.e = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(32, 32))
        given = torch.empty(32, 32)
        self.b.weight.data = given
        torch.nn.init.normal_(given)
        self.c.weight.data = self.d.weight.data
        torch.nn.init.normal_(self.d.weight)
        view = self.d.weight.data
        view.mul_(2.0)
        self.f = __import__("copy").deepcopy(self.d)
        del view

    def forward(self, x):
        return self.f(self.e(self.d(self.c(self.b(self.a(x))))))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_initializers_of_several_calls_and_parameters_made_from_others(tmp_path, dtype):
    # Found by an audit: in bf16 trunc_normal_'s steps were each rounded to bf16 (weights of
    # +-2.0); weight_norm's `original1` was the placeholder's zeros (NaN forward); a tensor given
    # as a weight's data and written after, one weight's storage given to another, and a copy
    # made while a view was alive all lost what was written.
    config = make_config(tmp_path, 3, "cpu", dtype, accumulation=1, clipping=0.0)
    model, reference = built_both(config, Chained)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    for name, value in engine.module_state_dict().items():
        if dtype == "fp32" or not name.startswith("e."):
            assert torch.equal(value, reference.state_dict()[name].to(value.dtype)), name
        else:  # (a value computed from a partition's bf16 values, weight_norm's g, may round
            # the other way: one bf16 step at most)
            torch.testing.assert_close(value.float(), reference.state_dict()[name].float(),
                                       rtol=2 ** -7, atol=1e-6, msg=name)
    x = torch.randn(3, 32, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    with torch.no_grad():
        assert torch.isfinite(engine(x)).all()


def test_nested_blocks_keep_what_a_modifying_one_wrote(tmp_path):
    # Found by audits: a read-only block inside a modifying one, and a modifying one inside a
    # read-only one, each gave the weight back as the block that lent it said, so the modifying
    # block's writes were lost.
    config = config_for(tmp_path, "cpu")
    with strata.init(config=config):
        model = Net()
    with strata.GatheredParameters([model.l2.weight], modifier_rank=0):
        model.l2.weight.data.fill_(3.0)
        with strata.GatheredParameters([model.l2.weight]):
            assert float(model.l2.weight.data.mean()) == 3.0
        model.l2.weight.data.add_(1.0)
    with strata.GatheredParameters([model.l1.weight]):
        with strata.GatheredParameters([model.l1.weight], modifier_rank=0):
            model.l1.weight.data.fill_(2.0)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert torch.equal(engine.module_state_dict()["l2.weight"], torch.full((50, 64), 4.0))
    assert torch.equal(engine.module_state_dict()["l1.weight"], torch.full((64, 32), 2.0))


def test_after_the_context_a_read_is_nan_a_replacement_is_taken_an_in_place_write_refused(
        tmp_path):
    # Found by an audit: after the context (before strata.initialize) a read gave the
    # placeholder's zeros (a plausible norm, a forward that ran), `p.data = t` was ignored and
    # `fill_` was lost, each silently.
    config = config_for(tmp_path, "cpu")
    torch.manual_seed(0)
    with strata.init(config=config):
        model = Net()
    assert torch.isnan(model.l1.weight.norm())
    model.l2.weight.data = torch.full((50, 64), 0.5)  # taken, as plain torch trains it
    # Read before initialize (a block, a copy): the values given, not the partition's (found by
    # a review: they were lost).
    with strata.GatheredParameters([model.l2.weight]):
        assert float(model.l2.weight.mean()) == 0.5
    assert float(__import__("copy").deepcopy(model).l2.weight.mean()) == 0.5
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert torch.equal(engine.module_state_dict()["l2.weight"], torch.full((50, 64), 0.5))
    engine.close()
    with strata.init(config=config):
        model = Net()
    model.l1.weight.data.fill_(0.25)
    with pytest.raises(ValueError, match=r"l1.weight, built under strata.init, written in "
                                         r"place after the context closed"):
        strata.initialize(model=model, config=config)


def test_after_the_context_conversions_and_load_state_dict_keep_or_take_the_values(tmp_path):
    # Found by an audit: m.to(memory_format=channels_last) (and, in bf16, m.float()) made each
    # placeholder a tensor of NaN, which strata.initialize then took as the weights; and
    # load_state_dict raised torch's "more than one element ... refers to a single memory
    # location".
    config = config_for(tmp_path, "cpu")
    model, reference = built_both(config, Net)
    model = model.to(memory_format=torch.channels_last).float()
    torch.manual_seed(5)
    loaded = {k: v for k, v in Net().state_dict().items() if k.startswith("l1.")}
    model.load_state_dict(loaded, strict=False)
    reference.load_state_dict(loaded, strict=False)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert_same_weights(engine, reference)


def test_a_module_built_in_bf16_draws_as_a_plain_bf16_build(tmp_path):
    # Found by an audit: partitions were lent in fp32 whatever they were built in, so a module
    # made with dtype=torch.bfloat16 drew other values than a plain bf16 build; and a
    # parametrization registered in bf16 training failed on the lent fp32 values ("may not
    # change the dtype").
    class Symmetric(torch.nn.Module):
        def forward(self, x):
            return x.triu() + x.triu(1).transpose(-1, -2)

    class Built(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 32, dtype=torch.bfloat16)
            torch.nn.init.normal_(self.a.weight, std=0.02)
            self.b = torch.nn.Linear(32, 32)
            torch.nn.utils.parametrize.register_parametrization(self.b, "weight", Symmetric())

    config = make_config(tmp_path, 3, "cpu", "bf16", accumulation=1, clipping=0.0)
    model, reference = built_both(config, Built)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, reference.state_dict()[name].bfloat16()), name


def test_a_modifying_block_that_raises_keeps_what_it_wrote(tmp_path):
    config = config_for(tmp_path, "cpu")
    with strata.init(config=config):
        model = Net()
    with pytest.raises(KeyError):
        with strata.GatheredParameters([model.l2.weight], modifier_rank=0):
            model.l2.weight.data.fill_(5.0)
            raise KeyError("the block's own error")
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert torch.equal(engine.module_state_dict()["l2.weight"], torch.full((50, 64), 5.0))


def test_a_parameter_made_from_placeholders_after_the_context_is_refused_by_name(tmp_path):
    # Found by an audit: weight_norm applied after the context made its `original` parameters
    # from the placeholders (NaN), and strata.initialize trained them: every loss NaN.
    config = config_for(tmp_path, "cpu")
    with strata.init(config=config):
        model = Net()
    torch.nn.utils.parametrizations.weight_norm(model.l1)
    with pytest.raises(ValueError, match=r"l1.parametrizations.weight.original0, "
                                         r"l1.parametrizations.weight.original1 of a model built "
                                         r"under strata.init hold only NaN"):
        strata.initialize(model=model, config=config)


def test_a_released_model_built_under_init_is_plain_torch_again(tmp_path):
    # Before, strata.init's marks stayed on the released model: a new engine was refused ("has
    # an engine already") and torch.save(model) failed pickling the old engine's callback.
    config = config_for(tmp_path, "cpu")
    with strata.init(config=config):
        model = Net()
    engine, _, _, _ = strata.initialize(model=model, config=config)
    trained = engine.module_state_dict()
    model = engine.release()
    torch.save(model, tmp_path / "model.pt")
    again, _, _, _ = strata.initialize(model=model, config=config_for(tmp_path / "again", "cpu"))
    for name, value in again.module_state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_a_model_converted_after_the_context_stays_unmaterialized(tmp_path):
    # model.bfloat16() (model.to(device or dtype), .half()) before strata.initialize made each
    # placeholder whole: a model built bigger than the host, then converted, was allocated whole.
    config = make_config(tmp_path, 3, "cpu", "bf16", accumulation=1, clipping=0.0)
    model, reference = built_both(config, Net)
    model = model.bfloat16()
    reference = reference.bfloat16()
    assert all(p.untyped_storage().nbytes() <= 2 for p in model.parameters() if p.numel() >= 100)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert_same_weights(engine, reference)


def test_a_round_trip_through_a_narrower_dtype_rounds_as_plain_torch(tmp_path):
    # Found by an audit: only the placeholder's one element was converted, so .half().float()
    # left the partitions unrounded (plain torch rounds every weight to fp16).
    config = config_for(tmp_path, "cpu")
    model, reference = built_both(config, Net)
    model.half().float()
    reference.half().float()
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert_same_weights(engine, reference)


def test_conversions_that_would_replace_parameters_are_refused_and_release_leaves_none(tmp_path):
    # Found by an audit: torch.__future__'s overwrite of parameters on conversion gave the module
    # new parameters of one NaN element, taken by strata.initialize; a released model's parameters
    # kept strata.init's finalizers, so torch's swap on conversion failed on them.
    config = config_for(tmp_path, "cpu")
    with strata.init(config=config):
        model = Net()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with pytest.raises(ValueError, match=r"overwrite or swap of module parameters on "
                                             r"conversion, over parameters built under "
                                             r"strata.init"):
            model.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    model = engine.release()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.l1.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model.l1.weight.dtype == torch.float64


def test_parameters_given_back_to_make_room_keep_what_was_written(tmp_path):
    # The bound at its least (twice the parameter being lent): nearly every lend gives another
    # back, and each re-lent weight must read what was written into it.
    config = config_for(tmp_path, "cpu")
    context = strata.init(config=config)
    context.lending.bound = 0
    torch.manual_seed(0)
    with context:
        model = Nano()
    torch.manual_seed(0)
    reference = Nano()
    assert context.lending.bound < 64 << 20
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert_same_weights(engine, reference)
