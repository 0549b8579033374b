"""Low rank: PowerSGD (Vogels et al., NeurIPS'19; torch's ``powerSGD_hook``) on Horovod's allreduce.

Each tensor's matrix view M (n x m, ``hvd_topk.core.lowrank``) leaves a rank as two thin matrices,
P = M Q (n x r) and Q = M^T P (m x r), one power iteration per step from the Q of the last step (warm
start, kept per key, identical on every rank). The math is in ``hvd_topk.core.lowrank``; this class
moves the matrices:

1. ``start``: M Q with this rank's M = acc. A tensor that does not shrink at least twofold (or has one
   dimension, or is sent whole: k = numel) goes dense: its accumulator takes P's place.
2. The first ``finish`` of the step runs the rest for every key started, in sorted key order, so ranks
   that started them in different orders still add the same collectives in the same order (``drain``
   may have run a and b already: the stock door's, after the backward pass, where ranks share cores):
   a. one allreduce (per dtype) of all the P's and dense tensors, laid end to end with one finite flag
      per key; any rank's raised flag, or a non-finite sum, gives that key None on every rank;
   b. P orthogonalized, Q_i = M_i^T P, one allreduce (per dtype) of all the Q's;
   c. the aggregate P Q^T (W P Q^T summing) and this rank's new residual M_i - P Q^T.

Why one flat buffer per phase rather than one tensor per key: where ranks started different keys, a
buffer of a different length fails at once on every rank (Horovod's "Mismatched ALLREDUCE tensor
shapes"), where separate tensors would leave ranks waiting for tensors the others never submit. It is
one message per phase, as Horovod's fusion would make of a group, and torch's hook lays its P's and
Q's out the same way.

Error feedback is the transport's (``Outcome.residual``, base.py invariant 2): over the ranks, the new
residuals plus the summed aggregate equal the accumulators. A dense key sends all (residual flushed).
Bytes per compressed key: r(n + m) values and one flag; a dense key: n*m values and one flag. With
``values='fp16'`` a float32 key's P and Q go in 16 bits, scaled per key and phase by a
power of two from the last step's sums (``hvd_topk.transports.lowrank_wire``: 2 bytes a value, a
float16 sum that overflowed summed again in float32); dense keys go in their own dtype.

Across hosts (``hosts``, ``communication='hierarchical'``): the same step, with each phase's sum taken
in three collectives instead of one (``lowrank_wire.sum_across_hosts``): a reduce-scatter inside each
host (exact, over the fast link), a sum of each shard across the hosts by the ranks at its position
(only the host's sum of the P's, then of the Q's, crosses the slow link: r(n + m) values per host, not
per rank), an allgather inside the host. The math, the residuals (each rank's own) and so the error
feedback are the flat transport's; only the order in which the ranks' P's and Q's are added differs.
"""
import math
from typing import NamedTuple, Optional

import torch

from .base import Outcome, Started
from .collectives import Waits, finite_flag, flag_raised
from .lowrank_wire import VALUES, largest, scale_for, sum_phase
from ..core.lowrank import (compressed_rank, decompress, finish_power_iteration, matrix_shape, next_warm_start,
                            start_power_iteration, warm_start, MIN_COMPRESSION_RATE)
from ..core.sparsify import sq_norm_finite
from ..core.validate import check_choice, check_int, check_number
from ..core.wire import LOWRANK_VALUE_BYTES

__all__ = ["LowRank"]


def _all_finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _product_finite(q_sum, rank):
    """Whether P Q^T is finite, read from the m x r ``q_sum`` alone (no pass over the n x m product): P's
    columns have norm 1 or 0, so every entry of P (q_sum / W)^T and of P q_sum^T is at most r max|q_sum|."""
    return _all_finite(q_sum) and float(q_sum.abs().max()) * rank < torch.finfo(q_sum.dtype).max


def _shape_of(shapes, key, acc, grad):
    """``key``'s shape: from ``shapes``, else ``grad``'s, else the flat ``acc``'s (dense)."""
    shape = shapes.get(key, grad.shape if grad is not None and grad.numel() == acc.numel() else acc.shape)
    if math.prod(shape) != acc.numel():
        raise ValueError(f"shapes[{key!r}] must hold the accumulator's {acc.numel()} elements, got {tuple(shape)}")
    return shape


def _in_float16(values, acc):
    """Whether a key's P and Q go in float16: ``values='fp16'`` and a float32 accumulator."""
    return values == "fp16" and acc.dtype == torch.float32


def _wire_bytes(matrix, r, acc, p_scale, q_scale):
    """A key's bytes on the wire: r(n + m) values and its flag (a scaled phase's at 2 bytes each), or
    all of ``acc`` and the flag (dense)."""
    size = acc.element_size()
    if not r:
        return (acc.numel() + 1) * size
    p_bytes, q_bytes = (LOWRANK_VALUE_BYTES["fp16"] if scale else size for scale in (p_scale, q_scale))
    return (r * matrix.shape[0] + 1) * p_bytes + r * matrix.shape[1] * q_bytes


class _Work(NamedTuple):
    """A key started this step, until the step's first ``finish``."""
    acc: torch.Tensor                     # this rank's flat accumulator
    matrix: Optional[torch.Tensor]        # its n x m view; None: the key goes dense
    q_old: Optional[torch.Tensor]         # the warm start it began from (kept if the new Q is unusable)
    payload: torch.Tensor                 # what the first allreduce sums: P, or the whole acc
    flag: torch.Tensor                    # finite_flag
    p_scale: Optional[float] = None       # P's and Q's float16 scales (lowrank_wire); None: own dtype
    q_scale: Optional[float] = None


class _KeptState:
    """``LowRank``'s state that outlives a step: the warm-start Q's and the last sums' largest values
    (the next step's wire scales), identical on every rank; dropped on an elastic reset, saved whole."""

    def forget(self):
        """Drop what the old set of ranks shared: work in flight, outcomes and the warm-start Q's (a
        joining rank has none; every rank starts again from the seeded Q)."""
        self.inflight, self.outcomes, self.q, self.last_largest, self.running = {}, {}, {}, {}, None

    def state_dict(self):
        """The warm-start Q's and the last sums' largest values (identical on every rank), and the rank
        they were made at."""
        return {"rank": self.rank, "q": {key: q.detach().clone() for key, q in self.q.items()},
                "largest": dict(self.last_largest)}

    def load_state_dict(self, state):
        """Continue from ``state_dict()``'s Q's: the steps after are bit for bit those of the saved job."""
        if state["rank"] != self.rank:
            raise ValueError(f"rank must be the saved state's {state['rank']} to load it, got {self.rank}")
        self.inflight, self.outcomes, self.q = {}, {}, {key: q.clone() for key, q in state["q"].items()}
        self.running = None
        self.last_largest = dict(state.get("largest", {}))        # older states: the first step in float32


class _StepPhases(_KeptState):
    """``LowRank``'s phases (module docstring, step 2): a and b as a generator of collectives
    (``collectives.Waits``), so that ``drain`` can run them before the first ``finish`` without blocking
    on a late rank; c, which needs ``average``, at the first ``finish``."""

    def drain(self, until):
        """Run phases a and b of the keys started so far (all of the step's: the caller's last key is
        in), asleep between polls, until they are done or ``time.monotonic()`` reaches ``until``; never
        blocks on a collective. Phase c, which needs ``average`` (the stock door reads it from Horovod's
        token at the first ``decompress``), and whatever is left stay for the first ``finish``."""
        if self.inflight and self.running is None:
            self.running = Waits(self._phases())
        if self.running is not None:
            self.running.advance(until)

    def settle(self):
        """Phases a-c of every key in flight, blocking (``_run_step``)."""
        if self.inflight or self.running is not None:
            self._run_step()

    def _run_step(self):
        """Phases a-c for every key in flight, in key order (module docstring); a-b from ``drain`` if it
        started them, and then those of any key started after it began (each rank alike, or the key
        check fails)."""
        running, self.running = self.running or Waits(self._phases()), None
        self._last_phase(*running.finish())
        if self.inflight:
            self._last_phase(*Waits(self._phases()).finish())

    def _last_phase(self, work, sums, second, q_sums):
        """Phase c: each key's outcome from its sums (``_phases``; a P sum of None was not finite)."""
        size = self.collectives.process_set.size()
        for key, total in sums.items():
            if total is None:                   # identical on every rank: every rank skips the key
                self.outcomes[key] = Outcome(None, None)
            elif work[key].matrix is None:      # dense: all was sent, the caller flushes the residual
                total = total * (1.0 / size) if self.average else total
                self.outcomes[key] = Outcome(total.reshape(-1).to(work[key].acc.dtype), None)
        for key, q_sum in q_sums.items():
            self.outcomes[key] = self._lowrank(key, work[key], second[key][0], q_sum, sums[key])

    def _phases(self):
        """Phases a and b (module docstring), a generator of collectives (``Waits``): returns the step's
        work, the P sums (None where some rank's flag was raised or the sum is not finite: each sum is
        read once), (P orthogonalized, this rank's Q_i) and the Q sums of the compressed keys."""
        self.collectives.start_pending()
        keys = sorted(self.inflight)
        work, self.inflight, self.launches = self.inflight, {}, []
        p_sums = yield from self._sum_phase("P", [(work[key].payload, work[key].flag, work[key].p_scale)
                                                  for key in keys])
        sums = {key: None if flag_raised(flag.reshape(())) or not _all_finite(total) else total
                for key, (total, flag) in zip(keys, p_sums)}
        second = {key: finish_power_iteration(work[key].matrix, total, self.epsilon)
                  for key, total in sums.items() if total is not None and work[key].matrix is not None}
        compressed = sorted(second)
        q_sums = yield from self._sum_phase("Q", [(second[key][1], None, work[key].q_scale) for key in compressed])
        return work, sums, second, {key: q_sum for key, (q_sum, _) in zip(compressed, q_sums)}

    def _sum_phase(self, phase, entries):
        """``lowrank_wire.sum_phase`` of one phase over this transport's ranks (or hosts), its launches kept
        (a generator of collectives)."""
        sums, launches = yield from sum_phase(entries, f"{self.name}.{phase}", self.collectives.process_set,
                                              self.hosts)
        self.launches += launches
        return sums


class LowRank(_StepPhases):
    """PowerSGD of each key's accumulator (module docstring).

    Args:
        collectives: the caller's ``Collectives`` (its process set; its pending groups are started
            before this transport adds collectives).
        average: the aggregate is the mean over the ranks (Horovod's Average), else the sum.
        rank: the approximation's rank r (>= 1), at most min(n, m) per tensor.
        shapes: key -> the tensor's shape, for its matrix view; a key not in it takes ``grad``'s shape
            when ``start`` gets one, else is one-dimensional (dense).
        name: prefix of the collectives' names (distinct per optimizer, identical on all ranks).
        seed: the first Q's seed (identical on all ranks).
        epsilon: added to each column's norm in the orthogonalization (torch's
            ``orthogonalization_epsilon``, >= 0).
        min_compression_rate: compress a tensor only if it shrinks more than this (> 0; torch's 2).
        hosts: ``HostSets`` of equal hosts: every sum goes through them (``lowrank_wire.sum_across_hosts``); None: flat.
        values: 'fp32': P's and Q's go in their own dtype, as torch's hook sends them; 'fp16': a float32
            key's in 16 bits (``hvd_topk.transports.lowrank_wire``).

    Example::

        lowrank = LowRank(Collectives("lowrank"), average=True, rank=4, shapes={"fc": (64, 32)})
        started = lowrank.start("fc", acc, None, finite)     # acc: grad + residual, flat
        out = started.finish()           # out.aggregate: the mean; out.residual: this rank's new one
    """

    def __init__(self, collectives, average, rank=4, shapes=None, name="hvd_topk.lowrank", seed=0, epsilon=0.0,
                 min_compression_rate=MIN_COMPRESSION_RATE, hosts=None, values="fp32"):
        self.collectives, self.average, self.name, self.hosts = collectives, average, name, hosts
        self.values = check_choice("values", values, VALUES)
        self.rank = check_int("rank", rank, low=1)
        self.seed = check_int("seed", seed, low=0)
        self.epsilon = check_number("epsilon", epsilon, low=0)
        self.min_compression_rate = check_number("min_compression_rate", min_compression_rate, low=0, low_open=True)
        self.shapes = dict(shapes or {})
        self.q = {}                     # key -> warm-start Q (m x r), identical on every rank
        self.last_largest = {}          # key -> (largest |P sum|, largest |Q sum|) of its last step, ditto
        self.inflight = {}              # key -> this step's started work, until the first finish
        self.outcomes = {}              # key -> Outcome, finished but not yet handed out
        self.launches = []              # (name, numel) of the allreduces of the last step, in order
        self.running = None             # phases a-b of the step, started by ``drain`` (``Waits``)
        self.settle_all = None          # settles the door's transports in one order (``step.fused_plan``)

    def _matrix(self, key, acc, grad, k):
        """(M as n x m, r) for a compressed key, or (None, 0) for a dense one."""
        shape = _shape_of(self.shapes, key, acc, grad)
        r = 0 if k is not None and k >= acc.numel() else compressed_rank(shape, self.rank, self.min_compression_rate)
        return (acc.view(*matrix_shape(shape)), r) if r else (None, 0)

    def start(self, key, acc, k, finite, grad=None, step=None, k_next=None):
        """Start ``key``'s step: P = M Q now, the collectives at the step's first ``finish``.

        Args:
            key: the tensor's name (sorted with the step's other keys).
            acc: this rank's flat accumulator (grad + residual); only read.
            k: ``acc.numel()`` sends it whole (dense); any other value (None too) compresses at ``rank``.
            finite: ``acc`` has no inf/NaN on this rank.
            grad: its shape serves when ``shapes`` lacks ``key``; ``step``, ``k_next``: unused.

        Returns:
            ``Started``: nbytes r(n + m) + 1 values (n*m + 1 dense), at 2 bytes each where they go in
            16 bits; sent_sq the squared norm of M's projection on the warm start's columns (all of
            ``acc`` dense).
        """
        if key in self.inflight or key in self.outcomes:
            raise RuntimeError(f"hvd_topk lowrank: tensor {key!r} started twice in one step")
        matrix, r = self._matrix(key, acc, grad, k)
        p_scale = q_scale = None
        if r:
            q_old = warm_start(self.q.get(key), key, matrix.shape[1], r, self.seed, acc)
            _, p = start_power_iteration(matrix, q_old, self.epsilon)
            payload, sent_sq = p, sq_norm_finite(p.reshape(-1))[0]
            if _in_float16(self.values, acc):
                p_scale, q_scale = (scale_for(x) for x in self.last_largest.get(key, (None, None)))
        else:
            q_old, payload, sent_sq = None, acc, sq_norm_finite(acc)[0]
        self.inflight[key] = _Work(acc, matrix, q_old, payload, finite_flag(finite, acc), p_scale, q_scale)

        def finish():
            if key not in self.outcomes:
                (self.settle_all or self.settle)()
            return self.outcomes.pop(key)
        values = r * sum(matrix.shape) if r else acc.numel()      # P and, at finish, Q; or everything
        return Started(_wire_bytes(matrix, r, acc, p_scale, q_scale), sent_sq, finish, values)

    def _lowrank(self, key, work, p, q_sum, p_sum):
        """A compressed key's outcome: the aggregate and this rank's residual; Q kept if all finite, and
        where the key goes in float16, the sums' largest values (its next step's wire scales)."""
        if not _product_finite(q_sum, q_sum.shape[1]):      # identical on every rank: all skip
            return Outcome(None, None)
        aggregate, mean, q = decompress(p, q_sum, self.collectives.process_set.size(), self.average)
        self.q[key] = next_warm_start(work.q_old, q)
        if _in_float16(self.values, work.acc):      # a pass over each sum (a device sync) only where used
            self.last_largest[key] = (largest(p_sum), largest(q_sum))
        return Outcome(aggregate.reshape(-1), None, residual=(work.matrix - mean).reshape(-1))
