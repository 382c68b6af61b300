"""The base stage's driver: the embedded base policy (tokenizer, tiny Qwen3, warm start) built into a folder."""

from __future__ import annotations

from pathlib import Path

from lopd_core.config import Params
from lopd_core.model.base_build import BaseBuildReport, build_base


def run_base(params: Params, out: str | Path, log=print) -> BaseBuildReport:
    """Build the embedded base into `out` (`lopd base` passes model.base_dir or --out; the cycle its work
    folder)."""
    log(f"building the embedded base into {out}")
    return build_base(params, out, log=log)
