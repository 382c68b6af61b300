"""The contract checker catches a broken environment; toolworld's episode record and malformed calls.

Every environment's run of the checker is one test in test_contract.py."""

from __future__ import annotations

import pytest
from _toolworld_fixtures import tasks

from lopd_core.envs import StepResult, ToolWorldEnv, check_env_contract, make_env, run_oracle
from lopd_core.envs.contract import MALFORMED_PROBES


def test_contract_detects_a_broken_env():
    class Leaky(ToolWorldEnv):
        def step(self, action):
            r = super().step(action)
            return StepResult(r.observation, 0.5, r.done, r.info)  # reward before done

    with pytest.raises(AssertionError, match="before done"):
        check_env_contract(Leaky, tasks("train")[:1])

    class Reusable(ToolWorldEnv):
        def reset(self, task):
            self._task = None
            return super().reset(task)

    with pytest.raises(AssertionError, match="second reset"):
        check_env_contract(Reusable, tasks("train")[:1])


def test_episode_record_and_step_info():
    task = tasks("train")[0]
    actions, results, env = run_oracle(task)
    assert len(env.episode) == len(actions)
    for entry, action, r in zip(env.episode, actions, results):
        assert entry["action"] == action and entry["observation"] == r.observation
    assert results[-1].info["stop_reason"] == "answer" and results[-1].observation == ""
    assert all(r.info["call"]["name"] and r.info["error"] is None for r in results[:-1])


def test_malformed_probes_are_error_observations():
    task = tasks("train")[3]
    for probe in MALFORMED_PROBES:
        env = make_env(task)
        env.reset(task)
        r = env.step(probe)
        assert not r.done and r.reward == 0.0
        assert r.observation.startswith('{"error": ') and r.info["error"]
