"""TopKEF logic in one process (world size 1: Horovod's collectives are local)."""
import math

import pytest
import torch

from hvd_topk import TopKEF
from hvd_topk.compression import STOCK_COMMUNICATIONS
from hvd_topk.core.sparsify import k_for
from hvd_topk.step import compressor_global

SPARSE = [c for c in STOCK_COMMUNICATIONS if c != "dense"]
GLOBAL = ["split_reduce", "allgather", "hierarchical"]        # TopKEF(selection='global')'s sparse transports
# (communication, selection): every sparse transport layer-wise, and those that select globally
SELECTED = [(c, "layerwise") for c in SPARSE] + [(c, "global") for c in GLOBAL]


def run_step(comp, grads):
    """One step as Horovod runs it: compress every gradient, (allreduce: the identity at size 1), then
    decompress every one. Returns [(this rank's sent contribution, decompressed result)]: what left
    this rank is acc minus the new residual (Σ sent + residual = Σ grad by construction, so the
    invariant tests check that the residual and the result agree)."""
    before = dict(comp.memory.residuals)
    compressed = [comp.compress(g) for g in grads]
    outs = [comp.decompress(out.clone(), ctx) for out, ctx in compressed]
    results = []
    for g, (_, ctx), out in zip(grads, compressed, outs):
        if ctx.dense:
            results.append((g.reshape(-1).clone(), out))
            continue
        acc = g.reshape(-1) + (0 if before.get(ctx.key) is None else before[ctx.key])
        after = comp.memory.residuals.get(ctx.key)
        results.append((acc - (0 if after is None else after), out))
    return results


def roundtrip(comp, grad):
    """A step with a single gradient; returns (sent, result)."""
    return run_step(comp, [grad])[0]


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), float("inf"), "0.1", None, True])
def test_bad_ratio_names_argument_and_range(bad):
    with pytest.raises(ValueError, match=r"ratio must be a number in \(0, 1\]"):
        TopKEF(ratio=bad)


@pytest.mark.parametrize("bad", [-1, 2.5, "3", None])
def test_bad_min_numel_names_argument_and_range(bad):
    with pytest.raises(ValueError, match="min_numel must be an integer >= 0"):
        TopKEF(min_numel=bad)


@pytest.mark.parametrize("text", ["soon", "2", "601", "nan"])
def test_bad_shutdown_grace_names_the_variable_and_range(monkeypatch, text):
    from hvd_topk.step import compressor_door
    monkeypatch.setenv("HVD_TOPK_SHUTDOWN_GRACE_S", text)
    with pytest.raises(ValueError, match=r"HVD_TOPK_SHUTDOWN_GRACE_S must be a number in \[3, 600\] \(seconds"):
        compressor_door._shutdown_grace_s()


def test_after_backward_runs_once_the_pass_has_ended():
    """The stock doors' step-end work waits for the backward pass (Horovod has every token by then);
    outside a pass it runs at once."""
    from hvd_topk.step.compressor_door import after_backward
    order = []
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda g: after_backward(lambda: order.append("callback")) or order.append("hook"))
    (x * 2).sum().backward()
    order.append("returned")
    after_backward(lambda: order.append("now"))
    assert order == ["hook", "callback", "returned", "now"]


def test_shutdown_grace_is_read_from_the_environment(monkeypatch):
    from hvd_topk.step import compressor_door
    monkeypatch.setenv("HVD_TOPK_SHUTDOWN_GRACE_S", "7.5")
    assert compressor_door._shutdown_grace_s() == 7.5
    monkeypatch.delenv("HVD_TOPK_SHUTDOWN_GRACE_S")
    assert compressor_door._shutdown_grace_s() == 15.0


def test_k_for_rounds_up_and_keeps_at_least_one():
    assert k_for(1000, 0.01) == 10
    assert k_for(1001, 0.01) == 11
    assert k_for(5, 0.001) == 1
    assert k_for(7, 1.0) == 7


def test_class_usage_uses_default_instance_with_ratio_001(hvd):
    assert TopKEF.default().settings.ratio == TopKEF.settings.ratio == 0.01
    assert TopKEF.default() is TopKEF.default()
    g = torch.randn(5000)
    out, ctx = TopKEF.compress(g)
    assert TopKEF.default().settings.communication == "split_reduce"
    assert out.numel() == 4                              # Horovod reduces a token; split_reduce sends the values
    assert TopKEF.decompress(out, ctx).shape == g.shape


def test_artopk_hands_horovod_k_values_and_a_flag(hvd):
    """The first step adds the 4-element op token (Horovod's op and process set, checked once)."""
    comp = TopKEF(communication="artopk")
    for step in range(3):
        out, ctx = comp.compress(torch.randn(5000))
        assert out.numel() == math.ceil(0.01 * 5000) + 1 + (4 if step == 0 else 0)
        assert comp.decompress(out, ctx).shape == (5000,)


def test_artopk_first_step_reduced_over_another_process_set_names_process_set(hvd):
    """Horovod summed the first step's buffer over 2 ranks, TopKEF has 1 (the optimizer's process_set was
    not given to it): decompress raises, naming process_set, before any value is used."""
    comp = TopKEF(ratio=0.01, min_numel=0, communication="artopk")
    out, ctx = comp.compress(torch.randn(5000))
    reduced = out.clone()
    reduced[-4:] *= 2                                     # [1, 1, f, f*f] from each of 2 ranks
    reduced[-3] = 1.0                                     # only one of them is rank 0
    with pytest.raises(ValueError, match="process_set"):
        comp.decompress(reduced, ctx)


@pytest.mark.parametrize("bad", ["ring", None, "SPLIT_REDUCE"])
def test_bad_communication_names_argument_and_choices(bad):
    with pytest.raises(ValueError, match="communication"):
        TopKEF(communication=bad)


def test_small_and_integer_tensors_pass_through_unchanged(hvd):
    comp = TopKEF(min_numel=100)
    small = torch.randn(99)
    ints = torch.arange(1000)
    for t in (small, ints):
        out, ctx = comp.compress(t)
        assert out is t and ctx.dense
        assert comp.decompress(out, ctx) is t


@pytest.mark.parametrize("communication, selection", SELECTED)
def test_error_feedback_invariant_float64(hvd, communication, selection):
    torch.manual_seed(0)
    comp = TopKEF(ratio=0.05, min_numel=0, communication=communication, selection=selection)
    shapes = [(40, 30), (40, 30), (300,)]          # two slots share a shape: must not mix
    total_grad = [torch.zeros(math.prod(s), dtype=torch.float64) for s in shapes]
    total_sent = [torch.zeros(math.prod(s), dtype=torch.float64) for s in shapes]
    for _ in range(30):
        grads = [torch.randn(s, dtype=torch.float64) * (i + 1) for i, s in enumerate(shapes)]
        for i, (g, (sent, _)) in enumerate(zip(grads, run_step(comp, grads))):
            total_grad[i] += g.reshape(-1)
            total_sent[i] += sent
    for i in range(len(shapes)):
        residual = comp.memory.residuals[i]
        torch.testing.assert_close(total_sent[i] + residual, total_grad[i], rtol=0, atol=1e-12)
        assert residual.abs().sum() > 0


@pytest.mark.parametrize("communication", SPARSE)
def test_decompressed_gradient_is_sparse_with_k_nonzeros(hvd, communication):
    comp = TopKEF(ratio=0.01, min_numel=0, communication=communication)
    g = torch.randn(10_000)
    for _ in range(3):
        _, dense = roundtrip(comp, g)
        assert int((dense != 0).sum()) == 100


def test_leader_picks_true_topk_of_accumulator_for_next_step(hvd):
    comp = TopKEF(ratio=0.01, min_numel=0, communication="artopk")
    g = torch.zeros(1000)
    g[[3, 500, 999]] = torch.tensor([5.0, -7.0, 6.0])
    g[10:20] = 0.001
    _, dense0 = roundtrip(comp, g)            # step 0: evenly spaced bootstrap set (0, 100, ..., 900)
    assert torch.nonzero(dense0).flatten().tolist() == [500]
    _, dense1 = roundtrip(comp, torch.zeros(1000))   # step 1: the leader's top-k from step 0
    assert dense1[3] == 5.0 and dense1[999] == 6.0   # the two largest held back are sent now
    assert dense1[500] == 0 and int((dense1 != 0).sum()) <= 10   # 500 went at step 0


@pytest.mark.parametrize("communication", STOCK_COMMUNICATIONS)
def test_ratio_one_returns_the_gradient_exactly(hvd, communication):
    comp = TopKEF(ratio=1.0, min_numel=0, communication=communication)
    for _ in range(3):
        g = torch.randn(64, 64)
        sent, dense = roundtrip(comp, g)
        assert torch.equal(dense, g)
        assert comp.memory.residuals[0] is None


def test_changed_gradient_sequence_raises_instead_of_mixing_residuals(hvd):
    comp = TopKEF(ratio=0.1, min_numel=0)
    a, b = torch.randn(100), torch.randn(50)
    run_step(comp, [a, b])
    with pytest.raises(ValueError, match="sequence of gradients changed"):
        comp.compress(torch.randn(50))                     # a different first gradient (a new tensor)
    comp2 = TopKEF(ratio=0.1, min_numel=0)
    run_step(comp2, [a, b])
    out, ctx = comp2.compress(a)                           # second step misses b (frozen layer)
    with pytest.raises(ValueError, match="compressed 1 gradients, the first step 2"):
        comp2.decompress(out, ctx)


@pytest.mark.parametrize("communication", SPARSE)
def test_unnamed_topkef_keeps_the_slot_of_a_gradient_compressed_again(hvd, communication):
    """optimizer.step() after optimizer.synchronize(), without skip_synchronize(), makes Horovod compress
    every gradient again, iterating a set, in another order on each process (Horovod's own
    test_synchronize_step_warning): the very tensor compressed last step keeps its slot."""
    comp = TopKEF(ratio=0.1, min_numel=0, communication=communication)
    a, b = torch.randn(100), torch.randn(50)
    run_step(comp, [a, b])
    compressed = [comp.compress(t) for t in (b, a)]         # by position, b would meet a's (100,) slot
    assert [ctx.key for _, ctx in compressed] == [1, 0]
    outs = [comp.decompress(out.clone(), ctx) for out, ctx in compressed]
    assert [o.shape for o in outs] == [(50,), (100,)]
    assert comp.memory.residuals[0].shape == (100,) and comp.memory.residuals[1].shape == (50,)
    run_step(comp, [torch.randn(100), torch.randn(50)])     # new tensors: by position, as before


def test_unnamed_topkef_refuses_a_slot_claimed_by_identity_and_by_position(hvd):
    """A reordered step mixing the last step's tensors with new ones cannot be keyed: it raises."""
    comp = TopKEF(ratio=0.1, min_numel=0)
    a, b = torch.randn(100), torch.randn(50)
    run_step(comp, [a, b])
    comp.compress(b)                                        # slot 1, by identity
    with pytest.raises(ValueError, match="slot #1 is handed out twice.*named_parameters"):
        comp.compress(torch.randn(100))                     # position 1: slot 1 again


@pytest.mark.parametrize("communication", SPARSE)
def test_non_finite_gradient_gives_nan_everywhere_and_keeps_residual(hvd, communication):
    comp = TopKEF(ratio=0.1, min_numel=0, communication=communication)
    roundtrip(comp, torch.randn(200))
    before = comp.memory.residuals[0].clone()
    g = torch.randn(200)
    g[17] = float("inf")
    _, dense = roundtrip(comp, g)
    assert torch.isnan(dense).all()
    assert torch.equal(comp.memory.residuals[0], before)
    _, dense = roundtrip(comp, torch.randn(200))        # next finite step proceeds normally
    assert torch.isfinite(dense).all()


@pytest.mark.parametrize("communication, selection", SELECTED)
def test_non_finite_in_one_tensor_nans_the_whole_step_and_keeps_every_residual(hvd, communication, selection):
    comp = TopKEF(ratio=0.1, min_numel=50, communication=communication, selection=selection)
    grads = [torch.randn(200), torch.randn(300), torch.randn(10)]
    run_step(comp, grads)
    before = {slot: r.clone() for slot, r in comp.memory.residuals.items()}
    bad = [torch.randn(200), torch.randn(300), torch.randn(10)]
    bad[1][5] = float("nan")                              # the second of two compressed tensors
    results = run_step(comp, bad)
    assert all(torch.isnan(out).all() for _, out in results)   # including the one decompressed first
    assert comp.memory.residuals.keys() == before.keys()
    assert all(torch.equal(comp.memory.residuals[s], before[s]) for s in before)
    small_bad = [torch.randn(200), torch.randn(300), torch.full((10,), float("inf"))]   # dense one
    assert all(torch.isnan(out).all() for _, out in run_step(comp, small_bad))
    assert all(torch.equal(comp.memory.residuals[s], before[s]) for s in before)


@pytest.mark.parametrize("communication, selection", SELECTED)
def test_state_dict_roundtrip_continues_identically(hvd, communication, selection):
    torch.manual_seed(0)
    steps = [[torch.randn(500), torch.randn(20, 30) * 3] for _ in range(8)]

    def make():
        return TopKEF(ratio=0.02, min_numel=0, communication=communication, selection=selection)
    ref = make()
    outs_ref = [[out for _, out in run_step(ref, grads)] for grads in steps]
    first = make()
    for grads in steps[:4]:
        run_step(first, grads)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for grads, expected in zip(steps[4:], outs_ref[4:]):
        assert all(torch.equal(out, e) for (_, out), e in zip(run_step(resumed, grads), expected))


# -- selection='global': one top-k over the step's compressed tensors ------------------------------------

@pytest.mark.parametrize("bad", ["all", "", "Global"])
def test_bad_selection_names_argument_and_choices(bad):
    with pytest.raises(ValueError, match=r"selection must be one of \('layerwise', 'global', None\)"):
        TopKEF(selection=bad)


def test_global_selection_with_artopk_names_selection_and_what_it_accepts():
    with pytest.raises(ValueError, match="selection must be 'layerwise' or None with communication='artopk'.*"
                                         "'split_reduce'"):
        TopKEF(communication="artopk", selection="global")
    assert TopKEF(communication="dense", selection="global").pool is None     # dense selects nothing


@pytest.mark.parametrize("communication,selection,runs", [
    ("split_reduce", None, "global"), ("allgather", None, "global"), ("hierarchical", None, "global"),
    ("artopk", None, "layerwise"), ("dense", None, "layerwise"), ("split_reduce", "layerwise", "layerwise")])
def test_global_selection_is_the_default_where_the_transport_carries_it(communication, selection, runs):
    comp = TopKEF(communication=communication, selection=selection)
    assert comp.settings.selection == selection and comp.selection == runs
    assert (comp.pool is not None) == (runs == "global")


@pytest.mark.parametrize("communication", GLOBAL)
def test_global_selection_takes_the_top_k_of_all_tensors_and_keeps_residuals_per_tensor(hvd, communication):
    """k = k_for(total, ratio) entries over both tensors, all from the large one (layer-wise would send
    each its own k); Horovod gets a token per tensor; the rest stays in each tensor's own residual."""
    big, small = torch.randn(400) + 100 * torch.sign(torch.randn(400)), torch.randn(600)
    comp = TopKEF(ratio=0.05, min_numel=0, communication=communication, values="fp32", selection="global")
    compressed = [comp.compress(g) for g in (small, big)]
    assert [out.numel() for out, _ in compressed] == [4, 4]
    outs = [comp.decompress(out.clone(), ctx) for out, ctx in compressed]
    assert int((outs[1] != 0).sum()) == k_for(1000, 0.05) and not outs[0].any()
    assert torch.equal(comp.memory.residuals[0], small) and comp.stats()["sparse_tensors"] == 1
    torch.testing.assert_close(comp.memory.residuals[1] + outs[1], big, rtol=0, atol=0)
    assert TopKEF(ratio=0.05, selection="global").state_dict()["selection"] == "global"


def test_a_gradient_after_the_global_bucket_left_names_the_cause(hvd, monkeypatch):
    """Where ranks share cores, from the second step the bucket leaves in the compress that completes the
    previous step's set of gradients; a gradient compressed after it in the same step raises, naming
    it, instead of being left out of the step's one top-k (or sent as a second pool)."""
    monkeypatch.setattr(compressor_global, "ranks_share_cores", lambda: True)     # one rank: it shares none
    params = {name: torch.nn.Parameter(torch.zeros(300)) for name in ("a", "b", "late")}
    comp = TopKEF(ratio=0.05, min_numel=0, named_parameters=params.items(), selection="global")

    def compress(name):
        params[name].grad = torch.randn(300)
        return comp.compress(params[name].grad)
    compressed = [compress("a"), compress("b")]
    for out, ctx in compressed:
        comp.decompress(out.clone(), ctx)
    compress("a"), compress("b")                          # the previous step's set: the bucket leaves
    assert comp.pool.bucket.pending is not None
    with pytest.raises(ValueError, match="'late' came after the step's bucket left"):
        compress("late")


def test_the_optimizer_selects_globally_when_topkef_does(hvd):
    import torch.nn as nn

    import hvd_topk
    model = nn.Linear(64, 32)

    def selection(compression, **kw):
        opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=compression, **kw)
        return opt._hvd_topk.selection
    layerwise = hvd_topk.OptimizerSettings(selection="layerwise")
    assert selection(TopKEF(selection="global")) == "global" and selection(TopKEF()) == "global"
    assert selection(TopKEF(selection="global"), settings=layerwise) == "global"      # either saying 'global'
    assert selection(TopKEF(selection="layerwise")) == selection(TopKEF(), settings=layerwise) == "layerwise"
    # the default per communication: per tensor where a tensor's transport is chosen per tensor
    assert selection(TopKEF(), communication="artopk") == selection(TopKEF(), communication="auto") == "layerwise"
    assert selection(TopKEF(communication="artopk")) == "layerwise"
    assert selection(hvd_topk.PowerSGD(), communication="hierarchical") == "layerwise"      # low rank
    pinned = hvd_topk.OptimizerSettings(pin={"weight": "dense"})
    assert selection(TopKEF(), settings=pinned) == "layerwise"
    with pytest.raises(ValueError, match="selection must be 'layerwise' or None with OptimizerSettings\\(pin=...\\)"):
        selection(TopKEF(selection="global"), settings=pinned)


def test_index_pipeline_shares_sets_at_flush_and_refuses_a_checkpoint_mid_step(hvd):
    from hvd_topk.transports.index_sets import IndexPipeline
    from hvd_topk.core.sparsify import topk_indices
    pipe = IndexPipeline("test.pipe")
    acc = torch.randn(100)
    sent = pipe.current("w", acc, 5, leader=0)          # first step: the evenly spaced set
    assert sent.tolist() == [0, 20, 40, 60, 80]
    pipe.launch_next("w", acc, acc, sent, 5, leader=0)
    with pytest.raises(RuntimeError, match="between steps"):
        pipe.state_dict()                                # picked, not yet shared
    pipe.flush()
    assert torch.equal(pipe.state_dict()["w"].long(), topk_indices(acc, 5))
    assert torch.equal(pipe.current("w", acc, 5, leader=0), topk_indices(acc, 5))


class _Ranks:
    """A stand-in process set of ``size`` ranks, for reading reduced tokens in one process."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def reduced_token(tokens, op):
    total = torch.stack(tokens).sum(0)
    return total / len(tokens) if op == "average" else total


@pytest.mark.parametrize("size", [2, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_reads_horovods_op_and_accepts_agreeing_keys(size, dtype):
    from hvd_topk.step.op_token import OpToken
    like = torch.zeros(1, dtype=dtype)
    tokens = [OpToken(_Ranks(size, r)).make("fc1.weight", like) for r in range(size)]
    assert OpToken(_Ranks(size)).average(reduced_token(tokens, "average"), "fc1.weight") is True
    assert OpToken(_Ranks(size)).average(reduced_token(tokens, "sum"), "fc1.weight") is False


@pytest.mark.parametrize("op", ["average", "sum"])
def test_token_refuses_ranks_that_keyed_a_gradient_differently(op):
    from hvd_topk.step.op_token import OpToken, fingerprint
    keys = [0, 1, 2, 3]                                   # positional keys: every rank another slot
    assert len({fingerprint(k) for k in keys}) > 1
    like = torch.zeros(1)
    tokens = [OpToken(_Ranks(4, r)).make(keys[r], like) for r in range(4)]
    for r in range(4):                                   # every rank decides the same from the same sum
        with pytest.raises(ValueError, match="different keys"):
            OpToken(_Ranks(4, r), mismatch_hint="use named_parameters").average(reduced_token(tokens, op), keys[r])


def test_token_refuses_a_reduction_that_is_neither_sum_nor_average():
    from hvd_topk.step.op_token import OpToken
    like = torch.zeros(1)
    tokens = [OpToken(_Ranks(2, r)).make("w", like) for r in range(2)]
    adasum_like = torch.tensor([1.25, 0.75, 5.0, 25.0])   # Adasum of [1,1,..] and [1,0,..]-like vectors
    with pytest.raises(ValueError, match="op=hvd.Average or hvd.Sum"):
        OpToken(_Ranks(2)).average(adasum_like, "w")
    assert OpToken(_Ranks(2)).average(reduced_token(tokens, "sum"), "w") is False


@pytest.mark.parametrize("op", ["average", "sum"])
@pytest.mark.parametrize("members", [[0], [0, 2], [1, 3], [0, 1, 2]])
def test_token_reduced_over_another_process_set_names_process_set(op, members):
    """Horovod reduced over some of TopKEF's 4 ranks only (the optimizer has a process set TopKEF was
    not given): every rank that reduced it raises, naming process_set, not op."""
    from hvd_topk.step.op_token import OpToken
    like = torch.zeros(1)
    reduced = reduced_token([OpToken(_Ranks(4, r)).make("w", like) for r in members], op)
    for r in members:
        with pytest.raises(ValueError, match="other than TopKEF's process_set .*process_set=ps"):
            OpToken(_Ranks(4, r)).average(reduced, "w")


# -- settings: made and kept, the transports built at the first compress --------------------------------

def test_making_a_topkef_keeps_its_settings_and_builds_nothing_until_compress(hvd, monkeypatch):
    """No collective at construction, not even 'hierarchical''s search for the hosts' process sets; a
    checkpoint of an unbuilt TopKEF is a fresh one's, and one loaded into it waits for the build."""
    import dataclasses

    from hvd_topk import TopKSettings
    from hvd_topk.transports import build
    resolved = []
    real_resolve = build.resolve
    monkeypatch.setattr(build, "resolve", lambda name, optional=False: resolved.append(name) or real_resolve(
        name, optional))
    comp = TopKEF(ratio=0.05, min_numel=16, communication="hierarchical", budget=2)
    assert comp.settings == TopKSettings(ratio=0.05, min_numel=16, communication="hierarchical", budget=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        comp.settings.ratio = 0.1
    assert resolved == [] and comp.transports._stack is None
    saved = comp.state_dict()
    assert (saved["steps"], saved["next_indices"], saved["ratio"]) == ({}, {}, 0.05)
    comp.load_state_dict(saved)
    assert comp.transports._stack is None
    roundtrip(comp, torch.randn(500))
    assert len(resolved) == 1 and comp.transports._stack is not None
    roundtrip(comp, torch.randn(500))
    assert len(resolved) == 1                                  # built once


def test_settings_of_a_kind_without_transports_are_refused_by_both_doors(hvd):
    """A second compressor kind sits beside Top-K as its own CompressorSettings subclass; until the
    factory has its builder, both doors refuse it with a ValueError naming the argument."""
    from dataclasses import dataclass

    import torch.nn as nn

    import hvd_topk
    from hvd_topk.settings import CompressorSettings
    from hvd_topk.transports.build import build_transports

    @dataclass(frozen=True)
    class OtherSettings(CompressorSettings):
        kind = "other"
        rank: int = 4

    class Other:
        settings = OtherSettings()
    with pytest.raises(ValueError, match=r"settings must be of a kind with transports \[.*'topk'\]"):
        build_transports(OtherSettings(), tag="t", key_index={})
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="compression must be TopKEF or PowerSGD, the class or an instance"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=Other)
