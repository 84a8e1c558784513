"""A minGPT-style LightningModule fine-tuned with Lightning's Trainer on strata (StrataStrategy).

    PYTHONPATH=build/release/python .venv/bin/python examples/lightning_mingpt.py \
        --work build/release/scratch/lightning [--strategy strata_stage_3_offload] \
        [--precision bf16-mixed] [--devices 2] [--max-steps 60] [--compare]

The model is minGPT's decoder (pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP,
learned positions, a head tied to the token embedding, byte tokens), built in ``configure_model``
as the DeepSpeed page of Lightning's documentation builds its minGPT: under ZeRO stage 3 it is
built under ``strata.init``, each large parameter a partition as it is made. Each layer draws its
initial weights in its own constructor (GPT-2's: normal with std 0.02, zero biases), before
strata.init partitions it: a model that writes its parameters after they are built (a loop over
``self.parameters()`` at the end of ``__init__``) would write placeholders under strata.init, as
under DeepSpeed's zero.Init.
``configure_optimizers`` returns torch.optim.AdamW (stepped by strata's CPU optimizer) with a
warm-up and cosine decay (Lightning's LR scheduler config, stepped each optimizer step). The text
is the licences Debian ships (/usr/share/common-licenses, read as bytes), windows of --context
bytes; the last tenth is held out for validation.

By default the strategy is StrataStrategy(stage=3, offload_optimizer=True,
offload_parameters=True) with the optimizer's state on NVMe under --work (ZeRO-Infinity's
layout: parameters in pinned host memory, lent to the device tier around each module); --strategy
takes any registered name instead (strata_stage_2_offload, strata_stage_3_offload, ...). A
ModelCheckpoint writes strata's checkpoint folder under --work each epoch; at the end it is
collated into one fp32 file (convert_zero_checkpoint_to_fp32_state_dict) that
``MinGPT.load_from_checkpoint`` reads. With --compare the same model, seed and batches train
under plain Lightning (strategy "auto") and the two loss curves are printed side by side.
Messages go through logging (the "lightning_mingpt" logger, to stderr); the curves and summary
are printed on stdout.
"""
import argparse
import logging
import math
import os
import shutil
import time

import torch
from torch.nn import functional as F

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

# Importing strata.lightning registers the strategy names (strata_stage_3_offload, ...).
from strata.lightning import StrataStrategy, convert_zero_checkpoint_to_fp32_state_dict

log = logging.getLogger("lightning_mingpt")


class Linear(nn.Linear):
    """GPT-2's initialization, drawn in the constructor."""

    def __init__(self, fan_in, fan_out, bias=True):
        super().__init__(fan_in, fan_out, bias=bias)
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def __init__(self, count, width):
        super().__init__(count, width)
        nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = Linear(width, 3 * width)
        self.proj = Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = Linear(width, 4 * width)
        self.out = Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers, width, heads, context, vocab=256):
        super().__init__()
        self.tokens = Embedding(vocab, width)
        self.positions = Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class MinGPT(pl.LightningModule):
    def __init__(self, layers=4, width=192, heads=6, context=64, lr=3e-3, warmup=10,
                 total_steps=100):
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self):
        if self.model is None:  # Lightning calls it in every run: build once
            h = self.hparams
            self.model = GPT(h.layers, h.width, h.heads, h.context)

    def forward(self, idx):
        return self.model(idx)

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        h = self.hparams
        decay = [p for n, p in self.named_parameters() if p.dim() > 1]
        other = [p for n, p in self.named_parameters() if p.dim() <= 1]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": other, "weight_decay": 0.0}],
                                      lr=h.lr, betas=(0.9, 0.95))

        def factor(step):
            if step < h.warmup:
                return (step + 1) / h.warmup
            progress = min(1.0, (step - h.warmup) / max(1, h.total_steps - h.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Windows(torch.utils.data.Dataset):
    """`count` windows of `context` + 1 bytes of `text`, at starts drawn once from `seed`."""

    def __init__(self, text, count, context, seed):
        self.text, self.context = text, context
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(text) - context - 1, (count,), generator=gen)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = int(self.starts[i])
        chunk = self.text[s:s + self.context + 1]
        return chunk[:-1], chunk[1:]


class Curve(Callback):
    """The mean logged train_loss of each optimizer step (rank 0 keeps it)."""

    def __init__(self):
        self.losses, self._pending = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._pending.append(float(trainer.callback_metrics["train_loss"]))
        if trainer.global_step > len(self.losses):
            self.losses.append(sum(self._pending) / len(self._pending))
            self._pending = []


def read_text(paths):
    data = bytearray()
    for path in paths:
        names = [os.path.join(path, n) for n in sorted(os.listdir(path))] \
            if os.path.isdir(path) else [path]
        for name in names:
            if os.path.isfile(name) and not os.path.islink(name):
                with open(name, "rb") as f:
                    data += f.read()
    return torch.tensor(list(data), dtype=torch.long)


def train(args, strategy, text, seed_offset=0):
    pl.seed_everything(args.seed, verbose=False)
    steps = args.max_steps
    model = MinGPT(args.layers, args.width, args.heads, args.context, args.lr,
                   warmup=max(1, steps // 10), total_steps=steps)
    cut = len(text) * 9 // 10
    per_rank = args.batch // args.devices
    train_data = Windows(text[:cut], steps * args.batch * args.accumulate, args.context, 1)
    val_data = Windows(text[cut:], 4 * args.batch, args.context, 2)
    loader = torch.utils.data.DataLoader(train_data, batch_size=per_rank)
    val_loader = torch.utils.data.DataLoader(val_data, batch_size=per_rank)
    curve = Curve()
    callbacks = [curve]
    checkpoints = None
    if strategy != "auto":
        checkpoints = ModelCheckpoint(dirpath=os.path.join(args.work, "checkpoints"),
                                      save_last=False, save_top_k=1, monitor="val_loss")
        callbacks.append(checkpoints)
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                         precision=args.precision, max_steps=steps,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0,
                         val_check_interval=None, check_val_every_n_epoch=1,
                         callbacks=callbacks, logger=False, enable_progress_bar=args.progress,
                         enable_checkpointing=checkpoints is not None,
                         enable_model_summary=False, num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(model, loader, val_loader)
    seconds = time.perf_counter() - start
    return trainer, model, curve, checkpoints, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="scratch folder (NVMe swap, checkpoints)")
    parser.add_argument("--strategy", help="a registered strategy name (strata_stage_3_offload, "
                                           "...); default: stage 3, the optimizer on NVMe")
    parser.add_argument("--precision", default="32-true",
                        choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8, help="the global batch (all ranks)")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--text", nargs="*", default=["/usr/share/common-licenses"])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--compare", action="store_true",
                        help="train under plain Lightning too and print both curves")
    parser.add_argument("--progress", action="store_true", help="Lightning's progress bar")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for name, value in (("--max-steps", args.max_steps), ("--batch", args.batch),
                        ("--accumulate", args.accumulate), ("--devices", args.devices)):
        if value < 1:
            parser.error(f"{name} {value}: accepted: 1 or more")
    if args.batch % args.devices:
        parser.error(f"--batch {args.batch} is not a multiple of --devices {args.devices}")
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    text = read_text(args.text)
    if len(text) < 20 * (args.context + 1):
        parser.error(f"the text is {len(text)} bytes; it needs at least {20 * (args.context + 1)}")
    os.makedirs(args.work, exist_ok=True)
    nvme = os.path.join(args.work, "nvme")
    shutil.rmtree(nvme, ignore_errors=True)
    shutil.rmtree(os.path.join(args.work, "checkpoints"), ignore_errors=True)
    os.makedirs(nvme)
    strategy = args.strategy or StrataStrategy(
        stage=3, offload_optimizer=True, offload_parameters=True,
        offload_optimizer_device="nvme", nvme_path=nvme,
        config={"zero_optimization": {"stage3_param_persistence_threshold": 4096}})

    trainer, model, curve, checkpoints, seconds = train(args, strategy, text)
    if trainer.global_rank != 0:
        return
    engine = trainer.strategy.engine
    moved = engine.stats()["bytes_moved"]
    log.info("strata: %d steps in %.1f s on the %s device tier, %s", trainer.global_step,
             seconds, engine.device_kind, precision_note(args.precision))
    best = checkpoints.best_model_path
    collated = os.path.join(args.work, "mingpt_fp32.ckpt")
    convert_zero_checkpoint_to_fp32_state_dict(best, collated)
    reloaded = MinGPT.load_from_checkpoint(collated)
    print(f"checkpoint folder: {best} (best val_loss "
          f"{float(checkpoints.best_model_score):.4f})")
    print(f"collated fp32 checkpoint: {collated} "
          f"({sum(p.numel() for p in reloaded.parameters())} parameters; "
          "MinGPT.load_from_checkpoint reads it)")
    print("bytes moved between tiers: " + ", ".join(f"{k} {v / 2**20:.1f} MiB"
                                                     for k, v in sorted(moved.items())))
    reference = None
    if args.compare:
        if args.devices != 1:
            log.info("--compare: plain Lightning runs in one process, with the same global "
                     "batch")
        args_plain = argparse.Namespace(**dict(vars(args), devices=1))
        _, _, reference, _, plain_seconds = train(args_plain, "auto", text)
        log.info("plain Lightning: %d steps in %.1f s", len(reference.losses), plain_seconds)
    print(f"{'step':>5} {'strata':>9}" + (f" {'plain':>9} {'diff':>9}" if reference else ""))
    every = max(1, len(curve.losses) // 20)
    for i, loss in enumerate(curve.losses):
        if i % every == 0 or i == len(curve.losses) - 1:
            line = f"{i + 1:>5} {loss:>9.4f}"
            if reference and i < len(reference.losses):
                line += f" {reference.losses[i]:>9.4f} {loss - reference.losses[i]:>+9.1e}"
            print(line)
    if reference:
        diff = max(abs(a - b) for a, b in zip(curve.losses, reference.losses))
        print(f"largest difference of the two curves: {diff:.2e}")


def precision_note(precision):
    return {"32-true": "fp32", "bf16-mixed": "bf16 with fp32 master weights",
            "16-mixed": "fp16 with fp32 master weights and dynamic loss scaling"}[precision]


if __name__ == "__main__":
    main()
