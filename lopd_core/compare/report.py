"""reports/compare.md, compare.png and compare.json from the runs of `lopd compare`.

The replicates are (deployment world, seed) pairs. The table is mean ± std over replicates (population std,
0 with one) of held-out success per split and mode, read from each run's eval.json (the cycle's evaluation, every
environment of `envs.mix`): with several environments their tasks are pooled there (a run's `final`) and a second
table gives each environment's own (`by_env`); the per-domain table pools the replicates' tasks.
"Reaches GRPO" compares curves evaluated on the same test_id tasks (same world and seed, same `curve_n` tasks): GRPO's
target is the mean over replicates of its last curve point; a method reaches it at the first curve point where its
own mean over replicates is at least as high, and that point's rollouts are reported as a fraction of GRPO's.
The verdict lines are arithmetic on these numbers, each difference with its 95 % interval; a verdict credits
experience only beyond it. Where both methods' runs of a replicate (same world and seed) left per-task outcomes
(eval_tasks.parquet beside eval.json), they played the same tasks with the same seeds, and the interval is the
paired one of the promotion gate (lopd_core/gate.py) over those tasks; otherwise it is the unpaired interval of
a difference of two proportions (tasks pooled over replicates), wider than the paired one.

Methods are read by their role in the methods table (lopd_core/methods.py), not by name: the tables list them
grouped by role (reference, baselines, ablations, controls), the verdict sets the reference method against every
baseline and control that ran, and the controls decide whether a gain is credited to experience. A method added
to the table takes its place here by its row alone. GRPO is named once, as the curve the others must reach.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pandas as pd

from lopd_core import methods as M

LINESTYLES = {"reference": "-", "baseline": "--", "ablation": ":", "control": "-."}
CELLS = [("test_id", "greedy"), ("test_id", "sampled"), ("test_ood", "greedy"), ("test_ood", "sampled")]


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def _pct(values: list[float]) -> str:
    m, s = _mean_std(values)
    return "n/a" if math.isnan(m) else f"{100 * m:.1f} ± {100 * s:.1f}"


def mean_curve(runs: list[dict], mode: str) -> pd.DataFrame:
    """Mean over replicates of a method's curve: columns step, rollouts, success, reward (rows by curve point)."""
    frames = [pd.DataFrame(r["curve"]) for r in runs]
    frame = pd.concat(frames).groupby("step", as_index=False).mean(numeric_only=True)
    return frame.rename(columns={f"{mode}_success": "success", f"{mode}_reward": "reward"})[
        ["step", "rollouts", "success", "reward"]
    ]


def reach(runs_by_method: dict[str, list[dict]], method: str, mode: str) -> str:
    """Rollouts `method` needed to reach GRPO's final test_id success, as a fraction of GRPO's budget."""
    if "grpo" not in runs_by_method or method not in runs_by_method:
        return "n/a (GRPO not run)"
    grpo = mean_curve(runs_by_method["grpo"], mode)
    target, grpo_rollouts = float(grpo["success"].iloc[-1]), float(grpo["rollouts"].iloc[-1])
    if target <= 0:
        return "GRPO's final success is 0: nothing to reach"
    curve = mean_curve(runs_by_method[method], mode)
    hit = curve[curve["success"] >= target - 1e-12]
    if hit.empty:
        return f"not reached (best {100 * curve['success'].max():.1f}% < GRPO's {100 * target:.1f}%)"
    rollouts = float(hit["rollouts"].iloc[0])
    return f"{int(rollouts)} rollouts = {rollouts / grpo_rollouts:.0%} of GRPO's {int(grpo_rollouts)}"


def _pooled(runs: list[dict], split: str, mode: str) -> tuple[float, int]:
    """Success rate over every seed's tasks together, and how many tasks that is."""
    cells = [r["final"][split][mode] for r in runs]
    n = sum(c["n"] for c in cells)
    return (sum(c["success_rate"] * c["n"] for c in cells) / n if n else float("nan")), n


def difference_interval(a: list[dict], b: list[dict], split: str, mode: str) -> tuple[float, float]:
    """(difference of success rates a − b, half-width of its 95 % normal interval), tasks pooled over replicates.

    The seeds' tasks are different draws of the same split, so pooling them is one larger sample per method;
    the interval is the unpaired one, wider than a paired test would give on the shared tasks — a difference
    inside it is not evidence either way."""
    (pa, na), (pb, nb) = _pooled(a, split, mode), _pooled(b, split, mode)
    if not na or not nb:
        return float("nan"), float("nan")
    return pa - pb, 1.96 * math.sqrt(pa * (1 - pa) / na + pb * (1 - pb) / nb)


def _paired_frames(a: list[dict], b: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """The outcomes of the replicates both methods ran, each replicate its own cell (`env` becomes
    world/seed/env, so the gate's mean over cells is the mean over replicates); None without any."""
    from lopd_core.outcomes import outcomes_path, read_outcomes

    def by_replicate(runs):
        return {(r.get("world"), r.get("seed")): outcomes_path(r["eval"]) for r in runs if r.get("eval")}

    left, right = by_replicate(a), by_replicate(b)
    shared = [k for k in left if k in right and left[k].exists() and right[k].exists()]
    if not shared:
        return None

    def frames(paths):
        return pd.concat(
            [read_outcomes(paths[k]).assign(env=lambda f, k=k: f"{k[0]}/{k[1]}/" + f["env"]) for k in shared]
        )

    return frames(left), frames(right)


def method_difference(a: list[dict], b: list[dict], split: str, mode: str) -> tuple[float, float, float, str]:
    """(success of a − b, the 95 % interval's low and high, how it was computed): paired over the shared tasks of
    shared replicates where the runs left per-task outcomes, else `difference_interval`'s unpaired one."""
    from lopd_core.gate import paired_differences, paired_interval

    frames = _paired_frames(a, b)
    if frames is not None:
        pick = [f[(f["split"] == split) & (f["mode"] == mode)] for f in frames]
        diffs = paired_differences(pick[1], pick[0], "success_rate")  # a − b: a plays the student
        if len(diffs):
            iv = paired_interval(diffs)
            return iv.gain, iv.low, iv.high, f"paired, n = {iv.n}"
    d, half = difference_interval(a, b, split, mode)
    return d, d - half, d + half, "unpaired"


def _difference_text(split: str, mode: str, d: float, low: float, high: float, how: str) -> str:
    if how == "unpaired":
        return f"{split}/{mode} {100 * d:+.1f} (±{100 * (high - low) / 2:.1f})"
    return f"{split}/{mode} {100 * d:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] ({how})"


def role_of(method: str) -> str:
    """The method's role in the methods table; a method no longer in it (an old report's) counts as a baseline."""
    spec = M.METHODS.get(method)
    return spec.role if spec is not None else "baseline"


def by_role(methods) -> list[str]:
    """`methods` grouped by role in the table's order of roles (reference, baseline, ablation, control), each
    group in the order they came."""
    methods = list(methods)
    return sorted(methods, key=lambda m: (M.ROLES.index(role_of(m)), methods.index(m)))


def _verdict(by_method: dict[str, list[dict]]) -> list[str]:
    lines = []
    for ref in [m for m in by_role(by_method) if role_of(m) == "reference"]:
        lines += _reference_verdict(ref, by_method)
    return lines


def _reference_verdict(ref: str, by_method: dict[str, list[dict]]) -> list[str]:
    """The reference method against every baseline and control that ran, then against the controls together."""
    lines, name = [], ref.upper()
    for other in [m for m in by_role(by_method) if role_of(m) in ("baseline", "control")]:
        parts = [
            _difference_text(split, mode, *method_difference(by_method[ref], by_method[other], split, mode))
            for split, mode in CELLS
        ]
        lines.append(f"- {name} − {other} (success, points; the 95 % interval of the difference): " + ", ".join(parts))
    controls = [c for c in by_role(by_method) if role_of(c) == "control"]
    if controls:
        diffs = [method_difference(by_method[ref], by_method[c], s, m)[:2] for c in controls for s, m in CELLS[:2]]
        names = ", ".join(controls)
        if all(low > 0 for _, low in diffs):
            lines.append(
                f"- On test_id (both modes) {name} beats the controls ({names}) by more than "
                "the noise: a gain there can be credited to experience."
            )
        elif all(d > 0 for d, _ in diffs):
            lines.append(
                f"- On test_id (both modes) {name} is ahead of the controls ({names}), but "
                "within the 95 % interval of the difference: no evidence that experience, rather than "
                "sharpening or chance, helps."
            )
        else:
            lines.append(
                f"- On test_id (both modes) {name} does not beat the controls ({names}): "
                "what it gains is not shown to come from experience rather than sharpening."
            )
    return lines


def write_compare_report(
    runs: list[dict],
    out_dir: str | Path,
    *,
    title: str,
    settings: list[tuple[str, str]],
    tuning: list[dict] | None = None,
    marks: list[int] | None = None,
    curve_n: int = 0,
) -> dict[str, Path]:
    """`runs`: run_method summaries (final runs only). Writes compare.md, compare.png and compare.json. `marks`:
    the rollouts the curves were read at, for the verdicts over training seeds (decide.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_method: dict[str, list[dict]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    by_method = {m: by_method[m] for m in by_role(by_method)}  # grouped by role: the tables list them so

    lines = [f"# {title}", ""]
    lines += [f"- **{k}**: {v}" for k, v in settings]
    n_eval = runs[0]["final"]["test_id"]["greedy"]["n"] if runs else 0
    envs = sorted({e for r in runs for e in r.get("by_env", {})})
    pooled = f"; the tasks of {', '.join(envs)} pooled" if len(envs) > 1 else ""
    heading = f"## Held-out success (mean ± std over runs; n = {n_eval} tasks per split and run{pooled})"
    lines += ["", heading, ""]
    lines += _success_table(by_method)
    if len(envs) > 1:
        lines += ["", "## Held-out success per environment (mean ± std over replicates)", ""]
        lines += _env_table(by_method, envs)
    lines += verdict_section(by_method, marks or [], curve_n)
    lines += ["", "## Rollouts to reach GRPO's final test_id success (curves on the same tasks)", ""]
    lines += _md_table(
        ["method", "greedy", "sampled"],
        [[m, reach(by_method, m, "greedy"), reach(by_method, m, "sampled")] for m in by_method if m != "grpo"],
    )
    lines += [
        "",
        (
            "## test_id success by tool domain (greedy; tasks pooled over replicates, a cross-domain task "
            "in each of its domains)"
        ),
        "",
    ]
    lines += _domain_table(by_method)
    verdict = _verdict(by_method)
    if verdict:
        lines += ["", "## Differences (arithmetic on the table above)", "", *verdict]
    if tuning:
        lines += ["", "## Learning-rate tuning (validation: train-split tasks; mean reward of greedy and sampled)", ""]
        lines += _tuning_table(tuning)
    lines += ["", "![success against rollouts; δ and β of the LOPD variants](compare.png)", ""]
    md = out / "compare.md"
    md.write_text("\n".join(lines))
    png = plot_compare(by_method, out / "compare.png")
    js = out / "compare.json"
    js.write_text(json.dumps({"settings": dict(settings), "runs": runs, "tuning": tuning or []}, indent=2, default=str))
    return {"md": md, "png": png, "json": js}


def verdict_section(by_method: dict[str, list[dict]], marks: list[int], curve_n: int) -> list[str]:
    """Every method against GRPO (and LOPD against the controls), at the end and at each rollout mark, with the
    interval over training seeds and tasks and its verdict (decide.py), and the goal beyond the paper."""
    from lopd_core.compare import decide as V

    if "grpo" not in by_method:
        return []
    grpo = by_method["grpo"]
    header = ["method − GRPO", "test_id greedy (final)", "test_id sampled (final)"]
    header += [f"greedy at {m} rollouts" for m in marks] + ["rollouts to GRPO's final (greedy)"]
    # GRPO's final success on the curve's own tasks (its last point), which every curve is read on
    target = statistics.fmean(r["curve"][-1]["greedy_success"] for r in grpo)
    grpo_budget = statistics.fmean(r["rollouts"] for r in grpo)
    rows, goal = [], []
    for method, rs in by_method.items():
        if method == "grpo":
            continue
        final = [V.compare_final(rs, grpo, "test_id", mode) for mode in ("greedy", "sampled")]
        at = [V.compare_at_mark(rs, grpo, m, "greedy", curve_n) for m in marks]
        reach_at = V.rollouts_to_reach(rs, target, "greedy")
        reach_text = "not reached" if reach_at is None else f"{reach_at:.0f} ({reach_at / grpo_budget:.0%})"
        rows.append([method, *[d.text() for d in final], *[d.text() for d in at], reach_text])
        last = at[-1] if at else final[0]
        if M.METHODS.get(method) and M.METHODS[method].teacher.reads_latents:
            goal.append((method, last, reach_at))
    lines = ["", "## Verdicts over training seeds and tasks (points; 95 % interval, lopd_core/compare/decide.py)", ""]
    lines += [
        "Each cell: the mean over (world, training seed) cells of the paired difference, a Student-t interval "
        "of the mixed model with a random seed effect (worlds as strata), and the verdict.",
        "",
    ]
    lines += _md_table(header, rows)
    lines += ["", *goal_lines(goal, grpo_budget, target)]
    return lines


def goal_lines(goal: list, grpo_budget: float, target: float) -> list[str]:
    """The goal beyond the paper: a LOPD-family method ahead of GRPO at the last mark, reaching GRPO's final
    success with at most half its rollouts."""
    ahead = [m for m, d, _ in goal if d.verdict == "ahead"]
    fast = [m for m, _, r in goal if r is not None and r <= grpo_budget / 2]
    return [
        f"- Goal beyond the paper (GRPO's final greedy success on the curve's tasks: {100 * target:.1f} %): a "
        "LOPD-family method ahead of "
        f"GRPO at the last mark — {'met by ' + ', '.join(ahead) if ahead else 'not met'}; reaching GRPO's final "
        f"success with at most half its rollouts — {'met by ' + ', '.join(fast) if fast else 'not met'}."
    ]


def _success_table(by_method: dict[str, list[dict]]) -> list[str]:
    """Held-out success per method (mean ± std over replicates), the methods grouped by role."""
    header = [
        "method",
        "lr",
        *[f"{s} {m} %" for s, m in CELLS],
        "test_id reward (greedy)",
        "rollouts",
        "steps",
        "wall s / run",
        "role",
    ]
    rows = []
    for method, rs in by_method.items():
        cells = [_pct([r["final"][s][m]["success_rate"] for r in rs]) for s, m in CELLS]
        reward_m, reward_s = _mean_std([r["final"]["test_id"]["greedy"]["reward_mean"] for r in rs])
        wall = statistics.fmean(r["train_seconds"] + r["eval_seconds"] for r in rs)
        rows.append(
            [
                method,
                f"{rs[0]['lr']:g}",
                *cells,
                f"{reward_m:.3f} ± {reward_s:.3f}",
                f"{statistics.fmean(r['rollouts'] for r in rs):.0f}",
                str(rs[0]["steps"]),
                f"{wall:.0f}",
                role_of(method),
            ]
        )
    return _md_table(header, rows)


def _tuning_table(tuning: list[dict]) -> list[str]:
    """The tuning runs' validation score per method and learning rate."""
    grid = sorted({t["lr"] for t in tuning})
    table: dict[str, dict] = {}
    for t in tuning:
        table.setdefault(t["method"], {})[t["lr"]] = t["score"]
    return _md_table(
        ["method", *[f"lr {g:g}" for g in grid]],
        [[m, *[f"{v[g]:.3f}" if g in v else "" for g in grid]] for m, v in table.items()],
    )


def _env_table(by_method: dict[str, list[dict]], envs: list[str]) -> list[str]:
    """One row per (method, environment): success per split and mode from the runs' `by_env`."""

    def rates(rs, env, split, mode):
        return [
            r["by_env"][env][split][mode]["success_rate"]
            for r in rs
            if mode in r.get("by_env", {}).get(env, {}).get(split, {})
        ]

    rows = [
        [method, env, *[_pct(rates(rs, env, s, m)) for s, m in CELLS]]
        for method, rs in by_method.items()
        for env in envs
    ]
    return _md_table(["method", "environment", *[f"{s} {m} %" for s, m in CELLS]], rows)


def _domain_table(by_method: dict[str, list[dict]], split: str = "test_id", mode: str = "greedy") -> list[str]:
    pooled: dict[str, dict[str, list[float]]] = {}
    for method, rs in by_method.items():
        for r in rs:
            for domain, cell in r["final"][split][mode].get("by_domain", {}).items():
                wins_n = pooled.setdefault(method, {}).setdefault(domain, [0.0, 0])
                wins_n[0] += cell["success_rate"] * cell["n"]
                wins_n[1] += cell["n"]
    domains = sorted({d for cells in pooled.values() for d in cells})
    if not domains:
        return ["(no per-domain figures in these runs)"]
    rows = [
        [
            m,
            *[
                f"{100 * pooled[m][d][0] / pooled[m][d][1]:.1f} (n={pooled[m][d][1]})" if d in pooled.get(m, {}) else ""
                for d in domains
            ],
        ]
        for m in by_method
    ]
    return _md_table(["method", *domains], rows)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *["| " + " | ".join(r) + " |" for r in rows]]


def plot_compare(by_method: dict[str, list[dict]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, mode in zip(axes[0], ("greedy", "sampled")):
        for method, rs in by_method.items():
            c = mean_curve(rs, mode)
            ax.plot(
                c["rollouts"],
                100 * c["success"],
                marker="o",
                label=method,
                linestyle=LINESTYLES[role_of(method)],
            )
        ax.set(title=f"test_id success ({mode})", xlabel="rollouts (sampled trajectories)", ylabel="success %")
    axes[0][0].legend(fontsize=7)
    for ax, column in zip(axes[1], ("delta", "beta")):
        for method, rs in by_method.items():
            frames = [pd.read_csv(r["csv"]) for r in rs if Path(r["csv"]).exists()]
            if not frames or not any(f[column].notna().any() for f in frames) or not _reads_latents(method):
                continue
            mean = pd.concat(frames).groupby("rollouts", as_index=False)[column].mean()
            ax.plot(mean["rollouts"], mean[column], label=method)
        ax.set(title=f"{'δ̄' if column == 'delta' else 'β'} (LOPD variants, mean over replicates)", xlabel="rollouts")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _reads_latents(method: str) -> bool:
    """A LOPD variant: its teacher reads the composer's latents, so its run has a δ̄ and a β to draw."""
    spec = M.METHODS.get(method)
    return spec is not None and spec.teacher.reads_latents
