"""hvd_topk.DistributedOptimizer: Horovod's distributed optimizer with Top-K transports and DGC.

Built like Horovod's own factory: a dynamic subclass of the user's optimizer class whose methods are
Horovod's ``_DistributedOptimizer`` with one extension point replaced: ``_allreduce_grad_async(p)``
returns a *callable* handle (Horovod's ``synchronize`` calls it) that finishes our transport and
returns the aggregated dense gradient. Horovod itself is not edited or patched.

With ``compress='update'`` the gradients stay local: at ``step()`` every rank runs the wrapped
optimizer on its own gradient, takes the change it made to the parameters (the update), puts the
parameters back, and sends the update through error feedback and the transport; the aggregated update
is then added on every rank. For Adam-type optimizers, whose per-element normalisation undoes error
feedback on gradients (an element sent once every 100 steps moves a few steps' worth, not 100).
"""
import math
import numbers
import time
import warnings
from typing import NamedTuple

import torch
from horovod.common.util import split_list
from horovod.torch import mpi_ops
from horovod.torch.compression import Compression
from horovod.torch.functions import broadcast_object
from horovod.torch.mpi_ops import Average, Sum
from horovod.torch.optimizer import _DistributedOptimizer

from .auto import DEFAULT_RATIOS, DEFAULT_WEIGHT, MODES, AutoTuner
from .comm import (Collectives, IndexPipeline, allgather_sparse_async, finite_flag, flag_raised,
                   scatter_add_gathered, star_leader)
from .compression import TopKEF
from .memory import ResidualMemory
from .sparsify import k_for, scatter_dense, sq_norm_finite, topk_indices
from .stats import StepStats

__all__ = ["DistributedOptimizer", "COMMUNICATIONS", "LEADERS", "SELECTIONS", "COMPRESSES"]

COMMUNICATIONS = ("artopk", "allgather", "dense", "auto")
COMPRESSES = ("gradient", "update")
LEADERS = ("star", "var")
SELECTIONS = ("layerwise", "global")
STATE_KEY = "hvd_topk"
GLOBAL_KEY = "__global__"        # residual and index-set key of the fused bucket (global selection)


def _check_count(name, value):
    """ValueError unless value is an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


class _Momentum(NamedTuple):
    """SGD settings of one parameter, moved out of the inner optimizer by momentum correction."""
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float


class _TopKState:
    """Everything hvd_topk keeps per optimizer, per rank. Never broadcast (residuals are per rank)."""

    _instances = 0    # creation counter: each optimizer's collectives that outlive a step get their own names

    def __init__(self, names, compression, communication, selection, leader, value_dtype, warmup_steps,
                 warmup_epochs, clip_grad_norm, op, gradient_predivide_factor, grad_scaler, tuner, dense_steps=0,
                 compress="gradient", local_momentum=True):
        # configuration
        self.ratio = compression.ratio        # moved by the adaptive ratio (identical on all ranks)
        self.ratio_change = None              # (first step, ratio): a decided change not yet in effect
        self.tuner = tuner                    # AutoTuner, or None: fixed transport and ratio
        self.clock = time.perf_counter        # step timing of the tuner (tests feed ranks other clocks)
        self.sparse_numels = {}               # key -> numel of every compressed tensor (or the bucket)
        self.min_numel = compression.min_numel
        self.communication, self.leader, self.value_dtype = communication, leader, value_dtype
        self.warmup_steps, self.warmup_epochs = warmup_steps, warmup_epochs
        self.dense_steps = dense_steps        # the first steps send everything (density 1)
        self.compress = compress              # "gradient", or "update": the local optimizer's change
        self.local_momentum = local_momentum  # update: False steps it without momentum when compressed
        self.clip_grad_norm, self.grad_scaler = clip_grad_norm, grad_scaler
        self.op = op
        self.prescale = 1.0 / gradient_predivide_factor if op == Average else 1.0
        self.postscale = gradient_predivide_factor if op == Average else 1.0
        self.selection = selection
        self.names = sorted(names)
        self.key_index = {name: i for i, name in enumerate(self.names + [GLOBAL_KEY])}  # same on all ranks
        self.momentum = {}                    # name -> _Momentum, for momentum-corrected parameters
        # per-rank state
        self.residuals = ResidualMemory()     # name -> v (DGC) or e (plain error feedback)
        self.velocities = {}                  # name -> u, DGC momentum buffer
        # Names identical on all ranks (the ranks create their optimizers in the same order) and distinct
        # between optimizers: one optimizer's index sets or score may still be in flight in another's step.
        self.tag = f"hvd_topk.opt{_TopKState._instances}"
        _TopKState._instances += 1
        self.index_sets = IndexPipeline(f"{self.tag}.indices")
        self.collectives = Collectives(f"{self.tag}.group")   # groups set by _init (Horovod's ``groups``)
        self.step = 0                         # synchronized steps, identical on all ranks
        self.epoch = 0
        self.score = 0.0                      # VAR: EWMA of this rank's squared gradient norm
        self.scores = None                    # VAR: everybody's scores, gathered once per step
        self.score_handle = None
        self.step_sq_norm = 0.0
        self.stats = StepStats()
        self.bucket = []                      # global selection: (name, p, g, u_new) of this step
        self.bucket_out = {}                  # global selection: name -> aggregated gradient
        self.commits = []                     # state updates of this step, applied if it is finite
        self.sent = set()                     # sparse keys submitted this step (layerwise selection)
        self.nonfinite = False                # some gradient of this step was non-finite somewhere
        self.last_end = None                  # clock() at the end of the previous step

    # -- schedules ---------------------------------------------------------------------------------

    def density(self, step):
        """Density of ``step``: the warm-up schedule of the ratio in effect at that step."""
        ratio = self.ratio_change[1] if self.ratio_change and step >= self.ratio_change[0] else self.ratio
        return self.density_with(ratio, step)

    def density_with(self, ratio, step):
        """Density 1 for the first D dense steps; then the DGC warm-up, ratio ** ((t + 1) / (W + 1))
        for t < W steps after them (or for the first W epochs); then ratio."""
        if step < self.dense_steps:
            return 1.0
        if self.warmup_epochs and self.epoch < self.warmup_epochs:
            return ratio ** ((self.epoch + 1) / (self.warmup_epochs + 1))
        if step - self.dense_steps < self.warmup_steps:
            return ratio ** ((step - self.dense_steps + 1) / (self.warmup_steps + 1))
        return ratio

    def is_sparse(self, p):
        """Whether p's gradient is compressed (else a plain allreduce)."""
        return not (self.communication == "dense" or p.dim() <= 1 or p.numel() < self.min_numel
                    or not p.is_floating_point())

    def leader_for(self, name, step):
        """Rank that picks the index set of ``name`` for ``step`` (identical on all ranks)."""
        if self.leader == "var" and self.scores is not None:
            return int(torch.argmax(self.scores))            # lowest rank wins ties
        return star_leader(self.key_index[name], step, mpi_ops.size())

    # -- one parameter -----------------------------------------------------------------------------

    def submit(self, p, name, update=None):
        """Start the transport of p's gradient (or, with compress='update', of ``update``: this rank's
        change of p, sent as it is); returns a callable giving the aggregate."""
        if self.leader == "var" and self.score_handle is not None:
            self.scores = mpi_ops.synchronize(self.score_handle).reshape(-1)
            self.score_handle = None
        if update is not None:
            g = update.reshape(-1)
        else:
            g = p.grad.reshape(-1)
            if self.grad_scaler is not None:
                g = g * (1.0 / self.grad_scaler.get_scale())
            g = self.clip_local(g)
        mom = self.momentum.get(name)
        u_new = None
        if mom is not None:
            # one fused pass per term (torch.add with alpha), not a temporary per product
            if mom.weight_decay:
                g = torch.add(g, p.detach().reshape(-1), alpha=mom.weight_decay)
            u = self.velocities.get(name)
            if u is None:
                u_new = g.clone()
            elif mom.dampening == 0:
                u_new = torch.add(g, u, alpha=mom.momentum)
            else:
                u_new = u.mul(mom.momentum).add_(g, alpha=1.0 - mom.dampening)
            g = torch.add(g, u_new, alpha=mom.momentum) if mom.nesterov else u_new
        if not self.is_sparse(p):
            return self._submit_dense(p, name, g, u_new)
        return self._submit_sparse(p, name, g, u_new)

    def clip_local(self, g):
        """Local gradient clipping (DGC): g scaled to norm clip_grad_norm * size**-0.5 if it is longer."""
        if self.clip_grad_norm is not None:
            limit = self.clip_grad_norm / math.sqrt(mpi_ops.size())
            norm = float(g.norm())
            if norm > limit:
                g = g * (limit / norm)
        return g

    def _submit_dense(self, p, name, g, u_new):
        """Plain allreduce of a tensor that is never compressed, in its own dtype (momentum, if
        corrected, is applied locally first: it is linear). g (u_new itself, with momentum
        correction) is only read, so no copy is made."""
        finish = self._dense_transport(name, g, collective="dense", keep_dtype=True)

        def done():
            out = finish()[0]
            if out is None:                            # identical on all ranks: read from the sum
                return self._skipped(p)
            if u_new is not None:
                self.commits.append(lambda: self.velocities.__setitem__(name, u_new))
            return self._unscale_out(out).reshape(p.shape)
        return done

    def _submit_sparse(self, p, name, g, u_new):
        if self.selection == "global":
            self.bucket.append((name, p, g, u_new))
            return lambda: self._bucket_output(name)
        finish = self._sparse_transport(name, g)
        self.sent.add(name)
        if len(self.sent) == len(self.sparse_numels):
            # The step's last compressed tensor: start sharing the next step's AR-Topk index sets now,
            # in the same Horovod cycle as the values, not after synchronize() (a cycle later, and the
            # next step's first select would wait for it).
            self.index_sets.flush()

        def done():
            dense, residual, indices = finish()
            if dense is None:
                return self._skipped(p)
            self.commits.append(lambda: self._commit(name, residual, u_new, indices))
            return self._unscale_out(dense.to(p.dtype)).reshape(p.shape)
        return done

    def _bucket_output(self, name):
        """Global selection: on the first call of a step, run one transport over every sparse tensor
        of the step, concatenated in name order (identical on all ranks); then hand out slices."""
        if self.bucket:
            entries = sorted(self.bucket, key=lambda e: e[0])
            self.bucket = []
            flat_g = torch.cat([g for _, _, g, _ in entries])
            dense, residual, indices = self._sparse_transport(GLOBAL_KEY, flat_g)()
            if dense is not None:
                self.commits.append(lambda: self._commit(GLOBAL_KEY, residual, None, None))
            offset = 0
            for n, p, g, u_new in entries:
                if dense is None:
                    self.bucket_out[n] = self._skipped(p)
                else:
                    part = None if indices is None else \
                        indices[(indices >= offset) & (indices < offset + g.numel())] - offset
                    self.commits.append(lambda n=n, u_new=u_new, part=part: self._commit(n, None, u_new, part,
                                                                                        residual_too=False))
                    self.bucket_out[n] = self._unscale_out(
                        dense[offset:offset + g.numel()].to(p.dtype)).reshape(p.shape)
                offset += g.numel()
        return self.bucket_out.pop(name)

    def _sparse_transport(self, key, g):
        """Start sending the flat accumulator acc = ``g`` + residual of ``key``; returns ``finish() ->
        (aggregated dense or None if some rank was non-finite, new residual, sent indices or None for
        all)``."""
        t0 = time.perf_counter()
        n = g.numel()
        k, k_next = k_for(n, self.density(self.step)), k_for(n, self.density(self.step + 1))
        mode = self.communication
        gains = self.tuner is not None and self.tuner.wants_gains(self.step)
        if self.tuner is not None:
            mode = self.tuner.mode(key, mode)
            if mode == "dense":           # everything: the residual is flushed
                k = n
        if k == n and not gains:          # density 1 (dense steps, ratio 1.0, auto's dense plan)
            return self._dense_transport(key, self.residuals.compensate(key, g, copy=False))
        acc = self.residuals.compensate(key, g)
        acc_sq, finite = sq_norm_finite(acc)
        flag = finite_flag(finite, acc)
        self.step_sq_norm += acc_sq if math.isfinite(acc_sq) else 0.0
        if gains and finite:
            self.tuner.observe_acc(acc)
        if k == n:
            mode = "dense"
        vdtype = self.value_dtype or acc.dtype
        if mode in ("artopk", "dense"):
            if k == n:
                indices, values = None, acc
            else:
                indices, values = self.index_sets.select(key, acc, g, k, self.leader_for(key, self.step),
                                                         k_next, self.leader_for(key, self.step + 1))
            buf = torch.cat([values.to(vdtype), flag.to(vdtype)])
            self.stats.add_sent(buf.numel() * buf.element_size(), sq_norm_finite(values)[0], acc_sq,
                                select_s=time.perf_counter() - t0)
            wait = self.collectives.allreduce(key, buf, f"hvd_topk.values.{key}", self.op, self.prescale,
                                              self.postscale, inplace=True)
            residual = None if indices is None else acc.index_fill_(0, indices, 0)

            def finish():
                out = wait()
                if flag_raised(out[-1]):
                    return None, None, None
                vals = out[:-1].to(acc.dtype)
                return (vals if indices is None else scatter_dense(vals, indices, n)), residual, indices
            return finish

        indices = torch.arange(n, device=acc.device) if k == n else topk_indices(acc, k)
        values = acc.index_select(0, indices)
        vbuf = torch.cat([values.to(vdtype), flag.to(vdtype)])
        self.stats.add_sent(vbuf.numel() * vbuf.element_size() + 4 * k, sq_norm_finite(values)[0], acc_sq,
                            select_s=time.perf_counter() - t0)
        waits = allgather_sparse_async(self.collectives, key, vbuf, torch.cat([indices, indices.new_full((1,), n)]),
                                       f"hvd_topk.allgather.{key}")
        residual = None if k == n else acc.index_fill_(0, indices, 0)

        def finish():
            # Every rank's flag sits at index n (one past the end) of its set: the last entry of a
            # dense vector of n + 1 elements sums all flags.
            dense = scatter_add_gathered(waits, n + 1, acc.dtype)
            if flag_raised(dense[-1]):
                return None, None, None
            dense = dense[:-1]
            if self.op == Average:
                dense.mul_(1.0 / mpi_ops.size())
            return dense, residual, None if k == n else indices
        return finish

    def _dense_transport(self, key, acc, collective="values", keep_dtype=False):
        """Density 1 as cheaply as stock Horovod: ``acc`` (possibly the gradient itself: it is only read)
        goes to an out-of-place allreduce, with no flag appended, no norm and no copy before sending;
        a non-finite rank shows in the sum, which is read after (identical on all ranks). The residual
        is flushed (None). The stats count these tensors as dense: their compression gain is 1 by
        definition. Values go in ``value_dtype`` unless ``keep_dtype`` (tensors never compressed)."""
        vdtype = acc.dtype if keep_dtype else self.value_dtype or acc.dtype
        buf = acc if acc.dtype == vdtype else acc.to(vdtype)
        self.stats.add_sent(buf.numel() * buf.element_size(), sent_sq=0.0, acc_sq=0.0, dense=True)
        wait = self.collectives.allreduce(key, buf, f"hvd_topk.{collective}.{key}", self.op, self.prescale,
                                          self.postscale)

        def finish():
            out = wait()
            if not sq_norm_finite(out)[1]:
                return None, None, None
            return out.to(acc.dtype), None, None
        return finish

    def _commit(self, name, residual, u_new, indices, residual_too=True):
        """Keep the new residual and momentum; DGC factor masking zeroes momentum where values were sent."""
        if residual_too:
            self.residuals.update(name, residual)
        if u_new is not None:
            if indices is not None:
                u_new.index_fill_(0, indices, 0)
            self.velocities[name] = u_new

    def _skipped(self, p):
        """Some rank's gradient was non-finite: the whole step is non-finite (see ``end_step``)."""
        self.nonfinite = True
        return torch.full(p.shape, float("nan"), dtype=p.dtype, device=p.device)

    def _unscale_out(self, dense):
        """Hand the loss scaler gradients in its scaled units (we accumulate unscaled ones)."""
        return dense if self.grad_scaler is None else dense * self.grad_scaler.get_scale()

    def end_step(self, comm_s):
        """After every parameter is synchronized: commit the step's residuals and momentum only if
        every gradient on every rank was finite (the decision is identical on all ranks, since it is
        read from aggregated values); advance the step; share the VAR score. Returns True if the
        step was non-finite."""
        self.index_sets.flush()               # the index sets, unless shared at the last submit
        self.sent = set()
        self.collectives.end_step()
        nonfinite = self.nonfinite
        if not nonfinite:
            for commit in self.commits:
                commit()
        self.commits, self.nonfinite = [], False
        self.stats.skipped = nonfinite
        self.stats.end_step(density=self.density(self.step), comm_s=comm_s)
        now = self.clock()
        # collective, at the same step on every rank; from the last dense step on (the probe then
        # plans for the density that follows)
        if self.tuner is not None and self.step + 1 >= self.dense_steps:
            change = self.tuner.end_step(self, self.step, 0.0 if self.last_end is None else now - self.last_end,
                                         comm_s)
            if change is not None:
                self.ratio_change = change
            now = self.clock()           # a probe's time is not the next step's
        self.last_end = now
        self.step += 1
        if self.ratio_change is not None and self.step >= self.ratio_change[0]:
            self.ratio, self.ratio_change = self.ratio_change[1], None
        if self.leader == "var" and mpi_ops.size() > 1:
            self.score = 0.9 * self.score + 0.1 * self.step_sq_norm
            self.score_handle = mpi_ops.allgather_async(torch.tensor([self.score], dtype=torch.float64),
                                                        name=f"{self.tag}.var.score")
        self.step_sq_norm = 0.0
        return nonfinite

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self):
        if self.score_handle is not None:
            self.scores = mpi_ops.synchronize(self.score_handle).reshape(-1)
            self.score_handle = None
        return {"world_size": mpi_ops.size(), "rank": mpi_ops.rank(),
                "names": self.names, "selection": self.selection, "step": self.step, "epoch": self.epoch,
                "residuals": self.residuals.state_dict(),
                "velocities": {k: v.clone() for k, v in self.velocities.items()},
                "index_sets": self.index_sets.state_dict(), "score": self.score,
                "scores": None if self.scores is None else self.scores.clone(),
                "ratio": self.ratio, "ratio_change": self.ratio_change,
                "tuner": None if self.tuner is None else self.tuner.state_dict()}

    def check_loadable(self, state):
        """ValueError if ``state`` belongs to another world size or model."""
        if state["world_size"] != mpi_ops.size():
            raise ValueError(f"checkpoint holds the residuals of {state['world_size']} ranks, this job "
                             f"has {mpi_ops.size()}; residuals are per rank and cannot be re-split "
                             "(start the optimizer fresh, or resume with the same number of ranks)")
        if state["names"] != self.names or state["selection"] != self.selection:
            raise ValueError("checkpoint was written for a model with other parameters "
                             f"({len(state['names'])} vs {len(self.names)} named tensors) or another "
                             f"selection ({state['selection']!r} vs {self.selection!r})")

    def load_state_dict(self, state):
        self.check_loadable(state)
        self.step, self.epoch = state["step"], state["epoch"]
        self.residuals.load_state_dict(state["residuals"])
        self.velocities = {k: v.clone() for k, v in state["velocities"].items()}
        self.index_sets.load_state_dict(state["index_sets"])
        self.score, self.scores = state["score"], state["scores"]
        self.score_handle = None
        self.ratio = state.get("ratio", self.ratio)
        self.ratio_change = state.get("ratio_change")
        if self.tuner is not None and state.get("tuner") is not None:
            self.tuner.load_state_dict(state["tuner"])

    def auto_stats(self):
        """Figures of the automatic decisions for ``stats()`` (numbers only, for TensorBoard)."""
        out = {"ratio": self.ratio}
        if self.tuner is not None and self.tuner.costs is not None:
            out.update(alpha=self.tuner.costs.alpha, beta=self.tuner.costs.beta)
            if self.tuner.auto_transport:
                for mode in MODES:
                    out[f"auto_{mode}"] = sum(1 for v in self.tuner.plan.values() if v == mode)
        return out


# -- methods of the dynamic class (Horovod's style: super(self.__class__, self)) ---------------------

def _init(self, params, named_parameters, hvd_topk_state, backward_passes_per_step, op,
          gradient_predivide_factor, process_set, momentum_correction, groups):
    _DistributedOptimizer.__init__(self, params, named_parameters, Compression.none,
                                   backward_passes_per_step, op, gradient_predivide_factor,
                                   None, False, process_set)
    self._hvd_topk = hvd_topk_state
    if not self._grad_accs and self.process_set.included():
        self._register_hooks()        # Horovod skips hooks at world size 1; we still need them
    sparse = {self._parameter_names[q]: q.numel() for group in self.param_groups for q in group["params"]
              if q.requires_grad and self._hvd_topk.is_sparse(q)}
    self._hvd_topk.sparse_numels = {GLOBAL_KEY: sum(sparse.values())} if \
        self._hvd_topk.selection == "global" and sparse else sparse
    if groups is not None:
        self._hvd_topk.collectives = Collectives(f"{self._hvd_topk.tag}.group", _key_groups(self, groups))
    if momentum_correction:
        for group in self.param_groups:
            mom = _Momentum(group.get("momentum", 0.0), group.get("dampening", 0.0),
                            bool(group.get("nesterov", False)), group.get("weight_decay", 0.0))
            for q in group["params"]:
                self._hvd_topk.momentum[self._parameter_names[q]] = mom
            # The inner optimizer applies the aggregated update without momentum or weight decay:
            # both already live in the per-rank buffers (DGC momentum correction).
            group.update(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)


def _key_groups(self, groups):
    """Horovod's ``groups`` as lists of keys: an int N splits the parameters (rank 0's order, as Horovod
    does) into N contiguous groups; a list of lists of parameters gives the groups, every other
    parameter is alone. With global selection the compressed tensors travel in the bucket instead."""
    params = [q for group in self.param_groups for q in group["params"] if q.requires_grad]
    names = broadcast_object([self._parameter_names[q] for q in params], root_rank=0, name="hvd_topk.groups")
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
    return self._hvd_topk.submit(p, self._parameter_names.get(p)), None


def _synchronize(self):
    t0 = time.perf_counter()
    _DistributedOptimizer.synchronize(self)
    if self._hvd_topk.compress == "update":
        return                                 # nothing was sent: the gradients are this rank's own
    if self._hvd_topk.end_step(comm_s=time.perf_counter() - t0):
        # Non-finite somewhere: every gradient of the step is NaN on every rank, so a loss scaler
        # (or the check in step()) skips the whole step, which the untouched residuals assume.
        for q in self._requires_update:
            if q.grad is not None:
                q.grad.fill_(float("nan"))


def _step(self, closure=None):
    if self._should_synchronize:
        if self._synchronized:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(); this synchronizes twice")
        self.synchronize()
    self._synchronized = False
    if self._hvd_topk.compress == "update":
        return _update_step(self, closure)
    if self._hvd_topk.stats.last().get("skipped"):
        warnings.warn("hvd_topk: a gradient was non-finite on some rank; the step is skipped on every "
                      "rank and residuals are unchanged")
        return None
    return super(self.__class__, self).step(closure)


def _update_step(self, closure):
    """compress='update': the wrapped optimizer steps on this rank's gradient; its change of every
    parameter goes through error feedback and the transport, and the aggregate is added on every rank
    (the parameters stay identical: all start from the same values and add the same aggregate)."""
    state = self._hvd_topk
    t0 = time.perf_counter()
    params = [q for group in self.param_groups for q in group["params"]
              if q.requires_grad and q.grad is not None]
    # Agree on finiteness before anything changes: a non-finite gradient on any rank skips the step on
    # every rank, with the local optimizer's state (Adam's moments) and the residuals untouched.
    bad = sum(1 for q in params if not bool(torch.isfinite(q.grad).all()))
    if mpi_ops.allreduce(torch.tensor([float(bad)]), name="hvd_topk.update.finite", op=Sum).item() > 0:
        state.nonfinite = True
        state.end_step(comm_s=time.perf_counter() - t0)
        warnings.warn("hvd_topk: a gradient was non-finite on some rank; the step is skipped on every "
                      "rank; the optimizer's state and the residuals are unchanged")
        return None
    if state.clip_grad_norm is not None:
        for q in params:
            q.grad.copy_(state.clip_local(q.grad))
    before = [q.detach().clone() for q in params]
    saved = [] if state.local_momentum or state.density(state.step) >= 1.0 else _drop_momentum(self.param_groups)
    try:
        loss = super(self.__class__, self).step(closure)
    finally:
        for group, key, value in saved:
            group[key] = value
    finishes = []
    with torch.no_grad():
        for q, q0 in zip(params, before):
            update = q.sub(q0)
            q.copy_(q0)                        # bit for bit the value every rank holds
            finishes.append((q, state.submit(q, self._parameter_names.get(q), update=update)))
        outs = [(q, finish()) for q, finish in finishes]
        if state.end_step(comm_s=time.perf_counter() - t0):
            warnings.warn("hvd_topk: an update was non-finite on some rank (its gradients were finite); it "
                          "is applied on no rank and residuals are unchanged, but the optimizers' own "
                          "states have taken the step")
            return loss
        for q, out in outs:
            q.add_(out)
    return loss


def _drop_momentum(param_groups):
    """Set every group's momentum to 0 (Adam's beta1, SGD's or RMSprop's momentum) for one step;
    returns (group, key, value) to restore."""
    saved = []
    for group in param_groups:
        if "betas" in group:
            saved.append((group, "betas", group["betas"]))
            group["betas"] = (0.0, *tuple(group["betas"])[1:])
        else:
            saved.append((group, "momentum", group["momentum"]))
            group["momentum"] = 0.0
    return saved


def _zero_grad(self, set_to_none=True):
    if self._handles:
        raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                             "optimizer.step() or optimizer.synchronize(); this would race with the "
                             "gradient communication")
    return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def _state_dict(self):
    state = super(self.__class__, self).state_dict()
    state[STATE_KEY] = self._hvd_topk.state_dict()
    return state


def _load_state_dict(self, state_dict):
    state_dict = dict(state_dict)
    ours = state_dict.pop(STATE_KEY, None)
    if ours is None:
        raise ValueError("state_dict has no hvd_topk state (residuals, momentum): it was not saved "
                         "by hvd_topk.DistributedOptimizer")
    self._hvd_topk.check_loadable(ours)          # before anything is loaded
    _DistributedOptimizer.load_state_dict(self, state_dict)
    self._hvd_topk.load_state_dict(ours)


def _set_epoch(self, epoch):
    """Tell the epoch-based warm-up which epoch starts now (same value on every rank)."""
    self._hvd_topk.epoch = int(epoch)


def _stats(self):
    """Figures of the last synchronized step (``hvd_topk.stats.StepStats``), the residual norm, the
    ratio in use and, with communication='auto', how many tensors use each transport."""
    return dict(self._hvd_topk.stats.last(), residual_norm=self._hvd_topk.residuals.norm(),
                **self._hvd_topk.auto_stats())


def _auto_state(self):
    """The automatic decisions: plan (name -> transport), ratio, probed costs and the history of
    (step, ratio, transport counts, reason); identical on every rank. None without auto/adaptive."""
    tuner = self._hvd_topk.tuner
    if tuner is None:
        return None
    return {"plan": dict(tuner.plan), "ratio": self._hvd_topk.ratio,
            "costs": None if tuner.costs is None else tuner.costs._asdict(), "history": list(tuner.history)}


_OVERRIDES = {"__init__": _init, "_allreduce_grad_async": _allreduce_grad_async,
              "synchronize": _synchronize, "step": _step, "zero_grad": _zero_grad, "state_dict": _state_dict,
              "load_state_dict": _load_state_dict, "set_epoch": _set_epoch, "stats": _stats,
              "auto_state": _auto_state}


def DistributedOptimizer(optimizer, named_parameters=None, compression=TopKEF, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, process_set=mpi_ops.global_process_set,
                         momentum_correction=None, warmup_steps=0, warmup_epochs=0, clip_grad_norm=None,
                         communication="artopk", leader="star", value_dtype=None, grad_scaler=None,
                         selection="layerwise", adaptive_ratio=None, adaptive_weight=DEFAULT_WEIGHT, auto_every=50,
                         dense_steps=0, compress="gradient", local_momentum=True, groups=None):
    """Wrap ``optimizer`` for Horovod with Top-K compression, error feedback and DGC momentum correction.

    Args:
        optimizer: a torch optimizer (SGD, Adam, AdamW, ...).
        named_parameters: ``model.named_parameters()``, as for Horovod (names key the per-rank state).
        compression: ``TopKEF`` or ``TopKEF(ratio=..., min_numel=...)``: where ratio and min_numel come from.
        backward_passes_per_step, op, gradient_predivide_factor, process_set: as in Horovod;
            op is ``hvd.Average`` or ``hvd.Sum``; only the global process set is supported.
        momentum_correction: DGC momentum correction + factor masking. None: on when the optimizer has
            momentum > 0 in some group; True with no momentum raises ValueError.
        warmup_steps: DGC warm-up over this many steps, density ratio ** ((t+1)/(W+1)) then ratio.
        warmup_epochs: the same schedule per epoch; call ``opt.set_epoch(epoch)`` at each epoch start.
        dense_steps: the first dense_steps steps send every element (density 1, a plain allreduce of
            the gradient: dense Horovod); the warm-up, if any, starts after them. For Adam-type
            optimizers, whose per-element statistics are set in the first steps (as 1-bit Adam's
            dense warm-up stage).
        clip_grad_norm: local clipping of each gradient tensor to norm clip_grad_norm * size**-0.5
            before accumulation (> 0), or None.
        communication: ``'artopk'`` (shared index set, allreduce of k values), ``'allgather'`` (every
            rank's own top-k, int32 indices, scatter-add), ``'dense'`` (plain allreduce) or ``'auto'``
            (per compressed tensor, the transport the cost model with probed alpha/beta picks;
            see ``hvd_topk.auto``).
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
            byte-level LM, see README). Adam's second moment is untouched. True (default) keeps the
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
        >>> opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...                                     named_parameters=model.named_parameters(),
        ...                                     compression=TopKEF(ratio=0.001), warmup_epochs=4)
    """
    if communication not in COMMUNICATIONS:
        raise ValueError(f"communication must be one of {COMMUNICATIONS}, got {communication!r}")
    if compress not in COMPRESSES:
        raise ValueError(f"compress must be one of {COMPRESSES}, got {compress!r}")
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
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    if leader not in LEADERS:
        raise ValueError(f"leader must be one of {LEADERS}, got {leader!r}")
    warmup_steps = _check_count("warmup_steps", warmup_steps)
    warmup_epochs = _check_count("warmup_epochs", warmup_epochs)
    dense_steps = _check_count("dense_steps", dense_steps)
    backward_passes_per_step = _check_count("backward_passes_per_step", backward_passes_per_step)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step}")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, numbers.Real)
                                       or not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0):
        raise ValueError(f"clip_grad_norm must be a finite number > 0 or None, got {clip_grad_norm!r}")
    if op not in (Average, Sum):
        raise ValueError("op must be hvd.Average or hvd.Sum (Adasum is not a sum of sparse vectors)")
    if not (isinstance(gradient_predivide_factor, numbers.Real) and gradient_predivide_factor > 0):
        raise ValueError(f"gradient_predivide_factor must be a number > 0, got {gradient_predivide_factor!r}")
    if process_set is not mpi_ops.global_process_set:
        raise ValueError("process_set: only the global process set is supported")
    if value_dtype is not None and not (isinstance(value_dtype, torch.dtype) and value_dtype.is_floating_point):
        raise ValueError(f"value_dtype must be a floating torch dtype or None, got {value_dtype!r}")
    if isinstance(compression, type) and issubclass(compression, TopKEF):
        compression = compression.default()
    if not isinstance(compression, TopKEF):
        raise ValueError(f"compression must be TopKEF or a TopKEF instance, got {compression!r}")
    ratios = _adaptive_ratios(adaptive_ratio, compression.ratio, communication)
    if isinstance(adaptive_weight, bool) or not isinstance(adaptive_weight, numbers.Real) \
            or not math.isfinite(adaptive_weight) or adaptive_weight < 0:
        raise ValueError(f"adaptive_weight must be a finite number >= 0, got {adaptive_weight!r}")
    if _check_count("auto_every", auto_every) < 2:
        raise ValueError(f"auto_every must be an integer >= 2, got {auto_every!r}")
    tuner = None
    if communication == "auto" or ratios is not None:
        tuner = AutoTuner(communication == "auto", ratios, weight=float(adaptive_weight), every=int(auto_every))
    has_momentum = any(g.get("momentum", 0.0) > 0 for g in optimizer.param_groups)
    if momentum_correction is None:
        momentum_correction = has_momentum and compress == "gradient"
    elif momentum_correction and not has_momentum:
        raise ValueError("momentum_correction=True needs an optimizer with momentum > 0 "
                         f"(got {type(optimizer).__name__} without momentum)")
    named_parameters = list(named_parameters) if named_parameters is not None else \
        [(f"param.{i}.{j}", q) for i, g in enumerate(optimizer.param_groups) for j, q in enumerate(g["params"])]
    _check_groups(groups, optimizer)
    state = _TopKState([n for n, _ in named_parameters], compression, communication, selection, leader, value_dtype,
                       warmup_steps, warmup_epochs, clip_grad_norm, op, gradient_predivide_factor, grad_scaler,
                       tuner, dense_steps, compress, local_momentum)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__, **_OVERRIDES))
    return cls(optimizer.param_groups, named_parameters, state, backward_passes_per_step, op,
               gradient_predivide_factor, process_set, bool(momentum_correction), groups)


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
        raise ValueError("adaptive_ratio needs a compressing communication ('artopk', 'allgather' or "
                         "'auto'), got communication='dense'")
    if not low <= ratio <= high:
        raise ValueError(f"the compression's ratio {ratio} (where the adaptive ratio starts) must lie within "
                         f"adaptive_ratio's bounds [{low}, {high}]")
    ratios = sorted({c for c in DEFAULT_RATIOS if low <= c <= high} | {ratio}, reverse=True)
    if len(ratios) < 2:
        raise ValueError(f"adaptive_ratio bounds [{low}, {high}] leave fewer than two candidate ratios "
                         f"(candidates: {DEFAULT_RATIOS} and the start ratio {ratio})")
    return tuple(ratios)
