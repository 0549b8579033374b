"""Elastic Horovod: ``hvd.elastic.TorchState(model=model, optimizer=opt, ...)`` with an hvd_topk optimizer.

Users write the elastic script exactly as Horovod's documentation does. ``TorchState`` picks a state
handler per object from Horovod's public handler registry (``horovod.torch.elastic.state``); the
optimizer factory registers ``TopKStateHandler`` there for hvd_topk's optimizers (``register``), ahead of
Horovod's own optimizer handler, which it extends:

- ``save`` (``state.commit()``): a copy of ``optimizer.state_dict()``, hvd_topk's per-rank state included.
- ``restore`` (after a failed collective, possibly with Horovod already shut down): the copy is loaded on
  this rank alone, with no check of the world size, which is about to change.
- ``sync`` (at the start and after every reset, collective): Horovod's ``broadcast_optimizer_state``, then
  what must be identical on every rank comes from rank 0: the step counter, the schedule (epoch, ratio)
  and the tuner's decisions. What depended on the old ranks is dropped on every rank: the shared AR-Topk
  index sets (the next step uses the spread set), VAR's scores and split_reduce's regions (equal again).
  Residuals and velocities are per rank and stay: a surviving rank keeps its own, a new rank starts
  from zero (nothing held back yet), so the error-feedback invariant holds on every rank and nothing is
  counted twice. Parameters stay identical.

A reset that only removes hosts skips ``sync`` (Horovod's ``skip_sync``): the survivors were in lockstep,
and the handles in flight when Horovod was re-initialised come back empty on every rank, so the index
sets and scores are dropped alike (``IndexPipeline._receive``, ``VarLeaders._receive``).
"""
import copy

from horovod.torch.elastic import state as elastic_state
from horovod.torch.functions import broadcast_object, broadcast_optimizer_state
from horovod.torch.optimizer import _DistributedOptimizer

from .checkpoint import STATE_KEY, load_coordinator_state
from ..core.memory import StepCommits

__all__ = ["ElasticOptimizer", "TopKStateHandler", "register"]


class ElasticOptimizer:
    """Base of every optimizer ``hvd_topk.DistributedOptimizer`` returns: how ``TorchState`` knows it."""


class TopKStateHandler(elastic_state.OptimizerStateHandler):
    """Horovod's optimizer handler, with hvd_topk's per-rank and shared state (module docstring)."""

    def restore(self):
        saved = dict(self._saved_optimizer_state)
        ours = saved.pop(STATE_KEY)
        _DistributedOptimizer.load_state_dict(self.value, saved)
        load_coordinator_state(self.value._hvd_topk, ours, check=False)
        forget_ranks(self.value._hvd_topk)

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)
        c = self.value._hvd_topk
        shared = broadcast_object({"step": c.step, "schedule": c.schedule.state_dict(),
                                   "tuner": None if c.tuner is None else c.tuner.state_dict()},
                                  root_rank=0, name=f"{c.tag}.elastic")
        c.step = shared["step"]
        c.schedule.load_state_dict(shared["schedule"])
        if c.tuner is not None:
            c.tuner.load_state_dict(copy.deepcopy(shared["tuner"]))
        forget_ranks(c)


def forget_ranks(c):
    """Drop what the coordinator ``c`` shared with the old set of ranks (identically on every rank)."""
    for transport in c.transports.values():
        transport.forget()
    c.last_end = None                     # the tuner's step clock restarts: a reset is not a step
    c.commits, c.sent_keys, c.routed = StepCommits(), set(), False    # the next start tells the buckets anew
    c.bucket.forget()                     # a new rank has not measured the row-sparse tensors: all measure anew


def register():
    """Put ``TopKStateHandler`` first in Horovod's handler registry (once)."""
    registry = elastic_state.get_handler_registry()
    if not any(handler is TopKStateHandler for _, handler in registry):
        elastic_state.set_handler_registry([(ElasticOptimizer, TopKStateHandler)] + list(registry))
