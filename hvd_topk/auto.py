"""``communication='auto'`` and the adaptive ratio of ``hvd_topk.DistributedOptimizer``.

Decisions come only from numbers every rank holds bit for bit (``comm.agree``: averaged over the
ranks, then rank 0's copy broadcast), so every rank takes the same decision at the same step even when
their clocks disagree.

**Transport per tensor (communication='auto').** After the first step the ranks probe α and β
(``hvd_topk.probe``) and time the compression work of this machine: σ, seconds per element of one
exact top-k selection, and π, seconds per element of one pass over the accumulator. For every
compressed tensor (n elements, density c, N ranks) the modelled seconds are::

    dense      dense_ring(M = 4n)                                 a plain allreduce, nothing selected
    allgather  allgather(M, c)   + σ·n + π·n                      every rank selects its own top-k
    artopk     artopk_ring(M, c) + σ·n/N + 2π·n                   the leader selects, all gather values

(``hvd_topk.costmodel``; the leader role rotates, so each rank selects 1/N of the tensors.) The
cheapest wins; ties go to dense, then artopk. The model ignores the overlap with the backward pass and
the ranks' competition for CPU (on a fast link a selection on every rank costs more than the model
says), so its choice is checked by measurement: the model's plan and every uniform plan (all dense,
all artopk, all allgather) modelled within 4x of it take turns, ``trial_steps`` steps at a time (A B C
A B C ...: a slow spell of the host falls on every plan, not on one). The first step of each turn and
the whole first round (each transport's first use) are not counted. After every round the ranks agree
on each plan's mean counted step of that round; from round ``trial_rounds`` on, with R counted rounds,
each plan is compared with the fastest so far through the paired differences d of their rounds
(relative to the fastest's mean; t = Student's t quantile 0.975 with R - 1 degrees of freedom,
m = ``trial_margin``, 5%)::

    mean(d) - t * sd(d) / sqrt(R) > m      the plan is slower by more than m: it leaves the trial
    mean(d) + m > t * sd(d) / sqrt(R)      the plan is not faster than the fastest by more than m

and the trial ends when the second holds for every plan left (or after ``trial_max_rounds`` rounds).
So a clear gap ends it in a few rounds, and two plans within the noise of each other take turns until
either is shown to be within m of the other. The fastest is kept, unless the all-dense plan is within m
of it: a smaller lead is noise on a busy host, and dense is exact. (The model's plan gets no such
preference: it charges α per tensor, while Horovod fuses the tensors of a cycle and AR-Topk shares every
index set in one allgather per step.) Horovod's Gloo and MPI collectives do not expose ring vs. tree,
so only the ring formulas are used here.

**Adaptive ratio.** Every ``every`` steps the ranks agree on (a) the mean measured step time T and (b)
the compression gain G(c) = ‖top-k_c(acc)‖² / ‖acc‖² of each candidate ratio c, computed from the
accumulators of one step (``sparsify.topk_energies``, one selection at the largest k). The step time
of another ratio is T(c) = T − comm(now) + comm(c), with the communication and selection terms above.
The ratio minimises::

    J(c) = T(c) / G(c) ** weight          (weight 0.3 by default)

i.e. the time to deliver a unit of gradient energy, with the gain discounted by ``weight`` < 1
because error feedback delays what is not sent instead of losing it. The default is measured
(``python -m bench.adaptive --calibrate``): on the digits CNN the progress per step of ratio c
relative to dense, steps_dense / steps_c to a test loss, followed G(c) ** w with w from 0.18 (near
convergence) to 0.40 (early), 0.31 on average over four thresholds. weight = 1 trades time and
gain one for one (favours larger ratios); weight = 0 minimises step time alone (favours the smallest
ratio). The ratio moves only when J improves by more than 5%; a new ratio takes effect two steps
later, so the AR-Topk index set prepared one step ahead already has the new size.

**Re-deciding.** At each check the measured communication time is compared with the model's
prediction, scaled by the calibration taken at the last probe; a drift of more than ``threshold``, the
same way at two checks in a row (one slow spell of a busy host is not a new network), re-runs the
probe and the transport choice (at most once per 4 checks).
"""
import logging
import math
import statistics
from typing import NamedTuple

import torch
from horovod.torch import mpi_ops

from . import costmodel
from .comm import agree
from .probe import Probe
from .sparsify import k_for, topk_energies, topk_indices

__all__ = ["MODES", "DEFAULT_RATIOS", "DEFAULT_WEIGHT", "Costs", "tensor_seconds", "plan_transports", "plan_seconds",
           "trial_plans", "choose_ratio", "AutoTuner"]

log = logging.getLogger("hvd_topk")

MODES = ("dense", "artopk", "allgather")          # also the tie-break order
DEFAULT_RATIOS = (0.1, 0.03, 0.01, 0.003, 0.001)
DEFAULT_WEIGHT = 0.3                               # w of J(c); measured, see the module docstring
_HYSTERESIS = 0.05                                 # J must improve by more than this to move the ratio
_TRIAL_SPAN = 4.0                                  # trial every uniform plan modelled within this x the best
_TRIAL_MARGIN = 0.05                               # a lead over dense smaller than this is a tie (_trial_step)
# Student's t, quantile 0.975, by degrees of freedom (beyond the table: 30's): how many standard errors
# of the mean of a few paired differences make a confident difference (_trial_verdict).
_T975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
         2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


class Costs(NamedTuple):
    """What the model needs of this machine and network, identical on every rank."""
    alpha: float            # s, latency of one message (probe)
    beta: float             # s/byte per rank (probe)
    select_s: float         # s per element of one exact top-k selection
    pass_s: float           # s per element of one pass over the accumulator


def tensor_seconds(numel, density, n_workers, costs, value_bytes=4):
    """Modelled seconds of each transport for one tensor (module docstring). dict mode -> s."""
    t = costmodel.predict(n_workers, numel * value_bytes, density, costs.alpha, costs.beta,
                          index_bytes=4, value_bytes=value_bytes)
    select, sweep = costs.select_s * numel, costs.pass_s * numel
    return {"dense": t["dense_ring"],
            "allgather": t["allgather"] + select + sweep,
            "artopk": t["artopk_ring"] + select / n_workers + 2 * sweep}


def plan_transports(numels, density, n_workers, costs, value_bytes=4, modes=MODES):
    """Cheapest transport per tensor: dict name -> mode (ties: order of ``MODES``).

    Args:
        numels: dict name -> number of elements of each compressed tensor (or bucket).
        density: fraction of elements the sparse transports send, in (0, 1].
        n_workers: ranks.
        costs: ``Costs``.
        modes: the transports to choose from.

    Example:
        >>> fast = Costs(alpha=1e-5, beta=1e-10, select_s=1e-9, pass_s=1e-10)
        >>> plan_transports({"w": 10**6}, 0.001, 4, fast)
        {'w': 'allgather'}
    """
    plan = {}
    for name, n in numels.items():
        t = tensor_seconds(n, density, n_workers, costs, value_bytes)
        plan[name] = min(modes, key=lambda m: (t[m], MODES.index(m)))
    return plan


def plan_seconds(numels, plan, density, n_workers, costs, value_bytes=4):
    """Modelled seconds of a whole plan (sum over its tensors)."""
    return sum(tensor_seconds(numels[name], density, n_workers, costs, value_bytes)[mode]
               for name, mode in plan.items())


def trial_plans(numels, density, n_workers, costs, value_bytes=4, span=_TRIAL_SPAN):
    """Plans worth measuring: the model's per-tensor plan first, then every uniform plan (one transport
    for all tensors, in ``MODES`` order) whose modelled time is within ``span`` x the model's plan."""
    plan = plan_transports(numels, density, n_workers, costs, value_bytes)
    best = plan_seconds(numels, plan, density, n_workers, costs, value_bytes)
    arms = [plan]
    for mode in MODES:
        uniform = {name: mode for name in numels}
        if uniform not in arms and plan_seconds(numels, uniform, density, n_workers, costs, value_bytes) \
                <= span * best:
            arms.append(uniform)
    return arms


def _plan_name(plan):
    modes = set(plan.values())
    return f"all {modes.pop()}" if len(modes) == 1 else \
        "mixed " + "/".join(f"{sum(1 for v in plan.values() if v == m)} {m}" for m in MODES if m in modes)


def choose_ratio(current, step_seconds, gains, weight=DEFAULT_WEIGHT, hysteresis=_HYSTERESIS):
    """The ratio minimising J(c) = T(c) / G(c)**weight; stays at ``current`` unless J improves enough.

    Args:
        current: the ratio in use (a key of both dicts).
        step_seconds: dict ratio -> modelled step seconds T(c).
        gains: dict ratio -> compression gain G(c) in [0, 1].
        weight: exponent of the gain, >= 0.
        hysteresis: relative improvement of J needed to move.

    Example:
        >>> choose_ratio(0.01, {0.1: 0.5, 0.01: 0.06, 0.001: 0.05}, {0.1: 0.6, 0.01: 0.1, 0.001: 0.01})
        0.01
    """
    def cost(c):
        g = gains[c]
        return math.inf if g <= 0 else step_seconds[c] / g ** weight

    best = min(sorted(step_seconds), key=cost)
    return best if cost(best) < (1 - hysteresis) * cost(current) else current


class _Trial:
    """The plans on trial and what the ranks agreed of them so far (``AutoTuner._trial_step``)."""

    def __init__(self, arms):
        self.arms = [dict(a) for a in arms]
        self.active = list(range(len(arms)))       # the plans still taking turns, in turn order
        self.rounds = 0                            # complete rounds
        self.means = [[] for _ in arms]            # per plan: agreed mean counted step of each counted round
        self.turn_times = []                       # this rank's step times of the turn under way
        self.round_means = []                      # this rank's turn means of the round under way


class AutoTuner:
    """Per-optimizer state of the automatic decisions (identical on every rank).

    Args:
        auto_transport: choose the transport of every compressed tensor (communication='auto').
        ratios: candidate ratios for the adaptive ratio, descending; None: fixed ratio.
        weight: exponent of the gain in J.
        every: steps between checks (ratio, drift), >= 2.
        trial_steps: steps of one plan in a row during the trial of plans (the first is not counted), >= 2.
        trial_rounds: the fewest rounds of the trial (the first is not counted), >= 3.
        trial_max_rounds: the most rounds of the trial, >= trial_rounds.
        trial_margin: the difference in step time the trial resolves: a plan within it of the fastest is
            as good (the all-dense plan within it is kept: exact); a lead over dense smaller than this is
            within the noise of a busy host.
        threshold: relative drift of communication time that triggers a new probe.
        probe: a ``hvd_topk.probe.Probe`` (default ``Probe(repeats=3)``).
    """

    def __init__(self, auto_transport, ratios, weight=DEFAULT_WEIGHT, every=50, trial_steps=4, trial_rounds=5,
                 threshold=0.5, probe=None, trial_margin=_TRIAL_MARGIN, trial_max_rounds=21):
        if trial_steps < 2 or trial_rounds < 3 or trial_max_rounds < trial_rounds:
            raise ValueError(f"trial_steps must be >= 2, trial_rounds >= 3 and trial_max_rounds >= trial_rounds, "
                             f"got {trial_steps}, {trial_rounds}, {trial_max_rounds}")
        # configuration
        self.auto_transport, self.ratios, self.weight = auto_transport, ratios, weight
        self.every, self.trial_steps, self.trial_rounds, self.threshold = every, trial_steps, trial_rounds, threshold
        self.trial_margin, self.trial_max_rounds = trial_margin, trial_max_rounds
        self.probe = probe or Probe(repeats=3)
        # agreed measurements
        self.costs = None                 # Costs, after the first probe
        self.calibration = None           # measured / modelled communication at the last probe
        self.last_probe_check = -math.inf
        self.drift_sign = 0               # +1/-1: the last check drifted up/down beyond threshold; 0: not
        # decisions
        self.plan = {}                    # name -> mode, in effect now (auto_transport)
        self.trial = None                 # _Trial under way, or None
        self.history = []                 # (step, ratio, {mode: count}, reason), identical on all ranks
        # this rank's measurements of the current window
        self.step_times = []
        self.comm_times = []
        self.gain_sums = None             # [energy of each candidate ..., ||acc||^2] of one step

    # -- what the optimizer asks ------------------------------------------------------------------

    def mode(self, name, fixed):
        """Transport of ``name`` this step (``fixed`` when transports are not chosen automatically)."""
        if not self.auto_transport:
            return fixed
        return self.plan.get(name, "dense")      # before the first decision: dense, exact

    def wants_gains(self, step):
        """Whether this step's accumulators feed the gain estimate (the step before a check)."""
        return self.ratios is not None and step >= 1 and (step + 1) % self.every == 0

    def observe_acc(self, acc):
        """Add one accumulator's top-k energies for every candidate ratio (this rank)."""
        n = acc.numel()
        energies = topk_energies(acc, [k_for(n, c) for c in self.ratios])
        total = float(torch.dot(acc.double(), acc.double()))
        row = energies + [total]
        self.gain_sums = row if self.gain_sums is None else [a + b for a, b in zip(self.gain_sums, row)]

    # -- after each step (collective: every rank calls it at the same step) ------------------------

    def end_step(self, state, step, step_s, comm_s):
        """Record this rank's times of ``step``; decide at the scheduled steps. Returns a ratio change
        (effective_step, ratio) or None."""
        if step >= 1:
            self.step_times.append(step_s)
            self.comm_times.append(comm_s)
            if self.trial is not None:
                self.trial.turn_times.append(step_s)
        if self.costs is None:
            self._probe(state, step, reason="start")
            return None
        if self.trial is not None:
            self._trial_step(state, step)
            return None
        if (step + 1) % self.every:
            return None
        return self._check(state, step)

    # -- decisions ---------------------------------------------------------------------------------

    def _probe(self, state, step, reason):
        res = self.probe.run()
        alpha, beta = res.alpha, res.beta
        if beta <= 0 and self.costs is not None and self.costs.beta > 0:
            # A re-probe whose fit finds no bandwidth term at all (busy host: the large messages were
            # not slower than the small ones) measured noise: keep the last fit (identical everywhere).
            alpha, beta = self.costs.alpha, self.costs.beta
            reason += ", re-probe without a bandwidth term: last alpha/beta kept"
        select_s, pass_s = agree(self._time_compression(state), "hvd_topk.auto.costs")
        self.costs = Costs(alpha, beta, select_s, pass_s)
        self.calibration = None
        self.last_probe_check = step
        self._choose_transports(state, step, reason)

    def _choose_transports(self, state, step, reason):
        if not self.auto_transport:
            self._record(step, state.ratio, reason)
            return
        numels, density, n = state.sparse_numels, state.density(step + 1), mpi_ops.size()
        plan = plan_transports(numels, density, n, self.costs)
        self.plan = plan
        self.trial = None
        arms = trial_plans(numels, density, n, self.costs)
        if len(arms) > 1:                               # the model is not sure enough: measure
            self.start_trial(arms)
        self._record(step, state.ratio, reason + (f", trial of {len(arms)} plans" if self.trial else ""))

    def start_trial(self, arms):
        """Measure ``arms`` (plans) in turns from the next step on (module docstring)."""
        self.trial = _Trial(arms)
        self.plan = dict(arms[0])

    def _trial_step(self, state, step):
        """One step of the trial is over: next turn, next round, and after a round the agreed verdict."""
        trial = self.trial
        if len(trial.turn_times) < self.trial_steps:
            return
        trial.round_means.append(statistics.fmean(trial.turn_times[1:]))   # the turn's first step: transition
        trial.turn_times = []
        if len(trial.round_means) < len(trial.active):
            self.plan = dict(trial.arms[trial.active[len(trial.round_means)]])
            return
        trial.rounds += 1
        if trial.rounds > 1:                       # the first round (each transport's first use) is not counted
            agreed = agree(trial.round_means, "hvd_topk.auto.trial")
            for a, m in zip(trial.active, agreed):
                trial.means[a].append(m)
        trial.round_means = []
        if trial.rounds >= self.trial_rounds:
            self._trial_verdict(state, step)
        if self.trial is not None:
            self.plan = dict(trial.arms[trial.active[0]])

    def _trial_verdict(self, state, step):
        """Drop the plans shown slower than the fastest by more than the margin; end the trial when no
        plan left may be faster than the fastest by more than the margin (module docstring)."""
        trial, m = self.trial, self.trial_margin
        best = min(trial.active, key=lambda a: (statistics.fmean(trial.means[a]), a))
        ref = statistics.fmean(trial.means[best])
        settled = True
        for a in list(trial.active):
            if a == best:
                continue
            d = [(x - y) / ref for x, y in zip(trial.means[a], trial.means[best])]
            if len(d) < 2:
                settled = False
                continue
            tse = _T975[min(len(d) - 1, len(_T975)) - 1] * statistics.stdev(d) / math.sqrt(len(d))
            if statistics.fmean(d) - tse > m:
                trial.active.remove(a)             # slower by more than the margin: out
            elif statistics.fmean(d) + m <= tse:
                settled = False                    # may still be the faster one
        if not settled and trial.rounds < self.trial_max_rounds:
            return
        means = {a: statistics.fmean(x) for a, x in enumerate(trial.means)}
        dense = [a for a in range(len(trial.arms)) if set(trial.arms[a].values()) == {"dense"}]
        if dense and dense[0] in trial.active and means[dense[0]] <= (1 + m) * means[best]:
            best = dense[0]                        # a lead over dense within the margin: keep dense, exact
        self.trial, self.plan = None, dict(trial.arms[best])
        self.calibration = None                    # measured against the plan now in effect
        self._record(step, state.ratio, f"trial, {trial.rounds - 1} counted rounds: " + ", ".join(
            f"{_plan_name(arm)} {means[a] * 1e3:.1f} ms/step"
            + ("" if a in trial.active else f" (out after {len(trial.means[a])})")
            for a, arm in enumerate(trial.arms)) + f"; kept {_plan_name(trial.arms[best])}")
        self.step_times, self.comm_times = [], []

    def _check(self, state, step):
        """Agree on the window's measurements; re-probe on drift; move the ratio."""
        gains = self.gain_sums or []
        self.gain_sums = None
        m = len(self.ratios) if self.ratios is not None else 0
        if len(gains) != m + (1 if m else 0):
            gains = [0.0] * (m + (1 if m else 0))    # no compressed tensor this step: no gain data
        agreed = agree([statistics.fmean(self.step_times or [0.0]),
                        statistics.fmean(self.comm_times or [0.0])] + gains, "hvd_topk.auto.check")
        step_s, comm_s, gains = agreed[0], agreed[1], agreed[2:]
        self.step_times, self.comm_times = [], []
        numels, n = state.sparse_numels, mpi_ops.size()
        density = state.density(step + 1)
        plan = self.plan if self.auto_transport else {k: state.communication for k in numels}
        modelled = plan_seconds(numels, plan, density, n, self.costs)
        if self.calibration is None:
            self.calibration = comm_s / modelled if modelled > 0 else None
            self.drift_sign = 0
        elif modelled > 0 and step - self.last_probe_check >= 4 * self.every:
            ratio = comm_s / modelled / self.calibration
            log_ratio = math.log(max(ratio, 1e-12))
            sign = 0 if abs(log_ratio) <= math.log1p(self.threshold) else (1 if log_ratio > 0 else -1)
            if sign and sign == self.drift_sign:          # the second check in a row, the same way
                self.drift_sign = 0
                self._probe(state, step, reason=f"drift x{ratio:.2f} at two checks")
                return None
            self.drift_sign = sign
        if self.ratios is None or not gains or gains[-1] <= 0:
            return None
        total = gains[-1]
        gain = {c: gains[i] / total for i, c in enumerate(self.ratios)}
        times = {}
        for c in self.ratios:
            d = state.density_with(c, step + 2)
            plan_c = plan_transports(numels, d, n, self.costs) if self.auto_transport else \
                {k: state.communication for k in numels}
            times[c] = max(0.0, step_s - modelled + plan_seconds(numels, plan_c, d, n, self.costs))
        new = choose_ratio(state.ratio, times, gain, self.weight)
        if new == state.ratio:
            return None
        self._record(step, new, f"ratio {state.ratio:g} -> {new:g} (gain {gain[state.ratio]:.3f} -> "
                                f"{gain[new]:.3f}, step {times[state.ratio] * 1e3:.1f} -> {times[new] * 1e3:.1f} ms)")
        if self.auto_transport:
            self.plan = plan_transports(numels, state.density_with(new, step + 2), n, self.costs)
        self.calibration = None
        return step + 2, new

    def _record(self, step, ratio, reason):
        counts = {m: sum(1 for v in self.plan.values() if v == m) for m in MODES} if self.auto_transport else {}
        self.history.append((step, ratio, counts, reason))
        if mpi_ops.rank() == 0:
            log.info("hvd_topk auto at step %d: ratio %g, transports %s (%s); alpha %.3g s, beta %.3g s/B",
                     step, ratio, counts, reason, self.costs.alpha, self.costs.beta)

    @staticmethod
    def _time_compression(state):
        """This rank's (s per element of a top-k selection, s per element of one pass), from a
        tensor as large as the largest compressed one (capped at 4M elements)."""
        n = min(max(state.sparse_numels.values(), default=1 << 16), 1 << 22)
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        k = k_for(n, state.ratio)
        sel, sweep = [], []
        for _ in range(3):
            t0 = state.clock()
            topk_indices(x, k)
            t1 = state.clock()
            x.add_(x, alpha=0.0)
            sweep.append(state.clock() - t1)
            sel.append(t1 - t0)
        return [statistics.median(sel) / n, statistics.median(sweep) / n]

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self):
        return {"plan": dict(self.plan), "costs": None if self.costs is None else tuple(self.costs),
                "history": list(self.history)}

    def load_state_dict(self, state):
        self.plan = dict(state["plan"])
        self.costs = None if state["costs"] is None else Costs(*state["costs"])
        self.history = list(state["history"])
