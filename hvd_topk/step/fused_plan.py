"""What both front doors do with the transports that send their keys in buckets (split_reduce, allgather,
dense_fp16: ``hvd_topk.transports.fused``): give them the buckets, tell them a step's keys, poll them;
and, with low rank and hierarchical, which run their later phases at a step's first ``finish``, settle
them all in one order at whichever first ``finish`` comes, so that no order of finishes hangs.

The plan is ``hvd_topk.core.buckets.plan_buckets`` over the compressed keys in registration order, so
every rank has the same buckets: the optimizer plans when it is made, ``TopKEF`` after its first step
(until then each key travels alone). The optimizer routes keys per step (dense steps, warm-up, auto's
plan): at a step's first start each fused transport learns which keys it gets, so that a bucket leaves
as soon as its own have come, not at ``synchronize()``.
"""
from ..core.buckets import cap_numel, plan_buckets

__all__ = ["FusedPlan"]


class FusedPlan:
    """The fused transports of one front door, and the order the door's transports settle a step in.

    Args:
        transports: callable -> the door's transports (built or not yet); those with ``buckets`` fuse,
            those with ``settle`` (and the buckets) settle.
    """

    def __init__(self, transports):
        self._transports = transports

    def transports(self):
        """The fused transports, each once (a name may alias another's transport)."""
        return list({id(t): t for t in self._transports() if getattr(t, "buckets", None) is not None}.values())

    def plan(self, keys, numels, cap_mb):
        """Buckets of at most ``cap_mb`` MB of float32 gradient over ``keys`` (registration order) that
        have a size in ``numels``; the first of at most a transport's ``first_bucket_mb``, where it has one."""
        keys = [key for key in keys if key in numels]
        for transport in self.transports():
            first_mb = getattr(transport, "first_bucket_mb", None)
            first = None if first_mb is None or not cap_mb else cap_numel(min(first_mb, cap_mb))
            transport.buckets.set_plan(plan_buckets(keys, numels, cap_numel(cap_mb), first))
        self._hand_out_settle()

    def expect(self, routes):
        """``routes``: key -> the transport it goes to this step."""
        for transport in self.transports():
            transport.buckets.expect([key for key, t in routes.items() if t is transport])
        self._hand_out_settle()

    def settlers(self):
        """What settles a step, each once, in the door's order of its transports (the same on every rank):
        the fused transports' buckets, and the transports that run their later phases at the step's
        first ``finish`` (low rank, hierarchical)."""
        found = [getattr(t, "buckets", None) or t for t in self._transports()]
        return list({id(s): s for s in found if callable(getattr(s, "settle", None))}.values())

    def settle(self):
        """Complete the step of every transport in flight, in ``settlers``' order: a rank that blocks on
        one has completed those before it, so whatever order Horovod finishes the keys in on each rank,
        every blocking wait is on a collective every rank starts (``hvd_topk.transports.fused``, rule 3)."""
        for settler in self.settlers():
            settler.settle()

    def _hand_out_settle(self):
        """Every settler's first ``finish`` of a step settles them all (``settle``)."""
        for settler in self.settlers():
            settler.settle_all = self.settle

    def advance(self):
        """Start the next phase of every bucket whose collective is done (never blocks)."""
        for transport in self.transports():
            transport.buckets.advance()
