"""The verdicts of `lopd compare`: every difference between two methods with an interval over training runs and
tasks, and one of three words — ahead, behind, or cannot tell at this n and S.

Why not an interval over tasks alone: one training run moves a final score by about ten points (two near-identical
arms ended 14 points apart on one replicate), so an interval that covers only the evaluation's tasks calls the
spread between training runs a verdict.

The design is nested: a world (with its bank and φ) holds S training seeds; each seed trains every method and
plays them on the same held-out tasks with the same sampling seeds (the seed's own draw of the split). So each
(world, seed) cell gives one paired difference d = mean over its tasks of (a − b). Its variance is the training
runs' spread plus the tasks' noise, σ²_seed + σ²_task / n, and the spread of the cells' d estimates both at once.

The interval is the two-stage (summary-statistic) analysis of a mixed model with a random seed effect: per world,
the mean of its S cells' d with its standard error s / √S; over worlds, the mean of the worlds' means (each world
one stratum, weighed alike) with Welch–Satterthwaite degrees of freedom; a Student-t interval at 95 %, two-sided.
In a balanced nested design this is the mixed model's exact inference for the fixed effect. The cells' variance is
floored at the variance their tasks alone give (σ²_task / n: the paired per-task differences' variance where the
runs left per-task outcomes, else the unpaired bound from the cells' success rates, as for the curve's points):
with few seeds two runs can agree by chance, and a zero spread must not read as certainty. A bootstrap over seeds
was not chosen: with S = 3–5 it resamples from 3–5 values, its percentile interval is too narrow by about
√((S − 1)/S) and has no t quantile, so it declares verdicts that more seeds overturn.

A verdict: "ahead" when the interval lies above 0, "behind" when below, else "cannot tell at n = …, S = …". With
one seed in a world there is no spread to estimate: that world cannot tell.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Difference:
    """a − b in points of success, its interval, the cells it rests on and the verdict."""

    mean: float  # success difference (fraction; × 100 for points)
    low: float
    high: float
    seeds: int  # (world, seed) cells
    worlds: int
    tasks: int  # held-out tasks per cell (the smallest)
    verdict: str

    def text(self) -> str:
        if math.isnan(self.low):
            return f"{100 * self.mean:+.1f} ({self.verdict})"
        return f"{100 * self.mean:+.1f} [{100 * self.low:+.1f}, {100 * self.high:+.1f}] {self.verdict}"


def cell_differences(a: dict, b: dict) -> dict[str, list[float]]:
    """Per world, the paired differences of the cells both methods ran: `a`, `b` map (world, seed) -> value."""
    out: dict[str, list[float]] = {}
    for key in sorted(set(a) & set(b)):
        out.setdefault(key[0], []).append(a[key] - b[key])
    return out


def two_level_interval(
    by_world: dict[str, list[float]], tasks: int, task_variance: dict[str, float] | None = None
) -> Difference:
    """The mixed-model interval of the mean difference (module docstring) and its verdict. `task_variance`: per
    world, the variance one cell's d has from its tasks alone (σ²_task / n); the cells' spread estimates
    σ²_seed + σ²_task / n, which is never below it, so a spread that came out smaller (two seeds that happened to
    agree) is raised to it rather than read as certainty."""
    cells = sum(len(v) for v in by_world.values())
    if not cells:
        return Difference(math.nan, math.nan, math.nan, 0, 0, tasks, "not run")
    means = [statistics.fmean(v) for v in by_world.values()]
    mean = statistics.fmean(means)
    if any(len(v) < 2 for v in by_world.values()):
        return Difference(mean, math.nan, math.nan, cells, len(by_world), tasks, _undecided(tasks, by_world))
    w = len(by_world)
    floor = task_variance or {}
    # each world's share of Var(mean): its cells' variance (at least their tasks' own) over S, weighed 1/W²
    parts = [max(statistics.variance(v), floor.get(k, 0.0)) / len(v) / w**2 for k, v in by_world.items()]
    se = math.sqrt(sum(parts))
    df = _satterthwaite(parts, [len(v) for v in by_world.values()])
    half = stats.t.ppf(0.5 + CONFIDENCE / 2, df) * se if se > 0 else 0.0
    low, high = mean - half, mean + half
    verdict = "ahead" if low > 0 else "behind" if high < 0 else _undecided(tasks, by_world)
    return Difference(mean, low, high, cells, w, tasks, verdict)


def _satterthwaite(parts: list[float], sizes: list[int]) -> float:
    """Welch–Satterthwaite degrees of freedom of a sum of independent variance estimates."""
    total = sum(parts)
    denominator = sum(p * p / (n - 1) for p, n in zip(parts, sizes))
    return total * total / denominator if denominator > 0 else float(sum(n - 1 for n in sizes))


def _undecided(tasks: int, by_world: dict[str, list[float]]) -> str:
    seeds = ", ".join(f"{w} {len(v)}" for w, v in by_world.items())
    return f"cannot tell at n = {tasks}, S = {seeds}"


def final_values(runs: list[dict], split: str, mode: str) -> dict[tuple[str, int], float]:
    """(world, seed) -> the run's final success on `split`/`mode`."""
    return {
        (r.get("world"), r.get("seed")): r["final"][split][mode]["success_rate"] for r in runs if split in r["final"]
    }


def curve_values(runs: list[dict], mark: int, mode: str) -> dict[tuple[str, int], float]:
    """(world, seed) -> success on the curve's held-out tasks at the first point with ≥ `mark` rollouts; a run
    whose curve stops short of the mark has no value there."""
    out = {}
    for r in runs:
        points = [p for p in r["curve"] if p["rollouts"] >= mark]
        if points:
            out[(r.get("world"), r.get("seed"))] = min(points, key=lambda p: p["rollouts"])[f"{mode}_success"]
    return out


def task_variances(a: dict, b: dict, n: int) -> dict[str, float]:
    """Per world, the mean over its cells of the variance of one cell's difference from its n tasks alone:
    (p_a(1 − p_a) + p_b(1 − p_b)) / n, the unpaired form — an upper bound of the paired one, so the floor it sets is
    conservative."""
    per_world: dict[str, list[float]] = {}
    for key in sorted(set(a) & set(b)):
        per_world.setdefault(key[0], []).append((a[key] * (1 - a[key]) + b[key] * (1 - b[key])) / max(n, 1))
    return {w: statistics.fmean(v) for w, v in per_world.items()}


def _compare(a: dict, b: dict, n: int, paired: dict[str, float] | None = None) -> Difference:
    floor = task_variances(a, b, n)
    floor.update(paired or {})  # the paired variance where per-task outcomes give it, else the unpaired bound
    return two_level_interval(cell_differences(a, b), n, floor)


def paired_task_variances(a: list[dict], b: list[dict], split: str, mode: str) -> dict[str, float]:
    """Per world, the mean over cells of var(per-task a − b) / n, from the runs' per-task outcomes (the same
    tasks and sampling seeds in a cell); worlds where a cell lacks them are left out (task_variances' bound)."""
    from lopd_core.gate import paired_differences
    from lopd_core.outcomes import outcomes_path, read_outcomes

    def by_cell(runs):
        return {(r.get("world"), r.get("seed")): outcomes_path(r["eval"]) for r in runs if r.get("eval")}

    left, right, per_world = by_cell(a), by_cell(b), {}
    for key in sorted(set(left) & set(right)):
        if not (left[key].exists() and right[key].exists()):
            return {}
        frames = [read_outcomes(p) for p in (right[key], left[key])]
        frames = [f[(f["split"] == split) & (f["mode"] == mode)] for f in frames]
        d = paired_differences(frames[0], frames[1], "success_rate")["d"]
        if len(d) > 1:
            per_world.setdefault(key[0], []).append(float(d.var(ddof=1)) / len(d))
    return {w: statistics.fmean(v) for w, v in per_world.items()}


def compare_final(a: list[dict], b: list[dict], split: str, mode: str) -> Difference:
    tasks = min((r["final"][split][mode]["n"] for r in a + b if split in r["final"]), default=0)
    paired = paired_task_variances(a, b, split, mode)
    return _compare(final_values(a, split, mode), final_values(b, split, mode), tasks, paired)


def compare_at_mark(a: list[dict], b: list[dict], mark: int, mode: str, curve_n: int) -> Difference:
    return _compare(curve_values(a, mark, mode), curve_values(b, mark, mode), curve_n)


def rollouts_to_reach(runs: list[dict], target: float, mode: str) -> float | None:
    """The fewest rollouts at which the method's mean curve (over its cells, point by point) reaches `target`;
    None where it never does."""
    by_point: dict[int, list[tuple[int, float]]] = {}
    for r in runs:
        for i, p in enumerate(r["curve"]):
            by_point.setdefault(i, []).append((p["rollouts"], p[f"{mode}_success"]))
    for i in sorted(by_point):
        rollouts, values = zip(*by_point[i])
        if statistics.fmean(values) >= target - 1e-12:
            return statistics.fmean(rollouts)
    return None
