"""The export stage's driver: the clean Hugging Face checkpoint with its model card. The local work only: logging
and registering the export in MLflow's registry is the tracking layer's (tasks/tracking.py)."""

from __future__ import annotations

from pathlib import Path

from lopd_core.config import Params
from lopd_core.export import export_checkpoint
from lopd_core.jsonio import read_json


def run_export(
    params: Params,
    model: str | Path,
    out: str | Path,
    *,
    student_eval: str | Path | None,
    base_eval: str | Path | None,
    lineage: dict,
    log=print,
) -> Path:
    """Export `model` to `out`; the card shows the evaluations at `student_eval` and `base_eval` (missing: none)."""
    path = export_checkpoint(
        model,
        out,
        rollout=params.rollout,
        student_eval=read_json(student_eval),
        base_eval=read_json(base_eval),
        lineage=lineage,
        name=params.tracking.registered_model,
    )
    log(
        f"exported {model} -> {path} (model card: {path / 'README.md'}; loads with "
        "AutoModelForCausalLM.from_pretrained)"
    )
    return path
