"""codegen: the oracle solving every family at every level, splits, feedback, reward (its contract:
test_contract.py)."""

from __future__ import annotations

import json

import pytest

from lopd_core.envs import ENVS, Task, make_env, make_tasks
from lopd_core.envs.codegen import FAMILIES, CodegenEnv, families_for, run_codegen_oracle


def test_families_cover_the_topics_and_hold_some_out():
    assert len(FAMILIES) >= 25
    assert {f.topic for f in FAMILIES.values()} == {
        "arithmetic",
        "conditionals",
        "loops",
        "strings",
        "dicts",
        "lists",
        "algorithms",
    }
    train, ood = families_for("train"), families_for("test_ood")
    assert len(ood) >= 5 and not {f.name for f in train} & {f.name for f in ood}
    assert ENVS["codegen"] is CodegenEnv


def _assert_oracle_solves(tasks):
    for task in tasks:
        actions, results, _ = run_codegen_oracle(task)
        assert results[-1].info["success"] and results[-1].reward == 1.0, (task.task_id, results[-1].observation)
        assert len(actions) == 1 and results[-1].info["stop_reason"] == "answer"


def test_oracle_passes_every_family():
    tasks = make_tasks("codegen", "train", len(families_for("train")), 1) + make_tasks("codegen", "test_ood", 7, 1)
    assert {t.template for t in tasks} == set(FAMILIES)
    _assert_oracle_solves(tasks)


@pytest.mark.slow
def test_oracle_passes_every_family_at_every_level():
    n_train = 3 * len(families_for("train"))  # every train family at levels 1, 2, 3
    tasks = make_tasks("codegen", "train", n_train, 2) + make_tasks("codegen", "test_ood", 3 * 7, 2)
    assert {(t.template, t.world) for t in tasks} == {(f, f"level{lv}") for f in FAMILIES for lv in (1, 2, 3)}
    _assert_oracle_solves(tasks)


def test_splits_are_deterministic_disjoint_and_json_exact():
    train = make_tasks("codegen", "train", 96, 0)
    test_id = make_tasks("codegen", "test_id", 32, 0)
    ood = make_tasks("codegen", "test_ood", 14, 0)
    assert [t.to_json() for t in train[:10]] == [t.to_json() for t in make_tasks("codegen", "train", 10, 0)]

    def content(tasks):
        return {json.dumps([t.template, t.spec["tests"]]) for t in tasks}

    assert not content(train) & content(test_id)
    assert {t.template for t in ood} == {f.name for f in families_for("test_ood")}
    assert all(Task.from_json(t.to_json()) == t for t in train + test_id + ood)
    levels = {t.spec["level"]: len(t.spec["tests"]) for t in train}
    assert levels == {1: 5, 2: 7, 3: 9}  # more tests, with edge cases, at higher levels


def test_feedback_names_the_first_failing_test_and_reward_is_the_fraction_passed():
    task = next(t for t in make_tasks("codegen", "train", 40, 0) if t.template == "sum_evens")
    env = make_env(task)
    env.reset(task)
    first = env.step("def sum_evens(xs):\n    return sum(xs)\n")
    assert not first.done and "first failure: sum_evens(" in first.observation and "expected" in first.observation
    second = env.step("```python\ndef sum_evens(xs):\n    return 1 / 0\n```")
    assert not second.done and "raised ZeroDivisionError" in second.observation
    last = env.step("def sum_evens(xs):\n    return sum(xs)\n")
    assert last.done and last.info["stop_reason"] == "turn_limit"
    assert last.reward == pytest.approx(last.info["checks_passed"] / last.info["checks_total"])
    assert 0 <= last.reward < 1 and not last.info["success"]


def test_syntax_errors_timeouts_and_empty_answers():
    task = make_tasks("codegen", "train", 1, 0)[0]
    env = CodegenEnv()
    env.reset(task)
    r = env.step("def broken(:")
    assert not r.done and "SyntaxError" in r.observation
    r = env.step(f"def {task.spec['function']}(*a):\n    while True:\n        pass\n")
    assert not r.done and "did not finish in time" in r.observation
    env = CodegenEnv()
    env.reset(task)
    r = env.step("   ")
    assert r.done and r.reward == 0.0 and r.info["stop_reason"] == "answer"
