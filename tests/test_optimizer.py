"""hvd_topk.DistributedOptimizer: bad input in one process; behaviour in real multi-rank jobs."""
import copy
import dataclasses
import re
import warnings

import pytest
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk import TopKEF
from hvd_topk.core.codec import packed_nbytes
from hvd_topk.core.sparsify import k_for
from hvd_topk.core.wire import FLAG_BYTES, FRAME_BYTES
from hvd_topk.step.bucket import regroup, zero_row_share

from testbed.launch import JobFailed
from testbed.pytest_jobs import Out

from conftest import (OutOf, assert_identical_across_ranks, assert_resume_bit_identical, assert_skipped_everywhere,
                      job, resume_jobs)


SETTINGS = {f.name for f in dataclasses.fields(hvd_topk.OptimizerSettings)}


def make(hvd, **kw):
    """The optimizer of a small model; keywords that are ``OptimizerSettings``' fields go there."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    base = kw.pop("base", None) or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    settings = hvd_topk.OptimizerSettings(**{k: kw.pop(k) for k in list(kw) if k in SETTINGS})
    return model, hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(), settings=settings,
                                                **kw)


@pytest.mark.parametrize("kw,match", [
    ({"communication": "ring"}, "communication must be one of"),
    ({"leader": "random"}, "leader must be one of"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"warmup_epochs": 1.5}, "warmup_epochs must be an integer >= 0"),
    ({"dense_steps": -3}, "dense_steps must be an integer >= 0"),
    ({"dense_steps": True}, "dense_steps must be an integer >= 0"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm must be a finite number > 0"),
    ({"clip_grad_norm": float("nan")}, "clip_grad_norm must be a finite number > 0"),
    ({"backward_passes_per_step": 0}, "backward_passes_per_step must be an integer >= 1"),
    ({"compression": "topk"}, "compression must be TopKEF"),
    ({"value_dtype": torch.int32}, "value_dtype must be a floating torch dtype"),
    ({"groups": 0}, "groups must be None, an integer >= 1 or a list of lists of parameters"),
    ({"groups": True}, "groups must be None, an integer >= 1 or a list of lists of parameters"),
    ({"groups": "2"}, "groups must be None, an integer >= 1 or a list of lists of parameters"),
    ({"groups": [torch.zeros(2)]}, "groups must be None, an integer >= 1 or a list of lists of parameters"),
    ({"groups": [[torch.zeros(2)]]}, "groups: every entry must be a parameter of the optimizer"),
])
def test_bad_arguments_raise_value_error_naming_them(hvd, kw, match):
    with pytest.raises(ValueError, match=match):
        make(hvd, **kw)


def test_groups_refuse_a_parameter_twice_and_map_to_keys(hvd):
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    w = model[0].weight
    with pytest.raises(ValueError, match="groups: a parameter can only appear once"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), groups=[[w], [w, model[1].weight]])
    # an int splits the parameters in order into contiguous groups, as Horovod's split_list does
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), groups=2)
    assert opt._hvd_topk.collectives.group_of == {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": 1}
    # lists: the parameters listed together; a group of one is no group; global selection leaves the
    # compressed tensors to its bucket
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        settings=hvd_topk.OptimizerSettings(selection="global"),
                                        compression=TopKEF(min_numel=16),
                                        groups=[[w, model[0].bias, model[1].bias], [model[1].weight]])
    assert opt._hvd_topk.collectives.group_of == {"0.bias": 0, "1.bias": 0}


def test_collectives_start_a_group_once_every_key_is_in(hvd):
    from hvd_topk.transports.collectives import Collectives
    c = Collectives("t.groups", [["a", "b"], ["c", "d"]])
    x = {k: torch.full((3,), float(i + 1)) for i, k in enumerate("abcde")}
    wait_b = c.allreduce("b", x["b"], "t.b", hvd.Sum)
    assert set(c.pending) == {0}
    with pytest.raises(RuntimeError, match="submitted twice"):
        c.allreduce("b", x["b"], "t.b", hvd.Sum)
    (wait_a_vals, wait_a_idx) = c.allgather("a", [x["a"].reshape(-1, 1), torch.arange(2, dtype=torch.int32)], "t.a")
    assert c.pending == {}                           # group 0 complete: started
    wait_e = c.allreduce("e", x["e"], "t.e", hvd.Sum)      # in no group: started at once
    wait_c = c.allreduce("c", x["c"], "t.c", hvd.Sum, postscale_factor=0.5)
    assert set(c.pending) == {1}                     # "d" never comes
    assert torch.equal(wait_b(), x["b"]) and torch.equal(wait_e(), x["e"])
    assert torch.equal(wait_a_vals().reshape(-1), x["a"])
    assert torch.equal(wait_a_idx(), torch.arange(2, dtype=torch.int32))
    assert torch.equal(wait_c(), x["c"] * 0.5)      # the first wait of an incomplete group starts it
    assert c.pending == {} and c.launched == {0: 1, 1: 1}
    c.end_step()
    assert c.launched == {}
    c.allreduce("a", x["a"], "t.a", hvd.Sum)
    with pytest.raises(RuntimeError, match="never waited for"):
        c.end_step()


def test_adasum_is_refused(hvd):
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        make(hvd, op=hvd.Adasum)


def test_momentum_correction_needs_momentum(hvd):
    model = nn.Linear(4, 4)
    for base in (torch.optim.Adam(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)):
        with pytest.raises(ValueError, match="momentum_correction=True needs an optimizer with momentum"):
            hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                          settings=hvd_topk.OptimizerSettings(momentum_correction=True))


def test_momentum_correction_is_off_by_default_and_checked(hvd):
    model = nn.Linear(4, 4)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert opt._hvd_topk.momentum.settings == {}          # the user's momentum acts on the aggregate
    assert opt.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="momentum_correction must be True or False, got 'yes'"):
        hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters(),
                                      settings=hvd_topk.OptimizerSettings(momentum_correction="yes"))


def test_momentum_correction_keeps_the_users_settings_visible_and_hides_them_from_the_inner_step(hvd):
    model = nn.Linear(4, 4)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        settings=hvd_topk.OptimizerSettings(momentum_correction=True))
    group = opt.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.9, True, 1e-4)
    assert opt._hvd_topk.momentum.settings["weight"] == (0.9, 0.0, True, 1e-4)
    with opt._hvd_topk.momentum.hidden():
        assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.0, False, 0.0)
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.9, True, 1e-4)
    group["momentum"] = 0.5                               # a scheduler's change is read at the next step
    assert opt._hvd_topk.momentum.settings["weight"].momentum == 0.5
    opt.load_state_dict(opt.state_dict())                 # torch puts new group dicts in place
    with opt._hvd_topk.momentum.hidden():
        assert opt.param_groups[0]["momentum"] == 0.0
    assert opt.param_groups[0]["momentum"] == 0.5
    for other in (torch.optim.Adam(model.parameters()), torch.optim.RMSprop(model.parameters(), momentum=0.9)):
        plain = hvd_topk.DistributedOptimizer(other, named_parameters=model.named_parameters())
        assert plain._hvd_topk.momentum.settings == {}, type(other).__name__   # not SGD's momentum


def test_warmup_schedule_is_dgc_exponential(hvd):
    _, opt = make(hvd, compression=TopKEF(ratio=0.001), warmup_steps=4)
    densities = [opt._hvd_topk.density(t) for t in range(6)]
    torch.testing.assert_close(torch.tensor(densities[:4]),
                               torch.tensor([0.001 ** (i / 5) for i in range(1, 5)]))
    assert densities[4:] == [0.001, 0.001]
    assert densities[0] == pytest.approx(0.251, abs=1e-3)     # DGC: 25% -> 6.25% -> ... -> 0.1%


def test_dense_steps_come_before_the_warmup(hvd):
    _, opt = make(hvd, compression=TopKEF(ratio=0.001), dense_steps=3, warmup_steps=2)
    densities = [opt._hvd_topk.density(t) for t in range(7)]
    assert densities[:3] == [1.0, 1.0, 1.0]
    assert densities[3:5] == pytest.approx([0.001 ** (1 / 3), 0.001 ** (2 / 3)])
    assert densities[5:] == [0.001, 0.001]


def test_index_sets_leave_with_the_last_compressed_gradient(hvd):
    """AR-Topk's next index sets are shared as soon as the step's last compressed gradient is submitted
    (during backward, in the Horovod cycle of the values), not after synchronize()."""
    model, opt = make(hvd, compression=TopKEF(ratio=0.1, min_numel=1), communication="artopk")
    pipeline = opt._hvd_topk.index_sets
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()       # the hooks submit every gradient
        assert pipeline.outgoing == {}                         # flushed before synchronize()
        assert sorted(pipeline.ready) == ["0.weight", "1.weight"]
        opt.step()


def test_zero_grad_accepts_set_to_none(hvd):
    model, opt = make(hvd)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(q.grad is not None and not q.grad.any() for q in model.parameters())
    opt.zero_grad(set_to_none=True)
    assert all(q.grad is None for q in model.parameters())


@pytest.mark.parametrize("selection,key", [("layerwise", "weight"), (None, "__global__")])
def test_error_feedback_invariant_single_process_plain_ef(hvd, selection, key):
    """Per tensor, and at the default (global selection: the one tensor is the bucket, its residual kept
    whole under the bucket's key)."""
    torch.manual_seed(0)
    model = nn.Linear(100, 50, bias=False).double()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                        named_parameters=model.named_parameters(),
                                        compression=TopKEF(ratio=0.02, min_numel=0, selection=selection))
    total_grad = torch.zeros(5000, dtype=torch.float64)
    total_sent = torch.zeros(5000, dtype=torch.float64)
    for _ in range(20):
        opt.zero_grad()
        model(torch.randn(4, 100, dtype=torch.float64)).pow(2).sum().backward()
        total_grad += model.weight.grad.reshape(-1)
        opt.synchronize()
        total_sent += model.weight.grad.reshape(-1)        # world size 1: aggregated == sent
        assert int((model.weight.grad != 0).sum()) == k_for(5000, 0.02)
        with opt.skip_synchronize():
            opt.step()
    residual = opt._hvd_topk.residuals.residuals[key].reshape(-1)
    torch.testing.assert_close(total_sent + residual, total_grad, rtol=0, atol=1e-10)


def test_error_feedback_invariant_with_a_row_sparse_tensor_alone(hvd):
    """Global selection over an embedding table and a linear layer: the table's gradient is row-sparse, so
    it keeps its own k and its residual its own name; the layer is the pooled bucket. For each, in
    float64: sum sent + residual = sum of the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(512, 8, mode="mean"), nn.Linear(8, 64, bias=False)).double()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                        named_parameters=model.named_parameters(),
                                        compression=TopKEF(ratio=0.05, min_numel=0))
    params = dict(model.named_parameters())
    total_grad = {n: torch.zeros(q.numel(), dtype=torch.float64) for n, q in params.items()}
    total_sent = {n: torch.zeros(q.numel(), dtype=torch.float64) for n, q in params.items()}
    for _ in range(12):
        opt.zero_grad()
        model(torch.randint(0, 512, (16, 8))).pow(2).sum().backward()    # about 120 of 512 rows
        for n, q in params.items():
            total_grad[n] += q.grad.reshape(-1)
        opt.synchronize()
        for n, q in params.items():
            total_sent[n] += q.grad.reshape(-1)        # world size 1: aggregated == sent
        assert [int((q.grad != 0).sum()) for q in params.values()] == [k_for(4096, 0.05), k_for(512, 0.05)]
        with opt.skip_synchronize():
            opt.step()
    residuals = opt._hvd_topk.residuals.residuals
    assert sorted(residuals) == ["0.weight", "__global__"]
    for name, key in (("0.weight", "0.weight"), ("1.weight", "__global__")):
        torch.testing.assert_close(total_sent[name] + residuals[key], total_grad[name], rtol=0, atol=1e-10)


def test_a_checkpoint_from_before_the_row_sparse_split_resumes_as_one_with_it(hvd):
    """A state written before row-sparse tensors went alone (the bucket's residual whole, no
    ``row_sparse``), loaded into an optimizer that has split its bucket, gives the next step bit for bit
    what the same state in today's layout gives: the residuals are laid out anew, none lost."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(512, 8, mode="mean"), nn.Linear(8, 64, bias=False))
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters(),
                                        compression=TopKEF(ratio=0.05, min_numel=0))
    batches = [torch.randint(0, 512, (16, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def step(tokens):
        opt.zero_grad()
        model(tokens).pow(2).sum().backward()
        opt.step()

    for tokens in batches[:3]:
        step(tokens)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    ours = state["hvd_topk"]
    assert ours["row_sparse"] == ["0.weight"] and sorted(ours["residuals"]) == ["0.weight", "__global__"]
    older = copy.deepcopy(state)
    residuals = older["hvd_topk"]["residuals"]
    residuals["__global__"] = torch.cat([residuals.pop("0.weight"), residuals["__global__"]])   # sorted keys
    del older["hvd_topk"]["row_sparse"]
    after = []
    for saved in (state, older):
        model.load_state_dict(weights)
        opt.load_state_dict(copy.deepcopy(saved))
        step(batches[3])
        after.append([q.detach().clone() for q in model.parameters()])
    for today, before in zip(*after):
        assert torch.equal(today, before)


def test_bucket_residuals_are_regrouped_for_another_split_of_the_row_sparse_tensors():
    """The optimizer's bucket residual (pooled keys in sorted order under ``__global__``, each row-sparse
    one under its own name) laid out for another split, as after an elastic reset or from a checkpoint
    written before the split, keeps every entry; one of another model's size is refused."""
    numels = {"b": 2, "a": 3, "c": 4}
    whole = torch.arange(9.0)                    # a, b, c pooled
    residuals = {"__global__": whole.clone(), "dense.bias": torch.ones(1)}
    regroup(residuals, numels, {"b"})
    assert torch.equal(residuals["__global__"], torch.cat([whole[:3], whole[5:]]))
    assert torch.equal(residuals["b"], whole[3:5]) and torch.equal(residuals["dense.bias"], torch.ones(1))
    regroup(residuals, numels, {"a", "b", "c"})
    assert "__global__" not in residuals and torch.equal(torch.cat([residuals[k] for k in "abc"]), whole)
    regroup(residuals, numels, set())
    assert sorted(residuals) == ["__global__", "dense.bias"] and torch.equal(residuals["__global__"], whole)
    with pytest.raises(ValueError, match="the bucket's residual has 5 entries, its tensors 9"):
        regroup({"__global__": torch.zeros(5)}, numels, set())
    grad = torch.zeros(4, 3)
    grad[1, 2] = 1.0
    assert (zero_row_share(grad), zero_row_share(torch.zeros(8))) == (0.75, 0.0)


def test_local_clipping_caps_each_gradient_norm(hvd):
    model = nn.Linear(64, 64, bias=False)
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                        named_parameters=model.named_parameters(),
                                        compression=TopKEF(ratio=1.0),
                                        settings=hvd_topk.OptimizerSettings(clip_grad_norm=0.5))
    (model(torch.randn(8, 64)) * 1000).sum().backward()
    assert float(model.weight.grad.norm()) > 10
    opt.synchronize()
    assert float(model.weight.grad.norm()) == pytest.approx(0.5, rel=1e-5)   # world size 1: 0.5 / sqrt(1)


def test_stats_and_tensorboard_writer(hvd, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from hvd_topk.step.stats import write_tensorboard

    def one_step(communication):
        model = nn.Linear(100, 50, bias=False)
        opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(),
                                            compression=TopKEF(ratio=0.02, min_numel=0), communication=communication)
        model(torch.randn(4, 100)).sum().backward()
        opt.step()
        return opt.stats()

    stats = one_step("artopk")
    assert stats["sparse_tensors"] == 1 and stats["density"] == 0.02
    assert stats["bytes_sent"] == (100 + 1) * 4          # k fp32 values + the finite flag
    assert 0 < stats["compression_gain"] < 1 and stats["residual_norm"] > 0
    split = one_step("split_reduce")
    # one rank: one allgather of a frame (signature, count, one flag) and a codec message of k bf16 values
    # and 16-bit offsets (8-byte header, one block: no counts), 4.2 bytes per entry; it keeps all its top-k
    assert split["bytes_sent"] == FRAME_BYTES + FLAG_BYTES + packed_nbytes(100, 5000, "bf16") == 12 + 8 + 4 * 100
    assert split["split_kept"] == 100 and split["split_imbalance"] == 1.0
    assert split["collectives_gather"] == 1 and split["time_step_s"] == 0.0       # the first step: no window
    assert split["time_pack_s"] > 0 and split["time_select_s"] > 0
    with SummaryWriter(str(tmp_path)) as writer:
        write_tensorboard(writer, stats, step=1)
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_stats_of_low_rank_say_what_it_sent(hvd, tmp_path):
    """PowerSGD through the optimizer: the density is the share of the compressed tensors' elements that P
    and Q carry, not a top-k ratio (none applies: ``ratio`` None, which the TensorBoard writer skips);
    where a tensor is pinned to top-k, the density is top-k's and low rank's share has its own key."""
    from torch.utils.tensorboard import SummaryWriter

    from hvd_topk.step.stats import write_tensorboard

    def one_step(**pin):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10))
        opt = hvd_topk.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            compression=hvd_topk.PowerSGD(rank=2, named_parameters=model.named_parameters()),
            settings=hvd_topk.OptimizerSettings(**pin))
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        return opt.stats()

    stats = one_step()
    share = (2 * (64 + 64) + 2 * (10 + 64)) / (64 * 64 + 10 * 64)      # r(n + m) / nm of both weights
    assert stats["sparse_tensors"] == 2 and stats["ratio"] is None
    assert stats["density"] == stats["lowrank_density"] == pytest.approx(share)
    with SummaryWriter(str(tmp_path)) as writer:
        write_tensorboard(writer, stats, step=1)
    mixed = one_step(pin={"1.weight": "artopk"})
    assert mixed["lowrank_density"] == pytest.approx(2 * (64 + 64) / (64 * 64))
    assert mixed["density"] == mixed["ratio"] == 0.01


def test_a_tensor_pinned_to_dense_fp16_keeps_fp16s_rounding_in_its_residual(hvd):
    """'dense_fp16' sends every entry in fp16 (half of dense's bytes); what fp16 did not carry stays in the
    residual and leaves later: after two steps the updates plus the residual are the two gradients, in
    float64. Its dense steps (density 1) stay exact, as dense Horovod's."""
    def run(dense_steps):
        torch.manual_seed(5)
        model = nn.Linear(64, 32, bias=False)
        start = model.weight.detach().clone()
        opt = hvd_topk.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters(),
            compression=TopKEF(ratio=0.01, min_numel=16),
            settings=hvd_topk.OptimizerSettings(pin={"weight": "dense_fp16"}, dense_steps=dense_steps))
        grads = []
        for step in range(2):
            opt.zero_grad()
            model(0.1 * torch.randn(8, 64)).pow(2).sum().backward()
            grads.append(model.weight.grad.detach().clone())
            opt.step()
        return start, model.weight.detach(), grads, opt

    start, end, grads, opt = run(dense_steps=0)
    assert opt.stats()["bytes_sent"] == 2 * 64 * 32 and opt.stats()["dense_tensors"] == 1
    residual = opt._hvd_topk.residuals.residuals["weight"].reshape(32, 64)
    assert residual.abs().max() > 1e-5                          # fp16's rounding, about 2**-11 of each entry
    torch.testing.assert_close((start - end).double() + residual.double(), sum(g.double() for g in grads),
                               rtol=0, atol=1e-6)
    start, end, grads, opt = run(dense_steps=2)                # both steps dense: exact, no residual
    assert opt.stats()["bytes_sent"] == 4 * 64 * 32
    torch.testing.assert_close(start - end, grads[0] + grads[1], rtol=0, atol=1e-6)


def test_state_dict_refuses_other_world_size_and_model(hvd):
    model, opt = make(hvd)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert "hvd_topk" in state and state["hvd_topk"]["world_size"] == 1
    wrong = dict(state, hvd_topk=dict(state["hvd_topk"], world_size=4))
    with pytest.raises(ValueError, match="residuals of 4 ranks"):
        opt.load_state_dict(wrong)
    bigger = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(1, 1))
    opt2 = hvd_topk.DistributedOptimizer(torch.optim.SGD(bigger.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=bigger.named_parameters())
    with pytest.raises(ValueError, match="model with other parameters"):
        opt2.load_state_dict(state)
    with pytest.raises(ValueError, match="no hvd_topk state"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "hvd_topk"})


def test_checkpoint_files_are_per_rank_and_checked(hvd, tmp_path):
    model, opt = make(hvd)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = hvd_topk.save_checkpoint(str(tmp_path / "c.pt"), model, opt, epoch=3)
    assert path.endswith("c.pt.rank0-of-1")
    assert hvd_topk.load_checkpoint(str(tmp_path / "c.pt"), model, opt) == {"epoch": 3}
    with pytest.raises(FileNotFoundError, match="no checkpoint for rank 0 of 1"):
        hvd_topk.load_checkpoint(str(tmp_path / "missing.pt"), model, opt)


# -- real multi-rank jobs --------------------------------------------------------------------------

def ratio_one_jobs(communication, selection, groups):
    # No weight decay here: stock hvd.broadcast_optimizer_state takes a real SGD step on zero gradients,
    # which with weight decay moves the parameters; the float64 reference test covers weight decay.
    common = ["--steps", 12, "--nesterov", "--dtype", "float64"]
    return (job(2, "opt_train.py", "--mode", "stock", *common),
            job(2, "opt_train.py", "--communication", communication, "--selection", selection,
                "--ratio", 1.0, "--groups", groups, *common))


@pytest.mark.parametrize("jobs", [ratio_one_jobs(*case) for case in [
    ("artopk", "layerwise", 0), ("allgather", "layerwise", 0), ("dense", "layerwise", 0), ("artopk", "global", 0),
    ("artopk", "layerwise", 2), ("split_reduce", "layerwise", 0)]],
    ids=["artopk-layerwise-0", "allgather-layerwise-0", "dense-layerwise-0", "artopk-global-0", "artopk-layerwise-2",
         "split_reduce-layerwise-0"])
def test_ratio_one_reproduces_dense_horovod(results, jobs):
    dense, ours = map(results, jobs)
    for name, value in dense[0]["params"].items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=1e-10, atol=1e-12)
    assert not torch.equal(dense[0]["params"]["0.weight"], dense[0]["initial"]["0.weight"])


def dense_steps_jobs(communication):
    # Adam: the dense phase must be dense Horovod exactly (Adam's statistics start from full gradients)
    common = ["--optimizer", "adam", "--dtype", "float64", "--min-numel", 64, "--width", 64]
    ours = ["--communication", communication, "--ratio", 0.01, "--dense-steps", 6]
    return (job(2, "opt_train.py", "--mode", "stock", "--steps", 6, *common),
            job(2, "opt_train.py", *ours, "--steps", 6, *common),
            job(2, "opt_train.py", *ours, "--steps", 10, *common))


@pytest.mark.parametrize("jobs", [dense_steps_jobs(c) for c in ["artopk", "allgather"]], ids=["artopk", "allgather"])
def test_dense_steps_reproduce_dense_horovod_then_compress(results, jobs):
    dense, first, longer = map(results, jobs)
    for name, value in dense[0]["params"].items():
        torch.testing.assert_close(first[0]["params"][name], value, rtol=1e-10, atol=1e-12)
    assert_identical_across_ranks(longer)
    stats = longer[0]["stats"]
    assert [s["density"] for s in stats] == [1.0] * 6 + [0.01] * 4
    assert all(s["compression_gain"] == pytest.approx(1.0) for s in stats[:6])
    assert all(s["compression_gain"] < 1 and s["residual_norm"] > 0 for s in stats[6:])
    # the dense steps cost what dense costs: every element once, as values (no indices)
    full = sum(p.numel() for p in dense[0]["params"].values()) * 8
    assert all(full <= s["bytes_sent"] <= full + 8 * 8 for s in stats[:6])
    assert all(s["bytes_sent"] < full / 10 for s in stats[6:])


def long_run_job(communication, leader, selection, np):
    """200 steps on 2 ranks; 100 on 3 and 4, which share 2 cores here at 2-3x the 2-rank step's cost.
    (No run reaches a moved split_reduce region: the regions move every 200 steps of a tensor,
    ``transports/regions.py``, and only from step 201 on; tests/test_split_reduce.py moves them every 4.)"""
    extra = []
    if "-fp16" in communication:                      # values in float16 on the wire
        extra += ["--value-dtype", "float16"]
    if communication.endswith("-bpps2"):              # backward_passes_per_step=2
        extra += ["--bpps", 2]
    steps = 200 if np == 2 else 100
    return job(np, "opt_train.py", "--steps", steps, "--communication", communication.split("-")[0],
               "--leader", leader, "--selection", selection, "--ratio", 0.01, "--width", 128, *extra)


LONG_RUNS = [
    ("artopk", "star", "layerwise", 2), ("artopk", "var", "layerwise", 3), ("allgather", "star", "layerwise", 2),
    ("dense", "star", "layerwise", 2), ("artopk", "star", "global", 3), ("allgather", "star", "global", 2),
    ("allgather-fp16", "star", "layerwise", 2), ("artopk-fp16-bpps2", "star", "layerwise", 2),
    ("split_reduce", "star", "layerwise", 3), ("split_reduce-fp16", "star", "global", 4)]


# the runs on 3 and 4 ranks only in the full suite: the fast loop keeps those on 2
@pytest.mark.parametrize("communication,selection,long_job",
                         [pytest.param(c, s, long_run_job(c, leader, s, np),
                                       marks=[pytest.mark.slow] if np > 2 else [])
                          for c, leader, s, np in LONG_RUNS],
                         ids=["-".join(map(str, case)) for case in LONG_RUNS])
def test_params_bit_identical_after_a_long_run(results, communication, selection, long_job):
    ranks = results(long_job)
    assert_identical_across_ranks(ranks)
    last = ranks[0]["stats"][-1]
    if communication.split("-")[0] != "dense":
        assert last["sparse_tensors"] == (1 if selection == "global" else 3)
        assert 0 < last["compression_gain"] < 1
        assert last["residual_norm"] > 0


GROUPED = [("artopk", "layerwise", 1, []), ("allgather", "layerwise", 2, []), ("artopk", "global", 1, []),
           ("allgather", "layerwise", 2, ["--compress", "update", "--optimizer", "adam"])]


def grouped_common(communication, selection, extra):
    return ["--steps", 30, "--communication", communication, "--selection", selection, "--ratio", 0.05,
            "--width", 128, "--dtype", "float64", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("plain_job,grouped_job", [
    (job(3, "opt_train.py", *grouped_common(c, s, extra)),
     # each grouped run records its own Horovod timeline (a launch whose timeline is started and stopped)
     job(3, "opt_train.py", *grouped_common(c, s, extra), "--groups", groups, "--timeline", Out("timeline.json"),
         env={"HOROVOD_TIMELINE": "DYNAMIC"}))
    for c, s, groups, extra in GROUPED], ids=[f"{c}-{s}-{g}-{len(e)}" for c, s, g, e in GROUPED])
def test_groups_give_the_ungrouped_result_through_horovods_grouped_collectives(results, plain_job, grouped_job):
    plain = results(plain_job)
    grouped = results(grouped_job)
    timeline = results.path(grouped_job, "timeline.json")
    assert_identical_across_ranks(grouped)
    for name, value in plain[0]["params"].items():   # the same sums, fused in another order
        torch.testing.assert_close(grouped[0]["params"][name], value, rtol=1e-10, atol=1e-12)
    assert not torch.equal(plain[0]["params"]["2.weight"], plain[0]["initial"]["2.weight"])
    # Horovod's own timeline names what it ran: every gradient of the grouped run went through a
    # grouped collective or, for allgather's compressed tensors, their fused bucket (one collective for
    # the bucket already); the plain run's per-tensor names do not appear.
    names = set(re.findall(r'"args": \{"name": "([^"]+)"', timeline.read_text()))
    # index sets, set-up (and global selection's one test for row-sparse tensors), a flag
    others = (".indices.", ".groups", ".row_sparse", "hvd_topk.update.finite")
    ours = {n for n in names if "hvd_topk" in n and not any(o in n for o in others)}
    grouped_name = (r"grouped_(allreduce|allgather)\.hvd_topk\.opt\d+\.group\.|allreduce\.hvd_topk\.values\.__global__"
                    r"|allgather\.hvd_topk\.opt\d+\.allgather\.bucket\d+$")
    assert ours and all(re.match(grouped_name, n) for n in ours), sorted(ours)   # opt<n>: the launch's n-th


TWO_OPTIMIZERS = job(2, "two_optimizers.py")


@pytest.mark.jobs(TWO_OPTIMIZERS)
def test_two_optimizers_in_one_job_keep_apart(results):
    """Two optimizers stepping in turn (AR-Topk index sets and VAR scores in flight between their steps)
    use their own collective names and end exactly where each ends when trained alone."""
    res = results(TWO_OPTIMIZERS)
    assert_identical_across_ranks(res)
    assert len(set(res[0]["tags"])) == 4 and res[0]["tags"] == res[1]["tags"]
    for name, value in res[0]["solo"].items():
        assert torch.equal(res[0]["params"][name], value), name
    assert not torch.equal(res[0]["params"]["m0.0.weight"], res[0]["params"]["m1.0.weight"])


MC_SETTINGS = dict(ratio=0.05, lr=0.01, m=0.9, wd=1e-3, min_numel=64)


@pytest.mark.parametrize("nesterov,mc_job", [
    (nesterov, job(2, "opt_train.py", "--communication", "allgather", "--ratio", MC_SETTINGS["ratio"], "--steps", 25,
                   "--dtype", "float64", "--record-grads", "--min-numel", MC_SETTINGS["min_numel"],
                   "--lr", MC_SETTINGS["lr"], "--weight-decay", MC_SETTINGS["wd"], *(["--nesterov"] if nesterov else [])))
    for nesterov in (False, True)], ids=["plain", "nesterov"])
def test_momentum_correction_matches_float64_reference(results, nesterov, mc_job):
    ratio, lr, m, wd, min_numel = (MC_SETTINGS[k] for k in ("ratio", "lr", "m", "wd", "min_numel"))
    ranks = results(mc_job)
    assert_identical_across_ranks(ranks)
    params = {n: v.clone() for n, v in ranks[0]["initial"].items()}
    # The velocities start from SGD's momentum buffers that Horovod's broadcast_optimizer_state created
    # (its step with zero gradients: wd * p), as stock Horovod's SGD does.
    u = [{n: b.reshape(-1).clone() for (_, n, key), b in res["initial_inner"].items() if key == "momentum_buffer"}
         for res in ranks]
    assert wd == 0 or all(u), "the weight decay's buffers are expected"
    v = [{} for _ in ranks]
    for t in range(25):
        update = {n: torch.zeros_like(p) for n, p in params.items()}
        for r, res in enumerate(ranks):
            for n, g in res["grads"][t].items():
                g = g.reshape(-1) + wd * params[n].reshape(-1)              # weight decay first
                u[r][n] = m * u[r][n] + g if n in u[r] else g.clone()
                step = g + m * u[r][n] if nesterov else u[r][n]
                if g.numel() < min_numel or params[n].dim() <= 1:
                    update[n] += step.reshape(params[n].shape)          # dense: plain local momentum
                    continue
                v[r][n] = v[r].get(n, torch.zeros_like(g)) + step
                idx = torch.topk(v[r][n].abs(), k_for(g.numel(), ratio)).indices
                sent = torch.zeros_like(g)
                sent[idx] = v[r][n][idx]
                v[r][n][idx] = 0                                        # error feedback
                u[r][n][idx] = 0                                        # factor masking
                update[n] += sent.reshape(params[n].shape)
        for n in params:
            params[n] = params[n] - lr * update[n] / len(ranks)
    for n, p in params.items():
        torch.testing.assert_close(ranks[0]["params"][n], p, rtol=1e-9, atol=1e-12)
    for r, res in enumerate(ranks):                                  # per-rank state matches too
        for n in v[r]:
            torch.testing.assert_close(res["state"]["residuals"][n], v[r][n], rtol=1e-9, atol=1e-12)


# split_reduce with global selection is the default configuration (TopKEF's default is resumed across hosts,
# tests/test_multihost.py)
RESUMED = [("artopk", "star", "layerwise"), ("artopk", "var", "layerwise"), ("allgather", "star", "layerwise"),
           ("artopk", "star", "global"), ("split_reduce", "star", "layerwise"), ("split_reduce", "star", "global")]


@pytest.mark.parametrize("jobs", [
    resume_jobs(["--steps", 50, "--communication", communication, "--leader", leader, "--ratio", 0.05,
                 "--warmup-steps", 10, "--selection", selection], save_at=24)
    for communication, leader, selection in RESUMED], ids=["-".join(case) for case in RESUMED])
def test_checkpoint_resume_is_bit_identical(results, jobs):
    assert_resume_bit_identical(results, jobs)


@pytest.mark.parametrize("overflow_job", [
    job(2, "opt_train.py", "--amp", "--steps", 12, "--overflow-rank", 1, "--overflow-step", 6, "--ratio", 0.05,
        *(["--overflow-one-tensor"] if one_tensor else [])) for one_tensor in (False, True)],
    ids=["loss", "one-tensor"])
def test_amp_overflow_on_one_rank_skips_step_everywhere(results, overflow_job):
    skips = assert_skipped_everywhere(results(overflow_job), step=6)
    assert {s["scale"] for s in skips} == {2.0 ** 7}     # backed off once, identically on both ranks


NON_FINITE = [("artopk", "layerwise", 0), ("allgather", "layerwise", 0), ("dense", "layerwise", 0),
              ("artopk", "global", 0), ("artopk", "layerwise", 8), ("allgather", "layerwise", 8),  # 8: step 5 is dense
              ("split_reduce", "layerwise", 0)]


@pytest.mark.parametrize("nan_job", [
    job(2, "opt_train.py", "--steps", 10, "--overflow-rank", 1, "--overflow-step", 5, "--overflow-one-tensor",
        "--ratio", 0.05, "--communication", communication, "--selection", selection, "--dense-steps", dense_steps)
    for communication, selection, dense_steps in NON_FINITE], ids=["-".join(map(str, c)) for c in NON_FINITE])
def test_non_finite_tensor_on_one_rank_skips_plain_step_everywhere(results, nan_job):
    """Without a loss scaler: one tensor NaN on rank 1 -> step() skips on both ranks, state unchanged."""
    assert_skipped_everywhere(results(nan_job), step=5)


SAVED_BY_TWO = job(2, "opt_train.py", "--steps", 10, "--save-at", 4)
# mpirun: the test reads one rank's error, and the job ends the 3-rank mpirun launch last (no launch of its own)
RESUMED_BY_THREE = job(3, "opt_train.py", "--steps", 10, "--resume", OutOf(SAVED_BY_TWO, "ckpt.pt"), fails=True,
                       backend="mpi")


@pytest.mark.jobs(RESUMED_BY_THREE)
def test_checkpoint_from_other_world_size_is_refused(results):
    with pytest.raises(JobFailed, match=r"no checkpoint for rank \d of 3"):
        results(RESUMED_BY_THREE)


# -- the settings object, and the keywords it replaced ------------------------------------------------

OLD_KEYWORDS = {   # (base optimizer, communication, every keyword the factory took before OptimizerSettings)
    "gradient": ("sgd", "artopk", dict(momentum_correction=True, warmup_steps=2, warmup_epochs=1, dense_steps=1,
                                       clip_grad_norm=0.5, selection="global", leader="var", value_dtype=torch.float16,
                                       adaptive_ratio=None, adaptive_weight=0.5, auto_every=10)),
    "update": ("adam", "allgather", dict(compress="update", local_momentum=False, dense_steps=2)),
}


def _train_six_steps(base_kind, communication, **spelling):
    """Parameters after 6 steps of a small model (world size 1), and the DeprecationWarnings of the build."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if base_kind == "sgd" else \
        torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            compression=TopKEF(ratio=0.05, min_numel=64), communication=communication,
                                            **spelling)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        opt.zero_grad()
        model(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
    return [q.detach().clone() for q in model.parameters()], \
        [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("case", sorted(OLD_KEYWORDS))
def test_old_keywords_warn_with_the_new_spelling_and_step_the_same_bits(hvd, case):
    base_kind, communication, old = OLD_KEYWORDS[case]
    new_params, new_warnings = _train_six_steps(base_kind, communication, settings=hvd_topk.OptimizerSettings(**old))
    old_params, old_warnings = _train_six_steps(base_kind, communication, **old)
    default_params, _ = _train_six_steps(base_kind, communication)
    # value_dtype is itself deprecated (TopKEF(values=...)): one more warning in both spellings
    values = [f"hvd_topk.OptimizerSettings(value_dtype={old['value_dtype']}) is deprecated: pass compression="
              f"hvd_topk.TopKEF(values='fp16') (artopk's and the dense allreduces' values still go in value_dtype)"] \
        if "value_dtype" in old else []
    assert new_warnings == values
    old_warnings = [w for w in old_warnings if w not in values]
    assert sorted(old_warnings) == sorted(f"hvd_topk.DistributedOptimizer({name}=...) is deprecated: pass "
                                          f"settings=hvd_topk.OptimizerSettings({name}=...)" for name in old)
    assert all(torch.equal(a, b) for a, b in zip(old_params, new_params))
    assert not all(torch.equal(a, b) for a, b in zip(default_params, new_params))    # the settings took effect


def test_an_old_keyword_goes_on_top_of_the_settings_and_an_unknown_one_is_refused(hvd):
    model = nn.Linear(8, 16)

    def build(**kw):
        return hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), **kw)
    with pytest.warns(DeprecationWarning, match=r"OptimizerSettings\(warmup_steps=\.\.\.\)"):
        opt = build(settings=hvd_topk.OptimizerSettings(dense_steps=3, warmup_steps=1), warmup_steps=4)
    assert (opt._hvd_topk.schedule.dense_steps, opt._hvd_topk.schedule.warmup_steps) == (3, 4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'warmup'"):
        build(warmup=4)
    with pytest.raises(ValueError, match="settings must be a hvd_topk.OptimizerSettings or None"):
        build(settings={"warmup_steps": 4})


def test_optimizer_settings_are_frozen_and_checked_when_made():
    settings = hvd_topk.OptimizerSettings(momentum_correction=None, warmup_epochs=4)
    assert settings.momentum_correction is False and settings.warmup_epochs == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.warmup_epochs = 5
    for bad, match in ((dict(selection="all"), "selection must be one of"),
                       (dict(auto_every=1), "auto_every must be an integer >= 2"),
                       (dict(adaptive_weight=-0.1), "adaptive_weight must be a finite number >= 0")):
        with pytest.raises(ValueError, match=match):
            hvd_topk.OptimizerSettings(**bad)


def test_the_optimizer_reads_only_the_compressions_settings(hvd, monkeypatch):
    """A TopKEF given to hvd_topk.DistributedOptimizer is never built: its hosts are never resolved
    (the optimizer resolves its own), and only its settings reach the optimizer's transports."""
    from hvd_topk.transports import build
    resolved = []
    monkeypatch.setattr(build, "resolve", lambda name, optional=False: resolved.append(name))
    comp = TopKEF(ratio=0.02, min_numel=16, communication="hierarchical", budget=2.0)
    model, opt = make(hvd, compression=comp)
    assert comp.transports._stack is None
    assert len(resolved) == 1 and resolved[0].startswith("hvd_topk.opt")
    state = opt._hvd_topk
    assert (state.schedule.ratio, state.min_numel, state.transports["split_reduce"].budget) == (0.02, 16, 2.0)
    assert state.transports["hierarchical"] is state.transports["split_reduce"]      # no hosts: flat
