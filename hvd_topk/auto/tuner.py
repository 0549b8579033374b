"""``communication='auto'`` and the adaptive ratio of ``hvd_topk.DistributedOptimizer`` (docs/auto.md).

``AutoTuner`` is the shell around pure decisions: it records this rank's step and communication times
and accumulator energies, has the ranks agree on them (``HorovodWorld.agree``: averaged over the ranks, then
rank 0's copy broadcast) and runs the probe; those are its only collectives. Every decision is taken
from agreed numbers by the pure functions of

- ``hvd_topk.auto.plans``: the modelled seconds of each transport and the plans they give,
- ``hvd_topk.auto.trial``: the measured trial of plans (turns, rounds, verdict),
- ``hvd_topk.auto.recheck``: the periodic check (re-probe on drift, the adaptive ratio),

so every rank takes the same decision at the same step even when their clocks disagree.

**Transport per tensor (communication='auto').** After the first step the ranks probe α and β
(``hvd_topk.auto.probe``) and time the compression work of this machine (σ, π of ``hvd_topk.auto.plans``); the
model's plan, and every uniform plan modelled within 4x of it, are then measured in turns
(``hvd_topk.auto.trial``) and the fastest is kept (dense on a tie within the margin). In a job across
equal hosts whose process sets Horovod has (``hvd_topk.transports.host_sets``), the probe also measures
the link within the hosts and the link between them, and hierarchical is one more transport to model
and to try (``hvd_topk.auto.plans``).

**Re-deciding.** Every ``every`` steps the ranks agree on the window's step and communication times
and the compression gains; a drift of the communication time from the model at two checks in a row
re-runs the probe and the transport choice, and the ratio moves to the candidate of least
J(c) = T(c) / G(c) ** weight when that improves J by more than 5% (``hvd_topk.auto.recheck``).
"""
import logging
import math

import torch
from horovod.torch import mpi_ops

from . import recheck, trial as trials
from .measure import HorovodWorld, time_compression
from .plans import (Costs, costs_from_data, costs_to_data, fitted_link, link_figures, plan_counts, plan_seconds,
                    plan_transports, transports_of, trial_plans, uniform_plan)
from .probe import Probe, probe_hosts
from .recheck import DEFAULT_WEIGHT, candidate_ratios, choose_ratio
from .trial import TRIAL_MARGIN
from ..core.sparsify import k_for, topk_energies
from ..core.validate import check_int, check_number

__all__ = ["AutoTuner", "tuner_for"]

log = logging.getLogger("hvd_topk")

# The probe's timed calls per message size (the median is kept): 3 is enough for the model's choice,
# which the trial then checks by measurement, and keeps the probe short (it runs again on drift).
_PROBE_REPEATS = 3


class _CollectiveSteps:
    """``AutoTuner``'s collective steps (every rank calls them at the same step): each has the ranks
    agree on their measurements (``self.world.agree``) or probes, then applies the pure decisions of
    ``hvd_topk.auto.plans``, ``hvd_topk.auto.trial`` and ``hvd_topk.auto.recheck`` to the tuner's attributes."""

    def _probe(self, state, step, reason):
        """Probe alpha and beta, time the compression, and choose the transports (a trial of plans when
        the model is not sure)."""
        res = self.probe.run()
        alpha, beta, kept = fitted_link(res.alpha, res.beta, self.costs)
        if kept:
            reason += ", re-probe without a bandwidth term: last alpha/beta kept"
        select_s, pass_s = self.world.agree(time_compression(state.sparse_numels, state.ratio, state.clock),
                                            "hvd_topk.auto.costs")
        link = None if self.hosts is None else probe_hosts(self.hosts, _PROBE_REPEATS)
        self.costs = Costs(alpha, beta, select_s, pass_s, link)
        self.calibration = None
        self.last_probe_check = step
        if not self.auto_transport:
            self._record(step, state.ratio, reason)
            return
        numels, density, n = state.sparse_numels, state.density(step + 1), self.world.size()
        self.plan, self.trial = plan_transports(numels, density, n, self.costs), None
        arms = trial_plans(numels, density, n, self.costs)
        if len(arms) > 1:                               # the model is not sure enough: measure
            self.start_trial(arms)
        self._record(step, state.ratio, reason + (f", trial of {len(arms)} plans" if self.trial else ""))

    def _trial_step(self, state, step):
        """One step of the trial is over: next turn, next round, and after a round the agreed verdict."""
        if not trials.turn_over(self.trial, self.trial_steps):
            return
        trial, round_over = trials.end_turn(self.trial)
        if round_over:
            agreed = self.world.agree(trial.round_means, "hvd_topk.auto.trial") if trials.counts_round(trial) \
                else None
            trial, kept = trials.end_round(trial, agreed, self.trial_rounds, self.trial_max_rounds, self.trial_margin)
            if kept is not None:
                self.trial, self.plan = None, dict(trial.arms[kept])
                self.calibration = None                    # measured against the plan now in effect
                self._record(step, state.ratio, trials.summary(trial, kept))
                self.step_times, self.comm_times = [], []
                return
        self.trial, self.plan = trial, dict(trial.arms[trials.on_turn(trial)])

    def _check(self, state, step):
        """Agree on the window's measurements; re-probe on drift; move the ratio."""
        row = recheck.check_row(self.step_times, self.comm_times, self.gain_sums,
                                len(self.ratios) if self.ratios is not None else 0)
        self.gain_sums = None
        agreed = self.world.agree(row, "hvd_topk.auto.check")
        step_s, comm_s, gains = agreed[0], agreed[1], agreed[2:]
        self.step_times, self.comm_times = [], []
        numels, n, density = state.sparse_numels, self.world.size(), state.density(step + 1)
        fixed = None if self.auto_transport else state.communication
        plan = self.plan if fixed is None else uniform_plan(numels, fixed)
        modelled = plan_seconds(numels, plan, density, n, self.costs)
        drift = recheck.drift_check(comm_s, modelled, self.calibration, self.drift_sign, self.threshold,
                                    recheck.probe_is_old(step, self.last_probe_check, self.every))
        self.calibration, self.drift_sign = drift.calibration, drift.sign
        if drift.reprobe:
            self._probe(state, step, reason=f"drift x{drift.ratio:.2f} at two checks")
            return None
        gain = recheck.gain_fractions(self.ratios, gains)
        if gain is None:
            return None
        at = step + recheck.RATIO_DELAY
        densities = {c: state.density_with(c, at) for c in self.ratios}
        times = recheck.ratio_step_seconds(step_s, modelled, numels, densities, n, self.costs, fixed)
        new = choose_ratio(state.ratio, times, gain, self.weight)
        if new == state.ratio:
            return None
        self._record(step, new, recheck.ratio_reason(state.ratio, new, gain, times))
        if self.auto_transport:
            self.plan = plan_transports(numels, state.density_with(new, at), n, self.costs)
        self.calibration = None
        return at, new

    def _record(self, step, ratio, reason):
        counts = plan_counts(self.plan, transports_of(self.costs)) if self.auto_transport else {}
        self.history.append((step, ratio, counts, reason))
        if self.world.rank() == 0:
            log.info("hvd_topk auto at step %d: ratio %g, transports %s (%s); alpha %.3g s, beta %.3g s/B",
                     step, ratio, counts, reason, self.costs.alpha, self.costs.beta)


class AutoTuner(_CollectiveSteps):
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
            as good (the all-dense plan within it is kept: exact; a smaller lead is a busy host's noise).
        threshold: relative drift of communication time that triggers a new probe.
        probe: a ``hvd_topk.auto.probe.Probe`` (default ``Probe(repeats=3)``).
    """

    # what a checkpoint holds besides plan, costs, history and trial (plain data)
    _CHECKPOINTED = ("calibration", "last_probe_check", "drift_sign", "step_times", "comm_times", "gain_sums")

    def __init__(self, auto_transport, ratios, weight=DEFAULT_WEIGHT, every=50, trial_steps=4, trial_rounds=5,
                 threshold=0.5, probe=None, trial_margin=TRIAL_MARGIN, trial_max_rounds=21):
        for name, value, low in (("trial_steps", trial_steps, 2), ("trial_rounds", trial_rounds, 3),
                                 ("trial_max_rounds", trial_max_rounds, trial_rounds), ("every", every, 2)):
            check_int(name, value, low=low)
        check_number("weight", weight, low=0)
        check_number("threshold", threshold, low=0, low_open=True)
        check_number("trial_margin", trial_margin, low=0)
        # configuration
        self.auto_transport, self.ratios, self.weight = auto_transport, ratios, weight
        self.every, self.trial_steps, self.trial_rounds, self.threshold = every, trial_steps, trial_rounds, threshold
        self.trial_margin, self.trial_max_rounds = trial_margin, trial_max_rounds
        self.probe = probe or Probe(repeats=_PROBE_REPEATS)
        self.world = HorovodWorld()
        self.hosts = None                 # HostSets of a job across equal hosts: hierarchical is a candidate
        # agreed measurements
        self.costs = None                 # Costs, after the first probe
        self.calibration = None           # measured / modelled communication at the first check after a probe
        self.last_probe_check = -math.inf
        self.drift_sign = 0               # +1/-1: the last check drifted up/down beyond threshold; 0: not
        # decisions
        self.plan = {}                    # name -> transport, in effect now (auto_transport)
        self.trial = None                 # trial.Trial under way, or None
        self.history = []                 # (step, ratio, {transport: count}, reason), identical on all ranks
        # this rank's measurements of the current window
        self.step_times, self.comm_times = [], []
        self.gain_sums = None             # [energy of each candidate ..., ||acc||^2] of one step

    # -- what the optimizer asks ------------------------------------------------------------------

    def mode(self, name, fixed):
        """Transport of ``name`` this step (``fixed`` when transports are not chosen automatically)."""
        if not self.auto_transport:
            return fixed
        return self.plan.get(name, "dense")      # before the first decision: dense, exact

    def figures(self):
        """``opt.stats()``'s share: the probed costs; with communication='auto', tensors per transport."""
        if self.costs is None:
            return {}
        counts = plan_counts(self.plan, transports_of(self.costs)) if self.auto_transport else {}
        return dict(alpha=self.costs.alpha, beta=self.costs.beta, **link_figures(self.costs),
                    **{f"auto_{m}": c for m, c in counts.items()})

    def wants_gains(self, step):
        """Whether this step's accumulators feed the gain estimate (the step before a check)."""
        return self.ratios is not None and step >= 1 and (step + 1) % self.every == 0

    def observe_acc(self, acc):
        """Add one accumulator's top-k energies for every candidate ratio (this rank)."""
        energies = topk_energies(acc, [k_for(acc.numel(), c) for c in self.ratios])
        row = energies + [float(torch.dot(acc.double(), acc.double()))]
        self.gain_sums = row if self.gain_sums is None else [a + b for a, b in zip(self.gain_sums, row)]

    # -- after each step (collective: every rank calls it at the same step) ------------------------

    def end_step(self, state, step, step_s, comm_s):
        """Record this rank's times of ``step``; decide at the scheduled steps. Returns a ratio change
        (effective_step, ratio) or None."""
        if step >= 1:
            self.step_times.append(step_s)
            self.comm_times.append(comm_s)
            if self.trial is not None:
                self.trial = trials.record_step(self.trial, step_s)
        if self.costs is None:
            self._probe(state, step, reason="start")
            return None
        if self.trial is not None:
            self._trial_step(state, step)
            return None
        if (step + 1) % self.every:
            return None
        return self._check(state, step)

    def start_trial(self, arms):
        """Measure ``arms`` (plans) in turns from the next step on (``hvd_topk.auto.trial``)."""
        self.trial = trials.new_trial(arms)
        self.plan = dict(arms[0])

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self):
        """Everything agreed and measured so far, a trial under way included, as plain data."""
        state = {"plan": dict(self.plan), "costs": costs_to_data(self.costs),
                 "history": list(self.history), "trial": trials.to_dict(self.trial)}
        for key in self._CHECKPOINTED:
            value = getattr(self, key)
            state[key] = list(value) if isinstance(value, list) else value
        return state

    def load_state_dict(self, state):
        """Continue from ``state_dict()``; an older checkpoint (plan, costs, history) restores those."""
        self.plan = dict(state["plan"])
        self.costs = costs_from_data(state["costs"])
        self.history = list(state["history"])
        if "trial" in state:
            self.trial = trials.from_dict(state["trial"])
            for key in self._CHECKPOINTED:
                value = state[key]
                setattr(self, key, list(value) if isinstance(value, list) else value)


def tuner_for(communication, adaptive_ratio, ratio, weight, every, process_set):
    """The optimizer's ``AutoTuner``, or None without communication='auto' and adaptive_ratio.
    ValueError naming a bad argument (adaptive_ratio, adaptive_weight, auto_every, process_set)."""
    ratios = candidate_ratios(adaptive_ratio, ratio, communication)
    check_number("adaptive_weight", weight, low=0)
    check_int("auto_every", every, low=2)
    if communication != "auto" and ratios is None:
        return None
    if process_set is not mpi_ops.global_process_set:
        raise ValueError("communication='auto' and adaptive_ratio need the global process set (their probe "
                         "and decisions run over all ranks)")
    return AutoTuner(communication == "auto", ratios, weight=float(weight), every=int(every))
