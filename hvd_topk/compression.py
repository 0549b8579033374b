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

Global selection (the default with split_reduce, allgather and hierarchical): ``compress`` keeps each
accumulator and hands Horovod the token; the step's first ``decompress`` (where ranks share cores, its last
``compress``) runs one top-k over all of them (``hvd_topk.step.compressor_global``), residuals still per parameter.

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
import itertools
from typing import Hashable, NamedTuple, Optional

import torch
from horovod.torch import mpi_ops

from .arguments import STOCK_COMMUNICATIONS, check_hierarchical, check_stock_selection
from .settings import TopKSettings
from .step.compressor_door import ClassOrInstance, CompressorDoor, keys_and_residuals, load_keys_and_residuals
from .step.compressor_global import GlobalSelection
from .step.compressor_transports import CompressorTransports, load_transports_state, sends_token, transports_state
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
    pooled: bool = False                       # selection='global': in the step's one top-k


class TopKEF(CompressorDoor):
    """Top-K sparsification with per-rank error feedback, for stock ``hvd.DistributedOptimizer``.

    Per gradient and rank: ``acc = grad + residual``; the transport sends k = max(1, ceil(ratio *
    numel)) entries of ``acc``; ``residual = acc`` with the entries that left this rank zeroed (with
    16-bit values: with their rounding left). The keys, the NaN rule and the class form are
    ``hvd_topk.step.compressor_door``'s. Tensors below ``min_numel`` elements, and non-floating ones, go unchanged.

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
            top-k sets disagree (non-IID data). None (default): one k per 4 ranks, between 1 and 4.
        values: ``'bf16'`` (default), ``'fp16'`` or ``'fp32'``: how split_reduce and allgather send float32
            values (about 4 bytes per kept entry in 16 bits; ``'fp32'`` keeps them exact); the rounding
            stays in the residual.
        bucket_cap_mb: split_reduce and allgather send the tensors in buckets of at most this many MB of
            float32 gradient, each as soon as its gradients are ready (from the second step); 0: one bucket.
        selection: ``'global'`` (one top-k over the step's compressed tensors once all are compressed,
            row-sparse ones alone), ``'layerwise'`` or None (default: global; with ``'artopk'`` layer-wise).

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
                 process_set=mpi_ops.global_process_set, communication="split_reduce", budget=None, values="bf16",
                 bucket_cap_mb=25.0, selection=None):
        settings = TopKSettings(ratio, min_numel, communication, budget, sync_indices, values, bucket_cap_mb,
                                selection)
        check_hierarchical(settings.communication, process_set)
        self.selection = check_stock_selection(settings)      # the one this TopKEF runs
        super().__init__(settings, named_parameters, process_set)
        self.transports = CompressorTransports(settings, tag=f"hvd_topk.TopKEF{next(TopKEF._instances)}",
                                               key_index=self.keys.key_index, process_set=process_set,
                                               mismatch_hint=_MISMATCH_HINT if named_parameters is None else "")
        self.pool = GlobalSelection(self.transports, settings.ratio) \
            if self.selection == "global" and settings.communication != "dense" else None

    def _compress(self, tensor):
        """``(tensor_to_allreduce, ctx)``: the token, ``[k values..., flag]`` (+ the token in a tensor's
        first step) or the gradient itself (module docstring)."""
        if not tensor.is_floating_point():
            return tensor, _Ctx(dense=True)
        key = self._next_key(tensor)
        self.transports.before_gradient()
        if tensor.numel() < self.settings.min_numel:
            self.transports.stats.add_sent(tensor.numel() * tensor.element_size(), 0.0, 0.0, dense=True)
            return tensor, _Ctx(dense=True, key=key, shape=tuple(tensor.shape))
        acc, k = self.memory.compensate(key, tensor), k_for(tensor.numel(), self.settings.ratio)
        if self.pool is not None and k < acc.numel():   # else everything goes: dense, as layer-wise
            return self.pool.send(key, acc, tensor), _Ctx(dense=False, key=key, shape=tuple(tensor.shape),
                                                          pooled=True)
        acc_sq, finite = sq_norm_finite(acc)
        buf, started, indices = self.transports.send(key, acc, k, finite, tensor, acc_sq=acc_sq)
        return buf, _Ctx(dense=False, key=key, shape=tuple(tensor.shape), started=started, indices=indices, acc=acc)

    def _failed_payload(self, tensor):     # what _compress sends: the tensor, a token, or values (None)
        n = tensor.numel()
        token = sends_token(self.settings.communication, n, k_for(n, self.settings.ratio))
        return tensor if n < self.settings.min_numel else super()._failed_payload(tensor) if token else None

    def _receive(self, tensor, ctx):
        return self.pool.receive(tensor, ctx.key) if ctx.pooled else \
            self.transports.receive(tensor, ctx.key, ctx.shape, ctx.started, ctx.indices, ctx.acc)

    def _forget(self):
        for part in (self.transports, self.pool) if self.pool is not None else (self.transports,):
            part.forget()

    def _after_compress(self):
        if self.keys.step_complete():          # the step's last gradient: AR-Topk's index sets leave,
            (self.pool or self.transports).flush()      # or the global bucket

    def _end_step(self):
        self.transports.flush()                # unless the last compress did (not in the first step)
        super()._end_step()
        self.transports.end_step(self.keys.registration_order(), self.settings.bucket_cap_mb)

    @ClassOrInstance
    def stats(self):
        """Figures of the last step this TopKEF decompressed (``hvd_topk.step.stats.StepStats``: bytes, the
        compression gain, where the step's time went), its residual norm and ratio."""
        return dict(self.transports.stats.last(), residual_norm=self.memory.norm(), ratio=self.settings.ratio)

    def state_dict(self):
        """This rank's residuals, step counters and pending index sets (waits for in-flight ones)."""
        return {"ratio": self.settings.ratio, "communication": self.settings.communication,
                "selection": self.selection, **keys_and_residuals(self), **transports_state(self.transports),
                "row_sparse": self.pool and self.pool.state_dict()}     # None: layer-wise, or not measured

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned on this rank."""
        load_keys_and_residuals(self, state)
        load_transports_state(self.transports, state)
        if self.pool is not None:          # an older checkpoint has no row_sparse: measured at the next step
            self.pool.load_state_dict(state.get("row_sparse"))
