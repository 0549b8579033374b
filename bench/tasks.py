"""The tasks the harness trains: each a model, its data, its optimizer recipe and its evaluation.

| task       | model                                                       | data                  | recipe                 | metric   |
|------------|-------------------------------------------------------------|-----------------------|------------------------|----------|
| `cnn-wide` | 2 conv + 1024-2048-2048-10 classifier, 6.33M parameters     | digits (8x8, built in) | SGD 0.05, momentum 0.9 | accuracy |
| `cnn`      | the same trunk, 1024-128-10 classifier, 0.15M parameters     | digits                | SGD 0.05, momentum 0.9 | accuracy |
| `mlp`      | 64-1024-1024-1024-10, 2.18M parameters, every gradient dense | digits                | SGD 0.05, momentum 0.9 | accuracy |
| `lm`       | byte-level GPT, 4 blocks x 128, 0.84M parameters             | the built-in corpus   | AdamW 2e-3, cosine, clip 1 | loss |
| `lm-small` | the same GPT with 2 blocks                                   | the built-in corpus   | as `lm`                | loss     |
| `bow`      | EmbeddingBag 65536 x 32 (2.10M) + 32-64-10 MLP               | synthetic topic documents | Adam 0.01          | accuracy |

The digits CNNs and the GPT are those of examples/digits_cnn.py and examples/char_lm.py, defined again
here because the examples import each other as scripts (``from common import ...``) and so cannot be
imported as modules; the examples stay the scripts users copy. The same seed gives the same weights
as the examples'. ``bow`` is the embedding-heavy task: 2000 documents of 32 tokens per test set, drawn
from a fixed seed, each token with probability 0.25 one of its topic's 300 words and otherwise a
Zipf-distributed background word; its embedding table's gradient is a dense tensor whose rows are
zero except those of the batch's tokens (``sparse=False``), the case Top-K selection is made for.

Every rank builds the same task; ``batch(step)`` gives rank ``rank``'s batch of global step ``step``,
the same in every arm, so arms trained side by side see the same data. Non-IID (``non_iid``): each
rank gets 2 label shards of the training set (McMahan et al.), or, for the LM, its contiguous slice of
the text.
"""
import gzip
import importlib.util
import math
import os

import numpy as np
import pydoc_data.topics
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TASKS", "Task"]

SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
ADAMW = {"optimizer": "adamw", "lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 0.1, "clip": 1.0, "warmup": 50}
ADAM = {"optimizer": "adam", "lr": 0.01}
BLOCK = 128                       # the LM's context, bytes
EVAL_WINDOWS = 128                # the LM's fixed validation windows
BOW_VOCAB, BOW_DIM, BOW_LEN, BOW_TOPIC_WORDS, BOW_TOPIC_P = 65536, 32, 32, 300, 0.25


# -- models -------------------------------------------------------------------------------------------
class DigitsCNN(nn.Module):
    """examples/digits_cnn.py's Net: 2 conv layers, then a classifier of ``fc_sizes``."""

    def __init__(self, fc_sizes=(128,)):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        sizes = [64 * 4 * 4, *fc_sizes, 10]
        self.fcs = [f"fc{i + 1}" for i in range(len(sizes) - 1)]     # the examples' parameter names
        for name, n_in, n_out in zip(self.fcs, sizes, sizes[1:]):
            setattr(self, name, nn.Linear(n_in, n_out))

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2).flatten(1)
        for name in self.fcs[:-1]:
            x = F.relu(getattr(self, name)(x))
        return getattr(self, self.fcs[-1])(x)


def mlp(widths=(64, 1024, 1024, 1024, 10)):
    """A plain MLP on the flattened digits: every gradient is a dense matrix or vector."""
    layers = [nn.Flatten()]
    for n_in, n_out in zip(widths, widths[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Block(nn.Module):
    """examples/char_lm.py's pre-LayerNorm transformer block."""

    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2, self.n_head = nn.LayerNorm(d), nn.LayerNorm(d), 4
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """examples/char_lm.py's byte-level GPT (tied head, GPT-2 initialisation), without dropout."""

    def __init__(self, n_layer=4, d=128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, d), nn.Embedding(BLOCK, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                scaled = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if scaled else 0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class BagOfWords(nn.Module):
    """Mean of the tokens' embeddings, then a small MLP: an embedding table with dense gradients."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(BOW_VOCAB, BOW_DIM, mode="mean")
        self.fc1, self.fc2 = nn.Linear(BOW_DIM, 64), nn.Linear(64, 10)

    def forward(self, tokens):
        return self.fc2(F.relu(self.fc1(self.emb(tokens))))


# -- data ---------------------------------------------------------------------------------------------
def digits():
    """scikit-learn's 8x8 digits, pixels / 16, the examples' fixed 80/20 split: read with numpy from the
    digits.csv.gz scikit-learn ships, as examples/data.py reads it (the same bits as ``load_digits``),
    without importing scikit-learn (~1.7 s of CPU per rank)."""
    folder = importlib.util.find_spec("sklearn").submodule_search_locations[0]
    with gzip.open(os.path.join(folder, "datasets", "data", "digits.csv.gz"), "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    x = torch.tensor(table[:, :-1].reshape(-1, 1, 8, 8), dtype=torch.float32) / 16.0
    y = torch.tensor(table[:, -1].astype(np.int64))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    test, train = order[:len(y) // 5], order[len(y) // 5:]
    return x[train], y[train], x[test], y[test]


def topic_documents(n_train=16000, n_test=2000, classes=10):
    """``bow``'s documents and topics, the same on every rank and run (a fixed generator)."""
    g = torch.Generator().manual_seed(4321)
    topics = torch.randperm(BOW_VOCAB, generator=g)[:classes * BOW_TOPIC_WORDS].view(classes, -1)
    zipf = 1.0 / torch.arange(1, BOW_VOCAB + 1, dtype=torch.float64) ** 1.05
    background = torch.randperm(BOW_VOCAB, generator=g)

    def draw(n):
        y = torch.randint(0, classes, (n,), generator=g)
        noise = background[torch.multinomial(zipf, n * BOW_LEN, replacement=True, generator=g)].view(n, -1)
        topical = topics[y[:, None], torch.randint(0, BOW_TOPIC_WORDS, (n, BOW_LEN), generator=g)]
        return torch.where(torch.rand(n, BOW_LEN, generator=g) < BOW_TOPIC_P, topical, noise), y

    return (*draw(n_train), *draw(n_test))


def corpus():
    """examples/char_lm.py's default text: scikit-learn's dataset descriptions, then Python's pydoc
    topics, UTF-8, as (train, validation) uint8 tensors (the last 10% is validation)."""
    descr = os.path.join(importlib.util.find_spec("sklearn").submodule_search_locations[0], "datasets", "descr")
    pieces = []
    for name in sorted(n for n in os.listdir(descr) if n.endswith(".rst")):
        with open(os.path.join(descr, name), "rb") as f:
            pieces.append(f.read().strip())
    topics = pydoc_data.topics.topics
    text = b"\n\n".join(pieces + [topics[k].strip().encode() for k in sorted(topics)]) + b"\n"
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return data[:len(data) * 9 // 10], data[len(data) * 9 // 10:]


def label_shards(labels, size, seed):
    """Non-IID parts: the training samples sorted by label, cut into 2 * size shards, 2 per rank."""
    order = torch.sort(labels, stable=True).indices
    shards = order[:len(order) // (2 * size) * 2 * size].view(2 * size, -1)
    dealt = torch.randperm(2 * size, generator=torch.Generator().manual_seed(seed))
    return [torch.cat([shards[dealt[2 * r]], shards[dealt[2 * r + 1]]]) for r in range(size)]


# -- tasks --------------------------------------------------------------------------------------------
class Task:
    """One task as one rank trains it (see the module docstring).

    Args:
        name: a key of ``TASKS``.
        rank, size: this rank and the ranks in all.
        seed: the batches' order (the models' weights are seeded by the runner).
        batch_size: samples (LM: windows) per rank per step; None: the task's own (16).
        steps: the run's length, for the LM's cosine schedule.
        non_iid: label shards (LM: text slices) per rank instead of IID samples.
        optimizer, lr: the recipe's optimizer (``sgd``, ``nesterov``: SGD with Nesterov's momentum,
            ``adam``, ``adamw``) and learning rate instead.

    Example:
        >>> task = Task("cnn", rank=0, size=2)
        >>> model = task.build(); opt = task.make_opt(model)
        >>> x, y = task.batch(0); task.loss(model(x), y).backward()
    """

    def __init__(self, name, rank, size, seed=0, batch_size=None, steps=1, non_iid=False, optimizer=None, lr=None):
        if name not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
        self.name, self.rank, self.size, self.seed, self.steps = name, rank, size, seed, steps
        self.build_model, self.kind, recipe, self.metric = TASKS[name]
        self.recipe = dict(recipe, **{k: v for k, v in (("optimizer", optimizer), ("lr", lr)) if v is not None})
        self.batch_size = batch_size or 16
        self.clip = self.recipe.get("clip", 0.0)
        if self.kind == "corpus":
            self.train, self.val = corpus()
            lo, hi = (len(self.train) * rank // size, len(self.train) * (rank + 1) // size) if non_iid else (0, len(self.train))
            self.window = (lo, hi - BLOCK)
            self.val_starts = torch.linspace(0, len(self.val) - BLOCK - 1, EVAL_WINDOWS, dtype=torch.float64).round().long()
            self.steps_per_epoch = max(1, len(self.train) // (size * self.batch_size * BLOCK))
            return
        self.x, self.y, self.x_test, self.y_test = digits() if self.kind == "digits" else topic_documents()
        self.mine = label_shards(self.y, size, seed)[rank] if non_iid else None
        per_rank = len(self.mine) if non_iid else len(self.y) // size
        self.steps_per_epoch = per_rank // self.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch_size must be at most {per_rank} (training samples per rank), got {batch_size}")

    def build(self):
        """A fresh model (seed it first: every arm's copy starts from the same weights)."""
        return self.build_model()

    def make_opt(self, model):
        """The recipe's optimizer over ``model`` (weight decay on matrices and embeddings only)."""
        r = self.recipe
        decay = [q for q in model.parameters() if q.dim() >= 2]
        groups = [{"params": decay, "weight_decay": r.get("weight_decay", 0.0)},
                  {"params": [q for q in model.parameters() if q.dim() < 2], "weight_decay": 0.0}]
        if r["optimizer"] in ("sgd", "nesterov"):
            return torch.optim.SGD(groups, lr=r["lr"], momentum=r.get("momentum", 0.9),
                                   nesterov=r["optimizer"] == "nesterov")
        kind = torch.optim.AdamW if r["optimizer"] == "adamw" else torch.optim.Adam
        return kind(groups, lr=r["lr"], betas=r.get("betas", (0.9, 0.999)))

    def lr_at(self, step):
        """The learning rate of ``step``: the recipe's, or (``warmup`` in it) examples/char_lm.py's
        schedule: a linear warm-up of 50 steps (at most half the run), then a cosine to a tenth at its end."""
        lr, warmup = self.recipe["lr"], min(self.recipe.get("warmup", 0), max(1, self.steps // 2))
        if not warmup:
            return lr
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.steps - warmup))
        return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))

    def batch(self, step):
        """(inputs, targets) of this rank at ``step``: the same in every arm."""
        if self.kind == "corpus":
            gen = torch.Generator().manual_seed(1_000_003 * (self.seed * 100_000 + step) + self.rank)
            starts = torch.randint(*self.window, (self.batch_size,), generator=gen)
            windows = self.train[starts[:, None] + torch.arange(BLOCK + 1)].long()
            return windows[:, :-1], windows[:, 1:]
        epoch, i = divmod(step, self.steps_per_epoch)
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        if self.mine is None:
            mine = torch.randperm(len(self.y), generator=gen)[self.rank::self.size]
        else:
            mine = self.mine[torch.randperm(len(self.mine), generator=gen)]
        picked = mine[i * self.batch_size:(i + 1) * self.batch_size]
        return self.x[picked], self.y[picked]

    def loss(self, out, target):
        return F.cross_entropy(out.flatten(0, -2), target.flatten())

    @torch.no_grad()
    def evaluate(self, model):
        """{"accuracy": test accuracy or None, "loss": test loss (LM: nats per byte on fixed windows)}."""
        model.eval()
        try:
            if self.kind == "corpus":
                total = 0.0
                for i in range(0, len(self.val_starts), 64):
                    w = self.val[self.val_starts[i:i + 64, None] + torch.arange(BLOCK + 1)].long()
                    total += F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
                return {"accuracy": None, "loss": total / (len(self.val_starts) * BLOCK)}
            out = model(self.x_test)
            return {"accuracy": (out.argmax(1) == self.y_test).float().mean().item(),
                    "loss": F.cross_entropy(out, self.y_test).item()}
        finally:
            model.train()


# name -> (model factory, data, recipe, metric); adding a task is adding an entry
TASKS = {
    "cnn-wide": (lambda: DigitsCNN((2048, 2048)), "digits", SGD, "accuracy"),
    "cnn": (DigitsCNN, "digits", SGD, "accuracy"),
    "mlp": (mlp, "digits", SGD, "accuracy"),
    "lm": (lambda: GPT(4), "corpus", ADAMW, "loss"),
    "lm-small": (lambda: GPT(2), "corpus", ADAMW, "loss"),
    "bow": (BagOfWords, "bow", ADAM, "accuracy"),
}
