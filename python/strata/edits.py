"""Weights edited in place between steps, taken as plain torch takes them.

Plain torch steps the weights as they are: one edited between steps (clamped, masked by a
pruning mask, a row zeroed, re-initialized, renormed by nn.Embedding's max_norm; through .data or
under torch.no_grad()) is stepped from its edited values. The engine steps its fp32 master
weights and writes the module's weights anew from them, which would undo such an edit silently.

`Edits` watches the parameters the engine keeps whole in the module (stages 0-2; stage 3's under
the persistence threshold). One written in place since the engine last wrote it (its version
counter moved, its tensor was replaced, or its .data was handed out: torch's version counter does
not see writes through .data; while another tensor holds its storage, a .data tensor kept or the
tensor given as its .data, it stays watched)
is compared, at the next forward (before backward, whose staged steps read the master weights)
or step, with its master weights rounded to its dtype, and the elements that differ are taken
into the master weights, the moments kept (as torch's optimizer keeps its state). Only those
parameters are read: a loop that edits nothing pays a look at each parameter's version.
A tensor that holds a weight's storage from before the engine was made (a .data tensor kept, a
buffer the weights are views of) keeps it watched from the start: its writes are taken, and the
weight is compared at every forward. Not seen: across ranks, an edit made on some ranks only
(each rank takes the changes of its own shard: the weights become a mix, where DDP's ranks would
part ways).

Stage 3's partitioned parameters are placeholders outside their modules' forward and backward:
a read of one's .data there would see no values and a write into it would be lost, and a tensor
set as its .data would be dropped at the next forward, so both are refused by name (read or edit
them within strata.GatheredParameters, or load them with module.load_state_dict). A write in
place into one (its version counter moved: into its placeholder between steps, or into the copy
lent to its forward, as nn.Embedding(max_norm=...)'s renorm writes) is lost with the copy: it is
refused by name at the next forward or step (a write through .data inside its forward is not
seen). Their placeholders' other reads and writes are refused by strata/placeholders.py.

`.data` is watched through a property set on torch.nn.Parameter once, when the first engine is
made: for any other parameter it is torch's own.

Thread safety: the engine's (one thread); the .data property may run in any thread (it sets a
flag).
"""

import weakref

import torch

from strata import checkpoints, placeholders
from strata.parameters import data_of, read_state, set_data, version_of
from strata.placeholders import PARTITIONED, partitioned_name

__all__ = ["Edits"]

# On a watched parameter (in its __dict__): whether its .data was handed out since the engine
# last wrote it.
_TAKEN = "_strata_data_taken"
# On a partitioned parameter lent whole to a GatheredParameters block: whether the block
# modifies (p.data = t is taken then), and whether its .data was handed out in the block.
_BLOCK = "_strata_block"


def _get_data(p):
    d = p.__dict__
    data = data_of(p)
    if _TAKEN in d:
        d[_TAKEN] = True
    if _BLOCK in d:
        d[_BLOCK] = (d[_BLOCK][0], True)
    if PARTITIONED in d and data.numel() == 0 and partitioned_name(p) is not None:
        if placeholders.lent_in_forward(p):  # (within the model's forward, as a torch function)
            return data_of(p)
        raise RuntimeError(
            f"{partitioned_name(p)}.data at ZeRO stage 3 outside its module's forward: its weights "
            "are the engine's partitions, and the parameter holds a placeholder without them "
            "(a read would see no values, a write would be lost); accepted: within "
            "strata.GatheredParameters([param]) (with modifier_rank=0 what the block writes "
            "becomes the weights and master weights), or engine.module_state_dict() to read "
            "them; a change of its shape (a model's resize_token_embeddings) before "
            "strata.initialize")
    if PARTITIONED in d and placeholders.left_by_closed(p):
        raise RuntimeError(f"{d[PARTITIONED][0]}.data: {placeholders.PLACEHOLDERS_LEFT}")
    return data


def _set_data(p, value):
    d = p.__dict__
    # (a move of its placeholder goes on)
    if PARTITIONED in d and value.numel() != 0 and partitioned_name(p) is not None and \
            not d.get(_BLOCK, (False,))[0]:  # (a modifying block takes it)
        raise RuntimeError(
            f"{partitioned_name(p)}.data = tensor at ZeRO stage 3: its weights are the engine's "
            "partitions (the parameter holds a placeholder outside its module's forward, a copy "
            "lent within it), and the tensor would be dropped at the next forward; accepted: "
            "module.load_state_dict({name: tensor}, strict=False) between steps (the weights "
            "and master weights replaced, the moments kept), or an edit within "
            "strata.GatheredParameters([param], modifier_rank=0)")
    set_data(p, value)
    if PARTITIONED in d and d[PARTITIONED][1] is None:  # (a closed engine's: given its weights)
        placeholders.unguard([p], closed=True)
    if _TAKEN in d:
        d[_TAKEN] = True


def _shared(p):
    """Whether another tensor holds p's storage (a .data tensor kept, the tensor given as its .data,
    a vector it is a view of): writes through it would not move p's version counter. (2: p's
    own tensor, and the storage object this asks through.)"""
    return torch._C._storage_Use_Count(data_of(p).untyped_storage()._cdata) > 2


def _unmark(params):
    """The marks the watch set on `params` taken off (its engine closed, or dropped)."""
    placeholders.unguard(params)
    for p in params:
        for mark in (_TAKEN, _BLOCK):
            p.__dict__.pop(mark, None)


def _install():
    if not isinstance(torch.nn.Parameter.__dict__.get("data"), property):
        torch.nn.Parameter.data = property(_get_data, _set_data,
                                           doc=torch._C.TensorBase.data.__doc__)


class Edits:
    """The watch over `entries` (the engine's parameters' entries: the trained ones kept whole
    are watched, the partitioned ones' placeholders guarded). See the module's docstring."""

    def __init__(self, entries, ranks=None):
        _install()
        self.ranks = ranks  # (strata/ranks.py: each rank takes its own shard's edits)
        self._lent_whole = {}  # id(entry): its copy lent to a block that does not modify
        self.entries = [e for e in entries if not e.partitioned]
        self.partitioned = [e for e in entries if e.partitioned]
        for e in self.entries:
            e.param.__dict__[_TAKEN] = False
        for e in self.partitioned:  # (an engine dropped without close() leaves none refused)
            placeholders.guard(e.param, e.name, e.shape, weakref.ref(self), e.frozen)
        # (an engine dropped without close() leaves its parameters unmarked too)
        self._unmark = weakref.finalize(self, _unmark,
                                        [e.param for e in self.entries + self.partitioned])
        self._marks = []
        self._behind = set()  # id(entry): its master weights ahead of its weights (behind())
        self.written()
        self._versions = {}  # id(partitioned entry): its version counter the engine knows
        self.settled(self.partitioned)

    def written(self, entries=None):
        """The engine has written the weights of `entries` (all of them: its step) or taken them
        (take): what they hold now is its own, unless another tensor holds their storage (it
        may be written through later: they stay taken)."""
        marks = dict(zip(map(id, self.entries), self._marks))
        if entries is None:
            self._behind.clear()
        for e in self.entries if entries is None else entries:
            e.param.__dict__[_TAKEN] = _shared(e.param)
            marks[id(e)] = (version_of(e.param), e.param.data_ptr())
        self._marks = [marks[id(e)] for e in self.entries]

    def edited(self):
        """The entries whose weights may have been written since written()."""
        return [e for e, (version, address) in zip(self.entries, self._marks)
                if (e.param.__dict__.get(_TAKEN) or version_of(e.param) != version
                    or e.param.data_ptr() != address) and id(e) not in self._behind]

    def behind(self, e):
        """Kept-whole entry `e`'s master weights were set ahead of its weights (across ranks,
        this rank's shard: safe_set_local_fp32_param), which follow at the next step: until
        then its weights are not compared with them (their old values would be taken back;
        an edit of them meanwhile is undone by the step, as DeepSpeed's)."""
        self._behind.add(id(e))

    def take(self, entries, runtime, store):
        """The elements of `entries`' weights (edited()) that differ from their master weights
        rounded to the weights' dtype taken as master weights (across ranks, this rank's shard
        of them), the moments kept. Returns the names of the parameters taken. No step may be in
        flight (the master weights are read and loaded)."""
        for e in entries:
            if tuple(e.param.shape) != e.shape:
                raise ValueError(
                    f"{e.name} was replaced between steps by a tensor of shape "
                    f"{tuple(e.param.shape)} (p.data = ...); the engine trains it as "
                    f"{e.shape}; accepted: a tensor of its own shape, or a new engine over "
                    "the resized model")
        taken = []
        for e in entries:
            master, first, second = read_state(runtime, e)
            weights = e.param.detach().reshape(-1).to("cpu", torch.float32)
            if self.ranks is not None:
                weights = self.ranks.own_shard(weights, e.shard)
            rounded = master.to(e.param.dtype).to(torch.float32)
            differs = (weights != rounded) & ~(weights.isnan() & rounded.isnan())
            if bool(differs.any()):
                master[differs] = weights[differs]
                taken.append((e, master, first, second))
        if taken:
            with checkpoints.loading_optimizer_state(
                    store, "taking the weights edited between steps", whole=False):
                for e, master, first, second in taken:
                    runtime.load_optimizer_state(e.gid, master, first, second)
        self.written(entries)
        return [e.name for e, *_ in taken]

    def settled(self, entries):
        """The partitioned `entries`' parameters were written by the engine (a GatheredParameters
        block's writes, taken): their version counters now are the engine's."""
        for e in entries:
            self._versions[id(e)] = version_of(e.param)

    def lend_whole(self, e, modify):
        """Partitioned entry `e` is lent whole to a GatheredParameters block (`modify`: with
        modifier_rank); its copy is kept to compare with at the block's end (in one process,
        for a block that does not modify)."""
        e.param.__dict__[_BLOCK] = (modify, False)
        self._lent_whole[id(e)] = None if modify or self.ranks else data_of(e.param).clone()

    def in_block(self, e):
        """Whether partitioned entry `e` is lent whole to a GatheredParameters block now."""
        return _BLOCK in e.param.__dict__

    def relent(self, e):
        """A block nested in the one that lent partitioned entry `e` whole wrote it back: what
        it holds now is what the enclosing block compares with at its end."""
        modify, _ = e.param.__dict__[_BLOCK]
        e.param.__dict__[_BLOCK] = (modify, False)
        if self._lent_whole.get(id(e)) is not None:
            self._lent_whole[id(e)] = data_of(e.param).clone()
        self._versions[id(e)] = version_of(e.param)

    def written_whole(self, e):
        """Whether the block that lent partitioned entry `e` whole wrote it: in place (its version
        counter moved), or through its .data (in one process: its values differ from the copy
        lent; across ranks a write through .data is not seen). (end_block ends the watch.)"""
        _, data_taken = e.param.__dict__.get(_BLOCK, (True, False))
        lent = self._lent_whole.get(id(e))
        if version_of(e.param) != self._versions.get(id(e)):
            return True
        return data_taken and lent is not None and not torch.equal(data_of(e.param), lent)

    def end_block(self, e):
        """The block that lent partitioned entry `e` whole has ended (a modifying one too: a
        block after it is not nested in it)."""
        e.param.__dict__.pop(_BLOCK, None)
        self._lent_whole.pop(id(e), None)

    def lost_writes(self):
        """Refused: a partitioned parameter written in place since the engine last knew it (into
        its placeholder, or the copy lent to its forward): the write was lost with it."""
        lost = [e for e in self.partitioned if version_of(e.param) != self._versions.get(id(e))]
        if not lost:
            return
        self.settled(lost)  # (said once)
        names = ", ".join(e.name for e in lost[:3]) + (" and more" if len(lost) > 3 else "")
        raise RuntimeError(
            f"{names} written in place at ZeRO stage 3 outside the engine (a write into its "
            "placeholder between steps, or into the copy lent to its module's forward, as "
            "nn.Embedding(max_norm=...)'s renorm does): the write was lost with that copy; "
            "accepted: the edit within strata.GatheredParameters([param], modifier_rank=0), "
            "or stage3_param_persistence_threshold above its elements "
            f"({lost[0].numel}: kept whole, its edits are taken at the next step), or stage 2")

    def forget(self):
        """The engine closed: its parameters are no longer watched."""
        self._unmark()
        self.entries, self.partitioned, self._marks = [], [], []
