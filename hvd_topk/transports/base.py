"""The transport contract: how one rank's flat accumulator becomes the same aggregate on every rank.

Every transport has one two-phase interface, so the step coordinator and ``TopKEF`` treat them alike::

    started = transport.start(key, acc, k, finite, grad=g, step=t, k_next=k1)  # select, pack, start
    out = started.finish()                                                    # wait: Outcome

Invariants, which tests/test_transports.py checks for every transport on real ranks:

1. ``out.aggregate`` is the dense flat aggregate (the sum, or the average when the transport was built
   to average), identical bit for bit on every rank; or None on every rank when some rank's
   accumulator was non-finite (all ranks learn it from the same sum, so all skip the step).
2. ``out.sent`` holds the indices of ``acc`` that left this rank (None: all of them). The caller zeroes
   them in the residual, which keeps error feedback exact per rank: Σ sent + residual = Σ grad. The
   aggregate is the sum (or average) over ranks of exactly what they sent.
   A transport that computes the residual itself gives this rank's new residual in ``out.residual``
   instead; the caller takes it as it is (``sent`` then only says where momentum correction masks).
   Low rank does (no entry leaves whole, ``sent`` None), dense in fp16 (``DenseFP16``: ``acc`` less
   its fp16 values, summed in float32), and so do split_reduce and allgather with
   16-bit values: an entry leaves as its decoded value d (``hvd_topk.core.codec.sent_values``), so
   the residual keeps ``acc - d`` there, exact in float32; an owner of split_reduce also keeps the
   rounding of the sums it coded again (``s - coded(s)``) at the indices it kept. Over the ranks, in
   float64: Σ new residuals + the summed aggregate (the aggregate times the number of ranks when
   averaging) = Σ acc, up to float32's rounding of the sums (which exact values have too); nothing of
   what was coded is lost. Exact values ('fp32', float64 accumulators) leave ``residual`` None.
3. ``started.nbytes`` is the payload this rank handed to the collectives, within the cost model's
   formula for the transport (``hvd_topk.auto.costmodel``).
4. ``forget()`` drops whatever outlives a step (phases in flight, shared index sets, regions): after an
   elastic reset only an empty start is the same on every rank.

A transport's collectives are named per key (a fused transport's per bucket: ``hvd_topk.transports.fused``),
so Horovod matches them across ranks whatever order the ranks start them in; a transport whose later
phases add collectives blocks on them in sorted key (bucket) order.
"""
from typing import Callable, NamedTuple, Optional, Protocol

import torch

__all__ = ["Transport", "Started", "Outcome"]


class Outcome(NamedTuple):
    """What a finished transport gives back (see the module docstring)."""
    aggregate: Optional[torch.Tensor]     # dense flat aggregate, or None: some rank was non-finite
    sent: Optional[torch.Tensor]          # indices of acc this rank sent; None: all of them
    selected: Optional[torch.Tensor] = None   # split_reduce: this rank's nominated top-k (a superset
                                          # of sent), where momentum correction masks; None: sent
    residual: Optional[torch.Tensor] = None   # lowrank: this rank's new residual (invariant 2); None:
                                          # the caller's, from sent


class Started(NamedTuple):
    """A transport in flight."""
    nbytes: int                           # payload handed to the collectives by this rank
    sent_sq: float                        # squared norm of the values sent (compression gain)
    finish: Callable[[], Outcome]         # waits for the collective
    values: Optional[int] = None          # lowrank: the values it sends for the tensor (r(n + m) of P and
                                          # Q, or every element of one it sends whole); None: top-k's k


class Transport(Protocol):
    """What every transport provides (module docstring for the invariants)."""

    def start(self, key: str, acc: torch.Tensor, k: int, finite: bool, grad: Optional[torch.Tensor] = None,
              step: Optional[int] = None, k_next: Optional[int] = None) -> Started:
        """Select k entries of the flat accumulator ``acc`` (all of them for k = acc.numel()) and start
        sending them. ``finite``: this rank's acc has no inf/NaN. ``grad``, ``step`` and ``k_next``
        serve transports that prepare the next step's selection now (AR-Topk); others ignore them."""

    def forget(self) -> None:
        """Drop what outlives a step (invariant 4)."""
