"""``communication='auto'`` and the adaptive ratio of ``hvd_topk.DistributedOptimizer`` (docs/auto.md).

``AutoTuner`` is the shell around pure decisions: it records this rank's step and communication times
and accumulator energies, has the ranks agree on them (``HorovodWorld.agree``: averaged over the ranks, then
rank 0's copy broadcast) and runs the probe; those are its only collectives. Every decision is taken
from agreed numbers by the pure functions of

- ``hvd_topk.auto.plans``: the modelled seconds of each transport and the plans they give,
- ``hvd_topk.auto.trial``: the measured trial of plans (turns, rounds, verdict),
- ``hvd_topk.auto.recheck``: the periodic check (re-probe on drift, the adaptive ratio),
- ``hvd_topk.auto.quality``: what each compressor sends of a tensor's gradient at once,

applied by its collective steps (``hvd_topk.auto.decide``), so every rank takes the same decision at the
same step even when their clocks disagree.

**Transport per tensor (communication='auto').** After the first timed step (the second, or the last
dense step) the ranks probe α and β (``hvd_topk.auto.probe``) and time the compression work of this
machine (σ, π of ``hvd_topk.auto.plans``); the model's plan, and every uniform plan modelled within 4x of
it in communication or within 1.5x in whole steps (that step's time outside communication added), are
then measured in turns (``hvd_topk.auto.trial``) and the fastest is kept (dense, then dense in fp16, on
a tie within the margin). In a job across equal hosts whose process sets Horovod has
(``hvd_topk.transports.host_sets``), the probe also measures the link within the hosts and the link
between them, and hierarchical is one more transport to model and to try (``hvd_topk.auto.plans``).
Where the optimizer offers low rank (``lowrank``), it is one more too, and each tensor's choice weighs a
quality figure against time: the fraction of its accumulator's energy each compressor sends at once,
sampled at the probe's step and at the first step of every round of the trial (``hvd_topk.auto.quality``).

**Re-deciding.** Every ``every`` steps the ranks agree on the window's step and communication times
and the compression gains; a drift of the communication time from the model at two checks in a row
re-runs the probe and the transport choice (without the plans a trial dropped by their quality), and
the ratio moves to the candidate of least J(c) = T(c) / G(c) ** weight when that improves J by more
than 5% (``hvd_topk.auto.recheck``).
"""
import math
import time

from horovod.torch import mpi_ops

from . import trial as trials
from .decide import PROBE_REPEATS, CollectiveSteps, HostSetsRelease
from .measure import HorovodWorld, sample_quality
from .plans import costs_from_data, costs_to_data, link_figures, plan_counts, transports_of
from .probe import Probe
from .quality import add_sample
from .recheck import DEFAULT_WEIGHT, candidate_ratios
from .trial import TRIAL_MARGIN
from ..core.sparsify import k_for, sq_norm64, topk_energies
from ..core.validate import check_int, check_number

__all__ = ["AutoTuner", "tuner_for"]


class _Checkpoints:
    """``AutoTuner``'s checkpoints: what it agreed and measured so far, as plain data."""

    # what a checkpoint holds besides plan, costs, history, trial and quality (plain data)
    _CHECKPOINTED = ("calibration", "last_probe_check", "drift_sign", "step_times", "comm_times", "gain_sums")

    def state_dict(self):
        """Everything agreed and measured so far, a trial under way included, as plain data."""
        state = {"plan": dict(self.plan), "costs": costs_to_data(self.costs), "history": list(self.history),
                 "trial": trials.to_dict(self.trial), "quality": {k: dict(v) for k, v in self.quality.items()},
                 "quality_sums": {k: dict(v) for k, v in self.quality_sums.items()},
                 "out_by_quality": [dict(plan) for plan in self.out_by_quality]}
        for key in self._CHECKPOINTED:
            value = getattr(self, key)
            state[key] = list(value) if isinstance(value, list) else value
        return state

    def load_state_dict(self, state):
        """Continue from ``state_dict()``; an older checkpoint (plan, costs, history) restores those."""
        self.plan = dict(state["plan"])
        self.costs = costs_from_data(state["costs"])
        self.history = list(state["history"])
        self.quality = {k: dict(v) for k, v in state.get("quality", {}).items()}
        self.quality_sums = {k: dict(v) for k, v in state.get("quality_sums", {}).items()}
        self.out_by_quality = [dict(plan) for plan in state.get("out_by_quality", [])]
        if "trial" in state:
            self.trial = trials.from_dict(state["trial"])
            for key in self._CHECKPOINTED:
                value = state[key]
                setattr(self, key, list(value) if isinstance(value, list) else value)


class _Samples:
    """What ``AutoTuner`` samples of the accumulators (the adaptive ratio's gains, the quality figures),
    and the seconds it spent on it this step: not the transports' time, so ``end_step`` takes them out."""

    sample_s = 0.0                    # this step's seconds in observe_acc

    def samples_quality(self, step):
        """Whether this step's accumulators are sampled for the quality figures (low rank offered): the
        first probe's step, and the first step of every round of a trial (not timed). Once a round, not
        once a turn: the gradient does not depend on the plan whose turn it is, and a sample of the
        embedding model's 2M-entry table took 80-140 ms of a 40 ms step on a busy host."""
        if self.lowrank is None or not self.auto_transport:
            return False
        if self.costs is None:
            return step >= self.first_step
        return self.trial is not None and not self.trial.turn_times and not self.trial.round_means

    def wants_gains(self, step):
        """Whether this step's accumulators feed the gain estimate (the step before a check) or the
        quality figures (``samples_quality``)."""
        return self.ratios is not None and step >= 1 and (step + 1) % self.every == 0 or self.samples_quality(step)

    def observe_acc(self, acc, key=None, k=None, grad=None):
        """Where low rank is offered, add the gradient ``grad`` of ``key`` (Top-K sends ``k`` entries) to
        this rank's quality sums; else one accumulator's top-k energies for every candidate ratio (never
        both: the adaptive ratio leaves low rank out). The quality is the fresh gradient's: an
        accumulator's residual is what the plans of the last steps left, so a trial would measure its arms.
        Its seconds add to ``sample_s``."""
        start = time.perf_counter()
        self._observe(acc, key, k, grad)
        self.sample_s += time.perf_counter() - start

    def _observe(self, acc, key, k, grad):
        if self.lowrank is not None:            # in the norm of the update (Adam's: update_weights)
            g = grad.reshape(-1)
            weight = self.update_weights and self.update_weights(key, g)
            self.quality_sums = add_sample(self.quality_sums, key, *sample_quality(g, key, k, self.lowrank, weight))
            return
        energies = topk_energies(acc, [k_for(acc.numel(), c) for c in self.ratios])
        row = energies + [sq_norm64(acc)]
        self.gain_sums = row if self.gain_sums is None else [a + b for a, b in zip(self.gain_sums, row)]


class AutoTuner(CollectiveSteps, HostSetsRelease, _Checkpoints, _Samples):
    """Per-optimizer state of the automatic decisions (identical on every rank).

    Args:
        auto_transport: choose the transport of every compressed tensor (communication='auto').
        ratios: candidate ratios for the adaptive ratio, descending; None: fixed ratio.
        weight: exponent of the gain in J (the adaptive ratio's, and the quality's where low rank is offered).
        every: steps between checks (ratio, drift), >= 2.
        trial_steps: steps of one plan in a row during the trial of plans (the first is not counted), >= 2.
        trial_rounds: the fewest rounds of the trial (the first is not counted), >= 3.
        trial_max_rounds: the most rounds of the trial, >= trial_rounds.
        trial_margin: the difference in step time the trial resolves: a plan within it of the fastest is
            as good (the all-dense plan within it is kept: exact; a smaller lead is a busy host's noise).
        threshold: relative drift of communication time that triggers a new probe.
        probe: a ``hvd_topk.auto.probe.Probe`` (default ``Probe(repeats=3)``).
    """

    def __init__(self, auto_transport, ratios, weight=DEFAULT_WEIGHT, every=50, trial_steps=4, trial_rounds=5,
                 threshold=0.5, probe=None, trial_margin=TRIAL_MARGIN, trial_max_rounds=10):
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
        self.probe, self.world = probe or Probe(repeats=PROBE_REPEATS), HorovodWorld()
        self.hosts, self.lowrank = None, None    # HostSets across equal hosts, the optimizer's LowRank: candidates
        self.update_weights = None        # (key, grad) -> Adam's factor per entry, or None (adam_weights)
        self.first_step = 0               # the last dense step: quality sampled from it on (probe: >= 1)
        self.start = "dense"              # the transport before the first decision (the optimizer's: see mode)
        # agreed measurements
        self.costs = None                 # Costs, after the first probe
        self.calibration = None           # measured / modelled communication at the first check after a probe
        self.last_probe_check = -math.inf
        self.drift_sign = 0               # +1/-1: the last check drifted up/down beyond threshold; 0: not
        self.quality = {}                 # name -> hvd_topk.auto.quality's FIELDS, agreed (low rank offered)
        # decisions
        self.plan = {}                    # name -> transport, in effect now (auto_transport)
        self.trial = None                 # trial.Trial under way, or None
        self.out_by_quality = []          # plans a trial dropped by their quality: no later trial has them
        self.history = []                 # (step, ratio, {transport: count}, reason), identical on all ranks
        # this rank's measurements of the current window
        self.step_times, self.comm_times = [], []
        self.gain_sums = None             # [energy of each candidate ..., ||acc||^2] of one step
        self.quality_sums = {}            # name -> FIELDS, this rank's samples since the last agreement

    # -- what the optimizer asks ------------------------------------------------------------------

    def mode(self, name, fixed):
        """Transport of ``name`` this step (``fixed`` when transports are not chosen automatically)."""
        if not self.auto_transport:
            return fixed
        # before the first decision the compression's own: dense would send the whole model once
        return self.start if self.costs is None else self.plan.get(name, "dense")

    def figures(self):
        """``opt.stats()``'s share: the probed costs; with communication='auto', tensors per transport."""
        if self.costs is None:
            return {}
        counts = plan_counts(self.plan, self.transports()) if self.auto_transport else {}
        return dict(alpha=self.costs.alpha, beta=self.costs.beta, **link_figures(self.costs),
                    **{f"auto_{m}": c for m, c in counts.items()})

    def transports(self):
        """The transports a plan chooses from (``hvd_topk.auto.plans.transports_of``)."""
        return transports_of(self.costs, self.lowrank is not None)

    # -- after each step (collective: every rank calls it at the same step) ------------------------

    def end_step(self, state, step, step_s, comm_s):
        """Record this rank's times of ``step``, less its seconds of sampling (``sample_s``: at step 1, a
        quality sample of the embedding model took 4-6x the rest of the step outside communication, and
        the whole-step rule would have tried dense plans there); decide at the scheduled steps. Returns
        a ratio change (effective_step, ratio) or None."""
        step_s, self.sample_s = max(comm_s, step_s - self.sample_s), 0.0
        if step >= 1:
            self.step_times.append(step_s)
            self.comm_times.append(comm_s)
            if self.trial is not None:
                self.trial = trials.record_step(self.trial, step_s)
        if self.costs is None:        # step 0 has no start to time it from: the probe (None) waits for step 1
            change = None if step == 0 else self._probe(state, step, reason="start", fixed_s=step_s - comm_s)
        elif self.trial is not None:
            change = self._trial_step(state, step)
        else:
            change = None if (step + 1) % self.every else self._check(state, step)
        if self.hosts is not None and self.costs is not None:     # every step: a resumed tuner lets go too
            self._let_the_host_sets_go(state, step)
        return change

    def start_trial(self, arms):
        """Measure ``arms`` (plans) in turns from the next step on (``hvd_topk.auto.trial``)."""
        self.trial = trials.new_trial(arms)
        self.plan = dict(arms[0])


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
