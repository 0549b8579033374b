"""A 2-rank job whose ranks use different parameters: rank 1's loss goes through ``fc3``, rank 0's does
not, so Horovod allreduces rank 0's (zero) ``fc3`` gradient at ``synchronize()``, after the others: the
ranks compress their gradients in different orders. Every rank writes ``<out>/rank<r>.pt`` with its final
parameters.
"""
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

from hvd_topk import TopKEF

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--compression", choices=["none", "named", "positional", "class"], default="named")
p.add_argument("--ratio", type=float, default=0.1)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--communication", default="split_reduce", help="TopKEF's transport")
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(1234)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        if hvd.rank() == 1:
            h = torch.tanh(self.fc3(h))
        return self.head(h)


model = Net()
compression = {"none": hvd.Compression.none, "class": TopKEF,
               "named": TopKEF(ratio=args.ratio, min_numel=64, named_parameters=model.named_parameters(),
                               communication=args.communication),
               "positional": TopKEF(ratio=args.ratio, min_numel=64, communication=args.communication)}[args.compression]
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
for step in range(args.steps):
    opt.zero_grad()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * hvd.rank() + step))
    ((model(x) - x @ w_true) ** 2).mean().backward()
    opt.step()
torch.save({"params": {n: q.detach().clone() for n, q in model.named_parameters()}},
           os.path.join(args.out, f"rank{hvd.rank()}.pt"))
