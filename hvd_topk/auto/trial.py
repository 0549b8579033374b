"""The measured trial of transport plans: its bookkeeping and its verdict.

Pure functions over a plain record (``Trial``); no Horovod, no torch. ``hvd_topk.auto`` records this
rank's step times into it, agrees with the other ranks on each round's means (the one collective) and
applies the verdict (docs/auto.md).

The plans on trial (``hvd_topk.auto.plans.trial_plans``: the model's plan and every uniform plan modelled
within 4x of it) take turns, ``trial_steps`` steps at a time (A B C A B C ...: a slow spell of the host
falls on every plan, not on one). The first step of each turn and the whole first round (each
transport's first use: buffers allocated, index pipeline started; turns of 2 steps) are not counted.
After every round the ranks agree on each plan's mean counted step of that round; from round
``trial_rounds`` on, with R counted rounds, each plan is compared with the fastest so far through the
paired differences d of their rounds (relative to the fastest's mean; t = Student's t quantile 0.975
with R - 1 degrees of freedom, m = ``trial_margin``, 5% by default)::

    mean(d) - t * sd(d) / sqrt(R) > m      the plan is slower by more than m: it leaves the trial
    mean(d) + m > t * sd(d) / sqrt(R)      the plan is not faster than the fastest by more than m

and the trial ends when the second holds for every plan left (or after ``trial_max_rounds`` rounds).
So a clear gap ends it in a few rounds, and two plans within the noise of each other take turns until
either is shown to be within m of the other. Before that, from the second counted round on, a plan
whose mean is more than ``CLEAR_GAP`` times the fastest's in every counted round so far leaves at once
(a gap beyond any turn's noise seen), and the trial ends when one plan is left. Where low rank is a
candidate, each plan's means are its J = step time / G^w (``scales``: 1 / G^w per plan,
``hvd_topk.auto.quality``), so a plan that sends less of the gradient at once must be faster by as much
to win; and from the first counted round on, a plan leaves whose J would be more than ``CLEAR_GAP``
times the best J of the round even at the fastest step any plan took in it (``quality_gaps``): its
handicap is its sampled G, not the timing's noise. The fastest is kept, unless the all-dense plan, or
else the all-dense_fp16 plan, is within m of it: a smaller lead is noise on a busy host, and dense is
exact (dense in fp16 sends every entry each step, its rounding a step later). (The model's plan gets no
such preference: it charges α per tensor, while Horovod fuses the tensors of a cycle and AR-Topk
shares every index set in one allgather per step.)
"""
import dataclasses
import math
import statistics
from typing import List, NamedTuple, Optional

from .plans import DENSE_TRANSPORTS, plan_name

__all__ = ["TRIAL_MARGIN", "Trial", "Verdict", "new_trial", "on_turn", "record_step", "turn_over", "end_turn",
           "counts_round", "end_round", "verdict", "clear_gaps", "quality_gaps", "summary", "to_dict", "from_dict"]

# A plan within this fraction of the fastest is as good; a lead over dense smaller than this is within
# the noise of a busy host (dense is then kept: exact).
TRIAL_MARGIN = 0.05
# Student's t, quantile 0.975, by degrees of freedom (beyond the table: 30's): how many standard errors
# of the mean of a few paired differences make a confident difference (``verdict``).
T975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
        2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)
# A plan more than this many times slower (in J) than the fastest in each of at least CLEAR_ROUNDS
# counted rounds leaves before the t-test could speak: turn means moved by up to 37% between rounds on
# the 2-core host, so a 1.5x gap twice over is no slow spell; and plans that send a third of low rank's
# energy at once (Top-K on dense gradients) were trained with for 4 counted rounds before leaving.
CLEAR_GAP = 1.5
CLEAR_ROUNDS = 2
# Steps of a turn that are not counted: the first one carries the switch from the previous plan.
_TURN_WARMUP = 1
# Rounds that are not counted: the first one is each transport's first use.
_WARMUP_ROUNDS = 1
# Steps of a turn in those rounds: the first use, and one step after it (the index pipeline's first
# shared set, Horovod's cached names); more would only train with every plan on trial for longer.
_WARMUP_TURN_STEPS = 2


@dataclasses.dataclass
class Trial:
    """The plans on trial and what is known of them so far; plain data (``dataclasses.asdict``)."""
    arms: List[dict]                  # the plans (name -> transport); arms[0] the model's
    active: List[int]                 # indices of the plans still taking turns, in turn order
    means: List[List[float]]          # per plan: agreed mean counted step of each counted round
    rounds: int = 0                   # complete rounds
    turn_times: List[float] = dataclasses.field(default_factory=list)    # this rank's, turn under way
    round_means: List[float] = dataclasses.field(default_factory=list)   # this rank's, round under way
    out_by_quality: List[int] = dataclasses.field(default_factory=list)  # plans ``quality_gaps`` dropped


class Verdict(NamedTuple):
    """What the agreed means of a trial show (``verdict``)."""
    active: List[int]                 # the plans not shown slower than the fastest by more than the margin
    settled: bool                     # no plan left may be faster than the fastest by more than the margin
    kept: int                         # the plan to keep if the trial ends now (the dense tie rule applied)


def new_trial(arms):
    """A trial of ``arms`` (plans) before its first step."""
    return Trial(arms=[dict(a) for a in arms], active=list(range(len(arms))), means=[[] for _ in arms])


def on_turn(trial):
    """Index of the plan whose turn it is."""
    return trial.active[len(trial.round_means)]


def record_step(trial, step_s):
    """``trial`` with this rank's time of one more step of the turn under way."""
    return dataclasses.replace(trial, turn_times=trial.turn_times + [step_s])


def turn_over(trial, trial_steps):
    """Whether the turn under way has its ``trial_steps`` steps (``_WARMUP_TURN_STEPS`` in a round not
    counted)."""
    return len(trial.turn_times) >= (trial_steps if trial.rounds >= _WARMUP_ROUNDS else _WARMUP_TURN_STEPS)


def end_turn(trial):
    """(trial, round_over): the finished turn's counted mean joins the round; the next plan's turn."""
    round_means = trial.round_means + [statistics.fmean(trial.turn_times[_TURN_WARMUP:])]
    return dataclasses.replace(trial, turn_times=[], round_means=round_means), \
        len(round_means) >= len(trial.active)


def counts_round(trial):
    """Whether the round now over is counted (then the ranks agree on its ``round_means``)."""
    return trial.rounds >= _WARMUP_ROUNDS


def end_round(trial, agreed, trial_rounds, max_rounds, margin=TRIAL_MARGIN, scales=None):
    """(trial, kept) after a round: ``agreed`` (the ranks' agreed ``round_means``, None for the round
    not counted) joins the means; from round ``trial_rounds`` on, the plans shown slower leave, and
    ``kept`` is the plan to keep when the trial is over (settled, or ``max_rounds`` rounds), else None.
    ``scales``: a factor per plan that its means are compared by (J per second), or None: 1."""
    means = [list(m) for m in trial.means]
    if agreed is not None:
        for a, m in zip(trial.active, agreed):
            means[a].append(m)
    trial = dataclasses.replace(trial, rounds=trial.rounds + 1, means=means, round_means=[])
    means = trial.means if scales is None else [[x * scale for x in m] for m, scale in zip(trial.means, scales)]
    if agreed is not None:
        active = clear_gaps(means, trial.active)
        kept = active if scales is None else quality_gaps(trial.means, scales, active)
        trial = dataclasses.replace(trial, active=kept,
                                    out_by_quality=trial.out_by_quality + [a for a in active if a not in kept])
        if len(trial.active) == 1:
            return trial, trial.active[0]
    if trial.rounds < trial_rounds:
        return trial, None
    v = verdict(trial.arms, means, trial.active, margin)
    trial = dataclasses.replace(trial, active=v.active)
    return trial, (v.kept if v.settled or trial.rounds >= max_rounds else None)


def verdict(arms, means, active, margin=TRIAL_MARGIN):
    """The module docstring's rule on the agreed ``means`` (per plan, per counted round) of the plans
    ``active``; every plan active has at least one mean."""
    best = min(active, key=lambda a: (statistics.fmean(means[a]), a))
    ref = statistics.fmean(means[best])
    active, settled = list(active), True
    for a in list(active):
        if a == best:
            continue
        d = [(x - y) / ref for x, y in zip(means[a], means[best])]
        if len(d) < 2:
            settled = False
            continue
        tse = T975[min(len(d) - 1, len(T975)) - 1] * statistics.stdev(d) / math.sqrt(len(d))
        if statistics.fmean(d) - tse > margin:
            active.remove(a)               # slower by more than the margin: out
        elif statistics.fmean(d) + margin <= tse:
            settled = False                # may still be the faster one
    return Verdict(active, settled, _dense_tie(arms, means, active, best, margin))


def clear_gaps(means, active, gap=CLEAR_GAP, rounds=CLEAR_ROUNDS):
    """``active`` without the plans whose mean was more than ``gap`` times the fastest plan's in every
    one of at least ``rounds`` counted rounds (``means``: per plan, per counted round, comparable).

    Example:
        >>> clear_gaps([[1.0, 1.1], [2.0, 1.7], [2.0, 1.2]], [0, 1, 2])     # 2: not in every round
        [0, 2]
        >>> clear_gaps([[1.0], [2.0]], [0, 1])         # one counted round: a spell of the host, maybe
        [0, 1]
    """
    if not active or len(means[active[0]]) < rounds:
        return list(active)
    best = min(active, key=lambda a: (statistics.fmean(means[a]), a))
    return [a for a in active if a == best or not all(x > gap * y for x, y in zip(means[a], means[best]))]


def quality_gaps(means, scales, active, gap=CLEAR_GAP):
    """``active`` without the plans that lose by their quality alone: whose J would be more than ``gap``
    times the best J of the last counted round even at the fastest step any plan took in that round
    (``means``: per plan, per counted round, in seconds; ``scales``: 1 / G^w per plan). One round is
    enough: the handicap is the plan's sampled G, which a turn's timing noise does not move (across 2
    emulated hosts the Top-K plans, G 0.41 against low rank's 0.96, had trained for 2 counted rounds).

    Example:
        >>> quality_gaps([[0.21], [0.18]], [1.04, 2.44], [0, 1])    # G 0.96 and 0.41 at w = 1: out
        [0]
        >>> quality_gaps([[0.21], [0.18]], [1.04, 1.32], [0, 1])    # G 0.76: it may yet win
        [0, 1]
    """
    if not active or not means[active[0]]:
        return list(active)
    fastest = min(means[a][-1] for a in active)
    best = min(means[a][-1] * scales[a] for a in active)
    return [a for a in active if fastest * scales[a] <= gap * best]


def _dense_tie(arms, means, active, best, margin):
    """``best``, or the all-dense plan, else the all-dense_fp16 plan, when it is still active and within
    ``margin`` of ``best``."""
    for transport in DENSE_TRANSPORTS:
        dense = [a for a in active if set(arms[a].values()) == {transport}]
        if dense and statistics.fmean(means[dense[0]]) <= (1 + margin) * statistics.fmean(means[best]):
            return dense[0]
    return best


def summary(trial, kept, gains=None):
    """The history's line of a finished trial: each plan's mean step (and its G, ``gains`` per plan, where
    quality weighed the comparison: the step alone does not say why a slower plan was kept), and the
    plan kept."""
    means = [statistics.fmean(x) for x in trial.means]
    return f"trial, {trial.rounds - _WARMUP_ROUNDS} counted rounds: " + ", ".join(
        f"{plan_name(arm)} {means[a] * 1e3:.1f} ms/step" + ("" if gains is None else f" at G {gains[a]:.2f}")
        + ("" if a in trial.active else f" (out after {len(trial.means[a])})")
        for a, arm in enumerate(trial.arms)) + f"; kept {plan_name(trial.arms[kept])}"


def to_dict(trial: Optional[Trial]):
    """Plain data of ``trial`` (None stays None), for a checkpoint."""
    return None if trial is None else dataclasses.asdict(trial)


def from_dict(data):
    """The ``Trial`` of ``to_dict``'s data (None stays None)."""
    return None if data is None else Trial(**{k: _copy(v) for k, v in data.items()})


def _copy(value):
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return dict(value) if isinstance(value, dict) else value
