"""bench/__main__.py, the one command line: every subcommand parses, bad values are refused naming the
flag (before anything runs), arm lists split at the commas outside brackets, a run refuses to start
where it cannot measure, and a failed job leaves its whole output in the results folder."""
import argparse
import json

import pytest

from bench import __main__ as cli
from bench import links, report, runner
from bench.tests.test_figures import _two_seeds
from testbed.launch import JobFailed


def _run_args(*argv):
    p = cli.parser()
    a = p.parse_args(["run", *argv])
    cli.check_run(p, a)
    return a


def test_every_subcommand_parses_its_defaults():
    p = cli.parser()
    assert p.parse_args(["run"]).arms == "horovod dense,topkef,hvd_topk"
    assert p.parse_args(["select"]).sizes == [10 ** 6, 10 ** 7, 25 * 10 ** 6, 10 ** 8]
    assert p.parse_args(["scale"]).alpha == 50e-6 and p.parse_args(["demo"]).epochs == 20
    assert p.parse_args(["peer-tests", "--horovod-source", "x"]).front_door == "topkef"
    assert p.parse_args(["ab", "true", "false"]).repeats == 3 and p.parse_args(["report", "d"]).folder == "d"


def test_run_values():
    a = _run_args("--arms", "horovod dense, hvd_topk[communication=allgather,warmup_epochs=4],ddp powersgd r4",
                  "--seeds", "0,1,2", "--targets", "0.9,0.95", "--env", "HOROVOD_HIERARCHICAL_ALLREDUCE=1",
                  "--link", "100mbit", "--hosts", "2")
    assert a.arms == ["horovod dense", "hvd_topk[communication=allgather,warmup_epochs=4]", "ddp powersgd r4"]
    assert a.seeds == [0, 1, 2] and a.targets == [0.9, 0.95] and a.out.endswith("bench/results/run_cnn-wide_100mbit_2hosts")
    assert cli.split_arms("a[x=1,y=[2]],b,,c") == ["a[x=1,y=[2]]", "b", "c"]


@pytest.mark.parametrize("argv, match", [
    (["--arms", "horovod dense,horovod fp8"], "horovod fp8"), (["--arms", "topkef,topkef"], "each arm once"),
    (["--arms", "hvd_topk[ratio]"], "key=value"), (["--link", "10mbit"], "10mbit"),
    (["--warmup", "20", "--steps", "20"], "--warmup must be at least 0 and less than --steps"),
    (["--arms", "ddp powersgd r4", "--warmup", "2"], "PowerSGD's dense steps"), (["--hosts", "40"], "--hosts must be 0..32"),
    (["--ratio", "1.5"], "--ratio must be in (0, 1]"), (["--steps", "0"], "--steps must be at least 1"),
    (["--turn", "0"], "--turn must be at least 1"), (["--env", "NOVALUE"], "KEY=VALUE"),
    (["--seeds", "a"], "comma-separated int"), (["--task", "resnet"], "resnet"),
    (["--page", "results.md"], "--page"), (["--link", "1mbit"], "--link must be one of"),
])
def test_bad_run_values_name_the_flag(capsys, argv, match):
    with pytest.raises(SystemExit):
        _run_args(*argv)
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["select", "--dtypes", "fp32,fp8"], "--dtypes"), (["select", "--ratios", "0"], "--ratios"),
    (["select", "--sizes", "10Q"], "--sizes"), (["scale", "--beta", "-1"], "beta must be"),
    (["scale", "--alpha", "-1"], "alpha"), (["peer-tests", "--horovod-source", ".", "--front-door", "x"], "--front-door"),
])
def test_bad_values_of_the_other_subcommands_are_usage_errors(capsys, argv, match, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv] if argv[0] == "peer-tests" else [*argv, "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()                  # refused before anything was written


def test_a_run_refuses_where_it_cannot_measure(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert cli.main(["run", "--out", str(tmp_path / "r")]) == 2
    assert "root" in capsys.readouterr().err and not (tmp_path / "r").exists()
    assert links.missing("100mbit", 0)[0].startswith("root")


def test_a_failed_job_leaves_its_whole_output(monkeypatch, tmp_path):
    output = "[0]<stderr>: the first error\n" + "x" * 10000 + "\n[1]<stderr>: the last line\n"

    def fails(*_, **__):
        raise JobFailed("job exited with 1", output)

    monkeypatch.setattr(links, "run_job", fails)
    placement = links.Placement([], 2, "lo")
    with pytest.raises(JobFailed):
        links.run_ranks(placement, ["python"], {}, 10, failed_log=str(tmp_path / "job_failed.log"))
    assert (tmp_path / "job_failed.log").read_text() == output       # the exception keeps only the tail


def test_the_job_environment():
    env = runner.job_env(None, 300, ["A=1=2"])
    assert "HOROVOD_CYCLE_TIME" not in env and env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "300" and env["A"] == "1=2"
    assert runner.job_env(20.0, 60)["HOROVOD_CYCLE_TIME"] == "20"


def test_report_rebuilds_a_folder(tmp_path, capsys):
    report.write(str(tmp_path), _two_seeds(), "cmd")
    (tmp_path / "table.md").unlink()
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "| topkef |" in capsys.readouterr().out and json.loads((tmp_path / "summary.json").read_text())
    assert isinstance(cli.parser(), argparse.ArgumentParser)
