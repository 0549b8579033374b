"""Steps to a target accuracy at the library's defaults: the benchmarks' dense-gradient MLP (bench/tasks.py's
``mlp``: 64-1024-1024-1024-10, 2.18M parameters, its batches and SGD; rebuilt here, since tests do not
import the benchmarks) on the examples' digits, Top-K at ratio 0.01 through one front door, every other
setting at its default. Rank 0 writes ``<out>/rank0.json`` with the test accuracy every
``--eval-every`` steps; every rank writes a digest of its final parameters.
"""
import argparse
import hashlib
import json
import os
import sys

# Run as a script, so only tests/workers/ is on sys.path: the data come from the repository's examples/.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_topk  # noqa: E402
from data import load_dataset  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--door", choices=["optimizer", "stock"], required=True)
p.add_argument("--selection", choices=["default", "layerwise", "global"], default="default",
               help="default: TopKEF's own (what the test checks); the others to compare by hand")
p.add_argument("--steps", type=int, default=90)
p.add_argument("--eval-every", type=int, default=10)
p.add_argument("--seed", type=int, default=3)
p.add_argument("--batch-size", type=int, default=16)
args = p.parse_args()


def batch(step):
    """This rank's samples of ``step``: each epoch a permutation of the training set, dealt out by rank."""
    epoch, i = divmod(step, len(y_train) // hvd.size() // args.batch_size)
    mine = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch))
    picked = mine[hvd.rank()::hvd.size()][i * args.batch_size:(i + 1) * args.batch_size]
    return x_train[picked], y_train[picked]


hvd.init()
torch.set_num_threads(1)
x_train, y_train, x_test, y_test = load_dataset("digits")
torch.manual_seed(args.seed)
widths = (64, 1024, 1024, 1024, 10)
model = nn.Sequential(nn.Flatten(), *[m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())][:-1])
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
selection = {} if args.selection == "default" else {"selection": args.selection}
if args.door == "stock":
    compression = hvd_topk.TopKEF(ratio=0.01, named_parameters=model.named_parameters(), **selection)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
else:
    opt = hvd_topk.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopKEF(ratio=0.01, **selection))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
curve = []
for step in range(args.steps):
    x, y = batch(step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if (step + 1) % args.eval_every == 0:
        with torch.no_grad():
            curve.append([step + 1, (model(x_test).argmax(1) == y_test).float().mean().item()])
digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in model.parameters())).hexdigest()
with open(os.path.join(args.out, f"rank{hvd.rank()}.json"), "w") as f:
    json.dump({"curve": curve, "params": digest}, f)
