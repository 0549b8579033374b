"""Transports for sparse gradients over Horovod's public collectives.

- AR-Topk (Tyagi & Swany, arXiv 2312.02493): one leader's index set is shared by all ranks and the k
  values are allreduced. ``IndexPipeline`` shares the index sets: by default the leader of step t+1
  picks its set during step t ("one step stale"), and at the end of step t one asynchronous allgather
  carries every tensor's set (each rank contributes the sets it leads), so the backward pass never
  waits on a collective per tensor, and a step costs one index collective, not one per tensor
  (Horovod neither fuses broadcasts nor keeps them in its response cache: each one is negotiated).
- Sparse allgather: every rank sends its own (values, int32 indices); receivers scatter-add.
- ``Collectives`` starts the optimizer's allreduces and allgathers, one by one or, with Horovod's
  ``groups``, a group's tensors together as one grouped collective per kind and dtype.
"""
import torch
from horovod.torch import mpi_ops

from .sparsify import spread_indices, topk_indices

__all__ = ["IndexPipeline", "Collectives", "star_leader", "finite_flag", "flag_raised",
           "allgather_sparse_async", "scatter_add_gathered", "agree"]


def agree(values, name, average=True):
    """``values`` averaged over the ranks (or rank 0's with ``average=False``), as rank 0 holds them.

    The broadcast makes the bits identical everywhere (an allreduce alone may round differently per
    rank), so decisions taken from the result are the same on every rank. Collective.
    """
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if mpi_ops.size() == 1:
        return t.tolist()
    if average:
        t = mpi_ops.allreduce(t, op=mpi_ops.Sum, name=f"{name}.sum") / mpi_ops.size()
    return mpi_ops.broadcast(t, root_rank=0, name=name).tolist()


def finite_flag(finite, like):
    """One element that rides with the values: 0 if this rank's accumulator is finite, else 1."""
    return torch.tensor([0.0 if finite else 1.0], dtype=like.dtype, device=like.device)


def flag_raised(flag):
    """True when an aggregated flag says some rank was non-finite (its sum > 0, or itself NaN/Inf)."""
    return not bool(torch.isfinite(flag)) or bool(flag != 0)


def star_leader(key_index, step, size):
    """STAR: round robin over steps, offset by the tensor's index so selection work spreads over ranks."""
    return (step + key_index) % size


class IndexPipeline:
    """Shared AR-Topk index sets, per key (tensor), identical on every rank.

    Default (one step stale): ``select`` sends the values at the set shared during the previous step
    and, on the next step's leader, picks the next set; ``flush`` (called on every rank once the step's
    last ``select`` is done) starts one allgather with every set of the step: rank r contributes the
    sets it leads, in key order, and every rank splits the result by the (key, k, leader) plan, which
    is identical on all ranks. The next step's first ``select`` waits for it (long finished by then).

    Args:
        name: prefix of the Horovod collective names (must be identical on all ranks).
        sync: broadcast the current step's index set inside ``select`` and wait for it, instead.
    """

    def __init__(self, name, sync=False):
        self.name = name
        self.sync = sync
        self.outgoing = {}         # key -> (k, leader, int32 set or None): picked this step, not yet sent
        self.in_flight = None      # (allgather handle, [(key, k, leader)]) of the last flush
        self.ready = {}            # key -> int32 index set for the next step

    def current(self, key, acc, k, leader):
        """The int64 index set every rank uses for ``key`` now; ``leader`` picks it if ``sync``."""
        if self.sync:
            buf = (topk_indices(acc, k).to(torch.int32) if mpi_ops.rank() == leader
                   else torch.empty(k, dtype=torch.int32, device=acc.device))
            if mpi_ops.size() > 1:
                mpi_ops.broadcast_(buf, root_rank=leader, name=f"{self.name}.{key}")
            return buf.long()
        self._receive()
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
        if mpi_ops.rank() == leader:
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
        self._receive()                         # a set nobody picked up: its step went dense
        plan = [(key,) + self.outgoing[key][:2] for key in sorted(self.outgoing)]
        mine = [self.outgoing[key][2] for key, _, leader in plan if leader == mpi_ops.rank()]
        self.outgoing = {}
        if mpi_ops.size() == 1:
            self.ready = {key: buf for (key, _, _), buf in zip(plan, mine)}
            return
        device = mine[0].device if mine else torch.device("cpu")
        block = torch.cat(mine) if mine else torch.empty(0, dtype=torch.int32, device=device)
        self.in_flight = (mpi_ops.allgather_async(block.reshape(-1, 1), name=f"{self.name}.sets"), plan)

    def _receive(self):
        """Wait for the last flush's allgather and split it into ``ready`` by its plan."""
        if self.in_flight is None:
            return
        handle, plan = self.in_flight
        self.in_flight = None
        gathered = mpi_ops.synchronize(handle).reshape(-1)
        self.ready, offset = {}, 0
        for rank in range(mpi_ops.size()):      # rank r's block: the sets it leads, in key order
            for key, k, leader in plan:
                if leader == rank:
                    self.ready[key] = gathered[offset:offset + k]
                    offset += k

    def state_dict(self):
        """The sets shared for the next step (waits for the allgather in flight); call it after the
        step's ``flush``."""
        if self.outgoing:
            raise RuntimeError("IndexPipeline.state_dict() during a step: the sets picked in it are not "
                               "shared yet (call it between steps)")
        self._receive()
        return {key: buf.clone() for key, buf in self.ready.items()}

    def load_state_dict(self, state):
        self.outgoing, self.in_flight = {}, None
        self.ready = {key: buf.clone() for key, buf in state.items()}


class Collectives:
    """The allreduces and allgathers of the optimizer's tensors, grouped as Horovod's ``groups`` are.

    A key (tensor) in no group starts its collective at once. The keys of a group wait until each of
    them has been submitted once, then start together: one grouped allreduce and one grouped
    allgather per dtype, tensors in key order, which Horovod negotiates as one and fuses into one
    buffer, so the step sends fewer and larger messages (at small ratios the per-message cost
    dominates: see README). The first ``wait`` of a step starts every group still pending as it is:
    the same on every rank when every rank submitted the same keys, as Horovod's collectives require
    anyway.

    Args:
        name: prefix of the grouped collectives' names (identical on all ranks).
        groups: lists of keys; a key in no list is in no group.
    """

    def __init__(self, name, groups=()):
        self.name = name
        self.group_of = {key: gid for gid, keys in enumerate(groups) for key in keys}
        self.sizes = [len(keys) for keys in groups]
        self.pending = {}          # group id -> {key: [(kind, tensor, options, slot)]}
        self.launched = {}         # group id -> launches this step (names stay the same step to step,
                                   # so Horovod's response cache hits)

    def allreduce(self, key, tensor, name, op, prescale_factor=1.0, postscale_factor=1.0, inplace=False):
        """Start (or queue in ``key``'s group) an allreduce; returns ``wait() -> output``. ``inplace``
        reduces ``tensor`` itself when it starts at once."""
        options = dict(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        if key not in self.group_of:
            start = mpi_ops.allreduce_async_ if inplace else mpi_ops.allreduce_async
            handle = start(tensor, name=name, **options)
            return lambda: mpi_ops.synchronize(handle)
        return self._queue(key, [("allreduce", tensor, options)])[0]

    def allgather(self, key, tensors, name):
        """Start (or queue in ``key``'s group) an allgather of each of ``tensors`` (named
        ``{name}.{i}``); returns one ``wait() -> output`` per tensor."""
        if key not in self.group_of:
            handles = [mpi_ops.allgather_async(t, name=f"{name}.{i}") for i, t in enumerate(tensors)]
            return [lambda h=h: mpi_ops.synchronize(h) for h in handles]
        return self._queue(key, [("allgather", t, {}) for t in tensors])

    def _queue(self, key, items):
        gid = self.group_of[key]
        group = self.pending.setdefault(gid, {})
        if key in group:
            raise RuntimeError(f"hvd_topk: tensor {key!r} submitted twice in one step")
        slots = [{} for _ in items]
        group[key] = [item + (slot,) for item, slot in zip(items, slots)]
        if len(group) == self.sizes[gid]:
            self._launch(gid)
        return [lambda slot=slot: self._wait(slot) for slot in slots]

    def _launch(self, gid):
        """Start the group's collectives: one per (kind, dtype, options), tensors in key order."""
        group = self.pending.pop(gid)
        batches = {}
        for key in sorted(group):
            for kind, tensor, options, slot in group[key]:
                batch_key = (kind, str(tensor.dtype), tuple(sorted(options.items())))
                batches.setdefault(batch_key, []).append((tensor, slot))
        again = self.launched.get(gid, 0)
        self.launched[gid] = again + 1
        for i, ((kind, _, options), batch) in enumerate(sorted(batches.items(), key=lambda b: repr(b[0]))):
            name = f"{self.name}.{gid}.{i}.{kind}" + (f".{again}" if again else "")
            tensors = [t for t, _ in batch]
            handle = (mpi_ops.grouped_allreduce_async(tensors, name=name, **dict(options)) if kind == "allreduce"
                      else mpi_ops.grouped_allgather_async(tensors, name=name))
            shared = {"handle": handle}
            for j, (_, slot) in enumerate(batch):
                slot.update(shared=shared, index=j)

    def end_step(self):
        """Call on every rank after the step's last ``wait``."""
        if self.pending:
            raise RuntimeError(f"hvd_topk: groups {sorted(self.pending)} were submitted but never waited for")
        self.launched = {}

    def _wait(self, slot):
        """The output of one queued tensor (its group's grouped collective waited for once)."""
        if "shared" not in slot:               # the group is incomplete: start every pending group
            for gid in sorted(self.pending):
                self._launch(gid)
        shared = slot["shared"]
        if "outputs" not in shared:
            shared["outputs"] = mpi_ops.synchronize(shared.pop("handle"))
        return shared["outputs"][slot["index"]]


def allgather_sparse_async(collectives, key, values, indices, name):
    """Start (through ``collectives``, in ``key``'s group if it has one) allgathers of this rank's
    ``values`` and int32 ``indices``; returns their ``wait`` callables."""
    return collectives.allgather(key, [values.reshape(-1, 1), indices.to(torch.int32).reshape(-1, 1)], name)


def scatter_add_gathered(waits, numel, dtype):
    """Wait for ``allgather_sparse_async`` and scatter-add every rank's set into a dense vector."""
    values = waits[0]().reshape(-1)
    indices = waits[1]().reshape(-1).long()
    dense = torch.zeros(numel, dtype=dtype, device=values.device)
    dense.index_add_(0, indices, values.to(dtype))
    return dense
