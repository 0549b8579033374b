"""What both front doors do with the transports that send their keys in buckets (split_reduce, allgather,
dense_fp16: ``hvd_topk.transports.fused``): give them the buckets, tell them a step's keys, poll them.

The plan is ``hvd_topk.core.buckets.plan_buckets`` over the compressed keys in registration order, so
every rank has the same buckets: the optimizer plans when it is made, ``TopKEF`` after its first step
(until then each key travels alone). The optimizer routes keys per step (dense steps, warm-up, auto's
plan): at a step's first start each fused transport learns which keys it gets, so that a bucket leaves
as soon as its own have come, not at ``synchronize()``.
"""
from ..core.buckets import cap_numel, plan_buckets

__all__ = ["FusedPlan"]


class FusedPlan:
    """The fused transports of one front door.

    Args:
        transports: callable -> the door's transports (built or not yet); those with ``buckets`` fuse.
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

    def expect(self, routes):
        """``routes``: key -> the transport it goes to this step."""
        for transport in self.transports():
            transport.buckets.expect([key for key, t in routes.items() if t is transport])

    def advance(self):
        """Start the next phase of every bucket whose collective is done (never blocks)."""
        for transport in self.transports():
            transport.buckets.advance()
