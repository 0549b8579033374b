"""The low-rank (PowerSGD) transport, hvd_topk/transports/lowrank.py, and its math, hvd_topk/core/lowrank.py.

On real ranks (tests/workers/lowrank.py, 2 and 3 ranks): the aggregates and residuals of consecutive
steps against a float64 PowerSGD written here from the paper and torch's hook (QR for the
orthogonalization, the seed rule restated), identical on every rank; error feedback exact over the
ranks; conv weights as out x in*kh*kw; the twofold rule and 1-D tensors dense; a non-finite step
skipped everywhere with Q and residuals kept; a state_dict round trip bit for bit; one allreduce per
phase and dtype; a process set; start and finish orders that differ per rank; the sums through 2
emulated hosts of 2 ranks (4 ranks, their host and cross process sets), as the flat transport's. In one process (world
size 1): the pure functions and the argument checks.
"""
import math
import time
import zlib

import pytest
import torch

from conftest import job
from hvd_topk.core.lowrank import compressed_rank, matrix_shape, next_warm_start, orthogonalize
from hvd_topk.transports.collectives import Collectives
from hvd_topk.transports.lowrank import LowRank

# as tests/workers/lowrank.py runs them
SHAPES = {"conv": (6, 3, 3, 3), "fc": (20, 12), "bias": (20,), "thin": (3, 40)}
RANK, SEED, STEPS, NAN_STEP, SAVE_AT, JUMP_STEP = 2, 7, 5, 3, 1, 3
COMPRESSED, DENSE = ("conv", "fc"), ("bias", "thin")
JOBS = {2: job(2, "lowrank.py"), 3: job(3, "lowrank.py", "--set", "0,2")}
HOSTS = job(4, "lowrank.py", "--hosts", 2)         # 2 emulated hosts of 2 ranks: their process sets


def by_step(records, key):
    return [r for r in records if r["key"] == key]


def reference_orthogonalize(a):
    """Orthonormal columns spanning a's leading columns: QR, signs as Gram-Schmidt gives them."""
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))


def reference_powersgd(grads, shape, key, average, skipped=()):
    """PowerSGD in float64 (Vogels et al. Algorithm 1 with torch's hook's warm start and error feedback):
    grads[step][rank] flat. Per step: (aggregate, every rank's residual, the Q kept), or None if skipped."""
    ranks, (n, m) = len(grads[0]), (shape[0], math.prod(shape[1:]))
    gen = torch.Generator().manual_seed((SEED << 32) ^ zlib.crc32(key.encode()))
    q = torch.randn(m, RANK, generator=gen, dtype=torch.float64)
    residuals = [torch.zeros(n, m, dtype=torch.float64) for _ in range(ranks)]
    out = []
    for step, per_rank in enumerate(grads):
        if step in skipped:
            out.append(None)
            continue
        ms = [g.double().reshape(n, m) + e for g, e in zip(per_rank, residuals)]
        q = reference_orthogonalize(q)
        p = reference_orthogonalize(sum(mi @ q for mi in ms))
        q_sum = sum(mi.T @ p for mi in ms)
        q = q_sum / ranks
        mean = p @ q.T
        residuals = [mi - mean for mi in ms]
        out.append((mean if average else p @ q_sum.T, residuals, q))
    return out


def ranks_of(results_, scenario):
    """Each taking rank's records of ``scenario``."""
    return [r[scenario]["records"] for r in results_ if r.get(scenario) is not None]


def check_against_reference(ranks, average, skipped=None, atol=1e-10):
    """Every compressed key's aggregate, residuals and Q, step by step, as the reference's; dense keys
    the exact sum or mean. ``skipped``: key -> the steps its reference skips. Returns how many
    (step, key) were compared."""
    compared = 0
    for key in SHAPES:
        per_rank = [by_step(records, key) for records in ranks]
        steps = list(zip(*per_rank))
        if key in DENSE:
            for records in steps:
                if records[0]["aggregate"] is None:
                    continue
                total = sum(r["grad"].double() for r in records) / (len(ranks) if average else 1)
                torch.testing.assert_close(records[0]["aggregate"].double(), total, rtol=0, atol=atol)
                assert all(r["residual"] is None for r in records), key      # flushed
                compared += 1
            continue
        expected = reference_powersgd([[r["grad"] for r in records] for records in steps], SHAPES[key], key,
                                      average, (skipped or {}).get(key, ()))
        for records, ref in zip(steps, expected):
            if ref is None:
                continue
            aggregate, residuals, q = ref
            torch.testing.assert_close(records[0]["aggregate"].double(), aggregate.reshape(-1), rtol=0, atol=atol)
            for r, e in zip(records, residuals):
                torch.testing.assert_close(r["residual"].double(), e.reshape(-1), rtol=0, atol=atol)
            torch.testing.assert_close(records[0]["q_after"].double(), q, rtol=0, atol=atol)
            compared += 1
    return compared


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
def test_consecutive_steps_match_a_float64_reference(results, np):
    res = results(JOBS[np])
    assert check_against_reference(ranks_of(res, "main"), True, skipped={"fc": (NAN_STEP,)}) == 4 * STEPS - 2
    assert check_against_reference(ranks_of(res, "sum"), False) == 4 * 2
    assert check_against_reference(ranks_of(res, "mixed"), True, atol=1e-5) == 4 * 2


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
@pytest.mark.parametrize("scenario", ("main", "sum", "mixed", "wire16"))
def test_identical_everywhere_and_error_feedback_exact(results, np, scenario):
    """Σ_ranks new residual + summed aggregate = Σ_ranks acc in float64, every compressed step (with
    16-bit P's and Q's too: the residuals are taken from the decoded sums); the aggregate identical bit
    for bit on every rank."""
    ranks = ranks_of(results(JOBS[np]), scenario)
    for records in zip(*ranks):
        aggregates = [r["aggregate"] for r in records]
        if aggregates[0] is None:
            assert all(a is None for a in aggregates)
            continue
        assert all(torch.equal(a, aggregates[0]) for a in aggregates), (records[0]["step"], records[0]["key"])
        summed = aggregates[0].double() * (np if scenario != "sum" else 1)
        residuals = sum(torch.zeros_like(summed) if r["residual"] is None else r["residual"].double()
                        for r in records)
        total = sum(r["acc"].double() for r in records)
        atol = 1e-12 if records[0]["acc"].dtype == torch.float64 else 1e-5 * max(1.0, float(total.abs().max()))
        torch.testing.assert_close(residuals + summed, total, rtol=0, atol=atol)


@pytest.mark.jobs(JOBS[2])
def test_conv_view_twofold_rule_and_bytes(results):
    """conv: 6 x 27 at rank 2; fc: 20 x 12; the bias (1-D) and thin (3 x 40: 2 x 43 x 2 >= 120) go
    dense. nbytes: r(n + m) values + a flag, or everything + a flag."""
    records = results(JOBS[2])[0]["main"]["records"]
    first = {r["key"]: r for r in records if r["step"] == 0}
    assert first["conv"]["q_after"].shape == (27, RANK) and first["fc"]["q_after"].shape == (12, RANK)
    assert first["bias"]["q_after"] is None and first["thin"]["q_after"] is None
    assert first["bias"]["residual"] is None and first["thin"]["residual"] is None
    expected = {"conv": RANK * (6 + 27) + 1, "fc": RANK * (20 + 12) + 1, "bias": 20 + 1, "thin": 120 + 1}
    assert {key: r["nbytes"] // 8 for key, r in first.items()} == expected
    assert 0 < first["conv"]["sent_sq"] < float(first["conv"]["acc"].square().sum())


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
def test_one_allreduce_per_phase_and_dtype(results, np):
    res = results(JOBS[np])[0]
    p_numel = RANK * 6 + RANK * 20 + 20 + 120 + 4               # the P's, the dense keys, 4 flags
    q_numel = RANK * 27 + RANK * 12
    assert res["main"]["launches"][0] == [("lowrank.main.P.float64", p_numel), ("lowrank.main.Q.float64", q_numel)]
    assert [name for name, _ in res["mixed"]["launches"][0]] == \
        ["lowrank.mixed.P.float32", "lowrank.mixed.P.float64", "lowrank.mixed.Q.float32", "lowrank.mixed.Q.float64"]


def exchanged(label, np):
    """The collectives that sum a float16 buffer on ``np`` ranks (``lowrank_wire.sum_by_exchange``): one
    allgather on 2 ranks; on more, the shards' alltoall, then their sums' allgather."""
    return [label] if np == 2 else [f"{label}.scatter", f"{label}.gather"]


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
def test_16_bit_wire_halves_the_bytes_and_resends_an_overflow(results, np):
    """float32 keys, values='fp16' beside 'fp32' (the default) on the same data: step 0 (no last sums) goes in float32;
    from step 1 the P's and Q's go in float16 (dense keys in float32), at 2 bytes a value, and the
    aggregates stay within 1% of the float32 wire's. At JUMP_STEP fc's gradient is 1e6 times larger: its
    float16 sums overflow, are summed again in float32, and no step is skipped."""
    res = results(JOBS[np])[0]
    names = [[name for name, _ in launched] for launched in res["wire16"]["launches"]]
    p16, q16 = (exchanged(f"lowrank.wire16.{phase}.float16", np) for phase in "PQ")
    assert names[0] == ["lowrank.wire16.P.float32", "lowrank.wire16.Q.float32"]
    assert names[1] == ["lowrank.wire16.P.float32"] + p16 + q16
    assert names[JUMP_STEP] == ["lowrank.wire16.P.float32"] + p16 + ["lowrank.wire16.P.resend.float32"] + q16 + \
        ["lowrank.wire16.Q.resend.float32"]
    assert all(n == names[1] for i, n in enumerate(names[1:], 1) if i != JUMP_STEP)
    assert [name for launched in res["wire32"]["launches"] for name, _ in launched] == \
        ["lowrank.wire32.P.float32", "lowrank.wire32.Q.float32"] * STEPS
    conv = by_step(res["wire16"]["records"], "conv")
    assert conv[0]["nbytes"] == 4 * (RANK * (6 + 27) + 1) and conv[1]["nbytes"] == 2 * (RANK * (6 + 27) + 1)
    for r16, r32 in zip(res["wire16"]["records"], res["wire32"]["records"]):
        assert r16["aggregate"] is not None and bool(torch.isfinite(r16["aggregate"]).all()), r16["step"]
        if r16["key"] in DENSE:
            assert torch.equal(r16["aggregate"], r32["aggregate"])
        else:
            gap = (r16["aggregate"] - r32["aggregate"]).norm() / r32["aggregate"].norm()
            assert gap < 1e-2, (r16["step"], r16["key"], float(gap))


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
def test_non_finite_step_skipped_everywhere_with_state_kept(results, np):
    """Rank 1's NaN in fc and bias at NAN_STEP: None on every rank, fc's Q and every residual kept;
    conv and thin went on; the next step is the reference's (checked above)."""
    for records in ranks_of(results(JOBS[np]), "main"):
        for key in SHAPES:
            steps = by_step(records, key)
            skipped = steps[NAN_STEP]
            assert (skipped["aggregate"] is None) == (key in ("fc", "bias")), key
            if skipped["aggregate"] is None:
                assert torch.equal(skipped["kept"], steps[NAN_STEP - 1]["kept"]), key
        fc = by_step(records, "fc")[NAN_STEP]
        assert fc["q_before"] is not None and torch.equal(fc["q_after"], fc["q_before"])


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
def test_state_dict_round_trip_continues_bit_for_bit(results, np):
    res = results(JOBS[np])
    for r in res:
        for straight, resumed in zip(r["main"]["records"], r["resume"]["records"]):
            if straight["step"] <= SAVE_AT:
                continue
            for field in ("aggregate", "residual", "kept", "q_after"):
                a, b = straight[field], resumed[field]
                assert (a is None and b is None) or torch.equal(a, b), (straight["step"], straight["key"], field)


@pytest.mark.jobs(JOBS[3])
def test_within_a_process_set(results):
    res = results(JOBS[3])
    assert res[1]["set"] is None
    ranks = ranks_of(res, "set")
    assert len(ranks) == 2 and res[0]["set"]["ranks"] == [0, 2]
    assert check_against_reference(ranks, True) == 4 * 2


@pytest.mark.slow
@pytest.mark.jobs(HOSTS)
def test_through_the_hosts_as_the_flat_transport(results):
    """'hierarchical': each phase reduce-scattered inside the host, each shard allreduced across the
    hosts, allgathered inside the host. The same PowerSGD as flat (float64: the sums' order only),
    identical bit for bit on every rank, error feedback exact, the NaN step skipped everywhere; only a
    shard of each phase crosses between the hosts."""
    res = results(HOSTS)
    hosts, flat = ranks_of(res, "hosts"), ranks_of(res, "flat")
    assert len(hosts) == 4
    assert check_against_reference(hosts, True, skipped={"fc": (NAN_STEP,)}) == 4 * STEPS - 2
    for by_hosts, by_flat in zip(zip(*hosts), zip(*flat)):
        for h, f in zip(by_hosts, by_flat):
            if f["aggregate"] is None:
                assert h["aggregate"] is None
                continue
            assert torch.equal(h["aggregate"], by_hosts[0]["aggregate"])
            torch.testing.assert_close(h["aggregate"], f["aggregate"], rtol=0, atol=1e-12)
            if f["residual"] is not None:
                torch.testing.assert_close(h["residual"], f["residual"], rtol=0, atol=1e-12)
    launches = res[0]["hosts"]["launches"][0]
    p_numel = RANK * 6 + RANK * 20 + 20 + 120 + 4
    assert launches[:3] == [("lowrank.hosts.P.float64.scatter", p_numel + p_numel % 2),
                            ("lowrank.hosts.P.float64.cross", -(-p_numel // 2)),
                            ("lowrank.hosts.P.float64.gather", -(-p_numel // 2))]
    assert [name for name, _ in launches[3:]] == [f"lowrank.hosts.Q.float64.{phase}" for phase in
                                                 ("scatter", "cross", "gather")]


@pytest.mark.slow
@pytest.mark.jobs(HOSTS)
def test_16_bit_wire_through_the_hosts(results):
    """values='fp16' through the hosts: each float16 phase summed by exchange (the host's alltoall, the
    cross allgather of the host's float32 sums in float16, the host's allgather), identical bit for bit on every rank, error
    feedback exact, within 1% of the flat float32 wire's aggregates, fc's overflow at JUMP_STEP summed
    again in float32 through the hosts, no step skipped."""
    res = results(HOSTS)
    ranks = ranks_of(res, "wire16_hosts")
    for records, flat32 in zip(zip(*ranks), res[0]["wire32"]["records"]):
        aggregates = [r["aggregate"] for r in records]
        assert aggregates[0] is not None and all(torch.equal(a, aggregates[0]) for a in aggregates)
        residuals = sum(torch.zeros_like(aggregates[0], dtype=torch.float64) if r["residual"] is None
                        else r["residual"].double() for r in records)
        total = sum(r["acc"].double() for r in records)
        torch.testing.assert_close(residuals + 4 * aggregates[0].double(), total, rtol=0,
                                   atol=1e-5 * max(1.0, float(total.abs().max())))
        gap = (aggregates[0] - flat32["aggregate"]).norm() / flat32["aggregate"].norm()
        assert gap < 1e-2, (records[0]["step"], records[0]["key"], float(gap))
    names = [[name for name, _ in launched] for launched in res[0]["wire16_hosts"]["launches"]]

    def through(label, *dtypes):                # each step started for every dtype before the next step
        return [f"lowrank.wire16_hosts.{label}.{dtype}.{step}" for step in ("scatter", "cross", "gather")
                for dtype in dtypes]
    assert names[1] == through("P", "float16", "float32") + through("Q", "float16")
    assert names[JUMP_STEP] == through("P", "float16", "float32") + through("P.resend", "float32") + \
        through("Q", "float16") + through("Q.resend", "float32")


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
def test_orders_differ_between_ranks_and_nothing_hangs(results, np):
    """The job ended (no rank waited forever) although every rank started and finished the keys in
    its own order."""
    res = results(JOBS[np])
    starts = {tuple(r["orders"][0][0]) for r in res}
    finishes = {tuple(order[1]) for r in res for order in r["orders"]}
    assert len(starts) == np and len(finishes) > np


# -- one process -----------------------------------------------------------------------------------

def test_matrix_view_and_the_twofold_rule():
    assert matrix_shape((8, 3, 3, 3)) == (8, 27) and matrix_shape((5, 7)) == (5, 7)
    assert matrix_shape((9,)) is None and matrix_shape(()) is None
    assert compressed_rank((8, 8), 2) == 0                     # 2 x 16 x 2 = 64, not below 64
    assert compressed_rank((9, 8), 2) == 2                     # 68 < 72
    assert compressed_rank((100, 200), 33) == 33 and compressed_rank((100, 200), 34) == 0
    assert compressed_rank((100, 200), 34, min_compression_rate=1) == 34
    assert compressed_rank((1000,), 1) == 0


def test_orthogonalize_as_gram_schmidt():
    a = torch.randn(30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q = orthogonalize(a)
    torch.testing.assert_close(q.T @ q, torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(q, reference_orthogonalize(a))
    assert torch.equal(a, torch.randn(30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    zero = orthogonalize(torch.zeros(5, 2))                    # no 0/0: a zero gradient sends zeros
    assert torch.equal(zero, torch.zeros(5, 2))
    shrunk = orthogonalize(a, epsilon=1.0)
    assert float(shrunk[:, 0].norm()) < 1.0


def test_zero_gradient_keeps_the_warm_start(hvd):
    q = torch.randn(12, 2)
    assert torch.equal(next_warm_start(q, torch.zeros(12, 2)), q)
    new = torch.ones(12, 2)
    assert torch.equal(next_warm_start(q, new), new)
    half = torch.cat([torch.ones(12, 1), torch.zeros(12, 1)], 1)        # a zero column: that one kept
    assert torch.equal(next_warm_start(q, half), torch.cat([torch.ones(12, 1), q[:, 1:]], 1))
    lowrank = LowRank(Collectives("lowrank.zero"), True, rank=2, shapes={"w": (20, 12)})
    lowrank.start("w", torch.randn(240), None, True).finish()
    before = lowrank.state_dict()["q"]["w"]
    out = lowrank.start("w", torch.zeros(240), None, True).finish()
    assert torch.equal(out.aggregate, torch.zeros(240)) and torch.equal(lowrank.state_dict()["q"]["w"], before)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_a_gradient_of_rank_below_r_is_sent_once(hvd, dtype):
    """Equal rows (a rank-1 gradient, as a batch of one gives): P's second column is rounding only, in
    the span of the first; it becomes zero instead of a normalised copy of the first, which sent M twice."""
    gen = torch.Generator().manual_seed(3)
    rank1 = torch.ones(40, 1, dtype=dtype) @ torch.randn(1, 12, generator=gen, dtype=dtype)
    rank2 = torch.randn(40, 2, generator=gen, dtype=dtype) @ torch.randn(2, 12, generator=gen, dtype=dtype)
    p = orthogonalize(rank1 @ torch.randn(12, 3, generator=gen, dtype=dtype))
    assert torch.equal(p[:, 1:], torch.zeros(40, 2, dtype=dtype))
    lowrank = LowRank(Collectives(f"lowrank.deficient.{dtype}"), True, rank=3, shapes={"a": (40, 12), "b": (40, 12)})
    for _ in range(2):
        started = [lowrank.start(key, m.reshape(-1).clone(), None, True) for key, m in (("a", rank1), ("b", rank2))]
        for st, m in zip(started, (rank1, rank2)):
            out = st.finish()
            atol = 1e-4 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(out.aggregate, m.reshape(-1), rtol=0, atol=atol)
    assert bool((lowrank.q["a"] != 0).any(dim=0).all())        # no zero column carried to the next step


def test_one_rank_k_numel_forget_and_shapes(hvd):
    lowrank = LowRank(Collectives("lowrank.one"), False, rank=2, shapes={"w": (20, 12)})
    acc = torch.randn(240, dtype=torch.float64)
    out = lowrank.start("w", acc, 240, True).finish()           # k = numel: sent whole
    assert torch.equal(out.aggregate, acc) and out.residual is None and "w" not in lowrank.q
    out = lowrank.start("w", acc, None, True).finish()
    torch.testing.assert_close(out.aggregate + out.residual, acc, rtol=0, atol=1e-12)
    assert lowrank.q["w"].shape == (12, 2)
    lowrank.forget()
    assert lowrank.q == {} and lowrank.inflight == {}
    g = torch.randn(20, 12, dtype=torch.float64)                # no shape given: grad's
    out = lowrank.start("v", g.reshape(-1), None, True, grad=g).finish()
    assert lowrank.q["v"].shape == (12, 2) and out.residual is not None
    out = lowrank.start("u", g.reshape(-1), None, True).finish()  # no shape at all: dense
    assert torch.equal(out.aggregate, g.reshape(-1)) and out.residual is None


def test_bad_arguments_name_the_parameter(hvd):
    collectives = Collectives("lowrank.bad")
    for kwargs, name in (({"rank": 0}, "rank"), ({"epsilon": -1.0}, "epsilon"),
                         ({"min_compression_rate": 0}, "min_compression_rate"), ({"seed": -1}, "seed")):
        with pytest.raises(ValueError, match=name):
            LowRank(collectives, True, **kwargs)
    saved = LowRank(collectives, True, rank=2).state_dict()
    with pytest.raises(ValueError, match="rank must be the saved state's 2"):
        LowRank(collectives, True, rank=4).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"shapes\['w'\] must hold the accumulator's 6 elements, got \(2, 2\)"):
        LowRank(collectives, True, shapes={"w": (2, 2)}).start("w", torch.randn(6), None, True)
    lowrank = LowRank(collectives, True, rank=2)
    lowrank.start("w", torch.randn(5), None, True)
    with pytest.raises(RuntimeError, match="started twice"):
        lowrank.start("w", torch.randn(5), None, True)


def test_float16_accumulators_get_float16_sums(hvd):
    """A float16 accumulator's P goes in its own dtype, summed by exchange (in float32): its sums come
    back in float16, so the power iteration's products have one dtype (one rank: the sum is its own)."""
    lowrank = LowRank(Collectives("lowrank.half.group"), True, rank=2, shapes={"w": (16, 8)}, name="lowrank.half")
    acc = torch.randn(128, generator=torch.Generator().manual_seed(0)).half()
    out = lowrank.start("w", acc, None, True).finish()
    assert out.aggregate.dtype == torch.float16 and out.residual.dtype == torch.float16
    torch.testing.assert_close(out.aggregate + out.residual, acc, rtol=0, atol=2e-3)


def test_drain_runs_the_sums_early_with_the_same_outcomes(hvd):
    """``drain`` (the stock door's, after the backward pass, where ranks share cores) runs phases a-b before the
    first finish; the outcomes are those of a step without it, bit for bit, also for a key started
    after the drain began, a dense key and a finish in another order. (The 3-rank PowerSGD jobs in
    tests/test_powersgd.py drain on a machine whose ranks share cores, as CI's 2 cores do.)"""
    gen = torch.Generator().manual_seed(5)
    accs = {key: torch.randn(n, generator=gen) for key, n in (("a", 240), ("b", 96), ("c", 7))}
    shapes = {"a": (20, 12), "b": (12, 8)}

    def step(lowrank, drain_after):
        started = {}
        for key in ("a", "b", "c"):
            started[key] = lowrank.start(key, accs[key].clone(), None, True)
            if key == drain_after:
                lowrank.drain(time.monotonic() + 5.0)
                assert lowrank.running is not None and lowrank.running.done
        return {key: started[key].finish() for key in ("c", "b", "a")}

    plain = LowRank(Collectives("lowrank.plain"), True, rank=2, shapes=shapes, name="lowrank.plain")
    drained = LowRank(Collectives("lowrank.drained"), True, rank=2, shapes=shapes, name="lowrank.drained")
    for drain_after in ("c", "b"):                  # all keys in; then "c" started after the drain
        want, got = step(plain, None), step(drained, drain_after)
        for key in accs:
            assert (want[key].residual is None) == (got[key].residual is None) == (key == "c"), key
            assert torch.equal(got[key].aggregate, want[key].aggregate), key
            if key != "c":
                assert torch.equal(got[key].residual, want[key].residual), key
        assert drained.running is None and not drained.inflight and not drained.outcomes
    assert all(torch.equal(drained.q[key], plain.q[key]) for key in plain.q)
