"""Image classification with Horovod and Top-K compression: a small CNN on scikit-learn's shipped
8x8 digits (built in), or real MNIST / CIFAR-10 files; dense Horovod, TopKEF or PowerSGD in stock
Horovod, or hvd_topk.DistributedOptimizer (momentum correction, warm-up, transports, low rank).

Launch (2 ranks, Gloo, on this machine):
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression topkef
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression none
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression hvd_topk \
        --ratio 0.001 --warmup-epochs 4
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression hvd_topk \
        --optimizer adam --lr 0.001 --communication allgather
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --compression powersgd --powersgd-rank 4
    mpirun -np 2 python examples/digits_cnn.py --compression topkef --ratio 0.001
    sbatch slurm/train_cpu.sbatch examples/digits_cnn.py --compression topkef --checkpoint ckpt/digits.pt
Other data, models and skew:
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --dataset mnist \
        --data-dir data/mnist --epochs 2 --eval-every 200
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --dataset cifar10 \
        --data-dir data/cifar-10-batches-bin --model resnet18 --lr 0.1 --batch-size 64 --time-budget 600
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --model wide --max-steps 300 \
        --json-out wide.json          # ~6.3M parameters, cheap compute: the bandwidth benchmark's model
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_cnn.py --non-iid --compression hvd_topk \
        --tensorboard runs/noniid
Datasets (examples/data.py): digits = scikit-learn's 8x8 digits (80/20 split, fixed seed); mnist =
the four IDX files (plain or .gz); cifar10 = the binary batches data_batch_1..5.bin + test_batch.bin.
Models: cnn = 2 conv + 2 fc layers (~0.15M parameters; adaptive pooling to 4x4 makes it take any
input size); wide = the same conv trunk with a 1024-2048-2048-10 classifier (~6.3M parameters, little
compute); resnet18 = CIFAR-style ResNet-18 (~11.2M parameters).
--non-iid: McMahan et al.'s label shards: the training samples sorted by label are cut into
2 * ranks equal shards (--shards-per-rank) and each rank gets 2 of them, dealt in a seeded order, so
each rank sees only a few labels; every rank has the same number of samples and steps per epoch.
Rank 0 prints each rank's label histogram. The test set stays the whole, balanced test set.
Stopping: --epochs, --max-steps (optimizer steps in total) and --time-budget (seconds of training,
evaluation excluded), whichever comes first; all ranks stop at the same step.
With --checkpoint, every rank saves its own file (model, optimizer, residuals, position) at each
epoch's end, and at the next step after SIGUSR1/SIGTERM, then exits with status 85 (EXIT_REQUEUE), on
which slurm/*.sbatch requeue the job; a run that finds the files resumes where they left off.
Rank 0 writes the run's record to --json-out: its settings, per-step times and link bytes, the test
curve and the final figures (examples/common.py, RunLog); stdout gets one summary line (JSON, the
final figures only) and, under horovodrun, one progress line per epoch. Bytes per step come from the
loopback's interface counters; run it in a private network namespace (python -m bench demo does) so
that they count this job's traffic only. BatchNorm statistics (resnet18) are per rank; rank 0 evaluates.
"""
import argparse
import glob
import os
import signal
import sys

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import hvd_topk
import hvd_topk.step.checkpoint
from common import RunLog, add_compression_args, add_run_args, check_compression_args, distributed_optimizer
from data import DATASETS, label_histogram, load_dataset, shard_partition

# -- arguments (one screen) ----------------------------------------------------------------------
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_compression_args(p)
add_run_args(p)
p.add_argument("--dataset", choices=DATASETS, default="digits")
p.add_argument("--data-dir", default=None, help="mnist/cifar10: folder with the real files")
p.add_argument("--model", choices=["cnn", "wide", "resnet18"], default="cnn")
p.add_argument("--non-iid", action="store_true", help="label-skewed shards per rank (McMahan et al.)")
p.add_argument("--shards-per-rank", type=int, default=2, help="--non-iid: label shards per rank")
p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--batch-size", type=int, default=16, help="per rank")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--momentum", type=float, default=0.9)
p.add_argument("--weight-decay", type=float, default=0.0)
p.add_argument("--eval-batch-size", type=int, default=500)
p.add_argument("--checkpoint", default=None, help="per-rank checkpoint path: resume from it, save each "
               "epoch, and on SIGUSR1/SIGTERM save and exit 85 (EXIT_REQUEUE)")
args = None         # parsed when run as a script; importing this file (tests: the models) parses nothing
EXIT_REQUEUE = 85   # "saved on a signal, run me again": slurm/*.sbatch requeue the job on it


class Net(nn.Module):
    """The small CNN; ``fc_sizes`` (wide) puts a wider classifier on the same conv trunk."""

    def __init__(self, in_channels=1, fc_sizes=(128,)):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        # Attribute names fc1, fc2 (, fc3) keep the parameter names of the original CNN.
        sizes = [64 * 4 * 4, *fc_sizes, 10]
        self.fcs = [f"fc{i + 1}" for i in range(len(sizes) - 1)]
        for name, n_in, n_out in zip(self.fcs, sizes, sizes[1:]):
            setattr(self, name, nn.Linear(n_in, n_out))

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        if x.shape[-2:] != (4, 4):              # 8x8 digits are 4x4 here already: left untouched
            x = F.adaptive_avg_pool2d(x, 4)
        x = x.flatten(1)
        for name in self.fcs[:-1]:
            x = F.relu(getattr(self, name)(x))
        return getattr(self, self.fcs[-1])(x)


# ResNet-18 for 32x32 inputs (He et al. 2016; the CIFAR variant: 3x3 stem, no max-pool), written out
# because torchvision is not installed here. Same layout as torchvision's BasicBlock ResNet-18.
class BasicBlock(nn.Module):
    def __init__(self, n_in, n_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(n_in, n_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(n_out)
        self.conv2 = nn.Conv2d(n_out, n_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(n_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or n_in != n_out:
            self.shortcut = nn.Sequential(nn.Conv2d(n_in, n_out, 1, stride, bias=False), nn.BatchNorm2d(n_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, in_channels=3, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, n_in = [], 64
        for n_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(n_in, n_out, stride), BasicBlock(n_out, n_out, 1)))
            n_in = n_out
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build_model(name, in_channels):
    """The model called ``name`` for inputs with ``in_channels`` channels."""
    if name == "cnn":
        return Net(in_channels)
    if name == "wide":
        return Net(in_channels, fc_sizes=(2048, 2048))
    return ResNet18(in_channels)


def main():
    # Record SIGUSR1/SIGTERM (Slurm's warnings) from the start; acted on at a step boundary.
    stop = on_signals(signal.SIGUSR1, signal.SIGTERM) if args.checkpoint else None
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    try:
        x_train, y_train, x_test, y_test = load_dataset(args.dataset, args.data_dir)
    except (OSError, ValueError) as e:
        sys.exit(f"digits_cnn.py: {e}")

    model = build_model(args.model, x_train.shape[1])
    if args.optimizer == "sgd":
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                               weight_decay=args.weight_decay)
    else:
        base = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    opt, comp = distributed_optimizer(args, model, base)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    resumed = resume(model, opt, comp) if args.checkpoint else None   # hvd_topk's: in opt.state_dict()
    start_epoch, start_step = resumed or (0, 0)

    # Which training samples are whose: every rank computes every rank's part the same way.
    parts = shard_partition(y_train, hvd.size(), args.shards_per_rank, seed=args.seed) if args.non_iid else None
    if parts is not None and hvd.rank() == 0:
        for r, part in enumerate(parts):
            print(f"non-iid: rank {r} label histogram {label_histogram(y_train[part])}", flush=True)
    per_rank = len(parts[0]) if parts is not None else len(y_train) // hvd.size()
    steps_per_epoch = per_rank // args.batch_size
    if steps_per_epoch == 0:
        sys.exit(f"digits_cnn.py: {per_rank} samples per rank is less than one batch of {args.batch_size}")
    total = steps_per_epoch * args.epochs
    if args.max_steps > 0:
        total = min(total, args.max_steps)
    done = start_epoch * steps_per_epoch + start_step

    log = RunLog(args, example="digits_cnn", model=model, model_name=args.model, dataset=args.dataset,
                 non_iid=args.non_iid, start_step=done)
    # A bar only on a terminal: under horovodrun (a pipe) its redraws arrive as one line of prefixed
    # fragments, so rank 0 prints one line per epoch there instead.
    progress = hvd.rank() == 0 and not args.quiet
    bar = tqdm(total=total, initial=done, disable=not (progress and sys.stderr.isatty()), desc=args.compression,
               mininterval=1.0)
    epoch_lines = progress and bar.disable
    log.start()
    epoch, test = start_epoch, None
    for epoch in range(start_epoch, args.epochs):
        if parts is not None:
            part = parts[hvd.rank()]
            mine = part[torch.randperm(len(part), generator=torch.Generator().manual_seed(epoch))]
        else:
            perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
            mine = perm[hvd.rank()::hvd.size()]
        if args.compression.startswith("hvd_topk"):
            opt.set_epoch(epoch)
        model.train()
        for s in range(start_step if epoch == start_epoch else 0, steps_per_epoch):
            # Every rank must stop at the same step: agree with one tiny allreduce. Across nodes the
            # signal reaches the ranks at different times, so a rank may stop on another's signal
            # before its own arrives: the ranks agree on the signal too (the highest number any got).
            signum = 0 if stop is None else int(hvd.allreduce(
                torch.tensor([float(max((signal.Signals[name].value for name in stop), default=0))]),
                op=hvd.Max, name="ckpt.stop").item())
            if signum:
                save(model, opt, comp, epoch, s, why=f"signal {signal.Signals(signum).name}")
                bar.close()
                sys.exit(EXIT_REQUEUE)
            if log.should_stop(log.step):
                break
            idx = mine[s * args.batch_size:(s + 1) * args.batch_size]
            log.begin_step()
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            log.end_step(opt, loss)
            bar.update(1)
            if args.eval_every > 0 and log.eval_due():
                test = evaluate_point(log, model, x_test, y_test, steps_per_epoch)
        else:   # the epoch ran to its end
            if args.eval_every == 0:
                test = evaluate_point(log, model, x_test, y_test, steps_per_epoch)
                if test is not None:
                    bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", acc=f"{test[1]:.3f}")
                    if epoch_lines:
                        print(f"epoch {epoch + 1}/{args.epochs}: step {log.step}, train loss {loss.item():.3f}, "
                              f"test acc {test[1]:.4f}, {log.wall():.1f} s", flush=True)
            if args.checkpoint:
                with log.paused():
                    save(model, opt, comp, epoch + 1, 0, why="end of epoch")
            continue
        break   # stopped by --max-steps or --time-budget
    bar.close()

    # The final figures: the last evaluation if it was made after the last step, else a new one.
    if not log.curve or log.curve[-1]["step"] != log.step:
        test = evaluate_point(log, model, x_test, y_test, steps_per_epoch)
    result = {"test_loss": test[0], "test_accuracy": test[1]} if test is not None else {}
    if args.checkpoint:
        result["resumed_from"] = {"epoch": start_epoch, "step": start_step} if resumed else None
    log.finish(model, result)


def evaluate_point(log, model, x, y, steps_per_epoch):
    """Rank 0 evaluates (outside the training clock) and adds a curve point at (steps, epochs done):
    (loss, acc); None on the other ranks."""
    if hvd.rank() != 0:
        return None
    with log.paused():
        loss, acc = evaluate(model, x, y)
    log.eval_point(log.step, log.step / steps_per_epoch, loss, acc)
    model.train()
    return loss, acc


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
    mine = os.path.exists(hvd_topk.step.checkpoint.rank_path(args.checkpoint))
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
    """(mean cross-entropy, accuracy) on (x, y), in batches of --eval-batch-size."""
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), args.eval_batch_size):
            out = model(x[i:i + args.eval_batch_size])
            loss += F.cross_entropy(out, y[i:i + args.eval_batch_size], reduction="sum").item()
            correct += int((out.argmax(1) == y[i:i + args.eval_batch_size]).sum())
    return loss / len(y), correct / len(y)


if __name__ == "__main__":
    args = p.parse_args()
    check_compression_args(p, args)
    main()
