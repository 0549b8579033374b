"""The periodic check's decisions: re-probe on drift, and the adaptive ratio.

Pure functions over plain numbers and dicts; no Horovod, no torch. Every ``every`` steps
``hvd_topk.auto`` has the ranks agree on this rank's ``check_row`` and applies what these functions
decide from the agreed numbers (docs/auto.md).

**Drift.** The measured communication time is compared with the model's prediction, scaled by the
calibration taken at the first check after the last probe or change of plan; a drift of more than
``threshold``, the same way at two checks in a row (one slow spell of a busy host is not a new
network), re-runs the probe and the transport choice (at most once per ``REPROBE_CHECKS`` checks).

**Adaptive ratio.** The ranks agree on (a) the mean measured step time T and (b) the compression gain
G(c) = ‖top-k_c(acc)‖² / ‖acc‖² of each candidate ratio c, computed from the accumulators of one step
(``sparsify.topk_energies``, one selection at the largest k). The step time of another ratio is
T(c) = T − comm(now) + comm(c), with the modelled communication and selection of
``hvd_topk.auto.plans``. The ratio minimises::

    J(c) = T(c) / G(c) ** weight          (weight 0.3 by default)

i.e. the time to deliver a unit of gradient energy, with the gain discounted by ``weight`` < 1
because error feedback delays what is not sent instead of losing it. The default is measured
(bench/results/adaptive/calibration.md, docs/studies/2026-11-adaptive-ratio.md): on the digits CNN the progress per step of ratio c
relative to dense, steps_dense / steps_c to a test loss, followed G(c) ** w with w from 0.18 (near
convergence) to 0.40 (early), 0.31 on average over four thresholds. weight = 1 trades time and
gain one for one (favours larger ratios); weight = 0 minimises step time alone (favours the smallest
ratio). The ratio moves only when J improves by more than ``HYSTERESIS``; a new ratio takes effect
``RATIO_DELAY`` steps later, so the AR-Topk index set prepared one step ahead already has the new size.
"""
import math
import numbers
import statistics
from typing import NamedTuple, Optional

from .plans import plan_seconds, plan_transports, uniform_plan

__all__ = ["DEFAULT_RATIOS", "DEFAULT_WEIGHT", "candidate_ratios",
           "HYSTERESIS", "REPROBE_CHECKS", "RATIO_DELAY", "Drift", "check_row",
           "probe_is_old", "drift_check", "gain_fractions", "ratio_step_seconds", "choose_ratio",
           "ratio_reason"]

DEFAULT_RATIOS = (0.1, 0.03, 0.01, 0.003, 0.001)    # the adaptive ratio's candidates (adaptive_ratio=True)
DEFAULT_WEIGHT = 0.3        # w of J(c); measured, see the module docstring
HYSTERESIS = 0.05           # J must improve by more than this to move the ratio (no flapping on noise)
REPROBE_CHECKS = 4          # at most one re-probe per this many checks: a probe costs about a step
RATIO_DELAY = 2             # steps until a new ratio takes effect: the index set of the next step exists
_LOG_FLOOR = 1e-12          # drift ratios are compared in log space; a measured 0 is clamped to this


class Drift(NamedTuple):
    """The drift rule's outcome at one check."""
    calibration: Optional[float]      # measured / modelled communication to compare against
    sign: int                         # +1/-1: this check drifted up/down beyond the threshold; 0: not
    reprobe: bool                     # the second check in a row the same way: probe again
    ratio: Optional[float]            # measured / modelled / calibration, None when not compared


def check_row(step_times, comm_times, gain_sums, n_ratios):
    """This rank's numbers for the check's agreement: [mean step s, mean communication s] + the gain
    sums ([energy of each of the ``n_ratios`` candidates ..., ||acc||^2]; zeros without gain data)."""
    width = n_ratios + (1 if n_ratios else 0)
    gains = gain_sums or []
    if len(gains) != width:
        gains = [0.0] * width                       # no compressed tensor this step: no gain data
    return [statistics.fmean(step_times or [0.0]), statistics.fmean(comm_times or [0.0])] + list(gains)


def probe_is_old(step, last_probe_check, every):
    """Whether the last probe lies ``REPROBE_CHECKS`` checks back, so that drift may re-probe."""
    return step - last_probe_check >= REPROBE_CHECKS * every


def drift_check(comm_s, modelled, calibration, last_sign, threshold, may_reprobe):
    """The drift rule (module docstring) at one check.

    Args:
        comm_s: agreed measured communication seconds per step.
        modelled: modelled seconds of the plan in effect.
        calibration: the last ``Drift.calibration`` (None after a probe or a change of plan).
        last_sign: the last ``Drift.sign``.
        threshold: relative drift that counts, > 0.
        may_reprobe: ``probe_is_old``; when False nothing is compared.

    Example:
        >>> drift_check(0.02, 0.01, 1.0, 1, 0.5, True).reprobe       # x2, up at the last check too
        True
    """
    if calibration is None:
        return Drift(comm_s / modelled if modelled > 0 else None, 0, False, None)
    if not (modelled > 0 and may_reprobe):
        return Drift(calibration, last_sign, False, None)
    ratio = comm_s / modelled / calibration
    log_ratio = math.log(max(ratio, _LOG_FLOOR))
    sign = 0 if abs(log_ratio) <= math.log1p(threshold) else (1 if log_ratio > 0 else -1)
    if sign and sign == last_sign:                # the second check in a row, the same way
        return Drift(calibration, 0, True, ratio)
    return Drift(calibration, sign, False, ratio)


def gain_fractions(ratios, gains):
    """dict ratio -> G(c) from the agreed gain sums [energy of each ratio ..., total], or None when
    there are no candidates or no gain data."""
    if ratios is None or not gains or gains[-1] <= 0:
        return None
    total = gains[-1]
    return {c: gains[i] / total for i, c in enumerate(ratios)}


def ratio_step_seconds(step_s, modelled, numels, densities, n_workers, costs, fixed=None):
    """dict ratio -> T(c) = T − comm(now) + comm(c) (>= 0), ``densities`` dict ratio -> density of c,
    comm(c) the model's plan at that density, or every tensor with ``fixed`` when given."""
    times = {}
    for c, d in densities.items():
        plan_c = plan_transports(numels, d, n_workers, costs) if fixed is None else uniform_plan(numels, fixed)
        times[c] = max(0.0, step_s - modelled + plan_seconds(numels, plan_c, d, n_workers, costs))
    return times


def choose_ratio(current, step_seconds, gains, weight=DEFAULT_WEIGHT, hysteresis=HYSTERESIS):
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


def ratio_reason(current, new, gains, times):
    """The history's line of a ratio move."""
    return (f"ratio {current:g} -> {new:g} (gain {gains[current]:.3f} -> {gains[new]:.3f}, "
            f"step {times[current] * 1e3:.1f} -> {times[new] * 1e3:.1f} ms)")


def candidate_ratios(adaptive_ratio, ratio, communication):
    """The optimizer's ``adaptive_ratio`` as candidate ratios (descending), or None; ValueError on bad
    bounds. ``ratio``: the compression's, where the adaptive ratio starts."""
    if adaptive_ratio is None or adaptive_ratio is False:
        return None
    if adaptive_ratio is True:
        low, high = min(DEFAULT_RATIOS), max(DEFAULT_RATIOS)
    elif (isinstance(adaptive_ratio, (tuple, list)) and len(adaptive_ratio) == 2
          and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in adaptive_ratio)
          and 0 < adaptive_ratio[0] <= adaptive_ratio[1] <= 1):
        low, high = float(adaptive_ratio[0]), float(adaptive_ratio[1])
    else:
        raise ValueError("adaptive_ratio must be None, True or (low, high) with 0 < low <= high <= 1, "
                         f"got {adaptive_ratio!r}")
    if communication in ("dense", "hierarchical"):      # hierarchical: its gains are not measured
        raise ValueError("adaptive_ratio needs communication 'artopk', 'allgather', 'split_reduce' or 'auto', "
                         f"got communication={communication!r}")
    if not low <= ratio <= high:
        raise ValueError(f"the compression's ratio {ratio} (where the adaptive ratio starts) must lie within "
                         f"adaptive_ratio's bounds [{low}, {high}]")
    ratios = sorted({c for c in DEFAULT_RATIOS if low <= c <= high} | {ratio}, reverse=True)
    if len(ratios) < 2:
        raise ValueError(f"adaptive_ratio bounds [{low}, {high}] leave fewer than two candidate ratios "
                         f"(candidates: {DEFAULT_RATIOS} and the start ratio {ratio})")
    return tuple(ratios)
