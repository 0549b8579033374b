"""The one place where transports are made: ``build_transports`` turns a front door's compressor
settings into its transport stack.

Both front doors call it: ``hvd_topk.DistributedOptimizer`` once per optimizer, ``TopKEF`` when Horovod
first calls ``compress`` (so that making a ``TopKEF`` runs no collective). Nothing else constructs the
transports, their leaders, index sets, collectives or regions (tests/test_layout.py checks it).

Each compressor kind (``hvd_topk.settings.CompressorSettings.kind``) has its builder here; the Top-K
kind's stack holds every Top-K transport over one ``Collectives``, one ``IndexPipeline`` and one set of
AR-Topk leaders, so a step may switch transports per tensor (``communication='auto'``) and checkpoints
find the shared state in one place.
"""
from typing import Dict, NamedTuple, Optional

from horovod.torch import mpi_ops

from .allgather import SparseAllgather
from .artopk import ARTopk
from .collectives import Collectives
from .dense import Dense
from .hierarchical import Hierarchical
from .host_sets import HostSets, resolve
from .index_sets import IndexPipeline
from .leaders import StarLeaders, VarLeaders
from .regions import Regions
from .split_reduce import SplitReduce

__all__ = ["TransportStack", "build_transports"]


class TransportStack(NamedTuple):
    """One front door's transports and what they share (built by keyword)."""
    transports: Dict[str, object]         # 'artopk', 'allgather', 'split_reduce'; 'dense' (density 1) and
                                          # 'plain' (never compressed) with a reduction; 'hierarchical' when asked
    collectives: Collectives              # Horovod's collectives, grouped or not (the optimizer sets groups)
    index_sets: IndexPipeline             # AR-Topk's shared index sets
    leaders: StarLeaders                  # AR-Topk's leaders (StarLeaders or VarLeaders)
    hosts: Optional[HostSets] = None      # the hierarchical transport's sets, where it runs across hosts


def build_transports(settings, *, tag, key_index, process_set=mpi_ops.global_process_set, communication=None,
                     reduction=None, leader="star", value_dtype=None, stats=None, mismatch_hint="",
                     on_leaders_differ=None):
    """The transport stack of ``settings``' kind.

    Args:
        settings: a ``CompressorSettings`` (``TopKSettings``: ratio, budget, communication, sync_indices).
        tag: prefix of every collective's name: identical on all ranks, distinct per optimizer or TopKEF.
        key_index: key -> int, the same on every rank (STAR's offsets, VAR's keys).
        process_set: the ranks that communicate; ranks count within it.
        communication: the transport asked for, if not ``settings.communication`` (the optimizer's may be
            ``'auto'``). ``'hierarchical'`` and ``'auto'`` resolve the hosts' process sets: collective.
        reduction: ``Reduction`` (Horovod's op and scale factors) where the transports reduce themselves
            (the optimizer), adding 'dense' and 'plain'; None: they sum, and Horovod's allreduce in
            ``TopKEF`` does the rest.
        leader: AR-Topk's leader, ``'star'`` or ``'var'``.
        value_dtype: dtype of the values on the wire; None keeps the accumulator's.
        stats: ``StepStats`` that split_reduce reports to, or None.
        mismatch_hint: what the errors say when the ranks keyed a gradient differently.
        on_leaders_differ: called when only AR-Topk's leaders differ between ranks (``IndexPipeline``).

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
                   mismatch_hint=mismatch_hint, on_leaders_differ=on_leaders_differ)


def _topk_stack(settings, *, tag, key_index, process_set, communication, reduction, leader, value_dtype, stats,
                mismatch_hint, on_leaders_differ):
    """Every Top-K transport over one set of collectives, index sets and leaders."""
    average = reduction is not None and reduction.op == mpi_ops.Average
    leaders = VarLeaders(key_index, f"{tag}.var", process_set) if leader == "var" else \
        StarLeaders(key_index, process_set)
    index_sets = IndexPipeline(f"{tag}.indices", sync=settings.sync_indices, mismatch_hint=mismatch_hint,
                               process_set=process_set, on_leaders_differ=on_leaders_differ)
    collectives = Collectives(f"{tag}.group", process_set=process_set)
    split_reduce = SplitReduce(collectives, average, Regions(), f"{tag}.split", value_dtype, stats, mismatch_hint,
                               settings.budget)
    transports = {"artopk": ARTopk(index_sets, leaders, collectives, reduction, value_dtype),
                  "allgather": SparseAllgather(collectives, average, value_dtype, name=f"{tag}.allgather"),
                  "split_reduce": split_reduce}
    if reduction is not None:
        transports["dense"] = Dense(collectives, reduction, value_dtype, name="values")
        transports["plain"] = Dense(collectives, reduction, None, name="dense")
    hosts = None
    if communication in ("hierarchical", "auto"):     # collective: finds the hosts' process sets
        hosts = resolve(f"{tag}.hier.hosts", optional=communication == "auto")
        if hosts is not None:
            inner = SplitReduce(Collectives(f"{tag}.hier.group", process_set=hosts.cross), False, split_reduce.regions,
                                f"{tag}.hier.split", value_dtype, stats, mismatch_hint, settings.budget)
            transports["hierarchical"] = Hierarchical(hosts, inner, average, f"{tag}.hier", collectives.start_pending)
        elif communication == "hierarchical":         # one host, or uneven hosts: the flat transport
            transports["hierarchical"] = split_reduce
    return TransportStack(transports, collectives, index_sets, leaders, hosts)


_BUILDERS = {"topk": _topk_stack}
