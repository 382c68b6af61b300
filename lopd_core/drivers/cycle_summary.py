"""What a reader sees of `lopd cycle`'s records: the lines the command ends with, and the report's runs,
evaluations and summary rows across every cycle so far.

Text from records (lopd_core/drivers/cycle_record.py), nothing else: the flow passes the report's inputs to its
report stage, the command prints the lines.
"""

from __future__ import annotations

from lopd_core.config import Params
from lopd_core.distill.teacher.teacher_play import teacher_lines
from lopd_core.jsonio import read_json
from lopd_core.methods import resolve_method
from lopd_core.settings.run import FINAL_SPLIT


def cycle_report_inputs(params: Params, history: list[dict]) -> tuple[list[dict], list[dict], list[tuple[str, str]]]:
    """(training runs, evaluations, summary rows) of the report across every cycle so far: one training run per
    cycle, base vs each cycle's student."""
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
    point_rule = (
        f"{'promoted' if last['promoted'] else 'not promoted'} (gate {last['gate']['student']:.4f} "
        f"vs champion {last['gate']['champion']:.4f})"
    )
    summary = [
        ("cycles", str(len(history))),
        ("last cycle", f"{last['cycle']}: " + last["gate"].get("reason", point_rule)),
        ("gate", gate_line(last["gate"], params)),
        *((f"guard {name} over the lineage", curve) for name, curve in guard_curves(history).items()),
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
    return runs, evals, summary


def _cell(results, env, split, mode) -> str:
    c = (results or {}).get(env, {}).get(split, {}).get(mode)
    if not c:
        return "n/a"
    lo, hi = c.get("ci95", (float("nan"), float("nan")))
    return f"{100 * c['success_rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def success_lines(record: dict, params: Params) -> list[str]:
    """Base -> new student success per environment, split and mode, with 95 % intervals."""
    ev = {k: read_json(v) for k, v in record["eval"].items()}
    envs = list(params.envs.mix)
    n = next((c["n"] for c in (ev["student"] or {}).get(envs[0], {}).get("test_id", {}).values()), None)
    lines = [f"  success, base -> new student (95 % interval, n = {n} per split; the report's tasks, eval.batch 0):"]
    for env in envs:  # a plugin environment is evaluated only on the splits it has
        label = f"{env} " if len(envs) > 1 else ""
        splits = [s for s in params.eval.splits if s in (ev["student"] or {}).get(env, {}) or len(envs) == 1]
        for split in splits:
            for mode in params.eval.modes:
                lines.append(
                    f"    {label + split:<14} {mode:<8} {_cell(ev['base'], env, split, mode)} -> "
                    f"{_cell(ev['student'], env, split, mode)}"
                )
    if FINAL_SPLIT in params.eval.splits:
        lines.append(f"    ({FINAL_SPLIT}: reported only, read by no decision, guard or option choice)")
    return lines


def summarize(record: dict, params: Params) -> list[str]:
    """The few lines `lopd cycle` ends with."""
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
    lines += success_lines(record, params)
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
        *(f"    guard {name} over the lineage: {curve}" for name, curve in record.get("guard_curves", {}).items()),
        (
            f"  cached stages reused: {', '.join(k for k, v in record['cached'].items() if v) or 'none'}; "
            f"composer: {record.get('composer_from', 'cold start φ0')}"
        ),
        f"  exported student: {record['export']} (registry version {record['version']})",
        f"  report: {record['report']}",
    ]
    return lines


def gate_line(gate: dict, params: Params) -> str:
    """The gate's settings, test and point estimates in one line (the reason is the decision's own sentence)."""
    g = params.cycle
    before = gate.get("resolvable_before")
    stated = (
        f"; before the evaluation, n = {gate.get('n_before')} could resolve about {100 * before:.0f} points"
        if before is not None
        else ""
    )
    if gate.get("detectable_before") is not None:
        stated += f" and promote a true gain of {100 * gate['detectable_before']:.0f} points 90 % of the time"
    if gate.get("batches"):
        first, end = gate["tasks"]
        stated += (
            f"; on fresh batch(es) {', '.join(map(str, gate['batches']))} (instances {first}..{end - 1} of each "
            "split, read by no earlier decision)"
        )
    test = gate.get("test", "point")
    if test == "paired":
        alpha = gate.get("alpha", (1 - g.confidence) / 2)
        test = f"exact one-sided paired sign-flip test at {100 * alpha:.3g} %"
    return (
        f"{test} of {g.gate_metric} ({g.gate_mode}, {'+'.join(g.gate_splits)}), "
        f"min gain {100 * g.min_gain:+.1f} points: student {gate['student']:.4f} vs champion {gate['champion']:.4f}"
        f"{stated}; {gate.get('looks', 1)} look(s)"
    )


def _comparison(c: dict | None, against: str, bound: str) -> str:
    if c is None:
        return f"since the {against}: not checked (no outcomes)"
    iv = c["interval"]
    change = f"{100 * iv['gain']:+.1f} points [{100 * iv['low']:+.1f}, {100 * iv['high']:+.1f}], n = {iv['n']}"
    return f"since the {against} {change}, p = {c['p']:.3f} ({bound}) -> {'FAILED' if c['failed'] else 'ok'}"


def guard_lines(gate: dict) -> list[str]:
    """One line per guard: its change since the champion and since the root, or why it was not checked."""
    lines = []
    for guard in gate.get("guards", []):
        if "vs_champion" not in guard:  # a record of the earlier gate: one interval against the champion
            iv = guard["interval"]
            change = "not checked" if iv is None else f"{100 * iv['gain']:+.1f} points"
            lines.append(f"{guard['name']}: {change} -> {'FAILED' if guard['failed'] else 'ok'}")
            continue
        fall = _comparison(guard["vs_champion"], "champion", f"a fall beyond {100 * guard['max_fall']:.0f} points")
        budget = _comparison(guard["vs_root"], "root", f"a fall within the {100 * guard['budget']:.0f}-point budget")
        lines.append(f"{guard['name']}: {fall}; {budget}")
    return lines


def lineage_points(history: list[dict]) -> list[dict]:
    """The report's guard chart input (lopd_core/run_report.py `plot_guards`): one {label, promoted, guards} per
    cycle, the guards as the gate's record keeps them (values and both comparisons)."""
    return [
        {"label": f"cycle {r['cycle']}", "promoted": bool(r["promoted"]), "guards": r.get("gate", {}).get("guards", [])}
        for r in history
    ]


def guard_curves(history: list[dict]) -> dict[str, str]:
    """Each guard's lineage curve across the cycles so far: each cycle's student (* when promoted) beside the
    root on the same tasks, in percent of the guard's metric on its cells. Each cycle's gate plays fresh tasks
    (flows/gate.py), so the root's value moves with the batch: the student is read against the root beside it."""
    points: dict[str, list[str]] = {}
    for record in history:
        for guard in record.get("gate", {}).get("guards", []):
            if guard.get("student") is None:
                continue
            mark = "*" if record["promoted"] else ""
            root = f" vs root {100 * guard['root']:.1f}" if guard.get("root") is not None else ""
            point = f"cycle {record['cycle']} {100 * guard['student']:.1f}{mark}{root}"
            points.setdefault(guard["name"], []).append(point)
    return {name: " -> ".join(curve) + " (%; * promoted)" for name, curve in points.items()}
