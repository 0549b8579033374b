"""bench/adaptive.py: the calibration's arithmetic and the summary table (the runs themselves are the
benchmark; the evidence grid's test covers the namespaces and the launcher they share)."""
import pytest

from bench.adaptive import fit_weight, main, steps_to, summary


def test_steps_to_uses_a_running_mean():
    curve = [{"step": s, "test_loss": v} for s, v in [(15, 1.0), (30, 0.05), (45, 0.5), (60, 0.1), (75, 0.1),
                                                      (90, 0.1)]]
    assert steps_to(curve, 0.2) == 60            # the single low point at step 30 is not enough
    assert steps_to(curve, 0.6, window=1) == 30
    assert steps_to(curve, 0.05) is None


def test_fit_weight_recovers_a_power_law():
    for w in (0.1, 0.3, 0.8):
        points = [(g, g ** w) for g in (0.6, 0.3, 0.1, 0.03, 0.01)]
        assert fit_weight(points) == pytest.approx(w)
    assert fit_weight([(0.5, 0.5), (0.1, 0.1)]) == pytest.approx(1.0)


def test_summary_compares_with_dense_and_fixed_ratio():
    rows = [{"mode": "dense", "test_acc": 0.98, "link_bytes": 1000},
            {"mode": "fixed 0.01", "test_acc": 0.97, "link_bytes": 100},
            {"mode": "fixed 0.01", "test_acc": 0.99, "link_bytes": 300},
            {"mode": "adaptive", "test_acc": 0.975, "link_bytes": 50}]
    mean, lines = summary(rows)
    assert mean["fixed 0.01"] == (pytest.approx(0.98), 200)
    adaptive = next(line for line in lines if line.startswith("| adaptive"))
    assert "-0.50" in adaptive and "0.25x" in adaptive


def test_refuses_without_root(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["--out", str(tmp_path)]) == 2
    assert "root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--modes", "dense,sparse", "--out", str(tmp_path)])
