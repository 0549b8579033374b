"""Global selection in ``TopKEF`` (``selection='global'``): one top-k over every compressed gradient of a step.

``compress`` keeps each compressed gradient's accumulator (acc = grad + residual, per key) and hands
Horovod only the ``op_token``. Once a rank holds the step's accumulators (its first ``receive``: Horovod
compresses every gradient of a step before it decompresses any; where ranks share cores, from the second
step on, its last compress: ``flush``) they go through the door's transport once, as one tensor
(``bucket.GlobalBucket``, the optimizer's: sorted key order, the same on every rank), with k =
k_for(their total numel, ratio); row-sparse ones (embedding tables) go alone beside it, each with its
own k. Each key gets its slice of the aggregate and of the new residual, so residuals stay per key in
the door's ``ResidualMemory``: checkpoints, elastic resets and the NaN rule (a non-finite entry anywhere:
the transport's aggregate is None on every rank) work as with layer-wise selection.

Every gradient's token is read before its slice is handed out: Horovod's op (Sum or Average) scales the
aggregate, and a key the ranks disagree on raises on every rank before any value is used (values may
have left in ``flush`` already; none of them is used before that check). The transport is one that
starts its own collectives (``transports.build.OWN_COLLECTIVES``): only those can wait for the step's
last gradient (``hvd_topk.arguments.check_stock_selection``).
"""
import time

from .bucket import GlobalBucket
from .compressor_door import after_backward
from ..core.sparsify import k_for, sq_norm_finite
from ..transports.collectives import agree, ranks_share_cores

__all__ = ["GlobalSelection", "DRAIN_S"]

# The longest a rank advances the bucket's phases in its last compress, where ranks share cores
# (``GlobalSelection.flush``). Ranks reach that point within a step's skew (milliseconds to a few hundred
# on shared cores); a rank that does not come within it (its step compressed other gradients: an error at
# the first decompress) is left to the first decompress, where the phases finish as in a step's first.
DRAIN_S = 2.0


class GlobalSelection:
    """One ``TopKEF``'s global selection, over its ``CompressorTransports`` (their token, stats, transport).

    Args:
        transports: the TopKEF's ``CompressorTransports``.
        ratio: the fraction of the step's compressed entries that is kept.
    """

    def __init__(self, transports, ratio):
        self.transports, self.ratio = transports, ratio
        self.token = None                     # the first decompressed (reduced token, key) of the step
        self.planned = None                   # group -> numel the fused transport's buckets were planned for
        ps = transports.process_set
        self.bucket = GlobalBucket(lambda shares: agree(shares, f"{transports.tag}.row_sparse", process_set=ps))

    def send(self, key, acc, grad):
        """Keep ``acc`` (flat) for the step's transports; returns the token for Horovod's allreduce."""
        if self.bucket.pending is not None:
            raise ValueError(f"TopKEF: gradient {key!r} came after the step's bucket left, once the previous "
                             "step's gradients were all compressed: every step must compress the same gradients")
        self.bucket.add(key, acc, grad)
        token = self.transports.token.make(key, grad)
        self.transports.stats.add_bytes(token.numel() * token.element_size())
        return token

    def flush(self):
        """The step's last gradient is compressed (from the second step: ``keys.step_complete``). Where
        ranks share cores (``ranks_share_cores``) the bucket leaves now, and once the backward pass has
        ended (``after_backward``: Horovod has the last token by then) this rank advances its phases,
        asleep between polls, until they are done or DRAIN_S has passed. Why: Horovod's
        ``synchronize()`` spins on the tokens until the slowest rank has compressed its last gradient, and
        the spinning ranks take the CPU the slow ones need; asleep here, they give it back, and the tokens
        then find every rank ready. Where every rank has a core, spinning costs nothing, and leaving here
        measured slower (a 2-rank small CNN's step: 1.63-1.87x dense's draining inside the last compress,
        1.58-1.70x only starting, 1.48-1.52x at the first decompress): there the bucket leaves at the first
        decompress. Not in a step whose row-sparse tensors are still to be measured (the first, or the
        first after a reset): that measurement blocks on a collective."""
        self.transports.flush()
        if not ranks_share_cores() or self.bucket.alone is None or not self.bucket.entries:
            return
        self.transports.stats.syncing()       # its waits are the step's synchronization from here
        self.bucket.start(self._run)
        transport = self.transports.own[self.transports.communication]
        after_backward(lambda: transport.drain(time.monotonic() + DRAIN_S))

    def receive(self, reduced, key):
        """(``key``'s flat slice of the aggregate, or None where some rank was non-finite; its new residual
        or None), in the gradient's dtype (the token's)."""
        self.transports.token.average(reduced, key)      # raises, on every rank, before any value is used
        self.token = (reduced, key)                      # says whether Horovod averaged (``_finish``)
        part = self.bucket.output(key, self._run)
        return tuple(None if t is None else t.to(reduced.dtype) for t in (part.aggregate, part.residual))

    def _run(self, groups):
        """Start the transport over each of the bucket's groups (the pooled tensors, each row-sparse one).
        Returns ``finish()`` -> per group (aggregate or None, None, new residual or None), called in the
        step's first ``receive``, after ``self.token`` is set."""
        stats = self.transports.stats
        transport = self.transports.own[self.transports.communication]
        self._plan(groups)
        started = []
        with stats.selecting():
            for group, flat in groups:
                acc_sq, finite = sq_norm_finite(flat)
                started.append((flat, acc_sq, transport.start(group, flat, k_for(flat.numel(), self.ratio), finite)))
        return lambda: [self._finish(*each) for each in started]

    def _plan(self, groups):
        """The groups (the pooled tensors, each row-sparse one) travel in the fused transport's buckets,
        as the optimizer's do: one exchange per phase for the step, not one per group (an embedding
        model's step ran two of each). Planned when the groups change (the first step, after a reset),
        the same on every rank: the groups and their order are agreed (``GlobalBucket.start``)."""
        numels = {group: flat.numel() for group, flat in groups}
        if numels != self.planned:
            self.transports.fused.plan(list(numels), numels, self.transports.settings.bucket_cap_mb)
            self.planned = numels

    def _finish(self, flat, acc_sq, started):
        self.transports.stats.add_sent(started.nbytes, started.sent_sq, acc_sq)
        aggregate, residual = self.transports.receive(*self.token, flat.shape, started, None, flat)
        return aggregate, None, residual

    def forget(self):
        """An abandoned step or an elastic reset: its kept accumulators go (their residuals were never
        committed), and the row-sparse tensors are measured anew (the transports drop their buckets)."""
        self.bucket.forget()
        self.planned = None

    def state_dict(self):
        """The row-sparse keys this rank's checkpoint keeps (None: not measured yet)."""
        return None if self.bucket.alone is None else sorted(self.bucket.alone, key=str)

    def load_state_dict(self, row_sparse):
        """Restore ``state_dict``'s keys (None, from an older checkpoint too: measured at the next step)."""
        self.forget()
        self.bucket.alone = None if row_sparse is None else set(row_sparse)
