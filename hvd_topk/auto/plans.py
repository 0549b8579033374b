"""Transport plans from the cost model: which transport each compressed tensor uses, and what a plan costs.

Pure functions over plain numbers and dicts (``hvd_topk.auto`` applies them, see
docs/auto.md). For every compressed tensor (n elements, density c, N ranks) the modelled seconds are::

    dense         dense_ring(M = 4n)                              a plain allreduce, nothing selected
    dense_fp16    dense_ring(2n) + φ·n                            the same in fp16; φ: ``DenseFP16``'s own
                                                                  work (cast, clamp, finite checks,
                                                                  residual, adds of the rows, scale)
    artopk        artopk_ring(M, c)  + σ·n/N + 2π·n               the leader selects, all gather values
    split_reduce  split_reduce(M, c) + σ·n + π·n                  every rank selects its own top-k; the
                                                                  owners' sums are O(k), left out
    allgather     allgather(M, c)    + σ·n + π·n                  every rank selects its own top-k

with the communication terms of ``hvd_topk.auto.costmodel``, σ the seconds per element of one exact top-k
selection, π the seconds per element of one pass over the accumulator (the leader role rotates, so
each rank selects 1/N of the tensors) and φ (``Costs.fp16_s``) the seconds per element of dense_fp16's
work around its exchange, timed with its own functions: its allocations cost it 15-100 π.
split_reduce and allgather are priced at ``ENTRY_BYTES`` per kept entry (bf16 values and 16-bit index
offsets, the transports' default); they (and dense_fp16) pay their latency per tensor, though they send
a bucket of tensors per collective, so the model overprices them where buckets hold many.
split_reduce's gather is priced at the sums its owners keep: ``budget_at(costs.budget, N)`` times k
(``Costs.budget``, TopKSettings' budget; over H ranks across the hosts).

A job across H hosts of L ranks each (``HostLink``, probed over the host sets and the cross sets of
``hvd_topk.transports.host_sets``) also has ``hierarchical``, with the host link's α_h, β_h and the
cross link's α_x, β_x (r = index bytes / value bytes)::

    hierarchical  (L−1)α_h + (L−1)/L·Mβ_h                         the host's dense ring reduce-scatter
                  + split_reduce(M/L, c) over H ranks, α_x, β_x   the shard's top-k across the hosts
                  + 2α_h·log L + (L−1)·Mc/L·(1+2r)·β_h            the host's allgather of the kept rows
                  + σ·n/L + 2π·n                                  one shard's selection, pad and rewrite

Where low rank is a candidate (``hvd_topk.auto.quality``; ``lowrank`` gives each tensor's n x m matrix
view and rank r, 0 where it would go dense), with μ the seconds per multiply-add of this machine's
matrix products::

    lowrank       dense_ring(4rn) + dense_ring(4rm)               P's and Q's allreduce (torch's two)
                  + 3μ·r·n·m + 2π·n·m                             M Q, M^T P, P Q^T; the residual

Each tensor takes the transport of least J = seconds / G^w, G the fraction of its gradient's energy the
transport sends at once (``hvd_topk.auto.quality``: 1 for dense and dense_fp16, whose rounding, about
2^-11 of each entry, is kept in the residual; measured for Top-K and low rank), w the gain's weight;
without quality figures (w = 0, or none given) J is the seconds. Ties go to dense, then dense_fp16, then
artopk, then split_reduce, then allgather, then hierarchical, then lowrank (``transports_of``).
Horovod's Gloo and MPI collectives do not expose ring vs. tree, so only the ring formulas are used. The
model ignores the overlap with the backward pass and the ranks' competition for CPU, so ``trial_plans``
lists the plans worth checking by measurement (``hvd_topk.auto.trial``): those within ``TRIAL_SPAN`` of
the model's plan in communication, and, where compute dominates a step, those within
``WHOLE_STEP_SPAN`` of it in whole steps (the step's measured part outside communication, plus each
plan's seconds beyond the ``BACKWARD_SHARE`` of it that the backward pass hides): dense's bytes may
cost a compute-bound step little, and its steps are exact.
Neither lets in a plan whose J would be beyond ``WHOLE_STEP_SPAN`` of the model plan's whole step even
if it communicated in no time (Top-K's G of 0.01-0.02 in the norm of AdamW's update on the char LM).
"""
import math
from typing import NamedTuple, Optional

from . import costmodel
from .quality import kept_fraction, plan_gain
from ..core.wire import CODEC_ENTRY_BYTES, INDEX_BYTES, budget_at

# allgather and split_reduce pack each entry in bf16 and a 16-bit index offset (TopKSettings' default
# values; hvd_topk.core.codec): the bytes the cost model prices for them
ENTRY_BYTES = CODEC_ENTRY_BYTES["bf16"]

__all__ = ["TRANSPORTS", "DENSE_TRANSPORTS", "HIERARCHICAL", "LOWRANK", "TRIAL_SPAN", "WHOLE_STEP_SPAN",
           "BACKWARD_SHARE", "HostLink", "Costs", "transports_of", "tensor_seconds", "hierarchical_seconds",
           "plan_transports", "plan_seconds", "trial_plans", "uniform_plan", "plan_name", "plan_counts", "fitted_link",
           "link_figures", "costs_to_data", "costs_from_data", "lowrank_seconds"]

# The transports a plan chooses from, also the tie-break order: dense first (exact, no compression
# error), then dense in fp16 (its rounding delayed, not lost), then AR-Topk (one selection per tensor),
# then split_reduce (bytes per rank flat in N), then allgather (the order of costmodel.COLLECTIVES).
TRANSPORTS = ("dense", "dense_fp16", "artopk", "split_reduce", "allgather")
# The transports that send every entry with one allreduce: between plans of these alone the model's ratio
# is the bytes and the timed work around them, not the CPU competition of selection that TRIAL_SPAN allows.
DENSE_TRANSPORTS = ("dense", "dense_fp16")
# The transport of jobs across equal hosts (``Costs.hosts``); last in the tie-break order: it needs
# both links to be measured right, and a flat transport is one collective fewer per phase.
HIERARCHICAL = "hierarchical"
# Low rank (PowerSGD), where the optimizer has it to offer; last in the tie-break order: its error is not
# of Top-K's kind (a subspace, not the largest entries), so it wins only on time or measured quality.
LOWRANK = "lowrank"
# Every uniform plan modelled within this factor of the model's plan (communication alone) is measured:
# the model's misses seen on busy hosts (CPU competition, fusion) stayed within it.
TRIAL_SPAN = 4.0
# A uniform plan whose modelled whole step (the measured part outside communication, the same for every
# plan, plus its modelled seconds) is within this factor of the model plan's is measured too: the
# trial's own clear gap (``hvd_topk.auto.trial.CLEAR_GAP``), beyond which a plan leaves it at once.
WHOLE_STEP_SPAN = 1.5
# The share of the step outside communication that communication can hide behind: the backward pass,
# about twice the forward's work (two products per layer where the forward has one), during which
# Horovod's hooks start each tensor's collectives. On the char LM (2 ranks, 100 Mbit/s) dense_fp16's
# modelled 140 ms of communication hid wholly in a step of 176 ms outside it, and dense's 280 ms half.
BACKWARD_SHARE = 2.0 / 3.0
# DenseFP16's work around its exchange in passes over a tensor, for costs measured before it was timed
# (``Costs.fp16_s`` None): an older checkpoint's. Timed, it is 15-100 π (π is one in-place add; its
# passes allocate).
FP16_PASSES = 8


class HostLink(NamedTuple):
    """The two links of a job across equal hosts (``hvd_topk.auto.decide.probe_hosts``)."""
    hosts: int              # H
    per_host: int           # L
    host_alpha: float       # s, within a host (probed over the host sets)
    host_beta: float        # s/byte per rank, within a host
    cross_alpha: float      # s, between hosts (probed over the cross sets, all at once)
    cross_beta: float       # s/byte per rank, between hosts


class Costs(NamedTuple):
    """What the model needs of this machine and network, identical on every rank."""
    alpha: float            # s, latency of one message (probe)
    beta: float             # s/byte per rank (probe)
    select_s: float         # s per element of one exact top-k selection
    pass_s: float           # s per element of one pass over the accumulator
    hosts: Optional[HostLink] = None       # a job across equal hosts: hierarchical is modelled too
    matmul_s: float = 0.0   # s per multiply-add of a thin matrix product (low rank's M Q and M^T P)
    budget: Optional[float] = None         # TopKSettings.budget: the sums split_reduce gathers (budget_at)
    fp16_s: Optional[float] = None         # s per element of dense_fp16's own work (None: FP16_PASSES · π)


def transports_of(costs, lowrank=None):
    """The transports a plan chooses from under ``costs``: hierarchical too where both links are known,
    low rank too where ``lowrank`` (name -> (n, m, r)) is given."""
    return TRANSPORTS + ((HIERARCHICAL,) if costs.hosts is not None else ()) + ((LOWRANK,) if lowrank else ())


def link_figures(costs):
    """``costs.hosts``'s two links by name (``opt.stats()``), {} for a job on one link."""
    return {} if costs.hosts is None else \
        {key: getattr(costs.hosts, key) for key in ("host_alpha", "host_beta", "cross_alpha", "cross_beta")}


def costs_to_data(costs):
    """``Costs`` (or None) as plain tuples, for a checkpoint."""
    return None if costs is None else \
        tuple(costs[:4]) + (None if costs.hosts is None else tuple(costs.hosts),) + tuple(costs[5:])


def costs_from_data(data):
    """The ``Costs`` of ``costs_to_data``'s tuples (an older checkpoint's four to seven too)."""
    if data is None:
        return None
    hosts = data[4] if len(data) > 4 else None
    return Costs(*data[:4], hosts=None if hosts is None else HostLink(*hosts),
                 matmul_s=data[5] if len(data) > 5 else 0.0, budget=data[6] if len(data) > 6 else None,
                 fp16_s=data[7] if len(data) > 7 else None)


def tensor_seconds(numel, density, n_workers, costs, value_bytes=4, lowrank=None):
    """Modelled seconds of each transport for one tensor (module docstring). dict transport -> s, in
    ``transports_of`` order; ``lowrank``: the tensor's (n, m, r), or None where low rank is no candidate."""
    t = costmodel.predict(n_workers, numel * value_bytes, density, costs.alpha, costs.beta, index_bytes=INDEX_BYTES,
                          value_bytes=value_bytes, entry_bytes=ENTRY_BYTES, kept=budget_at(costs.budget, n_workers))
    select, sweep = costs.select_s * numel, costs.pass_s * numel
    half = costmodel.predict(n_workers, numel * min(value_bytes, 2), 1.0, costs.alpha, costs.beta)["dense_ring"]
    fp16 = (FP16_PASSES * costs.pass_s if costs.fp16_s is None else costs.fp16_s) * numel
    seconds = {"dense": t["dense_ring"], "dense_fp16": half + fp16,
               "artopk": t["artopk_ring"] + select / n_workers + 2 * sweep,
               "split_reduce": t["split_reduce"] + select + sweep,
               "allgather": t["allgather"] + select + sweep}
    if costs.hosts is not None:
        seconds[HIERARCHICAL] = hierarchical_seconds(numel, density, costs, value_bytes)
    if lowrank is not None:
        seconds[LOWRANK] = lowrank_seconds(*lowrank, n_workers, costs, value_bytes) if lowrank[2] else seconds["dense"]
    return seconds


def lowrank_seconds(n, m, r, n_workers, costs, value_bytes=4):
    """Modelled seconds of low rank for one n x m tensor at rank r (module docstring).

    Example:
        >>> c = Costs(alpha=1e-5, beta=1e-9, select_s=0, pass_s=0, matmul_s=1e-10)
        >>> round(lowrank_seconds(1000, 1000, 4, 2, c), 9)       # 2 x (2α + 16 kB·β) + 3μ·4e6
        0.001272
    """
    def ring(nbytes):
        return costmodel.predict(n_workers, nbytes, 1.0, costs.alpha, costs.beta)["dense_ring"]
    return ring(r * n * value_bytes) + ring(r * m * value_bytes) + 3 * costs.matmul_s * r * n * m + \
        2 * costs.pass_s * n * m


def hierarchical_seconds(numel, density, costs, value_bytes=4):
    """Modelled seconds of hierarchical for one tensor (module docstring); ``costs.hosts`` is set."""
    link = costs.hosts
    per_host, m, r = link.per_host, numel * value_bytes, INDEX_BYTES / value_bytes
    scatter = (per_host - 1) * (link.host_alpha + m / per_host * link.host_beta)
    cross = costmodel.predict(link.hosts, m / per_host, density, link.cross_alpha, link.cross_beta,
                              index_bytes=INDEX_BYTES, value_bytes=value_bytes, entry_bytes=ENTRY_BYTES,
                              kept=budget_at(costs.budget, link.hosts))["split_reduce"]
    gather = 2 * link.host_alpha * math.log2(per_host) + \
        (per_host - 1) * m * density / per_host * (1 + 2 * r) * link.host_beta
    return scatter + cross + gather + costs.select_s * numel / per_host + 2 * costs.pass_s * numel


def plan_transports(numels, density, n_workers, costs, value_bytes=4, modes=None, lowrank=None, quality=None,
                    weight=0.0):
    """Best transport per tensor, of least J = seconds / G^weight (module docstring): dict name ->
    transport (ties: order of ``transports_of``).

    Args:
        numels: dict name -> number of elements of each compressed tensor (or bucket).
        density: fraction of elements the sparse transports send, in (0, 1].
        n_workers: ranks.
        costs: ``Costs``.
        modes: the transports to choose from (default: ``transports_of(costs, lowrank)``).
        lowrank: dict name -> (n, m, r) of the tensors low rank may send, or None: no low rank.
        quality: ``hvd_topk.auto.quality``'s figures (name -> energies), or None: seconds alone.
        weight: the exponent w of G in J, >= 0.

    Example:
        >>> fast = Costs(alpha=1e-5, beta=1e-10, select_s=1e-9, pass_s=1e-10)
        >>> plan_transports({"w": 10**6}, 0.001, 4, fast)       # one selection instead of four
        {'w': 'artopk'}
        >>> plan_transports({"w": 10**6}, 0.001, 4, fast._replace(select_s=0.0, pass_s=0.0))
        {'w': 'allgather'}
    """
    order = transports_of(costs, lowrank)
    modes = order if modes is None else modes
    plan = {}
    for name, n in numels.items():
        t = tensor_seconds(n, density, n_workers, costs, value_bytes, (lowrank or {}).get(name))
        plan[name] = min((m for m in modes if m in t),
                         key=lambda m: (t[m] / kept_fraction(quality, name, m) ** weight, order.index(m)))
    return plan


def plan_seconds(numels, plan, density, n_workers, costs, value_bytes=4, lowrank=None):
    """Modelled seconds of a whole plan (sum over its tensors)."""
    return sum(tensor_seconds(numels[name], density, n_workers, costs, value_bytes, (lowrank or {}).get(name))[mode]
               for name, mode in plan.items())


def uniform_plan(numels, transport):
    """The plan sending every tensor of ``numels`` with ``transport``."""
    return {name: transport for name in numels}


def trial_plans(numels, density, n_workers, costs, value_bytes=4, span=TRIAL_SPAN, lowrank=None, quality=None,
                weight=0.0, fixed_s=0.0):
    """Plans worth measuring: the model's per-tensor plan first, then every uniform plan (one transport
    for all tensors, in ``transports_of`` order) whose modelled J (its seconds over its energy-weighted
    G^w, ``quality.plan_gain``) is within ``span`` x the model's plan's, or whose J of a whole step
    (``fixed_s``, the step's measured seconds outside communication, plus the seconds beyond
    ``BACKWARD_SHARE`` of it, which the backward pass does not hide) is within ``WHOLE_STEP_SPAN`` x the
    model's plan's; but not a plan whose J would exceed that even at a step of
    ``fixed_s`` alone (no communication at all): its G is its handicap, and the trial would drop it after
    its first counted round (``trial.quality_gaps``), having trained with it. Where the model's plan and
    the uniform one send every tensor dense (``DENSE_TRANSPORTS``), ``span`` is ``WHOLE_STEP_SPAN``: the
    trial's clear gap. Low rank's uniform plan sends only the tensors of ``lowrank`` with it, the others as
    the model's plan does.

    Example:
        >>> slow = Costs(alpha=1e-4, beta=8e-8, select_s=1e-9, pass_s=1e-10)       # 100 Mbit/s
        >>> [plan_name(p) for p in trial_plans({"w": 10**6}, 0.01, 2, slow)]
        ['all split_reduce', 'all artopk', 'all allgather']
        >>> [plan_name(p) for p in trial_plans({"w": 10**6}, 0.01, 2, slow, fixed_s=1.0)]    # compute-bound
        ['all split_reduce', 'all dense', 'all dense_fp16', 'all artopk', 'all allgather']
    """
    plan = plan_transports(numels, density, n_workers, costs, value_bytes, lowrank=lowrank, quality=quality,
                           weight=weight)

    def j(p, fixed=0.0):                # the plan's seconds not hidden behind the backward pass, added
        seconds = plan_seconds(numels, p, density, n_workers, costs, value_bytes, lowrank)
        return (fixed + max(0.0, seconds - BACKWARD_SHARE * fixed)) / plan_gain(p, quality) ** weight
    best, best_step, arms = j(plan), j(plan, fixed_s), [plan]
    all_dense = set(plan.values()) <= set(DENSE_TRANSPORTS)
    for mode in transports_of(costs, lowrank):
        uniform = dict(plan, **uniform_plan(lowrank, mode)) if mode == LOWRANK else uniform_plan(numels, mode)
        futile = fixed_s / plan_gain(uniform, quality) ** weight > WHOLE_STEP_SPAN * best_step
        comm_span = WHOLE_STEP_SPAN if all_dense and mode in DENSE_TRANSPORTS else span
        if uniform not in arms and not futile and (
                j(uniform) <= comm_span * best or fixed_s > 0 and j(uniform, fixed_s) <= WHOLE_STEP_SPAN * best_step):
            arms.append(uniform)
    return arms


def plan_counts(plan, modes=TRANSPORTS):
    """dict transport -> number of tensors of ``plan`` sent with it (every one of ``modes``, in order)."""
    return {m: sum(1 for v in plan.values() if v == m) for m in modes}


def plan_name(plan):
    """Short name of a plan for the history: "all artopk", "mixed 2 dense/3 allgather"."""
    modes = set(plan.values())
    return f"all {modes.pop()}" if len(modes) == 1 else "mixed " + "/".join(
        f"{sum(1 for v in plan.values() if v == m)} {m}" for m in TRANSPORTS + (HIERARCHICAL, LOWRANK) if m in modes)


def fitted_link(alpha, beta, last):
    """(alpha, beta, kept) of a new probe: a re-probe whose fit finds no bandwidth term at all (busy
    host: the large messages were not slower than the small ones) measured noise, so the last fit
    (``Costs`` or None) is kept when it had one (kept True)."""
    if beta <= 0 and last is not None and last.beta > 0:
        return last.alpha, last.beta, True
    return alpha, beta, False
