"""The methods of ``hvd_topk.DistributedOptimizer``'s class: Horovod's ``_DistributedOptimizer`` with these
overrides (``OVERRIDES``), in Horovod's style (``super(self.__class__, self)``).

The one extension point is ``_allreduce_grad_async(p)``: it returns a *callable* handle (Horovod's
``synchronize`` calls it) that finishes our transport and returns the aggregated dense gradient. The
step itself is ``hvd_topk.step.coordinator.StepCoordinator`` (``self._hvd_topk``). Horovod is not edited or
patched.
"""
import time
import warnings

from horovod.common.util import split_list
from horovod.torch import mpi_ops
from horovod.torch.compression import Compression
from horovod.torch.functions import broadcast_object
from horovod.torch.optimizer import _DistributedOptimizer

from .bucket import GLOBAL_KEY
from .checkpoint import STATE_KEY, check_loadable, coordinator_state, load_coordinator_state
from ..transports.collectives import Reduction
from .update import update_step

__all__ = ["OVERRIDES"]


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
    state = self._hvd_topk
    pooled = state.selection == "global" and sparse
    state.sparse_numels = {GLOBAL_KEY: sum(sparse.values())} if pooled else sparse
    state.bucket_numels = sparse if pooled else {}
    # buckets in registration order, identical on every rank (the same model registers alike)
    registered = [self._parameter_names.get(q) for group in self.param_groups for q in group["params"]]
    state.plan_keys = [GLOBAL_KEY] + registered
    state.fused.plan(state.plan_keys, state.sparse_numels, state.bucket_cap_mb)
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
    times = self._hvd_topk.stats.times
    t0, ours = time.perf_counter(), times["select"] + times["pack"]
    _DistributedOptimizer.synchronize(self)
    if self._hvd_topk.compress == "update" or not self.process_set.included():
        return                                 # nothing was sent: the gradients are this rank's own
    # the communication's seconds: those of gradients first submitted here (unused ones, the global
    # bucket) count as selection and packing
    if self._hvd_topk.end_step(comm_s=time.perf_counter() - t0 - (times["select"] + times["pack"] - ours)):
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
    t0 = time.perf_counter()
    with self._hvd_topk.momentum.hidden():
        out = super(self.__class__, self).step(closure)
    self._hvd_topk.stats.add_time("optimizer", time.perf_counter() - t0)   # inside the next step's window
    return out


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
    _show_velocities(self, state)
    state[STATE_KEY] = coordinator_state(self._hvd_topk)
    return state


def _show_velocities(self, state):
    """Momentum correction keeps SGD's momentum as this rank's velocities, outside the wrapped SGD's
    state. The state dict shows copies of them as SGD's ``momentum_buffer``, the same quantity, as dense
    Horovod's would hold: a checkpoint then carries them, and ``hvd.broadcast_optimizer_state`` finds
    the state it expects. A broadcast into the copies leaves the velocities per rank; a rank without
    velocities starts them from the buffers it received (``MomentumCorrection.correct``)."""
    velocities = self._hvd_topk.momentum.velocities
    for group, saved in zip(self.param_groups, state["param_groups"]):
        for q, pid in zip(group["params"], saved["params"]):
            u = velocities.get(self._parameter_names.get(q))
            if u is not None:                 # a new dict: torch's state dict shares the live ones
                state["state"][pid] = dict(state["state"].get(pid, {}), momentum_buffer=u.view(q.shape).clone())


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
    """Figures of the last synchronized step (``hvd_topk.step.stats.StepStats``), the residual norm, the
    ratio in use (None in a step whose compressed tensors all went low rank) and, with communication='auto',
    the probed costs and how many tensors use each transport."""
    state = self._hvd_topk
    out = {"ratio": state.schedule.ratio, **state.stats.last(), "residual_norm": state.residuals.norm()}
    return out if state.tuner is None else dict(out, **state.tuner.figures())


def _auto_state(self):
    """The automatic decisions: plan (name -> transport), ratio, probed costs and the history of
    (step, ratio, transport counts, reason); identical on every rank. None without auto/adaptive."""
    tuner = self._hvd_topk.tuner
    if tuner is None:
        return None
    return {"plan": dict(tuner.plan), "ratio": self._hvd_topk.schedule.ratio,
            "costs": None if tuner.costs is None else tuner.costs._asdict(), "history": list(tuner.history)}


OVERRIDES = {"__init__": _init, "_allreduce_grad_async": _allreduce_grad_async,
              "synchronize": _synchronize, "step": _step, "zero_grad": _zero_grad, "state_dict": _state_dict,
              "load_state_dict": _load_state_dict, "set_epoch": _set_epoch, "stats": _stats,
              "auto_state": _auto_state}
