"""Building a model without materializing it, as DeepSpeed's zero.Init:

    with strata.init(config=ds_config):
        model = MyModel()                  # each large parameter a partition as it is made
    engine, optimizer, _, _ = strata.initialize(model=model, config=ds_config)
    engine.load_pretrained("pytorch_model.bin.index.json")

Inside the context every nn.Module's ``__init__`` is followed by a step that turns the module's
own parameters of at least stage3_param_persistence_threshold elements (trainable or frozen: the
engine lends a frozen one as any other and never writes it back) into strata partitions
(in the training dtype, in the tier offload_param names: device, host or NVMe) and leaves each
parameter an empty placeholder of its shape. A submodule's parameters are partitioned as soon as
the submodule is built (when its outermost ``__init__`` returns, so a subclass may set them after
``super().__init__()``), so the host memory building needs is about the largest module's own
parameters, not the model's. A `transformers` model's own initialization, which runs after every
module was built (``post_init``: ``_initialize_weights`` on each module, a parent's reaching into
its children's parameters), writes the partitions: while it runs for one module, each
partitioned parameter a torch function is given is lent whole, as an fp32 copy of its partition
(so that bf16 training draws the values a plain fp32 build does, then rounds them), and written
back when that module's initialization returns (so the host memory it needs is what one module's
initialization touches; across ranks the parameter is lent as zeros and rank 0's result is
kept). Other code that writes parameters after they were built does not reach the partitions:
load the pretrained weights (engine.load_pretrained), as fine-tuning does, or build without the
context. The context makes the Runtime (from the config's zero_optimization
and strata blocks) that ``strata.initialize`` then adopts, with the partitions as the parameters;
initialize refuses a config whose blocks differ. Small parameters stay ordinary tensors.

Only ZeRO stage 3 partitions (``enabled=False``, or another stage, builds normally). Launched as
several ranks, every parameter takes rank 0's values as it is built and each rank's partition
holds only its shard (strata/ranks.py). A parameter's
partition holds its initializer's values in the training dtype (the optimizer's fp32 master
weights start from them, or from load_pretrained). A parameter replaced while the model is built
(a tied weight: ``self.head.weight = self.emb.weight``) gives its partition back as the old
parameter goes; until then both are held, so the tier must have room for the two at that moment.
Parameters made on the meta device are left as they are (built so, they have no values to
partition; strata.initialize then cannot place them).

Thread safety: one context at a time per process (it patches nn.Module classes while open).
"""

import functools
import sys
import weakref

import torch
from torch.utils import _pytree
from torch.utils.dlpack import from_dlpack

from strata import ranks as ranks_module
from strata.config import TORCH_DTYPES, TrainConfig
from strata.runtime_settings import RuntimeSettings, make_runtime

__all__ = ["init", "built_under", "partition_of"]

_DTYPE_NAMES = TORCH_DTYPES
_open = []  # the context open now (at most one)


def _forget(context_ref, pid):
    """A partitioned parameter is gone: its partition is unregistered (quietly when the Runtime
    has already let it go, or is gone itself)."""
    context = context_ref()
    runtime = getattr(context, "runtime", None) if context is not None else None
    if runtime is None:
        return
    try:
        runtime.unregister(pid)
    except Exception:  # noqa: BLE001 - a finalizer must not raise; nothing is left to free
        pass


def partition_of(param):
    """The partition id a parameter was given by strata.init, or None."""
    made = getattr(param, "_strata_init", None)
    return made[1] if made is not None else None


def reshaped(model):
    """(name, its partition's shape, its shape now) of each parameter built under strata.init
    whose shape changed since (resize_token_embeddings after the build reads the placeholder's
    zeros and gives the parameter a size its partition does not have)."""
    return [(name, p._strata_init[2], tuple(p.shape)) for name, p in model.named_parameters()
            if getattr(p, "_strata_init", None) is not None and
            tuple(p.shape) != p._strata_init[2]]


def built_under(model):
    """The strata.init a model's parameters were partitioned by (None: none). Parameters of two
    contexts in one model are refused."""
    found = {id(p._strata_init[0]): p._strata_init[0] for p in model.parameters()
             if getattr(p, "_strata_init", None) is not None}
    if len(found) > 1:
        raise ValueError("strata.initialize: the model's parameters were built under different "
                         "strata.init contexts; accepted: one")
    return next(iter(found.values()), None)


class init:  # noqa: N801 (a context, named as DeepSpeed's zero.Init is used)
    """The context (see the module's docstring). `config`: the DeepSpeed config (a dict or a JSON
    path) the engine will be made with."""

    def __init__(self, config, enabled=True):
        raw = TrainConfig.load(config)
        # Across ranks (a launched job): each parameter is rank 0's, and each rank's tiers hold
        # only its shard (strata/ranks.py).
        self.ranks = ranks_module.join(raw)
        parsed = TrainConfig.parse(raw, world_size=self.ranks.size if self.ranks else 1)
        self.settings = RuntimeSettings(parsed)
        self.enabled = enabled and self.settings.stage == 3
        self.dtype = _DTYPE_NAMES[parsed.dtype]
        if self.ranks is not None:  # a rank that cannot go on is named on every rank
            ranks_module.agree_on_setup(self.ranks,
                                        ranks_module.setup_of(self.settings, self.dtype))
        self.runtime = None
        self.next_id = 0  # partition ids: a parameter's even, its gradient's the odd one after
        self.warnings = list(self.settings.warnings)
        self._patched = []
        self._building = set()  # modules whose __init__ runs now
        self._adopted = None  # the engine's warning callback, once adopted

    def __enter__(self):
        if _open:
            raise RuntimeError("strata.init: a context is open already; accepted: one at a time")
        if not self.enabled:
            return self
        if self.runtime is None:
            # The Runtime's warnings are kept until an engine adopts it, then told to the engine
            # (the callback holds the context weakly: the Runtime must not keep it alive).
            context = weakref.ref(self)
            self.runtime, stale = make_runtime(
                self.settings, lambda w: context() is not None and context()._tell(w))
            if stale:
                self.warnings.append(stale)
        _open.append(self)
        self._patch()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._unpatch()
            _open.remove(self)
        return False

    def adopt(self, on_warning):
        """The Runtime, for the engine (once): its warnings go to `on_warning` from now on."""
        if self._adopted is not None:
            raise ValueError("strata.initialize: a model built under this strata.init has an "
                             "engine already")
        self._adopted = on_warning
        for message in self.warnings:
            on_warning(message)
        return self.runtime

    def release(self):
        """The engine that adopted the Runtime is closed: the context lets it go too (its
        parameters' partitions go with it)."""
        self.runtime = None

    def _tell(self, message):
        if self._adopted is not None:
            self._adopted(message)
        else:
            self.warnings.append(message)

    # --- the patch -------------------------------------------------------------------------------

    def _patch(self):
        """Every nn.Module class's own __init__ is followed by _partition_module; classes made
        while the context is open too (__init_subclass__)."""
        classes, stack = [], [torch.nn.Module]
        while stack:
            cls = stack.pop()
            classes.append(cls)
            stack.extend(cls.__subclasses__())
        for cls in classes:
            self._wrap(cls)
        context = weakref.ref(self)
        original = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            if original is not None:
                original.__func__(cls, **kwargs)
            if context() is not None:
                context()._wrap(cls)
                if _is_pretrained_model_base(cls):  # transformers' modeling code loaded now
                    context()._wrap_initialization(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._patched.append((torch.nn.Module, "__init_subclass__", original))
        # transformers' post_init writes the partitions (_LentForInit): its PreTrainedModel now
        # when its modeling code is loaded, else as the class is made (init_subclass above:
        # transformers loads it on a model class's first use, which may be inside the context).
        modeling = sys.modules.get("transformers.modeling_utils")
        if modeling is not None:
            self._wrap_initialization(modeling.PreTrainedModel)

    def _wrap_initialization(self, cls):
        original = cls.__dict__["_initialize_weights"]
        context = self

        @functools.wraps(original)
        def wrapped(model, module, *args, **kwargs):
            lending = _LentForInit(context)
            try:
                with lending:
                    return original(model, module, *args, **kwargs)
            finally:
                lending.give_back()

        cls._initialize_weights = wrapped
        self._patched.append((cls, "_initialize_weights", original))

    def _wrap(self, cls):
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_strata_wrapped", False):
            return
        context = self

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            # Partitioned when the module's outermost __init__ returns (a subclass that sets its
            # parameters after super().__init__() sets them first).
            outer = id(module) not in context._building
            if outer:
                context._building.add(id(module))
            try:
                original(module, *args, **kwargs)
            finally:
                if outer:
                    context._building.discard(id(module))
            if outer:
                context._partition_module(module)

        wrapped._strata_wrapped = True
        cls.__init__ = wrapped
        self._patched.append((cls, "__init__", original))

    def _unpatch(self):
        for cls, name, original in reversed(self._patched):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._patched.clear()

    def _placeholder(self, shape):
        """A partitioned parameter's data: its shape and dtype without its bytes (one element,
        expanded)."""
        return torch.zeros((), dtype=self.dtype).expand(shape)

    def _write_whole(self, pid, whole):
        """A parameter's new values (whole, in the training dtype) into its partition: across
        ranks rank 0's, this rank's shard of them."""
        flat = whole.reshape(-1)
        if self.ranks is not None:
            flat = flat.contiguous()
            self.ranks.broadcast_tensor(flat, "a parameter's initialization")
            flat = self.ranks.own_shard(flat, self.ranks.shard_elements(whole.numel()))
        held = from_dlpack(self.runtime.acquire(pid, "host", traced=False))
        try:
            held.copy_(flat)
        finally:
            del held
            self.runtime.release(pid, "host", True, traced=False)

    def _partition_module(self, module):
        dtype_name = {v: k for k, v in _DTYPE_NAMES.items()}[self.dtype]
        for p in module.__dict__.get("_parameters", {}).values():
            if p is None or partition_of(p) is not None or \
                    p.numel() < self.settings.threshold or p.device.type == "meta":
                continue
            pid, self.next_id = self.next_id, self.next_id + 2
            with torch.no_grad():
                initial = p.detach().to(device="cpu", dtype=self.dtype).reshape(-1).contiguous()
                if self.ranks is not None:
                    self.ranks.broadcast_tensor(initial, f"a {type(module).__name__}'s parameter")
                    initial = self.ranks.own_shard(initial, self.ranks.shard_elements(p.numel()))
                self.runtime.register(pid, "param", dtype_name, initial.numel(), 0,
                                      self.settings.param_tier, initial)
                del initial
                p.data = self._placeholder(p.shape)
            p._strata_init = (self, pid, tuple(p.shape))
            # A parameter replaced while the model is built (a tied weight: head.weight =
            # emb.weight) gives its partition back as it goes, not at the end of the run: it
            # held a place in its tier's budget, which the rest of the build may need.
            weakref.finalize(p, _forget, weakref.ref(self), pid)


def _is_pretrained_model_base(cls):
    """Whether `cls` is transformers' PreTrainedModel itself (whose _initialize_weights every
    model's post_init runs)."""
    return cls.__name__ == "PreTrainedModel" and cls.__module__ == "transformers.modeling_utils" \
        and "_initialize_weights" in cls.__dict__


class _LentForInit(torch.overrides.TorchFunctionMode):
    """While one module's initialization runs: each parameter of `context`'s partitions that a
    torch function is given (``init.normal_(module.weight)``, ``module.weight[0]``) is lent
    whole first, as an fp32 copy of its partition (across ranks a zeroed tensor); give_back()
    writes them into the partitions (in the training dtype) and restores the placeholders."""

    def __init__(self, context):
        super().__init__()
        self.context = context
        self.lent = {}  # id(param) -> (param, pid)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in _pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.nn.Parameter) and id(leaf) not in self.lent:
                made = getattr(leaf, "_strata_init", None)
                if made is not None and made[0] is self.context:
                    self._lend(leaf, made[1])
        return func(*args, **kwargs)

    def _lend(self, param, pid):
        """The parameter whole in fp32 (transformers' initializers draw in the tensor's dtype, and
        a bf16 draw is not a plain fp32 build's): its partition's values, or across ranks zeros
        (rank 0's result is kept)."""
        context = self.context
        if context.ranks is not None:
            whole = torch.zeros(param.shape, dtype=torch.float32)
        else:
            held = from_dlpack(context.runtime.acquire(pid, "host", traced=False))
            try:
                whole = held.view(param.shape).to(torch.float32, copy=True)
            finally:
                del held
                context.runtime.release(pid, "host", False, traced=False)
        param.data = whole
        self.lent[id(param)] = (param, pid)

    def give_back(self):
        error = None
        while self.lent:
            _, (param, pid) = self.lent.popitem()
            whole, param.data = param.data, self.context._placeholder(param.shape)
            try:  # (across ranks rank 0's values, this rank's shard)
                self.context._write_whole(pid, whole)
            except Exception as e:  # noqa: BLE001 - each is given back; the first error raised
                error = error or e
        if error is not None:
            raise error
