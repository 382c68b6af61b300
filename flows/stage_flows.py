"""One Prefect flow per pipeline stage, each a recipe: open the stage's MLflow child run, compute the stage's cache
key, run its task (one call of the stage's driver), record what it made. `flows/cycle.py` composes them; each can
also run on its own (`parent_run=None`).

The child run opens before the work, so its duration is the stage's and a stage that raises leaves a FAILED run
(tasks/tracking.py `Tracker.run`). The caller passes its tracker, a required keyword (one MlflowClient per
command; the NullTracker with MLflow off), so no flow asks whether it is tracked.

A stage's work folder is `<cycle.dir>/work/<stage>-<key>`, the key being the content hash of what the stage
reads plus the params that shape its output (`tasks.caching.stage_key`). Which params and which inputs is not
written here: both come from the one table in `tasks/stage_params.py`, which dvc.yaml is checked against, so
the cycle's keys and DVC's stages cannot disagree. Prefect's task cache is consulted only while that folder is
complete; a deleted folder is recomputed (refresh_cache).
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from pathlib import Path

from prefect import flow

from flows.stopping import STOP_HOOKS
from lopd_core.config import Params
from lopd_core.drivers.progress import log
from tasks import stage_tasks as T
from tasks.caching import KEY_FILE, content_hash, is_complete, key_payload, plugin_fingerprint, stage_key
from tasks.stage_params import STAGES, reads_plugins, stage_sections, without_paths
from tasks.tracking import NullTracker, Tracker, dvc_hash, eval_metrics


def section(params: Params, name: str):
    """One params section (or `seed`) as the cache keys see it: path fields left out."""
    value = getattr(params, name)
    return without_paths(asdict(value) if is_dataclass(value) else value, name)


def model_input(model: str | None, name: str = "policy") -> tuple[dict, dict]:
    """A local model folder is hashed by content; a hub id is keyed by its name (its content hash is then
    "missing", so the name must enter the key beside it)."""
    if model is None or Path(model).exists():
        return {name: model}, {}
    return {name: None}, {f"{name}_id": model}


def stage_payload(params: Params, stage: str, inputs: dict, extra: dict | None = None) -> dict:
    """The cache key's payload of `stage`: the params and the inputs the table lists for it, plus `extra`
    (values that are not params: a bank's generation, a hub id). Inputs other than the table's are a bug in
    the calling flow, and fail here rather than key the stage on less than it reads."""
    expected = set(STAGES[stage].inputs)
    if set(inputs) != expected:
        raise ValueError(f"{stage}: inputs {sorted(inputs)} differ from tasks/stage_params.py's {sorted(expected)}")
    extra = dict(extra or {})
    if reads_plugins(stage):
        # A plugin's task file and its package's code are read by every stage that draws deployment tasks: an edit
        # in place must re-run them, so the key holds the files' content, not only their paths.
        plugins = plugin_fingerprint(params.envs)
        if plugins:
            extra["plugins"] = plugins
    return key_payload(stage, {**stage_sections(params, stage), **extra}, inputs)


def run_cached(
    task, params: Params, stage: str, inputs: dict, extra: dict | None = None, **kwargs
) -> tuple[dict, bool]:
    """Run a cached stage task in its content-addressed work folder; return (summary, was it cached)."""
    payload = stage_payload(params, stage, inputs, extra)
    key = stage_key(payload)
    root = Path(params.cycle.dir)
    work = root / "work" / f"{stage}-{key}"
    work.mkdir(parents=True, exist_ok=True)
    (work / KEY_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    runner = task.with_options(
        refresh_cache=not is_complete(work),
        timeout_seconds=params.cycle.stage_timeout_s,
        result_storage=(root / "prefect-results").resolve(),
    )
    state = runner(stage=stage, key=key, work=str(work), params=params, return_state=True, **kwargs)
    summary = state.result()
    cached = state.name == "Cached"
    log(f"{stage}: {'reused cached result' if cached else 'done'} ({work})")
    return summary, cached


def _tags(stage: str, cycle: int, tags: dict | None = None) -> dict:
    return {"lopd.stage": stage, "lopd.cycle": cycle, **(tags or {})}


FLOW = {"log_prints": True, "validate_parameters": False, **STOP_HOOKS}  # a stopped stage: Cancelled
AnyTracker = Tracker | NullTracker


@flow(name="lopd-base", **FLOW)
def base_flow(params: Params) -> str:
    """The starting policy: model.name_or_path if set, else the embedded base (built once into base_dir)."""
    if params.model.name_or_path:
        return params.model.name_or_path
    base_dir = Path(params.model.base_dir)
    if (base_dir / "config.json").exists():
        return str(base_dir)
    key = stage_key(stage_payload(params, "base", {}))
    runner = T.build_base_task.with_options(
        timeout_seconds=params.cycle.stage_timeout_s,
        result_storage=(Path(params.cycle.dir) / "prefect-results").resolve(),
        refresh_cache=True,
    )
    runner(stage="base", key=key, work=str(base_dir), params=params)
    return str(base_dir)


def traces_input(params: Params, source: str) -> str | None:
    """The served traces a stage reads when `source` (lopd.bank_source, lopd.trajectories) names them: keyed by
    their content, so a store that grew re-runs the stage; None (a fixed marker) when it reads none."""
    return params.lopd.traces if source in ("traces", "both") else None


@flow(name="lopd-bank", **FLOW)
def bank_flow(
    params: Params,
    policy: str,
    parent_bank: str | None = None,
    generation: int = 0,
    parent_run: str | None = None,
    cycle: int = 0,
    *,
    tracker: AnyTracker,
) -> dict:
    """Refresh the bank: the parent bank plus the successes of `policy`'s rollouts."""
    with tracker.run("bank", parent=parent_run, tags=_tags("bank", cycle)) as run:
        inputs, ids = model_input(policy)
        inputs["parent_bank"] = str(Path(parent_bank) / "experience.parquet") if parent_bank else None
        inputs["traces"] = traces_input(params, params.lopd.bank_source)
        summary, cached = run_cached(
            T.refresh_bank_task,
            params,
            "bank",
            inputs,
            {"generation": generation, **ids},
            policy=policy,
            parent_bank=parent_bank,
            generation=generation,
        )
        summary = {**summary, "dvc_md5": dvc_hash(summary["bank_dir"]), "cached": cached}
        tracker.set_tags(run, {"lopd.cached": cached, "lopd.bank.dvc_md5": summary["dvc_md5"]})
        tracker.log_metrics(
            run,
            {
                "bank.rollouts": summary["rollouts"],
                "bank.successes": summary["successes"],
                "bank.success_rate": summary["success_rate"],
                "bank.rows": summary["bank_rows"],
            },
        )
        tracker.log_artifact(run, Path(summary["bank_dir"]) / "bank_report.json")
    return summary


@flow(name="lopd-coldstart", **FLOW)
def coldstart_flow(
    params: Params, policy: str, bank: dict, parent_run: str | None = None, cycle: int = 0, *, tracker: AnyTracker
) -> dict:
    """φ0 for the composer from oracle successes of the pretraining worlds (`bank` only tags the run: the cold
    start never reads the deployment bank)."""
    tags = _tags("coldstart", cycle, {"lopd.bank.dvc_md5": bank.get("dvc_md5")})
    with tracker.run("coldstart", parent=parent_run, tags=tags) as run:
        inputs, ids = model_input(policy)
        summary, cached = run_cached(T.coldstart_task, params, "coldstart", inputs, ids, policy=policy)
        tracker.set_tags(run, {"lopd.cached": cached})
        tracker.log_metrics(
            run,
            {
                f"coldstart.{when}.{k}": v
                for when in ("first", "last")
                for k, v in summary[when].items()
                if isinstance(v, (int, float))
            },
        )
        tracker.log_artifact(run, summary["csv"])
    return {**summary, "cached": cached}


def run_over_bank(task, params: Params, stage: str, teacher: str, bank: dict, **composer: str) -> tuple[dict, bool]:
    """A cached stage in which the frozen `teacher` reads the bank through a composer (fit: `start`, teacher:
    `phi`): keyed by the teacher's weights, the bank's rows and the composer file."""
    inputs, ids = model_input(teacher, "teacher")
    inputs.update(bank=Path(bank["bank_dir"]), **composer)
    return run_cached(
        task,
        params,
        stage,
        inputs,
        ids,
        teacher=teacher,
        bank_dir=bank["bank_dir"],
        index_dir=bank["index_dir"],
        **composer,
    )


@flow(name="lopd-fit", **FLOW)
def fit_flow(
    params: Params,
    teacher: str,
    bank: dict,
    start: str,
    parent_run: str | None = None,
    cycle: int = 0,
    *,
    tracker: AnyTracker,
) -> dict:
    """φ fitted in the deployment world: the composer `start` (φ0, or the champion's φ) read into this cycle's
    bank by `teacher`, the frozen weights distillation reads with latents. Keyed by the bank's content, so a
    cycle whose bank changed fits again."""
    tags = _tags("fit", cycle, {"lopd.bank.dvc_md5": bank.get("dvc_md5")})
    with tracker.run("fit", parent=parent_run, tags=tags) as run:
        summary, cached = run_over_bank(T.fit_task, params, "fit", teacher, bank, start=start)
        tracker.set_tags(run, {"lopd.cached": cached, "lopd.fit.fitted": summary["fitted"]})
        metrics = {"fit.targets": summary["targets"], "fit.online_rollouts": summary["online_rollouts"]}
        for when in ("first", "last"):
            metrics.update({f"fit.{when}.{k}": v for k, v in (summary[when] or {}).items() if isinstance(v, float)})
        tracker.log_metrics(run, metrics)
        if summary["fitted"]:
            tracker.log_step_metrics(run, summary["csv"])
            tracker.log_artifact(run, summary["csv"])
    return {**summary, "cached": cached}


@flow(name="lopd-teacher", **FLOW)
def teacher_flow(
    params: Params,
    teacher: str,
    bank: dict,
    phi: str,
    parent_run: str | None = None,
    cycle: int = 0,
    *,
    tracker: AnyTracker,
) -> dict:
    """The teacher in play of a cycle: the ceiling its distillation trains toward (base, text, latents of φ)."""
    tags = _tags("teacher", cycle, {"lopd.bank.dvc_md5": bank.get("dvc_md5")})
    with tracker.run("teacher", parent=parent_run, tags=tags) as run:
        summary, cached = run_over_bank(T.teacher_task, params, "teacher", teacher, bank, phi=phi)
        tracker.set_tags(run, {"lopd.cached": cached})
        tracker.log_metrics(run, teacher_metrics(summary["results"]))
        tracker.log_artifact(run, summary["teacher_in_play"], "eval/teacher")
    return {**summary, "cached": cached}


def teacher_metrics(results: dict) -> dict[str, float]:
    """`teacher_in_play.<env>.<split>.<condition>.<mode>.success_rate` (and reward_mean) for MLflow."""
    return {
        f"teacher_in_play.{env}.{split}.{condition}.{mode}.{name}": float(cell[name])
        for env, splits in results.items()
        for split, section in splits.items()
        for condition, modes in section.get("teacher_in_play", {}).items()
        for mode, cell in modes.items()
        for name in ("success_rate", "reward_mean")
    }


@flow(name="lopd-distill", **FLOW)
def distill_flow(
    params: Params,
    policy: str,
    bank: dict,
    phi0: str,
    teacher: str | None = None,
    parent_run: str | None = None,
    cycle: int = 0,
    *,
    tracker: AnyTracker,
) -> dict:
    """LOPD training of a student from `policy`; the frozen teacher is `teacher`'s weights, or the policy's own
    when None. Every step's row of the CSV becomes MLflow step metrics (β and δ̄ included)."""
    tags = _tags("distill", cycle, {"lopd.bank.dvc_md5": bank.get("dvc_md5")})
    with tracker.run("distill", parent=parent_run, tags=tags) as run:
        inputs, ids = model_input(policy)
        teacher_input, teacher_id = model_input(teacher, "teacher")
        inputs.update(
            teacher_input, bank=Path(bank["bank_dir"]), phi0=phi0, traces=traces_input(params, params.lopd.trajectories)
        )
        summary, cached = run_cached(
            T.distill_task,
            params,
            "distill",
            inputs,
            {**ids, **teacher_id},
            policy=policy,
            bank_dir=bank["bank_dir"],
            index_dir=bank["index_dir"],
            phi0=phi0,
            teacher=teacher,
            generation=cycle,
        )
        tracker.set_tags(run, {"lopd.cached": cached})
        tracker.log_step_metrics(run, summary["csv"])
        tracker.log_artifact(run, summary["csv"])
        tracker.log_artifact(run, Path(summary["csv"]).with_name("distill_diagnostics.csv"))
    return {**summary, "cached": cached}


@flow(name="lopd-evaluate", **FLOW)
def evaluate_flow(
    params: Params,
    model: str,
    label: str = "student",
    parent_run: str | None = None,
    cycle: int = 0,
    *,
    tracker: AnyTracker,
) -> dict:
    """Held-out evaluation of the policy at `model`: eval.json and its per-task outcomes, both logged."""
    tags = _tags(f"evaluate-{label}", cycle, {"lopd.evaluated": label})
    with tracker.run(f"evaluate-{label}", parent=parent_run, tags=tags) as run:
        inputs, ids = model_input(model, "model")
        summary, cached = run_cached(T.evaluate_task, params, "evaluate", inputs, ids, model=model)
        tracker.set_tags(run, {"lopd.cached": cached})
        tracker.log_metrics(run, eval_metrics(summary["results"]))
        tracker.log_artifact(run, summary["eval"], f"eval/{label}")
        tracker.log_artifact(run, summary["outcomes"], f"eval/{label}")
    return {**summary, "cached": cached}


@flow(name="lopd-export", **FLOW)
def export_flow(
    params: Params,
    model: str,
    out: str,
    student_eval: str | None,
    base_eval: str | None,
    lineage: dict,
    parent_run: str | None = None,
    cycle: int = 0,
    promote: bool = False,
    *,
    tracker: AnyTracker,
) -> dict:
    """Export the clean checkpoint, log and register it as a version of `lopd-student`; move the champion
    alias to it only when `promote` (the gate passed). Untracked: the export alone, version None."""
    with tracker.run("export", parent=parent_run, tags=_tags("export", cycle, {"lopd.cached": False})) as run:
        path = T.export_task(model, out, params, student_eval, base_eval, lineage)
        student_hash = content_hash(model)
        # The same student (a cached cycle) keeps its version: the registry lists models, not runs.
        version = tracker.find_version("lopd.student_hash", student_hash) or tracker.register_student(
            run, path, tags={"lopd.cycle": cycle, "lopd.student_hash": student_hash}
        )
        tracker.log_artifact(run, Path(path) / "README.md")
        tracker.log_artifact(run, Path(path) / "lineage.json")
        if promote:
            tracker.promote(version)
        tracker.set_tags(run, {"lopd.registered_version": version, "lopd.promoted": promote})
    return {"export": path, "version": version, "promoted": promote}


@flow(name="lopd-report", **FLOW)
def report_flow(
    params: Params,
    runs: list[dict],
    evals: list[dict],
    out_dir: str,
    title: str,
    summary: list[tuple[str, str]],
    parent_run: str | None = None,
    cycle: int = 0,
    *,
    tracker: AnyTracker,
    lineage: list[dict] | None = None,
) -> str:
    """The offline HTML dashboard and its PNGs, logged as artifacts of the cycle."""
    with tracker.run("report", parent=parent_run, tags=_tags("report", cycle, {"lopd.cached": False})) as run:
        path = T.report_task(runs, evals, out_dir, title, summary, lineage)
        tracker.log_artifact(run, out_dir, "report")
        if parent_run:
            tracker.log_artifact(parent_run, out_dir, "report")
    return path
