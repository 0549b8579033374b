"""Loaded by pytest for every test folder of the repository: the multi-rank jobs that tests declare
and read (testbed/pytest_jobs.py: ``job``, ``OutOf``, ``Out``, the ``results`` fixture)."""
pytest_plugins = ["testbed.pytest_jobs"]
