"""How low rank's P's and Q's go on the wire: float16 with a power-of-two scale per tensor and phase,
summed end to end in one allreduce per dtype, or through the hosts.

PowerSGD's bytes are its P's and Q's. Sent in 16 bits they cost half (torch wraps its hook in
``fp16_compress_wrapper`` for the same reason). Horovod's allreduce has float16 but not bfloat16, and
float16's range is narrow (its largest is 65504, its smallest normal 6.1e-5), so each float32 P (or Q)
is multiplied before the cast by a power of two that every rank takes alike: the one that brings the
largest |sum| of the same tensor and phase at the last step to 2**10 (``scale_for``). That leaves the
sum 64x of headroom below float16's largest, and a power of two changes no digit of any value.

Where a tensor has no last sum (its first step, after an elastic reset, or a last sum of 0), its phase
goes in its own dtype, as do float64 and float16 accumulators and ``values='fp32'``. A sum that
overflowed float16 anyway (a gradient far larger than the last step's) is not finite on every rank
alike while the finite flags are clear; the transport then sums that tensor again in its own dtype
(``needs_resend``), so no step is lost to the wire.

``sum_phase`` sums one phase (``sum_end_to_end``: one in-place allreduce per wire dtype, the tensors
laid end to end; ``sum_across_hosts``: the same through a job's hosts, ``communication='hierarchical'``).
Each is a generator of collectives (``collectives.Waits``): it yields each handle it must wait for and
gets back that collective's output, so its caller decides how to wait: to the end at once, or polling
with a deadline (the stock door's drain after the backward pass, ``hvd_topk.powersgd``).

float16 is summed by exchange, not by Horovod's sum: Horovod adds float16 one element at a time in
software (Gloo's and its own MPI reduction), so on 2 ranks of a 2-core CPU machine a float16 allreduce
of 0.5M values took 8.6-13.6 ms, 3x float32's 2.5-4.3 ms, where an allgather of the same float16 values
took 1.1-1.8 ms. Each rank therefore receives the float16 pieces it must add (an allgather on 2 ranks, an
alltoall of the shards on more) and adds them in float32 in rank order, which gives every rank the same
bits and sends what a ring allreduce sends; on more than 2 ranks each shard's sum is allgathered in
float16 again. Across hosts only the host's sum crosses, in float16.

Error feedback stays exact: each rank's residual is M_i - P Q^T from the decoded sums, whatever their
rounding (``hvd_topk.core.lowrank``), so Σ residuals + W·P Q^T = Σ M_i holds for the numbers used.
"""
import math
from typing import Optional

import torch
from horovod.torch import mpi_ops

from .collectives import add_rows, flag_raised, reduce_scatter_async, reduce_scatter_sum
from ..core.wire import LOWRANK_VALUE_BYTES

__all__ = ["VALUES", "scale_for", "encode", "decode", "needs_resend", "largest", "sum_phase", "sum_end_to_end",
           "sum_across_hosts", "sum_by_exchange"]

VALUES = tuple(LOWRANK_VALUE_BYTES)         # PowerSGDSettings.values: 'fp16', 'fp32'
_TARGET_EXPONENT = 10                       # the last step's largest |sum| is scaled to 2**10
_EXPONENT_LIMIT = 100                       # scales within 2**±100: finite, and exact, in float32


def scale_for(last_largest: Optional[float]) -> Optional[float]:
    """The power of two that brings ``last_largest`` (the last step's largest |sum|) to 2**10, or None
    (no usable last sum: the phase goes in its own dtype).

    Example:
        >>> scale_for(3.0), scale_for(1e-3), scale_for(None), scale_for(0.0)
        (256.0, 524288.0, None, None)
    """
    if last_largest is None or not 0.0 < last_largest < math.inf:
        return None
    exponent = _TARGET_EXPONENT - math.ceil(math.log2(last_largest))
    return 2.0 ** max(-_EXPONENT_LIMIT, min(_EXPONENT_LIMIT, exponent))


def encode(tensor, scale):
    """What goes on the wire: ``tensor * scale`` in float16, or ``tensor`` itself where ``scale`` is None."""
    return tensor if scale is None else (tensor * scale).to(torch.float16)


def decode(total, scale, dtype):
    """The sum back in ``dtype``: ``total / scale`` (exact: a power of two), or ``total`` unscaled (a
    float16 sum comes back from its exchange in float32)."""
    total = total.to(dtype)
    return total if scale is None else total * (1.0 / scale)


def needs_resend(total, scale, raised):
    """Whether a float16 sum overflowed: it was scaled, no rank raised its finite flag (``raised``), and
    it is not finite (identical on every rank: every rank holds the same sum)."""
    return scale is not None and not raised and not bool(torch.isfinite(total).all())


def largest(total):
    """The largest |value| of a sum, a Python float (what the next step's ``scale_for`` reads)."""
    return float(total.abs().max()) if total.numel() else 0.0


def sum_phase(entries, name, process_set, hosts=None):
    """(sums, launches): [(sum, summed flag or None)] of ``entries`` [(payload, finite flag or None, float16
    scale or None)] over the ranks, one allreduce per wire dtype (``sum_end_to_end``, or through ``hosts``):
    a scaled payload goes in float16 with its flag beside it; a float16 sum that overflowed is summed
    again in the payload's own dtype (``<name>.resend``). Sums come back in the payloads' dtypes. A
    generator of collectives (module docstring): it returns (sums, launches)."""
    wire = []
    for payload, flag, scale in entries:
        wire += [encode(payload, scale)] + ([] if flag is None else [flag if scale is None else flag.half()])
    sums, launches = yield from _sum(wire, name, process_set, hosts)
    out, at, resend = [], 0, []
    for payload, flag, scale in entries:
        total, flag_sum = sums[at], None if flag is None else sums[at + 1]
        at += 1 if flag is None else 2
        if needs_resend(total, scale, flag_sum is not None and flag_raised(flag_sum.reshape(()))):
            resend.append(len(out))
        out.append([decode(total, scale, payload.dtype), flag_sum])
    if resend:
        again, more = yield from _sum([entries[i][0] for i in resend], f"{name}.resend", process_set, hosts)
        launches += more
        for i, total in zip(resend, again):
            out[i][0] = total
    return out, launches


def sum_end_to_end(tensors, name, process_set):
    """(the ranks' sums of ``tensors``, [(collective name, numel)]): one in-place allreduce per dtype
    of the tensors laid end to end in their order, all started before any is waited for; float16 by
    exchange (``sum_by_exchange``), while the others' allreduces are in flight. A generator of
    collectives (module docstring)."""
    handles, launches, exchanged = [], [], []
    for indices, flat, label in _flat_by_dtype(tensors, name):
        if flat.dtype == torch.float16:
            exchanged.append((indices, flat, label))
            continue
        launches.append((label, flat.numel()))
        handles.append((indices, mpi_ops.allreduce_async_(flat, op=mpi_ops.Sum, name=label, process_set=process_set)))
    buffers = []
    for indices, flat, label in exchanged:
        buffers.append((indices, (yield from sum_by_exchange(flat, process_set, label, launches))))
    for indices, handle in handles:
        buffers.append((indices, (yield handle)))
    return _split_sums(tensors, buffers), launches


def sum_by_exchange(flat, process_set, label, launches):
    """The ranks' sum of the float16 ``flat``, in float32, the same bits on every rank, with the bytes of
    a ring allreduce: on 2 ranks one allgather, each adding [rank 0's, rank 1's]; on more, each shard
    summed by its owner (``reduce_scatter_async``) and allgathered in float16 (a shard that overflows
    float16 arrives as inf, which ``needs_resend`` sees)."""
    if process_set.size() <= 2:
        launches.append((label, flat.numel()))
        gathered = yield mpi_ops.allgather_async(flat, name=label, process_set=process_set)
        return add_rows(gathered.view(process_set.size(), flat.numel()))
    started = reduce_scatter_async(flat, f"{label}.scatter", process_set)
    shard = reduce_scatter_sum(started, (yield started.handle))
    launches += [(f"{label}.scatter", started.numel), (f"{label}.gather", shard.numel())]
    gathered = yield mpi_ops.allgather_async(shard.to(torch.float16), name=f"{label}.gather", process_set=process_set)
    return gathered[:flat.numel()].to(torch.float32)


def _flat_by_dtype(tensors, name):
    """[(indices, the tensors of one dtype laid end to end, ``<name>.<dtype>``)], dtypes in sorted order."""
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return [(by_dtype[dtype], torch.cat([tensors[i].reshape(-1) for i in by_dtype[dtype]]),
             f"{name}.{str(dtype).removeprefix('torch.')}") for dtype in sorted(by_dtype, key=str)]


def _split_sums(tensors, buffers):
    """The per-tensor views of the summed buffers: [(indices of the tensors laid end to end, their sum)]."""
    sums = [None] * len(tensors)
    for indices, total in buffers:
        for i, part in zip(indices, torch.split(total, [tensors[i].numel() for i in indices])):
            sums[i] = part.view(tensors[i].shape)
    return sums


def sum_across_hosts(tensors, name, hosts):
    """``sum_end_to_end`` over ``hosts`` (``host_sets.HostSets``): per dtype, the buffer (padded to a
    multiple of the ranks per host) is reduce-scattered inside the host (``reduce_scatter_async``),
    each rank's shard summed over its cross set (an allreduce; float16 by exchange, from the host's
    float32 sum: only float16 crosses), and the shards allgathered inside the host: every rank ends with
    the same sums, bit for bit (each shard's sum is one cross set's, copied to the whole host). Each
    step is started for every dtype before any is waited for. A generator of collectives (module docstring)."""
    launches, scattered = [], []
    for indices, flat, label in _flat_by_dtype(tensors, name):
        started = reduce_scatter_async(flat, f"{label}.scatter", hosts.host)
        launches.append((f"{label}.scatter", started.numel))
        scattered.append((indices, flat, label, started))
    crossed = []
    for indices, flat, label, started in scattered:
        host_sum = reduce_scatter_sum(started, (yield started.handle))
        if flat.dtype == torch.float16:
            crossed.append((indices, flat, label, (yield from sum_by_exchange(host_sum.to(torch.float16), hosts.cross,
                                                                               f"{label}.cross", launches))))
            continue
        launches.append((f"{label}.cross", host_sum.numel()))
        crossed.append((indices, flat, label, mpi_ops.allreduce_async_(host_sum, op=mpi_ops.Sum, name=f"{label}.cross",
                                                                       process_set=hosts.cross)))
    gathered = []
    for indices, flat, label, total in crossed:
        total = total if torch.is_tensor(total) else (yield total)
        launches.append((f"{label}.gather", total.numel()))
        gathered.append((indices, flat.numel(), mpi_ops.allgather_async(total, name=f"{label}.gather",
                                                                        process_set=hosts.host)))
    sums = []
    for indices, numel, handle in gathered:
        sums.append((indices, (yield handle)[:numel]))
    return _split_sums(tensors, sums), launches


def _sum(tensors, name, process_set, hosts):
    """(the ranks' sums of ``tensors``, launches): over ``process_set``, or through the ``hosts`` (a generator)."""
    return (yield from sum_end_to_end(tensors, name, process_set) if hosts is None
            else sum_across_hosts(tensors, name, hosts))
