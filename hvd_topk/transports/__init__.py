"""Transports: how one rank's flat accumulator becomes the same aggregate on every rank.

Every transport has one two-phase interface, so the step coordinator (and, for AR-Topk, ``TopKEF``)
treats them alike::

    started = transport.start(key, acc, k, finite, ...)   # select, pack, start the collective
    out = started.finish()                                 # wait: Outcome(aggregate, sent)

``out.aggregate`` is the dense flat aggregate (averaged or summed as Horovod's ``op`` says), identical on
every rank, or None when some rank's accumulator was non-finite (every rank learns it from the same
sum, so every rank skips the step). ``out.sent`` holds the indices of ``acc`` that left this rank (None:
all of them); the caller zeroes them in the residual, which keeps error feedback exact:
Σ sent + residual = Σ grad, per rank.

- ``ARTopk`` (artopk.py): one leader's index set, shared by all ranks; the k values are allreduced.
- ``SparseAllgather`` (allgather.py): every rank's own top-k, as (values, int32 indices); scatter-add.
- ``SplitReduce`` (split_reduce.py): every rank's own top-k, summed per index region by its owner; the
  global top-k of the sums is allgathered (Ok-Topk). Bytes flat in the number of ranks.
- ``Dense`` (dense.py): a plain allreduce of everything, as stock Horovod sends it.
"""
from typing import Callable, NamedTuple, Optional

import torch

__all__ = ["Started", "Outcome", "ARTopk", "SparseAllgather", "SplitReduce", "Dense"]


class Outcome(NamedTuple):
    """What a finished transport gives back (see the module docstring)."""
    aggregate: Optional[torch.Tensor]     # dense flat aggregate, or None: some rank was non-finite
    sent: Optional[torch.Tensor]          # indices of acc this rank sent; None: all of them
    selected: Optional[torch.Tensor] = None   # split_reduce: this rank's nominated top-k (a superset
                                          # of sent), where momentum correction masks; None: sent


class Started(NamedTuple):
    """A transport in flight."""
    nbytes: int                           # payload handed to the collectives by this rank
    sent_sq: float                        # squared norm of the values sent (compression gain)
    finish: Callable[[], Outcome]         # waits for the collective


from .allgather import SparseAllgather  # noqa: E402  (they import Started and Outcome from here)
from .artopk import ARTopk  # noqa: E402
from .dense import Dense  # noqa: E402
from .split_reduce import SplitReduce  # noqa: E402
