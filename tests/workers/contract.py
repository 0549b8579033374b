"""A multi-rank job for Horovod's optimizer contract, with ``compression=`` swapped for ours.

One scenario per run (``--scenario``), in one column (``--column``):

- dense: stock ``hvd.DistributedOptimizer`` without compression, the reference;
- topkef: stock Horovod with ``TopKEF(ratio, named_parameters=...)``, one instance per optimizer;
- topkef_class: stock Horovod with ``compression=TopKEF`` (the class: ratio 0.01, no names);
- hvd_topk: ``hvd_topk.DistributedOptimizer`` with ``TopKEF(ratio)``.

Scenarios (float64, so that ratio 1.0 compares tightly with dense Horovod):

- sparse: ``nn.Embedding(sparse=True)``, with ``--sparse-as-dense`` or not;
- uneven: rank 1's loss goes through fc3, rank 0's does not; a new model and optimizer for each
  torch.optim class in turn;
- gan: a generator and a discriminator, two optimizers stepping in turn, ``requires_grad`` toggled;
- sync_twice: ``synchronize(); clip_grad_norm_(); step()`` without ``skip_synchronize()`` (Horovod warns,
  then synchronizes again);
- schedule: ``OneCycleLR(cycle_momentum=True)`` with weight decay; the momentum the optimizer shows after
  ``broadcast_optimizer_state`` and at every step is recorded.

Every rank writes ``<out>/rank<r>.pt``: the final parameters of every model (prefixed by model) and the
momenta read from ``param_groups``.
"""
import argparse
import os
import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk import TopKEF

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--scenario", choices=["sparse", "uneven", "gan", "sync_twice", "schedule"], required=True)
p.add_argument("--column", choices=["dense", "topkef", "topkef_class", "hvd_topk"], required=True)
p.add_argument("--ratio", type=float, default=1.0)
p.add_argument("--sparse-as-dense", action="store_true")
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
warnings.simplefilter("ignore")          # Horovod's "synchronizes twice" warning is expected here
W_TRUE = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))


def distributed(opt, model):
    """The column's distributed optimizer for ``opt`` over ``model``'s parameters."""
    named = list(model.named_parameters())
    extra = {"sparse_as_dense": args.sparse_as_dense}
    if args.column == "hvd_topk":
        return hvd_topk.DistributedOptimizer(opt, named_parameters=named,
                                             compression=TopKEF(ratio=args.ratio, min_numel=16), **extra)
    compression = {"dense": hvd.Compression.none, "topkef_class": TopKEF,
                   "topkef": TopKEF(ratio=args.ratio, min_numel=16, named_parameters=named)}[args.column]
    return hvd.DistributedOptimizer(opt, named_parameters=named, compression=compression, **extra)


def batch(step, width=16):
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1000 * hvd.rank() + step))
    return x, x @ W_TRUE


def mlp(*widths):
    torch.manual_seed(sum(widths))
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def train(model, opt, loss_of, steps=args.steps):
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        opt.zero_grad()
        loss_of(step).backward()
        opt.step()


def sparse():
    torch.manual_seed(3)
    model = nn.ModuleDict({"emb": nn.Embedding(64, 16, sparse=True), "head": nn.Linear(16, 1)})
    opt = distributed(torch.optim.SGD(model.parameters(), lr=0.1), model)

    def loss_of(step):
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(100 * hvd.rank() + step))
        return model["head"](model["emb"](ids)).pow(2).mean()
    train(model, opt, loss_of)
    return {"model": model}, {}


class Uneven(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.fc1, self.fc2, self.fc3, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.head(torch.tanh(self.fc3(h)) if hvd.rank() == 1 else h)


def uneven():
    models = {}
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.RMSprop, torch.optim.Adagrad):
        model = Uneven()
        kwargs = {"momentum": 0.9} if cls in (torch.optim.SGD, torch.optim.RMSprop) else {}
        opt = distributed(cls(model.parameters(), lr=0.01, **kwargs), model)

        def loss_of(step, model=model):
            x, y = batch(step)
            return (model(x) - y).pow(2).mean()
        train(model, opt, loss_of)
        models[cls.__name__] = model
    return models, {}


def gan():
    gen, disc = mlp(8, 32, 16), mlp(16, 32, 1)
    opt_g = distributed(torch.optim.SGD(gen.parameters(), lr=0.01, momentum=0.9), gen)
    opt_d = distributed(torch.optim.SGD(disc.parameters(), lr=0.01, momentum=0.9), disc)
    for model, opt in ((gen, opt_g), (disc, opt_d)):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(args.steps):
        z = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 * hvd.rank() + step))
        real, _ = batch(step)
        for q in gen.parameters():                      # the discriminator's turn
            q.requires_grad_(False)
        opt_d.zero_grad()
        (disc(real).pow(2).mean() + (1 - disc(gen(z))).pow(2).mean()).backward()
        opt_d.step()
        for q in gen.parameters():                      # the generator's turn
            q.requires_grad_(True)
        for q in disc.parameters():
            q.requires_grad_(False)
        opt_g.zero_grad()
        disc(gen(z)).pow(2).mean().backward()
        opt_g.step()
        for q in disc.parameters():
            q.requires_grad_(True)
    return {"gen": gen, "disc": disc}, {}


def sync_twice():
    model = mlp(16, 32, 32, 1)
    # Without momentum: with momentum correction, what synchronize() hands out (and the user clips) is
    # the aggregated velocity, not the gradient (docs/optimizer.md).
    opt = distributed(torch.optim.SGD(model.parameters(), lr=0.05), model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(args.steps):
        opt.zero_grad()
        x, y = batch(step)
        (model(x) - y).pow(2).mean().backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()                                      # no skip_synchronize(): Horovod syncs again
    return {"model": model}, {}


def schedule():
    model = mlp(16, 32, 32, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.8, weight_decay=1e-3)
    opt = distributed(base, model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=args.steps, cycle_momentum=True,
                                                base_momentum=0.8, max_momentum=0.95)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    momenta = [opt.param_groups[0]["momentum"]]
    for step in range(args.steps):
        opt.zero_grad()
        x, y = batch(step)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        sched.step()
        momenta.append(opt.param_groups[0]["momentum"])
    return {"model": model}, {"momenta": momenta}


models, extra = {"sparse": sparse, "uneven": uneven, "gan": gan, "sync_twice": sync_twice,
                 "schedule": schedule}[args.scenario]()
params = {f"{m}.{n}": q.detach().clone() for m, model in models.items() for n, q in model.named_parameters()}
torch.save({"params": params, **extra}, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
