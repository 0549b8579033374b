"""Sparse allgather: every rank sends its own top-k, packed (``hvd_topk.core.codec``); every rank scatter-adds.

Why it is correct: each rank receives every rank's (values, indices) and adds them into the same zero
vector in the same order (rank by rank), so the aggregate is identical everywhere and is the sum of
exactly what the ranks' values decoded to. Each rank's flag rides in its frame (``hvd_topk.core.buckets``):
inf when its accumulator was not finite, and then every rank returns None for that tensor.

The tensors of a bucket (``hvd_topk.transports.fused``) travel in one allgather: each as a frame and a
codec message of its top-k over [0, n), about 4 bytes per entry with 16-bit values (``values``). Bytes
per rank grow with the number of ranks: it receives (P - 1) messages of k entries.

Error feedback with 16-bit values: the residual keeps ``acc - sent_values(acc)`` at the sent entries
(exact in float32, ``hvd_topk.core.codec.sent_values``), so Σ sent + residual = Σ grad holds for what
the receivers decoded; with lossless values (``'fp32'``, float64 accumulators) the sent entries are
zeroed as before, and the sums are the same, in the same order, as with 8-byte (value, index) rows.
"""
import time

import torch
from horovod.torch import mpi_ops

from ..core.buckets import flag_of, frame, read_frames, signature, wire_dtype, wire_kind
from ..core.codec import pack, sent_values, unpack
from ..core.sparsify import sq_norm_finite, topk_indices
from .base import Outcome, Started
from .fused import Buckets

__all__ = ["SparseAllgather", "coded_residual", "mismatch_error"]

LOSSLESS = ("fp32", "fp64")


def coded_residual(acc, indices, wire_values, kind):
    """The new residual where ``acc``'s entries at ``indices`` left as ``wire_values`` coded in ``kind``:
    ``acc`` with ``acc - decoded`` there (in place); None for a lossless kind (the caller zeroes them)."""
    if kind in LOSSLESS:
        return None
    return acc.index_put_((indices,), acc.index_select(0, indices) - sent_values(wire_values, kind).to(acc.dtype))


def mismatch_error(key, numel, hint):
    """The ValueError every rank raises when the ranks' buffers hold other tensors than its own."""
    return ValueError(f"hvd_topk: the ranks sent different tensors under {key!r} ({numel} elements on this rank; "
                      f"another key, size or index region): {hint or 'every rank must step the same model'}")


class SparseAllgather:
    """Every rank's own top-k, gathered by all, one allgather per bucket.

    Args:
        collectives: the ``Collectives`` (its process set; its pending groups start before a wait).
        average: divide the sum by the number of ranks (Horovod's Average).
        values: 'bf16', 'fp16' or 'fp32': how float32 values go on the wire (``core.buckets.wire_kind``).
        name: prefix of the collectives' names (distinct per optimizer or TopKEF, identical on all ranks).
        stats: ``StepStats`` that records the phases, or None.
        mismatch_hint: what the error says to do when the ranks' tensors differ under one key.
    """

    def __init__(self, collectives, average, values="bf16", name="hvd_topk.allgather", stats=None, mismatch_hint=""):
        self.collectives, self.average, self.values, self.name = collectives, average, values, name
        self.stats, self.mismatch_hint = stats, mismatch_hint
        self.buckets = Buckets(name, self._phases, stats)

    def forget(self):
        """Nothing outlives a step but the bucket plan."""
        self.buckets.forget()

    def start(self, key, acc, k, finite, grad=None, step=None, k_next=None):
        n = acc.numel()
        indices = torch.arange(n, device=acc.device) if k == n else topk_indices(acc, k)
        values = acc.index_select(0, indices)
        kind = wire_kind(acc.dtype, self.values)
        t0 = time.perf_counter()
        wire_values = values.to(wire_dtype(kind))
        chunk = frame(signature(key, n, 0, n), flag_of(wire_values, finite), pack(wire_values, indices, 0, n, kind))
        if self.stats is not None:
            self.stats.add_time("pack", time.perf_counter() - t0)
        self.buckets.add(key, (chunk, acc, indices, wire_values, kind))
        return Started(chunk.numel(), sq_norm_finite(values)[0],
                       lambda: self.buckets.finish(key, self.collectives.start_pending))

    def _phases(self, name, items):
        """The bucket's one phase: one allgather of every key's frame (``fused.Buckets``)."""
        ps = self.collectives.process_set
        gathered = yield "gather", mpi_ops.allgather_async(torch.cat([item[0] for item in items.values()]),
                                                           name=name, process_set=ps)
        t0 = time.perf_counter()
        keys = list(items)
        per_rank = read_ranks(gathered, [items[key][1].numel() for key in keys], ps.size())
        outcomes = {}
        for i, key in enumerate(keys):
            _, acc, indices, wire_values, kind = items[key]
            n = acc.numel()
            if per_rank is None or any(frames[i][0] != signature(key, n, 0, n) for frames in per_rank):
                raise mismatch_error(key, n, self.mismatch_hint)
            sent = None if indices.numel() == n else indices
            if any(not frames[i][1] < float("inf") for frames in per_rank):
                outcomes[key] = Outcome(None, sent)
                continue
            aggregate = torch.zeros(n, dtype=acc.dtype, device=acc.device)
            for frames in per_rank:
                got, at = unpack(frames[i][2], 0, n)
                aggregate.index_add_(0, at.to(acc.device), got.to(device=acc.device, dtype=acc.dtype))
            if self.average:
                aggregate.mul_(1.0 / ps.size())
            outcomes[key] = Outcome(aggregate, sent, residual=coded_residual(acc, indices, wire_values, kind))
        if self.stats is not None:
            self.stats.add_time("unpack", time.perf_counter() - t0)
        return outcomes


def read_ranks(gathered, spans, ranks):
    """Every rank's frames (one per span) from an allgather's output, or None where they do not fit."""
    per_rank, at = [], 0
    try:
        for _ in range(ranks):
            frames, used = read_frames(gathered[at:], spans)
            per_rank.append(frames)
            at += used
    except ValueError:
        return None
    return per_rank if at == gathered.numel() else None
