"""``communication='auto'`` and the adaptive ratio of ``hvd_topk.DistributedOptimizer`` (docs/auto.md).

- costmodel.py: the alpha-beta model: modelled seconds of each collective.
- probe.py: measures alpha and beta over Horovod's public collectives, online.
- measure.py: times this machine's compression work; the ranks' agreement on numbers.
- plans.py: which transport each compressed tensor uses, and what a plan costs.
- trial.py: the measured trial of plans (turns, rounds, verdict).
- recheck.py: the periodic check: re-probe on drift, the adaptive ratio and its candidates.
- tuner.py: ``AutoTuner``, the per-optimizer state that applies them at the scheduled steps, and
  ``tuner_for``, which the optimizer's factory calls (the only import of this package from outside).

plans, trial and recheck are pure functions (no torch, no Horovod), so names are imported lazily here.
"""
import importlib

__all__ = ["AutoTuner", "tuner_for", "DEFAULT_RATIOS", "DEFAULT_WEIGHT"]

_PUBLIC = {"AutoTuner": ".tuner", "tuner_for": ".tuner", "DEFAULT_RATIOS": ".recheck", "DEFAULT_WEIGHT": ".recheck"}


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module 'hvd_topk.auto' has no attribute {name!r}")
