"""The core's numbers are pinned: every configuration of ``tests/workers/regression.py`` (each transport,
leader, selection and ``compress`` value, the schedules, groups, float16 values, TopKEF in stock Horovod,
and since issue 40 the defaults of 16-bit values and fused buckets) trains 30 steps on 2 ranks and must
end with parameters bit-identical to a reference in ``tests/data/regression_digests.json``.

The references were recorded from the core as it was before its redesign into transport classes (commit
5f2b8d7), with torch 2.13.0 (CPU build) on one thread; the entries changed or added on purpose since
are named, with the reason, under "changes" in the file. The stock configurations name TopKEF's
``communication='artopk'``, its transport when they were recorded (split_reduce is the default now), and
the first 19 send ``values='fp32'`` (fused buckets give their sums bit for bit). CPUs whose kernels round
differently (AVX2 or AVX-512 code paths in torch and MKL) give other bits from the first step on, so the
file holds one reference per kind of CPU it was recorded on, and a run must match every configuration
of one of them: a change to the core would have to reproduce another CPU's rounding in all of them to
pass. The file must hold one reference with every configuration the worker runs (the AVX-512 one). The
first machine's holds the 19 as recorded before issue 40; its CPU is not known, so the entries
re-recorded or added since could not be recorded on it: on such a CPU the run is held to that
reference's configurations less the ones it lists as "stale", and warns naming those it does not pin. On a new kind of CPU, record one more from 5f2b8d7: ``horovodrun
-np 2 -H localhost:2 --gloo python regression.py --out /tmp/ref --record /tmp/ref.json``, with
regression.py taken from commit cec5d95, in a checkout of 5f2b8d7 (the changed entries from a checkout
of the commit named in "changes", with this worker), and add it to "references".
"""
import json
import os
import warnings

import pytest

from conftest import ROOT, job

REFERENCE = os.path.join(ROOT, "tests", "data", "regression_digests.json")
EVERY_CONFIGURATION = job(2, "regression.py", backend="gloo")   # as recorded


@pytest.mark.jobs(EVERY_CONFIGURATION)
def test_every_configuration_bit_identical_to_a_reference(results):
    with open(REFERENCE) as f:
        references = json.load(f)["references"]
    ranks = results(EVERY_CONFIGURATION)
    for reference in references:
        assert reference["configs"].keys() <= ranks[0].keys(), "the worker no longer runs a recorded configuration"
    for name in ranks[0]:
        assert ranks[1][name]["digest"] == ranks[0][name]["digest"], f"{name}: ranks differ"
    assert any(reference["configs"].keys() == ranks[0].keys() for reference in references), \
        "no reference holds every configuration the worker runs"
    differences = []
    for reference in references:
        checked = {name: expected for name, expected in reference["configs"].items()
                   if name not in reference.get("stale", ())}
        changed = {name: (ranks[0][name]["abs_sum"], expected["abs_sum"])
                   for name, expected in checked.items() if ranks[0][name]["digest"] != expected["digest"]}
        if not changed:
            unpinned = sorted(set(ranks[0]) - set(checked))
            if unpinned:                       # a CPU whose reference predates them (module docstring)
                warnings.warn(f"on this CPU's reference ({reference['recorded_on']}) these configurations are "
                              f"not pinned: {unpinned}")
            return
        differences.append(f"against the reference recorded on {reference['recorded_on']}: {changed}")
    pytest.fail("parameters differ from every reference (sum |p| now, then):\n" + "\n".join(differences))
