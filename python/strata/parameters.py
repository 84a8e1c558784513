"""The engine's parameter table: what it keeps of each parameter it trains or lends (Param), in
the model's order, and the stage-3 partitions by parameter. The engine builds it once (strata/
engine.py: which parameters, their partitions and tiers) and hands it to its parts: the lending
(strata/lending.py), the gradients and the step read and write each entry's own fields (its
gradient's place, its staged step); the table itself does not change after the engine is built.

Thread safety: the engine's (one thread).
"""

import torch
from torch.utils.dlpack import from_dlpack

from strata import zero_init as init_module

__all__ = ["Param", "ParameterTable", "clear_grad", "data_of", "grad_of", "load_master",
           "read_frozen", "read_state", "set_data", "set_weights", "version_of", "write_frozen"]

_GET_DATA = torch._C.TensorBase.data.__get__
_SET_DATA = torch._C.TensorBase.data.__set__
_VERSION = torch._C.TensorBase._version.__get__
_GET_GRAD = torch._C.TensorBase.grad.__get__
_SET_GRAD = torch._C.TensorBase.grad.__set__
_RAW = torch._C._disabled_torch_function_impl  # (past strata/placeholders.py's dispatch)


def data_of(p):
    """p.data as torch's own gives it: past the property strata/edits.py sets on
    torch.nn.Parameter, which takes a read of .data for a write of the user's."""
    return _RAW(_GET_DATA, (), (p,), {})


def version_of(p):
    """p's version counter (torch's p._version), past strata/placeholders.py's dispatch."""
    return _RAW(_VERSION, (), (p,), {})


def grad_of(p):
    """p.grad, past strata/placeholders.py's dispatch (the gradient hooks' read, each parameter
    each backward)."""
    return _RAW(_GET_GRAD, (), (p,), {})


def clear_grad(p):
    """p.grad = None, past strata/placeholders.py's dispatch."""
    _RAW(_SET_GRAD, (), (p, None), {})


def set_data(p, value):
    """p.data = value as torch's own sets it: past the property strata/edits.py sets on
    torch.nn.Parameter, which refuses it for a partitioned parameter (the engine's lending
    sets them)."""
    _RAW(_SET_DATA, (), (p, value), {})


class Param:
    """What the engine keeps of one trainable parameter."""

    __slots__ = ("name", "param", "shape", "numel", "shard", "pid", "gid", "partitioned", "group",
                 "has_grad", "host_grad", "group_index", "steps", "sent_down", "staged",
                 "shard_grad", "frozen", "pinned_grad", "incoming", "pinned_weights", "grad_norm",
                 "grad_made_in")

    def __init__(self, name, param, pid, shard=None, frozen=False):
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        # Elements of its optimizer state (and, partitioned, of its partitions) on this rank: all
        # of them, or across ranks its shard's (strata/ranks.py).
        self.shard = self.numel if shard is None else shard
        self.shard_grad = None  # across ranks: this rank's shard of the mean gradient (fp32)
        self.pid = pid  # the parameter's partition (stage 3, large parameters): even
        self.gid = pid + 1  # its gradient's partition and its optimizer state
        self.partitioned = False
        self.group = 0
        self.has_grad = False
        self.host_grad = None  # stage 2: the fp32 sum of the micro-batches' gradients
        # On a GPU: host_grad's pinned memory, kept from step to step, and a later micro-batch's
        # gradient on its way to the host (pinned too) to be added to it.
        self.pinned_grad = None
        self.incoming = None
        self.pinned_weights = None  # on a GPU: where the step writes its new weights
        self.group_index = 0  # which optimizer param group
        self.steps = 0  # optimizer steps taken with a gradient (Adam's t, as torch's per tensor)
        self.sent_down = False  # GradientReady told for this step's gradient
        self.staged = None  # (lr, param copy target) once its step is staged (_Staged)
        # Its gradient's 2-norm (fp32, a tensor where the gradient was: on a GPU, not waited
        # for), taken in the gradient hook when that gradient is the window's whole one (one
        # micro-batch a step, one process, its first in the window): _grad_norm reads it instead
        # of the gradient's host copy. None otherwise.
        self.grad_norm = None
        # The backward (autograd's graph task) whose gradient hook ran for it last: nothing of
        # that backward needs its values again (the lending lends it no more there).
        self.grad_made_in = None
        # A frozen parameter partitioned at stage 3: lent around its modules as any other, with no
        # gradient, no optimizer state (gid unused), never written back.
        self.frozen = frozen

    def gradient_held(self):
        """The engine holds a gradient of it outside .grad (its partition's, its host sum, its
        shard of the mean across ranks)."""
        return self.has_grad or self.host_grad is not None or self.shard_grad is not None

    def kept_gradient(self, across_ranks):
        """Where its gradient summed since the last step is kept now (as made: the loss scale
        in), as (where, tensor): ("partition", None), its gradient partition in the Runtime's
        tiers; across ranks ("shard", shard_grad), this rank's shard of the mean (a sum not yet
        reduced is not it: Gradients.unreduced_here); ("host", host_grad), its host sum;
        ("grad", .grad), torch's; or None where there is none."""
        if self.partitioned:
            return ("partition", None) if self.has_grad else None
        if across_ranks:
            return None if self.shard_grad is None else ("shard", self.shard_grad)
        if self.host_grad is not None:
            return "host", self.host_grad
        grad = self.param.grad
        return None if grad is None else ("grad", grad)


class ParameterTable:
    """The engine's parameters: `trained`, the entries of the parameters the optimizer steps (the
    model's order), `frozen`, those of the stage-3 partitions it does not train, and
    `placeholder`, the empty tensor a partitioned parameter's .data is while it is not lent (on
    the compute device, in the training dtype: swapping .data never changes a parameter's device
    or dtype)."""

    def __init__(self, trained, frozen, placeholder, next_id=0):
        self.trained = trained
        self.trained_by_id = {id(e.param): e for e in trained}  # id(parameter) -> its entry
        self.frozen = frozen
        self.placeholder = placeholder
        self.next_id = next_id  # the first partition id no entry uses
        self.partitioned_by_id = {}  # id(parameter) -> its entry, once placed (placed())

    @classmethod
    def from_model(cls, model, named, stage, threshold, ranks, built, placeholder):
        """The table of `model`: an entry for each of `named` ((name, parameter) pairs, the
        parameters the optimizer trains), and at stage 3 for each other parameter of at least
        `threshold` elements or built under strata.init (`built`: what built it, or None).
        Across `ranks` each trained entry holds this rank's shard."""
        trained = []
        # Ids: a parameter built under strata.init keeps its partition's; the others take pairs
        # after every id in use.
        next_id = built.next_id if built is not None else 0
        for name, p in named:
            pid = init_module.partition_of(p)
            if pid is None:
                pid, next_id = next_id, next_id + 2
            trained.append(Param(name, p, pid, None if ranks is None
                                 else ranks.shard_elements(p.numel())))
        # The parameters not trained (requires_grad False, or left out of model_parameters): at
        # stage 3 the large ones (and any built under strata.init) are partitions too.
        frozen = []
        trained_ids = {id(p) for _, p in named}
        for name, p in model.named_parameters():
            if id(p) in trained_ids or stage != 3:
                continue
            pid = init_module.partition_of(p)
            if pid is None and p.numel() < threshold:
                continue
            if pid is None:
                pid, next_id = next_id, next_id + 2
            # (across ranks its partition holds this rank's shard, as a trained one's)
            frozen.append(Param(name, p, pid, None if ranks is None
                                else ranks.shard_elements(p.numel()), frozen=True))
        return cls(trained, frozen, placeholder, next_id)

    def placed(self):
        """The entries' partitions are decided (the engine's _place_parameters): indexed."""
        self.partitioned_by_id = {id(e.param): e for e in self.entries() if e.partitioned}

    def entries(self):
        """Every entry: the trained ones, then the frozen ones."""
        return self.trained + self.frozen

    def partitioned(self):
        """The entries of the partitioned parameters (stage 3's), trained and frozen."""
        return list(self.partitioned_by_id.values())

    def lent_bytes(self):
        """Bytes of the device tier that partitioned parameters lent now hold (their .data not the
        placeholder): their partitions', each its shard across ranks (the weights gathered whole
        from the shards are torch's tensors, outside the tier)."""
        return sum(e.shard * e.param.element_size() for e in self.partitioned_by_id.values()
                   if data_of(e.param).numel())

    def leave_unlent(self):
        """Every partitioned parameter's .data the placeholder (nothing lent)."""
        for e in self.partitioned_by_id.values():
            set_data(e.param, self.placeholder)


def set_weights(runtime, e, master):
    """e's weights made its master weights (fp32, flat) in the training dtype: a partitioned
    parameter's in its partition (through `runtime`), another's in the tensor."""
    with torch.no_grad():
        if e.partitioned:
            copy = from_dlpack(runtime.acquire(e.pid, "host", traced=False))
            try:
                copy.copy_(master)  # converted as it is copied, no temporary
            finally:
                del copy
                runtime.release(e.pid, "host", True, traced=False)
        else:
            data_of(e.param).copy_(master.view(e.shape).to(device=e.param.device,
                                                       dtype=e.param.dtype))


def read_state(runtime, e):
    """This rank's shard of trained entry e's optimizer state: [fp32 master weights, first
    moment, second moment], e.shard elements each (a moment the optimizer does not keep reads as
    zeros)."""
    state = [torch.empty(e.shard) for _ in range(3)]
    runtime.read_optimizer_state(e.gid, *state)
    return state


def load_master(runtime, e, master):
    """e's master weights (this rank's shard, fp32) replaced by `master`, its moments kept, as
    torch's optimizer keeps its state when the weights are loaded. Inside a load of the
    optimizer's state (checkpoints.loading_optimizer_state)."""
    _, first, second = read_state(runtime, e)
    runtime.load_optimizer_state(e.gid, master, first, second)


def read_frozen(runtime, e, ranks=None):
    """A frozen partitioned parameter's weights whole, on the CPU (its partition's host copy,
    copied; across `ranks` every rank's shard, all-gathered: every rank must call this)."""
    held = from_dlpack(runtime.acquire(e.pid, "host", traced=False))
    try:
        if ranks is None:
            return held.view(e.shape).clone()
        whole = []
        ranks.gather([(e, held, whole.append)])
        return whole[0].to("cpu", copy=True).view(e.shape)
    finally:
        del held
        runtime.release(e.pid, "host", False, traced=False)


def write_frozen(runtime, e, values, ranks=None):
    """Sets a frozen partitioned parameter's weights (`values` whole, converted to the training
    dtype; across `ranks` this rank's shard of them)."""
    values = values.reshape(-1)
    if ranks is not None:
        values = ranks.own_shard(values, e.shard)
    held = from_dlpack(runtime.acquire(e.pid, "host", traced=False))
    try:
        with torch.no_grad():
            held.copy_(values)
    finally:
        del held
        runtime.release(e.pid, "host", True, traced=False)
