"""TopKEF: Top-K with error feedback as a stock Horovod ``Compressor`` (AR-Topk transport).

Stock Horovod allreduces whatever ``compress`` returns, so the output must be valid to sum across
ranks. Each rank's own top-k sits at different indices, so TopKEF uses AR-Topk (``transports.ARTopk``,
the same class the optimizer uses): all ranks send their accumulator at one *shared* index set, chosen
by a leader rank (STAR: round robin), and the k values (+ one flag) are allreduced by Horovod.

How the index set is shared without a blocking collective per parameter: see ``index_sets.IndexPipeline``
(one step stale: one asynchronous allgather per step carries every tensor's set; ``sync_indices=True``
broadcasts inside compress and waits). Which parameter a gradient belongs to: ``gradient_keys``.

Non-finite gradients: if any rank's ``acc`` holds NaN/Inf, every rank learns it from a flag that rides
in the same allreduce (dense pass-through tensors show it in their sum); then every gradient of that
step is all NaN on every rank (so a loss scaler or ``isfinite`` check skips the step everywhere) and
every rank keeps all its residuals untouched.

Sparse gradients (``nn.Embedding(sparse=True)``) that Horovod sends with its own sparse allreduce
(``sparse_as_dense=False``) pass through untouched; with ``sparse_as_dense=True`` Horovod hands
``compress`` the densified gradient, which is compressed like any other.
"""
import math
from typing import Hashable, NamedTuple, Optional

import torch
from horovod.torch import mpi_ops
from horovod.torch.compression import Compressor

from .gradient_keys import ParameterKeys, SlotSequence
from .index_sets import IndexPipeline
from .leaders import StarLeaders
from .memory import ResidualMemory
from .sparsify import k_for, sq_norm_finite
from .transports import ARTopk
from .validate import check_int, check_number

__all__ = ["TopKEF"]


_MISMATCH_HINT = ("without named_parameters TopKEF matches gradients by their position in the step, and the "
                  "ranks' orders differ (a parameter unused on some rank, two optimizers, a changed model); "
                  "use TopKEF(ratio, named_parameters=model.named_parameters())")


class _Ctx(NamedTuple):
    """What ``decompress`` needs about one compressed gradient (built by keyword)."""
    dense: bool                                # True: passed through unchanged
    key: Optional[Hashable] = None             # parameter name or slot; None: not part of the step
    shape: tuple = ()
    indices: Optional[torch.Tensor] = None     # shared index set; None when all entries were sent
    residual: Optional[torch.Tensor] = None    # candidate residual, committed only on a finite step


class _ClassOrInstance:
    """Binds a method to the class's default instance when called on the class itself.

    Horovod calls ``compression.compress(tensor)``; with ``compression=TopKEF`` that is a call on the
    class, which then uses one shared default instance (ratio 0.01)."""

    def __init__(self, fn):
        self._fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        return self._fn.__get__(cls.default() if obj is None else obj, cls)


class _PendingStep:
    """One Horovod step's candidates: the new residuals are committed at its end only if every gradient
    was finite on every rank; otherwise every gradient of the step is handed out all NaN."""

    def __init__(self):
        self.commits = []                     # (key, residual)
        self.outputs = []                     # the step's decompressed gradients, as handed to Horovod
        self.nonfinite = False                # some gradient of this step was non-finite somewhere

    def hand_out(self, out, finite, like, shape):
        if not finite and not self.nonfinite:
            self.nonfinite = True
            for earlier in self.outputs:      # Horovod set_() them into p.grad: NaN them there
                earlier.fill_(float("nan"))
        if self.nonfinite:
            out = torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
        self.outputs.append(out)
        return out

    def commit(self, memory):
        if not self.nonfinite:
            for key, residual in self.commits:
                memory.update(key, residual)
        self.__init__()


class TopKEF(Compressor):
    """Top-K sparsification with per-rank error feedback, for stock ``hvd.DistributedOptimizer``.

    Per gradient and rank: ``acc = grad + residual``; the values of ``acc`` at the shared index set
    (k = max(1, ceil(ratio * numel)) entries) are allreduced; ``residual = acc`` with those entries
    zeroed. Tensors with fewer than ``min_numel`` elements, and non-floating tensors, go unchanged.

    Args:
        ratio: fraction of elements kept per tensor, in (0, 1]. 1.0 sends everything (dense result).
        min_numel: tensors with fewer elements go dense; >= 0.
        sync_indices: share the current step's index set with a blocking broadcast inside compress,
            instead of the default: one step stale, one asynchronous allgather of every set per step.
        named_parameters: ``model.named_parameters()``, as given to the optimizer: residuals, leaders
            and index sets are then keyed by parameter name, whatever order Horovod compresses in.
            Without it they are keyed by position in the step, which must then be the same every step
            and on every rank (if the ranks' orders differ, every rank raises, naming this argument).
        process_set: the optimizer's ``process_set``, if it has one: the index sets are shared within it.

    Example:
        >>> import horovod.torch as hvd, torch
        >>> hvd.init()
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
        ...                                compression=TopKEF(ratio=0.001,
        ...                                                   named_parameters=model.named_parameters()))
        >>> model(torch.randn(8, 64)).sum().backward()
        >>> opt.step()                     # 3 of the weight's 2048 entries sent; the bias (32) dense
    """

    _instances = 0            # creation counter: names the index collectives identically on all ranks

    def __init__(self, ratio=0.01, min_numel=1024, sync_indices=False, named_parameters=None,
                 process_set=mpi_ops.global_process_set):
        self.ratio = check_number("ratio", ratio, low=0, high=1, low_open=True, what="(fraction of elements kept)")
        self.min_numel = check_int("min_numel", min_numel)
        self.sync_indices = bool(sync_indices)
        # state, per rank
        self.keys = SlotSequence() if named_parameters is None else ParameterKeys(named_parameters)
        self.memory = ResidualMemory()        # key -> residual
        self.steps = {}                       # key -> steps compressed so far (same on all ranks)
        self._step = _PendingStep()           # this step's candidates
        self.index_sets = IndexPipeline(f"hvd_topk.TopKEF{TopKEF._instances}.indices", sync=sync_indices,
                                        mismatch_hint=_MISMATCH_HINT if named_parameters is None else "",
                                        process_set=process_set, on_leaders_differ=lambda: self.steps.clear())
        self.artopk = ARTopk(self.index_sets, StarLeaders(self.keys.key_index, process_set))
        TopKEF._instances += 1

    @classmethod
    def default(cls):
        """The instance used when the class itself is passed as ``compression=``."""
        if "_default_instance" not in cls.__dict__:
            cls._default_instance = cls()
        return cls._default_instance

    @_ClassOrInstance
    def compress(self, tensor):
        """Horovod contract: ``(tensor_to_allreduce, ctx)``; the first is ``[k values..., flag]``."""
        out = self._compress(tensor)
        if self.keys.step_complete():
            self.index_sets.flush()            # the step's last gradient: share the next sets now
        return out

    def _compress(self, tensor):
        if not tensor.is_floating_point():
            return tensor, _Ctx(dense=True)
        key = self.keys.next_key(tensor)
        if getattr(self.keys, "interrupted", False):
            # The abandoned step's candidates are dropped, and so are the index sets and step counters:
            # the failure may have stopped each rank at another point of that step (one flushed its
            # sets, another did not), so only an empty start is the same on every rank.
            self._step, self.keys.interrupted = _PendingStep(), False
            self.index_sets.forget()
            self.steps.clear()
        # Before a step counter is read: if the ranks' counters differ (a rank joined an elastic job),
        # every rank learns it here and clears them (IndexPipeline), so the leaders agree from now on.
        self.index_sets.receive()
        if tensor.numel() < self.min_numel:
            return tensor, _Ctx(dense=True, key=key, shape=tuple(tensor.shape))
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        acc = self.memory.compensate(key, tensor)
        k = k_for(acc.numel(), self.ratio)
        buf, indices, _ = self.artopk.pack(key, acc, k, sq_norm_finite(acc)[1], tensor.reshape(-1), step, k)
        residual = None if indices is None else acc.index_fill_(0, indices, 0)
        return buf, _Ctx(dense=False, key=key, shape=tuple(tensor.shape), indices=indices, residual=residual)

    @_ClassOrInstance
    def decompress(self, tensor, ctx):
        """Horovod contract: the dense aggregated gradient. The step's residuals are committed when
        its last gradient is decompressed, and only if every gradient was finite on every rank."""
        if ctx is None or (ctx.dense and ctx.key is None):
            return tensor        # Horovod's sparse allreduce (ctx None), or non-floating: not of the step
        self.keys.finish_one()
        if ctx.dense:
            out = tensor
            finite = sq_norm_finite(tensor.reshape(-1))[1]     # the sum: identical on all ranks
        else:
            out = ARTopk.unpack(tensor, ctx.indices, math.prod(ctx.shape), tensor.dtype)
            finite = out is not None
            if finite:
                out = out.reshape(ctx.shape)
            self._step.commits.append((ctx.key, ctx.residual))
        out = self._step.hand_out(out, finite, tensor, ctx.shape)
        if self.keys.pending == 0:             # Horovod compresses all before it decompresses any
            self.index_sets.flush()            # unless the last compress did (not in the first step)
            self._step.commit(self.memory)
        return out

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self):
        """This rank's residuals, step counters and pending index sets (waits for in-flight ones)."""
        return {"ratio": self.ratio, "signatures": list(getattr(self.keys, "signatures", [])),
                "residuals": self.memory.state_dict(), "steps": dict(self.steps),
                "next_indices": self.index_sets.state_dict()}

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned on this rank."""
        self.keys.restore(state["signatures"])
        self.memory.load_state_dict(state["residuals"])
        self.steps = dict(state["steps"])
        self.index_sets.load_state_dict(state["next_indices"])
