"""ZeRO across ranks for the engine: who owns which shard, and the bucketed collectives.

A job of several processes (launched by torchrun or DeepSpeed's launcher: MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) trains one model data-parallel. Every trainable
parameter of n elements is cut into world_size shards of ceil(n / world_size) elements (the last
padded with zeros); rank r owns shard r: its fp32 master weights and optimizer state (stage 1),
its gradient, reduce-scattered into it and averaged over the ranks (stage 2), and, at stage 3 for
the partitioned parameters, its weights, which are all its tiers hold (gathered whole before each
use).

Where the collectives run (Collectives, chosen by choose_collectives once the device is known):
  - strata's own (comm/, strata._strata.Job) over host buffers: through shared memory when every
    rank is on one host, else Gloo over TCP (strata.comm_transport: "auto", "shm", "tcp"); on the
    emulated device tier, and on GPUs where NCCL is absent or refuses (ranks sharing a GPU), the
    device's buffers then staged through pinned host memory (said once);
  - a torch.distributed process group over the device's own buffers: on GPUs, NCCL's (the one a
    trainer hands to strata.initialize, else torch.distributed's default group when it has NCCL,
    else one strata makes, as DeepSpeed's initialize does); on any device, a group the trainer
    hands. torch's NCCL group is the one a trainer already holds (Lightning, Accelerate and
    torchrun scripts make it), runs on its own stream, keeps the buffers it is given alive for
    the caching allocator, and is the NCCL torch was built with: strata makes no second NCCL
    communicator on the same GPUs.
The ranks' digests, norms and flags always go over the job's own (a few bytes).

Buckets (DeepSpeed's keys, counted in elements of the whole parameters):
  reduce_bucket_size     gradients reduce-scattered in one collective (default 5e8)
  allgather_bucket_size  weights all-gathered in one collective (default 5e8)
  overlap_comm           stage 3: a full bucket of gradients is reduce-scattered while backward
                         goes on, waited for when the next bucket is full or backward ends
                         (default: on at stage 3, off below, as DeepSpeed's)

Every rank must issue the same collectives in the same order: the engine does so as long as the
ranks run the same model through the same graph (parameters used, in the same order), as
DeepSpeed requires. The ranks check it: right before each bucket's collective they issue the
exchange of a 16-byte digest of what it holds (its kind, and its parameters' names and sizes),
and compare the digests before the collective's result is used (and before any collective no
digest guards), so a rank whose order differs is named on every rank at the same collective,
each raising the same error, rather than using the wrong tensors or waiting in a collective the
others never issue: the collective is given up (its buffers kept until it ends) and every later
one refused. The digest's round trip is not waited for before the collective is issued (waited
for first, it cost a stage-3 step on 2 ranks 18% here). A rank that dies or stops answering
fails the others' collectives within strata.comm_timeout_s, naming the collective.

Thread safety: the engine's (one thread).
"""

import atexit
import hashlib
import json
import os
import socket
import warnings
import weakref

import torch

from strata import _strata
from strata.notices import StrataWarning

__all__ = ["Collectives", "Ranks", "agree_on_setup", "choose_collectives", "join"]

_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_joined = []  # the job this process joined (once: its store holds MASTER_PORT + 1)
_told_alone = []  # the warning that launcher's variables without RANK or WORLD_SIZE were seen


def join(raw_config):
    """Ranks for an engine (or strata.init) when this process was launched as one of several (RANK
    or WORLD_SIZE set: the C++ reader checks every launcher's variable and names a missing or
    wrong one), else None. `raw_config`: the config as a dict (its strata.comm_timeout_s bounds
    every wait). A process joins its job once (its store holds MASTER_PORT + 1): strata.init and
    every engine share the job's collectives, in one order, each with Ranks (buckets) of its own.
    MASTER_ADDR, MASTER_PORT or LOCAL_RANK alone (accelerate's launch of one process sets the
    first two; some clusters export them to every process) leave this process training alone, as
    torch's does without init_process_group: said once in a warning; with a torch.distributed
    group of several ranks initialized (torch's spawn recipe), refused by name."""
    if not any(v in os.environ for v in ("RANK", "WORLD_SIZE")):
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # (torch's spawn recipe: init_process_group(rank=, world_size=) in each process)
            raise ValueError(
                f"strata: torch.distributed is initialized with {dist.get_world_size()} ranks "
                f"(this one {dist.get_rank()}), but RANK and WORLD_SIZE are not in the "
                "environment, from which strata joins the job: training alone here would "
                "differ from data parallel; accepted: launch with torchrun (or DeepSpeed's "
                "launcher), or set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK in "
                "each process before strata.initialize")
        stray = [v for v in _LAUNCH_VARIABLES if v in os.environ]
        if stray and not _told_alone:
            _told_alone.append(True)
            warnings.warn(
                f"strata: {', '.join(stray)} set but neither RANK nor WORLD_SIZE: this process "
                "trains alone; a job of several processes needs its launcher's RANK and "
                "WORLD_SIZE (torchrun and DeepSpeed's launcher set them)", StrataWarning,
                stacklevel=3)
        return None
    strata_block = raw_config.get("strata", {}) if isinstance(raw_config, dict) else {}
    timeout_s = strata_block.get("comm_timeout_s", 1800) if isinstance(strata_block, dict) \
        else 1800
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or \
            not 1 <= timeout_s <= 7 * 24 * 3600:
        raise ValueError(f"config: strata.comm_timeout_s: {timeout_s!r} is not accepted; "
                         "accepted: whole seconds from 1 to 604800")
    transport = strata_block.get("comm_transport", "auto") if isinstance(strata_block, dict) \
        else "auto"
    if not isinstance(transport, str):
        transport = json.dumps(transport)  # (named as given, once the ranks have exchanged it)
    if not _joined:
        _joined.append((_strata.Job(timeout_ms=timeout_s * 1000, transport=transport),
                        timeout_s, transport))
    job, joined_timeout, joined_transport = _joined[0]
    if job.world_size == 1:
        return None
    ranks = Ranks(job)
    if timeout_s != joined_timeout:
        ranks.warnings.append(
            f"strata.comm_timeout_s: {timeout_s} s, but this process joined its job with "
            f"{joined_timeout} s (an earlier strata.init or engine): the job's is kept")
    if transport != joined_transport:
        ranks.warnings.append(
            f"strata.comm_transport: {transport!r}, but this process joined its job with "
            f"{joined_transport!r} (an earlier strata.init or engine): the job's is kept")
    return ranks


# Elements of a bucket per byte of strata.host_budget_bytes: a bucket's buffers are host memory
# outside the tiers' budgets (the gradients it holds as autograd made them, at most 4 bytes an
# element, and its send buffer, 4 more; with overlap_comm one more bucket's send buffer in flight;
# an all-gather's in the training dtype), so that buckets are capped at a 64th of the host budget
# in elements: about a fifth of the budget in bytes at most in flight; and between collectives
# the buffers kept for the next ones (Ranks._give): two buckets' in fp32, an eighth more.
_BUCKET_PER_BUDGET_BYTE = 1 / 64


def bucket_settings(zero, stage):
    """The zero_optimization block's reduce_bucket_size, allgather_bucket_size (elements, 5e8 by
    default as DeepSpeed's) and overlap_comm (on at stage 3 by default, as DeepSpeed's), checked
    (in one process too, where they have nothing to act on)."""
    buckets = {}
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        value = zero.get(key, int(5e8))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
            raise ValueError(f"config: zero_optimization.{key}: {value!r} is not accepted; "
                             "accepted: a number of elements, 1 or more")
        buckets[key] = int(value)
    overlap = zero.get("overlap_comm", stage == 3)
    if overlap in (0, 1) and not isinstance(overlap, float):
        overlap = bool(overlap)
    if not isinstance(overlap, bool):
        raise ValueError(f"config: zero_optimization.overlap_comm: {overlap!r} is not "
                         "accepted; accepted: true or false")
    return buckets["reduce_bucket_size"], buckets["allgather_bucket_size"], overlap


def _as_rows(flat, rows, numel, into_rows):
    """A parameter's `numel` elements (`flat`) and its rank rows (`rows`: size x shard, rank j's
    row elements [j * shard, (j + 1) * shard)), copied one into the other (`into_rows`: from
    flat into rows); the padding after the last element is left as it is. Returns (the rows
    full, the elements of the last row that is not)."""
    shard = rows.shape[1]
    full, rest = divmod(numel, shard)
    pairs = [(flat[:full * shard].view(full, shard), rows[:full])]
    if rest:
        pairs.append((flat[full * shard:], rows[full, :rest]))
    for elements, row in pairs:
        (row if into_rows else elements).copy_(elements if into_rows else row)
    return full, rest


class Collectives:
    """Where the gradients' reduce-scatters and the weights' all-gathers run, and the buffers they
    take (`device`: where those are; `pinned`: host buffers pinned for a GPU's copies). Each call
    is issued at once and returns a work whose wait() makes its result ready for what follows."""

    KEPT = 4  # host buffers kept for the next collectives
    KEPT_FROM = 1 << 18  # elements: a smaller buffer comes from the allocator's heap, warm

    def __init__(self, name, device=torch.device("cpu"), pinned=False):
        self.name = name
        self.device = device
        self.pinned = pinned
        self._kept = []  # plain host buffers given back (give), for the next take

    def empty(self, *shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=self.device, pin_memory=self.pinned)

    def take(self, numel, dtype=torch.float32):
        """A 1-D buffer of `numel` elements for a collective, its contents undefined. In plain host
        memory, one given back before where one fits (up to twice as large): a fresh buffer of
        tens of MB costs three times its copy in page faults (glibc maps each large block
        afresh), which was 6% of a ZeRO-2 step on 2 ranks. Pinned and device buffers are new
        ones (their allocators cache)."""
        if self.pinned or self.device.type != "cpu" or numel < self.KEPT_FROM:
            return self.empty(numel, dtype=dtype)
        best = None
        for i, kept in enumerate(self._kept):
            if kept.dtype == dtype and numel <= kept.numel() <= 2 * numel and \
                    (best is None or kept.numel() < self._kept[best].numel()):
                best = i
        if best is None:
            return self.empty(numel, dtype=dtype)
        return self._kept.pop(best)[:numel]

    def give(self, buffer, limit_bytes):
        """`buffer` (take's, or a view of it) is no longer used by anyone: the next take may hand
        it out again. The largest are kept, at most KEPT of them and `limit_bytes` in all."""
        base = buffer if buffer._base is None else buffer._base
        if self.pinned or self.device.type != "cpu" or base.numel() < self.KEPT_FROM:
            return
        self._kept.append(base.view(-1))
        self._kept.sort(key=lambda kept: -kept.numel())
        while len(self._kept) > self.KEPT or \
                sum(kept.numel() * kept.element_size() for kept in self._kept) > limit_bytes:
            self._kept.pop()

    def let_go(self):
        """The buffers kept are freed (the engine closed)."""
        self._kept = []


class _OnJob(Collectives):
    """strata's own (the job's: shared memory between ranks on one host, else Gloo over TCP):
    reduce-scatters on its second communicator, so a bucket in flight never holds up a weight
    all-gather on the first (overlap_comm)."""

    def __init__(self, job, pinned=False):
        how = "shared memory" if job.transport == "shared memory" else "Gloo over TCP"
        super().__init__(f"strata's collectives ({how}) over host memory" +
                         (" (a GPU's buffers staged through pinned memory)" if pinned else ""),
                         pinned=pinned)
        self.job = job

    def reduce_scatter(self, send, out):
        return self.job.reduce_scatter(send, out, async_op=True, side=True)

    def all_gather(self, send, whole):
        return self.job.all_gather(send, whole, async_op=True)


class _OnGroup(Collectives):
    """A torch.distributed process group (NCCL's on a GPU, over the device's buffers).

    At the interpreter's exit (_settle_groups_at_exit) its works not yet waited for are given a
    moment to finish: torch's threads release a finished work's tensors, which takes the GIL, and
    one released once Python is finalizing aborts the process ("terminate called without an
    active exception")."""

    def __init__(self, group, device, pinned=False, made=False):
        import torch.distributed as dist
        self._dist = dist
        self.group = group
        self.made = made  # strata made it: destroyed at the interpreter's exit (settle)
        self.unwaited = []  # the works issued and not yet waited for (_Issued)
        super().__init__(f"torch.distributed's {_backend_for(group, device)} process group"
                         f"{' (made by strata)' if made else ''} over "
                         f"{'pinned host' if pinned else device.type} buffers", device, pinned)
        _GROUPS_IN_USE.add(self)
        if made:
            _MADE_GROUPS.append(self)  # (destroyed at exit even once no engine holds it)

    def reduce_scatter(self, send, out):
        return self._issued(self._dist.reduce_scatter_tensor(out, send, group=self._live(),
                                                             async_op=True))

    def all_gather(self, send, whole):
        return self._issued(self._dist.all_gather_into_tensor(whole, send, group=self._live(),
                                                              async_op=True))

    def _live(self):
        if self.group is None:  # (None would name torch's default group)
            raise RuntimeError("strata: a collective on a torch.distributed group that was "
                               "destroyed (by destroy_process_group(), or, the one strata made, "
                               "at the interpreter's exit); accepted: collectives before it")
        return self.group

    def _issued(self, work):
        if _EXIT_SETTLED:
            # Issued by an exit handler that runs after strata's (a trainer's, registered
            # before strata was imported): nothing would hold it until torch's thread is done
            # with it before Python finalizes.
            _hold_after_exit(work)
        self.unwaited = [w for w in self.unwaited if not w.is_completed()]
        issued = _Issued(work, self)
        self.unwaited.append(issued)
        return issued

    def settle(self, deadline):
        """Polls (until `deadline`, time.monotonic()'s) the works not yet waited for until they
        finish; then the default group strata made is destroyed (as torch asks of whoever makes
        one; not while a work of it runs, which the destroy would wait for), and a group the
        trainer destroyed is let go (its threads then end with it, while Python still runs)."""
        import time
        while any(not w.is_completed() for w in self.unwaited) and time.monotonic() < deadline:
            time.sleep(0.001)
        finished = all(w.is_completed() for w in self.unwaited)
        _keep_for_good(w.work for w in self.unwaited)
        self.unwaited = []
        if self.group is None:
            return
        dist = self._dist
        try:
            if finished and self.made and dist.is_initialized() and \
                    dist.group.WORLD is self.group:
                dist.destroy_process_group()
            dist.get_rank(self.group)
        except (RuntimeError, ValueError):  # destroyed (by the trainer, or just above)
            self.group = None


class _Issued:
    """A work strata issued on a torch group, as the group's caller uses it (wait, is_completed),
    known to the group until it is waited for."""

    def __init__(self, work, owner):
        self.work, self.owner = work, owner

    def wait(self):
        try:
            return self.work.wait()
        finally:
            if self in self.owner.unwaited:
                self.owner.unwaited.remove(self)

    def is_completed(self):
        return self.work.is_completed()


_GROUPS_IN_USE = weakref.WeakSet()
_MADE_GROUPS = []
_SETTLE_AT_EXIT_S = 5  # the longest the interpreter's exit waits for collectives still running
_EXIT_SETTLED = False  # _settle_groups_at_exit has run: the interpreter is about to finalize
# The works issued since then, each with when it was first seen finished (None: not yet). The
# list is never freed (settle keeps it for good); a work is let go from it once it has been seen
# finished for _KEEP_AFTER_EXIT_S (torch's thread long done with it: the main thread frees it),
# so that an exit handler's many collectives (a consolidated save) do not all stay in memory.
_AFTER_EXIT = []
_KEEP_AFTER_EXIT_S = 0.5


def _hold_after_exit(work):
    import time
    now = time.monotonic()
    kept = []
    for entry in _AFTER_EXIT:
        if entry[1] is None and entry[0].is_completed():
            entry[1] = now
        if entry[1] is None or now - entry[1] < _KEEP_AFTER_EXIT_S:
            kept.append(entry)
    _AFTER_EXIT[:] = kept
    _AFTER_EXIT.append([work, None])


def _keep_for_good(objects):
    """Each of `objects` (torch's Works, or a list of them) given a reference that is never
    dropped: torch's thread, whenever it lets go of a work, then never destroys it, which would
    release its tensors' Python objects (taking the GIL: during finalization that aborts the
    process)."""
    import ctypes
    for o in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


@atexit.register
def _settle_groups_at_exit():
    """Before the interpreter finalizes: every torch group's works not yet waited for given up
    to 5 s in all to finish, the group strata made destroyed, a moment given to the groups'
    threads to release what they just finished (_OnGroup). A group the trainer made stays usable
    for exit handlers that run after this one (those registered before strata was imported).
    The works not yet waited for are never freed (_keep_for_good), nor those issued after this
    until they have long finished (_hold_after_exit): torch's thread may let go of one after
    Python has begun to finalize."""
    import time
    global _EXIT_SETTLED
    _EXIT_SETTLED = True
    _keep_for_good([_AFTER_EXIT])
    groups = list(_GROUPS_IN_USE)
    deadline = time.monotonic() + _SETTLE_AT_EXIT_S
    for group in groups:
        group.settle(deadline)
    if groups:
        time.sleep(0.02)


def _backend_for(group, device):
    """The backend `group` runs `device`'s tensors on ("cpu:gloo,cuda:nccl" names one a device
    type); its whole name where it names one backend."""
    backend = _backend_of(group)
    for part in backend.split(","):
        kind, _, name = part.partition(":")
        if name and kind == device.type:
            return name
    return backend


def _backend_of(group):
    import torch.distributed as dist
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group made outside torch.distributed's registry
        return type(group).__name__


def training_of(config, zero):
    """The training keys every rank must share (config: config.TrainConfig; zero: the
    zero_optimization block as read), as setup_of takes them: ranks that step their shards with
    other rates, clipping, loss scaling or batches would train a model no rank's config
    describes. The NVMe folders may differ (each rank's own drive)."""
    zero = {k: ({kk: vv for kk, vv in v.items() if kk != "nvme_path"}
                if isinstance(v, dict) else v) for k, v in zero.items()}
    keys = {"optimizer": config.optimizer, "scheduler": config.scheduler,
            "gradient_clipping": config.clipping,
            "train_micro_batch_size_per_gpu": config.micro_batch,
            "gradient_accumulation_steps": config.accumulation,
            "data_types.grad_accum_dtype": config.grad_accum_dtype,
            "fp16": [config.loss_scale, config.initial_scale_power, config.loss_scale_window,
                     config.hysteresis, config.min_loss_scale, config.consecutive_hysteresis],
            "zero_optimization": zero}
    out = {}
    for key, value in keys.items():
        text = json.dumps(value, sort_keys=True, default=str)
        # Short ones as they are; a long one by its digest (its text would not fit the exchange).
        out[key] = text if len(text) <= 80 else \
            "digest " + hashlib.sha256(text.encode()).hexdigest()[:12]
    return out


def setup_of(settings, dtype, error=None, training=None):
    """This rank's set-up as agree_on_setup exchanges it: `settings` (runtime_settings.
    RuntimeSettings), the training dtype, an `error` that stops this rank (or None), and the
    training keys (training_of)."""
    mine = {"stage": str(settings.stage), "dtype": str(dtype).replace("torch.", ""),
            "device": "cuda" if settings.cuda else "emulated", **(training or {})}
    if settings.cuda:
        mine["visible GPUs"] = str(torch.cuda.device_count())
        try:
            mine["gpu"] = gpu_identity(settings.cuda_device())
        except (ValueError, RuntimeError) as raised:
            error = error or str(raised)
    if error:
        mine["error"] = error[:_SETUP_BYTES // 2]
    return mine


_SETUP_BYTES = 4096  # a rank's set-up, as JSON, at most
_PACKED_BYTES = 64 << 20  # broadcast_tensors: the bytes of one broadcast, at most


def agree_on_setup(ranks, mine):
    """Every rank's set-up (`mine`: a dict of short texts; "error": this rank cannot go on, why),
    exchanged before anything else is, so that ranks whose device, visible GPU count, dtype or
    stage differ, or a rank that cannot go on, are named on every rank at once, each raising the
    same ValueError (never one rank raising while the others wait in a collective). Returns every
    rank's dict."""
    limit = _SETUP_BYTES
    raw = json.dumps(mine, sort_keys=True).encode()
    cut = limit // (2 * len(mine))
    while len(raw) > limit:  # a rank's texts, cut until their JSON fits (escapes take room)
        mine = {k: v[:cut] for k, v in mine.items()}
        raw = json.dumps(mine, sort_keys=True).encode()
        cut //= 2
    data = bytearray(limit)
    data[:len(raw)] = raw
    everyone = torch.empty(ranks.size * limit // 4)  # the bytes, as float32's bits
    ranks.job.all_gather(torch.frombuffer(data, dtype=torch.float32), everyone)
    flat = everyone.numpy().tobytes()
    setups = [json.loads(flat[r * limit:(r + 1) * limit].rstrip(b"\0").decode())
              for r in range(ranks.size)]
    failed = [f"rank {r}: {s['error']}" for r, s in enumerate(setups) if s.get("error")]
    if failed:
        raise ValueError("strata.initialize: across ranks: " + "; ".join(failed))
    differ = []
    for key in sorted(k for k in setups[0] if k != "gpu"):
        values = [s.get(key) for s in setups]
        if len(set(values)) > 1:
            differ.append(f"{key}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    if differ:
        raise ValueError("strata.initialize: the ranks' set-ups differ (" + "; ".join(differ) +
                         "); accepted: the same config on every rank (but for nvme_path), each "
                         "rank seeing as many GPUs")
    return setups


def gpu_identity(device):
    """This host and GPU (who shares a GPU with whom: NCCL refuses two ranks on one)."""
    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"


def choose_collectives(ranks, device, setups, process_group=None, timeout_s=1800):
    """The Collectives for an engine on `device` (its compute device), `setups` every rank's
    (agree_on_setup: "gpu" each one's host and GPU on a GPU), `process_group` the one a trainer
    handed (or None). Returns (collectives, a notice to say once or None)."""
    if process_group is not None:
        _check_group(ranks, process_group)
        backend = _backend_of(process_group)
        if device.type == "cuda" and "nccl" in backend:
            return _OnGroup(process_group, device), None
        if device.type == "cuda" and "gloo" not in backend:
            raise ValueError(f"strata.initialize: process_group: its backend {backend!r} runs "
                             "neither on the GPU's buffers nor on host ones; accepted: a group "
                             "with NCCL (or Gloo, the GPU's buffers staged through host memory)")
        if device.type != "cuda" and "gloo" not in backend:
            raise ValueError(f"strata.initialize: process_group: its backend {backend!r} does "
                             "not run on host tensors, where the emulated device tier's are; "
                             "accepted there: a group with Gloo")
        return _OnGroup(process_group, torch.device("cpu"), pinned=device.type == "cuda"), None
    if device.type != "cuda":
        return ranks.collectives, None
    gpus = [s.get("gpu") for s in setups]
    shared = sorted({g for g in gpus if gpus.count(g) > 1})
    why = None
    if shared:
        who = [r for r, g in enumerate(gpus) if g in shared]
        why = (f"ranks {', '.join(map(str, who))} share a GPU ({shared[0]}), which NCCL refuses")
    else:
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_nccl_available():
            why = "this torch has no NCCL"
    if why is not None:
        return _OnJob(ranks.job, pinned=True), (
            f"across ranks on GPUs: {why}: the gradients and weights go through strata's own collectives, "
            "staged through pinned host memory (slower than NCCL; each rank on a GPU of its "
            "own uses NCCL)")
    return _default_nccl_group(ranks, device, timeout_s), None


def _check_group(ranks, group):
    size, rank = group.size(), group.rank()
    if (size, rank) != (ranks.size, ranks.rank):
        raise ValueError(
            f"strata.initialize: process_group: rank {rank} of {size} in the group handed, but "
            f"rank {ranks.rank} of {ranks.size} as the launcher says (RANK, WORLD_SIZE); "
            "accepted: a group of the job's every rank, in the launcher's order")


def _default_nccl_group(ranks, device, timeout_s):
    """torch.distributed's default group when it has NCCL, else one made (env://, as DeepSpeed's
    initialize makes it, NCCL for the GPU's tensors and Gloo for the host's)."""
    import datetime
    import torch.distributed as dist
    if dist.is_initialized():
        group = dist.group.WORLD
        if "nccl" in _backend_of(group):
            _check_group(ranks, group)
            return _OnGroup(group, device)
        raise ValueError(
            f"strata.initialize: torch.distributed's default group is {_backend_of(group)!r}, "
            "without NCCL, and strata.device is \"cuda\"; accepted: a default group with NCCL "
            "(init_process_group(\"nccl\") or its default \"cpu:gloo,cuda:nccl\"), or a group "
            "handed as strata.initialize(process_group=...)")
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method="env://",
                            rank=ranks.rank, world_size=ranks.size, device_id=device,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return _OnGroup(dist.group.WORLD, device, made=True)


class _Agreement:
    """One digest exchange (Ranks._agree): issued, then checked before what it guards is used;
    the collective it guards (`guarded`) is given up with it where the ranks disagree."""

    def __init__(self, ranks, number, what, work, everyone):
        self.ranks, self.number, self.what = ranks, number, what
        self.work, self.everyone = work, everyone
        self.guarded = None
        self.agreed = None  # every rank's flag, once compared

    def check(self):
        """This agreement and every one before it compared (raising where the ranks differ);
        returns whether every rank was ok."""
        if self.agreed is None:
            self.ranks._check_agreements(self)
        return self.agreed

    def compare(self):
        ranks = self.ranks
        try:
            self.work.wait()
        except _strata.Error as error:
            ranks._disagreed(f"rank {ranks.rank} of {ranks.size}: about to issue "
                             f"{self.what[:300]}: the ranks could not agree on it: {error}")
        raw = self.everyone.view(ranks.size, 5).numpy().tobytes()
        digests = [raw[20 * r:20 * r + 16] for r in range(ranks.size)]
        other = [r for r in range(ranks.size) if digests[r] != digests[0]]
        if other:
            self.abandon()
            ranks._disagreed(
                f"rank {ranks.rank} of {ranks.size}: the ranks issue different collectives at "
                f"collective {self.number}: rank{'s' if len(other) > 1 else ''} "
                f"{', '.join(map(str, other))} differ{'' if len(other) > 1 else 's'} from rank 0 "
                f"(this rank: {self.what[:300]}); accepted: the same model on every rank, its "
                "parameters used in the same order (the same graph); at stages 2-3 a parameter "
                "the data makes some ranks use and not others in a micro-batch (a branch, an "
                "expert given no tokens on a rank) breaks that order: every rank uses it (h = h + "
                "module(h[:0]).sum(): an empty batch, zero), or stage 0-1 (gradients reduced "
                "whole after backward); at stage 3 "
                "every rank runs every forward, evaluation's too (a module's weights are "
                "gathered from every rank); a model built under strata.init: every rank runs the "
                "same code on its weights (a read or write in the context, load_state_dict, "
                "GatheredParameters, copy.deepcopy), as each rank holds a shard of them")
        self.agreed = all(raw[20 * r + 16:20 * r + 20] == bytes(4) for r in range(ranks.size))

    def abandon(self):
        for work in (self.work, self.guarded):
            if hasattr(work, "abandon"):  # strata's own (a torch.distributed work ends alone)
                work.abandon()


class Ranks:
    """The job's ranks and one engine's collectives over them."""

    def __init__(self, job):
        self.job = job
        self.rank = job.rank
        self.size = job.world_size
        self.warnings = []
        self.reduce_bucket = int(5e8)
        self.allgather_bucket = int(5e8)
        self.overlap = False
        self._pending = []  # stage 3: (e, fp32 gradient, boundary) waiting for a full bucket
        self._pending_elements = 0
        # (work, entries, output, agreement) of the bucket being reduce-scattered
        self._in_flight = None
        self._collectives = 0  # issued so far (named when the ranks disagree)
        self._agreements = []  # issued, not yet checked, in order (_Agreement)
        self._broken = None  # the ranks disagreed: every later collective raises this
        self.reduce_scatters_in_backward = 0  # buckets reduce-scattered while backward ran
        # Where the gradients' and weights' collectives run (choose_collectives; until an engine
        # says otherwise, the job's own over host memory).
        self.collectives = _OnJob(job)
        self.device = torch.device("cpu")  # where the model computes (the gathered weights go)

    def use(self, collectives, device):
        """The engine's: its collectives (choose_collectives) and its compute device."""
        self.collectives, self.device = collectives, device

    def _give(self, buffer):
        """A collective's buffer given back to be kept for the next ones: at most two buckets'
        fp32 buffers (8 bytes an element of the larger bucket size), host memory outside the
        budgets as the buckets in flight are (_BUCKET_PER_BUDGET_BYTE)."""
        self.collectives.give(buffer, 8 * max(self.reduce_bucket, self.allgather_bucket))

    def configure(self, zero, stage, host_budget_bytes):
        """Takes the bucket keys of the zero_optimization block (bucket_settings), each bucket
        capped by the host budget (see _BUCKET_PER_BUDGET_BYTE; said in self.warnings)."""
        self.reduce_bucket, self.allgather_bucket, self.overlap = bucket_settings(zero, stage)
        cap = max(1 << 16, int(host_budget_bytes * _BUCKET_PER_BUDGET_BYTE))
        for key, attr in (("reduce_bucket_size", "reduce_bucket"),
                          ("allgather_bucket_size", "allgather_bucket")):
            if getattr(self, attr) > cap:
                if key in zero:
                    self.warnings.append(
                        f"zero_optimization.{key}: {getattr(self, attr)} elements would hold "
                        "that many in host memory outside strata.host_budget_bytes: buckets of "
                        f"{cap} are used (a 64th of the host budget)")
                setattr(self, attr, cap)

    def _agree(self, kind, entries):
        """Every rank is about to issue the same collective `kind` over the same parameters (see
        the module's docstring); else every rank raises, naming the ranks that differ. Returns
        the agreement, issued and not yet waited for (_Agreement): the collective is issued
        right behind it, and the agreement is checked before its result is used (check()), so
        that the digests' round trip is not added to every collective's."""
        return self._start_agreement(
            f"{kind} of " + ", ".join(f"{e.name} ({e.numel})" for e in entries), True)

    def _start_agreement(self, what, ok):
        self._refuse_if_broken()
        self._collectives += 1
        mine = bytearray(hashlib.blake2b(what.encode(), digest_size=16).digest())
        mine += bytes(4) if ok else b"\xff" * 4  # (float32's bits: 0.0, or a NaN)
        everyone = torch.empty(self.size * 5)  # 20 bytes a rank, carried as float32's bits
        try:
            work = self.job.all_gather(torch.frombuffer(mine, dtype=torch.float32), everyone,
                                       async_op=True)
        except _strata.Error as error:
            raise _strata.Error(f"rank {self.rank} of {self.size}: about to issue {what[:300]}: "
                                f"the ranks could not agree on it: {error}") from None
        agreement = _Agreement(self, self._collectives, what, work, everyone)
        self._agreements.append(agreement)
        return agreement

    def agree(self, what, ok=True):
        """Every rank is about to do `what` (see _agree: else every rank raises, naming the
        ranks that differ), checked now; returns whether every rank is `ok` (each rank says
        whether it is: a flag carried with the digest, in the same collective)."""
        return self._start_agreement(what, ok).check()

    def _check_agreements(self, upto):
        """The agreements issued up to `upto` (the last one when None) are checked, in order."""
        while self._agreements:
            agreement = self._agreements[0]
            if upto is not None and agreement.number > upto.number:
                return
            self._agreements.pop(0)
            agreement.compare()

    def _settle(self):
        """Before a collective no digest guards (a few bytes: norms, flags): the agreements
        issued so far are checked, so that ranks that disagree are named, not paired wrongly."""
        self._refuse_if_broken()
        self._check_agreements(None)

    def _refuse_if_broken(self):
        if self._broken is not None:
            raise _strata.Error(self._broken)

    def _disagreed(self, message):
        """The ranks disagree: what is in flight is given up (it may never complete: its tensors
        are kept until it does) and every later collective refused with the same error."""
        self._broken = message
        for agreement in self._agreements:
            agreement.abandon()
        self._agreements.clear()
        raise _strata.Error(message)

    # --- shards ---------------------------------------------------------------------------------

    def shard_elements(self, numel):
        return -(-numel // self.size)

    def own_range(self, numel, shard):
        """The elements (start, stop) of a whole of `numel` this rank's shard of `shard`
        elements holds (its padding past the whole's end not counted)."""
        lo = min(self.rank * shard, numel)
        return lo, min(lo + shard, numel)

    def own_shard(self, flat, shard):
        """This rank's shard of a whole flat tensor, padded with zeros to `shard` elements (a
        copy)."""
        out = torch.zeros(shard, dtype=flat.dtype)
        lo, hi = self.own_range(flat.numel(), shard)
        out[:hi - lo] = flat[lo:hi]
        return out

    def broadcast_module(self, module, skip=lambda t: False):
        """Rank 0's parameters and buffers, of every dtype (but those `skip` names), everywhere,
        as DeepSpeed's engine starts every rank from rank 0's weights."""
        self.broadcast_tensors([t for t in list(module.parameters()) + list(module.buffers())
                                 if not skip(t) and t.numel() > 0])

    def broadcast_tensors(self, tensors, what="the model's tensors"):
        """Rank 0's values of `tensors` (any dtype, any device), in place on every rank (each
        rank gives the same shapes and dtypes: else every rank raises, naming them), packed into
        as few broadcasts as their bytes allow (a tensor larger than _PACKED_BYTES alone)."""
        self.agree(f"the broadcast of {what} " +
                   ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors))
        group, size = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if group and size + nbytes > _PACKED_BYTES:
                self._broadcast_packed(group, size)
                group, size = [], 0
            group.append(t)
            size += nbytes
        if group:
            self._broadcast_packed(group, size)

    def _broadcast_packed(self, tensors, size):
        """One broadcast of `tensors` (`size` bytes in all), their bytes carried as float32's."""
        with torch.no_grad():
            carrier = torch.zeros((size + 3) // 4)
            packed = carrier.view(torch.uint8)
            offset = 0
            for t in tensors:
                raw = t.detach().to("cpu").reshape(-1).contiguous().view(torch.uint8)
                packed[offset:offset + raw.numel()] = raw
                offset += raw.numel()
            self.job.broadcast(carrier, 0)
            offset = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                piece = packed[offset:offset + n].clone()  # (aligned for its dtype)
                t.data.copy_(piece.view(t.dtype).view(t.shape))
                offset += n

    def sync_buffers(self, module):
        """After a step: the module's buffers take rank 0's values on every rank, as DDP gives
        every rank rank 0's buffers (BatchNorm's running statistics, which torch updates in
        place without a version bump a change could be told by): an eval forward, and a
        checkpoint, then see one model on every rank."""
        buffers = [b for b in module.buffers() if b.numel() > 0]
        if buffers:
            self.broadcast_tensors(buffers, "the model's buffers")

    def broadcast_tensor(self, flat, what):
        """Rank 0's values of a flat CPU tensor, in place (strata.init: a parameter as it is
        built, before each rank keeps its shard)."""
        self.agree(f"the broadcast of {what} ({flat.numel()} {flat.dtype})")
        self.job.broadcast(flat, 0)

    def gather_tensor(self, shard, what):
        """Every rank's `shard` (a flat CPU tensor, one size and dtype on every rank), in rank order
        (strata.init: a parameter lent whole from the ranks' shards)."""
        self.agree(f"the all-gather of {what} ({shard.numel()} {shard.dtype})")
        whole = torch.empty(self.size * shard.numel(), dtype=shard.dtype)
        self.job.all_gather(shard.contiguous(), whole)
        return whole

    def _buckets(self, items, limit):
        """Consecutive runs of `items` ((e, ...) tuples) of at most `limit` whole elements each
        (one item may be larger alone)."""
        bucket, elements = [], 0
        for item in items:
            if bucket and elements + item[0].numel > limit:
                yield bucket
                bucket, elements = [], 0
            bucket.append(item)
            elements += item[0].numel
        if bucket:
            yield bucket

    # --- gradients: reduce-scattered into their owners' shards, averaged ----------------------

    def _reduce_scatter(self, bucket, async_op):
        """Starts the reduce-scatter of `bucket` ((e, its whole gradient in any floating dtype, or
        None, ...)), summed in fp32: returns (work, output, its agreement), output holding this
        rank's shards one after another (waited for, the agreement checked, unless `async_op`)."""
        # Agreed on the job's first communicator, where every collective's digest goes (one order:
        # a rank that differs is named at once, whichever communicator its collective is for);
        # reduced on the second: a bucket in flight never holds up the weights' all-gathers on
        # the first (overlap_comm).
        agreement = self._agree("reduce-scatter", [e for e, *_ in bucket])
        shards = [e.shard for e, *_ in bucket]
        total = sum(shards)
        send = self.collectives.take(self.size * total).view(self.size, total)
        offset = 0
        for (e, grad, *_), shard in zip(bucket, shards):
            # Rank j's row: elements [j * shard, (j + 1) * shard); the padding past the last
            # element, and every row where this rank has no gradient, zero.
            full, rest = 0, 0
            if grad is not None:
                full, rest = _as_rows(grad.reshape(-1), send[:, offset:offset + shard], e.numel,
                                      into_rows=True)
            if rest:
                send[full, offset + rest:offset + shard] = 0
                full += 1
            send[full:, offset:offset + shard] = 0
            offset += shard
        out = self.collectives.empty(total)
        work = agreement.guarded = self.collectives.reduce_scatter(send.view(-1), out)
        if not async_op:
            agreement.check()
            work.wait()
            self._give(send)
            send = None
        return work, out, agreement, send

    @staticmethod
    def _split(bucket, out, scale):
        offset = 0
        for item in bucket:
            e = item[0]
            yield item, out[offset:offset + e.shard].mul_(scale)
            offset += e.shard

    def reduce_gradients(self, entries, gradient_of):
        """Stage 1 (and stage 3's unpartitioned parameters), after the window's last backward:
        each entry's whole gradient (gradient_of(e): a CPU tensor, or None for none on this rank)
        is reduce-scattered in buckets; returns {e: this rank's shard of the mean over the ranks, or
        None where no rank had a gradient}."""
        self._agree("the gradients' reduction", entries).check()
        grads = [gradient_of(e) for e in entries]
        has = torch.tensor([0.0 if g is None else 1.0 for g in grads])
        self.job.all_reduce(has)
        result = {}
        items = []
        for e, g, h in zip(entries, grads, has.tolist()):
            if h > 0:
                items.append((e, g))
            else:
                result[e] = None
        for bucket in self._buckets(items, self.reduce_bucket):
            _, out, _, _ = self._reduce_scatter(bucket, async_op=False)
            for (e, _), shard in self._split(bucket, out, 1.0 / self.size):
                result[e] = shard.to("cpu")  # (the host optimizer's, from a GPU's buffer)
        return result

    def add_gradient(self, e, grad, boundary, apply):
        """Stages 2 and 3, from the gradient hook: e's whole gradient (held as autograd made it,
        not copied) joins the open bucket; a full bucket is reduce-scattered (in the background
        with overlap_comm) and `apply(e, shard, boundary)` is called with each of its entries'
        mean shards once it is done."""
        self._apply = apply
        self._pending.append((e, grad.detach(), boundary))
        self._pending_elements += e.numel
        if self._pending_elements >= self.reduce_bucket:
            self.reduce_scatters_in_backward += 1
            self._flush(wait=not self.overlap)

    def finish_gradients(self):
        """After backward: the open bucket reduce-scattered and every bucket applied."""
        if self._pending:
            self._flush(wait=True)
        self._wait_in_flight()

    def _flush(self, wait):
        self._wait_in_flight()
        bucket, self._pending, self._pending_elements = self._pending, [], 0
        self._in_flight = (*self._reduce_scatter(bucket, async_op=True), bucket)
        if wait:
            self._wait_in_flight()

    def _wait_in_flight(self):
        if self._in_flight is None:
            return
        (work, out, agreement, send, bucket), self._in_flight = self._in_flight, None
        agreement.check()
        work.wait()
        self._give(send)
        for (e, _, boundary), shard in self._split(bucket, out, 1.0 / self.size):
            self._apply(e, shard, boundary)

    def drop_gradients(self):
        """A failed backward: the buckets not yet applied are dropped (an in-flight collective is
        waited for first: its buffers must outlive it)."""
        in_flight, self._in_flight = self._in_flight, None
        self._pending, self._pending_elements = [], 0
        if in_flight is not None:
            try:
                in_flight[2].check()
                in_flight[0].wait()
            except (_strata.Error, RuntimeError):  # (strata's own; torch.distributed's)
                pass

    # --- weights: all-gathered from their owners ----------------------------------------------

    def gather(self, items):
        """items: (e, this rank's shard: a flat tensor of e.shard elements, sink) with one dtype
        per bucket; all-gathered in buckets of allgather_bucket_size; for each, sink(whole flat
        tensor of e.numel elements, its own) is called, or, where sink is a tensor of e.numel
        elements, the weights are copied into it."""
        self.finish_gather(self.start_gather(items))

    def start_gather(self, items):
        """gather's collectives issued (the shards copied out: they may be let go); returns what
        finish_gather waits for and hands to the sinks."""
        by_dtype = {}
        for item in items:
            by_dtype.setdefault(item[1].dtype, []).append(item)
        started = []
        for dtype, group in by_dtype.items():
            for bucket in self._buckets(group, self.allgather_bucket):
                agreement = self._agree(
                    f"all-gather ({dtype}; "
                    f"{'with' if torch.is_grad_enabled() else 'without'} autograd)",
                    [e for e, *_ in bucket])
                total = sum(e.shard for e, *_ in bucket)
                send = self.collectives.take(total, dtype=dtype)
                offset = 0
                for e, shard, _ in bucket:
                    send[offset:offset + e.shard] = shard
                    offset += e.shard
                whole = self.collectives.take(self.size * total, dtype=dtype)
                work = agreement.guarded = self.collectives.all_gather(send, whole)
                started.append((work, [(e, sink) for e, _, sink in bucket],
                                whole.view(self.size, total), agreement, send))
        return started

    def finish_gather(self, started, deliver=True):
        """Waits for start_gather's collectives and hands each parameter whole to its sink (see
        gather), unless not `deliver` (a prefetch unused)."""
        for work, bucket, whole, agreement, send in started:
            agreement.check()
            work.wait()
            self._give(send)
            offset = 0
            for e, sink in bucket if deliver else ():
                rows = whole[:, offset:offset + e.shard]  # rank j's row: [j * shard, ...)
                offset += e.shard
                if isinstance(sink, torch.Tensor) and sink.is_contiguous():
                    _as_rows(sink.view(-1), rows, e.numel, into_rows=False)
                    continue
                piece = rows.reshape(-1)[:e.numel]
                if isinstance(sink, torch.Tensor):
                    sink.copy_(piece.view(sink.shape))
                    continue
                piece = piece.to(self.device, non_blocking=True)  # (staged through the host)
                if piece.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
                    piece = piece.clone()  # (a view of the bucket's buffer, given back below)
                sink(piece)
            self._give(whole)

    def failed_ranks(self, ok):
        """The ranks that are not `ok` (each rank says whether it is)."""
        self._settle()
        flags = torch.zeros(self.size)
        flags[self.rank] = 0.0 if ok else 1.0
        self.job.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def broadcast_text(self, text, limit=1024):
        """Rank 0's `text` (at most `limit` bytes of UTF-8), on every rank."""
        self._settle()
        data = bytearray(limit + 4)
        if self.rank == 0:
            raw = text.encode()[:limit]
            data[:4] = len(raw).to_bytes(4, "little")
            data[4:4 + len(raw)] = raw
        carrier = torch.frombuffer(data, dtype=torch.float32)  # the bytes, as float32's bits
        self.job.broadcast(carrier, 0)
        size = int.from_bytes(bytes(data[:4]), "little")
        return bytes(data[4:4 + size]).decode()

    def all_reduce_sum(self, values):
        """The float sums over the ranks of `values` (a list of floats)."""
        self._settle()
        t = torch.tensor(values, dtype=torch.float32)
        self.job.all_reduce(t)
        return t.tolist()
