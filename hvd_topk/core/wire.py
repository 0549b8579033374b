"""Sizes on the wire that the transports and the cost model share (no torch, no Horovod).

The cost model (``hvd_topk.auto.costmodel``) prices the bytes the transports send; both read these (and
``budget_at``: how many of split_reduce's sums its owners gather), so a change to a transport's message
changes its price too.
"""
__all__ = ["INDEX_BYTES", "HIST_BINS", "HIST_BYTES", "CODEC_BLOCK", "CODEC_HEADER_BYTES", "CODEC_OFFSET_BYTES",
           "CODEC_VALUE_BYTES", "CODEC_ENTRY_BYTES", "FRAME_BYTES",
           "FLAG_BYTES", "LOWRANK_VALUE_BYTES", "RANKS_PER_K", "MAX_BUDGET", "budget_at"]

INDEX_BYTES = 4        # the sparse transports send int32 indices: half the bytes of int64
HIST_BINS = 128        # split_reduce's magnitude histogram: 32 octaves below the largest possible sum
# split_reduce's histogram allreduce, int32: the bins, then the owner's count of frames whose signature
# differs from its own and of senders' buffers it could not read (mismatch checks that ride along)
HIST_BYTES = (HIST_BINS + 2) * 4

# The packed Top-K message of hvd_topk.core.codec (packed_nbytes there gives a message's exact size).
CODEC_BLOCK = 1 << 16             # an index is its block's count plus a 16-bit offset within the block
CODEC_HEADER_BYTES = 8            # k (int32), the value kind and the power-of-two scale (int16 each)
CODEC_OFFSET_BYTES = 2            # per entry: its index's offset within its block
CODEC_VALUE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}      # per entry, by value kind
# Per entry, headers and block counts aside (they add 2-4 bytes per 65,536 indices of the range)
CODEC_ENTRY_BYTES = {kind: size + CODEC_OFFSET_BYTES for kind, size in CODEC_VALUE_BYTES.items()}
# A fused bucket's buffer for one destination starts with a frame (hvd_topk.core.buckets): an int32
# signature of its keys, sizes and ranges and an int32 count, then a float32 flag per tensor (the largest
# |value| sent, or inf)
FRAME_BYTES = 8
FLAG_BYTES = 4
# Low rank's P and Q values of a float32 gradient, by PowerSGDSettings.values (hvd_topk.transports.lowrank_wire)
LOWRANK_VALUE_BYTES = {"fp16": 2, "fp32": 4}

# ``budget=None`` keeps one k per RANKS_PER_K ranks of the exchange, at least 1 and at most MAX_BUDGET: the
# summed candidates grow with the ranks, the more so where their data differ. Measured
# (docs/studies/2026-11-accuracy-8-16-ranks.md, 2026-11-steps-to-target.md run 10): the digits CNN at 8
# ranks, non-IID, 3 seeds: budget 2 ended within a point of dense where 1 ended 1.2-1.4 under; the MLP at 4
# ranks: budget 2 took 1.55x dense's steps against 1.65x, for 1.36x the bytes; the digits CNN at 16 ranks,
# one seed: budget 4 narrowed a 5.6-point gap to 3.9. The cap keeps split_reduce's bytes per rank flat in N
# past 16 ranks (its point against the allgather), where nothing was measured.
RANKS_PER_K, MAX_BUDGET = 4, 4.0


def budget_at(budget, ranks):
    """The multiple of k split_reduce's owners keep among ``ranks`` ranks: ``budget``, or where it is None
    ``ranks / RANKS_PER_K`` between 1 and ``MAX_BUDGET``.

    Example:
        >>> budget_at(None, 4), budget_at(None, 8), budget_at(None, 12), budget_at(None, 64), budget_at(8.0, 8)
        (1.0, 2.0, 3.0, 4.0, 8.0)
    """
    return float(budget) if budget is not None else min(MAX_BUDGET, max(1.0, ranks / RANKS_PER_K))
