"""Hot swap from the registry: moving the `champion` alias (as the promotion gate does) makes a running server
load the new version in the background and switch between requests, with no request failing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests._servers import offline_env
from tests.serve.conftest import LiveServer
from tests.serve.test_end_to_end import _converse

_REGISTER = """
import sys
import mlflow, mlflow.transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
uri, folder = sys.argv[1], sys.argv[2]
mlflow.set_tracking_uri(uri)
mlflow.set_registry_uri(uri)
experiment = mlflow.create_experiment("serve-test", artifact_location=sys.argv[3])  # not ./mlruns of the cwd
with mlflow.start_run(experiment_id=experiment):
    info = mlflow.transformers.log_model(
        transformers_model={"model": AutoModelForCausalLM.from_pretrained(folder),
                            "tokenizer": AutoTokenizer.from_pretrained(folder)},
        name="student", task="text-generation", pip_requirements=["torch"], registered_model_name="lopd-student")
print("VERSION", info.registered_model_version)
"""


def register_as_the_cycle_does(uri: str, folder, cwd) -> str:
    """A version logged with MLflow's transformers flavor (weights and tokenizer in separate folders), as the
    cycle's registration logs the exported student (tasks/tracking.py). In a child process: MLflow's
    process-wide tracking URI (and the environment variable it sets) must not leak into other tests."""
    out = subprocess.run(
        [sys.executable, "-c", _REGISTER, uri, str(folder), Path(cwd, "artifacts").as_uri()],
        check=False,
        capture_output=True,
        text=True,
        env=offline_env(),
        timeout=300,
        cwd=cwd,
    )  # artifacts land in cwd/mlruns
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("VERSION", 1)[1].split()[0]


@pytest.mark.slow
def test_alias_move_swaps_the_served_version(tiny_checkpoints, tmp_path):
    from mlflow import MlflowClient

    from lopd_serve.config import ServeConfig
    from lopd_serve.server import build_app

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registry = MlflowClient(tracking_uri=uri, registry_uri=uri)
    first = register_as_the_cycle_does(uri, tiny_checkpoints[0], tmp_path)
    registry.set_registered_model_alias("lopd-student", "champion", first)
    cfg = ServeConfig.from_dict(
        {
            "tracking_uri": uri,
            "poll_s": 0.2,
            "store_dir": str(tmp_path / "traces"),
            "model_cache_dir": str(tmp_path / "cache"),
            "device": "cpu",
            "max_messages": 128,
        }
    )
    with LiveServer(build_app(cfg)) as live:
        assert httpx.get(live.root + "/health").json()["model_version"] == f"lopd-student/{first}"
        failures, versions = [], []
        threads = [
            threading.Thread(target=_converse, args=(live.url, f"s{i}", 30, failures, versions)) for i in range(3)
        ]
        for t in threads:
            t.start()
        second = registry.create_model_version("lopd-student", source=str(tiny_checkpoints[1])).version
        registry.set_registered_model_alias("lopd-student", "champion", second)  # the gate promotes
        deadline = time.monotonic() + 60
        while httpx.get(live.root + "/health").json()["model_version"] != f"lopd-student/{second}":
            assert time.monotonic() < deadline, "the server never picked up the new champion"
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=300)
    assert failures == []
    assert f"lopd-student/{second}" in versions
