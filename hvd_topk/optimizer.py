"""hvd_topk.DistributedOptimizer: Horovod's distributed optimizer with Top-K transports and DGC.

Built like Horovod's own factory: a dynamic subclass of the user's optimizer class whose methods are
Horovod's ``_DistributedOptimizer`` with the overrides of ``hvd_topk.step.optimizer_methods``. This module
checks the arguments (``hvd_topk.arguments``; the automatic ones: ``hvd_topk.auto``), reads the
compression's settings (``hvd_topk.settings``), has ``hvd_topk.transports.build`` make the transports
and builds the step coordinator with its units (``hvd_topk.step.coordinator``).
"""
import dataclasses
import functools
import warnings

from horovod.torch import mpi_ops
from horovod.torch.mpi_ops import Average
from horovod.torch.optimizer import _DistributedOptimizer

from .arguments import check_lowrank_use, check_optimizer, dense_steps_of, selection_of, topk_only_settings
from .auto import DEFAULT_WEIGHT, tuner_for
from .auto.measure import adam_weights
from .auto.quality import QUALITY_WEIGHT
from .compression import TopKEF
from .settings import PowerSGDSettings, TopKSettings, with_old_keywords, with_value_dtype
from .step import elastic
from .step.bucket import GLOBAL_KEY, GlobalBucket
from .step.coordinator import StepConfig, StepCoordinator, StepUnits
from .step.dgc import MomentumCorrection
from .step.optimizer_methods import OVERRIDES
from .step.schedule import DensitySchedule
from .step.stats import StepStats
from .core.memory import ResidualMemory
from .transports.build import build_transports
from .transports.collectives import Reduction, agree

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, named_parameters=None, compression=TopKEF, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=mpi_ops.global_process_set, *, communication=None, grad_scaler=None,
                         settings=None, **deprecated):
    """Wrap ``optimizer`` for Horovod with Top-K compression, error feedback and DGC's corrections.

    Every argument, its accepted values and what it does: docs/optimizer.md.

    Args:
        optimizer, named_parameters, backward_passes_per_step, op, gradient_predivide_factor, num_groups,
            groups, sparse_as_dense, process_set: Horovod's, in Horovod's order and with Horovod's
            meaning; op is ``hvd.Average`` or ``hvd.Sum``. Sparse gradients go through Horovod's own
            sparse allreduce, uncompressed, unless ``sparse_as_dense``. With a ``process_set`` only its
            ranks communicate; the others step on their own gradients, as in Horovod.
        compression: ``TopKEF`` or ``TopKEF(ratio=..., min_numel=..., communication=..., budget=...)``,
            or ``PowerSGD`` / ``PowerSGD(rank=..., communication=...)`` (low rank): only its settings
            (``comp.settings``, a ``hvd_topk.TopKSettings`` or ``hvd_topk.PowerSGDSettings``) are read.
        communication: with Top-K ``'split_reduce'``, ``'artopk'``, ``'allgather'``, ``'hierarchical'``;
            with low rank ``'lowrank'``, ``'hierarchical'``; ``'dense'``; or ``'auto'`` (per tensor,
            among dense, Top-K's and low rank, from measured time and quality: ``hvd_topk.auto``); None:
            the compression's.
        grad_scaler: the ``torch.amp.GradScaler`` in use, if any: residuals and momentum then hold
            unscaled gradients, and an overflow on any rank skips the step on every rank.
        settings: a ``hvd_topk.OptimizerSettings`` with the seldom-tuned ones: DGC's warm-up, dense
            steps, momentum correction and clipping; selection; ``compress='update'`` and
            ``local_momentum``; the AR-Topk leader; the values' dtype on the wire; the adaptive ratio
            and auto's knobs. None: the defaults.
        **deprecated: those settings spelt as keywords, as before (``warmup_epochs=4``): the same
            behaviour, with a DeprecationWarning naming ``settings=OptimizerSettings(warmup_epochs=4)``.

    Returns:
        An optimizer of a subclass of ``optimizer``'s class with Horovod's ``synchronize()``,
        ``skip_synchronize()`` and ``zero_grad(set_to_none=...)``, plus ``stats()`` and ``set_epoch()``.

    Example:
        >>> import horovod.torch as hvd, torch, hvd_topk
        >>> hvd.init()
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...                                     named_parameters=model.named_parameters(),
        ...                                     compression=hvd_topk.TopKEF(ratio=0.001),
        ...                                     settings=hvd_topk.OptimizerSettings(warmup_epochs=4))
        >>> opt.set_epoch(0)
    """
    settings = with_old_keywords(settings, deprecated)
    if num_groups:
        warnings.warn("num_groups has been replaced by groups in Horovod", DeprecationWarning)
        groups = num_groups if groups is None else groups
    chosen = getattr(compression, "settings", None)    # the class's defaults, or an instance's
    if not isinstance(chosen, (TopKSettings, PowerSGDSettings)):
        raise ValueError(f"compression must be TopKEF or PowerSGD, the class or an instance, got {compression!r}")
    communication = chosen.communication if communication is None else communication
    check_lowrank_use(settings, communication, chosen.kind)
    settings = dataclasses.replace(settings, dense_steps=dense_steps_of(settings, chosen))
    # the optimizer's or TopKEF's selection, else the default of this communication (low rank selects nothing)
    settings = dataclasses.replace(settings, selection=selection_of(
        [settings.selection, getattr(chosen, "selection", None)],
        communication if chosen.kind == "topk" else "lowrank", pinned=bool(settings.pin)))
    # the other kind at its defaults: auto and pins may send a tensor with either
    lowrank = chosen if chosen.kind == "lowrank" else PowerSGDSettings()
    topk = TopKSettings() if chosen.kind == "lowrank" else with_value_dtype(chosen, settings.value_dtype)
    check_optimizer(optimizer=optimizer, settings=settings, communication=communication,
                    backward_passes_per_step=backward_passes_per_step, op=op,
                    gradient_predivide_factor=gradient_predivide_factor, groups=groups, process_set=process_set,
                    grad_scaler=grad_scaler)
    # w of the adaptive ratio (0.3), or, where auto weighs low rank against Top-K (the ratio is then fixed),
    # of the quality (1.0); the user's adaptive_weight sets either
    weight = settings.adaptive_weight if settings.adaptive_weight is not None else \
        QUALITY_WEIGHT if _offers_lowrank(communication, settings, topk) else DEFAULT_WEIGHT
    tuner = tuner_for(communication, settings.adaptive_ratio, topk.ratio, weight, settings.auto_every, process_set)
    named_parameters = list(named_parameters) if named_parameters is not None else \
        [(f"param.{i}.{j}", q) for i, g in enumerate(optimizer.param_groups) for j, q in enumerate(g["params"])]
    config = StepConfig(communication=communication, selection=settings.selection, compress=settings.compress,
                        local_momentum=settings.local_momentum, second_moment=settings.second_moment,
                        min_numel=0 if chosen.kind == "lowrank" else topk.min_numel,   # low rank: its twofold rule
                        clip_grad_norm=settings.clip_grad_norm, grad_scaler=grad_scaler,
                        bucket_cap_mb=topk.bucket_cap_mb, pin=settings.pin)
    state = _build(config, (chosen, topk if chosen is lowrank else lowrank), settings,
                   shapes={n: tuple(q.shape) for n, q in named_parameters}, tuner=tuner,
                   reduction=Reduction.of(op, gradient_predivide_factor), process_set=process_set)
    elastic.register()                   # hvd.elastic.TorchState(optimizer=...) then uses hvd_topk.step.elastic
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, elastic.ElasticOptimizer),
               dict(_DistributedOptimizer.__dict__, **OVERRIDES))
    opt = cls(optimizer.param_groups, named_parameters, state, backward_passes_per_step, op,
              gradient_predivide_factor, groups, bool(sparse_as_dense), process_set, settings.momentum_correction)
    if tuner is not None:                # auto's quality in the norm of an Adam-type update, where it has one
        tuner.update_weights = functools.partial(adam_weights, opt, dict(named_parameters))
    return opt


def _build(config, kinds, settings, *, shapes, tuner, reduction, process_set):
    """The step coordinator and its units, ``kinds`` the compression's settings and the other kind's.
    Collective names are identical on all ranks (the ranks create their optimizers in the same order) and
    distinct between optimizers: one optimizer's index sets or score may still be in flight in another's
    step."""
    tag = f"hvd_topk.opt{_build.instances}"
    _build.instances += 1
    stats = StepStats()
    names = sorted(shapes)
    # sync_indices is TopKEF's alone: the optimizer shares its index sets one step stale
    chosen, other = (dataclasses.replace(s, sync_indices=False) if s.kind == "topk" else s for s in kinds)
    stack = build_transports(chosen, tag=tag, alongside=other, shapes=shapes,
                             key_index={name: i for i, name in enumerate(names + [GLOBAL_KEY])},  # same on all ranks
                             process_set=process_set, communication=config.communication, reduction=reduction,
                             leader=settings.leader, value_dtype=settings.value_dtype, stats=stats)
    topk = chosen if chosen.kind == "topk" else other
    if tuner is not None and stack.hosts is not None:   # auto across equal hosts: one more to choose from
        tuner.hosts = stack.hosts
    if tuner is not None:
        tuner.first_step = max(settings.dense_steps - 1, 0)       # the last dense step (AutoTuner)
        tuner.start = chosen.communication if chosen.communication in stack.transports else "dense"
        # low rank is one more candidate, unless Top-K-only settings are on or Top-K sends everything
        # (ratio 1.0 means dense Horovod, which low rank is not)
        if _offers_lowrank(config.communication, settings, topk):
            tuner.lowrank = stack.transports["lowrank"]
    units = StepUnits(schedule=DensitySchedule(topk.ratio, settings.dense_steps, settings.warmup_steps,
                                               settings.warmup_epochs),
                      tuner=tuner, residuals=ResidualMemory(), momentum=MomentumCorrection(), leaders=stack.leaders,
                      index_sets=stack.index_sets, collectives=stack.collectives, transports=stack.transports,
                      bucket=GlobalBucket(lambda shares: agree(shares, f"{tag}.row_sparse", process_set=process_set)),
                      stats=stats)
    coordinator = StepCoordinator(config, units)
    coordinator.tag, coordinator.names = tag, names
    return coordinator


_build.instances = 0        # creation counter of the optimizers, for their collectives' names


def _offers_lowrank(communication, settings, topk):
    """Whether 'auto' chooses low rank too: not beside Top-K-only settings, nor at ratio 1.0 (which must
    stay dense Horovod)."""
    return communication == "auto" and not topk_only_settings(settings) and topk.ratio < 1.0
