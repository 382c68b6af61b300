"""The scripted oracle: solves everything with the true conventions, fails with wrong ones,
and always finishes a well-formed episode (wrong conventions, slips, errors included)."""

from __future__ import annotations

import collections
import random

from _toolworld_fixtures import all_tasks, tasks

from lopd_core.envs import TEMPLATES, WORLDS, make_env, oracle_actions, run_oracle
from lopd_core.envs.toolworld.oracle import GIVE_UP

# Pure look-ups whose tools no convention touches (documented; any new one must be deliberate).
CONVENTION_FREE = {"bank_balance_answer", "shop_total_answer", "msg_phone_answer"}


def test_oracle_solves_every_template_world_and_split():
    seen = collections.Counter()
    for task in all_tasks() + tasks("train", 1, 3):
        actions, results, env = run_oracle(task)
        info = results[-1].info
        assert info["success"] and results[-1].reward == 1.0, (
            task.task_id,
            actions,
            [r.observation for r in results],
        )
        assert info["stop_reason"] == "answer" and not env.internal_errors
        assert all(r.info["error"] is None for r in results[:-1]), task.task_id
        seen[(task.template, task.world)] += 1
    assert len(seen) == len(TEMPLATES) * len(WORLDS)


def test_oracle_needs_one_to_six_calls_and_max_turns_is_calls_plus_two():
    for task in all_tasks():
        actions, _, _ = run_oracle(task)
        n_calls = len(actions) - 1
        assert 1 <= n_calls <= 6, (task.template, task.world, n_calls)
        assert task.max_turns == n_calls + 2


def test_answer_tasks_end_with_the_expected_answer():
    for task in all_tasks():
        actions, _, _ = run_oracle(task)
        if task.spec["answer"] is None:
            assert actions[-1] == "done"
        else:
            assert any(c["op"].startswith("answer") for c in task.spec["checks"])


def test_wrong_conventions_fail():
    by_template = collections.defaultdict(list)
    for task in all_tasks():
        for other in WORLDS:
            if other == task.world:
                continue
            _, results, env = run_oracle(task, conventions=other)
            assert results[-1].done and not env.internal_errors
            by_template[task.template].append(results[-1].info["success"])
    sensitive = {name for name, ok in by_template.items() if not all(ok)}
    assert sensitive == set(TEMPLATES) - CONVENTION_FREE
    rate = sum(not s for v in by_template.values() for s in v) / sum(len(v) for v in by_template.values())
    assert rate > 0.75, rate


def test_wrong_convention_failure_is_silent_or_uninformative():
    convention_words = (
        "wire",
        "transfer",
        "cent",
        "unit",
        "verif",
        "confirm",
        "cart",
        "lock",
        "trash",
        "delete",
        "format",
        "iata",
        "city",
        "hold",
        "pay",
        "sms",
        "email",
        "slash",
    )
    for task in tasks("train")[::3]:
        for other in WORLDS:
            _, results, _ = run_oracle(task, conventions=other)
            for r in results:
                err = r.info.get("error") or ""
                assert not any(w in err for w in convention_words), (task.task_id, err)


def test_slips_still_finish_well_formed_episodes():
    failures = 0
    for i, task in enumerate(all_tasks()):
        rng = random.Random(i)
        actions, results, env = run_oracle(task, slip=0.6, rng=rng, conventions=rng.choice(list(WORLDS)))
        assert results[-1].done and len(results) <= task.max_turns and not env.internal_errors
        assert len(env.episode) == len(actions)
        failures += not results[-1].info["success"]
    assert failures > len(all_tasks()) // 4


def test_slip_is_plausible_and_typed():
    task = next(t for t in tasks("train") if t.template == "bank_pay_payee")
    policy = oracle_actions(task, slip=1.0, rng=random.Random(0))
    env = make_env(task)
    env.reset(task)
    results = []
    while True:
        r = env.step(policy.act(results))
        results.append(r)
        if r.done:
            break
    assert policy.slips >= 1
    assert all("bad type" not in (r.info.get("error") or "") for r in results)


def test_policy_gives_up_cleanly_when_stuck():
    task = next(t for t in tasks("train") if t.template == "calendar_cancel" and t.world == "aurora")
    env = make_env(task)
    env.reset(task)
    policy = oracle_actions(task, conventions="borealis")  # wrong date format -> lookup rejected
    results = [env.step(policy.act(None))]
    assert results[0].info["error"] == "rejected"
    final = env.step(policy.act(results))
    assert final.done and final.info["stop_reason"] == "answer" and not final.info["success"]
    assert env.episode[-1]["action"] == GIVE_UP
