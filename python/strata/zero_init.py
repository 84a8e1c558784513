"""Building a model without materializing it, as DeepSpeed's zero.Init:

    with strata.init(config=ds_config):
        model = MyModel()                  # each large parameter a partition as it is made
    engine, optimizer, _, _ = strata.initialize(model=model, config=ds_config)
    engine.load_pretrained("pytorch_model.bin.index.json")

Inside the context every nn.Module's ``__init__`` is followed by a step that turns the module's own
parameters of at least stage3_param_persistence_threshold elements (trainable or frozen: the engine
lends a frozen one as any other and never writes it back) into strata partitions (in the training
dtype, in the tier offload_param names: device, host or NVMe) and leaves each parameter an empty
placeholder of its shape. A submodule's parameters are partitioned as soon as the submodule is
built (when its outermost ``__init__`` returns, so a subclass may set them after
``super().__init__()``), so the host memory building needs is about the largest module's own
parameters, not the model's, plus the parameters lent to code that touches them (below: a bound of
their own, outside the host budget). While the context is open, the partitions are the parameters'
values to any code that runs: each partitioned parameter a torch function is given
(``init.trunc_normal_(self.proj.weight)`` in a parent's ``__init__``, ``self.apply(init_fn)``,
``p.data.zero_()``, ``copy_``, a norm read for a log), or made into another parameter
(``nn.Parameter(p)``: parametrizations' ``original``), is lent whole, a copy of its partition in
the dtype it was built in (fp32 for a model built in fp32, whatever the training dtype; across
ranks all-gathered from the ranks' shards). It stays lent while the lent parameters hold at most
twice the largest one's bytes (at least 64 MiB), so that an initializer of several calls runs in
fp32 throughout, as a plain build's does, and a weight an initializer draws anew (normal_,
trunc_normal_, then scaled) starts bf16 training from the plain fp32 values rounded once (one
edited after its module was built without being drawn anew, a parent's mul_, starts from its
partition's bf16 values); the least recently used one (no view of it alive, not held by a
GatheredParameters block) is given back to make room, and every one when the context closes (or
strata.initialize adopts its Runtime): written into its partition (across ranks rank 0's values) if
it may have been written, its placeholder restored. A value computed from a weight after its module
was built reads its partition's values (in bf16 training, rounded to bf16). Calls that read no
values (its shape, dtype, numel) lend nothing. ``copy.deepcopy`` of a partitioned parameter
(torch's ``nn.TransformerEncoder`` clones its layer so) is, while a module is built in the context,
a new partition holding its values; otherwise, until an engine adopts the Runtime, a plain
parameter holding them (a model copied whole: a reference, a teacher); while an engine trains it,
refused by name. After the context closes, the partitions are no longer lent to torch functions: a
parameter read then is its placeholder, whose one element is NaN (a norm, a forward give NaN, not
DeepSpeed's plausible empty tensors); values given to it (``p.data = t`` of its shape,
``load_state_dict``: lent for it) are written into its partition, as plain torch trains them; a
conversion (``model.to(device or dtype)``, ``.bfloat16()``, ``.half()``) converts the placeholder
without making it whole (a model built bigger than the host stays unmaterialized), and its
partition is lent in the new dtype from then on (rounded to it where it is narrower, as plain torch
rounds every weight; with torch.__future__'s overwrite or swap of parameters on conversion, refused
by name); a write in place into it (``fill_``, ``zero_``) is refused by name at strata.initialize
(other in-place ops raise torch's error on the placeholder), and so is a parameter or buffer made
from placeholders after it (all NaN: weight_norm applied then). Write within
``strata.GatheredParameters(params, modifier_rank=0)`` (the parameters whole in the block, what it
writes kept), load the pretrained weights (engine.load_pretrained), as fine-tuning does, or build
without the context. The context makes the Runtime (from the config's zero_optimization and strata
blocks) that ``strata.initialize`` then adopts, with the partitions as the parameters; initialize
refuses a config whose blocks differ. Small parameters, and parameters not of a floating dtype,
stay ordinary tensors.

Only ZeRO stage 3 partitions (``enabled=False``, or another stage, builds normally). Launched as
several ranks, every parameter takes rank 0's values as it is built and each rank's partition
holds only its shard (strata/ranks.py). A parameter's
partition holds its initializer's values in the training dtype (the optimizer's fp32 master
weights start from them, or from load_pretrained). A parameter replaced while the model is built
(a tied weight: ``self.head.weight = self.emb.weight``) gives its partition back as the old
parameter goes; until then both are held, so the tier must have room for the two at that moment.
Parameters made on the meta device are left as they are (built so, they have no values to
partition; strata.initialize then cannot place them).

Thread safety: one context at a time per process (it patches nn.Module classes while open, and from
its first use on nn.Module._apply, which converts every other module as torch does).
"""

import collections
import contextlib
import functools
import math
import weakref

import torch
from torch.utils import _pytree
from torch.utils.dlpack import from_dlpack

from strata import ranks as ranks_module
from strata.config import TORCH_DTYPES, TrainConfig
from strata.runtime_settings import RuntimeSettings, make_runtime

__all__ = ["init", "built_under", "forget", "lendable", "partition_of"]

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


_APPLY = torch.nn.Module._apply


def _apply_keeping_placeholders(module, fn, *args, **kwargs):
    """nn.Module._apply (model.to(device or dtype), .cuda(), .half(), .bfloat16()) where the
    module holds strata.init placeholders no engine has adopted: each is converted as its one
    element and expanded again to its shape (torch would make it whole: a model built bigger
    than the host, moved by `model.to(...)` before strata.initialize, would be allocated whole),
    and its partition is lent in its new dtype from then on (rounded to it where it is narrower),
    as a plain module's parameter would be converted. Other modules are converted as torch
    converts them."""
    kept = {}
    for name, p in module.__dict__.get("_parameters", {}).items():
        context = lendable(p) if p is not None else None
        if context is not None and id(p) not in context.lending.lent and _is_placeholder(p.data):
            kept[name] = p
    if kept and (torch.__future__.get_overwrite_module_params_on_conversion() or
                 torch.__future__.get_swap_module_params_on_conversion()):
        raise ValueError(
            f"{type(module).__name__}: a conversion (model.to(...)) with torch.__future__'s "
            "overwrite or swap of module parameters on conversion, over parameters built under "
            "strata.init (they would lose their partitions); accepted: those settings off (the "
            "default) until strata.initialize")
    for p in kept.values():
        p.data = p.data.as_strided((), ())
    try:
        return _APPLY(module, fn, *args, **kwargs)
    finally:
        for name, p in kept.items():
            context, pid, shape, dtype = p._strata_init
            converted = p.data.dtype
            p.data = p.data.expand(shape)
            if converted != dtype and converted.is_floating_point:
                p._strata_init = (context, pid, shape, converted)
                if not _holds_every(converted, dtype):  # (plain torch rounds every weight)
                    with context.lending._busy():
                        context._write_whole(pid, context.lending.whole(p))


def _is_placeholder(t):
    """Whether `t` is a placeholder (one element, expanded), not values of its own."""
    return t.untyped_storage().nbytes() <= t.element_size()


def _holds_every(wider, narrower):
    """Whether dtype `wider` holds every value of floating dtype `narrower` exactly."""
    if wider == torch.float64:
        return True
    return wider == torch.float32 and narrower in (torch.float16, torch.bfloat16)


def forget(model):
    """`model`'s parameters and modules are strata.init's no more (an engine released it whole:
    plain torch's again, for a new engine, a save, a copy): their marks and load hooks removed."""
    for p in model.parameters():
        p.__dict__.pop("_strata_init", None)
        p.__dict__.pop("__deepcopy__", None)
        finalizer = p.__dict__.pop("_strata_forget", None)
        if finalizer is not None:  # (the engine has let its partition go)
            finalizer.detach()
    for module in model.modules():
        for handle in module.__dict__.pop("_strata_init_hooks", ()):
            handle.remove()


def partition_of(param):
    """The partition id a parameter was given by strata.init, or None."""
    made = getattr(param, "_strata_init", None)
    return made[1] if made is not None else None


def reshaped(model):
    """(name, its partition's shape, its shape now) of each parameter built under strata.init
    whose shape changed since (resize_token_embeddings after the context reads the
    placeholder's NaN and gives the parameter a size its partition does not have)."""
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
        self.lending = _Lending(self)  # the partitions lent to torch functions (see the docstring)
        self.loading = set()  # ids of the parameters lent for a load_state_dict (_lend_for_load)

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
        self.lending.open = self.runtime is not None and self._adopted is None
        self.lending.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            try:
                self.lending.__exit__(*exc)
                self.lending.give_back_all()
            finally:
                self.lending.open = False
                self._unpatch()
                _open.remove(self)
        return False

    def settle(self, model):
        """An engine is about to adopt the Runtime with `model`: what is lent is given back, and
        nothing is lent from now on (the partitions are the engine's). A parameter whose values
        were replaced after the context closed (``p.data = t``) has them written into its
        partition (across ranks rank 0's), as plain torch trains them; one written in place
        after it (``p.data.fill_(x)``, ``zero_()``: the placeholder took the write, not the
        partition) is refused by name."""
        self.lending.give_back_all()
        self.lending.open = False
        if self.runtime is None or self._adopted is not None:  # (adopt() refuses it)
            return
        replaced, written, nan = [], [], []
        for name, p in model.named_parameters():
            made = getattr(p, "_strata_init", None)
            if made is None and p.is_floating_point() and p.numel() and torch.isnan(p).all():
                nan.append(name)  # (made from a placeholder after the context: weight_norm's)
            if made is None or made[0] is not self or tuple(p.shape) != made[2]:
                continue  # (resized: the engine refuses it, naming it)
            if not _is_placeholder(p.data):  # (values of its own)
                if not torch.isnan(p.data).all():  # (else its placeholder converted: m.to(...))
                    replaced.append((name, p))
            elif not torch.isnan(p.data.reshape(-1)[:1]).all():
                written.append(name)
        nan += [name for name, b in model.named_buffers()
                if b.is_floating_point() and b.numel() and torch.isnan(b).all()]
        if self.ranks is not None:  # (each rank's the same: else every rank names them)
            self.ranks.agree("parameters built under strata.init given values after it: " +
                             ", ".join(name for name, _ in replaced) + "; written in place: " +
                             ", ".join(written) + "; all NaN: " +
                             ", ".join(nan))
        if nan:
            raise ValueError(
                f"strata.initialize: {', '.join(nan)} of a model built under strata.init hold "
                "only NaN: made from its placeholders after the context closed (a "
                "parametrization, a copy of a weight); accepted: make them inside the context, "
                "or from the weights within strata.GatheredParameters(params)")
        if written:
            raise ValueError(
                f"strata.initialize: {', '.join(written)}, built under strata.init, written in "
                "place after the context closed (the placeholder took the write: the partition "
                "did not); accepted: the write inside the context, or within "
                "strata.GatheredParameters(params, modifier_rank=0)")
        for _, p in replaced:
            self._write_whole(p._strata_init[1], p.data.detach().to("cpu"))
        for p in model.parameters():  # (the engine's: its shape in the training dtype)
            made = getattr(p, "_strata_init", None)
            if made is not None and made[0] is self and tuple(p.shape) == made[2]:
                p.data = self._placeholder(made[2], self.dtype)

    def adopt(self, on_warning):
        """The Runtime, for the engine (once): its warnings go to `on_warning` from now on."""
        if self._adopted is not None:
            raise ValueError("strata.initialize: a model built under this strata.init has an "
                             "engine already (its partitions are that engine's); accepted: one "
                             "engine per strata.init context (build each model under its own)")
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
        while the context is open too (__init_subclass__). Module._apply keeps placeholders
        (_apply_keeping_placeholders: for good, as conversions after the context need it)."""
        if torch.nn.Module._apply is not _apply_keeping_placeholders:
            torch.nn.Module._apply = _apply_keeping_placeholders
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

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._patched.append((torch.nn.Module, "__init_subclass__", original))
        # nn.Parameter(p) of a partitioned p (parametrizations' `original`): torch makes it
        # without a torch function (Tensor._make_subclass), so p is lent first: the new
        # parameter holds its values, as plain torch's shares them.
        new = torch.nn.Parameter.__dict__["__new__"]

        def parameter(cls, data=None, requires_grad=True):
            made = getattr(data, "_strata_init", None)
            if context() is not None and context().lending.open and made is not None and \
                    made[0] is context():
                context().lending.lend(data)
            return new.__func__(cls, data, requires_grad)

        torch.nn.Parameter.__new__ = staticmethod(parameter)
        self._patched.append((torch.nn.Parameter, "__new__", new))

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

    @staticmethod
    def _placeholder(shape, dtype):
        """A partitioned parameter's data: its shape and dtype (the dtype it was built in, until
        settle()) without its bytes (one element, expanded). The element is NaN: read outside
        the context (before an engine lends it) it gives NaN, not plausible zeros; a write into
        it (fill_, zero_) changes it, which settle() names."""
        return torch.full((), math.nan, dtype=dtype).expand(shape)

    def _write_whole(self, pid, whole):
        """A parameter's new values (whole, in the training dtype) into its partition: across
        ranks rank 0's, this rank's shard of them. `whole` may be on a GPU (a lent parameter moved
        there inside the context): the partition and the ranks' broadcast take host memory."""
        flat = whole.detach().reshape(-1).to("cpu")
        if self.ranks is not None:
            flat = flat.contiguous()
            self.ranks.broadcast_tensor(
                flat, f"a {tuple(whole.shape)} parameter's values (partition {pid}), written while "
                "building")
            # (A copy, on a GPU or not contiguous, takes them back; an expanded tensor's elements
            # overlap, and its values are its own.)
            if flat.data_ptr() != whole.data_ptr() and 0 not in whole.stride():
                with torch.no_grad():  # every rank's `whole` holds rank 0's values, as its shard
                    whole.copy_(flat.view(whole.shape))
            flat = self.ranks.own_shard(flat, self.ranks.shard_elements(whole.numel()))
        held = from_dlpack(self.runtime.acquire(pid, "host", traced=False))
        try:
            held.copy_(flat)
        finally:
            del held
            self.runtime.release(pid, "host", True, traced=False)

    def _copy(self, p):
        """A new parameter partitioned as `p` is (a partition of its own, a copy of p's values:
        across ranks each rank copies its own shard)."""
        pid, self.next_id = self.next_id, self.next_id + 2
        source = partition_of(p)
        with self.lending._busy():
            if id(p) in self.lending.lent:  # (what was written into it so far)
                initial = p.detach().to(device="cpu", dtype=self.dtype).reshape(-1).contiguous()
                if self.ranks is not None:
                    initial = self.ranks.own_shard(initial, self.ranks.shard_elements(p.numel()))
            else:
                held = from_dlpack(self.runtime.acquire(source, "host", traced=False))
                try:
                    initial = held.clone()
                finally:
                    del held
                    self.runtime.release(source, "host", False, traced=False)
        self._register(pid, initial)
        dtype = p._strata_init[3]
        copy = type(p)(self._placeholder(p.shape, dtype), p.requires_grad)
        self._hold(copy, pid, dtype)
        return copy

    def _register(self, pid, initial):
        """Partition `pid` made with `initial` (this rank's shard, in the training dtype)."""
        self.runtime.register(pid, "param", {v: k for k, v in _DTYPE_NAMES.items()}[self.dtype],
                              initial.numel(), 0, self.settings.param_tier, initial)

    def _hold(self, p, pid, dtype):
        """`p`, its placeholder now, is partition `pid` of this context, built in `dtype` (what it
        is lent in): copy.deepcopy of it copies its partition; a parameter replaced while the
        model is built (a tied weight: head.weight = emb.weight) gives its partition back as it
        goes, not at the end of the run: it held a place in its tier's budget, which the rest of
        the build may need."""
        p._strata_init = (self, pid, tuple(p.shape), dtype)
        p.__deepcopy__ = functools.partial(_deepcopy_partitioned, weakref.ref(p))
        p._strata_forget = weakref.finalize(p, _forget, weakref.ref(self), pid)

    def _partition_module(self, module):
        partitioned_any = False
        for p in module.__dict__.get("_parameters", {}).values():
            if p is None or partition_of(p) is not None or not p.is_floating_point() or \
                    p.numel() < self.settings.threshold or p.device.type == "meta":
                continue
            if not partitioned_any:  # (load_state_dict before strata.initialize: lent for it)
                partitioned_any = True
                module.__dict__["_strata_init_hooks"] = (
                    module._register_load_state_dict_pre_hook(
                        functools.partial(_lend_for_load, weakref.ref(self)), with_module=True),
                    module.register_load_state_dict_post_hook(
                        functools.partial(_give_back_after_load, weakref.ref(self))))
            pid, self.next_id = self.next_id, self.next_id + 2
            with torch.no_grad():
                initial = p.detach().to(device="cpu", dtype=self.dtype).reshape(-1).contiguous()
                if self.ranks is not None:
                    self.ranks.broadcast_tensor(initial, f"a {type(module).__name__}'s parameter")
                    initial = self.ranks.own_shard(initial, self.ranks.shard_elements(p.numel()))
                self._register(pid, initial)
                del initial
                built_in = p.dtype
                p.data = self._placeholder(p.shape, built_in)
            self._hold(p, pid, built_in)


def _lend_for_load(context_ref, module, state_dict, prefix, *args):
    """module.load_state_dict() after the context (before strata.initialize): the module's
    partitioned parameters the state dict names are lent for torch's copy into them (inside the
    context the mode lends them). Held weakly, and copied with the module (deepcopy)."""
    context = context_ref()
    if context is None or context.lending.open:
        return
    for name, p in module.__dict__.get("_parameters", {}).items():
        if p is not None and prefix + name in state_dict and lendable(p) is context:
            context.lending.pin(p, modify=True)
            context.loading.add(id(p))


def _give_back_after_load(context_ref, module, incompatible_keys):
    """What _lend_for_load lent, written into the partitions."""
    context = context_ref()
    if context is None:
        return
    lent = [p for p in module.__dict__.get("_parameters", {}).values()
            if p is not None and id(p) in context.loading]
    for p in lent:
        context.loading.discard(id(p))
        context.lending.unpin(p)


def lendable(param):
    """The strata.init context whose partition `param` is, while no engine has adopted it (its
    values can be lent: GatheredParameters), else None."""
    made = getattr(param, "_strata_init", None)
    context = made[0] if made is not None else None
    if context is None or context.runtime is None or context._adopted is not None:
        return None
    return context


def _deepcopy_partitioned(param_ref, memo=None):
    """copy.deepcopy of a parameter strata.init partitioned (set on it as `__deepcopy__`, until
    its engine closes; torch's own would copy its placeholder: zeros): while a module is built
    in the context (nn.TransformerEncoder cloning its layer), a new partition holding a copy of
    its values, part of the model; else, until an engine adopts it, a plain parameter holding
    them (a model copied whole: a reference, a teacher); refused while an engine trains it."""
    param = param_ref()
    context = param._strata_init[0]
    if lendable(param) is None:
        raise TypeError("copy.deepcopy of a parameter a strata engine trains (built under "
                        "strata.init): the copy would hold no values; accepted: copy "
                        "engine.module_state_dict() into a model of your own, or copy after "
                        "engine.release()")
    if context.lending.open and context._building:
        copy = context._copy(param)
    else:
        copy = type(param)(context.lending.values(param).to(param.dtype), param.requires_grad)
    if memo is not None:
        memo[id(param)] = copy
    return copy


# Tensor attributes and methods that read no values: lent for nothing.
_NO_VALUES = frozenset((
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "_grad", "grad_fn", "_grad_fn",
    "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
    "is_nested", "is_xpu", "is_mps", "names", "name", "_version", "output_nr", "_base", "nbytes",
    "itemsize", "retains_grad", "_backward_hooks", "_post_accumulate_grad_hooks",
    "size", "numel", "nelement", "dim", "ndimension", "is_floating_point", "is_complex",
    "is_signed", "element_size", "is_contiguous", "stride", "storage_offset", "get_device",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
    "__len__", "_is_view", "is_shared", "is_pinned"))


def _reads_values(func):
    """Whether torch function `func` may read or write a tensor's values (a property's getter or
    setter is named by its property)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", "")
        return name == "data" or name not in _NO_VALUES
    return name not in _NO_VALUES


# The bytes lent parameters may hold at once while building (at least twice the largest one).
_LENT_BYTES = 64 << 20


class _Lent:
    """A partitioned parameter lent whole: the bytes lent, what tells a write."""

    def __init__(self, param, whole, written):
        self.param, self.bytes = param, whole.numel() * whole.element_size()
        self.pins = 0  # blocks that hold it lent (pin())
        self.pinned_fresh = False  # lent by a block (given back when the last block ends)
        self.modified = False  # a block that holds it keeps its writes
        self.version = param._version
        self.storage = whole.untyped_storage().data_ptr()
        self.views = {}  # id(view) -> its finalizer: views handed out, alive
        # Taken as written: a view was handed out (a write through it is not counted by param).
        self.maybe_written = written

    def written(self):
        data = self.param.data
        return self.maybe_written or self.param._version != self.version or \
            data.untyped_storage().data_ptr() != self.storage


class _Lending(torch.overrides.TorchFunctionMode):
    """While `context` is open (see the module's docstring): each partitioned parameter of its
    partitions that a torch function is given is lent whole, and stays lent while the lent bytes
    are within the bound (so that an initializer made of several calls, trunc_normal_'s, runs in
    fp32 throughout, as a plain build's); the least recently used one no view keeps and no block
    holds (pin) is given back to make room, and every one when the context closes."""

    def __init__(self, context):
        super().__init__()
        self.context = context
        self.open = False  # lending (the context open, no engine yet)
        self.bound = _LENT_BYTES
        self.lent = collections.OrderedDict()  # id(param) -> _Lent, least recently used first
        self.busy = False  # lending or giving back (its own torch functions pass through)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.open or self.busy or not _reads_values(func):
            return func(*args, **kwargs)
        given = []
        for leaf in _pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.nn.Parameter):
                made = getattr(leaf, "_strata_init", None)
                if made is not None and made[0] is self.context:
                    given.append(leaf)
        for param in given:
            self.lend(param, keep=given)
        out = func(*args, **kwargs)
        if self.lent:
            self._follow_views(out)
        return out

    @contextlib.contextmanager
    def _busy(self):
        busy, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = busy

    def lend(self, param, written=False, keep=()):
        """The parameter whole, in the dtype it was built in (whole()): its partition's values
        (across ranks gathered from every rank's shard); room made first (`keep`: parameters not
        given back for it). `written`: written back when given back, whatever it tells
        (GatheredParameters' block writes through views this mode does not see). Lent already:
        marked most recently used."""
        key = id(param)
        if key not in self.lent:
            with self._busy():
                self._make_room(param.numel() * param._strata_init[3].itemsize, keep)
                if _is_placeholder(param.data):
                    param.data = self.whole(param)
                elif tuple(param.shape) == param._strata_init[2]:  # (p.data = t after the
                    # context: its values now, written at once, whatever the lending does next)
                    self.context._write_whole(partition_of(param), param.data.detach())
                else:  # (of another shape: refused as it is given back)
                    written = True
                self.lent[key] = _Lent(param, param.data, written)
        self.lent.move_to_end(key)
        self.lent[key].maybe_written |= written
        return self.lent[key]

    def _make_room(self, incoming, keep):
        """Gives back the least recently used lent parameters (no view alive, no pin, not in
        `keep`) until `incoming` more bytes fit within the bound: twice the largest parameter
        lent, at least _LENT_BYTES (across ranks every rank lends and gives back the same ones
        in the same order: each give-back is a broadcast)."""
        self.bound = max(self.bound, 2 * incoming)
        held = sum(lent.bytes for lent in self.lent.values())
        kept = {id(p) for p in keep}
        for key in list(self.lent):
            if held + incoming <= self.bound:
                break
            lent = self.lent[key]
            if lent.views or lent.pins or key in kept:
                continue
            del self.lent[key]
            held -= lent.bytes
            self._give_back(lent, write=True)

    def values(self, param):
        """`param`'s values whole in the dtype it was built in (a copy): its lent tensor's when
        it is lent (what was written into it so far), else its partition's."""
        with self._busy():
            if id(param) in self.lent or not _is_placeholder(param.data):
                return param.data.to(param._strata_init[3], copy=True)
            return self.whole(param)

    def whole(self, param):
        """A copy of `param`'s partition whole, in the dtype it was built in (an fp32 model's
        initializers draw in fp32, as a plain build's, and a bf16 draw is not an fp32 one
        rounded); across ranks gathered from the shards."""
        context, pid = self.context, partition_of(param)
        _, _, shape, dtype = param._strata_init
        held = from_dlpack(context.runtime.acquire(pid, "host", traced=False))
        try:
            if context.ranks is None:
                return held.view(shape).to(dtype, copy=True)
            shard = held.clone()
        finally:
            del held
            context.runtime.release(pid, "host", False, traced=False)
        shard = context.ranks.gather_tensor(
            shard, f"a {tuple(shape)} parameter (partition {pid}), lent while building")
        return shard[:param.numel()].view(shape).to(dtype, copy=True)

    def _follow_views(self, out):
        """Each tensor `out` holds that views a lent parameter's values (p.data, p[0]) keeps it
        lent while it is alive."""
        by_storage = {lent.storage: lent for lent in self.lent.values()}
        for leaf in _pytree.tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or id(leaf) in self.lent:
                continue
            try:
                lent = by_storage.get(leaf.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # (a tensor without storage)
                continue
            if lent is not None and id(leaf) not in lent.views:
                lent.maybe_written = True
                lent.views[id(leaf)] = weakref.finalize(leaf, lent.views.pop, id(leaf), None)

    def pin(self, param, modify):
        """A block (GatheredParameters, a load_state_dict after the context) holds `param` lent
        until unpin(); `modify`: what it writes is kept."""
        fresh = id(param) not in self.lent
        lent = self.lend(param, written=modify)
        lent.pins += 1
        lent.pinned_fresh = lent.pinned_fresh or (fresh and lent.pins == 1)
        lent.modified = lent.modified or modify

    def unpin(self, param):
        """A block's hold ends: when the last one ends, a parameter the blocks lent is given back,
        written if any of them modifies (else what they wrote is dropped, as DeepSpeed's
        GatheredParameters without modifier_rank drops it); one lent before them stays lent."""
        lent = self.lent.get(id(param))
        if lent is None:
            return
        lent.pins -= 1
        if not lent.pins and lent.pinned_fresh:
            self.give_back([param], write=lent.modified)

    def give_back(self, params, write):
        """`params` given back (those lent): written where they may have been, if `write`."""
        chosen = {id(p) for p in params}
        self._give_back_where(lambda key: key in chosen, write)

    def give_back_all(self):
        """Every lent parameter given back, each written where it may have been."""
        self._give_back_where(lambda key: True, True)

    def _give_back_where(self, chosen, write):
        """The first error raised once every chosen one is given back."""
        error = None
        with self._busy():
            for key in [key for key in self.lent if chosen(key)]:
                lent = self.lent.pop(key)
                for finalizer in list(lent.views.values()):
                    finalizer.detach()
                try:
                    self._give_back(lent, write)
                except Exception as e:  # noqa: BLE001 - each given back; the first error raised
                    error = error or e
        if error is not None:
            raise error

    def _give_back(self, lent, write):
        param, context = lent.param, self.context
        whole, (_, pid, shape, dtype) = param.data, param._strata_init
        if whole.is_floating_point():  # (converted while lent, model.bfloat16(): its dtype now)
            dtype = whole.dtype
            param._strata_init = (context, pid, shape, dtype)
        written = write and lent.written()
        param.data = context._placeholder(shape, dtype)
        if not written:
            return
        if tuple(whole.shape) != shape:
            raise ValueError(f"strata.init: a partitioned parameter of shape {shape} "
                             f"was given values of shape {tuple(whole.shape)}; accepted: its own "
                             "shape (build the module with its final sizes)")
        context._write_whole(pid, whole)  # (across ranks rank 0's values, this rank's shard)
