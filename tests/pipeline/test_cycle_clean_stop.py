"""Clean stops (issue #47 item 5), as a scheduler makes them: SIGTERM to `lopd cycle` in the middle of a stage.
It must exit within its grace period with 143, leave no process behind (the temporary Prefect server, the reaper),
release the cycle folder's lock and end its MLflow runs KILLED; the next `lopd cycle` resumes from the stages
cached before the signal. What is left behind is found by a marker in the environment every descendant inherits
(tests/_stopping.py), so a server started in a session of its own is counted too."""

import json
import uuid

import pytest
from _stopping import GRACE_S, read_until, settle, start, terminate
from _tiny_cycle import TINY_CYCLE


@pytest.mark.slow
def test_sigterm_mid_stage_stops_the_cycle_and_the_next_resumes(tmp_path):
    from mlflow import MlflowClient

    from lopd_core.locks import folder_lock

    marker = uuid.uuid4().hex
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'tracking.db'}",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
    }
    argv = ["cycle", *[a for s in TINY_CYCLE for a in ("--set", s)], "--set", f"cycle.stop_grace_s={GRACE_S}"]
    proc, lines = start(argv, tmp_path, marker, **env), []
    # the bank is done and cached; the cold start or the fit is running when the signal comes
    assert read_until(proc, "bank: done", 1200, lines), "".join(lines[-40:])
    code, seconds = terminate(proc)
    print(f"lopd cycle: exit {code} {seconds:.1f}s after SIGTERM")
    assert code == 143, "".join(lines[-40:])
    assert seconds < GRACE_S + 5
    assert not settle(marker), settle(marker)
    with folder_lock(tmp_path / "data/cycles", "the cycle folder"):  # released: taken at once
        pass
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert "RUNNING" not in statuses.values(), statuses
    assert statuses["cycle-1"] == "KILLED", statuses

    proc, lines = start(argv, tmp_path, marker, **env), []  # the next cycle resumes from the cached bank
    out, _ = proc.communicate(timeout=1800)
    assert proc.returncode == 0, out[-4000:]
    (record,) = json.loads((tmp_path / "data/cycles/history.json").read_text())
    assert record["cached"]["bank"], record["cached"]
