"""Settings of `lopd serve`: one frozen dataclass, read from params.yaml's `serve:` section when present.

Why a dataclass of its own: the serving settings are not a training stage's, and the run configuration
(lopd_core/config.py) does not know the section yet; `ServeConfig.load` reads `serve:` and `tracking:` straight
from the YAML file, validates every key (an error names the key, the value and what was expected), and the
command line overrides a few of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServeConfig:
    model: str = ""  # a checkpoint folder; "" serves the registry's `alias` version of `registered_model`
    host: str = "127.0.0.1"  # any other address needs an API key in `api_key_env`
    port: int = 8000
    api_key_env: str = "LOPD_API_KEY"  # the variable holding the key (a key is never written in a file)
    store_dir: str = "data/traces"
    store_segment_bytes: int = 64 * 2**20  # a segment is closed here and the next one opened
    store_max_bytes: int = 2**30  # the store's bound: beyond it, requests get 503 until it is cleared
    batch_window_ms: float = 10.0  # how long the first request of a batch waits for others to join
    max_batch: int = 16
    max_body_bytes: int = 2**20
    max_messages: int = 64
    max_tokens_limit: int = 512  # the largest `max_tokens` a request may ask for
    default_max_tokens: int = 128
    max_context: int = 2048  # prompt + max_tokens must fit
    max_sessions: int = 1024  # sessions held in memory; beyond it, new sessions get 429
    poll_s: float = 30.0  # how often the registry alias is checked for a new champion (0: never)
    tracking_uri: str = "sqlite:///mlflow.db"
    registered_model: str = "lopd-student"
    alias: str = "champion"
    model_cache_dir: str = "data/serve/models"  # registry versions are downloaded here
    device: str = "auto"
    seed: int = 0

    @staticmethod
    def load(params_path: str | Path = "params.yaml", **overrides) -> ServeConfig:
        """`serve:` and `tracking:` of the params file (absent file or section: defaults), then `overrides`
        (None values ignored); MLFLOW_TRACKING_URI overrides the file's tracking URI, as for every command."""
        raw: dict = {}
        path = Path(params_path)
        if path.exists():
            doc = yaml.safe_load(path.read_text()) or {}
            serve = doc.get("serve") or {}
            tracking = doc.get("tracking") or {}
            if not isinstance(serve, dict):
                raise ServeConfigError(f"serve: expected a mapping, got {serve!r}")
            raw.update(serve)
            for src, dst in (("mlflow_uri", "tracking_uri"), ("registered_model", "registered_model"),
                             ("champion_alias", "alias")):
                if src in tracking and dst not in serve:
                    raw[dst] = tracking[src]
            if "seed" in doc and "seed" not in serve:
                raw["seed"] = doc["seed"]
        raw.update({k: v for k, v in overrides.items() if v is not None})
        if os.environ.get("MLFLOW_TRACKING_URI"):
            raw["tracking_uri"] = os.environ["MLFLOW_TRACKING_URI"]
        return ServeConfig.from_dict(raw)

    @staticmethod
    def from_dict(raw: dict) -> ServeConfig:
        known = {f.name: f for f in fields(ServeConfig)}
        for key, value in raw.items():
            if key not in known:
                raise ServeConfigError(f"serve.{key}: unknown key (value {value!r}); expected one of: "
                                       f"{', '.join(known)}")
        values = {}
        for key, value in raw.items():
            kind = type(getattr(ServeConfig, key))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ServeConfigError(f"serve.{key}: got {value!r}, expected a {kind.__name__}")
            values[key] = value
        cfg = replace(ServeConfig(), **values)
        for key in ("port", "store_segment_bytes", "store_max_bytes", "max_batch", "max_body_bytes",
                    "max_messages", "max_tokens_limit", "default_max_tokens", "max_context", "max_sessions"):
            if getattr(cfg, key) <= 0:
                raise ServeConfigError(f"serve.{key}: got {getattr(cfg, key)!r}, expected a positive number")
        if cfg.batch_window_ms < 0 or cfg.poll_s < 0:
            raise ServeConfigError("serve.batch_window_ms and serve.poll_s: expected numbers >= 0")
        if cfg.default_max_tokens > cfg.max_tokens_limit:
            raise ServeConfigError(f"serve.default_max_tokens: got {cfg.default_max_tokens}, expected at most "
                                   f"serve.max_tokens_limit ({cfg.max_tokens_limit})")
        return cfg

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) or None

    def check_exposure(self) -> None:
        """Refuse to listen beyond loopback without a key: an open endpoint would let anyone spend the machine
        and write into the trace store."""
        if self.host not in LOOPBACK and not self.api_key():
            raise ServeConfigError(f"serve.host={self.host!r} is not loopback: set an API key in the environment "
                                   f"variable {self.api_key_env} (clients send `Authorization: Bearer KEY`)")
