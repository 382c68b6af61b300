"""The report stage's driver: the offline HTML dashboard and its PNGs from training curves and evaluations."""

from __future__ import annotations

import json
from pathlib import Path

from lopd_core import run_report as page
from lopd_core.run_report import EvalColumn, TrainingRun


def run_report(
    runs: list[dict],
    evals: list[dict],
    out_dir: str | Path,
    *,
    title: str,
    summary: list[tuple[str, str]] = (),
    lineage: list[dict] = (),
    log=print,
) -> Path:
    """Runs are {label, csv, margin} (margin None: priced, read from the CSV's `margin` column), evals are
    {label, path}; an evaluation whose file is missing or empty is left out of the tables. `lineage`: the cycles'
    guards (lopd_core/drivers/cycle_summary.py `lineage_points`), drawn as their curves."""
    training = [
        TrainingRun(r["label"], Path(r["csv"]), None if r["margin"] is None else float(r["margin"])) for r in runs
    ]
    columns = [
        EvalColumn(e["label"], json.loads(Path(e["path"]).read_text()))
        for e in evals
        if e.get("path") and Path(e["path"]).exists()
    ]
    path = page.write_report(
        training, [c for c in columns if c.results], out_dir, title=title, summary=summary, lineage=lineage
    )
    log(f"report: {path} (open it in a browser; it needs no network)")
    return path
