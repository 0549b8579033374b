"""Horovod's own optimizer tests, run with hvd_topk swapped in for ``hvd.DistributedOptimizer``.

Horovod 0.28.1's ``test/parallel/test_torch.py`` is not in its sdist, so this needs a Horovod source
tree at the v0.28.1 tag (``--horovod-source``); nothing of it is copied here. torch 2.13's new
``torch.optim.Muon`` fails three of the tests for Horovod itself; ``--without-muon`` runs a temporary
copy of the tests whose optimizer lists leave it out (the only change). Under horovodrun, pytest
collects that file, and a plugin rebinds the module's global ``hvd`` to a namespace that forwards
everything to ``horovod.torch`` except ``DistributedOptimizer``, which builds the front door named by
``--front-door`` (Horovod itself is untouched)::

    python -m bench peer-tests --horovod-source ~/src/horovod --front-door topkef
    python -m bench peer-tests --horovod-source ~/src/horovod --front-door hvd_topk --np 2

Front doors: ``horovod`` (nothing swapped: the baseline, since some tests fail on torch 2.13 as
they stand), ``topkef`` (``compression=TopKEF(named_parameters=..., process_set=...)``, given the
optimizer's process set as TopKEF's docs ask), ``topkef_unnamed`` (an instance without names or process
set: where the optimizer has a process set, it must fail on every rank, naming ``process_set``),
``topkef_class`` (``compression=TopKEF``), ``hvd_topk`` (``hvd_topk.DistributedOptimizer``), and the
same for low rank: ``powersgd`` (``compression=PowerSGD(rank=4, named_parameters=..., process_set=...)``),
``powersgd_class`` (``compression=PowerSGD``) and ``hvd_topk_powersgd``
(``hvd_topk.DistributedOptimizer(compression=PowerSGD(rank=4))``). Each test runs in a job of its own with a 120 s limit, so a hang
shows as a timeout, not as a stuck run. Prints one line per test and the tally.
"""
import os
import shutil
import sys
import tempfile
import time
import unittest.mock

import horovod.torch as hvd

import hvd_topk
from hvd_topk import TopKEF
from testbed.launch import JobFailed, run_job

# The tests of test_torch.py that build hvd.DistributedOptimizer (CPU ones; the GPU variants skip).
OPTIMIZER_TESTS = ("test_broadcast_state", "test_broadcast_state_options", "test_broadcast_state_no_grad",
                   "test_force_allreduce", "test_model_parallelism", "test_delta_optimizer", "test_duplicate_names",
                   "test_dynamic_requires_grad", "test_gradient_clipping", "test_synchronize_step_warning",
                   "test_no_named_parameters", "test_missing_named_parameters", "test_optimizer_no_named_parameters",
                   "test_sparse_embeddings", "test_optimizer_process_sets")
FRONT_DOORS = ("horovod", "topkef", "topkef_unnamed", "topkef_class", "hvd_topk", "powersgd", "powersgd_class",
               "hvd_topk_powersgd")
# test_torch.py imports the ``mock`` backport; the standard library's is the same API
sys.modules.setdefault("mock", unittest.mock)


class SwappedHorovod:
    """``horovod.torch`` with ``DistributedOptimizer`` replaced by one of hvd_topk's front doors."""

    def __init__(self, front_door, ratio):
        self._hvd, self._front_door, self._ratio = hvd, front_door, ratio

    def __getattr__(self, name):
        return getattr(self._hvd, name)

    def DistributedOptimizer(self, optimizer, named_parameters=None, compression=None, **kwargs):
        if self._front_door.startswith("hvd_topk"):
            compression = hvd_topk.PowerSGD(rank=4) if self._front_door == "hvd_topk_powersgd" else \
                TopKEF(ratio=self._ratio)
            return hvd_topk.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                                 compression=compression, **kwargs)
        named = list(named_parameters) if named_parameters is not None else None
        process_set = kwargs.get("process_set", self._hvd.global_process_set)
        comp = {"topkef": lambda: TopKEF(ratio=self._ratio, min_numel=0, named_parameters=named,
                                         process_set=process_set),
                "topkef_unnamed": lambda: TopKEF(ratio=self._ratio, min_numel=0),
                "topkef_class": lambda: TopKEF,
                "powersgd": lambda: hvd_topk.PowerSGD(rank=4, named_parameters=named, process_set=process_set),
                "powersgd_class": lambda: hvd_topk.PowerSGD}[self._front_door]()
        return self._hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=comp, **kwargs)


def pytest_collection_finish(session):
    """pytest plugin hook (this module is loaded with -p): rebind ``hvd`` in the collected module."""
    swapped = SwappedHorovod(os.environ["PEER_FRONT_DOOR"], float(os.environ["PEER_RATIO"]))
    for item in session.items:
        if swapped._front_door != "horovod":
            item.module.hvd = swapped


# torch 2.13 added torch.optim.Muon (2-D parameters only), which test_broadcast_state, its _options
# variant and test_force_allreduce build for every optimizer class: they fail for Horovod itself.
_OPTIMIZER_FILTER = "               subclass != torch.optim.SparseAdam\n"
_WITHOUT_MUON = "               subclass != torch.optim.SparseAdam and subclass.__name__ != 'Muon'\n"


def tests_without_muon(horovod_source, into):
    """A copy of Horovod's test/parallel in ``into`` whose optimizer lists leave out torch's Muon (the
    only change); returns its test_torch.py. Raises if the file is not the one this was written for.
    test/utils is copied beside it: test_torch.py imports its ``common`` from ``../utils``."""
    parallel = os.path.join(into, "parallel")
    shutil.copytree(os.path.join(horovod_source, "test", "parallel"), parallel)
    shutil.copytree(os.path.join(horovod_source, "test", "utils"), os.path.join(into, "utils"))
    path = os.path.join(parallel, "test_torch.py")
    with open(path) as f:
        text = f.read()
    if text.count(_OPTIMIZER_FILTER) != 3:
        raise SystemExit(f"{path}: expected Horovod 0.28.1's three optimizer lists")
    with open(path, "w") as f:
        f.write(text.replace(_OPTIMIZER_FILTER, _WITHOUT_MUON))
    return path


def run_one(args, test):
    """(outcome, seconds, last lines) of one Horovod test in a job of its own."""
    tests = args.test_file
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "bench.peer_tests", "-p", "no:cacheprovider",
            f"{tests}::TorchTests::{test}"]
    env = dict(os.environ, PEER_FRONT_DOOR=args.front_door, PEER_RATIO=str(args.ratio),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    try:
        output = run_job(args.np, argv, timeout=args.timeout, env=env)
        outcome = "skipped" if " skipped" in output and " passed" not in output else "passed"
    except JobFailed as failed:
        output = failed.output
        outcome = "timeout" if time.monotonic() - t0 >= args.timeout - 1 else "failed"
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or " E " in line or line.endswith(" E")]
    return outcome, time.monotonic() - t0, (errors or lines or ["(no output)"])[-1:]


def main(args):
    """The CLI's ``peer-tests``: every test of ``args.tests`` (None: all) in a job of its own; returns 0."""
    if args.front_door not in FRONT_DOORS:
        raise ValueError(f"--front-door must be one of {list(FRONT_DOORS)}, got {args.front_door!r}")
    args.tests = args.tests or list(OPTIMIZER_TESTS)
    args.test_file = os.path.join(args.horovod_source, "test", "parallel", "test_torch.py")
    with tempfile.TemporaryDirectory() as tmp:
        if args.without_muon:
            args.test_file = tests_without_muon(args.horovod_source, tmp)
        run_all(args)
    return 0


def run_all(args):
    tally = {}
    for test in args.tests:
        outcome, seconds, tail = run_one(args, test)
        tally[outcome] = tally.get(outcome, 0) + 1
        print(f"{test:40s} {outcome:8s} {seconds:6.1f} s" + ("" if outcome == "passed" else f"   {tail[-1][:160]}"),
              flush=True)
    print(f"{args.front_door}: " + ", ".join(f"{n} {k}" for k, n in sorted(tally.items())))
