"""Prefect tasks over the LOPD stages: thin wrappers that take paths, call lopd_core, and return paths.

Expensive deterministic stages (base, bank refresh, cold start, distillation, evaluation) are cached across
runs by `tasks.caching.by_stage_key`: the calling flow computes the key from the content of the stage's inputs
and its params sections, and passes the key's work folder; the stage writes only there and marks it complete
last. Export and report are never cached; nothing here retries, for a deterministic local step that failed
fails the same way again (the retries sit on the MLflow registry calls, tasks/tracking.py). Long stages get a
timeout from `cycle.stage_timeout_s` (applied by the flow with `with_options`). No task passes a model or a
tensor: models are loaded inside the task from the folder it was given and dropped when it returns.

Each task is one call of its stage's driver (lopd_core/drivers/, lopd_core/drivers/distill.py run_lopd), the function
`lopd <stage>` and `lopd compare` call too, with the paths redirected into the task's work folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from prefect import task

from lopd_core.config import Params
from lopd_core.drivers.progress import log
from tasks.caching import by_stage_key, mark_complete


def with_paths(params: Params, **changes: str) -> Params:
    """A copy of params with some `section.key` paths redirected, e.g. bank__dir="work/bank"."""
    out = dataclasses.replace(params)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(out, section, dataclasses.replace(getattr(out, section), **{key: value}))
    return out


def _fresh(work: str) -> Path:
    """The stage's work folder. Stages overwrite what they write, and distillation resumes from the
    checkpoint an interrupted attempt left there."""
    path = Path(work)
    path.mkdir(parents=True, exist_ok=True)
    return path


CACHED = {"cache_key_fn": by_stage_key, "persist_result": True}


@task(name="base", **CACHED)
def build_base_task(stage: str, key: str, work: str, params: Params) -> dict:
    """The embedded base policy into `work` (the folder is model.base_dir): the shipped copy where the settings
    are its own, else built from the code (lopd_core/drivers/base.py)."""
    from lopd_core.drivers.base import install_base

    out = _fresh(work)
    installed = install_base(params, out, log=log)
    report = json.loads((out / "build_report.json").read_text())
    return mark_complete(
        out,
        {
            "model": str(out),
            **installed,
            "parameters": report["parameters"],
            "steps": report["steps"],
            "final_loss": report["final_loss"],
        },
    )


@task(name="bank-refresh", **CACHED)
def refresh_bank_task(
    stage: str, key: str, work: str, params: Params, policy: str, parent_bank: str | None, generation: int
) -> dict:
    """The champion's bank plus the successes of the champion's rollouts on training tasks, in a bank folder of
    its own (`work/bank`) started as a copy of the champion's (drivers/bank.py `restart`)."""
    from lopd_core.drivers.bank import run_bank

    out = _fresh(work)
    bank_dir, index_dir = out / "bank", out / "bank_index"
    p = with_paths(params, bank__dir=str(bank_dir), bank__index_dir=str(index_dir), model__name_or_path=policy)
    summary = run_bank(p, restart_from=parent_bank, restart=True, cycle=generation, log=log)
    return mark_complete(out, {**summary, "bank_dir": str(bank_dir), "index_dir": str(index_dir)})


@task(name="coldstart", **CACHED)
def coldstart_task(stage: str, key: str, work: str, params: Params, policy: str) -> dict:
    """φ0, the composer's cold start, on oracle successes of the pretraining worlds read by the policy."""
    from lopd_core.drivers.coldstart import run_coldstart

    out = _fresh(work)
    p = with_paths(
        params, model__name_or_path=policy, coldstart__out=str(out / "phi0.pt"), lopd__csv=str(out / "distill.csv")
    )
    summary = run_coldstart(p, log=log)
    return mark_complete(out, {**summary, "phi0": str(out / "phi0.pt"), "csv": str(out / "coldstart.csv")})


@task(name="fit", **CACHED)
def fit_task(
    stage: str, key: str, work: str, params: Params, teacher: str, bank_dir: str, index_dir: str, start: str
) -> dict:
    """φ fitted in the deployment world (lopd_core/distill/composer/world_fit.py): the composer `start` read into the
    bank at `bank_dir` by `teacher`, the frozen weights distillation will read with latents."""
    from lopd_core.drivers.fit import run_fit

    out = _fresh(work)
    p = with_paths(
        params,
        model__name_or_path=teacher,
        bank__dir=bank_dir,
        bank__index_dir=index_dir,
        coldstart__fit_out=str(out / "phi.pt"),
        lopd__csv=str(out / "distill.csv"),
    )
    summary = run_fit(p, start=start, log=log)
    return mark_complete(out, {**summary, "phi": str(out / "phi.pt"), "csv": str(out / "fit.csv")})


@task(name="distill", **CACHED)
def distill_task(
    stage: str,
    key: str,
    work: str,
    params: Params,
    policy: str,
    bank_dir: str,
    index_dir: str,
    phi0: str,
    teacher: str | None = None,
    generation: int = 0,
) -> dict:
    """LOPD training of a student from `policy`, taught by `teacher`'s frozen weights (None: the policy's own);
    resumes from the folder's checkpoint after an interruption."""
    from lopd_core.drivers.distill import run_lopd

    out = _fresh(work)
    p = with_paths(
        params,
        bank__dir=bank_dir,
        bank__index_dir=index_dir,
        model__name_or_path=policy,
        coldstart__out=phi0,
        coldstart__fit_out=phi0,  # the composer it starts from, fitted in the world or not (drivers/distill.py)
        lopd__out_dir=str(out),
        lopd__csv=str(out / "distill.csv"),
    )
    summary = run_lopd(p, resume=True, teacher=teacher, cycle=generation, log=log)
    grown = (
        {"bank_dir": summary["bank_dir"], "index_dir": str(Path(summary["bank_dir"]).parent / "bank_index")}
        if summary.get("bank_dir")
        else {}
    )
    return mark_complete(
        out, {**summary, "csv": str(out / "distill.csv"), "composer": str(out / "composer.pt"), "grown_bank": grown}
    )


@task(name="evaluate", **CACHED)
def evaluate_task(stage: str, key: str, work: str, params: Params, model: str) -> dict:
    """Held-out success of the policy at `model` -> work/eval.json (DESIGN §5 layout), and one row per played task
    beside it (work/eval_tasks.parquet, what the promotion gate pairs)."""
    from lopd_core.drivers.evaluate import run_evaluate
    from lopd_core.outcomes import outcomes_path

    out = _fresh(work)
    p = with_paths(params, model__name_or_path=model)
    log(f"evaluate: {model} on {', '.join(params.eval.splits)} (n={params.eval.n_per_split} per split)")
    results = run_evaluate(p, out / "eval.json", log=log)
    summary = {"eval": str(out / "eval.json"), "outcomes": str(outcomes_path(out / "eval.json"))}
    return mark_complete(out, {**summary, "model": model, "results": results})


@task(name="teacher", **CACHED)
def teacher_task(
    stage: str, key: str, work: str, params: Params, teacher: str, bank_dir: str, index_dir: str, phi: str
) -> dict:
    """The teacher in play: `teacher`'s frozen weights alone, reading the bank at `bank_dir` as text and as the
    latents of composer `phi`, on the held-out tasks of eval.teacher_splits -> work/teacher_in_play.json."""
    from lopd_core.drivers.teacher import run_teacher_in_play
    from lopd_core.jsonio import write_json

    out = _fresh(work)
    p = with_paths(params, model__name_or_path=teacher, bank__dir=bank_dir, bank__index_dir=index_dir)
    results = run_teacher_in_play(p, composer=phi, log=log)
    write_json(out / "teacher_in_play.json", results)
    return mark_complete(out, {"teacher_in_play": str(out / "teacher_in_play.json"), "results": results})


@task(name="export")
def export_task(
    model: str, out: str, params: Params, student_eval: str | None, base_eval: str | None, lineage: dict
) -> str:
    """The clean Hugging Face checkpoint with its model card (LoRA merged)."""
    from lopd_core.drivers.export import run_export

    return str(run_export(params, model, out, student_eval=student_eval, base_eval=base_eval, lineage=lineage, log=log))


@task(name="report")
def report_task(
    runs: list[dict],
    evals: list[dict],
    out_dir: str,
    title: str,
    summary: list[tuple[str, str]],
    lineage: list[dict] | None = None,
) -> str:
    """The offline HTML dashboard: runs are {label, csv, margin}, evals are {label, path}, lineage the cycles'
    guards (`lopd cycle` only)."""
    from lopd_core.drivers.report import run_report

    return str(run_report(runs, evals, out_dir, title=title, summary=summary, lineage=lineage or [], log=log))
