"""`lopd cycle`: continual self-improvement, one Prefect flow run per invocation, N cycles each.

One cycle, as a recipe (DESIGN §3 "Continual cycles"):
  1. start from the champion — the last promoted student, the base policy before any promotion;
  2. refresh the bank: the champion's bank plus the successes of the champion's own rollouts;
  3. cold start φ0 when the champion has no composer yet (the first cycle), else reuse the champion's φ; fit φ
     into this cycle's bank, and play the teacher it makes (alone, reading the bank as text, as φ's latents);
  4. distil a new student from the champion; the frozen teacher is the champion itself, or the first base
     when `cycle.refresh_teacher` is false; with `lopd.replay_share` > 0 a share of each step replays the
     pretraining worlds and every world an earlier cycle deployed to (lopd_core/distill/update/replay.py);
  5. evaluate champion, student and the first base (the lineage's root) on the report's held-out tasks
     (`eval.batch` 0, every split test_final included: the same tasks every cycle, cached but the student's);
  6. the gate plays champion, student and root on a batch of fresh held-out tasks of its own (flows/gate.py: no
     earlier cycle's gate read them, and the report does not show them); export the student, register it as a
     version of `lopd-student`, and promote it — champion alias, champion.json — only if the gate passes
     (lopd_core/gate.py: by default an exact paired test shows a gain above `cycle.min_gain`, and no guard falls
     beyond its budget since the root or its bound since the champion);
  7. write the report across all cycles so far.

State between invocations lives in `cycle.dir`: champion.json (what the next cycle starts from) and
history.json (one record per cycle, assembled from the stages' summaries by lopd_core/drivers/cycle_record.py:
this flow only orchestrates). Every stage is keyed by the content of its inputs, so running again with
nothing changed — same params, same champion — reuses every cached stage instead of recomputing it. A cycle
after one that did not promote starts from the same champion with the same inputs, so its distillation takes a
fresh seed (cycle_record.with_retry_seed): it tries again rather than replaying the cycle before from cache.
MLflow: one parent run per cycle, a child run per stage (flows/stage_flows.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from prefect import flow

from flows import gate as gate_flow
from flows import stage_flows as S
from flows.stopping import STOP_HOOKS
from lopd_core.config import Params, load_params
from lopd_core.drivers.cycle_record import (
    Champion,
    CycleRun,
    CycleStages,
    cycle_lineage,
    cycle_metrics,
    cycle_record,
    cycle_tags,
    gate_record,
    retries_of_champion,
    student_eval_with_teacher,
    teacher_for,
    with_earlier_worlds,
    with_retry_seed,
)
from lopd_core.drivers.cycle_summary import cycle_report_inputs, guard_curves, lineage_points
from lopd_core.drivers.progress import log
from lopd_core.envs.mix import resolve_mix
from lopd_core.jsonio import read_json, write_json
from lopd_core.locks import folder_lock
from lopd_core.model.shipped import base_identity
from tasks.tracking import NullTracker, Tracker, git_commit, make_tracker

AnyTracker = Tracker | NullTracker


@flow(name="lopd-cycle", log_prints=True, validate_parameters=False, **STOP_HOOKS)
def cycle_flow(
    params_file: str = "params.yaml", overrides: list[str] | None = None, cycles: int = 1, track: bool = True
) -> list[dict]:
    """Run `cycles` cycles from the current champion; return one record per cycle."""
    params = load_params(params_file, overrides or [])
    resolve_mix(params.envs)  # every environment of the mix resolves before a base is built or a run opened
    # One cycle at a time per folder: a second run would read the same history and champion and overwrite them.
    with folder_lock(params.cycle.dir, "the cycle folder"):
        return _run_cycles(params, cycles, make_tracker(params.tracking, track))


def _run_cycles(params: Params, cycles: int, tracker: AnyTracker) -> list[dict]:
    """The cycles, one after the other, sharing `tracker` (one MlflowClient for the whole command)."""
    root = Path(params.cycle.dir)
    history = read_json(root / "history.json", [])
    # before the base is built or fetched: a split the first gate would outrun (a small task file at the default
    # eval.n_per_split) stops the command now; each cycle checks its own again
    gate_flow.check_fresh_tasks(params, gate_flow.gate_start(history, params.eval.n_per_split))
    tracker.close_abandoned_runs()
    base = S.base_flow(params)
    state = read_json(root / "champion.json", None)
    champion = Champion(**state) if state else Champion(model=base)
    records = []
    for _ in range(cycles):
        record = run_one_cycle(params, tracker, champion, base, number=len(history) + 1, history=history)
        history.append(record)
        write_json(root / "history.json", history, default=str)
        if record["promoted"]:
            champion = Champion(**record["new_champion"])
            write_json(root / "champion.json", asdict(champion), default=str)
        records.append(record)
    return records


def run_one_cycle(
    params: Params, tracker: AnyTracker, champion: Champion, base: str, *, number: int, history: list[dict]
) -> dict:
    """One cycle, the module docstring's recipe: each step below is one or more stage flows; what the cycle
    keeps of them is assembled in lopd_core/drivers/cycle_record.py."""
    started = time.perf_counter()
    start = gate_flow.gate_start(history, params.eval.n_per_split)
    gate_flow.check_fresh_tasks(params, start)  # before any stage: a split the gate would outrun stops the cycle now
    log(f"cycle {number}: starting from {champion.model} (generation {champion.generation})")
    commit = git_commit()
    # the cycle's parent run: ended FAILED by the context manager when a stage raises
    with tracker.run(f"cycle-{number}", tags=cycle_tags(number, commit, champion)) as parent:
        tracker.log_params(parent, params.to_dict())
        common = {"parent_run": parent, "cycle": number, "tracker": tracker}
        stages = read_experience(params, champion, base, common)
        stages.update(distill=distill_student(distill_params(params, history), champion, base, stages, common))
        resolvable = announce_gate(params, number, start)
        stages.update(evaluate_cycle(params, champion, base, stages, common))
        decision, looks, batches = gate_student(params, champion, base, stages, common, start)
        gate = gate_record(decision, resolvable, batches=batches, n_per_split=params.eval.n_per_split)
        done = CycleStages(**stages, gate_looks=looks)
        run = CycleRun(number, commit, parent, base_identity(base))
        exported = export_student(params, done, cycle_lineage(run, champion, done, gate, decision.promoted), common)
        record = cycle_record(params, run, champion, done, gate, decision.promoted, exported)
        record["guard_curves"] = guard_curves(history + [record])
        record["report"] = write_cycle_report(params, history + [record], tracker, parent, number)
        record["seconds"] = round(time.perf_counter() - started, 1)
        track_cycle(tracker, parent, record, cycle_metrics(params, record, done))
    return record


def read_experience(params: Params, champion: Champion, base: str, common: dict) -> dict:
    """Steps 2-3: the bank refreshed by the champion's rollouts, φ0 when the champion has no composer yet, φ
    fitted into this bank by the weights that will read its latents, and the teacher in play reading it."""
    tracker, parent = common["tracker"], common["parent_run"]
    bank = S.bank_flow(params, champion.model, (champion.bank or {}).get("bank_dir"), champion.generation + 1, **common)
    tracker.set_tags(parent, {"lopd.bank.dvc_md5": bank["dvc_md5"]})
    phi0, cold = champion.composer, None  # a promoted champion carries its trained composer on
    if phi0 is None:
        cold = S.coldstart_flow(params, champion.model, bank, **common)
        phi0 = cold["phi0"]
    teacher = teacher_for(params, champion, base) or champion.model
    # φ read into this cycle's bank by the weights that will read its latents (DESIGN §3: φ0 does not transfer)
    fitted = S.fit_flow(params, teacher, bank, phi0, **common)
    play = S.teacher_flow(params, teacher, bank, fitted["phi"], **common)
    return {"bank": bank, "coldstart": cold, "fit": fitted, "teacher": play}


def distill_params(params: Params, history: list[dict]) -> Params:
    """The distillation's params: earlier worlds replayed, and a fresh seed when the champion stayed in place
    (lopd_core/drivers/cycle_record.py with_retry_seed), said in the log."""
    distill = with_retry_seed(with_earlier_worlds(params, history), history)
    if distill.seed != params.seed:
        log(
            f"cycle {len(history) + 1}: the champion stayed in place for {retries_of_champion(history)} cycle(s): "
            f"the student trains on a fresh stream (seed {distill.seed}); bank, φ and evaluations keep seed "
            f"{params.seed}"
        )
    return distill


def distill_student(params: Params, champion: Champion, base: str, stages: dict, common: dict) -> dict:
    """Step 4: a new student distilled from the champion toward the fitted φ's latent teacher (`params` replay the
    worlds earlier cycles deployed to, where lopd.replay_share asks for replay)."""
    teacher = teacher_for(params, champion, base)
    distilled = S.distill_flow(params, champion.model, stages["bank"], stages["fit"]["phi"], teacher, **common)
    return {**distilled, "seed": params.seed}  # a retry's own seed (distill_params), kept in the record


def announce_gate(params: Params, number: int, start: int) -> tuple[float, int, float]:
    """What the gate's first look can resolve, said before the evaluation (lopd_core/gate.py), and which batch of
    fresh tasks it plays."""
    resolvable = gate_flow.resolvable_before(params)
    n = params.eval.n_per_split
    log(
        f"cycle {number}: the gate plays batch {start} of fresh held-out tasks (instances {start * n}.."
        f"{(start + 1) * n - 1} of each split; the report's are batch 0)"
    )
    log(
        f"cycle {number}: the gate ({params.cycle.gate_test}) at n = {resolvable[1]} paired tasks can resolve a "
        f"gain of about {100 * resolvable[0]:.0f} points or more, and promotes a true gain of "
        f"{100 * resolvable[2]:.0f} points 90 % of the time (min gain {100 * params.cycle.min_gain:.0f} points; "
        "before the evaluation, per-task sd 0.5 assumed; lopd_core/gate.py)"
    )
    return resolvable


def evaluate_cycle(params: Params, champion: Champion, base: str, stages: dict, common: dict) -> dict:
    """Step 5: champion and student on the report's held-out tasks (`eval.batch` 0; the student's file with the
    teacher in play beside it), and the base, when the champion is no longer the base: the report's first column
    (a cached stage: the same outcomes every cycle). No decision reads these: the gate plays its own batches."""
    champ_eval = S.evaluate_flow(params, champion.model, label="champion", **common)
    student_eval = S.evaluate_flow(params, stages["distill"]["student"], label="student", **common)
    student_eval["eval"] = student_eval_with_teacher(
        params, common["cycle"], student_eval["eval"], stages["teacher"]["results"]
    )
    base_eval = champ_eval if champion.model == base else S.evaluate_flow(params, base, label="base", **common)
    return {"champion_eval": champ_eval, "student_eval": student_eval, "base_eval": base_eval}


def gate_student(params: Params, champion: Champion, base: str, stages: dict, common: dict, start: int):
    """Step 6's gate: champion against student on the paired outcomes of fresh batches from `start` on, the
    guards against the champion and the lineage's root (the first base, played on the same batch), with more
    looks when `eval.sequential` asks for them (flows/gate.py); the decision, the evaluations of its looks and the
    batches they played."""
    models = {"champion": champion.model, "student": stages["distill"]["student"], "root": base}
    decision, looks, batches = gate_flow.decide_promotion(params, models, start=start, common=common)
    g = params.cycle
    log(f"cycle {common['cycle']}: gate {g.gate_metric} ({g.gate_mode}, {'+'.join(g.gate_splits)}): {decision.reason}")
    return decision, looks, batches


def export_student(params: Params, stages: CycleStages, lineage: dict, common: dict) -> dict:
    """Step 6: the student exported with its lineage, registered, and promoted when the gate passed."""
    number = common["cycle"]
    return S.export_flow(
        params,
        stages.distill["student"],
        str(Path(params.cycle.dir) / "exports" / f"cycle-{number:03d}" / "student"),
        stages.student_eval["eval"],
        stages.base_eval["eval"],
        lineage,
        promote=lineage["promoted"],
        **common,
    )


def track_cycle(tracker: AnyTracker, parent: str | None, record: dict, metrics: dict[str, float]) -> None:
    """The cycle's parent run: its metrics, the decision's tags, the distill CSV and the evaluations."""
    tracker.log_metrics(parent, metrics)
    tracker.set_tags(
        parent,
        {
            "lopd.promoted": record["promoted"],
            "lopd.registered_version": record["version"],
            "lopd.gate": record["gate"]["reason"],
        },
    )
    tracker.log_artifact(parent, record["csv"], "plots")
    for label, path in record["eval"].items():
        tracker.log_artifact(parent, path, f"eval/{label}")


def write_cycle_report(
    params: Params, history: list[dict], tracker: AnyTracker, parent: str | None, number: int
) -> str:
    """Step 7: the report across every cycle so far: one training run per cycle, base vs each cycle's student."""
    runs, evals, summary = cycle_report_inputs(params, history)
    title = "LOPD continual cycles"
    return S.report_flow(
        params,
        runs,
        evals,
        params.cycle.report_dir,
        title,
        summary,
        parent_run=parent,
        cycle=number,
        tracker=tracker,
        lineage=lineage_points(history),
    )
