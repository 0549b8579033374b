"""A step's compressed tensors in buckets, and how each tensor's entries are framed on the wire (no Horovod).

- ``plan_buckets``: the partition of a front door's keys into buckets, as DDP buckets its gradients:
  keys in reverse registration order (backward makes the last layers' gradients ready first), a new
  bucket whenever the next key would take the bucket past the cap. Every rank computes it from the same
  keys in the same order, so the buckets are identical everywhere.
- ``wire_kind``: the codec's value kind (``hvd_topk.core.codec``) for an accumulator's dtype and the
  ``values`` setting: 16 bits by default where the gradient is float32; fp32 with ``values='fp32'``;
  float64 accumulators go unchanged ('fp64'); float16 and bfloat16 ones in their own 16 bits.
- ``frame`` / ``read_frame``: a bucket's buffer for one destination: a frame (an int32 ``signature`` of
  the bucket's keys, sizes and index ranges, the count of its tensors, a float32 flag per tensor) and
  one codec message per value kind present, over the bucket's index space (``offsets``: its tensors
  laid end to end). The signature lets a receiver refuse a buffer that another rank filled with other
  tensors (other keys, sizes or index regions) instead of reading it wrongly; a tensor's flag is the
  sender's largest |value| sent, or inf when its accumulator was not finite.
"""
import zlib

import torch

from .codec import VALUE_KINDS, message_nbytes
from .validate import check_choice, check_int
from .wire import FLAG_BYTES, FRAME_BYTES

__all__ = ["plan_buckets", "cap_numel", "wire_kind", "wire_dtype", "signature", "offsets", "frame", "read_frame",
           "flag_of"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def plan_buckets(keys, numels, cap, first_cap=None):
    """The buckets of ``keys`` (given in registration order): reversed, cut where the next key would
    take a bucket's elements past ``cap`` (the first bucket's past ``first_cap``, where given).

    Args:
        keys: the keys in registration order (identical on every rank).
        numels: key -> number of elements of its tensor.
        cap: most elements per bucket, int >= 0 (a larger tensor is a bucket alone); 0: one bucket.
        first_cap: most elements of the first bucket (the last layers', ready first), int >= 0, as DDP's
            first bucket of 1 MiB; None: ``cap``.

    Returns:
        list of lists of keys, every key in exactly one.

    Example:
        >>> plan_buckets(["a", "b", "c"], {"a": 5, "b": 3, "c": 4}, cap=8)
        [['c', 'b'], ['a']]
        >>> plan_buckets(["a", "b", "c"], {"a": 5, "b": 3, "c": 4}, cap=0, first_cap=4)
        [['c'], ['b', 'a']]
    """
    cap = check_int("cap", cap)
    first_cap = cap if first_cap is None else check_int("first_cap", first_cap)
    buckets, size = [], 0
    for key in reversed(list(keys)):
        n = int(numels[key])
        limit = first_cap if len(buckets) == 1 else cap
        if not buckets or (limit and size + n > limit):
            buckets.append([])
            size = 0
        buckets[-1].append(key)
        size += n
    return buckets


def cap_numel(cap_mb):
    """``plan_buckets``' cap for ``bucket_cap_mb`` MB of float32 gradient: at least 1 element (0: no cap).

    Example:
        >>> cap_numel(25.0), cap_numel(1e-9), cap_numel(0)
        (6553600, 1, 0)
    """
    return max(1, int(cap_mb * 2 ** 20) // 4) if cap_mb > 0 else 0


def wire_kind(dtype, values):
    """The codec kind of an accumulator of ``dtype`` under the ``values`` setting ('bf16', 'fp16', 'fp32').

    Example:
        >>> wire_kind(torch.float32, "bf16"), wire_kind(torch.float64, "bf16"), wire_kind(torch.float16, "bf16")
        ('bf16', 'fp64', 'fp16')
    """
    check_choice("values", values, VALUE_KINDS)
    if dtype == torch.float64:
        return "fp64"
    if dtype == torch.float32 or values == "fp32":
        return values
    return "bf16" if dtype == torch.bfloat16 else "fp16"


def wire_dtype(kind):
    """The dtype ``codec.pack`` takes the values of ``kind`` in."""
    return torch.float64 if kind == "fp64" else torch.float32


def signature(*parts):
    """An int32 fingerprint of ``parts`` (the keys, sizes, index ranges of a message), identical on all ranks."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


def offsets(numels):
    """Where each tensor starts in a bucket's index space (its tensors laid end to end), and the total.

    Example:
        >>> offsets([3, 5])
        ([0, 3], 8)
    """
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += int(n)
    return starts, total


def flag_of(values, finite):
    """A tensor's flag: the largest |value| of ``values`` (capped to float32's largest), or inf if not finite."""
    if not finite:
        return float("inf")
    return min(float(values.abs().max()), _FLOAT32_MAX) if values.numel() else 0.0


def frame(sig, flags, messages):
    """uint8: the frame (int32 ``sig``, int32 count, a float32 flag per tensor) and the codec ``messages``."""
    head = torch.empty(FRAME_BYTES + FLAG_BYTES * len(flags), dtype=torch.uint8)
    head[:FRAME_BYTES].view(torch.int32).copy_(torch.tensor([sig, len(flags)], dtype=torch.int32))
    head[FRAME_BYTES:].view(torch.float32).copy_(torch.tensor(flags, dtype=torch.float32))
    return torch.cat([head] + list(messages))


def read_frame(buf, messages, span):
    """The frame at the front of ``buf`` and its ``messages`` codec messages of a range ``span`` long:
    (sig, float64 flags, [message], bytes read). ValueError where ``buf`` ends before they do."""
    if buf.numel() < FRAME_BYTES:
        raise ValueError(f"buf ends inside a frame: {buf.numel()} bytes")
    sig, count = buf[:FRAME_BYTES].clone().view(torch.int32).tolist()
    at = FRAME_BYTES + FLAG_BYTES * count
    if count < 0 or at > buf.numel():
        raise ValueError(f"buf ends inside a frame of {count} flags: {buf.numel()} bytes")
    flags = buf[FRAME_BYTES:at].clone().view(torch.float32).double()
    found = []
    for _ in range(messages):
        end = at + message_nbytes(buf[at:], span)
        if end > buf.numel():
            raise ValueError(f"buf ends inside message {len(found)}: {buf.numel()} bytes, it needs {end}")
        found.append(buf[at:end])
        at = end
    return sig, flags, found, at
