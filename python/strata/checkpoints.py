"""Checkpoints of a strata engine: ``engine.save_checkpoint`` and ``engine.load_checkpoint``.

A checkpoint is a folder per tag under the save folder, with DeepSpeed's habits: a ``latest`` file
beside the tags names the newest. A tag's folder holds

* ``optimizer_states.bin``: each trainable parameter's fp32 master weights, exp_avg and
  exp_avg_sq (Adagrad's sum and Lion's exp_avg in exp_avg's place), raw little-endian float32,
  one parameter after the other in the engine's order, streamed partition by partition from the
  Runtime's optimizer (host or NVMe): never more than one parameter's state in memory;
* ``engine_states.pt``: the learning-rate scheduler's state, the trainer's ``client_state`` (the
  data position, say) and the module's buffers and frozen parameters, with ``torch.save``;
* ``meta.json``, written last: the format, the step counters, the fp16 loss scaler, the optimizer's
  param groups, each parameter's name, shape, Adam step count, offset and the XXH3-128 digests of
  its three tensors, the other names of tied parameters, the digest of ``engine_states.pt``, a
  blake2b digest of meta.json's own content (``meta_digest``: its counters and rates are checked
  as the tensors are), and
  the config as given.

Saved by several ranks (strata/ranks.py), the folder holds ``optimizer_states.rank<r>.bin`` in
place of ``optimizer_states.bin``: rank r's shard of each parameter's three tensors (``shard``
elements each, the last rank's padded), and meta.json says ``world_size`` and, per parameter, each
rank's offset and digests; rank 0 writes the rest once every rank has written its part (the
frozen partitions' weights whole in ``engine_states.pt``, each rank's shard gathered). A
checkpoint is read by any number of ranks, whatever number wrote it.

``strata.zero_to_fp32`` (and the ``strata_zero_to_fp32`` command) turns one into a plain fp32
state dict.

Crash-consistent: a save writes the folder under a temporary name (``.TAG.partial-...``), syncs
every file and the folder, renames it to TAG (an existing TAG is first renamed aside to
``.TAG.replaced-<time>-...`` and removed once the new one is in place, by a rename out of those
names first so that a removal killed half-way is never taken for a whole copy), syncs the save
folder, and only then replaces ``latest`` (written aside, synced, renamed, the folder synced). A
process killed at any moment leaves ``latest`` naming a whole checkpoint; a TAG found only renamed
aside is loaded from the newest such copy.

A save is taken between steps, at the end of a gradient-accumulation window (inside one the
gradients summed so far would not be kept: refused). Tags are 1 to 200 of A-Z a-z 0-9 _ . + = -,
not starting with '.' or '-', and name nothing a save writes aside.

Loading checks before it changes anything: every parameter of the engine is in the checkpoint
with its shape and none is extra (all mismatches named at once), the files are whole, every
tensor's digest matches (a flipped byte is named by file and tensor), the optimizer and its param
groups are the engine's, and the engine's scheduler takes the saved schedule. Then gradients
summed before the load are dropped, the optimizer state is loaded all or none (the Runtime's load:
one manifest record for the NVMe state), the parameters are set from the master weights in the
training dtype, and the counters, loss scaler and scheduler are restored, so the steps after a
load are bit for bit the steps of the run that saved it (for a model whose randomness the trainer
restores: the random-number state is the trainer's, in client_state, as in DeepSpeed). With
``load_module_only`` (or ``load_optimizer_states=False``) only the weights are taken: the master
weights follow them and the moments stay.

`CheckpointStore` holds what a save or load reads and writes, handed it by the engine: the
parameter table, the Runtime, the ranks, the training state's counts, the loss scaler, the
optimizer and its schedule, the step and the gradients (a load drops the gradients summed before
it), the module (its buffers and frozen parameters), the config, the warnings. The functions
below take the store. Thread safety: the engine's (one thread).
"""

import concurrent.futures
import contextlib
import copy
import hashlib
import json
import os
import re
import socket
import shutil
import time
import uuid

import torch

from strata import _strata
from strata.parameters import read_frozen, set_weights, write_frozen

__all__ = ["save", "load", "CheckpointError"]

FORMAT = "strata-checkpoint"
VERSION = 1
STATES = "optimizer_states.bin"
ENGINE = "engine_states.pt"
META = "meta.json"
LATEST = "latest"
_KINDS = ("master", "exp_avg", "exp_avg_sq")

# Test seam: called with the name of each moment of a save (a test kills the process there).
_crash_point = None


class CheckpointStore:
    """What an engine's checkpoints read and write (see the module's docstring). `runtime` is
    handed by the engine once made (None once it is closed); `lr_scheduler`, the engine's, is
    handed before each save and load (a trainer may set the engine another)."""

    def __init__(self, table, ranks, state, scaler, step, gradients, notices, *, optimizer,
                 optimizer_kind, module, config, dtype):
        self.table = table
        self.ranks = ranks
        self.state = state
        self.scaler = scaler
        self.step = step
        self.gradients = gradients
        self.notices = notices
        self.optimizer = optimizer
        self.optimizer_kind = optimizer_kind
        self.module = module
        self.config = config
        self.dtype = dtype
        self.runtime = None
        self.lr_scheduler = None


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the file and what is wrong are named."""


def _point(name):
    if _crash_point is not None:
        _crash_point(name)


def _digest(tensor):
    return _strata.digest(tensor)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")


def _check_tag(tag):
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag.startswith(LATEST) or \
            ".partial" in tag or ".replaced" in tag:
        raise ValueError(f"save_checkpoint: tag {tag!r}; accepted: 1 to 200 of A-Z a-z 0-9 _ . + "
                         f"= -, not starting with '.' or '-', not {LATEST!r}..., without "
                         "'.partial' or '.replaced'")


def _host():
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


_PARTIAL = re.compile(r"\.(.+)\.partial-([A-Za-z0-9]+)-([0-9]+)-[0-9a-f]{8}")
_SYNC_EVERY = 64 << 20  # bytes of optimizer state written between syncs of a save
_DOUBLE_BUFFER_MAX = 256 << 20  # a save double-buffers states up to this size
_DELETING = re.compile(r"\.deleting-[0-9a-f]{8}")


def _remove_dead_partials(save_dir):
    """Folders of saves killed before their rename: made on this host by a process that is gone
    (a save of another host or PID namespace on a shared folder is left alone)."""
    for name in os.listdir(save_dir):
        m = _PARTIAL.fullmatch(name)
        if m and m.group(2) == _host() and not os.path.exists(f"/proc/{m.group(3)}"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        elif _DELETING.fullmatch(name):  # a removal that was killed half-way
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def _replaced(save_dir, tag):
    """The folders a save of `tag` moved aside (exactly this tag's), newest first: each is named
    by the time it was moved, so that when the tag's own folder is gone (two saves of the tag
    killed in turn) the one that was the tag last is found, not an older one."""
    pattern = re.compile(re.escape(f".{tag}.replaced-") + r"(\d{20})-[0-9a-f]{8}")
    found = [(int(m.group(1)), n) for n in os.listdir(save_dir)
             if (m := pattern.fullmatch(n))]
    return [n for _, n in sorted(found, reverse=True)]


def _remove(save_dir, name):
    """Removes a folder put aside: renamed out of the asides' names first, so a removal killed
    half-way leaves nothing that _resolve could take for whole (_remove_dead_partials finishes
    it)."""
    doomed = os.path.join(save_dir, f".deleting-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(os.path.join(save_dir, name), doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


# Across ranks the ranks agree on a save or load first (Ranks.agree): a call on one rank alone
# (guarded by `if rank == 0`) ends with an error naming it, not a collective the others never
# joined.
_EVERY_RANK = ("engine.{}(), of which each rank {} (accelerate's save_state / load_state through "
               "strata.hf.for_accelerate, Trainer's checkpoints): every rank must call it, not "
               "the saving rank alone")


def save(store, save_dir, tag=None, client_state=None, save_latest=True,
         exclude_frozen_parameters=False):
    """Saves the engine's training state under save_dir/tag (see the module's docstring);
    returns the tag's folder. exclude_frozen_parameters (DeepSpeed's): the parameters not
    trained are left out (meta.json names them); a load keeps the model's own."""
    if store.step.staged is not None:
        raise RuntimeError("save_checkpoint: between backward and step; save after step()")
    if store.step.half_loaded is not None:
        raise RuntimeError(f"save_checkpoint: {store.step.half_loaded}")
    if store.step.stepped_early:
        raise RuntimeError(
            f"save_checkpoint: the step is half taken ({len(store.step.stepped_early)} parameters "
            "stepped during backward before it was dropped, the others have not yet: "
            "strata.optimizer_during_backward); save after step()")
    if store.state.micro_steps % store.state.accumulation:
        # As DeepSpeed's and plain PyTorch's checkpoints (a trainer's validation or exception
        # callback saves where it is): the state as of the last step, without the window's
        # gradients.
        store.notices.warn(
            f"save_checkpoint inside a gradient-accumulation window (micro-batch "
            f"{store.state.micro_steps % store.state.accumulation} of "
            f"{store.state.accumulation}): the gradients summed so far in the window are not "
            "saved; a run resumed from this checkpoint ends the window with the micro-batches "
            "that follow only")
    tag = f"global_step{store.state.global_steps}" if tag is None else tag
    _check_tag(tag)
    save_dir = os.fspath(save_dir)
    left_out = _frozen_names(store) if exclude_frozen_parameters else ()
    if store.ranks is not None:
        return _save_ranks(store, save_dir, tag, client_state, save_latest, left_out)
    partial = _new_partial(save_dir, tag)
    try:
        _write_state(store, partial, client_state, left_out)
        _point("files_written")
        final = _publish(save_dir, tag, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if save_latest:
        _write_latest(save_dir, tag)
    _drop_asides(save_dir, tag)
    return final


def _new_partial(save_dir, tag):
    """The folder a save writes into before its rename (save_dir made; dead saves' removed)."""
    os.makedirs(save_dir, exist_ok=True)
    _remove_dead_partials(save_dir)
    partial = os.path.join(save_dir,
                           f".{tag}.partial-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(partial)
    return partial


def _publish(save_dir, tag, partial):
    """The whole, written folder synced and renamed to `tag` (an existing one moved aside first);
    returns its path."""
    _fsync_dir(partial)
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final):
        aside = os.path.join(save_dir,
                             f".{tag}.replaced-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
        _point("old_renamed_aside")
    os.rename(partial, final)
    _fsync_dir(save_dir)
    _point("renamed")
    return final


def _write_latest(save_dir, tag):
    latest = os.path.join(save_dir, LATEST)
    written = f"{latest}.partial-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _write_file(written, tag.encode())
    os.replace(written, latest)
    _fsync_dir(save_dir)
    _point("latest_written")


def _drop_asides(save_dir, tag):
    """The old folder, and any a killed save left aside for this tag."""
    for name in _replaced(save_dir, tag):
        _remove(save_dir, name)


def _save_ranks(store, save_dir, tag, client_state, save_latest, left_out):
    """A save across ranks (the folder shared by them, as DeepSpeed's): rank 0 makes the folder
    and tells the others its name; every rank writes its optimizer states
    (optimizer_states.rank<r>.bin, its shard of every parameter's) and their digests; once every
    rank has, rank 0 writes engine_states.pt and meta.json (every rank's digests in it), renames the
    folder and moves ``latest``. A rank that fails or dies before the checkpoint is whole ends the
    save on every rank with an error, the folder removed and ``latest`` unchanged; one that dies
    after is told of in rank 0's error, which says the checkpoint is whole. Every rank must give
    the same tag."""
    ranks = store.ranks
    ranks.agree(_EVERY_RANK.format("save_checkpoint", "writes its shard"))
    lead = ranks.rank == 0
    failure, name = None, ""
    if lead:
        try:
            name = os.path.basename(_new_partial(save_dir, tag))
        except OSError as error:
            failure = error
    name = ranks.broadcast_text(name)
    if not name:
        if failure is not None:
            raise failure
        raise CheckpointError(f"save_checkpoint: rank 0 could not make the checkpoint's folder "
                              f"in {save_dir} (it says why); nothing was saved")
    partial = os.path.join(save_dir, name)
    theirs = name[1:name.rindex(".partial-")]
    failed = ranks.failed_ranks(theirs == tag)  # every rank saves the same tag
    if failed:
        if lead:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(
            f"save_checkpoint: rank{'s' if len(failed) > 1 else ''} "
            f"{', '.join(map(str, failed))} gave another tag than rank 0's {theirs!r} (this rank: "
            f"{tag!r}); accepted: the same tag on every rank; nothing was saved")
    try:
        try:
            entries, size = _write_optimizer_states(
                store, os.path.join(partial, _rank_file(ranks.rank)))
            _write_file(os.path.join(partial, f"rank{ranks.rank}.json"),
                        json.dumps({"params": entries, "bytes": size}).encode())
            _point("rank_written")
        except Exception as error:  # told to the others first
            failure = error
        failed = ranks.failed_ranks(failure is None)
        if failed:
            if failure is not None:
                raise failure
            raise CheckpointError(
                f"save_checkpoint: rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))} could not write {tag!r} (each says why); nothing "
                f"was saved, {LATEST} is unchanged")
        # The frozen partitions' weights whole for engine_states.pt (each an all-gather every
        # rank joins; rank 0 keeps them, the others let each go).
        frozen = {}
        for name, value in _module_rest(store, left_out)[1].items():
            if value.frozen is not None:
                whole = value.read()
                if lead:
                    frozen[name] = whole
                del whole
        published = False
        if lead:
            try:
                _finish_ranks(store, save_dir, tag, partial, client_state, save_latest, frozen,
                              left_out)
                published = True
            except Exception as error:
                failure = error
        _point("before_outcome")
        try:
            failed = ranks.failed_ranks(failure is None)  # rank 0's outcome, on every rank
        except Exception as error:
            if published:  # whole and named; only telling the others failed
                _drop_asides(save_dir, tag)
                raise CheckpointError(
                    f"save_checkpoint: {tag!r} was saved whole"
                    f"{' and ' + LATEST + ' names it' if save_latest else ''}, but the other "
                    f"ranks could not be told: {error}") from error
            raise
        if failed:
            if failure is not None:
                raise failure
            raise CheckpointError(f"save_checkpoint: rank 0 could not complete {tag!r} (it says "
                                  "why)")
    except BaseException:
        if lead:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if lead:
        _drop_asides(save_dir, tag)
    return os.path.join(save_dir, tag)


def _finish_ranks(store, save_dir, tag, partial, client_state, save_latest, frozen, left_out):
    """Rank 0, once every rank has written its part: the engine's states (`frozen`: the frozen
    partitions' weights, gathered) and meta.json, then the folder renamed and ``latest``
    moved."""
    size = store.ranks.size
    parts = []
    for q in range(size):
        part_file = os.path.join(partial, f"rank{q}.json")
        with open(part_file, encoding="utf-8") as f:
            parts.append(json.load(f))
    params = [dict(_param_meta(e), shard=e.shard, ranks=[part["params"][i] for part in parts])
              for i, e in enumerate(store.table.trained)]
    files = {_rank_file(q): {"bytes": part["bytes"]} for q, part in enumerate(parts)}
    files[ENGINE] = {"digest": _write_engine_states(store, partial, client_state, frozen,
                                                    left_out)}
    for q in range(size):
        os.remove(os.path.join(partial, f"rank{q}.json"))
    _write_meta(store, partial, params, files, left_out, world_size=size)
    _point("files_written")
    _publish(save_dir, tag, partial)
    if save_latest:
        _write_latest(save_dir, tag)


def _write_state(store, folder, client_state, left_out):
    """One process's checkpoint: its optimizer state, engine states and meta.json."""
    entries, size = _write_optimizer_states(store, os.path.join(folder, STATES))
    params = [dict(_param_meta(e), **entry) for e, entry in zip(store.table.trained, entries)]
    engine_digest = _write_engine_states(store, folder, client_state, None, left_out)
    _write_meta(store, folder, params,
                {STATES: {"bytes": size}, ENGINE: {"digest": engine_digest}}, left_out)


def _param_meta(e):
    return {"name": e.name, "shape": list(e.shape), "numel": e.numel, "steps": e.steps,
            "group_index": e.group_index}


def _write_optimizer_states(store, file):
    """Each parameter's optimizer state on this rank (its master weights, exp_avg, exp_avg_sq:
    e.shard floats each, its shard's across ranks) one after the other in `file`, synced; returns
    ([{"offset", "digests"} per parameter], the file's bytes)."""
    entries = []
    offset = 0
    sizes = [{"numel": e.shard} for e in store.table.trained]
    # Two buffers: a parameter's state is read from the optimizer (NVMe or host) and digested
    # while the one before is written by a thread of its own, which also syncs every 64 MiB so
    # that the disk's writeback runs beside the rest rather than all in the final sync.
    # (One buffer when the largest parameter's state is large: the host then holds it once.)
    first = _state_buffer(sizes)
    buffers = [first] if first.numel() * 4 > _DOUBLE_BUFFER_MAX else [first, _state_buffer(sizes)]
    pending = [None] * len(buffers)
    with open(file, "wb") as f, concurrent.futures.ThreadPoolExecutor(max_workers=1) as writer:
        unsynced = [0]

        def write(view):
            f.write(view)
            unsynced[0] += len(view)
            if unsynced[0] >= _SYNC_EVERY:
                f.flush()
                os.fdatasync(f.fileno())
                unsynced[0] = 0

        try:
            for i, e in enumerate(store.table.trained):
                slot = i % len(buffers)
                if pending[slot] is not None:
                    pending[slot].result()  # its buffer is free again (and a failure raised)
                n = e.shard
                flat = buffers[slot][:3 * n]
                tensors = [flat[k * n:(k + 1) * n] for k in range(len(_KINDS))]
                store.runtime.read_optimizer_state(e.gid, *tensors)
                digests = {kind: _digest(t) for kind, t in zip(_KINDS, tensors)}
                pending[slot] = writer.submit(write, memoryview(flat.numpy()).cast("B"))
                entries.append({"offset": offset, "digests": digests})
                offset += 3 * 4 * n
                _point("parameter_written")
        except BaseException:
            for future in pending:  # waited for, but the first failure is the one raised
                if future is not None:
                    future.exception()
            raise
        for future in pending:
            if future is not None:
                future.result()
        f.flush()
        os.fsync(f.fileno())
    return entries, offset


def _write_engine_states(store, folder, client_state, read, left_out):
    """engine_states.pt, synced; returns its digest. `read`: tensors of the module's rest read
    already (across ranks, the frozen partitions' gathered); `left_out`: names not saved."""
    scheduler = store.lr_scheduler.state_dict() if store.lr_scheduler is not None and \
        hasattr(store.lr_scheduler, "state_dict") else None
    aliases, extra = _module_rest(store, left_out)
    del aliases
    read = read or {}
    torch.save({"lr_scheduler": scheduler, "client_state": client_state,
                "module_extra": {n: read[n] if n in read else t.read()
                                 for n, t in extra.items()}},
               os.path.join(folder, ENGINE))
    with open(os.path.join(folder, ENGINE), "rb+") as f:
        os.fsync(f.fileno())
        return _file_digest(f)


def _file_digest(f):
    """The blake2b-128 of an open file, read a block at a time (not whole: a frozen base's
    weights may be most of engine_states.pt)."""
    return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def _accumulation_of(config, world_size):
    """The gradient_accumulation_steps a saved DeepSpeed config gave (its own key, or
    train_batch_size over the micro-batch and the ranks, or DeepSpeed's 1 where neither is
    given), or None where it cannot be told."""
    if not isinstance(config, dict):
        return None
    steps = config.get("gradient_accumulation_steps")
    if steps is None:
        total, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
        if total is None or micro is None:  # (DeepSpeed's: the micro-batch is the rest)
            return 1
        if not (isinstance(total, int) and isinstance(micro, int) and micro > 0 and
                total % (micro * world_size) == 0):
            return None
        steps = total // (micro * world_size)
    return steps if isinstance(steps, int) and steps > 0 else None


def _micro_steps_on_load(store, meta):
    """The loaded engine's micro-step count: the checkpoint's, where it accumulated as this engine
    does (a save inside a window resumes there); with another gradient_accumulation_steps the
    checkpoint's position is no position in this engine's windows: its first window starts
    afresh, as a loop with the new accumulation starts its windows where it resumes (said where
    the save was inside a window: that window's micro-batches are not made up)."""
    micro_steps, saved = meta["micro_steps"], meta.get("accumulation")
    if saved is None:  # (saved before the key)
        saved = _accumulation_of(meta.get("config"), meta.get("world_size", 1))
    accumulation = store.state.accumulation
    if saved is None or saved == accumulation:  # (not said: as saved)
        return micro_steps
    inside = micro_steps % saved
    if inside:
        store.notices.warn(
            f"load_checkpoint: the checkpoint was saved inside a gradient-accumulation window "
            f"(micro-batch {inside} of {saved}); this engine accumulates {accumulation}: its "
            "first window starts afresh with the micro-batches that follow")
    return micro_steps - micro_steps % accumulation


def _write_meta(store, folder, params, files, left_out, world_size=None):
    aliases, _ = _module_rest(store)
    meta = {
        "format": FORMAT, "version": VERSION, "digest": "xxh3-128 per tensor; blake2b-128 of "
                                                          f"{ENGINE}",
        "global_steps": store.state.global_steps, "skipped_steps": store.state.skipped_steps,
        "micro_steps": store.state.micro_steps,
        "accumulation": store.state.accumulation,
        "loss_scaler": store.scaler.state_dict(),
        "dtype": str(store.dtype).replace("torch.", ""),
        "optimizer": store.optimizer_kind,
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in store.optimizer.param_groups],
        "params": params,
        "aliases": aliases,
        "files": files,
        "config": store.config.source,
    }
    if world_size is not None:
        meta["world_size"] = world_size
    if left_out:  # (exclude_frozen_parameters: the model's own are kept on load)
        meta["frozen_excluded"] = sorted(left_out)
    meta["meta_digest"] = _meta_digest(meta)
    _write_file(os.path.join(folder, META), json.dumps(meta, indent=1).encode())


def _meta_digest(meta):
    """blake2b-128 of meta.json's content without this digest (keys sorted): the step counts, the
    loss scale and the learning rates it holds are checked as the tensors are."""
    body = {k: v for k, v in meta.items() if k != "meta_digest"}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


class _Rest:
    """A tensor of the module's state dict outside the optimizer: a buffer or a frozen parameter,
    held as a tensor or (a frozen parameter at stage 3) as a partition."""

    def __init__(self, store, value, frozen):
        self.store, self.value, self.frozen = store, value, frozen
        self.shape = torch.Size(frozen.shape) if frozen is not None else value.shape

    def read(self):
        """Its values on the CPU (a copy; a frozen partition's across ranks all-gathered: every
        rank reads it)."""
        if self.frozen is not None:
            return read_frozen(self.store.runtime, self.frozen, self.store.ranks)
        return self.value.detach().to("cpu").clone()

    def write(self, values):
        """Sets its values (converted to its dtype; a frozen partition across ranks keeps this
        rank's shard)."""
        if self.frozen is not None:
            write_frozen(self.store.runtime, self.frozen, values, self.store.ranks)
            return
        with torch.no_grad():
            self.value.copy_(values.to(device=self.value.device, dtype=self.value.dtype))


def _module_rest(store, left_out=()):
    """What the module's state dict holds besides the trainable parameters under their own names:
    (aliases: another name of a trainable parameter, a tied weight -> its name; the rest: frozen
    parameters and buffers by name, each a _Rest, but those `left_out` names)."""
    names = {id(e.param): e.name for e in store.table.trained}
    frozen = {id(e.param): e for e in store.table.frozen}
    aliases, rest = {}, {}
    for name, value in store.module.state_dict(keep_vars=True).items():
        own = names.get(id(value))
        if own is None:
            if name not in left_out:
                rest[name] = _Rest(store, value, frozen.get(id(value)))
        elif own != name:
            aliases[name] = own
    return aliases, rest


def _frozen_names(store):
    """The names of the module's state dict that are parameters not trained (one of no elements,
    which the engine leaves to torch, is kept: it costs nothing)."""
    frozen = {id(e.param) for e in store.table.frozen}
    return {name for name, value in store.module.state_dict(keep_vars=True).items()
            if isinstance(value, torch.nn.Parameter) and id(value) not in store.table.trained_by_id
            and (id(value) in frozen or value.numel())}


def _resolve(load_dir, tag):
    """The folder of `tag` (a save killed between renames left it aside), or None."""
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path
    aside = _replaced(load_dir, tag) if os.path.isdir(load_dir) else []
    return os.path.join(load_dir, aside[0]) if aside else None


def _read_meta(path):
    file = os.path.join(path, META)
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"load_checkpoint: {file} is missing: not a whole checkpoint") \
            from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"load_checkpoint: {file} cannot be read: {error}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or \
            meta.get("version") != VERSION:
        raise CheckpointError(f"load_checkpoint: {file} is not a {FORMAT} of version {VERSION}")
    if meta.get("meta_digest") != _meta_digest(meta):
        raise CheckpointError(f"load_checkpoint: {file} does not match its digest (meta_digest): "
                              "it was changed or damaged; nothing was changed")
    return meta


def _check_shapes(store, meta, file):
    ours = {e.name: list(e.shape) for e in store.table.trained}
    theirs = {p["name"]: p["shape"] for p in meta["params"]}
    problems = [f"missing: {n}" for n in ours if n not in theirs]
    problems += [f"unexpected: {n}" for n in theirs if n not in ours]
    problems += [f"{n}: shape {theirs[n]} in the checkpoint, {ours[n]} in the model"
                 for n in ours if n in theirs and theirs[n] != ours[n]]
    if problems:
        raise CheckpointError(f"load_checkpoint: {file} was written by a different model: "
                              + "; ".join(problems) + "; nothing was changed")


def _state_buffer(entries):
    """One buffer for the largest parameter's three tensors, read into for each in turn (a
    megabyte tensor made and freed per parameter is kept resident by glibc's heap in a process
    without a Runtime, zero_to_fp32's: measured +16 MiB for 32 MiB of weights)."""
    return torch.empty(3 * max((e["numel"] for e in entries), default=0), dtype=torch.float32)


def saved_world_size(meta):
    """How many ranks wrote the checkpoint (1: one process's, optimizer_states.bin)."""
    return meta.get("world_size", 1)


def _rank_file(rank):
    return f"optimizer_states.rank{rank}.bin"


def _pieces(meta, entry):
    """Where a parameter's state lies: ([(file, offset, digests) per saved rank], the elements of
    each piece). One process's checkpoint is one piece of all its elements."""
    if saved_world_size(meta) == 1:
        return [(STATES, entry["offset"], entry["digests"])], entry["numel"]
    return [(_rank_file(q), r["offset"], r["digests"]) for q, r in enumerate(entry["ranks"])], \
        entry["shard"]


def _read_into(f, tensor):
    """Reads into a contiguous CPU tensor's bytes until it is full or the file ends; the bytes
    read."""
    view = memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else \
        memoryview(b"")
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            break
        done += got
    return done


def _read_range(handles, meta, entry, lo, hi, out):
    """Elements [lo, hi) of a parameter's tensors (master, exp_avg, exp_avg_sq: as many as `out`
    has rows) into the rows of `out` (k x m, m >= hi - lo; the rest zeros: a shard's padding),
    from whichever saved pieces hold them (`handles`: open files by name): a checkpoint is read
    by any number of ranks, whatever number wrote it."""
    pieces, shard = _pieces(meta, entry)
    out.zero_()
    hi = min(hi, entry["numel"])
    for q, (name, offset, _) in enumerate(pieces):
        a, b = max(lo, q * shard), min(hi, (q + 1) * shard)
        if a >= b:
            continue
        f = handles[name]
        for k in range(out.shape[0]):
            f.seek(offset + 4 * (k * shard + a - q * shard))
            if _read_into(f, out[k, a - lo:b - lo]) != 4 * (b - a):
                raise CheckpointError(f"load_checkpoint: {f.name} ends inside {entry['name']}; "
                                      "nothing was changed")


def _files_for(meta, ranges):
    """The saved files holding elements of the given {name: (lo, hi)} (every file without)."""
    needed = set()
    for entry in meta["params"]:
        pieces, shard = _pieces(meta, entry)
        lo, hi = ranges.get(entry["name"], (0, entry["numel"]))
        for q, (name, _, _) in enumerate(pieces):
            if max(lo, q * shard) < min(hi, (q + 1) * shard, entry["numel"]):
                needed.add(name)
    return sorted(needed)


def _verify(path, meta, files=None):
    """The saved state files (`files`, default all) are whole and every tensor in them matches
    its digest; and engine_states.pt matches its own."""
    world = saved_world_size(meta)
    names = [STATES] if world == 1 else [_rank_file(q) for q in range(world)]
    if files is not None:
        names = [n for n in names if n in files]
    for name in names:
        states = os.path.join(path, name)
        if not os.path.isfile(states):
            raise CheckpointError(f"load_checkpoint: {states} is missing; nothing was changed")
        size = os.path.getsize(states)
        if size != meta["files"][name]["bytes"]:
            raise CheckpointError(f"load_checkpoint: {states} holds {size} bytes, "
                                  f"{meta['files'][name]['bytes']} were written; nothing was "
                                  "changed")
    buffer = torch.empty(3 * max((_pieces(meta, e)[1] for e in meta["params"]), default=0))
    for q, name in enumerate(names):
        states = os.path.join(path, name)
        with open(states, "rb") as f:
            for entry in meta["params"]:
                pieces, n = _pieces(meta, entry)
                _, offset, digests = next(p for p in pieces if p[0] == name)
                f.seek(offset)
                flat = buffer[:3 * n]
                if _read_into(f, flat) != 3 * 4 * n:
                    raise CheckpointError(f"load_checkpoint: {states} ends inside "
                                          f"{entry['name']}; nothing was changed")
                for k, kind in enumerate(_KINDS):
                    if _digest(flat[k * n:(k + 1) * n]) != digests[kind]:
                        raise CheckpointError(
                            f"load_checkpoint: {states}: {entry['name']} ({kind}) does not match "
                            "its digest: the file is damaged; nothing was changed")
    engine_file = os.path.join(path, ENGINE)
    try:
        with open(engine_file, "rb") as f:
            digest = _file_digest(f)
    except FileNotFoundError:
        raise CheckpointError(f"load_checkpoint: {engine_file} is missing; nothing was changed") \
            from None
    if digest != meta["files"][ENGINE]["digest"]:
        raise CheckpointError(f"load_checkpoint: {engine_file} does not match its digest: the "
                              "file is damaged; nothing was changed")


def load(store, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
         load_module_only=False):
    """Loads a checkpoint into the engine (see the module's docstring); returns (its folder,
    client_state), or (None, None) when `load_dir` has no ``latest`` and no tag is given (as
    DeepSpeed's, with a warning)."""
    # Between backward and step, the engine's or a loop's own (stages 0-1: .grad at a window's
    # end); not after a load that failed part way: the load that puts it right drops what is
    # pending, as a load in the middle of a window drops the window's sums.
    if store.step.staged is not None or store.step.half_loaded is None and (
            store.state.gradients_since_step or
            store.state.micro_steps % store.state.accumulation == 0 and
            any(e.param.grad is not None for e in store.table.trained)):
        raise RuntimeError(
            "load_checkpoint between backward and step: it would drop the gradients made since "
            "the last step (plain torch's optimizer.step() after a load steps the loaded weights "
            "with them); accepted: load after step(), or after zero_grad()")
    if store.ranks is not None:
        store.ranks.agree(_EVERY_RANK.format("load_checkpoint", "reads its shard"))
    checked = checked_everywhere(store, "load_checkpoint", lambda: _check_load(
        store, os.fspath(load_dir), tag, load_optimizer_states, load_lr_scheduler_states,
        load_module_only))
    if checked is None:
        return None, None
    return _apply_load(store, checked, load_module_only, load_optimizer_states)


def checked_everywhere(store, what, check):
    """check()'s result once it has passed on every rank (one process: once it has passed); a
    rank whose check failed raises its error, the others an error naming it: nothing changes on
    any rank."""
    failure = result = None
    try:
        result = check()
    except Exception as error:  # across ranks, told to the others first
        failure = error
    if store.ranks is not None:
        failed = store.ranks.failed_ranks(failure is None)
        if failed and failure is None:
            raise CheckpointError(
                f"{what}: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
                "could not load it (each says why); nothing was changed")
    if failure is not None:
        raise failure
    return result


def _check_load(store, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                load_module_only):
    """Everything load checks before it changes anything; None when there is no `latest` and no
    tag (said in a warning)."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            store.notices.warn(f"load_checkpoint: {latest} is missing and no tag was given: "
                               "nothing was loaded")
            return None
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    path = _resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"load_checkpoint: no checkpoint {tag!r} in {load_dir}")
    meta = _read_meta(path)
    _check_shapes(store, meta, os.path.join(path, META))
    # This rank's elements of each parameter: all of them, or its shard's across ranks.
    rank = store.ranks.rank if store.ranks is not None else 0
    ranges = {e.name: (rank * e.shard, rank * e.shard + e.shard) for e in store.table.trained}
    files = _files_for(meta, ranges)
    _verify(path, meta, files)
    # Mapped, not read whole: each rank reads the parts it keeps (a frozen base's shard).
    engine_states = torch.load(os.path.join(path, ENGINE), mmap=True)
    _, rest = _module_rest(store, set(meta.get("frozen_excluded", ())))
    saved_rest = engine_states["module_extra"]
    problems = [f"missing: {n}" for n in rest if n not in saved_rest]
    problems += [f"unexpected: {n}" for n in saved_rest if n not in rest]
    problems += [f"{n}: shape {list(saved_rest[n].shape)} in the checkpoint, "
                 f"{list(rest[n].shape)} in the model"
                 for n in rest if n in saved_rest and saved_rest[n].shape != rest[n].shape]
    if problems:
        raise CheckpointError(f"load_checkpoint: {os.path.join(path, ENGINE)} was written by a "
                              "different model (buffers and frozen parameters): "
                              + "; ".join(problems) + "; nothing was changed")
    by_name = {p["name"]: p for p in meta["params"]}
    scheduler_state = engine_states["lr_scheduler"]
    restore_scheduler = False
    if not load_module_only:
        _check_optimizer(store, meta, os.path.join(path, META))
        restore_scheduler = _check_scheduler(store, scheduler_state, load_lr_scheduler_states,
                                             os.path.join(path, ENGINE))
    return path, meta, ranges, files, engine_states, rest, by_name, restore_scheduler


@contextlib.contextmanager
def loading_optimizer_state(store, what, whole):
    """The optimizer state's load (Runtime.begin_load_optimizer_state .. commit or abort), as the
    body loads it. With strata.optimizer_commit "partition" each NVMe partition is written as it
    is loaded, so a load that fails part way leaves those: the engine then refuses to stage, step
    or save until a load of the `whole` state succeeds (store.step.half_loaded says why)."""
    store.runtime.begin_load_optimizer_state()
    try:
        yield
        store.runtime.commit_load_optimizer_state()
    except BaseException as error:
        store.runtime.abort_load_optimizer_state()
        if store.step.commit_each:  # what was written of the NVMe state stays
            store.step.half_loaded = (
                f"{what} failed part way ({error}); with strata.optimizer_commit \"partition\" "
                "the optimizer state it had written to NVMe stays, beside the rest of the old "
                "state: load a checkpoint (its optimizer state whole) again")
        raise
    if whole:
        store.step.half_loaded = None


def _apply_load(store, checked, load_module_only, load_optimizer_states):
    """The checked load applied (see load)."""
    path, meta, ranges, files, engine_states, rest, by_name, restore_scheduler = checked
    saved_rest = engine_states["module_extra"]
    module_only = load_module_only or not load_optimizer_states
    scheduler_state = engine_states["lr_scheduler"]
    # Checked: from here on the engine changes. Gradients summed before the load are dropped.
    store.gradients.end_step(failed=False)
    buffer = torch.empty(3 * max((e.shard for e in store.table.trained), default=0))
    handles = {}
    try:
        for name in files:
            handles[name] = open(os.path.join(path, name), "rb")

        def read(e):
            state = buffer[:3 * e.shard].view(3, e.shard)
            _read_range(handles, meta, by_name[e.name], *ranges[e.name], state)
            return state

        # The optimizer's state, all or none: the checkpoint's, or (module only) the current
        # moments under the checkpoint's master weights, so the next step goes on from them.
        with loading_optimizer_state(store, "a checkpoint's load",
                                     whole=not module_only):
            for e in store.table.trained:
                master, exp_avg, exp_avg_sq = read(e)
                if module_only:
                    _, exp_avg, exp_avg_sq = (torch.empty(e.shard) for _ in range(3))
                    store.runtime.read_optimizer_state(e.gid, _, exp_avg, exp_avg_sq)
                store.runtime.load_optimizer_state(e.gid, master, exp_avg, exp_avg_sq)
        gather = []  # across ranks: the unpartitioned parameters' shards, whole everywhere
        for e in store.table.trained:
            master = read(e)[0]
            if store.ranks is not None and not e.partitioned:
                gather.append((e, master.to(store.dtype, copy=True),
                               lambda whole, e=e: set_weights(store.runtime, e, whole)))
            else:
                set_weights(store.runtime, e, master)
        if gather:
            store.ranks.gather(gather)
    finally:
        for f in handles.values():
            f.close()
    for name, value in rest.items():
        value.write(saved_rest[name])
    if load_module_only:
        return path, engine_states["client_state"]
    if load_optimizer_states:
        for e in store.table.trained:
            e.steps = by_name[e.name]["steps"]
    store.state.global_steps = meta["global_steps"]
    store.state.skipped_steps = meta["skipped_steps"]
    store.state.micro_steps = _micro_steps_on_load(store, meta)
    if meta["dtype"] == str(store.dtype).replace("torch.", ""):
        store.scaler.load_state_dict(meta["loss_scaler"])
    else:
        store.notices.warn(f"load_checkpoint: the checkpoint trained in {meta['dtype']}, this "
                           f"engine in {str(store.dtype).replace('torch.', '')}: its loss scale "
                           "is not taken")
    for group, saved in zip(store.optimizer.param_groups, meta["param_groups"]):
        group.update(saved)
    if restore_scheduler:
        store.lr_scheduler.load_state_dict(scheduler_state)
    return path, engine_states["client_state"]


def _check_optimizer(store, meta, file):
    """The checkpoint's optimizer is the engine's, with as many param groups, the parameters in
    the same ones."""
    if meta["optimizer"] != store.optimizer_kind:
        raise CheckpointError(f"load_checkpoint: {file} holds the state of {meta['optimizer']}, "
                              f"this engine steps {store.optimizer_kind}: accepted: the same "
                              "optimizer (or load_module_only=True); nothing was changed")
    if len(meta["param_groups"]) != len(store.optimizer.param_groups):
        raise CheckpointError(f"load_checkpoint: {file} has {len(meta['param_groups'])} param "
                              f"groups, this engine {len(store.optimizer.param_groups)}; nothing "
                              "was changed")
    groups = {p["name"]: p["group_index"] for p in meta["params"]}
    moved = [e.name for e in store.table.trained if groups[e.name] != e.group_index]
    if moved:
        raise CheckpointError(f"load_checkpoint: {file} puts {', '.join(moved)} in other param "
                              "groups; nothing was changed")


def _check_scheduler(store, state, wanted, file):
    """Whether the scheduler's state is to be restored; a state the engine's scheduler refuses is
    found here, before anything changes."""
    if not wanted:
        return False
    scheduler = store.lr_scheduler
    if (scheduler is None) != (state is None):
        store.notices.warn(f"load_checkpoint: {file} has {'no' if state is None else 'a'} "
                           f"learning-rate scheduler state and this engine "
                           f"{'has' if state is None else 'has no'} scheduler: the schedule is "
                           "not restored")
        return False
    if scheduler is None:
        return False
    # (a copy tried first: its optimizer's parameters shared, not copied: stage 3's are
    # placeholders, which refuse .data, and the others' weights need no copy)
    trial = copy.deepcopy(scheduler, memo={id(p): p for group in store.optimizer.param_groups
                                          for p in group["params"]})
    try:
        trial.load_state_dict(state)
    except Exception as error:  # any scheduler's own check
        raise CheckpointError(f"load_checkpoint: {file}: the learning-rate scheduler's state "
                              f"does not fit this engine's {type(scheduler).__name__} ({error!r});"
                              " nothing was changed") from None
    return True
