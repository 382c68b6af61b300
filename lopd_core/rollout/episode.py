"""One trajectory's side of a rollout, whoever generates its turns: the environment is reset into the first
turn's ids, each sampled turn is appended as an action and handed to the environment, and the observation comes
back as forced ids. The in-process engine (engine.py) and rollouts over an inference server (served.py) both
play episodes through these functions, so the trajectory contract is the same for both.
"""

from __future__ import annotations

from lopd_core.envs import make_env
from lopd_core.envs.base import checked_result
from lopd_core.errors import EnvironmentFault
from lopd_core.model.chat import TrajectoryIds
from lopd_core.rollout.observation import _bounded_episode, bounded_observation
from lopd_core.rollout.trajectory import RolloutRequest, Sampling, Trajectory


def start_episode(codec, req: RolloutRequest):
    """The request's environment, reset, and its trajectory holding the first turn's forced ids."""
    env = make_env(req.task)
    first = env.reset(req.task)
    ids: TrajectoryIds = codec.start(
        first.system, first.user, list(req.experiences) or None, tools=list(first.tools) or None
    )
    traj = Trajectory(
        req.task,
        req.sample_index,
        req.experiences,
        ids.token_ids,
        ids.action_mask,
        ids.sample_logprobs,
        prompt_length=len(ids),
    )
    return env, traj


def finish(traj: Trajectory, env, result, stop_reason: str | None = None, codec=None, cap: int = 0) -> None:
    traj.reward = float(result.reward)
    traj.success = bool(result.info.get("success", False))
    traj.stop_reason = stop_reason or result.info.get("stop_reason", "")
    traj.episode = list(env.episode) if codec is None else _bounded_episode(list(env.episode), codec, cap)


def check_first_turn(traj: Trajectory, extra: int, sampling: Sampling) -> None:
    """A first turn too long to leave room for one assistant turn within `max_context` cannot be played: the
    error names the task (its system text, instruction or experiences are too long for the setting)."""
    length = len(traj.token_ids) + extra
    if length + sampling.max_new_tokens > sampling.max_context:
        latents = f" and {extra} spliced positions" if extra else ""
        raise EnvironmentFault(
            f"task {traj.task.task_id!r} of env {traj.task.env!r}: its first turn is {len(traj.token_ids)} tokens"
            f"{latents}, which with rollout.max_new_tokens={sampling.max_new_tokens} exceeds the context limit of "
            f"{sampling.max_context}: shorten the task's system text or instruction, or raise rollout.max_context"
        )


def apply_turn(
    traj: Trajectory, env, codec, ids: list[int], logprobs: list[float], *, sampling: Sampling, extra: int = 0
) -> bool:
    """Append a sampled turn, play it in the environment and append the observation; True while the episode
    goes on. `extra`: positions a context embedder splices in beyond the ids (a latent teacher's latents)."""
    grow = TrajectoryIds(traj.token_ids, traj.action_mask, traj.sample_logprobs)
    grow.add_action(ids, logprobs)
    if not ids or ids[-1] != codec.im_end_id:
        grow.add_forced([codec.im_end_id])  # the engine closed the turn, not the policy
    traj.num_turns += 1
    cap = sampling.max_observation_tokens
    result = checked_result(traj.task, env.step(codec.decode_action(ids)))
    if result.done:
        finish(traj, env, result, codec=codec, cap=cap)
        return False
    observation = codec.observation_ids(bounded_observation(codec, result.observation, cap))
    # The next turn must fit whole (the observation, then up to max_new_tokens of action): else the episode is
    # closed here, and no context ever outgrows max_context.
    if len(traj.token_ids) + extra + len(observation) + sampling.max_new_tokens > sampling.max_context:
        finish(
            traj, env, checked_result(traj.task, env.step("")), stop_reason="context_limit", codec=codec, cap=cap
        )  # the empty answer closes it
        return False
    grow.add_forced(observation)
    return True
