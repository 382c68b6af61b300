"""A `lopd compare` run is the cycle's distillation and evaluation (issue #29): it trains through `run_lopd`, the
stage function of `lopd distill` and the cycle, so with `bank.refresh_every` > 0 the student's rollouts join the
bank during the run — in the run's own copy, the seed bank untouched — and it evaluates the exported student as
the cycle's evaluate stage does, so eval.json holds every environment of `envs.mix`."""

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from lopd_core.config import load_params
from tests._tiny_cycle import TINY_CYCLE

PARAMS_FILE = str(Path(__file__).resolve().parents[2] / "params.yaml")


@pytest.mark.slow
def test_a_compare_run_grows_its_own_bank_and_evaluates_every_env_of_the_mix(
    tmp_path, tiny_model, tiny_tokenizer, monkeypatch
):
    from lopd_core.compare.report import write_compare_report
    from lopd_core.compare.run import run_method
    from lopd_core.distill.composer.composer import save_composer
    from lopd_core.drivers.distill import new_composer, seed_bank

    monkeypatch.chdir(tmp_path)
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    params = load_params(
        PARAMS_FILE,
        [
            *TINY_CYCLE,
            f"model.name_or_path={model_dir}",
            "envs.mix={toolworld: 1.0, codegen: 1.0}",
            "bank.seed_tasks=2",
            "bank.samples_per_task=1",
            f"bank.dir={tmp_path / 'seed_bank'}",
            f"bank.index_dir={tmp_path / 'seed_index'}",
            # every trajectory counts as a success, so the bank grows whatever the tiny policy scores
            "bank.min_reward=0.0",
            "bank.refresh_every=1",
            "eval.splits=[test_id, test_ood]",
        ],
    )
    seed = seed_bank(params, log=lambda *_: None)
    seed_parquet = tmp_path / "seed_bank" / "experience.parquet"
    seed_bytes = seed_parquet.read_bytes()
    phi0 = tmp_path / "phi0.pt"
    save_composer(new_composer(params, tiny_model), phi0)
    per_step = params.lopd.tasks_per_step * params.lopd.samples_per_task

    summary = run_method(
        params,
        "lopd",
        tmp_path / "run",
        budget=seed["rollouts"] + 2 * per_step,
        bank_rollouts=seed["rollouts"],
        bank_dir=str(seed_parquet.parent),
        index_dir=str(tmp_path / "seed_index"),
        phi0=str(phi0),
        curve_points=1,
        curve_n=1,
        eval_n=1,
        log=lambda *_: None,
    )

    # the cycle's growing bank: refreshed after every step, in the run's own copy
    assert summary["steps"] == 2 and [r["step"] for r in summary["bank"]["refreshes"]] == [1, 2]
    grown = pd.read_parquet(tmp_path / "run" / "bank" / "experience.parquet")
    assert summary["bank"]["added"] > 0 and len(grown) == seed["bank_rows"] + summary["bank"]["added"]
    assert set(grown["policy_version"]) & {"student@step-1", "student@step-2"}
    assert seed_parquet.read_bytes() == seed_bytes  # the seed bank other runs start from is unchanged

    # the cycle's evaluation of the exported student: every environment of the mix, DESIGN §5's shape
    results = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert set(results) == {"toolworld", "codegen"}
    for env in ("toolworld", "codegen"):
        for split in ("test_id", "test_ood"):
            assert set(results[env][split]) == {"greedy", "sampled"}  # the report's modes added to eval.modes
            assert {"success_rate", "reward_mean", "n", "ci95"} <= set(results[env][split]["greedy"])
    assert (tmp_path / "run" / "student" / "config.json").exists()
    assert summary["final"]["test_id"]["greedy"]["n"] == 2  # one task per environment, pooled
    assert set(summary["by_env"]) == {"toolworld", "codegen"}
    assert [p["step"] for p in summary["curve"]] == [0, 2] and summary["curve"][0]["rollouts"] == seed["rollouts"]

    paths = write_compare_report([summary], tmp_path / "reports", title="t", settings=[("preset", "x")])
    md = paths["md"].read_text()
    assert "Held-out success per environment" in md and "| lopd | codegen |" in md


def test_the_mix_is_pooled_for_the_main_table_and_the_report_splits_are_added():
    from lopd_core.compare.run import final_eval_params, pool_envs
    from lopd_core.config import Params
    from lopd_core.evaluation import wilson_interval

    def cell(rate, n, domains):
        return {
            "success_rate": rate,
            "reward_mean": rate,
            "n": n,
            "ci95": wilson_interval(round(rate * n), n),
            "by_domain": {d: {"success_rate": rate, "n": n} for d in domains},
        }

    results = {
        "toolworld": {"test_id": {"greedy": cell(0.5, 10, ["retail"])}},
        "codegen": {"test_id": {"greedy": cell(0.0, 30, ["codegen"])}},
        "bfcl": {"overall": 0.9},
    }  # a benchmark's section is no environment of the mix
    pooled = pool_envs(results, ["toolworld", "codegen"])["test_id"]["greedy"]
    assert (pooled["success_rate"], pooled["n"], pooled["reward_mean"]) == (0.125, 40, 0.125)
    assert pooled["ci95"] == wilson_interval(5, 40) and set(pooled["by_domain"]) == {"retail", "codegen"}
    assert pool_envs(results, ["toolworld"]) is results["toolworld"]

    p = Params()
    p.eval = replace(p.eval, splits=["pretrain_test"], modes=["greedy"], benchmarks=["humaneval"])
    q = final_eval_params(p, 7)
    assert (q.eval.splits, q.eval.modes, q.eval.n_per_split) == (
        ["pretrain_test", "test_id", "test_ood"],
        ["greedy", "sampled"],
        7,
    )
    assert q.eval.benchmarks == ["humaneval"] and p.eval.splits == ["pretrain_test"]  # params left as they were
    # a comparison chooses between methods: it never plays test_final, which no choice reads (eval.splits' default)
    assert "test_final" in Params().eval.splits and "test_final" not in final_eval_params(Params(), 7).eval.splits
