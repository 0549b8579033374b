"""Small CNN on scikit-learn's shipped digits (8x8): dense Horovod, TopKEF in stock Horovod, or
hvd_topk.DistributedOptimizer (momentum correction, warm-up, transports).

Launch (2 ranks, Gloo, on this machine):
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression topkef
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression none
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression hvd_topk \
        --ratio 0.001 --warmup-epochs 4
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression hvd_topk \
        --optimizer adam --lr 0.001 --communication allgather
    mpirun -np 2 python examples/digits_cnn.py --compression topkef --ratio 0.001
    sbatch slurm/train_cpu.sbatch examples/digits_cnn.py --compression topkef --checkpoint ckpt/digits.pt
With --checkpoint, every rank saves its own file (model, optimizer, TopKEF residuals, position) at each
epoch's end, and at the next step after SIGUSR1/SIGTERM, then exits with status 85 (EXIT_REQUEUE), on
which slurm/*.sbatch requeue the job; a run that finds the files resumes where they left off.
Bytes per step come from the loopback's interface counters; run it in a private network namespace
(examples/demo.py does) so that they count this job's traffic only.
"""
import argparse
import glob
import json
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from tqdm import tqdm

import hvd_topk
import hvd_topk.checkpoint
from hvd_topk import TopKEF
from hvd_topk.wire import loopback_bytes

# -- arguments (one screen) ----------------------------------------------------------------------
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--compression", choices=["none", "fp16", "topkef", "hvd_topk"], default="topkef")
p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
p.add_argument("--communication", choices=["artopk", "allgather", "dense"], default="artopk",
               help="hvd_topk: transport")
p.add_argument("--leader", choices=["star", "var"], default="star", help="hvd_topk: AR-Topk leader")
p.add_argument("--selection", choices=["layerwise", "global"], default="layerwise",
               help="hvd_topk: top-k per tensor, or over all compressed tensors at once")
p.add_argument("--momentum-correction", choices=["auto", "on", "off"], default="auto",
               help="hvd_topk: DGC momentum correction (auto: on for SGD with momentum)")
p.add_argument("--warmup-epochs", type=int, default=0, help="hvd_topk: DGC warm-up epochs")
p.add_argument("--ratio", type=float, default=0.01, help="TopKEF: fraction of elements kept")
p.add_argument("--min-numel", type=int, default=1024, help="TopKEF: smaller tensors go dense")
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--batch-size", type=int, default=16, help="per rank")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--momentum", type=float, default=0.9)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--json-out", default=None, help="rank 0 writes its results here")
p.add_argument("--quiet", action="store_true", help="no progress bar")
p.add_argument("--checkpoint", default=None, help="per-rank checkpoint path: resume from it, save each "
               "epoch, and on SIGUSR1/SIGTERM save and exit 85 (EXIT_REQUEUE)")
args = p.parse_args()
EXIT_REQUEUE = 85   # "saved on a signal, run me again": slurm/*.sbatch requeue the job on it


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    # Record SIGUSR1/SIGTERM (Slurm's warnings) from the start; acted on at a step boundary.
    stop = on_signals(signal.SIGUSR1, signal.SIGTERM) if args.checkpoint else None
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_test = len(y) // 5
    x_test, y_test = x[order[:n_test]], y[order[:n_test]]
    x_train, y_train = x[order[n_test:]], y[order[n_test:]]

    model = Net()
    comp = None    # the TopKEF instance given to stock Horovod: it holds this rank's residuals
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.compression == "hvd_topk":
        opt = hvd_topk.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            compression=TopKEF(ratio=args.ratio, min_numel=args.min_numel),
            communication=args.communication, leader=args.leader, warmup_epochs=args.warmup_epochs,
            selection=args.selection,
            momentum_correction={"auto": None, "on": True, "off": False}[args.momentum_correction])
    else:
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                       "topkef": TopKEF(ratio=args.ratio, min_numel=args.min_numel)}[args.compression]
        if args.compression == "topkef":
            comp = compression
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    resumed = resume(model, opt, comp) if args.checkpoint else None   # hvd_topk's: in opt.state_dict()
    start_epoch, start_step = resumed or (0, 0)

    steps_per_epoch = len(y_train) // (args.batch_size * hvd.size())
    total = steps_per_epoch * args.epochs
    done = start_epoch * steps_per_epoch + start_step
    bar = tqdm(total=total, initial=done, disable=hvd.rank() != 0 or args.quiet, desc=args.compression,
               mininterval=1.0)
    hvd.allreduce(torch.zeros(1), name="barrier.start")
    tx0, t0 = loopback_bytes()[0], time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        mine = perm[hvd.rank()::hvd.size()]
        if args.compression == "hvd_topk":
            opt.set_epoch(epoch)
        model.train()
        for s in range(start_step if epoch == start_epoch else 0, steps_per_epoch):
            # Every rank must stop at the same step: agree on the flag with one tiny allreduce.
            if stop is not None and hvd.allreduce(torch.tensor([float(bool(stop))]), op=hvd.Max,
                                                  name="ckpt.stop").item() > 0:
                save(model, opt, comp, epoch, s, why=f"signal {stop[0]}")
                bar.close()
                sys.exit(EXIT_REQUEUE)
            idx = mine[s * args.batch_size:(s + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            bar.update(1)
        bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", acc=f"{evaluate(model, x_test, y_test):.3f}")
        if args.checkpoint:
            save(model, opt, comp, epoch + 1, 0, why="end of epoch")
    hvd.allreduce(torch.zeros(1), name="barrier.end")
    wall, tx1 = time.perf_counter() - t0, loopback_bytes()[0]
    bar.close()

    acc = evaluate(model, x_test, y_test)
    # Parameters must be identical on every rank: compare against rank 0's.
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    same = bool(torch.equal(hvd.broadcast(flat, root_rank=0, name="check.params"), flat))
    same = hvd.allreduce(torch.tensor([float(same)]), op=hvd.Min, name="check.same").item() == 1.0
    result = {"compression": args.compression, "optimizer": args.optimizer,
              "ratio": args.ratio if args.compression in ("topkef", "hvd_topk") else None,
              "ranks": hvd.size(), "steps": total, "test_accuracy": acc,
              "loopback_tx_bytes": tx1 - tx0,
              "bytes_per_rank_per_step": (tx1 - tx0) / hvd.size() / max(1, total - done),
              "wall_s": wall, "params_identical": same,
              "num_params": sum(q.numel() for q in model.parameters())}
    if args.checkpoint:
        result["resumed_from"] = {"epoch": start_epoch, "step": start_step} if resumed else None
    if hvd.rank() == 0:
        print(json.dumps(result))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)


def on_signals(*signums):
    """Install handlers that only record the signal; the training loop acts on it at a step boundary."""
    got = []
    for signum in signums:
        signal.signal(signum, lambda num, frame: got.append(signal.Signals(num).name))
    return got


def save(model, opt, comp, epoch, step, why):
    """Every rank writes its own file (the error-feedback residuals are per rank); then a barrier."""
    extra = {"epoch": epoch, "step": step}
    if comp is not None:
        extra["compressor"] = comp.state_dict()
    hvd_topk.save_checkpoint(args.checkpoint, model, opt, **extra)
    hvd.allreduce(torch.zeros(1), name="ckpt.saved")   # nobody exits while another rank still writes
    if hvd.rank() == 0:
        print(f"checkpoint: saved {args.checkpoint} ({hvd.size()} ranks) at epoch {epoch} step {step} "
              f"({why})", flush=True)


def resume(model, opt, comp):
    """Load this rank's checkpoint if every rank has one: (epoch, step) to go on from, or None."""
    mine = os.path.exists(hvd_topk.checkpoint.rank_path(args.checkpoint))
    others = glob.glob(glob.escape(args.checkpoint) + ".rank*-of-*")   # any world size
    have, clash = hvd.allreduce(torch.tensor([float(mine), float(bool(others) and not mine)]),
                                op=hvd.Sum, name="ckpt.have").tolist()
    if have == 0 and clash:   # residuals are per rank: never start over beside another size's files
        sys.exit(f"{args.checkpoint}: checkpoints of another world size exist, none for {hvd.size()} "
                 "ranks; remove them or use another --checkpoint")
    if have == 0:
        return None
    if have != hvd.size():
        sys.exit(f"{args.checkpoint}: only {have:.0f} of {hvd.size()} ranks found their checkpoint file")
    extra = hvd_topk.load_checkpoint(args.checkpoint, model, opt)
    if comp is not None:
        comp.load_state_dict(extra["compressor"])
    if hvd.rank() == 0:
        print(f"checkpoint: resumed from {args.checkpoint} at epoch {extra['epoch']} step {extra['step']}",
              flush=True)
    return extra["epoch"], extra["step"]


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


if __name__ == "__main__":
    main()
