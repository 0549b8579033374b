"""The ``Transport`` protocol's invariants (hvd_topk/transports/base.py), checked for every transport on
real ranks (tests/workers/transports.py): aggregates identical bit for bit on every rank and equal to
the average of what left the ranks; None everywhere when one rank was non-finite; error feedback exact
in float64 per rank; ``nbytes`` within each transport's bound; ``forget()`` leaves a working transport."""
import pytest
import torch

from conftest import job

TRANSPORTS = ("dense", "artopk", "allgather", "split_reduce")
NAN_STEP = 3
JOBS = [job(np, "transports.py", "--nan-step", NAN_STEP) for np in (2, 3)]


def max_nbytes(name, n, k, ranks):
    """What ``start`` may hand the collectives: values are float32, indices int32 (hvd_topk.core.wire)."""
    return {"dense": 4 * n,
            "artopk": 4 * (k + 1),                       # k values + the finite flag
            "allgather": 4 * (k + 1) + 4 * k,            # values + flag, and their indices
            "split_reduce": 8 * (k + ranks)}[name]       # (value, index) rows + one flag row per owner


@pytest.mark.jobs(*JOBS)
@pytest.mark.parametrize("np", (2, 3))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_transport_contract(results, np, name):
    ranks = [r[name] for r in results(JOBS[(2, 3).index(np)])]
    for records in zip(*ranks):                          # one (step, key) across the ranks
        step, key = records[0]["step"], records[0]["key"]
        aggregates = [r["aggregate"] for r in records]
        if step == NAN_STEP and key == "a":
            assert all(a is None for a in aggregates), (name, step, key)
            continue
        assert all(a is not None and torch.equal(a, aggregates[0]) for a in aggregates), (name, step, key)
        average_sent = sum(r["sent"] for r in records) / np
        torch.testing.assert_close(aggregates[0].double(), average_sent, rtol=1e-5, atol=1e-6)
        n, k = records[0]["sent"].numel(), records[0]["k"]
        assert all(0 < r["nbytes"] <= max_nbytes(name, n, k, np) for r in records), (name, step)
        if name != "dense":
            assert all(int(r["sent"].count_nonzero()) <= k for r in records), (name, step, key)
    for rank in ranks:                                   # Σ sent + residual = Σ grad, committed steps
        for key in ("a", "b"):
            mine = [r for r in rank if r["key"] == key and not (r["step"] == NAN_STEP and key == "a")]
            total_sent = sum(r["sent"] for r in mine)
            torch.testing.assert_close(total_sent + mine[-1]["residual"], sum(r["grad"] for r in mine),
                                       rtol=0, atol=1e-5)


@pytest.mark.jobs(*JOBS)
@pytest.mark.parametrize("np", (2, 3))
def test_waiting_ranks_sleep_instead_of_spinning(results, np):
    # The ranks that wait a second for the last one spend a small part of it on the CPU; Horovod's own
    # synchronize() (HVD_TOPK_SPIN_WAIT=1) would spend all of it, starving ranks that share the cores.
    waits = [r["late_wait"] for r in results(JOBS[(2, 3).index(np)])][:-1]
    for wall, cpu in waits:
        assert wall > 0.5 and cpu < 0.2 * wall, waits
