"""The comparison report's verdict: differences with their 95 % interval, and credit to experience only beyond
it (lopd_core/compare/report.py). Hand-checked numbers."""

import math

import pytest

from lopd_core.compare.report import CELLS, _verdict, difference_interval


def _run(rate: float, n: int = 50) -> dict:
    return {
        "final": {
            split: {mode: {"success_rate": rate, "reward_mean": 0.0, "n": n} for s, mode in CELLS if s == split}
            for split in ("test_id", "test_ood")
        }
    }


def test_difference_interval_pools_the_seeds():
    d, half = difference_interval([_run(0.1), _run(0.2)], [_run(0.05, 100)], "test_id", "greedy")
    assert d == pytest.approx(0.10)  # pooled 15/100 against 5/100
    assert half == pytest.approx(1.96 * math.sqrt(0.15 * 0.85 / 100 + 0.05 * 0.95 / 100))


@pytest.mark.parametrize(
    "lopd_rate, expected", [(0.40, "by more than the noise"), (0.12, "within the 95 %"), (0.05, "does not beat")]
)
def test_verdict_credits_experience_only_beyond_the_noise(lopd_rate, expected):
    runs = {
        "lopd": [_run(lopd_rate, 100)] * 3,
        "sharpened_teacher": [_run(0.10, 100)] * 3,
        "lopd_random_retrieval": [_run(0.10, 100)] * 3,
    }
    lines = _verdict(runs)
    assert expected in lines[-1]
    assert "(±" in lines[0]


def test_shared_tasks_give_a_paired_interval(tmp_path):
    """Runs of one replicate (world, seed) left per-task outcomes: the difference is paired over their tasks, and
    narrower than the unpaired one when the two agree on most tasks."""
    from lopd_core.compare.report import method_difference
    from lopd_core.outcomes import write_outcomes

    def run(name: str, wins: set[int]) -> dict:
        rows = [
            {
                "env": "toolworld",
                "split": "test_id",
                "mode": "greedy",
                "task_id": f"t{i}",
                "template": f"tpl{i % 20}",
                "world": "cobalt",
                "success": i in wins,
                "reward": 1.0 if i in wins else 0.0,
                "turns": 1,
                "tokens": 5,
                "batch": 0,
            }
            for i in range(100)
        ]
        write_outcomes(rows, tmp_path / name / "eval_tasks.parquet")
        summary = _run(len(wins) / 100, 100)
        return {**summary, "world": "cobalt", "seed": 0, "eval": str(tmp_path / name / "eval.json")}

    lopd, grpo = run("lopd", set(range(40))), run("grpo", set(range(30)))  # lopd wins 10 more, loses none
    d, low, high, how = method_difference([lopd], [grpo], "test_id", "greedy")
    assert d == pytest.approx(0.10) and how == "paired, n = 100"
    _, half = difference_interval([lopd], [grpo], "test_id", "greedy")
    assert low > 0 and high - low < 2 * half
    assert "[+" in _verdict({"lopd": [lopd], "grpo": [grpo]})[0]
