"""PowerSGD: low-rank compression with error feedback as a stock Horovod ``Compressor``.

The low-rank transport (``hvd_topk.transports.lowrank``, the one ``hvd_topk.DistributedOptimizer`` drives)
sums the P's and Q's of a step's tensors in its own collectives, Horovod's public asynchronous
allreduces, one per phase for all tensors. Horovod still allreduces whatever ``compress`` returns, so
each compressed gradient hands Horovod a 4-element token (``hvd_topk.step.op_token``: Horovod's op, and
a check that every rank keyed the gradient alike), as ``TopKEF``'s split_reduce does:

1. ``compress``: acc = gradient + this rank's residual; P = M Q starts (M: acc as a matrix, a conv
   weight out x in*kh*kw; Q: the warm start, identical on every rank).
2. Horovod compresses every gradient of a step before it decompresses any, so at the first
   ``decompress`` every rank has started the same keys: the token tells whether Horovod averaged, and
   the transport runs both phases for every key in sorted order (no order of the ranks can hang it).
   Where ranks share cores, from the second step on, the step's last ``compress`` has the P and Q sums
   run as soon as the backward pass ends (``after_backward``), asleep between polls, for up to
   ``DRAIN_S``, while Horovod reduces the tokens. Why: Horovod's ``synchronize()`` spins until every
   rank's tokens are in, and spinning ranks take the CPU that ranks still in their backward pass need;
   asleep, they give it back, and the tokens find every rank ready. (P Q^T itself needs Horovod's op:
   it stays for the first ``decompress``, as does whatever is left where a rank is late.)
3. ``decompress`` returns P Q^T (the mean, or the sum where Horovod sums); this rank's residual becomes
   M - P Q^T, committed at the step's end if every rank was finite.

Tensors that would not shrink twofold (torch's ``min_compression_rate``), 1-D tensors and non-floating
ones go to Horovod's allreduce as they are; so does every gradient of the first ``dense_steps`` steps,
as torch's hook sends them before its ``start_powerSGD_iter`` (at least 2 where it keeps residuals).
The machinery every door shares (keys, the pending step, the NaN rule, the shutdown on a mismatch, the
class form): ``hvd_topk.step.compressor_door``.
"""
import copy
import itertools
import time
from typing import Hashable, NamedTuple, Optional

from horovod.torch import mpi_ops

from .arguments import check_hierarchical
from .settings import PowerSGDSettings
from .step.compressor_door import (ClassOrInstance, CompressorDoor, after_backward, keys_and_residuals,
                                  load_keys_and_residuals)
from .step.compressor_global import DRAIN_S
from .step.op_token import OpToken
from .step.stats import StepStats
from .core.lowrank import compressed_rank
from .core.sparsify import sq_norm_finite
from .transports.build import build_transports

__all__ = ["PowerSGD"]

_MISMATCH_HINT = ("without named_parameters PowerSGD matches gradients by their position in the step, and the "
                  "ranks' orders differ (a parameter unused on some rank, two optimizers, a changed model); "
                  "use PowerSGD(rank, named_parameters=model.named_parameters())")


class _Ctx(NamedTuple):
    """What ``decompress`` needs about one compressed gradient (built by keyword)."""
    dense: bool                                # True: Horovod's allreduce carries the gradient itself
    key: Optional[Hashable] = None             # parameter name or slot; None: not part of the step
    shape: tuple = ()
    started: object = None                     # the low-rank transport in flight


def _compresses(door, tensor):
    """Whether ``tensor`` leaves ``door`` as P and Q this step (past the dense steps, and shrinking twofold)."""
    s = door.settings
    past_dense = not s.dense_steps or door.steps.agreed(f"{door.tag}.steps", door.process_set) >= s.dense_steps
    return past_dense and compressed_rank(tuple(tensor.shape), s.rank, s.min_compression_rate)


class PowerSGD(CompressorDoor):
    """PowerSGD (Vogels et al., NeurIPS'19; torch's ``powerSGD_hook``) for stock ``hvd.DistributedOptimizer``.

    Per gradient and rank: ``acc = grad + residual``; its matrix view M leaves as P and Q of rank ``rank`` (one
    power iteration, warm-started from the last step's Q); every rank receives P Q^T and keeps ``residual = M -
    P Q^T``. ``hvd_topk.DistributedOptimizer(compression=...)`` accepts it too, reading only ``comp.settings``
    (a ``hvd_topk.PowerSGDSettings``; the class's are the defaults). Making one runs no collective.

    Args:
        rank: the rank r of each tensor's approximation, >= 1 (torch's ``matrix_approximation_rank``).
        named_parameters: ``model.named_parameters()``, as given to the optimizer: residuals and Q's keyed
            by name, whatever order Horovod compresses in; without it, by position in the step.
        process_set: the optimizer's ``process_set``, if it has one: the transport runs within it.
        communication: ``'lowrank'`` (one allreduce of every P, one of every Q) or ``'hierarchical'``
            (the sums taken inside each host first; only each host's sum crosses between hosts).
        min_compression_rate: compress a tensor only if it shrinks more than this, > 0 (torch's 2).
        seed, epsilon: the seed of every tensor's first Q (>= 0); added to each column's norm (>= 0).
        values: ``'fp32'`` (as torch's hook) or ``'fp16'`` (a float32 gradient's P's and Q's in 16 bits).
        dense_steps: the first steps go to Horovod's allreduce uncompressed, >= 0 (torch's ``start_powerSGD_iter``).

    Example:
        >>> import horovod.torch as hvd, torch
        >>> hvd.init()
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
        ...                                compression=PowerSGD(rank=4,
        ...                                                     named_parameters=model.named_parameters()))
        >>> model(torch.randn(8, 64)).sum().backward()
        >>> opt.step()                     # the weight as 4 x (32 + 64) values; the bias dense
    """

    _instances = itertools.count()   # creation counter: names the collectives identically on all ranks
    settings = PowerSGDSettings()    # the class's own: what ``compression=PowerSGD`` means

    def __init__(self, rank=4, named_parameters=None, process_set=mpi_ops.global_process_set,
                 communication="lowrank", min_compression_rate=2.0, seed=0, epsilon=0.0, values="fp32",
                 dense_steps=0):
        settings = PowerSGDSettings(rank, min_compression_rate, communication, seed, epsilon, values, dense_steps)
        check_hierarchical(settings.communication, process_set)
        super().__init__(settings, named_parameters, process_set)
        self.hint = _MISMATCH_HINT if named_parameters is None else ""
        self.tag = f"hvd_topk.PowerSGD{next(PowerSGD._instances)}"
        self.token = OpToken(process_set, mismatch_hint=self.hint, door="PowerSGD")
        self._transport = None                # built at the first compress
        self._restored = None                 # Q's loaded before it was built
        self.step_stats = StepStats()         # the figures of ``stats()``

    @property
    def transport(self):
        """The low-rank transport, built at first use (``'hierarchical'`` finds the hosts' sets: a collective)."""
        if self._transport is None:
            stack = build_transports(self.settings, tag=self.tag, key_index=self.keys.key_index,
                                     process_set=self.process_set, mismatch_hint=self.hint)
            self._transport = stack.transports[self.settings.communication]
            if self._restored is not None:
                self._transport.load_state_dict(self._restored)
                self._restored = None
        return self._transport

    def _compress(self, tensor):
        if not tensor.is_floating_point():
            return tensor, _Ctx(dense=True)
        key = self._next_key(tensor)
        if not _compresses(self, tensor):
            self.step_stats.add_sent(tensor.numel() * tensor.element_size(), 0.0, 0.0, dense=True)
            return tensor, _Ctx(dense=True, key=key, shape=tuple(tensor.shape))
        transport = self.transport
        with self.step_stats.selecting():     # accumulate, and P = M Q
            acc = self.memory.compensate(key, tensor)
            acc_sq, finite = sq_norm_finite(acc)
            started = transport.start(key, acc, None, finite, grad=tensor)
        token = self.token.make(key, tensor)
        self.step_stats.add_sent(started.nbytes + token.numel() * token.element_size(), started.sent_sq, acc_sq,
                                 lowrank=(started.values, acc.numel()))
        return token, _Ctx(dense=False, key=key, shape=tuple(tensor.shape), started=started)

    def _after_compress(self):          # the step's last gradient, where ranks share cores: module docstring, 2
        if self._transport is not None and self._last_compress_may_drain():
            self.step_stats.syncing()
            after_backward(lambda: self._transport.drain(time.monotonic() + DRAIN_S))

    def _failed_payload(self, tensor):
        return super()._failed_payload(tensor) if _compresses(self, tensor) else tensor

    def _receive(self, reduced, ctx):
        self.step_stats.syncing()
        # raises on every rank before any value is used; with Horovod's op the mean is P Q^T, as in the optimizer
        self.transport.average = self.token.average(reduced, ctx.key)
        outcome = ctx.started.finish()
        return outcome.aggregate, outcome.residual

    def _forget(self):
        self.steps.reset()                    # a rank that joined has counted no step: all agree again
        if self._transport is not None:
            self._transport.forget()

    def _end_step(self):
        super()._end_step()
        self.step_stats.end_step(density=1.0)     # 1.0 where every gradient went dense

    @ClassOrInstance
    def stats(self):
        """The last step's figures (``hvd_topk.step.stats``: bytes, P and Q's share, time), residual norm, rank."""
        return dict(self.step_stats.last(), residual_norm=self.memory.norm(), rank=self.settings.rank)

    def state_dict(self):
        """This rank's residuals and the warm-start Q's (identical on every rank)."""
        q = copy.deepcopy(self._restored) if self._transport is None else self._transport.state_dict()
        return {"rank": self.settings.rank, **keys_and_residuals(self), "q": q}

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned on this rank: the steps after are the saved job's, bit for bit."""
        if state["rank"] != self.settings.rank:
            raise ValueError(f"rank must be the saved state's {state['rank']} to load it, got {self.settings.rank}")
        load_keys_and_residuals(self, state)
        if self._transport is None:
            self._restored = copy.deepcopy(state["q"])
        elif state["q"] is not None:
            self._transport.load_state_dict(state["q"])
