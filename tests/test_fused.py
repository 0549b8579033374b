"""Fused buckets (hvd_topk/transports/fused.py) against per-tensor sends, on real ranks, through both front
doors (tests/workers/fused.py): gradients ready in different orders on different ranks and a layer one
rank never uses; no hang, and with exact values the same parameters bit for bit whether every tensor
travels alone, in several buckets or in one; the step's time split in stats. The pure parts (the plan,
the frames) are tested here in one process."""
import pytest
import torch

from conftest import assert_identical_across_ranks, job
from hvd_topk.core.buckets import cap_numel, flag_of, frame, offsets, plan_buckets, read_frame, signature, wire_kind
from hvd_topk.core.codec import pack, unpack
from hvd_topk.core.sparsify import k_for
from hvd_topk.step.fused_plan import FusedPlan
from hvd_topk.step.stats import StepStats, hidden_share
from hvd_topk.transports.dense import DenseFP16
from hvd_topk.transports.fused import Buckets

# 3 ranks share 2 cores here, where each collective costs several times its 2-rank time (20 runs of 8
# steps: 22 s of the fast loop); 4 steps still carry residuals through 3 steps and every phase.
JOBS = {2: job(2, "fused.py"), 3: job(3, "fused.py", "--steps", 4)}
RUNS = [(door, communication) for door in ("opt", "stock") for communication in ("split_reduce", "allgather")]


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
@pytest.mark.parametrize("communication", ("split_reduce", "allgather"))
def test_global_selection_sends_an_embedding_table_alone_and_resumes_exactly(results, np, communication):
    """``selection='global'`` over an embedding table and two linear layers: every rank measures the
    table's gradient row-sparse at the first step, so it keeps its own k beside the pooled layers (two
    transports a step, where the pool alone would let the table and the layers share one k, fused into
    one exchange per phase), in both doors alike, bit for bit; the split survives a checkpoint, and a run
    resumed halfway ends where the straight run ends."""
    ranks = results(JOBS[np])
    k_table, k_pool = k_for(1024 * 16, 0.05), k_for(16 * 64 + 64 * 16, 0.05)
    halfway = 4 if np == 2 else 2                # the jobs' --steps // 2
    straight = {door: ranks[0][(door, communication, "rows", None)] for door in ("opt", "stock")}
    for door, run in straight.items():
        for stop_at in (None, halfway):
            assert_identical_across_ranks([res[(door, communication, "rows", stop_at)] for res in ranks])
            assert ranks[0][(door, communication, "rows", stop_at)]["row_sparse"] == ["emb.weight"]
        resumed = ranks[0][(door, communication, "rows", halfway)]["params"]
        for name, value in run["params"].items():
            assert torch.equal(resumed[name], value), (door, name)
            assert torch.equal(straight["stock"]["params"][name], value), (door, name)
        assert run["stats"]["sparse_tensors"] == 2, run["stats"]
        # the table and the pool travel in one fused exchange per phase, through either door
        phases = {k: v for k, v in run["stats"].items() if k.startswith("collectives_")}
        assert phases and set(phases.values()) == {1}, (door, phases)
        if door == "stock":
            # Where ranks share cores (3 ranks on 2 cores here), TopKEF's bucket leaves in the step's last
            # compress, from the second step on (and from the second after a resume: in a first step the
            # row-sparse measurement's collective blocks), and its phases are done there; else at the first
            # decompress, as before
            for stop_at in (None, halfway):
                res = ranks[0][(door, communication, "rows", stop_at)]
                shared, left = res["shared_cores"], res["left"]
                assert [sent for sent, _ in left] == [shared and step not in (0, stop_at) for step in range(len(left))], left
                assert not shared or any(drained for sent, drained in left if sent), left
        nonzero = run["first_nonzero"]
        pooled = nonzero["fc1.weight"] + nonzero["fc2.weight"]
        if communication == "split_reduce":
            # the largest k of the ranks' summed nominations (from 3 ranks the owners' shares of the k-th
            # bin round down: up to one entry per owner fewer)
            slack = 0 if np == 2 else np
            for count, k in ((nonzero["emb.weight"], k_table), (pooled, k_pool)):
                assert k - slack <= count <= k, nonzero
        else:                                    # every rank's own k, where they differ
            assert k_table <= nonzero["emb.weight"] <= np * k_table and k_pool <= pooled <= np * k_pool, nonzero


@pytest.mark.jobs(JOBS[2])
def test_drain_gives_up_at_its_deadline_while_a_rank_is_late(results):
    """``Buckets.drain`` (TopKEF's wait in its last compress) never waits past its deadline: with rank 1 a
    second late, rank 0 leaves its 0.2 s drain with the bucket still in flight, and ``finish`` then
    completes it on both ranks alike."""
    ranks = results(JOBS[2])
    late = [res["late"] for res in ranks]
    assert late[0]["in_flight"] and 0.2 <= late[0]["waited"] < 0.9, late[0]
    assert late[0]["gathered"] == late[1]["gathered"] == [0.0, 1.0], late


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
@pytest.mark.parametrize("door, communication", RUNS)
def test_fused_buckets_give_the_per_tensor_parameters_on_every_rank(results, np, door, communication):
    ranks = results(JOBS[np])
    runs = [(door, communication, "fp32", label) for label in ("alone", "buckets", "one")]
    runs.append((door, communication, "bf16", "buckets"))
    for run in runs:
        assert_identical_across_ranks([res[run] for res in ranks])
    alone = ranks[0][runs[0]]["params"]
    for run in runs[1:3]:
        for name, value in alone.items():
            assert torch.equal(ranks[0][run]["params"][name], value), (run, name)
    assert not torch.equal(ranks[0][runs[3]]["params"]["body.0.weight"], alone["body.0.weight"])   # 16 bits


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
def test_dense_fp16_sends_one_exchange_per_bucket_with_the_per_tensor_parameters(results, np):
    """Every tensor pinned to 'dense_fp16': the same parameters on every rank, and bit for bit whether each
    tensor is summed alone, in several buckets or in one (each element is added in float32 in rank
    order, wherever it lies in a bucket); on 3 ranks one exchange (an alltoall and an allgather) per
    bucket, so six per tensor alone, one in all in one bucket; on 2 ranks every tensor alone (one
    allgather each, whatever the cap); and 2 bytes an entry."""
    ranks = results(JOBS[np])
    runs = {label: ("opt", "dense_fp16", "fp16", label) for label in ("alone", "buckets", "one")}
    for run in runs.values():
        assert_identical_across_ranks([res[run] for res in ranks])
    alone = ranks[0][runs["alone"]]
    for label in ("buckets", "one"):
        for name, value in alone["params"].items():
            assert torch.equal(ranks[0][runs[label]]["params"][name], value), (label, name)
    exchanges = {label: ranks[0][run]["stats"]["collectives_exchange"] for label, run in runs.items()}
    if np == 2:
        assert exchanges == {"alone": 6, "buckets": 6, "one": 6}, exchanges
    else:
        assert exchanges["alone"] == 12 and exchanges["one"] == 2 and 2 < exchanges["buckets"] < 12, exchanges
    numel = sum(value.numel() for value in alone["params"].values())
    assert alone["stats"]["bytes_sent"] == 2 * numel, alone["stats"]        # 2 bytes an entry


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
@pytest.mark.parametrize("other", ("dense_fp16", "lowrank"))
def test_transports_of_several_phases_settle_in_one_order_on_every_rank(results, np, other):
    """Tensors pinned in turn to ``other`` and 'split_reduce', in buckets: on 3 ranks each has several
    phases, and the ranks finish the keys in other orders (odd ranks' gradients come reversed, one layer
    unused on rank 0); the job ends (no hang: ``FusedPlan.settle``; without it, 3 ranks hung) with the
    same parameters on every rank, both transports having sent."""
    ranks = results(JOBS[np])
    run = ("opt", "mixed", other, "buckets")
    assert_identical_across_ranks([res[run] for res in ranks])
    stats = ranks[0][run]["stats"]
    assert stats["collectives_gather"] >= 1 and (np == 2 or stats["collectives_split"] >= 1), stats
    assert stats["collectives_exchange"] >= 1 if other == "dense_fp16" else stats["lowrank_density"] > 0, stats


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
@pytest.mark.parametrize("door, communication", RUNS)
def test_one_collective_per_bucket_and_phase_and_the_time_split(results, np, door, communication):
    """Alone, one collective per tensor (six weights) and phase; in one bucket, one. The step's seconds
    split into its parts, which add up to the step."""
    stats = {label: results(JOBS[np])[0][(door, communication, "fp32", label)]["stats"] for label in ("alone", "one")}
    phases = ["gather"] if np <= 2 or communication == "allgather" else ["split", "hist", "gather"]
    for phase in phases:
        assert stats["one"][f"collectives_{phase}"] == 1, stats["one"]
        assert stats["alone"][f"collectives_{phase}"] == stats["alone"]["sparse_tensors"] == 6, stats["alone"]
    for s in stats.values():
        parts = ["time_compute_s", "time_select_s", "time_pack_s", "time_sync_s", "time_optimizer_s"]
        assert all(s[part] >= 0 for part in parts) and s["time_step_s"] > 0
        assert sum(s[part] for part in parts) == pytest.approx(s["time_step_s"], rel=1e-6)
        assert s["time_wait_s"] == pytest.approx(sum(s[f"time_wait_{phase}_s"] for phase in phases if
                                                     f"time_wait_{phase}_s" in s))
        assert 0.0 <= s["comm_hidden"] <= 1.0
        assert (s["time_optimizer_s"] > 0) == (door == "opt")          # TopKEF cannot see the optimizer


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("np", (2, 3))
@pytest.mark.parametrize("communication", ("split_reduce", "allgather"))
def test_both_doors_give_the_same_parameters_layerwise_and_global(results, np, communication):
    """With exact values the two front doors train alike, bit for bit: layer-wise, and with
    ``selection='global'`` (TopKEF's one top-k over the step's tensors at its first decompress, the
    optimizer's over its bucket at synchronize()), which sends one tensor and differs from layer-wise."""
    ranks = results(JOBS[np])
    for label in ("buckets", "global"):
        runs = {door: (door, communication, "fp32", label) for door in ("opt", "stock")}
        assert_identical_across_ranks([res[runs["stock"]] for res in ranks])
        opt, stock = (ranks[0][run]["params"] for run in runs.values())
        for name, value in opt.items():
            assert torch.equal(stock[name], value), (label, name)
    for door in ("opt", "stock"):
        assert ranks[0][(door, communication, "fp32", "global")]["stats"]["sparse_tensors"] == 1
        assert not torch.equal(ranks[0][(door, communication, "fp32", "global")]["params"]["body.0.weight"],
                               ranks[0][(door, communication, "fp32", "buckets")]["params"]["body.0.weight"])


def test_buckets_follow_reverse_registration_order_within_the_cap():
    """The keys reversed, cut at the cap; the first bucket at its own cap where one is given (a
    ``first_bucket_mb`` transport's)."""
    numels = {"a": 10, "b": 20, "c": 5, "d": 40}
    assert plan_buckets("abcd", numels, cap=30) == [["d"], ["c", "b"], ["a"]]
    assert plan_buckets("abcd", numels, cap=0) == [["d", "c", "b", "a"]]
    assert plan_buckets("abcd", numels, cap=1) == [["d"], ["c"], ["b"], ["a"]]
    assert plan_buckets([], numels, cap=5) == []
    # DDP's small first bucket (dense_fp16's): the last layers leave early, the rest within the cap
    assert plan_buckets("abcd", numels, cap=30, first_cap=10) == [["d"], ["c", "b"], ["a"]]
    assert plan_buckets("dcba", numels, cap=0, first_cap=10) == [["a"], ["b", "c", "d"]]
    assert plan_buckets("abcd", {"a": 1, "b": 1, "c": 1, "d": 1}, cap=3, first_cap=1) == [["d"], ["c", "b", "a"]]
    assert cap_numel(1e-9) == 1 and cap_numel(0.0) == 0 and cap_numel(1.0) == 2 ** 18
    with pytest.raises(ValueError, match="cap must be an integer >= 0"):
        plan_buckets("ab", numels, cap=-1)


def test_dense_fp16_plans_a_first_bucket_of_1_mib_where_the_others_plan_by_the_cap():
    """``FusedPlan`` gives a transport with ``first_bucket_mb`` (``DenseFP16``: its buckets carry every
    entry) a first bucket of that much float32 gradient, as DDP does; the sparse ones plan by the cap alone."""
    class Fake:
        def __init__(self, first_mb=None):
            self.buckets = Buckets("test", None)
            if first_mb is not None:
                self.first_bucket_mb = first_mb
    sparse, dense16 = Fake(), Fake(DenseFP16.first_bucket_mb)
    mib = 2 ** 18                                    # float32 elements in 1 MiB
    numels = {"a": mib, "b": mib // 2, "c": mib // 2, "d": mib // 4}
    plan = FusedPlan(lambda: [sparse, dense16])
    plan.plan(list("abcd"), numels, 25.0)
    assert sparse.buckets.members == [["d", "c", "b", "a"]]
    assert dense16.buckets.members == [["d", "c"], ["b", "a"]]
    plan.plan(list("abcd"), numels, 0.0)             # one bucket asked for: one bucket for both
    assert sparse.buckets.members == dense16.buckets.members == [["d", "c", "b", "a"]]


def test_the_wire_kind_keeps_float64_and_16_bit_accumulators_whole():
    assert wire_kind(torch.float32, "bf16") == "bf16" and wire_kind(torch.float32, "fp32") == "fp32"
    assert wire_kind(torch.float64, "bf16") == wire_kind(torch.float64, "fp32") == "fp64"
    assert wire_kind(torch.float16, "bf16") == "fp16" and wire_kind(torch.bfloat16, "fp16") == "bf16"
    assert wire_kind(torch.float16, "fp32") == "fp32"
    with pytest.raises(ValueError, match="values must be one of"):
        wire_kind(torch.float32, "int8")


def test_a_bucket_buffer_reads_back_with_its_signature_flags_and_messages():
    values = torch.tensor([3.0, -1.0, 0.5])
    starts, total = offsets([100, 20])                        # "w" at 0, "b" at 100: 120 indices
    messages = [pack(values, torch.tensor([7, 1, 99]), 0, total),
                pack(values[:1].double(), torch.tensor([starts[1] + 4]), 0, total, "fp64")]
    sig = signature("allgather", ("w", "b"), (100, 20))
    buf = torch.cat([frame(sig, [flag_of(values, True), flag_of(values, False)], messages),
                     torch.zeros(4, dtype=torch.uint8)])      # whatever follows is not read
    got_sig, flags, found, used = read_frame(buf, 2, total)
    assert used == buf.numel() - 4 and got_sig == sig and flags.tolist() == [3.0, float("inf")]
    got, at = unpack(found[0], 0, total)
    assert at.tolist() == [1, 7, 99] and got.tolist() == [-1.0, 3.0, 0.5]
    assert unpack(found[1], 0, total)[1].tolist() == [104]
    assert signature("w", 100) != signature("w", 101) != signature("b", 100)
    with pytest.raises(ValueError, match="ends inside message 1"):
        read_frame(buf[:used - 8], 2, total)
    with pytest.raises(ValueError, match="ends inside a frame"):
        read_frame(buf[:12], 2, total)


def test_hidden_share_counts_overlapping_flights_once():
    assert hidden_share([(0.0, 2.0), (1.0, 3.0)], blocked=0.0) == 1.0
    assert hidden_share([(0.0, 1.0), (2.0, 3.0)], blocked=2.0) == 0.0
    assert hidden_share([], blocked=0.0) == 0.0
    stats = StepStats(clock=iter([10.0, 11.0]).__next__)
    stats.end_step(density=0.01)
    stats.add_time("pack", 0.25)
    stats.add_collective("gather")
    stats.add_wait("gather", 0.25)
    stats.add_flight(10.0, 10.5)
    stats.end_step(density=0.01, comm_s=0.5)
    last = stats.last()
    assert last["time_step_s"] == 1.0 and last["time_compute_s"] == 0.25 and last["collectives_gather"] == 1
    assert last["time_wait_gather_s"] == 0.25 and last["comm_hidden"] == 0.5
