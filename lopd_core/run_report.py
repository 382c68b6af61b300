"""`lopd report`: one self-contained HTML page (PNGs inlined as base64, no script, no CDN) plus the PNGs.

What a person watching a LOPD run needs to see, per training run (one per cycle when there are several):
reward and success against rollouts, δ̄ against the margin line m, the β trajectory, the KL terms and the
student/teacher entropies, the held-out evaluation (base vs students, greedy and sampled) as a table and as bars
with their 95 % intervals, the teacher in play (the frozen base alone, reading its bank rows as text, as φ's
latents) beside each student, and, for `lopd cycle`, each guard's curve across the lineage.

Per-step curves are smoothed as TensorBoard smooths them (`ema`: an exponential moving average, debiased at the
start), drawn bold over the raw points, which stay faint behind: the per-step reward is a sawtooth (a step's tasks
are consecutive tasks of a stream whose templates, and so domains, rotate), and the raw line hides the trend. β,
the margin m and the distillation weight are not smoothed: they are the run's own state, not noisy estimates.

It reads only files (plots/distill.csv columns of DESIGN §5, metrics/eval.json) and the records it is given, and
writes only under `out_dir`, so it runs anywhere, offline. Plotting uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from lopd_core.export import eval_rows
from lopd_core.outputs import OutputPathError, check_folder, mark_folder, write_file

# Left in every report folder: a later report may write into a folder holding it, and no other non-empty folder.
REPORT_MARKER = ".lopd-report"
_FOOTER = "Self-contained: images are inlined; no network access needed."
# The smoothing weight of the per-step curves (TensorBoard's slider, fixed here). Each step's B tasks are
# consecutive tasks of a stream whose templates rotate (about 40 training templates: a domain returns every
# 40 / B = 5 steps at B = 8), so the raw reward is a sawtooth of about that period; an EMA of weight w averages
# about 1 / (1 − w) steps, and 0.8 spans one period.
SMOOTHING = 0.8
FINAL_SPLIT = "test_final"  # read by no decision (lopd_core/envs/held_out.py): marked as reported only


def _earlier_report(folder: Path, names: set[str]) -> bool:
    """A report written before the marker existed: its index.html carries write_report's footer (a user's own
    index.html in a folder of the same names does not)."""
    try:
        return "index.html" in names and _FOOTER in (folder / "index.html").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False


@dataclass(frozen=True)
class TrainingRun:
    """One distillation run: a label ("cycle 2"), its per-step CSV and the margin m it was trained with (None:
    `lopd.margin: auto`, priced by the run). The CSV's `margin` column, where it has one, is the m in force at
    each step and is what the report draws; `margin` is for CSVs written before the column existed."""

    label: str
    csv: Path
    margin: float | None


@dataclass(frozen=True)
class EvalColumn:
    """One evaluated policy: a label ("base", "cycle 1 student") and its metrics/eval.json content."""

    label: str
    results: dict


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _read(runs: list[TrainingRun]) -> list[tuple[TrainingRun, pd.DataFrame]]:
    out = []
    for run in runs:
        if Path(run.csv).exists():
            frame = pd.read_csv(run.csv)
            if len(frame):
                out.append((run, frame))
    return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def ema(values, weight: float = SMOOTHING) -> np.ndarray:
    """TensorBoard's smoothing of a scalar curve: last ← w · last + (1 − w) · v from last = 0, divided by 1 − w^k
    after k finite points (the debiasing, so that the first points are not pulled toward 0). A non-finite point is
    kept as it is and does not enter the average (a NaN step: no such trajectory that step)."""
    out, last, k = [], 0.0, 0
    for v in np.asarray(values, dtype=float):
        if not math.isfinite(v):
            out.append(v)
            continue
        last, k = weight * last + (1 - weight) * v, k + 1
        out.append(last / (1 - weight**k) if weight < 1 else last)
    return np.asarray(out, dtype=float)


def _curve(ax, x, y, label: str, *, smooth: bool = True, **style):
    """One per-step series: the EMA bold over the raw points drawn faint in the same colour (too few points to
    smooth: the raw points alone, marked). Returns the bold line."""
    y = pd.Series(y, dtype=float).to_numpy()
    if not smooth or np.isfinite(y).sum() < 3:
        return ax.plot(x, y, marker=".", label=label, **style)[0]
    raw = ax.plot(x, y, alpha=0.25, linewidth=0.9, **style)[0]
    return ax.plot(x, ema(y), color=raw.get_color(), linewidth=1.9, label=label, **style)[0]


SMOOTHED_NOTE = (
    f"Per-step curves: the bold line is an exponential moving average (weight {SMOOTHING:g}, smoothed as TensorBoard "
    "smooths), the faint line behind it each step's own value. β, the margin m and the distillation weight are drawn "
    "as they are."
)


def plot_reward_success(data, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, frame in data:
        _curve(axes[0], frame["rollouts"], frame["reward_mean"], run.label)
        _curve(axes[1], frame["rollouts"], frame["success_rate"], run.label)
    axes[0].set(title="reward of the step's rollouts (smoothed)", xlabel="rollouts", ylabel="reward")
    axes[1].set(title="success rate of the step's rollouts (smoothed)", xlabel="rollouts", ylabel="success")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def margins(run: TrainingRun, frame: pd.DataFrame) -> pd.Series:
    """The m in force at each step: the CSV's `margin` column where it has one (a priced margin is only known
    there), else the run's margin (NaN where neither says)."""
    if "margin" in frame and frame["margin"].notna().any():
        return frame["margin"].astype(float)
    return pd.Series(float("nan") if run.margin is None else float(run.margin), index=frame.index)


def _margin_label(m: pd.Series) -> str:
    values = m.dropna().unique()
    if len(values) == 0:
        return "–"
    return f"{values[0]:g}" if len(values) == 1 else f"{values.min():g}…{values.max():g}"


def plot_delta_margin(data, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for run, frame in data:
        line = _curve(ax, frame["step"], frame["delta"], f"δ̄ {run.label}")
        m = margins(run, frame)
        if m.notna().any():  # per step: the margin in force (priced once under `lopd.margin: auto`)
            ax.plot(
                frame["step"],
                m,
                linestyle="--",
                drawstyle="steps-post",
                color=line.get_color(),
                alpha=0.7,
                label=f"margin m = {_margin_label(m)}",
            )
        for part, style, what in (
            ("delta_success", (0, (1, 1)), "successes"),
            ("delta_failure", (0, (4, 2, 1, 2)), "failures"),
        ):
            if part in frame and frame[part].notna().any():  # δ̄'s parts (NaN: no such trajectory that step)
                ax.plot(
                    frame["step"],
                    ema(frame[part]),
                    linestyle=style,
                    color=line.get_color(),
                    alpha=0.6,
                    label=f"δ on {what} {run.label} (EMA)",
                )
    ax.set(title="privileged margin δ̄ (smoothed) against the margin line m (β rises while δ̄ < m)", xlabel="step")
    ax.set(ylabel="δ̄")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: it hides no curve
    return _save(fig, path)


def plot_beta(data, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for run, frame in data:
        ax.plot(frame["step"], frame["beta"], marker=".", label=run.label)
    ax.set(title="Lagrange multiplier β (dual ascent)", xlabel="step", ylabel="β")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_kl_entropy(data, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, frame in data:
        _curve(axes[0], frame["step"], frame["distill_loss"], f"KL(p_S‖p_T) {run.label}")
        _curve(axes[0], frame["step"], frame["kl_phi"], f"KL φ {run.label}", linestyle="--")
        # lopd.replay_share > 0 (distill/update/replay.py)
        if "replay_kl" in frame and frame["replay_kl"].notna().any():
            _curve(axes[0], frame["step"], frame["replay_kl"], f"KL to the base, replay {run.label}", linestyle=":")
        _curve(axes[1], frame["step"], frame["student_entropy"], f"student {run.label}")
        _curve(axes[1], frame["step"], frame["teacher_entropy"], f"teacher {run.label}", linestyle="--")
    axes[0].set(title="distillation, composer and replay KL (smoothed)", xlabel="step", ylabel="nats/token")
    axes[1].set(title="entropy at action tokens (smoothed)", xlabel="step", ylabel="nats")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_reward_signal(data, path: Path) -> Path:
    """Where the reward is silent: the share of groups whose rewards are all equal (GRPO learns nothing there) and
    of groups that all failed, and the distillation weight in force (the reward-led arms gate or anneal it)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, frame in data:
        if "flat_groups" not in frame:  # a CSV written before these columns existed
            continue
        _curve(axes[0], frame["step"], frame["flat_groups"], f"all rewards equal {run.label}")
        _curve(axes[0], frame["step"], frame["failed_groups"], f"all failed {run.label}", linestyle="--")
        axes[1].plot(frame["step"], frame["distill_weight"], marker=".", label=run.label)
    axes[0].set(title="groups without a reward signal (smoothed)", xlabel="step", ylabel="share of the step's groups")
    axes[1].set(title="distillation weight in force", xlabel="step", ylabel="weight")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _split_label(env: str, split: str, several: bool) -> str:
    name = f"{env} {split}" if several else split
    return f"{name}\n(reported only)" if split == FINAL_SPLIT else name


def _errors(values: list[float], intervals: list) -> np.ndarray:
    """matplotlib's yerr (2, n) from [low, high] intervals around `values` (no interval: no bar)."""
    low = [v - iv[0] if iv else 0.0 for v, iv in zip(values, intervals)]
    high = [iv[1] - v if iv else 0.0 for v, iv in zip(values, intervals)]
    return np.clip(np.array([low, high], dtype=float), 0.0, None)


def _top(intervals_and_values) -> float:
    """An upper y limit that shows small rates (a fixed [0, 1] flattens 5 % against 0 %): 15 % above the highest
    bar or interval, at most 1."""
    top = max([v for v in intervals_and_values if math.isfinite(v)] or [1.0])
    return min(1.0, 1.15 * top + 0.02)


def plot_eval(columns: list[EvalColumn], path: Path, mode: str = "greedy") -> Path:
    """Grouped bars per environment and split, one bar per evaluated policy, each with its 95 % interval: success
    (the Wilson interval) and, below, mean reward (the normal interval of the mean, where the evaluation recorded
    one), which still separates policies while every success rate is zero."""
    plt = _pyplot()
    cells = [{(e, s): c for e, s, m, c in eval_rows(col.results) if m == mode} for col in columns]
    keys = list(dict.fromkeys(k for cell in cells for k in cell))
    several = len({e for e, _ in keys}) > 1
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.6))
    width = 0.8 / max(1, len(columns))
    for ax, metric, interval, label in (
        (axes[0], "success_rate", "ci95", "success rate"),
        (axes[1], "reward_mean", "reward_ci95", "mean reward"),
    ):
        heights = []
        for i, (col, cell) in enumerate(zip(columns, cells)):
            xs = [j + i * width for j in range(len(keys))]
            values = [cell.get(k, {}).get(metric, math.nan) for k in keys]
            intervals = [cell.get(k, {}).get(interval) for k in keys]
            heights += values + [iv[1] for iv in intervals if iv]
            ax.bar(xs, values, width, label=col.label, yerr=_errors(values, intervals), capsize=2, ecolor="#333")
        labels = [_split_label(e, s, several) for e, s in keys]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], labels, fontsize=8)
        ax.set(title=f"held-out {label} ({mode}, 95 % intervals)", ylabel=label, ylim=(0, _top(heights)))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def teacher_cells(columns: list[EvalColumn]) -> dict[tuple[str, str], list[tuple[str, dict, dict]]]:
    """{(env, split): [(column label, {condition: {mode: summary}}, the column's own {mode: summary})]} for every
    column whose evaluation carries the teacher in play (lopd_core/distill/teacher/teacher_play.py's key)."""
    out: dict = {}
    for col in columns:
        for env, splits in (col.results or {}).items():
            if not isinstance(splits, dict):  # a benchmark's section
                continue
            for split, modes in splits.items():
                played = modes.get("teacher_in_play") if isinstance(modes, dict) else None
                if played:
                    own = {m: c for m, c in modes.items() if isinstance(c, dict) and "success_rate" in c}
                    out.setdefault((env, split), []).append((col.label, played, own))
    return out


TEACHER_CONDITIONS = (("base", "base alone"), ("text", "reading rows as text"), ("latents", "reading φ's latents"))


def plot_teacher(columns: list[EvalColumn], path: Path) -> Path | None:
    """The teacher in play beside each student: per environment, split and mode, grouped bars of success with
    their Wilson intervals — the frozen base alone, reading its bank rows as text, reading them as φ's latents
    (the teacher distillation trains toward), and the student itself on the same tasks. None: nothing to draw."""
    cells = teacher_cells(columns)
    panels = [
        (key, mode)
        for key, rows in cells.items()
        for mode in dict.fromkeys(m for _, played, _ in rows for c in played.values() for m in c)
    ]
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.3 * len(panels)), squeeze=False)
    bars = [*TEACHER_CONDITIONS, ("student", "the student, same tasks")]
    colours = {"base": "#9e9e9e", "text": "C1", "latents": "C2", "student": "C0"}
    width = 0.8 / len(bars)
    for ax, ((env, split), mode) in zip(axes[:, 0], panels):
        rows = cells[(env, split)]
        heights = []
        for i, (condition, label) in enumerate(bars):
            found = [(own if condition == "student" else got.get(condition, {})).get(mode) for _, got, own in rows]
            values = [c["success_rate"] if c else math.nan for c in found]
            intervals = [c.get("ci95") if c else None for c in found]
            heights += values + [iv[1] for iv in intervals if iv]
            xs = [j + i * width for j in range(len(rows))]
            ax.bar(xs, values, width, label=label, color=colours[condition], yerr=_errors(values, intervals), capsize=2)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r[0] for r in rows], fontsize=8)
        ax.set(title=f"{env} {split}, {mode}: success with 95 % intervals", ylabel="success rate")
        ax.set_ylim(0, _top(heights))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_guards(lineage: list[dict], path: Path) -> Path | None:
    """Each guard's curve across the lineage, one row per guard, from the cycles' gate records
    (lopd_core/drivers/cycle_record.py `guard_record`): left, its value for each cycle's student (filled: promoted)
    beside the root on the same tasks; right, the change since the root with its 95 % interval against the budget
    (−cycle.guard_budget: the guard fails unless the data show the fall is smaller) and the change since the
    champion against its bound (−cycle.guard_max_fall). Each cycle's gate plays fresh tasks, so the root's value
    moves with the batch. None: no guard was checked."""
    names = list(dict.fromkeys(g["name"] for r in lineage for g in r.get("guards", []) if g.get("student") is not None))
    if not names:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 3.1 * len(names)), squeeze=False)
    labels = [r["label"] for r in lineage]
    x = np.arange(len(lineage))
    for (left, right), name in zip(axes, names):
        guards = [next((g for g in r.get("guards", []) if g["name"] == name), None) for r in lineage]

        def value(g, key):
            return math.nan if g is None or g.get(key) is None else 100 * g[key]

        student = np.array([value(g, "student") for g in guards])
        promoted = np.array([bool(r.get("promoted")) for r in lineage])
        left.plot(x, [value(g, "root") for g in guards], "x--", color="grey", label="root, same tasks")
        line = left.plot(x, student, "-", color="C0", alpha=0.6)[0]
        left.scatter(x[promoted], student[promoted], color=line.get_color(), zorder=3, label="student (promoted)")
        left.scatter(
            x[~promoted], student[~promoted], facecolor="white", edgecolor=line.get_color(), zorder=3, label="student"
        )
        left.set(title=name, ylabel="value, %")
        for offset, (key, bound_key, colour, what, bound_name) in enumerate(
            (
                ("vs_root", "budget", "C3", "since the root", "−budget"),
                ("vs_champion", "max_fall", "#777777", "since the champion", "−max fall"),
            )
        ):
            comparisons = [g.get(key) if g else None for g in guards]
            gain = [100 * c["interval"]["gain"] if c else math.nan for c in comparisons]
            errors = _errors(
                gain, [[100 * c["interval"]["low"], 100 * c["interval"]["high"]] if c else None for c in comparisons]
            )
            right.errorbar(x + 0.08 * offset, gain, yerr=errors, fmt="o", color=colour, capsize=3, label=what)
            bound = next((g[bound_key] for g in guards if g and g.get(bound_key) is not None), None)
            if bound is not None:
                style = "--" if offset == 0 else ":"
                right.axhline(-100 * bound, color=colour, linestyle=style, linewidth=1.2, label=f"{bound_name}")
        right.axhline(0, color="black", linewidth=0.6)
        right.set(title="change with its 95 % interval", ylabel="points")
        for ax in (left, right):
            ax.set_xticks(x, labels, fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return _save(fig, path)


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (
        f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"><figcaption>'
        f"{html.escape(alt)}</figcaption></figure>"
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def eval_table(columns: list[EvalColumn]) -> tuple[list[str], list[list[str]]]:
    keys: list[tuple[str, str, str]] = []
    cells = []
    for col in columns:
        cell = {(e, s, m): c for e, s, m, c in eval_rows(col.results)}
        keys += [k for k in cell if k not in keys]
        cells.append(cell)
    header = ["env", "split", "mode"] + [f"{c.label} success [95% CI] / reward" for c in columns] + ["n"]
    rows = []
    for key in keys:
        row = [key[0], f"{key[1]} (reported only)" if key[1] == FINAL_SPLIT else key[1], key[2]]
        n = ""
        for cell in cells:
            c = cell.get(key)
            row.append(
                f"{100 * c['success_rate']:.1f}% [{100 * c['ci95'][0]:.1f}, {100 * c['ci95'][1]:.1f}]"
                f" / {c['reward_mean']:.3f}"
                if c
                else "–"
            )
            n = c["n"] if c else n
        rows.append(row + [str(n)])
    return header, rows


def _final_rows(data) -> list[list[str]]:
    rows = []
    for run, frame in data:
        last = frame.iloc[-1]
        rows.append(
            [
                run.label,
                str(int(last["step"])),
                str(int(last["rollouts"])),
                f"{last['reward_mean']:.3f}",
                f"{last['success_rate']:.3f}",
                f"{last['beta']:.4f}",
                f"{frame['delta'].mean():+.4f}",
                _margin_label(margins(run, frame)),
            ]
        )
    return rows


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}figure{margin:10px 0}img{max-width:100%}figcaption{font-size:.8em;color:#666}
.note{color:#666;font-size:.85em}"""


def _training_section(data, out: Path) -> str:
    """The training runs' last steps and curves (their PNGs, and δ̄ beside the margin as a CSV) in `out`."""
    if not data:
        return '<p class="note">No training curves yet (no distill CSV found).</p>'
    final = _table(
        ["run", "steps", "rollouts", "reward", "success", "final β", "mean δ̄", "margin m"], _final_rows(data)
    )
    figures = [
        (plot_reward_success(data, out / "reward_success.png"), "reward and success against rollouts"),
        (plot_delta_margin(data, out / "delta_margin.png"), "δ̄ against the margin line m"),
        (plot_beta(data, out / "beta.png"), "β trajectory"),
        (plot_kl_entropy(data, out / "kl_entropy.png"), "KL terms and entropies"),
        (plot_reward_signal(data, out / "reward_signal.png"), "groups without a reward signal"),
    ]
    margin_rows = [
        pd.DataFrame(
            {
                "run": run.label,
                "step": frame["step"],
                "rollouts": frame["rollouts"],
                "delta": frame["delta"],
                "margin": margins(run, frame),
            }
        )
        for run, frame in data
    ]
    pd.concat(margin_rows).to_csv(out / "delta_margin.csv", index=False)
    return (
        "<h2>Training runs (last step)</h2>"
        + final
        + "<h2>Training curves</h2>"
        + f'<p class="note">{html.escape(SMOOTHED_NOTE)}</p>'
        + "".join(_img(p, alt) for p, alt in figures)
    )


def write_report(
    runs: list[TrainingRun],
    evals: list[EvalColumn],
    out_dir: str | Path,
    *,
    title: str = "LOPD report",
    summary: list[tuple[str, str]] = (),
    lineage: list[dict] = (),
) -> Path:
    """Write out_dir/index.html and its PNGs; return the HTML path. Missing CSVs are skipped, not fatal.
    `lineage`: one {label, promoted, guards} per cycle (lopd_core/drivers/cycle_summary.py `lineage_points`), for
    the guards' curves; empty outside `lopd cycle`.

    `out_dir` must be missing, empty or a report folder of ours (outputs.check_folder): `--out /` or a folder of
    the user's is refused before anything is written into it."""
    out = check_folder(out_dir, REPORT_MARKER, "a report", _earlier_report)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"cannot create the report folder {out_dir}: {exc.strerror}") from exc
    mark_folder(out, REPORT_MARKER)
    data = _read(runs)
    sections = [f"<h1>{html.escape(title)}</h1>"]
    if summary:
        sections.append("<h2>Summary</h2>" + _table(["what", "value"], [list(r) for r in summary]))
    sections.append(_training_section(data, out))
    evals = [c for c in evals if c.results]
    if evals:
        header, rows = eval_table(evals)
        sections.append(
            "<h2>Held-out evaluation</h2>"
            + '<p class="note">The evaluation\'s own tasks (eval.batch 0). test_final is read by no decision, guard '
            "or option choice: reported only.</p>"
            + _table(header, rows)
            + _img(plot_eval(evals, out / "eval.png"), "held-out success and mean reward per split (greedy)")
        )
        teacher = plot_teacher(evals, out / "teacher_in_play.png")
        if teacher is not None:
            sections.append(
                "<h2>Teacher in play</h2>"
                + _img(teacher, "the frozen base alone, reading its bank rows as text and as φ's latents; the student")
            )
    guards = plot_guards(list(lineage), out / "guards.png")
    if guards is not None:
        sections.append(
            "<h2>Guards across the lineage</h2>"
            + '<p class="note">What each cycle\'s gate read: a fresh batch of held-out tasks per cycle, champion, '
            "student and root on the same tasks.</p>"
            + _img(guards, "each guard per cycle, and its change since the root and since the champion")
        )
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body>{''.join(sections)}"
        f'<p class="note">{_FOOTER}</p></body></html>'
    )
    return write_file(out / "index.html", page)
