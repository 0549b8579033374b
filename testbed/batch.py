"""Several scripts in turn inside one multi-rank job: one launch and one ``hvd.init()`` for many runs.

On a small machine a launch costs seconds (the launcher, two imports of torch and Horovod per rank,
Gloo's rendezvous), often more than the run itself. ``run_batch`` starts this file as the job's
command; on every rank it runs each entry as ``__main__`` with its own ``sys.argv`` and ``sys.path[0]``,
exactly as ``python script args`` would, in the same order, so entry i's collectives all finish
before entry i+1 starts. Scripts that call ``hvd.init()`` again get the running Horovod (Horovod
ignores a second ``init``); scripts that shut Horovod down, or need their own environment, cannot share a job.

A failing entry ends the job (``os._exit(1)``): the other ranks may wait in its collectives, and only
ending the job frees them. Marks written before and after each entry tell the launcher which entry
failed; ``run_batch`` reports that one as failed and starts a new job for the entries after it.

    python testbed/batch.py PLAN.json   # what run_batch launches; PLAN: {"marks", "timeout_each", "entries"}
"""
import contextlib
import faulthandler
import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings

__all__ = ["run_batch"]


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


def _run_entries(plan_path):
    """Run every entry of the plan in order on this rank; exit the process at the first failure."""
    with open(plan_path) as f:
        plan = json.load(f)
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401  (imported first, so that its defaults can be kept from entry 0 on)
    for index, argv in enumerate(plan["entries"]):
        _mark(plan["marks"], index, "started")
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
        # An entry that hangs (a rank waiting inside a collective's C++ call, deaf to Python signals)
        # is ended from faulthandler's own thread, with every thread's stack, after its time is up.
        faulthandler.dump_traceback_later(plan["timeout_each"], exit=True)
        try:
            with warnings.catch_warnings(), _torch_defaults_kept():
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:              # argparse's --help, or a script's own exit
            if stop.code not in (None, 0):
                print(f"batch entry {index} ({' '.join(argv)}) exited with {stop.code}", flush=True)
                sys.stdout.flush()
                os._exit(1)
        except BaseException:                   # noqa: B902  (whatever it was, the job must end)
            traceback.print_exc()
            print(f"batch entry {index} ({' '.join(argv)}) failed", flush=True)
            sys.stderr.flush()
            os._exit(1)
        faulthandler.cancel_dump_traceback_later()
        _mark(plan["marks"], index, "done")


def _finished(marks, index, np):
    return all(os.path.exists(os.path.join(marks, f"{index}.done.rank{r}")) for r in range(np))


def run_batch(np, entries, timeout_each=240, **launch):
    """Run ``entries`` (argv lists, each ``[script, arg, ...]``) in turn, in as few jobs as possible.

    Args:
        np: ranks of every job.
        entries: the runs, in the order they must run (a later entry may read an earlier one's files).
        timeout_each: seconds allowed per entry: past them the entry's ranks exit, dumping their stacks.
        launch: passed to ``run_job`` (backend, prefix, env, cwd).

    Returns:
        A list with, per entry, None when it ran to the end on every rank, or the ``JobFailed`` of the
        job it failed in. An entry after a failed one runs in the next job; a job that fails before
        its first entry starts fails every entry it held.
    """
    from testbed.launch import JobFailed, run_job

    outcome = [None] * len(entries)
    pending = list(range(len(entries)))
    while pending:
        with tempfile.TemporaryDirectory(prefix="batch-") as marks:
            plan = os.path.join(marks, "plan.json")
            with open(plan, "w") as f:
                json.dump({"marks": marks, "timeout_each": timeout_each,
                           "entries": [list(map(str, entries[i])) for i in pending]}, f)
            try:
                run_job(np, [sys.executable, os.path.abspath(__file__), plan],
                        timeout=timeout_each * len(pending), **launch)
                return outcome
            except JobFailed as failed:
                done = 0
                while done < len(pending) and _finished(marks, done, np):
                    done += 1
                if done == len(pending):        # every entry finished, then the job failed: blame the last
                    done -= 1
                started = os.path.exists(os.path.join(marks, f"{done}.started.rank0")) or done > 0
                failed_entries = pending[done:done + 1] if started else pending
                for i in failed_entries:
                    outcome[i] = failed
                pending = pending[done + 1:] if started else []
    return outcome


if __name__ == "__main__":
    _run_entries(sys.argv[1])
