"""communication='auto' and the adaptive ratio: pure decisions, bad input, and real 3-rank jobs."""
import dataclasses
import math
import pickle
import random
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk import TopKEF
from hvd_topk.auto import recheck, trial as trials
from hvd_topk.auto.plans import (TRANSPORTS, Costs, HostLink, costs_from_data, costs_to_data, plan_seconds,
                                 plan_transports, tensor_seconds, trial_plans, uniform_plan)
from hvd_topk.auto.measure import time_compression
from hvd_topk.auto.recheck import choose_ratio
from hvd_topk.auto.tuner import AutoTuner
from hvd_topk.core.sparsify import topk_energies
from hvd_topk.core.wire import CODEC_ENTRY_BYTES
from hvd_topk.transports.split_reduce import SplitReduce

from testbed.pytest_jobs import job

from conftest import assert_identical_across_ranks

FAST = Costs(alpha=1e-5, beta=1e-11, select_s=1e-9, pass_s=1e-10)       # 100 GB/s-class link
SLOW = Costs(alpha=1e-4, beta=8e-8, select_s=1e-9, pass_s=1e-10)        # 100 Mbit/s
CPU_BOUND = Costs(alpha=1e-5, beta=1e-11, select_s=1e-7, pass_s=1e-9)   # fast link, slow selection


def test_tensor_seconds_hand_computed():
    # n = 1e6 fp32 (M = 4e6 B), c = 0.01, N = 4, FAST. dense ring: 6α + 1.5·Mβ.
    t = tensor_seconds(10**6, 0.01, 4, FAST)
    assert math.isclose(t["dense"], 6e-5 + 1.5 * 4e6 * 1e-11)
    # allgather: α·2 + Mc·β·3 + σn + πn (its entries packed in 4 bytes: Mc·4/4)
    assert math.isclose(t["allgather"], 2e-5 + 4e4 * 1e-11 * 3 + 1e-3 + 1e-4)
    # artopk ring: α(6 + 2) + Mcβ(1.5 + 2) + σn/N + 2πn
    assert math.isclose(t["artopk"], 8e-5 + 4e4 * 1e-11 * 3.5 + 1e-3 / 4 + 2e-4)
    # split_reduce: α·12 + 1.5·(Mc + 520)·β + σn + πn (packed as allgather's)
    assert math.isclose(t["split_reduce"], 1.2e-4 + 1.5 * (4e4 + 520) * 1e-11 + 1e-3 + 1e-4)
    # dense in fp16: 6α + 1.5·(M/2)β, and its eight passes (FP16_PASSES)
    assert math.isclose(t["dense_fp16"], 6e-5 + 1.5 * 2e6 * 1e-11 + 8e-4)
    assert tuple(t) == TRANSPORTS == ("dense", "dense_fp16", "artopk", "split_reduce", "allgather")


def test_dense_fp16_is_priced_at_its_timed_work_and_loses_to_dense_where_the_link_is_fast():
    """Costs.fp16_s (φ, timed by measure.time_compression) replaces the FP16_PASSES estimate, which
    only costs measured before φ was (fp16_s None) still use. On a fast loopback (β 1.2e-9 s/B) φ of
    5e-9 s costs more than the 2n bytes saved: dense; at 100 Mbit/s the bytes win: dense_fp16."""
    loopback = Costs(alpha=2e-5, beta=1.2e-9, select_s=2e-8, pass_s=1e-10)
    t8, timed = (tensor_seconds(10**6, 0.01, 2, loopback._replace(fp16_s=f)) for f in (None, 5e-9))
    assert timed["dense_fp16"] - t8["dense_fp16"] == pytest.approx(10**6 * (5e-9 - 8e-10), rel=1e-9)
    assert t8["dense"] > t8["dense_fp16"] and timed["dense"] < timed["dense_fp16"]
    numels = {"conv": 10**6}
    assert plan_transports(numels, 1.0, 2, loopback._replace(fp16_s=5e-9)) == {"conv": "dense"}
    assert plan_transports(numels, 1.0, 2, SLOW._replace(fp16_s=5e-9)) == {"conv": "dense_fp16"}
    assert costs_from_data(costs_to_data(SLOW._replace(fp16_s=5e-9))).fp16_s == 5e-9
    assert costs_from_data(costs_to_data(SLOW)[:7]) == SLOW                     # an older checkpoint


def test_time_compression_times_dense_fp16s_own_work_above_one_pass():
    """φ is dense_fp16's encoding, residual, adds and scale (each allocating), not one in-place pass:
    several times π. A priced-at-one-pass φ (the fast-link regression's cause) would fail here."""
    select_s, pass_s, matmul_s, fp16_s = time_compression({"w": 1 << 18}, 0.01, time.perf_counter)
    assert min(select_s, pass_s, matmul_s, fp16_s) > 0 and fp16_s > 3 * pass_s


def test_plan_picks_allgather_tiny_density_fast_link_and_split_reduce_slow_many():
    assert plan_transports({"w": 10**7}, 1e-4, 4, FAST._replace(select_s=0, pass_s=0)) == {"w": "allgather"}
    # 100 Mbit/s, 64 ranks: split_reduce's bytes, flat in N, beat AR-Topk's index broadcast (log N)
    assert plan_transports({"w": 10**7}, 0.05, 64, SLOW) == {"w": "split_reduce"}
    # ... and on 2 ranks split_reduce is one allgather of 4-byte entries: one message and half AR-Topk's bytes
    assert plan_transports({"w": 10**7}, 0.05, 2, SLOW) == {"w": "split_reduce"}
    # Selection costs more than a fast link saves: dense.
    assert plan_transports({"w": 10**6}, 0.01, 2, CPU_BOUND) == {"w": "dense"}
    # Ties go to dense (N = 1: nothing to send, selection still costs).
    assert plan_transports({"w": 10**6}, 0.01, 1, SLOW) == {"w": "dense"}


def test_plan_seconds_sums_tensors():
    numels = {"a": 10**6, "b": 10**5}
    plan = {"a": "artopk", "b": "dense"}
    want = tensor_seconds(10**6, 0.01, 4, SLOW)["artopk"] + tensor_seconds(10**5, 0.01, 4, SLOW)["dense"]
    assert math.isclose(plan_seconds(numels, plan, 0.01, 4, SLOW), want)


def test_trial_plans_are_the_models_plan_and_the_plausible_uniform_ones():
    numels = {"w": 10 ** 6, "v": 10 ** 5}
    slow = trial_plans(numels, 0.01, 4, SLOW)
    assert slow[0] == plan_transports(numels, 0.01, 4, SLOW)
    assert {"w": "dense", "v": "dense"} not in slow            # 100 Mbit/s: dense is far off, not tried
    assert len(slow) == len({tuple(sorted(p.items())) for p in slow})
    for plan in slow[1:]:
        assert len(set(plan.values())) == 1
        assert plan_seconds(numels, plan, 0.01, 4, SLOW) <= 4 * plan_seconds(numels, slow[0], 0.01, 4, SLOW)
    assert {"w": "split_reduce", "v": "split_reduce"} in slow         # a uniform plan of the new transport
    # a fast link: dense is the model's choice, artopk is modelled 3.5x dearer (tried), dense in fp16 5.6x
    # (its passes cost more than the bytes it saves) and allgather 6.7x (not)
    dense, artopk = {"w": "dense", "v": "dense"}, {"w": "artopk", "v": "artopk"}
    assert trial_plans(numels, 0.01, 4, FAST) == [dense, artopk]
    assert trial_plans(numels, 0.01, 4, FAST, span=3.0) == [dense]
    # an expensive selection: everything sparse is modelled > 100x dearer, nothing to measure
    assert trial_plans(numels, 0.01, 4, CPU_BOUND) == [dense]


def test_a_compute_bound_step_puts_the_dense_plans_on_trial():
    """At 100 Mbit/s dense's communication is modelled 63x the model's plan's and fp16's 31x: not tried.
    Where the step's measured part outside communication dominates, their whole steps (that part, plus
    their seconds beyond the 2/3 of it the backward pass hides: BACKWARD_SHARE) are modelled within 1.5x
    (WHOLE_STEP_SPAN) of the plan's, and they are measured; the others are tried as before."""
    numels = {"w": 10 ** 6, "v": 10 ** 5}
    plan = plan_transports(numels, 0.01, 4, SLOW)
    comm = [plan_seconds(numels, uniform_plan(numels, m), 0.01, 4, SLOW) for m in ("dense", "dense_fp16")]
    base = plan_seconds(numels, plan, 0.01, 4, SLOW)
    assert comm[0] > 60 * base and comm[1] > 30 * base
    sparse = trial_plans(numels, 0.01, 4, SLOW)
    assert trial_plans(numels, 0.01, 4, SLOW, fixed_s=0.2) == sparse          # 0.2 s: fp16's step 1.67x
    assert trial_plans(numels, 0.01, 4, SLOW, fixed_s=0.3) == sparse[:1] + [uniform_plan(numels, "dense_fp16")] + \
        sparse[1:]                                                            # 0.3 s: fp16's 1.22x, dense's 2.1x
    assert trial_plans(numels, 0.01, 4, SLOW, fixed_s=0.5) == sparse[:1] + \
        [uniform_plan(numels, "dense"), uniform_plan(numels, "dense_fp16")] + sparse[1:]      # dense's 1.39x


def test_between_dense_plans_the_trial_span_is_the_clear_gap():
    """At density 0.7 on 2 ranks and 100 Mbit/s the model sends everything in fp16. All artopk is modelled
    2.8x dearer and is tried (TRIAL_SPAN: its selection may lose to CPU competition by that much); all
    dense is modelled 2.0x, its bytes twice fp16's through the same allreduce, beyond the clear gap
    (WHOLE_STEP_SPAN), and is not; a compute-bound step that hides its bytes puts it back on trial."""
    numels = {"w": 10 ** 6, "v": 10 ** 5}
    fp16, dense, artopk = (uniform_plan(numels, m) for m in ("dense_fp16", "dense", "artopk"))
    assert plan_transports(numels, 0.7, 2, SLOW) == fp16
    artopk_ratio = plan_seconds(numels, artopk, 0.7, 2, SLOW) / plan_seconds(numels, fp16, 0.7, 2, SLOW)
    plans = trial_plans(numels, 0.7, 2, SLOW)
    assert plans[0] == fp16 and artopk in plans and dense not in plans
    # ``span`` governs the plans of the compressed transports only: dense stays out even at 10x, while
    # artopk leaves at a span just under its modelled ratio
    assert dense not in trial_plans(numels, 0.7, 2, SLOW, span=10.0)
    assert artopk not in trial_plans(numels, 0.7, 2, SLOW, span=0.99 * artopk_ratio)
    assert dense in trial_plans(numels, 0.7, 2, SLOW, fixed_s=1.0)


# 2 hosts x 2 ranks: a fast link within each host, 100 Mbit/s shared by both positions between them
ACROSS = SLOW._replace(hosts=HostLink(hosts=2, per_host=2, host_alpha=1e-5, host_beta=1e-10, cross_alpha=1e-4,
                                      cross_beta=1.6e-7))


def test_hierarchical_is_modelled_across_hosts_only_and_wins_where_the_link_between_is_slow():
    assert "hierarchical" not in tensor_seconds(10**6, 0.01, 4, SLOW)
    # n = 1e6 (M = 4e6 B), c = 0.01, L = H = 2, r = 1. Host reduce-scatter: α_h + M/2·β_h; across the
    # hosts split_reduce of the 2 MB shard on 2 ranks, one allgather of 4-byte entries: α_x + Mc/2·β_x;
    # host allgather of the kept rows: 2α_h + Mc/2·3·β_h; one shard's selection σn/2 and two passes 2πn.
    want = (1e-5 + 2e6 * 1e-10) + (1e-4 + 2e4 * 1.6e-7) + (2e-5 + 2e4 * 3 * 1e-10) + 1e-3 / 2 + 2e-4
    assert math.isclose(tensor_seconds(10**6, 0.01, 4, ACROSS)["hierarchical"], want)
    assert plan_transports({"w": 10**7}, 0.01, 4, ACROSS) == {"w": "hierarchical"}
    assert {"w": "hierarchical"} in trial_plans({"w": 10**7}, 0.01, 4, ACROSS)
    # the link within the hosts as slow as the one between: the host's dense phase costs more than it saves
    flat = ACROSS._replace(hosts=ACROSS.hosts._replace(host_alpha=1e-4, host_beta=1.6e-7))
    assert plan_transports({"w": 10**7}, 0.01, 4, flat) == {"w": "split_reduce"}
    assert {"w": "hierarchical"} not in trial_plans({"w": 10**7}, 0.01, 4, flat)


def test_the_model_prices_split_reduces_gather_at_its_budget():
    """Costs.budget (TopKSettings'): None, the default, gathers one k per 4 ranks; a number as given."""
    k1, default, four = (tensor_seconds(10**6, 0.01, 8, SLOW._replace(budget=b))["split_reduce"] for b in (1, None, 4))
    entries = 10**6 * 0.01 * CODEC_ENTRY_BYTES["bf16"]      # Mc·e/4 bytes at 4-byte values
    assert default - k1 == pytest.approx(7 / 8 * entries * SLOW.beta, rel=1e-9)          # 2k at 8 ranks
    assert four - k1 == pytest.approx(3 * 7 / 8 * entries * SLOW.beta, rel=1e-9)
    assert tensor_seconds(10**6, 0.01, 4, SLOW) == tensor_seconds(10**6, 0.01, 4, SLOW._replace(budget=1))
    assert costs_from_data(costs_to_data(SLOW._replace(budget=2.0))).budget == 2.0


def test_costs_with_both_links_survive_a_checkpoint_and_old_ones_load():
    assert costs_from_data(costs_to_data(ACROSS)) == ACROSS
    assert costs_from_data(costs_to_data(SLOW)) == SLOW and costs_from_data(None) is None
    assert costs_from_data((1e-4, 8e-8, 1e-9, 1e-10)) == SLOW          # written before hosts existed
    assert costs_to_data(ACROSS)[4] == (2, 2, 1e-5, 1e-10, 1e-4, 1.6e-7)


class State:                                          # what the tuner reads of the optimizer
    sparse_numels, ratio, communication = {"w": 4096}, 0.01, "artopk"
    transports = {"split_reduce": SplitReduce(None, True, None, "state")}      # its budget: the default
    clock = staticmethod(time.perf_counter)

    @staticmethod
    def density(step):
        return 0.01


def run_trial(tuner, arms, step_s, first=1, limit=500):
    """Feed the tuner's trial of ``arms`` the step times ``step_s(step, mode)``; the modes run, in order."""
    tuner.costs = SLOW
    tuner.start_trial(arms)
    seen = []
    for step in range(first, first + limit):
        mode = tuner.plan["w"]
        seen.append(mode)
        assert tuner.end_step(State, step, step_s(step, mode), 0.0) is None
        if tuner.trial is None:
            return seen
    raise AssertionError(f"the trial did not end in {limit} steps")


@pytest.mark.parametrize("slow, rounds", [(1.4, 3), (3.0, 2)])
def test_trial_plans_take_turns_and_the_fastest_is_kept(hvd, slow, rounds):
    """No noise. Plans 1.4x and 1.2x the fastest's step: the fewest rounds, then the t-test shows them
    slower. 3x and 2x: more than CLEAR_GAP in each of 2 counted rounds, out before the fewest rounds."""
    tuner = AutoTuner(True, None, trial_steps=3, trial_rounds=4)      # the first round is not counted
    arms = [{"w": "artopk"}, {"w": "allgather"}, {"w": "dense"}]
    times = {"artopk": 0.1 * slow, "allgather": 0.1, "dense": 0.1 + 0.1 * (slow - 1) / 2}
    seen = run_trial(tuner, arms, lambda step, mode: times[mode] + (5.0 if (step - 5) % 3 == 0 else 0.0), first=5)
    warmup = ["artopk"] * 2 + ["allgather"] * 2 + ["dense"] * 2              # the first round's turns: 2 steps
    assert seen == warmup + (["artopk"] * 3 + ["allgather"] * 3 + ["dense"] * 3) * rounds
    assert tuner.trial is None and tuner.plan == {"w": "allgather"}
    reason = tuner.history[-1][3]
    assert reason.startswith(f"trial, {rounds} counted rounds: ")
    assert "all allgather 100.0 ms/step" in reason
    assert f"all artopk {100 * slow:.1f} ms/step (out after {rounds})" in reason
    assert reason.endswith("kept all allgather")


def test_trial_goes_on_while_a_slow_spell_leaves_the_order_open(hvd):
    """A slow spell of the host in one turn makes the rounds disagree: the plan shown slower by more
    than the margin leaves, the other two take turns until the spell is outweighed."""
    tuner = AutoTuner(True, None, trial_steps=3, trial_rounds=4)
    arms = [{"w": "artopk"}, {"w": "allgather"}, {"w": "dense"}]
    times = {"artopk": 0.3, "allgather": 0.1, "dense": 0.2}
    seen = run_trial(tuner, arms, lambda step, mode: times[mode] + (0.5 if 14 <= step < 17 else 0.0), first=5)
    assert seen[9:12] == ["allgather"] * 3                            # the spell: allgather's 2nd turn
    assert len(seen) > 33                                             # beyond the fewest rounds
    assert seen[33:] == (["allgather"] * 3 + ["dense"] * 3) * ((len(seen) - 33) // 6)   # artopk out
    assert tuner.plan == {"w": "allgather"}
    assert tuner.history[-1][3].endswith("kept all allgather")


def test_trial_with_equal_plans_ends_at_the_most_rounds(hvd):
    tuner = AutoTuner(True, None, trial_steps=2, trial_rounds=3, trial_max_rounds=7)
    arms = [{"w": "artopk"}, {"w": "allgather"}]
    noise = [0.0, 0.03, -0.02, 0.05, 0.01, -0.04, 0.02]               # the same host, turn by turn
    seen = run_trial(tuner, arms, lambda step, mode: 0.1 + noise[((step - 1) // 2) % 7])
    assert len(seen) == 7 * 2 * 2
    assert tuner.history[-1][3].startswith("trial, 6 counted rounds: ")


def test_trial_stops_early_on_a_clear_gap_in_noise(hvd):
    """Plans 10% apart in a noisy host: settled long before the most rounds, the fast one kept."""
    tuner = AutoTuner(True, None, trial_steps=3, trial_rounds=4, trial_max_rounds=40)
    arms = [{"w": "allgather"}, {"w": "artopk"}]
    rng = random.Random(3)
    seen = run_trial(tuner, arms, lambda step, mode: {"artopk": 0.08, "allgather": 0.088}[mode]
                     * (1 + rng.uniform(-0.15, 0.15)))
    assert tuner.plan == {"w": "artopk"}
    assert len(seen) < 40 * 6


@pytest.mark.parametrize("step_s, kept", [
    ({"artopk": 0.100, "allgather": 0.097, "dense": 0.101}, "dense"),      # dense within 5%: exact wins
    ({"artopk": 0.100, "allgather": 0.097, "dense": 0.200}, "allgather"),  # among sparse plans the fastest
    ({"artopk": 0.100, "allgather": 0.094, "dense": 0.0995}, "allgather"), # a lead over dense beyond 5% counts
    ({"artopk": 0.100, "allgather": 0.110, "dense": 0.104}, "dense"),
])
def test_trial_lead_over_dense_within_the_margin_keeps_dense(hvd, step_s, kept):
    tuner = AutoTuner(True, None, trial_steps=2, trial_rounds=3)
    arms = [{"w": "artopk"}, {"w": "allgather"}, {"w": "dense"}]      # arms[0]: the model's plan
    run_trial(tuner, arms, lambda step, mode: step_s[mode])
    assert tuner.trial is None and tuner.plan == {"w": kept}


def test_trial_does_not_count_the_first_round(hvd):
    """Each transport's first turn (buffers allocated, index pipeline started) is not measured."""
    tuner = AutoTuner(True, None, trial_steps=2, trial_rounds=3)
    arms = [{"w": "allgather"}, {"w": "artopk"}]
    run_trial(tuner, arms, lambda step, mode: 0.5 if step <= 4 and mode == "artopk"
              else {"artopk": 0.08, "allgather": 0.1}[mode])
    assert tuner.trial is None and tuner.plan == {"w": "artopk"}


@pytest.mark.parametrize("plan, pin, trial, released, removed", [
    ({"w": "artopk"}, {}, None, True, True),                        # nothing hierarchical: let go
    ({"w": "artopk"}, {}, None, False, False),                      # release refused (registered sets)
    ({"w": "hierarchical"}, {}, None, True, False),                 # in effect
    ({"w": "artopk"}, {"b": "hierarchical"}, None, True, False),    # pinned
    ({"w": "artopk"}, {}, [{"w": "artopk"}, {"w": "hierarchical"}], True, False),    # on trial
])
def test_auto_lets_the_host_sets_go_once_no_plan_holds_hierarchical(hvd, monkeypatch, plan, pin, trial, released,
                                                                      removed):
    """Across hosts the tuner asks ``host_sets.release`` for its sets at the end of a step where neither
    the plan in effect, nor a pin, nor a plan on trial holds hierarchical; where they are removed it
    holds none (later probes leave hierarchical out) and this step's history entry says so; it asks
    again at the next step where they were not."""
    calls = []
    monkeypatch.setattr("hvd_topk.auto.decide.release", lambda sets: calls.append(sets) or released)
    tuner = AutoTuner(True, None, every=50)
    tuner.costs, tuner.hosts, tuner.plan = SLOW, "the sets", dict(plan)
    if trial is not None:
        tuner.start_trial(trial)
        tuner.plan = dict(plan)
    state = type("PinnedState", (State,), {"pin": pin})
    tuner.history.append((7, 0.01, {}, "trial, 4 counted rounds: ...; kept all artopk"))
    for step in (7, 8):
        tuner.end_step(state, step, 0.1, 0.0)
    asked = trial is None and "hierarchical" not in plan.values() and not pin
    assert calls == (["the sets"] if removed else ["the sets"] * 2 if asked else [])
    assert tuner.hosts == (None if removed else "the sets")
    reasons = [entry[3] for entry in tuner.history]
    assert reasons == (["trial, 4 counted rounds: ...; kept all artopk; the hosts' process sets removed: no plan "
                        "holds hierarchical"] if removed else ["trial, 4 counted rounds: ...; kept all artopk"])


def test_trial_settings_are_checked():
    for kw in ({"trial_steps": 1}, {"trial_rounds": 2}, {"trial_rounds": 5, "trial_max_rounds": 4}):
        with pytest.raises(ValueError, match=r"trial_(steps|rounds|max_rounds) must be an integer >= "):
            AutoTuner(True, None, **kw)


def test_drift_reprobes_only_when_two_checks_in_a_row_drift_the_same_way(hvd):
    tuner = AutoTuner(True, None, every=2)
    tuner.costs, tuner.plan, tuner.last_probe_check = SLOW, {"w": "artopk"}, 0
    probes = []
    tuner._probe = lambda state, step, reason, fixed_s: probes.append((step, reason))
    modelled = plan_seconds(State.sparse_numels, tuner.plan, 0.01, 1, SLOW)

    def check(step, factor):
        tuner.comm_times, tuner.step_times = [factor * modelled], [0.1]
        tuner._check(State, step)

    check(1, 1.0)                          # calibration
    check(9, 2.0)                          # one slow spell: up
    check(11, 1.0)                         # gone
    check(13, 0.4)                         # down ...
    check(15, 2.0)                         # ... then up: not the same way
    assert probes == []
    check(17, 2.1)                         # up twice in a row: a new network
    assert probes == [(17, "drift x2.10 at two checks")]


def test_reprobe_without_a_bandwidth_term_keeps_the_last_fit(hvd):
    from hvd_topk.auto.probe import ProbeResult

    def fit(alpha, beta):
        return ProbeResult(alpha, beta, alpha, beta, "allreduce", 2, (4, 64), (1e-4, 1e-4), 0.1)

    class FakeProbe:
        fits = iter([fit(1e-4, 2e-9), fit(5e-4, 0.0), fit(3e-4, 4e-9)])

        def run(self):
            return next(self.fits)

    tuner = AutoTuner(True, None, probe=FakeProbe())
    tuner._probe(State, 0, reason="start")
    assert (tuner.costs.alpha, tuner.costs.beta) == (1e-4, 2e-9)
    tuner._probe(State, 50, reason="drift")               # no bandwidth term: noise, the last fit stays
    assert (tuner.costs.alpha, tuner.costs.beta) == (1e-4, 2e-9)
    assert "last alpha/beta kept" in tuner.history[-1][3]
    tuner._probe(State, 100, reason="drift")              # a real fit replaces it
    assert (tuner.costs.alpha, tuner.costs.beta) == (3e-4, 4e-9)


def test_a_reprobe_leaves_out_the_plans_a_trial_dropped_by_quality(hvd):
    """A drift re-probe tries the plans again, but not those a trial dropped by their quality (G): the
    drift is the network's, their G is not, and each turn of theirs would train with them. The model's
    plan stays in; the dropped plans survive a checkpoint."""
    from hvd_topk.auto.probe import ProbeResult

    class FakeProbe:
        def run(self):
            return ProbeResult(1e-4, 2e-9, 1e-4, 2e-9, "allreduce", 2, (4, 64), (1e-4, 1e-4), 0.1)

    model, topk, other = {"w": "lowrank"}, {"w": "artopk"}, {"w": "split_reduce"}
    tuner = AutoTuner(True, None, weight=1.0, trial_steps=2, trial_rounds=3, probe=FakeProbe())
    tuner.quality = {"w": {"energy": 1.0, "topk": 0.41, "lowrank": 0.96}}
    run_trial(tuner, [model, topk], lambda step, mode: {"lowrank": 0.2, "artopk": 0.18}[mode])
    assert tuner.plan == model and tuner.out_by_quality == [topk]       # out after one counted round
    tuner._plans = lambda numels, density, n, fixed_s: (model, [model, topk, other])
    tuner._probe(State, 50, reason="drift")
    assert tuner.trial.arms == [model, other]
    tuner.out_by_quality = [topk, other]
    tuner._probe(State, 100, reason="drift")
    assert tuner.trial is None and tuner.plan == model                   # the model's plan alone: no trial
    restored = AutoTuner(True, None)
    restored.load_state_dict(tuner.state_dict())
    assert restored.out_by_quality == [topk, other]


def test_choose_ratio_objective_and_hysteresis():
    times = {0.1: 0.5, 0.01: 0.06, 0.001: 0.02}
    gains = {0.1: 0.6, 0.01: 0.1, 0.001: 0.01}
    # J(w=0.5): 0.1 -> 0.645, 0.01 -> 0.190, 0.001 -> 0.2
    assert choose_ratio(0.1, times, gains, weight=0.5) == 0.01
    near = {**times, 0.001: 0.0195}                              # J(0.001) = 0.195
    assert choose_ratio(0.001, near, gains, weight=0.5) == 0.001       # 0.190 vs 0.195: within 5%, stay
    assert choose_ratio(0.1, times, gains, weight=0.0) == 0.001        # time alone
    assert choose_ratio(0.001, times, gains, weight=1.0) == 0.01       # J: 0.83, 0.6, 2.0
    assert choose_ratio(0.01, times, {0.1: 0.0, 0.01: 0.0, 0.001: 0.0}) == 0.01   # no gain data


# -- the pure decisions, without Horovod ----------------------------------------------------------

def test_decision_modules_import_neither_horovod_nor_torch():
    code = ("import sys, hvd_topk.auto.plans, hvd_topk.auto.trial, hvd_topk.auto.recheck; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('horovod', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


ARMS = [{"w": "artopk"}, {"w": "allgather"}, {"w": "dense"}]


def test_trial_turns_skip_their_first_step_and_rotate():
    trial = trials.new_trial(ARMS)
    assert trials.on_turn(trial) == 0 and not trials.counts_round(trial)    # the first round: first uses
    trial = trials.record_step(trial, 5.0)
    assert not trials.turn_over(trial, 3)
    assert trials.turn_over(trials.record_step(trial, 0.1), 3)              # its turns: 2 steps
    trial = dataclasses.replace(trials.new_trial(ARMS), rounds=1)           # a counted round
    for s in (5.0, 0.1, 0.2):                                 # 5.0: the switch, not counted
        assert not trials.turn_over(trial, 3)
        trial = trials.record_step(trial, s)
    assert trials.turn_over(trial, 3)
    trial, round_over = trials.end_turn(trial)
    assert not round_over and trial.turn_times == [] and trial.round_means == [pytest.approx(0.15)]
    assert trials.on_turn(trial) == 1 and trials.counts_round(trial)


def test_verdict_drops_the_clearly_slower_plans_and_settles():
    means = [[0.100, 0.101, 0.099], [0.200, 0.210, 0.190], [0.130, 0.131, 0.129]]
    assert trials.verdict(ARMS, means, [0, 1, 2]) == trials.Verdict(active=[0], settled=True, kept=0)


@pytest.mark.parametrize("dense_s, active, kept", [
    (0.103, [0, 2], 2),          # a lead over dense within the 5% margin: dense kept, exact
    (0.106, [0], 0),             # beyond the margin: dense is out, the fastest kept
])
def test_verdict_dense_tie(dense_s, active, kept):
    means = [[0.100] * 3, [0.200] * 3, [dense_s] * 3]
    assert trials.verdict(ARMS, means, [0, 1, 2]) == trials.Verdict(active, True, kept)


@pytest.mark.parametrize("fp16_s, dense_s, kept", [
    (0.103, 0.200, 2),           # dense in fp16 within the margin of the fastest (low rank): kept
    (0.103, 0.104, 3),           # dense too: dense first, exact
    (0.106, 0.200, 0),           # beyond the margin: the fastest
])
def test_verdict_dense_fp16_tie(fp16_s, dense_s, kept):
    arms = [{"w": "lowrank"}, {"w": "artopk"}, {"w": "dense_fp16"}, {"w": "dense"}]
    means = [[0.100] * 3, [0.200] * 3, [fp16_s] * 3, [dense_s] * 3]
    assert trials.verdict(arms, means, [0, 1, 2, 3]).kept == kept


def test_verdict_stays_open_while_the_rounds_disagree():
    arms = ARMS[:2]
    noisy = [[0.10, 0.12, 0.09], [0.11, 0.09, 0.12]]
    assert trials.verdict(arms, noisy, [0, 1]) == trials.Verdict([0, 1], False, 0)
    assert trials.verdict(arms, [[0.1], [0.2]], [0, 1]).settled is False     # one counted round: no spread


def test_end_round_counts_from_the_second_round_and_ends_at_the_most_rounds():
    arms = ARMS[:2]
    trial = trials.Trial(arms, [0, 1], [[], []], rounds=0, round_means=[0.5, 0.1])
    trial, kept = trials.end_round(trial, None, trial_rounds=3, max_rounds=5)
    assert (trial.rounds, trial.means, trial.round_means, kept) == (1, [[], []], [], None)
    open_trial = trials.Trial(arms, [0, 1], [[0.10, 0.12, 0.09], [0.11, 0.09, 0.12]], rounds=4,
                              round_means=[0.1, 0.1])
    trial, kept = trials.end_round(open_trial, [0.1, 0.1], trial_rounds=3, max_rounds=6)
    assert trial.rounds == 5 and trial.means[1][-1] == 0.1 and kept is None       # not settled: goes on
    trial, kept = trials.end_round(open_trial, [0.1, 0.1], trial_rounds=3, max_rounds=5)
    assert trial.active == [0, 1] and kept == 0                                 # the most rounds: ends
    assert trials.summary(trial, kept).startswith("trial, 4 counted rounds: all artopk 102.5 ms/step")
    assert trials.summary(trial, kept, [0.5, 0.25]).startswith(      # quality weighed: each plan's G too
        "trial, 4 counted rounds: all artopk 102.5 ms/step at G 0.50, all allgather 105.0 ms/step at G 0.25;")
    early = trials.Trial(arms, [0, 1], [[0.1], [0.13]], rounds=1)
    assert trials.end_round(early, [0.1, 0.13], trial_rounds=3, max_rounds=5)[1] is None  # too few rounds
    trial, kept = trials.end_round(trials.Trial(arms, [0, 1], [[0.1], [0.3]], rounds=1), [0.1, 0.3], 3, 5)
    assert (trial.active, kept) == ([0], 0)                  # 3x the fastest twice: out, the trial over
    trial, kept = trials.end_round(trials.Trial(arms, [0, 1], [[0.1], [0.3]], rounds=1), [0.1, 0.3], 3, 5,
                                   scales=[3.0, 1.0])        # weighed by G, the two are alike: no gap
    assert (trial.active, kept) == ([0, 1], None)


def test_end_round_drops_a_plan_that_loses_by_quality_alone_after_one_counted_round():
    """Low rank (G 0.96) and Top-K (G 0.41) at w = 1, as across 2 emulated hosts: Top-K's step is the
    fastest, yet at that step its J is 2x low rank's, so it leaves after the first counted round. A
    plan at G 0.76 could still win on its step: it stays, and so does every plan without scales."""
    arms = [{"w": "lowrank"}, {"w": "artopk"}, {"w": "split_reduce"}]
    first = trials.Trial(arms, [0, 1, 2], [[], [], []], rounds=1)
    measured = [0.207, 0.1785, 0.202]
    trial, kept = trials.end_round(first, measured, 5, 10, scales=[1 / 0.96, 1 / 0.41, 1 / 0.76])
    assert (trial.active, kept, trial.out_by_quality) == ([0, 2], None, [1])
    trial, kept = trials.end_round(first, measured, 5, 10, scales=[1 / 0.96, 1 / 0.41, 1 / 0.41])
    assert (trial.active, kept) == ([0], 0)                         # one plan left: the trial is over
    assert trial.out_by_quality == [1, 2]
    assert trials.end_round(first, measured, 5, 10)[0].active == [0, 1, 2]
    assert trials.quality_gaps([[], []], [1.0, 3.0], [0, 1]) == [0, 1]      # no counted round yet


def test_drift_rule_two_checks_in_a_row_the_same_way():
    cal = recheck.drift_check(0.02, 0.01, None, 0, 0.5, True)
    assert cal == recheck.Drift(2.0, 0, False, None)                # the first check calibrates
    sign, seen = 0, []
    for factor in (2.0, 1.0, 0.4, 2.0, 2.1):
        d = recheck.drift_check(factor * 0.02, 0.01, 2.0, sign, 0.5, True)
        sign = d.sign
        seen.append((d.sign, d.reprobe))
    assert seen == [(1, False), (0, False), (-1, False), (1, False), (0, True)]
    assert recheck.drift_check(0.08, 0.01, 2.0, 1, 0.5, False) == recheck.Drift(2.0, 1, False, None)
    assert recheck.probe_is_old(9, 1, 2) and not recheck.probe_is_old(8, 1, 2)  # 4 checks of 2 steps


def test_ratio_check_arithmetic():
    assert recheck.check_row([0.1, 0.3], [], None, 2) == [pytest.approx(0.2), 0.0, 0.0, 0.0, 0.0]
    assert recheck.check_row([], [0.1], [1.0, 2.0, 4.0], 2) == [0.0, 0.1, 1.0, 2.0, 4.0]
    assert recheck.check_row([0.1], [0.1], [1.0], 2)[2:] == [0.0] * 3         # no compressed tensor
    assert recheck.gain_fractions((0.1, 0.01), [2.0, 1.0, 4.0]) == {0.1: 0.5, 0.01: 0.25}
    assert recheck.gain_fractions((0.1, 0.01), [0.0, 0.0, 0.0]) is None
    assert recheck.gain_fractions(None, []) is None
    numels, densities = {"w": 10**6, "v": 10**5}, {0.1: 0.1, 0.01: 0.01}
    dense = recheck.ratio_step_seconds(0.5, 0.2, numels, densities, 4, SLOW, fixed="dense")
    assert dense == {0.1: pytest.approx(0.5 - 0.2 + plan_seconds(numels, {"w": "dense", "v": "dense"}, 0.1, 4, SLOW)),
                     0.01: dense[0.1]}
    model = recheck.ratio_step_seconds(0.5, 0.2, numels, densities, 4, SLOW)
    for c, d in densities.items():
        assert model[c] == max(0.0, 0.5 - 0.2 + plan_seconds(numels, plan_transports(numels, d, 4, SLOW), d, 4, SLOW))
    assert recheck.ratio_step_seconds(0.0, 10.0, numels, densities, 4, SLOW)[0.01] == 0.0   # never < 0


# -- a checkpoint taken during a trial ---------------------------------------------------------------

class Solo:
    """One rank and no Horovod: the tuner's world, agreeing with itself."""

    @staticmethod
    def agree(values, name):
        return [float(v) for v in values]

    @staticmethod
    def size():
        return 1

    @staticmethod
    def rank():
        return 0


TRIAL_KW = dict(trial_steps=3, trial_rounds=4, trial_max_rounds=12)
_RNG = random.Random(5)
NOISE = [_RNG.uniform(-0.2, 0.2) for _ in range(400)]


def scripted(step, mode):
    """Step times of a noisy host: dense leaves after the fewest rounds (step 34), the two sparse plans
    take turns until step 69."""
    return {"artopk": 0.100, "allgather": 0.104, "dense": 0.140}[mode] * (1 + NOISE[step])


def solo_tuner():
    tuner = AutoTuner(True, None, **TRIAL_KW)
    tuner.world = Solo()
    return tuner


def feed(tuner, steps):
    """The plan of every step of ``steps`` and the tuner's answers, fed the scripted times."""
    seen = []
    for step in steps:
        seen.append(dict(tuner.plan))
        assert tuner.end_step(State, step, scripted(step, tuner.plan["w"]), 0.01) is None
    return seen


def mid_trial(stop):
    tuner = solo_tuner()
    tuner.costs = SLOW
    tuner.start_trial(ARMS)
    feed(tuner, range(1, stop))
    assert tuner.trial is not None
    return tuner


# in the first round, at a round's start, mid-turn, just after dense left, in the last turn
@pytest.mark.parametrize("stop", [2, 7, 11, 25, 34, 50, 67])
def test_checkpoint_mid_trial_continues_the_trial(stop):
    """A tuner checkpointed during a trial and loaded into a fresh one takes the plans the tuner that
    went on would have, and ends the trial with the same verdict at the same step."""
    ref = mid_trial(1)
    plans = feed(ref, range(1, 120))
    counts = {"dense": 0, "dense_fp16": 0, "artopk": 1, "split_reduce": 0, "allgather": 0}
    assert ref.trial is None and ref.history == [(69, 0.01, counts, (
        "trial, 9 counted rounds: all artopk 96.2 ms/step, all allgather 101.5 ms/step, "
        "all dense 141.2 ms/step (out after 3); kept all artopk"))]
    saved = pickle.loads(pickle.dumps(mid_trial(stop).state_dict()))    # plain data
    resumed = solo_tuner()
    resumed.load_state_dict(saved)
    assert feed(resumed, range(stop, 120)) == plans[stop - 1:]
    assert (resumed.plan, resumed.history, resumed.trial) == (ref.plan, ref.history, ref.trial)
    assert resumed.state_dict() == ref.state_dict()


def test_old_checkpoint_loads_without_its_trial():
    """A checkpoint of plan, costs and history only (the format before trials were saved) loads as it
    did: the plan on its turn stays, as if chosen, and the trial is not continued."""
    tuner = mid_trial(23)
    old = {k: tuner.state_dict()[k] for k in ("plan", "costs", "history")}
    resumed = solo_tuner()
    resumed.load_state_dict(old)
    assert (resumed.plan, resumed.costs, resumed.trial) == (tuner.plan, SLOW, None)
    ref = mid_trial(1)
    plans = feed(ref, range(1, 120))
    assert feed(resumed, range(23, 120)) != plans[22:]


def test_topk_energies_match_brute_force():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    ks = [1, 10, 100, 1000, 10_000]
    sq = torch.sort(x.double() ** 2, descending=True).values
    for k, e in zip(ks, topk_energies(x, ks)):
        assert math.isclose(e, float(sq[:k].sum()), rel_tol=1e-9)
    with pytest.raises(ValueError, match="ks must be ints"):
        topk_energies(x, [10_001])


def make(hvd, **kw):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kw)


@pytest.mark.parametrize("kw,match", [
    ({"adaptive_ratio": (0.1, 0.001)}, r"adaptive_ratio must be None, True or \(low, high\)"),
    ({"adaptive_ratio": "yes"}, r"adaptive_ratio must be None, True or \(low, high\)"),
    ({"adaptive_ratio": (0.0, 0.1)}, r"0 < low <= high <= 1"),
    ({"adaptive_ratio": True, "communication": "dense"}, "adaptive_ratio needs communication"),
    ({"adaptive_ratio": (0.02, 0.1)}, r"ratio 0.01 .* must lie within adaptive_ratio's bounds"),
    ({"adaptive_ratio": (0.01, 0.01)}, "fewer than two candidate ratios"),
    ({"adaptive_weight": -1}, "adaptive_weight must be a finite number >= 0"),
    ({"auto_every": 1}, "auto_every must be an integer >= 2"),
])
def test_bad_auto_arguments_raise(hvd, kw, match):
    with pytest.raises(ValueError, match=match):
        make(hvd, **kw)


def test_error_feedback_invariant_across_transport_switches(hvd):
    """Σ sent + residual = Σ input while the plan moves a tensor between dense, artopk, split_reduce and
    allgather (a switch to dense flushes the residual). One process: the aggregate is this rank's own
    sent."""
    torch.manual_seed(0)
    model = nn.Linear(64, 32, bias=False).double()
    base = torch.optim.SGD(model.parameters(), lr=0.0)
    opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=TopKEF(ratio=0.05, min_numel=16), communication="auto")
    tuner = opt._hvd_topk.tuner
    sent_sum = torch.zeros(64 * 32, dtype=torch.float64)
    grad_sum = torch.zeros_like(sent_sum)
    modes = ["artopk", "artopk", "allgather", "dense", "artopk", "split_reduce", "split_reduce", "allgather",
             "split_reduce", "allgather"]
    for step, mode in enumerate(modes):
        tuner.plan = {"weight": mode}
        tuner.trial = None
        opt.zero_grad()
        x = torch.randn(8, 64, dtype=torch.float64)
        model(x).pow(2).sum().backward()
        grad_sum += model.weight.grad.reshape(-1)
        opt.synchronize()
        sent_sum += model.weight.grad.reshape(-1)
        with opt.skip_synchronize():
            opt.step()
        residual = opt._hvd_topk.residuals.residuals.get("weight")
        held = torch.zeros_like(sent_sum) if residual is None else residual
        torch.testing.assert_close(sent_sum + held, grad_sum, rtol=1e-12, atol=1e-12)
        if mode == "dense":
            assert residual is None
        else:
            assert (model.weight.grad != 0).sum() == math.ceil(0.05 * 64 * 32)
    assert tuner.costs.budget is None            # the model prices the compression's budget: the default


def test_the_probe_gives_the_model_the_compressions_budget(hvd):
    model = nn.Linear(64, 32, bias=False)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=TopKEF(ratio=0.05, min_numel=16, budget=3), communication="auto")
    for _ in range(2):                           # the second step's end probes: the first is not timed
        opt.zero_grad()
        model(torch.randn(8, 64)).pow(2).sum().backward()
        opt.step()
    assert opt._hvd_topk.tuner.costs.budget == 3.0


RATIO_ONE = ["--steps", 16, "--nesterov", "--dtype", "float64"]
RATIO_ONE_JOBS = (job(2, "opt_train.py", "--mode", "stock", *RATIO_ONE),
                  job(2, "opt_train.py", "--communication", "auto", "--auto-every", 4, "--ratio", 1.0, *RATIO_ONE))


@pytest.mark.jobs(RATIO_ONE_JOBS)
def test_ratio_one_auto_reproduces_dense_horovod(results):
    dense, ours = map(results, RATIO_ONE_JOBS)
    for name, value in dense[0]["params"].items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=1e-10, atol=1e-12)


SKEWED_CLOCK = job(3, "opt_train.py", "--communication", "auto", "--adaptive-ratio", "--auto-every", 5, "--steps", 60,
                   "--width", 256, "--min-numel", 64, "--skew-clock-rank", 1, timeout=300)


@pytest.mark.jobs(SKEWED_CLOCK)
def test_three_ranks_with_skewed_clock_take_identical_decisions(results):
    """Rank 1's step clock runs 5x fast: every decision (transport plan, ratio, history) is still the
    same on every rank, since only agreed (allreduced, then broadcast) numbers enter them."""
    ranks = results(SKEWED_CLOCK)
    assert_identical_across_ranks(ranks)
    auto = [r["auto"] for r in ranks]
    assert auto[0]["history"] and auto[0]["costs"]["beta"] > 0
    for r in (1, 2):
        assert auto[r] == auto[0], f"rank {r} decided differently"
    ratios = [s["ratio"] for s in ranks[0]["stats"]]
    for r in (1, 2):
        assert [s["ratio"] for s in ranks[r]["stats"]] == ratios
        assert [s["density"] for s in ranks[r]["stats"]] == [s["density"] for s in ranks[0]["stats"]]
    assert set(ratios) <= {0.1, 0.03, 0.01, 0.003, 0.001}


@pytest.mark.jobs(SKEWED_CLOCK)
def test_first_step_goes_with_the_compressions_own_transport(results):
    """Before its first decision auto sends with the compression's transport (split_reduce for TopKEF()),
    not every element: a dense first step would cost a whole model's allreduce on a slow link."""
    first = results(SKEWED_CLOCK)[0]["stats"][0]        # (later steps follow the plans auto chose)
    assert first["sparse_tensors"] > 0 and first["split_kept"] > 0 and first["density"] == 0.01
