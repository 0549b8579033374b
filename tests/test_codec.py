"""The packed Top-K message (hvd_topk/core/codec.py): round trips, exact error feedback, rounding bounds,
sizes, and one real 2-rank job that sends messages through Horovod's alltoall and allgather on Gloo
(tests/workers/codec_wire.py)."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import job
from hvd_topk.core.codec import (MAX_SPAN, VALUE_KINDS, message_nbytes, pack, packed_nbytes, sent_values,
                                  split_messages, unpack)
from hvd_topk.core.wire import CODEC_BLOCK, CODEC_ENTRY_BYTES

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FP32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max


def random_values(n, seed, family):
    """float32 values of one family: normal, tiny, huge, subnormal, zeros, or any finite bit pattern."""
    gen = torch.Generator().manual_seed(seed)
    if family == "bits":                                    # every finite float32, subnormals and -0 included
        bits = torch.randint(-2 ** 31, 2 ** 31, (4 * n,), generator=gen, dtype=torch.int64).to(torch.int32)
        values = bits.view(torch.float32)
        return values[torch.isfinite(values)][:n].clone()
    if family == "subnormal":
        bits = torch.randint(0, 2 ** 23, (n,), generator=gen, dtype=torch.int32)
        return bits.view(torch.float32) * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    if family == "zeros":
        return torch.where(torch.rand(n, generator=gen) < 0.5, -0.0, 0.0)
    if family == "huge":                                    # up to float32's largest
        return (torch.rand(n, generator=gen) * 2 - 1) * FP32_MAX
    scale = {"normal": 1.0, "tiny": 1e-38, "mixed": None}[family]
    if scale is None:
        scale = 10.0 ** torch.randint(-44, 38, (n,), generator=gen).double()
        return (torch.randn(n, generator=gen).double() * scale).float()
    return torch.randn(n, generator=gen) * scale


FAMILIES = ["normal", "tiny", "huge", "subnormal", "zeros", "bits", "mixed"]


def round_trip(values, indices, lo, hi, kind):
    buf = pack(values, indices, lo, hi, kind)
    assert buf.dtype == torch.uint8 and buf.numel() == packed_nbytes(indices.numel(), hi - lo, kind)
    got_values, got_indices = unpack(buf, lo, hi)
    order = indices.argsort()
    assert got_indices.dtype == torch.int64 and torch.equal(got_indices, indices[order].long())
    assert got_values.dtype == torch.float32
    assert torch.equal(got_values.view(torch.int32), sent_values(values, kind)[order].view(torch.int32))
    return buf


@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("lo", [0, 1, 65_535, 65_536, 1_000_003])
def test_indices_at_the_block_bounds(kind, lo):
    at = [0, 1, 65_534, 65_535, 65_536, 65_537, 131_071, 131_072, 196_607, 196_608, 199_999]
    indices = torch.tensor(at[::-1]) + lo
    round_trip(torch.randn(len(at)), indices, lo, lo + 200_000, kind)


@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("span", [1, 3, 65_535, 65_536, 65_537, 131_072, 200_001])
def test_every_index_of_the_range(kind, span):
    # from k = 65,536 on, a block can be full and its count takes 4 bytes
    lo = 17
    indices = torch.randperm(span, generator=torch.Generator().manual_seed(span)) + lo
    round_trip(random_values(span, span, "mixed"), indices, lo, lo + span, kind)


@pytest.mark.parametrize("first_block", [32_768, 65_534, 65_535])
def test_block_counts_past_int16(first_block):
    # below k = 65,536 a block's count travels in 16 bits: counts from 32,768 on must come back unsigned
    indices = torch.cat([torch.arange(first_block), torch.tensor([131_072 + 5])][:1 + (first_block < 65_535)])
    round_trip(torch.randn(indices.numel()), indices.flip(0), 0, 200_000, "bf16")


@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("index", [0, 65_535, 65_536, 2 ** 31 - 1])
def test_a_single_entry(kind, index):
    buf = round_trip(torch.tensor([-1.5]), torch.tensor([index]), 0, 2 ** 31, kind)
    assert unpack(buf, 0, 2 ** 31)[0].item() == -1.5
    round_trip(torch.tensor([2.0]), torch.tensor([index], dtype=torch.int32), index, index + 1, kind)


@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("lo, hi", [(0, 0), (5, 5), (0, 1), (3, 200_000), (0, 2 ** 31)])
def test_empty_messages(kind, lo, hi):
    buf = round_trip(torch.zeros(0), torch.zeros(0, dtype=torch.long), lo, hi, kind)
    assert buf.numel() == 8                                 # the header alone, whatever the range


@st.composite
def messages(draw):
    """(values, indices, lo, hi, kind): a range anywhere below 2**31, up to 3 blocks long, k in [0, span]."""
    span = draw(st.one_of(st.integers(0, 3 * CODEC_BLOCK), st.sampled_from([1, CODEC_BLOCK - 1, CODEC_BLOCK])))
    lo = draw(st.one_of(st.integers(0, MAX_SPAN - span), st.sampled_from([0, MAX_SPAN - span])))
    k = draw(st.one_of(st.just(0), st.just(span), st.integers(0, min(span, 3000))))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if 4 * k < span:                                        # k distinct in [0, span) without a permutation of it
        indices = torch.randint(0, span, (2 * k,), generator=gen).unique()[:k]
        indices = indices[torch.randperm(indices.numel(), generator=gen)] + lo
    else:
        indices = torch.randperm(span, generator=gen)[:k] + lo
    if draw(st.booleans()):
        indices = indices.sort().values                     # pack's path for indices already in order
    values = random_values(k, seed, draw(st.sampled_from(FAMILIES)))
    return values[:k], indices[:values.numel()], lo, lo + span, draw(st.sampled_from(VALUE_KINDS))


@settings(SETTINGS, max_examples=150)
@given(message=messages())
def test_round_trips_over_ranges(message):
    round_trip(*message)


def test_indices_in_order_or_not_give_the_same_message():
    indices = torch.randperm(300_000, generator=torch.Generator().manual_seed(1))[:5000]
    values = torch.randn(5000)
    order = indices.argsort()
    for kind in VALUE_KINDS:
        assert torch.equal(pack(values, indices, 0, 300_000, kind), pack(values[order], indices[order], 0, 300_000,
                                                                           kind))


@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_error_feedback_is_exact_for_what_was_sent(kind, family):
    acc = random_values(20_000, FAMILIES.index(family), family)
    if family == "huge":                                    # float32's largest and its neighbours
        acc = torch.cat([acc, torch.tensor([FP32_MAX, -FP32_MAX, BF16_MAX, 3e38, 2.0 ** 127])])
    sent = sent_values(acc, kind)
    residual = acc - sent                                   # float32, as the caller keeps it
    assert torch.isfinite(sent).all() and torch.isfinite(residual).all()
    assert torch.equal(residual.double(), acc.double() - sent.double())          # the subtraction was exact
    assert torch.equal(sent.double() + residual.double(), acc.double())
    assert (sent.double() + residual.double()).sum() == acc.double().sum()
    if kind == "fp32":
        assert torch.equal(sent, acc)
    elif family != "zeros":
        assert residual.count_nonzero() > 0                 # 16 bits really dropped some


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e30, 3e38, FP32_MAX, 1e-38, 1e-44])
def test_fp16_never_overflows_and_keeps_11_bits(scale):
    acc = (torch.rand(10_000, generator=torch.Generator().manual_seed(3)) * 2 - 1) * scale
    acc[0] = scale                                          # the largest magnitude, exactly
    sent = sent_values(acc, "fp16")
    assert torch.isfinite(sent).all()
    largest = acc.abs().max().double()
    error = (sent.double() - acc.double()).abs()
    top_binade = acc.abs() >= 2.0 ** 127                    # rounded toward zero where up would overflow
    keeps = acc.abs().double() >= largest * 2.0 ** -28
    bound = acc.abs().double() * torch.where(top_binade, 2.0 ** -10, 2.0 ** -11)
    assert (error[keeps] <= bound[keeps]).all()
    assert (error[~keeps] <= largest * 2.0 ** -39).all()
    bf16_error = (sent_values(acc, "bf16").double() - acc.double()).abs()
    assert error.sum() < bf16_error.sum() / 4               # fp16 keeps 3 more bits than bf16


@pytest.mark.parametrize("family", ["normal", "huge", "mixed", "bits"])
def test_bf16_keeps_8_bits(family):
    acc = random_values(20_000, 7, family)
    acc = torch.cat([acc, torch.tensor([FP32_MAX, -FP32_MAX, 3.39e38, -3.3e38])])
    sent = sent_values(acc, "bf16")
    assert torch.isfinite(sent).all()
    normal = acc.abs() >= 2.0 ** -126
    above = acc.abs() > BF16_MAX                            # rounded toward zero, not to inf
    bound = acc.abs().double() * torch.where(above, 2.0 ** -7, 2.0 ** -8)
    error = (sent.double() - acc.double()).abs()
    assert (error[normal] <= bound[normal]).all()
    assert (error[~normal] <= 2.0 ** -134).all()            # bf16's smallest step is 2**-133
    assert (sent[above].abs() == BF16_MAX).all() and above.any()


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_non_finite_values_stay_non_finite_and_finite_ones_finite(kind):
    acc = torch.tensor([math.inf, -math.inf, math.nan, -2.5, 0.75, 1e-3])
    sent = sent_values(acc, kind)
    assert sent[0] == math.inf and sent[1] == -math.inf and math.isnan(sent[2])
    assert torch.isfinite(sent[3:]).all()
    assert sent[3:5].tolist() == [-2.5, 0.75]               # fp16's scale came from the finite values
    _, indices = unpack(pack(acc, torch.arange(6), 0, 6, kind), 0, 6)
    assert indices.tolist() == list(range(6))


@SETTINGS
@given(k=st.integers(0, 3 * CODEC_BLOCK), span=st.integers(0, MAX_SPAN), kind=st.sampled_from(VALUE_KINDS))
def test_the_size_is_the_sum_of_its_parts(k, span, kind):
    k = min(k, span)
    blocks = -(-span // CODEC_BLOCK) - 1 if k else 0
    count_bytes = 2 if k < CODEC_BLOCK else 4
    parts = [8, (CODEC_ENTRY_BYTES[kind] - 2) * k, count_bytes * blocks, 2 * k]
    size = packed_nbytes(k, span, kind)
    assert size % 4 == 0 and sum(parts) <= size <= sum(parts) + 6


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("span", [100_000, 1_000_003, 6_300_000, 25_000_000, 100_000_000, 2 ** 31])
def test_at_most_4_5_bytes_per_entry_at_ratio_0_01(kind, span):
    k = math.ceil(0.01 * span)
    assert packed_nbytes(k, span, kind) / k <= 4.5
    if span <= 6_300_000:                                   # the real buffer too
        indices = torch.arange(0, span, 100)[torch.randperm(k, generator=torch.Generator().manual_seed(span))]
        assert pack(torch.randn(k), indices, 0, span, kind).numel() / k <= 4.5
    assert packed_nbytes(1000, 100_000, kind) / 1000 <= 4.5


def test_messages_laid_end_to_end_split_by_their_headers():
    gen = torch.Generator().manual_seed(11)
    parts = [(0, 300_000, 4000, "bf16"), (10, 10, 0, "fp16"), (5, 6, 1, "fp32"), (0, 70_000, 70_000, "fp16"),
             (100, 200, 0, "bf16"), (7, 1000, 993, "fp32")]
    sent = []
    for lo, hi, k, kind in parts:
        indices = torch.randperm(hi - lo, generator=gen)[:k] + lo
        sent.append((random_values(k, k, "mixed"), indices))
    buf = torch.cat([pack(v, i, lo, hi, kind) for (v, i), (lo, hi, _, kind) in zip(sent, parts)])
    messages = split_messages(buf, [hi - lo for lo, hi, _, _ in parts])
    for message, (values, indices), (lo, hi, _, kind) in zip(messages, sent, parts):
        got_values, got_indices = unpack(message, lo, hi)
        order = indices.argsort()
        assert torch.equal(got_indices, indices[order]) and torch.equal(got_values, sent_values(values, kind)[order])
    shifted = torch.cat([torch.zeros(2, dtype=torch.uint8), buf])[2:]         # not on a 4-byte boundary
    assert torch.equal(unpack(split_messages(shifted, [hi - lo for lo, hi, _, _ in parts])[0], 0, 300_000)[1],
                       sent[0][1].sort().values)


def test_float64_values_go_unchanged_and_read_at_any_offset():
    gen = torch.Generator().manual_seed(12)
    values = torch.randn(300, generator=gen, dtype=torch.float64) * 1e200       # beyond float32's range
    indices = torch.randperm(70_000, generator=gen)[:300]
    message = pack(values, indices, 0, 70_000, "fp64")
    assert message.numel() == packed_nbytes(300, 70_000, "fp64") == 8 + 8 * 300 + 4 + 2 * 300
    assert message_nbytes(message, 70_000) == message.numel() and torch.equal(sent_values(values, "fp64"), values)
    order = indices.argsort()
    for skew in (4, 8, 12):                                   # float64 views need 8-byte alignment
        shifted = torch.cat([torch.zeros(skew, dtype=torch.uint8), message])[skew:]
        got_values, got_indices = unpack(shifted, 0, 70_000)
        assert torch.equal(got_values, values[order]) and torch.equal(got_indices, indices[order])
    with pytest.raises(ValueError, match=r"float64 for 'fp64'"):
        pack(values.float(), indices, 0, 70_000, "fp64")


@pytest.mark.parametrize("call, match", [
    (lambda: pack(torch.ones(1), torch.tensor([0]), 0, 2 ** 31 + 1), r"hi must be an integer in \[0, 2147483648\]"),
    (lambda: pack(torch.ones(1), torch.tensor([0]), 5, 4), r"hi must be an integer in \[5, 2147483648\]"),
    (lambda: pack(torch.ones(1), torch.tensor([0]), -1, 4), r"lo must be an integer in \[0, 2147483648\]"),
    (lambda: pack(torch.ones(1), torch.tensor([10]), 0, 10), r"indices must lie in \[lo, hi\) = \[0, 10\)"),
    (lambda: pack(torch.ones(1), torch.tensor([2]), 3, 10), r"indices must lie in"),
    (lambda: pack(torch.ones(3), torch.tensor([1, 1, 1]), 0, 2), r"indices must be distinct"),
    (lambda: pack(torch.ones(2), torch.tensor([1]), 0, 2), r"indices must be a 1-D integer tensor of 2 entries"),
    (lambda: pack(torch.ones(1), torch.tensor([1.0]), 0, 2), r"indices must be a 1-D integer tensor"),
    (lambda: pack(torch.ones(1, dtype=torch.float64), torch.tensor([1]), 0, 2), r"values must be a 1-D float32"),
    (lambda: pack(torch.ones(1), torch.tensor([1]), 0, 2, "int8"), r"value_kind must be one of"),
    (lambda: sent_values(torch.ones(2, 2)), r"values must be a 1-D float32"),
    (lambda: packed_nbytes(5, 4), r"k must be an integer in \[0, 4\]"),
    (lambda: packed_nbytes(0, 2 ** 31 + 1), r"span must be an integer in \[0, 2147483648\]"),
    (lambda: unpack(pack(torch.ones(1), torch.tensor([1]), 0, 2), 0, 70_000), r"buf holds 16 bytes, .* needs 20"),
    (lambda: unpack(pack(torch.ones(1), torch.tensor([1]), 0, 70_000), 0, 2), r"buf holds 20 bytes"),
    (lambda: unpack(torch.zeros(4, dtype=torch.uint8), 0, 2), r"buf must be a 1-D uint8 tensor of at least 8"),
    (lambda: unpack(torch.full((8,), 7, dtype=torch.uint8), 0, 2), r"does not start with a message header"),
    (lambda: split_messages(pack(torch.ones(1), torch.tensor([1]), 0, 2), [2, 2]), r"at least 8 bytes"),
    (lambda: split_messages(torch.zeros(12, dtype=torch.uint8), [2]), r"buf holds 12 bytes but .* end at byte 8"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(SETTINGS, max_examples=150)
@given(message=messages())
def test_cuda_packs_the_cpus_bytes_and_reads_them_alike(message):
    """On a GPU (scripts/gpu_check.sh; CI has none): ``pack`` of CUDA tensors makes the bytes the CPU
    makes, and ``unpack`` on the GPU gives what it gives on the CPU, bit for bit. The GPU takes its own
    paths (torch's sort for indices out of order, the header read back to the host), and CUDA ranks'
    error feedback is exact only if ``sent_values`` there rounds as the CPU tests above check."""
    values, indices, lo, hi, kind = message
    on_cpu = pack(values, indices, lo, hi, kind)
    on_gpu = pack(values.cuda(), indices.cuda(), lo, hi, kind)
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)
    (gpu_values, gpu_indices), (cpu_values, cpu_indices) = unpack(on_gpu, lo, hi), unpack(on_cpu, lo, hi)
    assert gpu_values.is_cuda and gpu_indices.is_cuda and torch.equal(gpu_indices.cpu(), cpu_indices)
    assert torch.equal(gpu_values.cpu().view(torch.int32), cpu_values.view(torch.int32))
    sent = sent_values(values.cuda(), kind)
    assert torch.equal(sent.cpu().view(torch.int32), sent_values(values, kind).view(torch.int32))


WIRE = job(2, "codec_wire.py", backend="gloo")
WIRE_SPANS = {(0, 0): 131_072, (1, 0): 68_931, (0, 1): 3, (1, 1): 2}     # (owner, tensor): its region's length


@pytest.mark.jobs(WIRE)
def test_messages_cross_alltoall_and_allgather_on_gloo(results):
    ranks = results(WIRE)
    assert set(ranks[0]) == {(kind, round_) for kind in VALUE_KINDS for round_ in (0, 1)}
    for (kind, round_), _ in ranks[0].items():
        for receiver, record in enumerate(r[kind, round_] for r in ranks):
            assert set(record["received"]) == set(WIRE_SPANS) and set(record["gathered"]) == {0, 1}
            for (sender, t), (values, indices) in record["received"].items():
                sent_indices, sent, original, nbytes = ranks[sender][kind, round_]["sent"][receiver, t]
                assert torch.equal(indices, sent_indices) and torch.equal(values, sent), (kind, sender, receiver, t)
                assert nbytes == packed_nbytes(sent_indices.numel(), WIRE_SPANS[receiver, t], kind)
                if sent.numel() > 100:                                  # 2 or 3 values may all be exact
                    assert torch.equal(sent, original) == (kind == "fp32"), (kind, sender, t)   # 16 bits
            for sender, (values, indices) in record["gathered"].items():
                sent_indices, sent, _ = ranks[sender][kind, round_]["gather_sent"]
                assert torch.equal(indices, sent_indices) and torch.equal(values, sent), (kind, sender, receiver)
    first = ranks[0]["bf16", 0]["received"][1, 0][1]                # rank 1's entries of rank 0's region
    assert {65_535, 65_536, 131_071} <= set(first.tolist()) and first.numel() == 350
    assert ranks[1]["bf16", 1]["received"][0, 0][1].numel() == 0   # the empty message of round 1
    assert ranks[0]["fp16", 1]["gathered"][1][1].numel() == 0      # and of the allgather
    assert ranks[1]["fp16", 0]["received"][1, 1][1].tolist() == [3, 4]    # k = span of the small tensor
