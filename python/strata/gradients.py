"""The gradient path: each parameter's gradient taken as autograd makes it final (a hook on its
AccumulateGrad node), summed into its gradient partition (stage 3, in grad_accum_dtype; at the
accumulation boundary it leaves the device in the background and its optimizer step is staged),
into a host sum (stage 2, or grad_accum_dtype other than the training dtype), or reduce-scattered
across ranks into each owner's shard (strata/ranks.py); and every gradient dropped when the step
is over.

`Gradients` owns the gradient path: the hooks, which parameters' hooks ran in the window's last
micro-batch, and (HostCopies) the GPU's gradients on their way to pinned host memory. The engine
builds it with what it uses (the parameter table, the ranks, the training state, the lending,
which a gradient hook gives the parameter back to, and the optimizer step, which it stages) and
hands it the Runtime. Thread safety: the engine's (one thread).
"""

import weakref

import torch
from torch.utils.dlpack import from_dlpack

from strata import _strata

from strata.lending import kernel_stream
from strata.parameters import clear_grad, grad_of

__all__ = ["BACKWARD_AFTER_CLIP", "Gradients", "HostCopies"]

# A backward after the user's clip_grad_norm_ in the same step, where the clip waits for the step.
BACKWARD_AFTER_CLIP = (
    "backward after torch.nn.utils.clip_grad_norm_ in the same step: the engine applies the "
    "clip at the step to every gradient it holds, this backward's too (torch's clipped only "
    "those made before it); accepted: clip_grad_norm_ after the step's last backward")


class Gradients:
    """The engine's gradient path (see the module's docstring)."""

    def __init__(self, table, ranks, state, lending, step, copies, notices, *, stage,
                 sum_apart, grad_accum_dtype, device):
        self.table = table  # strata/parameters.py
        self.ranks = ranks  # strata/ranks.py; None in one process
        self.state = state  # strata/training_state.py
        self.lending = lending  # strata/lending.py
        self.step = step  # strata/step.py
        self.copies = copies  # HostCopies
        self.notices = notices  # strata/notices.py
        self.stage = stage
        self.sum_apart = sum_apart  # stage 0-1 gradients summed on the host (grad_accum_dtype)
        self.grad_accum_dtype = grad_accum_dtype
        self.device = device
        self.runtime = None  # the engine's, handed once made; None once it is closed
        self.fired = set()  # parameters whose gradient hook ran in the boundary micro-batch
        # Across ranks: gradients made since the last reduce() (stage 1's, stage 3's small
        # parameters': this rank's own until the window's last backward reduces them).
        self.unreduced = False

    def hook(self, e):
        """The hook on e's AccumulateGrad node: it runs once autograd has put e's gradient in
        .grad."""
        # The hook lives on a C++ autograd node the garbage collector cannot see into: it holds
        # the gradients weakly, or they (and their engine) would never be collected.
        gradients = weakref.ref(self)

        def hook(*unused):
            self = gradients()
            if self is None:
                return
            grad = grad_of(e.param)  # (read past the placeholder's guard: each backward)
            if grad is None:
                return
            if self.step.user_clip is not None:  # (refused: nothing of this backward kept)
                clear_grad(e.param)
                self.lending.drop_all()
                raise RuntimeError(BACKWARD_AFTER_CLIP)
            self.state.gradient_made()  # (a backward of the user's own: engine._adopt_backward)
            boundary = self.state.is_boundary()
            if boundary:
                if e.staged is not None or e in self.fired:
                    # A second gradient in the boundary micro-batch (a second backward through
                    # it): a step staged from the first cannot stand, and its hold on the gradient
                    # goes before the gradient is added to.
                    self.step.second_gradient(e)
                elif self.state.accumulation == 1 and self.ranks is None and \
                        (e.partitioned or self.stage == 2 or self.sum_apart):
                    # The window's whole gradient: its norm now, where it is (on a GPU, queued on
                    # torch's stream), not from its host copy after backward
                    # (OptimizerStep.grad_norm).
                    with torch.no_grad():
                        e.grad_norm = torch.linalg.vector_norm(grad, 2, dtype=torch.float32)
                self.fired.add(e)
            if e.partitioned:
                clear_grad(e.param)
                # Its gradient is the last thing backward needed of it (autograd sums the uses of
                # a shared parameter before this hook): the lent copy goes back now.
                e.grad_made_in = torch._C._current_graph_task_id()
                self.lending.give_back(e)
                if self.ranks is not None:  # reduce-scattered into the owners' shards
                    self.ranks.add_gradient(e, grad, boundary, self._add_shard)
                    return
                self._add_to_partition(e, grad.reshape(-1), boundary)
                if boundary:  # its optimizer step is staged
                    self.step.stage_from_hook(e)
            elif self.stage == 2 and self.ranks is not None:
                # Reduce-scattered as it is made: this rank keeps only its shard's mean.
                clear_grad(e.param)
                self.ranks.add_gradient(e, grad, boundary, self._add_shard)
            elif self.stage == 2 or self.sum_apart:
                # To the host as it is made, summed there in grad_accum_dtype (stage 2; other
                # stages when that is not the training dtype).
                clear_grad(e.param)
                if grad.device.type == "cuda":
                    whole = self.copies.send(e, grad.reshape(-1))
                    e.has_grad = True
                    if boundary and whole and self.ranks is None:
                        # The window's whole gradient, on its way to the host: its step is staged
                        # now, the optimizer's thread reading it once its copy has landed (a fence
                        # on the gradients' stream), while backward goes on.
                        self.step.stage_from_hook(e, e.host_grad,
                                                  grad_stream=self.copies.stream())
                    return
                elif e.host_grad is None:
                    # The window's first is autograd's own tensor, kept, as plain torch keeps
                    # it in .grad (autograd gives .grad a tensor of its own: one a tensor hook
                    # kept is copied first); a later micro-batch's is added to it in place, as
                    # torch adds to .grad. Cast only where grad_accum_dtype differs.
                    e.host_grad = grad.reshape(-1).to(dtype=self.grad_accum_dtype)
                else:
                    e.host_grad.add_(grad.reshape(-1).to(dtype=self.grad_accum_dtype))
                e.has_grad = True
            # (Stage 3's small parameters keep torch's .grad, staged after backward from what it
            # holds then: the user may set or edit it between backward and step, as torch's.)
        return hook

    def _add_shard(self, e, shard, boundary):
        """Across ranks: this rank's shard of e's mean gradient, summed into its gradient (stage 2:
        e.shard_grad in fp32; stage 3: its gradient partition, which at the boundary leaves the
        device); in the window's last micro-batch (`boundary`) the shard is final and its step is
        staged, while backward goes on."""
        if not e.partitioned:
            shard = shard.to("cpu")  # (the host optimizer's, from a GPU's buffer)
            e.shard_grad = shard if e.shard_grad is None else e.shard_grad.add_(shard)
            e.has_grad = True
            if boundary:
                self.step.stage_from_hook(e, e.shard_grad)
            return
        # (Across ranks sharing a GPU the shard is in pinned host memory, strata's collectives':
        # to the partition's device, queued on torch's stream.)
        self._add_to_partition(e, shard.to(self.device, non_blocking=True), boundary)
        if boundary:
            self.step.stage_from_hook(e)

    def _add_to_partition(self, e, values, boundary):
        """Sums `values` into e's gradient partition on the device (the window's first is copied
        into it, its room taken without zeros); in its last micro-batch (`boundary`) the gradient
        leaves the device now, in the background, while backward goes on."""
        first = not e.has_grad
        with torch.no_grad():
            part = from_dlpack(self.runtime.acquire(e.gid, "device", overwrite=first))
            if first:
                part.copy_(values)
            else:
                part.add_(values)
            del part
        # On a GPU the sum is queued on torch's stream: the Runtime copies it to the host only
        # once that work has run.
        self.runtime.release(e.gid, "device", True, kernel_stream(self.device))
        e.has_grad = True
        if boundary:
            self.runtime.gradient_ready(e.gid)
            e.sent_down = True

    def unreduced_here(self, e):
        """Whether this rank's gradient of e so far is its own sum, not yet reduced with the other
        ranks' (across ranks: stages 0-1 and stage 3's small parameters, before the window's
        last backward reduces them; stage 2 and partitions reduce during backward). A backward
        after that reduce (a retained graph) adds to the reduced sum: .grad is then the user's,
        or this backward's own."""
        return self.unreduced and not e.partitioned and self.stage != 2 and e.shard_grad is None

    def held(self, e):
        """A copy of this rank's gradient of e where the engine holds it outside .grad (flat: its
        partition's, its shard across ranks, its host sum), or None; as made (the loss scale
        in), in grad_accum_dtype."""
        self.copies.land()  # (a GPU's gradients on their way to the host)
        kept = e.kept_gradient(self.ranks is not None)
        if kept is None or kept[0] == "grad":
            return None
        where, g = kept
        if where != "partition":
            return g.clone()
        part = from_dlpack(self.runtime.acquire(e.gid, "host", traced=False))
        try:
            return part.clone()
        finally:
            del part
            self.runtime.release(e.gid, "host", False, traced=False)

    def replace(self, e, values, where):
        """e's gradient, where the engine holds it, replaced by `values` (fp32, flat: this rank's
        elements of it, as torch's .grad holds them after GradScaler.unscale_ and a
        clip_grad_norm_ of this step), between backward and step: what the user's
        safe_set_*_grad or `.grad = t` gives (`where` names it); one with no gradient since the
        last step is given one, as torch's `.grad = t` gives it. A step staged with the old
        gradient is dropped and taken anew after backward; from the next step on, nothing is
        staged during backward (the user's change comes after it). Refused where parameters
        stepped for good during this backward, and where the value, with the loss scale in,
        is past the range of the dtype the gradient is kept in (fp16)."""
        if not self.state.gradients_since_step:
            raise RuntimeError(f"{where} with no backward since the last step: there is no "
                               "gradient to set; accepted: between backward and step()")
        if self.step.stepped_during_backward():
            self.step.user_sets_gradients = True  # (from the next step on)
            raise RuntimeError(
                f"{where}: parameters may have stepped for good during this backward "
                "(strata.optimizer_during_backward: no change of gradients was known when it "
                "began) with their gradients as backward made them; from the next step on they "
                "wait for it; accepted: gradients set from the first step on, or "
                "strata.optimizer_during_backward false")
        self.copies.land()
        clip = self.step.user_clip
        if clip == 0:
            raise RuntimeError(
                f"{where} after clip_grad_norm_ with max_norm 0 in this step: the engine applies "
                "the clip (0) at the step to every gradient it holds, so no value set after it "
                "could stand; accepted: the set before the clip, or a max_norm above 0")
        scale = self.step.scaler.scale / (1.0 if clip is None else clip)
        values = values * scale
        if e.partitioned:
            kept = "partition"
        elif self.ranks is not None:
            kept = "shard"
        elif e.host_grad is not None or (e.param.grad is None and
                                         (self.stage == 2 or self.sum_apart)):
            kept = "host"
        else:
            kept = "grad"
        dtype = {"grad": e.param.dtype, "shard": torch.float32,
                 "host": self.grad_accum_dtype if e.host_grad is None else e.host_grad.dtype
                 }.get(kept, self.grad_accum_dtype)
        if bool(values.isfinite().all()) and not bool(values.to(dtype).isfinite().all()):
            raise ValueError(
                f"{where}: the value times {scale:g} (the loss scale, divided by this step's "
                f"clip_grad_norm_ coefficient) is past {dtype}'s range, the dtype the engine "
                f"keeps this gradient in; accepted: values within {torch.finfo(dtype).max:g} / "
                f"{scale:g}")
        self.step.user_sets_gradients = True
        if e.staged is not None:
            self.step.drop_staged(f"{where} changed the gradient of {e.name} after its step was "
                                  "staged")
        e.grad_norm = None  # (the hook's, of the old one)
        if kept == "partition":
            part = from_dlpack(self.runtime.acquire(e.gid, "host", traced=False,
                                                    overwrite=not e.has_grad))
            try:
                part[:values.numel()].copy_(values)
                if not e.has_grad:
                    part[values.numel():].zero_()
            finally:
                del part
                self.runtime.release(e.gid, "host", True, traced=False)
            e.has_grad = True
        elif kept == "shard":
            if e.shard_grad is None:
                e.shard_grad = torch.zeros(e.shard, dtype=torch.float32)
            e.shard_grad[:values.numel()].copy_(values)
            e.has_grad = True
        elif kept == "host":
            if e.host_grad is None:
                e.host_grad = values.to(self.grad_accum_dtype)
            else:
                e.host_grad.copy_(values)
            e.has_grad = True
        elif e.param.grad is None:
            e.param.grad = values.view(e.shape).to(e.param.device, e.param.dtype)
        else:
            e.param.grad.copy_(values.view(e.shape))

    def take_given(self, only=None):
        """Each .grad the user gave by hand between backward and step (`p.grad = t`, plain torch's
        way to replace a gradient; of entry `only`, or of any), taken as the gradient
        (replace()) and .grad None again, where the engine keeps the gradient apart from .grad:
        at stage 2, with grad_accum_dtype apart, across ranks once reduced (the hook and the
        reduce leave .grad None there), and after a clip_grad_norm_ that left the clip to the
        step (OptimizerStep.clip_by_user moves stage 3's small parameters' gradients out of
        .grad then): a .grad found there is the user's. Across ranks before the window's reduce,
        .grad is this rank's own sum, reduced with the others' as DDP's; where the sum is kept
        apart (grad_accum_dtype), a .grad given then is refused (it could not replace it).
        Refused under fp16, where whether t carries the loss scale cannot be told."""
        apart = self.stage == 2 or self.sum_apart or self.ranks is not None
        if not apart and self.step.user_clip is None:  # (.grad is torch's: nothing to take)
            return
        for e in self.table.trained if only is None else (only,):
            if e.partitioned:  # (refuses .grad = t: strata/placeholders.py)
                continue
            given = e.param.grad
            if given is None:
                continue
            if self.unreduced_here(e):
                if e.host_grad is not None:
                    raise RuntimeError(
                        f"{e.name}.grad = t across ranks before the window's gradients are "
                        "reduced, where this rank's sum so far is kept apart from .grad "
                        "(grad_accum_dtype other than the training dtype): t could not replace "
                        "it; accepted: .grad = t or strata.safe_set_full_grad after the "
                        "window's last backward")
                continue
            self._take(e, given)

    def _take(self, e, given):
        if self.step.dtype == torch.float16:
            raise RuntimeError(
                f"{e.name}.grad = t between backward and step under fp16, where the engine keeps "
                "the gradient apart from .grad (stage 2, grad_accum_dtype apart, across ranks, "
                "or after a clip_grad_norm_ at stage 3) and scales the loss: whether t carries "
                "the loss scale cannot be told (where .grad holds the gradient, at stages 0-1 "
                "and stage 3's small parameters in one process, it holds the scaled one); "
                "accepted: strata.safe_set_full_grad(param, t), t unscaled as "
                "strata.safe_get_full_grad reads it")
        start, stop = (0, e.numel) if self.ranks is None else \
            self.ranks.own_range(e.numel, e.shard)
        values = given.detach().to("cpu", torch.float32).reshape(-1)[start:stop]
        e.param.grad = None
        try:
            self.replace(e, values, f"{e.name}.grad = t between backward and step")
        except BaseException:
            e.param.grad = given  # (nothing taken)
            raise

    def prehook(self, e):
        """The pre-hook on e's AccumulateGrad node, where its gradient is held outside .grad
        (stage 2, grad_accum_dtype apart): a .grad given by hand since the last backward is
        taken (take_given) before autograd adds this backward's to it, as torch adds to the
        .grad given."""
        gradients = weakref.ref(self)

        def prehook(*unused):
            self = gradients()
            if self is not None and e.param.grad is not None:
                self.take_given(e)
        return prehook

    def reduce(self):
        """Across ranks, after the window's last backward: the unpartitioned parameters' gradients
        (.grad, or their host sums) reduce-scattered into their owners' shards (e.shard_grad, the
        mean over the ranks; a second backward's added), and dropped where they were."""
        # On a GPU their host sums are read below: each micro-batch's copy landed and summed
        # first (a copy still in flight would be read as it is written).
        self.copies.land()

        def gradient_of(e):
            if e.host_grad is not None:
                return e.host_grad
            if e.param.grad is not None:  # (where it is: a GPU's goes to NCCL as it is)
                return e.param.grad.detach().reshape(-1)
            return None

        # Stage 2 reduced them during backward; stage 1 and stage 3's unpartitioned ones now.
        entries = [e for e in self.table.trained if not e.partitioned and self.stage != 2]
        if entries:
            for e, shard in self.ranks.reduce_gradients(entries, gradient_of).items():
                e.param.grad = None
                e.host_grad = None
                if shard is not None:
                    e.shard_grad = shard if e.shard_grad is None else e.shard_grad.add_(shard)
                    e.has_grad = True
        self.unreduced = False

    def end_step(self, failed):
        """The step is over (taken, skipped or `failed`): a staged step left is aborted and every
        gradient dropped. Each part is tried; a failure among them raises the first one, unless
        the step `failed` (its error is the one to see: these are kept in engine.warnings)."""
        errors = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except _strata.Error as error:
                errors.append(error)

        attempt(self.step.end_staged, False, "the step failed" if failed else "gradients dropped")
        self.step.release_early_held(attempt)
        self.step.end_window()
        self._drop_all(attempt)
        if errors:
            if not failed:
                raise errors[0]
            for error in errors:
                self.notices.warn(f"after the failed step: {error}")

    def _drop_all(self, attempt):
        """Every gradient dropped (a partition's discarded through `attempt`)."""
        self.copies.land()  # their pinned memory is written to again next step: the copies end
        self.fired.clear()
        self.unreduced = False
        for e in self.table.trained:
            if e.partitioned and e.has_grad:
                attempt(self.runtime.discard, e.gid)
            e.grad_norm = None
            e.has_grad = False
            e.sent_down = False
            e.host_grad = None
            e.incoming = None
            e.shard_grad = None
            e.param.grad = None


class HostCopies:
    """On a GPU: the gradients' copies to pinned host memory, on a stream of their own, and their
    landing (the later micro-batches' summed into the first's)."""

    def __init__(self, device, dtype):
        self.device = device
        self.dtype = dtype  # grad_accum_dtype: what the host sums are kept in
        self._stream = None  # made on first use (stream())
        # The copies of the backward running, and of those that ended, each with the event
        # after its copies.
        self._in_flight = []
        self._landing = []

    def stream(self):
        """The CUDA stream the gradients' copies to the host run on, made once: a stream of its
        own, so that they overlap backward's kernels rather than queue between them."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def send(self, e, grad):
        """A GPU's gradient to the host without the host waiting for the GPU: copied into pinned
        memory on the gradients' stream (stream()), after the work queued on torch's
        stream so far (which made it), while backward goes on there: the window's first straight
        into e.host_grad (returns True: e.host_grad will be the whole gradient once the copy has
        landed), a later one into e.incoming, added once it has landed (returns False). The copies
        of one backward are marked by an event after it (engine.backward) and waited for before
        the host reads them (land()); a step staged from e.host_grad waits for a
        fence on that stream instead."""
        if e.incoming is not None:  # an earlier micro-batch's, long landed: summed now
            self.land(finished_only=True)
        values = grad.to(self.dtype)
        if e.pinned_grad is None:
            e.pinned_grad = torch.empty(e.numel, dtype=self.dtype, pin_memory=True)
        incoming = None
        stream = self.stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if e.host_grad is None:
                e.host_grad = e.pinned_grad
                e.host_grad.copy_(values, non_blocking=True)
            else:
                if e.incoming is not None:  # a second gradient in this backward (a shared use)
                    self.land()
                incoming = e.incoming = torch.empty(e.numel, dtype=self.dtype,
                                                    pin_memory=True)
                incoming.copy_(values, non_blocking=True)
        # The copy reads `values` after this returns, on another stream than the one that made
        # it: torch's caching allocator keeps its memory from reuse until that stream's work
        # queued so far has run. The copy belongs to this backward's batch: summed only once that
        # batch's event has passed.
        values.record_stream(stream)
        self._in_flight.append((e, incoming))
        return incoming is None

    def end_backward(self):
        """After a backward: its gradients' copies to the host, marked by an event on the
        gradients' stream."""
        if self._in_flight:
            event = self.stream().record_event()
            self._landing.append((event, self._in_flight))
            self._in_flight = []

    def land(self, finished_only=False):
        """Waits for the gradients' copies to the host (those of the backwards that ended, each
        marked by its event; with not `finished_only`, also those of a backward still running or
        that failed, by waiting for the gradients' stream) and sums each later micro-batch's into
        its host_grad."""
        batches, self._landing = self._landing, []
        if not finished_only and self._in_flight:
            self.stream().synchronize()
            batches.append((None, self._in_flight))
            self._in_flight = []
        for event, copies in batches:
            if event is not None:
                event.synchronize()
            for e, incoming in copies:
                if incoming is not None:
                    e.host_grad.add_(incoming)
                    if e.incoming is incoming:
                        e.incoming = None
