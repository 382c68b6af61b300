"""The promotion gate as a decision under noise: paired differences, a bootstrap interval, guards, looks.

Why: at n = 100 a success rate's 95 % interval is about ±8 points, so comparing the student's rate with the
champion's promotes noise about half the time a student is no better. Both are played on the same tasks with the
same sampling seeds (lopd_core/evaluation.py), so the gate works on the per-task differences d_i = student_i −
champion_i (lopd_core/outcomes.py), whose spread is much smaller wherever the two agree on a task.

The interval: a seeded bootstrap of the gate's statistic, the mean over its cells (env × split) of each
cell's mean d, as the point-estimate gate averages cells. Resampling is stratified by cell. Within a cell, tasks
that share a template are not independent draws, so the bootstrap resamples whole templates (a clustered
bootstrap) when the cell has at least MIN_CLUSTERS of them; with fewer, a clustered bootstrap is known to be too
narrow, and tasks are resampled one by one instead (as the split draws them; the few templates then count as
fixed, not sampled, and the interval speaks for them only). Which was used is part of the interval's description.

The rule (`cycle.gate_test: paired`): promote only when the interval's lower bound exceeds `cycle.min_gain` and
no guard fails. A guard (`cycle.guards`) is a metric that must not fall, e.g. pretrain_test success (forgetting):
it fails when its own paired interval lies wholly below −`cycle.guard_max_fall`, i.e. when the data show a fall
larger than the bound. It does not ask the data to prove no fall (non-inferiority in the strict sense), which at
the default n would block nearly every cycle. `point` keeps the earlier rule: student > champion + min_gain on the
two means, no interval and no guards.

Sequential looks (`eval.sequential`): a look that straddles the threshold plays another batch of fresh tasks, up
to `eval.max_n` per split. Each of the K = max_n // n_per_split possible looks uses a Bonferroni-adjusted level,
1 − (1 − level) / K. The stated false-promotion rate over all looks together is 1 − level (5 % by default): exact
intervals would keep it to half that (a one-sided error); the other half is kept for the bootstrap interval's
approximate coverage at small n (tests/test_gate.py simulates it). Bonferroni rather than Pocock or an
alpha-spending function: it needs no table or numerical boundary, holds whatever the correlation between looks
(they share earlier batches) and for a bootstrap rather than a normal interval, and at the few looks a CPU
budget allows it costs little width over Pocock's boundary.

Imports neither Prefect nor MLflow: the cycle (flows/cycle.py) builds the rule from params and calls `decide`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist

import numpy as np
import pandas as pd

MIN_CLUSTERS = 10  # below this many templates in a cell, resample tasks within templates instead of templates
RESAMPLES = 2000
PLANNING_SD = 0.5  # per-task sd of the paired difference assumed before any outcome is seen (see resolvable_gain)
KEYS = ["env", "split", "mode", "task_id"]


@dataclass(frozen=True)
class Interval:
    """A paired difference (student − champion) in the metric's own units, its interval and its sample."""

    gain: float
    low: float
    high: float
    n: int  # paired tasks
    level: float
    resampling: str  # how the bootstrap resampled: "clustered by template" etc.

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def text(self) -> str:
        return f"{100 * self.gain:+.1f} points [{100 * self.low:+.1f}, {100 * self.high:+.1f}], n = {self.n}"


@dataclass(frozen=True)
class Guard:
    """A metric that must not fall: `metric` of the cells (env, split) it names, under the gate's mode."""

    name: str
    cells: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class GateRule:
    test: str  # paired | point
    metric: str  # success_rate | reward_mean
    mode: str
    splits: tuple[str, ...]
    min_gain: float
    guards: tuple[Guard, ...] = ()
    guard_metric: str = "success_rate"
    guard_max_fall: float = 0.0
    level: float = 0.95


@dataclass(frozen=True)
class GuardResult:
    name: str
    interval: Interval | None  # None: no outcomes for its cells (not checked)
    max_fall: float

    @property
    def failed(self) -> bool:
        return self.interval is not None and self.interval.high < -self.max_fall


@dataclass(frozen=True)
class GateDecision:
    promoted: bool
    test: str
    reason: str  # one sentence
    champion: float  # the gate's point estimates, as the point rule reads them
    student: float
    interval: Interval | None = None
    guards: list[GuardResult] = field(default_factory=list)
    looks: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_guards(specs, envs: list[str], splits, metric: str) -> tuple[Guard, ...]:
    """`cycle.guards` against the mix: a split name is one guard per env (`toolworld pretrain_test success`),
    `env:split` one guard, `per_env` each env on the gate's splits alone when the mix has several (the average
    over envs could rise while one of them falls)."""
    label = {"success_rate": "success", "reward_mean": "reward"}[metric]
    out: list[Guard] = []
    for spec in specs:
        if spec == "per_env":
            if len(envs) > 1:
                out += [Guard(f"{env} {'+'.join(splits)} {label}", tuple((env, s) for s in splits)) for env in envs]
        elif ":" in spec:
            env, split = spec.split(":", 1)
            out.append(Guard(f"{env} {split} {label}", ((env, split),)))
        else:
            out += [Guard(f"{env} {spec} {label}", ((env, spec),)) for env in envs]
    return tuple(out)


def rule_from(cycle, envs: list[str]) -> GateRule:
    """The rule of a `cycle` settings section (lopd_core/settings/run.py CycleConfig) for the mix `envs`."""
    return GateRule(
        test=cycle.gate_test,
        metric=cycle.gate_metric,
        mode=cycle.gate_mode,
        splits=tuple(cycle.gate_splits),
        min_gain=cycle.min_gain,
        guards=resolve_guards(cycle.guards, envs, cycle.gate_splits, cycle.guard_metric),
        guard_metric=cycle.guard_metric,
        guard_max_fall=cycle.guard_max_fall,
        level=cycle.confidence,
    )


def paired_differences(champion: pd.DataFrame, student: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per task both played (same env, split, mode, task id): env, split, mode, template, d = student −
    champion on `metric` (success_rate reads the success column, reward_mean the reward)."""
    column = {"success_rate": "success", "reward_mean": "reward"}[metric]
    both = champion[[*KEYS, "template", column]].merge(
        student[[*KEYS, column]], on=KEYS, suffixes=("_champion", "_student"), validate="one_to_one"
    )
    d = both[f"{column}_student"].astype(float) - both[f"{column}_champion"].astype(float)
    return both[[*KEYS, "template"]].assign(d=d.to_numpy())


def _cell_resamples(d: np.ndarray, templates: np.ndarray, rng: np.random.Generator, size: int):
    """`size` bootstrap means of one cell's differences, how they were resampled, and how many units."""
    names, index = np.unique(templates, return_inverse=True)
    if len(names) >= MIN_CLUSTERS:
        sums, counts = np.bincount(index, weights=d), np.bincount(index)
        pick = rng.integers(len(names), size=(size, len(names)))  # (resamples, clusters)
        return sums[pick].sum(1) / counts[pick].sum(1), "clustered by template", len(names)
    means = d[rng.integers(len(d), size=(size, len(d)))].mean(1)  # (resamples,)
    return means, f"tasks resampled ({len(names)} templates: too few to cluster)", len(d)


def paired_interval(diffs: pd.DataFrame, *, level: float = 0.95, seed: int = 0, resamples: int = RESAMPLES) -> Interval:
    """The mean over cells (env, split) of each cell's mean difference, with its percentile bootstrap interval
    (stratified by cell; see the module docstring for the clustering)."""
    if diffs.empty:
        raise ValueError("no task was played by both policies: nothing to pair")
    rng = np.random.default_rng(seed)
    means, draws, how, units = [], [], set(), math.inf
    for _, cell in diffs.groupby(["env", "split"], sort=True):
        d = cell["d"].to_numpy(float)
        means.append(d.mean())
        resampled, text, count = _cell_resamples(d, cell["template"].to_numpy(str), rng, resamples)
        units = min(units, count)
        draws.append(resampled)
        how.add(text)
    stat = np.mean(draws, axis=0)
    gain = float(np.mean(means))
    # The bootstrap's spread, widened by √(G/(G−1)) for G resampled units (a resample of G units underestimates
    # the variance by that factor), around the observed gain with Student's t quantile on G − 1 degrees of
    # freedom: the percentile interval's tails, and the normal quantile's, are too thin at the small n and the
    # extreme levels a sequential gate uses.
    half = t_quantile(1 - (1 - level) / 2, units - 1) * float(np.std(stat)) * math.sqrt(units / max(units - 1, 1))
    return Interval(gain, gain - half, gain + half, len(diffs), level, "; ".join(sorted(how)))


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (close to the exact value for
    df >= 5, the few-unit cases being slightly wider still; no scipy needed)."""
    z = NormalDist().inv_cdf(p)
    df = max(df, 1.0)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _cells(frame: pd.DataFrame, mode: str, cells) -> pd.DataFrame:
    keep = pd.Series(False, index=frame.index)
    for env, split in cells:
        keep |= (frame["env"] == env) & (frame["split"] == split)
    return frame[keep & (frame["mode"] == mode)]


def point_score(frame: pd.DataFrame, metric: str, mode: str, cells) -> float:
    """The point rule's number: the mean over cells of each cell's mean `metric`."""
    column = {"success_rate": "success", "reward_mean": "reward"}[metric]
    chosen = _cells(frame, mode, cells)
    return float(chosen.groupby(["env", "split"])[column].mean().mean()) if len(chosen) else math.nan


def gate_cells(frame: pd.DataFrame, splits) -> list[tuple[str, str]]:
    """The (env, split) cells of the gate's splits that `frame` holds."""
    present = frame[["env", "split"]].drop_duplicates()
    return sorted((e, s) for e, s in present.itertuples(index=False) if s in splits)


def resolvable_gain(n_tasks: int, *, min_gain: float = 0.0, level: float = 0.95, sd: float = PLANNING_SD) -> float:
    """The smallest observed gain whose interval would clear `min_gain` with `n_tasks` paired tasks, before any
    outcome is seen: min_gain + z·sd/√n, with the per-task sd of the difference taken as `sd` (0.5: a quarter of
    the tasks change outcome between the two policies). After the evaluation, the interval's own half-width
    replaces the guess (`GateDecision.reason`)."""
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    return min_gain + z * sd / math.sqrt(max(n_tasks, 1))


def check_guards(champion: pd.DataFrame, student: pd.DataFrame, rule: GateRule, *, seed: int) -> list[GuardResult]:
    out = []
    for guard in rule.guards:
        diffs = paired_differences(
            _cells(champion, rule.mode, guard.cells), _cells(student, rule.mode, guard.cells), rule.guard_metric
        )
        interval = paired_interval(diffs, level=rule.level, seed=seed) if len(diffs) else None
        out.append(GuardResult(guard.name, interval, rule.guard_max_fall))
    return out


def decide(champion: pd.DataFrame, student: pd.DataFrame, rule: GateRule, *, seed: int = 0) -> GateDecision:
    """The gate's decision on two outcome frames (lopd_core/outcomes.py) of the same tasks."""
    cells = gate_cells(champion, rule.splits)
    if not cells:
        raise ValueError(
            f"the outcomes have none of the gate's splits {list(rule.splits)}: set eval.splits to include them"
        )
    old, new = point_score(champion, rule.metric, rule.mode, cells), point_score(student, rule.metric, rule.mode, cells)
    if rule.test == "point":
        promoted = new > old + rule.min_gain
        verdict = "promoted" if promoted else "not promoted"
        reason = (
            f"{verdict} by the point rule (cycle.gate_test: point): {rule.metric} {new:.4f} vs {old:.4f} + min gain "
            f"{rule.min_gain:g}, no interval and no guards consulted"
        )
        return GateDecision(promoted, "point", reason, old, new)
    diffs = paired_differences(_cells(champion, rule.mode, cells), _cells(student, rule.mode, cells), rule.metric)
    interval = paired_interval(diffs, level=rule.level, seed=seed)
    guards = check_guards(champion, student, rule, seed=seed)
    failed = [g for g in guards if g.failed]
    clears = interval.low > rule.min_gain
    if failed:
        reason = "not promoted: " + "; ".join(
            f"guard {g.name} fell {g.interval.text()}, beyond its bound of {100 * g.max_fall:.1f} points"
            for g in failed
        )
    elif clears:
        reason = f"promoted: {interval.text()}, lower bound above the min gain of {100 * rule.min_gain:+.1f} points"
    else:
        floor = 100 * (rule.min_gain + interval.half_width)
        reason = f"not promoted: {interval.text()} cannot resolve a gain below ~{floor:.0f} points"
    return GateDecision(clears and not failed, "paired", reason, old, new, interval, guards)


def look_level(level: float, looks: int) -> float:
    """The level of each of `looks` looks, Bonferroni-adjusted so that all of them together keep `level`."""
    return 1 - (1 - level) / max(looks, 1)


def sequential_decide(
    play: Callable[[int], tuple[pd.DataFrame, pd.DataFrame]], rule: GateRule, *, looks: int, seed: int = 0
) -> GateDecision:
    """Play batch 0, 1, … (`play(k)` -> champion and student outcomes of batch k, fresh tasks each) and decide
    on all batches so far at the Bonferroni level, stopping at the first look that settles it: promoted, a guard
    failed, or the upper bound at or below min_gain (no further batch could promote at this level without the
    lower bound crossing it, which the adjusted level already pays for). With one look it is `decide`."""
    at = replace(rule, level=look_level(rule.level, looks))
    champion, student = [], []
    for k in range(looks):
        c, s = play(k)
        champion.append(c)
        student.append(s)
        decision = decide(pd.concat(champion), pd.concat(student), at, seed=seed + k)
        settled = (
            decision.promoted
            or any(g.failed for g in decision.guards)
            or (decision.interval is not None and decision.interval.high <= rule.min_gain)
        )
        if settled or k == looks - 1 or rule.test == "point":
            reason = decision.reason + (
                f" (look {k + 1} of {looks}, each at {100 * at.level:.2f} %)" if looks > 1 else ""
            )
            return replace(decision, reason=reason, looks=k + 1)
    raise AssertionError("unreachable")
