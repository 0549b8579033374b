"""Loaded by pytest for every test folder of the repository: the multi-rank jobs that tests declare
and read (testbed/pytest_jobs.py: ``job``, ``OutOf``, ``Out``, the ``results`` fixture), and the
shutdown grace of the suite's jobs."""
import os

pytest_plugins = ["testbed.pytest_jobs"]

# A job whose ranks fail a check of their agreement ends HVD_TOPK_SHUTDOWN_GRACE_S after the error (15 s
# unset). The suite's refusal jobs wait that out, on an idle machine whose ranks reach the check within
# a second of each other: 3 s there, the least the library accepts (every launch inherits it; remote
# ranks keep 15 s). Waiting ranks spin in Horovod's synchronize, so each second of grace costs the
# machine's cores too: the refusal tests took 169 s at 3 s against 196 s at 5 s (docs/studies/2026-11-suite-time.md).
os.environ.setdefault("HVD_TOPK_SHUTDOWN_GRACE_S", "3")
