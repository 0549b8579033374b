"""hvd_topk: Top-K gradient compression with error feedback for Horovod + PyTorch (and low rank, PowerSGD).

Public names are imported lazily, so that ``hvd_topk.core.sparsify`` works without Horovod.
"""
import importlib

__all__ = ["TopKEF", "PowerSGD", "DistributedOptimizer", "TopKSettings", "PowerSGDSettings", "OptimizerSettings",
           "save_checkpoint", "load_checkpoint", "host_process_sets"]
__version__ = "0.1.0"

_PUBLIC = {"TopKEF": ".compression", "PowerSGD": ".powersgd", "DistributedOptimizer": ".optimizer",
           "TopKSettings": ".settings", "PowerSGDSettings": ".settings", "OptimizerSettings": ".settings",
           "save_checkpoint": ".step.checkpoint", "load_checkpoint": ".step.checkpoint",
           "host_process_sets": ".transports.host_sets"}


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module 'hvd_topk' has no attribute {name!r}")
