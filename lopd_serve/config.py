"""The settings `lopd serve` runs with: params.yaml's `serve` section (lopd_core/settings/serve.py) plus what it
reads of the run's other sections (the registry from `tracking`, the sampling seed from `seed`), the flags on
top.

Why a class beside the section: the served app needs the registry's coordinates and the seed in one value, and
a test builds one from a few keys (`ServeConfig.from_dict`) with the section's checks and error messages. Every
key is defined once: the serve keys by the section it extends, the others' defaults read from their own sections
(`_default`), so a default changed there is the server's too.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from lopd_core.rollout.sync import default_sync_root
from lopd_core.settings.checks import ConfigError
from lopd_core.settings.fields import build
from lopd_core.settings.params import Params
from lopd_core.settings.run import TrackingConfig
from lopd_core.settings.serve import ServeConfig as ServeSection

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServeConfigError(ConfigError):
    pass


def _default(section, key: str):
    """The default a setting has in its own section (params.yaml's), read rather than written again here."""
    return next(f.default for f in dataclasses.fields(section) if f.name == key)


@dataclass(frozen=True)
class ServeConfig(ServeSection):
    tracking_uri: str = _default(TrackingConfig, "mlflow_uri")  # MLFLOW_TRACKING_URI overrides it
    registered_model: str = _default(TrackingConfig, "registered_model")
    alias: str = _default(TrackingConfig, "champion_alias")
    seed: int = _default(Params, "seed")  # the run's seed: the server's stream of per-request seeds

    @staticmethod
    def from_params(params, **overrides) -> ServeConfig:
        """`params.serve`, the registry of `params.tracking` and `params.seed`, then `overrides` (None values
        ignored: a flag not given); MLFLOW_TRACKING_URI overrides the tracking URI, as for every command."""
        raw = asdict(params.serve)
        raw.update(
            tracking_uri=params.tracking.mlflow_uri,
            registered_model=params.tracking.registered_model,
            alias=params.tracking.champion_alias,
            seed=params.seed,
        )
        raw.update({k: v for k, v in overrides.items() if v is not None})
        if os.environ.get("MLFLOW_TRACKING_URI"):
            raw["tracking_uri"] = os.environ["MLFLOW_TRACKING_URI"]
        return ServeConfig.from_dict(raw)

    @staticmethod
    def load(params_path: str | Path = "params.yaml", **overrides) -> ServeConfig:
        """`from_params` of a params file (the implicit default params.yaml may be missing: every default)."""
        from lopd_core.config import load_params

        return ServeConfig.from_params(load_params(params_path), **overrides)

    @staticmethod
    def from_dict(raw: dict) -> ServeConfig:
        """Every key checked as params.yaml's are: an error names `serve.KEY`, the value and what was expected."""
        try:
            return build(ServeConfig, raw, "serve")
        except ConfigError as exc:
            raise ServeConfigError(str(exc)) from None

    def server_device(self) -> str:
        """Where the server's own copy of a model goes: with an engine process the weights that decode are the
        engine's (on serve.device), and the server's copy only renders, checks and smoke-tests: the CPU."""
        return "cpu" if self.engine == "process" else self.device

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) or None

    def reload_key(self) -> str | None:
        return os.environ.get(self.reload_key_env) or None

    def reload_folders(self) -> list[Path]:
        """Where a reload may load from: serve.reload_roots, else the model cache, the served folder's parent and
        the trainers' default sync folder (lopd_core/rollout/sync.py).
        A chat client must not make the server read (and serve, and record traces under) any folder it can name."""
        roots = list(self.reload_roots) or [
            self.model_cache_dir,
            *([str(Path(self.model).parent)] if self.model else []),
            str(default_sync_root()),  # a trainer's updates when rollout.sync_dir is empty (served rollouts)
        ]
        return [Path(r).resolve() for r in roots]

    def check_exposure(self) -> None:
        """Refuse to listen beyond loopback without a key: an open endpoint would let anyone spend the machine
        and write into the trace store."""
        if self.host not in LOOPBACK and not self.api_key():
            raise ServeConfigError(
                f"serve.host={self.host!r} is not loopback: set an API key in the environment "
                f"variable {self.api_key_env} (clients send `Authorization: Bearer KEY`)"
            )
