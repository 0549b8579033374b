"""Property tests of the fast exact Top-K selection (hvd_topk.core.sparsify.topk_indices) against torch.topk."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_topk.core import sparsify
from hvd_topk.core.sparsify import topk_indices

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
KINDS = ["normal", "cauchy", "few_values", "zeros", "outlier", "denormal", "negative", "sparse",
         "non_finite"]
# (the threads fixture sets torch's threads once for all of a test's examples, as it should)
SETTINGS = settings(max_examples=600, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Large enough for the sampled path with its real constants, over several pass steps and a partial one.
LARGE = sparsify._CPU_CHUNK * 2 + 12345
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's CPU threads during the test: the selection's pass runs in numpy at one, in torch above."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def make_input(kind, n, dtype, seed):
    """A 1-D tensor of n elements drawn from the named distribution, reproducible from seed."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == "normal":
        x = normal
    elif kind == "cauchy":
        # Heavy tails: a few huge magnitudes next to many tiny ones.
        x = normal / torch.randn(n, generator=gen, dtype=torch.float64)
    elif kind == "few_values":
        # Many exact ties, signs mixed: the k-th magnitude is almost always tied.
        x = torch.randint(-3, 4, (n,), generator=gen).to(torch.float64)
    elif kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
        x[torch.rand(n, generator=gen) < 0.5] = -0.0
    elif kind == "outlier":
        x = normal * 1e-3
        x[torch.randint(n, (1,), generator=gen)] = -1e4
    elif kind == "denormal":
        # Subnormal magnitudes of the target dtype: they must order exactly, not flush to zero.
        x = torch.rand(n, generator=gen, dtype=torch.float64) * torch.finfo(dtype).tiny
        x[torch.rand(n, generator=gen) < 0.5] *= -1
    elif kind == "negative":
        x = -normal.abs()
    elif kind == "sparse":
        # Mostly exact zeros, as in an embedding gradient: k often reaches into the zeros.
        x = normal * (torch.rand(n, generator=gen) < 0.05)
    elif kind == "non_finite":
        x = normal
        x[torch.rand(n, generator=gen) < 0.02] = float("nan")
        x[torch.rand(n, generator=gen) < 0.02] = float("inf")
        x[torch.rand(n, generator=gen) < 0.02] = float("-inf")
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return x.to(dtype)


def descending_magnitudes(x):
    """|x| exactly (in float64) sorted largest first, NaN first (torch.sort orders NaN above all numbers)."""
    return x.abs().double().sort(descending=True, stable=True).values


def check_topk(x, k, idx):
    """idx is a valid top-k selection of x: the index set of torch.topk when the k-th magnitude is not tied."""
    n = x.numel()
    assert idx.dtype == torch.int64
    assert idx.device == x.device
    assert idx.shape == (k,)
    idx_cpu, x_cpu = idx.cpu(), x.cpu()
    assert int(idx_cpu.min()) >= 0 and int(idx_cpu.max()) < n
    assert idx_cpu.unique().numel() == k, "indices are not distinct"
    want = descending_magnitudes(x_cpu)
    got = descending_magnitudes(x_cpu[idx_cpu])
    torch.testing.assert_close(got, want[:k], rtol=0, atol=0, equal_nan=True)
    boundary_tied = k < n and (want[k - 1] == want[k] or bool(want[k - 1].isnan() & want[k].isnan()))
    if not boundary_tied:
        ref = torch.topk(x_cpu.abs(), k).indices
        assert torch.equal(idx_cpu.sort().values, ref.sort().values)


@st.composite
def cases(draw, max_n=3000):
    """(x, k): a random input of a random kind, size and dtype, and a k in [1, n]."""
    n = draw(st.integers(1, max_n))
    k = draw(st.one_of(st.just(1), st.just(n), st.integers(1, n)))
    x = make_input(draw(st.sampled_from(KINDS)), n, draw(st.sampled_from(DTYPES)),
                   draw(st.integers(0, 2**31 - 1)))
    return x, k


@SETTINGS
@given(case=cases())
def test_public_selection_matches_torch_topk(case):
    x, k = case
    check_topk(x, k, topk_indices(x, k))


@SETTINGS
@given(case=cases(), sample_size=st.sampled_from([1, 7, 64, 1000]),
       chunk=st.sampled_from([8, 24, 64, 1000, 4096]))
def test_threshold_path_matches_torch_topk_at_any_size(threads, case, sample_size, chunk):
    # Small samples and steps drive the sampled path through every branch (retries, fallback,
    # ties across steps, partial last step) on inputs small enough for many examples.
    x, k = case
    check_topk(x, k, sparsify._topk_by_threshold(x, k, sample_size=sample_size, chunk=chunk))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
def test_large_inputs_take_the_fast_path_and_match(threads, kind, dtype, monkeypatch):
    calls = []
    exact = sparsify._topk_exact
    monkeypatch.setattr(sparsify, "_topk_exact", lambda x, k: calls.append(k) or exact(x, k))
    x = make_input(kind, LARGE, dtype, seed=LARGE)
    for ratio in (1e-4, 0.01, 0.2):
        k = max(1, int(ratio * LARGE))
        check_topk(x, k, topk_indices(x, k))
    # Distinct, tied, all-equal and non-finite magnitudes alike are selected without torch.topk over x.
    assert calls == []


@pytest.mark.parametrize("kind", ["normal", "few_values", "zeros", "sparse", "non_finite"])
def test_same_input_same_indices(threads, kind):
    x = make_input(kind, LARGE, torch.float32, seed=7)
    for k in (1, 1000, 30000):
        first = topk_indices(x, k)
        assert torch.equal(first, topk_indices(x, k))
        assert torch.equal(first, topk_indices(x.clone(), k))


def test_nan_counts_as_largest_like_torch_topk(threads):
    x = make_input("normal", LARGE, torch.float32, seed=3)
    nan_at = torch.arange(5, x.numel(), x.numel() // 40)
    x[nan_at] = float("nan")
    x[1] = float("-inf")
    got = set(topk_indices(x, nan_at.numel() + 1).tolist())
    assert got == set(nan_at.tolist()) | {1}
    assert got == set(torch.topk(x.abs(), nan_at.numel() + 1).indices.tolist())


def test_ties_at_the_threshold_take_the_first_in_index_order(threads):
    # The sampled threshold is 0, so the zeros overflow the candidate cap: the pass then keeps the
    # first k zeros in index order and only collects larger magnitudes after that.
    x = torch.zeros(1000)
    x[[10, 500, 900]] = torch.tensor([5.0, -4.0, 3.0])
    idx = sparsify._topk_by_threshold(x, 8, sample_size=64, chunk=64)
    assert sorted(idx.tolist()) == [0, 1, 2, 3, 4, 10, 500, 900]


def sampled_positions(n, sample_size):
    """The positions the sampled path reads, recomputed from its fixed seed."""
    gen = torch.Generator().manual_seed(sparsify._SAMPLE_SEED)
    return torch.randint(n, (sample_size,), generator=gen)


@pytest.mark.parametrize("misled", ["too_high", "too_low"])
def test_misleading_sample_falls_back_to_exact(misled, monkeypatch):
    # Values at exactly the sampled positions are made unrepresentative, so the estimated threshold
    # is far off: too high leaves fewer than k candidates after every retry, too low overflows the cap.
    calls = []
    passes = []
    exact, pick = sparsify._topk_exact, sparsify._pick_above
    monkeypatch.setattr(sparsify, "_topk_exact", lambda x, k: calls.append(k) or exact(x, k))
    monkeypatch.setattr(sparsify, "_pick_above", lambda *a: passes.append(a[2]) or pick(*a))
    n, k, sample_size = 20000, 200, 64
    x = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 1.0
    where = sampled_positions(n, sample_size)
    x[where] = 100.0 + torch.arange(sample_size, dtype=x.dtype) if misled == "too_high" else 1e-3
    idx = sparsify._topk_by_threshold(x, k, sample_size=sample_size, chunk=4096)
    check_topk(x, k, idx)
    assert calls == [k]
    assert len(passes) == (len(sparsify._MARGINS) if misled == "too_high" else 1)
    if misled == "too_high":
        assert passes == sorted(passes, reverse=True), "retries must lower the threshold"


def test_k_equal_to_numel_returns_every_index():
    x = torch.randn(37)
    assert torch.equal(topk_indices(x, 37), torch.arange(37))


@pytest.mark.parametrize("x, k, match", [
    (torch.randn(4, 4), 1, "x must be a non-empty 1-D tensor"),
    (torch.randn(0), 1, "x must be a non-empty 1-D tensor"),
    (torch.arange(10), 1, "x must have dtype"),
    (torch.randn(10), 0, r"k must be an integer in \[1, 10\]"),
    (torch.randn(10), 11, r"k must be an integer in \[1, 10\]"),
    (torch.randn(10), 2.0, r"k must be an integer in \[1, 10\]"),
    (torch.randn(10), True, r"k must be an integer in \[1, 10\]"),
])
def test_bad_arguments_name_the_parameter_and_range(x, k, match):
    with pytest.raises(ValueError, match=match):
        topk_indices(x, k)


def test_input_requiring_grad_is_accepted_and_untouched():
    x = torch.randn(LARGE, requires_grad=True)
    before = x.detach().clone()
    check_topk(x.detach(), 100, topk_indices(x, 100))
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_strided_input_matches(threads, dtype):
    # A strided view (every third element, from an odd offset) reinterprets as integers in place.
    base = make_input("cauchy", 3 * LARGE + 1, dtype, seed=5)
    x = base[1::3]
    for k in (7, LARGE // 100):
        check_topk(x, k, topk_indices(x, k))


@needs_cuda
@pytest.mark.parametrize("path", ["pass", "topk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_torch_topk(kind, dtype, path, monkeypatch):
    # "pass": CUDA's size bound lowered to LARGE, so float32/float64 take the sampled pass, as inputs of
    # 2**26 elements and more do; 2-byte dtypes still take torch.topk. "topk": the bound as shipped.
    calls = []
    exact = sparsify._topk_exact
    monkeypatch.setattr(sparsify, "_topk_exact", lambda x, k: calls.append(k) or exact(x, k))
    if path == "pass":
        monkeypatch.setattr(sparsify, "_MIN_FAST_NUMEL_CUDA", LARGE)
    x = make_input(kind, LARGE, dtype, seed=11).cuda()
    ks = (1, LARGE // 1000, LARGE // 100, LARGE // 5)
    for k in ks:
        idx = topk_indices(x, k)
        check_topk(x, k, idx)
        assert torch.equal(idx, topk_indices(x, k))
    takes_pass = path == "pass" and dtype in (torch.float32, torch.float64)
    assert calls == ([] if takes_pass else [k for k in ks for _ in range(2)])


@needs_cuda
@settings(max_examples=40, deadline=None)
@given(case=cases(), chunk=st.sampled_from([8, 64, 4096]))
def test_cuda_threshold_path_matches_torch_topk(case, chunk):
    x, k = case
    check_topk(x.cuda(), k, sparsify._topk_by_threshold(x.cuda(), k, sample_size=64, chunk=chunk))


@pytest.mark.parametrize("n", [0, 1, 7, 21_800, 100_000])
def test_ascending_is_torch_sort(n):
    """The transports' sort of indices (numpy's on the CPU) gives torch's result, duplicates and the
    empty tensor included."""
    gen = torch.Generator().manual_seed(n)
    idx = torch.randint(0, max(1, n // 3), (n,), generator=gen)          # many duplicates
    got = sparsify.ascending(idx)
    assert got.dtype == torch.int64 and torch.equal(got, idx.sort().values)
