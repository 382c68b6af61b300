"""What a rollout takes and returns: the sampling settings, a request, and the trajectory (the training contract).

What a trajectory records (the contract training relies on):
  * token_ids       — the whole conversation, exactly the ids the policy saw and produced;
  * action_mask     — 1 where the policy sampled the token (its actions and their closing <|im_end|>), 0 for
                      forced tokens (system, user, observations, turn framing, a closing <|im_end|> the engine
                      had to add after a turn ran out of tokens);
  * sample_logprobs — log-probability of each sampled token under the distribution it was drawn from
                      (after temperature and top-p; greedy records the plain log-softmax), 0 where forced;
  * reward, success, stop_reason and the environment's episode record.
The same contract holds whether the in-process engine or an inference server generated the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lopd_core.envs import Task


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 64  # per assistant turn
    max_context: int = 1024  # a trajectory that outgrows this is closed with stop_reason "context_limit"
    # An observation's own tokens beyond this are cut, and the model is told so (`bounded_observation`).
    max_observation_tokens: int = 512
    # Inference servers that generate instead of the in-process engine (`rollout.backend: openai`,
    # lopd_core/rollout/served.py); None: the engine generates with the model it is given.
    served: ServedBackend | None = None

    @classmethod
    def from_rollout(cls, rollout_cfg, temperature: float | None = None) -> Sampling:
        """The `rollout` section's sampling in process (at `temperature` when given, else the section's)."""
        return cls(
            temperature=rollout_cfg.temperature if temperature is None else temperature,
            top_p=rollout_cfg.top_p,
            max_new_tokens=rollout_cfg.max_new_tokens,
            max_context=rollout_cfg.max_context,
            max_observation_tokens=rollout_cfg.max_observation_tokens,
        )


@dataclass(frozen=True)
class ServedBackend:
    """OpenAI-compatible servers that generate a rollout's turns, and how their weights are kept current."""

    servers: tuple[str, ...]  # base URLs, http://HOST:PORT/v1; each takes a slice of the requests
    sync: str = "reload"  # "reload": save the policy, POST /admin/reload on each server; "none": not synced here
    sync_dir: str = ""  # where the policy is saved for the servers to reload ("" a temporary folder)
    api_key_env: str = "LOPD_API_KEY"  # the environment variable holding the servers' key (unset: none sent)

    @classmethod
    def from_settings(cls, rollout_cfg) -> ServedBackend | None:
        """The `rollout` section's servers when its backend is openai; None for the in-process engine."""
        if rollout_cfg.backend != "openai":
            return None
        return cls(tuple(rollout_cfg.servers), rollout_cfg.sync, rollout_cfg.sync_dir, rollout_cfg.api_key_env)


@dataclass(frozen=True)
class RolloutRequest:
    task: Task
    sample_index: int = 0
    experiences: tuple[str, ...] = ()  # success texts placed in the first user turn (empty for the student)


@dataclass
class Trajectory:
    task: Task
    sample_index: int
    experiences: tuple[str, ...]
    token_ids: list[int]
    action_mask: list[int]
    sample_logprobs: list[float]
    prompt_length: int  # forced tokens before the first action
    reward: float = 0.0
    success: bool = False
    stop_reason: str = ""
    num_turns: int = 0
    episode: list[dict] = field(default_factory=list)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)
