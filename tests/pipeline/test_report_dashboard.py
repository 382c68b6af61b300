"""The dashboard a team reads (issue #46 item 5): smoothed per-step curves, held-out bars with their intervals, the
teacher in play and each guard's lineage curve (lopd_core/run_report.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lopd_core.evaluation import mean_interval
from lopd_core.run_report import EvalColumn, TrainingRun, ema, plot_guards, teacher_cells, write_report


def test_the_smoothing_is_tensorboards_debiased_ema_by_hand():
    """w = 0.5 on 1, 0, 1: last = 0.5, 0.25, 0.625; debiased by 1 − 0.5^k (0.5, 0.75, 0.875): 1, 1/3, 5/7."""
    assert ema([1.0, 0.0, 1.0], 0.5) == pytest.approx([1.0, 1 / 3, 5 / 7])
    # a NaN step stays NaN and does not enter the average: the next point is the k = 2 one
    out = ema([1.0, math.nan, 0.0], 0.5)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx(1 / 3)
    assert ema([0.3] * 5, 0.8) == pytest.approx([0.3] * 5)  # a constant stays itself (no pull toward 0)
    # weight 0: no smoothing
    assert np.array_equal(ema([0.1, 0.9, 0.4], 0.0), [0.1, 0.9, 0.4])


def test_the_reward_interval_by_hand():
    """Rewards 0, 1, 0, 1: mean 0.5, sample sd √(1/3), half-width 1.96 · √(1/3) / 2 = 0.5658."""
    assert mean_interval([0.0, 1.0, 0.0, 1.0]) == [0.0, 1.0]  # clipped to the rewards' range
    low, high = mean_interval([0.4, 0.6] * 50)  # sd 0.1005, n 100: ± 0.0197
    assert low == pytest.approx(0.5 - 0.0197, abs=1e-4) and high == pytest.approx(0.5 + 0.0197, abs=1e-4)
    assert mean_interval([0.7]) == [0.0, 1.0]


def _cell(rate):
    return {"success_rate": rate, "reward_mean": rate, "n": 200, "ci95": [rate - 0.05, rate + 0.05]}


def _student(rate, teacher):
    results = {"toolworld": {s: {"greedy": _cell(rate)} for s in ("test_id", "test_final")}}
    results["toolworld"]["test_id"]["teacher_in_play"] = {c: {"greedy": _cell(v)} for c, v in teacher.items()}
    return results


def _guard(student, root, change):
    comparison = {"interval": {"gain": change, "low": change - 0.05, "high": change + 0.05, "n": 200}, "p": 0.01}
    return {
        "name": "toolworld pretrain_test success",
        "student": student,
        "champion": root,
        "root": root,
        "budget": 0.1,
        "max_fall": 0.1,
        "vs_root": {**comparison, "failed": False},
        "vs_champion": {**comparison, "failed": False},
    }


def test_the_report_draws_the_teacher_in_play_and_the_guards_and_marks_test_final(tmp_path):
    from test_pipeline_units import distill_csv

    evals = [
        EvalColumn("base", {"toolworld": {s: {"greedy": _cell(0.1)} for s in ("test_id", "test_final")}}),
        EvalColumn("cycle 1 student", _student(0.3, {"base": 0.1, "text": 0.3, "latents": 0.25})),
    ]
    cells = teacher_cells(evals)
    assert list(cells) == [("toolworld", "test_id")] and cells[("toolworld", "test_id")][0][0] == "cycle 1 student"
    lineage = [
        {"label": "cycle 1", "promoted": True, "guards": [_guard(0.22, 0.26, -0.04)]},
        {"label": "cycle 2", "promoted": False, "guards": [_guard(0.20, 0.25, -0.05)]},
    ]
    page = write_report(
        [TrainingRun("cycle 1", distill_csv(tmp_path / "d.csv", steps=12), 0.05)],
        evals,
        tmp_path / "report",
        lineage=lineage,
    ).read_text()
    for png in ("eval", "teacher_in_play", "guards"):
        assert (tmp_path / "report" / f"{png}.png").stat().st_size > 1000
    assert page.count("data:image/png;base64,") == 8  # the five training figures, eval, teacher, guards
    assert "test_final (reported only)" in page and "exponential moving average" in page
    assert plot_guards([{"label": "cycle 1", "promoted": False, "guards": []}], tmp_path / "none.png") is None
