"""communication='hierarchical' (hvd_topk/transports/hierarchical.py, host_sets.py): the pieces that need
no second rank. The jobs across emulated hosts (2 hosts x 2 ranks, both front doors, the process-set
error, uneven hosts) are in tests/test_multihost.py.
"""
import math
import warnings

import pytest
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk.transports.collectives import Collectives
from hvd_topk.transports.regions import Regions
from hvd_topk.transports import SparseAllgather, SplitReduce
from hvd_topk.transports.hierarchical import Hierarchical, shard_of
from hvd_topk.transports import host_sets
from hvd_topk.transports.host_sets import HostSets, host_process_sets, plan_sets


def _table(hosts_of_ranks):
    """Horovod's (local_rank, local_size, cross_rank, cross_size) per rank, for ranks placed on hosts as
    given (a host name per rank, in rank order), numbered as Horovod numbers them."""
    hosts = list(dict.fromkeys(hosts_of_ranks))
    local = {h: [r for r, x in enumerate(hosts_of_ranks) if x == h] for h in hosts}
    rows = []
    for r, h in enumerate(hosts_of_ranks):
        lr = local[h].index(r)
        same_position = [q for q in range(len(hosts_of_ranks)) if local[hosts_of_ranks[q]].index(q) == lr]
        rows.append((lr, len(local[h]), same_position.index(r), len(same_position)))
    return rows


def test_sets_of_even_hosts_numbered_by_host_or_round_robin():
    assert plan_sets(_table("aabbcc")) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])
    # mpirun --map-by node: rank r on host r % 2
    assert plan_sets(_table("abab")) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])


@pytest.mark.parametrize("placement, reason", [
    ("aab", "the hosts run different numbers of ranks (2 and 1)"),
    ("abb", "the hosts run different numbers of ranks (2 and 1)"),
    ("aaaa", "one host"),
    ("abcd", "one rank per host"),
    ("a", "one host"),
])
def test_jobs_that_fall_back_to_flat_say_why(placement, reason):
    planned = plan_sets(_table(placement))
    assert isinstance(planned, str) and planned.startswith(reason), planned


def test_inconsistent_numbers_fall_back():
    # two ranks claim the same local rank on one host
    assert "do not describe 2 hosts of 2 ranks" in plan_sets([(0, 2, 0, 2), (0, 2, 0, 2), (0, 2, 1, 2),
                                                              (1, 2, 1, 2)])


def test_host_process_sets_from_arguments_and_the_launchers_environment(monkeypatch):
    assert [ps.ranks for ps in host_process_sets(size=6, local_size=3)] == \
        [[0, 1, 2], [3, 4, 5], [0, 3], [1, 4], [2, 5]]
    assert host_process_sets(size=4, local_size=4) == []            # one host: the flat fallback
    for size, local in (("HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE"),
                        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
        for name in ("HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(size, "4")
        monkeypatch.setenv(local, "2")
        assert [ps.ranks for ps in host_process_sets()] == [[0, 1], [2, 3], [0, 2], [1, 3]]
    monkeypatch.delenv(size)
    with pytest.raises(ValueError, match="size and local_size must be given"):
        host_process_sets()
    with pytest.raises(ValueError, match="local_size must divide size"):
        host_process_sets(size=6, local_size=4)


@pytest.mark.parametrize("n, per_host, k", [(10, 4, 5), (2048, 2, 103), (4096, 8, 1), (3, 4, 1), (1001, 3, 1001)])
def test_shards_cover_the_tensor_and_k_scales_with_them(n, per_host, k):
    shards = [shard_of(n, per_host, j, k) for j in range(per_host)]
    assert {m for m, *_ in shards} == {math.ceil(n / per_host)}
    starts = [start for _, start, _, _ in shards]
    assert starts == sorted(starts) and sum(real for _, _, real, _ in shards) == n
    assert all(start + real <= n for _, start, real, _ in shards)
    k_total = sum(ks for *_, ks in shards)
    assert min(k, n) <= k_total <= k + per_host and all(ks <= real for _, _, real, ks in shards)


def _alone(hvd, inner_kind):
    """Hierarchical on one rank: its host and cross sets are the one rank (world size 1)."""
    ps = hvd.global_process_set
    sets = HostSets(host=ps, cross=ps, position=0, hosts=1, per_host=1)
    collectives = Collectives("test.hier.group", process_set=ps)
    inner = SplitReduce(collectives, False, Regions(), "test.hier.split") if inner_kind == "split_reduce" \
        else SparseAllgather(collectives, False, name="test.hier.allgather")
    return Hierarchical(sets, inner, average=True, name=f"test.hier.{inner_kind}")


@pytest.mark.parametrize("inner_kind", ["split_reduce", "allgather"])
def test_one_rank_sends_its_topk_and_keeps_the_rest(hvd, inner_kind):
    """Alone, the host's sum is the accumulator itself: the aggregate is its top-k, ``sent`` names them,
    and acc with them zeroed is the residual (Σ sent + residual = acc exactly)."""
    transport = _alone(hvd, inner_kind)
    acc = torch.tensor([0.5, -4.0, 1.0, 3.0, -0.25, 2.0], dtype=torch.float64)
    original = acc.clone()
    started = [transport.start(key, a, 2) for key, a in (("b", acc), ("a", original.clone() * 2))]
    out = started[0].finish()
    assert sorted(out.sent.tolist()) == [1, 3]
    assert torch.equal(out.aggregate, torch.tensor([0, -4.0, 0, 3.0, 0, 0], dtype=torch.float64))
    residual = acc.index_fill_(0, out.sent, 0)
    assert torch.equal(residual + out.aggregate, original)
    assert sorted(out.selected.tolist()) == [1, 3]
    assert torch.equal(started[1].finish().aggregate, 2 * out.aggregate)     # finished with the first


def test_one_non_finite_entry_skips_the_key(hvd):
    transport = _alone(hvd, "split_reduce")
    acc = torch.tensor([1.0, float("nan"), 2.0, 0.0])
    out = transport.start("w", acc, 1).finish()
    assert out.aggregate is None


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))


def test_one_host_falls_back_to_flat_split_reduce_with_a_warning(hvd):
    """World size 1 is one host: both front doors train with the flat transport; the job is told once
    (the decision is taken once per job)."""
    host_sets._RESOLVED.clear()
    for door in ("optimizer", "topkef"):
        model = _model()
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if door == "optimizer":
                opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                                    compression=hvd_topk.TopKEF(ratio=0.1, min_numel=64),
                                                    communication="hierarchical")
            else:
                comp = hvd_topk.TopKEF(ratio=0.1, min_numel=64, communication="hierarchical",
                                       named_parameters=model.named_parameters())
                opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp)
        told = [str(w.message) for w in seen if "runs the flat transport: one host" in str(w.message)]
        assert len(told) == (1 if door == "optimizer" else 0), told
        transport = opt._hvd_topk.transports["hierarchical"] if door == "optimizer" else comp.transports.own[
            "hierarchical"]
        assert type(transport) is SplitReduce
        before = model[0].weight.detach().clone()
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        if door == "topkef":       # stock Horovod compresses nothing at world size 1: compress by hand
            sent, ctx = comp.compress(model[0].weight.grad)
            model[0].weight.grad = comp.decompress(sent, ctx)
            for q in (model[0].bias, model[2].weight, model[2].bias):
                q.grad = None
        opt.step()
        changed = int((model[0].weight != before).sum())
        assert 0 < changed <= math.ceil(0.1 * before.numel()), changed


def test_hierarchical_needs_the_global_process_set_and_a_fixed_ratio(hvd):
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="communication='hierarchical' needs the global process set"):
        hvd_topk.TopKEF(communication="hierarchical", process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="adaptive_ratio needs communication .* got communication='hierarchical'"):
        hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                      communication="hierarchical", adaptive_ratio=True)
    with pytest.raises(ValueError, match="communication must be one of .*'hierarchical'"):
        hvd_topk.TopKEF(communication="hierarchy")
