"""Sizes on the wire that the transports and the cost model share (no torch, no Horovod).

The cost model (``hvd_topk.auto.costmodel``) prices the bytes the transports send; both read these, so
a change to a transport's message changes its price too.
"""
__all__ = ["INDEX_BYTES", "HIST_BINS", "HIST_BYTES"]

INDEX_BYTES = 4        # the sparse transports send int32 indices: half the bytes of int64
HIST_BINS = 128        # split_reduce's magnitude histogram: 32 octaves below the largest possible sum
# split_reduce's histogram allreduce, int32: the bins, one count of rows received outside the owner's
# region and one of senders whose size differs from the owner's (mismatch checks that ride along)
HIST_BYTES = (HIST_BINS + 2) * 4
