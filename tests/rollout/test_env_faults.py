"""What an environment hands the rollout engine is bounded and checked (issue #30 items 5-6): an observation is
cut to `rollout.max_observation_tokens` and marked as cut, no context outgrows `rollout.max_context`, a first
turn that cannot fit is one error naming the task, and a reward outside [0, 1] stops the run naming the
environment and the task."""

from types import SimpleNamespace

import pytest

from lopd_core.envs import make_tasks, registry
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

PLUGINS = {
    name: f"_faulty_envs:{cls}"
    for name, cls in [
        ("flood", "FloodEnv"),
        ("huge_observation", "HugeObservationEnv"),
        ("nan_reward", "NanRewardEnv"),
        ("huge_reward", "HugeRewardEnv"),
        ("long_prompt", "LongPromptEnv"),
    ]
}


@pytest.fixture(autouse=True)
def faulty_plugins():
    registry.use_config(SimpleNamespace(plugins=PLUGINS, task_files={}))
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))


def _play(model, tokenizer, env: str, **sampling):
    tasks = make_tasks(env, "train", 2, 0)
    settings = {"temperature": 1.0, "max_new_tokens": 8, "max_context": 256, **sampling}
    return rollout(
        model, make_chat(tokenizer), [RolloutRequest(t) for t in tasks], sampling=Sampling(**settings), seed=0
    )


@pytest.mark.parametrize("env", ["flood", "huge_observation"])
def test_observations_are_cut_marked_and_no_context_outgrows_the_limit(tiny_model, tiny_tokenizer, env):
    codec = make_chat(tiny_tokenizer)
    trajectories = _play(tiny_model, tiny_tokenizer, env, max_observation_tokens=48)
    for traj in trajectories:
        assert len(traj.token_ids) <= 256, (env, len(traj.token_ids))
        shown = [e["observation"] for e in traj.episode if e["observation"]]
        assert shown and all("[observation truncated: " in o for o in shown)  # the model is told, the bank too
        assert all(len(codec.encode(o)) <= 48 for o in shown)
        assert "observation truncated" in tiny_tokenizer.decode(traj.token_ids)


def test_a_short_observation_is_left_as_it_is(tiny_model, tiny_tokenizer):
    (traj, _) = _play(tiny_model, tiny_tokenizer, "flood", max_observation_tokens=4096, max_context=8192)
    assert all("truncated" not in e["observation"] for e in traj.episode)


def test_a_first_turn_that_cannot_fit_names_the_task(tiny_model, tiny_tokenizer):
    with pytest.raises(
        ValueError,
        match=r"task 'long_prompt/train/0/0' of env 'long_prompt': its first turn "
        r"is \d+ tokens.*rollout\.max_context",
    ) as caught:
        _play(tiny_model, tiny_tokenizer, "long_prompt")
    assert type(caught.value).__name__ == "EnvironmentFault"  # a StateError: the command line prints one line


@pytest.mark.parametrize("env, shown", [("nan_reward", "nan"), ("huge_reward", "1000000000.0")])
def test_a_reward_outside_0_1_stops_the_run_naming_env_and_task(tiny_model, tiny_tokenizer, env, shown):
    with pytest.raises(ValueError) as caught:
        _play(tiny_model, tiny_tokenizer, env, max_context=4096)
    message = str(caught.value)
    assert type(caught.value).__name__ == "EnvironmentFault"
    assert f"env {env!r} returned reward {shown}" in message and f"task '{env}/train/0/" in message
    assert "\n" not in message
