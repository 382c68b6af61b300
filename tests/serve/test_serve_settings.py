"""`lopd serve` reads params.yaml's `serve` section like every command (checked at load, errors naming the key),
the registry from `tracking` and the seed from `seed`; the command line's flags override the file; and
`rollout.backend: openai` needs its servers."""

from __future__ import annotations

import re

import pytest

from lopd_core.config import ConfigError, Params, load_params
from lopd_core.rollout.trajectory import ServedBackend
from lopd_serve.config import ServeConfig, ServeConfigError

PARAMS = """
seed: 7
tracking:
  mlflow_uri: sqlite:///elsewhere.db
  registered_model: my-student
serve:
  port: 8123
  max_batch: 3
  max_top_logprobs: 5
  device: cpu
"""


def test_serve_section_from_params_yaml_and_flags_on_top(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS)
    params = load_params(path)
    assert params.serve.port == 8123 and params.serve.max_batch == 3
    cfg = ServeConfig.from_params(params, port=None, host="localhost")  # a flag given, one not
    assert (cfg.port, cfg.host, cfg.max_batch, cfg.max_top_logprobs) == (8123, "localhost", 3, 5)
    assert (cfg.tracking_uri, cfg.registered_model, cfg.seed) == ("sqlite:///elsewhere.db", "my-student", 7)
    assert ServeConfig.load(path, port=9001).port == 9001
    assert load_params(path, ["serve.port=9100"]).serve.port == 9100  # --set reaches it as every section


@pytest.mark.parametrize(
    "bad, message",
    [
        ("serve:\n  prot: 1\n", "serve.prot: unknown key"),
        ("serve:\n  port: -1\n", "serve.port: got -1"),
        ("serve:\n  device: gpu\n", "serve.device: got 'gpu'"),
        ("serve:\n  default_max_tokens: 900\n", "serve.default_max_tokens"),
    ],
)
def test_bad_serve_settings_fail_at_load_naming_the_key(tmp_path, bad, message):
    path = tmp_path / "params.yaml"
    path.write_text(bad)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_params(path)
    with pytest.raises(ServeConfigError, match=r"serve\.port"):
        ServeConfig.from_dict({"port": 0})


def test_rollout_backend_openai_needs_servers(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("rollout:\n  backend: openai\n")
    with pytest.raises(ConfigError, match=r"rollout\.servers"):
        load_params(path)
    path.write_text("rollout:\n  backend: openai\n  servers: [http://127.0.0.1:8000/v1]\n")
    backend = ServedBackend.from_settings(load_params(path).rollout)
    assert backend.servers == ("http://127.0.0.1:8000/v1",)
    assert ServedBackend.from_settings(Params().rollout) is None  # the default: the in-process engine
