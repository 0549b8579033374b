"""bench/arms.py: every entry of the arm table builds its optimizer on its own copy of the model and
takes a step (one rank: Horovod and torch.distributed in this process), every copy starts from the
same weights, and arm names with overrides are read or refused with the arm named."""
import doctest
import warnings

import pytest
import torch
import torch.distributed as dist

from bench import arms
from bench.arms import ARMS, build_arm, needs_host_sets, parse_arm
from bench.tasks import Task


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Horovod and a torch.distributed Gloo group of one rank, in this process."""
    import horovod.torch as hvd     # noqa: PLC0415  (only these tests start Horovod in the test process)

    hvd.init()
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("store") / "file"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return hvd


@pytest.mark.parametrize("name", [n for n in ARMS if n != "hvd_topk auto"])
def test_every_arm_builds_and_steps(one_rank, name):
    task = Task("cnn", 0, 1)
    torch.manual_seed(0)
    reference = task.build()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # hierarchical on one host: flat, with a warning
        arm = build_arm(name, 7, task, ratio=0.01)
    assert all(torch.equal(p, q) for p, q in zip(arm.model.parameters(), reference.parameters()))
    assert arm.kind == ("ddp" if name.startswith("ddp") else "local" if name == "compute only" else "horovod")
    for step in range(3):
        x, y = task.batch(step)
        arm.opt.zero_grad()
        task.loss(arm.forward(x), y).backward()
        arm.opt.step()
    assert not all(torch.equal(p, q) for p, q in zip(arm.model.parameters(), reference.parameters())), name
    assert all(torch.isfinite(p).all() for p in arm.model.parameters())
    assert hasattr(arm.opt, "stats") == name.startswith("hvd_topk")
    # the stock door's arms report their TopKEF's or PowerSGD's own stats(), Horovod's dense and DDP none
    assert (arm.reporter is not None) == name.startswith(("hvd_topk", "topkef", "powersgd")), name
    if arm.reporter is not None:
        assert any(isinstance(v, (int, float)) for v in arm.reporter.stats().values()), name
    # torch's hook's state
    assert (arm.powersgd_state is not None) == name.startswith(("ddp powersgd", "ddp fp16 powersgd"))


def test_overrides_reach_topkef_and_the_optimizer(one_rank):
    task = Task("cnn", 0, 1)
    arm = build_arm("hvd_topk[communication=allgather,ratio=0.05,min_numel=2048,momentum_correction=true]", 0,
                    task, ratio=0.01)
    x, y = task.batch(0)
    arm.opt.zero_grad()
    task.loss(arm.forward(x), y).backward()
    arm.opt.step()
    assert arm.opt.stats()["ratio"] == 0.05
    grouped = build_arm("topkef[groups=1,sync_indices=true]", 2, task, ratio=0.01)
    assert grouped.opt._groups == 1                          # Horovod's argument reached its optimizer
    with pytest.raises(ValueError, match="momentum_correction"):      # the library's own check, named
        build_arm("hvd_topk[momentum_correction=true]", 1, Task("cnn", 0, 1, optimizer="adam"), ratio=0.01)


def test_topkef_settings_reach_topkef_in_both_doors(one_rank):
    """values and bucket_cap_mb are TopKEF's: an hvd_topk arm hands them to its TopKEF, not to
    OptimizerSettings (which has no such fields and would refuse them)."""
    task = Task("cnn", 0, 1)
    stock = build_arm("topkef[values=fp32,bucket_cap_mb=1]", 3, task, ratio=0.01)
    assert (stock.opt._compression.settings.values, stock.opt._compression.settings.bucket_cap_mb) == ("fp32", 1)
    arm = build_arm("hvd_topk[values=fp16,bucket_cap_mb=2]", 4, task, ratio=0.01)
    x, y = task.batch(0)
    arm.opt.zero_grad()
    task.loss(arm.forward(x), y).backward()
    arm.opt.step()
    assert all(torch.isfinite(p).all() for p in arm.model.parameters())


def test_both_low_rank_doors_take_the_hooks_dense_steps(one_rank):
    """torch's hook sends its first START_POWERSGD_ITER steps dense; our low rank does too, through either
    door (PowerSGD(dense_steps=...)), unless the arm's name says otherwise."""
    task = Task("cnn", 0, 1)
    stock = build_arm("powersgd r4", 5, task, ratio=0.01)
    assert stock.opt._compression.settings.dense_steps == arms.START_POWERSGD_ITER == 2
    assert build_arm("powersgd r2[dense_steps=0]", 6, task, ratio=0.01).opt._compression.settings.dense_steps == 0
    opt_door = build_arm("hvd_topk powersgd r4", 7, task, ratio=0.01)
    assert opt_door.opt._hvd_topk.schedule.dense_steps == arms.START_POWERSGD_ITER


def test_names_and_overrides_are_read():
    assert parse_arm(" topkef ") == ("topkef", {})
    assert parse_arm("topkef[budget=2,sync_indices=false]") == ("topkef", {"budget": 2, "sync_indices": False})
    assert parse_arm("hvd_topk[communication=allgather,warmup_epochs=4,ratio=0.001]") == (
        "hvd_topk", {"communication": "allgather", "warmup_epochs": 4, "ratio": 0.001})
    assert needs_host_sets(["topkef", "hvd_topk hierarchical"]) and needs_host_sets(["hvd_topk[communication=auto]"])
    assert not needs_host_sets(["horovod dense", "ddp powersgd r4", "hvd_topk allgather"])


@pytest.mark.parametrize("text, match", [
    ("horovod fp8", "must be one of"), ("hvd_topk[ratio]", "key=value"),
    ("ddp[hook=x]", "DDP arms and the compute-only arm take no overrides"), ("compute only[ratio=0.1]", "no overrides"),
    ("horovod dense[ratio=0.1]", "only Horovod's arguments"),
    ("hvd_topk[1x=2]", "key=value"), ("topkef[budget=2", "must be one of"),
])
def test_bad_names_are_refused_naming_the_arm(text, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_arm(text)
    assert repr(text) in str(e.value)


def test_docstring_examples():
    assert doctest.testmod(arms).attempted >= 1 and doctest.testmod(arms).failed == 0
