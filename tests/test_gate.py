"""The promotion gate (lopd_core/gate.py) on synthetic per-task outcomes, seeded: no model, a few seconds.

The outcome generator: each task has its own success probability (tasks of one template alike, templates apart),
and a policy's outcome on a task is a draw from it, independent between the two policies. That is harder on the
gate than identical weights evaluated greedily (whose outcomes agree task for task, so every difference is 0):
it is the null of a student no better than the champion that still changes its answer on many tasks.
"""

import numpy as np
import pandas as pd
import pytest

from lopd_core import gate as G
from lopd_core.outcomes import outcomes_frame


def _probabilities(rng, n: int, templates: int) -> tuple[np.ndarray, np.ndarray]:
    template = rng.integers(templates, size=n)
    level = rng.uniform(0.1, 0.7, size=templates)  # a template's difficulty
    return np.clip(level[template] + rng.normal(0, 0.1, size=n), 0.02, 0.98), template


def _play(rng, p, template, *, split="test_id", env="toolworld", batch=0, validate=False) -> pd.DataFrame:
    """One policy's outcomes on the tasks (validated against the outcome schema when `validate`: slow)."""
    success = rng.random(len(p)) < p
    frame = pd.DataFrame(
        {
            "env": env,
            "split": split,
            "mode": "greedy",
            "task_id": f"{env}/{split}/t{template[i]}/{batch:02d}{i:06d}",
            "template": f"t{template[i]}",
            "world": "cobalt",
            "success": bool(success[i]),
            "reward": 1.0 if success[i] else 0.5 * float(rng.random()),
            "turns": 2,
            "tokens": 30,
            "batch": batch,
        }
        for i in range(len(p))
    )
    return outcomes_frame(frame.to_dict("records")) if validate else frame


def _rule(**changes) -> G.GateRule:
    base = G.GateRule(test="paired", metric="success_rate", mode="greedy", splits=("test_id",), min_gain=0.0)
    return G.GateRule(**{**base.__dict__, **changes})


def _decisions(gain: float, n: int, seeds=range(40), templates: int = 40) -> list[G.GateDecision]:
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        p, template = _probabilities(rng, n, templates)
        champion = _play(rng, p, template)
        student = _play(rng, np.clip(p + gain, 0, 1), template)
        out.append(G.decide(champion, student, _rule(), seed=seed))
    return out


def test_a_student_with_the_champions_weights_is_rarely_promoted():
    """The champion's own weights played again with other sampling: most tasks keep their outcome, the rest are
    redrawn from the same probability."""
    promoted = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        p, template = _probabilities(rng, 100, 40)
        champion = _play(rng, p, template)
        redrawn = _play(rng, p, template)
        keep = rng.random(len(p)) < 0.7
        student = champion.copy()
        student.loc[~keep, ["success", "reward"]] = redrawn.loc[~keep, ["success", "reward"]]
        promoted += G.decide(champion, student, _rule(), seed=seed).promoted
    assert promoted <= 2  # at most 5 % of 40


def test_an_independent_redraw_is_rarely_promoted():
    """The harsher null: every outcome of the student redrawn independently (the stated one-sided rate is 2.5 %)."""
    decisions = _decisions(0.0, 100, seeds=range(200))
    assert sum(d.promoted for d in decisions) <= 10  # at most 5 % of 200
    assert all(d.reason.startswith("not promoted") or d.promoted for d in decisions)


def test_identical_outcomes_are_never_promoted_and_say_why():
    rng = np.random.default_rng(0)
    p, template = _probabilities(rng, 100, 40)
    same = _play(rng, p, template, validate=True)
    d = G.decide(same, same.copy(), _rule(), seed=0)
    assert not d.promoted
    assert (d.interval.low, d.interval.gain, d.interval.high) == (0.0, 0.0, 0.0)
    assert d.reason == "not promoted: +0.0 points [+0.0, +0.0], n = 100 cannot resolve a gain below ~0 points"


def test_a_real_gain_of_20_points_at_n_200_is_promoted():
    decisions = _decisions(0.20, 200)
    assert sum(d.promoted for d in decisions) >= 36  # at least 90 % of 40
    promoted = next(d for d in decisions if d.promoted)
    assert promoted.reason.startswith("promoted: +") and "n = 200" in promoted.reason


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
    assert point >= 12 and paired <= 4  # this null's paired rate is checked over 200 seeds above


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
    assert d.interval.low > 0  # the gain alone would promote
    assert not d.promoted
    assert d.reason.startswith("not promoted: guard toolworld pretrain_test success fell -")
    # the default bound (cycle.guard_max_fall: 10 points) still blocks a 30-point fall
    assert not G.decide(champion, student, _rule(guards=guards, guard_max_fall=0.1), seed=0).promoted
    # without the guard, the same outcomes promote
    assert G.decide(champion, student, _rule(), seed=0).promoted


def test_a_guard_with_no_outcomes_is_reported_unchecked_not_failed():
    rng = np.random.default_rng(1)
    p, template = _probabilities(rng, 100, 40)
    champion, student = _play(rng, p, template), _play(rng, np.clip(p + 0.4, 0, 1), template)
    d = G.decide(champion, student, _rule(guards=(G.Guard("x pretrain_test success", (("x", "pretrain_test"),)),)))
    assert d.promoted and d.guards[0].interval is None and not d.guards[0].failed


def test_few_templates_resample_within_templates():
    rng = np.random.default_rng(2)
    p, template = _probabilities(rng, 100, 8)
    champion, student = _play(rng, p, template), _play(rng, p, template)
    diffs = G.paired_differences(champion, student, "success_rate")
    assert G.paired_interval(diffs).resampling == "tasks resampled (8 templates: too few to cluster)"
    p, template = _probabilities(rng, 100, 40)
    diffs = G.paired_differences(_play(rng, p, template), _play(rng, p, template), "success_rate")
    assert G.paired_interval(diffs).resampling == "clustered by template"


def test_the_interval_is_the_mean_of_cells_and_is_seeded():
    rng = np.random.default_rng(4)
    p, template = _probabilities(rng, 60, 20)
    a = pd.concat([_play(rng, p, template), _play(rng, p, template, split="test_ood")])
    b = pd.concat([_play(rng, p, template), _play(rng, p, template, split="test_ood")])
    diffs = G.paired_differences(a, b, "reward_mean")
    by_cell = diffs.groupby("split")["d"].mean()
    interval = G.paired_interval(diffs, seed=7)
    assert interval.gain == pytest.approx(by_cell.mean())
    assert interval == G.paired_interval(diffs, seed=7)
    assert interval.low <= interval.gain <= interval.high


def test_resolvable_gain_before_the_evaluation():
    # 1.96 · 0.5 / √100 = 0.098: about 10 points at n = 100, 5 at n = 400
    assert G.resolvable_gain(100) == pytest.approx(0.098, abs=1e-3)
    assert G.resolvable_gain(400, min_gain=0.02) == pytest.approx(0.069, abs=1e-3)


def _sequential(gain: float, seed: int, looks: int, n: int = 50, level_of=None) -> G.GateDecision:
    rng = np.random.default_rng(seed)
    p, template = _probabilities(rng, n * looks, 40)

    def play(k):
        part = slice(k * n, (k + 1) * n)
        pk, tk = p[part], template[part]
        return _play(rng, pk, tk, batch=k), _play(rng, np.clip(pk + gain, 0, 1), tk, batch=k)

    rule = _rule() if level_of is None else _rule(level=level_of)
    return G.sequential_decide(play, rule, looks=looks, seed=seed)


def test_the_sequential_rule_keeps_its_false_promotion_rate():
    """The stated rate (lopd_core/gate.py): at most 1 − confidence = 5 % false promotions over every look
    together (Bonferroni over 4 looks). 200 seeded runs of a student no better than the champion, each outcome
    redrawn (the harsher null), at 50 fresh tasks a look."""
    runs = [_sequential(0.0, seed, looks=4) for seed in range(200)]
    assert sum(d.promoted for d in runs) <= 10
    assert any(d.looks > 1 for d in runs) and all(1 <= d.looks <= 4 for d in runs)
    assert all("of 4, each at 98.75 %" in d.reason for d in runs)


def test_the_sequential_rule_stops_early_on_a_clear_gain():
    runs = [_sequential(0.3, seed, looks=4) for seed in range(20)]
    assert sum(d.promoted for d in runs) >= 18
    assert sum(d.looks for d in runs) / len(runs) < 2.5  # most settle before the last look
