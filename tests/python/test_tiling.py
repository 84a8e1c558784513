"""strata.TiledLinear and strata.tile_linears (memory-centric tiling): the same products as the
Linear they replace, and at stage 3 a device tier that must hold a tile, not the whole matrix."""
import copy
import re

import pytest
import torch
import transformers

import strata
from strata.tiling import TiledLinear, tile_linears


@pytest.mark.parametrize("in_splits, out_splits", [(1, 1), (1, 3), (3, 1), (2, 5)])
def test_a_tiled_linear_computes_the_linears_product_and_gradients(in_splits, out_splits):
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 10)
    tiled = TiledLinear.from_linear(linear, in_splits, out_splits)
    assert len(tiled.tiles) == out_splits and all(len(r) == in_splits for r in tiled.tiles)
    assert torch.equal(tiled.weight_whole(), linear.weight)
    x = torch.randn(4, 7, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = linear(x), tiled(x2)
    # Not bit for bit even with whole input rows: the BLAS picks its kernel (and so its order of
    # summing) by the product's shape, and a tile's is narrower (seen on an AMD EPYC, 2026-11-27:
    # 1.2e-7 apart at in_splits 1, out_splits 3).
    torch.testing.assert_close(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    grad_whole = torch.cat([torch.cat([t.weight.grad for t in row], 1) for row in tiled.tiles])
    torch.testing.assert_close(grad_whole, linear.weight.grad)
    bias = torch.cat([row[0].bias.grad for row in tiled.tiles])
    torch.testing.assert_close(bias, linear.bias.grad)
    assert all(t.bias is None for row in tiled.tiles for t in row[1:])


def test_a_new_tiled_linear_is_initialised_as_its_whole_matrix_would_be():
    torch.manual_seed(0)
    tiled = TiledLinear(4096, 8, in_splits=4)
    bound = 1 / 4096 ** 0.5  # the whole matrix's fan-in, not a tile's (1024)
    weights = tiled.weight_whole()
    assert weights.abs().max() <= bound and weights.abs().max() > 0.9 * bound
    assert TiledLinear(5, 3, bias=False).tiles[0][0].bias is None


@pytest.mark.parametrize("arguments, message", [
    ({"in_features": 0, "out_features": 3}, "in_features=0"),
    ({"in_features": 4, "out_features": 3, "in_splits": 5}, "in_splits=5; accepted: an int from 1 "
                                                             "to the in_features (4)"),
    ({"in_features": 4, "out_features": 3, "out_splits": 0}, "out_splits=0"),
    ({"in_features": 4, "out_features": 3, "out_splits": True}, "out_splits=True"),
])
def test_bad_tilings_are_refused_naming_what_is_accepted(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TiledLinear(**arguments)
    with pytest.raises(ValueError, match="accepted: a torch.nn.Linear"):
        TiledLinear.from_linear(torch.nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="max_tile_params=0"):
        tile_linears(torch.nn.Linear(2, 2), 0)


def _llama(vocab=128):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def test_tile_linears_replaces_the_large_linears_of_a_transformers_model():
    model = _llama()
    before = copy.deepcopy(model)
    # The MLP's 64 x 256 matrices (16384 weights) are cut, attention's 64 x 64 ones (4096) and
    # the head (tied to the embeddings) are not.
    assert tile_linears(model, 4096) == 6
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.up_proj, TiledLinear) and isinstance(mlp.down_proj, TiledLinear)
    assert max(t.weight.numel() for row in mlp.up_proj.tiles for t in row) <= 4096
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(model(ids).logits, before(ids).logits)
    # Rows wider than the limit (down_proj's 256): cut along the input features too.
    small = copy.deepcopy(before)
    assert tile_linears(small, 100) == 14  # every Linear but the tied head
    assert max(p.numel() for n, p in small.named_parameters() if "tiles" in n) <= 100
    assert len(small.model.layers[0].mlp.down_proj.tiles[0]) == 3  # 256 inputs in 3
    torch.testing.assert_close(small(ids).logits, before(ids).logits, rtol=1e-4, atol=1e-5)


def _config(tmp_path, device_budget):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                                  "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}},
            "strata": {"device": "emulated", "device_budget_bytes": device_budget,
                       "host_budget_bytes": 64 << 20}}


def test_at_stage3_the_device_holds_tiles_where_a_whole_matrix_does_not_fit(tmp_path):
    """The device budget (48 KiB) is smaller than an MLP matrix (64 x 256 weights: 64 KiB in
    fp32): the untiled model is refused naming the budget; tiled to 2048-weight tiles (8 KiB), the
    same model trains through it, as plain torch trains the tiled model."""
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(strata.Error, match="budget"):
        engine, _, _, _ = strata.initialize(model=_llama(32), config=_config(tmp_path, 48 << 10))
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    model = _llama(32)
    assert tile_linears(model, 2048) == 10  # q, o and the MLP's three, in two layers
    reference = copy.deepcopy(model)
    engine, _, _, _ = strata.initialize(model=model, config=_config(tmp_path, 48 << 10))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        ref = reference(input_ids=ids, labels=ids)
        optimizer.zero_grad()
        ref.loss.backward()
        optimizer.step()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert engine.stats()["peak_bytes"]["device"] <= 48 << 10
    engine.close()


def test_under_strata_init_each_tile_is_a_partition_of_its_own(tmp_path):
    config = _config(tmp_path, 1 << 20)
    with strata.init(config=config):
        tiled = TiledLinear(256, 64, in_splits=2, out_splits=4)
    ids = {strata.zero_init.partition_of(t.weight) for row in tiled.tiles for t in row}
    assert None not in ids and len(ids) == 8
    engine, _, _, _ = strata.initialize(model=tiled, config=config)
    x = torch.randn(2, 256)
    engine.backward(engine(x).square().sum())
    engine.step()
    engine.close()


def test_from_linear_keeps_a_frozen_linear_frozen_and_gives_its_weight_to_readers():
    linear = torch.nn.Linear(8, 6)
    linear.requires_grad_(False)
    tiled = TiledLinear.from_linear(linear, 2, 3)
    assert not any(p.requires_grad for p in tiled.parameters())
    # Code that reads a Linear's weight (F.linear, nn.TransformerEncoderLayer's fast path) gets
    # the whole matrix, differentiable through the tiles.
    assert torch.equal(tiled.weight, linear.weight) and torch.equal(tiled.bias, linear.bias)
    trained = TiledLinear.from_linear(torch.nn.Linear(8, 6), 2, 3)
    x = torch.randn(3, 8)
    torch.nn.functional.linear(x, trained.weight, trained.bias).sum().backward()
    assert all(p.grad is not None for p in trained.parameters())
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=64, batch_first=True).eval()
    before = copy.deepcopy(layer)
    assert tile_linears(layer, 256) == 2  # linear1, linear2 (the attention's own stay)
    with torch.no_grad():
        src = torch.randn(2, 5, 16)
        torch.testing.assert_close(layer(src), before(src))


def test_weights_that_are_not_there_or_read_by_peft_are_refused_by_name(tmp_path):
    with strata.init(config=_config(tmp_path, 1 << 20)):
        built = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match="not materialized"):
        tile_linears(built, 100)
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="tile the model before applying peft"):
        tile_linears(model, 1000)
    # Refused whole: no Linear of the model was replaced before the peft layer was met.
    assert not any(isinstance(m, TiledLinear) for m in model.modules())


def test_a_wrapper_set_on_a_linears_forward_is_kept_at_stage3_and_after_close(tmp_path):
    """A forward set on the instance (a hook library's wrapper) is left alone by the lending's
    _Zero3Linear, and put back by close(), as the engine found it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    inner = model[0].forward
    wrapper = lambda x: inner(x) * 2  # noqa: E731
    model[0].forward = wrapper
    reference = copy.deepcopy(model)
    reference[0].forward = lambda x: torch.nn.functional.linear(
        x, reference[0].weight, reference[0].bias) * 2
    config = _config(tmp_path, 1 << 20)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    x = torch.randn(3, 64)
    torch.testing.assert_close(engine(x), reference(x))
    engine.close()  # (the partitioned weights are left placeholders: the wrapper is what stays)
    assert model[0].__dict__.get("forward") is wrapper


def test_a_tiled_model_saves_and_loads_the_weights_of_its_linears(tmp_path):
    """A tiled module's state dict is its Linear's (weight and bias whole): a tiled model trained
    at stage 3 and saved with save_pretrained loads into the untiled model (nothing missing) and
    computes what it computed; its weights load back into the tiled engine's module, cut into the
    tiles; keep_vars=True still gives the tiles' parameters."""
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _llama(32)
    assert tile_linears(model, 2048) == 10
    assert all("tiles" not in k for k in model.state_dict())
    assert any("tiles" in k for k in model.state_dict(keep_vars=True))
    engine, _, _, _ = strata.initialize(model=model, config=_config(tmp_path, 48 << 10))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    with torch.no_grad():
        expected = engine(input_ids=ids).logits
    engine.module.save_pretrained(tmp_path / "saved")
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved",
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
    plain = copy.deepcopy(loaded)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    engine.module.load_state_dict(plain.state_dict())  # cut into the tiles, through the engine
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, plain(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-6)


def test_a_tiled_model_is_released_with_its_tiles_weights(tmp_path):
    """engine.release() gives each tile its weights (module_state_dict joins them into their
    Linear's: release cuts them again) and the module computes as the engine did."""
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _llama(32)
    tile_linears(model, 2048)
    engine, _, _, _ = strata.initialize(model=model, config=_config(tmp_path, 48 << 10))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with torch.no_grad():
        expected = engine(input_ids=ids).logits
    released = engine.release()
    with torch.no_grad():
        torch.testing.assert_close(released(input_ids=ids).logits, expected)
