"""Sparse allgather: every rank sends its own top-k, packed (``hvd_topk.core.codec``); every rank scatter-adds.

Why it is correct: each rank receives every rank's (values, indices) and adds them into the same zero
vector in the same order (rank by rank), so the aggregate is identical everywhere and is the sum of
exactly what the ranks' values decoded to. Each rank's flag per tensor rides in its frame
(``hvd_topk.core.buckets``): inf when its accumulator was not finite, and then every rank returns None
for that tensor.

The tensors of a bucket (``hvd_topk.transports.fused``) travel in one allgather as one frame and one
codec message per value kind over the bucket's index space (its tensors laid end to end): about 4
bytes per entry with 16-bit values (``values``), one pack and one unpack per rank for the whole bucket.
Bytes per rank grow with the number of ranks: it receives (P - 1) messages of the bucket's entries.

Error feedback with 16-bit values: the residual keeps ``acc - sent_values(acc)`` at the sent entries
(exact in float32, ``hvd_topk.core.codec.sent_values``), so Σ sent + residual = Σ grad holds for what
the receivers decoded; with lossless values (``'fp32'``, float64 accumulators) the sent entries are
zeroed as before, and the sums are the same, in the same order, as with 8-byte (value, index) rows.
``Started.nbytes`` counts a tensor's entries and its flag per destination; the bucket's frame and
message headers go to ``stats`` when the bucket leaves.
"""
import time

import torch
from horovod.torch import mpi_ops

from ..core.buckets import flag_of, frame, offsets, read_frame, signature, wire_dtype, wire_kind
from ..core.codec import pack, sent_values, unpack
from ..core.sparsify import ascending, sq_norm_finite, topk_indices
from ..core.wire import CODEC_ENTRY_BYTES, FLAG_BYTES
from .base import Outcome, Started
from .fused import Buckets

__all__ = ["SparseAllgather", "LOSSLESS", "mismatch_error", "bucket_buffer", "read_ranks", "kinds_of"]

LOSSLESS = ("fp32", "fp64")


def mismatch_error(keys, hint):
    """The ValueError every rank raises when the ranks' buffers hold other tensors than its own."""
    return ValueError(f"hvd_topk: the ranks sent different tensors in the bucket of {list(keys)!r} (another key, "
                      f"size or index region): {hint or 'every rank must step the same model'}")


def kinds_of(items):
    """The value kinds of a bucket's tensors, sorted: one message each."""
    return sorted({item["kind"] for item in items.values()})


def bucket_buffer(sig, items, starts, total, part):
    """One destination's buffer of a bucket (frame, then a message per kind over [0, total)) and each key's
    decoded values of it (None for lossless kinds). ``part(key) -> (local indices, wire values)``, sorted."""
    position, messages, decoded = {key: i for i, key in enumerate(items)}, [], {}
    for kind in kinds_of(items):
        mine = [key for key in items if items[key]["kind"] == kind]
        parts = [part(key) for key in mine]
        values = torch.cat([v for _, v in parts])
        messages.append(pack(values, torch.cat([i + starts[position[key]] for key, (i, _) in zip(mine, parts)]),
                             0, total, kind))
        coded = None if kind in LOSSLESS else sent_values(values, kind).split([v.numel() for _, v in parts])
        decoded.update({key: None if coded is None else coded[j] for j, key in enumerate(mine)})
    return frame(sig, [item["flag"] for item in items.values()], messages), decoded


def read_ranks(gathered, messages, total, ranks):
    """Every rank's (sig, flags, messages) from an allgather of ``bucket_buffer``s, or None where they
    do not fit."""
    per_rank, at = [], 0
    try:
        for _ in range(ranks):
            sig, flags, found, used = read_frame(gathered[at:], messages, total)
            per_rank.append((sig, flags, found))
            at += used
    except ValueError:
        return None
    return per_rank if at == gathered.numel() else None


class SparseAllgather:
    """Every rank's own top-k, gathered by all, one allgather per bucket.

    Args:
        collectives: the ``Collectives`` (its process set; its pending groups start before a wait).
        average: divide the sum by the number of ranks (Horovod's Average).
        values: 'bf16', 'fp16' or 'fp32': how float32 values go on the wire (``core.buckets.wire_kind``).
        name: prefix of the collectives' names (distinct per optimizer or TopKEF, identical on all ranks).
        stats: ``StepStats`` that records the phases and the buckets' headers, or None.
        mismatch_hint: what the error says to do when the ranks' tensors differ under one key.
    """

    def __init__(self, collectives, average, values="bf16", name="hvd_topk.allgather", stats=None, mismatch_hint=""):
        self.collectives, self.average, self.values, self.name = collectives, average, values, name
        self.stats, self.mismatch_hint = stats, mismatch_hint
        self.buckets = Buckets(name, self._phases, stats)

    def drain(self, until):
        """Advance the buckets in flight until done or ``until`` (``Buckets.drain``); never blocks."""
        self.buckets.drain(until)

    def forget(self):
        """Nothing outlives a step but the bucket plan."""
        self.buckets.forget()

    def start(self, key, acc, k, finite, grad=None, step=None, k_next=None):
        n = acc.numel()
        sel = torch.arange(n, device=acc.device) if k == n else ascending(topk_indices(acc, k))
        values = acc.index_select(0, sel)
        kind = wire_kind(acc.dtype, self.values)
        wire_values = values.to(wire_dtype(kind))
        self.buckets.add(key, dict(acc=acc, sel=sel, wire_values=wire_values, kind=kind, flag=flag_of(wire_values, finite)))
        return Started(k * CODEC_ENTRY_BYTES[kind] + FLAG_BYTES, sq_norm_finite(values)[0],
                       lambda: self.buckets.finish(key, self.collectives.start_pending))

    def _phases(self, name, items):
        """The bucket's one phase: one allgather of every rank's buffer (``fused.Buckets``)."""
        ps, keys, t0 = self.collectives.process_set, list(items), time.perf_counter()
        starts, total = offsets(items[key]["acc"].numel() for key in keys)
        sig = signature("allgather", tuple(keys), tuple(items[key]["acc"].numel() for key in keys))
        buf, decoded = bucket_buffer(sig, items, starts, total, lambda key: (items[key]["sel"], items[key]["wire_values"]))
        if self.stats is not None:
            self.stats.add_time("pack", time.perf_counter() - t0)
            self.stats.add_bytes(buf.numel() - sum(items[key]["sel"].numel() * CODEC_ENTRY_BYTES[items[key]["kind"]]
                                                   + FLAG_BYTES for key in keys))
        gathered = yield "gather", mpi_ops.allgather_async(buf, name=name, process_set=ps)
        t0 = time.perf_counter()
        kinds = kinds_of(items)
        per_rank = read_ranks(gathered, len(kinds), total, ps.size())
        if per_rank is None or any(sig_ != sig or flags.numel() != len(keys) for sig_, flags, _ in per_rank):
            raise mismatch_error(keys, self.mismatch_hint)
        sums = {kind: torch.zeros(total, dtype=wire_dtype(kind)) for kind in kinds}
        for _, _, messages in per_rank:                  # rank by rank: the same order everywhere
            for kind, message in zip(kinds, messages):
                got, at = unpack(message, 0, total)
                sums[kind].index_add_(0, at, got)
        outcomes = {}
        for i, key in enumerate(keys):
            item = items[key]
            acc, sel, n = item["acc"], item["sel"], item["acc"].numel()
            sent = None if sel.numel() == n else sel
            if any(not float(flags[i]) < float("inf") for _, flags, _ in per_rank):
                outcomes[key] = Outcome(None, sent)
                continue
            aggregate = sums[item["kind"]][starts[i]:starts[i] + n].to(device=acc.device, dtype=acc.dtype, copy=True)
            if self.average:
                aggregate.mul_(1.0 / ps.size())
            residual = None if decoded[key] is None else \
                acc.index_put_((sel,), acc.index_select(0, sel) - decoded[key].to(acc.dtype))
            outcomes[key] = Outcome(aggregate, sent, residual=residual)
        if self.stats is not None:
            self.stats.add_time("unpack", time.perf_counter() - t0)
        return outcomes
