"""Low rank (PowerSGD) through both front doors: ``hvd_topk.PowerSGD`` in stock ``hvd.DistributedOptimizer``
and as ``hvd_topk.DistributedOptimizer``'s compression (tests/workers/powersgd.py, a small CNN in float64).

On real ranks (2 and 3): the doors train side by side on the same data and end with the same parameters,
identical on every rank; a NaN on one rank skips the step on every rank with every residual kept;
saved after step 2 and resumed, both end bit for bit as a straight run; within a process set; at a rank
where every tensor goes dense (the twofold rule), dense Horovod's parameters; the stock door not given
the optimizer's process set (the class form cannot be) fails on every rank of the set, naming it, and
the job ends. In one process: the settings' checks, the Top-K-only settings refused with low rank,
the hierarchical fallback on one host, the class form's defaults.
"""
import re
import warnings

import pytest
import torch
import torch.nn as nn

import hvd_topk
from testbed.launch import JobFailed
from testbed.pytest_jobs import OutOf, job

from conftest import assert_identical_across_ranks

BOTH = ("opt", "stock")
NAN = job(2, "powersgd.py", "--doors", "opt,stock,dense", "--nan-rank", 1, "--nan-step", 3)
SUM3 = job(3, "powersgd.py", "--op", "sum", "--nan-rank", 2, "--nan-step", 2)
ALL_DENSE = job(2, "powersgd.py", "--doors", "opt,stock,dense", "--rank", 64, "--steps", 4)
DENSE_FIRST = job(2, "powersgd.py", "--doors", "opt,stock,dense", "--dense-steps", 2, "--steps", 2)
# 3 dense steps, saved after the second: a resumed door that forgot its steps would compress one too soon
STRAIGHT = job(2, "powersgd.py", "--dense-steps", 3)
SAVED = job(2, "powersgd.py", "--dense-steps", 3, "--save-at", 1)
RESUMED = job(2, "powersgd.py", "--dense-steps", 3, "--resume", OutOf(SAVED, "opt.pt"))
# jobs that register the process set {0, 2} at hvd.init share a launch of their own
IN_SET = job(3, "powersgd.py", "--set", "0,2", "--steps", 4, alone="set {0, 2} of 3")
NOT_GIVEN = job(3, "powersgd.py", "--set", "0,2", "--doors", "stock", "--stock-form", "class", "--steps", 3,
                alone=True, timeout=150, fails=True)       # the class form: state in the class, a launch alone


def door(results_, name):
    return [dict(r[name], error=r["error"]) for r in results_]


@pytest.mark.parametrize("np,doors_job", [(2, NAN), pytest.param(3, SUM3, marks=pytest.mark.slow)], ids=["2", "3"])
def test_both_doors_identical_everywhere_and_alike(results, np, doors_job):
    """Every rank ends with the same parameters, and the stock door with the optimizer door's: the same
    transport, the same Q's and sums (2 ranks: bit for bit; 3 ranks: Horovod's sum of the uncompressed
    biases may add in another order)."""
    res = results(doors_job)
    assert all(r["error"] is None for r in res)
    for name in BOTH:
        assert_identical_across_ranks(door(res, name))
    opt, stock = res[0]["opt"]["params"], res[0]["stock"]["params"]
    for name, value in opt.items():
        if np == 2:
            assert torch.equal(stock[name], value), name
        else:
            torch.testing.assert_close(stock[name], value, rtol=0, atol=1e-12)
    assert res[0]["opt"]["transports"] == ["allgather", "artopk", "dense", "dense_fp16", "lowrank", "plain",
                                             "split_reduce"]
    assert sorted(res[0]["opt"]["q"]["lowrank"]["q"]) == ["0.weight", "3.weight", "5.weight"]
    # the conv weight is 8 x 27; every weight holds a residual of its own on every rank
    assert res[0]["opt"]["q"]["lowrank"]["q"]["0.weight"].shape == (27, 2)
    assert all(res[r]["stock"]["residuals"]["0.weight"] is not None for r in range(np))
    assert not torch.equal(res[0]["stock"]["residuals"]["3.weight"], res[1]["stock"]["residuals"]["3.weight"])
    # both doors' stats(): P and Q carry r(n + m) of the n x m elements of the three weights, rank 2
    share = (2 * (8 + 27) + 2 * (32 + 288) + 2 * (10 + 32)) / (8 * 27 + 32 * 288 + 10 * 32)
    for r in range(np):
        for name in BOTH:
            stats = res[r][name]["stats"]
            assert stats["density"] == stats["lowrank_density"] == pytest.approx(share), (r, name)
            assert stats["ratio"] is None and stats["sparse_tensors"] == 3 and stats["dense_tensors"] == 3, (r, name)
        # the stock door's payload: P and Q with a finite flag per weight, Horovod's 4-element token per
        # weight, the three biases whole, all float64
        biases = 8 + 32 + 10
        assert res[r]["stock"]["stats"]["bytes_sent"] == 8 * (round(share * 9752) + 3 + 4 * 3 + biases), r
        assert res[r]["stock"]["stats"]["rank"] == 2 and res[r]["stock"]["stats"]["residual_norm"] > 0


@pytest.mark.parametrize("np,doors_job", [(2, NAN), pytest.param(3, SUM3, marks=pytest.mark.slow)], ids=["2", "3"])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(results, np, doors_job):
    res = results(doors_job)
    for r in res:
        for name in BOTH + (("dense",) if np == 2 else ()):
            skipped = r[name]["skipped"]
            assert skipped["params_unchanged"] and skipped["residuals_unchanged"] and skipped["grads_nan"], name
            assert skipped["had_residuals"] == (name != "dense")


@pytest.mark.jobs(ALL_DENSE)
def test_a_rank_where_every_tensor_goes_dense_is_dense_horovod(results):
    """rank 64: no tensor shrinks twofold, so both doors send everything: dense Horovod's parameters."""
    res = results(ALL_DENSE)
    assert_identical_across_ranks(door(res, "opt"))
    dense = res[0]["dense"]["params"]
    for name in BOTH:
        for key, value in dense.items():
            torch.testing.assert_close(res[0][name]["params"][key], value, rtol=0, atol=1e-12)
        assert all(v is None for v in res[0][name]["residuals"].values()), name


@pytest.mark.jobs(DENSE_FIRST)
def test_the_dense_steps_are_dense_horovod_through_both_doors(results):
    """PowerSGD(dense_steps=2) (torch's start_powerSGD_iter): its first 2 steps are dense Horovod's, in
    the stock door as in the optimizer's, and leave no residual."""
    res = results(DENSE_FIRST)
    dense = res[0]["dense"]["params"]
    for name in BOTH:
        assert_identical_across_ranks(door(res, name))
        for key, value in dense.items():
            torch.testing.assert_close(res[0][name]["params"][key], value, rtol=0, atol=1e-12)
        assert all(v is None for v in res[0][name]["residuals"].values()), name


@pytest.mark.jobs(STRAIGHT, SAVED, RESUMED)
def test_resumed_from_per_rank_checkpoints_bit_for_bit(results):
    """Residuals (per rank), Q's and the steps done (both doors) saved after step 1 of 3 dense ones and
    loaded: the run ends as the straight one, bit for bit, on every rank; the doors agree bit for bit."""
    straight, resumed = results(STRAIGHT), results(RESUMED)
    for r in range(2):
        for name in BOTH:
            assert all(v is not None for v in straight[r][name]["residuals"].values()), (r, name)   # compressed
            for key, value in straight[r][name]["params"].items():
                assert torch.equal(resumed[r][name]["params"][key], value), (r, name, key)
                assert torch.equal(straight[r]["stock"]["params"][key], value), (r, name, key)


@pytest.mark.slow
@pytest.mark.jobs(IN_SET)
def test_within_a_process_set(results):
    """The optimizers reduce within {0, 2} of 3 ranks: ranks 0 and 2 identical, rank 1 on its own."""
    res = results(IN_SET)
    assert res[0]["ranks"] == [0, 2] and all(r["error"] is None for r in res)
    for name in BOTH:
        ranks = door(res, name)
        assert_identical_across_ranks([ranks[0], ranks[2]])
        assert not torch.equal(ranks[1]["params"]["3.weight"], ranks[0]["params"]["3.weight"])
    for key, value in res[0]["opt"]["params"].items():
        assert torch.equal(res[0]["stock"]["params"][key], value), key


@pytest.mark.slow
@pytest.mark.jobs(NOT_GIVEN)
def test_the_class_form_in_a_process_set_fails_every_rank_naming_it(results):
    """compression=PowerSGD (the class) runs over all ranks; the optimizer reduces within {0, 2}: ranks
    0 and 2 raise at the first step, naming process_set, and the job ends instead of hanging."""
    with pytest.raises(JobFailed) as failed:
        results(NOT_GIVEN)
    for rank in (0, 2):
        assert re.search(rf"rank {rank} failed at [0-9.]+: ValueError: PowerSGD: Horovod reduced this gradient over "
                         "a set of ranks other than PowerSGD's process_set", failed.value.output), rank
    assert results.run(NOT_GIVEN).seconds < 90


# -- one process ------------------------------------------------------------------------------------

def test_settings_and_their_checks():
    s = hvd_topk.PowerSGDSettings()
    assert (s.kind, s.rank, s.min_compression_rate, s.communication) == ("lowrank", 4, 2.0, "lowrank")
    assert hvd_topk.PowerSGD.settings == s and hvd_topk.PowerSGD(rank=2).settings.rank == 2
    for kwargs, message in (({"rank": 0}, "rank must be an integer >= 1"),
                            ({"communication": "split_reduce"}, r"communication must be one of \('lowrank', "),
                            ({"min_compression_rate": 0}, "min_compression_rate must be a finite number > 0"),
                            ({"epsilon": -1}, "epsilon must be"), ({"seed": -1}, "seed must be"),
                            ({"dense_steps": -1}, "dense_steps must be an integer >= 0")):
        with pytest.raises(ValueError, match=message):
            hvd_topk.PowerSGDSettings(**kwargs)
    with pytest.raises(ValueError, match="pin must be None or a dict of parameter name -> one of"):
        hvd_topk.OptimizerSettings(pin={"w": "fastest"})


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))


@pytest.mark.parametrize("settings, named", [
    (dict(momentum_correction=True), "momentum_correction"), (dict(warmup_steps=5), "warmup_steps"),
    (dict(warmup_epochs=2), "warmup_epochs"), (dict(selection="global"), "selection"),
    (dict(adaptive_ratio=True), "adaptive_ratio"), (dict(compress="update"), "compress"),
    (dict(leader="var"), "leader"), (dict(value_dtype=torch.float16), "value_dtype")])
def test_topk_only_settings_are_refused_with_low_rank(hvd, settings, named):
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=rf"^{named} cannot be used with low rank \(PowerSGD\)"):
        hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=hvd_topk.PowerSGD,
                                      settings=hvd_topk.OptimizerSettings(**settings))
    pinned = hvd_topk.OptimizerSettings(pin={"0.weight": "lowrank"}, **settings)
    with pytest.raises(ValueError, match=rf"^{named} cannot be used with low rank \(PowerSGD pinned to a tensor\)"):
        hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), settings=pinned)


def test_the_dense_steps_given_twice_must_agree(hvd):
    """PowerSGD(dense_steps=...) and OptimizerSettings(dense_steps=...) say the same thing: either one
    counts, both alike too, and two different numbers are refused rather than one silently chosen."""
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    for own, theirs, steps in ((0, 3, 3), (3, 0, 3), (3, 3, 3)):
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            compression=hvd_topk.PowerSGD(dense_steps=theirs),
                                            settings=hvd_topk.OptimizerSettings(dense_steps=own))
        assert opt._hvd_topk.schedule.dense_steps == steps, (own, theirs)
    with pytest.raises(ValueError, match=r"dense_steps must be set once: OptimizerSettings\(dense_steps=2\) and "
                                         "the compression's dense_steps=3 differ"):
        hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                      compression=hvd_topk.PowerSGD(dense_steps=3),
                                      settings=hvd_topk.OptimizerSettings(dense_steps=2))


def test_communication_of_the_other_kind_is_refused(hvd):
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="with a low-rank compression, got 'split_reduce'"):
        hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                      compression=hvd_topk.PowerSGD(), communication="split_reduce")
    with pytest.raises(ValueError, match=r"communication='lowrank' needs compression=hvd_topk.PowerSGD"):
        hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), communication="lowrank")
    with pytest.raises(ValueError, match="compression must be TopKEF or PowerSGD"):
        hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=object())
    with pytest.raises(ValueError, match="communication='hierarchical' needs the global process set"):
        hvd_topk.PowerSGD(communication="hierarchical", process_set=hvd.ProcessSet([0]))


def test_pinned_tensors_take_their_transport_and_one_host_falls_back(hvd):
    """A pin overrides the communication per tensor (here low rank beside split_reduce); 'hierarchical'
    on one host runs the flat low rank, saying so once."""
    model = _model()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopKEF(ratio=0.1, min_numel=32),
                                        settings=hvd_topk.OptimizerSettings(pin={"0.weight": "lowrank"}))
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    assert list(opt._hvd_topk.transports["lowrank"].q) == ["0.weight"]
    assert opt._hvd_topk.residuals.residuals["2.weight"] is not None      # split_reduce's
    from hvd_topk.transports import host_sets
    host_sets._RESOLVED.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(),
                                            compression=hvd_topk.PowerSGD(communication="hierarchical"))
    assert opt._hvd_topk.transports["hierarchical"] is opt._hvd_topk.transports["lowrank"]
    assert [str(w.message) for w in seen if "runs the flat transport: one host" in str(w.message)]


def test_a_checkpoint_of_another_rank_is_refused(hvd):
    """The Q's of PowerSGD(rank=2) cannot warm-start rank 4: refused before anything is loaded."""
    def trained(rank):
        model = _model()
        opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(),
                                            compression=hvd_topk.PowerSGD(rank=rank))
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        return opt
    saved = trained(2).state_dict()
    assert list(saved["hvd_topk"]["transports"]["lowrank"]["q"]) == ["0.weight"]
    other = trained(4)
    before = other._hvd_topk.transports["lowrank"].q["0.weight"].clone()
    with pytest.raises(ValueError, match=r"PowerSGD\(rank=2\) .* has rank=4: resume with the same rank"):
        other.load_state_dict(saved)
    assert torch.equal(other._hvd_topk.transports["lowrank"].q["0.weight"], before)
    same = trained(2)
    same.load_state_dict(saved)
    assert torch.equal(same._hvd_topk.transports["lowrank"].q["0.weight"],
                       saved["hvd_topk"]["transports"]["lowrank"]["q"]["0.weight"])


@pytest.mark.parametrize("shared", [True, False])
def test_the_last_compress_sums_where_ranks_share_cores(hvd, monkeypatch, shared):
    """From the second step, where ranks share cores, the P's and Q's are summed once the backward pass
    of the step's last compress ends (``after_backward``, ``LowRank.drain``; called outside a pass, as
    here, at once); elsewhere nothing runs before the first decompress. Either way the gradients
    handed out are the same, bit for bit. (One rank: Horovod calls no compressor at world size 1, so
    the test does; the 3-rank jobs above drain where the machine has fewer than 3 cores.)"""
    from hvd_topk.step import compressor_door
    model = _model()
    named = list(model.named_parameters())
    comp = hvd_topk.PowerSGD(rank=2, named_parameters=named)
    reference = hvd_topk.PowerSGD(rank=2, named_parameters=named)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) for _, p in named]
        for (_, p), g in zip(named, grads):
            p.grad = g                    # named keys find a gradient's parameter by its .grad
        monkeypatch.setattr(compressor_door, "ranks_share_cores", lambda: shared)
        compressed = [comp.compress(g) for g in grads]
        running = comp.transport.running
        assert (running is not None and running.done) == (shared and step > 0), step
        got = [comp.decompress(out.clone(), ctx) for out, ctx in compressed]
        monkeypatch.setattr(compressor_door, "ranks_share_cores", lambda: False)       # the reference: never
        want = [reference.decompress(out.clone(), ctx) for out, ctx in [reference.compress(g) for g in grads]]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
