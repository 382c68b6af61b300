"""`lopd compare`: the report's arithmetic on hand-made runs (fast), and the smoke preset end to end through
Prefect and MLflow on the tiny fixtures (slow)."""

import json
from dataclasses import replace

import pandas as pd
import pytest

from lopd_core.compare.report import reach, write_compare_report
from lopd_core.compare.run import plan_steps
from lopd_core.config import Params
from lopd_core.methods import METHOD_NAMES


def _run(method, seed, curve, final, csv):
    pd.DataFrame({"step": [1, 2], "rollouts": [8, 16], "delta": [0.01, 0.02], "beta": [0.0, 0.02]}).to_csv(
        csv, index=False
    )
    cell = {"success_rate": final, "reward_mean": final, "n": 10}
    return {
        "method": method,
        "seed": seed,
        "lr": 3e-4,
        "steps": 2,
        "rollouts": curve[-1][0],
        "train_seconds": 1.0,
        "eval_seconds": 1.0,
        "csv": str(csv),
        "final": {s: {"greedy": cell, "sampled": cell} for s in ("test_id", "test_ood")},
        "curve": [
            {
                "step": i,
                "rollouts": r,
                "greedy_success": v,
                "sampled_success": v,
                "greedy_reward": v,
                "sampled_reward": v,
            }
            for i, (r, v) in enumerate(curve)
        ],
    }


def test_report_reach_fraction_and_not_reached(tmp_path):
    runs = [
        _run("grpo", 0, [(0, 0.0), (50, 0.1), (100, 0.3)], 0.3, tmp_path / "g.csv"),
        _run("lopd", 0, [(20, 0.0), (30, 0.3), (100, 0.4)], 0.4, tmp_path / "l.csv"),
        _run("sharpened_teacher", 0, [(0, 0.0), (50, 0.1), (100, 0.2)], 0.2, tmp_path / "s.csv"),
    ]
    by = {r["method"]: [r] for r in runs}
    assert reach(by, "lopd", "greedy") == "30 rollouts = 30% of GRPO's 100"
    assert reach(by, "sharpened_teacher", "greedy").startswith("not reached")
    paths = write_compare_report(
        runs,
        tmp_path / "reports",
        title="t",
        settings=[("preset", "x")],
        tuning=[{"method": "lopd", "lr": 3e-4, "score": 0.2}],
    )
    md = paths["md"].read_text()
    assert "| lopd | 0.0003 | 40.0 ± 0.0 |" in md and "not reached" in md and "lr 0.0003" in md
    assert paths["png"].stat().st_size > 0 and json.loads(paths["json"].read_text())["runs"]


def test_budget_charges_the_bank_to_methods_that_read_it():
    p = Params()
    p.lopd = replace(p.lopd, tasks_per_step=2, samples_per_task=2)
    assert plan_steps(p, "grpo", 24, 8) == (6, 0)
    assert plan_steps(p, "lopd", 24, 8) == (4, 8)
    with pytest.raises(ValueError, match="no training step"):
        plan_steps(p, "lopd", 10, 8)


@pytest.mark.slow
def test_smoke_preset_runs_every_method(tmp_path, tiny_model, tiny_tokenizer, prefect_harness, monkeypatch):
    from flows.compare import compare_flow

    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    monkeypatch.chdir(tmp_path)
    overrides = [
        "compare.preset=smoke",
        f"model.name_or_path={model_dir}",
        f"compare.work_dir={tmp_path / 'w'}",
        f"compare.report_dir={tmp_path / 'reports'}",
        f"tracking.mlflow_uri=sqlite:///{tmp_path}/m.db",
    ]
    params_file = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "params.yaml")
    out = compare_flow(params_file=params_file, overrides=overrides, track=True)
    methods = {r["method"] for r in out["runs"]}
    assert methods == set(METHOD_NAMES)
    seeds = Params().compare.presets["smoke"].train_seeds  # every method trained under each training seed
    assert len(out["runs"]) == seeds * len(METHOD_NAMES) and {r["train_seed"] for r in out["runs"]} == set(range(seeds))
    budgets = {r["method"]: r["rollouts"] for r in out["runs"]}
    assert all(b <= 24 for b in budgets.values()) and budgets["grpo"] > budgets["lopd"] - 8
    md = (tmp_path / "reports" / "compare.md").read_text()
    assert "Rollouts to reach GRPO" in md and (tmp_path / "reports" / "compare.png").exists()
    assert "Verdicts over training seeds and tasks" in md and "weights sha256" in md
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    exp = client.get_experiment_by_name(Params().tracking.experiment)
    children = client.search_runs([exp.experiment_id], "tags.`lopd.stage` = 'compare-run'")
    assert len(children) == seeds * len(METHOD_NAMES)
    assert len({c.data.tags["mlflow.parentRunId"] for c in children}) == 1
