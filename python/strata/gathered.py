"""DeepSpeed's deepspeed.zero.GatheredParameters over strata's engines (see the class).

Thread safety: the engine's (one thread).
"""

import torch

from strata import checkpoints
from strata import guards
from strata import zero_init
from strata.parameters import data_of, load_master, set_data, set_weights, write_frozen

__all__ = ["GatheredParameters"]


class GatheredParameters:
    """DeepSpeed's deepspeed.zero.GatheredParameters: within the block, the given parameters that
    an engine not closed keeps as partitions (stage 3) hold their weights whole (a copy, on the
    compute device, in the training dtype), for code that reads them outside their module's
    forward, where they are placeholders with no bytes (a logged norm, a weight inspected or
    edited). With modifier_rank set (0 in one process), what the block wrote into them becomes
    their weights (and a trained one's fp32 master weights, its moments kept) when it ends, an
    exception's too; else a write is dropped, and refused by name at the block's end (in place;
    through .data, in one process). A trained parameter an engine keeps whole (stages 0-2, stage
    3's small ones) is its weights already; what the block wrote into it becomes its fp32 master
    weights too (its moments kept): with modifier_rank at the block's end, without it at the next
    forward or step, as any edit of a weight kept whole (strata/edits.py; across
    ranks: modifier_rank 0, rank 0's writes on every rank; every rank enters the block, as
    DeepSpeed's; a frozen one's too, each rank keeping rank 0's, or its shard of them; a
    trained partitioned one's edit across ranks is refused). A parameter strata.init partitioned
    that no engine has adopted yet is lent whole for the block (in the dtype it was built in;
    across ranks gathered from the shards, rank 0's writes kept). Other parameters pass as they are.
    Not for autograd: a loss computed in the
    block from them would save what backward cannot find after it (the weights are given back at
    its end); compute such a loss inside the module's forward."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        del fwd_module  # DeepSpeed's: where it registers external parameters (not needed here)
        params = [params] if torch.is_tensor(params) else list(params)
        self.modify = modifier_rank is not None
        self.enabled = enabled
        self.held = []  # (engine, entry): gathered whole for the block
        self.nested = []  # (engine, entry): whole already in an enclosing block (left to it)
        self.kept = []  # (engine, entry): whole already; written to the master weights at exit
        self.plain = []  # (engine, parameter): across ranks, its module's others (rank 0's at exit)
        self.built = []  # (strata.init context, parameter): its partition, no engine yet
        if not enabled:
            return

        def modified_by_rank_0(engine):
            """Across ranks an edit is rank 0's, written on every rank: another is refused."""
            if self.modify and engine.ranks is not None and modifier_rank != 0:
                raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}) across "
                                 "ranks: accepted: modifier_rank=0 (rank 0's writes become "
                                 "every rank's weights)")
        for p in params:
            for engine in list(guards.LIVE):
                if engine._runtime is None:
                    continue
                kept = engine.table.trained_by_id.get(id(p)) if self.modify else None
                if kept is not None and not kept.partitioned:
                    modified_by_rank_0(engine)
                    self.kept.append((engine, kept))
                    break
                e = engine.stage == 3 and engine.table.partitioned_by_id.get(id(p))
                if e:
                    if self.modify and engine.ranks is not None and not e.frozen:
                        raise ValueError("GatheredParameters(modifier_rank=...) across ranks "
                                         f"over {e.name}, a trained parameter partitioned: not "
                                         "supported yet (each rank holds a shard of its master "
                                         "weights); accepted: modifier_rank=None, or one "
                                         "process (a frozen one's edit is taken)")
                    modified_by_rank_0(engine)
                    self.held.append((engine, e))
                    break
                if self.modify and engine.ranks is not None and \
                        any(q is p for q in engine.module.parameters()):
                    # (a frozen one under the persistence threshold: each rank's copy)
                    modified_by_rank_0(engine)
                    self.plain.append((engine, p))
                    break
            else:
                context = zero_init.lendable(p)
                if context is not None:
                    modified_by_rank_0(context)
                    self.built.append((context, p))

    def __enter__(self):
        self.nested = [(engine, e) for engine, e in self.held if engine._edits.in_block(e)]
        self.held = [(engine, e) for engine, e in self.held if (engine, e) not in self.nested]
        for engine, e in self.held:  # all checked before any changes
            if data_of(e.param).numel() != 0:
                raise RuntimeError(f"GatheredParameters: {e.name} is lent to its module now "
                                   "(inside its forward or backward); accepted: outside them")
        for engine, _ in self.kept:  # no step of the optimizer's thread writes them meanwhile
            engine.runtime.wait_for_early_steps()
        with torch.no_grad():
            for engine, e in self.held:
                engine.runtime.wait_for_early_steps()
                set_data(e.param, engine._whole_weights(e).to(engine.device).view(e.shape))
                engine._edits.lend_whole(e, self.modify)
        for context, p in self.built:  # (lent whole for the block: see _Lending.unpin)
            context.lending.pin(p, self.modify)
        return self

    def __exit__(self, *exc):
        try:
            # A partitioned weight written in place in a block that does not modify: its writes
            # are dropped with it (refused by name below, once given back).
            dropped = [] if self.modify else [
                e.name for engine, e in self.held if engine._edits.written_whole(e)]
            # (with modifier_rank what the block wrote is kept, an exception's too, as plain
            # torch keeps it)
            if self.modify:
                both = self.held + self.nested + self.kept
                for engine in {id(engine): engine for engine, _ in both}.values():
                    self._write_back(engine, [e for owner, e in both if owner is engine])
                for engine, e in self.nested:  # (what the enclosing block lent is this now)
                    engine._edits.relent(e)
                for engine in {id(engine): engine for engine, _ in self.plain}.values():
                    engine.ranks.broadcast_tensors([p.data for owner, p in self.plain
                                                    if owner is engine])
        finally:
            for engine, e in self.held:
                set_data(e.param, engine.table.placeholder)
                engine._edits.end_block(e)
                engine._edits.settled([e])  # (what the block wrote is taken, or refused here)
            for context, p in self.built:
                context.lending.unpin(p)
        if dropped and exc[0] is None:
            raise RuntimeError(
                f"GatheredParameters without modifier_rank: {', '.join(dropped[:3])} written in "
                "place in the block, and its writes were dropped with the whole weights at its "
                "end (a block that does not modify gives them back unwritten); accepted: "
                "GatheredParameters(params, modifier_rank=0) to keep what the block writes")
        return False

    @staticmethod
    def _write_back(engine, entries):
        """The block's writes into `entries` (across ranks, unpartitioned ones, rank 0's): a frozen
        one's partition; a trained one's master weights (its moments kept, in one load of the
        optimizer's state; across ranks, this rank's shard of them) and weights."""
        if engine.ranks is not None:
            engine.ranks.broadcast_tensors([data_of(e.param) for e in entries])
        trained = []
        for e in entries:
            values = data_of(e.param).detach().reshape(-1)
            if e.frozen:
                write_frozen(engine.runtime, e, values.cpu(), engine.ranks)
            else:
                trained.append((e, values.to(device="cpu", dtype=torch.float32).contiguous()))
        with checkpoints.loading_optimizer_state(engine._checkpoints, "GatheredParameters",
                                                 whole=False):
            for e, master in trained:
                load_master(engine.runtime, e, master if engine.ranks is None else
                            engine.ranks.own_shard(master, e.shard))
        for e, master in trained:
            set_weights(engine.runtime, e, master)
