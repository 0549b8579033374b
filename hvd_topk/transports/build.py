"""The one place where transports are made: ``build_transports`` turns a front door's compressor
settings into its transport stack.

Both front doors call it: ``hvd_topk.DistributedOptimizer`` once per optimizer, ``TopKEF`` when Horovod
first calls ``compress`` (so that making a ``TopKEF`` runs no collective). Nothing else constructs the
transports, their leaders, index sets, collectives or regions (tests/test_layout.py checks it).

Each compressor kind (``hvd_topk.settings.CompressorSettings.kind``) has its builder here; the Top-K
kind's stack holds every Top-K transport over one ``Collectives``, one ``IndexPipeline`` and one set of
AR-Topk leaders, so a step may switch transports per tensor (``communication='auto'``) and checkpoints
find the shared state in one place. The low-rank kind's stack is ``LowRank`` (flat, or through the hosts
for ``'hierarchical'``). The optimizer passes the other kind's settings as ``alongside``: its stack then
holds both kinds over the same collectives, so auto and ``OptimizerSettings(pin=...)`` may send any
tensor with any of them.
"""
from typing import Dict, NamedTuple, Optional

from horovod.torch import mpi_ops

from .allgather import SparseAllgather
from .artopk import ARTopk
from .collectives import Collectives
from .dense import Dense, DenseFP16
from .hierarchical import Hierarchical
from .host_sets import HostSets, resolve
from .index_sets import IndexPipeline
from .leaders import StarLeaders, VarLeaders
from .lowrank import LowRank
from .regions import Regions
from .split_reduce import SplitReduce

__all__ = ["TransportStack", "build_transports", "OWN_COLLECTIVES"]

# The Top-K transports that start their own collectives (more than one phase, or values of their own):
# TopKEF runs them behind its token, and only they carry a global selection's values through it.
OWN_COLLECTIVES = ("split_reduce", "allgather", "hierarchical")


class TransportStack(NamedTuple):
    """One front door's transports and what they share (built by keyword)."""
    transports: Dict[str, object]         # 'artopk', 'allgather', 'split_reduce'; 'dense' (density 1),
                                          # 'dense_fp16' (auto's, pins') and 'plain' (never compressed)
                                          # with a reduction; 'hierarchical' when
                                          # asked; 'lowrank' of the low-rank kind (or alongside)
    collectives: Collectives              # Horovod's collectives, grouped or not (the optimizer sets groups)
    index_sets: Optional[IndexPipeline]   # AR-Topk's shared index sets (None: low rank alone)
    leaders: Optional[StarLeaders]        # AR-Topk's leaders (StarLeaders or VarLeaders; None: low rank alone)
    hosts: Optional[HostSets] = None      # the hierarchical transport's sets, where it runs across hosts


def build_transports(settings, *, tag, key_index, process_set=mpi_ops.global_process_set, communication=None,
                     reduction=None, leader="star", value_dtype=None, stats=None, mismatch_hint="",
                     on_leaders_differ=None, alongside=None, shapes=None):
    """The transport stack of ``settings``' kind.

    Args:
        settings: a ``CompressorSettings`` (``TopKSettings``: ratio, budget, communication, sync_indices).
        tag: prefix of every collective's name: identical on all ranks, distinct per optimizer or TopKEF.
        key_index: key -> int, the same on every rank (STAR's offsets, VAR's keys).
        process_set: the ranks that communicate; ranks count within it.
        communication: the transport asked for, if not ``settings.communication`` (the optimizer's may be
            ``'auto'``). ``'hierarchical'`` and ``'auto'`` resolve the hosts' process sets: collective.
        reduction: ``Reduction`` (Horovod's op and scale factors) where the transports reduce themselves
            (the optimizer), adding 'dense', 'dense_fp16' and 'plain'; None: they sum, and Horovod's allreduce in
            ``TopKEF`` does the rest.
        leader: AR-Topk's leader, ``'star'`` or ``'var'``.
        value_dtype: dtype of artopk's and the dense allreduces' values on the wire; None keeps the
            accumulator's (split_reduce and allgather code theirs as ``settings.values`` says).
        stats: ``StepStats`` that split_reduce and allgather report to, or None.
        mismatch_hint: what the errors say when the ranks keyed a gradient differently.
        on_leaders_differ: called when only AR-Topk's leaders differ between ranks (``IndexPipeline``).
        alongside: settings of the other kind, whose transports join the stack (the optimizer's), or None.
        shapes: key -> the tensor's shape (low rank's matrix views); None: flat keys go dense there.

    Returns:
        A ``TransportStack``.

    Example:
        >>> import horovod.torch as hvd
        >>> from hvd_topk.settings import TopKSettings
        >>> hvd.init()
        >>> stack = build_transports(TopKSettings(), tag="doc", key_index={"w": 0})
        >>> sorted(stack.transports)
        ['allgather', 'artopk', 'split_reduce']
    """
    builder = _BUILDERS.get(settings.kind)
    if builder is None:
        raise ValueError(f"settings must be of a kind with transports {sorted(_BUILDERS)}, got "
                         f"{type(settings).__name__} (kind {settings.kind!r})")
    return builder(settings, tag=tag, key_index=key_index, process_set=process_set,
                   communication=settings.communication if communication is None else communication,
                   reduction=reduction, leader=leader, value_dtype=value_dtype, stats=stats,
                   mismatch_hint=mismatch_hint, on_leaders_differ=on_leaders_differ, alongside=alongside,
                   shapes=shapes)


def _topk_stack(settings, *, tag, key_index, process_set, communication, reduction, leader, value_dtype, stats,
                mismatch_hint, on_leaders_differ, alongside=None, shapes=None):
    """Every Top-K transport over one set of collectives, index sets and leaders (and low rank alongside)."""
    average = reduction is not None and reduction.op == mpi_ops.Average
    leaders = VarLeaders(key_index, f"{tag}.var", process_set) if leader == "var" else \
        StarLeaders(key_index, process_set)
    index_sets = IndexPipeline(f"{tag}.indices", sync=settings.sync_indices, mismatch_hint=mismatch_hint,
                               process_set=process_set, on_leaders_differ=on_leaders_differ)
    collectives = Collectives(f"{tag}.group", process_set=process_set)
    split_reduce = SplitReduce(collectives, average, Regions(), f"{tag}.split", settings.values, stats, mismatch_hint,
                               settings.budget)
    transports = {"artopk": ARTopk(index_sets, leaders, collectives, reduction, value_dtype),
                  "allgather": SparseAllgather(collectives, average, settings.values, name=f"{tag}.allgather",
                                               stats=stats, mismatch_hint=mismatch_hint),
                  "split_reduce": split_reduce}
    hosts = None
    if communication in ("hierarchical", "auto"):     # collective: finds the hosts' process sets
        hosts = resolve(f"{tag}.hier.hosts", optional=communication == "auto")
    if reduction is not None:
        transports["dense"] = Dense(collectives, reduction, value_dtype, name="values")
        transports["plain"] = Dense(collectives, reduction, None, name="dense")
        # through the hosts where hierarchical was asked for: each host's sum crosses once (transports/dense.py);
        # auto's stays flat (its model and trial have not priced the other way)
        transports["dense_fp16"] = DenseFP16(collectives, reduction, f"{tag}.values16", stats,
                                             hosts if communication == "hierarchical" else None)
    if hosts is not None:
        inner = SplitReduce(Collectives(f"{tag}.hier.group", process_set=hosts.cross), False, split_reduce.regions,
                            f"{tag}.hier.split", settings.values, stats, mismatch_hint, settings.budget)
        transports["hierarchical"] = Hierarchical(hosts, inner, average, f"{tag}.hier", collectives.start_pending)
    elif communication == "hierarchical":             # one host, or uneven hosts: the flat transport
        transports["hierarchical"] = split_reduce
    if alongside is not None:
        transports["lowrank"] = _lowrank(alongside, f"{tag}.lowrank", collectives, average, shapes)
    return TransportStack(transports, collectives, index_sets, leaders, hosts)


def _lowrank(settings, name, collectives, average, shapes, hosts=None):
    """A ``LowRank`` of ``PowerSGDSettings``."""
    return LowRank(collectives, average, settings.rank, shapes, name, settings.seed, settings.epsilon,
                   settings.min_compression_rate, hosts, settings.values)


def _lowrank_stack(settings, *, tag, key_index, process_set, communication, reduction, alongside=None, shapes=None,
                   **topk):
    """Low rank (``PowerSGDSettings``): 'lowrank', and 'hierarchical' across the hosts when asked, over
    the Top-K stack of ``alongside`` (its hosts resolved only for 'auto') or over collectives of its own."""
    if alongside is not None:
        stack = _topk_stack(alongside, tag=tag, key_index=key_index, process_set=process_set, reduction=reduction,
                            communication="auto" if communication == "auto" else "split_reduce", **topk)
    else:
        stack = TransportStack({}, Collectives(f"{tag}.group", process_set=process_set), None, None)
    average = reduction is not None and reduction.op == mpi_ops.Average
    lowrank = _lowrank(settings, f"{tag}.lowrank", stack.collectives, average, shapes)
    transports, hosts = dict(stack.transports, lowrank=lowrank), stack.hosts
    if communication == "hierarchical":               # collective: finds the hosts' process sets
        hosts = resolve(f"{tag}.hier.hosts")          # None: one host or uneven hosts (warned): the flat one
        transports["hierarchical"] = lowrank if hosts is None else \
            _lowrank(settings, f"{tag}.hier.lowrank", stack.collectives, average, shapes, hosts)
    return stack._replace(transports=transports, hosts=hosts)


_BUILDERS = {"topk": _topk_stack, "lowrank": _lowrank_stack}
