"""Packed Top-K messages (hvd_topk/core/codec.py) through Horovod's alltoall and allgather (tests/test_codec.py).

Per value kind, two rounds. In each, every rank sends every owner one buffer holding one message per
tensor, for the owner's region of it, laid end to end as a fused exchange would (alltoall, int32
splits); then every rank's message of the whole first tensor goes to all (allgather, sizes read from
the headers). In the second round each rank sends nothing to the next rank for the first tensor (an
empty message), and the last rank sends an empty allgather message. The entries include the indices at
the 65,536-index block bounds and at the regions' bounds.

Writes ``<out>/rank<r>.pt``: per (kind, round), what this rank encoded for each owner and tensor (the
entries in index order, values as ``sent_values``, and the originals), what it decoded from each
sender, the bytes it sent, and the same for the allgather.
"""
import argparse
import os

import horovod.torch as hvd
import torch

from hvd_topk.core.codec import VALUE_KINDS, pack, sent_values, split_messages, unpack

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
P, RANK = hvd.size(), hvd.rank()
if P != 2:
    raise SystemExit(f"codec_wire.py runs on 2 ranks, got {P}")
# (numel, region bounds of the 2 owners): the first crosses three block bounds, one of them a region
# bound; the second is small enough that its messages hold every index of their regions (k = span)
TENSORS = [(200_003, [0, 131_072, 200_003]), (5, [0, 3, 5])]
BOUNDS_AT = [65_535, 65_536, 131_071, 131_072, 131_073, 196_608, 200_002]


def entries(seed, lo, hi, k):
    """k distinct indices in [lo, hi) (the block and region bounds among them) and their values: normal,
    tiny and huge magnitudes, zeros."""
    gen = torch.Generator().manual_seed(seed)
    fixed = torch.tensor([i for i in BOUNDS_AT if lo <= i < hi] + [lo, hi - 1], dtype=torch.long).unique()
    rest = torch.randperm(hi - lo, generator=gen)[:k] + lo
    indices = torch.cat([fixed, rest[~torch.isin(rest, fixed)]])[:k]
    indices = indices[torch.randperm(indices.numel(), generator=gen)]           # in no order, as top-k's
    scale = torch.tensor([1.0, 1e-30, 1e30, 0.0])[torch.randint(0, 4, (indices.numel(),), generator=gen)]
    return torch.randn(indices.numel(), generator=gen) * scale, indices


def encoded(values, indices):
    """What the receiver must decode: the entries in index order, values as sent."""
    order = indices.argsort()
    return indices[order], values[order]


def exchange(kind, round_):
    record = {"sent": {}, "received": {}, "gathered": {}}
    buffers, splits = [], []
    for owner in range(P):
        nbytes = 0
        for t, (numel, bounds) in enumerate(TENSORS):
            lo, hi = bounds[owner], bounds[owner + 1]
            k = 0 if round_ == 1 and t == 0 and owner == (RANK + 1) % P else min(hi - lo, 300 + 50 * RANK)
            values, indices = entries(10_000 * RANK + 100 * owner + 10 * t + round_, lo, hi, k)
            message = pack(values, indices, lo, hi, kind)
            buffers.append(message)
            nbytes += message.numel()
            sent = sent_values(values, kind)
            record["sent"][owner, t] = (*encoded(sent, indices), values[indices.argsort()], message.numel())
        splits.append(nbytes)
    received, received_splits = hvd.alltoall(torch.cat(buffers), torch.tensor(splits, dtype=torch.int32),
                                             name=f"codec.{kind}.{round_}.split")
    spans = [bounds[RANK + 1] - bounds[RANK] for _, bounds in TENSORS]
    for sender, chunk in enumerate(torch.split(received, received_splits.tolist())):
        for t, message in enumerate(split_messages(chunk, spans)):
            lo, hi = TENSORS[t][1][RANK], TENSORS[t][1][RANK + 1]
            record["received"][sender, t] = unpack(message, lo, hi)
    numel = TENSORS[0][0]
    k = 0 if round_ == 1 and RANK == P - 1 else 400 + 100 * RANK
    values, indices = entries(20_000 + 10 * RANK + round_, 0, numel, k)
    record["gather_sent"] = (*encoded(sent_values(values, kind), indices), values[indices.argsort()])
    gathered = hvd.allgather(pack(values, indices, 0, numel, kind), name=f"codec.{kind}.{round_}.gather")
    for sender, message in enumerate(split_messages(gathered, [numel] * P)):
        record["gathered"][sender] = unpack(message, 0, numel)
    return record


result = {(kind, round_): exchange(kind, round_) for kind in VALUE_KINDS for round_ in (0, 1)}
torch.save(result, os.path.join(args.out, f"rank{RANK}.pt"))
