"""hvd_topk.DistributedOptimizer: Horovod's distributed optimizer with Top-K transports and DGC.

Built like Horovod's own factory: a dynamic subclass of the user's optimizer class whose methods are
Horovod's ``_DistributedOptimizer`` with one extension point replaced: ``_allreduce_grad_async(p)``
returns a *callable* handle (Horovod's ``synchronize`` calls it) that finishes our transport and
returns the aggregated dense gradient. Horovod itself is not edited or patched. The step itself is
``coordinator.StepCoordinator``; this module validates the arguments and builds it.
"""
import numbers
import time
import warnings

import torch
from horovod.common.util import split_list
from horovod.torch import mpi_ops
from horovod.torch.compression import Compression
from horovod.torch.functions import broadcast_object
from horovod.torch.mpi_ops import Average, Sum
from horovod.torch.optimizer import _DistributedOptimizer

from .auto import DEFAULT_RATIOS, DEFAULT_WEIGHT, AutoTuner
from .bucket import GLOBAL_KEY, GlobalBucket
from .checkpoint import STATE_KEY, check_loadable, coordinator_state, load_coordinator_state
from .comm import Collectives, Reduction
from .compression import TopKEF
from .coordinator import StepConfig, StepCoordinator, StepUnits
from . import elastic
from .dgc import MomentumCorrection
from .index_sets import IndexPipeline
from .leaders import StarLeaders, VarLeaders
from .memory import ResidualMemory
from .plans import TRANSPORTS
from .schedule import DensitySchedule
from .stats import StepStats
from .regions import Regions
from .transports import ARTopk, Dense, SparseAllgather, SplitReduce
from .transports.hierarchical import hierarchical_or_flat
from .update import update_step
from .validate import check_choice, check_int, check_number

__all__ = ["DistributedOptimizer", "COMMUNICATIONS", "LEADERS", "SELECTIONS", "COMPRESSES"]

COMMUNICATIONS = ("artopk", "allgather", "split_reduce", "hierarchical", "dense", "auto")
COMPRESSES = ("gradient", "update")
LEADERS = ("star", "var")
SELECTIONS = ("layerwise", "global")


def DistributedOptimizer(optimizer, named_parameters=None, compression=TopKEF, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=mpi_ops.global_process_set, *,
                         momentum_correction=None, warmup_steps=0, warmup_epochs=0, clip_grad_norm=None,
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
        momentum_correction: DGC momentum correction + factor masking. None: on for ``torch.optim.SGD``
            with momentum > 0 in some group; True without SGD's momentum raises ValueError. The
            settings stay in ``param_groups``, read at every step (``hvd_topk.dgc``).
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
            (several ranks per host: dense inside each host, split_reduce of each shard across hosts, so
            about k entries per host cross the slow link; the hosts' process sets come from
            ``hvd.init(process_sets=hvd_topk.host_process_sets())`` or HOROVOD_DYNAMIC_PROCESS_SETS=1;
            one host or uneven hosts fall back to split_reduce; ``hvd_topk.transports.hierarchical``), ``'dense'``
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
    compression, communication, momentum_correction, tuner = _checked(
        **{k: v for k, v in locals().items() if k not in ("named_parameters", "num_groups")})
    named_parameters = list(named_parameters) if named_parameters is not None else \
        [(f"param.{i}.{j}", q) for i, g in enumerate(optimizer.param_groups) for j, q in enumerate(g["params"])]
    config = StepConfig(communication=communication, selection=selection, compress=compress,
                        local_momentum=local_momentum, min_numel=compression.min_numel,
                        clip_grad_norm=clip_grad_norm, grad_scaler=grad_scaler)
    state = _build(config, names=sorted(n for n, _ in named_parameters),
                   schedule=DensitySchedule(compression.ratio, dense_steps, warmup_steps, warmup_epochs),
                   tuner=tuner, leader=leader, reduction=Reduction.of(op, gradient_predivide_factor),
                   value_dtype=value_dtype, process_set=process_set, budget=compression.budget)
    elastic.register()                   # hvd.elastic.TorchState(optimizer=...) then uses hvd_topk.elastic
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, elastic.ElasticOptimizer),
               dict(_DistributedOptimizer.__dict__, **_OVERRIDES))
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
    if config.communication == "hierarchical":          # collective: finds the hosts' process sets
        transports["hierarchical"] = hierarchical_or_flat(transports["split_reduce"], f"{tag}.hier", average,
                                                          collectives.start_pending)
    units = StepUnits(schedule=schedule, tuner=tuner, residuals=ResidualMemory(), momentum=MomentumCorrection(),
                      leaders=leaders, index_sets=index_sets, collectives=collectives, transports=transports,
                      bucket=GlobalBucket(), stats=stats)
    coordinator = StepCoordinator(config, units)
    coordinator.tag, coordinator.names = tag, names
    return coordinator


_build.instances = 0        # creation counter of the optimizers, for their collectives' names


def _checked(*, optimizer, compression, backward_passes_per_step, op, gradient_predivide_factor, groups,
             sparse_as_dense, process_set, momentum_correction, warmup_steps, warmup_epochs, clip_grad_norm,
             communication, leader, value_dtype, grad_scaler, selection, adaptive_ratio, adaptive_weight, auto_every,
             dense_steps, compress, local_momentum):
    """ValueError naming the first bad argument; else (TopKEF instance, communication (None: the
    TopKEF's), momentum correction on/off, the AutoTuner or None)."""
    if isinstance(compression, type) and issubclass(compression, TopKEF):
        compression = compression.default()
    if not isinstance(compression, TopKEF):
        raise ValueError(f"compression must be TopKEF or a TopKEF instance, got {compression!r}")
    communication = compression.communication if communication is None else communication
    check_choice("communication", communication, COMMUNICATIONS)
    check_choice("compress", compress, COMPRESSES)
    check_choice("selection", selection, SELECTIONS)
    check_choice("leader", leader, LEADERS)
    if compress == "update" and momentum_correction:
        raise ValueError("momentum_correction=True cannot be used with compress='update' (the local "
                         "optimizer keeps its momentum; its update is what is compressed)")
    if not isinstance(local_momentum, bool):
        raise ValueError(f"local_momentum must be True or False, got {local_momentum!r}")
    if not local_momentum:
        if compress != "update":
            raise ValueError("local_momentum=False needs compress='update' (with compress='gradient' the "
                             "optimizer steps on the aggregate; see momentum_correction)")
        if any("betas" not in g and "momentum" not in g for g in optimizer.param_groups):
            raise ValueError(f"local_momentum=False needs an optimizer whose param groups have 'betas' (Adam "
                             f"family) or 'momentum' (SGD, RMSprop); {type(optimizer).__name__} has neither")
    if compress == "update" and grad_scaler is not None:
        raise ValueError("grad_scaler cannot be used with compress='update' (use it with "
                         "compress='gradient', or unscaled gradients)")
    for name, value in (("warmup_steps", warmup_steps), ("warmup_epochs", warmup_epochs),
                        ("dense_steps", dense_steps)):
        check_int(name, value)
    check_int("backward_passes_per_step", backward_passes_per_step, low=1)
    if clip_grad_norm is not None:
        check_number("clip_grad_norm", clip_grad_norm, low=0, low_open=True, what="or None")
    if op not in (Average, Sum):
        raise ValueError("op must be hvd.Average or hvd.Sum (Adasum is not a sum of sparse vectors)")
    check_number("gradient_predivide_factor", gradient_predivide_factor, low=0, low_open=True)
    if not isinstance(process_set, mpi_ops.ProcessSet) or process_set.process_set_id is None:
        raise ValueError(f"process_set must be a Horovod ProcessSet registered with hvd.init or "
                         f"hvd.add_process_set, got {process_set!r}")
    if value_dtype is not None and not (isinstance(value_dtype, torch.dtype) and value_dtype.is_floating_point):
        raise ValueError(f"value_dtype must be a floating torch dtype or None, got {value_dtype!r}")
    ratios = _adaptive_ratios(adaptive_ratio, compression.ratio, communication)
    check_number("adaptive_weight", adaptive_weight, low=0)
    check_int("auto_every", auto_every, low=2)
    tuner = None
    if communication == "hierarchical" and (ratios is not None or process_set is not mpi_ops.global_process_set):
        raise ValueError("communication='hierarchical' needs the global process set (it builds its own per "
                         "host) and no adaptive_ratio (its gains are not measured)")
    if (communication == "auto" or ratios is not None) and process_set is not mpi_ops.global_process_set:
        raise ValueError("communication='auto' and adaptive_ratio need the global process set (their probe "
                         "and decisions run over all ranks)")
    if communication == "auto" or ratios is not None:
        tuner = AutoTuner(communication == "auto", ratios, weight=float(adaptive_weight), every=int(auto_every))
    # DGC's correction is SGD's momentum, on the raw gradient; RMSprop's momentum acts after its
    # normalisation, so correcting it would change what the optimizer computes.
    has_momentum = isinstance(optimizer, torch.optim.SGD) and \
        any(g.get("momentum", 0.0) > 0 for g in optimizer.param_groups)
    if momentum_correction is None:
        momentum_correction = has_momentum and compress == "gradient"
    elif momentum_correction and not has_momentum:
        raise ValueError("momentum_correction=True needs an optimizer with momentum > 0: torch.optim.SGD "
                         f"or a subclass (got {type(optimizer).__name__} without SGD's momentum)")
    _check_groups(groups, optimizer)
    return compression, communication, bool(momentum_correction), tuner


# -- methods of the dynamic class (Horovod's style: super(self.__class__, self)) ---------------------

def _init(self, params, named_parameters, hvd_topk_state, backward_passes_per_step, op,
          gradient_predivide_factor, groups, sparse_as_dense, process_set, momentum_correction):
    # Horovod's groups are not given to Horovod: our Collectives group the transports' collectives.
    _DistributedOptimizer.__init__(self, params, named_parameters, Compression.none,
                                   backward_passes_per_step, op, gradient_predivide_factor,
                                   None, sparse_as_dense, process_set)
    self._hvd_topk = hvd_topk_state
    if not self._grad_accs and self.process_set.included():
        self._register_hooks()        # Horovod skips hooks at world size 1; we still need them
    sparse = {self._parameter_names[q]: q.numel() for group in self.param_groups for q in group["params"]
              if q.requires_grad and self._hvd_topk.is_sparse(q)}
    self._hvd_topk.sparse_numels = {GLOBAL_KEY: sum(sparse.values())} if \
        self._hvd_topk.selection == "global" and sparse else sparse
    if groups is not None:
        self._hvd_topk.collectives.set_groups(_key_groups(self, groups))
    if momentum_correction:
        self._hvd_topk.momentum.take_over(self, self._parameter_names)


def _key_groups(self, groups):
    """Horovod's ``groups`` as lists of keys: an int N splits the parameters (rank 0's order, as Horovod
    does) into N contiguous groups; a list of lists of parameters gives the groups, every other
    parameter is alone. With global selection the compressed tensors travel in the bucket instead."""
    params = [q for group in self.param_groups for q in group["params"] if q.requires_grad]
    ps = self.process_set                     # Horovod's root_rank is a global rank
    names = broadcast_object([self._parameter_names[q] for q in params], root_rank=ps.ranks[0],
                             name=f"{self._hvd_topk.tag}.groups", process_set=ps)
    if sorted(names) != sorted(self._parameter_names[q] for q in params):
        raise ValueError("groups: the ranks' models have different parameters")
    if isinstance(groups, list):
        lists = [[self._parameter_names[q] for q in group if q.requires_grad] for group in groups]
    else:
        lists = split_list(names, groups)
    if self._hvd_topk.selection == "global":
        bucketed = {self._parameter_names[q] for q in params if self._hvd_topk.is_sparse(q)}
        lists = [[n for n in keys if n not in bucketed] for keys in lists]
    return [keys for keys in lists if len(keys) > 1]


def _allreduce_grad_async(self, p):
    if p.grad is None:
        p.grad = p.data.new(p.size()).zero_()
    if self._hvd_topk.compress == "update":
        return (lambda: p.grad), None          # the gradient stays local; step() sends the update
    name = self._parameter_names.get(p)
    if p.grad.is_sparse and not self.sparse_as_dense:
        # Horovod's own sparse allreduce (self._compression is Compression.none): passed through
        handle, _ = _DistributedOptimizer._allreduce_grad_async(self, p)
        return _momentum_after_sum(self._hvd_topk, p, name, handle), None
    return self._hvd_topk.submit(p, name, grad=p.grad.to_dense() if p.grad.is_sparse else None), None


def _momentum_after_sum(state, p, name, wait):
    """``done`` of a gradient Horovod aggregates itself (sparse): momentum correction, if p's group has
    it, applies to the aggregate (linear, so the same as before the sum, as for dense tensors)."""
    def done():
        out = wait()
        if name not in state.momentum.group_index:
            return out
        g = out.to_dense().reshape(-1)
        if state.grad_scaler is not None:
            g = g * (1.0 / state.grad_scaler.get_scale())
        g, u_new = state.momentum.correct(name, g, p)
        return state.hand_out(name, p, g, None, u_new)
    return done


def _synchronize(self):
    t0 = time.perf_counter()
    _DistributedOptimizer.synchronize(self)
    if self._hvd_topk.compress == "update" or not self.process_set.included():
        return                                 # nothing was sent: the gradients are this rank's own
    if self._hvd_topk.end_step(comm_s=time.perf_counter() - t0):
        # Non-finite somewhere: every gradient of the step is NaN on every rank, so a loss scaler
        # (or the check in step()) skips the whole step, which the untouched residuals assume.
        for q in self._requires_update:
            if q.grad is not None:
                q.grad.fill_(float("nan"))


def _step(self, closure=None):
    if not self.process_set.included():        # as Horovod: a rank outside the set steps on its own
        return super(self.__class__, self).step(closure)
    if self._should_synchronize:
        if self._synchronized:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(); this synchronizes twice")
            _average_again(self)
        else:
            self.synchronize()
    self._synchronized = False
    if self._hvd_topk.compress == "update":
        return update_step(self, closure)
    if self._hvd_topk.stats.last().get("skipped"):
        warnings.warn("hvd_topk: a gradient was non-finite on some rank; the step is skipped on every "
                      "rank and residuals are unchanged")
        return None
    with self._hvd_topk.momentum.hidden():
        return super(self.__class__, self).step(closure)


def _average_again(self):
    """A second synchronize() in one step, as Horovod does it: the gradients (already aggregated, maybe
    clipped since) are averaged once more, uncompressed; the step, residuals and velocities stay as the
    first synchronize() left them."""
    params = sorted((q for q in self._requires_update if q.grad is not None), key=self._parameter_names.get)
    if not params:
        return
    r = Reduction.of(self.op, self.gradient_predivide_factor)
    grads = [q.grad.to_dense() if q.grad.is_sparse else q.grad for q in params]
    outs = mpi_ops.grouped_allreduce(grads, name=f"{self._hvd_topk.tag}.again", op=r.op, prescale_factor=r.prescale,
                                     postscale_factor=r.postscale, process_set=self.process_set)
    for q, out in zip(params, outs):
        if q.grad.is_sparse:
            q.grad.zero_().add_(out.to_sparse())
        else:
            q.grad.copy_(out)


def _zero_grad(self, set_to_none=True):
    if self._handles:
        raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                             "optimizer.step() or optimizer.synchronize(); this would race with the "
                             "gradient communication")
    return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def _state_dict(self):
    state = super(self.__class__, self).state_dict()
    state[STATE_KEY] = coordinator_state(self._hvd_topk)
    return state


def _load_state_dict(self, state_dict):
    state_dict = dict(state_dict)
    ours = state_dict.pop(STATE_KEY, None)
    if ours is None:
        raise ValueError("state_dict has no hvd_topk state (residuals, momentum): it was not saved "
                         "by hvd_topk.DistributedOptimizer")
    check_loadable(self._hvd_topk, ours)          # before anything is loaded
    _DistributedOptimizer.load_state_dict(self, state_dict)
    load_coordinator_state(self._hvd_topk, ours)


def _set_epoch(self, epoch):
    """Tell the epoch-based warm-up which epoch starts now (same value on every rank)."""
    self._hvd_topk.schedule.epoch = int(epoch)


def _stats(self):
    """Figures of the last synchronized step (``hvd_topk.stats.StepStats``), the residual norm, the
    ratio in use and, with communication='auto', the probed costs and how many tensors use each
    transport."""
    state = self._hvd_topk
    out = dict(state.stats.last(), residual_norm=state.residuals.norm(), ratio=state.schedule.ratio)
    tuner = state.tuner
    if tuner is not None and tuner.costs is not None:
        out.update(alpha=tuner.costs.alpha, beta=tuner.costs.beta)
        if tuner.auto_transport:
            out.update({f"auto_{mode}": sum(1 for v in tuner.plan.values() if v == mode) for mode in TRANSPORTS})
    return out


def _auto_state(self):
    """The automatic decisions: plan (name -> transport), ratio, probed costs and the history of
    (step, ratio, transport counts, reason); identical on every rank. None without auto/adaptive."""
    tuner = self._hvd_topk.tuner
    if tuner is None:
        return None
    return {"plan": dict(tuner.plan), "ratio": self._hvd_topk.schedule.ratio,
            "costs": None if tuner.costs is None else tuner.costs._asdict(), "history": list(tuner.history)}


_OVERRIDES = {"__init__": _init, "_allreduce_grad_async": _allreduce_grad_async,
              "synchronize": _synchronize, "step": _step, "zero_grad": _zero_grad, "state_dict": _state_dict,
              "load_state_dict": _load_state_dict, "set_epoch": _set_epoch, "stats": _stats,
              "auto_state": _auto_state}


def _check_groups(groups, optimizer):
    """ValueError unless ``groups`` is None, an int >= 1 or a list of lists of the optimizer's
    parameters, each at most once (Horovod's accepted values)."""
    if groups is None:
        return
    if isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
        valid = groups >= 1
    else:
        valid = isinstance(groups, list) and all(isinstance(g, (list, tuple)) for g in groups)
    if not valid:
        raise ValueError(f"groups must be None, an integer >= 1 or a list of lists of parameters, got {groups!r}")
    if not isinstance(groups, list):
        return
    mine = {id(q) for group in optimizer.param_groups for q in group["params"]}
    seen = set()
    for group in groups:
        for q in group:
            if not isinstance(q, torch.Tensor) or id(q) not in mine:
                raise ValueError("groups: every entry must be a parameter of the optimizer")
            if id(q) in seen:
                raise ValueError("groups: a parameter can only appear once")
            seen.add(id(q))


def _adaptive_ratios(adaptive_ratio, ratio, communication):
    """Candidate ratios (descending) of the adaptive ratio, or None; ValueError on bad bounds."""
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
    if communication == "dense":
        raise ValueError("adaptive_ratio needs a compressing communication ('artopk', 'allgather', "
                         "'split_reduce' or 'auto'), got communication='dense'")
    if not low <= ratio <= high:
        raise ValueError(f"the compression's ratio {ratio} (where the adaptive ratio starts) must lie within "
                         f"adaptive_ratio's bounds [{low}, {high}]")
    ratios = sorted({c for c in DEFAULT_RATIOS if low <= c <= high} | {ratio}, reverse=True)
    if len(ratios) < 2:
        raise ValueError(f"adaptive_ratio bounds [{low}, {high}] leave fewer than two candidate ratios "
                         f"(candidates: {DEFAULT_RATIOS} and the start ratio {ratio})")
    return tuple(ratios)
