"""Byte-level GPT language model with dense Horovod, TopKEF or PowerSGD in stock Horovod, or hvd_topk's optimizer.

A decoder-only transformer over bytes (vocabulary 256), trained on text that ships with Python and
scikit-learn, so nothing is downloaded.

Launch (2 ranks, Gloo, on this machine):
    horovodrun -np 2 -H localhost:2 --gloo python examples/char_lm.py --compression none
    horovodrun -np 2 -H localhost:2 --gloo python examples/char_lm.py --compression topkef --ratio 0.01
    horovodrun -np 2 -H localhost:2 --gloo python examples/char_lm.py --compression hvd_topk --ratio 0.01
    horovodrun -np 2 -H localhost:2 --gloo python examples/char_lm.py --compression hvd_topk --ratio 0.01 \
        --compress update --local-momentum off --communication allgather \
        --dense-steps 20 --second-moment frozen        # each rank's AdamW update, Adam's second moment held
    horovodrun -np 2 -H localhost:2 --gloo python examples/char_lm.py --compression topkef --non-iid
    horovodrun -np 2 -H localhost:2 --gloo python examples/char_lm.py --compression hvd_topk_powersgd --powersgd-rank 4
    horovodrun -np 4 -H localhost:4 --gloo python examples/char_lm.py --n-layer 6 --d-model 256 \
        --block-size 256 --data my_corpus.txt --tensorboard runs/lm
    mpirun -np 2 python examples/char_lm.py --compression topkef --ratio 0.001
    sbatch slurm/train_cpu.sbatch examples/char_lm.py --compression hvd_topk

Default corpus (no download; the same bytes on every rank and every run of one installation): the
dataset descriptions scikit-learn ships, sklearn/datasets/descr/*.rst in file-name order (~43 KB),
followed by Python's own reference-manual help text, the dict ``pydoc_data.topics.topics`` of the
standard library (the text behind ``help('with')``), in key order (~465 KB with Python 3.11), each
piece UTF-8 encoded and separated by a blank line. ``--data FILE`` trains on a file of your own,
read as raw bytes. The last 10% of the text is held out for validation.

Data per rank: by default (IID) every rank samples random windows from the whole training text with a
generator of its own (seeded by --seed and the rank). With --non-iid, rank r of P samples only from
the r-th of P contiguous slices of the training text, so ranks see different documents (with the
default corpus and 2 ranks: rank 0 the scikit-learn descriptions and the first half of the Python
topics, rank 1 the rest), a skewed split that makes the averaged gradient matter more.

test_loss is the mean cross-entropy in nats per byte over a fixed, evenly spaced set of validation
windows, the same on every rank (ln 256 = 5.545 for a uniform guess).
"""
import argparse
import importlib.util
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

VOCAB = 256
DEFAULT_CORPUS = "sklearn-descr+pydoc-topics"
CORPUS_HELP = ("Default corpus: scikit-learn's dataset descriptions (sklearn/datasets/descr/*.rst, "
               "sorted by file name, ~43 KB), then Python's reference-manual help text (the standard "
               "library's pydoc_data.topics.topics, sorted by key, ~465 KB with Python 3.11), UTF-8, pieces "
               "separated by a blank line: ~509 KB, identical on every rank and run. The last 10% is "
               "validation. --non-iid: rank r of P samples only from the r-th of P contiguous slices of the "
               "training text.")


# -- data ----------------------------------------------------------------------------------------
def default_corpus():
    """The default text as bytes: scikit-learn's dataset descriptions, then Python's pydoc topics."""
    import pydoc_data.topics

    # Located without importing scikit-learn (slow to import, and only its text files are needed).
    descr = os.path.join(importlib.util.find_spec("sklearn").submodule_search_locations[0], "datasets", "descr")
    pieces = []
    for name in sorted(os.listdir(descr)):
        if name.endswith(".rst"):
            with open(os.path.join(descr, name), "rb") as f:
                pieces.append(f.read().strip())
    topics = pydoc_data.topics.topics
    pieces += [topics[key].strip().encode("utf-8") for key in sorted(topics)]
    return b"\n\n".join(pieces) + b"\n"


def min_corpus_bytes(block_size, slices=1):
    """Shortest text whose validation part (ceil(n / 10) bytes) holds one window of block_size + 1
    bytes and whose training part (floor(9n / 10)) splits into ``slices`` rank slices that each hold one."""
    window = block_size + 1
    return max(10 * window - 9, -(-10 * slices * window // 9))


def load_corpus(path, block_size, slices=1):
    """(uint8 tensor, name) of --data's file, or of the default corpus when path is None.

    Raises ValueError naming --data when the file is missing, empty, or too short for block_size.
    """
    if path is None:
        data, name = default_corpus(), DEFAULT_CORPUS
    else:
        if not os.path.isfile(path):
            raise ValueError(f"--data {path}: no such file")
        with open(path, "rb") as f:
            data, name = f.read(), path
        if not data:
            raise ValueError(f"--data {path}: the file is empty")
    need = min_corpus_bytes(block_size, slices)
    if len(data) < need:
        raise ValueError(
            f"--data {name}: {len(data)} bytes is too short for --block-size {block_size}"
            f"{f' on {slices} non-IID ranks' if slices > 1 else ''}: need at least {need} bytes (the "
            f"last 10% is validation, and it and every training slice must hold one window of "
            f"block_size + 1 = {block_size + 1} bytes)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), name


def split_train_val(data):
    """(train, val): the last 10% of the text is validation."""
    n_train = len(data) * 9 // 10
    return data[:n_train], data[n_train:]


def rank_slice(n, rank, size):
    """[lo, hi) of rank's contiguous 1/size share of n training bytes (--non-iid)."""
    return n * rank // size, n * (rank + 1) // size


def window_starts(lo, hi, block_size, batch_size, gen):
    """batch_size random window starts such that every window of block_size + 1 bytes lies in [lo, hi)."""
    return torch.randint(lo, hi - block_size, (batch_size,), generator=gen)


def get_batch(data, starts, block_size):
    """Inputs and next-byte targets (int64, batch x block_size) of the windows at ``starts``."""
    idx = starts[:, None] + torch.arange(block_size + 1)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


def eval_starts(n, block_size, count):
    """Fixed, evenly spaced validation windows: the same on every rank and every run."""
    # float64: float32 would misplace starts in texts over 16 MB
    return torch.linspace(0, n - block_size - 1, min(count, n - block_size), dtype=torch.float64).round().long()


# -- model ---------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level decoder-only transformer: learned token and position embeddings, n_layer blocks,
    a final LayerNorm and a linear head over 256 bytes (sharing the token embedding when tie_weights).

    Example:
        >>> model = GPT(n_layer=4, n_head=4, d_model=128, block_size=128)
        >>> logits = model(torch.zeros(2, 16, dtype=torch.long))   # (2, 16, 256)
    """

    def __init__(self, n_layer=4, n_head=4, d_model=128, block_size=128, dropout=0.0, tie_weights=True):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_head ({n_head})")
        self.block_size = block_size
        self.wte = nn.Embedding(VOCAB, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        if tie_weights:
            self.head.weight = self.wte.weight
        # GPT-2 initialisation: N(0, 0.02), residual projections scaled down by sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx):
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} bytes is longer than block_size {self.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def evaluate(model, data, starts, block_size, batch=64):
    """Mean cross-entropy (nats per byte) of the model over the windows of ``data`` at ``starts``."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            x, y = get_batch(data, starts[i:i + batch], block_size)
            total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    return total / (len(starts) * block_size)


def lr_at(step, args):
    """Linear warm-up over --warmup-iters, then cosine decay to lr/10 at --steps (or constant)."""
    if step < args.warmup_iters:
        return args.lr * (step + 1) / args.warmup_iters
    if args.schedule == "constant":
        return args.lr
    progress = min(1.0, (step - args.warmup_iters) / max(1, args.steps - args.warmup_iters))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# -- arguments (one screen) ----------------------------------------------------------------------
def build_parser():
    from common import add_compression_args, add_run_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=CORPUS_HELP,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None, metavar="FILE",
                   help="train on this file's bytes instead of the default corpus (see below)")
    p.add_argument("--non-iid", action="store_true",
                   help="rank r samples only from the r-th of P contiguous slices of the training text")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="context length in bytes")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--untied", action="store_true",
                   help="an output head of its own instead of the token embedding's")
    p.add_argument("--batch-size", type=int, default=16, help="windows per rank per step")
    p.add_argument("--steps", type=int, default=600,
                   help="optimizer steps, the cosine's length (--max-steps stops earlier, same schedule)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (adamw 2e-3, sgd 0.1)")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd momentum")
    p.add_argument("--weight-decay", type=float, default=0.1, help="on matrices and embeddings only")
    p.add_argument("--warmup-iters", type=int, default=50, help="linear learning-rate warm-up steps")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="after warm-up: cosine decay to lr/10 at --steps, or constant")
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the averaged gradient's global norm (0: off)")
    p.add_argument("--eval-windows", type=int, default=128, help="fixed validation windows")
    add_compression_args(p)
    add_run_args(p)
    p.set_defaults(eval_every=50)   # 0: after each pass over the training text
    return p


def main():
    import horovod.torch as hvd
    from common import RunLog, check_compression_args, distributed_optimizer

    p = build_parser()
    args = p.parse_args()
    check_compression_args(p, args)
    for flag in ("n_layer", "n_head", "d_model", "block_size", "batch_size", "steps", "eval_windows"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.lr is None:
        args.lr = {"adamw": 2e-3, "sgd": 0.1}[args.optimizer]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    try:
        data, name = load_corpus(args.data, args.block_size, size if args.non_iid else 1)
        torch.manual_seed(args.seed)
        model = GPT(args.n_layer, args.n_head, args.d_model, args.block_size, args.dropout, not args.untied)
    except ValueError as e:
        p.error(str(e))
    train, val = split_train_val(data)
    lo, hi = rank_slice(len(train), rank, size) if args.non_iid else (0, len(train))
    gen = torch.Generator().manual_seed(1_000_003 * args.seed + rank)   # this rank's windows
    torch.manual_seed(args.seed + 7919 * (rank + 1))                    # this rank's dropout masks
    val_starts = eval_starts(len(val), args.block_size, args.eval_windows)

    # Weight decay on matrices and embeddings, not on biases and LayerNorm (as nanoGPT does).
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer == "adamw":
        base = torch.optim.AdamW(groups, lr=lr_at(0, args), betas=(0.9, 0.99))
    else:
        base = torch.optim.SGD(groups, lr=lr_at(0, args), momentum=args.momentum)
    opt, _ = distributed_optimizer(args, model, base)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    model_name = f"gpt-{args.n_layer}x{args.d_model}"
    log = RunLog(args, example="char_lm", model=model, model_name=model_name, dataset=name,
                 non_iid=args.non_iid)
    quiet = rank != 0 or args.quiet
    if not quiet:
        print(f"{name}: {len(train)} training bytes ({'non-IID slices' if args.non_iid else 'IID'}), "
              f"{len(val)} validation bytes; {model_name}, {log.meta['num_params']} parameters, block "
              f"{args.block_size}; {size} ranks x {args.batch_size} windows; {args.compression}", flush=True)
    tokens_per_step = size * args.batch_size * args.block_size
    total = min(args.steps, args.max_steps) if args.max_steps > 0 else args.steps
    # A bar only on a terminal: under horovodrun its redraws arrive as one line of prefixed fragments;
    # the evaluation lines below show the progress there.
    bar = tqdm(total=total, disable=quiet or not sys.stderr.isatty(), desc=args.compression, mininterval=1.0)
    test_loss, evaluated_at = None, None
    log.start()
    while log.step < args.steps and not log.should_stop(log.step):
        epoch = log.step * tokens_per_step / len(train)   # passes over the training text
        for group in opt.param_groups:
            group["lr"] = lr_at(log.step, args)
        if args.compression.startswith("hvd_topk"):
            opt.set_epoch(int(epoch))                      # --warmup-epochs counts passes over the text
        log.begin_step()
        x, y = get_batch(train, window_starts(lo, hi, args.block_size, args.batch_size, gen), args.block_size)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        # Clip the averaged gradient, identical on every rank (with --compress update the gradients
        # stay local, so each rank clips its own).
        if args.grad_clip > 0:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        log.end_step(opt, loss.detach())
        bar.update(1)
        pass_done = int(log.step * tokens_per_step / len(train)) > int(epoch)   # finished a pass over the text
        if log.eval_due(epoch_end=pass_done) or log.step == args.steps:
            with log.paused():
                test_loss, evaluated_at = evaluate(model, val, val_starts, args.block_size), log.step
            log.eval_point(log.step, log.step * tokens_per_step / len(train), test_loss)
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{test_loss:.3f}")
            if not quiet:
                bar.write(f"step {log.step}: train loss {loss.item():.4f}, val loss {test_loss:.4f}")
    if evaluated_at != log.step:   # stopped by --max-steps or --time-budget between evaluations
        with log.paused():
            test_loss = evaluate(model, val, val_starts, args.block_size)
        log.eval_point(log.step, log.step * tokens_per_step / len(train), test_loss)
    bar.close()
    log.finish(model, {"test_loss": test_loss, "test_accuracy": None, "batch_size": args.batch_size,
                       "block_size": args.block_size, "lr": args.lr, "train_bytes": len(train),
                       "val_bytes": len(val)})


if __name__ == "__main__":
    main()
