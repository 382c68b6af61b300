"""The base stage's driver: the embedded base policy (tokenizer, tiny Qwen3, warm start) in a folder.

Two ways in (lopd_core/model/shipped.py says why): `install_base` puts the base the settings name into the folder —
the shipped copy where `model.base_source` is `shipped` and the build settings are the shipped base's own, else a
build from the code; `run_base` always builds, and says whether the rebuild matches the shipped base.
"""

from __future__ import annotations

from pathlib import Path

from lopd_core.config import Params
from lopd_core.model.base_build import BaseBuildReport, build_base
from lopd_core.model.shipped import install_shipped, rebuild_verdict, shipped_for, weights_sha256


def run_base(params: Params, out: str | Path, log=print) -> BaseBuildReport:
    """Build the embedded base into `out` from the code (`lopd base`), then compare it with the shipped one."""
    log(f"building the embedded base into {out}")
    report = build_base(params, out, log=log)
    log(f"base: {rebuild_verdict(out)}")
    return report


def install_base(params: Params, out: str | Path, log=print) -> dict:
    """The base the settings name, into `out` (`lopd base --install`, DVC's base stage, the cycle's and the
    compare's first stage): {"source": "shipped" | "build", "weights_sha256": ...}."""
    manifest = shipped_for(params)
    if manifest is not None:
        install_shipped(out)
        log(
            f"base: installed the shipped base into {out} "
            f"(weights sha256 {manifest['files']['model.safetensors'][:16]}…)"
        )
        return {"source": "shipped", "weights_sha256": weights_sha256(out)}
    why = (
        "model.base_source is build"
        if params.model.base_source == "build"
        else "the build settings differ from the shipped base's"
    )
    log(f"base: building from the code ({why})")
    run_base(params, out, log=log)
    return {"source": "build", "weights_sha256": weights_sha256(out)}
