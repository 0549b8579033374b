"""communication='hierarchical' where hvd.init did not register its process sets (2 hosts x 2 ranks).

``--mode none``: plain ``hvd.init()``. Building the hierarchical transport raises (the text is kept),
and ``communication='auto'`` leaves hierarchical out of its candidates.
``--mode dynamic``: ``hvd.init(process_sets="dynamic")``. ``host_sets.resolve`` adds the sets; a sum of
the ranks over each is kept. ``host_sets.release`` then removes them (Horovod's sets afterwards are
kept); ``communication='auto'`` on a model with nothing to compress adds them again at its build and
removes them at its first decision (its history and Horovod's sets after 3 steps are kept); sets that two
callers resolved are not released (Horovod's sets after the attempt are kept).

One ``hvd.init`` per launch: horovodrun's Gloo rendezvous serves one. Its server clears a scope's keys
once every rank has finished connecting, so a rank that shuts down and calls ``hvd.init`` again can
read a slower rank's keys of the previous init (a refused connect), or have its own new key cleared.
When tests/workers/hierarchical.py ran both checks before its training, re-initialising in one process,
it failed so in 1 of 6 runs beside a busy core (each rank saw only "Horovod has been shut down").

Every rank writes ``<out>/rank<r>.pt``: {"mode", "error", "auto_candidates", "sums", "released", "sets"}
and, in ``--mode dynamic``, "auto_history" and "released_held_twice".
"""
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn as nn
from horovod.torch import mpi_ops

import hvd_topk
from hvd_topk.transports import host_sets


def known_sets():
    """Horovod's own table of the process sets it knows: id -> ranks (read, through its basics: the
    public module has no reader of it)."""
    return mpi_ops._basics._get_process_set_ids_and_ranks()


p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["none", "dynamic"], required=True)
args = p.parse_args()

result = {"mode": args.mode, "error": None, "auto_candidates": None, "sums": None, "released": None, "sets": None}
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
    result["released"] = host_sets.release(sets)
    result["sets"] = {"released": known_sets()}
    model = nn.Linear(4, 1)                    # under min_numel: auto has no tensor to choose for
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), communication="auto")
    result["sets"]["auto built"] = known_sets()
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    result["sets"]["auto decided"] = known_sets()
    result["auto_history"] = [entry[3] for entry in opt.auto_state()["history"]]
    held_twice = host_sets.resolve()
    host_sets.resolve()
    result["released_held_twice"] = host_sets.release(held_twice)
    result["sets"]["held twice"] = known_sets()
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
hvd.shutdown()
