"""Elastic training with hvd_topk: the digits MLP, written as Horovod's elastic documentation writes it.

Workers may join and leave while it trains; ``state.commit()`` saves the model, the optimizer and
hvd_topk's per-rank residuals, and every reset brings the ranks back in step (docs/elastic.md).

    # on one machine: a hosts file that you edit while it runs (e.g. localhost:2, then localhost:3)
    echo localhost:2 > /tmp/hosts; printf '#!/bin/sh\\ncat /tmp/hosts\\n' > /tmp/discover.sh
    chmod +x /tmp/discover.sh
    horovodrun -np 2 --min-np 1 --max-np 3 --host-discovery-script /tmp/discover.sh \\
        --network-interface lo python examples/elastic_digits.py --epochs 20
"""
import argparse

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_topk
from data import load_dataset   # examples/data.py, beside this file
from hvd_topk import TopKEF

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--ratio", type=float, default=0.01)
p.add_argument("--commit-every", type=int, default=10, help="batches between commits")
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
x_train, y_train, x_test, y_test = load_dataset("digits")
x_train, x_test = x_train.flatten(1), x_test.flatten(1)
model = nn.Sequential(nn.Linear(x_train.shape[1], 256), nn.ReLU(), nn.Linear(256, 10))
opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression=TopKEF(ratio=args.ratio, min_numel=1024),
                                    settings=hvd_topk.OptimizerSettings(warmup_steps=20))
sampler = hvd.elastic.ElasticSampler(torch.utils.data.TensorDataset(x_train, y_train), shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=args.batch_size, sampler=sampler)


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):
        state.sampler.set_epoch(state.epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            state.sampler.record_batch(state.batch, args.batch_size)
            state.batch += 1
            if state.batch % args.commit_every == 0:
                state.commit()
        state.batch = 0
        state.commit()
        if hvd.rank() == 0:
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
            print(f"epoch {state.epoch + 1}/{args.epochs}: {hvd.size()} ranks, test acc {acc:.4f}", flush=True)


train(hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0))
