"""Transports: how one rank's flat accumulator becomes the same aggregate on every rank.

The contract (``Transport``, ``Started``, ``Outcome``) and its invariants are in ``base.py``. One file
per transport, each with what only it uses beside it:

- ``Dense`` (dense.py): a plain allreduce of everything, as stock Horovod sends it.
- ``ARTopk`` (artopk.py): one leader's index set, shared by all ranks; the k values are allreduced.
  Its leaders (leaders.py) and its shared index sets (index_sets.py).
- ``SparseAllgather`` (allgather.py): every rank's own top-k, as (values, int32 indices); scatter-add.
- ``SplitReduce`` (split_reduce.py): every rank's own top-k, summed per index region by its owner; the
  global top-k of the sums is allgathered (Ok-Topk). Bytes flat in the number of ranks. Its regions
  (regions.py).
- ``Hierarchical`` (hierarchical.py): several ranks per host: a dense reduce-scatter inside each host,
  a ``SplitReduce`` of each shard's top-k across hosts, an allgather inside each host. Its hosts'
  process sets and the flat fallback (host_sets.py).
- collectives.py: what they share on top of Horovod's public collectives (grouping, flags, agreement).
- build.py: ``build_transports``, the one factory that makes a front door's transports from its settings.
"""
from .base import Outcome, Started, Transport
from .allgather import SparseAllgather
from .artopk import ARTopk
from .dense import Dense
from .split_reduce import SplitReduce
from .hierarchical import Hierarchical

__all__ = ["Transport", "Started", "Outcome", "ARTopk", "SparseAllgather", "SplitReduce", "Dense", "Hierarchical"]

