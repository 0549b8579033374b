"""testbed/batch.py: several scripts in turn in one 2-rank job, as the shared jobs of the suite run.

One call holds a script that succeeds, one that fails on one rank while the other waits in a
collective, one that hangs in a collective, and successes between them: each entry's outcome, part of
the output and times are its own, the entries after a failure run in a new job, and the torch defaults
a script changed do not reach the next one.
"""
import json
import time

import pytest

from testbed.batch import run_batch, run_entries
from testbed.launch import JobFailed
from conftest import ROOT

pytestmark = pytest.mark.multirank

OK = """
import json, sys, torch, horovod.torch as hvd
hvd.init()
assert torch.get_default_dtype() == torch.float32, "a default from an earlier entry leaked"
torch.set_default_dtype(torch.float64)
total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ok").item()
print("ok entry writes", sys.argv[1])
json.dump({"argv": sys.argv[1:], "total": total}, open(sys.argv[1] + f".rank{hvd.rank()}", "w"))
"""
FAILS_ON_RANK_1 = """
import torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    raise RuntimeError("entry failed on purpose")
hvd.allreduce(torch.ones(1), name="waits for rank 1")
"""
HANGS = """
import time, torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 0:
    hvd.allreduce(torch.ones(1), name="rank 1 never joins")
time.sleep(3600)
"""


@pytest.mark.slow
def test_each_entry_has_its_own_outcome_and_later_entries_still_run(tmp_path):
    scripts = {}
    for name, text in (("ok", OK), ("fails", FAILS_ON_RANK_1), ("hangs", HANGS)):
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(text)
    out = [tmp_path / f"out{i}" for i in range(3)]
    entries = [[scripts["ok"], out[0]], [scripts["fails"]], [scripts["ok"], out[1]], [scripts["hangs"]],
               [scripts["ok"], out[2]]]
    start = time.monotonic()
    # the hung entry's own timeout short (4 s): it is the one waited out
    outcome = run_entries(2, entries, timeout_each=[60, 60, 60, 4, 60], cwd=ROOT)
    assert time.monotonic() - start < 120
    assert [o.failure is None for o in outcome] == [True, False, True, False, True]
    assert all(isinstance(outcome[i].failure, JobFailed) for i in (1, 3))
    assert "entry failed on purpose" in outcome[1].failure.output
    assert "Timeout" in outcome[3].failure.output   # faulthandler's report of the hung entry's stacks
    for path in out:
        for rank in (0, 1):
            assert json.loads((tmp_path / f"{path.name}.rank{rank}").read_text())["total"] == 2.0
    # each entry's part of the output holds its own lines only, though 0 and 1, then 2 and 3, shared a job
    for i, part in zip((0, 2, 4), out):
        assert outcome[i].output.count(f"ok entry writes {part}") == 2                # one line per rank
        assert "ok entry writes" not in outcome[i].output.replace(f"ok entry writes {part}", "")
        assert "failed on purpose" not in outcome[i].output and "Timeout" not in outcome[i].output
    assert "entry failed on purpose" in outcome[1].output and "ok entry writes" not in outcome[1].output
    # every entry started; the hung one ran its 4 s before its ranks were ended
    assert all(o.started is not None and o.ended >= o.started for o in outcome)
    assert 4 <= outcome[3].ended - outcome[3].started < 60


def test_timeouts_are_checked_before_anything_is_launched():
    for bad in ([10], 0, [10, -1]):
        with pytest.raises(ValueError, match="timeout_each"):
            run_batch(2, [["a.py"], ["b.py"]], timeout_each=bad, cwd=ROOT)
