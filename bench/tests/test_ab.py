"""bench/ab.py: the A/B timer runs the two commands in alternating order, leaves the warm-up rounds
out, takes the ratio within each round, stops at a failing command, and times real commands."""
import argparse
import json

import pytest

from bench import ab


def test_rounds_alternate_and_the_ratio_is_per_round():
    calls, walls = [], iter([1.0, 2.0, 4.0, 2.0, 3.0, 1.0, 2.0, 2.0])      # warm-up A B, then B A, A B, B A

    def timer(command, timeout):
        calls.append(command)
        return next(walls), 0.5, 0

    runs, figures = ab.compare("a", "b", repeats=3, warmup=1, timer=timer)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [r["first"] for r in runs] == ["A", "B", "A", "B"] and [r["counted"] for r in runs] == [False] + [True] * 3
    # counted rounds: (A 2, B 4), (A 3, B 1), (A 2, B 2)
    assert figures["A wall_s"] == {"min": 2.0, "median": 2.0, "max": 3.0}
    assert figures["A/B wall"] == {"min": 0.5, "median": 1.0, "max": 3.0}
    assert figures["A/B cpu"]["median"] == 1.0
    assert "| A/B wall | 0.500 | **1.000** | 3.000 |" in ab.table("a", "b", figures, 3, 1)


def test_a_failing_command_is_named():
    def timer(command, timeout):
        return 0.1, 0.0, 3 if command == "b" else 0

    with pytest.raises(RuntimeError, match="command B exited with 3 in round 1: b"):
        ab.compare("a", "b", timer=timer)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        ab.compare("a", "b", repeats=0)


def test_real_commands(tmp_path, capsys):
    args = argparse.Namespace(a="sleep 0.3", b="X=1; sleep 0.1", repeats=2, warmup=0, timeout=30,
                              out=str(tmp_path / "ab"), command="python -m bench ab ...")
    assert ab.main(args) == 0
    saved = json.loads((tmp_path / "ab" / "ab.json").read_text())
    assert saved["figures"]["A/B wall"]["median"] > 1.5
    assert (tmp_path / "ab" / "manifest.json").exists() and "| A wall_s |" in capsys.readouterr().out
    assert ab.main(argparse.Namespace(**{**vars(args), "b": "exit 4", "out": None})) == 1
