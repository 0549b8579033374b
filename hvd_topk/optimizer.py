"""hvd_topk.DistributedOptimizer: Horovod's distributed optimizer with Top-K transports and DGC.

Built like Horovod's own factory: a dynamic subclass of the user's optimizer class whose methods are
Horovod's ``_DistributedOptimizer`` with the overrides of ``hvd_topk.step.optimizer_methods``. This module
checks the arguments (``hvd_topk.arguments``; the automatic ones: ``hvd_topk.auto``) and builds the
step coordinator with its units (``hvd_topk.step.coordinator``).
"""
import warnings

from horovod.torch import mpi_ops
from horovod.torch.mpi_ops import Average
from horovod.torch.optimizer import _DistributedOptimizer

from .step import elastic
from .arguments import check_optimizer
from .auto import DEFAULT_WEIGHT, tuner_for
from .step.bucket import GLOBAL_KEY, GlobalBucket
from .compression import TopKEF
from .step.coordinator import StepConfig, StepCoordinator, StepUnits
from .step.dgc import MomentumCorrection
from .core.memory import ResidualMemory
from .step.optimizer_methods import OVERRIDES
from .step.schedule import DensitySchedule
from .step.stats import StepStats
from .transports import ARTopk, Dense, SparseAllgather, SplitReduce
from .transports.collectives import Collectives, Reduction
from .transports.hierarchical import hierarchical_or_flat
from .transports.index_sets import IndexPipeline
from .transports.leaders import StarLeaders, VarLeaders
from .transports.regions import Regions

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, named_parameters=None, compression=TopKEF, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=mpi_ops.global_process_set, *,
                         momentum_correction=False, warmup_steps=0, warmup_epochs=0, clip_grad_norm=None,
                         communication=None, leader="star", value_dtype=None, grad_scaler=None,
                         selection="layerwise", adaptive_ratio=None, adaptive_weight=DEFAULT_WEIGHT, auto_every=50,
                         dense_steps=0, compress="gradient", local_momentum=True):
    """Wrap ``optimizer`` for Horovod with Top-K compression, error feedback and DGC momentum correction.

    Args:
        optimizer: a torch optimizer (SGD, Adam, AdamW, ...).
        named_parameters: ``model.named_parameters()``, as for Horovod (names key the per-rank state).
        compression: ``TopKEF`` or ``TopKEF(ratio=..., min_numel=...)``: where ratio and min_numel come from.
        backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups, sparse_as_dense,
            process_set: Horovod's arguments, in Horovod's order and with Horovod's meaning (``groups``
            below); op is ``hvd.Average`` or ``hvd.Sum``. Sparse gradients (``nn.Embedding(sparse=True)``)
            go through Horovod's own sparse allreduce, uncompressed, unless ``sparse_as_dense``, which
            densifies them and then compresses them like any gradient. With a ``process_set`` only its
            ranks communicate, and every rank counts within it; the others step on their own gradients,
            as in Horovod. The arguments after ``process_set`` are hvd_topk's and keyword-only.
        momentum_correction: DGC momentum correction + factor masking (``hvd_topk.step.dgc``), for SGD with
            momentum > 0 in some group, else ValueError. Off by default: the user's momentum on the
            aggregate held accuracy and loss better at 8 ranks, IID and non-IID (docs/results.md).
        warmup_steps: DGC warm-up over this many steps, density ratio ** ((t+1)/(W+1)) then ratio.
        warmup_epochs: the same schedule per epoch; call ``opt.set_epoch(epoch)`` at each epoch start.
        dense_steps: the first dense_steps steps send every element (density 1, a plain allreduce of
            the gradient: dense Horovod); the warm-up, if any, starts after them. For Adam-type
            optimizers, whose per-element statistics are set in the first steps (as 1-bit Adam's
            dense warm-up stage).
        clip_grad_norm: local clipping of each gradient tensor to norm clip_grad_norm * size**-0.5
            before accumulation (> 0), or None.
        communication: ``'artopk'`` (shared index set, allreduce of k values), ``'allgather'`` (every
            rank's own top-k, int32 indices, scatter-add), ``'split_reduce'`` (every rank's own top-k
            summed per index region by the region's owner, the global top-k of the sums allgathered:
            bytes flat in the number of ranks; ``hvd_topk.transports.split_reduce``), ``'hierarchical'``
            (dense inside each host, split_reduce of each shard across hosts; its process sets from
            ``hvd_topk.host_process_sets()`` or HOROVOD_DYNAMIC_PROCESS_SETS=1; docs/design.md), ``'dense``
            (plain allreduce) or ``'auto'`` (per compressed tensor, the transport the cost model with
            probed alpha/beta picks; see ``hvd_topk.auto``). None (default): the compression's
            ``communication``, ``'split_reduce'`` unless the TopKEF given says otherwise. split_reduce
            selects from every rank's accumulator, where AR-Topk's one leader's index set fell behind
            dense on the digits CNN at 8 ranks (docs/results.md); ``'artopk'`` needs the fewest
            collectives per step (the lowest latency).
        leader: AR-Topk leader, ``'star'`` (round robin) or ``'var'`` (largest EWMA gradient norm).
        selection: ``'layerwise'`` (top-k of each tensor, sent as soon as its gradient is ready) or
            ``'global'`` (one top-k over all compressed tensors fused into one bucket, sent at
            ``synchronize()``).
        value_dtype: dtype of the values on the wire (e.g. ``torch.float16``); None keeps the gradient's.
        grad_scaler: the ``torch.amp.GradScaler`` in use, if any: residuals and momentum then hold
            unscaled gradients, and an overflow on any rank skips the step on every rank.
        adaptive_ratio: None/False (fixed ratio), True (candidates 0.1, 0.03, 0.01, 0.003, 0.001) or
            (low, high) bounds on those candidates; the compression's ratio is where it starts.
        adaptive_weight: exponent w of the gain in the adaptive ratio's J(c) = T(c) / G(c)**w, >= 0
            (0.3: measured, see ``hvd_topk.auto``).
        auto_every: steps between the automatic checks (ratio, drift), int >= 2.
        compress: ``'gradient'`` (error feedback on the gradients; the optimizer steps on their
            aggregate, as in Horovod) or ``'update'`` (every rank steps the optimizer on its own
            gradient; error feedback, the transport and the ratio apply to the change it makes to the
            parameters; the aggregated change is added on every rank). ``'update'`` is for Adam-type
            optimizers: their per-element normalisation undoes error feedback on gradients. The
            optimizer's state (momentum, Adam's moments) is then per rank, like the residuals (save
            it with ``hvd_topk.save_checkpoint``); the communication starts at ``step()``, not during
            the backward pass; ``clip_grad_norm`` clips the local gradients before the local step; a
            gradient clipped between ``synchronize()`` and ``step()`` is this rank's own. Not with
            momentum_correction (the momentum stays in the local optimizer) or grad_scaler. With
            ratio 1.0 it averages the local updates: dense Horovod for plain SGD, not for Adam.
        local_momentum: with ``compress='update'``: False steps the optimizer without momentum
            (Adam's beta1, SGD's or RMSprop's momentum set to 0 for that step, restored after it) on
            every step whose density is below 1, i.e. after ``dense_steps``. Error feedback already
            sends each element's update as the sum of the steps it was held back, which acts as
            momentum; keeping the optimizer's own momentum on top of it overshoots (measured on the
            byte-level LM, see docs/results.md). Adam's second moment is untouched. True (default) keeps the
            optimizer as it is.
        groups: as in Horovod: None (every tensor's collective starts as soon as it is ready), an int
            N >= 1 (the parameters split into N contiguous groups) or a list of lists of parameters
            (each list a group; every other parameter alone). The collectives of a group start together
            once all its gradients are ready, one grouped collective per kind and dtype: fewer, larger
            messages (at small ratios the per-message cost dominates), at the price of less overlap
            with the backward pass. With ``selection='global'`` the compressed tensors are in the
            bucket and only the others are grouped.

    Returns:
        An optimizer of a subclass of ``optimizer``'s class with Horovod's ``synchronize()``,
        ``skip_synchronize()`` and ``zero_grad(set_to_none=...)``, plus ``stats()`` and ``set_epoch()``.

    Example:
        >>> import horovod.torch as hvd, torch, hvd_topk
        >>> hvd.init()
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...                                     named_parameters=model.named_parameters(),
        ...                                     compression=hvd_topk.TopKEF(ratio=0.001), warmup_epochs=4)
        >>> opt.set_epoch(0)
    """
    if num_groups:
        warnings.warn("num_groups has been replaced by groups in Horovod", DeprecationWarning)
        groups = num_groups if groups is None else groups
    if isinstance(compression, type) and issubclass(compression, TopKEF):
        compression = compression.default()
    if not isinstance(compression, TopKEF):
        raise ValueError(f"compression must be TopKEF or a TopKEF instance, got {compression!r}")
    communication, momentum_correction = check_optimizer(
        **{k: v for k, v in locals().items() if k not in ("named_parameters", "num_groups", "sparse_as_dense",
                                                         "adaptive_ratio", "adaptive_weight", "auto_every")})
    tuner = tuner_for(communication, adaptive_ratio, compression.ratio, adaptive_weight, auto_every, process_set)
    named_parameters = list(named_parameters) if named_parameters is not None else \
        [(f"param.{i}.{j}", q) for i, g in enumerate(optimizer.param_groups) for j, q in enumerate(g["params"])]
    config = StepConfig(communication=communication, selection=selection, compress=compress,
                        local_momentum=local_momentum, min_numel=compression.min_numel,
                        clip_grad_norm=clip_grad_norm, grad_scaler=grad_scaler)
    state = _build(config, names=sorted(n for n, _ in named_parameters),
                   schedule=DensitySchedule(compression.ratio, dense_steps, warmup_steps, warmup_epochs),
                   tuner=tuner, leader=leader, reduction=Reduction.of(op, gradient_predivide_factor),
                   value_dtype=value_dtype, process_set=process_set, budget=compression.budget)
    elastic.register()                   # hvd.elastic.TorchState(optimizer=...) then uses hvd_topk.step.elastic
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, elastic.ElasticOptimizer),
               dict(_DistributedOptimizer.__dict__, **OVERRIDES))
    return cls(optimizer.param_groups, named_parameters, state, backward_passes_per_step, op,
               gradient_predivide_factor, groups, bool(sparse_as_dense), process_set, momentum_correction)


def _build(config, *, names, schedule, tuner, leader, reduction, value_dtype, process_set, budget):
    """The step coordinator and its units. Collective names are identical on all ranks (the ranks create
    their optimizers in the same order) and distinct between optimizers: one optimizer's index sets or
    score may still be in flight in another's step."""
    tag = f"hvd_topk.opt{_build.instances}"
    _build.instances += 1
    key_index = {name: i for i, name in enumerate(names + [GLOBAL_KEY])}     # same on all ranks
    leaders = VarLeaders(key_index, f"{tag}.var", process_set) if leader == "var" else \
        StarLeaders(key_index, process_set)
    index_sets = IndexPipeline(f"{tag}.indices", process_set=process_set)
    collectives = Collectives(f"{tag}.group", process_set=process_set)   # groups: set by _init
    stats = StepStats()
    average = reduction.op == Average
    transports = {"artopk": ARTopk(index_sets, leaders, collectives, reduction, value_dtype),
                  "allgather": SparseAllgather(collectives, average, value_dtype),
                  "split_reduce": SplitReduce(collectives, average, Regions(), f"{tag}.split", value_dtype, stats,
                                              budget=budget),
                  "dense": Dense(collectives, reduction, value_dtype, name="values"),
                  "plain": Dense(collectives, reduction, None, name="dense")}
    if config.communication in ("hierarchical", "auto"):    # collective: finds the hosts' process sets
        auto = config.communication == "auto"
        hierarchical = hierarchical_or_flat(transports["split_reduce"], f"{tag}.hier", average,
                                            collectives.start_pending, optional=auto)
        if not auto:
            transports["hierarchical"] = hierarchical
        elif hierarchical is not transports["split_reduce"]:   # across equal hosts: one more to choose from
            transports["hierarchical"] = hierarchical
            tuner.hosts = hierarchical.sets
    units = StepUnits(schedule=schedule, tuner=tuner, residuals=ResidualMemory(), momentum=MomentumCorrection(),
                      leaders=leaders, index_sets=index_sets, collectives=collectives, transports=transports,
                      bucket=GlobalBucket(), stats=stats)
    coordinator = StepCoordinator(config, units)
    coordinator.tag, coordinator.names = tag, names
    return coordinator


_build.instances = 0        # creation counter of the optimizers, for their collectives' names
