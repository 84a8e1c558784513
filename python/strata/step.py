"""The optimizer step: staged during backward (each partitioned parameter's step as its gradient
is final, speculatively with no clipping and no overflow) and committed after it when that was the
step to take, else dropped and taken anew (clipping by the global norm, the fp16 loss scale and
overflow exact); the commit changes everything or nothing (with strata.optimizer_commit
"partition", each NVMe partition commits as it is written, so the step is staged during backward
only where nothing can drop it), and the new weights reach the parameters (their host copies, or
read back from the master weights when homed on NVMe).
docs/engine.md says why the staged step is exact.

`OptimizerStep` owns the step: the one being staged, whether the next is speculated or held,
the partitions that stepped early, the order the gradient hook met the parameters in, the user's
clipping, the new weights still to write from the master weights, and the optimizer's NVMe byte
counts. The engine builds it with what it uses (the parameter table, the ranks, the training
state, the loss scaler, the gradients' host copies, the config, its warnings) and hands it the
Runtime and the optimizer (whose groups give each parameter's rates). Thread safety: the
engine's (one thread).
"""

import math
import time

import torch
from torch.utils.dlpack import from_dlpack

from strata import _strata
from strata.parameters import data_of, set_weights

__all__ = ["OptimizerStep"]


class _Staged:
    """The optimizer step being staged during backward (Runtime.begin_optimizer_step): each
    partitioned parameter's step is staged as autograd makes its gradient final, speculatively
    with no clipping and no overflow; engine.step() commits it when that was right, else aborts
    it and steps again."""

    def __init__(self, scale, early=False, held=False):
        self.scale = scale  # the loss scale the gradients were made with
        self.entries = []  # staged _Param entries, their targets pinned in the host tier
        self.early = early  # host-resident partitions step in place as they are staged
        # Held: the NVMe state is read ahead as staged, and nothing steps until the gradients'
        # scale is known after backward (finish_staged).
        self.held = held


class OptimizerStep:
    """The engine's optimizer step (see the module's docstring)."""

    def __init__(self, table, ranks, state, scaler, copies, notices, config, *, dtype, device,
                 refresh, optimizer_on_host, read_ahead, commit_each):
        self.table = table  # strata/parameters.py
        self.ranks = ranks  # strata/ranks.py; None in one process
        self.state = state  # strata/training_state.py
        self.scaler = scaler  # strata/loss_scaler.py
        self.copies = copies  # strata/gradients.py HostCopies
        self.notices = notices  # strata/notices.py
        self.config = config  # strata/config.py TrainConfig
        self.dtype = dtype
        self.device = device
        self.runtime = None  # the engine's, handed once made; None once it is closed
        self.optimizer = None  # the engine's (its param_groups: each parameter's rates)
        # Parameters homed on NVMe take their new weights from the committed master weights
        # (refresh_weights) rather than from host copies (the engine's set-up decides).
        self.refresh = refresh
        self.pending_refresh = []  # their new weights not written yet: before the next forward
        self.refresh_error = None  # a step's new weights not all written: step() raises it
        # The optimizer state in host memory (offload_optimizer "cpu"): its partitions may step
        # in place during backward when nothing learnt after backward can change the step.
        self._optimizer_on_host = optimizer_on_host
        # strata.optimizer_commit "partition" with the state on NVMe: each partition's new state
        # lands as it is written, so a step once begun is not dropped.
        self.commit_each = commit_each
        # The step staged during backward (stages 2 and 3): on until a step needs clipping, then
        # off until one does not. Across ranks each shard's step is staged once its gradient is
        # reduce-scattered; after backward the ranks agree that every one's staged step stands
        # before any commits (finish_staged).
        self.staged = None
        self._speculate = True
        self._redo_reason = None  # the staged step was dropped during this backward
        # A step that cannot be speculated is staged held (_may_hold) where the optimizer has
        # room to read its NVMe state ahead; not after a second gradient.
        self._read_ahead = read_ahead
        self._hold = True
        # Host-resident partitions that stepped in place during this backward before the staged
        # step was dropped: they are not stepped again.
        self.stepped_early = set()
        self.early_held = []  # their host copies, released written after backward
        # A load that failed part way with commit_each: what it had loaded stays (checkpoints).
        self.half_loaded = None
        # The parameters whose step the gradient hook stages in the boundary micro-batch (or
        # would, were staging paused), in that order, as dict keys: a step after backward stages
        # them first, in that order, as backward's staging would have (the optimizer's read-ahead
        # room is laid out in the order staged, and a step finds there what the last one left
        # only at the same place).
        self._hook_order = {}
        self._second_gradient = False  # one of them ran twice: staging pauses for a step
        self.redone_steps = 0  # staged steps dropped and taken anew
        self.last_redo_reason = None
        # torch.nn.utils.clip_grad_norm_ called by the user between backward and step
        # (clip_by_user): this step's coefficient, and whether the user clips at all (then no
        # partition steps for good during backward: the coefficient comes after it).
        self.user_clip = None
        self.user_clips = False
        # Whether the user sets gradients between backward and step (Gradients.replace): then
        # nothing is staged during backward (a step staged with a gradient changed after is
        # dropped).
        self.user_sets_gradients = False
        # Whether a learning rate, weight decay or betas was set between the window's last
        # backward and its step (the same value too: rate_set), or changed after a step was
        # staged: then no partition steps for good during backward (_may_step_early) with a rate
        # the user may change after it; a staged step that can be dropped still is.
        self.rates_set_after_backward = False
        self._weights_sent = None  # the event after the last step's new weights went to the GPU
        self.optimizer_read = self.optimizer_written = 0  # the optimizer's NVMe bytes

    def stage_from_hook(self, e, grad=None, grad_stream=None):
        """The gradient hook's: e's gradient is final in the boundary micro-batch; its step is
        staged (stage()), and its place in the order the hook met the parameters kept."""
        self._hook_order[e] = None
        self.stage(e, grad, grad_stream=grad_stream)

    def second_gradient(self, e):
        """A second gradient of e in the boundary micro-batch (a second backward through it): a
        step staged from the first cannot stand, and its hold on the gradient goes before the
        gradient is added to; staging pauses for the next step."""
        self._second_gradient = True
        e.grad_norm = None  # the sum's is taken after backward
        if e.staged is not None:
            self.drop_staged(f"the gradient of {e.name} changed after its step was staged")

    def end_window(self):
        """The step is over (taken, skipped or failed): what this window learnt sets the next
        one's staging."""
        self.stepped_early.clear()
        self._redo_reason = None
        # Staged again from the next step unless this one was clipped or saw a second gradient.
        self._speculate = self._speculate and not self._second_gradient
        self._hold = not self._second_gradient  # a held step would be dropped again
        self._second_gradient = False
        self.user_clip = None  # the user's clip_grad_norm_ of this step
        self._hook_order.clear()

    def release_early_held(self, attempt):
        """The host copies of partitions that stepped early in a dropped step, held until
        backward was over: released written (each through `attempt`)."""
        held, self.early_held = self.early_held, []
        for e in held:
            attempt(lambda pid: self.runtime.release(pid, "host", True, traced=False), e.pid)

    def rate_set(self):
        """A group's lr, weight_decay or betas was set (EngineOptimizer.watch_rates): set after
        the window's last backward began, before its step (a loop that sets its rates between
        backward and step, the same value too), it ends stepping for good during backward for
        the rest of the run (_may_step_early), before any partition steps with a rate the loop
        would change after it."""
        if self.state.gradients_since_step and self.state.is_boundary():
            self.rates_set_after_backward = True

    def _hyper_of(self, e):
        """(lr, weight_decay, beta1, beta2) of e's group now (a schedule may have changed them;
        the betas -1, the optimizer's own, where it has none: Adagrad)."""
        group = self.optimizer.param_groups[e.group_index]
        if not self.optimizer.has_betas:
            return float(group["lr"]), float(group["weight_decay"]), -1.0, -1.0
        betas = group["betas"]
        try:
            beta1, beta2 = betas
            if isinstance(beta1, str) or isinstance(beta2, str):
                raise TypeError
            beta1, beta2 = float(beta1), float(beta2)
            if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):  # (C++ takes < 0 as its own)
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"param group {e.group_index}'s betas are {betas!r}; accepted: two "
                             "numbers, each at least 0 and below 1") from None
        return float(group["lr"]), float(group["weight_decay"]), beta1, beta2

    def stage(self, e, grad=None, clip=1.0, always=False, grad_stream=None):
        """Stages e's optimizer step (its gradient is final; `clip`: the clipping coefficient):
        the Runtime's optimizer thread reads its NVMe state, steps it and writes it to fresh
        extents (during backward, when staged from the gradient hook); the new weights reach the
        parameter when the step commits. A partitioned parameter's gradient is its gradient
        partition (taken from the host tier by that thread, one at a time) and its new weights go
        into its host copy, pinned until then (with parameters homed on NVMe, they are read back
        from the committed master weights instead, one at a time: refresh_weights); another's are
        given (`grad`; with `grad_stream`, a CUDA stream where its copy into it is still queued:
        the optimizer's thread reads it once that copy has run). Without `always`, nothing is
        staged while staging is paused."""
        if e in self.stepped_early:  # it stepped during a backward whose step was dropped
            return
        if self.half_loaded is not None:  # step() refuses; nothing may land meanwhile
            return
        staged = self.staged
        if staged is None:
            hold = False
            if not always:
                # (a step staged with gradients the user then changes would be dropped)
                if self._redo_reason is not None or self.user_sets_gradients:
                    return
                # With commit_each each partition's step lands as it is taken: it speculates
                # only where none is dropped.
                if not self._speculate or (self.commit_each and not self._may_step_early()):
                    if not self._may_hold():
                        return
                    hold = True  # its state read ahead; stepped once the scale is known
            early = not always and not hold and self._host_early()
            try:
                self.runtime.begin_optimizer_step(host_early=early, hold=hold)
            except _strata.Error as error:
                if always:
                    raise
                # The last step's state written behind it could not be stored, say: nothing is
                # staged during this backward; step() begins again and raises it.
                self._redo_reason = f"beginning the step failed: {error}"
                return
            staged = self.staged = _Staged(self.scaler.scale, early, hold)
        lr, weight_decay, beta1, beta2 = self._hyper_of(e)
        try:
            target = None
            if not e.partitioned:
                target = self._weights_target(e)
            elif not self.refresh:
                target = from_dlpack(self.runtime.acquire(e.pid, "host", traced=False))
            elif self.commit_each:
                # Its gradient is final: nothing uses the parameter again before the step (the
                # Runtime leaves one still lent to the device alone, and it is read back then).
                # The optimizer's thread writes its new weights into its partition once its
                # state has landed (no read-back).
                target = e.pid
            e.staged = ((lr, weight_decay, beta1, beta2), target)
            staged.entries.append(e)
            self.runtime.stage_optimizer_step(
                e.steps + 1, [(e.gid, grad, target)], lr=lr, grad_scale=clip / staged.scale,
                check_overflow=self.config.checks_overflow and not self.commit_each,
                weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                grad_stream=None if grad_stream is None else grad_stream.cuda_stream)
        except _strata.Error as error:
            if always:
                raise
            # Staging is the step done early; when it cannot be (the host tier has no room for
            # the parameter's copy, say), the step is taken after backward, as unstaged.
            self.drop_staged(f"staging the step of {e.name} failed: {error}")

    def _weights_target(self, e):
        """Where the optimizer writes an unpartitioned parameter's new weights (in the training
        dtype): the parameter itself when it is a contiguous CPU tensor, else a copy made for
        it (_write_back_weights puts it in place)."""
        if self.ranks is not None:  # this rank's shard, all-gathered after the step
            return torch.empty(e.shard, dtype=self.dtype)
        if e.param.device.type == "cpu" and e.param.is_contiguous():
            return data_of(e.param).reshape(-1)
        if e.param.device.type == "cuda":
            # Pinned and kept from step to step: the new weights go to the GPU on torch's
            # stream without the host waiting (_write_back_weights); the last step's copies out
            # of it have run before it is written again.
            if self._weights_sent is not None:
                self._weights_sent.synchronize()
                self._weights_sent = None
            if e.pinned_weights is None:
                e.pinned_weights = torch.empty(e.numel, dtype=self.dtype, pin_memory=True)
            return e.pinned_weights
        return torch.empty(e.numel, dtype=self.dtype)

    def stepped_during_backward(self, e=None):
        """Whether parameters (`e`, or any) may have stepped for good during this backward
        (strata.optimizer_during_backward): what they hold is the step's result already."""
        if e is None:
            return bool(self.stepped_early) or (self.staged is not None and self.staged.early)
        return e in self.stepped_early or (self.staged is not None and self.staged.early
                                           and e.staged is not None)

    def refuse_read_after_early_steps(self, what, e=None):
        """Refuses `what`, a read of weights or optimizer state between backward and step, where
        parameters (`e`, or any) stepped for good during this backward
        (strata.optimizer_during_backward): it would read the step's result, where plain torch's
        weights and optimizer state change at step()."""
        if self.stepped_during_backward(e):
            raise RuntimeError(
                f"{what} between backward and step, after {'parameters' if e is None else 'it'} "
                "stepped during backward (strata.optimizer_during_backward): what it reads is "
                "the step's result already, where plain torch's changes at step(); accepted: "
                "before backward or after step(), or strata.optimizer_during_backward false")

    def owns_any(self, params):
        """Whether any of `params` is one of the engine's trained parameters."""
        return any(id(p) in self.table.trained_by_id for p in params)

    def clip_by_user(self, params, max_norm, norm_type, error_if_nonfinite, adopt_backward):
        """torch.nn.utils.clip_grad_norm_(params, max_norm) called by the user over the engine's
        parameters (guards.route_clip_grad_norm): the gradients are in the engine (partitions,
        host sums), not in .grad, where torch's would find none and clip nothing. Returns the
        total norm of the unscaled gradients, as torch's (a 0-d fp32 tensor), and the step that
        follows is clipped by max_norm / (norm + 1e-6) when that is under 1 (then by the config's
        gradient_clipping too, on the norm so clipped), plain torch's arithmetic; where every
        gradient of the engine's is its .grad still (stages 0-1 in one process), they are
        clipped there in place instead, as torch's. Other parameters given (not the engine's)
        count in the norm with their .grad, clipped in place as torch's. A second call in the step sees the first's
        clipping, as torch's does. Refused: a norm other than 2, a part of the engine's
        parameters, a micro-batch before the accumulation boundary (it would clip a partial sum),
        no backward since the step. From the first such call on nothing steps for good during
        backward (the coefficient comes after it)."""
        where = "torch.nn.utils.clip_grad_norm_ over the engine's parameters"
        if float(norm_type) != 2.0:
            raise ValueError(f"{where}: norm_type {norm_type}: accepted: 2.0 (strata's clipping "
                             "is by the global L2 norm, as DeepSpeed's gradient_clipping)")
        counted = self.state.micro_steps % self.state.accumulation
        if not self.state.backward_since_step and counted:
            # (step() counted the window's micro-batches so far, as DeepSpeed's after each
            # backward: accelerate's accumulate(), Lightning's window)
            raise RuntimeError(
                f"{where} within the accumulation window, after its micro-batch {counted} of "
                f"{self.state.accumulation} (counted by step()): it would clip a partial sum "
                "(and a loss.backward() of one's own since is not taken under "
                f"gradient_accumulation_steps {self.state.accumulation}); accepted: once, "
                "after the window's last engine.backward (under accelerate, inside `if "
                "accelerator.sync_gradients:`)")
        adopt_backward(where)  # (the engine's: a backward of the user's own is taken)
        given = {id(p) for p in params}
        missing = [e.name for e in self.table.trained if id(e.param) not in given]
        if missing:
            raise ValueError(f"{where}: {len(missing)} of its trained parameters are not among "
                             f"those given ({', '.join(missing[:3])}...): it clips by the norm of "
                             "all of them; accepted: every trained parameter (model.parameters()),"
                             " or gradient_clipping in the config")
        if not self.state.backward_since_step:
            raise RuntimeError(f"{where}: no backward() since the last step(): the gradients "
                               "were dropped with it; accepted: after backward, before step()")
        if not self.state.is_boundary():
            raise RuntimeError(
                f"{where} before the last micro-batch of the accumulation window (micro-step "
                f"{self.state.micro_steps + 1} of {self.state.accumulation}): it would clip a "
                "partial sum; accepted: once, after the window's last backward (as plain torch "
                "users clip before optimizer.step())")
        early = self.stepped_during_backward()
        self.user_clips = True  # from the next step on, nothing steps for good in backward
        if early:
            raise RuntimeError(
                f"{where}: parameters may have stepped for good during this backward "
                "(strata.optimizer_during_backward: no clipping was known when it began), "
                "unclipped; from the next step on they wait for it; accepted: call it from the "
                "first step on, or gradient_clipping in the config")
        self.copies.land()
        clipped = 1.0 if self.user_clip is None else self.user_clip  # an earlier call's
        norm = self.grad_norm(self.scaler.scale) * clipped
        others = [p for p in params
                  if id(p) not in self.table.trained_by_id and p.grad is not None]
        if others:
            rest = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad.detach(), 2, dtype=torch.float32).cpu()
                 for p in others]), 2).item()
            norm = math.sqrt(norm * norm + rest * rest)
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped. To disable "
                               "this error and scale the gradients by the non-finite norm "
                               "anyway, set `error_if_nonfinite=False`")
        coefficient = min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        # Where every gradient of the engine's is still its parameter's .grad (stages 0-1 in
        # one process, none staged), they are clipped there in place, as torch's: a read of
        # .grad after it sees them clipped, and what is added to .grad after it (noise) is not
        # clipped at the step.
        in_grad = self.ranks is None and all(
            not e.gradient_held() and e.staged is None for e in self.table.trained)
        if not in_grad:
            self.user_clip = clipped * coefficient
            # The gradients still in .grad (stage 3's small parameters, one process) move to host
            # sums: the clip applies to them at the step with the others', .grad reads None from
            # here as theirs does, and a .grad given after it is the user's
            # (Gradients.take_given).
            for e in self.table.trained if self.ranks is None else ():
                if not e.partitioned and not e.gradient_held() and e.param.grad is not None:
                    # (a copy: a tensor the user kept of .grad is not the sum stepped)
                    e.host_grad = e.param.grad.detach().reshape(-1).to("cpu", copy=True)
                    e.has_grad = True
                    e.param.grad = None
        if coefficient < 1.0:
            with torch.no_grad():
                for p in others + ([e.param for e in self.table.trained
                                    if e.param.grad is not None] if in_grad else []):
                    p.grad.mul_(coefficient)
        return torch.tensor(norm, dtype=torch.float32, device=self.device)

    def _may_step_early(self):
        """Whether partitions may step for good as backward makes their gradients final: when
        strata.optimizer_during_backward says they may and nothing learnt after backward can
        change the step (no gradient clipping, no fp16 loss scale nor bf16.check_grad_overflow,
        one process: across ranks a rank whose staging failed makes every rank take the step
        anew), from the second step on (the first shows whether the boundary micro-batch takes
        one backward), and not once a rate was set between backward and step. Dropping
        such a step cannot undo them (_end_staged)."""
        return (self.runtime.optimizer_during_backward and self.config.clipping <= 0
                and not self.user_clips and not self.rates_set_after_backward
                and not self.config.checks_overflow and self.ranks is None
                and self.state.global_steps >= 1)

    def _may_hold(self):
        """Whether a step that cannot be speculated (clipping scaled the last one, or each
        partition commits as it lands) is staged held during backward: its NVMe state read ahead
        into the optimizer's read-ahead room (strata.optimizer_read_ahead_bytes) as each gradient
        is final, stepped after backward with the clipping then known. Not across ranks, nor
        after a window that saw a second gradient (it would be dropped again)."""
        return self._read_ahead and self.ranks is None and self._hold

    def _host_early(self):
        """Whether the host-resident partitions step in place as backward makes their gradients
        final, rather than after backward (_may_step_early, with the state in host memory)."""
        return self._optimizer_on_host and self._may_step_early()

    def drop_staged(self, reason):
        """The staged step cannot stand: aborted; this step is taken anew after backward. Host-
        resident partitions that had stepped in place (early) keep that step, taken with what
        was known when they were staged, and are not stepped again; a warning says so."""
        self.redone_steps += 1
        self.last_redo_reason = self._redo_reason = reason
        self.end_staged(committed=False, reason=reason)

    def end_staged(self, committed, reason="backward failed"):
        """Ends the staged step: aborted unless `committed` (for `reason`); the partitioned
        parameters' host copies released (written when committed), the others' new weights put
        in place. Host-resident partitions that had stepped in place (early) keep that step, and
        a warning says so."""
        staged, self.staged = self.staged, None
        if staged is None:
            return
        stepped = set()
        if not committed:
            stepped = set(self.runtime.abort_optimizer_step())
        copied = set(self.runtime.take_copied_partitions())  # weights written where they live
        # Stepped in part (sub_group_size, a step that failed inside them): a partitioned one's
        # host copy holds the landed sub-groups' new weights, kept (released written); none is
        # counted stepped: the next step steps the rest (and remakes every sub-group's weights).
        partly = set(self.runtime.partly_stepped_optimizer_partitions()) \
            if self.commit_each and not committed else set()
        if self.refresh:
            # Homed on NVMe, its new weights written into its partition without reading the old
            # ones (Runtime::AcquireToReplace): the sub-groups that did not land hold no weights
            # there; every one is written from the master weights before the next forward.
            self.pending_refresh.extend(
                e for e in staged.entries
                if e.partitioned and e.gid in partly and e not in self.pending_refresh)
            if partly and not self.state.in_backward:
                # Now, not only before the next forward: a module called on its own (not through
                # engine.forward) reads its partitions as they are (an audit's finding).
                try:
                    self.refresh_weights([])
                except _strata.Error:
                    pass  # still pending: written before the next forward, which raises if not
        early = [e for e in staged.entries if e.gid in stepped]
        for e in early:  # stepped in place during backward: that step stands
            e.steps += 1
            self.stepped_early.add(e)
            if self.refresh and e.partitioned and e not in self.pending_refresh and \
                    e.gid not in copied:
                # Homed on NVMe: its new weights are read from its master weights before the
                # next forward.
                self.pending_refresh.append(e)
        if early:
            # Nothing more is staged in this window: the rest step after backward.
            self._redo_reason = self._redo_reason or reason
            how = ("strata.optimizer_commit \"partition\": each partition's new NVMe state "
                   "replaces its old one as it is written" if self.commit_each else
                   "strata.optimizer_during_backward: host-resident optimizer state steps "
                   "during backward, and their new weights may already have been used by "
                   "what ran of backward after that")
            when = "" if self.commit_each else " during backward"
            self.notices.warn(f"the optimizer step was dropped ({reason}) after {len(early)} "
                              f"parameters had stepped{when} with the gradients and rates known "
                              f"then ({how}): they keep that step, and the others step when the "
                              "step is taken")
        gather = []
        sent = False  # new weights gone to a GPU from pinned memory
        failed = None  # every entry is ended; the first release that fails is raised after
        for e in staged.entries:
            target = e.staged[1]
            e.staged = None
            # By a step that stands, whole or in part.
            written = committed or e in self.stepped_early or (e.partitioned and e.gid in partly)
            if e.partitioned:
                if target is not None and not isinstance(target, int):  # (int: written there)
                    del target
                    if written and not committed:
                        # Stepped early, dropped while backward may still use its device copy:
                        # its host copy goes back written once backward is over
                        # (Gradients.end_step).
                        self.early_held.append(e)
                        continue
                    try:
                        self.runtime.release(e.pid, "host", written, traced=False)
                    except _strata.Error as error:
                        failed = failed or error
            elif written and self.ranks is not None:
                gather.append((e, target, data_of(e.param)))
            elif written:
                sent = self._write_back_weights(e, target) or sent
        if sent:  # one event after every copy out of the pinned targets
            self._weights_sent = torch.cuda.current_stream(self.device).record_event()
        if gather:  # every rank's new shards, whole on every rank
            with torch.no_grad():
                self.ranks.gather(gather)
        if failed is not None:
            raise failed

    def _unstaged(self):
        """(entry, host gradient or None: its partition's) for each parameter with a gradient
        whose step is not staged: those the gradient hook stages first, in the order it met them
        (in one process: across ranks every rank keeps the parameters' own order), then the
        others."""
        first = list(self._hook_order) if self.ranks is None else []
        trained = self.table.trained
        rest = [e for e in trained if e not in self._hook_order] if first else trained
        for e in first + rest:
            if e.staged is not None or e in self.stepped_early:
                continue
            kept = e.kept_gradient(self.ranks is not None)
            if kept is None:
                continue
            where, g = kept
            if where == "grad":
                g = g.detach().reshape(-1).to("cpu").contiguous()
            yield e, g

    def grad_norm(self, scale):
        """As torch.nn.utils.clip_grad_norm_: the norm of the gradients' norms, in fp32, of the
        unscaled gradients (inf when one is not finite); a partition's gradient is read from the
        host tier one at a time, unless the gradient hook took its norm already."""
        if self.ranks is None:
            return self._local_norm() / scale
        # Across ranks a failure here is carried in the sum, so that every rank raises at once
        # rather than wait in a collective the failing rank never issues.
        failure, local = None, 0.0
        try:
            local = self._local_norm()
        except Exception as error:  # noqa: BLE001 - raised below, once every rank knows
            failure = error
        total, failed = self.ranks.all_reduce_sum([local * local, 1.0 if failure else 0.0])
        if failure is not None:
            raise failure
        if failed:
            raise _strata.Error(
                f"rank {self.ranks.rank} of {self.ranks.size}: the gradients' norm could not be "
                f"taken on {int(failed)} other rank{'s' if failed > 1 else ''} (its error is that "
                "rank's): the step is dropped on every rank, nothing changed")
        total = math.sqrt(total)
        return total / scale if math.isfinite(total) else math.inf

    def _local_norm(self):
        """This process's part of grad_norm: the norm of its gradients (or shards), as made."""
        norms = []
        for e in self.table.trained:
            if e.grad_norm is not None and (e.has_grad or e.host_grad is not None):
                norms.append(e.grad_norm)  # taken in the gradient hook (gradients.py)
                continue
            kept = e.kept_gradient(self.ranks is not None)
            if kept is None:
                continue
            where, g = kept
            if where != "partition":
                norms.append(torch.linalg.vector_norm(g, 2, dtype=torch.float32))
                continue
            g = from_dlpack(self.runtime.acquire(e.gid, "host", traced=False))
            try:
                norms.append(torch.linalg.vector_norm(g, 2, dtype=torch.float32))
            finally:
                del g
                self.runtime.release(e.gid, "host", False, traced=False)
        # Partitions' norms are on the host, the parameters kept on the device (stage 3's small
        # ones, stages 0-2) have theirs there: each device's norms are stacked where they are.
        by_device = {}
        for n in norms:
            by_device.setdefault(n.device, []).append(n)
        parts = [torch.linalg.vector_norm(torch.stack(ns), 2).cpu() for ns in by_device.values()]
        total = torch.linalg.vector_norm(torch.stack(parts), 2).item() if parts else 0.0
        return total if math.isfinite(total) else math.inf

    def finish_staged(self):
        """Commits the step staged during backward when it is the step to take: no clipping
        (the global norm under gradient_clipping), the loss scale and learning rates it was
        staged with, no gradient changed after it. Returns (stepped, report), or (None, None)
        when the step must be taken anew (the staged one aborted; counted in redone_steps)."""
        # What backward did not stage: stage 3's unpartitioned parameters (their .grad, read
        # after backward; across ranks reduced at the step), a GPU's at stage 2 with more
        # micro-batches, and partitioned ones with no gradient in this micro-batch (their
        # partition holds the earlier ones').
        if self.staged is not None:
            for e, g in list(self._unstaged()):
                self.stage(e, g)
        if self.ranks is not None and not self.ranks.agree(
                "the step staged during backward", self.staged is not None):
            # A rank's staging failed (its host tier had no room, say) or none staged: every
            # rank takes the step anew, so that each issues the same collectives.
            if self.staged is not None:
                self.drop_staged("another rank's step staged during backward could not stand")
            return None, None
        staged = self.staged
        if staged is None:  # none staged, or a staging failed
            return None, None
        reason = None
        if staged.scale != self.scaler.scale:
            reason = "the loss scale changed"
        for e in staged.entries:
            if reason is None and \
                    e.staged[0] != self._hyper_of(e):
                reason = (f"the learning rate, weight decay or betas of {e.name}'s group changed "
                          "after its step was staged; from the next step on no partition steps "
                          "for good during backward")
                self.rates_set_after_backward = True
        if staged.held:
            if reason is not None:  # nothing has stepped: taken anew
                self.drop_staged(reason)
                return None, None
            norm, clip = self._norm_and_clip(staged.scale)
            if clip is None:
                self.end_staged(committed=False)
                self.scaler.update(overflow=True)
                return False, {"overflow": True, "grad_norm": norm}
            self._speculate = clip == 1.0
            self.runtime.release_optimizer_step(clip / staged.scale)
            return self._commit(norm, staged=True)
        if reason is None and self.user_clip is not None and self.user_clip < 1.0:
            reason = "torch.nn.utils.clip_grad_norm_ scales this step"
            self._speculate = False  # likely again next step: not staged then
        norm = None
        # (In fp16 or with bf16.check_grad_overflow across ranks the norm over every rank says
        # whether any rank's shards overflowed: then every rank skips the step, as
        # _norm_and_clip.)
        if reason is None and (self.config.clipping > 0 or
                               (self.config.checks_overflow and self.ranks is not None)):
            norm = self.grad_norm(staged.scale)
            if math.isfinite(norm) and self.config.clipping > 0 and \
                    self.config.clipping / (norm + 1e-6) < 1.0:
                reason = "gradient clipping scales this step"
                self._speculate = False  # likely again next step: not staged then
        if reason is not None:
            self.drop_staged(reason)
            return None, None
        if norm is not None and not math.isfinite(norm):
            self.end_staged(committed=False)
            self.scaler.update(overflow=True)
            return False, {"overflow": True, "grad_norm": norm}
        return self._commit(norm, staged=True)

    def step_anew(self):
        """The step after backward: the global norm and clip coefficient (gradient_clipping),
        then every parameter's step staged with them and committed. (Across ranks the
        gradients are reduced first: Gradients.reduce.)"""
        norm, clip = self._norm_and_clip(self.scaler.scale)
        if clip is None:
            self.scaler.update(overflow=True)
            return False, {"overflow": True, "grad_norm": norm}
        # Stage the next step during backward unless it clipped.
        self._speculate = clip == 1.0
        try:
            for e, g in list(self._unstaged()):
                self.stage(e, g, clip=clip, always=True)
        except Exception:
            if self.ranks is not None:  # told in the commit's first phase, as the others wait
                self.ranks.failed_ranks(False)
            raise
        if self.staged is None:
            return True, {"overflow": False, "grad_norm": norm, "seconds": 0.0, "bytes_read": 0,
                          "bytes_written": 0, "bytes_reused": 0}
        return self._commit(norm, staged=False)

    def _norm_and_clip(self, scale):
        """(global norm or None, clipping coefficient), the gradients made with loss scale
        `scale`; the coefficient is None when the norm is not finite (an overflow). The norm is
        taken for gradient_clipping, and in fp16 or with bf16.check_grad_overflow across ranks
        (every rank must see an overflow that any rank's shard holds, and skip the step with the
        others) or with commit_each (a partition's step lands as it is taken, so an overflow must
        be known before the first)."""
        norm = None
        if self.config.clipping > 0 or (self.config.checks_overflow and
                                        (self.ranks is not None or self.commit_each)):
            norm = self.grad_norm(scale)
            if not math.isfinite(norm):
                return norm, None
        clip = 1.0
        if self.user_clip is not None:  # the user's clip_grad_norm_, then the config's on it
            clip = self.user_clip
        if norm is not None and self.config.clipping > 0:
            clip *= min(1.0, self.config.clipping / (norm * clip + 1e-6))
        return norm, clip

    def _commit(self, norm, staged):
        """Commits the open staged step (all or nothing): the new weights reach the parameters,
        the step counts advance and the loss scale follows (an overflow skips the step).
        Across ranks in two phases: every rank first prepares its step (its staged work done and
        checked), and commits only if every rank could; else every rank raises, its step dropped
        with nothing changed, as one process's failed step."""
        prepared_s = 0.0  # across ranks: the first phase's wait for the staged work
        if self.ranks is not None:
            t0 = time.perf_counter()
            self._prepare_on_every_rank()
            prepared_s = time.perf_counter() - t0
        try:
            r = self.runtime.commit_optimizer_step()
        except _strata.Error:
            if self.ranks is not None:  # every rank learns of it before its weights' gathers
                self.ranks.failed_ranks(False)
            raise
        if self.ranks is not None:
            failed = self.ranks.failed_ranks(True)
            if failed:
                raise _strata.Error(
                    f"rank {self.ranks.rank} of {self.ranks.size}: the optimizer step committed "
                    f"here but failed on rank{'s' if len(failed) > 1 else ''} "
                    f"{', '.join(map(str, failed))} (its error is that rank's): the ranks' "
                    "optimizer states now differ; accepted: load the last checkpoint on every "
                    "rank")
        if r["overflow"]:  # nothing was changed
            self.end_staged(committed=False)
            self.scaler.update(overflow=True)
            return False, {"overflow": True, "grad_norm": None}
        copied = set(self.runtime.take_copied_partitions())  # their weights written already
        entries = list(self.staged.entries)
        early = self.staged.early
        held = self.staged.held
        for e in entries:
            e.steps += 1
        self.end_staged(committed=True)
        if self.refresh:
            try:
                self.refresh_weights([e for e in entries if e.gid not in copied])
            except _strata.Error as error:  # raised by step() once its bookkeeping is done
                self.refresh_error = error
        self.optimizer_read += r["bytes_read"]
        # Bytes written behind a step (strata.optimizer_write_behind) are counted with the next.
        self.optimizer_written += r["bytes_written"] + r["behind_bytes_written"]
        self.scaler.update(overflow=False)
        return True, {"overflow": False, "grad_norm": norm,
                      "seconds": r["commit_seconds"] + prepared_s, "staged_seconds": r["seconds"], "read_seconds": r["read_seconds"],
                      "write_seconds": r["write_seconds"], "compute_seconds": r["compute_seconds"],
                      "bytes_read": r["bytes_read"],
                      "bytes_written": r["bytes_written"], "bytes_reused": r["bytes_reused"],
                      "staged": staged,
                      "host_early": early, "held": held, "written_behind": r["written_behind"],
                      "behind_bytes_written": r["behind_bytes_written"],
                      "behind_wait_seconds": r["behind_wait_seconds"]}

    def _prepare_on_every_rank(self):
        """The commit's first phase across ranks: raises this rank's own failure to prepare, or
        names the ranks that failed to prepare theirs (every rank learns of each before any
        commits, so that the step is dropped on every rank, their states kept alike)."""
        try:
            self.runtime.prepare_optimizer_step()
        except _strata.Error as error:
            others = [r for r in self.ranks.failed_ranks(False) if r != self.ranks.rank]
            if others:
                raise _strata.Error(
                    f"{error} (and rank{'s' if len(others) > 1 else ''} "
                    f"{', '.join(map(str, others))} could not prepare theirs either: no rank "
                    "committed the step)") from error
            raise
        failed = self.ranks.failed_ranks(True)
        if failed:
            raise _strata.Error(
                f"rank {self.ranks.rank} of {self.ranks.size}: the optimizer step could not be "
                f"prepared on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
                "(its error is that rank's), so no rank committed it: every rank's optimizer "
                "state is as it was before the step, and the step's gradients are dropped; "
                "accepted: go on training (the next step is taken as ever), or load the last "
                "checkpoint on every rank")

    def refresh_weights(self, entries):
        """Parameters homed on NVMe: their new weights are their committed master weights in the
        training dtype, read back one parameter at a time (never all in host memory at once).
        The weights are a copy of the master weights: one that cannot be written now (a failed
        read or write) is written before the next forward, and the step's error says so."""
        pending = list(self.pending_refresh) + [
            e for e in entries if e.partitioned and e not in self.pending_refresh]
        self.pending_refresh = pending
        # One buffer for every parameter's state, not three tensors each: a megabyte tensor made
        # and freed per parameter is kept resident by glibc's heap once its mmap threshold has
        # risen, so that the process's resident memory drifts above what is in use.
        state = torch.empty(3 * max((e.shard for e in pending), default=0))
        while pending:
            e = pending[0]
            master, m, v = state[:3 * e.shard].view(3, e.shard)
            try:
                # A parameter stepped in part (a step that failed part way): each sub-group's
                # master weights are its weights.
                self.runtime.read_optimizer_state(e.gid, master, m, v, mixed_steps=True)
                set_weights(self.runtime, e, master)
            except Exception as error:
                raise _strata.Error(
                    f"the optimizer step committed, but the new weights of {len(pending)} "
                    f"parameters could not be written yet ({e.name}: {error}); they are written "
                    "from the master weights before the next forward") from error
            pending.pop(0)

    def _write_back_weights(self, e, target):
        """After the step: a copy written elsewhere than the parameter (a GPU parameter, or a
        non-contiguous one) is copied into it; to a GPU on torch's stream, from pinned memory
        (returns True then: _end_staged marks the copies' end with an event, waited for before
        that memory is written again)."""
        if not e.partitioned and target.data_ptr() != e.param.data_ptr():
            to_gpu = e.param.device.type == "cuda" and target.is_pinned()
            data_of(e.param).copy_(target.view(e.shape), non_blocking=to_gpu)
            return to_gpu
        return False
