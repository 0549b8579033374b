"""The step coordinator of ``hvd_topk.DistributedOptimizer``: one synchronized step, on every rank.

1. ``submit(p, name)`` (Horovod's backward hook; with compress='update', ``step()``): the gradient,
   unscaled and clipped, corrected for momentum (``dgc``), goes with its residual to its transport:
   ``Dense`` for tensors never compressed and at density 1 (``DenseFP16`` where auto or a pin chose it),
   else the configured (or auto-chosen) sparse transport, or into the global bucket. It returns
   ``done``, which Horovod's ``synchronize`` calls.
2. The step's last compressed tensor starts sharing AR-Topk's next index sets, in the same Horovod
   cycle as the values (after ``synchronize`` would be a cycle later).
3. ``done()`` waits for the transport and hands back the aggregate as the gradient; the new residual
   (acc with the sent entries zeroed, or the transport's own ``Outcome.residual``) and velocity are queued.
4. ``end_step()`` commits what was queued only if every rank was finite (read from aggregated values, so
   the decision is the same everywhere), advances the step and the schedule, and lets the tuner and the
   VAR leaders act. Everything a decision reads is identical on all ranks.
"""
import functools
import math
import time
from typing import NamedTuple, Optional

import torch

from .bucket import GLOBAL_KEY, regroup
from .dgc import clip_local
from .fused_plan import FusedPlan
from .routing import DENSE, route
from ..core.memory import StepCommits
from ..core.sparsify import sq_norm_finite

__all__ = ["StepConfig", "StepUnits", "StepCoordinator", "start_bucket", "split_bucket"]


class StepConfig(NamedTuple):
    """What the user chose (validated by ``hvd_topk.DistributedOptimizer``)."""
    communication: str                    # 'artopk', 'allgather', 'split_reduce', 'hierarchical', 'dense', 'auto'
    selection: str                        # 'layerwise' or 'global'
    compress: str                         # 'gradient' or 'update'
    local_momentum: bool                  # compress='update': keep the optimizer's momentum when sparse
    second_moment: str                    # compress='update': 'local' or 'frozen' after the dense steps
    min_numel: int                        # smaller tensors are never compressed
    clip_grad_norm: Optional[float]       # DGC local clipping, or None
    grad_scaler: object                   # torch.amp.GradScaler in use, or None
    bucket_cap_mb: float = 25.0           # split_reduce's and allgather's buckets (TopKSettings)
    pin: Optional[dict] = None            # name -> the transport it always takes (OptimizerSettings.pin)


class StepUnits(NamedTuple):
    """The units one step coordinates; every one keeps its own state."""
    schedule: object                      # DensitySchedule: density per step, the ratio
    tuner: object                         # AutoTuner, or None (fixed transport and ratio)
    residuals: object                     # ResidualMemory: this rank's residual per key
    momentum: object                      # MomentumCorrection: this rank's velocities
    leaders: object                       # StarLeaders or VarLeaders (AR-Topk)
    index_sets: object                    # IndexPipeline (AR-Topk)
    collectives: object                   # Collectives: Horovod's collectives, grouped or not
    transports: dict                      # 'artopk', 'allgather', 'split_reduce', 'dense' (density 1),
                                          # 'plain' (never compressed)
    bucket: object                        # GlobalBucket (selection='global')
    stats: object                         # StepStats


class StepCoordinator:
    """One optimizer's step, on one rank; ``config`` and ``units`` become flat attributes."""

    def __init__(self, config, units):
        self.__dict__.update(config._asdict(), **units._asdict())
        self.clock = time.perf_counter        # the tuner's step clock (tests give ranks other clocks)
        self.sparse_numels = {}               # key -> numel of every compressed tensor (or bucket group)
        self.bucket_numels = {}               # selection='global': key -> numel of every tensor in the bucket
        self.bucket_split = set()             # the row-sparse keys sent beside the pooled bucket now
        self.plan_keys = []                   # the keys in registration order, for the fused buckets
        self.step = 0                         # synchronized steps, identical on all ranks
        self.commits = StepCommits()          # state updates of this step, applied if it is finite
        self.sent_keys = set()                # sparse keys submitted this step (layer-wise selection)
        self.last_end = None                  # clock() at the end of the previous step
        self.routed = False                   # this step's keys were told to the fused transports
        self.fused = FusedPlan(lambda: self.transports.values())

    # what the tuner reads (``AutoTuner.end_step``)
    ratio = property(lambda self: self.schedule.ratio)
    density = property(lambda self: self.schedule.density)
    density_with = property(lambda self: self.schedule.density_with)

    def is_sparse(self, p):
        """Whether p's gradient is compressed (else a plain allreduce in its own dtype)."""
        return not (self.communication == "dense" or p.dim() <= 1 or p.numel() < self.min_numel
                    or not p.is_floating_point())

    def submit(self, p, name, update=None, grad=None):
        """Start the transport of p's gradient (``grad``, else ``p.grad``), or of ``update``, this rank's
        change of p, sent as it is; returns ``done() -> aggregated gradient``."""
        fresh = update if update is not None else p.grad if grad is None else grad
        g = fresh.reshape(-1)
        if update is None:                    # a gradient: unscaled, clipped
            if self.grad_scaler is not None:
                g = g * (1.0 / self.grad_scaler.get_scale())
            g = clip_local(g, self.clip_grad_norm, self.collectives.process_set.size())
        g, u_new = self.momentum.correct(name, g, p)
        if not self.is_sparse(p):
            started = self.transports["plain"].start(name, g)
            self.stats.add_sent(started.nbytes, 0.0, 0.0, dense=True)
            self.fused.advance()
            return lambda: self.hand_out(name, p, started.finish().aggregate, None, u_new)
        if self.selection == "global":
            self.bucket.add(name, g, fresh)
            start = functools.partial(start_bucket, self)
            if len(self.bucket.entries) == len(self.bucket_numels):
                self.bucket.start(start)      # the step's last compressed tensor: the bucket leaves now
            return lambda: self.hand_out(name, p, *self.bucket.output(name, start)[:2], u_new)
        with self.stats.selecting():          # accumulate + select (packing apart)
            pending = self._start(name, g)
        self.sent_keys.add(name)
        if len(self.sent_keys) == len(self.sparse_numels):
            self.index_sets.flush()           # the step's last compressed tensor (step 2)
        return lambda: self.hand_out(name, p, *self._finish(name, pending), u_new)

    def _start(self, key, g):
        """Start sending the flat accumulator acc = g + residual of ``key``; returns (acc, finish)."""
        if not self.routed:                   # the step's first start: the fused transports' keys
            self.routed = True
            self.fused.expect({name: self.transports[route(self, name, n)[0]]
                               for name, n in self.sparse_numels.items()})
        n = g.numel()
        mode, k, k_next, gains = route(self, key, n)
        if mode in DENSE:
            acc = self.residuals.compensate(key, g, copy=False)
            started = self.transports[mode].start(key, acc)
            self.stats.add_sent(started.nbytes, 0.0, 0.0, dense=True)
            return acc, started.finish
        acc = self.residuals.compensate(key, g)
        acc_sq, finite = sq_norm_finite(acc)
        self.leaders.observe(acc_sq if math.isfinite(acc_sq) else 0.0)
        if gains and finite:
            self.tuner.observe_acc(acc, key, k_next, g)
        started = self.transports[mode].start(key, acc, k, finite, grad=g, step=self.step, k_next=k_next)
        self.stats.add_sent(started.nbytes, started.sent_sq, acc_sq,
                            lowrank=None if started.values is None else (started.values, acc.numel()))
        return acc, started.finish

    def _finish(self, key, pending):
        """(aggregate or None, where the velocity is masked) of a started transport; queues the new
        residual. The mask is what this rank selected: for split_reduce its whole nominated top-k, so
        unkept entries stop gathering momentum on momentum (design.md, "DGC momentum correction")."""
        acc, finish = pending
        out = finish()
        if out.aggregate is not None:
            residual = out.residual if out.residual is not None else \
                None if out.sent is None else acc.index_fill_(0, out.sent, 0)
            self.commits.add(lambda: self.residuals.update(key, residual))
        return out.aggregate, out.sent if out.selected is None else out.selected

    def hand_out(self, name, p, aggregate, sent, u_new):
        """The aggregate as p's gradient (NaN everywhere if some rank was non-finite); queues the velocity."""
        if aggregate is None:
            self.commits.nonfinite = True     # the whole step is skipped (end_step)
            return torch.full(p.shape, float("nan"), dtype=p.dtype, device=p.device)
        self.commits.add(lambda: self.momentum.commit(name, u_new, sent))
        out = aggregate.to(p.dtype)
        if self.grad_scaler is not None:      # hand the scaler gradients in its scaled units
            out = out * self.grad_scaler.get_scale()
        return out.reshape(p.shape)

    def end_step(self, comm_s):
        """After every parameter is synchronized: commit the step if it was finite everywhere, advance
        it, let the tuner decide (collective) and VAR share its score. Returns True if non-finite."""
        self.index_sets.flush()               # the index sets, unless shared at the last submit
        self.sent_keys, self.routed = set(), False
        self.collectives.end_step()
        self.stats.skipped = nonfinite = self.commits.end()
        self.stats.end_step(density=self.schedule.density(self.step), comm_s=comm_s)
        now = self.clock()
        # from the last dense step on (the probe then plans for the density that follows)
        if self.tuner is not None and self.step + 1 >= self.schedule.dense_steps:
            step_s = 0.0 if self.last_end is None else now - self.last_end
            self.schedule.change_ratio(self.tuner.end_step(self, self.step, step_s, comm_s))
            now = self.clock()                # a probe's time is not the next step's
        self.last_end = now
        self.step += 1
        self.schedule.advance(self.step)
        self.leaders.end_step()
        return nonfinite


def start_bucket(c, groups):
    """Start the global bucket's groups (``bucket.GlobalBucket.start``) through ``c``'s transports, as
    soon as the step's last compressed tensor is submitted (or at synchronize(), where Horovod submits
    a gradient unused on this rank); returns ``finish()`` -> per group (aggregate or None, indices, None)."""
    if c.bucket.alone != c.bucket_split:  # measured this step: the first, or the first after a reset
        split_bucket(c, c.bucket.alone)
    with c.stats.selecting():
        pending = [(key, c._start(key, flat)) for key, flat in groups]
    # the pooled tensors' residual stays whole, under GLOBAL_KEY; a row-sparse one's under its name
    return lambda: [(*c._finish(key, started), None) for key, started in pending]


def split_bucket(c, alone):
    """Send the row-sparse keys ``alone`` (``bucket.GlobalBucket``) beside ``c``'s pooled bucket from now
    on: the residuals' layout, the keys the transports expect and the fused buckets follow, alike on every
    rank."""
    regroup(c.residuals.residuals, c.bucket_numels, alone)
    pooled = sum(n for key, n in c.bucket_numels.items() if key not in alone)
    c.sparse_numels = dict({GLOBAL_KEY: pooled} if pooled else {},
                           **{key: c.bucket_numels[key] for key in sorted(alone)})
    c.fused.plan(c.plan_keys, c.sparse_numels, c.bucket_cap_mb)
    c.bucket_split = set(alone)
