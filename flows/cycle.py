"""`lopd cycle`: continual self-improvement, one Prefect flow run per invocation, N cycles each.

One cycle, as a recipe (DESIGN §3 "Continual cycles"):
  1. start from the champion — the last promoted student, the base policy before any promotion;
  2. refresh the bank: the champion's bank plus the successes of the champion's own rollouts;
  3. cold start φ0 when the champion has no composer yet (the first cycle), else reuse the champion's φ;
  4. distil a new student from the champion; the frozen teacher is the champion itself, or the first base
     when `cycle.refresh_teacher` is false;
  5. evaluate champion and student on held-out tasks (the champion's evaluation is cached);
  6. export the student, register it as a version of `lopd-student`, and promote it — champion alias,
     champion.json — only if the gate passes (flows/gate.py, lopd_core/gate.py: by default the paired interval
     of the gain clears `cycle.min_gain` and no guard shows a fall);
  7. write the report across all cycles so far.

State between invocations lives in `cycle.dir`: champion.json (what the next cycle starts from) and
history.json (one record per cycle). Every stage is keyed by the content of its inputs, so running again with
nothing changed — same params, same champion — reuses every cached stage instead of recomputing it.
MLflow: one parent run per cycle, a child run per stage (flows/stage_flows.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow

from flows import gate as gate_flow
from flows import stage_flows as S
from lopd_core.config import Params, load_params
from lopd_core.distill.teacher_play import teacher_lines
from lopd_core.envs.mix import resolve_mix
from lopd_core.jsonio import read_json, write_json
from lopd_core.locks import folder_lock
from lopd_core.methods import resolve_method
from tasks.caching import content_hash
from tasks.stage_tasks import log
from tasks.tracking import NullTracker, Tracker, git_commit, make_tracker


@dataclass
class Champion:
    """What a cycle starts from. The base is generation 0 and has neither bank nor composer."""

    model: str
    bank: dict | None = None  # the bank summary of the cycle that produced it (bank_dir, index_dir, dvc_md5)
    composer: str | None = None  # φ trained with it; None: cold start needed
    eval: str | None = None  # its eval.json
    generation: int = 0
    cycle: int = 0  # the cycle that promoted it
    version: str | None = None  # its lopd-student version in the registry
    gate: dict | None = None  # the gate's decision that promoted it (flows/gate.py gate_record)


def gate_score(params: Params, results: dict | None) -> float:
    """The gate's point estimate from an eval.json: `gate_metric` under `gate_mode`, averaged over envs and
    `gate_splits` (the base's figure on the parent run; the decision itself reads per-task outcomes)."""
    g = params.cycle
    values = [
        splits[s][g.gate_mode][g.gate_metric]
        for splits in (results or {}).values()
        for s in g.gate_splits
        if s in splits and g.gate_mode in splits[s]
    ]
    if not values:
        raise ValueError(
            f"the evaluation has none of the gate's splits {g.gate_splits} in mode {g.gate_mode!r}: "
            "set eval.splits/eval.modes to include them"
        )
    return sum(values) / len(values)


def teacher_for(params: Params, champion: Champion, base: str) -> str | None:
    """The teacher's weights for this cycle's distillation: None (the champion the student starts from, one
    weight copy in LoRA mode) unless `cycle.refresh_teacher` is false and the champion is no longer the base."""
    return None if params.cycle.refresh_teacher or champion.model == base else base


def _last_row(csv_path: str) -> tuple[dict, float]:
    import pandas as pd

    frame = pd.read_csv(csv_path)
    return frame.iloc[-1].to_dict(), float(frame["delta"].mean())


@flow(name="lopd-cycle", log_prints=True, validate_parameters=False)
def cycle_flow(
    params_file: str = "params.yaml", overrides: list[str] | None = None, cycles: int = 1, track: bool = True
) -> list[dict]:
    """Run `cycles` cycles from the current champion; return one record per cycle."""
    params = load_params(params_file, overrides or [])
    resolve_mix(params.envs)  # every environment of the mix resolves before a base is built or a run opened
    # One cycle at a time per folder: a second run would read the same history and champion and overwrite them.
    with folder_lock(params.cycle.dir, "the cycle folder"):
        return _run_cycles(params, cycles, make_tracker(params.tracking, track))


def _run_cycles(params: Params, cycles: int, tracker: Tracker | NullTracker) -> list[dict]:
    """The cycles, one after the other, sharing `tracker` (one MlflowClient for the whole command)."""
    root = Path(params.cycle.dir)
    tracker.close_abandoned_runs()
    base = S.base_flow(params)
    state = read_json(root / "champion.json", None)
    champion = Champion(**state) if state else Champion(model=base)
    history = read_json(root / "history.json", [])
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
    params: Params, tracker: Tracker | NullTracker, champion: Champion, base: str, *, number: int, history: list[dict]
) -> dict:
    started = time.perf_counter()
    log(f"cycle {number}: starting from {champion.model} (generation {champion.generation})")
    commit = git_commit()
    # the cycle's parent run: ended FAILED by the context manager when a stage raises
    with tracker.run(
        f"cycle-{number}",
        tags={
            "lopd.cycle": number,
            "git.commit": commit,
            "lopd.champion": champion.model,
            "lopd.champion_version": champion.version or "base",
        },
    ) as parent:
        tracker.log_params(parent, params.to_dict())
        common = {"parent_run": parent, "cycle": number, "tracker": tracker}
        bank = S.bank_flow(
            params, champion.model, (champion.bank or {}).get("bank_dir"), champion.generation + 1, **common
        )
        tracker.set_tags(parent, {"lopd.bank.dvc_md5": bank["dvc_md5"]})
        phi0, cold = champion.composer, None  # a promoted champion carries its trained composer on
        if phi0 is None:
            cold = S.coldstart_flow(params, champion.model, bank, **common)
            phi0 = cold["phi0"]
        teacher = teacher_for(params, champion, base)
        # φ read into this cycle's bank by the weights that will read its latents (DESIGN §3: φ0 does not transfer)
        fitted = S.fit_flow(params, teacher or champion.model, bank, phi0, **common)
        play = S.teacher_flow(params, teacher or champion.model, bank, fitted["phi"], **common)
        distilled = S.distill_flow(params, champion.model, bank, fitted["phi"], teacher, **common)
        resolvable = gate_flow.resolvable_before(params)
        log(
            f"cycle {number}: the gate ({params.cycle.gate_test}) at n = {resolvable[1]} paired tasks can resolve a "
            f"gain of about {100 * resolvable[0]:.0f} points or more (before the evaluation; lopd_core/gate.py)"
        )
        champ_eval = S.evaluate_flow(params, champion.model, label="champion", **common)
        student_eval = S.evaluate_flow(params, distilled["student"], label="student", **common)
        student_eval["eval"] = with_teacher(params, number, student_eval["eval"], play["results"])
        base_eval = champ_eval if champion.model == base else S.evaluate_flow(params, base, label="base", **common)

        decision, looks = gate_flow.decide_promotion(
            params, champion.model, distilled["student"], (champ_eval, student_eval), common=common
        )
        gate = gate_flow.gate_record(decision, resolvable)
        promoted = decision.promoted
        log(
            f"cycle {number}: gate {params.cycle.gate_metric} ({params.cycle.gate_mode}, "
            f"{'+'.join(params.cycle.gate_splits)}): {decision.reason}"
        )

        lineage = {
            "cycle": number,
            "parent model": champion.model,
            "parent version": champion.version or "base",
            "base model content": content_hash(base)[:16],
            "bank DVC md5": bank["dvc_md5"],
            "bank rows": bank["bank_rows"],
            "git commit": commit,
            "mlflow cycle run": parent or "untracked",
            "distill steps": distilled["steps"],
            "gate": decision.reason,
            "promoted": promoted,
        }
        exported = S.export_flow(
            params,
            distilled["student"],
            str(Path(params.cycle.dir) / "exports" / f"cycle-{number:03d}" / "student"),
            student_eval["eval"],
            base_eval["eval"],
            lineage,
            promote=promoted,
            **common,
        )
        last, delta_mean = _last_row(distilled["csv"])
        record = {
            "cycle": number,
            "promoted": promoted,
            "gate": gate,
            "champion_before": asdict(champion),
            "student": distilled["student"],
            "csv": distilled["csv"],
            "export": exported["export"],
            "version": exported["version"],
            "mlflow_run": parent,
            "eval": {"base": base_eval["eval"], "champion": champ_eval["eval"], "student": student_eval["eval"]},
            "final_beta": float(last["beta"]),
            "final_delta": float(last["delta"]),
            "delta_mean": delta_mean,
            "bank": bank_census(
                distilled.get("grown_bank", {}).get("bank_dir") or bank["bank_dir"], distilled.get("bank_added", 0)
            ),
            # the m the run trained with (the resolved method's: 0 for lopd_no_margin), not the section's
            "margin": distilled.get("margin", resolve_method(params.lopd, params.baselines).margin),
            "cached": {
                k: v["cached"]
                for k, v in (
                    ("bank", bank),
                    ("coldstart", cold),
                    ("fit", fitted),
                    ("teacher", play),
                    ("distill", distilled),
                    ("champion_eval", champ_eval),
                    ("student_eval", student_eval),
                    *((f"gate_look_{i + 2}", e) for i, e in enumerate(looks)),
                )
                if v is not None
            },
            "composer_from": ("the champion's" if cold is None else "cold start φ0")
            + (f", fitted in the world on {fitted['targets']} trajectories" if fitted["fitted"] else ", not fitted"),
            "teacher_in_play": play["results"],
            "base_hash": lineage["base model content"],
            # the bank the student's own successes grew during distillation, when it grew (growing_bank.py)
            "new_champion": asdict(
                Champion(
                    model=distilled["student"],
                    bank={**bank, **(distilled.get("grown_bank") or {})},
                    composer=distilled["composer"],
                    eval=student_eval["eval"],
                    generation=champion.generation + 1,
                    cycle=number,
                    version=exported["version"],
                    gate=gate,
                )
            ),
        }
        record["report"] = write_cycle_report(params, history + [record], tracker, parent, number)
        record["seconds"] = round(time.perf_counter() - started, 1)
        tracker.log_metrics(
            parent,
            {
                **gate_flow.gate_metrics(gate),
                "gate.base": gate_score(params, base_eval["results"]),
                "beta": record["final_beta"],
                "delta": record["final_delta"],
                "delta_mean": delta_mean,
                "cycle_seconds": record["seconds"],
            },
        )
        tracker.set_tags(
            parent,
            {"lopd.promoted": promoted, "lopd.registered_version": exported["version"], "lopd.gate": decision.reason},
        )
        tracker.log_artifact(parent, distilled["csv"], "plots")
        for label, path in record["eval"].items():
            tracker.log_artifact(parent, path, f"eval/{label}")
    return record


def with_teacher(params: Params, number: int, eval_path: str, teacher: dict) -> str:
    """The student's eval.json with this cycle's teacher in play under each env and split, as a file of the
    cycle's own (the evaluation's folder is a cached stage result, shared by any cycle that made the same
    student)."""
    from lopd_core.distill.teacher_play import merge_teacher

    out = Path(params.cycle.dir) / "evals" / f"cycle-{number:03d}-student.json"
    write_json(out, merge_teacher(read_json(eval_path), teacher))
    return str(out)


def write_cycle_report(
    params: Params, history: list[dict], tracker: Tracker | NullTracker, parent: str | None, number: int
) -> str:
    """The report across every cycle so far: one training run per cycle, base vs each cycle's student."""
    trained_margin = resolve_method(params.lopd, params.baselines).margin
    runs = [
        {"label": f"cycle {r['cycle']}", "csv": r["csv"], "margin": r.get("margin", trained_margin)} for r in history
    ]
    evals = [{"label": "base", "path": history[0]["eval"]["base"]}]
    evals += [
        {
            "label": f"cycle {r['cycle']} student" + (" (promoted)" if r["promoted"] else ""),
            "path": r["eval"]["student"],
        }
        for r in history
    ]
    last = history[-1]
    summary = [
        ("cycles", str(len(history))),
        (
            "last cycle",
            (
                f"{last['cycle']}: "
                + last["gate"].get(
                    "reason",
                    f"{'promoted' if last['promoted'] else 'not promoted'} (gate {last['gate']['student']:.4f} "
                    f"vs champion {last['gate']['champion']:.4f})",
                )
            ),
        ),
        ("gate", gate_line(last["gate"], params)),
        (
            "final β / last δ̄ / mean δ̄",
            (
                f"{last['final_beta']:.4f} / {last['final_delta']:+.4f} / "
                f"{last['delta_mean']:+.4f} (margin m = {last['margin']:g})"
            ),
        ),
        ("teacher in play", "; ".join(teacher_lines(last.get("teacher_in_play") or {}, params.eval.modes)) or "n/a"),
        ("base weights (content hash)", last.get("base_hash", "n/a")),
        ("exported student", last["export"]),
        ("registered version", str(last["version"])),
    ]
    return S.report_flow(
        params,
        runs,
        evals,
        params.cycle.report_dir,
        "LOPD continual cycles",
        summary,
        parent_run=parent,
        cycle=number,
        tracker=tracker,
    )


def bank_census(bank_dir: str, added_in_distill: int = 0) -> dict:
    """Rows of the bank a cycle ends with, and its successes per tool domain (a cross-domain task counts in
    each of its domains; rows of other environments under the environment's name: `codegen`, a plugin's)."""
    import pandas as pd

    from lopd_core.envs import TEMPLATES

    path = Path(bank_dir) / "experience.parquet"
    frame = (
        pd.read_parquet(path, columns=["env", "template"])
        if path.exists()
        else pd.DataFrame({"env": [], "template": []})
    )
    by_domain: dict[str, int] = {}
    for (env, template), count in frame.value_counts(["env", "template"]).items():
        for domain in TEMPLATES[template].domains if env == "toolworld" and template in TEMPLATES else (env,):
            by_domain[domain] = by_domain.get(domain, 0) + int(count)
    return {"rows": len(frame), "by_domain": by_domain, "added_in_distill": int(added_in_distill)}


def summarize(record: dict, params: Params) -> list[str]:
    """The few lines `lopd cycle` ends with."""
    ev = {k: read_json(v) for k, v in record["eval"].items()}

    def cell(results, env, split, mode):
        c = (results or {}).get(env, {}).get(split, {}).get(mode)
        if not c:
            return "n/a"
        lo, hi = c.get("ci95", (float("nan"), float("nan")))
        return f"{100 * c['success_rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"

    worlds = ", ".join(params.envs.deploy_worlds)
    lines = [
        f"cycle {record['cycle']} summary ({record.get('seconds', 0):.0f}s; deployment world(s): {worlds}; "
        f"base weights {record.get('base_hash', 'n/a')}):"
    ]
    bank = record.get("bank") or {}
    if bank:
        by_domain = ", ".join(f"{d} {n}" for d, n in sorted(bank.get("by_domain", {}).items()))
        lines.append(
            f"  bank: {bank.get('rows')} rows ({bank.get('added_in_distill', 0)} added by the student "
            f"during distillation); successes by domain: {by_domain or 'none'}"
        )
    envs = list(params.envs.mix)
    n = next((c["n"] for c in (ev["student"] or {}).get(envs[0], {}).get("test_id", {}).values()), None)
    lines.append(f"  success, base -> new student (95 % interval, n = {n} per split):")
    for env in envs:  # a plugin environment is evaluated only on the splits it has
        label = f"{env} " if len(envs) > 1 else ""
        splits = [s for s in params.eval.splits if s in (ev["student"] or {}).get(env, {}) or len(envs) == 1]
        for split in splits:
            for mode in params.eval.modes:
                lines.append(
                    f"    {label + split:<14} {mode:<8} {cell(ev['base'], env, split, mode)} -> "
                    f"{cell(ev['student'], env, split, mode)}"
                )
    teacher = [f"    {line}" for line in teacher_lines(record.get("teacher_in_play") or {}, params.eval.modes)]
    if teacher:
        lines += ["  teacher in play (the frozen base alone, reading its bank rows as text, as φ's latents):", *teacher]
    lines += [
        (
            f"  final β {record['final_beta']:.4f}, δ̄ {record['final_delta']:+.4f} at the last step "
            f"(mean {record['delta_mean']:+.4f}; margin m = {record['margin']:g})"
        ),
        f"  gate: {gate_line(record['gate'], params)}",
        f"  promoted: {'yes' if record['promoted'] else 'no'} ({record['gate'].get('reason', 'point rule')})",
        *(f"    guard {line}" for line in guard_lines(record["gate"])),
        (
            f"  cached stages reused: {', '.join(k for k, v in record['cached'].items() if v) or 'none'}; "
            f"composer: {record.get('composer_from', 'cold start φ0')}"
        ),
        f"  exported student: {record['export']} (registry version {record['version']})",
        f"  report: {record['report']}",
    ]
    return lines


def gate_line(gate: dict, params: Params) -> str:
    """The gate's settings and point estimates in one line (the reason is the decision's own sentence)."""
    g = params.cycle
    before = gate.get("resolvable_before")
    stated = (
        f"; before the evaluation, n = {gate.get('n_before')} could resolve about {100 * before:.0f} points"
        if before is not None
        else ""
    )
    return (
        f"{gate.get('test', 'point')} test of {g.gate_metric} ({g.gate_mode}, {'+'.join(g.gate_splits)}), "
        f"min gain {g.min_gain:g}: student {gate['student']:.4f} vs champion {gate['champion']:.4f}"
        f"{stated}; {gate.get('looks', 1)} look(s)"
    )


def guard_lines(gate: dict) -> list[str]:
    """One line per guard: its paired change, or why it was not checked."""
    lines = []
    for guard in gate.get("guards", []):
        iv = guard["interval"]
        if iv is None:
            lines.append(f"{guard['name']}: not checked (no outcomes for it in this evaluation)")
            continue
        change = f"{100 * iv['gain']:+.1f} points [{100 * iv['low']:+.1f}, {100 * iv['high']:+.1f}], n = {iv['n']}"
        lines.append(f"{guard['name']}: {change} -> {'FAILED' if guard['failed'] else 'ok'}")
    return lines
