"""communication='auto' with low rank among its choices (hvd_topk/auto/quality.py, plans.py, measure.py).

In one process, where the decision is pure: the quality figures of a row-sparse gradient (Top-K sends
all of it, rank 4 a fifth) and of a rank-2 gradient (rank 4 sends all, Top-K a quarter); the plan per
tensor from modelled time and quality (each tensor its compressor; quality turning a choice that time
alone makes); low rank's modelled seconds; a trial's verdict by J; the cases that leave low rank out.
On 2 real ranks behind a 100 Mbit/s link (tests/workers/auto_mix.py): the probe, the sampled quality and
(where the probe's figures leave the uniform plans a chance) a trial keep each tensor on its compressor,
the same on every rank.
"""
import math
import re

import pytest
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk.auto import trial as trials
from hvd_topk.auto.measure import adam_weights, lowrank_sizes, sample_quality
from hvd_topk.auto.plans import Costs, costs_from_data, costs_to_data, plan_transports, tensor_seconds, trial_plans
from hvd_topk.auto.quality import TOPK, add_sample, kept_fraction, plan_gain, quality_from_row, quality_row
from hvd_topk.core.sparsify import k_for
from hvd_topk.settings import PowerSGDSettings
from hvd_topk.transports.build import build_transports
from testbed.pytest_jobs import job

from conftest import assert_identical_across_ranks

SHAPES = {"emb": (2000, 64), "fc": (512, 256)}
SLOW = Costs(alpha=1e-4, beta=8e-8, select_s=1e-9, pass_s=1e-10, matmul_s=1e-10)      # 100 Mbit/s


def built_gradients(seed=0):
    """A row-sparse gradient (30 of 2000 rows, rank 30) and one of rank 2."""
    gen = torch.Generator().manual_seed(seed)
    emb = torch.zeros(SHAPES["emb"])
    emb[torch.randperm(2000, generator=gen)[:30]] = torch.randn(30, 64, generator=gen)
    return {"emb": emb, "fc": torch.randn(512, 2, generator=gen) @ torch.randn(2, 256, generator=gen)}


def quality_of(hvd, density):
    """The quality figures of ``built_gradients`` (Top-K at ``density``, rank 4) and the low-rank sizes."""
    lowrank = build_transports(PowerSGDSettings(rank=4), tag="auto.lowrank", key_index={},
                               shapes=SHAPES).transports["lowrank"]
    quality = {}
    for key, g in built_gradients().items():
        quality = add_sample(quality, key, *sample_quality(g.reshape(-1), key, k_for(g.numel(), density), lowrank))
    return quality, lowrank_sizes(lowrank, SHAPES)


def test_quality_favours_each_compressor_on_its_tensor(hvd):
    quality, sizes = quality_of(hvd, 0.02)
    assert sizes == {"emb": (2000, 64, 4), "fc": (512, 256, 4)}
    assert kept_fraction(quality, "emb", "split_reduce") == pytest.approx(1.0)     # 1920 of 2560 entries
    assert kept_fraction(quality, "emb", "lowrank") < 0.3                          # rank 4 of 30
    assert kept_fraction(quality, "fc", "lowrank") == pytest.approx(1.0, abs=1e-5)
    assert kept_fraction(quality, "fc", "artopk") < 0.3
    assert all(kept_fraction(quality, key, "dense") == 1.0 for key in SHAPES)
    # the ranks agree on the sums as one row: the same figures back
    assert quality_from_row(quality_row(quality, sorted(SHAPES)), sorted(SHAPES)) == quality


def test_quality_in_the_norm_of_an_adam_update(hvd):
    """Half the rows of a rank-1 gradient carry only noise 1e-4 its size: rank 4 sends nearly all of its
    energy (G > 0.99), but Adam's first steps scale each entry by about 1 / |g| (adam_weights), and in
    that norm rank 4's error on the smallest entries outweighs what it sends (G < 0: kept_fraction's
    floor) and Top-K's 2% of the entries send about 2% of the update. Weights of 1 give the plain figures;
    SGD has none."""
    lowrank = build_transports(PowerSGDSettings(rank=4), tag="auto.adam", key_index={},
                               shapes=SHAPES).transports["lowrank"]
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(512, 1, generator=gen)
    u[256:] = 0
    g = (u @ torch.randn(1, 256, generator=gen) + 1e-4 * torch.randn(512, 256, generator=gen)).reshape(-1)
    k = k_for(g.numel(), 0.02)
    plain = sample_quality(g, "fc", k, lowrank)
    assert sample_quality(g, "fc", k, lowrank, torch.ones_like(g)) == pytest.approx(plain, rel=1e-6)
    assert plain[2] / plain[0] > 0.99
    model = nn.Linear(256, 512, bias=False)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = adam_weights(adam, {"fc": model.weight}, "fc", g)                      # before its first step
    model.weight.grad = g.view(512, 256).clone()
    adam.step()
    second = adam_weights(adam, {"fc": model.weight}, "fc", g)                     # the same gradient again
    for weight in (first, second):                                                 # v_hat = g^2 both times
        torch.testing.assert_close(weight, 1 / (g.abs() + 1e-8))
    energy, topk, low = sample_quality(g, "fc", k, lowrank, first)
    assert low < 0 and kept_fraction({"fc": dict(energy=energy, topk=topk, lowrank=low)}, "fc", "lowrank") < 1e-9
    assert 0.01 < topk / energy < 0.05
    assert adam_weights(torch.optim.SGD(model.parameters(), lr=0.1), {"fc": model.weight}, "fc", g) is None


def test_auto_samples_quality_in_the_wrapped_adams_norm(hvd):
    """The optimizer hands its tuner the weights of its own (wrapped) AdamW state; an SGD one has none.
    Two steps of auto on one rank: the samples of the AdamW run are in its update's norm, where Top-K's
    5% of a dense gradient's entries send far less than in the gradient's own."""
    def run(make):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = hvd_topk.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                            communication="auto", compression=hvd_topk.TopKEF(ratio=0.05, min_numel=64))
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(16, 64)).pow(2).mean().backward()
            opt.step()
        tuner = opt._hvd_topk.tuner
        g = torch.ones(64 * 32)
        return tuner.update_weights("0.weight", g), kept_fraction(tuner.quality, "0.weight", "artopk")

    adam_weight, adam_topk = run(lambda params: torch.optim.AdamW(params, lr=1e-3))
    sgd_weight, sgd_topk = run(lambda params: torch.optim.SGD(params, lr=0.1))
    assert adam_weight is not None and adam_weight.shape == (64 * 32,) and sgd_weight is None
    assert adam_topk < 0.5 * sgd_topk, (adam_topk, sgd_topk)


def test_each_tensor_takes_its_compressor_and_quality_can_turn_the_choice(hvd):
    numels = {key: math.prod(shape) for key, shape in SHAPES.items()}
    quality, sizes = quality_of(hvd, 0.02)
    plan = plan_transports(numels, 0.02, 2, SLOW, lowrank=sizes, quality=quality, weight=0.3)
    assert plan["emb"] in TOPK and plan["fc"] == "lowrank", plan
    # at density 0.002 a Top-K transport is the fastest for both, by a factor 3 or more on fc; fc's Top-K
    # sends 5% of its energy: weighed at w = 1, rank 4 (all of it) wins there; at w = 0 (time alone) not
    quality, _ = quality_of(hvd, 0.002)
    by_time = plan_transports(numels, 0.002, 2, SLOW, lowrank=sizes, quality=quality, weight=0.0)
    assert by_time["emb"] in TOPK and by_time["fc"] in TOPK, by_time
    seconds = tensor_seconds(numels["fc"], 0.002, 2, SLOW, lowrank=sizes["fc"])
    assert seconds["lowrank"] > 3 * seconds[by_time["fc"]]
    by_j = plan_transports(numels, 0.002, 2, SLOW, lowrank=sizes, quality=quality, weight=1.0)
    assert by_j == {"emb": by_time["emb"], "fc": "lowrank"}, by_j
    # the trial's plans: the model's, then each uniform one within 4x of its J; all low rank among them
    arms = trial_plans(numels, 0.02, 2, SLOW, lowrank=sizes, quality=quality, weight=0.3)
    assert arms[0] == plan_transports(numels, 0.02, 2, SLOW, lowrank=sizes, quality=quality, weight=0.3)
    assert {"emb": "lowrank", "fc": "lowrank"} in arms and {"emb": "dense", "fc": "dense"} not in arms


def test_lowrank_seconds_and_costs_round_trip():
    t = tensor_seconds(512 * 256, 0.02, 2, SLOW, lowrank=(512, 256, 4))
    p_bytes, q_bytes = 4 * 512 * 4, 4 * 256 * 4          # 2 ranks: a ring allreduce is 2α + Mβ
    assert math.isclose(t["lowrank"], 4e-4 + (p_bytes + q_bytes) * 8e-8 + 3e-10 * 4 * 512 * 256 + 2e-10 * 512 * 256)
    assert tensor_seconds(100, 0.02, 2, SLOW, lowrank=(10, 10, 0))["lowrank"] == \
        tensor_seconds(100, 0.02, 2, SLOW)["dense"]                                 # sent dense there
    assert "lowrank" not in tensor_seconds(100, 0.02, 2, SLOW)
    assert costs_from_data(costs_to_data(SLOW)) == SLOW
    assert costs_from_data(costs_to_data(SLOW)[:4]) == SLOW._replace(matmul_s=0.0)     # an older checkpoint


def test_the_trial_compares_plans_by_j():
    """Two plans of equal step time: the one that sends half the energy at once loses at w = 1 (its J
    doubles) and ties at w = 0 (the first, the model's, is kept)."""
    quality = {"w": {"energy": 1.0, "topk": 0.5, "lowrank": 1.0}}
    arms = [{"w": "lowrank"}, {"w": "artopk"}]
    for weight, kept in ((1.0, {"w": "lowrank"}), (0.0, {"w": "lowrank"})):
        trial = trials.new_trial(arms)
        scales = [1 / plan_gain(arm, quality) ** weight for arm in arms]
        for _ in range(4):
            for _ in arms:
                trial = trials.record_step(trials.record_step(trial, 0.1), 0.1)
                trial, _ = trials.end_turn(trial)
            agreed = list(trial.round_means) if trials.counts_round(trial) else None
            trial, verdict = trials.end_round(trial, agreed, 3, 4, scales=scales)
        assert dict(trial.arms[verdict]) == kept
    trial = trials.new_trial(arms[::-1])                 # all Top-K first, 10% faster: J 1.8x at w = 1
    scales = [1 / plan_gain(arm, quality) for arm in arms[::-1]]
    for _ in range(4):
        for step_s in (0.09, 0.1):
            trial = trials.record_step(trials.record_step(trial, step_s), step_s)
            trial, _ = trials.end_turn(trial)
        agreed = list(trial.round_means) if trials.counts_round(trial) else None
        trial, verdict = trials.end_round(trial, agreed, 3, 4, scales=scales)
    assert dict(trial.arms[verdict]) == {"w": "lowrank"}


def _optimizer(compression=None, **settings):
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
    return hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), communication="auto",
                                         compression=compression or hvd_topk.TopKEF(ratio=0.05, min_numel=64),
                                         settings=hvd_topk.OptimizerSettings(**settings))


def test_low_rank_is_a_candidate_unless_top_k_only_settings_or_ratio_one(hvd):
    assert _optimizer()._hvd_topk.tuner.lowrank is not None
    assert _optimizer(hvd_topk.PowerSGD(rank=2))._hvd_topk.tuner.lowrank.rank == 2
    assert _optimizer(momentum_correction=True)._hvd_topk.tuner.lowrank is None
    assert _optimizer(hvd_topk.TopKEF(ratio=1.0))._hvd_topk.tuner.lowrank is None    # dense Horovod stays exact
    tuner = _optimizer(dense_steps=5)._hvd_topk.tuner
    assert tuner.first_step == 4 and not tuner.samples_quality(3) and tuner.samples_quality(4)


def test_a_trial_samples_quality_once_a_round_not_once_a_turn(hvd):
    """A sample costs a Top-K and a power iteration of every tensor: it is taken on the first step of a
    round (the gradient does not depend on the plan on turn), not on the first of every plan's turn."""
    tuner = _optimizer()._hvd_topk.tuner
    tuner.costs = SLOW
    tuner.start_trial([{"w": "dense"}, {"w": "artopk"}, {"w": "lowrank"}])
    sampled = []
    for step in range(2, 2 + 2 * 3 + 4 * 3):      # the first round (turns of 2 steps), then one counted
        sampled.append(tuner.samples_quality(step))
        tuner.trial = trials.record_step(tuner.trial, 0.01)
        if trials.turn_over(tuner.trial, 4):
            tuner.trial, round_over = trials.end_turn(tuner.trial)
            if round_over:
                tuner.trial, _ = trials.end_round(tuner.trial, None, 3, 10)
    assert [i for i, s in enumerate(sampled) if s] == [0, 6]


def test_the_seconds_of_sampling_are_not_counted_in_the_step(hvd):
    """A quality sample (a Top-K and a power iteration of every tensor) is the tuner's own work, not the
    transports': its seconds leave the step's time before the tuner records it, so the probe's time
    outside communication (the whole-step rule's f) and the trial's means do not carry it."""
    tuner = _optimizer()._hvd_topk.tuner
    tuner.observe_acc(torch.randn(512 * 256), "fc", 1000, torch.randn(512 * 256))
    assert tuner.sample_s > 0
    tuner.costs, tuner.sample_s = SLOW, 0.05
    tuner.end_step(None, 2, step_s=0.08, comm_s=0.01)
    assert tuner.step_times == [pytest.approx(0.03)] and tuner.comm_times == [0.01] and tuner.sample_s == 0.0


def test_quality_weight_is_one_unless_the_user_sets_adaptive_weight(hvd):
    assert _optimizer()._hvd_topk.tuner.weight == 1.0
    assert _optimizer(adaptive_weight=0.3)._hvd_topk.tuner.weight == 0.3
    assert _optimizer(adaptive_ratio=(0.01, 0.1))._hvd_topk.tuner.weight == 0.3    # the adaptive ratio's


def test_a_plan_futile_by_its_quality_is_not_tried(hvd):
    """A uniform plan whose J would exceed the clear gap (1.5x the model plan's whole-step J) even at a
    step of the time outside communication alone is left out of the trial, whatever its modelled
    communication. Here the uniform Top-K plans send about a quarter of the energy at once and
    communicate in under 3 ms (the model plan too): at w = 1 a step of 1 ms outside communication leaves
    them in (the 4x rule), one of 10 ms does not (10 / 0.26 > 1.5 x 12.6 ms); time alone (w = 0)
    leaves nothing out."""
    numels = {key: math.prod(shape) for key, shape in SHAPES.items()}
    quality, sizes = quality_of(hvd, 0.02)

    def topk_arms(fixed_s, weight):
        arms = trial_plans(numels, 0.02, 2, SLOW, lowrank=sizes, quality=quality, weight=weight, fixed_s=fixed_s)
        return [arm for arm in arms if set(arm.values()) <= set(TOPK)]
    assert len(topk_arms(1e-3, 1.0)) == 2 and all(plan_gain(a, quality) < 0.3 for a in topk_arms(1e-3, 1.0))
    assert topk_arms(1e-2, 1.0) == [] and topk_arms(1e-2, 0.0) == topk_arms(1e-3, 0.0) != []


MIX = job(2, "auto_mix.py", netns="100mbit", timeout=300)


@pytest.mark.jobs(MIX)
def test_on_two_ranks_each_tensor_keeps_its_compressor(results):
    """100 Mbit/s: dense is far off; the model's plan sends emb with Top-K and fc with rank 4, and it is
    kept (J at w = 2): by a trial against the uniform plans modelled within 4x of it (all artopk,
    split_reduce, allgather, low rank), or without one where the probe's figures make every uniform plan
    futile (each sends about 65% of the energy at once, so at w = 2 even a step with no communication
    leaves its J beyond the clear gap unless the model plan's communication is over 0.6x the step's time
    outside it: ``trial_plans``). Every decision, the quality figures and the parameters are the same on
    every rank."""
    ranks = results(MIX)
    first = ranks[0]
    assert first["model_plan"]["emb"] in TOPK and first["model_plan"]["fc"] == "lowrank", first["model_plan"]
    assert first["auto"]["plan"]["emb"] in TOPK and first["auto"]["plan"]["fc"] == "lowrank", first["auto"]["history"]
    history = first["auto"]["history"]
    tried = re.search(r"trial of (\d) plans", history[0][3])         # whether: the probe's α/β decide
    assert "kept mixed" in history[-1][3] if tried else len(history) == 1, history
    g = {key: {m: kept_fraction(first["quality"], key, m) for m in ("artopk", "lowrank")} for key in SHAPES}
    assert g["emb"]["artopk"] > 0.99 > 0.3 > g["emb"]["lowrank"] and g["fc"]["lowrank"] > 0.99 > 0.4 > g["fc"]["artopk"]
    assert all(r["auto"] == first["auto"] and r["quality"] == first["quality"] for r in ranks)
    assert_identical_across_ranks(ranks)
