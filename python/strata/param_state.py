"""One parameter's training state read or set whole: DeepSpeed's deepspeed.utils.safe_get_full_*,
safe_set_full_* and their local variants, for what plain torch reads in .grad, in the
parameter and in optimizer.state[p], where the engine keeps them (partitions, host sums, shards
across ranks, the optimizer's fp32 master weights and moments).

    safe_get_full_fp32_param(p)            the fp32 master weights, p's shape
    safe_get_full_optimizer_state(p, key)  "exp_avg", "exp_avg_sq" (Adam), "sum" (Adagrad),
                                           "exp_avg" (Lion), p's shape, fp32
    safe_get_full_grad(p)                  the gradient summed since the last step (between
                                           backward and step; None where it has none), p's shape
    safe_set_full_fp32_param(p, value)     the master weights and the weights
    safe_set_full_optimizer_state(p, value, key)
    safe_set_full_grad(p, value)           the gradient the step takes (between backward and
                                           step), as plain torch's `p.grad = value`
    safe_get_local_*(p[, key]), safe_set_local_*(p, value[, key])
                                           this rank's shard, flat (in one process: all of it)

A parameter no engine trains gives None (safe_get_full_grad: a copy of its .grad), as DeepSpeed's
(the getters), or is refused (the setters). Across ranks the full variants are collectives: every
rank calls them, for the same parameters in the same order (as DeepSpeed's at ZeRO-3); the local
ones and safe_set_full_grad are not (each rank takes its own shard of the whole value). The values
are copies, on the CPU in fp32 (the gradient in the dtype and on the device it is kept on: .grad's
at stages 0-1 in one process, grad_accum_dtype on the CPU elsewhere), the weights edited in place
since the last step taken first (strata/edits.py), as torch's .grad is after GradScaler.unscale_:
in fp16 the loss scale divided out, a clip_grad_norm_ called before applied; a gradient is set as
it is read (strata/gradients.py: Gradients.replace). The state setters
take effect from the next step and are refused between backward and step (a step staged during
backward reads the state); the master weights and moments of a partition that stepped during
this backward (strata.optimizer_during_backward) are refused then too. The gradient setters are
for between backward and step: a step staged with the old gradient is taken anew.

Thread safety: the engine's (one thread).
"""

import torch

from strata import checkpoints
from strata import guards
from strata.optimizer import EngineOptimizer
from strata.parameters import read_state, set_weights

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]

def _entry(param, where):
    """(engine, entry) of the engine training `param`, or (None, None)."""
    engine = guards.engine_of([param], where)
    if engine is None:
        return None, None
    return engine, engine.table.trained_by_id[id(param)]


def _state_index(engine, key, where):
    """Which of the optimizer's state tensors `key` names (0: master weights)."""
    names = EngineOptimizer._STATE_NAMES[engine.optimizer_kind]
    if key is None and where.endswith("fp32_param"):
        return 0
    if key not in names:
        raise ValueError(f"{where}: optim_state_key {key!r}: the engine's optimizer "
                         f"({engine.optimizer_kind}) keeps {', '.join(map(repr, names))}")
    return 1 + names.index(key)


def _own_range(engine, e):
    """The elements of e's flat whole this rank's shard holds: (start, stop)."""
    return (0, e.numel) if engine.ranks is None else engine.ranks.own_range(e.numel, e.shard)


def _read_state(engine, e, index, where):
    """This rank's shard of e's master weights (index 0) or a moment, fp32, e.shard elements;
    refused where e stepped during this backward (what is read would be after the step that
    plain torch takes at step())."""
    engine._step.refuse_read_after_early_steps(f"{where}({e.name})", e)
    engine._take_edits()  # (the weights edited since the last step: in the master weights)
    engine.runtime.wait_for_early_steps()
    return read_state(engine.runtime, e)[index]


def _whole(engine, e, shard, what):
    """e's whole flat values from every rank's shard (in one process, the shard itself)."""
    if engine.ranks is None:
        return shard[:e.numel]
    return engine.ranks.gather_tensor(shard.contiguous(), f"{e.name}'s {what}")[:e.numel]


def _get_state(param, key, full, kind):
    where = f"safe_get_{'full' if full else 'local'}_{kind}"
    engine, e = _entry(param, where)
    if engine is None:
        return None
    shard = _read_state(engine, e, _state_index(engine, key, where), where)
    if full:
        return _whole(engine, e, shard, key or "master weights").view(e.shape)
    start, stop = _own_range(engine, e)
    return shard[:stop - start]


def _values(where, value, engine, e, full):
    """`value` checked for e (its shape whole, or this rank's shard flat): this rank's elements
    of it, flat fp32 on the CPU."""
    start, stop = _own_range(engine, e)
    wanted = e.numel if full else stop - start
    value = torch.as_tensor(value)
    if value.is_complex() or (full and value.dim() > 1 and tuple(value.shape) != e.shape):
        raise ValueError(f"{where}: a value of shape {tuple(value.shape)} and dtype "
                         f"{value.dtype} for {e.name}; accepted: a real tensor of its shape "
                         f"{e.shape} (or flat, {e.numel} elements)")
    values = value.detach().to("cpu", torch.float32).reshape(-1)
    if values.numel() != wanted:
        raise ValueError(f"{where}: a value of {values.numel()} elements for {e.name}, whose "
                         f"{'whole' if full else 'shard on this rank'} has {wanted}; accepted: "
                         f"{'its shape ' + str(e.shape) if full else 'this rank' + chr(39) + 's'}"
                         f"{'' if full else ' shard, flat (safe_get_local_*)'}")
    return values[start:stop] if full else values


def _trained_or_refused(param, where):
    engine, e = _entry(param, where)
    if engine is None:
        raise ValueError(f"{where}: the parameter (shape {tuple(param.shape)}) is not one a "
                         "strata engine trains; accepted: a parameter of engine.module that "
                         "requires grad")
    return engine, e


def _set_state(param, value, key, full, kind):
    where = f"safe_set_{'full' if full else 'local'}_{kind}"
    engine, e = _trained_or_refused(param, where)
    index = _state_index(engine, key, where)
    if engine._state.gradients_since_step:
        raise RuntimeError(f"{where} between backward and step: the step (staged during "
                           "backward) reads the state; accepted: after step() or before "
                           "backward")
    values = _values(where, value, engine, e, full)
    engine.runtime.wait_for_early_steps()
    state = read_state(engine.runtime, e)
    state[index].zero_()
    state[index][:values.numel()] = values
    with checkpoints.loading_optimizer_state(engine._checkpoints, where, whole=False):
        engine.runtime.load_optimizer_state(e.gid, *state)
    if index == 0:  # the weights are the master weights' rounding
        if e.partitioned:
            set_weights(engine.runtime, e, state[0])
        elif full or engine.ranks is None:
            set_weights(engine.runtime, e, _whole(engine, e, state[0], "master weights"))
            engine._edits.written([e])
        else:  # (a local shard's: at the next step's all-gather)
            engine._edits.behind(e)


def safe_get_full_fp32_param(param):
    """param's fp32 master weights whole (its shape, on the CPU), or None."""
    return _get_state(param, None, True, "fp32_param")


def safe_get_full_optimizer_state(param, optim_state_key):
    """param's optimizer state `optim_state_key` whole (fp32, its shape, on the CPU), or None."""
    return _get_state(param, optim_state_key, True, "optimizer_state")


def safe_get_local_fp32_param(param):
    """This rank's shard of param's fp32 master weights (flat), or None."""
    return _get_state(param, None, False, "fp32_param")


def safe_get_local_optimizer_state(param, optim_state_key):
    """This rank's shard of param's optimizer state `optim_state_key` (flat), or None."""
    return _get_state(param, optim_state_key, False, "optimizer_state")


def safe_set_full_fp32_param(param, value):
    """param's fp32 master weights (and its weights, their rounding) set to `value` whole."""
    _set_state(param, value, None, True, "fp32_param")


def safe_set_full_optimizer_state(param, value, optim_state_key):
    """param's optimizer state `optim_state_key` set to `value` whole."""
    _set_state(param, value, optim_state_key, True, "optimizer_state")


def safe_set_local_fp32_param(param, value):
    """This rank's shard of param's fp32 master weights set to `value` (flat); across ranks the
    weights follow at the next step's all-gather."""
    _set_state(param, value, None, False, "fp32_param")


def safe_set_local_optimizer_state(param, value, optim_state_key):
    """This rank's shard of param's optimizer state `optim_state_key` set to `value` (flat)."""
    _set_state(param, value, optim_state_key, False, "optimizer_state")


def _get_grad(param, full):
    where = f"safe_get_{'full' if full else 'local'}_grad"
    engine, e = _entry(param, where)
    if engine is None:
        return None if param.grad is None else param.grad.detach().clone()
    engine._take_assigned_grads(e)
    # (a clip_grad_norm_ of this step is applied at the step; in fp16 the loss scale divided
    # out: torch's .grad after GradScaler.unscale_, where clipping happens)
    factor = 1.0 / engine.loss_scale
    if engine._step.user_clip is not None:
        factor *= engine._step.user_clip
    if engine.ranks is None:
        g = engine._gradients.held(e) if param.grad is None else param.grad.detach().reshape(-1)
        if g is None:
            return None
        g = g * factor if factor != 1.0 else g.clone()
        return g.view(e.shape) if full else g
    start, stop = _own_range(engine, e)
    unreduced = engine._gradients.unreduced_here(e)  # (the same on every rank)
    if not full:  # (this rank's own: no collective)
        if unreduced:
            raise RuntimeError(_unreduced(where, e))
        g = engine._gradients.held(e)
        return None if g is None else (g * factor)[:stop - start]
    if not engine.ranks.agree(f"{where}({e.name})", not unreduced):
        raise RuntimeError(_unreduced(where, e))
    g = engine._gradients.held(e)
    present, = engine.ranks.all_reduce_sum([0.0 if g is None else 1.0])
    if not present:
        return None
    if g is None:
        g = torch.zeros(e.shard, dtype=engine.grad_accum_dtype)
    return _whole(engine, e, g * factor, "gradient").view(e.shape)


def _set_grad(param, value, full):
    where = f"safe_set_{'full' if full else 'local'}_grad"
    engine, e = _trained_or_refused(param, where)
    engine._take_assigned_grads(e)
    if engine.ranks is not None and engine._gradients.unreduced_here(e):
        raise RuntimeError(_unreduced(where, e))
    engine._gradients.replace(e, _values(where, value, engine, e, full), f"{where}({e.name})")


def _unreduced(where, e):
    return (f"{where}({e.name}) across ranks before the window's gradients are reduced (stage "
            "1, or stage 3's small parameters, before the window's last backward); accepted: "
            "after the window's last backward, before step()")


def safe_get_full_grad(param):
    """param's gradient summed since the last step, whole (its shape), or None."""
    return _get_grad(param, full=True)


def safe_get_local_grad(param):
    """This rank's shard of param's gradient summed since the last step (flat), or None."""
    return _get_grad(param, full=False)


def safe_set_full_grad(param, value):
    """param's gradient since the last step set to `value` whole (its shape), between backward
    and step: what the step (and a clip_grad_norm_ after it) takes."""
    _set_grad(param, value, full=True)


def safe_set_local_grad(param, value):
    """This rank's shard of param's gradient set to `value` (flat), between backward and step."""
    _set_grad(param, value, full=False)
