"""A plugin environment trains through `lopd cycle` with no change to the project's code.

The example package (examples/lopd-example-env, installed by `scripts/setup.sh --dev`) registers `library` under
the entry point group `lopd.envs`; the tiny cycle runs with it in the mix beside toolworld. What must hold: the
pretraining stages (warm start, cold start) stay on the built-ins, while the bank's rollouts, the distillation
stream and the evaluation include the plugin — on the splits it has (no pretrain_test) and without `+experience`.
"""

import json
import time
from pathlib import Path

import pytest
from _tiny_cycle import TINY_CYCLE

pytest.importorskip("lopd_example_env", reason="install examples/lopd-example-env (scripts/setup.sh --dev)")


@pytest.fixture()
def project(tmp_path, monkeypatch, prefect_harness):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'tracking.db'}")
    return tmp_path


@pytest.mark.slow
def test_cycle_with_the_example_plugin_in_the_mix(project, capsys):
    import pandas as pd

    from lopd_cli.main import main

    args = ["cycle", "--no-mlflow"]
    for assignment in [
        *TINY_CYCLE,
        "envs.mix={toolworld: 1.0, library: 1.0}",
        "bank.seed_tasks=8",
        "lopd.tasks_per_step=4",
    ]:
        args += ["--set", assignment]
    started = time.perf_counter()
    assert main(args) == 0
    print(f"plugin cycle: {time.perf_counter() - started:.0f}s")
    out = capsys.readouterr().out
    assert "cycle 1 summary" in out

    (record,) = json.loads((project / "data/cycles/history.json").read_text())
    for who in ("base", "student"):
        results = json.loads(Path(record["eval"][who]).read_text())
        assert set(results["library"]) == {"test_id", "test_ood"}, who  # no pretrain_test, no +experience
        assert set(results["toolworld"]) == {"test_id", "test_ood", "pretrain_test", "test_final"}, who
        for split in ("test_id", "test_ood"):
            cell = results["library"][split]["greedy"]
            assert cell["n"] == 3 and 0.0 <= cell["reward_mean"] <= 1.0

    # The bank's seed rollouts split between the two envs, the plugin's rows carrying its world.
    (seed_path,) = project.glob("data/cycles/**/seed_rollouts.parquet")
    seeds = pd.read_parquet(seed_path, columns=["env", "world", "task_id"])
    assert seeds["env"].value_counts().to_dict() == {"toolworld": 4, "library": 4}
    assert set(seeds.loc[seeds["env"] == "library", "world"]) == {"library"}
    # Whatever the plugin contributed to the bank (a tiny base rarely wins its tasks: tests/envs/test_plugins.py
    # banks a scripted success) is counted under its own name, never as another env's.
    for path in project.glob("data/cycles/**/experience.parquet"):
        rows = pd.read_parquet(path, columns=["env", "world"])
        assert set(rows["env"]) <= {"toolworld", "library"}
        assert (rows.loc[rows["env"] == "library", "world"] == "library").all()
    assert set(record["bank"]["by_domain"]) - {"bank", "calendar", "shop", "files", "msg", "travel"} <= {"library"}
    print(f"plugin cycle: bank {record['bank']}; library eval {results['library']}")
