"""compress='update': every rank steps the wrapped optimizer on its own gradient and the change it makes
to the parameters goes through error feedback and the transport. Checked against a reference optimizer
stepped on the same gradients (error-feedback invariant on the updates), on real 2- and 3-rank jobs
(identical parameters, dense Horovod at ratio 1.0 for plain SGD, a non-finite rank skipping the step
with every state untouched, bit-identical resume of the per-rank optimizer state)."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk import TopKEF
from hvd_topk.core.sparsify import k_for

from conftest import (assert_identical_across_ranks, assert_resume_bit_identical, assert_skipped_everywhere, job,
                      resume_jobs)


def make(model, base, **kw):
    """Keywords that are ``OptimizerSettings``' fields go there."""
    fields = {f.name for f in dataclasses.fields(hvd_topk.OptimizerSettings)}
    settings = hvd_topk.OptimizerSettings(**{k: kw.pop(k) for k in list(kw) if k in fields})
    return hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), settings=settings, **kw)


@pytest.mark.parametrize("kw,match", [
    ({"compress": "weights"}, "compress must be one of"),
    ({"compress": "update", "momentum_correction": True}, "momentum_correction=True cannot be used with "
                                                          "compress='update'"),
    ({"compress": "update", "grad_scaler": torch.amp.GradScaler("cpu")}, "grad_scaler cannot be used with "
                                                                        "compress='update'"),
])
def test_bad_arguments_raise_value_error_naming_them(hvd, kw, match):
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=match):
        make(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kw)


def test_momentum_stays_in_the_local_optimizer(hvd):
    model = nn.Linear(64, 64)
    opt = make(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
               compress="update")
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["weight_decay"] == 1e-4
    assert opt._hvd_topk.momentum.settings == {}


def _optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999))
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1)


@pytest.mark.parametrize("communication,kind,local_momentum", [
    ("artopk", "adamw", True), ("allgather", "adamw", True), ("allgather", "adamw", False),
    ("artopk", "sgd", False)])
def test_error_feedback_invariant_on_local_updates(hvd, communication, kind, local_momentum):
    """Σ sent + residual = Σ local updates, the updates taken by a reference optimizer stepped on the
    same gradients from the same parameters (world size 1: the aggregate is this rank's sent). With
    local_momentum=False the reference steps with momentum (beta1) 0 once the dense steps are over."""
    torch.manual_seed(0)
    model = nn.Linear(100, 50).double()           # weight: compressed; bias (1-D): sent whole
    reference = copy.deepcopy(model)
    dense_steps = 0 if local_momentum else 3
    opt = make(model, _optimizer(kind, model.parameters()), compression=TopKEF(ratio=0.02, min_numel=0),
               communication=communication, compress="update", dense_steps=dense_steps,
               local_momentum=local_momentum)
    ref_opt = _optimizer(kind, reference.parameters())
    start = model.weight.detach().clone()
    total_update = torch.zeros_like(start)
    k = k_for(5000, 0.02)
    for step in range(20):
        if step == dense_steps and not local_momentum:       # the reference drops momentum from here on
            key, value = ("betas", (0.0, 0.999)) if kind == "adamw" else ("momentum", 0.0)
            ref_opt.param_groups[0][key] = value
        x = torch.randn(4, 100, dtype=torch.float64)
        with torch.no_grad():
            for a, b in zip(reference.parameters(), model.parameters()):
                a.copy_(b)
        ref_opt.zero_grad()
        reference(x).pow(2).sum().backward()
        ref_opt.step()
        total_update += reference.weight.detach() - model.weight.detach()
        before = model.weight.detach().clone()
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        moved = int((model.weight != before).sum())
        assert moved == k if step >= dense_steps else moved > k      # only the top-k elements moved
        # a dense tensor: the whole update (p0 + (p1 - p0) may round p1 in its last bit)
        torch.testing.assert_close(model.bias, reference.bias, rtol=0, atol=1e-15)
    # allgather selects globally by default: the one compressed tensor is the bucket, its residual whole
    key = "__global__" if opt._hvd_topk.selection == "global" else "weight"
    assert opt._hvd_topk.selection == ("global" if communication == "allgather" else "layerwise")
    residual = opt._hvd_topk.residuals.residuals[key].reshape(start.shape)
    torch.testing.assert_close(model.weight.detach() - start + residual, total_update, rtol=0, atol=1e-12)
    assert float(residual.norm()) > 0
    # the optimizer's own hyperparameters are as the user set them
    assert opt.param_groups[0].get("betas", (0.9,))[0] == opt.param_groups[0].get("momentum", 0.9) == 0.9
    if kind == "adamw":        # the local AdamW stepped exactly once per step, on the local gradient
        assert opt.state[model.weight]["step"] == ref_opt.state[reference.weight]["step"] == 20
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[model.weight][key], ref_opt.state[reference.weight][key],
                                       rtol=0, atol=0)


@pytest.mark.parametrize("kw,match", [
    ({"compress": "update", "local_momentum": "off"}, "local_momentum must be True or False, got 'off'"),
    ({"local_momentum": False}, "local_momentum=False needs compress='update'"),
])
def test_bad_local_momentum_raises_value_error(hvd, kw, match):
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=match):
        make(model, torch.optim.AdamW(model.parameters()), **kw)
    with pytest.raises(ValueError, match="local_momentum=False needs an optimizer whose param groups have 'betas'"):
        make(model, torch.optim.Adagrad(model.parameters()), compress="update", local_momentum=False)


@pytest.mark.parametrize("kw,match", [
    ({"compress": "update", "dense_steps": 3, "second_moment": "global"}, "second_moment must be one of"),
    ({"dense_steps": 3, "second_moment": "frozen"}, "second_moment='frozen' needs compress='update' and dense_steps"),
    ({"compress": "update", "second_moment": "frozen"}, "needs compress='update' and dense_steps >= 1 .*dense_steps=0"),
])
def test_bad_second_moment_raises_value_error(hvd, kw, match):
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=match):
        make(model, torch.optim.AdamW(model.parameters()), **kw)
    for base in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters(), amsgrad=True)):
        with pytest.raises(ValueError, match="second_moment='frozen' needs torch.optim.Adam or AdamW without amsgrad"):
            make(model, base, compress="update", dense_steps=3, second_moment="frozen")


def test_frozen_second_moment_holds_the_dense_steps_moment(hvd):
    """After the dense steps v / (1 - beta2^t) stays what it was at their end, and each compressed step
    divides by sqrt(beta2 v^ + (1 - beta2) g^2 / (1 - beta2^t)) (hvd_topk.step.second_moment; world size 1,
    ratio 1.0: the update is applied whole)."""
    torch.manual_seed(0)
    model = nn.Linear(20, 10).double()
    lr, wd, (beta1, beta2), eps = 1e-2, 0.1, (0.9, 0.99), 1e-8
    opt = make(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(beta1, beta2), eps=eps),
               compression=TopKEF(ratio=1.0, min_numel=0), communication="allgather", compress="update",
               dense_steps=3, second_moment="frozen")
    state = opt.state[model.weight]
    for step in range(12):
        w, m = model.weight.detach().clone(), (state["exp_avg"].clone() if state else None)
        opt.zero_grad()
        model(torch.randn(4, 20, dtype=torch.float64)).pow(2).sum().backward()
        g = model.weight.grad.clone()
        opt.step()
        t = float(state["step"])
        assert t == step + 1
        if step == 2:
            held = state["exp_avg_sq"] / (1 - beta2 ** t)
        if step >= 3:
            torch.testing.assert_close(state["exp_avg_sq"] / (1 - beta2 ** t), held, rtol=1e-13, atol=0)
            m = beta1 * m + (1 - beta1) * g
            denom = (beta2 * held + (1 - beta2) * g * g / (1 - beta2 ** t)).sqrt() + eps
            expected = w * (1 - lr * wd) - lr / (1 - beta1 ** t) * m / denom
            torch.testing.assert_close(model.weight.detach(), expected, rtol=0, atol=1e-14)


# -- real multi-rank jobs --------------------------------------------------------------------------

LOCAL_ADAM = [("artopk", "layerwise", 2, "on"), ("allgather", "layerwise", 2, "on"), ("artopk", "global", 3, "on"),
              ("auto", "layerwise", 2, "on"), ("allgather", "layerwise", 3, "off")]


@pytest.mark.parametrize("communication,adam_job", [
    (communication, job(np, "opt_train.py", "--compress", "update", "--optimizer", "adam", "--weight-decay", 1e-4,
                        "--steps", 60, "--communication", communication, "--selection", selection, "--ratio", 0.05,
                        "--auto-every", 10, "--dense-steps", 3, "--local-momentum", local_momentum))
    for communication, selection, np, local_momentum in LOCAL_ADAM], ids=["-".join(map(str, c)) for c in LOCAL_ADAM])
def test_params_identical_with_local_adam(results, communication, adam_job):
    ranks = results(adam_job)
    assert_identical_across_ranks(ranks)
    last = ranks[0]["stats"][-1]
    if communication == "auto":              # its plan (dense is right for a model this small) is agreed
        assert ranks[0]["auto"]["history"] and all(r["auto"] == ranks[0]["auto"] for r in ranks)
    else:
        assert 0 < last["compression_gain"] < 1 and last["residual_norm"] > 0
    assert not torch.equal(ranks[0]["params"]["0.weight"], ranks[0]["initial"]["0.weight"])
    # the local optimizers' states differ (each saw its own gradients); the parameters do not
    key = ("opt", "0.weight", "exp_avg")
    assert not torch.equal(ranks[0]["inner"][key], ranks[1]["inner"][key])


FROZEN_JOB = job(2, "opt_train.py", "--compress", "update", "--optimizer", "adam", "--steps", 30, "--dense-steps", 3,
                 "--second-moment", "frozen", "--communication", "allgather", "--ratio", 0.05, "--lr", 0.01)


@pytest.mark.jobs([FROZEN_JOB])
def test_frozen_second_moment_is_the_same_on_every_rank(results):
    """The dense steps give every rank dense Adam's moments; frozen, the second stays the same on every
    rank through the compressed steps, while the first moments (each rank's own momentum) part."""
    ranks = results(FROZEN_JOB)
    assert_identical_across_ranks(ranks)
    assert not torch.equal(ranks[0]["params"]["0.weight"], ranks[0]["initial"]["0.weight"])
    assert ranks[0]["stats"][-1]["residual_norm"] > 0
    for name in ("0.weight", "2.weight"):
        held = ranks[0]["inner"][("opt", name, "exp_avg_sq")]
        assert float(held.norm()) > 0 and torch.equal(held, ranks[1]["inner"][("opt", name, "exp_avg_sq")])
        assert not torch.equal(ranks[0]["inner"][("opt", name, "exp_avg")], ranks[1]["inner"][("opt", name, "exp_avg")])


ADAM_DENSE = ["--optimizer", "adam", "--steps", 8, "--dtype", "float64", "--lr", 0.01, "--weight-decay", 1e-3]
ADAM_DENSE_JOBS = (job(2, "opt_train.py", "--mode", "stock", *ADAM_DENSE),
                   job(2, "opt_train.py", "--compress", "update", "--dense-steps", 8, *ADAM_DENSE))


@pytest.mark.jobs(ADAM_DENSE_JOBS)
def test_dense_steps_with_adam_reproduce_dense_horovod(results):
    """compress='update''s dense steps average the gradients and step Adam on the average: dense Horovod's
    Adam, moments included, on every rank."""
    dense, ours = map(results, ADAM_DENSE_JOBS)
    for name, value in dense[0]["params"].items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=1e-10, atol=1e-12)
    for key, value in dense[0]["inner"].items():
        for rank in ours:
            torch.testing.assert_close(rank["inner"][key], value, rtol=1e-10, atol=1e-12)
    assert not torch.equal(dense[0]["params"]["0.weight"], dense[0]["initial"]["0.weight"])


PLAIN_SGD = ["--steps", 12, "--momentum", 0, "--dtype", "float64", "--lr", 0.05]
PLAIN_SGD_JOBS = (job(2, "opt_train.py", "--mode", "stock", *PLAIN_SGD),
                  job(2, "opt_train.py", "--compress", "update", "--ratio", 1.0, *PLAIN_SGD))


@pytest.mark.jobs(PLAIN_SGD_JOBS)
def test_ratio_one_with_plain_sgd_reproduces_dense_horovod(results):
    """Plain SGD is linear in the gradient, so the mean of the local updates is dense Horovod's update."""
    dense, ours = map(results, PLAIN_SGD_JOBS)
    for name, value in dense[0]["params"].items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=1e-10, atol=1e-12)
    assert not torch.equal(dense[0]["params"]["0.weight"], dense[0]["initial"]["0.weight"])


@pytest.mark.parametrize("overflow_job", [
    job(2, "opt_train.py", "--compress", "update", "--optimizer", "adam", "--steps", 10, "--overflow-rank", 1,
        "--overflow-step", 5, "--ratio", 0.05, *(["--overflow-one-tensor"] if one_tensor else []))
    for one_tensor in (False, True)], ids=["loss", "one-tensor"])
def test_non_finite_on_one_rank_skips_the_step_and_keeps_every_state(results, overflow_job):
    """Rank 1's gradient is non-finite at step 5: no rank steps its optimizer (Adam's moments unchanged),
    residuals and parameters unchanged on both; step 6 goes on."""
    assert_skipped_everywhere(results(overflow_job), step=5)


RESUME_JOBS = resume_jobs(["--compress", "update", "--optimizer", "adam", "--steps", 40, "--ratio", 0.05,
                           "--warmup-steps", 5], save_at=19)


@pytest.mark.jobs(RESUME_JOBS)
def test_checkpoint_resume_is_bit_identical(results):
    """The local optimizer's state is per rank: it is saved and restored with each rank's file."""
    assert_resume_bit_identical(results, RESUME_JOBS)
