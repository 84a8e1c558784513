"""What the engine sets on the user's model and on torch while it holds them, and takes off.

- The engines not closed (LIVE), and torch.nn.utils' clipping over their parameters routed to
  them (route_clip_grad_norm, once, at import): their gradients are not in .grad.
- The module's own methods an engine stands in for (load_state_dict_through, zero_grad_through,
  save_pretrained_through: a peft model's adapters saved without reading its frozen base,
  generate_through: across ranks, generate's ranks kept in step as under DeepSpeed's ZeRO-3,
  num_parameters: a partitioned parameter counted by its real size).
- What a closed engine leaves: each partitioned parameter a placeholder of its shape without its
  bytes (leave_placeholders), refused by name by the module's forward and state_dict()
  (refuse_placeholders) and by strata.initialize (left_placeholders), until the module has its
  weights again (unguard); and a model whose parameters an engine not closed holds
  (engine_holding).

Thread safety: the engine's (one thread); the routing is installed once, at import.
"""

import contextlib
import functools
import gc
import weakref

import torch
import torch.optim.optimizer as optimizer_hooks

from strata import pretrained
from strata import placeholders, tiling
from strata.parameters import set_data

__all__ = ["LIVE", "PLACEHOLDERS_LEFT", "engine_holding", "engine_of", "leave_placeholders",
           "left_placeholders", "load_state_dict_through", "num_parameters",
           "refuse_placeholders", "route_clip_grad_norm", "save_pretrained_through",
           "generate_through", "unguard",
           "zero_grad_through"]

# The engines not closed: torch.nn.utils.clip_grad_norm_ over their parameters comes to them.
LIVE = weakref.WeakSet()
_CLIPPING = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")


def engine_of(params, what):
    """The engine not closed whose trained parameters are among `params` (None: no engine's);
    refused: two engines' parameters in one call."""
    found = [engine for engine in list(LIVE)
             if engine._runtime is not None and engine._owns_any(params)]
    if len(found) > 1:
        raise ValueError(f"{what} over the parameters of {len(found)} strata engines at once: "
                         "each engine's gradients are its own; accepted: one engine's "
                         "parameters a call")
    return found[0] if found else None


def route_clip_grad_norm():
    """Routes torch.nn.utils' clipping (what Trainer, Accelerate, Lightning and plain loops call
    between backward and step), once, when strata is imported: clip_grad_norm_ over an engine's
    parameters is the engine's (OptimizerStep.clip_by_user: the norm of its gradients wherever they are,
    with any other parameters' gradients given, and the step clipped by it, plain torch's
    arithmetic; a second call sees the first's clipping, as torch's does); clip_grad_value_ and
    clip_grads_with_norm_ over an engine's parameters are torch's where its gradients are torch's
    .grad, unscaled (stages 0-1 in one process, not fp16, no grad_accum_dtype sum apart), and
    refused by name elsewhere; over other parameters each is torch's own.

    torch wraps each of these in a no_grad wrapper that calls the function in its closure; the
    routing takes that function's place there, so the wrapper torch exposes stays the same
    object and a name imported from torch before strata was is routed too (a script that does
    `from torch.nn.utils import clip_grad_norm_` first would otherwise clip nothing at stages 2
    and 3, with no error)."""
    def clip_grad_norm_(torchs):
        def clip(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
            params = [parameters] if torch.is_tensor(parameters) else list(parameters)
            engine = engine_of(params, "torch.nn.utils.clip_grad_norm_")
            if engine is not None:
                return engine._clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite)
            return torchs(params, max_norm, norm_type=norm_type,
                          error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        return clip

    def refused(name):
        def route(torchs):
            def clip(parameters, *args, **kwargs):
                params = [parameters] if torch.is_tensor(parameters) else list(parameters)
                engine = engine_of(params, f"torch.nn.utils.{name}")
                apart = engine._gradients_apart() if engine is not None else None
                if apart is not None:
                    raise ValueError(
                        f"torch.nn.utils.{name} over a strata engine's parameters where their "
                        f"gradients are not torch's .grad ({apart}): it would clip nothing, or "
                        "the scaled values; accepted: torch.nn.utils.clip_grad_norm_, or "
                        "gradient_clipping in the config")
                return torchs(params, *args, **kwargs)
            return clip
        return route

    for name in _CLIPPING:
        exposed = getattr(torch.nn.utils, name, None)
        if exposed is None:
            continue
        route = clip_grad_norm_ if name == "clip_grad_norm_" else refused(name)
        cells = dict(zip(exposed.__code__.co_freevars, exposed.__closure__ or ()))
        if "func" in cells:  # torch's no_grad wrapper (torch.nn.utils.clip_grad._no_grad)
            if not getattr(cells["func"].cell_contents, "_strata", False):
                cells["func"].cell_contents = route(cells["func"].cell_contents)
                cells["func"].cell_contents._strata = True
        elif not getattr(exposed, "_strata", False):  # another torch: its name replaced
            stand_in = functools.wraps(exposed)(route(exposed))
            stand_in._strata = True
            setattr(torch.nn.utils, name, stand_in)
            setattr(torch.nn.utils.clip_grad, name, stand_in)


route_clip_grad_norm()


def _refuse_a_foreign_optimizer(optimizer, args, kwargs):
    """torch's global step pre-hook (registered once, below): an optimizer that is not an
    engine's (nor a wrapper over its parameter groups, as Accelerate's) stepping a strata
    engine's trained parameters is refused by name. Their gradients are the engine's (at stages
    2 and 3 not in .grad: it would step nothing) and their fp32 master weights too (the engine's
    next step would put back what it changed)."""
    del args, kwargs
    if not LIVE:
        return
    groups = getattr(optimizer, "param_groups", None) or []
    params = [p for g in groups for p in g.get("params", ())]
    engine = engine_of(params, f"{type(optimizer).__name__}.step()")
    if engine is None:
        return
    own = {id(g) for g in engine.optimizer.param_groups}
    if any(id(g) in own for g in groups):  # the engine's optimizer, or a wrapper over it
        return
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() over a strata engine's parameters: it is not the "
        "engine's optimizer, and their gradients and fp32 master weights are the engine's (at "
        f"stage {engine.stage} it would "
        f"{'step nothing' if engine.stage >= 2 else 'be undone by the engine'}); accepted: the "
        "optimizer strata.initialize returns (give yours to strata.initialize(optimizer=...))")


optimizer_hooks.register_optimizer_step_pre_hook(_refuse_a_foreign_optimizer)


def engine_holding(model):
    """The engine not closed that holds any of `model`'s parameters (None: none does). One that
    nothing reaches any more (a reference cycle: a notebook's cell run again over the same
    model) is collected first."""
    ids = {id(p) for p in model.parameters()}

    def holding():
        return next((engine for engine in list(LIVE) if engine._runtime is not None and any(
            id(e.param) in ids for e in engine.table.entries())), None)
    if holding() is None:
        return None
    gc.collect()
    return holding()


def leave_placeholders(model_ref, params, dtype, device):
    """What a closed engine (or one dropped without close) leaves of its partitioned `params`
    ((parameter, shape) pairs): each its shape again without its bytes (one element, expanded),
    and the module (`model_ref`, a weak reference) refusing them by name
    (refuse_placeholders)."""
    for p, shape in params:
        set_data(p, torch.zeros((), dtype=dtype, device=device).expand(shape))
        placeholders.leave(p, shape)  # (its own reads refused too)
    model = model_ref()
    if model is not None:
        refuse_placeholders(model)


def refuse_placeholders(model):
    """After close: the engine's partitioned parameters are placeholders of their shape without
    their bytes (marked by placeholders.leave); a module holding one refuses forward and
    state_dict() by name, where it would compute with zeros and save zeros (save_pretrained
    after the engine's last reference was dropped), and strata.initialize refuses it
    (left_placeholders)."""

    def refuse(module, what):
        held = left_placeholders(module)
        if held:
            raise RuntimeError(f"{what} of {type(module).__name__} ({', '.join(held[:3])}): "
                               f"{PLACEHOLDERS_LEFT}")

    for module in model.modules():
        if module not in _GUARDED and left_placeholders(module):
            _GUARDED[module] = (
                module.register_forward_pre_hook(lambda m, args: refuse(m, "forward")),
                module.register_state_dict_pre_hook(
                    lambda m, prefix, keep_vars: refuse(m, "state_dict()")))


PLACEHOLDERS_LEFT = placeholders.PLACEHOLDERS_LEFT


def unguard(model):
    """Removes close's refusing hooks from `model`'s modules and its parameters' records (their
    weights are given back: the model is plain torch's, no weak reference left on them)."""
    for module in model.modules():
        for handle in _GUARDED.pop(module, ()):
            handle.remove()
    placeholders.unguard(model.parameters(), closed=True)


def num_parameters(module, only_trainable=False, exclude_embeddings=False):
    """transformers' PreTrainedModel.num_parameters, a partitioned parameter counted by its real
    size (ds_numel) rather than its placeholder's."""
    embeddings = {f"{name}.weight" for name, m in module.named_modules()
                  if isinstance(m, torch.nn.Embedding)} if exclude_embeddings else set()
    return sum(getattr(p, "ds_numel", p.numel()) for name, p in module.named_parameters()
               if name not in embeddings and (p.requires_grad or not only_trainable))


def load_state_dict_through(engine_ref, prefix=""):
    def load_state_dict(module, state_dict, strict=True, assign=False):
        """As torch's, for a module an engine trains (or, with `prefix`, its submodule of that
        name, whose own load_state_dict would copy into placeholders): the weights stream into
        its partitions and the optimizer's master weights (engine.load_pretrained's rules:
        every missing, unexpected or wrongly shaped tensor named before anything changes), and
        the optimizer keeps its state (moments, step counts), as torch's module.load_state_dict
        leaves its optimizer's (engine.load_pretrained starts it afresh)."""
        engine = engine_ref()
        if engine is None:
            raise RuntimeError("load_state_dict: the engine training this module is gone")
        if assign:
            raise ValueError("load_state_dict: assign=True is not supported for a module an "
                             "engine trains (its parameters are the engine's partitions); "
                             "accepted: assign=False")
        state_dict = dict(state_dict)
        for name, child in module.named_modules():  # a TiledLinear's weight whole, cut
            if isinstance(child, tiling.TiledLinear):
                tiling.cut_whole(child, state_dict, f"{name}." if name else "")
        if not prefix:
            missing, unexpected = pretrained.load(engine, state_dict, strict, keep_state=True)
            return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
        keys = list(module.state_dict(keep_vars=True))  # (nothing gathered)
        own = set(keys)
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                f"{missing[:5]}, unexpected keys {unexpected[:5]}; accepted: the keys of "
                "module.state_dict(), or strict=False")
        pretrained.load(engine, {prefix + k: v for k, v in state_dict.items() if k in own},
                        strict=False, keep_state=True)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
    return load_state_dict


def save_pretrained_through(engine_ref):
    def save_pretrained(module, save_directory, safe_serialization=True, selected_adapters=None,
                        save_embedding_layers="auto", is_main_process=True, **kwargs):
        """peft's save_pretrained, for a peft model an engine trains with its frozen base
        partitioned (stage 3): without a state_dict given, the adapters' entries are
        engine.state_dict_to_save's, the frozen base's weights not read (peft's would read
        them all, once for each adapter). Across ranks every rank calls it (the adapters'
        weights partitioned are gathered); the ones that do not save pass is_main_process=False,
        as peft says."""
        engine = engine_ref()
        live = engine is not None and engine._runtime is not None
        known = selected_adapters is None or all(a in module.peft_config
                                                 for a in selected_adapters)
        if live and known and kwargs.get("state_dict") is None:
            kwargs["state_dict"] = engine.state_dict_to_save(
                module, adapters=selected_adapters, save_embedding_layers=save_embedding_layers)
        # Given a state dict, peft takes the weights from it; a module kept whole beside the
        # adapters (modules_to_save) still lists its keys with its own state_dict(), which must
        # not read them again (across ranks, a gather on the saving rank alone).
        with engine.keys_only() if live and kwargs.get("state_dict") is not None \
                else contextlib.nullcontext():
            return type(module).save_pretrained(
                module, save_directory, safe_serialization=safe_serialization,
                selected_adapters=selected_adapters, save_embedding_layers=save_embedding_layers,
                is_main_process=is_main_process, **kwargs)
    return save_pretrained


def generate_through(engine_ref, module):
    """Sets on `module` (a transformers model an engine trains across ranks at stage 3) the
    generate of transformers under DeepSpeed's ZeRO-3: synced_gpus on unless said otherwise (a
    rank whose sequences have ended goes on running forwards, each a gather the others join,
    until every rank's have), its flag summed over the ranks through the engine's own
    collectives (a loop of one's own has no torch.distributed group)."""
    own = type(module)._has_unfinished_sequences

    def generate(*args, synced_gpus=None, **kwargs):
        return type(module).generate(module, *args, **kwargs, synced_gpus=(
            True if synced_gpus is None else synced_gpus))

    def has_unfinished_sequences(this_peer_finished, synced_gpus, device):
        engine = engine_ref()
        if not synced_gpus or engine is None or engine.ranks is None:
            return own(module, this_peer_finished, synced_gpus, device)
        return engine.ranks.all_reduce_sum([0.0 if this_peer_finished else 1.0])[0] > 0
    module.generate = generate
    module._has_unfinished_sequences = has_unfinished_sequences


def refuse_deepcopy(memo=None):
    """copy.deepcopy of a module an engine trains (set on the module while the engine holds it)."""
    raise TypeError("copy.deepcopy of a module a strata engine trains: the copy would keep the "
                    "engine's methods and hooks (at stage 3 its partitions too) and follow the "
                    "engine as it trains; accepted: copy it before strata.initialize, or build a "
                    "new model and load engine.module_state_dict() into it (or model = "
                    "engine.release() to end training first)")


def zero_grad_through(engine_ref):
    def zero_grad(module, set_to_none=True):
        """As torch's, for a module an engine trains: its gradients are the engine's
        (Engine.zero_grad drops them), and any other parameter's .grad is torch's to zero."""
        engine = engine_ref()
        if engine is not None and engine._runtime is not None:
            engine.zero_grad(set_to_none)
        torch.nn.Module.zero_grad(module, set_to_none)
    return zero_grad


def convert_through(engine_ref):
    def _apply(module, fn, *args, **kwargs):
        """nn.Module._apply (model.to(...), .half(), .float()) of the module an engine trains: a
        change of its parameters' dtype is refused by name (the engine computes in the config's
        dtype from fp32 master weights, and its next step would write the weights anew: the
        conversion's rounding lost silently, or a dtype the engine does not train in); a move or
        a conversion to their own dtype goes on as torch's."""
        engine = engine_ref()
        if engine is not None and engine._runtime is not None:
            for p in module.parameters():
                if p.is_floating_point():
                    converted = fn(torch.empty((), dtype=p.dtype, device=p.device)).dtype
                    if converted != p.dtype:
                        raise TypeError(
                            f"{type(module).__name__}.to({converted}) (.half(), .float(), "
                            f".bfloat16()) of a module a strata engine trains in {p.dtype}: the "
                            "engine computes in the config's dtype from fp32 master weights, and "
                            "its next step would write the weights anew; accepted: the dtype "
                            "set in the config (its bf16 or fp16 block) before "
                            "strata.initialize, or the conversion after engine.release()")
                    break
        with placeholders.own():  # (stage 3: the placeholders converted as they are)
            return type(module)._apply(module, fn, *args, **kwargs)
    return _apply


def save_to_state_dict(module, *args, **kwargs):
    """nn.Module._save_to_state_dict of a module owning partitioned parameters (stage 3): torch's,
    whose entries are the placeholders (detached), which the engine's state_dict post-hook
    replaces with the weights whole."""
    with placeholders.own():
        return type(module)._save_to_state_dict(module, *args, **kwargs)


_GUARDED = weakref.WeakKeyDictionary()


def left_placeholders(module, recurse=False):
    """The names of `module`'s parameters that are still a closed engine's placeholders (not
    given their weights since: p.data = ..., load_state_dict(..., assign=True))."""
    return [name for name, p in module.named_parameters(recurse=recurse, remove_duplicate=False)
            if placeholders.left_by_closed(p)]
