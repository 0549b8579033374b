"""Horovod's PyTorch MNIST example with one change: compression=TopKEF(...) in hvd.DistributedOptimizer.

    horovodrun -np 2 --gloo python examples/pytorch_digits_topkef.py                     # sklearn digits
    horovodrun -np 2 --gloo python examples/pytorch_digits_topkef.py --data-dir data/mnist  # MNIST files
Low rank instead: compression=hvd_topk.PowerSGD(rank=4, named_parameters=model.named_parameters()).
"""
import argparse
import hashlib

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

from data import load_dataset   # the file beside this one: digits built in, MNIST from its IDX files
from hvd_topk import TopKEF

parser = argparse.ArgumentParser(description="Horovod + TopKEF on digits or MNIST")
parser.add_argument("--data-dir", help="folder of MNIST's IDX files (default: scikit-learn's digits)")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.025)
parser.add_argument("--ratio", type=float, default=0.01, help="fraction of each gradient sent per step")
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)   # Horovod: one CPU thread per worker

x_train, y_train, x_test, y_test = load_dataset("mnist" if args.data_dir else "digits", args.data_dir)
train_set = torch.utils.data.TensorDataset(x_train, y_train)
sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveMaxPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10))
# Horovod: scale the learning rate by the number of workers.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=TopKEF(ratio=args.ratio, named_parameters=model.named_parameters()))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for epoch in range(args.epochs):
    model.train()
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():   # every rank tests its share of the test set; the accuracies are averaged
        mine = slice(hvd.rank(), None, hvd.size())
        acc = (model(x_test[mine]).argmax(1) == y_test[mine]).float().mean()
    acc = hvd.allreduce(acc, name="avg_accuracy").item()
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}/{args.epochs}: test accuracy {acc:.4f}", flush=True)
# The same parameters on every rank, so the same checksum.
checksum = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"rank {hvd.rank()}: parameters sha256 {checksum[:16]}", flush=True)
