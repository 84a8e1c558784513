"""strata.hf: transformers' Trainer trained through strata, against the same Trainer without it
(the same TrainingArguments, model, data and seed), on the host-emulated device tier."""
import copy
import json
import os
import sys

import pytest
import torch
import transformers

import strata
import strata.hf

sys.path.insert(0, os.path.dirname(__file__))
from launch import start_ranks  # noqa: E402
from test_hf_models import ARCHITECTURES, _lora, batches  # noqa: E402

# Ten samples a epoch at two a micro-batch and two micro-batches a step: windows of 2, 2 and 1
# (Trainer ends an epoch's last window early).
SAMPLES, STEPS = 10, 3


def data(name="llama"):
    rows = []
    for b in batches(name, SAMPLES // 2, seed=3):
        for i in range(2):
            rows.append({k: v[i] for k, v in b.items()})
    return rows


def args_of(tmp_path, name, **more):
    kwargs = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3,
                  max_grad_norm=0.5, warmup_steps=1, lr_scheduler_type="linear",
                  weight_decay=0.01, logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=True, seed=0, disable_tqdm=True)
    kwargs.update(more)
    return transformers.TrainingArguments(**kwargs)


def strata_config(stage, offload, tmp_path):
    nvme = str(tmp_path / "nvme")
    zero = {"stage": stage, "offload_optimizer": {"device": offload},
            "stage3_param_persistence_threshold": 100, "reduce_bucket_size": "auto"}
    if offload == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme
        zero["offload_param"] = {"buffer_count": 2, "buffer_size": 1 << 16}
    if stage == 3:
        zero.setdefault("offload_param", {}).update(device=offload)
        if offload == "nvme":
            zero["offload_param"]["nvme_path"] = nvme
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": zero,
            "strata": {"device": "emulated", "device_budget_bytes": 96 << 10,
                       "host_budget_bytes": 64 << 20, "nvme_capacity_bytes": 64 << 20}}


def logged(trainer):
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h]


def plain_run(tmp_path, model, name="llama", **more):
    trainer = transformers.Trainer(model=model, args=args_of(tmp_path, "plain", **more),
                                   train_dataset=data(name))
    trainer.train()
    return trainer


@pytest.mark.parametrize("name,stage,offload", [("llama", 2, "cpu"), ("llama", 3, "nvme"),
                                               ("t5", 3, "nvme")])
def test_trainer_trains_through_strata_as_without_it(tmp_path, name, stage, offload):
    """Accumulation with a short last window, max_grad_norm (Trainer's clip_grad_norm_, which
    the engine answers), the linear schedule with warmup, the no-decay group of Trainer's
    optimizer: the same losses, gradient norms and rates, step by step; save_model writes the
    trained weights whole, which load back (a decoder, and an encoder-decoder whose embedding
    the encoder, the decoder and the head share)."""
    torch.manual_seed(0)
    model = ARCHITECTURES[name]()
    plain = plain_run(tmp_path, copy.deepcopy(model), name)
    trainer = strata.hf.Trainer(model=model, args=args_of(tmp_path, "strata"),
                                train_dataset=data(name),
                                strata_config=strata_config(stage, offload, tmp_path))
    trainer.train()
    engine = trainer.strata_engine
    assert engine.stage == stage and engine._state.accumulation == 2
    if stage == 3:
        assert any(e.partitioned for e in engine.table.trained)
    ours, theirs = logged(trainer), logged(plain)
    assert len(ours) == len(theirs) == STEPS
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(ours, theirs):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
        assert lr == pytest.approx(ref_lr)
    assert theirs[0][1] > 0.5  # max_grad_norm clipped
    whole = engine.module_state_dict()
    for key, value in plain.model.state_dict().items():
        torch.testing.assert_close(whole[key], value, rtol=1e-4, atol=1e-5, msg=key)
    trainer.save_model(tmp_path / "saved")
    loaded = type(model).from_pretrained(tmp_path / "saved")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, whole[key]), key


class _DoubledLoss(transformers.Trainer):
    """A Trainer with a training step of its own, as TRL's trainers have: its loss doubled."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.own_steps = getattr(self, "own_steps", 0) + 1
        model.train()
        inputs = self._prepare_inputs(inputs)
        loss = 2 * self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.accelerator.backward(loss)
        return loss.detach()


def test_a_subclass_s_own_training_step_runs_through_the_engine(tmp_path):
    """with_strata(a Trainer subclass with a training step of its own): that step runs, its
    accelerator.backward the engine's, and gives what it gives without strata (the engine
    taking Trainer's step in its place trained another loss, silently)."""
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]()
    plain = _DoubledLoss(model=copy.deepcopy(model), args=args_of(tmp_path, "plain"),
                         train_dataset=data())
    plain.train()
    ours = strata.hf.with_strata(_DoubledLoss)(
        model=model, args=args_of(tmp_path, "strata"), train_dataset=data(),
        strata_config=strata_config(2, "cpu", tmp_path))
    ours.train()
    assert ours.own_steps == plain.own_steps == 5  # windows of 2, 2 and 1
    assert len(logged(ours)) == STEPS
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(logged(ours), logged(plain)):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
        assert lr == pytest.approx(ref_lr)


def test_a_checkpoint_resumes_bit_for_bit(tmp_path):
    """save_steps: Trainer's checkpoint holds the engine's whole training state (strata/) beside
    the weights; a new Trainer resuming from it ends where the uninterrupted run ends, bit for
    bit. The epoch's short last window (step 3) is a prefix of the recorded trace: step 4 is
    still prefetched as planned."""
    def run(name, resume=None):
        torch.manual_seed(0)
        trainer = strata.hf.Trainer(
            model=ARCHITECTURES["llama"](),
            args=args_of(tmp_path, name, save_strategy="steps", save_steps=2, max_steps=4),
            train_dataset=data(), strata_config=strata_config(3, "nvme", tmp_path / name))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run("whole")
    assert not [w for w in whole.strata_engine.warnings if "access order" in w]
    assert whole.strata_engine.last_step_stats["runtime"]["mode"] == "planned"
    assert os.path.isdir(tmp_path / "whole" / "checkpoint-2" / "strata")
    resumed = run("resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    ours = resumed.strata_engine.module_state_dict()
    for name, value in whole.strata_engine.module_state_dict().items():
        assert torch.equal(ours[name], value), name
    assert logged(resumed)[-1] == logged(whole)[-1]


def test_a_peft_adapter_trains_and_saves_as_an_adapter(tmp_path):
    """A LoRA model under Trainer at stage 3 (the frozen base offloaded): the losses of the
    Trainer without strata; save_model writes the adapter alone, with its trained weights; its
    checkpoints leave the base out (as Trainer's of DeepSpeed's) and resume bit for bit."""
    torch.manual_seed(0)
    model = _lora(ARCHITECTURES["llama"]())  # (its adapters' A drawn once, for both)
    fresh = copy.deepcopy(model)
    plain = plain_run(tmp_path, copy.deepcopy(model))

    def run(model, name, resume=None):
        trainer = strata.hf.Trainer(model=model, args=args_of(tmp_path, name, save_steps=2,
                                                              save_strategy="steps"),
                                    train_dataset=data(),
                                    strata_config=strata_config(3, "cpu", tmp_path / name))
        trainer.train(resume_from_checkpoint=resume)
        return trainer
    trainer = run(model, "strata")
    checkpoint = tmp_path / "strata" / "checkpoint-2"
    meta = json.loads((checkpoint / "strata" / "meta.json").read_text())
    base = {e.name for e in trainer.strata_engine.table.frozen}
    assert base and base <= set(meta["frozen_excluded"])
    resumed = run(fresh, "resumed", resume=str(checkpoint))
    ours = resumed.strata_engine.module_state_dict()
    for name, value in trainer.strata_engine.module_state_dict().items():
        assert torch.equal(ours[name], value), name
    assert len(logged(trainer)) == len(logged(plain)) == STEPS
    for (loss, norm, _), (ref_loss, ref_norm, _) in zip(logged(trainer), logged(plain)):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    trainer.save_model(tmp_path / "adapter")
    saved = os.listdir(tmp_path / "adapter")
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
    from safetensors.torch import load_file
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    whole = trainer.strata_engine.module_state_dict()
    assert adapter and all(v.numel() > 0 for v in adapter.values())
    for key, value in adapter.items():
        (name,) = [n for n in whole if n.replace(".default", "") == key]
        assert torch.equal(value, whole[name]), key


def test_auto_values_are_filled_and_disagreements_named(tmp_path):
    args = args_of(tmp_path, "x")
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {
                  "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                  "total_num_steps": "auto"}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    filled = strata.hf.fill_auto(config, args, ARCHITECTURES["llama"](), num_training_steps=30)
    assert filled["train_micro_batch_size_per_gpu"] == 2
    assert filled["gradient_accumulation_steps"] == 2 and filled["train_batch_size"] == 4
    assert filled["gradient_clipping"] == 0.0  # Trainer clips, by max_grad_norm
    assert filled["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                             "weight_decay": 0.01}
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                             "warmup_num_steps": 1, "total_num_steps": 30}
    assert filled["zero_optimization"]["reduce_bucket_size"] == 32 * 32
    strata.check_config(filled)  # strata reads what it fills
    for key, value, said in (
            ("train_micro_batch_size_per_gpu", 8, r"train_micro_batch_size_per_gpu is 8 and "
                                                  r"the TrainingArguments give 2"),
            ("gradient_clipping", 2.0, r"gradient_clipping is 2.0 .* give 0.5"),
            ("fp16", {"enabled": True}, r"fp16.enabled is True .* give False")):
        with pytest.raises(ValueError, match=said):
            strata.hf.fill_auto(dict(config, **{key: value}), args)
    # The scheduler's values set are compared too, as transformers compares them.
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2}}
    with pytest.raises(ValueError, match=r"scheduler.params.warmup_max_lr is 0.01 and the "
                                         r"TrainingArguments give 0.001"):
        strata.hf.fill_auto(dict(config, scheduler=scheduler), args, num_training_steps=30)
    with pytest.raises(ValueError, match=r"strata.hf: strata.device_budget_bytes is \"auto\""):
        strata.hf.fill_auto({"strata": {"device_budget_bytes": "auto"}}, args)
    with pytest.raises(ValueError, match=r"fp16 .*accepted: bf16=True, or fp32"):
        strata.hf.Trainer(model=ARCHITECTURES["llama"](), args=args_of(tmp_path, "y", fp16=True),
                          strata_config={})
    with pytest.raises(ValueError, match="strata_config is missing"):
        strata.hf.Trainer(model=ARCHITECTURES["llama"](), args=args)
    with pytest.raises(ValueError, match=r"scheduler.type 'OneCycleLR' is not supported; "
                                         r"accepted: WarmupLR, WarmupDecayLR, WarmupCosineLR"):
        strata.hf.Trainer(model=ARCHITECTURES["llama"](), args=args,
                          strata_config={"scheduler": {"type": "OneCycleLR", "params": {}}})
    deepspeed = args_of(tmp_path, "z")
    deepspeed.deepspeed = "ds_config.json"  # (made by DeepSpeed's integration where installed)
    with pytest.raises(ValueError, match=r"TrainingArguments.deepspeed is set: .* accepted: the "
                                         r"DeepSpeed config as strata_config="):
        strata.hf.Trainer(model=ARCHITECTURES["llama"](), args=deepspeed, strata_config={})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(strata_config(2, "cpu", tmp_path)))
    trainer = strata.hf.Trainer(model=ARCHITECTURES["llama"](), args=args, train_dataset=data(),
                                strata_config=str(path))
    assert trainer.strata_config["zero_optimization"]["stage"] == 2


def test_bf16_trains_within_the_tolerance_of_trainers_mixed_precision(tmp_path):
    """bf16=True: Trainer without strata computes under autocast over fp32 weights; through
    strata the weights are bf16 with fp32 master weights (DeepSpeed's bf16): the losses agree
    within the project's bf16 tolerance."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)  # this process's accelerator was made without bf16
    try:
        torch.manual_seed(0)
        model = ARCHITECTURES["llama"]()
        model_start = {k: v.clone() for k, v in model.state_dict().items()}
        plain = plain_run(tmp_path, copy.deepcopy(model), bf16=True)
        trainer = strata.hf.Trainer(model=model, args=args_of(tmp_path, "strata", bf16=True),
                                    train_dataset=data(),
                                    strata_config=strata_config(2, "cpu", tmp_path))
        trainer.train()
        assert trainer.strata_engine.bf16_enabled()
        assert len(logged(trainer)) == len(logged(plain)) == STEPS
        for (loss, _, _), (ref_loss, _, _) in zip(logged(trainer), logged(plain)):
            assert loss == pytest.approx(ref_loss, rel=2e-2)
        # The weights moved as plain Trainer's did: over the model, far closer to where plain
        # Trainer's went than to where they started (bf16 weights near 1, the norms', round away
        # a step's change: compared over every weight at once).
        ours = trainer.strata_engine.module_state_dict()
        moved = apart = 0.0
        for name, value in plain.model.state_dict().items():
            moved += (value.float() - model_start[name].float()).square().sum().item()
            apart += (ours[name].float() - value.float()).square().sum().item()
        assert moved > 0 and apart < 0.25 * moved, (apart, moved)
    finally:
        AcceleratorState._reset_state(True)


def _word_tokenizer():
    """A tokenizer made here (nothing is downloaded): the words w0..w99, whitespace apart."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{f"w{i}": i + 3 for i in range(100)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                                                pad_token="[PAD]", eos_token="[EOS]")


def sft_run(tmp_path, name, config=None):
    """TRL's SFTTrainer (through strata with `config`, a strata config) with a peft LoRA
    config, on text it tokenizes itself, gradient checkpointing on (its default), trained."""
    import datasets
    import peft
    from trl import SFTConfig, SFTTrainer
    gen = torch.Generator().manual_seed(5)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 100, (12,), generator=gen))
             for _ in range(SAMPLES)]
    # lm_head trained whole beside the adapters (modules_to_save): at stage 3 a partition, its
    # keys listed in peft's save with the module's own state_dict().
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "gate_proj"],
                           modules_to_save=["lm_head"])
    args = SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3,
                     max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True,
                     seed=0, max_length=16, save_strategy="no", disable_tqdm=True,
                     bf16=False)  # (gradient checkpointing left on: TRL's default)
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]()
    torch.manual_seed(1)  # the adapters' A, drawn in the trainer's get_peft_model
    kwargs = {} if config is None else {"strata_config": config}
    trainer = (SFTTrainer if config is None else strata.hf.with_strata(SFTTrainer))(
        model=model, args=args, processing_class=_word_tokenizer(),
        train_dataset=datasets.Dataset.from_dict({"text": texts}), peft_config=lora, **kwargs)
    trainer.train()
    return trainer


def test_trls_sft_trainer_with_lora_trains_through_strata_as_without_it(tmp_path):
    """TRL's SFTTrainer with LoRA (sft_run): strata.hf.with_strata(SFTTrainer) gives its losses
    and gradient norms, step by step."""
    import peft
    plain = sft_run(tmp_path, "plain")
    ours = sft_run(tmp_path, "strata", strata_config(3, "cpu", tmp_path))
    assert isinstance(ours.model, peft.PeftModel) and ours.strata_engine is not None
    assert ours.args.gradient_checkpointing
    assert len(logged(ours)) == len(logged(plain)) == STEPS
    for (loss, norm, _), (ref_loss, ref_norm, _) in zip(logged(ours), logged(plain)):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)


def test_trls_dpo_trainer_trains_through_strata_as_without_it(tmp_path):
    """TRL's DPOTrainer (its own training step and loss, a frozen reference model beside the
    engine's) at stage 3: with_strata(DPOTrainer) logs its losses, norms and rewards."""
    import datasets
    from trl import DPOConfig, DPOTrainer
    gen = torch.Generator().manual_seed(5)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 100, (n,), generator=gen))
    rows = datasets.Dataset.from_dict({key: [words(length) for _ in range(8)] for key, length in
                                       (("prompt", 5), ("chosen", 4), ("rejected", 4))})

    def run(cls, name, **kwargs):
        args = DPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3,
                         max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True,
                         seed=0, save_strategy="no", disable_tqdm=True, bf16=False)
        torch.manual_seed(0)
        model = ARCHITECTURES["llama"]()
        trainer = cls(model=model, ref_model=copy.deepcopy(model), args=args,
                      processing_class=_word_tokenizer(), train_dataset=rows, **kwargs)
        trainer.train()
        return [h for h in trainer.state.log_history if "loss" in h]

    plain = run(DPOTrainer, "plain")
    ours = run(strata.hf.with_strata(DPOTrainer), "strata",
               strata_config=strata_config(3, "cpu", tmp_path))
    assert len(ours) == len(plain) == 2
    assert plain[1]["rewards/margins"] != 0  # (the second step's: the policy has moved)
    for mine, theirs in zip(ours, plain):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margins"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), key


def test_an_accelerate_loop_trains_and_resumes_through_strata(tmp_path):
    """Accelerate's loop over the engine's module and optimizer: prepare, accelerator.backward,
    clip_grad_norm_, optimizer.step, save_state / load_state (a new engine resuming bit for bit)
    and get_state_dict (the weights whole at stage 3), against the same loop in plain torch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    rows = [transformers.default_data_collator(data()[i:i + 2]) for i in range(0, SAMPLES, 2)]

    def engine_of(name, model):
        config = fill_config(strata_config(3, "nvme", tmp_path / name))
        engine, optimizer, _, _ = strata.initialize(model=model, config=config)
        return engine, accelerator.prepare(engine.module, optimizer)

    def train(model, optimizer, batches, accelerator=accelerator):
        norms = []
        for batch in batches:
            accelerator.backward(model(**batch).loss)
            norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
        return norms

    torch.manual_seed(0)
    base = ARCHITECTURES["llama"]()
    plain = copy.deepcopy(base)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    plain_accelerator = Accelerator(cpu=True)  # its own models and optimizers to save
    plain_model, plain_optimizer = plain_accelerator.prepare(plain, plain_optimizer)
    engine, (model, optimizer) = engine_of("a", base)
    ours = train(model, optimizer, rows[:3])
    assert ours == pytest.approx(
        train(plain_model, plain_optimizer, rows[:3], plain_accelerator), rel=1e-4)
    accelerator.save_state(tmp_path / "state")
    whole = accelerator.get_state_dict(model)
    for name, value in plain_model.state_dict().items():
        torch.testing.assert_close(whole[name], value, rtol=1e-4, atol=1e-5, msg=name)
    train(model, optimizer, rows[3:])
    accelerator._models.clear()
    accelerator._optimizers.clear()
    torch.manual_seed(1)
    resumed, (resumed_model, resumed_optimizer) = engine_of("b", ARCHITECTURES["llama"]())
    accelerator.load_state(tmp_path / "state")
    train(resumed_model, resumed_optimizer, rows[3:])
    ours = resumed.module_state_dict()
    for name, value in engine.module_state_dict().items():
        assert torch.equal(ours[name], value), name
    # Through for_accelerate, save_state keeps the engine's checkpoint in place of the weights
    # and the optimizer's state read whole; a state saved without it is named on load.
    strata.hf.for_accelerate(accelerator)
    with pytest.raises(FileNotFoundError, match=r"holds no strata checkpoint \(strata/\) for a "
                                                r"prepared engine: .* without strata.hf.for_acc"):
        accelerator.load_state(tmp_path / "state")
    with pytest.raises(ValueError, match=r"save_state\(exclude_buffers=...\) with a "
                                         r"strata engine prepared: .*accepted: client_state"):
        accelerator.save_state(tmp_path / "engine", exclude_buffers=True)
    side = accelerator.prepare(torch.nn.Linear(2, 2))  # a model of accelerate's beside it
    accelerator.save_state(tmp_path / "engine")
    assert sorted(os.listdir(tmp_path / "engine")) == ["latest", "model.safetensors",
                                                       "random_states_0.pkl", "strata"]
    train(resumed_model, resumed_optimizer, rows[:1])
    accelerator.free_memory()
    again, prepared = engine_of("c", ARCHITECTURES["llama"]())
    side_again = accelerator.prepare(torch.nn.Linear(2, 2))
    # (the engine's keyword to its checkpoint, accelerate's to the model it loads)
    accelerator.load_state(tmp_path / "engine", load_optimizer_states=True, strict=True)
    assert torch.equal(side_again.weight, side.weight)
    train(*prepared, rows[:1])
    ours = again.module_state_dict()
    for name, value in resumed.module_state_dict().items():
        assert torch.equal(ours[name], value), name
    AcceleratorState._reset_state(True)


def test_accelerate_backward_is_the_engines_and_the_accumulations_must_agree(tmp_path):
    """for_accelerate's accelerator.backward scales the loss and ends the window as accelerate
    does, into the engine's backward: an engine accumulating otherwise than the Accelerator is
    refused, naming both, before anything is scaled twice or not at all."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    try:
        accelerator = strata.hf.for_accelerate(Accelerator(cpu=True,
                                                           gradient_accumulation_steps=2))
        assert strata.hf.for_accelerate(accelerator) is accelerator  # (once)
        engine, optimizer, _, _ = strata.initialize(
            model=ARCHITECTURES["llama"](), config=fill_config(strata_config(2, "cpu", tmp_path)))
        model, optimizer = accelerator.prepare(engine.module, optimizer)
        batch = transformers.default_data_collator(data()[:2])
        with pytest.raises(ValueError, match=r"accelerator.backward\(learning_rate=...\) over a "
                                             r"strata engine's module: .* retain_graph alone"):
            accelerator.backward(model(**batch).loss, learning_rate=1e-3)  # (LOMO's keyword)
        with pytest.raises(ValueError, match=r"the Accelerator accumulates 2 micro-batches a step "
                                             r"and the engine's config 1 .*accepted: the same"):
            accelerator.backward(model(**batch).loss)
    finally:
        AcceleratorState._reset_state(True)


def fill_config(config):
    """A strata config for a loop of one's own (no Trainer to fill its "auto" values)."""
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
                  gradient_clipping=0.0, optimizer={"type": "AdamW", "params": {
                      "lr": 1e-3, "weight_decay": 0.01}})
    for key in ("train_batch_size", "bf16"):
        config.pop(key)
    config["zero_optimization"]["reduce_bucket_size"] = 1 << 20
    return config


def test_trainer_leaves_placing_the_model_to_the_engine(tmp_path):
    """Trainer moves the whole model to its device when it is made, which offloading a model
    larger than the GPU must not do: strata's Trainer leaves it where it is (the engine places
    it when training starts)."""
    model = ARCHITECTURES["llama"]()

    def moved(*args, **kwargs):
        raise AssertionError(f"the model was moved: .to{args}")

    model.to = moved
    strata.hf.Trainer(model=model, args=args_of(tmp_path, "x"), train_dataset=data(),
                      strata_config=strata_config(3, "cpu", tmp_path))
    with pytest.raises(AssertionError, match="the model was moved"):
        transformers.Trainer(model=model, args=args_of(tmp_path, "y"), train_dataset=data())


def test_resuming_from_a_checkpoint_strata_did_not_save_is_refused(tmp_path):
    """A checkpoint of a Trainer without strata has no engine state to resume (its optimizer.pt
    is torch's): resuming strata's Trainer from it is refused by name, not begun afresh."""
    torch.manual_seed(0)
    plain_run(tmp_path, ARCHITECTURES["llama"](), save_strategy="steps", save_steps=2)
    trainer = strata.hf.Trainer(model=ARCHITECTURES["llama"](), args=args_of(tmp_path, "ours"),
                                train_dataset=data(),
                                strata_config=strata_config(2, "cpu", tmp_path))
    with pytest.raises(FileNotFoundError, match=r"holds no strata checkpoint \(strata/\)"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    # One strata saved with save_only_model=True: the weights alone, said so.
    torch.manual_seed(0)
    only = strata.hf.Trainer(model=ARCHITECTURES["llama"](),
                             args=args_of(tmp_path, "only", save_strategy="steps", save_steps=2,
                                          save_only_model=True),
                             train_dataset=data(), strata_config=strata_config(2, "cpu", tmp_path))
    only.train()
    resumed = strata.hf.Trainer(model=ARCHITECTURES["llama"](),
                                args=args_of(tmp_path, "again"),  # (save_only_model not set)
                                train_dataset=data(),
                                strata_config=strata_config(2, "cpu", tmp_path))
    with pytest.raises(FileNotFoundError, match=r"and no optimizer state: a checkpoint saved "
                                                r"with save_only_model=True holds the weights"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "only" / "checkpoint-2"))


# One rank of a job of two (torchrun's variables set): Trainer with DDP, as transformers makes it
# (the reference), then strata's Trainer at stage 2 and at stage 3 (evaluating, saving a checkpoint
# at step 2, and resumed from it), then TRL's SFTTrainer with LoRA, then an Accelerate loop, each
# with and without strata.
# Rank 0 writes what each logged, and the weights.
RANKS = r"""
import copy, os, pathlib, sys
sys.path.insert(0, sys.argv[1])
import safetensors.torch, torch, transformers
import strata, strata.engine, strata.hf
from test_hf_trainer import (ARCHITECTURES, data, args_of, strata_config, logged, sft_run,
                             accelerate_ranks_run)
tmp, out = pathlib.Path(sys.argv[2]), {}
rank = int(os.environ["RANK"])


def run(name, stage=None, offload=None, resume=None):
    torch.manual_seed(0)
    args = args_of(tmp, name, save_strategy="steps", save_steps=2, eval_strategy="steps",
                   eval_steps=2)
    given = dict(model=ARCHITECTURES["llama"](), args=args, train_dataset=data(),
                 eval_dataset=data()[:6])
    if stage is None:
        trainer = transformers.Trainer(**given)
    else:
        config = strata_config(stage, offload, tmp / f"{name}{rank}")
        config["strata"]["comm_timeout_s"] = 120
        trainer = strata.hf.Trainer(**given, strata_config=config)
        assert trainer.strata_engine is None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(tmp / name / "saved")  # every rank: at stage 3 a gather
    weights = trainer.model.state_dict() if stage is None else \
        trainer.strata_engine.module_state_dict()
    if stage is not None:
        assert trainer.strata_engine.ranks.size == 2
        assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    else:
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    out[name] = {"logged": logged(trainer), "weights": weights,
                 "evals": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]}


run("ddp")
run("stage2", 2, "cpu")
run("stage3", 3, "nvme")
run("resumed", 3, "nvme", resume=str(tmp / "stage3" / "checkpoint-2"))
for name, strata_given in (("sft_ddp", None), ("sft_stage3", strata_config(3, "cpu", tmp))):
    trainer = sft_run(tmp, name, strata_given)
    # save_model on every rank: the adapters' weights gathered, the frozen base (each rank's
    # shard) read on no rank (rank 0 saves the adapters alone; rank 1 joins their gathers).
    read, read_frozen = [], strata.engine.read_frozen
    strata.engine.read_frozen = lambda *a: read.append(a) or read_frozen(*a)
    trainer.save_model(tmp / name / "saved")
    strata.engine.read_frozen = read_frozen
    assert not read, (rank, len(read))
    if strata_given is not None:
        assert trainer.strata_engine.table.frozen  # (partitioned: the base's shards)
    adapter = safetensors.torch.load_file(tmp / name / "saved" / "adapter_model.safetensors") \
        if rank == 0 else {}
    out[name] = {"logged": logged(trainer), "weights": adapter, "evals": []}
for name, stage in (("accelerate_ddp", None), ("accelerate_stage3", 3)):
    out[name] = accelerate_ranks_run(tmp, rank, stage)
# generate at stage 3, each rank on its own prompt, rank 0's ending at once (its eos the first
# token it makes): the ranks go on together, each with the plain model's tokens.
torch.manual_seed(0)
model = ARCHITECTURES["gpt2"]()
plain = copy.deepcopy(model).eval()
config = strata_config(3, "cpu", tmp / f"generate{rank}")
config.update(train_micro_batch_size_per_gpu=1, train_batch_size=2, gradient_accumulation_steps=1,
              gradient_clipping=0.0, bf16={"enabled": False}, optimizer={"type": "AdamW"})
config["zero_optimization"]["reduce_bucket_size"] = 1 << 20
engine, _, _, _ = strata.initialize(model=model, config=config)
prompts = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(4))
with torch.no_grad():
    eos = plain.generate(prompts[:1], max_new_tokens=1, do_sample=False)[0, -1].item()
    given = dict(max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    ours = engine.module.eval().generate(prompts[rank:rank + 1], **given)
    assert torch.equal(ours, plain.generate(prompts[rank:rank + 1], **given)), (rank, ours)
    assert (ours.shape[1] == 7) == (rank == 0), ours  # (rank 0 ended after one token)
# A generate the model instance has of its own is left as it is, and kept after close().
own_model = ARCHITECTURES["gpt2"]()
own_model.generate = own = lambda *args, **kwargs: "its own"
own_engine, _, _, _ = strata.initialize(model=own_model, config=config)
assert own_model.generate is own
own_engine.close()
assert own_model.generate is own
# Seq2SeqTrainer's predict_with_generate (T5, stage 3), its ranks ending at other lengths: the
# engine's generate on each rank's rows.
torch.manual_seed(0)
rows = data("t5")[:4]
args = transformers.Seq2SeqTrainingArguments(
    output_dir=str(tmp / "s2s"), per_device_train_batch_size=2, per_device_eval_batch_size=2,
    max_steps=1, learning_rate=1e-3, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
    save_strategy="no", predict_with_generate=True, generation_max_length=10)
trainer = strata.hf.with_strata(transformers.Seq2SeqTrainer)(
    model=ARCHITECTURES["t5"](), args=args, train_dataset=rows,
    strata_config=strata_config(3, "cpu", tmp / f"s2s{rank}"))
trainer.train()
# Rank 0's sequences end at their first token (every token its eos), rank 1's after 8 at least.
given = {"eos_token_id": list(range(trainer.model.config.vocab_size))} if rank == 0 else \
    {"min_new_tokens": 8}
predicted = trainer.predict(rows[:2], **given).predictions
assert predicted.shape[0] >= 2, predicted.shape  # (gathered from the ranks)
if rank == 0:
    torch.save(out, tmp / "out.pt")
# Out without the interpreter's finalization: torch's Gloo threads may free Trainer's last
# finished collective as it runs and abort the process (torch's open issue 190489; about one exit
# in ten here, with or without strata, a destroy_process_group() first or not).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def accelerate_ranks_run(tmp_path, rank, stage=None):
    """One rank's Accelerate loop over its half of each global batch, two micro-batches a step
    through accumulate() and accelerator.backward (through strata at `stage`, for_accelerate:
    the engine's backward; else in DDP with torch's AdamW): its clipped gradients' norms, and
    the weights (accelerator.get_state_dict, every rank)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    accelerator = strata.hf.for_accelerate(Accelerator(cpu=True, gradient_accumulation_steps=2))
    rows = [transformers.default_data_collator(data()[i:i + 2]) for i in range(0, 8, 2)] * 2
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]()
    if stage is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        config = fill_config(strata_config(stage, "cpu", tmp_path))
        config["gradient_accumulation_steps"] = 2
        engine, optimizer, _, _ = strata.initialize(model=model, config=config)
        model = engine.module
        head = torch.nn.ModuleDict({"model": model, "head": torch.nn.Linear(2, 2)})
        with pytest.raises(ValueError, match=r"2 trained parameters of the model are not the "
                                             r"strata engine's \(head.weight, head.bias\)"):
            accelerator.prepare(head)  # (nothing would reduce the head's gradients)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) == (stage is None)

    def train(model, optimizer, batches, norms):
        for batch in batches:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
                optimizer.step()
                optimizer.zero_grad()
        return norms
    norms = train(model, optimizer, rows[rank::2][:2], [])
    if stage is not None:  # after the first step, every rank's shard (for_accelerate)
        accelerator.save_state(str(tmp_path / "state"))
    train(model, optimizer, rows[rank::2][2:], norms)
    assert len(norms) == 2
    weights = accelerator.get_state_dict(model)
    if stage is not None:  # each model(...) prepared as engine() prepares it: gathers ahead
        assert engine.prefetched_gathers > 0
        with pytest.raises(RuntimeError, match=r"each rank holds a shard; .*"
                                               r"strata.hf.for_accelerate\(accelerator\) first"):
            optimizer.state_dict()  # (what accelerate's placement of it would have read)
        # A new engine resumes from the state saved: the step after it as the run's.
        assert sorted(os.listdir(tmp_path / "state")) == [
            "latest", "random_states_0.pkl", "random_states_1.pkl", "strata"]
        accelerator.free_memory()
        torch.manual_seed(1)
        resumed, optimizer, _, _ = strata.initialize(model=ARCHITECTURES["llama"](),
                                                     config=config)
        model, optimizer = accelerator.prepare(resumed.module, optimizer)
        accelerator.load_state(str(tmp_path / "state"))
        assert train(model, optimizer, rows[rank::2][2:], []) == norms[1:]
        ours = resumed.module_state_dict()  # (a gather: every rank)
        for name, value in engine.module_state_dict().items():
            assert torch.equal(ours[name], value), name
    AcceleratorState._reset_state(True)
    return {"logged": norms, "weights": weights, "evals": []}


def test_trainer_across_two_ranks_trains_as_trainer_with_ddp(tmp_path):
    """torchrun's two ranks: strata's Trainer (never wrapped in DDP: the engine reduces) logs
    the losses, gradient norms, rates and evaluation losses of Trainer with DDP, step by step,
    and ends at its weights, at stage 2 and at stage 3 with NVMe; save_model (a gather at stage
    3, on every rank) writes the trained weights whole; the checkpoint the two ranks wrote
    resumes bit for bit; TRL's SFTTrainer with LoRA across the ranks logs what it logs with
    DDP; an Accelerate loop accumulating (strata.hf.for_accelerate) ends at DDP's weights, and
    its save_state (each rank's shard) resumes bit for bit; generate's ranks ending at other
    lengths go on together (each with the plain model's tokens)."""
    procs = start_ranks(2, RANKS, (os.path.dirname(os.path.abspath(__file__)), tmp_path))
    for p in procs:
        _, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    ddp = out["ddp"]
    assert len(ddp["logged"]) == STEPS and len(ddp["evals"]) == 2  # steps 2 and 3
    for name, reference in (("stage2", ddp), ("stage3", ddp), ("resumed", ddp),
                            ("sft_stage3", out["sft_ddp"])):
        ours = out[name]
        assert len(ours["logged"]) == len(reference["logged"]), name
        for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(ours["logged"],
                                                                  reference["logged"]):
            assert loss == pytest.approx(ref_loss, rel=1e-5), name
            assert norm == pytest.approx(ref_norm, rel=1e-4), name
            assert lr == pytest.approx(ref_lr), name
        assert ours["evals"] == pytest.approx(reference["evals"], rel=1e-5), name
        for key, value in reference["weights"].items():
            torch.testing.assert_close(ours["weights"][key], value, rtol=1e-4, atol=1e-5,
                                       msg=f"{name}: {key}")
    # (the adapters compared, and the lm_head trained whole beside them)
    assert any("lora_" in key for key in out["sft_ddp"]["weights"])
    assert any("lm_head" in key for key in out["sft_ddp"]["weights"])
    for key, value in out["stage3"]["weights"].items():
        assert torch.equal(out["resumed"]["weights"][key], value), key
    # Accelerate's loop (for_accelerate: the engine's module never in DDP, accelerator.backward
    # the engine's, accumulating as accelerate does), against DDP's.
    reference, ours = out["accelerate_ddp"], out["accelerate_stage3"]
    assert reference["logged"] == pytest.approx(ours["logged"], rel=1e-5)
    for key, value in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert sorted(os.listdir(tmp_path / "stage3" / "checkpoint-2" / "strata")) == [
        "engine_states.pt", "meta.json", "optimizer_states.rank0.bin",
        "optimizer_states.rank1.bin"]
    saved = type(ARCHITECTURES["llama"]()).from_pretrained(tmp_path / "stage3" / "saved")
    for key, value in saved.state_dict().items():
        assert torch.equal(value, out["stage3"]["weights"][key]), key
