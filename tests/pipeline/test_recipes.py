"""The pure parts of the recipes, without Prefect or MLflow: what a cycle keeps of its stages' summaries
(lopd_core/drivers/cycle_record.py), the learning rate each compared method keeps and the settings table of
compare.md (lopd_core/compare/plan.py), the warm start's schedule (lopd_core/model/warmstart.py)."""

import json
from dataclasses import replace

import pandas as pd
import pytest

from lopd_core.compare.plan import report_settings, tune_score, tuned_rates
from lopd_core.config import Params
from lopd_core.drivers.cycle_record import (
    Champion,
    CycleRun,
    CycleStages,
    cycle_lineage,
    cycle_metrics,
    cycle_record,
)
from lopd_core.model.warmstart import lr_factor, replan


def _cell(success):
    return {"success_rate": success, "reward_mean": success, "n": 10, "ci95": [0.0, 1.0]}


def _stages(tmp_path, cached: bool) -> CycleStages:
    csv = tmp_path / "distill.csv"
    pd.DataFrame({"step": [1, 2], "beta": [0.0, 0.25], "delta": [0.02, 0.04]}).to_csv(csv, index=False)
    results = {"toolworld": {s: {"greedy": _cell(0.3)} for s in ("test_id", "test_ood")}}
    evals = {
        name: {"eval": str(tmp_path / f"{name}.json"), "results": results, "cached": cached}
        for name in ("champion", "student")
    }
    return CycleStages(
        bank={"bank_dir": str(tmp_path / "bank"), "index_dir": "i", "dvc_md5": "md5", "bank_rows": 7, "cached": cached},
        coldstart={"phi0": "phi0.pt", "cached": cached},
        fit={"phi": "phi.pt", "fitted": True, "targets": 12, "cached": cached},
        teacher={"results": {}, "cached": cached},
        distill={"student": "s", "csv": str(csv), "composer": "phi.pt", "steps": 2, "margin": 0.05, "cached": cached},
        champion_eval=evals["champion"],
        student_eval=evals["student"],
        base_eval=evals["champion"],
        gate_looks=[{"cached": cached}],
    )


def test_a_cycle_record_is_assembled_from_the_stages_summaries(tmp_path):
    """What history.json keeps: the last row's β and δ̄ and the mean δ̄ (0.02 and 0.04: mean 0.03), every stage's
    cache flag by name (the gate's evaluations too), the next champion one generation on, the run's lineage."""
    params = Params()
    stages = _stages(tmp_path, cached=True)
    champion = Champion(model="base")
    run = CycleRun(number=3, commit="abc", parent_run=None, base_hash="f" * 16)
    gate = {"champion": 0.3, "student": 0.4, "looks": 2, "reason": "gain cleared", "gain": 0.1, "n": 20}
    lineage = cycle_lineage(run, champion, stages, gate, promoted=True)
    assert lineage["mlflow cycle run"] == "untracked" and lineage["bank rows"] == 7 and lineage["promoted"]
    record = cycle_record(params, run, champion, stages, gate, True, {"export": "x", "version": "4"})
    assert record["final_beta"] == 0.25 and record["final_delta"] == 0.04
    assert record["delta_mean"] == pytest.approx(0.03)
    assert list(record["cached"]) == [
        "bank",
        "coldstart",
        "fit",
        "teacher",
        "distill",
        "champion_eval",
        "student_eval",
        "gate_eval_1",
    ]
    assert all(record["cached"].values()) and record["mlflow_run"] is None and record["base_hash"] == "f" * 16
    assert record["composer_from"] == "cold start φ0, fitted in the world on 12 trajectories"
    assert record["new_champion"]["generation"] == 1 and record["new_champion"]["cycle"] == 3
    assert record["new_champion"]["version"] == "4" and record["bank"] == {
        "rows": 0,
        "by_domain": {},
        "added_in_distill": 0,
    }
    json.dumps(record)  # history.json holds it as it is
    metrics = cycle_metrics(params, {**record, "seconds": 1.5}, stages)
    assert metrics["gate.gain"] == 0.1 and "gate.low" not in metrics and metrics["cycle_seconds"] == 1.5
    assert metrics["gate.base"] == pytest.approx(0.3)  # the base's gate score: greedy test_id and test_ood


def test_a_champion_with_its_composer_skips_the_cold_start(tmp_path):
    stages = replace(_stages(tmp_path, cached=False), coldstart=None, gate_looks=[])
    run = CycleRun(number=1, commit="abc", parent_run="run-1", base_hash="0" * 16)
    record = cycle_record(
        Params(),
        run,
        Champion(model="m", composer="phi.pt"),
        stages,
        {"reason": "r"},
        False,
        {
            "export": "x",
            "version": None,
        },
    )
    assert "coldstart" not in record["cached"] and not any(record["cached"].values())
    assert record["composer_from"].startswith("the champion's") and record["mlflow_run"] == "run-1"


def test_each_method_keeps_its_best_rate_and_a_tie_goes_to_the_default():
    tuning = [
        {"method": "lopd", "lr": 1e-4, "score": 0.5},
        {"method": "lopd", "lr": 1e-3, "score": 0.5},  # a tie: 1e-4 is nearer the default 3e-4
        {"method": "grpo", "lr": 1e-4, "score": 0.2},
        {"method": "grpo", "lr": 1e-3, "score": 0.4},
    ]
    assert tuned_rates(tuning, ["lopd", "grpo"], [1e-4, 1e-3], 3e-4) == {"lopd": 1e-4, "grpo": 1e-3}
    assert tuned_rates([], ["lopd"], [5e-4], 3e-4) == {"lopd": 5e-4}  # one value: no tuning
    assert tuned_rates([], ["lopd"], [], 3e-4) == {"lopd": 3e-4}
    cells = {"greedy": {"reward_mean": 0.2}, "sampled": {"reward_mean": 0.4}}
    assert tune_score({"final": {"train": cells}}) == pytest.approx(0.3)


def test_the_compare_settings_table_says_how_the_comparison_ran():
    params = Params()
    preset = params.compare.presets[params.compare.preset]
    common = {
        "command": "lopd compare",
        "pairs": [("cobalt", 0)],
        "base": "data/base",
        "base_hash": "0123456789ab",
        "overrides": [],
        "seconds": 90.0,
        "commit": "abc",
    }
    untuned = dict(report_settings(params, preset, tune_pair=None, bank_sampled=None, **common))
    assert untuned["bank"] == "not used" and untuned["learning-rate grid (lopd.lr_student)"].endswith("no tuning)")
    assert untuned["total wall time"] == "1.5 min" and untuned["preset overrides"] == "none"
    tuned = dict(report_settings(params, preset, tune_pair=("cobalt", 7), bank_sampled=24, **common))
    assert "tuned in cobalt on seed 7" in tuned["learning-rate grid (lopd.lr_student)"]
    assert tuned["bank"].startswith("24 sampled rollouts per replicate")


def test_the_warm_start_schedule_warms_up_then_decays_to_five_percent():
    assert lr_factor(0, 100, 10) == pytest.approx(0.1) and lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10) == pytest.approx(1.0) and lr_factor(100, 100, 10) == pytest.approx(0.05)
    # 10 steps took 2 s: 0.2 s a step; 8 s of the 10 s budget left affords 40 more
    assert replan(10, elapsed=2.0, since_mark=2.0, planned_at_most=1000, time_budget_s=10.0) == 50
    assert replan(10, elapsed=2.0, since_mark=2.0, planned_at_most=30, time_budget_s=10.0) == 30
    assert replan(10, elapsed=20.0, since_mark=2.0, planned_at_most=1000, time_budget_s=10.0) == 11
