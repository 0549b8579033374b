"""Online probe of the cost model's alpha and beta over Horovod's public collectives.

Every rank runs the same schedule. First a pass, ascending (the smallest size, then x4 from 1 MiB, below
the largest; each size's second call timed), finds the first size whose agreed time is long enough for
the bandwidth term to dominate the latency (50 ms and 4x the smallest's, or 100 ms): larger sizes would
only cost time (a 4 MiB allreduce takes 0.7 s on 2 ranks behind 100 Mbit/s), so the ladder stops there.
Then for each size of the ladder (4 B .. 4 MiB by default, largest first) ``repeats`` timed calls of
``hvd.allreduce_`` (or ``hvd.broadcast_``) on a float32 tensor, after an untimed warm-up call, or with
the pass's timed call of that size among them (two calls of 1 MiB fewer); the median time per size is
kept. The ranks agree on the medians (averaged with an allreduce, then rank 0's copy broadcast: the bits
are identical everywhere). If the largest size took less than 4x the smallest, the bandwidth term is
drowned by latency and noise, so sizes x4 larger are added (up to ``max_bytes``), decided on the agreed
times. A line ``t = a + b·bytes`` is fitted by ordinary least squares, rank 0's fit is broadcast, and
the line is read through the cost model of the collective used (``hvd_topk.auto.costmodel``,
docs/auto.md; ``M`` the message bytes, ``N`` the ranks):

- ``allreduce`` (ring): t = 2(N−1)α + 2(N−1)/N·Mβ, so  α = a / (2(N−1)),  β = b·N / (2(N−1)).
- ``broadcast`` (tree): t = α·log2 N + log2 N·Mβ,   so  α = a / log2 N,    β = b / log2 N.

What the numbers include: α is the *effective* latency of one step as Horovod sees it (Python call,
Horovod's background-thread cycle and negotiation, the transport's latency), which is what a step
time built from these collectives pays. β is seconds per byte *per rank*: when the ranks share one
link (one host's loopback, one NIC for several ranks), β is the shared link's time per byte times
the number of ranks sending at once. E.g. a 2-rank ring allreduce on one loopback limited to R
bytes/s sends 2M bytes through it (M per rank), so t ≈ 2M/R and the probe reports β ≈ 2/R.

Example (one rank here; in a job, every rank calls ``run()``, a collective):
    >>> import horovod.torch as hvd
    >>> from hvd_topk.auto import costmodel
    >>> from hvd_topk.auto.probe import Probe
    >>> hvd.init()
    >>> probe = Probe()
    >>> res = probe.run()
    >>> best = costmodel.choose(hvd.size(), 4e6, 0.01, res.alpha, res.beta)
"""
import math
import statistics
import time
from typing import NamedTuple, Tuple

import horovod.torch as hvd
import numpy as np
import torch

from ..transports.collectives import agree, wait
from ..core.validate import check_choice, check_int, check_number

__all__ = ["DEFAULT_SIZES", "DEFAULT_REPEATS", "DEFAULT_MAX_BYTES", "ProbeResult", "Probe",
           "fit_line", "to_alpha_beta", "pass_sizes"]

# 4 B .. 4 MiB in steps of x16: 0.1-0.4 s in all on an unlimited loopback here (2 busy cores).
DEFAULT_SIZES = (4, 64, 1024, 16384, 262144, 4194304)
# Timed calls per size: the median of 5 shrugs off one or two calls slowed by the host.
DEFAULT_REPEATS = 5
# The x4 extension stops here: 16 MiB takes about 1.3 s per call on a 100 Mbit/s link.
DEFAULT_MAX_BYTES = 16 << 20
# Bytes of one element of the probe's messages (float32): sizes must be whole elements.
_ELEMENT_BYTES = 4
_PROBED = ("allreduce", "broadcast")
# The largest message must take this many times the smallest's time, or the slope is noise.
_MIN_SIGNAL = 4.0
# Each extension multiplies the largest size by this: finer than the ladder's x16.
_EXTENSION = 4
# Untimed calls before the timed ones of a size: the first call of a name negotiates and allocates.
_WARMUP_CALLS = 1
# The pass stops the ladder at the first size whose second call took this long, and this many times the
# smallest size's: its time is then mostly bandwidth (alpha is about 1 ms with Horovod's default cycle).
# Not 16x (nor 8x): across 2 emulated hosts at 100 Mbit/s the smallest took 9-24 ms and 1 MiB 0.12-0.17 s
# (its bandwidth term's 0.13 s), so the ladder went on to 4 MiB, 0.5-0.9 s a call, in two of the probes.
_ENOUGH_S = 0.05
_ENOUGH_OVER_SMALLEST = 4
# A call this long is the link's whatever the smallest took (one stalled small call must not send the
# ladder on to 4 MiB).
_ENOUGH_ALONE_S = 0.1
# The pass's sizes above the smallest: x4 from here. Not smaller: one stalled call would then stop the
# ladder among latency-bound sizes, whose line has no slope (a beta of 0 once, across emulated hosts).
_PASS_FROM = 1 << 20


class ProbeResult(NamedTuple):
    """One probe's outcome, identical on every rank."""
    alpha: float                 # s, the cost model's latency (>= 0)
    beta: float                  # s/byte per rank, the cost model's inverse bandwidth (>= 0)
    intercept_s: float           # a of the fitted t = a + b·bytes (may be slightly < 0 from noise)
    slope_s_per_byte: float      # b of the fit
    collective: str              # "allreduce" or "broadcast"
    n_workers: int
    sizes: Tuple[int, ...]       # message bytes probed, ascending (with any x4 extension)
    times_s: Tuple[float, ...]   # median seconds per size, averaged over the ranks
    wall_s: float                # seconds the probe took on rank 0


def fit_line(sizes, times):
    """Ordinary least-squares line ``t = a + b·bytes`` through (sizes, times).

    Unweighted on purpose: the slope is then set by the large messages, where beta matters (gradients
    are megabytes) and where real links bend away from a line least (a relative-error fit let the
    small, latency-bound sizes drag the slope of a 100 Mbit/s link 16% low). With a geometric size
    ladder most points are small, so the intercept still lands near the small messages' time.

    Args:
        sizes: message bytes, at least two distinct values.
        times: seconds per message, same length, finite.

    Returns:
        (a, b) as floats: intercept in s, slope in s/byte.

    Example:
        >>> a, b = fit_line([0, 1000, 2000], [1e-3, 2e-3, 3e-3])
        >>> round(a, 9), round(b, 12)
        (0.001, 1e-06)
    """
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if x.ndim != 1 or x.shape != t.shape or len(np.unique(x)) < 2:
        raise ValueError("sizes and times must be 1-D, of equal length, with at least two distinct sizes")
    if not np.isfinite(t).all():
        raise ValueError(f"times must be finite, got {t.tolist()}")
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), t, rcond=None)
    return float(a), float(b)


def to_alpha_beta(intercept_s, slope_s_per_byte, n_workers, collective="allreduce"):
    """The cost model's (alpha, beta) from a fitted line of ``collective`` on ``n_workers`` ranks.

    allreduce (ring): α = a / (2(N−1)), β = b·N / (2(N−1)); broadcast (tree): α = a / log2 N,
    β = b / log2 N. Negative values (noise around 0) are clamped to 0; N = 1 gives (0, 0).

    Args:
        intercept_s, slope_s_per_byte: a and b of ``fit_line``.
        n_workers: int >= 1.
        collective: ``"allreduce"`` or ``"broadcast"``.

    Returns:
        (alpha, beta) as floats >= 0.

    Example:
        >>> to_alpha_beta(4e-4, 2e-8, 2)     # 2 ranks: α = a/2, β = b
        (0.0002, 2e-08)
    """
    check_choice("collective", collective, _PROBED)
    check_int("n_workers", n_workers, low=1)
    if n_workers == 1:
        return 0.0, 0.0
    if collective == "allreduce":
        alpha, beta = intercept_s / (2 * (n_workers - 1)), slope_s_per_byte * n_workers / (2 * (n_workers - 1))
    else:
        alpha, beta = intercept_s / math.log2(n_workers), slope_s_per_byte / math.log2(n_workers)
    return max(0.0, alpha), max(0.0, beta)


class Probe:
    """Measures alpha and beta with Horovod's collectives; every method that talks is collective.

    Args:
        sizes: message bytes to probe, multiples of 4 (float32 elements), at least two distinct ones
            (default ``DEFAULT_SIZES``, 4 B .. 4 MiB). Those above the first size of the pass that took
            long enough (module docstring) are left out; the rest are probed largest first. On slow
            links keep the largest well above the link's burst.
        repeats: timed calls per size, int >= 1 (default 5); the median is kept.
        max_bytes: int (multiple of 4). When the largest size takes less than 4x the smallest, the
            bandwidth term is lost in the latency and its noise (fast links, busy hosts), so sizes x4
            larger are added, up to this many bytes (default 16 MiB), until it does.
        collective: ``"allreduce"`` (ring model) or ``"broadcast"`` (tree model, root 0).
        name: prefix of the Horovod collective names (identical on every rank).
        process_set: the ranks of one probe, the global set by default. Another set probes that set's
            link (``hvd_topk.auto.decide.probe_hosts``): every rank runs the same schedule over its own
            set at once, the ranks agree over all sets, so the numbers are the sets' average. allreduce
            only.

    Example (every rank gets the same res.alpha and res.beta):
        >>> probe = Probe(repeats=3)
        >>> res = probe.run()
    """

    def __init__(self, sizes=DEFAULT_SIZES, repeats=DEFAULT_REPEATS, max_bytes=DEFAULT_MAX_BYTES,
                 collective="allreduce", name="hvd_topk.probe", process_set=None):
        sizes = tuple(sizes)
        if len(set(sizes)) < 2 or not all(_is_msg_bytes(s) for s in sizes):
            raise ValueError(f"sizes must hold at least two distinct ints >= 4 that are multiples of 4, "
                             f"got {sizes!r}")
        check_int("repeats", repeats, low=1)
        if not _is_msg_bytes(max_bytes):
            raise ValueError(f"max_bytes must be an int >= 4 that is a multiple of 4, got {max_bytes!r}")
        check_choice("collective", collective, _PROBED)
        if process_set is not None and process_set is not hvd.global_process_set and collective != "allreduce":
            raise ValueError(f"a probe over a process set uses collective='allreduce', got {collective!r}")
        # Schedule (identical on every rank)
        self.sizes, self.repeats, self.max_bytes = tuple(sorted(set(sizes))), repeats, max_bytes
        self.collective, self.name = collective, name
        self.process_set = hvd.global_process_set if process_set is None else process_set
        # Outcome of the last run, None before the first
        self.result = None
        self._passed = {}                   # size -> [this rank's timed call of the pass], for the ladder

    def run(self):
        """Probe now (collective: every rank calls it at the same point) and return a ``ProbeResult``.

        At world size 1 nothing is sent and alpha = beta = 0 (the cost model predicts 0 there too).
        """
        start = time.perf_counter()
        n = self.process_set.size()
        if n == 1:
            self.result = ProbeResult(0.0, 0.0, 0.0, 0.0, self.collective, 1, self.sizes,
                                      tuple(0.0 for _ in self.sizes), 0.0)
            return self.result
        # One small call lines the ranks up, so that no rank times the others' late arrival.
        wait(hvd.allreduce_async_(torch.zeros(1), op=hvd.Sum, name=f"{self.name}.align"))
        self._passed = {}
        top = self._enough_size()
        sizes = [s for s in self.sizes if s < top] + [top]
        # Largest first: a token bucket's burst allowance (tc tbf, cloud NIC credits) is then spent in
        # the first untimed warm-up call instead of flattering the timed ones.
        medians = {size: self._median_s(size) for size in reversed(sizes)}
        times = self._agree([medians[s] for s in sizes], "times")
        # The extension is decided on agreed times, so every rank takes the same schedule.
        while times[-1] < _MIN_SIGNAL * times[0] and sizes[-1] * _EXTENSION <= self.max_bytes:
            sizes.append(sizes[-1] * _EXTENSION)
            times += self._agree([self._median_s(sizes[-1])], f"times.{sizes[-1]}")
        a, b = fit_line(sizes, times)
        a, b, wall = self._agree([a, b, time.perf_counter() - start], "fit", average=False)
        alpha, beta = to_alpha_beta(a, b, n, self.collective)
        self.result = ProbeResult(alpha, beta, a, b, self.collective, n, tuple(sizes), tuple(times), wall)
        return self.result

    def _enough_size(self):
        """The first size of the pass (``pass_sizes``, ascending) whose agreed time (``_pass_call_s``)
        reaches ``_ENOUGH_S`` and ``_ENOUGH_OVER_SMALLEST`` times the smallest's, or ``_ENOUGH_ALONE_S``;
        the ladder's largest if none does."""
        sizes = pass_sizes(self.sizes)
        if not sizes:
            return self.sizes[-1]
        low = self.sizes[0]
        smallest = self._agree([self._pass_call_s(low)], f"pass.{low}")[0]
        enough = max(_ENOUGH_S, _ENOUGH_OVER_SMALLEST * smallest)
        for size in sizes:
            if self._agree([self._pass_call_s(size)], f"pass.{size}")[0] >= min(enough, _ENOUGH_ALONE_S):
                return size
        return self.sizes[-1]

    def _pass_call_s(self, size):
        """The second of two calls of ``size``, kept for the ladder: the first negotiates, and on a link
        with a burst allowance (tc tbf's 1 MB) passes 1 MiB at line rate (it sent the ladder on to 4 MiB)."""
        self._call_s(size)
        self._passed[size] = [self._call_s(size)]
        return self._passed[size][0]

    def _median_s(self, size):
        """Median seconds of ``repeats`` calls of ``size`` bytes: the pass's, then more after the untimed
        warm-up call where the pass made none."""
        times = self._passed.pop(size, [])
        for _ in range(0 if times else _WARMUP_CALLS):
            self._call_s(size)
        return statistics.median(times + [self._call_s(size) for _ in range(self.repeats - len(times))])

    def _call_s(self, size):
        """Seconds of one call of ``size`` bytes, waited for as the transports wait (``wait``: Horovod's
        spin made calls of 4 B take up to 1 s where 4 ranks shared 2 cores)."""
        buf = torch.zeros(size // _ELEMENT_BYTES, dtype=torch.float32)
        t0 = time.perf_counter()
        if self.collective == "allreduce":      # one name per size: Horovod's cache serves repeats
            handle = hvd.allreduce_async_(buf, op=hvd.Sum, name=f"{self.name}.allreduce.{size}",
                                          process_set=self.process_set)
        else:
            handle = hvd.broadcast_async_(buf, root_rank=0, name=f"{self.name}.broadcast.{size}")
        wait(handle)
        return time.perf_counter() - t0

    def _agree(self, values, key, average=True):
        """``values`` averaged over the ranks (or rank 0's): identical bits everywhere."""
        return agree(values, f"{self.name}.{key}", average)


def pass_sizes(ladder):
    """The sizes the pass tries after the ladder's smallest, ascending: x4 steps from 1 MiB, below the
    ladder's largest (the ladder times that one anyway: the pass ending without a stop means it).

    Example:
        >>> pass_sizes(DEFAULT_SIZES), pass_sizes((4, 8))
        ([1048576], [])
    """
    low, high = min(ladder), max(ladder)
    sizes, size = [], _PASS_FROM
    while size < high:
        if size > low:
            sizes.append(size)
        size *= _EXTENSION
    return sizes


def _is_msg_bytes(value):
    """An int >= 4 and a multiple of 4 (whole float32 elements)."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= _ELEMENT_BYTES \
        and value % _ELEMENT_BYTES == 0
