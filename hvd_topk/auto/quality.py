"""The quality figure ``communication='auto'`` weighs against time where low rank is a candidate.

Pure functions over plain numbers and dicts (no torch, no Horovod). A transport's quality on a tensor is
G, the fraction of the tensor's accumulator energy it sends at once::

    G = ||C(g)||^2 / ||g||^2 = 1 - (||g - C(g)|| / ||g||)^2

(one minus the squared relative error; error feedback keeps the rest for later steps), in the norm of
the optimizer's update: the gradient's own, or with an Adam-type optimizer ||g / (sqrt(v_hat) + eps)||,
the norm its update has (``hvd_topk.auto.measure.adam_weights``; there a compressor's error can exceed
what it sends, and G is floored). Dense sends all (G = 1); the Top-K transports the top-k at the
density in use (``topk_energies``); low rank one warm-started power iteration's P Q^T
(``hvd_topk.core.lowrank.kept_energy``). ``hvd_topk.auto`` samples
them on this rank's gradients (not the accumulators: their residuals are what the plans of the last
steps left, so a trial would measure its own arms) at the probe's step and at the first step of every
round of the trial (a step not timed), and the ranks agree on their sums (``quality_row``/``quality_from_row``).

A plan's G is energy-weighted over its tensors (``plan_gain``), so the tensors that carry the gradient
count most; per tensor and per plan the choice minimises J = seconds / G^w (``objective``, w the
optimizer's ``adaptive_weight`` where it is set, else ``QUALITY_WEIGHT``): the time to send a unit of
gradient energy, with the gain discounted because error feedback delays what is not sent rather than
losing it.
"""
import math

__all__ = ["TOPK", "FIELDS", "QUALITY_WEIGHT", "kept_fraction", "plan_gain", "objective", "quality_row",
           "quality_from_row", "add_sample"]

TOPK = ("artopk", "split_reduce", "allgather", "hierarchical")    # the transports that send a top-k
FIELDS = ("energy", "topk", "lowrank")       # per tensor: ||acc||^2, and what Top-K and low rank send of it
_FLOOR = 1e-12                               # a G of 0 would make J infinite: every choice then ties
# w where Top-K's G is weighed against low rank's. Not the adaptive ratio's 0.3 (measured between Top-K's
# ratios): at 0.3 auto kept Top-K plans that then needed 1.5-2.9x the steps of low rank on the MLP and the
# wide CNN; at 1.0 it kept low rank there after the shortest trial and reached the target in 0.75-1.26x
# the fastest PowerSGD hook's time (docs/studies/2026-11-auto-against-peers.md, "The quality weight").
QUALITY_WEIGHT = 1.0


def kept_fraction(quality, name, transport):
    """G of ``transport`` on tensor ``name``, in (0, 1]: 1 for dense, or where ``quality`` (name -> the
    ``FIELDS`` sums) has no figure for it.

    Example:
        >>> q = {"w": {"energy": 4.0, "topk": 1.0, "lowrank": 3.0}}
        >>> kept_fraction(q, "w", "split_reduce"), kept_fraction(q, "w", "lowrank"), kept_fraction(q, "w", "dense")
        (0.25, 0.75, 1.0)
    """
    figures = (quality or {}).get(name)
    field = "topk" if transport in TOPK else "lowrank" if transport == "lowrank" else None
    if figures is None or field is None or not figures["energy"] > 0:
        return 1.0
    return min(1.0, max(_FLOOR, figures[field] / figures["energy"]))


def plan_gain(plan, quality):
    """G of a whole plan (name -> transport): the energy its tensors send at once over their energy.

    Example:
        >>> q = {"a": {"energy": 3.0, "topk": 3.0, "lowrank": 1.5}, "b": {"energy": 1.0, "topk": 0.5, "lowrank": 1.0}}
        >>> plan_gain({"a": "artopk", "b": "lowrank"}, q), plan_gain({"a": "lowrank", "b": "lowrank"}, q)
        (1.0, 0.625)
    """
    total = sum((quality or {}).get(name, {}).get("energy", 0.0) for name in plan)
    if not total > 0:
        return 1.0
    sent = sum(kept_fraction(quality, name, mode) * quality[name]["energy"] for name, mode in plan.items()
               if name in quality)
    return max(_FLOOR, sent / total)


def objective(seconds, gain, weight):
    """J = seconds / gain ** weight (module docstring).

    Example:
        >>> objective(0.2, 0.25, 0.5)
        0.4
    """
    return seconds / gain ** weight


def add_sample(sums, name, energy, topk, lowrank):
    """``sums`` (name -> ``FIELDS`` sums, this rank's) with one accumulator's figures added."""
    old = sums.get(name, dict.fromkeys(FIELDS, 0.0))
    return dict(sums, **{name: {"energy": old["energy"] + energy, "topk": old["topk"] + topk,
                                "lowrank": old["lowrank"] + lowrank}})


def quality_row(sums, names):
    """This rank's sums as one row for the ranks' agreement, ``FIELDS`` per name in ``names``' order
    (zeros for a tensor this rank did not sample)."""
    return [float(sums.get(name, {}).get(field, 0.0)) for name in names for field in FIELDS]


def quality_from_row(row, names):
    """The agreed row back as name -> ``FIELDS`` (the ranks' mean sums: the ratios are the figures);
    a tensor with no energy anywhere has no figure.

    Example:
        >>> quality_from_row([2.0, 1.0, 2.0, 0.0, 0.0, 0.0], ["a", "b"])
        {'a': {'energy': 2.0, 'topk': 1.0, 'lowrank': 2.0}}
    """
    out = {}
    for i, name in enumerate(names):
        values = row[i * len(FIELDS):(i + 1) * len(FIELDS)]
        if values[0] > 0 and all(math.isfinite(v) for v in values):
            out[name] = dict(zip(FIELDS, values))
    return out
