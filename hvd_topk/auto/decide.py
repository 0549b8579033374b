"""The collective steps of ``hvd_topk.auto.tuner.AutoTuner``: the probe and the choice of transports, a
step of the trial, the periodic check. Every rank runs each at the same step; each has the ranks agree
on their measurements, then applies pure decisions to the tuner's attributes (docs/auto.md).
"""
import logging

from . import recheck, trial as trials
from .measure import lowrank_sizes, time_compression
from .plans import (HIERARCHICAL, Costs, HostLink, fitted_link, plan_counts, plan_seconds, plan_transports, trial_plans,
                    uniform_plan)
from .probe import Probe
from .quality import plan_gain, quality_from_row, quality_row
from .recheck import choose_ratio
from ..transports.host_sets import release

__all__ = ["CollectiveSteps", "HostSetsRelease", "PROBE_REPEATS", "probe_hosts"]

log = logging.getLogger("hvd_topk")

# The probe's timed calls per message size (the median is kept): 3 is enough for the model's choice,
# which the trial then checks by measurement, and keeps the probe short (it runs again on drift).
PROBE_REPEATS = 3


def probe_hosts(sets, repeats=PROBE_REPEATS):
    """(the ``HostLink`` of a job across equal hosts, the seconds its two probes took on rank 0): α and β
    over every host's set at once (``hvd_topk.transports.host_sets.HostSets``), then over every cross
    set at once, as hierarchical's phases run (so the cross β is per rank while every position of a
    host shares the host's link). Collective."""
    host = Probe(repeats=repeats, name="hvd_topk.probe.host", process_set=sets.host).run()
    cross = Probe(repeats=repeats, name="hvd_topk.probe.cross", process_set=sets.cross).run()
    return HostLink(sets.hosts, sets.per_host, host.alpha, host.beta, cross.alpha, cross.beta), \
        host.wall_s + cross.wall_s


class CollectiveSteps:
    """``AutoTuner``'s collective steps (every rank calls them at the same step): each has the ranks
    agree on their measurements (``self.world.agree``) or probes, then applies the pure decisions of
    ``hvd_topk.auto.plans``, ``hvd_topk.auto.trial``, ``hvd_topk.auto.recheck`` and ``hvd_topk.auto.quality``
    to the tuner's attributes."""

    def _numels(self, state):
        """name -> elements of the tensors auto chooses for: the compressed ones no pin holds."""
        pinned = getattr(state, "pin", None) or {}
        return {k: v for k, v in state.sparse_numels.items() if k not in pinned}

    def _sizes(self, numels):
        """name -> (n, m, r) of ``numels``' tensors low rank may send; None where it is no candidate."""
        return None if self.lowrank is None else lowrank_sizes(self.lowrank, numels)

    def _agree_quality(self, names, extra=(), name="hvd_topk.auto.quality"):
        """The ranks agree on ``extra`` and this rank's quality sums (where low rank is a candidate) in one
        allreduce; the figures they give join ``self.quality``. Returns the agreed ``extra``."""
        row = list(extra) + (quality_row(self.quality_sums, names) if self.lowrank is not None else [])
        agreed = self.world.agree(row, name) if row else []
        if self.lowrank is not None:
            self.quality = dict(self.quality, **quality_from_row(agreed[len(extra):], names))
        return agreed[:len(extra)]

    def _plans(self, numels, density, n, fixed_s=0.0):
        """(the model's plan, the plans worth a trial: ``trial_plans``) at ``density``, quality weighed."""
        figures = dict(lowrank=self._sizes(numels), quality=self.quality, weight=self.weight if self.quality else 0.0)
        return plan_transports(numels, density, n, self.costs, **figures), \
            trial_plans(numels, density, n, self.costs, fixed_s=fixed_s, **figures)

    def _probe(self, state, step, reason, fixed_s=0.0):
        """Probe alpha and beta, time the compression, agree on ``fixed_s`` (the last step's seconds outside
        communication) and choose the transports (a trial of plans when the model is not sure)."""
        res = self.probe.run()
        alpha, beta, kept = fitted_link(res.alpha, res.beta, self.costs)
        if kept:
            reason += ", re-probe without a bandwidth term: last alpha/beta kept"
        numels = self._numels(state)
        select_s, pass_s, matmul_s, fp16_s, fixed_s = self._agree_quality(
            sorted(numels), time_compression(state.sparse_numels, state.ratio, state.clock) + [max(0.0, fixed_s)],
            "hvd_topk.auto.costs")
        self.quality_sums = {}
        link, hosts_s = (None, 0.0) if self.hosts is None else probe_hosts(self.hosts, PROBE_REPEATS)
        reason += f", probe {res.wall_s + hosts_s:.1f} s, {fixed_s * 1e3:.0f} ms/step outside communication"
        self.costs = Costs(alpha, beta, select_s, pass_s, link, matmul_s, state.transports["split_reduce"].budget,
                           fp16_s)
        self.calibration, self.last_probe_check = None, step
        if not self.auto_transport:
            self._record(step, state.ratio, reason)
            return
        self.plan, arms = self._plans(numels, state.density(step + 1), self.world.size(), fixed_s)
        # A re-probe answers a change of the network; a plan that lost a trial by its quality (its G)
        # would lose again, and its turns would train with it: it stays out (the model's plan stays in).
        arms = arms[:1] + [arm for arm in arms[1:] if arm not in self.out_by_quality]
        self.trial = None
        if len(arms) > 1:                               # the model is not sure enough: measure
            self.start_trial(arms)
        self._record(step, state.ratio, reason + (f", trial of {len(arms)} plans" if self.trial else ""))

    def _trial_step(self, state, step):
        """One step of the trial is over: next turn, next round, and after a round the agreed verdict."""
        if not trials.turn_over(self.trial, self.trial_steps):
            return
        trial, round_over = trials.end_turn(self.trial)
        if round_over:
            agreed = self._agree_quality(sorted(self._numels(state)), trial.round_means, "hvd_topk.auto.trial") \
                if trials.counts_round(trial) else None
            gains = [plan_gain(arm, self.quality) for arm in trial.arms] if self.quality else None
            scales = None if gains is None else [1 / gain ** self.weight for gain in gains]
            trial, kept = trials.end_round(trial, agreed, self.trial_rounds, self.trial_max_rounds, self.trial_margin,
                                           scales)
            if kept is not None:
                self.out_by_quality += [dict(trial.arms[a]) for a in trial.out_by_quality
                                        if trial.arms[a] not in self.out_by_quality]
                self.trial, self.plan = None, dict(trial.arms[kept])
                self.calibration = None                    # measured against the plan now in effect
                self._record(step, state.ratio, trials.summary(trial, kept, gains))
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
        numels, n, density = self._numels(state), self.world.size(), state.density(step + 1)
        fixed = None if self.auto_transport else state.communication
        plan = self.plan if fixed is None else uniform_plan(numels, fixed)
        modelled = plan_seconds(numels, plan, density, n, self.costs, lowrank=self._sizes(numels))
        drift = recheck.drift_check(comm_s, modelled, self.calibration, self.drift_sign, self.threshold,
                                    recheck.probe_is_old(step, self.last_probe_check, self.every))
        self.calibration, self.drift_sign = drift.calibration, drift.sign
        if drift.reprobe:
            self._probe(state, step, reason=f"drift x{drift.ratio:.2f} at two checks", fixed_s=step_s - comm_s)
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
            self.plan = self._plans(numels, state.density_with(new, at), n)[0]
        self.calibration = None
        return at, new

    def _record(self, step, ratio, reason):
        counts = plan_counts(self.plan, self.transports()) if self.auto_transport else {}
        self.history.append((step, ratio, counts, reason))
        if self.world.rank() == 0:
            log.info("hvd_topk auto at step %d: ratio %g, transports %s (%s); alpha %.3g s, beta %.3g s/B",
                     step, ratio, counts, reason, self.costs.alpha, self.costs.beta)


class HostSetsRelease:
    """``AutoTuner``'s letting go of the hosts' process sets, a collective step of its own (``end_step``
    calls it on every rank at every step while it holds them)."""

    def _let_the_host_sets_go(self, state, step):
        """Across hosts, once no plan in effect, on trial or pinned holds hierarchical: remove the hosts'
        process sets where ``host_sets.release`` can (it added them; nothing else holds them): with them,
        Horovod's own allreduce of a model's tensors took twice as long across emulated hosts
        (``hvd_topk.transports.host_sets``). Hierarchical is then no candidate of later probes. The
        history's entry of this step says so."""
        plans = [self.plan, getattr(state, "pin", None) or {}] + (self.trial.arms if self.trial is not None else [])
        if any(HIERARCHICAL in plan.values() for plan in plans) or not release(self.hosts):
            return
        self.hosts = None
        note = "the hosts' process sets removed: no plan holds hierarchical"
        if self.history and self.history[-1][0] == step:      # the decision of this step: one entry
            self.history[-1] = self.history[-1][:3] + (f"{self.history[-1][3]}; {note}",)
        else:
            self._record(step, state.ratio, note)
