"""The process sets of ``communication='hierarchical'``: one per host, and one per position within a host.

Horovod numbers every rank twice: ``local_rank`` within its host (``local_size`` ranks there) and
``cross_rank`` across the hosts. Hierarchical needs, for every rank,

- its *host set*: the ranks of its host (the dense reduce-scatter and the allgather run there), and
- its *cross set*: the ranks at the same position on every host, one per host (they hold the same
  shard and run the sparse transport over the slow link).

Horovod runs a collective only within a process set it knows, registered either at
``hvd.init(process_sets=[...])`` or, when the job runs with ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or
``hvd.init(process_sets="dynamic")``), by ``hvd.add_process_set`` at any time, called by every rank.
``resolve`` takes the registered sets made by ``host_process_sets`` and adds the missing ones when
Horovod allows it; otherwise it raises on every rank, naming the exact sets to pass to ``hvd.init``.

Process sets are not free. Across 2 emulated hosts at 100 Mbit/s (4 ranks on 2 cores) a plain
``hvd.DistributedOptimizer`` on the char LM stepped 1.13 s a step with these four sets added against
0.63-0.69 s before they were added and after they were removed, in one job, and took tens of seconds
now and then with them (a likely cause, not confirmed: Horovod's background loop coordinates every set
it knows). ``release`` removes the sets ``resolve`` added once their last holder lets them go (auto
does, when no plan of its holds hierarchical); sets registered by ``hvd.init`` stay for the whole job.

Every rank decides from the same table (an allgather of every rank's Horovod numbers), so every rank
takes the same decision: the same sets, the same error, or the same fallback to the flat transport
(one host, one rank per host, or hosts with different numbers of ranks, where shards cannot line up).
"""
import os
import warnings
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from horovod.torch import mpi_ops

__all__ = ["HostSets", "plan_sets", "host_process_sets", "resolve", "release"]

_MADE = []                 # ProcessSets made by host_process_sets (registered once hvd.init had them)
_ADDED = []                # ProcessSets resolve added (hvd.add_process_set), in the same order on every rank
_RESOLVED = {}             # "sets" -> HostSets or None (fallback), for this Horovod job
_HOLDERS = {"count": 0}    # resolve's answers that are HostSets and not yet released: each is a holder


class HostSets(NamedTuple):
    """This rank's sets (``resolve``)."""
    host: object           # ProcessSet of this rank's host
    cross: object          # ProcessSet of the ranks at this rank's position on every host
    position: int          # this rank's index within its host set: which shard it owns
    hosts: int             # number of hosts
    per_host: int          # ranks per host


def plan_sets(table) -> Union[Tuple[List[List[int]], List[List[int]]], str]:
    """(host rank lists, cross rank lists) of a job, or why it falls back to the flat transport.

    Args:
        table: one row per global rank, in rank order: (local_rank, local_size, cross_rank, cross_size).

    Example:
        >>> plan_sets([(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)])
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        >>> plan_sets([(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)])
        'the hosts run different numbers of ranks (2 and 1): their shards would not line up'
    """
    size = len(table)
    local_sizes = sorted({row[1] for row in table}, reverse=True)
    if len(local_sizes) > 1:
        return (f"the hosts run different numbers of ranks ({' and '.join(map(str, local_sizes))}): "
                "their shards would not line up")
    per_host = local_sizes[0]
    if per_host == size:
        return "one host: nothing crosses a slow link"
    if per_host == 1:
        return "one rank per host: hierarchical is the flat transport"
    hosts = {}
    for rank, (local_rank, _, cross_rank, _) in enumerate(table):
        hosts.setdefault(cross_rank, []).append((local_rank, rank))
    if len(hosts) * per_host != size or any(sorted(lr for lr, _ in h) != list(range(per_host))
                                            for h in hosts.values()):
        return f"Horovod's local and cross ranks do not describe {size // per_host} hosts of {per_host} ranks"
    host_lists = [sorted(rank for _, rank in hosts[c]) for c in sorted(hosts)]
    cross_lists = [sorted(h[position] for h in host_lists) for position in range(per_host)]
    return host_lists, cross_lists


def host_process_sets(size=None, local_size=None):
    """The ProcessSets hierarchical needs, for ``hvd.init(process_sets=...)`` (before ``hvd.init``).

    Assumes Horovod numbers ranks host after host (horovodrun does, and mpirun's default mapping);
    ``resolve`` checks it against Horovod's numbers and names the right sets where it does not hold.

    Args:
        size, local_size: ranks in all and per host; None reads them from the launcher's environment
            (horovodrun: HOROVOD_SIZE/HOROVOD_LOCAL_SIZE; mpirun: OMPI_COMM_WORLD_SIZE/_LOCAL_SIZE).

    Example:
        >>> [ps.ranks for ps in host_process_sets(size=4, local_size=2)]
        [[0, 1], [2, 3], [0, 2], [1, 3]]
    """
    size = size if size is not None else _env_int("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE")
    local_size = local_size if local_size is not None else _env_int("HOROVOD_LOCAL_SIZE",
                                                                   "OMPI_COMM_WORLD_LOCAL_SIZE")
    if size is None or local_size is None:
        raise ValueError("host_process_sets: size and local_size must be given (the launcher's environment "
                         "has neither HOROVOD_SIZE/HOROVOD_LOCAL_SIZE nor OMPI_COMM_WORLD_SIZE/_LOCAL_SIZE)")
    if not (isinstance(size, int) and isinstance(local_size, int) and 1 <= local_size <= size
            and size % local_size == 0):
        raise ValueError(f"host_process_sets: local_size must divide size (ranks per host of equal hosts), "
                         f"got size={size!r}, local_size={local_size!r}")
    table = [(r % local_size, local_size, r // local_size, size // local_size) for r in range(size)]
    planned = plan_sets(table)
    if isinstance(planned, str):
        return []                      # the flat fallback needs no sets
    made = [mpi_ops.ProcessSet(ranks) for ranks in planned[0] + planned[1]]
    _MADE.extend(made)
    return made


def _env_int(*names):
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def resolve(name="hvd_topk.hosts", optional=False) -> Optional[HostSets]:
    """This rank's ``HostSets``, or None where hierarchical falls back to the flat transport (with a
    warning saying why). Collective on the first call of a job (every rank must call it); the same
    answer afterwards. ValueError, on every rank, when Horovod knows the sets and cannot add them.

    ``optional``: for ``communication='auto'``, to which hierarchical is one candidate: None, silently,
    wherever hierarchical would fall back or raise (the same on every rank)."""
    cached = _RESOLVED.get("sets", False)
    if cached is not False and (cached is None or cached.host.process_set_id is not None):
        _HOLDERS["count"] += cached is not None
        return cached
    row = torch.tensor([[mpi_ops.local_rank(), mpi_ops.local_size(), mpi_ops.cross_rank(), mpi_ops.cross_size()]])
    table = mpi_ops.allgather(row, name=f"{name}.layout").tolist() if mpi_ops.size() > 1 else row.tolist()
    planned = plan_sets(table)
    if isinstance(planned, str):
        if not optional:
            warnings.warn(f"hvd_topk: communication='hierarchical' runs the flat transport: {planned}")
        _RESOLVED["sets"] = None
        return None
    host_lists, cross_lists = planned
    try:
        sets = [_registered(ranks, host_lists + cross_lists) for ranks in host_lists + cross_lists]
    except ValueError:
        if optional:             # every rank fails at the same set: Horovod refuses all or none
            return None
        raise
    rank = mpi_ops.rank()
    host = next(i for i, ranks in enumerate(host_lists) if rank in ranks)
    position = host_lists[host].index(rank)
    _RESOLVED["sets"] = HostSets(sets[host], sets[len(host_lists) + position], position, len(host_lists),
                                 len(host_lists[0]))
    _HOLDERS["count"] = 1
    return _RESOLVED["sets"]


def release(sets):
    """Remove ``sets`` (``resolve``'s answer) from Horovod, if they can go: resolve added them (dynamic
    process sets) and their caller is their last holder (every transport stack that resolved them holds
    them). Collective: every rank calls it at the same step, and gets the same answer. Returns whether
    they were removed; if not, nothing changed. A later ``resolve`` adds them again."""
    if sets is None or _RESOLVED.get("sets") is not sets or _HOLDERS["count"] != 1 or not _ADDED:
        return False
    for process_set in _ADDED:       # every rank removes every set, in the order they were added
        mpi_ops.remove_process_set(process_set)
    _ADDED.clear()
    _RESOLVED.pop("sets")
    _HOLDERS["count"] = 0
    return True


def _registered(ranks, needed):
    """The ProcessSet of ``ranks``: one host_process_sets made and hvd.init registered, else one added now."""
    for ps in _MADE:
        if ps.ranks == ranks and ps.process_set_id is not None:
            return ps
    try:
        _ADDED.append(mpi_ops.add_process_set(ranks))
        return _ADDED[-1]
    except ValueError as e:
        raise ValueError(
            f"communication='hierarchical' needs Horovod process sets {needed} (each host's ranks, then the "
            f"ranks at each position on every host): start the job with HOROVOD_DYNAMIC_PROCESS_SETS=1 (or "
            f"hvd.init(process_sets='dynamic')), or call hvd.init(process_sets=hvd_topk.host_process_sets()) "
            f"(Horovod says: {e})") from None
