"""A ZeRO stage-3 partitioned parameter outside its module's forward: its shape real, its values
refused by name.

Outside the forward (and backward) of the module that uses it, a parameter stage 3 partitions
holds an empty placeholder: its weights are the engine's partitions. Plain torch's parameter holds
its values there, so every read of the placeholder would differ from plain torch silently: a
count of the model's parameters (``sum(p.numel() ...)``), a weight-decay group chosen by
``p.dim() >= 2``, a logged ``p.norm()`` (0.0), ``parameters_to_vector`` (short), a copy taken
with ``p.detach().clone()`` or ``ema.lerp_(p, w)`` (empty), a submodule's own
``load_state_dict`` (a size mismatch).

While a live engine partitions it, such a parameter's class is `Partitioned` (a subclass of
torch.nn.Parameter: ``isinstance(p, nn.Parameter)`` holds), and what a torch function reads of it
while it holds the placeholder is:
  - its metadata as plain torch's: ``shape``, ``size()``, ``dim()``, ``ndim``, ``numel()``,
    ``nbytes``, ``stride()`` (contiguous), ``dim_order()``, ``len()``, ``type()``, dtype,
    device, ``.grad`` (None between backward and step, as DeepSpeed's: the gradient is the
    engine's partition), ``requires_grad``; ``torch.zeros_like(p)`` and the other ``*_like``
    factories, ``p.new(...)``, ``torch.result_type`` and ``is_same_size`` (they read its shape,
    dtype and device only);
  - everything else (its values read, written, copied or converted) refused by name, saying what
    to use: ``strata.GatheredParameters([p])`` (with ``modifier_rank=0`` what it writes is kept),
    ``strata.safe_get_full_fp32_param(p)``, ``engine.module_state_dict()`` or the module's (a
    submodule's) ``load_state_dict``; within a forward of a module that does not own it,
    ``strata.register_external_parameter``. Within the forward of the engine's model (called as
    a module, its hooks running: engine(x), model(x), generate()) such a read is no refusal: the
    engine lends the parameter there and then, as a use outside its owner's forward
    (forward_begins, strata/lending.py's lend_external);
  - ``p.grad = t`` (while a live engine partitions it, lent or not) refused by name, saying
    ``strata.safe_set_full_grad(p, t)`` sets the gradient the step takes.
Lent to a forward, a backward or a GatheredParameters block, it is any parameter. The engine's own
code (module conversions, state_dict()'s entries, which its hook then replaces with the weights
whole) runs within `own()`, and reads the placeholder as it is (`holds_values`). The engine's
release() gives the parameters torch.nn.Parameter back (close() and a drop leave them guarded,
below).

Only parameters whose class is torch.nn.Parameter itself are guarded (a subclass of one's own
keeps its class, and its placeholder's reads go unrefused). ``.data`` is refused by
strata/edits.py's property, and ``p.as_subclass(cls)`` (a copy without its values) by
Partitioned's own method. Not caught: a copy made by ``torch.tensor(p)``, ``torch.asarray(p,
copy=True)``, ``t.new_tensor(p)``, the legacy ``torch.Tensor(p)``, DLPack's ``to_dlpack(p)`` or
``torch.Tensor.as_subclass(p, cls)`` / ``torch.Tensor._make_subclass(cls, p)`` called unbound
(empty: torch makes them without a torch function; torch.tensor warns that it copies from a
tensor). Wrapping those names on torch would catch them, but TorchScript and torch.compile know
torch's functions by identity, and a wrapper put in torch.tensor's place stops a scripted
function that calls it from compiling. The storage's own attributes (``p.data_ptr()``,
``p.untyped_storage()``) are let through: the placeholder's, one for all.

After the engine's close() (or drop) each stays Partitioned, holding a placeholder of its shape
(one element, expanded), and its reads and writes are refused by name, saying engine.release()
gives the weights back, until it is given its weights (``p.data = t``; the module's
``load_state_dict(state, assign=True)`` gives it new parameters); release() leaves
torch.nn.Parameter.

Each torch function given a guarded parameter costs about 1-2 us more (the subclass's dispatch in
Python), lent or not: 2.2 us for F.linear given a guarded weight and bias, 1.2 us a getter
(.grad, dtype). The engine's own .data and version-counter reads and writes go past it
(strata/parameters.py's data_of, set_data, version_of, grad_of, clear_grad).

Thread safety: guard() and unguard() are the engine's (one thread); the torch functions may run in
any thread, and own() holds for the thread that entered it.
"""

import contextlib
import math
import threading
import weakref

import torch

__all__ = ["PARTITIONED", "Partitioned", "forward_begins", "forward_ends", "guard",
           "holds_values", "lent_in_forward", "own", "partitioned_name", "passes_guard",
           "unguard"]

# On a partitioned parameter (in its __dict__): (its name, a weak reference to the engine's watch
# of it (strata/edits.py): while that is alive, its placeholder's reads are refused; its shape;
# after its engine closed, the address of the placeholder it was left; whether it is frozen).
PARTITIONED = "_strata_partitioned"

_OWN = threading.local()
_RAW = torch._C._disabled_torch_function_impl  # a torch function run as on a plain parameter
_NUMEL = torch.Tensor.numel
_DATA_PTR = torch.Tensor.data_ptr

# What a closed engine leaves, said by its refusals (here, and strata/guards.py's).
PLACEHOLDERS_LEFT = (
    "its weights were partitioned by a strata engine that is closed (engine.close(), or its "
    "last reference dropped), and only placeholders without their bytes are left; accepted: "
    "engine.release() (closes the engine and gives the module its weights back whole), or "
    "engine.module_state_dict() / save_checkpoint before closing, then "
    "module.load_state_dict(state, assign=True)")

# Attributes and methods that read no values: torch's own answer goes.
_PASS = frozenset((
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
    "data_ptr", "untyped_storage", "storage_offset", "element_size", "is_floating_point",
    "is_complex", "is_signed", "is_contiguous", "get_device", "is_pinned", "is_shared",
    "is_inference", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "__dir__",
    "_is_view"))
# Getters of views of the values: refused as reads.
_VALUE_GETTERS = frozenset(("T", "mT", "H", "mH", "real", "imag"))
# The getters looked at (the others, dtype, grad, requires_grad, are torch's own).
_WATCHED_GETTERS = _VALUE_GETTERS | {"shape", "ndim", "nbytes"}
_LIKE = frozenset(("zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                   "randn_like", "randint_like"))


def partitioned_name(p):
    """The name of `p` while a live engine partitions it, else None."""
    mark = p.__dict__.get(PARTITIONED)
    return mark[0] if mark is not None and mark[1] is not None and mark[1]() is not None \
        else None


def left_by_closed(p):
    """Whether `p` holds what a closed engine left of it (not given its weights since)."""
    mark = p.__dict__.get(PARTITIONED)
    return mark is not None and mark[3] is not None and _RAW(_DATA_PTR, (), (p,), {}) == mark[3]


def holds_values(p):
    """Whether parameter `p` holds values now (lent), not its placeholder: read past the guard."""
    return _RAW(_NUMEL, (), (p,), {}) != 0


def passes_guard(p):
    """Whether every torch function given guarded parameter `p` would run now as on a plain
    parameter: it is lent (neither a live engine's placeholder nor what a closed one left)."""
    return not _held(p)


def forward_begins(lender):
    """The forward of an engine's model begins (in this thread), until forward_ends(lender): a
    placeholder's values that a torch function reads there are the parameter's, lent by
    `lender.lend_external(p)` (a use outside its owner's forward that the forwards looking for
    those did not meet: strata/lending.py), not refused. Held weakly; a lender left by a forward
    whose end did not run (a KeyboardInterrupt skips torch's always-called hooks) is put back in
    place by its next forward, and taken off by forward_ends when its engine ends."""
    forward_ends(lender)
    _OWN.__dict__.setdefault("forwards", []).append(weakref.ref(lender))


def forward_ends(lender):
    stack = getattr(_OWN, "forwards", [])
    stack[:] = [ref for ref in stack if ref() is not None and ref() is not lender]


def lent_in_forward(p):
    """Whether `p` was lent for a torch function within an engine's model's forward
    (forward_begins: the innermost engine's first)."""
    lenders = (ref() for ref in reversed(getattr(_OWN, "forwards", ())))
    return any(lender is not None and lender.lend_external(p) for lender in lenders) and \
        not _held(p)


@contextlib.contextmanager
def own():
    """The engine's own torch calls on the placeholders (in this thread): not refused."""
    _OWN.depth = getattr(_OWN, "depth", 0) + 1
    try:
        yield
    finally:
        _OWN.depth -= 1


def guard(p, name, shape, watch, frozen=False):
    """Parameter `p`, named `name`, of `shape` (`frozen`: not trained), is guarded while `watch`
    (a weak reference) is alive: Partitioned, if its class is torch.nn.Parameter itself."""
    p.__dict__[PARTITIONED] = (name, watch, tuple(shape), None, frozen)
    if type(p) is torch.nn.Parameter:
        p.__class__ = Partitioned


def leave(p, shape):
    """`p`'s engine closed and left it its placeholder (of `shape`, set just before): guarded
    with the closed engine's refusal until it is given its weights (p.data = t)."""
    name, _, _, _, frozen = p.__dict__.get(PARTITIONED, ("the parameter", 0, 0, 0, False))
    p.__dict__[PARTITIONED] = (name, None, tuple(shape), _RAW(_DATA_PTR, (), (p,), {}), frozen)
    if type(p) is torch.nn.Parameter:
        p.__class__ = Partitioned


def unguard(params, closed=False):
    """`params` are plain torch.nn.Parameter again, unmarked (those a closed engine left only
    with `closed`)."""
    for p in params:
        mark = p.__dict__.get(PARTITIONED)
        if mark is not None and (closed or mark[3] is None):
            del p.__dict__[PARTITIONED]
            if type(p) is Partitioned:
                p.__class__ = torch.nn.Parameter




def _name(func):
    """(the function's name, whether it is an attribute's getter or setter)"""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", ""), True
    return name, False


def _held(value):
    """Whether `value` is a guarded parameter holding its placeholder (or what a closed engine
    left it)."""
    if type(value) is not Partitioned:
        return False
    if _RAW(_NUMEL, (), (value,), {}) == 0:
        return partitioned_name(value) is not None
    return left_by_closed(value)


def _placeholder_in(values):
    """The first guarded parameter holding its placeholder in `values` (or in a list or tuple
    among them), else None."""
    for value in values:
        if type(value) is Partitioned:
            if _held(value):
                return value
        elif type(value) in (list, tuple):
            held = _placeholder_in(value)
            if held is not None:
                return held
    return None


def _placeholder_of(args, kwargs):
    """The first guarded parameter holding its placeholder among a call's arguments, else None."""
    held = _placeholder_in(args)
    if held is None and kwargs:
        held = _placeholder_in(kwargs.values())
    return held


def _shape(p):
    return p.__dict__[PARTITIONED][2]


def _stand_in(p):
    """A tensor of `p`'s shape, dtype and device without its bytes (one element, expanded)."""
    return torch.empty((), dtype=p.dtype, device=p.device).expand(_shape(p))


def _with_stand_ins(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_with_stand_ins(v) for v in value)
    return _stand_in(value) if _held(value) else value


def _answer(func, name, p, args, kwargs):
    """What plain torch's parameter answers for `func` (named `name`) reading only metadata of
    placeholder `p` (args[0], or the other arguments where it reads no values: zeros_like,
    result_type, is_same_size), or NotImplemented where it reads values."""
    shape = torch.Size(_shape(p))
    if name in ("shape", "size", "dim", "ndimension", "ndim", "numel", "nelement", "nbytes",
                "dim_order", "is_same_size", "result_type", "new") or name in _LIKE:
        args = tuple(_with_stand_ins(a) for a in args)
        kwargs = {k: _with_stand_ins(v) for k, v in kwargs.items()}
        if name == "nbytes":
            return math.prod(shape) * p.element_size()
        if name == "dim_order":
            return tuple(range(len(shape)))
        return _RAW(func, (), args, kwargs)
    if not args or args[0] is not p:  # (given by keyword: torch.nn.init's tensor=p)
        return NotImplemented
    if name == "type" and len(args) == 1 and not kwargs:  # (its name; a conversion reads values)
        return _RAW(func, (), args, kwargs)
    if name == "stride":
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return strides if dim is None else strides[dim]
    if name == "__len__":
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]
    if name == "__format__":
        return format(repr(p), *args[1:])
    return NotImplemented


def _refuse(name, p):
    what = f".{name}" if name in _VALUE_GETTERS else f"{name}()"
    if partitioned_name(p) is None:  # (a closed engine's)
        return RuntimeError(f"{p.__dict__[PARTITIONED][0]}: {what}: {PLACEHOLDERS_LEFT}")
    return RuntimeError(
        f"{partitioned_name(p)}: {what} of a parameter ZeRO stage 3 partitions, outside its "
        "module's forward: the parameter holds an empty placeholder there (its weights are the "
        "engine's partitions), so its values would be read as none or written into nothing; "
        "accepted: within strata.GatheredParameters([param]) (with modifier_rank=0 what the "
        "block writes becomes the weights and master weights), strata.safe_get_full_fp32_param("
        "param) to read the master weights, engine.module_state_dict() (or the model's "
        "state_dict()) for the weights and the model's load_state_dict to set them; in the "
        "forward of a module that does not own it, strata.register_external_parameter(module, "
        "param) (its shape, numel() and dtype are answered as plain torch's)")


def _refuse_grad(p):
    if p.__dict__[PARTITIONED][4]:
        return RuntimeError(
            f"{partitioned_name(p)}: .grad = t on a frozen parameter ZeRO stage 3 partitions "
            "(requires_grad False when strata.initialize made the optimizer): no step takes a "
            "gradient of it, and its placeholder holds none; accepted: leave its .grad None")
    return RuntimeError(
        f"{partitioned_name(p)}: .grad = t on a parameter ZeRO stage 3 partitions: its gradient "
        "is the engine's gradient partition, not .grad (which reads None between backward and "
        "step, as DeepSpeed's); accepted: strata.safe_set_full_grad(param, t) between backward "
        "and step (strata.safe_get_full_grad(param) reads it)")


class Partitioned(torch.nn.Parameter):
    """A parameter a live engine partitions at stage 3 (see the module's docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_OWN, "depth", 0):
            name, attribute = _name(func)
            if name == "grad" and func.__name__ == "__set__" and args[1] is not None and \
                    partitioned_name(args[0]) is not None:
                raise _refuse_grad(args[0])
            if (not attribute or name in _WATCHED_GETTERS) and name not in _PASS:
                held = _placeholder_of(args, kwargs)
                if held is not None:
                    answer = _answer(func, name, held, args, kwargs)
                    if answer is not NotImplemented:
                        return answer
                    while held is not None:  # (each lent within a model's forward, or refused)
                        if not lent_in_forward(held):
                            raise _refuse(name, held)
                        held = _placeholder_of(args, kwargs)
        return _RAW(func, types, args, kwargs)

    def as_subclass(self, cls):
        if _held(self) and not getattr(_OWN, "depth", 0):
            raise _refuse("as_subclass", self)
        return super().as_subclass(cls)

    def __repr__(self):
        if _held(self) and not getattr(_OWN, "depth", 0):
            if partitioned_name(self) is None:
                return (f"Parameter left by a closed strata engine ({self.__dict__[PARTITIONED][0]}"
                        f", shape {tuple(_shape(self))}, {self.dtype}): no values")
            return (f"Parameter partitioned by strata at ZeRO stage 3 ({partitioned_name(self)}, "
                    f"shape {tuple(_shape(self))}, {self.dtype}): its values are the engine's "
                    "partitions, read within strata.GatheredParameters([param])")
        return super().__repr__()
