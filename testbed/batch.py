"""Several scripts in turn inside one multi-rank job: one launch and one ``hvd.init()`` for many runs.

On a small machine a launch costs seconds (the launcher, two imports of torch and Horovod per rank,
Gloo's rendezvous), often more than the run itself. ``run_batch`` starts this file as the job's
command; on every rank it runs each entry as ``__main__`` with its own ``sys.argv`` and ``sys.path[0]``,
exactly as ``python script args`` would, in the same order, so entry i's collectives all finish
before entry i+1 starts. Scripts that call ``hvd.init()`` again get the running Horovod (Horovod
ignores a second ``init``); scripts that shut Horovod down, or need their own environment, cannot share a job.

A failing entry ends the job (the rank exits as the script alone would, with status 1, its exit
handlers shutting Horovod down): the other ranks may wait in its collectives, and only ending the job
frees them. Marks written before and after each entry tell the launcher which entry
failed; ``run_batch`` reports that one as failed and starts a new job for the entries after it.
Each rank also prints a line as each entry starts, so that the job's output can be cut into each
entry's part (``run_entries``).

    python testbed/batch.py PLAN.json   # what run_batch launches; PLAN: {"marks", "timeouts", "entries"}
"""
import contextlib
import faulthandler
import json
import os
import re
import runpy
import sys
import tempfile
import time
import traceback
import warnings
from typing import NamedTuple, Optional

__all__ = ["run_batch", "run_entries", "EntryOutcome"]

ENTRY_STARTS = "batch entry {} starts"
_STARTS = re.compile(r"batch entry (\d+) starts$")
_RANK_PREFIX = re.compile(r"^\[\d+\]<\w+>:")      # horovodrun's "[rank]<stdout>:" before each line
EXIT_GRACE_S = 30       # a failed entry's rank ends by then, exit handlers or not
LAUNCH_S = 60           # a launch's own seconds (launcher, imports, rendezvous) beyond its entries' time


class EntryOutcome(NamedTuple):
    """How one entry of ``run_entries`` ended.

    failure: None when it ran to the end on every rank, else the ``JobFailed`` it ended in (its
        output is this entry's part of the job's output).
    output: this entry's part of its job's output (each rank's lines from the entry's start mark to
        the next entry's).
    started, ended: ``time.time()`` of the entry's start on its first rank and of its end on the last,
        or of the end of the job it failed in; None if it never started.
    """
    failure: Optional[Exception]
    output: str
    started: Optional[float]
    ended: Optional[float]


def _mark(marks, index, what):
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    open(os.path.join(marks, f"{index}.{what}.rank{rank}"), "w").close()


@contextlib.contextmanager
def _torch_defaults_kept():
    """The process-wide torch settings a script may change (default dtype, threads, grad mode) are put
    back after it, so that each entry starts as it would in a process of its own."""
    torch = sys.modules.get("torch")
    saved = torch and (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled())
    try:
        yield
    finally:
        torch = sys.modules.get("torch")
        if saved and torch:
            torch.set_default_dtype(saved[0])
            torch.set_num_threads(saved[1])
            torch.set_grad_enabled(saved[2])


def _exit_as_a_script_would():
    """End this rank as the failed script would have ended alone: a normal exit with status 1, whose
    exit handlers shut Horovod down, so that the other ranks see it (and report their own errors, not
    only the launcher's kill). An exit that hangs (a thread that never ends) is cut short with its stacks."""
    sys.stdout.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
    raise SystemExit(1)


def _run_entries(plan_path):
    """Run every entry of the plan in order on this rank; exit the process at the first failure."""
    with open(plan_path) as f:
        plan = json.load(f)
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401  (imported first, so that its defaults can be kept from entry 0 on)
    for index, argv in enumerate(plan["entries"]):
        _mark(plan["marks"], index, "started")
        for stream in (sys.stdout, sys.stderr):        # each is read apart: both say where an entry starts
            print(ENTRY_STARTS.format(index), file=stream, flush=True)
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
        # An entry that hangs (a rank waiting inside a collective's C++ call, deaf to Python signals)
        # is ended from faulthandler's own thread, with every thread's stack, after its time is up.
        faulthandler.dump_traceback_later(plan["timeouts"][index], exit=True)
        try:
            with warnings.catch_warnings(), _torch_defaults_kept():
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:              # argparse's --help, or a script's own exit
            if stop.code not in (None, 0):
                print(f"batch entry {index} ({' '.join(argv)}) exited with {stop.code}", flush=True)
                _exit_as_a_script_would()
        except BaseException:                   # noqa: B902  (whatever it was, the job must end)
            traceback.print_exc()
            print(f"batch entry {index} ({' '.join(argv)}) failed", flush=True)
            _exit_as_a_script_would()
        faulthandler.cancel_dump_traceback_later()
        _mark(plan["marks"], index, "done")


def _finished(marks, index, np):
    return all(os.path.exists(os.path.join(marks, f"{index}.done.rank{r}")) for r in range(np))


def _mark_times(marks, index, what):
    return [os.path.getmtime(os.path.join(marks, name)) for name in os.listdir(marks)
            if name.startswith(f"{index}.{what}.rank")]


def split_output(text, count):
    """Cut a batch job's output into its ``count`` entries' parts: a line goes to the entry its rank's
    stream (the ``[r]<stdout>:`` prefix horovodrun writes; without one, whichever stream started an
    entry last) last started; lines before any entry's start go to the first."""
    parts = [[] for _ in range(count)]
    current, last = {}, 0
    for line in text.splitlines(keepends=True):
        prefix = _RANK_PREFIX.match(line)
        rank = prefix and prefix.group(0)
        starts = _STARTS.search(line.rstrip("\r\n"))
        if starts and int(starts.group(1)) < count:
            current[rank] = last = int(starts.group(1))
        parts[current.get(rank, last)].append(line)
    return ["".join(p) for p in parts]


def run_entries(np, entries, timeout_each=240, **launch):
    """Run ``entries`` (argv lists, each ``[script, arg, ...]``) in turn, in as few jobs as possible.

    Args:
        np: ranks of every job.
        entries: the runs, in the order they must run (a later entry may read an earlier one's files).
        timeout_each: seconds allowed per entry, one number or one per entry: past them the entry's
            ranks exit, dumping their stacks.
        launch: passed to ``run_job`` (backend, prefix, env, cwd).

    Returns:
        One ``EntryOutcome`` per entry. An entry after a failed one runs in the next job; a job that
        fails before its first entry starts fails every entry it held, with the job's whole output.

    Example::

        ok, failed = run_entries(2, [["a.py", "--x", "1"], ["b.py"]], cwd=ROOT)
        if failed.failure: print(failed.output)
    """
    from testbed.launch import JobFailed, run_job

    timeouts = list(timeout_each) if isinstance(timeout_each, (list, tuple)) else [timeout_each] * len(entries)
    if len(timeouts) != len(entries) or not all(t > 0 for t in timeouts):
        raise ValueError(f"timeout_each: one number > 0 or one per entry ({len(entries)}), got {timeout_each!r}")
    outcome = [EntryOutcome(None, "", None, None)] * len(entries)
    pending = list(range(len(entries)))
    while pending:
        with tempfile.TemporaryDirectory(prefix="batch-") as marks:
            plan = os.path.join(marks, "plan.json")
            with open(plan, "w") as f:
                json.dump({"marks": marks, "timeouts": [timeouts[i] for i in pending],
                           "entries": [list(map(str, entries[i])) for i in pending]}, f)
            failed = None
            try:
                text = run_job(np, [sys.executable, os.path.abspath(__file__), plan],
                               timeout=LAUNCH_S + sum(timeouts[i] for i in pending), **launch)
            except JobFailed as error:
                failed, text = error, error.output
            ended = time.time()
            parts = split_output(text, len(pending))
            done = 0
            while done < len(pending) and _finished(marks, done, np):
                done += 1
            if failed is not None and done == len(pending):   # every entry finished, then the job failed
                done -= 1
            for index in range(min(done + 1, len(pending))):
                started = _mark_times(marks, index, "started")
                end = max(_mark_times(marks, index, "done")) if index < done else ended
                outcome[pending[index]] = EntryOutcome(None, parts[index], *((min(started), end) if started else
                                                                             (None, None)))
            if failed is None:
                return outcome
            if outcome[pending[done]].started is not None:      # the entry it failed in had started
                argv = " ".join(map(str, entries[pending[done]]))
                outcome[pending[done]] = outcome[pending[done]]._replace(failure=JobFailed(
                    f"{str(failed).splitlines()[0]} (in batch entry {argv})", parts[done]))
                pending = pending[done + 1:]
            else:                               # nothing started: the launch itself failed
                for i in pending:
                    outcome[i] = EntryOutcome(failed, text, None, None)
                pending = []
    return outcome


def run_batch(np, entries, timeout_each=240, **launch):
    """``run_entries``, returning per entry only None (it ran to the end on every rank) or the
    ``JobFailed`` of the job it failed in."""
    return [entry.failure for entry in run_entries(np, entries, timeout_each, **launch)]


if __name__ == "__main__":
    _run_entries(sys.argv[1])
