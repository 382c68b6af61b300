"""`lopd compare`: every method of lopd_core/methods.py at the same rollout budget, seeds, one report.

The recipe:
  1. the base policy (built once, as in `lopd cycle`);
  2. the replicates are (deployment world, seed) pairs; per pair, when any method reads the bank: the bank of
     the agent's own successes in that world (its sampled rollouts are charged to those methods' budget) and
     the composer's cold start φ0 (pretraining worlds only) — both cached Prefect stages from flows/stage_flows.py;
  3. learning rates: with more than one value in the preset's grid, every method is tuned on the same grid, on
     `tune_seed` in `tune_world` and validation tasks (train split, never test), at `tune_budget_fraction` of
     the budget;
  4. one run per (method, world, seed) at the tuned rate, mapped over a Prefect task: the cycle's distill stage
     function (`run_lopd`: the growing bank in a copy per run, checkpoints, the exported student) and the cycle's
     evaluation of that student on every environment of `envs.mix` (lopd_core/compare/run.py);
  5. reports/compare.md, compare.png, compare.json (lopd_core/compare/report.py).
MLflow: one parent run, a child run per (method, seed) (and per tuning run) with the distill CSV's columns as
step metrics, the held-out curve as metrics stepped by rollouts, and the final evaluation.

Runs go through a one-worker task runner: the 2-core default machine gains nothing from running two trainings
at once, and each run seeds torch's global generator, which concurrent threads would share. Each run's folder
is keyed by the content of what it reads (params sections, base, bank, φ0, method, seed, lr): a finished run is
reused when `lopd compare` runs again with nothing changed.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows import stage_flows as S
from lopd_core.compare.plan import pair_params, report_settings, run_seed, tune_score, tuned_rates
from lopd_core.config import ConfigError, Params, load_params
from lopd_core.drivers.progress import log
from lopd_core.envs.mix import resolve_mix
from lopd_core.methods import method_spec
from lopd_core.model.shipped import weights_sha256
from tasks.caching import (
    DONE,
    is_complete,
    key_payload,
    mark_complete,
    plugin_fingerprint,
    stage_key,
)
from tasks.stage_params import COMPARE_CODE
from tasks.tracking import NullTracker, Tracker, eval_metrics, git_commit, make_tracker

AnyTracker = Tracker | NullTracker


def preset_params(params_file: str, overrides: list[str]) -> tuple[Params, object, list[str]]:
    """Params with the preset's overrides applied first and the user's after them (the user's win); the
    compare work folder becomes cycle.dir, so the base, bank and cold-start stages cache under it."""
    first = load_params(params_file, overrides)
    name = first.compare.preset
    if name not in first.compare.presets:
        raise ConfigError(f"compare.preset: got {name!r}, expected one of {', '.join(first.compare.presets)}")
    preset = first.compare.presets[name]
    merged = [*preset.overrides, f"cycle.dir={first.compare.work_dir}", *overrides]
    return load_params(params_file, merged), preset, merged


@task(name="compare-run", cache_policy=NO_CACHE)  # a finished run is found by its folder (module docstring)
def compare_run_task(
    work: str,
    params: Params,
    method: str,
    budget: int,
    bank: dict | None,
    phi0: str | None,
    curve_points: int,
    curve_n: int,
    eval_n: int,
    validation_n: int,
    curve_marks: list[int],
    tracker: AnyTracker,
    parent: str | None,
    run_name: str,
    run_tags: dict,
) -> dict:
    """One (method, seed, lr) run in its own folder (lopd_core/compare/run.py), inside its MLflow child run."""
    from lopd_core.compare.run import run_method

    bank = bank or {}
    with tracker.run(run_name, parent=parent, tags={**run_tags, "lopd.cached": False}) as run:
        tracker.log_params(run, params.to_dict())
        log(f"compare: {method} seed {params.seed} lr {params.lopd.lr_student:g} -> {work}")
        summary = run_method(
            params,
            method,
            work,
            budget=budget,
            bank_rollouts=bank.get("sampled", 0),
            bank_dir=bank.get("bank_dir"),
            index_dir=bank.get("index_dir"),
            phi0=phi0,
            curve_points=curve_points,
            curve_n=curve_n,
            eval_n=eval_n,
            validation_n=validation_n,
            curve_marks=curve_marks,
            log=log,
        )
        _log_results(tracker, run, summary)
    return mark_complete(work, {**summary, "commit": git_commit()})  # the code it ran (compare.reuse: identity)


def _job(
    params: Params,
    method: str,
    pair: tuple[str, int],
    lr: float,
    budget: int,
    inputs: dict,
    preset,
    validation_n: int,
    train_seed: int = 0,
) -> dict:
    """One run to do: its params, its work folder (keyed by the content of all it reads) and the bank and φ it
    reads, from the replicate's `inputs` (replicate_inputs). Training run `train_seed` of the replicate trains
    and evaluates under its own seed (plan.run_seed); the bank and φ are the replicate's."""
    world, replicate_seed = pair
    base, banks, phi0s = inputs["base"], inputs["banks"], inputs["phi0s"]
    seed = run_seed(replicate_seed, train_seed)
    p = pair_params(params, world, seed)
    p.lopd = replace(p.lopd, lr_student=lr, method=method)
    spec = method_spec(method, p.baselines)
    bank = banks.get(pair) if spec.uses_bank else None
    phi0 = phi0s.get(pair) if spec.needs_composer else None
    if bank and phi0:  # a method that reads the fitted φ pays for the text teacher's rollouts it was fitted on
        bank = {**bank, "sampled": bank["sampled"] + bank.get("fit_sampled", 0)}
    sections = {"seed": seed, "world": world, "method": method, "lr": lr, "budget": budget}
    sections |= {name: S.section(p, name) for name in ("lopd", "eval", "bench", "bank")}
    sections |= {"envs": p.envs, "baselines": p.baselines, "rollout": p.rollout, "composer": p.composer}
    sections["curve"] = [preset.curve_points, preset.curve_n, preset.eval_n, validation_n]
    if preset.curve_marks:  # (absent otherwise: the keys of runs read at evenly spaced points stay as they were)
        sections["curve_marks"] = list(preset.curve_marks)
    if plugins := plugin_fingerprint(p.envs):  # the mix's plugin task files and code (tasks/stage_params.py)
        sections["plugins"] = plugins
    inputs = {"base": base, "bank": bank and str(Path(bank["bank_dir"]) / "experience.parquet"), "phi0": phi0}
    phase = "tune" if validation_n else "final"
    key = stage_key(key_payload(f"compare-{phase}", sections, inputs, code=COMPARE_CODE))
    work = Path(p.cycle.dir) / "runs" / f"{phase}-{method}-{world}-s{seed}-lr{lr:g}-{key[:10]}"
    p.model = replace(p.model, name_or_path=base)
    return {
        "work": str(work),
        "params": p,
        "method": method,
        "budget": budget,
        "bank": bank,
        "phi0": phi0,
        "phase": phase,
        "validation_n": validation_n,
        "replicate": [world, replicate_seed],
        "train_seed": train_seed,
    }


def _run_name(job: dict) -> tuple[str, dict]:
    """The child run's name and tags of a job."""
    world, seed = job["params"].envs.deploy_worlds[0], job["params"].seed
    return (
        f"{job['phase']}-{job['method']}-{world}-seed{seed}",
        {
            "lopd.stage": "compare-run",
            "lopd.compare.phase": job["phase"],
            "lopd.method": job["method"],
            "lopd.seed": seed,
            "lopd.world": world,
        },
    )


def same_run(job: dict, preset) -> str | None:
    """`compare.reuse: identity`: a finished run of the job's method, world, seed and learning rate (its folder's
    name) at the same budget and evaluation size, whatever code it ran — the job's own folder first."""
    if is_complete(job["work"]):
        return None
    prefix = Path(job["work"]).name.rsplit("-", 1)[0] + "-"
    for folder in sorted(Path(job["work"]).parent.glob(prefix + "*")):
        if not is_complete(folder):
            continue
        summary = json.loads((folder / DONE).read_text())
        if summary.get("budget") != job["budget"]:
            continue
        cells = summary.get("final", {}).get("test_id", {}).get("greedy", {})
        if job["validation_n"] or cells.get("n") == preset.eval_n:
            return str(folder)
    return None


def _run_all(
    jobs: list[dict], preset, tracker: AnyTracker, parent: str | None, on_done=None, reuse: str = "content"
) -> list[dict]:
    """Map the task over the jobs not finished yet (each opens its child run before its work); a job finished by
    an earlier `lopd compare` gets a child run of its recorded results, tagged cached. Every job's summary, in
    job order."""
    if reuse == "identity":
        for j in jobs:
            j["work"] = same_run(j, preset) or j["work"]
    todo = [j for j in jobs if not is_complete(j["work"])]
    for j in jobs:
        if j not in todo:
            name, tags = _run_name(j)
            with tracker.run(name, parent=parent, tags={**tags, "lopd.cached": True}) as run:
                tracker.log_params(run, j["params"].to_dict())
                _log_results(tracker, run, json.loads((Path(j["work"]) / DONE).read_text()))
    if todo:
        names = [_run_name(j) for j in todo]
        futures = compare_run_task.map(
            work=[j["work"] for j in todo],
            params=[j["params"] for j in todo],
            method=[j["method"] for j in todo],
            budget=[j["budget"] for j in todo],
            bank=[j["bank"] for j in todo],
            phi0=[j["phi0"] for j in todo],
            curve_points=preset.curve_points,
            curve_n=preset.curve_n,
            eval_n=preset.eval_n,
            validation_n=[j["validation_n"] for j in todo],
            curve_marks=unmapped(list(preset.curve_marks)),
            tracker=unmapped(tracker),
            parent=unmapped(parent),
            run_name=[n for n, _ in names],
            run_tags=[t for _, t in names],
        )
        for future in futures:
            future.result()
            if on_done is not None:  # the report so far, from every finished run: a stopped comparison has one
                on_done([_done(j) for j in jobs if is_complete(j["work"])])
    return [_done(j) for j in jobs]


def _done(job: dict) -> dict:
    """A finished run's summary, with which replicate and training seed it is."""
    summary = json.loads((Path(job["work"]) / DONE).read_text())
    return {**summary, "replicate": job["replicate"], "train_seed": job["train_seed"]}


def _log_results(tracker: AnyTracker, run: str | None, summary: dict) -> None:
    """A compare run's numbers into its child run: the distill CSV as step metrics, the held-out curve stepped by
    rollouts, the final evaluation."""
    tracker.log_step_metrics(run, summary["csv"])
    for point in summary["curve"]:
        tracker.log_metrics(
            run,
            {f"curve.test_id.{k}": v for k, v in point.items() if k not in ("step", "rollouts")},
            step=int(point["rollouts"]),
        )
    tracker.log_metrics(
        run,
        {
            **eval_metrics(json.loads(Path(summary["eval"]).read_text())),
            "compare.rollouts": summary["rollouts"],
            "compare.steps": summary["steps"],
            "compare.bank_added": summary["bank"]["added"],
            "compare.train_seconds": summary["train_seconds"],
            "compare.eval_seconds": summary["eval_seconds"],
        },
    )
    tracker.log_artifact(run, summary["csv"])
    tracker.log_artifact(run, summary["eval"])


@flow(name="lopd-compare", log_prints=True, validate_parameters=False, task_runner=ThreadPoolTaskRunner(max_workers=1))
def compare_flow(
    params_file: str = "params.yaml",
    overrides: list[str] | None = None,
    track: bool = True,
    command: str = "lopd compare",
) -> dict:
    """The module docstring's recipe, one named step each, inside the comparison's MLflow parent run."""
    started = time.perf_counter()
    commit = git_commit()  # the code the runs use: taken now, not when the report is written
    params, preset, merged = preset_params(params_file, overrides or [])
    resolve_mix(params.envs)  # every environment of the mix resolves before any work or MLflow run
    tracker = make_tracker(params.tracking, track)  # one MlflowClient for every run of the comparison
    with tracker.run(
        f"compare-{params.compare.preset}",
        tags={"lopd.stage": "compare", "git.commit": commit, "lopd.compare.preset": params.compare.preset},
    ) as parent:
        tracker.log_params(parent, params.to_dict())
        base = S.base_flow(params)
        pairs = preset.pairs(params.envs.deploy_worlds)
        tune_pair = (preset.tune_world or params.envs.deploy_worlds[0], preset.tune_seed)
        tune_pair = tune_pair if len(preset.lr_grid) > 1 else None
        replicates = pairs + ([tune_pair] if tune_pair else [])
        inputs = replicate_inputs(params, preset, base, replicates, parent, tracker)
        tuning = tune(params, preset, tune_pair, inputs, tracker, parent)
        lr_of = tuned_rates(tuning, preset.methods, preset.lr_grid, params.lopd.lr_student)
        # replicate by replicate, training seed by seed, every method within a seed: a comparison stopped part way
        # has every method at the same seeds, and the next `lopd compare` resumes from the finished runs
        jobs = [
            _job(params, m, pair, lr_of[m], preset.budget, inputs, preset, 0, t)
            for pair in pairs
            for t in range(preset.train_seeds)
            for m in preset.methods
        ]

        def settings_now() -> list:
            return report_settings(
                params,
                preset,
                command=command,
                pairs=pairs,
                tune_pair=tune_pair,
                bank_sampled=next(iter(inputs["banks"].values()))["sampled"] if inputs["banks"] else None,
                base=base,
                base_hash=weights_sha256(base),
                overrides=merged,
                seconds=time.perf_counter() - started,
                commit=commit,
            )

        def partial(done: list[dict]) -> None:
            report(params, done, settings_now(), tuning, NullTracker(), None, planned=len(jobs))

        runs = _run_all(jobs, preset, tracker, parent, on_done=partial, reuse=params.compare.reuse)
        seconds = time.perf_counter() - started
        paths = report(params, runs, settings_now(), tuning, tracker, parent, planned=len(jobs))
        tracker.log_metrics(parent, {"compare.seconds": seconds})
    log(f"compare: {len(runs)} runs in {seconds / 60:.1f} min -> {paths['md']}")
    return {"runs": runs, "tuning": tuning, "report": {k: str(v) for k, v in paths.items()}, "seconds": seconds}


def report_from_disk(params_file: str = "params.yaml", overrides: list[str] | None = None, command: str = "") -> dict:
    """`lopd compare --report-only`: the report of the preset's finished runs found in compare.work_dir, without
    running, scheduling or keying anything — what a comparison still running (or stopped) has so far. A run
    counts when it is a final run of one of the preset's methods, in one of its worlds, at its budget."""
    params, preset, merged = preset_params(params_file, overrides or [])
    worlds = {w for w, _ in preset.pairs(params.envs.deploy_worlds)}
    runs = []
    for done in sorted((Path(params.compare.work_dir) / "runs").glob(f"final-*/{DONE}")):
        summary = json.loads(done.read_text())
        if summary["method"] in preset.methods and summary["world"] in worlds and summary["budget"] == preset.budget:
            runs.append(summary)
    runs.sort(key=lambda r: (r["seed"], preset.methods.index(r["method"])))  # the order a comparison runs them
    base = params.model.name_or_path or params.model.base_dir
    settings = [
        ("command", f"`{command or 'lopd compare --report-only'}`"),
        ("preset", params.compare.preset),
        ("methods", ", ".join(preset.methods)),
        ("runs found", f"{len(runs)} finished runs in {params.compare.work_dir}/runs (each keyed by its code)"),
        ("base", f"{base}, weights sha256 {weights_sha256(base) if Path(base).is_dir() else 'n/a'}"),
        ("preset overrides", " ".join(f"`{o}`" for o in merged) or "none"),
        ("git commit (of this report)", git_commit()),
    ]
    return report(params, runs, settings, [], NullTracker(), None)


def replicate_inputs(
    params: Params, preset, base: str, pairs: list[tuple[str, int]], parent: str | None, tracker: AnyTracker
) -> dict:
    """Step 2: per replicate, when any method reads the bank, the bank of the agent's own successes in its world,
    and when any reads latents, φ0 fitted into that bank: {"base", "banks": {pair: bank summary}, "phi0s": {pair:
    φ path}}, what every run's job reads."""
    specs = [method_spec(m, params.baselines) for m in preset.methods]
    banks, phi0s = {}, {}
    inputs = {"base": base, "banks": banks, "phi0s": phi0s}
    if not any(s.uses_bank for s in specs):
        return inputs
    for pair in pairs:
        p = pair_params(params, *pair)
        bank = S.bank_flow(p, base, None, 0, parent_run=parent, tracker=tracker)
        banks[pair] = {**bank, "sampled": p.bank.seed_tasks * p.bank.samples_per_task}
        if any(s.needs_composer for s in specs):
            phi0 = S.coldstart_flow(p, base, bank, parent_run=parent, tracker=tracker)["phi0"]
            # φ read into the replicate's world (DESIGN §3); its text-teacher rollouts are charged (_job)
            fitted = S.fit_flow(p, base, bank, phi0, parent_run=parent, tracker=tracker)
            phi0s[pair] = fitted["phi"]
            banks[pair]["fit_sampled"] = fitted["online_rollouts"]
    return inputs


def tune(
    params: Params, preset, tune_pair: tuple[str, int] | None, inputs: dict, tracker: AnyTracker, parent: str | None
) -> list[dict]:
    """Step 3: every method on every rate of the grid, on the tuning replicate's validation tasks at a fraction of
    the budget; one `{"method", "lr", "score"}` per run (none when the grid has one value)."""
    if tune_pair is None:
        return []
    budget = max(1, int(preset.budget * preset.tune_budget_fraction))
    jobs = [
        _job(params, m, tune_pair, lr, budget, inputs, preset, preset.tune_n)
        for m in preset.methods
        for lr in preset.lr_grid
    ]
    return [
        {"method": job["method"], "lr": summary["lr"], "score": tune_score(summary)}
        for job, summary in zip(jobs, _run_all(jobs, preset, tracker, parent))
    ]


def report(
    params: Params,
    runs: list[dict],
    settings: list,
    tuning: list[dict],
    tracker: AnyTracker,
    parent: str | None,
    planned: int | None = None,
) -> dict:
    """Step 5: compare.md, compare.png and compare.json, logged as artifacts of the parent run (also written
    after each finished run, from the runs finished so far: `planned` says how many there will be)."""
    from lopd_core.compare.report import write_compare_report

    preset = params.compare.presets[params.compare.preset]
    paths = write_compare_report(
        runs,
        params.compare.report_dir,
        title=f"lopd compare ({params.compare.preset})",
        settings=[
            *settings,
            ("runs finished", f"{len(runs)} of {planned or len(runs)}"),
            ("code of the runs", ", ".join(sorted({r.get("commit", "not recorded")[:12] for r in runs})) or "none"),
        ],
        tuning=tuning,
        marks=list(preset.curve_marks),
        curve_n=preset.curve_n,
    )
    for path in paths.values():
        tracker.log_artifact(parent, path, "compare")
    return paths
