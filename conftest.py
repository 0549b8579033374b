"""Loaded by pytest for every test folder of the repository: the multi-rank jobs that tests declare
and read (testbed/pytest_jobs.py: ``job``, ``OutOf``, ``Out``, the ``results`` fixture), and the
shutdown grace of the suite's jobs."""
import os

pytest_plugins = ["testbed.pytest_jobs"]

# A job whose ranks fail a check of their agreement ends HVD_TOPK_SHUTDOWN_GRACE_S after the error (15 s
# unset). The suite's refusal jobs wait that out, on an idle machine whose ranks reach the check within
# a second of each other: 5 s there (every launch inherits it; remote ranks keep 15 s).
os.environ.setdefault("HVD_TOPK_SHUTDOWN_GRACE_S", "5")
