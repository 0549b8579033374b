"""Fused buckets against per-tensor sends, through both front doors (tests/test_fused.py).

One small MLP trained ``--steps`` steps per run (8 unless told), fresh each time, on gradients that
become ready in different orders on different ranks (odd ranks: one backward pass per parameter, last
layer first... reversed) and with a layer that rank 0 never uses (Horovod submits its zero gradient at
``synchronize()``). Each of hvd_topk.DistributedOptimizer and stock Horovod with TopKEF, each of
split_reduce and allgather, runs with exact values ('fp32') three times: every tensor alone
(``bucket_cap_mb`` of one element), in several buckets, and in one bucket for the whole step; then once
with the default 16-bit values, and once with ``selection='global'`` (exact values: one top-k over the
step's tensors, both doors alike). Then the optimizer with every tensor pinned to 'dense_fp16', at the
three bucket caps, and with the tensors pinned in turn to 'dense_fp16' (or 'lowrank') and 'split_reduce'
(``mixed``).
Then a model with an embedding table, with ``selection='global'`` through both doors (``rows``): the
table's gradient is row-sparse, so it is selected alone beside the pooled linear layers; each run goes
``--steps`` steps straight, and half of them, a checkpoint (state dicts) and the rest in fresh objects.
With 2 ranks, first: a bucket's ``drain`` while rank 1 comes a second late (``late``).
Writes ``<out>/rank<r>.pt``: per run the final parameters and the last step's stats.
"""
import argparse
import os
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk.transports.collectives import ranks_share_cores
from hvd_topk.transports.fused import Buckets

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
CAPS = {"alone": 1e-7, "buckets": 0.02, "one": 0.0}      # MB of float32 gradient per bucket


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        # no biases and min_numel=0 below: every tensor is compressed; a dense one's sum over 3 ranks
        # would depend on what Horovod's timing fused it with
        self.body = nn.ModuleList([nn.Linear(a, b, bias=False) for a, b in [(32, 64), (64, 64), (64, 64), (64, 48)]])
        self.extra = nn.Linear(48, 48, bias=False)        # unused on rank 0
        self.head = nn.Linear(48, 1, bias=False)

    def forward(self, x):
        for layer in self.body:
            x = torch.tanh(layer(x))
        if hvd.rank() != 0:
            x = torch.tanh(self.extra(x))
        return self.head(x)


def train(door, communication, values, cap, selection="layerwise", pin=None):
    torch.manual_seed(1234)
    model = Net()
    # the optimizer door selects as TopKEF's settings say, too
    compression = hvd_topk.TopKEF(ratio=0.05, min_numel=0, named_parameters=model.named_parameters(),
                                  communication=communication, values=values, bucket_cap_mb=cap, selection=selection)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if door == "opt":
        names = [n for n, _ in model.named_parameters()]
        settings = None if pin is None else hvd_topk.OptimizerSettings(pin={n: pin(i) for i, n in enumerate(names)})
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression,
                                            settings=settings)
    else:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * hvd.rank() + step))
        loss = ((model(x) - x @ w_true) ** 2).mean()
        used = [q for name, q in model.named_parameters() if hvd.rank() != 0 or not name.startswith("extra")]
        order = used[::-1 if hvd.rank() % 2 else 1]       # Horovod's hook of each fires in this order
        for i, q in enumerate(order):
            loss.backward(inputs=[q], retain_graph=i < len(order) - 1)
        opt.step()
    stats = opt.stats() if door == "opt" else compression.stats()
    return {"params": {n: q.detach().clone() for n, q in model.named_parameters()}, "stats": stats}


class Bag(nn.Module):
    """An embedding table (each rank's 16 documents of 6 tokens touch at most 96 of its 1024 rows) and two
    linear layers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(1024, 16, mode="mean")
        self.fc1, self.fc2 = nn.Linear(16, 64, bias=False), nn.Linear(64, 16, bias=False)

    def forward(self, tokens):
        return self.fc2(torch.tanh(self.fc1(self.emb(tokens))))


def make_rows(door, communication):
    model = Bag()
    compression = hvd_topk.TopKEF(ratio=0.05, min_numel=0, named_parameters=model.named_parameters(),
                                  communication=communication, values="fp32", selection="global")
    base = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    wrap = hvd_topk.DistributedOptimizer if door == "opt" else hvd.DistributedOptimizer
    return model, compression, wrap(base, named_parameters=model.named_parameters(), compression=compression)


def train_rows(door, communication, stop_at=None):
    """``--steps`` steps; with ``stop_at``, the state after that many goes into fresh objects first."""
    torch.manual_seed(99)
    model, compression, opt = make_rows(door, communication)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    first_nonzero, left = None, []
    for step in range(args.steps):
        if step == stop_at:
            saved = [model.state_dict(), opt.state_dict(), compression.state_dict()]
            model, compression, opt = make_rows(door, communication)
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            if door == "stock":             # TopKEF keeps its own state; the optimizer's holds it
                compression.load_state_dict(saved[2])
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        tokens, target = torch.randint(0, 1024, (16, 6), generator=g), torch.randn(16, 16, generator=g)
        ((model(tokens) - target) ** 2).mean().backward()
        if door == "stock":                 # TopKEF's bucket left in the last compress; drained there?
            transport = compression.transports.own[communication]
            left.append((compression.pool.bucket.pending is not None, not transport.buckets.flights))
        opt.step()                          # the parameters' .grad now hold the aggregates
        if step == 0:
            first_nonzero = {n: int((q.grad != 0).sum()) for n, q in model.named_parameters()}
    state = opt.state_dict()["hvd_topk"] if door == "opt" else compression.state_dict()
    return {"params": {n: q.detach().clone() for n, q in model.named_parameters()},
            "stats": opt.stats() if door == "opt" else compression.stats(),
            "first_nonzero": first_nonzero, "row_sparse": state["row_sparse"], "left": left,
            "shared_cores": ranks_share_cores()}


def late_rank():
    """``Buckets.drain`` gives up at its deadline while rank 1 is late, and ``finish`` then completes."""
    def phases(name, items):
        gathered = yield "gather", hvd.allgather_async(torch.tensor([float(hvd.rank())]), name=f"{name}.late")
        return {key: gathered for key in items}
    buckets = Buckets("test.drain", phases)
    if hvd.rank() == 1:
        time.sleep(1.0)
    buckets.add("x", None)
    t0 = time.monotonic()
    buckets.drain(t0 + 0.2)
    waited, in_flight = time.monotonic() - t0, bool(buckets.flights)
    return {"waited": waited, "in_flight": in_flight, "gathered": buckets.finish("x").tolist()}


result = {"late": late_rank()} if hvd.size() == 2 else {}
for door in ("opt", "stock"):
    for communication in ("split_reduce", "allgather"):
        for stop_at in (None, args.steps // 2):
            result[(door, communication, "rows", stop_at)] = train_rows(door, communication, stop_at)
for door in ("opt", "stock"):
    for communication in ("split_reduce", "allgather"):
        for label, cap in CAPS.items():
            result[(door, communication, "fp32", label)] = train(door, communication, "fp32", cap)
        result[(door, communication, "bf16", "buckets")] = train(door, communication, "bf16", CAPS["buckets"])
        result[(door, communication, "fp32", "global")] = train(door, communication, "fp32", CAPS["buckets"], "global")
for label, cap in CAPS.items():              # every tensor pinned to dense in fp16: its own buckets
    result[("opt", "dense_fp16", "fp16", label)] = train("opt", "split_reduce", "fp32", cap, pin=lambda i: "dense_fp16")
# two fused transports of several phases each (on 3 ranks) in one step, finished in other orders by other ranks
for pair in (("dense_fp16", "split_reduce"), ("lowrank", "split_reduce")):
    result[("opt", "mixed", pair[0], "buckets")] = train("opt", "split_reduce", "fp32", CAPS["buckets"],
                                                         pin=lambda i, pair=pair: pair[i % 2])
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
