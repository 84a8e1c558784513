"""Hugging Face `transformers` models under strata.initialize, against plain PyTorch.

Each architecture is built from a small config with random weights (nothing is downloaded) and
trained a few steps through the engine and through plain torch (torch.optim.AdamW with
clip_grad_norm_; bf16: the mixed-precision recipe written out, references.MixedPrecisionAdamW) on
the same batches from the same seed, with the models' own keyword arguments (input_ids,
attention_mask with padding, labels) and loss (`.loss` of their output objects). The device tier
is the host-emulated one: at stage 3 its budget is set below the model's parameters, so every
step lends them through it, and each case checks that it did.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import strata
from references import MixedPrecisionAdamW

VOCAB = 128
STEPS, ACCUMULATION = 3, 2
# A fine-tuning rate: Adam moves every weight by about LR a step, whatever its gradient, so
# gradients that differ by a rounding near zero move a weight by up to 2 LR apart.
LR = 1e-3


def _decoder(cls_name, config_name, **extra):
    def build():
        config = getattr(transformers, config_name)(**{
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
            **extra})
        return getattr(transformers, cls_name)(config)
    return build


# Each a function that builds the model; dropout off, so that both sides compute the same.
ARCHITECTURES = {
    "llama": _decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2),
    "qwen2": _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2),
    "mistral": _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2),
    "gemma": _decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=2, head_dim=8),
    "phi": _decoder("PhiForCausalLM", "PhiConfig", resid_pdrop=0.0, embd_pdrop=0.0,
                    attention_dropout=0.0),
    # A mixture of experts: each layer's experts in two 3-D parameters, an expert's slice taken
    # in forward (a view autograd saves); at stage 3 the budget holds about one layer's experts.
    "mixtral": _decoder("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2,
                        num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2),
    # Conv1D layers (not nn.Linear), the head tied to the embedding.
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)),
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
    # Encoder-decoder, the embedding shared by both and the head.
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
}


def batches(name, n, seed=1):
    """Keyword arguments of `n` micro-batches: two sequences of 12, the second padded by 3."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (2, 12), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        if name == "t5":
            labels = torch.randint(3, VOCAB, (2, 6), generator=gen)
        else:
            labels = ids.masked_fill(mask == 0, -100)
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return out


def param_bytes(model, dtype):
    return sum(p.numel() for p in model.parameters()) * torch.tensor([], dtype=dtype).element_size()


def make_config(tmp_path, model, stage, offload, dtype):
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    largest = max(p.numel() for p in model.parameters())
    # A quarter of the parameters, or room for the largest one with its (fp32) gradient and half
    # as much again.
    element = torch.tensor([], dtype=torch_dtype).element_size()
    budget = max(param_bytes(model, torch_dtype) // 4, largest * (element + 4) * 3 // 2)
    nvme = str(tmp_path / "nvme")
    zero = {"stage": stage, "offload_optimizer": {"device": offload},
            "stage3_param_persistence_threshold": 100}
    if offload == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme
        # Its staging buffers (DeepSpeed's default buffer_size, 1e8 elements, is more than the
        # host budget).
        zero["offload_param"] = {"buffer_count": 2, "buffer_size": 1 << 16}
    if stage == 3:
        zero.setdefault("offload_param", {})["device"] = offload
        if offload == "nvme":
            zero["offload_param"]["nvme_path"] = nvme
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": zero,
              "strata": {"device": "emulated", "device_budget_bytes": budget,
                         "host_budget_bytes": 64 << 20, "nvme_capacity_bytes": 64 << 20}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train_both(tmp_path, name, stage, offload, dtype):
    torch.manual_seed(0)
    model = ARCHITECTURES[name]()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    reference = MixedPrecisionAdamW(copy.deepcopy(model), torch_dtype, clipping=1.0, lr=LR)
    config = make_config(tmp_path, model, stage, offload, dtype)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    losses = []
    for kwargs in batches(name, STEPS * ACCUMULATION):
        out = engine(**kwargs)
        engine.backward(out.loss)
        engine.step()
        ref_loss = reference.model(**kwargs).loss
        reference.backward(ref_loss, ACCUMULATION)
        if engine.micro_steps % ACCUMULATION == 0:
            reference.step()
        losses.append((out.loss.item(), ref_loss.item()))
    return engine, reference, losses, config, initial


def assert_offloaded(engine, config, model_bytes, stage, offload):
    """At stage 3 the parameters went through a device tier smaller than they are, within its
    budget; with the optimizer on NVMe, its state was read and written there."""
    stats = engine.stats()
    moved = stats["bytes_moved"]
    if stage == 3:
        budget = config["strata"]["device_budget_bytes"]
        assert stats["budget_bytes"]["device"] == budget < model_bytes
        assert 0 < stats["peak_bytes"]["device"] <= budget
        into_device = sum(v for k, v in moved.items() if k.endswith("_to_device"))
        assert into_device >= STEPS * model_bytes // 2, moved  # lent again every step
    if offload == "nvme":
        assert moved.get("host_to_nvme", 0) > 0 and moved.get("nvme_to_host", 0) > 0, moved


# Every architecture at stage 3 with parameters and optimizer on NVMe in fp32, and each at one
# other stage, offload and dtype, so that every stage, both offloads and both dtypes meet several.
CASES = [(name, 3, "nvme", "fp32") for name in ARCHITECTURES] + [
    ("llama", 3, "cpu", "bf16"), ("qwen2", 2, "nvme", "fp32"), ("mistral", 1, "cpu", "bf16"),
    ("gemma", 0, "cpu", "fp32"), ("phi", 3, "cpu", "bf16"), ("gpt2", 2, "cpu", "bf16"),
    ("bert", 1, "nvme", "fp32"), ("t5", 3, "cpu", "bf16")]


@pytest.mark.parametrize("name,stage,offload,dtype", CASES)
def test_a_transformers_model_trains_as_plain_torch(tmp_path, name, stage, offload, dtype):
    engine, reference, losses, config, initial = train_both(tmp_path, name, stage, offload,
                                                            dtype)
    # fp32: the same arithmetic but for the optimizer's fused multiply-adds; bf16: the same
    # recipe, where a weight whose bf16 rounding lands the other way moves later losses by about
    # 2^-8 relative.
    tolerance = 1e-5 if dtype == "fp32" else 2e-2
    for ours, theirs in losses:
        assert ours == pytest.approx(theirs, rel=tolerance, abs=tolerance), losses
    ours = engine.module_state_dict()
    theirs = reference.model.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key].float(), value.float(), rtol=tolerance,
                                   atol=tolerance, msg=lambda m: f"{key}: {m}")
    moved = max((ours[key].float() - initial[key].float()).abs().max().item() for key in initial)
    assert moved > 0.5 * LR  # it trained
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert_offloaded(engine, config, param_bytes(reference.model, torch_dtype), stage, offload)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_generate_with_offloaded_parameters_gives_the_plain_models_tokens(tmp_path, name):
    torch.manual_seed(0)
    model = ARCHITECTURES[name]()
    plain = copy.deepcopy(model).eval()
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, model, 3, "cpu", "fp32"))
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    engine.eval()
    with torch.no_grad():
        ours = engine.module.generate(prompt, max_new_tokens=6, do_sample=False)
    theirs = plain.generate(prompt, max_new_tokens=6, do_sample=False)
    assert ours.tolist() == theirs.tolist()
    assert engine.stats()["peak_bytes"]["device"] <= make_config(
        tmp_path, plain, 3, "cpu", "fp32")["strata"]["device_budget_bytes"]
    # Training goes on after eval as before it: the next step equals plain torch's.
    engine.train()
    plain.train()
    torch_adamw = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01)
    for kwargs in batches(name, 2):
        loss = engine(**kwargs).loss
        engine.backward(loss)
        engine.step()
        ref_loss = plain(**kwargs).loss
        (ref_loss / ACCUMULATION).backward()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    torch_adamw.step()
    kwargs = batches(name, 1, seed=9)[0]
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == pytest.approx(plain(**kwargs).loss.item(),
                                                             rel=1e-5)


def test_gradient_checkpointing_enable_trains_as_plain_torch(tmp_path):
    # transformers' default: torch.utils.checkpoint without reentrance. Each decoder layer is
    # recomputed whole in backward, so the device holds a layer's parameters at once.
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]()
    model_bytes = param_bytes(model, torch.float32)
    model.gradient_checkpointing_enable()
    reference = MixedPrecisionAdamW(copy.deepcopy(model), torch.float32, clipping=1.0, lr=LR)
    config = make_config(tmp_path, model, 3, "cpu", "fp32")
    config["strata"]["device_budget_bytes"] = 80000
    engine, _, _, _ = strata.initialize(model=model, config=config)
    for kwargs in batches("llama", 4):
        loss = engine(**kwargs).loss
        engine.backward(loss)
        engine.step()
        ref_loss = reference.model(**kwargs).loss
        reference.backward(ref_loss, ACCUMULATION)
        if engine.micro_steps % ACCUMULATION == 0:
            reference.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert engine.stats()["peak_bytes"]["device"] <= 80000 < model_bytes


@pytest.mark.parametrize("name,dtype", [("llama", "fp32"), ("gpt2", "fp32"), ("t5", "fp32"),
                                        ("llama", "bf16"), ("t5", "bf16")])
def test_a_model_from_config_under_strata_init_is_initialized_as_transformers_does(tmp_path,
                                                                                    name, dtype):
    # transformers initializes every weight after the modules are built (post_init); under
    # strata.init that writes the partitions, module by module: the same values as a plain
    # build from the same seed (in bf16, their rounding: drawn in fp32 as a plain build draws).
    torch.manual_seed(0)
    plain = ARCHITECTURES[name]()
    config = make_config(tmp_path, plain, 3, "nvme", dtype)
    if dtype == "bf16":
        plain = plain.to(torch.bfloat16)
    torch.manual_seed(0)
    with strata.init(config=config):
        model = ARCHITECTURES[name]()
    partitioned = {n: p for n, p in plain.named_parameters()
                   if strata.zero_init.partition_of(model.get_parameter(n)) is not None}
    assert sum(p.numel() for p in partitioned.values()) > 0.8 * sum(
        p.numel() for p in plain.parameters())
    # Nothing materialized: each a placeholder of one element's bytes.
    assert all(model.get_parameter(n).untyped_storage().nbytes() <= 4 for n in partitioned)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    ours = engine.module_state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    kwargs = batches(name, 1)[0]
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == pytest.approx(plain(**kwargs).loss.item(),
                                                             rel=1e-6 if dtype == "fp32" else 1e-2)


def _lora(model):
    import peft
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj", "gate_proj"])
    return peft.get_peft_model(model, config)


def _lora_config(tmp_path):
    # The device tier holds under half the frozen base.
    return make_config(tmp_path, ARCHITECTURES["llama"](), 3, "nvme", "fp32")


def _train_lora_beside_plain(engine, plain, steps):
    """`steps` optimizer steps of `engine` and of `plain` (a copy of its LoRA model, plain torch:
    AdamW on the trained parameters, clip_grad_norm_ by 1.0) on the same micro-batches, the
    losses and at the end the weights agreeing; returns the engine's weights."""
    torch_adamw = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR,
                                    weight_decay=0.01)
    for i, kwargs in enumerate(batches("llama", steps * ACCUMULATION)):
        loss = engine(**kwargs).loss
        engine.backward(loss)
        engine.step()
        ref_loss = plain(**kwargs).loss
        (ref_loss / ACCUMULATION).backward()
        if (i + 1) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            torch_adamw.step()
            torch_adamw.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    ours = engine.module_state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    return ours


def test_lora_trains_the_adapters_only_with_the_frozen_base_offloaded(tmp_path):
    torch.manual_seed(0)
    base = ARCHITECTURES["llama"]()
    model_bytes = param_bytes(base, torch.float32)
    model = _lora(base)
    plain = copy.deepcopy(model)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters()
                     if not p.requires_grad}
    config = _lora_config(tmp_path)
    assert config["strata"]["device_budget_bytes"] < model_bytes / 2
    engine, _, _, _ = strata.initialize(model=model, config=config)
    # Every large frozen weight is a partition, lent around its module and never trained.
    assert {e.name for e in engine.table.frozen} == {n for n, p in frozen_before.items()
                                                 if p.numel() >= 100}
    assert all(e.name.endswith(("lora_A.default.weight", "lora_B.default.weight"))
               for e in engine.table.trained)
    ours = _train_lora_beside_plain(engine, plain, STEPS)
    for name, value in frozen_before.items():
        assert torch.equal(ours[name], value), name  # never written back
    stats = engine.stats()
    assert stats["peak_bytes"]["device"] <= config["strata"]["device_budget_bytes"]
    # The frozen base is homed on NVMe (the device tier holds under half of it): it is read from
    # there, and never written back (above). (The adapters' optimizer state is read only where a
    # step does not find it in the read-ahead room, as the step before committed it.)
    assert stats["bytes_moved"].get("nvme_to_device", 0) + \
        stats["bytes_moved"].get("nvme_to_host", 0) >= model_bytes // 2


def test_lora_on_a_model_built_under_strata_init_computes_with_its_weights(tmp_path):
    # The frozen weights were partitions from the start: before, they were left out of the
    # engine's lending and the model forwarded with all-zero weights.
    torch.manual_seed(0)
    plain = _lora(ARCHITECTURES["llama"]())
    model_bytes = param_bytes(plain, torch.float32)
    config = _lora_config(tmp_path)
    assert config["strata"]["device_budget_bytes"] < model_bytes / 2
    torch.manual_seed(0)
    with strata.init(config=config):
        model = ARCHITECTURES["llama"]()
    model = _lora(model)
    engine, _, _, _ = strata.initialize(model=model, config=config)
    kwargs = batches("llama", 1)[0]
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == pytest.approx(plain(**kwargs).loss.item(),
                                                             rel=1e-6)
    # Pretrained weights stream into the frozen partitions too.
    torch.manual_seed(5)
    other = _lora(ARCHITECTURES["llama"]())
    torch.save(other.state_dict(), tmp_path / "pretrained.bin")
    assert engine.load_pretrained(tmp_path / "pretrained.bin") == ([], [])
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == pytest.approx(other(**kwargs).loss.item(),
                                                             rel=1e-6)
    for name, value in other.state_dict().items():
        torch.testing.assert_close(engine.module_state_dict()[name], value, rtol=0, atol=0)


def test_a_checkpoint_of_a_lora_model_keeps_its_frozen_partitions(tmp_path):
    def make(seed):
        torch.manual_seed(seed)
        model = _lora(ARCHITECTURES["llama"]())
        return strata.initialize(model=model, config=_lora_config(tmp_path / str(seed)))[0]

    engine = make(0)
    for kwargs in batches("llama", 2):
        engine.backward(engine(**kwargs).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    other = make(1)  # other frozen weights and adapters: the load replaces all of them
    other.load_checkpoint(tmp_path / "ckpt")
    ours, theirs = engine.module_state_dict(), other.module_state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    kwargs = batches("llama", 1, seed=3)[0]
    for e in (engine, other):
        e.backward(e(**kwargs).loss)
        e.step()
    with torch.no_grad():
        assert engine(**kwargs).loss.item() == other(**kwargs).loss.item()
    # exclude_frozen_parameters (DeepSpeed's; Trainer's for a peft model): the base is not
    # written, and a load keeps the model's own base (the adapters and buffers are loaded).
    engine.save_checkpoint(tmp_path / "ckpt", tag="lean", exclude_frozen_parameters=True)
    lean = tmp_path / "ckpt" / "lean"
    excluded = set(json.loads((lean / "meta.json").read_text())["frozen_excluded"])
    assert excluded == {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    assert not excluded & set(torch.load(lean / "engine_states.pt")["module_extra"])
    third = make(2)
    own = third.module_state_dict()
    third.load_checkpoint(tmp_path / "ckpt", tag="lean")
    ours, theirs = engine.module_state_dict(), third.module_state_dict()
    for name in ours:
        assert torch.equal(theirs[name], own[name] if name in excluded else ours[name]), name
    # Consolidated, it lacks the base, and says so.
    from strata import zero_to_fp32
    with pytest.warns(strata.StrataWarning, match=rf"exclude_frozen_parameters: "
                                                  rf"{len(excluded)} parameters not trained "
                                                  r"are not in it .*strict=False"):
        zero_to_fp32.consolidate(tmp_path / "ckpt", tmp_path / "lean.pt", tag="lean")
    assert not excluded & set(torch.load(tmp_path / "lean.pt"))


def test_a_device_budget_without_room_for_a_checkpointed_block_names_what_it_lends(tmp_path):
    # Gradient checkpointing recomputes a whole GPT-2 block in backward: a budget of a quarter
    # of the parameters cannot hold one, and the error says what was being lent and why.
    torch.manual_seed(0)
    model = ARCHITECTURES["gpt2"]()
    model.gradient_checkpointing_enable()
    engine, _, _, _ = strata.initialize(model=model, config=make_config(tmp_path, model, 3, "cpu",
                                                                        "fp32"))
    with pytest.raises(strata.Error, match=r"lending transformer\.h\.\d\..* to Conv1D: parameters "
                                           r"lent now hold \d+ bytes of it; .*gradient checkpointing"
                                           r".*raise strata\.device_budget_bytes") as raised:
        for kwargs in batches("gpt2", 2):
            engine.backward(engine(**kwargs).loss)
            engine.step()
    assert raised.value.code == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize("imported", ["before", "inside"])
def test_strata_init_initializes_a_transformers_model_whose_modeling_code_loads_late(tmp_path,
                                                                                     imported):
    # transformers loads its modeling code on first use: a model class named first inside the
    # context ("before": `import transformers` only; "inside": not even that) is built under
    # strata.init and initialized as transformers does, not refused by the placeholders.
    code = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
{"import transformers" if imported == "before" else ""}
import strata
assert "transformers.modeling_utils" not in sys.modules
config = {{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW"}},
          "zero_optimization": {{"stage": 3, "offload_optimizer": {{"device": "cpu"}},
          "stage3_param_persistence_threshold": 10}},
          "strata": {{"device": "emulated", "host_budget_bytes": 64 << 20,
                     "device_budget_bytes": 64 << 20}}}}
torch.manual_seed(0)
with strata.init(config=config):
    import transformers
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16))
engine, _, _, _ = strata.initialize(model=model, config=config)
torch.manual_seed(0)
plain = transformers.LlamaForCausalLM(model.config)
ours = engine.module_state_dict()
for key, value in plain.state_dict().items():
    assert torch.equal(ours[key], value), key
x = torch.randint(0, 64, (2, 8))
engine.backward(engine(input_ids=x, labels=x).loss)
engine.step()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_save_pretrained_at_stage_3_writes_the_weights_whole(tmp_path):
    """transformers' save_pretrained on the engine's module at stage 3 (as a Trainer's save does):
    module.state_dict() gives the partitioned parameters whole, as plain torch's does, so the
    saved model loads back with the trained weights (not placeholders without their bytes) and
    computes what the engine computes."""
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]()
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, model, 3, "nvme", "fp32"))
    assert any(e.partitioned for e in engine.table.trained)
    for kwargs in batches("llama", 2 * ACCUMULATION):
        engine.backward(engine(**kwargs).loss)
        engine.step()
    whole = engine.module_state_dict()
    state = engine.module.state_dict()
    assert state.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(state[name].cpu(), value), name
    raw = engine.module.state_dict(keep_vars=True)  # the parameters themselves, as torch's
    assert all(raw[e.name] is e.param for e in engine.table.trained)
    engine.module.save_pretrained(tmp_path / "saved")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, whole[name]), name
    (kwargs,) = batches("llama", 1, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kwargs).logits, engine(**kwargs).logits)


def test_a_lora_adapter_saved_at_stage_3_holds_its_trained_weights(tmp_path, monkeypatch):
    """peft's save_pretrained of an adapter trained at stage 3 (its A and B matrices partitions):
    the adapter file holds them whole, and loads onto a fresh base to the engine's outputs; the
    frozen base's weights are not read for it (peft's own reads them all), save those the
    adapter keeps (save_embedding_layers: the embeddings, whole)."""
    import peft
    import safetensors.torch
    import strata.engine
    torch.manual_seed(0)
    base = ARCHITECTURES["llama"]()
    fresh_base = copy.deepcopy(base)
    engine, _, _, _ = strata.initialize(model=_lora(base), config=_lora_config(tmp_path))
    assert any(e.partitioned for e in engine.table.trained)
    for kwargs in batches("llama", 2 * ACCUMULATION):
        engine.backward(engine(**kwargs).loss)
        engine.step()
    whole = engine.module_state_dict()
    read, read_frozen = [], strata.engine.read_frozen
    monkeypatch.setattr(strata.engine, "read_frozen", lambda *a: read.append(a) or read_frozen(*a))
    engine.module.save_pretrained(tmp_path / "adapter")
    assert not read  # (the base's 16 weights, every one partitioned, before)
    engine.module.save_pretrained(tmp_path / "embeddings", save_embedding_layers=True)
    embeddings = safetensors.torch.load_file(tmp_path / "embeddings" / "adapter_model.safetensors")
    assert len(read) == 2 and sum(name.endswith("embed_tokens.weight") for name in embeddings) == 1
    for name, value in embeddings.items():
        if "lora_" not in name:  # (peft's names for the adapters' own lose "default")
            assert torch.equal(value, whole[name]), name
    loaded = peft.PeftModel.from_pretrained(fresh_base, tmp_path / "adapter")
    for name, value in loaded.state_dict().items():
        if "lora_" in name:
            assert torch.equal(value, whole[name]), name
    (kwargs,) = batches("llama", 1, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kwargs).logits, engine(**kwargs).logits)


def test_parameter_counts_at_stage_3_are_the_models(tmp_path):
    """transformers' num_parameters() and peft's trainable count see a partitioned parameter's
    real size (placeholders hold none of it), as without strata."""
    torch.manual_seed(0)
    plain = ARCHITECTURES["llama"]()
    model = copy.deepcopy(plain)
    engine, _, _, _ = strata.initialize(
        model=model, config=make_config(tmp_path, model, 3, "cpu", "fp32"))
    assert any(e.partitioned for e in engine.table.trained)
    for kwargs in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        assert engine.module.num_parameters(**kwargs) == plain.num_parameters(**kwargs), kwargs
    engine.close()
    assert "num_parameters" not in model.__dict__  # taken off with the engine
    base = ARCHITECTURES["llama"]()
    plain_lora = _lora(copy.deepcopy(base))
    engine, _, _, _ = strata.initialize(model=_lora(base), config=_lora_config(tmp_path))
    assert any(e.partitioned for e in engine.table.frozen)
    assert engine.module.get_nb_trainable_parameters() == \
        plain_lora.get_nb_trainable_parameters()
    assert engine.bfloat16_enabled() is False and engine.bf16_enabled() is False


def test_gradient_checkpointing_of_a_lora_model_trains_as_plain_torch(tmp_path):
    """TRL's default: gradient checkpointing (without reentrance) of a LoRA model, its frozen
    base partitioned at stage 3. torch keeps a saved frozen weight as the tensor itself and checks
    its shape after recomputing the block, when the module has given it back: the recomputation
    saves the lent copy instead, and the steps are plain torch's."""
    torch.manual_seed(0)
    base = ARCHITECTURES["llama"]()
    base.gradient_checkpointing_enable()
    base.enable_input_require_grads()
    model = _lora(base)
    plain = copy.deepcopy(model)
    config = _lora_config(tmp_path)
    config["strata"]["device_budget_bytes"] = 120000  # a recomputed block's weights at once
    engine, _, _, _ = strata.initialize(model=model, config=config)
    assert any(e.partitioned for e in engine.table.frozen)
    _train_lora_beside_plain(engine, plain, 2)


def test_a_lora_model_released_after_stage_3_merges_as_plain_peft(tmp_path):
    """peft's merge_and_unload edits the base weights, which stage 3 keeps as partitions:
    engine.release() gives the module its trained weights back (a plain torch module again),
    and the merged model computes what the engine computed."""
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=_lora(ARCHITECTURES["llama"]()),
                                        config=_lora_config(tmp_path))
    for kwargs in batches("llama", 2 * ACCUMULATION):
        engine.backward(engine(**kwargs).loss)
        engine.step()
    (kwargs,) = batches("llama", 1, seed=7)
    with torch.no_grad():
        expected = engine(**kwargs).logits
    with pytest.raises(RuntimeError, match=r"peft's merge_and_unload at ZeRO stage 3: .*"
                                           r"engine.release\(\)"):
        engine.module.merge_and_unload()
    model = engine.release()
    assert all(p.numel() > 0 for p in model.parameters())
    merged = model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(**kwargs).logits, expected, rtol=1e-4, atol=1e-5)


def test_resizing_a_model_built_under_strata_init_is_refused_by_name(tmp_path):
    """resize_token_embeddings on a model built under strata.init reads the partitions'
    placeholders (zeros), not their weights, and gives the parameters sizes their partitions do
    not have: strata.initialize names the parameter and both shapes (it crashed on the sizes)."""
    model = ARCHITECTURES["llama"]()
    config = make_config(tmp_path, model, 3, "cpu", "fp32")
    with strata.init(config=config):
        built = ARCHITECTURES["llama"]()
    built.resize_token_embeddings(200, mean_resizing=False)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight was built under strata.init "
                                         r"as a partition of shape \(128, 32\) and has shape "
                                         r"\(200, 32\)"):
        strata.initialize(model=built, config=config)
