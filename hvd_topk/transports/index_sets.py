"""AR-Topk's shared index sets, identical on every rank.

By default the leader of step t+1 picks its set during step t ("one step stale"), and at the end of
step t one asynchronous allgather carries every tensor's set (each rank contributes the sets it leads),
so the backward pass never waits on a collective per tensor, and a step costs one index collective, not
one per tensor (Horovod neither fuses broadcasts nor keeps them in its response cache: each one is
negotiated).

Default (one step stale): ``select`` sends the values at the set shared during the previous step and,
on the next step's leader, picks the next set; ``flush`` (called on every rank once the step's last
``select`` is done) starts one allgather with every set of the step: rank r contributes the sets it
leads, in key order, and every rank splits the result by the (key, k, leader) plan, which is identical
on all ranks. The next step's first ``select`` waits for it (long finished by then).
"""
import zlib

import torch
from horovod.torch import mpi_ops

from ..core.sparsify import spread_indices, topk_indices
from .collectives import wait

__all__ = ["IndexPipeline", "PLAN_HEADER"]

# Every rank's block of the allgather starts with [number of index entries, fingerprint of its (key, k)
# list, fingerprint of its leaders]: blocks of any length can be split, and every rank sees whether all
# ranks meant the same plan. If the keys differ (ranks keyed their tensors differently), every rank
# raises the same error instead of applying a set to the wrong tensor or waiting forever. If only the
# leaders differ (the ranks' step counters differ: a rank joined an elastic job), every rank drops the
# sets and, given ``on_leaders_differ``, realigns its counters; without it, raises.
PLAN_HEADER = 3


class IndexPipeline:
    """Shared AR-Topk index sets, per key (tensor), identical on every rank (module docstring).

    Args:
        name: prefix of the Horovod collective names (must be identical on all ranks).
        sync: broadcast the current step's index set inside ``select`` and wait for it, instead.
        mismatch_hint: what the error says to do when the ranks' plans differ.
        process_set: the ranks that share the sets; ranks count within it.
        on_leaders_differ: called on every rank when only the leaders differ; None: raise.
    """

    def __init__(self, name, sync=False, mismatch_hint="", process_set=mpi_ops.global_process_set,
                 on_leaders_differ=None):
        self.name, self.sync, self.process_set = name, sync, process_set
        self.mismatch_hint, self.on_leaders_differ = mismatch_hint, on_leaders_differ
        self.outgoing = {}         # key -> (k, leader, int32 set or None): picked this step, not yet sent
        self.in_flight = None      # (allgather handle, [(key, k, leader)]) of the last flush
        self.ready = {}            # key -> int32 index set for the next step

    def current(self, key, acc, k, leader):
        """The int64 index set every rank uses for ``key`` now; ``leader`` picks it if ``sync``."""
        if self.sync:
            ps = self.process_set
            buf = (topk_indices(acc, k).to(torch.int32) if ps.rank() == leader
                   else torch.empty(k, dtype=torch.int32, device=acc.device))
            if ps.size() > 1:                 # Horovod's root_rank is a global rank
                wait(mpi_ops.broadcast_async_(buf, ps.ranks[leader], name=f"{self.name}.{key}", process_set=ps))
            return buf.long()
        self.receive()
        buf = self.ready.pop(key, None)
        if buf is None or buf.numel() != k:    # first step, or k changed: any shared set is valid
            return spread_indices(acc.numel(), k, device=acc.device)
        return buf.long()

    def select(self, key, acc, grad, k, leader, k_next, next_leader):
        """(indices, values) every rank sends for ``key`` now; picks the next step's set for ``flush``.

        ``leader`` picks the set if ``sync``; ``next_leader`` picks the next one (k_next entries)."""
        indices = self.current(key, acc, k, leader)
        values = acc.index_select(0, indices)
        if k_next < acc.numel():
            self.launch_next(key, acc, grad, indices, k_next, next_leader)
        return indices, values

    def launch_next(self, key, acc, grad, indices, k, leader):
        """Leader of the next step picks top-k of (acc minus what is sent now, plus this gradient);
        the set leaves with the step's ``flush``.

        ``acc`` still holds the values being sent at ``indices``; it is returned unchanged."""
        if self.sync:
            return
        buf = None
        if self.process_set.rank() == leader:
            sent = acc.index_select(0, indices)
            acc.index_copy_(0, indices, grad.index_select(0, indices))   # predicts acc of next step
            buf = topk_indices(acc, k).to(torch.int32)
            acc.index_copy_(0, indices, sent)
        self.outgoing[key] = (k, leader, buf)

    def flush(self):
        """Start sharing the sets picked this step: one asynchronous allgather. Collective: every rank
        calls it at the same point of the step, with the same keys picked."""
        if not self.outgoing:
            return
        self.receive()                         # a set nobody picked up: its step went dense
        plan = [(key,) + self.outgoing[key][:2] for key in sorted(self.outgoing)]
        mine = [self.outgoing[key][2] for key, _, leader in plan if leader == self.process_set.rank()]
        self.outgoing = {}
        if self.process_set.size() == 1:
            self.ready = {key: buf for (key, _, _), buf in zip(plan, mine)}
            return
        device = mine[0].device if mine else torch.device("cpu")
        sets = torch.cat(mine) if mine else torch.empty(0, dtype=torch.int32, device=device)
        keys = [(key, k) for key, k, _ in plan]
        header = torch.tensor([sets.numel(), _fingerprint(keys), _fingerprint([p[2] for p in plan])],
                              dtype=torch.int32, device=device)
        block = torch.cat([header, sets]).reshape(-1, 1)
        self.in_flight = (mpi_ops.allgather_async(block, name=f"{self.name}.sets", process_set=self.process_set), plan)

    def receive(self):
        """Wait for the last flush's allgather, if any, and split it into ``ready`` by its plan."""
        if self.in_flight is None:
            return
        handle, plan = self.in_flight
        self.in_flight = None
        gathered = wait(handle)
        if gathered is None:                   # Horovod was re-initialised since (an elastic reset):
            self.ready = {}                    # every rank's flush died with it, so every rank starts
            return                             # the next step from the spread set
        blocks = _split_blocks(gathered.reshape(-1), self.process_set.size())
        self.ready = {}
        leaders_differ = _check_plans([fingerprints for fingerprints, _ in blocks], len(plan), self.mismatch_hint,
                                      realign=self.on_leaders_differ is not None)
        if leaders_differ:
            self.on_leaders_differ()
            return
        for rank, (_, sets) in enumerate(blocks):   # rank r's block: the sets it leads, in key order
            offset = 0
            for key, k, leader in plan:
                if leader == rank:
                    self.ready[key] = sets[offset:offset + k]
                    offset += k

    def state_dict(self):
        """The sets shared for the next step (waits for the allgather in flight); call it after the
        step's ``flush``."""
        if self.outgoing:
            raise RuntimeError("IndexPipeline.state_dict() during a step: the sets picked in it are not "
                               "shared yet (call it between steps)")
        self.receive()
        return {key: buf.clone() for key, buf in self.ready.items()}

    def forget(self):
        """Drop every set, shared or in flight: the ranks changed (elastic), so every rank starts from the
        spread set."""
        self.outgoing, self.in_flight, self.ready = {}, None, {}

    def load_state_dict(self, state):
        self.outgoing, self.in_flight = {}, None
        self.ready = {key: buf.clone() for key, buf in state.items()}


def _fingerprint(values):
    """A 31-bit fingerprint of ``values``' repr, identical on every rank for equal values."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


def _split_blocks(gathered, size):
    """[(fingerprints, sets)] of every rank's block of the allgather (``PLAN_HEADER``)."""
    blocks, offset = [], 0
    for _ in range(size):
        length = int(gathered[offset])
        blocks.append((tuple(gathered[offset + 1:offset + PLAN_HEADER].tolist()),
                       gathered[offset + PLAN_HEADER:offset + PLAN_HEADER + length]))
        offset += PLAN_HEADER + length
    return blocks


def _check_plans(fingerprints, n_sets, hint, realign):
    """True if only the leaders differ from rank 0's (and ``realign`` allows it: the caller realigns);
    False if every rank meant rank 0's plan; else ValueError, raised alike on every rank."""
    differ = [r for r, f in enumerate(fingerprints) if f[0] != fingerprints[0][0]]
    if differ:
        hint = hint or "the ranks must give their tensors the same keys"
        raise ValueError(f"hvd_topk: rank(s) {differ} shared AR-Topk index sets for other tensors than rank 0 "
                         f"did ({n_sets} sets on this rank); {hint}")
    leaders_differ = [r for r, f in enumerate(fingerprints) if f[1] != fingerprints[0][1]]
    if leaders_differ and not realign:
        raise ValueError(f"hvd_topk: rank(s) {leaders_differ} count steps differently from rank 0 (a rank joined "
                         "without the others' state: with elastic Horovod, pass the optimizer to "
                         "hvd.elastic.TorchState)")
    return bool(leaders_differ)
