"""A fused transport's buckets: which keys travel together, when a bucket leaves, and its phases in flight.

``SparseAllgather``, ``SplitReduce`` and ``DenseFP16`` hand every started key to their ``Buckets``. A
bucket (a list of keys of the plan, ``hvd_topk.core.buckets.plan_buckets``, identical on every rank)
leaves as soon as every key expected of it this step has been started: during the backward pass, from
Horovod's hooks, in both front doors. Its phases are a generator (the transport's ``phases(name,
items)``) that packs the bucket into one buffer, yields ``(phase, handle)`` for each collective and
receives its output, and returns ``{key: Outcome}``; so each phase is one collective per bucket,
whatever the number of keys.

Why no order of events can hang:

1. Collectives are named per bucket (``<name>.bucket<i>``; a key outside the plan, or one that comes
   after its bucket left, travels alone as ``<name>.<key>``), so Horovod matches them whatever order
   the ranks start them in.
2. Later phases advance without blocking: at every ``add`` (the next gradient's start) each bucket in
   flight is polled (``mpi_ops.poll``) and its next phase started only if its output is there.
3. Every ``finish`` sends the buckets still filling as they are (every rank has started every key by
   the first: Horovod submits every gradient of a step before it waits for any); one whose outcome is
   not yet there settles every transport of its front door (``settle_all``, which
   ``hvd_topk.step.fused_plan`` sets: in the door's order of its transports, the same on every rank,
   whatever order Horovod finishes the keys in on each), the fused ones completing their buckets in
   sorted order, blocking, and before each blocking wait starting the next phase of every bucket whose
   collective is done (as 2.), so that the buckets' phases overlap instead of one after the other. A
   rank blocks on bucket b's phase j only once it has started every phase of the buckets before b (of
   its transport and of those settled before it); every other rank starts b's phase j before it blocks
   on anything after b. By induction each blocking wait is on a collective every rank starts.

Stats (``stats``, optional): collectives started and seconds blocked per phase, and each bucket's time
in flight (from its first collective to its outcome), from which ``StepStats`` reports the share of the
communication hidden behind compute.
"""
import time

from horovod.torch import mpi_ops

from .collectives import nap, wait

__all__ = ["Buckets", "as_phase"]


def as_phase(phase, steps):
    """A generator of collectives (``collectives.Waits``: it yields handles) as one phase of a bucket's
    phases: it yields ``(phase, handle)`` for each, and returns what ``steps`` returns."""
    output = None
    while True:
        try:
            handle = steps.send(output)
        except StopIteration as end:
            return end.value
        output = yield phase, handle


def _order(bucket):
    """Sort key of a bucket id: the plan's buckets by index, then the lone keys by name."""
    return (0, bucket, "") if isinstance(bucket, int) else (1, 0, str(bucket[1]))


class Buckets:
    """The keys of one transport's step, gathered into buckets that leave when complete (module docstring).

    Args:
        name: prefix of the buckets' collective names (identical on all ranks, distinct per transport).
        phases: ``phases(name, items) -> generator`` (module docstring); ``items`` maps each key of the
            bucket, in sorted order, to what ``add`` was given for it.
        stats: ``StepStats`` that records the phases' collectives, waits and flights, or None.
    """

    def __init__(self, name, phases, stats=None):
        self.name, self.phases, self.stats = name, phases, stats
        self.members = []             # the plan: bucket index -> its keys
        self.bucket_of = {}           # key -> bucket index
        self.expected = None          # bucket index -> the keys expected this step; None: the plan's
        self.filling = {}             # bucket id -> {key: item} started, not yet sent
        self.left = set()             # bucket ids sent this step
        self.flights = {}             # bucket id -> [generator, phase, handle, first collective's start]
        self.outcomes = {}            # key -> Outcome, not yet handed out
        self.settle_all = None        # settles every fused transport of the door in one order (rule 3)

    def set_plan(self, buckets):
        """The plan: lists of keys, identical on every rank (``plan_buckets``); replaces the old one."""
        self.members = [list(keys) for keys in buckets]
        self.bucket_of = {key: i for i, keys in enumerate(self.members) for key in keys}
        self.expected = None

    def expect(self, keys):
        """The keys this transport gets this step (a bucket leaves once its own have come)."""
        keys = set(keys)
        self.expected = [{key for key in members if key in keys} for members in self.members]

    def add(self, key, item, alone=False):
        """Start ``key`` (``item`` goes to its bucket's phases), sending its bucket if complete (or it alone)."""
        bucket = None if alone else self.bucket_of.get(key)
        if bucket is None or bucket in self.left:
            bucket = ("key", key)
        filling = self.filling.setdefault(bucket, {})
        if key in filling or key in self.outcomes:
            raise RuntimeError(f"hvd_topk: tensor {key!r} submitted twice in one step")
        filling[key] = item
        wanted = {key} if not isinstance(bucket, int) else \
            set(self.members[bucket] if self.expected is None else self.expected[bucket])
        if wanted <= set(filling):
            self._send(bucket)
        self.advance()

    def finish(self, key, before_wait=None):
        """The Outcome of ``key``; the step's first call sends what is still filling and settles the step
        (``settle_all``: every transport of the door; else ``settle``), ``before_wait()`` first."""
        for bucket in sorted(self.filling, key=_order):     # every key of the step has been started
            self._send(bucket)
        if key not in self.outcomes:
            if before_wait is not None:
                before_wait()
            (self.settle_all or self.settle)()
        outcome = self.outcomes.pop(key)
        if not (self.outcomes or self.flights or self.filling):
            self.left = set()                               # the step is over
        return outcome

    def settle(self):
        """Send the buckets still filling; complete those in flight in sorted order, blocking (rule 3)."""
        for bucket in sorted(self.filling, key=_order):
            self._send(bucket)
        for bucket in sorted(self.flights, key=_order):
            while bucket in self.flights:
                self.advance()              # the later buckets' next phases, before blocking (rule 3 holds)
                if bucket not in self.flights:
                    break
                (phase, handle), t0 = self.flights[bucket][1:3], time.perf_counter()
                output = wait(handle)
                if self.stats is not None:
                    self.stats.add_wait(phase, time.perf_counter() - t0)
                self._next(bucket, output)

    def advance(self):
        """Start the next phase of every bucket whose collective is done; never blocks."""
        for bucket in sorted(self.flights, key=_order):
            while bucket in self.flights and mpi_ops.poll(self.flights[bucket][2]):
                self._next(bucket, mpi_ops.synchronize(self.flights[bucket][2]))

    def drain(self, until):
        """``advance`` with ``wait``'s short sleeps between polls until no bucket is in flight or
        ``time.monotonic()`` reaches ``until``: the sleeps count as waits of the first bucket's phase.
        Never blocks on a collective, so it keeps rule 3 (a caller may give up on a rank that is late)."""
        start = time.monotonic()
        self.advance()
        while self.flights and time.monotonic() < until:
            t0 = time.perf_counter()
            nap(start)
            if self.stats is not None:
                self.stats.add_wait(self.flights[min(self.flights, key=_order)][1], time.perf_counter() - t0)
            self.advance()

    def forget(self):
        """Drop this step's buckets (an abandoned step); the plan stays."""
        self.filling, self.left, self.flights, self.outcomes = {}, set(), {}, {}

    def _send(self, bucket):
        items = self.filling.pop(bucket)
        self.left.add(bucket)
        name = f"{self.name}.bucket{bucket}" if isinstance(bucket, int) else f"{self.name}.{bucket[1]}"
        generator = self.phases(name, {key: items[key] for key in sorted(items, key=str)})
        self.flights[bucket] = [generator, None, None, time.perf_counter()]
        self._next(bucket, None)

    def _next(self, bucket, output):
        """Hand ``output`` to the bucket's phases; record its next collective, or its outcomes."""
        flight = self.flights[bucket]
        try:
            flight[1:3] = flight[0].send(output)
        except StopIteration as done:
            self.outcomes.update(done.value)
            del self.flights[bucket]
            if self.stats is not None:
                self.stats.add_flight(flight[3], time.perf_counter())
            return
        if self.stats is not None:
            self.stats.add_collective(flight[1])
