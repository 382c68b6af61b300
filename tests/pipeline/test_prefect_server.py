"""The worker-fleet path end to end, on loopback: `prefect server start` (its own PREFECT_HOME and SQLite
database in tmp), a process work pool, the repository's prefect.yaml deployed with `prefect deploy`, a
`prefect worker`, and a tiny cycle run of the deployment created and followed through the REST API to
COMPLETED. The worker's flow run logs to an `mlflow server` through MLFLOW_TRACKING_URI, so the same test shows
a cycle landing in a tracking server.

Slow tier: two servers, a worker and a whole (tiny) cycle in a subprocess; a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _servers import LOOPBACK, Server, free_port, http_get, offline_env, stop_group
from _tiny_cycle import TINY_CYCLE

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
POOL = "lopd-test-pool"
TINY = TINY_CYCLE
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _get(url: str) -> dict:
    return json.loads(http_get(url, timeout=30)[1])


def _cli(argv: list[str], env: dict, cwd: Path) -> None:
    res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture
def project(tmp_path):
    """A working folder for the deployment: the repository's params and packages, its own data/."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    for pkg in ("lopd_core", "flows", "tasks"):
        (work / pkg).symlink_to(ROOT / pkg)
    return work


@pytest.mark.slow
def test_cycle_deployment_runs_on_a_worker(project, tmp_path):
    prefect_port, mlflow_port = free_port(), free_port()
    api = f"http://{LOOPBACK}:{prefect_port}/api"
    mlflow_url = f"http://{LOOPBACK}:{mlflow_port}"
    home = tmp_path / "prefect_home"
    env = offline_env(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api,
        PREFECT_UI_ENABLED="false",
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        MLFLOW_TRACKING_URI=mlflow_url,
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        PYTHONPATH=str(project),
    )
    prefect = str(BIN / "prefect")
    server = Server(
        "prefect",
        [prefect, "server", "start", "--host", LOOPBACK, "--port", str(prefect_port)],
        f"{api}/health",
        log_dir=tmp_path,
        env=env,
        cwd=tmp_path,
        start_timeout_s=300,
    )
    tracking = Server(
        "mlflow",
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
            "--host",
            LOOPBACK,
            "--port",
            str(mlflow_port),
            "--workers",
            "1",
        ],
        f"{mlflow_url}/health",
        log_dir=tmp_path,
        env=env,
        start_timeout_s=300,
    )
    worker = None
    try:
        server.start()
        tracking.start()
        _cli([prefect, "work-pool", "create", POOL, "--type", "process"], env, project)
        started = time.perf_counter()
        # prefect.yaml's pull step is `set_working_directory: {{ $PWD }}`, read from the *environment* of
        # `prefect deploy` (not its cwd): PWD must name the project, else the run would work in the repository.
        _cli(
            [
                prefect,
                "--no-prompt",
                "deploy",
                "--prefect-file",
                str(ROOT / "prefect.yaml"),
                "--name",
                "lopd-nightly-cycle",
                "--pool",
                POOL,
            ],
            {**env, "PWD": str(project)},
            project,
        )
        print(f"prefect deploy: {time.perf_counter() - started:.1f}s")
        worker_log = (tmp_path / "worker.log").open("wb")
        worker = subprocess.Popen(
            [prefect, "worker", "start", "--pool", POOL, "--type", "process", "--limit", "1"],
            cwd=project,
            env=env,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        worker_log.close()

        deployment = _get(f"{api}/deployments/name/lopd-cycle/lopd-nightly-cycle")
        assert deployment["entrypoint"] == "flows/cycle.py:cycle_flow"
        workdirs = [
            step[k]["directory"]
            for step in deployment["pull_steps"]
            for k in step
            if k.endswith("set_working_directory")
        ]
        assert workdirs == [str(project)], deployment["pull_steps"]  # never the repository itself
        run = _post(
            f"{api}/deployments/{deployment['id']}/create_flow_run",
            {"parameters": {"params_file": "params.yaml", "overrides": TINY, "cycles": 1, "track": True}},
        )
        started = time.perf_counter()
        state = run["state"]["type"]
        while state not in TERMINAL and time.perf_counter() - started < 900:
            time.sleep(3)
            state = _get(f"{api}/flow_runs/{run['id']}")["state"]["type"]
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-4000:]
        print(f"cycle flow run: {state} after {time.perf_counter() - started:.0f}s")
        assert state == "COMPLETED", (tmp_path / "worker.log").read_text()[-6000:]

        # The worker ran it in the deployment's folder, and it reached the tracking server.
        (record,) = json.loads((project / "data/cycles/history.json").read_text())
        assert record["mlflow_run"]
        parent = _get(f"{mlflow_url}/api/2.0/mlflow/runs/get?run_id={record['mlflow_run']}")["run"]
        assert {t["key"]: t["value"] for t in parent["data"]["tags"]}["lopd.cycle"] == "1"
        assert parent["info"]["status"] == "FINISHED"
        print(f"prefect server start-up: {server.startup_s:.1f}s; mlflow server start-up: {tracking.startup_s:.1f}s")
    finally:
        stop_group(worker)
        tracking.stop()
        server.stop()
