"""Every transport driven directly through the ``Transport`` protocol (tests/test_transports.py).

Per variant, two keys per step, started in reversed order on odd ranks and finished in key order, as
a caller does. Rank 1 poisons key "a" with a NaN at ``--nan-step``: that key's aggregate must be None
on every rank and its residual is kept. ``forget()`` is called before the last step. The variants: each
transport with exact values ('fp32': split_reduce and allgather as 8-byte rows summed), then dense,
allgather and split_reduce with 16-bit values (dense-fp16's key "b" with one entry over its clamp at
step 0), and both sparse ones with the two keys fused in one bucket. Writes
``<out>/rank<r>.pt``: per variant and step and key, the aggregate, the accumulator, what left this rank
(acc - new residual, float64), the gradient, the residual after the step and ``Started.nbytes``.

Last, ``collectives.wait`` on an allreduce that the last rank joins 1 s late: every rank records the
wall and CPU seconds of its wait (a spinning wait would spend the whole second on the CPU).
"""
import argparse
import os
import time

import horovod.torch as hvd
import torch

from hvd_topk.transports import ARTopk, Dense, SparseAllgather, SplitReduce
from hvd_topk.transports.dense import DenseFP16
from hvd_topk.transports.collectives import Collectives, Reduction, wait
from hvd_topk.transports.index_sets import IndexPipeline
from hvd_topk.transports.leaders import StarLeaders
from hvd_topk.transports.regions import Regions

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--nan-step", type=int, default=3)
p.add_argument("--numel", type=int, default=1003)      # no rank count divides it: uneven regions
p.add_argument("--k", type=int, default=12)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
KEYS = ("a", "b")
# variant -> (transport, values, fused)
VARIANTS = {"dense": ("dense", None, False), "dense-fp16": ("dense_fp16", "fp16", False),
            "artopk": ("artopk", None, False),
            "allgather": ("allgather", "fp32", False), "split_reduce": ("split_reduce", "fp32", False),
            "allgather-bf16": ("allgather", "bf16", False), "split_reduce-bf16": ("split_reduce", "bf16", False),
            "split_reduce-fp16": ("split_reduce", "fp16", False),
            "allgather-fused": ("allgather", "bf16", True), "split_reduce-fused": ("split_reduce", "bf16", True),
            "split_reduce-fused-fp32": ("split_reduce", "fp32", True)}

CLAMPED = 7             # dense-fp16's entry of key "b" that exceeds what a rank may send in fp16 at step 0
# The gradients are seeded per (transport, values): a fused variant replays its per-tensor variant's
DATA = sorted({spec[:2] for spec in VARIANTS.values()}, key=repr)


def build(variant):
    """The transport of ``variant`` averaging over all ranks, and what its caller flushes after a step's starts."""
    name, values, fused = VARIANTS[variant]
    collectives = Collectives(f"contract.{variant}.group")
    if name == "dense":
        return Dense(collectives, Reduction.of(hvd.Average), name="contract.dense"), collectives, None
    if name == "dense_fp16":
        return DenseFP16(collectives, Reduction.of(hvd.Average), name="contract.dense16"), collectives, None
    if name == "artopk":
        index_sets = IndexPipeline(f"contract.{variant}.indices")
        leaders = StarLeaders({key: i for i, key in enumerate(KEYS)})
        return ARTopk(index_sets, leaders, collectives, Reduction.of(hvd.Average)), collectives, index_sets
    if name == "allgather":
        transport = SparseAllgather(collectives, True, values, name=f"contract.{variant}")
    else:
        transport = SplitReduce(collectives, True, Regions(rebalance_every=2), f"contract.{variant}", values)
    if fused:
        transport.buckets.set_plan([list(KEYS)])
    return transport, collectives, None


def run(variant):
    transport, collectives, index_sets = build(variant)
    residual = {key: torch.zeros(args.numel) for key in KEYS}
    k = args.numel if variant.startswith("dense") else args.k
    records = []
    for step in range(args.steps):
        if step == args.steps - 1:
            # As after an elastic reset, every rank at once. A reset's collectives died with Horovod;
            # here AR-Topk's index-set allgather is still in flight, so it is waited for first (a new
            # one under the same name would be refused while it runs).
            if index_sets is not None:
                index_sets.receive()
            transport.forget()
        started = {}
        for key in (reversed(KEYS) if hvd.rank() % 2 else KEYS):
            seed = 100000 * DATA.index(VARIANTS[variant][:2]) + 1000 * hvd.rank() + 10 * step + KEYS.index(key)
            gen = torch.Generator().manual_seed(seed)
            g = torch.randn(args.numel, generator=gen)
            if variant == "dense-fp16" and key == "b":    # beyond the clamp once (exact in float32), then 0
                g[CLAMPED] = 2e4 if step == 0 else 0.0
            acc = g + residual[key]
            if step == args.nan_step and hvd.rank() == 1 and key == "a":
                acc[5] = float("nan")
            finite = bool(torch.isfinite(acc).all())
            before = acc.clone()               # the transport may write the residual into acc
            started[key] = (transport.start(key, acc, k, finite, grad=g, step=step, k_next=k), acc, before, g)
        if index_sets is not None:
            index_sets.flush()                 # the step's last start: AR-Topk's next sets leave
        for key in KEYS:
            st, acc, before, g = started[key]
            out = st.finish()
            if out.residual is not None:
                new = out.residual.clone()
            elif out.sent is not None:
                new = acc.clone().index_fill_(0, out.sent, 0)
            else:
                new = torch.zeros(args.numel)
            if out.aggregate is not None:      # committed only if every rank was finite
                residual[key] = new
            records.append(dict(step=step, key=key, aggregate=out.aggregate, acc=before.double(),
                                sent=before.double() - residual[key].double() if out.aggregate is not None else None,
                                grad=g.double(), residual=residual[key].double().clone(), nbytes=st.nbytes, k=k,
                                sent_count=None if out.sent is None else out.sent.numel()))
        collectives.end_step()
    return records


def late_wait(late_s=1.0):
    """(wall s, this thread's CPU s) of wait() on an allreduce that the last rank starts late_s late."""
    if hvd.rank() == hvd.size() - 1:
        time.sleep(late_s)
    handle = hvd.allreduce_async(torch.ones(4), name="late_wait")
    wall, cpu = time.perf_counter(), time.thread_time()
    assert torch.equal(wait(handle), torch.ones(4))
    return time.perf_counter() - wall, time.thread_time() - cpu


result = {variant: run(variant) for variant in VARIANTS}
result["size"] = hvd.size()
result["late_wait"] = late_wait()
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
