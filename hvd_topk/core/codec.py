"""One Top-K message in about 4 bytes per kept entry: 16-bit values and 16-bit index offsets (no Horovod).

A message holds the k entries one rank sends for the index range [lo, hi) of one tensor (all of it, or
an owner's region in split_reduce) as one uint8 buffer, native byte order, each section at a multiple
of 4 bytes so that it is read in place::

    header   8 bytes: k (int32), the value kind (int16), the power-of-two scale exponent (int16)
    values   k x 2, 4 or 8 bytes, in index order: bf16, fp16 (scaled by 2**exponent), fp32 (or fp64)
    counts   entries per 65,536-index block of the range but the last (k minus the others): uint16
             while k < 65,536 (no block can then hold 65,536), else int32; none when k = 0
    offsets  k x 2 bytes: each index minus lo, modulo 65,536 (its block follows from the counts)

The size follows from (k, hi - lo, value kind) (``packed_nbytes``) and is a multiple of 4: messages
laid end to end split by their headers (``split_messages``) and stay aligned. Block counts cost 2
bytes per 65,536 indices of the range, so a bf16 or fp16 message costs 4.003 bytes per entry at ratio
0.01 (4.03 at 0.001, 4.3 at 0.0001) plus 8 to 12 per message. Fixed-width offsets keep both ends to a
few vectorised passes, where variable-width deltas need a scan, and a bitmap (hi - lo bits) beats
2 bytes per entry only above 1/16 of the range, where a dense allreduce wins anyway.

pack + unpack, one thread, bf16 (fp16, fp32 within 10%): k = 63,000 of 6.3M 2.0 ms (1.1 ms sorted), k = 1M
of 100M 38 ms (19 ms sorted), against 1.0 and 19 ms for 8-byte rows; ``pack`` skips the sort of sorted indices.
"""
import math

import torch

from .sparsify import ascending
from .validate import check_choice, check_int
from .wire import CODEC_BLOCK, CODEC_HEADER_BYTES, CODEC_OFFSET_BYTES, CODEC_VALUE_BYTES

__all__ = ["VALUE_KINDS", "KINDS", "MAX_SPAN", "sent_values", "packed_nbytes", "pack", "unpack", "message_nbytes",
           "split_messages"]

VALUE_KINDS = ("bf16", "fp16", "fp32")    # the kinds of float32 values; float64 values go as 'fp64', unchanged
KINDS = VALUE_KINDS + ("fp64",)
MAX_SPAN = 1 << 31                  # indices below 2**31 (int32, as elsewhere on the wire); larger tensors refused
_KIND_CODES = {"fp32": 0, "bf16": 1, "fp16": 2, "fp64": 3}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
_BLOCK_BITS = CODEC_BLOCK.bit_length() - 1
# fp16's scale puts the largest finite magnitude in [2**14, 2**15): rounding it to 11 bits gives at most
# 2**15, below fp16's largest finite value (65504), and leaves 2**38 below it before fp16's smallest step.
_FP16_TOP_EXPONENT = 15
_FP32_TOP_BINADE = 2.0 ** 127       # only magnitudes from here on can round up past float32's largest


def _times_pow2(x, exponent):
    """``x * 2**exponent`` in float32, in two factors (2**exponent alone may lie outside float32's range)."""
    half = exponent // 2
    return x * 2.0 ** half * 2.0 ** (exponent - half) if exponent else x


def _largest_finite(values):
    """The largest finite magnitude in ``values`` (0.0 when none), as a Python float."""
    least, most = torch.aminmax(values) if values.numel() else (torch.zeros(()),) * 2
    largest = max(-float(least), float(most))                  # NaN or inf: a second pass, rarely taken
    return largest if math.isfinite(largest) else float(torch.nan_to_num(values.abs(), nan=0.0, posinf=0.0).amax())


def _sort_by_index(relative, codes):
    """(relative, codes) in index order. One sort of int64 keys (index, then the code's bits) moves both
    (``sparsify.ascending``: numpy's sort on the CPU)."""
    if codes.element_size() == 8:                             # fp64: no room for the code beside the index
        order = torch.argsort(relative, stable=True)
        return relative[order], codes[order]
    width = 8 * codes.element_size()
    bits_dtype = torch.int16 if width == 16 else torch.int32
    keys = (relative.long() << width) | (codes.view(bits_dtype).long() & ((1 << width) - 1))
    keys = ascending(keys)
    return (keys >> width).to(torch.int32), keys.to(bits_dtype).view(codes.dtype)     # low bits: the code


def _decode(codes, exponent):
    """New float32 values of a message's codes (bf16, fp16 or fp32; fp16 scaled by 2**exponent); fp64's own."""
    if codes.dtype == torch.float64:
        return codes.clone()
    return _times_pow2(codes.to(torch.float32, copy=True), -exponent)


def _encode(values, value_kind):
    """(codes, exponent): ``values`` (float32) rounded to nearest in ``value_kind``, fp16 after scaling by
    2**exponent; a finite value whose code would decode to inf takes the next code toward zero."""
    if value_kind in ("fp32", "fp64"):
        return values, 0
    largest = _largest_finite(values)
    if value_kind == "bf16":
        exponent, codes = 0, values.to(torch.bfloat16)
    else:
        exponent = _FP16_TOP_EXPONENT - math.frexp(largest)[1] if largest > 0 else 0
        codes = _times_pow2(values, exponent).to(torch.float16)
    if largest >= _FP32_TOP_BINADE:
        rounded_up = torch.isinf(_decode(codes, exponent)) & torch.isfinite(values)
        # sign and magnitude: one less in the integer view is one step toward zero, for either sign
        codes = (codes.view(torch.int16) - rounded_up.to(torch.int16)).view(codes.dtype)
    return codes, exponent


def sent_values(values, value_kind="bf16"):
    """The float32 values a receiver decodes from ``pack(values, ...)``: what error feedback counts as sent.

    The caller keeps ``values - sent_values(values, kind)`` in its residual instead of zero. That
    subtraction is exact in float32, so Σ sent + residual = Σ accumulator holds bit for bit in float64:
    each decoded d is a float32 number (codes have fewer significand bits and the scale is a power of
    two, so d = code * 2**-exponent stays on float32's grid; where the code's step is the finer, v is
    coded exactly), and d lies within [v/2, 2v] or is 0 (rounding to nearest moves v by at most half a
    step of its binade, and zero is a code; at float32's top binade a code that would decode to inf is
    replaced by the next one toward zero), so v - d is exact by Sterbenz's lemma, subnormals included.

    Rounding: bf16 <= 2**-8 relative (2**-7 above its largest finite, 3.39e38), <= 2**-134 absolute
    below 2**-126; fp16 <= 2**-11 relative down to 2**-28 x the message's largest magnitude, <= 2**-39 x
    that largest absolute below it (2**-10 relative where float32's top binade rounds toward zero).
    Non-finite values (the transports find non-finite accumulators before encoding) stay inf and NaN,
    fp16's scale comes from the finite ones, and no finite value ever becomes inf.

    Args:
        values: 1-D float32 tensor (float64 for 'fp64').
        value_kind: 'bf16', 'fp16' (with a per-message power-of-two scale), 'fp32' or 'fp64' (unchanged).

    Returns:
        1-D float32 tensor, elementwise the decoded value of each of ``values`` (same order).

    Example:
        >>> sent_values(torch.tensor([1.0, 1 / 3, 3.4e38]), "bf16").tolist()
        [1.0, 0.333984375, 3.3895313892515355e+38]
    """
    _check_values(values, check_choice("value_kind", value_kind, KINDS))
    return _decode(*_encode(values, value_kind))


def _described(x):                                            # a bad tensor argument, for its error message
    return f"{getattr(x, 'dtype', type(x))} of shape {tuple(getattr(x, 'shape', ()))}"


def _check_values(values, value_kind):
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.dtype != (
            torch.float64 if value_kind == "fp64" else torch.float32):
        raise ValueError(f"values must be a 1-D float32 tensor (float64 for 'fp64'), got {_described(values)}")


def _sections(k, span, value_kind):
    """[(start, end, dtype)] of the values, block counts and offsets of a message, and its size in bytes."""
    blocks = -(-span // CODEC_BLOCK) - 1 if k else 0
    count_dtype = torch.int16 if k < CODEC_BLOCK else torch.int32
    parts = [(CODEC_VALUE_BYTES[value_kind] * k, _DTYPES[value_kind]), (count_dtype.itemsize * blocks, count_dtype),
             (CODEC_OFFSET_BYTES * k, torch.int16)]
    start, sections = CODEC_HEADER_BYTES, []
    for size, dtype in parts:
        sections.append((start, start + size, dtype))
        start += -(-size // 4) * 4
    return sections, start


def packed_nbytes(k, span, value_kind="bf16"):
    """The exact size of a message of k entries of an index range ``span`` long (what the cost model prices).

    Args:
        k: entries in the message, 0 <= k <= span.
        span: hi - lo of the message's index range, 0 <= span <= 2**31.
        value_kind: 'bf16', 'fp16', 'fp32' or 'fp64'.

    Returns:
        int, bytes: a multiple of 4; 8 for an empty message.

    Example:
        >>> packed_nbytes(63_000, 6_300_000, "bf16"), packed_nbytes(0, 6_300_000, "fp16")
        (252200, 8)
    """
    span = check_int("span", span, 0, MAX_SPAN)
    k = check_int("k", k, 0, span)
    return _sections(k, span, check_choice("value_kind", value_kind, KINDS))[1]


def pack(values, indices, lo, hi, value_kind="bf16"):
    """One message of the entries (values, indices) whose indices lie in [lo, hi), in index order.

    Args:
        values: 1-D float32 tensor of the k entries' values (k = 0: an empty message); float64 for 'fp64'.
        indices: 1-D integer tensor of their indices, lo <= index < hi, distinct, in any order.
        lo, hi: the message's index range, 0 <= lo <= hi <= 2**31 (larger tensors are refused).
        value_kind: 'bf16', 'fp16', 'fp32' or 'fp64' (``sent_values`` says what each does to the values).

    Returns:
        1-D uint8 tensor of ``packed_nbytes(k, hi - lo, value_kind)`` bytes (module docstring).

    Example:
        >>> buf = pack(torch.tensor([0.5, -2.0]), torch.tensor([70_000, 3]), 0, 100_000)
        >>> buf.numel(), unpack(buf, 0, 100_000)
        (20, (tensor([-2.0000,  0.5000]), tensor([    3, 70000])))
    """
    span = check_int("hi", hi, check_int("lo", lo, 0, MAX_SPAN), MAX_SPAN) - lo
    _check_values(values, check_choice("value_kind", value_kind, KINDS))
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.numel() != values.numel() \
            or indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"indices must be a 1-D integer tensor of {values.numel()} entries (one per value), "
                         f"got {_described(indices)}")
    k = indices.numel()
    least, most = (int(x) for x in torch.aminmax(indices)) if k else (lo, hi - 1)
    if least < lo or most >= hi:
        raise ValueError(f"indices must lie in [lo, hi) = [{lo}, {hi}), got {least} to {most}")
    if k > span:
        raise ValueError(f"indices must be distinct: got {k} of a range of {span} indices")
    codes, exponent = _encode(values, value_kind)
    relative = (indices - lo).to(torch.int32)                 # < 2**31
    if k > 1 and not bool((relative[1:] >= relative[:-1]).all()):
        relative, codes = _sort_by_index(relative, codes)
    (values_at, counts_at, offsets_at), size = _sections(k, span, value_kind)
    buf = torch.zeros(size, dtype=torch.uint8, device=values.device)
    buf[:4].view(torch.int32)[0] = k
    buf[4:8].view(torch.int16).copy_(torch.tensor([_KIND_CODES[value_kind], exponent], dtype=torch.int16))
    buf[values_at[0]:values_at[1]].view(values_at[2]).copy_(codes)
    counts = buf[counts_at[0]:counts_at[1]].view(counts_at[2])
    ends = torch.arange(1, counts.numel() + 1, dtype=torch.int32, device=relative.device) << _BLOCK_BITS
    ends = torch.searchsorted(relative, ends)                 # entries before each block's end (sorted)
    counts.copy_(torch.diff(ends, prepend=ends.new_zeros(1)))                  # int16 wraps to uint16's bits
    buf[offsets_at[0]:offsets_at[1]].view(torch.int16).copy_((relative & (CODEC_BLOCK - 1)).to(torch.int16))
    return buf


def _header(buf):
    """(k, value kind) of the message that starts ``buf``, and its scale exponent."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 \
            or buf.numel() < CODEC_HEADER_BYTES:
        raise ValueError(f"buf must be a 1-D uint8 tensor of at least {CODEC_HEADER_BYTES} bytes (a message), "
                         f"got {_described(buf)}")
    head = buf[:CODEC_HEADER_BYTES].cpu().clone()
    k = int(head[:4].view(torch.int32)[0])
    code, exponent = head[4:].view(torch.int16).tolist()
    kinds = {c: kind for kind, c in _KIND_CODES.items()}
    if code not in kinds or k < 0:
        raise ValueError(f"buf does not start with a message header: k = {k}, value kind code {code} "
                         f"(accepted: {sorted(kinds)})")
    return k, kinds[code], exponent


def unpack(buf, lo, hi):
    """The entries of one message of the range [lo, hi): (values, indices), in index order.

    Args:
        buf: 1-D uint8 tensor holding exactly one message of ``pack`` for the same [lo, hi).
        lo, hi: the range the message was packed for.

    Returns:
        (values float32, indices int64), 1-D, k each, sorted by index; the values are ``sent_values``
        of the packed ones.

    Example:
        >>> unpack(pack(torch.tensor([1.0]), torch.tensor([65_536]), 65_536, 65_537, "fp16"), 65_536, 65_537)
        (tensor([1.]), tensor([65536]))
    """
    span = check_int("hi", hi, check_int("lo", lo, 0, MAX_SPAN), MAX_SPAN) - lo
    k, value_kind, exponent = _header(buf)
    (values_at, counts_at, offsets_at), size = _sections(k, span, value_kind)
    if k > span or buf.numel() != size:
        raise ValueError(f"buf holds {buf.numel()} bytes, a message of {k} entries of a range of {span} "
                         f"indices needs {size} (and k <= {span}); unpack takes one message for the same range")
    if buf.storage_offset() % max(4, _DTYPES[value_kind].itemsize) or not buf.is_contiguous():
        buf = buf.clone()                   # views of 4- (8-) byte items start at multiples of 4 (8)
    values = _decode(buf[values_at[0]:values_at[1]].view(values_at[2]), exponent)
    offsets = buf[offsets_at[0]:offsets_at[1]].view(torch.int16).long() & (CODEC_BLOCK - 1)
    counts = buf[counts_at[0]:counts_at[1]].view(counts_at[2]).long() & (2 ** (8 * counts_at[2].itemsize) - 1)
    last = k - int(counts.sum())
    if last < 0:
        raise ValueError(f"buf's block counts add up to {k - last}, more than its {k} entries")
    counts = torch.cat([counts, counts.new_full((1,), last)])
    blocks = torch.repeat_interleave(torch.arange(counts.numel(), device=buf.device), counts, output_size=k)
    return values, blocks.mul_(CODEC_BLOCK).add_(offsets).add_(lo)


def message_nbytes(buf, span):
    """The size of the message that starts ``buf`` (of a range ``span`` long), read from its header: e.g. 16
    for one entry of a range of 10 (``packed_nbytes(1, 10)``)."""
    k, value_kind, _ = _header(buf)
    return packed_nbytes(k, span, value_kind)


def split_messages(buf, spans):
    """The messages laid end to end in ``buf``, one per span, each sized from its own header.

    Args:
        buf: 1-D uint8 tensor: ``pack`` messages concatenated, the i-th of a range ``spans[i]`` long.
        spans: hi - lo of each message's range, in order.

    Returns:
        list of 1-D uint8 views of ``buf``, one message each (``unpack`` them with their ranges).

    Example:
        >>> two = torch.cat([pack(torch.tensor([1.0]), torch.tensor([5]), 0, 10), pack(torch.ones(0),
        ...                  torch.ones(0, dtype=torch.long), 10, 20)])
        >>> [m.numel() for m in split_messages(two, [10, 10])]
        [16, 8]
    """
    messages, at = [], 0
    for span in spans:
        size = message_nbytes(buf[at:], span)
        if at + size > buf.numel():
            raise ValueError(f"buf ends inside message {len(messages)}: {buf.numel()} bytes, it needs {at + size}")
        messages.append(buf[at:at + size])
        at += size
    if at != buf.numel():
        raise ValueError(f"buf holds {buf.numel()} bytes but its messages for spans {list(spans)} end at byte {at}")
    return messages
