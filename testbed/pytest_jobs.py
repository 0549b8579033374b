"""Multi-rank jobs that tests declare and read, run in shared launches: a pytest plugin.

A launch costs seconds on a small machine (horovodrun, two imports of torch and Horovod, Gloo's
rendezvous), often more than the run it starts. So a test declares the runs it reads as ``Job``
values, ``job(np, worker, *args)``, in its parameters or in ``@pytest.mark.jobs(...)``, and reads each
with the ``results`` fixture. After collection, the selected tests' jobs are grouped by rank count and
launch settings (backend, environment, network namespace) across a test folder (jobs that register
process sets, across their test file only); each group runs in one launch (testbed/batch.py) the
first time a test asks for one of its jobs. Each test still asserts on its own jobs, so a failure
names its test; a job that fails fails only the tests that read it.

Loaded for every test folder by the repository's root conftest.py (``pytest_plugins``). A worker
named by its file name lives in the ``workers/`` folder beside the test file that declares it and
gets ``--out FOLDER`` (where it writes ``rank<r>.pt`` or ``rank<r>.json``); a worker named by a path
(``examples/char_lm.py``) is taken from the repository root and gets only its arguments.

Example (tests/test_example.py, with tests/workers/ones.py writing ``{"total": ...}`` per rank)::

    from testbed.pytest_jobs import job

    ONES = job(2, "ones.py", "--value", 1)

    @pytest.mark.jobs(ONES)
    def test_two_ranks_add_up(results):
        assert [r["total"] for r in results(ONES)] == [2, 2]
"""
import contextlib
import dataclasses
import json
import os
import time
from typing import NamedTuple, Optional

import pytest

__all__ = ["Job", "job", "Out", "OutOf", "JobRun", "JobResults", "ROOT"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class Out:
    """An argument, or an environment value, naming a file in the job's own output folder
    (``Out("result.json")``): known only when the job runs."""
    name: str


@dataclasses.dataclass(frozen=True)
class Job:
    """One run of a worker on ``np`` ranks; equal jobs (same worker, arguments, ranks, settings) run
    once. Made by ``job(...)``, which checks the fields."""
    np: int
    worker: str
    args: tuple
    backend: str = "mpi"
    alone: object = False
    env: tuple = ()
    netns: Optional[str] = None
    timeout: float = 240
    fails: bool = False

    def group(self, scope):
        """The launch this job shares: the jobs of the same ranks and launch settings (and ``alone``
        label) of the tests in ``scope`` (a test folder, or one test file)."""
        return (scope, self.np, self.backend, self.env, self.netns, self if self.alone is True else self.alone)


@dataclasses.dataclass(frozen=True)
class OutOf:
    """An argument naming a file that an earlier job wrote (``OutOf(first, "ckpt.pt")``): the job that
    reads it runs after ``job``, in the same launch when they share one."""
    job: Job
    name: str


def job(np, worker, *args, backend=None, alone=False, env=None, netns=None, timeout=240, fails=False):
    """A ``Job``: ``worker`` run on ``np`` ranks with the arguments a command line would get.

    Args:
        np: ranks, >= 1.
        worker: a file in the ``workers/`` folder beside the declaring test file (it gets ``--out``
            first), or a path from the repository root such as ``"examples/char_lm.py"``.
        args: its arguments (``str()`` of each), ``Out(name)`` or ``OutOf(job, name)``.
        backend: ``"mpi"`` (mpirun) or ``"gloo"`` (horovodrun --gloo). None: ``"gloo"`` for a job that
            ``fails`` (horovodrun lets every rank print its own error, which those tests read, where
            mpirun ends the other ranks at the first exit) or runs in a ``netns`` (the wire tests count
            the bytes of the transport as users launch it), else ``"mpi"``, the cheaper launch here
            (figures in docs/testing.md).
        alone: True: the run needs a launch of its own (state that lives as long as the process, such as
            the class form ``compression=TopKEF``, or ``hvd.shutdown()``); a string: it shares a launch
            only with the jobs of the same string (e.g. jobs that all register the same process sets at
            ``hvd.init``, which only the launch's first ``hvd.init`` registers).
        env: extra environment variables of its launch, ``{name: value}`` (``Out`` values allowed when
            ``alone``); jobs with other variables never share a launch.
        netns: None, or the launch runs in a private network namespace (testbed/wire.py) whose
            loopback carries only its bytes: ``"unlimited"``, or a tbf rate such as ``"100mbit"``.
        timeout: seconds the run may take once started; past them its ranks exit with their stacks.
        fails: the job is expected to fail (the test reads it in ``pytest.raises(JobFailed)``): it runs
            after the other jobs of its launch, since its failure ends the launch.

    Returns:
        The ``Job``, to list in ``@pytest.mark.jobs(...)`` or a test's parameters.

    Example:
        >>> job(2, "train.py", "--steps", 10).args
        ('--steps', '10')
    """
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"np: the number of ranks, an int >= 1, got {np!r}")
    if backend is None:
        backend = "gloo" if fails or netns is not None else "mpi"
    if backend not in BACKENDS:
        raise ValueError(f"backend: one of {BACKENDS}, got {backend!r}")
    if not (alone is True or alone is False or isinstance(alone, str) and alone):
        raise ValueError(f"alone: True, False or a non-empty label, got {alone!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout: seconds > 0, got {timeout!r}")
    if netns is not None and not (isinstance(netns, str) and netns):
        raise ValueError(f"netns: None, 'unlimited' or a tbf rate such as '100mbit', got {netns!r}")
    env = tuple(sorted((str(k), v if isinstance(v, Out) else str(v)) for k, v in (env or {}).items()))
    if not alone and any(isinstance(v, Out) for _, v in env):
        raise ValueError("env: an Out(...) value names one job's folder, so the job needs alone=True")
    return Job(np, worker, tuple(a if isinstance(a, (Out, OutOf)) else str(a) for a in args), backend, alone,
               env, netns, timeout, bool(fails))


class JobRun(NamedTuple):
    """How a job ended: its output folder, the ``JobFailed`` it ended in (None: it ran to the end on
    every rank), its part of its launch's output, and the ``time.time()`` of its start on its first rank
    and of its end on the last or of the end of the launch it failed in (None if it never started)."""
    folder: object
    failure: Optional[Exception]
    output: str
    started: Optional[float]
    ended: Optional[float]

    @property
    def seconds(self):
        """From the job's start to its end (not counting its launch's start)."""
        return None if self.started is None else self.ended - self.started


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


def pytest_configure(config):
    config.addinivalue_line("markers", "jobs(*jobs): the testbed.pytest_jobs Jobs a test reads, run with other "
                                       "tests' jobs in shared launches")


def pytest_collection_modifyitems(items):
    """Tests that read jobs (``results``) start multi-rank jobs: marked ``multirank``. Tests that launch
    in other ways carry the mark themselves."""
    for item in items:
        if "results" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multirank)


def _script(folder, worker):
    """The worker's file: in ``folder``/workers, or from the repository root; and whether it is in workers/."""
    own = os.sep not in worker and "/" not in worker
    return (os.path.join(folder, "workers", worker) if own else os.path.join(ROOT, worker)), own


def _registers_process_sets(folder, j):
    """Whether the job's worker registers process sets at ``hvd.init``, which only a launch's first
    ``hvd.init`` does: such a job shares launches only with its own test file's jobs, as written for."""
    try:
        with open(_script(folder, j.worker)[0]) as f:
            return "process_sets=" in f.read()
    except OSError:
        return False


def _scope(item, jobs):
    """Which tests' jobs share this test's launches: its folder's, or its file's when its jobs register
    process sets."""
    folder = str(item.path.parent)
    return str(item.path) if any(_registers_process_sets(folder, j) for j in jobs) else folder


def pytest_collection_finish(session):
    plan = _Plan()
    for item in session.items:      # the selected tests only (after -k, -m, --deselect)
        values = list(getattr(getattr(item, "callspec", None), "params", {}).values())
        for marker in item.iter_markers("jobs"):
            values.extend(marker.args)
        jobs = list(_jobs_in(values))
        scope = _scope(item, jobs)
        plan.folders[scope] = str(item.path.parent)
        for j in jobs:
            plan.scopes[item.nodeid, j] = scope
            group = plan.groups.setdefault(j.group(scope), [])
            if j not in group:
                group.append(j)
    for group in plan.groups.values():  # stable: the others in their order, then the jobs expected to fail
        group.sort(key=lambda j: j.fails)
    timeouts = {key: sum(j.timeout for j in group) for key, group in plan.groups.items()}
    if session.config.pluginmanager.hasplugin("timeout"):
        for item in session.items:      # a test may run its groups' launches: their own timeouts guard them
            keys = {j.group(scope) for (nodeid, j), scope in plan.scopes.items() if nodeid == item.nodeid}
            if keys:
                item.add_marker(pytest.mark.timeout(sum(timeouts[k] for k in keys) + 120 * len(keys)))
    session.config.stash[_PLAN] = plan


class _Plan:
    def __init__(self):
        self.groups = {}            # Job.group(scope) -> its jobs, in the order they must run
        self.scopes = {}            # (test's node id, job) -> the scope its launches are shared in
        self.folders = {}           # scope -> the test folder (its workers/ folder holds the workers)
        self.launches = []          # (seconds, ranks, jobs, first worker, scope): what the suite spent where
        self.jobs = []              # (seconds, ranks, worker, arguments): which runs inside the launches


_PLAN = pytest.StashKey()


class SharedJobs:
    """Runs each group of declared jobs in one launch when first needed."""

    def __init__(self, plan, tmp_path_factory):
        self.plan = plan
        self.tmp = tmp_path_factory
        self.runs = {}              # (scope, job) -> JobRun

    def run(self, nodeid, j):
        """The ``JobRun`` of job ``j``, declared by the test ``nodeid``; runs its group if needed."""
        scope = self.plan.scopes.get((nodeid, j))
        assert scope is not None, f"{j} is not declared: list it in the test's parameters or in @pytest.mark.jobs(...)"
        if (scope, j) not in self.runs:
            self._launch(j.group(scope))
        return self.runs[scope, j]

    def _launch(self, key):
        from testbed.batch import run_entries

        scope = key[0]
        todo = [j for j in self.plan.groups[key] if (scope, j) not in self.runs]
        for j in todo:              # files read from a job of another group: that group first
            for a in j.args:
                if isinstance(a, OutOf) and a.job not in todo and (scope, a.job) not in self.runs:
                    self._launch(a.job.group(scope))
        folders = {j: self.tmp.mktemp(os.path.basename(j.worker).removesuffix(".py")) for j in todo}
        entries = [self._argv(scope, j, folders) for j in todo]
        first = todo[0]
        launch = dict(backend=first.backend, cwd=ROOT,
                      env={k: str(folders[first] / v.name) if isinstance(v, Out) else v for k, v in first.env})
        started = time.monotonic()
        with _namespace(first.netns) as prefix:
            outcomes = run_entries(first.np, entries, timeout_each=[j.timeout for j in todo], prefix=prefix, **launch)
        self.plan.launches.append((time.monotonic() - started, first.np, len(todo), first.worker,
                              os.path.relpath(scope, ROOT)))
        for j, outcome in zip(todo, outcomes):
            self.runs[scope, j] = run = JobRun(folders[j], *outcome)
            if run.seconds is not None:
                self.plan.jobs.append((run.seconds, j.np, j.worker, " ".join(map(str, j.args))))

    def _argv(self, scope, j, folders):
        """The worker's command line: its script, ``--out`` for workers/, its arguments with paths."""
        script, own = _script(self.plan.folders[scope], j.worker)
        if not os.path.isfile(script):
            raise ValueError(f"worker {j.worker!r}: no such file {script}")
        args = [str(folders[j] / a.name) if isinstance(a, Out) else
                str(self.runs[scope, a.job].folder / a.name) if isinstance(a, OutOf) and a.job not in folders else
                str(folders[a.job] / a.name) if isinstance(a, OutOf) else a for a in j.args]
        return [script, *(["--out", str(folders[j])] if own else []), *args]


@contextlib.contextmanager
def _namespace(netns):
    """The launch prefix for ``Job.netns``: nothing, or a fresh namespace's, deleted after the launch."""
    if netns is None:
        yield ()
        return
    from testbed.wire import Namespace
    with Namespace(rate=None if netns == "unlimited" else netns) as ns:
        yield tuple(ns.prefix)


class JobResults:
    """What the ``results`` fixture gives a test: ``results(job)``, ``results.path(job, name)`` and
    ``results.run(job)`` for the jobs it declared."""

    def __init__(self, shared, nodeid):
        self.shared, self.nodeid = shared, nodeid

    def __call__(self, j):
        """The per-rank result dicts the worker saved (``rank<r>.pt``, or ``rank<r>.json``); raises the
        ``JobFailed`` the job ended in."""
        folder = self.path(j, ".")
        ranks = []
        for r in range(j.np):
            pt, js = folder / f"rank{r}.pt", folder / f"rank{r}.json"
            if pt.exists():
                import torch
                ranks.append(torch.load(pt, weights_only=False))
            elif js.exists():
                ranks.append(json.loads(js.read_text()))
            else:
                raise FileNotFoundError(f"{j.worker} wrote neither {pt.name} nor {js.name} in {folder}")
        return ranks

    def path(self, j, name):
        """The path of ``name`` in the job's output folder, once the job ran to the end on every rank;
        raises the ``JobFailed`` the job ended in."""
        done = self.run(j)
        if done.failure is not None:
            raise done.failure
        return done.folder / name

    def run(self, j):
        """The job's ``JobRun`` (folder, failure, output, seconds), however it ended: for jobs expected to
        fail, or whose output or time is read."""
        return self.shared.run(self.nodeid, j)


@pytest.fixture(scope="session")
def _shared_jobs(request, tmp_path_factory):
    return SharedJobs(request.config.stash[_PLAN], tmp_path_factory)


def pytest_terminal_summary(terminalreporter, config):
    """The slowest shared launches, and the slowest jobs inside them. ``--durations`` charges a launch to
    the first test that reads one of its jobs, so it alone does not say where the suite's minutes go."""
    plan = config.stash.get(_PLAN, None)
    launches = sorted(plan.launches if plan else [], reverse=True)
    if not launches:
        return
    terminalreporter.section("slowest shared launches")
    total = sum(seconds for seconds, *_ in launches)
    terminalreporter.write_line(f"{len(launches)} launches, {total:.0f} s in all")
    for seconds, ranks, jobs, worker, scope in launches[:10]:
        terminalreporter.write_line(f"{seconds:7.1f}s  {ranks} ranks, {jobs} jobs, first {worker} ({scope})")
    terminalreporter.write_line("slowest jobs inside them:")
    for seconds, ranks, worker, args in sorted(plan.jobs, reverse=True)[:10]:
        terminalreporter.write_line(f"{seconds:7.1f}s  {ranks} ranks, {worker} {args[:90]}")


@pytest.fixture
def results(request, _shared_jobs):
    """``results(job)``: the per-rank result dicts of a job this test declared, run with other tests'
    jobs in one launch; ``results.path(job, name)``, ``results.run(job)``: see ``JobResults``."""
    return JobResults(_shared_jobs, request.node.nodeid)
