import dataclasses
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def assert_identical_across_ranks(results):
    """Bit-identical parameters on every rank, and training that did not blow up (a stronger check
    than identity alone: diverged runs can be identical too)."""
    for name, value in results[0]["params"].items():
        assert torch.isfinite(value).all() and value.abs().max() < 100, f"{name} diverged"
    for r, res in enumerate(results[1:], start=1):
        for name, value in results[0]["params"].items():
            assert torch.equal(value, res["params"][name]), f"rank {r} differs from rank 0 in {name}"


def assert_skipped_everywhere(results, step):
    """The job's --overflow-step ``step`` was skipped on every rank with every state, residual and
    parameter unchanged (the worker's snapshot), and the next step was not; returns the skip records."""
    assert_identical_across_ranks(results)
    skips = []
    for res in results:
        (skip,) = res["skipped"]
        assert skip["had_residuals"] and skip["state_unchanged"] and skip["params_unchanged"]
        assert res["stats"][step]["skipped"] and not res["stats"][step + 1]["skipped"]
        skips.append(skip)
    return skips


def resume_jobs(args, save_at):
    """Three 2-rank opt_train.py jobs: straight through, saved after step ``save_at``, resumed from that
    save (see ``assert_resume_bit_identical``)."""
    first = job(2, "opt_train.py", *args, "--save-at", save_at)
    return job(2, "opt_train.py", *args), first, job(2, "opt_train.py", *args, "--resume", OutOf(first, "ckpt.pt"))


def assert_resume_bit_identical(results, jobs):
    """The run saved and resumed (``resume_jobs``) ends bit-identical to the one straight run."""
    full, _, resumed = map(results, jobs)
    for r in range(2):
        for name, value in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][name], value), f"rank {r} {name} differs after resume"


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process (world size 1: collectives are local)."""
    import horovod.torch as hvd
    hvd.init()
    return hvd


@pytest.fixture
def run_ranks(tmp_path):
    """Run a test worker on N real ranks; returns the per-rank result dicts saved by the worker."""
    from testbed.launch import run_job

    def run(np, worker, *args, backend="gloo", timeout=240, prefix=(), out=None):
        out = out or tmp_path / f"job{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        argv = [sys.executable, os.path.join(WORKERS, worker), "--out", str(out), *map(str, args)]
        run_job(np, argv, backend=backend, timeout=timeout, prefix=prefix, cwd=ROOT)
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(np)]

    return run


# -- jobs that share a launch ------------------------------------------------------------------------
#
# A launch costs seconds on a small machine, often more than the run it starts. A test declares the
# runs it reads as ``Job`` values, in its parameters or in a ``jobs`` marker. After collection, the
# selected tests' jobs are grouped by (module, ranks, backend) and each group runs in one launch
# (testbed/batch.py), the first time a test asks for one of them; each test still asserts on its
# own jobs, so a failure names its test. A job that fails fails only the tests that read it.

@dataclasses.dataclass(frozen=True)
class Job:
    """One run of a worker on ``np`` ranks; equal jobs (same worker, arguments, ranks) run once.
    ``alone``: the run needs a process of its own (state that lives as long as the process, such as
    the class form ``compression=TopKEF``)."""
    np: int
    worker: str
    args: tuple
    backend: str = "gloo"
    alone: bool = False

    def group(self, module):
        """The launch this job shares: its module's jobs of the same ranks and backend."""
        return (module, self.np, self.backend) + ((self,) if self.alone else ())


@dataclasses.dataclass(frozen=True)
class OutOf:
    """An argument naming a file that an earlier job wrote (``OutOf(first, "ckpt.pt")``): the job that
    reads it runs after ``job``, in the same launch."""
    job: Job
    name: str


def job(np, worker, *args, backend="gloo", alone=False):
    """A ``Job`` of ``worker`` (a file in tests/workers) with the arguments a command line would get."""
    return Job(np, worker, tuple(a if isinstance(a, OutOf) else str(a) for a in args), backend, alone)


def _jobs_in(value):
    """The jobs in a test parameter or marker argument (a Job, or tuples/lists of them), with every job
    that they read from before them."""
    if isinstance(value, Job):
        for arg in value.args:
            if isinstance(arg, OutOf):
                yield from _jobs_in(arg.job)
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jobs_in(v)


def pytest_collection_modifyitems(items):
    """Tests that read jobs (``run_ranks``, ``results``) start multi-rank jobs: marked ``multirank``.
    Tests that launch in other ways carry the mark themselves."""
    for item in items:
        if {"run_ranks", "results"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multirank)


def pytest_collection_finish(session):
    groups = {}                     # Job.group -> its jobs, in the order they must run
    for item in session.items:      # the selected tests only (after -k, -m, --deselect)
        values = list(getattr(getattr(item, "callspec", None), "params", {}).values())
        for marker in item.iter_markers("jobs"):
            values.extend(marker.args)
        for j in _jobs_in(values):
            group = groups.setdefault(j.group(item.module.__name__), [])
            if j not in group:
                group.append(j)
    session.config.stash[_PLAN] = groups


_PLAN = pytest.StashKey()


class SharedJobs:
    """Runs each group of declared jobs in one launch when first needed; ``results(job)`` reads them."""

    def __init__(self, groups, tmp_path_factory):
        self.groups = groups
        self.tmp = tmp_path_factory
        self.out = {}               # job -> its output folder
        self.failed = {}            # job -> the JobFailed it ended in

    def results(self, module, j):
        """The per-rank result dicts of job ``j``, declared by a test of ``module``."""
        key = j.group(module)
        assert j in self.groups.get(key, ()), f"{j} is not declared: list it in the test's parameters or " \
                                              "in @pytest.mark.jobs(...)"
        if j not in self.out and j not in self.failed:
            self._run(key)
        if j in self.failed:
            raise self.failed[j]
        return [torch.load(self.out[j] / f"rank{r}.pt", weights_only=False) for r in range(j.np)]

    def _run(self, key):
        from testbed.batch import run_batch

        todo = [j for j in self.groups[key] if j not in self.out and j not in self.failed]
        for j in todo:              # files read from a job with another rank count: that group first
            for a in j.args:
                if isinstance(a, OutOf) and a.job not in todo and a.job not in self.out and a.job not in self.failed:
                    self._run(a.job.group(key[0]))
        for j in todo:
            self.out[j] = self.tmp.mktemp(j.worker.removesuffix(".py"))
        entries = [[os.path.join(WORKERS, j.worker), "--out", str(self.out[j]),
                    *(str(self.out[a.job] / a.name) if isinstance(a, OutOf) else a for a in j.args)]
                   for j in todo]
        for j, failure in zip(todo, run_batch(todo[0].np, entries, backend=todo[0].backend, cwd=ROOT)):
            if failure is not None:
                self.failed[j] = failure
                del self.out[j]


@pytest.fixture(scope="session")
def _shared_jobs(request, tmp_path_factory):
    return SharedJobs(request.config.stash[_PLAN], tmp_path_factory)


@pytest.fixture
def results(request, _shared_jobs):
    """``results(job)``: the per-rank result dicts of a job this test declared, run with its module's
    other jobs in one launch."""
    return lambda j: _shared_jobs.results(request.module.__name__, j)
