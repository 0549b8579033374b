"""The alpha-beta cost model (docs/costmodel.md): modelled seconds of each collective.

Pure functions over numbers; no Horovod import. Notation: ``alpha`` is the latency of one message (s),
``beta`` the time per byte on one link (s/byte), ``M = message_bytes`` the bytes of the dense gradient,
``N = n_workers``, ``c = density`` (fraction of elements sent), ``log N = log2(N)``.

Sparse transports send the selected values in the gradient's own dtype, so ``M·c`` is the bytes of the
values, and the matching indices take ``M·c·r`` bytes with ``r = index_bytes / value_bytes``
(int32 indices with fp32 values: r = 1). For r = 1 every formula below but split_reduce's is the published
one (docs/costmodel.md); split_reduce's is derived there from its three collectives. allgather and
split_reduce pack their entries (``hvd_topk.core.codec``): with ``entry_bytes`` e per entry (value and
index offset, ``hvd_topk.core.wire.CODEC_ENTRY_BYTES``) their ``Mc(1+r)`` becomes ``Mc·e/value_bytes``.
With N <= 2 split_reduce is one allgather (its two-rank path), priced as the allgather:

=============  ===========================================  =====================================
name           seconds                                      what it is
=============  ===========================================  =====================================
dense_ring     2(N−1)α + 2(N−1)/N·Mβ                        ring allreduce of the dense gradient
dense_tree     2α·log N + 2·log N·Mβ                        tree allreduce of the dense gradient
allgather      α·log N + Mc(1+r)β(N−1)                      allgather of every rank's values and
                                                            indices (published: 2Mcβ(N−1) for r = 1)
artopk_ring    α[2(N−1) + log N] + Mcβ[2(N−1)/N + r·log N]  broadcast of the leader's indices
                                                            (Mcr bytes) + ring allreduce of the
                                                            values (Mc bytes)
artopk_tree    3α·log N + Mcβ·log N·(2 + r)                 the same with a tree allreduce
                                                            (published: 3Mcβ·log N for r = 1)
split_reduce   4(N−1)α + (N−1)/N·Mc(1+r)(1+b)β              Ok-Topk's split and reduce: alltoall
               + 2(N−1)/N·Hβ                                of the rows to their region's owner,
                                                            ring allreduce of an H-byte histogram,
                                                            ring allgatherv of the ~b·k kept rows
                                                            (b: ``kept``, the budget; 1 by default)
=============  ===========================================  =====================================

With one worker there is nothing to communicate and every time is 0.
"""
import math

from ..core.validate import check_int, check_number
from ..core.wire import HIST_BYTES, INDEX_BYTES

__all__ = ["COLLECTIVES", "HIST_BYTES", "predict", "choose", "crossover_density"]

# Also the tie-break order of ``choose``: on equal modelled times prefer the dense transports (exact,
# no compression error), then AR-Topk (one dense k-vector, Horovod's plain allreduce), then split_reduce
# (three collectives per tensor, but bytes per rank flat in N: a tie at this N turns its way at a larger
# one), then allgather (bytes per rank growing with N).
COLLECTIVES = ("dense_ring", "dense_tree", "artopk_ring", "artopk_tree", "split_reduce", "allgather")
# Relative margin within which two modelled times count as a tie, so that rounding in formulas that
# are equal on paper (e.g. all zeros at N = 1) cannot flip the choice.
_TIE_RTOL = 1e-9


def predict(n_workers, message_bytes, density, alpha, beta, index_bytes=INDEX_BYTES, value_bytes=4, entry_bytes=None,
            kept=1.0):
    """Modelled communication seconds of every collective (docs/costmodel.md, module docstring).

    Args:
        n_workers: number of ranks N, an int >= 1.
        message_bytes: bytes M of the dense gradient (or fused bucket), a number >= 0.
        density: fraction c of the elements sent by the sparse transports, in (0, 1]. The dense
            transports ignore it.
        alpha: latency per message in seconds, >= 0.
        beta: seconds per byte on one link, >= 0 (1 Gbit/s: 8e-9).
        index_bytes: bytes per index on the wire, > 0 (int32: 4).
        value_bytes: bytes per value on the wire, > 0 (float32: 4); only the ratio
            ``index_bytes / value_bytes`` enters, since ``M·c`` already counts the values.
        entry_bytes: bytes per kept entry of allgather and split_reduce (packed: 4 for bf16 values),
            > 0; None: a value and an index, ``value_bytes + index_bytes``.
        kept: split_reduce's gathered entries as a multiple of k (its budget, ``hvd_topk.core.wire.budget_at``),
            >= 1.

    Returns:
        dict name -> seconds (float) for ``"dense_ring"``, ``"dense_tree"``, ``"allgather"``,
        ``"artopk_ring"``, ``"artopk_tree"``, ``"split_reduce"``.

    Example:
        >>> t = predict(4, 1e6, 0.01, alpha=1e-5, beta=1e-9)
        >>> round(t["dense_ring"], 9), round(t["allgather"], 9)   # 6α + 1.5Mβ;  2α + 2Mcβ·3
        (0.00156, 8e-05)
    """
    n, m, c, a, b, r = _check(n_workers, message_bytes, density, alpha, beta, index_bytes, value_bytes)
    kept = check_number("kept", kept, low=1, what="(multiple of k gathered by split_reduce)")
    if n == 1:
        return {name: 0.0 for name in COLLECTIVES}
    log_n = math.log2(n)
    mc = m * c
    entries = mc * (1 + r) if entry_bytes is None else \
        mc * check_number("entry_bytes", entry_bytes, low=0, low_open=True) / value_bytes
    ring = 2 * (n - 1) / n       # share of the message each rank sends in a ring allreduce
    times = {
        "dense_ring": 2 * (n - 1) * a + ring * m * b,
        "dense_tree": 2 * a * log_n + 2 * log_n * m * b,
        "allgather": a * log_n + entries * b * (n - 1),
        "artopk_ring": a * (2 * (n - 1) + log_n) + mc * b * (ring + r * log_n),
        "artopk_tree": 3 * a * log_n + mc * b * log_n * (2 + r),
        # alltoall (N−1 messages) and ring allgatherv (N−1) carry (N−1)/N of the ~k and ~kept·k entries
        # per rank; the histogram's ring allreduce takes 2(N−1) messages. Frames and headers are left out.
        "split_reduce": 4 * (n - 1) * a + ((n - 1) / n * entries * (1 + kept) + ring * HIST_BYTES) * b,
    }
    if n <= 2:                   # split_reduce's two-rank path: one allgather of every rank's entries
        times["split_reduce"] = times["allgather"]
    return times


def choose(n_workers, message_bytes, density, alpha, beta, index_bytes=INDEX_BYTES, value_bytes=4, candidates=None,
           entry_bytes=None):
    """Name of the collective with the smallest modelled time.

    Ties (times within a relative 1e-9) go to the candidate listed first in ``COLLECTIVES`` order:
    dense_ring, dense_tree, artopk_ring, artopk_tree, split_reduce, allgather (dense first: no
    compression error; split_reduce before allgather: its bytes per rank do not grow with N).
    So at ``n_workers == 1``, where everything costs 0, the answer is the first dense candidate.

    Args:
        n_workers, message_bytes, density, alpha, beta, index_bytes, value_bytes, entry_bytes: as for
            ``predict``.
        candidates: names to choose from (a non-empty iterable of names in ``COLLECTIVES``);
            None for all of them.

    Returns:
        str, one of the candidates.

    Example:
        >>> choose(512, 1e8, 0.05, alpha=5e-5, beta=8e-8)          # 100 Mbit/s, many workers
        'split_reduce'
        >>> choose(64, 1e8, 0.01, alpha=5e-5, beta=8e-10)          # 10 Gbit/s: latency counts too
        'artopk_ring'
        >>> choose(4, 1e8, 1e-4, alpha=5e-5, beta=8e-11)           # 100 Gbit/s, few workers
        'allgather'
    """
    times = predict(n_workers, message_bytes, density, alpha, beta, index_bytes, value_bytes, entry_bytes)
    names = _check_candidates(candidates)
    best = min(times[name] for name in names)
    return next(name for name in names if times[name] <= best * (1 + _TIE_RTOL))


def crossover_density(n_workers, index_bytes=INDEX_BYTES, value_bytes=4):
    """Density below which the Top-K allgather sends fewer bytes per rank than a dense ring allreduce.

    Equating the bandwidth terms Mc(1+r)(N−1) and 2(N−1)/N·M gives c* = 2 / (N(1 + r)),
    r = index_bytes / value_bytes (int32 indices, fp32 values: c* = 1/N). It ignores latency, so it is
    the crossover on slow links; on fast links allgather's smaller latency moves it up.

    Args:
        n_workers: number of ranks N, an int >= 1.
        index_bytes, value_bytes: as for ``predict``.

    Returns:
        float c*, capped at 1.0 (at N = 1 and 2 allgather never sends more than the ring).

    Example:
        >>> crossover_density(64)
        0.015625
    """
    n, _, _, _, _, r = _check(n_workers, 0, 1.0, 0.0, 0.0, index_bytes, value_bytes)
    return min(1.0, 2.0 / (n * (1.0 + r)))


def _check(n_workers, message_bytes, density, alpha, beta, index_bytes, value_bytes):
    """Validated (N, M, c, alpha, beta, index/value ratio); ValueError names the bad argument."""
    n = check_int("n_workers", n_workers, low=1)
    m = check_number("message_bytes", message_bytes, low=0)
    c = check_number("density", density, low=0, high=1, low_open=True)
    a = check_number("alpha", alpha, low=0, what="(seconds)")
    b = check_number("beta", beta, low=0, what="(seconds per byte)")
    si = check_number("index_bytes", index_bytes, low=0, low_open=True)
    sv = check_number("value_bytes", value_bytes, low=0, low_open=True)
    return n, m, c, a, b, si / sv


def _check_candidates(candidates):
    """Candidate names in ``COLLECTIVES`` order; ValueError for unknown names or an empty set."""
    if candidates is None:
        return COLLECTIVES
    wanted = set(candidates)
    unknown = sorted(wanted - set(COLLECTIVES))
    if unknown or not wanted:
        raise ValueError(f"candidates must be a non-empty subset of {COLLECTIVES}, got {candidates!r}")
    return tuple(name for name in COLLECTIVES if name in wanted)
