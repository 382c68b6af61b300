"""The shared servers a team runs, started here on loopback (tests/_servers.py), used through the project's own
code paths and checked through the servers' own APIs:

* MLflow: `mlflow server` on a SQLite file; the pipeline's Tracker (tasks/tracking.py) writes a cycle's parent
  and child runs, params, step metrics and the distill CSV through MLFLOW_TRACKING_URI; the REST API shows them.
* Chroma: `chroma run`; the bank (bank.chroma_url) rebuilds its index from the parquet on the server and
  retrieves exactly what the embedded folder retrieves; a second open finds the server's index current.

Start-up times are printed (pytest -s) and asserted bounded. Slow tier: each spawns a server process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _servers import LOOPBACK, Server, free_port, http_get, offline_env

import lopd_core  # noqa: F401  (offline defaults)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _api(base: str, path: str) -> dict:
    status, body = http_get(base + path)
    assert status == 200
    return json.loads(body)


@pytest.mark.slow
def test_mlflow_server_shows_what_the_pipeline_tracked(tmp_path, monkeypatch):
    from lopd_core.config import load_params
    from lopd_core.distill.update.dashboard import CSV_COLUMNS
    from tasks.tracking import CYCLE_TAG, STAGE_TAG, Tracker

    port = free_port()
    base = f"http://{LOOPBACK}:{port}"
    argv = [
        str(BIN / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--artifacts-destination",
        str(tmp_path / "artifacts"),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # The server's job runner (GenAI jobs, several huey consumers) is not needed by the pipeline: off, it starts
    # faster and leaves fewer processes to stop.
    env = offline_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    with Server("mlflow", argv, f"{base}/health", log_dir=tmp_path, env=env, start_timeout_s=300) as server:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", base)
        params = load_params(ROOT / "params.yaml", ["tracking.experiment=lopd-server-test"])
        tracker = Tracker(params.tracking)
        assert tracker.uri == base
        parent = tracker.start_run("cycle-1", tags={CYCLE_TAG: 1})
        child = tracker.start_run("distill", parent=parent, tags={STAGE_TAG: "distill", CYCLE_TAG: 1})
        tracker.log_params(child, {"lopd": {"margin": 0.05, "beta_lr": 0.5}})
        csv_path = tmp_path / "distill.csv"
        rows = [[step] + [0.1 * step] * (len(CSV_COLUMNS) - 1) for step in (1, 2, 3)]
        csv_path.write_text("\n".join([",".join(CSV_COLUMNS)] + [",".join(map(str, r)) for r in rows]) + "\n")
        assert tracker.log_step_metrics(child, csv_path) == 3
        tracker.log_artifact(child, csv_path)
        tracker.end(child)
        tracker.end(parent)

        # Read back through the server's REST API, not through the client that wrote.
        run = _api(base, f"/api/2.0/mlflow/runs/get?run_id={child}")["run"]
        assert run["info"]["status"] == "FINISHED"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["mlflow.parentRunId"] == parent and tags[STAGE_TAG] == "distill"
        assert {p["key"]: p["value"] for p in run["data"]["params"]} == {"lopd.margin": "0.05", "lopd.beta_lr": "0.5"}
        history = _api(base, f"/api/2.0/mlflow/metrics/get-history?run_id={child}&metric_key=beta")["metrics"]
        assert sorted((m["step"], round(m["value"], 6)) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3)]
        files = _api(base, f"/api/2.0/mlflow/artifacts/list?run_id={child}").get("files", [])
        assert [f["path"] for f in files] == ["distill.csv"]
        experiments = _api(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=lopd-server-test")
        assert experiments["experiment"]["name"] == "lopd-server-test"
        print(f"mlflow server start-up: {server.startup_s:.1f}s")
    assert server.proc.poll() is not None  # stopped with the test


@pytest.fixture(scope="module")
def bank_parquet(tmp_path_factory):
    """A bank of oracle successes over 36 training tasks (parquet only: each test builds its own index)."""
    from lopd_core.bank import ExperienceBank
    from lopd_core.envs import make_tasks, run_oracle
    from lopd_core.rollout.engine import Trajectory
    from lopd_core.rollout.table import trajectories_to_frame

    trajs = []
    for task in make_tasks("toolworld", "train", 36, seed=0):
        _, _, env = run_oracle(task)
        trajs.append(
            Trajectory(
                task=task,
                sample_index=0,
                experiences=(),
                token_ids=[1, 2, 3],
                action_mask=[0, 1, 1],
                sample_logprobs=[0.0, -0.1, -0.2],
                prompt_length=1,
                reward=1.0,
                success=True,
                stop_reason="answer",
                num_turns=len(env.episode),
                episode=env.episode,
            )
        )
    root = tmp_path_factory.mktemp("bank")
    bank = ExperienceBank(root / "bank" / "experience.parquet", embedder=object())
    report = bank.refresh(trajectories_to_frame(trajs), min_reward=1.0, policy_version="oracle", cycle=0)
    assert report.total == 36
    return root


@pytest.mark.slow
def test_chroma_server_retrieves_like_the_embedded_folder(bank_parquet, tmp_path):
    from lopd_core.config import load_params
    from lopd_core.drivers.distill import open_bank
    from lopd_core.envs import make_tasks

    queries = make_tasks("toolworld", "test_id", 12, seed=5) + make_tasks("toolworld", "train", 6, seed=0)
    local = load_params(
        ROOT / "params.yaml", [f"bank.dir={bank_parquet / 'bank'}", f"bank.index_dir={tmp_path / 'index'}"]
    )

    def hits(params, **kw):
        with open_bank(params) as bank:
            rebuilt = bank.ensure_index()
            found = bank.retrieve(queries, 3, **kw)
        return rebuilt, [[(h.row_id, round(h.similarity, 5)) for h in row] for row in found]

    assert hits(local)[0]  # the embedded index is built from the parquet
    expected = {kw: hits(local, allow_self_retrieval=kw)[1] for kw in (True, False)}
    assert all(len(row) == 3 for row in expected[True])

    port = free_port()
    argv = [
        str(BIN / "chroma"),
        "run",
        "--path",
        str(tmp_path / "chroma_server"),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
    ]
    with Server(
        "chroma", argv, f"http://{LOOPBACK}:{port}/api/v2/heartbeat", log_dir=tmp_path, start_timeout_s=300
    ) as server:
        remote = load_params(
            ROOT / "params.yaml", [f"bank.dir={bank_parquet / 'bank'}", f"bank.chroma_url=http://{LOOPBACK}:{port}"]
        )
        rebuilt, got = hits(remote)
        assert rebuilt  # an empty server: the collection is built from the parquet
        assert got == expected[True]
        rebuilt, got = hits(remote, allow_self_retrieval=False)
        assert not rebuilt and got == expected[False]  # the server's collection is current: reused as is
        collections = json.loads(
            http_get(f"http://{LOOPBACK}:{port}/api/v2/tenants/default_tenant/databases/default_database/collections")[
                1
            ]
        )
        assert [c["name"] for c in collections] == [remote.bank.collection]
        print(f"chroma server start-up: {server.startup_s:.1f}s")
    assert server.proc.poll() is not None
