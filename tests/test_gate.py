"""The promotion gate (lopd_core/gate.py) on synthetic per-task outcomes, seeded: no model, fast.

The outcome generator: each task has its own success probability (tasks of one template alike, templates apart),
and a policy's outcome on a task is a draw from it. Two couplings of student to champion: independent draws (the
harsh null: a student no better than the champion that still changes its answer on half the tasks it could), and
`keep` — the student keeps the champion's draw on a task with probability `keep` and draws afresh otherwise, from its
own probability (greedy outcomes of a student distilled from the champion agree on most tasks). The rates that
need many decisions (1,000 at a time) are counted by `cells_test`, the function `decide` calls on the same
differences (tested equal below), without the frames' overhead.
"""

import itertools

import numpy as np
import pandas as pd
import pytest

from lopd_core import gate as G
from lopd_core import sign_flip
from lopd_core.outcomes import outcomes_frame
from lopd_core.settings.run import CycleConfig

DEFAULT_MIN_GAIN = CycleConfig().min_gain
ALPHA = 0.025  # the default one-sided level: (1 − cycle.confidence) / 2


def _probabilities(rng, n: int, templates: int) -> tuple[np.ndarray, np.ndarray]:
    template = rng.integers(templates, size=n)
    level = rng.uniform(0.1, 0.7, size=templates)  # a template's difficulty
    return np.clip(level[template] + rng.normal(0, 0.1, size=n), 0.02, 0.98), template


def _frame(success, template, *, split="test_id", env="toolworld", batch=0, reward=None) -> pd.DataFrame:
    n = len(success)
    reward = np.where(success, 1.0, 0.3) if reward is None else reward
    return pd.DataFrame(
        {
            "env": env,
            "split": split,
            "mode": "greedy",
            "task_id": [f"{env}/{split}/t{template[i]}/{batch:02d}{i:06d}" for i in range(n)],
            "template": [f"t{t}" for t in template],
            "world": "cobalt",
            "success": np.asarray(success, bool),
            "reward": np.asarray(reward, float),
            "turns": 2,
            "tokens": 30,
            "batch": batch,
        }
    )


def _play(rng, p, template, *, split="test_id", env="toolworld", batch=0, validate=False) -> pd.DataFrame:
    """One policy's outcomes on the tasks, drawn independently (validated against the outcome schema when
    `validate`: slow)."""
    success = rng.random(len(p)) < p
    reward = np.where(success, 1.0, 0.5 * rng.random(len(p)))
    frame = _frame(success, template, split=split, env=env, batch=batch, reward=reward)
    return outcomes_frame(frame.to_dict("records")) if validate else frame


def _rule(**changes) -> G.GateRule:
    base = G.GateRule(test="paired", metric="success_rate", mode="greedy", splits=("test_id",), min_gain=0.0)
    return G.GateRule(**{**base.__dict__, **changes})


def _pair(seed: int, gain: float, n: int, *, keep: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Champion and student successes on n tasks (the student `gain` better in probability), and the templates."""
    rng = np.random.default_rng(seed)
    p, template = _probabilities(rng, n, 40)
    u = rng.random(n)
    v = np.where(rng.random(n) < keep, u, rng.random(n))
    return u < p, v < np.clip(p + gain, 0, 1), template


def _promotes(champion, student, min_gain: float) -> bool:
    d = student.astype(float) - champion.astype(float)
    return G.cells_test([d], min_gain).p <= ALPHA


# ---- the exact test -------------------------------------------------------------------------------------------
def test_the_exact_p_value_is_the_enumerated_sign_flip_distribution():
    """Against all 2^12 sign patterns, for binary differences shifted by a min gain (three sizes: win, tie, loss),
    and the Monte-Carlo path within its error of the exact value."""
    rng = np.random.default_rng(0)
    for _ in range(4):
        terms = rng.choice([-1.0, 0.0, 1.0], size=12, p=[0.2, 0.4, 0.4]) - 0.05
        patterns = np.array(list(itertools.product([-1.0, 1.0], repeat=12)))  # (4096, 12)
        enumerated = np.mean(patterns @ np.abs(terms) >= terms.sum() - 1e-12)
        p, method = sign_flip.sign_flip_p(terms)
        assert p == pytest.approx(enumerated, abs=1e-12) and method.startswith("exact")
        drawn, how = sign_flip.sign_flip_p(terms, exact_patterns=0)
        assert how.startswith("Monte-Carlo") and drawn == pytest.approx(enumerated, abs=0.015)  # 3 sd at 10,000


def test_five_wins_and_no_loss_in_400_is_not_promoted():
    """The review's case: +1.25 points whose old interval cleared zero. The exact test: the 5 discordant tasks all
    favour the student, p = 2^-5 = 0.03125 > 0.025 (McNemar's exact test); 6 of 6 would give 2^-6 = 0.0156."""
    champion = np.zeros(400, bool)
    student = champion.copy()
    student[:5] = True
    template = np.arange(400) % 40
    for min_gain in (0.0, DEFAULT_MIN_GAIN):
        d = G.decide(_frame(champion, template), _frame(student, template), _rule(min_gain=min_gain))
        assert not d.promoted and d.reason.startswith("not promoted: +1.2 points")
    d = G.decide(_frame(champion, template), _frame(student, template), _rule())
    assert d.gain_test.p == pytest.approx(2**-5) and d.gain_test.method == "exact over 5 differing tasks"
    assert d.interval.low > 0  # the shown interval alone would have promoted it
    student[5] = True
    assert G.decide(_frame(champion, template), _frame(student, template), _rule()).gain_test.p == pytest.approx(2**-6)


def test_decide_and_cells_test_agree():
    """The rates below count with `cells_test`; `decide` reaches the same p-value on the same outcomes."""
    for seed in range(3):
        champion, student, template = _pair(seed, 0.05, 200, keep=0.5)
        d = G.decide(_frame(champion, template), _frame(student, template), _rule(min_gain=DEFAULT_MIN_GAIN))
        direct = G.cells_test([student.astype(float) - champion], DEFAULT_MIN_GAIN)
        assert d.gain_test.p == pytest.approx(direct.p, rel=1e-12)
        assert d.promoted == (direct.p <= ALPHA)


# ---- the done-when rates of issue #46 ---------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0.0, 0.7])
def test_a_student_equal_to_the_champion_is_promoted_at_most_2_5_percent_of_1000(keep):
    """1,000 seeded decisions at n = 200 of a student with the champion's own success probabilities: at a zero min
    gain (the test's own size: at most 2.5 %; the binomial sd of a count at 2.5 % in 1,000 is 4.9) and at the
    default min gain (a fraction of that)."""
    at_zero = at_default = 0
    for seed in range(1000):
        champion, student, _ = _pair(seed, 0.0, 200, keep=keep)
        at_zero += _promotes(champion, student, 0.0)
        at_default += _promotes(champion, student, DEFAULT_MIN_GAIN)
    assert at_zero <= 25 + 2 * 5
    assert at_default <= 5


def test_at_the_min_gain_itself_the_shifted_test_keeps_its_level():
    """Shifted by a positive min gain, a binary task's term is not symmetric: the test's size at the boundary
    (true gain = min gain) is checked, not assumed. 1,000 seeded decisions at n = 200."""
    promoted = sum(
        _promotes(*_pair(seed, DEFAULT_MIN_GAIN, 200, keep=0.7)[:2], DEFAULT_MIN_GAIN) for seed in range(1000)
    )
    assert promoted <= 25 + 2 * 5


def test_a_real_gain_of_15_points_at_n_200_is_promoted_90_percent():
    """At the default min gain, 500 seeded students truly 15 points better on 200 tasks, keeping the champion's
    draw on 70 % of the tasks (independent draws, sd of a task's difference 0.66 instead of 0.5, give about 80 %)."""
    promoted = sum(_promotes(*_pair(seed, 0.15, 200, keep=0.7)[:2], DEFAULT_MIN_GAIN) for seed in range(500))
    assert promoted >= 450
    champion, student, template = _pair(0, 0.15, 200, keep=0.7)
    d = G.decide(_frame(champion, template), _frame(student, template), _rule(min_gain=DEFAULT_MIN_GAIN))
    assert d.promoted and d.reason.startswith("promoted: +") and "n = 200" in d.reason


def _lineage(seed: int, fall: float, *, cycles: int = 3, with_root: bool = True) -> list[bool]:
    """Cycles of a lineage whose every student gains 20 points on the gate's split and loses `fall` on
    pretrain_test against its champion; the champion's outcomes are the promoted student's (the same tasks every
    cycle). The decisions, until the first that does not promote."""
    rng = np.random.default_rng(seed)
    p, tp = _probabilities(rng, 200, 40)  # test_id
    q, tq = _probabilities(rng, 200, 40)  # pretrain_test
    u, w = rng.random(200), rng.random(200)
    root = pd.concat([_frame(u < p, tp), _frame(w < q, tq, split="pretrain_test")])
    champion, decisions = root, []
    guards = G.resolve_guards(["pretrain_test"], ["toolworld"], ("test_id",), "success_rate")
    for cycle in range(1, cycles + 1):
        u = np.where(rng.random(200) < 0.7, u, rng.random(200))
        w = np.where(rng.random(200) < 0.7, w, rng.random(200))
        student = pd.concat([_frame(u < p + 0.2 * cycle, tp), _frame(w < q - fall * cycle, tq, split="pretrain_test")])
        d = G.decide(champion, student, _rule(guards=guards), root=root if with_root else None, seed=seed)
        decisions.append(d)
        if not d.promoted:
            break
        champion = student
    return decisions


def test_a_fall_of_4_points_a_cycle_is_blocked_by_the_third_cycle():
    """12 points since the root by the third cycle, past the 10-point budget: every lineage is blocked by then, by
    its guard since the root, which says so. The guard since the champion alone (no root) lets most through."""
    for seed in range(10):
        decisions = _lineage(seed, 0.04)
        assert not decisions[-1].promoted, seed
        assert "since the root" in decisions[-1].reason
    unguarded = [all(d.promoted for d in _lineage(seed, 0.04, with_root=False)) for seed in range(10)]
    assert sum(unguarded) >= 8


def test_a_lineage_that_forgets_nothing_is_rarely_blocked():
    """The price of the non-inferiority guard: a student that loses nothing must still show it has lost less than
    the budget. Here (correlated outcomes, n = 200) it passes three cycles in a row in most lineages."""
    kept = [all(d.promoted for d in _lineage(seed, 0.0)) for seed in range(10)]
    assert sum(kept) >= 8


# ---- guards ----------------------------------------------------------------------------------------------------
def test_a_forgetting_student_is_blocked_by_its_guard_which_is_named():
    rng = np.random.default_rng(3)
    p, template = _probabilities(rng, 200, 40)
    q, qt = _probabilities(rng, 200, 40)
    champion = pd.concat([_play(rng, p, template), _play(rng, q, qt, split="pretrain_test")])
    student = pd.concat(
        [_play(rng, np.clip(p + 0.3, 0, 1), template), _play(rng, np.clip(q - 0.3, 0, 1), qt, split="pretrain_test")]
    )
    guards = G.resolve_guards(["pretrain_test", "per_env"], ["toolworld"], ("test_id",), "success_rate")
    assert [g.name for g in guards] == ["toolworld pretrain_test success"]  # per_env: one env, nothing to add
    d = G.decide(champion, student, _rule(guards=guards), seed=0)
    assert d.gain_test.p <= ALPHA  # the gain alone would promote
    assert not d.promoted
    assert d.reason.startswith("not promoted: guard toolworld pretrain_test success fell -")
    assert "since the champion, beyond its bound of 10.0 points" in d.reason
    assert d.guards[0].vs_root is None  # no root given: that comparison is not checked
    assert G.decide(champion, student, _rule(), seed=0).promoted  # without the guard, the same outcomes promote


def test_with_the_reward_gate_success_on_the_gate_splits_is_guarded():
    """A student whose reward rises while its success falls: the reward gate alone would promote it."""
    guards = G.resolve_guards(["gate_success"], ["toolworld"], ("test_id", "test_ood"), "success_rate", "reward_mean")
    assert [(g.name, g.metric) for g in guards] == [("toolworld test_id+test_ood success", "success_rate")]
    assert G.resolve_guards(["gate_success"], ["toolworld"], ("test_id",), "success_rate", "success_rate") == ()
    two = G.resolve_guards(["per_env", "gate_success"], ["a", "b"], ("test_id",), "success_rate", "reward_mean")
    assert [g.name for g in two] == ["a test_id success", "b test_id success"]  # the same guard is kept once
    rng = np.random.default_rng(5)
    p, template = _probabilities(rng, 200, 40)
    u = rng.random(200)
    champion = _frame(u < p, template, reward=np.where(u < p, 1.0, 0.2))
    falls = u < p - 0.2
    student = _frame(falls, template, reward=np.where(falls, 1.0, 0.9))
    rule = _rule(metric="reward_mean", guards=guards)
    assert G.decide(champion, student, _rule(metric="reward_mean"), seed=0).promoted
    d = G.decide(champion, student, rule, root=champion, seed=0)
    assert not d.promoted and "guard toolworld test_id+test_ood success" in d.reason


def test_a_guard_with_no_outcomes_is_reported_unchecked_not_failed():
    rng = np.random.default_rng(1)
    p, template = _probabilities(rng, 100, 40)
    champion, student = _play(rng, p, template), _play(rng, np.clip(p + 0.4, 0, 1), template)
    guard = G.Guard("x pretrain_test success", (("x", "pretrain_test"),))
    d = G.decide(champion, student, _rule(guards=(guard,)), root=champion)
    g = d.guards[0]
    assert d.promoted and g.vs_champion is None and g.vs_root is None and not g.failed and g.student is None


# ---- the shown interval, the point rule, what n resolves ------------------------------------------------------
def test_identical_outcomes_are_never_promoted_and_say_why():
    rng = np.random.default_rng(0)
    p, template = _probabilities(rng, 100, 40)
    same = _play(rng, p, template, validate=True)
    d = G.decide(same, same.copy(), _rule(), seed=0)
    assert not d.promoted
    assert (d.interval.low, d.interval.gain, d.interval.high) == (0.0, 0.0, 0.0)
    assert d.gain_test.p == 1.0
    assert d.reason == (
        "not promoted: +0.0 points [+0.0, +0.0], n = 100; a gain above the min gain of +0.0 points is not shown, "
        "p = 1 for a change > +0.0 points (exact: no task differs) > 0.025 (this n resolves about 0 points or "
        "more)"
    )


def test_the_point_rule_promotes_noise_the_paired_rule_does_not():
    """Why the gate changed: on a student no better than the champion, the point rule promotes whenever the
    noise favours the student (about half the time)."""
    point, paired = 0, 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        p, template = _probabilities(rng, 100, 40)
        champion, student = _play(rng, p, template), _play(rng, p, template)
        point += G.decide(champion, student, _rule(test="point")).promoted
        paired += G.decide(champion, student, _rule(), seed=seed).promoted
    assert point >= 12 and paired <= 4  # 4 of these 40 (p = 0.003-0.014); the rate is counted over 1,000 above


def test_few_templates_resample_within_templates():
    rng = np.random.default_rng(2)
    p, template = _probabilities(rng, 100, 8)
    champion, student = _play(rng, p, template), _play(rng, p, template)
    diffs = G.paired_differences(champion, student, "success_rate")
    assert G.paired_interval(diffs).resampling == "tasks resampled (8 templates: too few to cluster)"
    p, template = _probabilities(rng, 100, 40)
    diffs = G.paired_differences(_play(rng, p, template), _play(rng, p, template), "success_rate")
    assert G.paired_interval(diffs).resampling == "clustered by template"


def test_the_interval_and_the_test_are_the_mean_of_cells_and_are_seeded():
    rng = np.random.default_rng(4)
    p, template = _probabilities(rng, 60, 20)
    q, qt = _probabilities(rng, 30, 20)
    a = pd.concat([_play(rng, p, template), _play(rng, q, qt, split="test_ood")])
    b = pd.concat([_play(rng, p, template), _play(rng, q, qt, split="test_ood")])
    diffs = G.paired_differences(a, b, "reward_mean")
    by_cell = diffs.groupby("split")["d"].mean()
    interval = G.paired_interval(diffs, seed=7)
    assert interval.gain == pytest.approx(by_cell.mean())
    assert interval == G.paired_interval(diffs, seed=7)
    assert interval.low <= interval.gain <= interval.high
    test = G.paired_test(diffs, 0.0, seed=7)  # rewards: Monte-Carlo, reproducible from its seed
    assert test.method == "Monte-Carlo, 10000 sign patterns, seed 7" and test == G.paired_test(diffs, 0.0, seed=7)


def test_what_the_default_n_resolves():
    """The module docstring's power table: min_gain + (z_{1−α} + z_{power}) · 0.5 / √n."""
    # (1.96 + 1.28) · 0.5 / 20 = 0.081: a 10-point gain promoted 90 % of the time at the default n = 400
    assert G.detectable_gain(400, min_gain=0.02) == pytest.approx(0.101, abs=1e-3)
    assert G.detectable_gain(400, min_gain=0.02, power=0.8) == pytest.approx(0.090, abs=1e-3)  # (1.96 + 0.84)/40
    assert G.detectable_gain(200, min_gain=0.02) == pytest.approx(0.135, abs=1e-3)  # 15 points: above 90 %
    # 1.96 · 0.5 / √100 = 0.098: the observed gain that clears, about 10 points at n = 100, 5 (+ min gain) at 400
    assert G.resolvable_gain(100) == pytest.approx(0.098, abs=1e-3)
    assert G.resolvable_gain(400, min_gain=0.02) == pytest.approx(0.069, abs=1e-3)


# ---- sequential looks ------------------------------------------------------------------------------------------
def _sequential(gain: float, seed: int, looks: int, n: int = 50) -> G.GateDecision:
    rng = np.random.default_rng(seed)
    p, template = _probabilities(rng, n * looks, 40)

    def play(k):
        part = slice(k * n, (k + 1) * n)
        pk, tk = p[part], template[part]
        return G.Played(_play(rng, pk, tk, batch=k), _play(rng, np.clip(pk + gain, 0, 1), tk, batch=k))

    return G.sequential_decide(play, _rule(), looks=looks, seed=seed)


def test_the_sequential_rule_keeps_its_false_promotion_rate():
    """At most α = 2.5 % false promotions over every look together (the gain's test at α / 4 at each of 4
    looks). 200 seeded runs of a student no better than the champion, each outcome redrawn, 50 fresh tasks a
    look, at a zero min gain."""
    runs = [_sequential(0.0, seed, looks=4) for seed in range(200)]
    assert sum(d.promoted for d in runs) <= 5 + 2 * 2  # 2.5 % of 200, and two binomial sd
    assert any(d.looks > 1 for d in runs) and all(1 <= d.looks <= 4 for d in runs)
    assert all("of 4, the gain's test at 0.00625 each" in d.reason for d in runs)


def test_the_sequential_rule_stops_early_on_a_clear_gain():
    runs = [_sequential(0.3, seed, looks=4) for seed in range(20)]
    assert sum(d.promoted for d in runs) >= 18
    assert sum(d.looks for d in runs) / len(runs) < 2.5  # most settle before the last look
