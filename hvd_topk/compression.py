"""TopKEF: Top-K with error feedback as a stock Horovod ``Compressor``.

Stock Horovod allreduces whatever ``compress`` returns and hands the sum to ``decompress``. Every
rank's own top-k sits at different indices, so their values cannot simply be summed there. TopKEF
therefore runs one of hvd_topk's transports (``hvd_topk.transports``, the same classes the optimizer
drives) with Horovod's public asynchronous collectives, named per parameter:

- ``split_reduce`` (default) and ``allgather`` start their first collective in ``compress`` and hand
  Horovod only a 4-element token (``hvd_topk.op_token``: Horovod's op, and a check that every rank
  keyed the gradient alike). Horovod calls every ``compress`` of a step before its first
  ``decompress``, so at the first ``decompress`` every rank has started the same first-phase
  collectives, and split_reduce runs its later phases for all tensors in one agreed (sorted) order:
  no deadlock, whatever order the ranks' gradients became ready in.
- ``artopk``: every rank sends its accumulator at one leader's shared index set (``index_sets``), and
  Horovod's own allreduce sums the k values (+ one flag). Fewest collectives; one leader's choice.
- ``dense`` (or ratio 1.0): the gradient + one flag go to Horovod's allreduce: dense Horovod.

Which parameter a gradient belongs to: ``gradient_keys``.

Non-finite gradients: if any rank's ``acc`` holds NaN/Inf, every rank learns it (a flag in the same
collective); then every gradient of that step is all NaN on every rank (so a loss scaler or
``isfinite`` check skips the step everywhere) and every rank keeps all its residuals untouched.

Sparse gradients (``nn.Embedding(sparse=True)``) that Horovod sends with its own sparse allreduce
(``sparse_as_dense=False``) pass through untouched; with ``sparse_as_dense=True`` Horovod hands
``compress`` the densified gradient, which is compressed like any other.
"""
import math
from typing import Hashable, NamedTuple, Optional

import torch
from horovod.torch import mpi_ops
from horovod.torch.compression import Compressor

from .comm import Collectives
from .gradient_keys import ParameterKeys, SlotSequence
from .index_sets import IndexPipeline
from .leaders import StarLeaders
from .memory import ResidualMemory
from .op_token import OpToken
from .regions import Regions
from .sparsify import k_for, sq_norm_finite
from .transports import ARTopk, SparseAllgather, SplitReduce
from .validate import check_choice, check_int, check_number

__all__ = ["TopKEF", "STOCK_COMMUNICATIONS"]

STOCK_COMMUNICATIONS = ("split_reduce", "allgather", "artopk", "dense")


_MISMATCH_HINT = ("without named_parameters TopKEF matches gradients by their position in the step, and the "
                  "ranks' orders differ (a parameter unused on some rank, two optimizers, a changed model); "
                  "use TopKEF(ratio, named_parameters=model.named_parameters())")


class _Ctx(NamedTuple):
    """What ``decompress`` needs about one compressed gradient (built by keyword)."""
    dense: bool                                # True: passed through unchanged
    key: Optional[Hashable] = None             # parameter name or slot; None: not part of the step
    shape: tuple = ()
    indices: Optional[torch.Tensor] = None     # artopk: shared index set; None when all entries were sent
    residual: Optional[torch.Tensor] = None    # artopk: candidate residual, committed only on a finite step
    started: object = None                     # split_reduce/allgather: the transport in flight
    acc: Optional[torch.Tensor] = None         # ... and the accumulator, whose sent entries leave the residual


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

    Per gradient and rank: ``acc = grad + residual``; the transport sends k = max(1, ceil(ratio *
    numel)) entries of ``acc``; ``residual = acc`` with the entries that left this rank zeroed.
    Tensors with fewer than ``min_numel`` elements, and non-floating tensors, go unchanged.

    Args:
        ratio: fraction of elements kept per tensor, in (0, 1]. 1.0 sends everything (dense result).
        min_numel: tensors with fewer elements go dense; >= 0.
        communication: the transport (module docstring): ``'split_reduce'`` (default: every rank's own
            top-k, the global top-k of the sums kept), ``'allgather'`` (every rank's own top-k, all
            kept), ``'artopk'`` (one leader's index set) or ``'dense'``.
        sync_indices: artopk only: share the current step's index set with a blocking broadcast
            inside compress, instead of the default: one step stale, one asynchronous allgather of
            every set per step.
        named_parameters: ``model.named_parameters()``, as given to the optimizer: residuals and the
            transports' state are then keyed by parameter name, whatever order Horovod compresses in.
            Without it they are keyed by position in the step, which must then be the same every step
            and on every rank (if the ranks' orders differ, every rank raises, naming this argument).
        process_set: the optimizer's ``process_set``, if it has one: the transport runs within it.
        budget: split_reduce keeps the largest ``budget * k`` of the summed entries (>= 1): room for
            the ranks' own top-k entries where their sets disagree (non-IID data), at budget * k rows
            gathered by every rank. ``hvd_topk.DistributedOptimizer`` reads it from here too.

    Horovod's ``op`` may be Average or Sum (``gradient_predivide_factor`` included); Adasum raises at
    the first step, on every rank.

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

    _instances = 0            # creation counter: names the collectives identically on all ranks

    def __init__(self, ratio=0.01, min_numel=1024, sync_indices=False, named_parameters=None,
                 process_set=mpi_ops.global_process_set, communication="split_reduce", budget=1.0):
        self.ratio = check_number("ratio", ratio, low=0, high=1, low_open=True, what="(fraction of elements kept)")
        self.min_numel = check_int("min_numel", min_numel)
        self.communication = check_choice("communication", communication, STOCK_COMMUNICATIONS)
        self.budget = check_number("budget", budget, low=1, what="(multiple of k kept by split_reduce)")
        self.sync_indices = bool(sync_indices)
        tag, hint = f"hvd_topk.TopKEF{TopKEF._instances}", _MISMATCH_HINT if named_parameters is None else ""
        TopKEF._instances += 1
        # state, per rank
        self.keys = SlotSequence() if named_parameters is None else ParameterKeys(named_parameters)
        self.memory = ResidualMemory()        # key -> residual
        self.steps = {}                       # key -> steps compressed so far (same on all ranks)
        self._step = _PendingStep()           # this step's candidates
        self.index_sets = IndexPipeline(f"{tag}.indices", sync=sync_indices, mismatch_hint=hint,
                                        process_set=process_set, on_leaders_differ=lambda: self.steps.clear())
        self.artopk = ARTopk(self.index_sets, StarLeaders(self.keys.key_index, process_set))
        # Sums, not averages: the op is read from the token at decompress (hvd_topk.op_token).
        collectives = Collectives(f"{tag}.group", process_set=process_set)
        self.transports = {"split_reduce": SplitReduce(collectives, False, Regions(), f"{tag}.split",
                                                       mismatch_hint=hint, budget=self.budget),
                           "allgather": SparseAllgather(collectives, False, name=f"{tag}.allgather")}
        self.token = OpToken(process_set, mismatch_hint=hint or _MISMATCH_HINT)
        self.process_set = process_set

    @classmethod
    def default(cls):
        """The instance used when the class itself is passed as ``compression=``."""
        if "_default_instance" not in cls.__dict__:
            cls._default_instance = cls()
        return cls._default_instance

    @_ClassOrInstance
    def compress(self, tensor):
        """Horovod contract: ``(tensor_to_allreduce, ctx)``: the token, ``[k values..., flag]`` or the
        gradient itself (module docstring)."""
        out = self._compress(tensor)
        if self.communication == "artopk" and self.keys.step_complete():
            self.index_sets.flush()            # the step's last gradient: share the next sets now
        return out

    def _compress(self, tensor):
        if not tensor.is_floating_point():
            return tensor, _Ctx(dense=True)
        key = self.keys.next_key(tensor)
        if getattr(self.keys, "interrupted", False):
            # The abandoned step's candidates are dropped, and so are the index sets, phases in flight
            # and step counters: the failure may have stopped each rank at another point of that step
            # (one flushed its sets, another did not), so only an empty start is the same on every rank.
            self._step, self.keys.interrupted = _PendingStep(), False
            self.index_sets.forget()
            self.transports["split_reduce"].forget()
            self.steps.clear()
        if self.communication == "artopk":
            # Before a step counter is read: if the ranks' counters differ (a rank joined an elastic
            # job), every rank learns it here and clears them (IndexPipeline), so the leaders agree.
            self.index_sets.receive()
        if tensor.numel() < self.min_numel:
            return tensor, _Ctx(dense=True, key=key, shape=tuple(tensor.shape))
        acc = self.memory.compensate(key, tensor)
        k = k_for(acc.numel(), self.ratio)
        finite = sq_norm_finite(acc)[1]
        if self.communication in self.transports and k < acc.numel():
            started = self.transports[self.communication].start(key, acc, k, finite)
            return (self.token.make(key, tensor),
                    _Ctx(dense=False, key=key, shape=tuple(tensor.shape), started=started, acc=acc))
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        if self.communication != "artopk":
            k = acc.numel()                    # dense: everything, through Horovod's allreduce
        buf, indices, _ = self.artopk.pack(key, acc, k, finite, tensor.reshape(-1), step, k)
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
            out, residual = self._unpack(tensor, ctx)
            finite = out is not None
            if finite:
                out = out.reshape(ctx.shape)
            self._step.commits.append((ctx.key, residual))
        out = self._step.hand_out(out, finite, tensor, ctx.shape)
        if self.keys.pending == 0:             # Horovod compresses all before it decompresses any
            if self.communication == "artopk":
                self.index_sets.flush()        # unless the last compress did (not in the first step)
            self._step.commit(self.memory)
        return out

    def _unpack(self, reduced, ctx):
        """(flat aggregate or None if non-finite somewhere, candidate residual) of one gradient."""
        if ctx.started is None:
            return ARTopk.unpack(reduced, ctx.indices, math.prod(ctx.shape), reduced.dtype), ctx.residual
        average = self.token.average(reduced, ctx.key)     # raises, on every rank, before any value is used
        outcome = ctx.started.finish()
        if outcome.aggregate is not None and average:
            outcome.aggregate.mul_(1.0 / self.process_set.size())
        residual = None if outcome.sent is None else ctx.acc.index_fill_(0, outcome.sent, 0)
        return outcome.aggregate, residual

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self):
        """This rank's residuals, step counters and pending index sets (waits for in-flight ones)."""
        return {"ratio": self.ratio, "communication": self.communication,
                "signatures": list(getattr(self.keys, "signatures", [])),
                "residuals": self.memory.state_dict(), "steps": dict(self.steps),
                "next_indices": self.index_sets.state_dict(),
                "regions": self.transports["split_reduce"].regions.state_dict()}

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned on this rank."""
        self.keys.restore(state["signatures"])
        self.memory.load_state_dict(state["residuals"])
        self.steps = dict(state["steps"])
        self.index_sets.load_state_dict(state["next_indices"])
        self.transports["split_reduce"].forget()
        self.transports["split_reduce"].regions.load_state_dict(state.get("regions"))
