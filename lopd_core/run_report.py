"""`lopd report`: one self-contained HTML page (PNGs inlined as base64, no script, no CDN) plus the PNGs.

What a person watching a LOPD run needs to see, per training run (one per cycle when there are several):
reward and success against rollouts, δ̄ against the margin line m, the β trajectory, the KL terms and the
student/teacher entropies, and the held-out evaluation table (base vs students, greedy and sampled).
It reads only files (plots/distill.csv columns of DESIGN §5, metrics/eval.json) and writes only under `out_dir`,
so it runs anywhere, offline. Plotting uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lopd_core.export import eval_rows
from lopd_core.outputs import OutputPathError, check_folder, mark_folder, write_file

# Left in every report folder: a later report may write into a folder holding it, and no other non-empty folder.
REPORT_MARKER = ".lopd-report"
_FOOTER = "Self-contained: images are inlined; no network access needed."


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


def plot_reward_success(data, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, frame in data:
        axes[0].plot(frame["rollouts"], frame["reward_mean"], marker=".", label=run.label)
        axes[1].plot(frame["rollouts"], frame["success_rate"], marker=".", label=run.label)
    axes[0].set(title="reward (mean over the step's rollouts)", xlabel="rollouts", ylabel="reward")
    axes[1].set(title="success rate of the step's rollouts", xlabel="rollouts", ylabel="success", ylim=(-0.02, 1.02))
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
        line = ax.plot(frame["step"], frame["delta"], marker=".", label=f"δ̄ {run.label}")[0]
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
                    frame[part],
                    linestyle=style,
                    color=line.get_color(),
                    alpha=0.5,
                    label=f"δ on {what} {run.label}",
                )
    ax.set(title="privileged margin δ̄ against the margin line m (β rises while δ̄ < m)", xlabel="step", ylabel="δ̄")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
        axes[0].plot(frame["step"], frame["distill_loss"], marker=".", label=f"KL(p_S‖p_T) {run.label}")
        axes[0].plot(frame["step"], frame["kl_phi"], linestyle="--", label=f"KL φ {run.label}")
        # lopd.replay_share > 0 (distill/update/replay.py)
        if "replay_kl" in frame and frame["replay_kl"].notna().any():
            axes[0].plot(frame["step"], frame["replay_kl"], linestyle=":", label=f"KL to the base, replay {run.label}")
        axes[1].plot(frame["step"], frame["student_entropy"], marker=".", label=f"student {run.label}")
        axes[1].plot(frame["step"], frame["teacher_entropy"], linestyle="--", label=f"teacher {run.label}")
    axes[0].set(title="distillation KL (student), composer KL, replay KL", xlabel="step", ylabel="nats/token")
    axes[1].set(title="entropy at action tokens", xlabel="step", ylabel="nats")
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
        axes[0].plot(frame["step"], frame["flat_groups"], marker=".", label=f"all rewards equal {run.label}")
        axes[0].plot(frame["step"], frame["failed_groups"], linestyle="--", label=f"all failed {run.label}")
        axes[1].plot(frame["step"], frame["distill_weight"], marker=".", label=run.label)
    axes[0].set(title="groups without a reward signal", xlabel="step", ylabel="share of the step's groups")
    axes[1].set(title="distillation weight in force", xlabel="step", ylabel="weight")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_eval(columns: list[EvalColumn], path: Path) -> Path:
    """Grouped bars per split, one bar per evaluated policy: greedy success, and greedy mean reward (which
    still separates policies while every success rate is zero)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    cells = [{(s, m): c for _, s, m, c in eval_rows(col.results)} for col in columns]
    splits = sorted({s for cell in cells for (s, m) in cell if m == "greedy"})
    width = 0.8 / max(1, len(columns))
    for ax, field, label in zip(axes, ("success_rate", "reward_mean"), ("success rate", "mean reward")):
        for i, (col, cell) in enumerate(zip(columns, cells)):
            xs = [j + i * width for j in range(len(splits))]
            ax.bar(xs, [cell.get((s, "greedy"), {}).get(field, 0.0) for s in splits], width, label=col.label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(splits))], splits, rotation=15, fontsize=8)
        ax.set(title=f"held-out {label} (greedy)", ylabel=label, ylim=(0, 1))
        ax.legend(fontsize=8)
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
        row = list(key)
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
        + "".join(_img(p, alt) for p, alt in figures)
    )


def write_report(
    runs: list[TrainingRun],
    evals: list[EvalColumn],
    out_dir: str | Path,
    *,
    title: str = "LOPD report",
    summary: list[tuple[str, str]] = (),
) -> Path:
    """Write out_dir/index.html and its PNGs; return the HTML path. Missing CSVs are skipped, not fatal.

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
            + _table(header, rows)
            + _img(plot_eval(evals, out / "eval.png"), "held-out success per split")
        )
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body>{''.join(sections)}"
        f'<p class="note">{_FOOTER}</p></body></html>'
    )
    return write_file(out / "index.html", page)
