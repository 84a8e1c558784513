"""Fine-tuning with transformers' Trainer through strata: the script a Trainer user writes, with
one line changed (strata.hf.Trainer and a DeepSpeed config for strata).

    PYTHONPATH=build/release/python .venv/bin/python examples/hf_trainer.py --work /tmp/hf \
        [--text FILE_OR_FOLDER ...] [--stage 3] [--offload nvme] [--steps 40] [--bf16]

or across ranks, unchanged: `torchrun --nproc_per_node 2 examples/hf_trainer.py ...` (.venv/bin's
torchrun), each rank on its share of the batches, as Trainer gives them with DDP.

The data: text files on this machine (by default the licences Debian ships), as bytes, cut into
blocks of --context and held out one in ten for evaluation: a datasets.Dataset, as a Trainer user
builds one. The model: examples/llama.py's Llama (byte tokens). TrainingArguments as usual
(accumulation, max_grad_norm, a cosine schedule with warmup, evaluation and checkpoints every
--save-steps, logging); strata's config is DeepSpeed's, its values "auto" where Trainer's
arguments fill them. At the end the model is saved with save_model and loaded back with
from_pretrained, its evaluation loss compared with the trained one's.
"""
import argparse
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune import read_text  # noqa: E402
from llama import llama  # noqa: E402

import strata.hf  # noqa: E402


def blocks(text, context):
    """Dicts of input_ids and labels (the same ids: the model shifts them), one per block."""
    n = len(text) // context
    ids = text[:n * context].view(n, context)
    return [{"input_ids": row, "labels": row} for row in ids]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="output folder (checkpoints, NVMe swap)")
    parser.add_argument("--text", nargs="*", default=["/usr/share/common-licenses"])
    parser.add_argument("--stage", type=int, default=3, choices=[2, 3])
    parser.add_argument("--offload", default="nvme", choices=["cpu", "nvme"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    import datasets
    rows = blocks(read_text(args.text), args.context)
    held_out = rows[::10]
    train = [r for i, r in enumerate(rows) if i % 10]
    train_data = datasets.Dataset.from_list([{k: v.tolist() for k, v in r.items()}
                                             for r in train]).with_format("torch")
    eval_data = datasets.Dataset.from_list([{k: v.tolist() for k, v in r.items()}
                                            for r in held_out[:64]]).with_format("torch")

    torch.manual_seed(0)
    model = llama(args.layers, args.width, max(1, args.width // 64), args.context)
    nvme = os.path.join(args.work, "nvme")
    zero = {"stage": args.stage, "offload_optimizer": {"device": args.offload},
            "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
    if args.offload == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme
    if args.stage == 3:
        zero["offload_param"] = {"device": args.offload}
        if args.offload == "nvme":
            zero["offload_param"]["nvme_path"] = nvme
    strata_config = {"train_micro_batch_size_per_gpu": "auto",
                     "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                     "bf16": {"enabled": "auto"}, "zero_optimization": zero}

    training_args = transformers.TrainingArguments(
        output_dir=os.path.join(args.work, "out"), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=3e-4,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), weight_decay=0.01,
        max_grad_norm=1.0, bf16=args.bf16, logging_steps=5, eval_strategy="steps",
        eval_steps=args.save_steps, save_strategy="steps", save_steps=args.save_steps,
        save_total_limit=2, report_to="none", use_cpu=not torch.cuda.is_available(), seed=0)
    trainer = strata.hf.Trainer(model=model, args=training_args, train_dataset=train_data,
                                eval_dataset=eval_data, strata_config=strata_config)
    trainer.train()
    trained = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(args.work, "model"))  # every rank (it gathers); rank 0 writes
    trainer.accelerator.wait_for_everyone()  # the file whole before any rank reads it
    trainer.strata_engine.close()  # its NVMe store and pinned memory, before the model loads back
    loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(args.work, "model"))
    plain = transformers.Trainer(model=loaded, args=training_args, eval_dataset=eval_data)
    reloaded = plain.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        print(f"hf_trainer: {args.steps} steps through strata (stage {args.stage}, offload "
              f"{args.offload}): evaluation loss {trained:.4f}; the saved model, loaded back "
              f"with from_pretrained: {reloaded:.4f}")


if __name__ == "__main__":
    main()
