"""The ``Transport`` protocol's invariants (hvd_topk/transports/base.py), checked for every transport on
real ranks (tests/workers/transports.py): aggregates identical bit for bit on every rank and equal to
the average of what left the ranks; None everywhere when one rank was non-finite; error feedback exact
in float64 per rank and, with 16-bit values, over the ranks; ``nbytes`` within each transport's bound;
``forget()`` leaves a working transport; a fused bucket gives the per-tensor sends' aggregate."""
import pytest
import torch

from conftest import job
from hvd_topk.core.wire import CODEC_ENTRY_BYTES, CODEC_HEADER_BYTES, FRAME_BYTES

VARIANTS = ("dense", "dense-fp16", "artopk", "allgather", "split_reduce", "allgather-bf16", "split_reduce-bf16",
            "split_reduce-fp16", "allgather-fused", "split_reduce-fused", "split_reduce-fused-fp32")
CODED = {"dense-fp16": "fp16", "allgather-bf16": "bf16", "split_reduce-bf16": "bf16", "split_reduce-fp16": "fp16",
         "allgather-fused": "bf16", "split_reduce-fused": "bf16"}
NAN_STEP = 3
# Gloo's data path as horovodrun launches it, and 3 ranks (frames per owner) under mpirun in the fast
# loop, under both in the full suite: a launch of Gloo's 3 ranks costs the fast loop 12 s of its 5 min
LAUNCHES = [pytest.param(job(np, "transports.py", "--nan-step", NAN_STEP, backend=backend), id=f"{np}-{backend}",
                         marks=[pytest.mark.slow] if (np, backend) == (3, "gloo") else [])
            for np, backend in [(2, "gloo"), (3, "mpi"), (3, "gloo")]]


def summed_to(variant, records):
    """The tolerance of the aggregate against the average of what left the ranks: float32's sums, or
    dense-fp16's on more than 2 ranks, whose shard sums go back to fp16 (2**-11 of the largest value)."""
    if variant != "dense-fp16" or len(records) <= 2:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=0, atol=2 ** -10 * max(float(r["sent"].abs().max()) for r in records))


def max_nbytes(variant, n, k, ranks):
    """What ``start`` may hand the collectives: float32 values, or codec messages in frames (one per owner
    from 3 ranks on, each with its header and two sections padded to 4 bytes)."""
    if variant in ("dense", "dense-fp16", "artopk"):                # artopk: k values + the finite flag
        return {"dense": 4 * n, "dense-fp16": 2 * n, "artopk": 4 * (k + 1)}[variant]
    messages = ranks if variant.startswith("split_reduce") and ranks > 2 else 1
    return messages * (FRAME_BYTES + CODEC_HEADER_BYTES + 4 + 4) + k * CODEC_ENTRY_BYTES[CODED.get(variant, "fp32")]


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_transport_contract(results, launch, variant):
    np = launch.np
    ranks = [r[variant] for r in results(launch)]
    for records in zip(*ranks):                          # one (step, key) across the ranks
        step, key = records[0]["step"], records[0]["key"]
        aggregates = [r["aggregate"] for r in records]
        if step == NAN_STEP and key == "a":
            assert all(a is None for a in aggregates), (variant, step, key)
            continue
        assert all(a is not None and torch.equal(a, aggregates[0]) for a in aggregates), (variant, step, key)
        average_sent = sum(r["sent"] for r in records) / np
        torch.testing.assert_close(aggregates[0].double(), average_sent, **summed_to(variant, records))
        n, k = records[0]["acc"].numel(), records[0]["k"]
        assert all(0 < r["nbytes"] <= max_nbytes(variant, n, k, np) for r in records), (variant, step)
        if not variant.startswith("dense"):
            assert all(r["sent_count"] <= k for r in records), (variant, step, key)
    for rank in ranks:                                   # Σ sent + residual = Σ grad, committed steps
        for key in ("a", "b"):
            mine = [r for r in rank if r["key"] == key and not (r["step"] == NAN_STEP and key == "a")]
            total_sent = sum(r["sent"] for r in mine)
            torch.testing.assert_close(total_sent + mine[-1]["residual"], sum(r["grad"] for r in mine),
                                       rtol=0, atol=1e-5)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("variant", sorted(CODED))
def test_16_bit_values_keep_their_rounding_in_the_residuals(results, launch, variant):
    """In float64, every step: the ranks' accumulators = their new residuals + the summed aggregate, to
    float32's rounding of the sums (1e-6 of the largest |acc|). Had the rounding of the 16-bit values
    (2**-9 relative for bf16) been dropped instead of kept, this would miss by about 1e-3. dense-fp16's
    sums are Horovod's, in fp16: there what left each rank must be fp16 values, which a flushed
    residual (what left = the accumulator) would not be; on 2 ranks its sums are float32's."""
    np = launch.np
    ranks = [r[variant] for r in results(launch)]
    coded = 0
    for records in zip(*ranks):
        if records[0]["aggregate"] is None:
            continue
        accs = sum(r["acc"] for r in records)
        kept = sum(r["residual"] for r in records) + records[0]["aggregate"].double() * np
        scale = max(float(r["acc"].abs().max()) for r in records)
        fp16_sums = np * summed_to(variant, records)["atol"] if variant == "dense-fp16" and np > 2 else 0.0
        torch.testing.assert_close(kept, accs, rtol=0, atol=max(1e-6 * scale, fp16_sums))
        if variant == "dense-fp16":
            assert all(torch.equal(r["sent"], r["sent"].half().double()) for r in records)
        for r in records:                                # what left is not the accumulator: it was coded
            left = r["sent"] != 0
            coded += int((r["sent"][left] != r["acc"][left]).sum())
    assert coded > 0


@pytest.mark.parametrize("launch", LAUNCHES)
def test_dense_fp16_clamps_what_the_ranks_sum_could_overflow(results, launch):
    """Each rank's entry of 2e4 at step 0: 2 or 3 of them would sum past fp16's 65504 to inf. Each rank
    sends 16384 (the largest power of two under 65504 / ranks), the aggregate is finite, the excess
    waits in the residual and leaves at step 1 (where the gradient there is 0)."""
    for rank in results(launch):
        b = [r for r in rank["dense-fp16"] if r["key"] == "b"]
        assert b[0]["aggregate"] is not None and float(b[0]["aggregate"][7]) == 16384.0
        assert float(b[0]["sent"][7]) == 16384.0 and float(b[0]["residual"][7]) == 2e4 - 16384
        assert float(b[1]["sent"][7]) == 2e4 - 16384 and float(b[1]["residual"][7]) == 0.0


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("fused, alone", [("split_reduce-fused-fp32", "split_reduce"),
                                          ("allgather-fused", "allgather-bf16")])
def test_a_fused_bucket_gives_the_per_tensor_aggregate(results, launch, fused, alone):
    """The two keys in one bucket (one collective per phase) against each alone, on the same gradients
    (the worker seeds per transport and values): with fp32 values split_reduce's sums are the same, in
    the same order, bit for bit, step after step; so are allgather's in bf16."""
    for rank in results(launch):
        assert len(rank[fused]) == len(rank[alone]) > 0
        for together, apart in zip(rank[fused], rank[alone]):
            assert together["step"] == apart["step"] and together["key"] == apart["key"]
            torch.testing.assert_close(together["acc"], apart["acc"], rtol=0, atol=0, equal_nan=True)
            assert (together["aggregate"] is None) == (apart["aggregate"] is None)
            if apart["aggregate"] is not None:
                assert torch.equal(together["aggregate"], apart["aggregate"])
                assert torch.equal(together["residual"], apart["residual"])


@pytest.mark.parametrize("launch", LAUNCHES)
def test_waiting_ranks_sleep_instead_of_spinning(results, launch):
    # The ranks that wait a second for the last one spend a small part of it on the CPU; Horovod's own
    # synchronize() (HVD_TOPK_SPIN_WAIT=1) would spend all of it, starving ranks that share the cores.
    waits = [r["late_wait"] for r in results(launch)][:-1]
    for wall, cpu in waits:
        assert wall > 0.5 and cpu < 0.2 * wall, waits


def test_shared_cores_setting_reads_0_1_or_nothing(monkeypatch):
    """HVD_TOPK_SHARED_CORES: '1' or '0' decides whether ranks share cores (hosts that share a machine's
    cores, which Horovod counts apart); unset or empty leaves it to the rule; anything else names it."""
    from hvd_topk.transports import collectives
    assert [collectives.shared_cores_setting(t) for t in ("1", "0", "", None)] == [True, False, None, None]
    for bad in ("yes", "2", " 1", "true"):
        with pytest.raises(ValueError, match=r"HVD_TOPK_SHARED_CORES must be '0' or '1' \(unset: ranks per host"):
            collectives.shared_cores_setting(bad)
    for forced in (True, False):
        monkeypatch.setattr(collectives, "_SHARED_CORES", forced)
        assert collectives.ranks_share_cores() is forced
