"""bench/tasks.py: every task's model size, its batches (the same in every arm, each rank its own),
non-IID shards, the LM's schedule, the embedding task's gradient, evaluation, and bad input."""
import doctest
import importlib.util
import os

import pytest
import torch

from bench import tasks
from bench.tasks import TASKS, Task

PARAMS = {"cnn-wide": 6_334_858, "cnn": 151_306, "mlp": 2_176_010, "lm": 842_496, "lm-small": 445_952,
          "bow": 2_099_914}


@pytest.fixture(scope="module")
def built():
    """Every task on rank 0 of 2, and a model of each (seed 0)."""
    out = {}
    for name in TASKS:
        task = Task(name, 0, 2)
        torch.manual_seed(0)
        out[name] = (task, task.build())
    return out


def test_every_task_is_listed_with_its_size(built):
    assert set(TASKS) == set(PARAMS)
    for name, (_, model) in built.items():
        assert sum(p.numel() for p in model.parameters()) == PARAMS[name], name
    # the embedding-heavy task: a table of more than 1M parameters
    assert built["bow"][1].emb.weight.numel() >= 1_000_000


def test_one_step_of_every_task_lowers_nothing_to_nan_and_evaluates(built):
    for name, (task, model) in built.items():
        opt = task.make_opt(model)
        x, y = task.batch(0)
        loss = task.loss(model(x), y)
        loss.backward()
        opt.step()
        m = task.evaluate(model)
        assert torch.isfinite(loss) and m["loss"] > 0, name
        assert (m["accuracy"] is None) == (task.metric == "loss"), name
        if m["accuracy"] is not None:
            assert 0 <= m["accuracy"] <= 1
        assert model.training, f"{name}: evaluate() must leave the model training"


def test_batches_are_the_same_in_every_arm_and_each_ranks_own():
    a, b, other = Task("cnn", 0, 2, seed=3), Task("cnn", 0, 2, seed=3), Task("cnn", 1, 2, seed=3)
    for step in (0, 1, 44, 100):
        assert torch.equal(a.batch(step)[0], b.batch(step)[0])
    assert not torch.equal(a.batch(0)[0], other.batch(0)[0])
    assert not torch.equal(a.batch(0)[0], Task("cnn", 0, 2, seed=4).batch(0)[0])
    lm = Task("lm-small", 0, 2)
    x, y = lm.batch(7)
    assert x.shape == (16, tasks.BLOCK) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(lm.batch(7)[0], Task("lm-small", 0, 2).batch(7)[0])


def test_digits_are_the_examples_to_the_bit():
    """The harness reads the digits as examples/data.py does (scikit-learn's shipped file, the same
    split), so a task's runs train on exactly the examples' data."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(tasks.__file__)))
    spec = importlib.util.spec_from_file_location("examples_data", os.path.join(root, "examples", "data.py"))
    examples_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(examples_data)
    for ours, theirs in zip(tasks.digits(), examples_data.load_dataset("digits")):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_an_epoch_of_a_rank_visits_distinct_samples():
    task = Task("cnn", 1, 2, batch_size=16)
    seen = torch.cat([task.batch(s)[1] for s in range(task.steps_per_epoch)])
    assert len(seen) == task.steps_per_epoch * 16
    xs = torch.cat([task.batch(s)[0].flatten(1) for s in range(task.steps_per_epoch)])
    assert len(torch.unique(xs, dim=0)) >= len(xs) - 5          # a few digits images are duplicates


def test_non_iid_gives_each_rank_a_few_labels():
    shards = [Task("cnn", r, 4, non_iid=True) for r in range(4)]
    labels = [set(torch.cat([t.batch(s)[1] for s in range(t.steps_per_epoch)]).tolist()) for t in shards]
    assert all(len(ls) <= 6 for ls in labels), labels          # 2 shards of sorted labels, of 10
    assert set().union(*labels) == set(range(10))
    lm = [Task("lm-small", r, 2, non_iid=True) for r in range(2)]
    assert lm[0].window[1] < lm[1].window[0] + tasks.BLOCK + 1             # rank 0's slice ends where 1's begins


def test_lm_schedule_warms_up_then_falls_to_a_tenth():
    task = Task("lm", 0, 2, steps=600)
    assert task.lr_at(0) == pytest.approx(2e-3 / 50) and task.lr_at(49) == pytest.approx(2e-3)
    assert task.lr_at(600) == pytest.approx(2e-4) and task.lr_at(325) < task.lr_at(100)
    assert Task("lm", 0, 2, steps=20).lr_at(0) == pytest.approx(2e-3 / 10)      # warm-up: at most half a short run
    assert Task("cnn", 0, 2).lr_at(500) == 0.05


def test_recipe_overrides():
    task = Task("cnn", 0, 2, optimizer="adam", lr=1e-3)
    opt = task.make_opt(task.build())
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 1e-3
    lm_opt = Task("lm-small", 0, 2).make_opt(Task("lm-small", 0, 2).build())
    assert isinstance(lm_opt, torch.optim.AdamW) and [g["weight_decay"] for g in lm_opt.param_groups] == [0.1, 0.0]
    nesterov = Task("mlp", 0, 2, optimizer="nesterov").make_opt(Task("mlp", 0, 2).build())
    assert isinstance(nesterov, torch.optim.SGD) and nesterov.param_groups[0]["nesterov"]
    assert nesterov.param_groups[0]["momentum"] == 0.9 and nesterov.param_groups[0]["lr"] == 0.05
    assert not Task("mlp", 0, 2).make_opt(Task("mlp", 0, 2).build()).param_groups[0]["nesterov"]


def test_embedding_gradient_is_dense_and_mostly_zero(built):
    task, model = built["bow"]
    model.zero_grad()
    x, y = task.batch(3)
    task.loss(model(x), y).backward()
    grad = model.emb.weight.grad
    assert not grad.is_sparse and grad.shape == (tasks.BOW_VOCAB, tasks.BOW_DIM)
    touched = int((grad.abs().sum(1) > 0).sum())
    assert 0 < touched <= x.numel() and touched < 0.02 * tasks.BOW_VOCAB


def test_bad_input_names_it():
    with pytest.raises(ValueError, match="task must be one of"):
        Task("resnet", 0, 2)
    with pytest.raises(ValueError, match="batch_size must be at most 719"):
        Task("cnn", 0, 2, batch_size=5000)


def test_docstring_examples():
    assert doctest.testmod(tasks).failed == 0
