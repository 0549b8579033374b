"""The arms: what trains the model, one entry per way of sending its gradients.

``ARMS`` maps an arm's name to a function that takes a ``Build`` (the arm's own copy of the model, the
task, the run's ratio) and returns the arm's optimizer: stock Horovod (dense, fp16, TopKEF with each
transport, hvd_topk's PowerSGD), hvd_topk's DistributedOptimizer (each transport, auto, the DGC levers,
low rank), or PyTorch DDP with a communication hook. Adding an arm is adding one entry, e.g. a stock
Horovod compressor::

    "horovod fp16": lambda b: b.horovod(hvd.Compression.fp16),

A name may end in keyword overrides in brackets (values: numbers, true/false, or words):
``hvd_topk[communication=allgather,momentum_correction=true,warmup_epochs=4]``, ``topkef[budget=2]``,
``horovod dense[groups=1]``. TopKEF's own arguments (ratio, min_numel, budget, sync_indices, values,
bucket_cap_mb) go to TopKEF, Horovod's (groups, num_groups, backward_passes_per_step, sparse_as_dense) to the
DistributedOptimizer, the rest to hvd_topk's (``communication`` and its settings). Low-rank arms
(``powersgd rN``, ``hvd_topk powersgd rN``) give PowerSGD's own (communication, min_compression_rate,
seed, epsilon, values) to ``hvd_topk.PowerSGD``. DDP arms take none; ``ddp fp16 powersgd rN`` is torch's
hook inside torch's ``fp16_compress_wrapper`` (its P's and Q's in float16, as hvd_topk's by default).
``compute only`` sends nothing (each rank its own optimizer step): the compute a step's exchange adds to,
which ``bench.report`` sets beside each arm's bytes on the link (a step's bound).

Every Horovod arm names its parameters ``a<i>.<name>`` (``i``: its place in the run), so no two arms'
collectives share a name. DDP arms wrap the model in ``DistributedDataParallel`` over the Gloo group
the runner made; torch's ``powerSGD_hook`` runs with the model in ONE bucket: with several, Gloo pairs
the P and Q allreduces that the hook issues from its worker thread with the next bucket's allreduce
issued from the autograd thread in different orders on different ranks ("Received data size doesn't
match expected size"); with one bucket there is one chain of collectives per step, in the same order
on every rank. PowerSGD's first 2 steps are dense (``START_POWERSGD_ITER``, the fewest torch allows
with error feedback), so runs warm every arm up for more steps than that; ``hvd_topk powersgd rN``
and ``powersgd rN`` take the same 2 dense steps (``PowerSGD(dense_steps=...)``, through both doors).
"""
import re

import horovod.torch as hvd
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

import hvd_topk

__all__ = ["ARMS", "Arm", "Build", "parse_arm", "START_POWERSGD_ITER", "TOPKEF_ARGS"]

START_POWERSGD_ITER = 2
TOPKEF_ARGS = ("ratio", "min_numel", "budget", "sync_indices", "values", "bucket_cap_mb")
POWERSGD_ARGS = ("communication", "min_compression_rate", "seed", "epsilon", "values", "dense_steps")
HOROVOD_ARGS = ("groups", "num_groups", "backward_passes_per_step", "sparse_as_dense")
# arms whose transport needs Horovod's process sets of the hosts (hvd_topk.host_process_sets)
HOST_SETS = ("hierarchical", "auto")


class Arm:
    """One arm in a run: its name, model copy, what the batch goes through, its optimizer and records."""

    def __init__(self, name, model, forward, opt, kind, powersgd_state=None, compression=None):
        self.name, self.model, self.forward, self.opt, self.kind = name, model, forward, opt, kind
        self.powersgd_state = powersgd_state      # torch's PowerSGDState, for its compression rate
        # what the runner reads stats() from after each step: hvd_topk's optimizer, else the TopKEF or
        # PowerSGD inside stock Horovod's (its own step's split: the stock door's phases), else nothing
        self.reporter = next((s for s in (opt, compression) if hasattr(s, "stats")), None)
        self.steps, self.step_s, self.measured_s, self.bytes, self.curve, self.stats = 0, [], [], [], [], []


class Build:
    """What an arm's entry builds from: this arm's model copy, its place ``index`` and the run's
    ``ratio`` and ``min_numel`` (None: TopKEF's default)."""

    def __init__(self, model, task, index, ratio, min_numel, overrides):
        self.model, self.task, self.index, self.overrides = model, task, index, overrides
        self.topk = {"ratio": ratio, **({} if min_numel is None else {"min_numel": min_numel})}
        self.named = [(f"a{index}.{n}", p) for n, p in model.named_parameters()]
        self.kind, self.forward, self.powersgd_state, self.compression = "horovod", model, None, None

    def _split(self, **preset):
        """(TopKEF's keyword arguments, Horovod's optimizer arguments, the rest): the preset, then the
        name's overrides."""
        merged = {**self.topk, **preset, **self.overrides}
        return ({k: v for k, v in merged.items() if k in TOPKEF_ARGS},
                {k: v for k, v in merged.items() if k in HOROVOD_ARGS},
                {k: v for k, v in merged.items() if k not in TOPKEF_ARGS + HOROVOD_ARGS})

    def horovod(self, compression, **horovod_args):
        """Stock ``hvd.DistributedOptimizer`` with ``compression`` (and the name's Horovod arguments)."""
        horovod_args = {**horovod_args, **{k: v for k, v in self.overrides.items() if k in HOROVOD_ARGS}}
        self.compression = compression
        return hvd.DistributedOptimizer(self.task.make_opt(self.model), named_parameters=self.named,
                                        compression=compression, **horovod_args)

    def topkef(self, **preset):
        """Stock Horovod with ``hvd_topk.TopKEF`` (its default transport unless ``preset`` names one)."""
        topk, horovod_args, rest = self._split(**preset)
        return self.horovod(hvd_topk.TopKEF(named_parameters=self.named, **topk, **rest), **horovod_args)

    def hvd_topk(self, **preset):
        """``hvd_topk.DistributedOptimizer`` with TopKEF's arguments, Horovod's, its ``communication``,
        and the rest as its settings (``hvd_topk.OptimizerSettings``)."""
        topk, keywords, rest = self._split(**preset)
        keywords.update({k: rest.pop(k) for k in ("communication",) if k in rest})
        if rest:
            keywords["settings"] = hvd_topk.OptimizerSettings(**rest)
        return hvd_topk.DistributedOptimizer(self.task.make_opt(self.model), named_parameters=self.named,
                                             compression=hvd_topk.TopKEF(**topk), **keywords)

    def powersgd(self, rank):
        """Stock Horovod with ``hvd_topk.PowerSGD`` at ``rank``, its first ``START_POWERSGD_ITER`` steps dense
        as torch's hook's (the name's PowerSGD and Horovod arguments)."""
        low_rank = {"dense_steps": START_POWERSGD_ITER,
                    **{k: v for k, v in self.overrides.items() if k in POWERSGD_ARGS}}
        horovod_args = {k: v for k, v in self.overrides.items() if k in HOROVOD_ARGS}
        unknown = set(self.overrides) - set(low_rank) - set(horovod_args)
        if unknown:
            raise ValueError(f"powersgd arms take PowerSGD's {POWERSGD_ARGS} and Horovod's {HOROVOD_ARGS}, got "
                             f"{sorted(unknown)}")
        return self.horovod(hvd_topk.PowerSGD(rank, named_parameters=self.named, **low_rank), **horovod_args)

    def hvd_topk_powersgd(self, rank):
        """``hvd_topk.DistributedOptimizer`` with ``hvd_topk.PowerSGD`` at ``rank``, its first
        ``START_POWERSGD_ITER`` steps dense as torch's hook's; the name's PowerSGD arguments go to
        PowerSGD, Horovod's to the optimizer, the rest to its settings."""
        low_rank = {"dense_steps": START_POWERSGD_ITER,
                    **{k: v for k, v in self.overrides.items() if k in POWERSGD_ARGS}}
        keywords = {k: v for k, v in self.overrides.items() if k in HOROVOD_ARGS}
        rest = {k: v for k, v in self.overrides.items() if k not in POWERSGD_ARGS + HOROVOD_ARGS}
        settings = hvd_topk.OptimizerSettings(**rest)
        return hvd_topk.DistributedOptimizer(self.task.make_opt(self.model), named_parameters=self.named,
                                             compression=hvd_topk.PowerSGD(rank, **low_rank), settings=settings,
                                             **keywords)

    def compute_only(self):
        """No exchange at all: each rank steps on its own gradient, so the ranks drift apart. Its step is
        the compute every other arm's communication adds to (forward, backward, the optimizer), on the
        same cores beside the same ranks: the bound of a step is this plus its bytes' time on the link."""
        self.kind = "local"
        return self.task.make_opt(self.model)

    def ddp(self, hook=None, state=None, one_bucket=False):
        """PyTorch DDP over torch.distributed's group, with ``hook`` (and its state) registered."""
        model_mb = sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2 ** 20
        # DDP makes its first bucket as large as bucket_cap_mb when that is given: one bucket.
        self.forward = DistributedDataParallel(self.model, bucket_cap_mb=int(model_mb) + 1 if one_bucket else None)
        if hook is not None:
            self.forward.register_comm_hook(state, hook)
        self.kind, self.powersgd_state = "ddp", state
        return self.task.make_opt(self.forward)

    def ddp_powersgd(self, rank, fp16=False):
        """DDP with torch's own ``powerSGD_hook`` at ``rank`` (inside ``fp16_compress_wrapper`` with
        ``fp16``), the model in one bucket."""
        state = psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START_POWERSGD_ITER)
        hook = default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook) if fp16 else psgd.powerSGD_hook
        return self.ddp(hook, state, one_bucket=True)


ARMS = {
    "horovod dense": lambda b: b.horovod(hvd.Compression.none),
    "horovod fp16": lambda b: b.horovod(hvd.Compression.fp16),
    "topkef": lambda b: b.topkef(),                        # TopKEF's default transport, split_reduce
    "topkef artopk": lambda b: b.topkef(communication="artopk"),
    "topkef allgather": lambda b: b.topkef(communication="allgather"),
    "topkef hierarchical": lambda b: b.topkef(communication="hierarchical"),
    "hvd_topk": lambda b: b.hvd_topk(),                    # its defaults
    "hvd_topk split_reduce": lambda b: b.hvd_topk(communication="split_reduce"),
    "hvd_topk artopk": lambda b: b.hvd_topk(communication="artopk"),
    "hvd_topk allgather": lambda b: b.hvd_topk(communication="allgather"),
    # TopKEF's values (default 'bf16'): an entry named '... fp16' or '... fp32' presets them (bench.figures reads it)
    "hvd_topk allgather fp16": lambda b: b.hvd_topk(communication="allgather", values="fp16"),
    "hvd_topk allgather fp32": lambda b: b.hvd_topk(communication="allgather", values="fp32"),
    "hvd_topk hierarchical": lambda b: b.hvd_topk(communication="hierarchical"),
    "hvd_topk dense": lambda b: b.hvd_topk(communication="dense"),
    # every tensor the optimizer compresses pinned to dense in fp16 (one of auto's choices)
    "hvd_topk dense_fp16": lambda b: b.hvd_topk(pin={n: "dense_fp16" for n, p in b.named if p.dim() > 1}),
    "hvd_topk auto": lambda b: b.hvd_topk(communication="auto"),
    "hvd_topk adaptive": lambda b: b.hvd_topk(adaptive_ratio=True),
    # DGC's levers: momentum correction, and the warm-up (the density falls from ratio ** (1 / (W + 1))
    # to the ratio over W steps: one epoch of the task)
    "hvd_topk mc": lambda b: b.hvd_topk(momentum_correction=True),
    "hvd_topk warmup": lambda b: b.hvd_topk(warmup_steps=b.task.steps_per_epoch),
    "hvd_topk dgc": lambda b: b.hvd_topk(momentum_correction=True, warmup_steps=b.task.steps_per_epoch),
    # low rank through both doors, beside torch's hook at the same ranks
    "hvd_topk powersgd r1": lambda b: b.hvd_topk_powersgd(1),
    "hvd_topk powersgd r2": lambda b: b.hvd_topk_powersgd(2),
    "hvd_topk powersgd r4": lambda b: b.hvd_topk_powersgd(4),
    "powersgd r1": lambda b: b.powersgd(1),
    "powersgd r2": lambda b: b.powersgd(2),
    "powersgd r4": lambda b: b.powersgd(4),
    "ddp": lambda b: b.ddp(),
    "ddp fp16": lambda b: b.ddp(default_hooks.fp16_compress_hook),
    "ddp powersgd r1": lambda b: b.ddp_powersgd(1),
    "ddp powersgd r2": lambda b: b.ddp_powersgd(2),
    "ddp powersgd r4": lambda b: b.ddp_powersgd(4),
    "ddp fp16 powersgd r1": lambda b: b.ddp_powersgd(1, fp16=True),
    "ddp fp16 powersgd r2": lambda b: b.ddp_powersgd(2, fp16=True),
    "ddp fp16 powersgd r4": lambda b: b.ddp_powersgd(4, fp16=True),
    "compute only": lambda b: b.compute_only(),            # no collective: not a way to train, a bound
}
# the dense references of "dense final - 1 pt" / "dense + 2%", the first one a run has
DENSE = ("horovod dense", "ddp")
# the transports auto chooses from, each fixed: auto is compared with the fastest of those a run has
FIXED_TRANSPORTS = ("horovod dense", "hvd_topk dense", "hvd_topk dense_fp16", "hvd_topk split_reduce",
                    "hvd_topk artopk", "hvd_topk allgather")

_NAME = re.compile(r"^([^\[\]]+?)(?:\[([^\[\]]*)\])?$")


def parse_arm(text):
    """(entry name, overrides) of an arm's name; ValueError naming the arm when it is unknown.

    Example:
        >>> parse_arm("hvd_topk[communication=allgather,warmup_epochs=4]")
        ('hvd_topk', {'communication': 'allgather', 'warmup_epochs': 4})
    """
    match = _NAME.match(text.strip())
    if not match or match.group(1).strip() not in ARMS:
        raise ValueError(f"arm {text!r}: the name must be one of {list(ARMS)}, optionally followed by "
                         "[key=value,...]")
    overrides = {}
    for item in filter(None, (match.group(2) or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"arm {text!r}: overrides are key=value, got {item!r}")
        overrides[key.strip()] = _value(value.strip())
    if overrides and match.group(1).strip().startswith(("ddp", "compute only")):
        raise ValueError(f"arm {text!r}: DDP arms and the compute-only arm take no overrides")
    if overrides and match.group(1).strip().startswith("horovod") and set(overrides) - set(HOROVOD_ARGS):
        raise ValueError(f"arm {text!r}: horovod arms take only Horovod's arguments {HOROVOD_ARGS}")
    return match.group(1).strip(), overrides


def _value(text):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def build_arm(text, index, task, ratio, min_numel=None):
    """Arm ``text`` (a name of ``ARMS``, with overrides) with its own copy of ``task``'s model; the
    caller seeds torch first, so every arm starts from the same weights. Horovod arms get rank 0's
    parameters broadcast."""
    name, overrides = parse_arm(text)
    build = Build(task.build(), task, index, ratio, min_numel, overrides)
    opt = ARMS[name](build)
    if build.kind == "horovod":
        hvd.broadcast_parameters(build.model.state_dict(), root_rank=0)
    return Arm(text, build.model, build.forward, opt, build.kind, build.powersgd_state, build.compression)


def needs_host_sets(names):
    """Whether any arm's transport needs Horovod's process sets of the hosts."""
    return any(parse_arm(n)[0].endswith(HOST_SETS) or parse_arm(n)[1].get("communication") in HOST_SETS
               for n in names)
