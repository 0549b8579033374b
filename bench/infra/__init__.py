"""Tooling for benchmarks, tests and the demo (not imported by training code): launching multi-rank
jobs with a hard timeout (launch.py), network namespaces and loopback counters (wire.py), and the
provenance manifest written next to results (manifest.py)."""
