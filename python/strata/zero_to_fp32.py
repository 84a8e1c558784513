"""A strata checkpoint as one fp32 state dict, as DeepSpeed's zero_to_fp32.

    strata_zero_to_fp32 CHECKPOINT_DIR OUT [--tag TAG] [--shard-size BYTES] [--safetensors]
    python3 -m strata.zero_to_fp32 CHECKPOINT_DIR OUT ...
    strata.zero_to_fp32.consolidate(checkpoint_dir, out, tag=None, shard_bytes=None,
                                    safetensors=False)

OUT is a ``torch.save`` file (an existing folder: ``pytorch_model.bin`` in it, as DeepSpeed's
newer zero_to_fp32 writes) that ``torch.load`` reads and a plain ``nn.Module`` of the same
architecture loads with ``load_state_dict`` (strict): every trainable parameter's fp32 master
weights, a tied weight under each of its names, the buffers and frozen parameters as saved (a
checkpoint saved with exclude_frozen_parameters holds no frozen ones: said in a StrataWarning, the
state dict then loads with strict=False over a model holding them). With
``--shard-size``, OUT is a folder of files of at most that many bytes each (a tensor larger than it
has a file of its own) and ``pytorch_model.bin.index.json``, the index large models ship with
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).

With ``--safetensors`` (or an OUT ending in ``.safetensors``) the files are safetensors, as
transformers' ``save_pretrained`` writes them: ``model.safetensors`` (OUT, or in the folder
OUT), or shards ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``,
with the metadata ``{"format": "pt"}`` that ``from_pretrained`` asks for. safetensors holds no shared tensors: a tied
weight is written once, under the first of its names in the module's state dict (the embedding's,
which transformers ties the head to when it loads); the others are left out.

The checkpoint is verified first (every digest: a damaged file is named and nothing is written).
The master weights are not read into memory: each is a copy-on-write map of its bytes in the
checkpoint's ``optimizer_states.bin``, which ``torch.save`` writes out page by page. The pages it
reads in are the file's, clean, and the kernel can reclaim them, but they count in the process's
resident memory while mapped: with ``--shard-size`` each shard's are given back once it is written,
so the resident memory stays near one shard's size; written to one file, it grows by the model's
size (in such file pages; anonymous memory stays near one tensor's) until the file is written.
A checkpoint saved by several ranks holds each parameter in shards, one file per rank: each
parameter is joined as it is written (with ``--shard-size``, one output shard's parameters at a
time; to one file, the whole model in memory).
"""

import argparse
import json
import logging
import mmap
import os
import sys
import warnings
import weakref

import numpy
import torch

from strata import checkpoints
from strata.notices import StrataWarning

__all__ = ["consolidate", "main"]

INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _state_dict(checkpoint_dir, tag):
    """(the verified checkpoint's folder, an ordered {name: tensor} of the fp32 state dict)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if tag is None:
        latest = os.path.join(checkpoint_dir, checkpoints.LATEST)
        try:
            with open(latest, encoding="utf-8") as f:
                tag = f.read().strip()
        except OSError as error:
            raise checkpoints.CheckpointError(
                f"zero_to_fp32: {latest} cannot be read ({error.strerror}); give the tag") from None
    path = checkpoints._resolve(checkpoint_dir, tag) if os.path.isdir(checkpoint_dir) else None
    if path is None:
        raise checkpoints.CheckpointError(
            f"zero_to_fp32: no checkpoint {tag!r} in {checkpoint_dir}")
    meta = checkpoints._read_meta(path)
    checkpoints._verify(path, meta)
    out = {}
    for p in meta["params"]:
        pieces, shard = checkpoints._pieces(meta, p)
        if len(pieces) == 1:  # one process's: a map of the bytes
            file, offset, _ = pieces[0]
            mapped = numpy.memmap(os.path.join(path, file), dtype="<f4", mode="c", offset=offset,
                                  shape=(p["numel"],))
            out[p["name"]] = torch.from_numpy(mapped).view(p["shape"])
            _MAPS[id(out[p["name"]])] = mapped
        else:  # every rank's shard, read when written (_materialize)
            out[p["name"]] = _Shards(path, meta, p)
    for alias, name in meta.get("aliases", {}).items():
        out[alias] = out[name]
    extra = torch.load(os.path.join(path, checkpoints.ENGINE), mmap=True)["module_extra"]
    for name, value in extra.items():  # frozen parameters and buffers; floating ones in fp32
        out[name] = value.float() if value.is_floating_point() else value
    left_out = meta.get("frozen_excluded", [])
    if left_out:
        warnings.warn(
            f"zero_to_fp32: {path} was saved with exclude_frozen_parameters: {len(left_out)} "
            f"parameters not trained are not in it ({', '.join(left_out[:3])}"
            f"{', ...' if len(left_out) > 3 else ''}); the state dict written lacks them: load "
            "it with load_state_dict(..., strict=False) over a model that holds them (its "
            "base), or save the checkpoint without exclude_frozen_parameters", StrataWarning,
            stacklevel=3)
    return path, out


class _Shards:
    """A parameter's master weights saved in shards by several ranks: joined when written, one
    shard of the output at a time (_materialize)."""

    def __init__(self, path, meta, entry):
        self.path, self.meta, self.entry = path, meta, entry
        self.shape = torch.Size(entry["shape"])

    def numel(self):
        return self.entry["numel"]

    def element_size(self):
        return 4

    def load(self):
        files = sorted({p[0] for p in checkpoints._pieces(self.meta, self.entry)[0]})
        handles = {f: open(os.path.join(self.path, f), "rb") for f in files}
        try:
            master = torch.empty(1, self.numel())
            checkpoints._read_range(handles, self.meta, self.entry, 0, self.numel(), master)
        finally:
            for f in handles.values():
                f.close()
        return master[0].view(self.shape)


def _materialize(state):
    """`state` with every _Shards read (a tensor under several names read once)."""
    done = {}
    out = {}
    for name, value in state.items():
        if isinstance(value, _Shards):
            if id(value) not in done:
                done[id(value)] = value.load()
            value = done[id(value)]
        out[name] = value
    return out


# The maps behind the master weights _state_dict hands out, by id of the tensor (weakly: a map
# goes with its tensor).
_MAPS = weakref.WeakValueDictionary()


def _drop_pages(tensor):
    """The pages of a master weight's map that writing it read in, given back: they are the
    checkpoint file's and clean, but they count in the process's resident memory until dropped,
    and a sharded consolidation must stay near one shard's size."""
    mapped = _MAPS.get(id(tensor))
    if mapped is not None and getattr(mapped, "_mmap", None) is not None and \
            hasattr(mmap, "MADV_DONTNEED"):
        mapped._mmap.madvise(mmap.MADV_DONTNEED)


def consolidate(checkpoint_dir, out, tag=None, shard_bytes=None, safetensors=False):
    """Writes the checkpoint's fp32 state dict to `out` (a file, or in an existing folder
    pytorch_model.bin or model.safetensors; with `shard_bytes`, a folder of shards and their
    index), as torch.save files or (`safetensors`, or `out` ending in .safetensors)
    safetensors. Returns the names written."""
    if shard_bytes is not None and shard_bytes < 1:
        raise ValueError(f"zero_to_fp32: shard size {shard_bytes}; accepted: at least 1 byte")
    _, state = _state_dict(checkpoint_dir, tag)
    out = os.fspath(out)
    safetensors = safetensors or out.endswith(".safetensors")
    if safetensors:  # a tensor once, under its first name
        seen = set()
        state = {n: t for n, t in state.items() if not (id(t) in seen or seen.add(id(t)))}
    if shard_bytes is None:
        if os.path.isdir(out):  # (the name from_pretrained looks for)
            out = os.path.join(out, "model.safetensors" if safetensors else "pytorch_model.bin")
        _write(_materialize(state), out, safetensors)
        return list(state)
    os.makedirs(out, exist_ok=True)
    # A tensor with all its names (a tied weight's) goes into one shard, which torch.save keeps
    # shared.
    groups = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), (tensor, []))[1].append(name)
    shards, current, size = [], {}, 0
    for tensor, names in groups.values():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        for name in names:
            current[name] = tensor
        size += nbytes
    if current:
        shards.append(current)
    weight_map = {}
    total = sum(t.numel() * t.element_size() for t, _ in groups.values())
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if safetensors else \
            f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        _write(_materialize(shard), os.path.join(out, file), safetensors)
        for name, tensor in shard.items():
            weight_map[name] = file
            _drop_pages(tensor)
    index = SAFETENSORS_INDEX if safetensors else INDEX
    with open(os.path.join(out, index), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return list(state)


def _write(state, path, safetensors):
    if safetensors:
        from safetensors.torch import save_file
        save_file({n: t.contiguous() for n, t in state.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(state, path)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="strata_zero_to_fp32",
        description="A strata checkpoint as one fp32 state dict (torch.save), or shards and "
                    "their index.")
    parser.add_argument("checkpoint_dir", help="the folder save_checkpoint wrote (with `latest`)")
    parser.add_argument("out", help="the state dict's file, or a folder to write it in "
                        "(pytorch_model.bin, model.safetensors; shards with --shard-size)")
    parser.add_argument("--tag", help="the checkpoint's tag (default: the one `latest` names)")
    parser.add_argument("--shard-size", type=int, metavar="BYTES",
                        help="write shards of at most BYTES each and their index")
    parser.add_argument("--safetensors", action="store_true",
                        help="write safetensors (as save_pretrained does) rather than torch.save")
    args = parser.parse_args(argv)
    # The command line's own messages go through the `strata` logger, to stderr (the library
    # itself never configures logging: this is the program's entry point).
    log = logging.getLogger("strata.zero_to_fp32")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("strata_zero_to_fp32: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        names = consolidate(args.checkpoint_dir, args.out, args.tag, args.shard_size,
                            args.safetensors)
    except (checkpoints.CheckpointError, ValueError, OSError) as error:
        log.error("%s", error)
        return 2
    log.info("%d tensors to %s", len(names), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
