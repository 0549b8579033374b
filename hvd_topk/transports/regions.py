"""Index regions of split_reduce: which rank owns (sums and selects) which indices of a tensor.

A tensor of n elements is cut into P contiguous regions, one per rank of the process set, given by
P + 1 boundaries ``0 = b_0 <= b_1 <= ... <= b_P = n``; rank r owns ``[b_r, b_{r+1})``. They start equal.
Gradients are rarely spread evenly (an embedding's few hot rows, a layer's bias-like columns), so an
owner of a busy region would receive far more than its k/P rows. Every ``rebalance_every`` steps the
boundaries move so that each region holds the same share of the indices kept over the last period
(Ok-Topk rebalances the same way, every few hundred steps).

Why every rank gets the same boundaries without communicating: the kept indices come out of the
allgather that ends each step, identical on every rank, and the counts and boundaries are integer
arithmetic on them. A rank that disagreed would send rows outside their owner's region, which the
owners detect (``transports.split_reduce``) and report on every rank.
"""
import torch

__all__ = ["Regions"]


class Regions:
    """The boundaries of every tensor (key) and the kept-index counts they are rebalanced from.

    Args:
        rebalance_every: finished steps of a key between two rebalances, int >= 1.
    """

    CHUNKS_PER_RANK = 256              # resolution of the counts: boundaries move by whole chunks
    MAX_CHUNKS = 1 << 16               # ... and at most this many chunks per tensor (memory per key)

    def __init__(self, rebalance_every=200):
        self.rebalance_every = rebalance_every
        self.bounds = {}                # key -> int64 tensor of P + 1 boundaries
        self.counts = {}                # key -> int64 kept indices per chunk since the last rebalance
        self.steps = {}                 # key -> steps counted since the last rebalance

    def of(self, key, n, ranks):
        """The boundaries of ``key`` (n elements, ``ranks`` regions); equal regions the first time, or
        when n or the number of ranks changed."""
        b = self.bounds.get(key)
        if b is None or int(b[-1]) != n or b.numel() != ranks + 1:
            b = torch.div(torch.arange(ranks + 1, dtype=torch.int64) * n, ranks, rounding_mode="floor")
            self.bounds[key] = b
            self.counts[key] = torch.zeros(min(n, self.CHUNKS_PER_RANK * ranks, self.MAX_CHUNKS), dtype=torch.int64)
            self.steps[key] = 0
        return b

    @staticmethod
    def owners(indices, bounds):
        """Owner rank of each index: r with ``bounds[r] <= i < bounds[r + 1]``."""
        return torch.bucketize(indices, bounds[1:-1], right=True)

    def observe(self, key, kept):
        """Count the indices kept this step (identical on every rank); rebalance when the period ends."""
        b, counts = self.bounds[key], self.counts[key]
        n, chunks = int(b[-1]), counts.numel()
        counts += torch.bincount(torch.div(kept.cpu() * chunks, n, rounding_mode="floor"), minlength=chunks)
        self.steps[key] += 1
        if self.steps[key] >= self.rebalance_every:
            self.bounds[key] = self._balanced(counts, n, b.numel() - 1)
            counts.zero_()
            self.steps[key] = 0

    @staticmethod
    def _balanced(counts, n, ranks):
        """Boundaries at whole chunks such that every region holds about the same count. Every chunk
        also weighs 1/chunks of one count, so that stretches where nothing was kept are split evenly
        (and a period where nothing was kept at all gives equal regions) without diluting the counts."""
        chunks = counts.numel()
        cumulative = torch.cumsum(counts * chunks + 1, 0)
        targets = torch.div(torch.arange(1, ranks, dtype=torch.int64) * int(cumulative[-1]), ranks,
                            rounding_mode="floor")
        ends = torch.searchsorted(cumulative, targets) + 1          # chunks in regions 0..r
        inner = torch.div(ends * n, chunks, rounding_mode="floor")
        return torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([n])])

    def largest_share(self, key, kept):
        """How many of the indices ``kept`` lie in the busiest region of ``key``."""
        b = self.bounds[key]
        return int(torch.bincount(self.owners(kept.cpu(), b), minlength=b.numel() - 1).max())

    def forget(self):
        """Back to equal regions (the ranks changed: elastic reset)."""
        self.bounds, self.counts, self.steps = {}, {}, {}

    def state_dict(self):
        return {"bounds": {k: b.clone() for k, b in self.bounds.items()},
                "counts": {k: c.clone() for k, c in self.counts.items()}, "steps": dict(self.steps)}

    def load_state_dict(self, state):
        """Restore ``state_dict()``; None (a checkpoint from before split_reduce) gives equal regions."""
        if state is None:
            return self.forget()
        self.bounds = {k: b.clone() for k, b in state["bounds"].items()}
        self.counts = {k: c.clone() for k, c in state["counts"].items()}
        self.steps = dict(state["steps"])
