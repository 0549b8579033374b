"""TopKEF: Top-K with error feedback as a stock Horovod ``Compressor``.

Stock Horovod allreduces whatever ``compress`` returns and hands the sum to ``decompress``. Every
rank's own top-k sits at different indices, so their values cannot simply be summed there. TopKEF
therefore runs one of hvd_topk's transports (``hvd_topk.transports``, the same classes the optimizer
drives) with Horovod's public asynchronous collectives, named per parameter:

- ``split_reduce`` (default) and ``allgather`` start their first collective in ``compress`` and hand
  Horovod only a 4-element token (``hvd_topk.step.op_token``: Horovod's op, and a check that every rank
  keyed the gradient alike). Horovod calls every ``compress`` of a step before its first
  ``decompress``, so at the first ``decompress`` every rank has started the same first-phase
  collectives, and split_reduce runs its later phases for all tensors in one agreed (sorted) order:
  no deadlock, whatever order the ranks' gradients became ready in.
- ``artopk``: every rank sends its accumulator at one leader's shared index set (``index_sets``), and
  Horovod's own allreduce sums the k values (+ one flag; + the token in a tensor's first step, which
  checks the op and process set before the index sets' first allgather). Fewest collectives; one
  leader's choice.
- ``dense`` (or ratio 1.0): the gradient + one flag go to Horovod's allreduce: dense Horovod.

Which parameter a gradient belongs to: ``gradient_keys``. Horovod's ``op`` may be Average or Sum
(``gradient_predivide_factor`` included); Adasum raises at the first step, on every rank, and so does
an optimizer ``process_set`` that TopKEF was not given (the token's sum shows both).

Non-finite gradients: if any rank's ``acc`` holds NaN/Inf, every rank learns it (a flag in the same
collective); then every gradient of that step is all NaN on every rank (so a loss scaler or
``isfinite`` check skips the step everywhere) and every rank keeps all its residuals untouched.

Sparse gradients (``nn.Embedding(sparse=True)``) that Horovod sends with its own sparse allreduce
(``sparse_as_dense=False``) pass through untouched; with ``sparse_as_dense=True`` Horovod hands
``compress`` the densified gradient, which is compressed like any other.
"""
import contextlib
import itertools
import threading
from typing import Hashable, NamedTuple, Optional

import torch
from horovod.torch import mpi_ops
from horovod.torch.compression import Compressor

from .arguments import STOCK_COMMUNICATIONS, check_hierarchical
from .settings import TopKSettings
from .step.compressor_transports import CompressorTransports
from .step.gradient_keys import ParameterKeys, SlotSequence
from .core.memory import ResidualMemory, StepCommits
from .core.sparsify import k_for, sq_norm_finite

__all__ = ["TopKEF", "STOCK_COMMUNICATIONS"]

_MISMATCH_HINT = ("without named_parameters TopKEF matches gradients by their position in the step, and the "
                  "ranks' orders differ (a parameter unused on some rank, two optimizers, a changed model); "
                  "use TopKEF(ratio, named_parameters=model.named_parameters())")


class _Ctx(NamedTuple):
    """What ``decompress`` needs about one compressed gradient (built by keyword)."""
    dense: bool                                # True: passed through unchanged
    key: Optional[Hashable] = None             # parameter name or slot; None: not part of the step
    shape: tuple = ()
    started: object = None                     # split_reduce/allgather: the transport in flight
    indices: Optional[torch.Tensor] = None     # artopk: shared index set; None when all entries were sent
    acc: Optional[torch.Tensor] = None         # the accumulator: with its sent entries zeroed, the residual


class _ClassOrInstance:
    """Binds a method to the class's default instance when called on the class itself.

    Horovod calls ``compression.compress(tensor)``; with ``compression=TopKEF`` that is a call on the
    class, which then uses one shared default instance (ratio 0.01)."""

    def __init__(self, fn):
        self._fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        return self._fn.__get__(cls.default() if obj is None else obj, cls)


SHUTDOWN_GRACE_S = 15.0       # time the other ranks get to reach the same check and raise it themselves


@contextlib.contextmanager
def _ends_job_on_mismatch():
    """A check of this rank's gradient sequence failed (ValueError). Where the other ranks fail the
    same check, each raises it; a rank that does not may be waiting in a collective this rank will
    never join. So Horovod is shut down SHUTDOWN_GRACE_S seconds after the error is raised: that
    rank's collective then fails too, and the job ends instead of hanging. (Alone, no rank waits.)"""
    try:
        yield
    except ValueError:
        if mpi_ops.size() == 1:
            raise
        timer = threading.Timer(SHUTDOWN_GRACE_S, mpi_ops.shutdown)
        timer.daemon = True
        timer.start()
        raise


class _PendingStep(StepCommits):
    """One Horovod step's new residuals (``StepCommits``); if some gradient was non-finite on some rank,
    every gradient of the step is handed out all NaN."""

    def __init__(self):
        super().__init__()
        self.outputs = []                     # the step's decompressed gradients, as handed to Horovod

    def hand_out(self, out, finite, like, shape):
        if not finite and not self.nonfinite:
            self.nonfinite = True
            for earlier in self.outputs:      # Horovod set_() them into p.grad: NaN them there
                earlier.fill_(float("nan"))
        if self.nonfinite:
            out = torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
        self.outputs.append(out)
        return out


class TopKEF(Compressor):
    """Top-K sparsification with per-rank error feedback, for stock ``hvd.DistributedOptimizer``.

    Per gradient and rank: ``acc = grad + residual``; the transport sends k = max(1, ceil(ratio *
    numel)) entries of ``acc``; ``residual = acc`` with the entries that left this rank zeroed.
    Tensors with fewer than ``min_numel`` elements, and non-floating tensors, go unchanged.

    Making one only checks and keeps its settings (``comp.settings``, a ``TopKSettings``; the class's are
    the defaults): all that ``hvd_topk.DistributedOptimizer`` reads. Horovod's first ``compress`` builds the transports.

    Args:
        ratio: fraction of elements kept per tensor, in (0, 1]. 1.0 sends everything (dense result).
        min_numel: tensors with fewer elements go dense; >= 0.
        communication: the transport (module docstring): ``'split_reduce'`` (default: every rank's own
            top-k, the global top-k of the sums kept), ``'allgather'`` (every rank's own top-k, all kept),
            ``'hierarchical'`` (dense inside each host, split_reduce across them), ``'artopk'`` or ``'dense'``.
        sync_indices: artopk only: share the step's index set by a blocking broadcast (default: one step stale).
        named_parameters: ``model.named_parameters()``, as given to the optimizer: state keyed by name, whatever
            order Horovod compresses in; without it, by position in the step (the same on every step and rank).
        process_set: the optimizer's ``process_set``, if it has one: the transport runs within it.
        budget: split_reduce keeps the largest ``budget * k`` summed entries (>= 1): room where the ranks'
            top-k sets disagree (non-IID data).

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

    _instances = itertools.count()   # creation counter: names the collectives identically on all ranks
    settings = TopKSettings()        # the class's own: what ``compression=TopKEF`` means

    def __init__(self, ratio=0.01, min_numel=1024, sync_indices=False, named_parameters=None,
                 process_set=mpi_ops.global_process_set, communication="split_reduce", budget=1.0):
        self.settings = TopKSettings(ratio, min_numel, communication, budget, sync_indices)
        check_hierarchical(self.settings.communication, process_set)
        self.keys = SlotSequence() if named_parameters is None else ParameterKeys(named_parameters)
        self.memory, self._step = ResidualMemory(), _PendingStep()     # key -> residual; this step's candidates
        self.transports = CompressorTransports(self.settings, tag=f"hvd_topk.TopKEF{next(TopKEF._instances)}",
                                               key_index=self.keys.key_index, process_set=process_set,
                                               mismatch_hint=_MISMATCH_HINT if named_parameters is None else "")

    @classmethod
    def default(cls):
        """The instance used when the class itself is passed as ``compression=``."""
        if "_default_instance" not in cls.__dict__:
            cls._default_instance = cls()
        return cls._default_instance

    @_ClassOrInstance
    def compress(self, tensor):
        """Horovod contract: ``(tensor_to_allreduce, ctx)``: the token, ``[k values..., flag]`` (+ the
        token in a tensor's first step) or the gradient itself (module docstring)."""
        with _ends_job_on_mismatch():
            out = self._compress(tensor)
        if self.keys.step_complete():
            self.transports.flush()            # the step's last gradient
        return out

    def _compress(self, tensor):
        if not tensor.is_floating_point():
            return tensor, _Ctx(dense=True)
        key = self.keys.next_key(tensor)
        if getattr(self.keys, "interrupted", False):
            # The abandoned step's candidates are dropped, and so is what the transports shared: the
            # failure may have stopped each rank at another point of that step.
            self._step, self.keys.interrupted = _PendingStep(), False
            self.transports.forget()
        self.transports.before_gradient()
        if tensor.numel() < self.settings.min_numel:
            return tensor, _Ctx(dense=True, key=key, shape=tuple(tensor.shape))
        acc = self.memory.compensate(key, tensor)
        k = k_for(acc.numel(), self.settings.ratio)
        buf, started, indices = self.transports.send(key, acc, k, sq_norm_finite(acc)[1], tensor)
        return buf, _Ctx(dense=False, key=key, shape=tuple(tensor.shape), started=started, indices=indices, acc=acc)

    @_ClassOrInstance
    def decompress(self, tensor, ctx):
        """Horovod contract: the dense aggregated gradient. The step's residuals are committed when
        its last gradient is decompressed, and only if every gradient was finite on every rank."""
        if ctx is None or (ctx.dense and ctx.key is None):
            return tensor        # Horovod's sparse allreduce (ctx None), or non-floating: not of the step
        # The checks raise only on the ranks that see the mismatch (the token's: only the optimizer's
        # process set); the shutdown ends any rank left waiting for them.
        with _ends_job_on_mismatch():
            self.keys.finish_one()
            received = None if ctx.dense else self.transports.receive(tensor, ctx.key, ctx.shape, ctx.started,
                                                                      ctx.indices, ctx.acc)
        if ctx.dense:
            out = tensor
            finite = sq_norm_finite(tensor.reshape(-1))[1]     # the sum: identical on all ranks
        else:
            out, residual = received
            finite = out is not None
            if finite:
                out = out.reshape(ctx.shape)
            self._step.add(lambda key=ctx.key, residual=residual: self.memory.update(key, residual))
        out = self._step.hand_out(out, finite, tensor, ctx.shape)
        if self.keys.pending == 0:             # Horovod compresses all before it decompresses any
            self.transports.flush()            # unless the last compress did (not in the first step)
            self._step.end()
        return out

    def state_dict(self):
        """This rank's residuals, step counters and pending index sets (waits for in-flight ones)."""
        return {"ratio": self.settings.ratio, "communication": self.settings.communication,
                "signatures": list(getattr(self.keys, "signatures", [])),
                "residuals": self.memory.state_dict(), **self.transports.state_dict()}

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned on this rank."""
        self.keys.restore(state["signatures"])
        self.memory.load_state_dict(state["residuals"])
        self.transports.load_state_dict(state)
