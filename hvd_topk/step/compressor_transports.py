"""The transports as ``TopKEF`` drives them inside Horovod's ``Compressor`` contract.

``send`` runs in ``compress``, ``receive`` in ``decompress``; between them Horovod allreduces what
``send`` returned. The transport classes are the optimizer's (``hvd_topk.transports``):

1. ``split_reduce``/``allgather``: ``start`` their first collective now (Horovod's public
   asynchronous collectives, named per key) and return the ``op_token`` for Horovod's allreduce.
   ``receive`` reads Horovod's op and the key check from the reduced token before any value is used,
   then finishes the transport (split_reduce runs its later phases for every key at the first
   ``receive`` of a step, in sorted key order: every rank has started every first phase by then).
2. ``artopk``: the k values at the shared index set + a flag go to Horovod's allreduce; the next
   step's sets leave in one allgather once the step's last gradient is compressed (``flush``). A key's
   first step also carries the ``op_token``, read in ``receive`` before that step's ``flush``: the
   allgather runs over TopKEF's process_set, so if Horovod reduces over another set (the optimizer's,
   not given to TopKEF), ranks outside it never join and every later step would wait for them
   forever; Horovod's op too is checked once. So does a key's first step after ``load_state_dict``
   (a resumed job may run with another set). Later steps send no token (the set and op cannot
   change; mismatched keys show in the allgather's plan check).
3. ``dense`` (and any tensor whose k is its size): the accumulator + a flag go to Horovod's allreduce.

The sums are taken as sums; ``receive`` divides by P when the token says Horovod averaged, with the
same ``mul_(1/P)`` as the optimizer's transports.
"""
import copy
import math

import torch
from horovod.torch import mpi_ops

from .op_token import TOKEN_SIZE, OpToken
from .stats import StepStats
from .fused_plan import FusedPlan
from ..transports import ARTopk
from ..transports.build import OWN_COLLECTIVES, build_transports

__all__ = ["CompressorTransports", "sends_token", "transports_state", "load_transports_state"]


def sends_token(communication, numel, k):
    """Whether ``CompressorTransports.send`` hands Horovod the ``op_token`` for a tensor of ``numel``
    entries, ``k`` kept: its transport runs its own collectives (``OWN_COLLECTIVES``) and keeps fewer
    than all. Else the tensor's values go in Horovod's allreduce."""
    return communication in OWN_COLLECTIVES and k < numel


class CompressorTransports:
    """One ``TopKEF``'s transport state, per rank, over the stack ``build_transports`` makes of its
    settings, built at first use (Horovod's first ``compress``; ``'hierarchical'`` then finds the hosts'
    process sets, a collective), so making a TopKEF runs none; a checkpoint loaded before waits in ``_restored``.

    Args:
        settings: the TopKEF's ``TopKSettings`` (communication, budget, sync_indices).
        tag: prefix of the collectives' names (identical on all ranks, distinct per TopKEF).
        key_index: key -> int, the same on every rank (STAR's leaders).
        process_set: the ranks Horovod reduces over.
        mismatch_hint: what the errors say when the ranks keyed a gradient differently.
    """

    def __init__(self, settings, *, tag, key_index, process_set=mpi_ops.global_process_set, mismatch_hint=""):
        self.settings, self.tag, self.key_index, self.mismatch_hint = settings, tag, key_index, mismatch_hint
        self.communication, self.process_set = settings.communication, process_set
        self.steps = {}                       # key -> artopk steps so far (same on all ranks)
        self.unchecked = set()                # artopk: keys restored with steps > 0, not yet sent a token
        self.token = OpToken(process_set, mismatch_hint=mismatch_hint)
        self._stack, self._own = None, None   # build_transports' stack, and its OWN_COLLECTIVES transports
        self._restored = None                 # the index sets and regions loaded before the stack was built
        self.stats = StepStats()              # TopKEF.stats()
        self.sent_numels = {}                 # key -> numel of what went through a fused transport this step
        self.planned = False                  # the fused transports have their buckets (after the first step)
        self.fused = FusedPlan(lambda: self.own.values())

    def _built(self):
        if self._stack is None:
            self._stack = build_transports(self.settings, tag=self.tag, key_index=self.key_index,
                                           process_set=self.process_set, mismatch_hint=self.mismatch_hint,
                                           on_leaders_differ=lambda: self.steps.clear(), stats=self.stats)
            self._own = {name: t for name, t in self._stack.transports.items() if name in OWN_COLLECTIVES}
            if self._restored is not None:
                _load_shared(self, self._restored)
                self._restored = None
        return self._stack

    index_sets = property(lambda self: self._built().index_sets, doc="AR-Topk's ``IndexPipeline``.")
    artopk = property(lambda self: self._built().transports["artopk"], doc="the ``ARTopk`` transport.")

    @property
    def own(self):
        """name -> the transports of ``OWN_COLLECTIVES`` that were built (with the stack, at first use)."""
        self._built()
        return self._own

    def before_gradient(self):
        """Before a step counter is read: if the ranks' counters differ (a rank joined an elastic job),
        every rank learns it here and clears them (``IndexPipeline``), so the leaders agree."""
        if self.communication == "artopk":
            self.index_sets.receive()

    def flush(self):
        """The step's gradients are all compressed: artopk's next index sets leave now."""
        if self.communication == "artopk":
            self.index_sets.flush()

    def send(self, key, acc, k, finite, grad, acc_sq=0.0):
        """(tensor for Horovod's allreduce, transport in flight or None, artopk's index set or None).
        artopk zeroes the sent entries of ``acc`` at once: ``acc`` is then the candidate residual."""
        with self.stats.selecting():
            buf, started, indices = self._send(key, acc, k, finite, grad)
        self.stats.add_sent(buf.numel() * buf.element_size() + (started.nbytes if started else 0),
                            started.sent_sq if started else 0.0, acc_sq, dense=not (started or indices is not None))
        self.fused.advance()
        return buf, started, indices

    def _send(self, key, acc, k, finite, grad):
        if sends_token(self.communication, acc.numel(), k):
            started = self.own[self.communication].start(key, acc, k, finite)
            self.sent_numels[key] = acc.numel()
            return self.token.make(key, grad), started, None
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        if self.communication != "artopk":
            k = acc.numel()                   # dense: everything, through Horovod's allreduce
        buf, indices, _ = self.artopk.pack(key, acc, k, finite, grad.reshape(-1), step, k)
        if indices is not None:
            acc.index_fill_(0, indices, 0)
        if self.communication == "artopk" and (step == 0 or key in self.unchecked):    # module docstring, 2.
            self.unchecked.discard(key)
            buf = torch.cat([buf, self.token.make(key, buf)])
        return buf, None, indices

    def receive(self, reduced, key, shape, started, indices, acc):
        """(flat aggregate, or None if some rank was non-finite; candidate residual or None)."""
        self.stats.syncing()
        if started is None:
            numel = math.prod(shape)
            if reduced.numel() == (numel if indices is None else indices.numel()) + 1 + TOKEN_SIZE:
                self.token.average(reduced[-TOKEN_SIZE:], key)   # raises, on every rank, before any value
                reduced = reduced[:-TOKEN_SIZE]                  # is used (Horovod averaged the values)
            aggregate = ARTopk.unpack(reduced, indices, numel, reduced.dtype)
            return aggregate, None if indices is None else acc
        average = self.token.average(reduced, key)       # raises, on every rank, before any value is used
        outcome = started.finish()
        if outcome.aggregate is not None and average:
            outcome.aggregate.mul_(1.0 / self.process_set.size())
        if outcome.residual is not None:              # the transport computed the residual itself
            return outcome.aggregate, outcome.residual
        return outcome.aggregate, None if outcome.sent is None else acc.index_fill_(0, outcome.sent, 0)

    def end_step(self, keys, cap_mb):
        """The step's last gradient was decompressed: its figures close; after the first step, the keys it
        sent through a fused transport get their buckets (``keys``: every key in registration order; until
        then each key travels alone)."""
        self.stats.end_step(density=self.settings.ratio)
        if not self.planned and self.sent_numels:
            self.planned = True
            self.fused.plan(keys, self.sent_numels, cap_mb)
        self.sent_numels = {}

    def forget(self):
        """An abandoned step or new ranks (elastic reset): only an empty start, without buckets (a joined
        rank has none; each key goes alone for a step, then all plan alike), is the same on every rank."""
        self.artopk.forget()
        for transport in self.own.values():
            transport.forget()
        self.steps, self.sent_numels, self.planned = {}, {}, False
        self.fused.plan([], {}, 0)


def transports_state(transports):
    """What of a ``CompressorTransports`` a checkpoint keeps (``TopKEF.state_dict``): artopk's step counters,
    its next index sets and split_reduce's regions, or those loaded before its stack was built."""
    if transports._stack is None:             # nothing to build (or resolve) for it
        shared = copy.deepcopy(transports._restored or {"next_indices": {}, "regions": None})
    else:
        shared = {"next_indices": transports.index_sets.state_dict(),
                  "regions": transports.own["split_reduce"].regions.state_dict()}
    return {"steps": dict(transports.steps), **shared}


def load_transports_state(transports, state):
    """Restore ``transports_state``'s ``state`` into ``transports`` (``TopKEF.load_state_dict``)."""
    transports.steps = dict(state["steps"])
    transports.unchecked = set(transports.steps)
    shared = {"next_indices": state["next_indices"], "regions": state.get("regions")}
    if transports._stack is None:
        transports._restored = copy.deepcopy(shared)
    else:
        _load_shared(transports, shared)


def _load_shared(transports, shared):
    transports.index_sets.load_state_dict(shared["next_indices"])
    transports.own["split_reduce"].forget()
    transports.own["split_reduce"].regions.load_state_dict(shared["regions"])
