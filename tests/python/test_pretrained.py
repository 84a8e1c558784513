"""engine.load_pretrained: a state dict streamed in tensor by tensor, from one torch.save file or
from shards with an index; every mismatch named before anything changes (strata/pretrained.py)."""
import copy
import json
import os
import sys

import pytest
import torch

import strata
from strata import checkpoints

sys.path.insert(0, os.path.dirname(__file__))
from references import assert_computes_as  # noqa: E402
from test_checkpoint import Whole, state_of, train, whole_engine  # noqa: E402
from test_engine import Net, batches, make_config, step_both  # noqa: E402


def engine_of(tmp_path, model, offload="nvme", dtype="fp32"):
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, 3, offload, dtype, 1, 0.0))
    return engine


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_pretrained_weights_load_and_train_as_in_plain_torch(tmp_path, offload):
    torch.manual_seed(0)
    pretrained = Net()
    with torch.no_grad():
        for p in pretrained.parameters():
            p.mul_(3.0)  # weights no initializer gives
    torch.save(pretrained.state_dict(), tmp_path / "pretrained.bin")
    torch.manual_seed(1)
    engine = engine_of(tmp_path, Net(), offload)
    assert engine.load_pretrained(tmp_path / "pretrained.bin") == ([], [])
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, pretrained.state_dict()[name]), name
    reference = copy.deepcopy(pretrained)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches(3):
        step_both(engine, reference, torch_adamw, x, y)


def test_shards_with_an_index_load_a_tied_model(tmp_path):
    # A checkpoint consolidated into shards (strata_zero_to_fp32 --shard-size): the tied weight,
    # the buffer and the frozen parameter come back through the index.
    source = whole_engine(tmp_path, "source", 0)
    train(source, batches(2))
    source.save_checkpoint(tmp_path / "ckpt")
    from strata import zero_to_fp32
    zero_to_fp32.consolidate(tmp_path / "ckpt", tmp_path / "shards", shard_bytes=3000)
    target = whole_engine(tmp_path, "target", 1)
    assert target.load_pretrained(tmp_path / "shards") == ([], [])
    expected = source.module_state_dict()
    for name, value in target.module_state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert_computes_as(target, expected, Whole, next(iter(batches(1)))[0])


def test_every_mismatch_is_named_and_nothing_changes(tmp_path):
    torch.manual_seed(0)
    state = Net().state_dict()
    state["l1.weight"] = torch.zeros(3, 3)
    del state["ln.bias"]
    state["extra.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "bad.bin")
    engine = engine_of(tmp_path, Net())
    before = state_of(engine)
    with pytest.raises(checkpoints.CheckpointError) as failed:
        engine.load_pretrained(tmp_path / "bad.bin")
    text = str(failed.value)
    for part in ("l1.weight: shape [3, 3]", "missing: ln.bias", "unexpected: extra.weight",
                 "nothing was changed"):
        assert part in text
    for a, b in zip(before, state_of(engine)):
        assert torch.equal(a, b)
    # Not strict: the missing and unexpected pass, the wrong shape does not.
    with pytest.raises(checkpoints.CheckpointError, match="l1.weight: shape"):
        engine.load_pretrained(tmp_path / "bad.bin", strict=False)
    state["l1.weight"] = Net().state_dict()["l1.weight"]
    torch.save(state, tmp_path / "loose.bin")
    assert engine.load_pretrained(tmp_path / "loose.bin", strict=False) == \
        (["ln.bias"], ["extra.weight"])


def test_files_that_are_not_state_dicts_are_named(tmp_path):
    engine = engine_of(tmp_path, Net())
    torch.save(Net().state_dict(), tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(checkpoints.CheckpointError, match="not a torch.save zip archive"):
        engine.load_pretrained(tmp_path / "legacy.bin")
    torch.save([torch.zeros(1)], tmp_path / "list.bin")
    with pytest.raises(checkpoints.CheckpointError, match="holds a list"):
        engine.load_pretrained(tmp_path / "list.bin")
    (tmp_path / "shards").mkdir()
    with pytest.raises(checkpoints.CheckpointError,
                       match="shards holds none of model.safetensors, model.safetensors.index.json,"
                             " pytorch_model.bin.index.json"):
        engine.load_pretrained(tmp_path / "shards")
    (tmp_path / "shards" / "model.safetensors.index.json").write_text("{")
    with pytest.raises(checkpoints.CheckpointError, match="cannot be read as a shard index"):
        engine.load_pretrained(tmp_path / "shards")
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(checkpoints.CheckpointError,
                       match="broken.safetensors cannot be read as safetensors"):
        engine.load_pretrained(tmp_path / "broken.safetensors")


def test_parameters_in_the_file_and_a_missing_shard(tmp_path):
    torch.manual_seed(0)
    source = Net()
    torch.save(dict(source.named_parameters()), tmp_path / "params.bin")  # nn.Parameter values
    engine = engine_of(tmp_path, Net(), "cpu")
    engine.load_pretrained(tmp_path / "params.bin")
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, source.state_dict()[name]), name
    assert_computes_as(engine, source.state_dict(), Net, next(iter(batches(1)))[0])
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "pytorch_model.bin.index.json").write_text(
        '{"weight_map": {"emb.weight": "gone.bin"}}')
    with pytest.raises(checkpoints.CheckpointError, match="names gone.bin, which is missing"):
        engine.load_pretrained(tmp_path / "shards")


def test_every_fault_of_a_sharded_index_is_named_at_once(tmp_path):
    """Two shards missing, two names put in shards that lack them and a tensor a shard holds but
    the index does not list: all named in one error (it stopped at the first), nothing changed."""
    torch.manual_seed(0)
    engine = engine_of(tmp_path, Net(), "cpu")
    before = engine.module_state_dict()
    state = Net().state_dict()
    folder = tmp_path / "shards"
    folder.mkdir()
    torch.save({"emb.weight": state["emb.weight"], "l1.weight": state["l1.weight"]},
               folder / "a.bin")
    index = {"weight_map": {"emb.weight": "a.bin", "ln.bias": "a.bin", "ln.weight": "a.bin",
                            "l2.weight": "gone1.bin", "l2.bias": "gone2.bin"}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(checkpoints.CheckpointError) as failed:
        engine.load_pretrained(folder)
    text = str(failed.value)
    for expected in ["names gone1.bin, which is missing", "names gone2.bin, which is missing",
                     "puts ln.bias in a.bin, which lacks it",
                     "puts ln.weight in a.bin, which lacks it",
                     "a.bin holds l1.weight, which it does not list", "nothing was changed"]:
        assert expected in text, text
    for name, value in engine.module_state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_pickle_that_names_other_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"emb.weight": torch.zeros(1), "x": Evil()}, tmp_path / "evil.bin")
    engine = engine_of(tmp_path, Net(), "cpu")
    with pytest.raises(checkpoints.CheckpointError, match="is not part of a state dict"):
        engine.load_pretrained(tmp_path / "evil.bin")
