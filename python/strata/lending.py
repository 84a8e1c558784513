"""Stage 3's parameters lent around each module's forward and backward: the engine's part that
FSDP2 calls the parameter group.

A partitioned parameter's ``.data`` is an empty placeholder until a module that uses it runs: a
forward pre-hook on each such module (registered first, so the module's own pre-hooks see the
weights) lends it from the Runtime into the device tier, a forward hook gives it back, and a hook
on the forward's outputs lends it again before the module's backward (a module pre-backward hook
does not exist in every torch). A lent tensor is released when torch frees it, so a view that
autograd holds keeps its partition pinned rather than pointing at reused memory; the views it saves
during the model's forward are kept as their place in the parameter and taken anew in backward
(_SavedViews: a mixture of experts' slices, F.linear's transposed weight), so that they do not
pin every layer's weights at once. An nn.Linear (or a subclass that keeps its forward) runs torch's
F.linear there, and _Zero3Linear, which saves the weight itself, not a view, where other
saved-tensor hooks are in force (checkpointing's recomputation, a user's) or under autocast. A
frozen parameter has no gradient hook to give it back in backward: it goes back once the module's
input gradient is made.
The model's first forward finds parameters used outside their owner's forward (_ExternalUses),
and so does its first forward with gradients, where the first ran without them (a trainer that
generates before it trains: TRL's GRPO, whose training forward reads the head's weight itself).
Across ranks the partitions hold shards, all-gathered as they are lent (strata/ranks.py), the
next module's gathered while one computes (in the order the first micro-batch fetched them).

`Lending` owns what it lends: which entries each module lends, how many holds each lent partition
has, the first forward's discovery, the ranks' gather order, and its hooks. The engine builds it
with what it uses (the parameter table, the ranks, the training state) and hands it the Runtime
(`runtime`, None once the engine is closed). Thread safety: the engine's (one thread).
"""

import contextlib
import types
import weakref

import torch
from torch.utils import _pytree
from torch.utils.dlpack import from_dlpack

from strata import _strata
from strata.parameters import data_of, set_data, version_of
from strata import placeholders
from strata.placeholders import Partitioned, holds_values, passes_guard

__all__ = ["Lending", "kernel_stream", "register_external_parameter", "weakly"]


def kernel_stream(device):
    """Where the model's kernels are queued on `device`: on a GPU torch's current stream (the
    integer cudaStream_t the Runtime takes with a device copy's release, so that it neither reuses
    nor reads the copy before they have run; 0 is CUDA's legacy default stream, torch's default,
    a stream like any other); None on the CPU beside the emulated tier (no streams)."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


class Lending:
    """Stage 3's lending (see the module's docstring) for one engine's model."""

    def __init__(self, table, ranks, state, runtime):
        self.table = table  # strata/parameters.py
        self.ranks = ranks  # strata/ranks.py; None in one process
        self.state = state  # strata/training_state.py
        self.runtime = runtime  # the engine's; None once it is closed
        self.module = None  # the model, once hooked (install)
        self.by_module = {}  # module -> the entries its forward lends
        # module -> (any of them frozen, any trained): what its hooks check on each call
        self._kinds = {}
        self._cuda = table.placeholder.device.type == "cuda"
        self.holders = {}  # pid -> holds on its lent copy (its modules' forwards and backwards)
        self.handles = []  # the hooks it put on the model
        self.patched_forward = []  # (module, its own forward or None) it set (_Zero3Linear's)
        # _ExternalUses has run: in the first forward, and in the first forward with gradients
        # (where the first ran without them: generation before training)
        self.discovered = self.discovered_with_grad = False
        self.discovering = None  # the _ExternalUses of the forward running now
        self.internal_depth = 0  # > 0 while the engine's own torch calls run (internal())
        self.saved_views = None
        # Across ranks: the modules' fetches, once recorded; the recording; where the forward is
        # in it; the gather started ahead (module, its entries, its collectives).
        self.gather_order = None
        self.recording = []
        self.cursor = None
        self.prefetched = None
        self.prefetched_gathers = 0  # gathers started ahead that their module used
        # What the hooks put on a forward's tensors call: through a weak reference, so that a
        # graph the user keeps (a loss not backwarded) keeps neither the lending nor its Runtime.
        self._weak_before_backward = weakly(self._before_backward, gone=(
            "backward through a forward of a strata engine that is gone (closed, or its last "
            "reference dropped): its parameters are placeholders now, and the gradients would "
            "be computed with them; accepted: backward before the engine is closed"))
        self._weak_drop = weakly(self._drop)

    # --- set-up and tear-down -------------------------------------------------------------------

    def install(self, model, stage):
        """Hooks `model`'s modules that use partitioned parameters (and, at stage 3, the model's
        first forward's discovery and the saved views)."""
        self.module = model
        partitioned = self.table.partitioned_by_id
        for module in model.modules():
            used = list(module._parameters.values()) + \
                list(getattr(module, "_strata_external_parameters", ()))
            own = [partitioned[id(p)] for p in used if p is not None and id(p) in partitioned]
            if own:
                self._lend_around(module, own)
        if stage == 3:
            # torch.compile of the model would run a graph that bypasses the lending (silently
            # wrong from its second step): dynamo is told to leave the model's forward eager.
            if all(m is not model for m, _ in self.patched_forward):
                # (remove() puts back a forward the instance had of its own: a wrapper's.)
                self.patched_forward.append((model, model.__dict__.get("forward")))
            model.forward = torch.compiler.disable(model.forward)
            # The first forward, however it is called (engine(), generate()).
            self.handles += [
                model.register_forward_pre_hook(weakly(self._begin_discovery), prepend=True),
                model.register_forward_hook(weakly(self._end_discovery), always_call=True)]
            # Views of lent weights that autograd saves, kept as where they are (_SavedViews).
            self.saved_views = _SavedViews(self)
            self.handles += [
                model.register_forward_pre_hook(weakly(self.saved_views.enter)),
                model.register_forward_hook(weakly(self.saved_views.leave), always_call=True)]

    def remove(self):
        """Takes its hooks and forwards off the model; nothing stays lent."""
        placeholders.forward_ends(self)  # (in this thread: a forward left unended)
        self.drop_all()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for module, own in self.patched_forward:
            module.__dict__.pop("forward", None)
            if own is not None:
                module.forward = own
        self.patched_forward = []

    # --- the loop's points ----------------------------------------------------------------------

    def begin_forward(self):
        """A forward of the model begins (across ranks: its gathers follow the recorded order)."""
        if self.ranks is not None:
            self._take_prefetched(None)  # one started for a backward that did not come
            self.cursor = 0
            if self.gather_order is None:  # recorded from the forward whose backward comes
                self.recording = []

    def end_backward(self):
        """A backward ended well: across ranks, its first fetch order is the one to follow."""
        if self.ranks is not None and self.gather_order is None and \
                self.recording is not None:
            self.gather_order = self.recording

    def drop_all(self):
        """Every hold given back and every partitioned parameter unlent (after a backward)."""
        self.holders.clear()
        self.table.leave_unlent()

    def give_back(self, e):
        """e's lent copy goes back now, whatever holds it (its gradient is made: the last thing
        backward needed of it)."""
        self.holders.pop(e.pid, None)
        set_data(e.param, self.table.placeholder)

    @contextlib.contextmanager
    def internal(self):
        """The engine's own torch calls (lending, gathering): _ExternalUses lets them be."""
        self.internal_depth += 1
        try:
            yield
        finally:
            self.internal_depth -= 1

    def lend_now(self, e):
        """Lends `e` and holds it once more: its module's _drop, or its gradient hook, gives it
        back. Across ranks its shard is gathered whole (an external use the first forward finds:
        every rank's forward meets it at the same point)."""
        self.holders[e.pid] = self.holders.get(e.pid, 0) + 1
        if not holds_values(e.param):
            lent = from_dlpack(self.runtime.lend(e.pid, "device", self._stream(),
                                                 self._traced()))
            if self.ranks is None:
                set_data(e.param, lent.view(e.shape))
            else:
                self.ranks.gather([(e, lent, self._sink(e))])

    # --- the hooks ------------------------------------------------------------------------------

    def _begin_discovery(self, module, args):
        """The model's first forward, and its first with gradients, find the partitioned
        parameters a module uses that it does not own (_ExternalUses), and register each with
        the module that used it (at most two forwards pay for the look at each torch call); a
        later forward lends one they did not meet as its torch function reads it
        (lend_external)."""
        placeholders.forward_begins(self)
        if self.discovering is None and (
                not self.discovered or
                not self.discovered_with_grad and torch.is_grad_enabled()):
            self.discovering = _ExternalUses(self)
            self.discovering.with_grad = torch.is_grad_enabled()
            self.discovering.__enter__()

    def _end_discovery(self, module, args, output):
        placeholders.forward_ends(self)
        if self.discovering is not None:
            discovering, self.discovering = self.discovering, None
            discovering.__exit__(None, None, None)
            self.discovered = True
            self.discovered_with_grad = self.discovered_with_grad or discovering.with_grad

    def _lend_around(self, module, entries):
        """Lends `entries` (partitioned parameters) around `module`'s forward and backward: hooks
        it (once) and adds them to what it lends."""
        if module not in self.by_module:
            self.by_module[module] = []
            # The hooks hold the lending weakly: the module must not keep its engine alive (the
            # last reference to an engine frees its Runtime, pinned memory and disk).
            # Lending runs before the module's other pre-hooks (they see its weights, as in plain
            # torch); a post-hook registered after the engine's sees them given back.
            self.handles += [
                module.register_forward_pre_hook(weakly(self._before_forward), with_kwargs=True,
                                                 prepend=True),
                module.register_forward_hook(weakly(self._after_forward))]
            # nn.Linear, or a subclass that keeps its forward (strata.TiledLinear's tiles), unless
            # something set a forward of its own on the instance (a wrapper's hook: it stays).
            if isinstance(module, torch.nn.Linear) and \
                    type(module).forward is torch.nn.Linear.forward and \
                    "forward" not in module.__dict__:
                module.forward = types.MethodType(_zero3_linear_forward, module)
                self.patched_forward.append((module, None))
        self.by_module[module] += [e for e in entries if e not in self.by_module[module]]
        lent = self.by_module[module]
        self._kinds[module] = (any(e.frozen for e in lent), any(not e.frozen for e in lent))

    def _use_external(self, param, module):
        """`module`'s forward used `param`, a partitioned parameter it does not own (found by
        _ExternalUses): it is registered as external to `module`, lent around it from now on, and
        lent now, until `module`'s forward ends."""
        e = self.table.partitioned_by_id[id(param)]
        register_external_parameter(module, param)
        self._lend_around(module, [e])
        self.lend_now(e)

    def lend_external(self, param):
        """Within the model's forward, after the forwards that look for them: `param`, read by a
        torch function outside its owner's forward, is registered as external to the model and
        lent now, as _ExternalUses does (TRL's fused LM head reads lm_head.weight in the model's
        own forward, first in a pass after generate()); returns whether it is this engine's."""
        if self.internal_depth or self.runtime is None or \
                id(param) not in self.table.partitioned_by_id:
            return False
        if self.ranks is not None:
            # The model lends it first from now on: the recorded order of the gathers no longer
            # holds (prefetching would stop for good); recorded anew from the next forward (every
            # rank lends it at the same point).
            self.gather_order, self.recording = None, None
        try:
            self._use_external(param, self.module)
        except _strata.Error as error:
            if error.code != "RESOURCE_EXHAUSTED":
                raise
            raise _with_hint(
                error, f"lending {self.table.partitioned_by_id[id(param)].name}, read outside its "
                "module's forward, for the rest of the model's forward: parameters lent now hold "
                f"{self.table.lent_bytes()} bytes of it; raise strata.device_budget_bytes, or "
                "strata.register_external_parameter(module, param) with the module whose forward "
                "reads it, to lend it around that module alone") from None
        return True

    def _stream(self):
        return kernel_stream(self.table.placeholder.device) if self._cuda else None

    def _traced(self):
        """Whether a lend now is part of the training step's access trace: a forward with
        gradients or in training mode (a checkpointed segment's first forward runs without
        gradients), or anything during engine.backward (whose hooks run without them). An
        evaluation's forward (eval mode under no_grad, outside backward) is not: the scheduler
        neither records it nor takes it for a step that left the plan."""
        return torch.is_grad_enabled() or self.state.in_backward or self.module.training

    def _fetch(self, module, backward=None):
        """Lends `module`'s entries (holding each once more); in `backward` (autograd's graph task
        of a backward's fetch) not those whose gradients that backward made already: a hook that
        runs late (a view's base node, _before_backward_of) would hold them to its end."""
        prefetched = self._take_prefetched(module)
        gather = []
        for e in self.by_module[module]:
            if backward is not None and e.grad_made_in == backward:
                continue
            held = self.holders.get(e.pid, 0)
            if held == 0 and not holds_values(e.param) and e not in prefetched[0]:
                try:
                    lent = from_dlpack(self.runtime.lend(e.pid, "device", self._stream(),
                                                         self._traced()))
                except _strata.Error as error:
                    if error.code != "RESOURCE_EXHAUSTED":
                        raise
                    raise _with_hint(
                        error, f"lending {e.name} to {type(module).__name__}: parameters lent "
                        f"now hold {self.table.lent_bytes()} bytes of it; a view autograd saved, "
                        "or gradient checkpointing recomputing a whole block in backward, holds "
                        "its module's parameters at once: raise strata.device_budget_bytes to "
                        "hold them") from None
                if self.ranks is None:
                    set_data(e.param, lent.view(e.shape))
                else:  # its shard, gathered whole with the module's others (then given back)
                    gather.append((e, lent, self._sink(e)))
            self.holders[e.pid] = held + 1
        if self.ranks is not None:
            self.ranks.finish_gather(prefetched[1])
            if gather:
                self.ranks.gather(gather)
            gather = lent = None  # the shards given back before the next module's are lent
            self._prefetch_after(module)

    # Across ranks, the all-gathers follow the order the first micro-batch fetched the modules in
    # (forward, then backward): while a module computes, the next one's weights are gathered
    # (issued on every rank at the same point, so the ranks' collectives stay in one order). A
    # micro-batch whose order differs (on every rank alike) gathers on demand for its rest.

    def _sink(self, e):
        def sink(whole):
            if not holds_values(e.param):  # (a prefetch dropped unused hands its copy to nobody)
                set_data(e.param, whole.view(e.shape))
        return sink

    def _take_prefetched(self, module):
        """({entries} the gather started ahead for `module` covers, its collectives); a gather
        started for another module is waited for and dropped."""
        pending, self.prefetched = self.prefetched, None
        if pending is None:
            return set(), []
        target, entries, started = pending
        if target is module:
            self.prefetched_gathers += 1
            return entries, started
        self.ranks.finish_gather(started, deliver=False)
        return set(), []

    def _prefetch_after(self, module):
        if self.gather_order is None:  # the first micro-batch: recording the order
            if self.recording is not None:  # (None: from the next forward, lend_external)
                self.recording.append(module)
            return
        if self.cursor is None or self.cursor >= len(self.gather_order) or \
                self.gather_order[self.cursor] is not module:
            self.cursor = None  # another order: on demand until the next forward
            return
        self.cursor += 1
        if self.cursor == len(self.gather_order):
            return
        following = self.gather_order[self.cursor]
        items = []
        for e in self.by_module[following]:
            if self.holders.get(e.pid, 0) == 0 and not holds_values(e.param):
                lent = from_dlpack(self.runtime.lend(e.pid, "device", self._stream(),
                                                     self._traced()))
                items.append((e, lent, self._sink(e)))
        if items:
            self.prefetched = (following, {e for e, _, _ in items},
                               self.ranks.start_gather(items))

    def _drop(self, module, frozen_only=False):
        for e in self.by_module.get(module, ()):
            if frozen_only and not e.frozen:
                continue
            held = self.holders.get(e.pid, 0) - 1
            self.holders[e.pid] = max(held, 0)
            if held <= 0:
                set_data(e.param, self.table.placeholder)

    # The hooks run for every lending module twice a step: the engine's own torch calls are
    # marked without internal()'s context manager (a generator a call).

    def _before_forward(self, module, args, kwargs):
        self.internal_depth += 1
        try:
            self._fetch(module)
        finally:
            self.internal_depth -= 1
        if self._kinds[module][0] and torch.is_grad_enabled():
            # A frozen parameter has no gradient hook to give it back in backward: it goes back
            # once the gradient of the module's input is made (its backward is done then).
            for t in _tensors((args, kwargs)):
                if t.requires_grad:
                    done = []

                    def after_backward(grad, module=module, done=done, drop=self._weak_drop):
                        if not done:
                            done.append(True)
                            drop(module, frozen_only=True)

                    t.register_hook(after_backward)
                    break

    def _after_forward(self, module, inputs, output):
        hooked = False
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    _before_backward_of(t, module, self._weak_before_backward,
                                        self.by_module[module])
                    hooked = True
            if not hooked and self._kinds[module][1]:
                # No output carries a gradient back into the module, yet it has trained
                # parameters: what it computed with them went elsewhere (an auxiliary loss kept
                # on the module), where no hook could lend them again for backward. They stay
                # lent until their gradients are made (the gradient hook gives each back), or
                # until backward ends.
                return
        self.internal_depth += 1
        try:
            self._drop(module)
        finally:
            self.internal_depth -= 1

    def _before_backward(self, module):
        self._fetch(module, backward=torch._C._current_graph_task_id())


class _SavedViews:
    """While the model's forward runs at stage 3: a view of a lent partitioned parameter that
    autograd saves for backward (an expert's slice of a mixture of experts' 3-D weight, as
    transformers 5 computes ``F.linear(x, self.gate_up_proj[i])``) is kept as where it lies in
    its parameter (shape, strides, offset), not as the tensor: the tensor would keep the lent
    partition pinned from forward to backward, every layer's experts at once, where the
    parameter is lent again before its module's backward (its output's hook) and the view is
    taken anew from it there. The parameter itself, saved whole (_Zero3Linear, a LayerNorm's
    weight), needs nothing: its data is swapped, not its tensor. Applied only where no other
    saved-tensor hooks are in force when the forward begins (torch.utils.checkpoint's, a user's
    torch.autograd.graph.save_on_cpu): those are left to do as they do; inside a checkpointed
    region checkpointing's own hooks apply."""

    def __init__(self, lending):
        self._lending = weakref.ref(lending)
        self._hooks = None
        self._depth = 0

    @staticmethod
    def in_force():
        """Whether a _SavedViews' hooks are the saved-tensor hooks in force now (the innermost)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and getattr(top[0], "__func__", None) is _SavedViews._pack

    def enter(self, module, args):
        self._depth += 1
        if self._depth == 1 and \
                torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def leave(self, module, args, output):
        self._depth -= 1
        if self._depth == 0 and self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    # Any other tensor is kept as itself, with its version: under saved-tensor hooks autograd
    # does not check that a saved tensor was not changed in place before backward (as it does
    # without them), so _unpack checks it, with torch's words.

    def _pack(self, t):
        base = t._base
        lending = self._lending()
        if base is None or lending is None:
            return t, version_of(t)
        e = lending.table.partitioned_by_id.get(id(base))
        if e is None:
            return t, version_of(t)
        lent = data_of(e.param)  # (its values, read past the placeholder's guard)
        if t.dtype != lent.dtype or lent.numel() == 0 or \
                t.untyped_storage().data_ptr() != lent.untyped_storage().data_ptr():
            return t, version_of(t)
        return _LentView(e, t.size(), t.stride(), t.storage_offset() - lent.storage_offset())

    def _unpack(self, saved):
        if type(saved) is tuple:
            t, version = saved
            if version_of(t) != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                    f"{version_of(t)}; expected version {version} instead (saved in the forward "
                    "of a strata engine's model, whose saved-tensor hooks check it as torch "
                    "does). Hint: change the tensor out of place, or clone it before")
            return t
        e = saved.entry
        lending = self._lending()
        if lending is None or not lending.runtime or placeholders.left_by_closed(e.param):
            raise RuntimeError(f"backward needs a view of {e.name} that autograd saved in "
                               "forward, and the engine is closed (or gone): its parameters "
                               "hold placeholders; accepted: backward before the engine is "
                               "closed")
        if not holds_values(e.param):  # not lent again by its module's backward: lent now
            if lending.ranks is not None:
                raise RuntimeError(f"backward needs a view of {e.name} that autograd saved in "
                                   "forward, and its parameter is not lent (across ranks "
                                   "outside its module's backward)")
            with lending.internal():
                lending.lend_now(e)
        data = data_of(e.param)
        return data.as_strided(saved.size, saved.stride, data.storage_offset() + saved.offset)


class _LentView:
    """What _SavedViews keeps of a saved view of a lent parameter: its entry and its place."""
    __slots__ = ("entry", "size", "stride", "offset")

    def __init__(self, entry, size, stride, offset):
        self.entry, self.size, self.stride, self.offset = entry, size, stride, offset


def register_external_parameter(module, parameter):
    """Says that `module`'s forward uses `parameter`, which another module owns (a tied weight
    used functionally, as ``h @ self.wte.weight.t()``), as DeepSpeed's
    ``deepspeed.zero.register_external_parameter``: at stage 3 the parameter is then lent for the
    whole of `module`'s forward. The model's first forward (and its first with gradients)
    registers the uses it meets by itself with the module that used it (_ExternalUses), and a
    later forward one it meets first with the model (Lending.lend_external: lent for the whole
    of the model's forward from then on); call this, before ``strata.initialize``, to lend one
    such a later forward meets around its own module alone (a large head: less device memory
    held)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise ValueError("register_external_parameter: accepted: a torch.nn.Parameter")
    external = module.__dict__.setdefault("_strata_external_parameters", [])
    if not any(p is parameter for p in external):
        external.append(parameter)


class _Zero3Linear(torch.autograd.Function):
    """F.linear that saves the weight parameter itself for backward, not the transposed view
    F.linear's autograd saves: a view would keep the lent partition pinned from forward to
    backward (every layer's at once), where the parameter is lent again before its backward.

    Its output is a tensor of its own, not a view (a model may change it in place: ReLU(inplace),
    ``h += x``). Under torch.autocast it computes in the autocast dtype, as F.linear would, and
    its backward does too (the weight is cast again there, not kept cast)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.cast = cast
        if torch._C._current_graph_task_id() != -1:
            # A forward inside backward: gradient checkpointing's recomputation. torch keeps a
            # saved tensor that needs no gradient (a frozen weight) as the tensor itself and
            # checks its shape once the block is recomputed, after the module has given the
            # weight back: a frozen one is saved as the lent copy it computed with (held until
            # its backward, as checkpointing holds a block's weights at once).
            weight = weight.detach() if not weight.requires_grad else weight
            bias = bias.detach() if bias is not None and not bias.requires_grad else bias
        ctx.save_for_backward(x, weight, bias)
        with torch.autocast(device, enabled=False):
            if cast is not None:
                x, weight = x.to(cast), weight.to(cast)
                bias = bias.to(cast) if bias is not None else None
            flat = x.reshape(-1, x.shape[-1])
            out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=flat.dtype, device=x.device)
            if bias is None:
                torch.mm(flat, weight.t(), out=out.view(-1, weight.shape[0]))
            else:
                torch.addmm(bias, flat, weight.t(), out=out.view(-1, weight.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        cast = ctx.cast
        w = weight.to(cast) if cast is not None else weight
        xs = x.to(cast) if cast is not None else x
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(w).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(xs.reshape(-1, xs.shape[-1])) \
                .to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b


def _zero3_linear_forward(module, input):  # noqa: A002 - nn.Linear.forward's name for it
    """nn.Linear's forward at stage 3: torch's own F.linear where nothing it saves can keep the
    lent weight pinned (no gradients, or the model's forward under _SavedViews, which keeps the
    transposed view F.linear's autograd saves as its place in the weight), outside torch.autocast
    (whose cast copy of the weight F.linear would save from forward to backward); _Zero3Linear
    elsewhere (checkpointing's recomputation or its saved-tensor hooks, a user's, autocast). The
    host's cost per call of the first is torch's: _Zero3Linear's Python autograd function costs
    several times F.linear's on the host (bench/host_cost.py). With the weight and bias lent (or
    kept: a small bias), a plain tensor for input and no torch function mode in force, the call
    skips the placeholder's guard, which has nothing to refuse there (Partitioned's dispatch,
    half again F.linear's host time)."""
    weight, bias = module.weight, module.bias
    if not torch.is_grad_enabled() or (
            _SavedViews.in_force() and not torch.is_autocast_enabled(input.device.type)):
        if type(input) is torch.Tensor and type(weight) is Partitioned and \
                passes_guard(weight) and (bias is None or type(bias) is torch.nn.Parameter or
                                          type(bias) is Partitioned and passes_guard(bias)) and \
                _modes_in_force() == 0:
            with _NO_SUBCLASS_DISPATCH():
                return torch.nn.functional.linear(input, weight, bias)
        return torch.nn.functional.linear(input, weight, bias)
    return _Zero3Linear.apply(input, weight, bias)


_NO_SUBCLASS_DISPATCH = torch._C.DisableTorchFunctionSubclass
_modes_in_force = torch._C._len_torch_function_stack


# What a placeholder answers as its parameter would (a parent reading self.dtype is no use of the
# weights): _ExternalUses lends nothing for these.
_METADATA = {getattr(torch.Tensor, name).__get__ for name in (
    "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_cuda",
    "is_sparse", "is_meta", "is_quantized", "shape", "ndim")} | {
    # (its shape answered as plain torch's: strata/placeholders.py)
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel}


class _ExternalUses(torch.overrides.TorchFunctionMode):
    """During an engine's first forward at stage 3: each torch function given a partitioned
    parameter that is not lent (a parameter used outside its owner's forward: F.linear(x,
    self.fc.weight) in a parent, an nn.ParameterList indexed by its parent, a tied head used as
    ``h @ wte.weight.t()``) lends it, registered as external to the innermost module whose
    forward runs (Lending._use_external), as register_external_parameter would. A later forward
    that uses a parameter so where the first did not lends it as the torch function reads it,
    registered to the model (Lending.lend_external: the placeholder's own refusal is where it is
    met)."""

    def __init__(self, lending):
        super().__init__()
        self.lending = lending
        self.stack = []
        self.handles = []
        self.with_grad = False  # (the forward it looks at runs with gradients)

    def __enter__(self):
        def enter(module, args):
            self.stack.append(module)

        def leave(module, args, out):  # (returns None: the output stays the module's)
            if self.stack:
                self.stack.pop()

        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                        torch.nn.modules.module.register_module_forward_hook(leave)]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lending = self.lending
        if lending.internal_depth or func in _METADATA:
            return func(*args, **kwargs)
        for leaf in _pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.nn.Parameter) and \
                    id(leaf) in lending.table.partitioned_by_id and not holds_values(leaf):
                lending._use_external(leaf, self.stack[-1] if self.stack else lending.module)
        return func(*args, **kwargs)


def _with_hint(error, hint):
    """The Runtime's `error` (a full device budget) with what the lending knows said after it,
    its code and errno kept."""
    told = _strata.Error(f"{error} ({hint})")
    told.code, told.errno = error.code, getattr(error, "errno", 0)
    return told


def weakly(method, gone=None):
    """`method` (a bound method of the lending, or of the engine) called through a weak
    reference: once its object is gone, nothing, or with `gone` a RuntimeError saying it."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            if gone is not None:
                raise RuntimeError(gone)
            return None
        return bound(*args, **kwargs)
    return call


def _before_backward_of(t, module, before, entries):
    """`before(module)` runs once the gradient of `t`, one of `module`'s outputs, is made,
    before the module's own backward: a hook on `t`; where `t` is a view of a tensor made by a
    node that takes one of the module's trained parameters (`entries`, through a view of it at
    most: F.linear's output of a 3-D input, with a bias), also one on that node, whichever runs
    first: a view changed in place afterwards (ReLU(inplace), ``h += x``) is given a node of its
    own in the graph, and the hook on `t` no longer runs. (That node runs before the parameter's
    gradient is made, so never after the module's backward: a view of another tensor, the
    module's input say, is not hooked at its base, whose node would lend the parameters again
    once their gradients had given them back.) Once a backward (a retained graph's next
    backward runs it again)."""
    ran = [None]  # the backward it ran in

    def run(*unused):
        task = torch._C._current_graph_task_id()
        if ran[0] != task:
            ran[0] = task
            before(module)

    t.register_hook(run)
    base = t._base
    if base is not None and base.grad_fn is not None and \
            _takes_one_of(base.grad_fn, [e.param for e in entries]):
        base.grad_fn.register_prehook(run)


def _takes_one_of(node, params):
    """Whether autograd `node` takes one of `params` as an input, or a view of one (the
    parameter's gradient is made after it)."""
    for step, _ in node.next_functions:
        for leaf, _ in ((step, 0),) + (step.next_functions if step is not None else ()):
            variable = getattr(leaf, "variable", None)
            if variable is not None and any(variable is p for p in params):
                return True
    return False


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
