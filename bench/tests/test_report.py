"""bench/report.py: a results folder's files from records made by hand: the table's rows, a
headline.json that docs/results.md's generator accepts, the plots, and the same files again from
records.json alone."""
import json

import pytest

from bench import report, results_page
from bench.tests.test_figures import _arm, _record, _two_seeds

FILES = ("records.json", "summary.json", "table.md", "headline.json", "curves.png", "steps.png")


@pytest.fixture
def folder(tmp_path):
    report.write(str(tmp_path), _two_seeds(), "python -m bench run --seeds 0,1", targets=[0.9], load=[1.5, 2.5])
    return tmp_path


def test_every_file_is_written(folder):
    for name in FILES:
        assert (folder / name).stat().st_size > 0, name
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["command"] == "python -m bench run --seeds 0,1" and summary["load_avg"] == [1.5, 2.5]
    assert set(summary["arms"]) == {"horovod dense", "topkef", "ddp powersgd r4"}


def test_table_rows(folder):
    text = (folder / "table.md").read_text()
    assert "Horovod cycle time 1 ms (Horovod's default)" in text and "seeds [0, 1]" in text
    assert "| topkef | 600.0 (500.0-700.0) | 4,100 | 4,000 | 6.83x, 0.0041x | 0.9480 | 10.5 s (20) | 21.0 s (40) | yes |" \
        in text
    assert "| ddp powersgd r4 |" in text and "reached by 1/2 seeds" in text
    assert "- horovod dense - 1 pt: topkef" in text and "Load average (1 min) during the job: 1.5-2.5" in text


def test_headline_is_what_the_results_page_reads(folder):
    checked = results_page.read_headline(str(folder / "headline.json"))
    assert checked["page"] is None and len(checked["date"]) == 10
    measures = [r["measure"] for r in checked["rows"]]
    assert measures == ["topkef vs horovod dense: median step / bytes per rank per step",
                        "ddp powersgd r4 vs horovod dense: median step / bytes per rank per step",
                        "Training time to horovod dense - 1 pt, each arm"]
    assert checked["rows"][0]["value"] == "600.0 vs 4,100.0 ms (speed-up 6.83x) / 0.0041x the bytes"
    assert checked["rows"][2]["value"] == "horovod dense 162.0 s, topkef 21.0 s, ddp powersgd r4 not reached"
    assert checked["rows"][0]["setup"] == "cnn, 2 ranks, 100mbit loopback, cycle 1 ms (Horovod's default)"


def test_each_arm_over_its_bound_beside_the_compute_only_arm(tmp_path):
    """2 hosts x 2 ranks at 100 Mbit/s: topkef's 500 ms step, 250 kB per rank (500 kB on a host's link:
    40 ms), against the compute-only step of 300 ms: 500 / 340 = 1.47x; no bound on an unlimited link."""
    arms = {"compute only": _arm([[20, 6.0, 0.5, 1.0]], step_s=[0.3] * 3, nbytes=[10.0] * 3, kind="local"),
            "topkef": _arm([[20, 10.0, 0.9, 0.5]], step_s=[0.5] * 3, nbytes=[250e3] * 3)}
    record = dict(_record(0, arms), ranks=4, hosts=2, iface="eth0")
    report.write(str(tmp_path), [record], "cmd")
    text = (tmp_path / "table.md").read_text()
    assert "- topkef: 500.0 / (300.0 + 40.0) ms = 1.47x" in text, text
    assert "one host's 100mbit link (2 ranks' bytes per rank)" in text and "| - (no exchange) |" in text
    report.write(str(tmp_path / "fast"), [dict(record, link="unlimited")], "cmd")
    assert "over its bound" not in (tmp_path / "fast" / "table.md").read_text()


def test_headline_without_a_dense_arm_gives_each_arms_own_figures(tmp_path):
    records = [_record(0, {"topkef": _arm([[20, 10.0, 0.93, 0.5]])})]
    report.write(str(tmp_path), records, "cmd", title="one arm", page="docs/benchmarks.md")
    checked = results_page.read_headline(str(tmp_path / "headline.json"))
    assert checked["title"] == "one arm" and checked["page"] == "docs/benchmarks.md"
    assert checked["rows"][0] == {"measure": "topkef: median step / bytes per rank per step",
                                  "value": "200.0 ms / 4,100 B",
                                  "setup": "cnn, 2 ranks, 100mbit loopback, cycle 1 ms (Horovod's default)"}


def test_the_folder_is_rebuilt_from_its_records_alone(folder):
    table = (folder / "table.md").read_text()
    for name in FILES[1:]:
        (folder / name).unlink()
    report.rebuild(str(folder))
    assert (folder / "table.md").read_text() == table and (folder / "curves.png").exists()
