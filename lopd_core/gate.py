"""The promotion gate as a decision under noise: an exact paired test decides, a bootstrap interval is shown, and
guards hold what the student must not lose, against the champion and against the lineage's root.

Why paired: at n = 100 a success rate's 95 % interval is about ±8 points, so comparing the student's rate with the
champion's promotes noise about half the time a student is no better. Both are played on the same tasks with the
same sampling seeds (lopd_core/evaluation.py), so the gate works on the per-task differences d_i = student_i −
champion_i (lopd_core/outcomes.py), whose spread is much smaller wherever the two agree on a task.

The decision (`cycle.gate_test: paired`). The statistic T is the mean over the gate's cells (env × split) of each
cell's mean d, as the point rule averages cells. The student is promoted when a **one-sided sign-flip permutation
test** rejects H0: E[T] ≤ `cycle.min_gain` at α = (1 − `cycle.confidence`) / 2 = **2.5 %**, and no guard fails.
The test writes T as a sum of per-task terms t_i = (d_i − min_gain) / (C · n_cell) and takes as its null the 2^n
sign patterns s of independent fair signs: p = P(Σ s_i |t_i| ≥ Σ t_i). The p-value is exact where the terms take
few distinct sizes (binary outcomes: wins, losses and ties of each cell) by a convolution of binomials; at
min_gain = 0 the ties drop out and it is the exact sign test on the discordant tasks, i.e. **McNemar's exact test**.
Rewards (many sizes) use FLIPS sign patterns drawn from a fixed seed, p = (1 + #{≥ observed}) / (1 + FLIPS).
 - Why exact: the interval this gate used to decide with (a t-interval on the bootstrap's spread) was calibrated on
   average but promoted 5 wins and 0 losses in 400 tasks (+1.2 points [+0.1, +2.4]), where the exact test gives
   p = 2^-5 = 3.1 %: on few discordant tasks a normal tail is too thin.
 - Why one-sided at 2.5 %: the question is one-sided (is the student better?), and 2.5 % is the error the old
   two-sided 95 % interval's lower bound spent, so `cycle.confidence` keeps its meaning.
 - What it is exact for: at min_gain = 0, for any outcome, under the null of a student exchangeable with the champion
   on every task (the same policy played again: each d_i is symmetric) — false promotions at most 2.5 %. Shifted by
   a positive min_gain, a binary task's term is no longer symmetric, and the size at the boundary (true gain =
   min_gain) is 2.5 % only approximately; simulated, it stays at or below it (tests/test_gate.py).
 - Signs are flipped per task, not per template: the randomization is the task's, exact whatever tasks of a template
   share; it speaks for the split's tasks as drawn. The shown interval resamples templates and can be wider.

`cycle.min_gain` (default 0.02: 2 points) is the gain a student must show to be worth a new champion. The smallest
true gain promoted with power 1 − β is about min_gain + (z_{1−α} + z_{1−β}) · sd / √n (`detectable_gain`), sd the
per-task sd of d (0.5: a quarter of the tasks change outcome). At the default n = 2 gate splits × 200 tasks = 400:
0.02 + (1.96 + 1.28) · 0.5 / 20 = 0.10, a 10-point gain is promoted 90 % of the time (9 points: 80 %); at n = 200,
13.5 points 90 % (15 points: 96 %; simulated in tests/test_gate.py). Two points is about the size of a min gain the
default n carries at no real cost (a 2-point rise of the bar moves the 90 % gain from 8 to 10 points), and it turns
away what the gate has no use for: gains smaller than the evaluation's own drift, like the 5-of-400 student above
(+1.25 points), whatever the noise. A min gain much above that (8 points) would turn away most real students at
this n; to resolve a smaller one, raise eval.n_per_split (the gain's resolution falls as 1/√n).

Guards (`cycle.guards`): metrics that must not fall, e.g. pretrain_test success (forgetting). Forgetting is
cumulative (DESIGN §3: one cycle took pretrain_test 26 → 18 %, three 25 → 15 %, each inside a per-cycle bound), so
each guard compares the student, with the same exact test at the unadjusted α = 2.5 %, both
 - with the lineage's **root** (the first base, played on each look's tasks beside them): a non-inferiority test — the
   guard fails unless the test rejects H0: E[d_root] ≤ −`cycle.guard_budget`, i.e. unless the data show the
   student has lost less than the budget since the root. The burden is the student's: a student that forgets
   nothing passes with probability about Φ(budget · √n / sd − 1.96), 81 % at n = 200, sd 0.5, budget 0.10 (94 % at
   sd 0.4); a fall of 4 points a cycle is past a 10-point budget by the third cycle and blocked there;
 - with the **champion**: the guard fails when the test rejects H0: E[d] ≥ −`cycle.guard_max_fall`, i.e. when the
   data show a fall beyond the bound within one cycle (a sudden fall after cycles that gained on the guard).
With `gate_metric: reward_mean`, the guard `gate_success` (a default) holds success on the gate's own splits, which
a reward gain could otherwise hide. A guard whose outcomes are missing is reported unchecked, not failed.

Shown, not deciding: the gain's **bootstrap standard-error interval**, gain ± t_{G−1} · SE · √(G / (G−1)), SE the
spread of a seeded bootstrap stratified by cell, resampling whole templates (a clustered bootstrap) where the cell
has at least MIN_CLUSTERS of them and tasks otherwise (the few templates then count as fixed); G the resampled units.
It is two-sided at 1 − 2α of the look (95 % at one look), so its lower bound sits at the test's level.

Sequential looks (`eval.sequential`): a look that has not settled plays another batch of fresh tasks, up to
`eval.max_n` per split. The gain's test at each of the K = max_n // n_per_split possible looks is at α / K
(Bonferroni), so false promotions over all looks together stay within α. Bonferroni rather than Pocock or an
alpha-spending function: no boundary table, valid however the looks correlate (they share earlier batches). The
guards keep the unadjusted α at every look: a fall shown at any look blocks, and the root guard asks every look to
show non-inferiority afresh (a student may pass it at a later look on more tasks).

`point` keeps the earlier rule: student > champion + min_gain on the two means, no test and no guards.
Imports neither Prefect nor MLflow: the cycle (flows/cycle.py, flows/gate.py) builds the rule from params and calls
`decide` or `sequential_decide`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist

import numpy as np
import pandas as pd

from lopd_core.sign_flip import sign_flip_p

MIN_CLUSTERS = 10  # below this many templates in a cell, resample tasks within templates instead of templates
RESAMPLES = 2000
PLANNING_SD = 0.5  # per-task sd of the paired difference assumed before any outcome is seen (see detectable_gain)
KEYS = ["env", "split", "mode", "task_id"]
COLUMN = {"success_rate": "success", "reward_mean": "reward"}


@dataclass(frozen=True)
class Interval:
    """A paired difference (student − other) in the metric's own units, and its bootstrap standard-error interval
    (two-sided at `level`; shown, never deciding)."""

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
class PairedTest:
    """The one-sided sign-flip test of H1: T > `threshold` (`greater`) or T < `threshold` (`less`), T the mean
    over cells of the cell's mean paired difference."""

    threshold: float
    alternative: str  # greater | less
    p: float
    method: str  # exact | Monte-Carlo, with its sign patterns

    def text(self) -> str:
        side = ">" if self.alternative == "greater" else "<"
        return f"p = {self.p:.3g} for a change {side} {100 * self.threshold:+.1f} points ({self.method})"


@dataclass(frozen=True)
class Guard:
    """A metric that must not fall: `metric` of the cells (env, split) it names, under the gate's mode."""

    name: str
    cells: tuple[tuple[str, str], ...]
    metric: str = "success_rate"


@dataclass(frozen=True)
class GateRule:
    test: str  # paired | point
    metric: str  # success_rate | reward_mean
    mode: str
    splits: tuple[str, ...]
    min_gain: float
    guards: tuple[Guard, ...] = ()
    guard_max_fall: float = 0.1  # since the champion: a fall the data show beyond it fails the guard
    guard_budget: float = 0.1  # since the root: the guard fails unless the data show a smaller fall
    level: float = 0.95  # the tests are one-sided at (1 − level) / 2
    looks: int = 1  # the gain's α is shared among this many looks (Bonferroni); the guards' is not

    @property
    def alpha(self) -> float:
        """The one-sided level of the guards, and of the gain's test at one look."""
        return (1 - self.level) / 2

    @property
    def gain_alpha(self) -> float:
        return self.alpha / max(self.looks, 1)


@dataclass(frozen=True)
class Comparison:
    """A guard's change against one reference (champion or root): the shown interval and the deciding test."""

    interval: Interval
    test: PairedTest
    failed: bool


@dataclass(frozen=True)
class GuardResult:
    """A guard's values (the metric's mean over its cells: the lineage's curve) and its two comparisons; a
    comparison is None where its outcomes are missing (not checked)."""

    name: str
    student: float | None
    champion: float | None
    root: float | None
    vs_champion: Comparison | None
    vs_root: Comparison | None
    max_fall: float
    budget: float

    @property
    def failed(self) -> bool:
        return any(c is not None and c.failed for c in (self.vs_champion, self.vs_root))


@dataclass(frozen=True)
class GateDecision:
    promoted: bool
    test: str
    reason: str  # one sentence
    champion: float  # the gate's point estimates, as the point rule reads them
    student: float
    interval: Interval | None = None
    gain_test: PairedTest | None = None
    alpha: float | None = None  # the one-sided level the gain's test was held to at this look
    guards: list[GuardResult] = field(default_factory=list)
    looks: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Played:
    """The outcome frames (lopd_core/outcomes.py) of one batch of tasks: champion, student, and the lineage's root
    (None: not played, the root comparisons go unchecked; the champion's own frame while it is the root)."""

    champion: pd.DataFrame
    student: pd.DataFrame
    root: pd.DataFrame | None = None


def resolve_guards(specs, envs: list[str], splits, metric: str, gate_metric: str = "") -> tuple[Guard, ...]:
    """`cycle.guards` against the mix: a split name is one guard per env (`toolworld pretrain_test success`),
    `env:split` one guard, `per_env` each env on the gate's splits alone when the mix has several (the average
    over envs could rise while one of them falls), `gate_success` success on the gate's splits in each env when the
    gate's metric is the reward (a reward gain could hide a fall in success). A name resolved twice is kept once."""
    label = {"success_rate": "success", "reward_mean": "reward"}[metric]
    joined = "+".join(splits)
    out: dict[str, Guard] = {}
    for spec in specs:
        if spec == "per_env":
            several = envs if len(envs) > 1 else []
            found = [Guard(f"{e} {joined} {label}", tuple((e, s) for s in splits), metric) for e in several]
        elif spec == "gate_success":
            on_reward = gate_metric == "reward_mean"
            found = [Guard(f"{e} {joined} success", tuple((e, s) for s in splits)) for e in envs if on_reward]
        elif ":" in spec:
            env, split = spec.split(":", 1)
            found = [Guard(f"{env} {split} {label}", ((env, split),), metric)]
        else:
            found = [Guard(f"{env} {spec} {label}", ((env, spec),), metric) for env in envs]
        for guard in found:
            out.setdefault(guard.name, guard)
    return tuple(out.values())


def rule_from(cycle, envs: list[str], looks: int = 1) -> GateRule:
    """The rule of a `cycle` settings section (lopd_core/settings/run.py CycleConfig) for the mix `envs`."""
    return GateRule(
        test=cycle.gate_test,
        metric=cycle.gate_metric,
        mode=cycle.gate_mode,
        splits=tuple(cycle.gate_splits),
        min_gain=cycle.min_gain,
        guards=resolve_guards(cycle.guards, envs, cycle.gate_splits, cycle.guard_metric, cycle.gate_metric),
        guard_max_fall=cycle.guard_max_fall,
        guard_budget=cycle.guard_budget,
        level=cycle.confidence,
        looks=looks,
    )


def paired_differences(champion: pd.DataFrame, student: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per task both played (same env, split, mode, task id): env, split, mode, template, d = student −
    champion on `metric` (success_rate reads the success column, reward_mean the reward)."""
    column = COLUMN[metric]
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
    """The mean over cells (env, split) of each cell's mean difference, with its bootstrap standard-error interval,
    two-sided at `level` (stratified by cell; see the module docstring for the clustering). Shown, not deciding."""
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
    # freedom: not a percentile interval, whose tails (like the normal quantile's) are too thin at small n.
    half = t_quantile(1 - (1 - level) / 2, units - 1) * float(np.std(stat)) * math.sqrt(units / max(units - 1, 1))
    return Interval(gain, gain - half, gain + half, len(diffs), level, "; ".join(sorted(how)))


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (close to the exact value for
    df >= 5, the few-unit cases being slightly wider still; no scipy needed)."""
    z = NormalDist().inv_cdf(p)
    df = max(df, 1.0)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def cells_test(cells: list[np.ndarray], threshold: float, *, alternative: str = "greater", seed: int = 0) -> PairedTest:
    """The module docstring's exact one-sided test of H1: T > threshold (`greater`) or T < threshold (`less`), T
    the mean over `cells` of each cell's mean difference: each task's term weighs 1 / (C · n_cell)."""
    sign = {"greater": 1.0, "less": -1.0}[alternative]
    terms = np.concatenate([sign * (np.asarray(d, float) - threshold) / (len(d) * len(cells)) for d in cells])
    p, method = sign_flip_p(terms, seed=seed)
    return PairedTest(threshold, alternative, p, method)


def paired_test(diffs: pd.DataFrame, threshold: float, *, alternative: str = "greater", seed: int = 0) -> PairedTest:
    """`cells_test` on the differences of `paired_differences`, by cell (env, split)."""
    if diffs.empty:
        raise ValueError("no task was played by both policies: nothing to pair")
    cells = [d.to_numpy(float) for _, d in diffs.groupby(["env", "split"], sort=True)["d"]]
    return cells_test(cells, threshold, alternative=alternative, seed=seed)


def _cells(frame: pd.DataFrame, mode: str, cells) -> pd.DataFrame:
    keep = pd.Series(False, index=frame.index)
    for env, split in cells:
        keep |= (frame["env"] == env) & (frame["split"] == split)
    return frame[keep & (frame["mode"] == mode)]


def point_score(frame: pd.DataFrame, metric: str, mode: str, cells) -> float:
    """The point rule's number: the mean over cells of each cell's mean `metric`."""
    chosen = _cells(frame, mode, cells)
    return float(chosen.groupby(["env", "split"])[COLUMN[metric]].mean().mean()) if len(chosen) else math.nan


def gate_cells(frame: pd.DataFrame, splits) -> list[tuple[str, str]]:
    """The (env, split) cells of the gate's splits that `frame` holds."""
    present = frame[["env", "split"]].drop_duplicates()
    return sorted((e, s) for e, s in present.itertuples(index=False) if s in splits)


def detectable_gain(
    n_tasks: int, *, min_gain: float = 0.0, alpha: float = 0.025, power: float = 0.9, sd: float = PLANNING_SD
) -> float:
    """The true gain the one-sided test at `alpha` promotes with probability `power` at `n_tasks` paired tasks,
    by the normal approximation: min_gain + (z_{1−α} + z_{power}) · sd / √n (the module docstring's table)."""
    z = NormalDist().inv_cdf
    return min_gain + (z(1 - alpha) + z(power)) * sd / math.sqrt(max(n_tasks, 1))


def resolvable_gain(n_tasks: int, *, min_gain: float = 0.0, alpha: float = 0.025, sd: float = PLANNING_SD) -> float:
    """The smallest observed gain the test at `alpha` would promote with `n_tasks` paired tasks, before any outcome
    is seen: min_gain + z_{1−α}·sd/√n (a true gain this large is promoted half the time; `detectable_gain` for a
    given power). After the evaluation, the shown interval's half-width replaces the guess (`GateDecision.reason`)."""
    return detectable_gain(n_tasks, min_gain=min_gain, alpha=alpha, power=0.5, sd=sd)


def _compare(other: pd.DataFrame, student: pd.DataFrame, guard: Guard, rule: GateRule, *, seed: int, since_root: bool):
    """The guard's change student − `other` on its cells (None: no task in common): against the root a
    non-inferiority test (fails unless the data show a fall smaller than the budget), against the champion a test
    of a fall beyond the bound (fails when the data show one)."""
    diffs = paired_differences(
        _cells(other, rule.mode, guard.cells), _cells(student, rule.mode, guard.cells), guard.metric
    )
    if diffs.empty:
        return None
    interval = paired_interval(diffs, level=1 - 2 * rule.alpha, seed=seed)
    if since_root:
        test = paired_test(diffs, -rule.guard_budget, alternative="greater", seed=seed)
        return Comparison(interval, test, failed=test.p > rule.alpha)
    test = paired_test(diffs, -rule.guard_max_fall, alternative="less", seed=seed)
    return Comparison(interval, test, failed=test.p <= rule.alpha)


def _guard_value(frame: pd.DataFrame | None, guard: Guard, mode: str) -> float | None:
    """The guard's metric on its cells (a point of its lineage curve); None when not played."""
    value = math.nan if frame is None else point_score(frame, guard.metric, mode, guard.cells)
    return None if math.isnan(value) else value


def check_guards(played: Played, rule: GateRule, *, seed: int) -> list[GuardResult]:
    """Each guard against the champion and against the root, at the unadjusted α (the module docstring)."""
    out = []
    for guard in rule.guards:
        since_root = None
        if played.root is not None:
            since_root = _compare(played.root, played.student, guard, rule, seed=seed, since_root=True)
        out.append(
            GuardResult(
                guard.name,
                *(_guard_value(f, guard, rule.mode) for f in (played.student, played.champion, played.root)),
                vs_champion=_compare(played.champion, played.student, guard, rule, seed=seed, since_root=False),
                vs_root=since_root,
                max_fall=rule.guard_max_fall,
                budget=rule.guard_budget,
            )
        )
    return out


def _guard_reason(g: GuardResult, alpha: float) -> str:
    if g.vs_root is not None and g.vs_root.failed:
        c = g.vs_root
        return (
            f"guard {g.name} changed {c.interval.text()} since the root: a fall within its budget of "
            f"{100 * g.budget:.1f} points is not shown ({c.test.text()} > {alpha:g})"
        )
    c = g.vs_champion
    return (
        f"guard {g.name} fell {c.interval.text()} since the champion, beyond its bound of {100 * g.max_fall:.1f} "
        f"points ({c.test.text()} <= {alpha:g})"
    )


def decide(champion: pd.DataFrame, student: pd.DataFrame, rule: GateRule, *, root=None, seed: int = 0) -> GateDecision:
    """The gate's decision on the outcome frames (lopd_core/outcomes.py) of the same tasks: champion, student, and
    the lineage's root (None: the guards' root comparisons go unchecked)."""
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
            f"{rule.min_gain:g}, no test and no guards consulted"
        )
        return GateDecision(promoted, "point", reason, old, new)
    diffs = paired_differences(_cells(champion, rule.mode, cells), _cells(student, rule.mode, cells), rule.metric)
    alpha = rule.gain_alpha
    interval = paired_interval(diffs, level=1 - 2 * alpha, seed=seed)
    test = paired_test(diffs, rule.min_gain, seed=seed)
    guards = check_guards(Played(champion, student, root), rule, seed=seed)
    failed = [g for g in guards if g.failed]
    clears = test.p <= alpha
    if failed:
        reason = "not promoted: " + "; ".join(_guard_reason(g, rule.alpha) for g in failed)
    elif clears:
        reason = f"promoted: {interval.text()}; a gain above the min gain shown, {test.text()} <= {alpha:g}"
    else:
        floor = 100 * (rule.min_gain + interval.half_width)
        reason = (
            f"not promoted: {interval.text()}; a gain above the min gain of {100 * rule.min_gain:+.1f} points is not "
            f"shown, {test.text()} > {alpha:g} (this n resolves about {floor:.0f} points or more)"
        )
    return GateDecision(clears and not failed, "paired", reason, old, new, interval, test, alpha, guards)


def sequential_decide(play: Callable[[int], Played], rule: GateRule, *, looks: int, seed: int = 0) -> GateDecision:
    """Play batch 0, 1, … (`play(k)` -> the outcomes of batch k, fresh tasks each) and decide on all batches so
    far, the gain's test at α / looks (Bonferroni), stopping at the first look that settles it: promoted, a fall
    since the champion shown, or the shown interval's upper bound at or below min_gain (no further batch could
    promote without the test crossing a level the adjustment already pays for). With one look it is `decide`."""
    at = replace(rule, looks=looks)
    batches: list[Played] = []
    for k in range(looks):
        batches.append(play(k))
        roots = [b.root for b in batches]
        decision = decide(
            pd.concat([b.champion for b in batches]),
            pd.concat([b.student for b in batches]),
            at,
            root=None if any(r is None for r in roots) else pd.concat(roots),
            seed=seed + k,
        )
        fell = any(g.vs_champion is not None and g.vs_champion.failed for g in decision.guards)
        futile = decision.interval is not None and decision.interval.high <= rule.min_gain
        if decision.promoted or fell or futile or k == looks - 1 or rule.test == "point":
            reason = decision.reason + (
                f" (look {k + 1} of {looks}, the gain's test at {at.gain_alpha:.4g} each)" if looks > 1 else ""
            )
            return replace(decision, reason=reason, looks=k + 1)
    raise AssertionError("unreachable")
