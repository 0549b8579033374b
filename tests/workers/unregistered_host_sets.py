"""communication='hierarchical' where hvd.init did not register its process sets (2 hosts x 2 ranks).

``--mode none``: plain ``hvd.init()``. Building the hierarchical transport raises (the text is kept),
and ``communication='auto'`` leaves hierarchical out of its candidates.
``--mode dynamic``: ``hvd.init(process_sets="dynamic")``. ``host_sets.resolve`` adds the sets; a sum of
the ranks over each is kept.

One ``hvd.init`` per launch: horovodrun's Gloo rendezvous serves one. Its server clears a scope's keys
once every rank has finished connecting, so a rank that shuts down and calls ``hvd.init`` again can
read a slower rank's keys of the previous init (a refused connect), or have its own new key cleared.
When tests/workers/hierarchical.py ran both checks before its training, re-initialising in one process,
it failed so in 1 of 6 runs beside a busy core (each rank saw only "Horovod has been shut down").

Every rank writes ``<out>/rank<r>.pt``: {"mode", "error", "auto_candidates", "sums"}.
"""
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk.transports import host_sets

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["none", "dynamic"], required=True)
args = p.parse_args()

result = {"mode": args.mode, "error": None, "auto_candidates": None, "sums": None}
if args.mode == "none":
    hvd.init()
    try:
        hvd_topk.TopKEF(communication="hierarchical").transports.own    # built (the hosts' sets found) at first use
    except ValueError as e:
        result["error"] = str(e)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1),
                                        communication="auto")
    result["auto_candidates"] = sorted(opt._hvd_topk.transports)
else:
    hvd.init(process_sets="dynamic")
    sets = host_sets.resolve()
    one = torch.tensor([float(hvd.rank())])
    result["sums"] = [float(hvd.allreduce(one, op=hvd.Sum, name=f"check.{i}", process_set=ps))
                      for i, ps in enumerate((sets.host, sets.cross))]
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
hvd.shutdown()
