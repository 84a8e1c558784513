"""Pretrained weights streamed into an engine: ``engine.load_pretrained(source)``.

`source` is one of:
  - a ``safetensors`` file, or a folder (or the index file itself) of safetensors shards with
    ``model.safetensors.index.json``, as Hugging Face models ship;
  - a ``torch.save`` file of a state dict (the zip format torch has written since 1.6), or a
    folder (or the index) of such shards with ``pytorch_model.bin.index.json``
    (``{"weight_map": {name: file}}``), as ``strata_zero_to_fp32 --shard-size`` writes;
  - a folder holding one of those (``model.safetensors`` first, as transformers looks);
  - a state dict in memory (``engine.module.load_state_dict(state_dict)`` comes here).
Stored tensors may be fp32, bf16 or fp16 (any float dtype): each is converted as it is placed.
The files are not loaded whole: a safetensors file is read a tensor at a time; a torch.save
pickle is read with each tensor left where it is in the archive; each tensor goes straight into
its place (a partition's host or NVMe copy and the optimizer's fp32 master weights), so the host
memory a load needs beyond the budgets is about one parameter's optimizer state (its fp32 weights
and two zeroed moments: three times its fp32 size), whatever the model's size.

Names are matched as transformers matches them: a checkpoint of the base model loads into a model
with a head (and back) through the model's ``base_model_prefix`` ("model.", "transformer.",
"bert."); a PEFT model takes its base model's names (``base_model.model.`` and ``.base_layer.``
left out), so a base checkpoint loads under LoRA adapters; the old LayerNorm names ``gamma`` and
``beta`` are ``weight`` and ``bias``; a tensor that
is one of the model's non-persistent buffers (``position_ids`` in older BERT checkpoints) or that
the model says to ignore (``_keys_to_ignore_on_load_unexpected``) is passed over. Before anything
changes, every name is checked against the model: missing, unexpected and wrongly shaped tensors
are named, all of them, both shapes shown (``strict=False`` lets missing and unexpected names
pass; a wrong shape never does). Then the optimizer state is replaced all or none: the master weights
are the loaded tensors in fp32 and the optimizer starts afresh over them (moments and step counts
zero, as for a model just built); the parameters are set in the training dtype; the buffers and
frozen parameters are copied in.

Thread safety: the engine's (one thread).
"""

import json
import os
import pickle
import re
import zipfile

import torch

from strata import checkpoints
from strata.parameters import load_master, set_weights

__all__ = ["load", "read_state_dict_lazily", "read_safetensors_lazily"]

INDEX = "pytorch_model.bin.index.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class _SafetensorsTensor:
    """A tensor of a safetensors file, read when asked for (only its own bytes)."""

    def __init__(self, path, name, shape, dtype):
        self.path, self.name, self.shape, self.dtype = path, name, torch.Size(shape), dtype

    def read(self):
        from safetensors import safe_open
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(self.name)


class _InMemory:
    """A tensor of a state dict given in memory."""

    def __init__(self, tensor):
        self.tensor, self.shape, self.dtype = tensor, tensor.shape, tensor.dtype

    def read(self):
        return self.tensor.detach()


def read_safetensors_lazily(path):
    """{name: a tensor left in the file (.shape, .dtype, .read())} of a safetensors file."""
    from safetensors import safe_open
    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt") as f:
            out = {}
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise checkpoints.CheckpointError(
                        f"load_pretrained: {path}: {name} is stored as {piece.get_dtype()}; "
                        f"accepted: {', '.join(_SAFETENSORS_DTYPES)}")
                out[name] = _SafetensorsTensor(path, name, piece.get_shape(), dtype)
            return out
    except checkpoints.CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - safetensors' own error types vary by version
        raise checkpoints.CheckpointError(
            f"load_pretrained: {path} cannot be read as safetensors: {error}") from None


def _read_file_lazily(path):
    if os.fspath(path).endswith(".safetensors"):
        return read_safetensors_lazily(path)
    return read_state_dict_lazily(path)


class _LazyStorage:
    def __init__(self, archive, record, dtype):
        self.archive, self.record, self.dtype = archive, record, dtype


class _LazyTensor:
    """A tensor of a torch.save archive, read when asked for."""

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset = storage, offset
        self.shape, self.stride = torch.Size(size), tuple(stride)

    @property
    def dtype(self):
        return self.storage.dtype

    def read(self):
        """The tensor's own elements: only the bytes of the storage it spans are read (a storage
        shared by many tensors is not read whole for each)."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        span = 0 if 0 in self.shape else \
            1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride))
        data = torch.empty(span * size, dtype=torch.uint8)  # read into at once: no copies
        with zipfile.ZipFile(self.storage.archive) as z, z.open(self.storage.record) as f:
            f.seek(self.offset * size)
            got = checkpoints._read_into(f, data)
        if got != span * size:
            raise checkpoints.CheckpointError(
                f"load_pretrained: {self.storage.archive}: {self.storage.record} ends early")
        return data.view(self.dtype).as_strided(self.shape, self.stride, 0)


def _storage_dtype(name):
    dtype = getattr(torch, name, None)
    if isinstance(dtype, type) and hasattr(dtype, "dtype"):
        return dtype.dtype
    raise pickle.UnpicklingError(f"a storage of type {name} is not known to this torch")


class _Unpickler(pickle.Unpickler):
    """torch.save's pickle with the storages left in the archive."""

    def __init__(self, file, archive, prefix):
        super().__init__(file)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        # What a state dict's pickle names, and nothing else (a pickle can run any code it names).
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return lambda storage, offset, size, stride, *rest: _LazyTensor(storage, offset, size,
                                                                            stride)
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *rest: data  # an nn.Parameter: its tensor
        if module == "torch" and name.endswith("Storage"):
            return _StorageKind(name)
        if (module, name) in (("collections", "OrderedDict"), ("torch", "Size")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a state dict")

    def persistent_load(self, saved_id):
        _, kind, key, _, _ = saved_id
        dtype = kind.dtype if isinstance(kind, _StorageKind) else kind
        return _LazyStorage(self.archive, f"{self.prefix}/data/{key}", dtype)


class _StorageKind:
    def __init__(self, name):
        self.dtype = _storage_dtype(name)


def read_state_dict_lazily(path):
    """{name: a tensor left in the archive (.shape, .dtype, .read())} of a torch.save file."""
    path = os.fspath(path)
    if not zipfile.is_zipfile(path):
        raise checkpoints.CheckpointError(
            f"load_pretrained: {path} is not a torch.save zip archive (accepted: the format "
            "torch.save writes since 1.6, or a folder of shards with an index)")
    with zipfile.ZipFile(path) as z:
        pickles = [n for n in z.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise checkpoints.CheckpointError(f"load_pretrained: {path} holds no data.pkl")
        prefix = pickles[0][:-len("/data.pkl")]
        with z.open(pickles[0]) as f:
            try:
                state = _Unpickler(f, path, prefix).load()
            except (pickle.UnpicklingError, AttributeError, ValueError, TypeError) as error:
                raise checkpoints.CheckpointError(
                    f"load_pretrained: {path} cannot be read: {error}") from None
    if not isinstance(state, dict):
        raise checkpoints.CheckpointError(f"load_pretrained: {path} holds a "
                                           f"{type(state).__name__}; accepted: a state dict")
    return {k: v for k, v in state.items() if isinstance(v, _LazyTensor)}


def _entries(source):
    """{name: lazy tensor} of a file, of the shards an index names, of the file or index a folder
    holds, or of a state dict in memory."""
    if isinstance(source, dict):
        return {name: _InMemory(t) for name, t in source.items() if torch.is_tensor(t)}
    source = os.fspath(source)
    index = None
    if os.path.isdir(source):
        for name in (SAFETENSORS, SAFETENSORS_INDEX, INDEX):
            if os.path.exists(os.path.join(source, name)):
                index = os.path.join(source, name)
                break
        else:
            raise checkpoints.CheckpointError(
                f"load_pretrained: {source} holds none of {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                f"{INDEX}; accepted: a folder with one of them, or a file")
        if not index.endswith(".index.json"):
            return _read_file_lazily(index)
    elif source.endswith(".index.json"):
        index = source
    if index is None:
        return _read_file_lazily(source)
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise checkpoints.CheckpointError(
            f"load_pretrained: {index} cannot be read as a shard index: {error}") from None
    folder = os.path.dirname(index)
    out, problems = {}, []
    for file in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(folder, file)):
            problems.append(f"it names {file}, which is missing")
            continue
        shard = _read_file_lazily(os.path.join(folder, file))
        listed = {name for name, where in weight_map.items() if where == file}
        for name in sorted(listed):
            if name not in shard:
                problems.append(f"it puts {name} in {file}, which lacks it")
            else:
                out[name] = shard[name]
        problems += [f"{file} holds {name}, which it does not list"
                     for name in sorted(set(shard) - listed)]
    if problems:
        raise checkpoints.CheckpointError(
            f"load_pretrained: {index}: " + "; ".join(problems) + "; nothing was changed")
    return out


def load(engine, source, strict=True, keep_state=False):
    """Streams the state dict at `source` into the engine (see the module's docstring). Returns
    (missing names, unexpected names), both empty when strict. `keep_state`: the loaded
    parameters' optimizer state (moments, step counts) is kept, their master weights alone
    replaced, as torch's module.load_state_dict leaves its optimizer's state; else it starts
    afresh."""
    if engine._step.staged is not None or engine._state.gradients_since_step or any(
            e.param.grad is not None for e in engine.table.trained):
        # torch's would step the loaded weights with them; the load drops them (Gradients.
        # end_step), which would skip the step silently.
        raise RuntimeError("load_pretrained / module.load_state_dict between backward and step: "
                           "the gradients made since the last step() would be dropped, and the "
                           "step would change nothing; accepted: load after step() or before "
                           "backward (zero_grad() first drops them by name)")
    entries, aliases, rest, missing, unexpected = checkpoints.checked_everywhere(
        engine._checkpoints, "load_pretrained", lambda: _check(engine, source, strict))
    engine._gradients.end_step(failed=False)  # gradients summed before the load are dropped
    wanted = {e.name for e in engine.table.trained}
    source_of = {n: n for n in wanted if n in entries}
    alias_of = dict(aliases)
    for alias, own in alias_of.items():
        if own not in source_of and alias in entries:
            source_of[own] = alias
    loaded = [e for e in engine.table.trained if e.name in source_of]

    def ours(e, whole):
        """This rank's part of a parameter: across ranks, its shard of the optimizer's state and
        of a partition; otherwise (and an unpartitioned parameter's weights) all of it."""
        return whole if engine.ranks is None else engine.ranks.own_shard(whole, e.shard)

    with checkpoints.loading_optimizer_state(engine._checkpoints, "load_pretrained",
                                              whole=len(loaded) == len(engine.table.trained)):
        for e in loaded:
            # (A state dict's tensors may be on a GPU, as torch's load_state_dict takes them:
            # the optimizer's state is host memory.)
            master = ours(e, entries[source_of[e.name]].read().to("cpu", torch.float32)
                          .reshape(-1).contiguous())
            if keep_state:
                load_master(engine.runtime, e, master)
            else:
                engine.runtime.load_optimizer_state(
                    e.gid, master, torch.full_like(master, engine._initial_state),
                    torch.zeros_like(master))
    for e in loaded:
        whole = entries[source_of[e.name]].read().to("cpu", torch.float32).reshape(-1)
        set_weights(engine.runtime, e, ours(e, whole) if e.partitioned else whole)
        if not keep_state:
            e.steps = 0
    for name, value in rest.items():
        if name in entries:
            value.write(entries[name].read())
    return missing, unexpected


def _check(engine, source, strict):
    """What load checks before it changes anything: (the entries, the module's aliases, its
    other tensors, the missing and unexpected names)."""
    aliases, rest = checkpoints._module_rest(engine._checkpoints)
    wanted = {e.name: e.shape for e in engine.table.trained}
    wanted.update({n: tuple(t.shape) for n, t in rest.items()})
    alias_of = dict(aliases)  # another name of a trainable parameter -> its name
    entries = _matched(engine.module, _entries(source), set(wanted) | set(alias_of))
    where = "the state dict" if isinstance(source, dict) else os.fspath(source)
    missing = [n for n in wanted if n not in entries and
               not any(a in entries for a, own in alias_of.items() if own == n)]
    unexpected = [n for n in entries if n not in wanted and n not in alias_of]
    shapes = [f"{n}: shape {list(entries[n].shape)} in {where}, "
              f"{list(wanted[n])} in the model"
              for n in wanted if n in entries and tuple(entries[n].shape) != tuple(wanted[n])]
    shapes += [f"{a}: shape {list(entries[a].shape)}, {list(wanted[own])} in the model"
               for a, own in alias_of.items()
               if a in entries and tuple(entries[a].shape) != tuple(wanted[own])]
    problems = shapes + ([f"missing: {n}" for n in missing] +
                         [f"unexpected: {n}" for n in unexpected] if strict else [])
    if problems:
        raise checkpoints.CheckpointError("load_pretrained: " + "; ".join(problems) +
                                           "; nothing was changed")
    return entries, aliases, rest, missing, unexpected


def _matched(model, entries, known):
    """`entries` under the model's names, matched as transformers matches them (the module's
    docstring): a name the model lacks is tried with the old LayerNorm names replaced and with
    the base model's prefix added or taken off; what is still unknown and is a non-persistent
    buffer of the model, or matches its _keys_to_ignore_on_load_unexpected, is passed over."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    ignore = [re.compile(p) for p in
              (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    non_persistent = {f"{path}.{b}" if path else b for path, m in model.named_modules()
                      for b in getattr(m, "_non_persistent_buffers_set", ())}
    # A PEFT model's names, as the model it wraps has them (base_model.model.<name>, a wrapped
    # layer's weights under .base_layer.): a base model's checkpoint loads into its adapted model.
    unwrapped = {}
    for name in known:
        unwrapped.setdefault(re.sub(r"^base_model\.model\.", "", name)
                             .replace(".base_layer.", "."), name)
    out = {}
    for name, tensor in entries.items():
        target = name
        if target not in known:
            legacy = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
            tried = [legacy]
            if prefix:
                tried.append(f"{prefix}.{legacy}")
                if legacy.startswith(prefix + "."):
                    tried.append(legacy[len(prefix) + 1:])
            target = next((t for t in tried if t in known), None) or \
                next((unwrapped[t] for t in tried if t in unwrapped), name)
        if target not in known and (target in non_persistent or
                                    any(p.search(name) for p in ignore)):
            continue
        out.setdefault(target, tensor)
    return out
