"""Plugin environments that misbehave the way issue #30 found (registered through `envs.plugins` as
"_faulty_envs:Class"): an observation of unbounded size, a reward outside [0, 1], a huge first turn."""

from __future__ import annotations

from lopd_core.envs import FirstObservation, StepResult, Task


class FloodEnv:
    """Every step answers with an observation of `size` characters (words, as a search result would be)."""

    name = "flood"
    size = 3000
    reward = 0.0
    instruction = "Search for everything."

    def __init__(self) -> None:
        self._task: Task | None = None
        self._turns = 0
        self._episode: list[dict] = []

    @classmethod
    def make_tasks(cls, split, n, seed):
        return [
            Task(
                task_id=f"{cls.name}/{split}/{seed}/{i}",
                env=cls.name,
                split=split,
                template="t",
                world=cls.name,
                instruction=cls.instruction,
                spec={},
                max_turns=4,
            )
            for i in range(n)
        ]

    def reset(self, task: Task) -> FirstObservation:
        self._task = task
        return FirstObservation(system="tools: search(query)", user=task.instruction)

    def step(self, action: str) -> StepResult:
        self._turns += 1
        done = self._turns >= self._task.max_turns or not action
        observation = "" if done else ("lorem ipsum dolor " * (self.size // 18 + 1))[: self.size]
        self._episode.append({"action": action, "call": None, "observation": observation, "error": None})
        info = {"error": None, "call": None}
        if done:
            info.update(
                success=False, stop_reason="answer" if not action else "turn_limit", checks_passed=0, checks_total=1
            )
        return StepResult(observation, self.reward if done else 0.0, done, info)

    @property
    def episode(self) -> list[dict]:
        return [dict(e) for e in self._episode]


class HugeObservationEnv(FloodEnv):
    name = "huge_observation"
    size = 200_000


class NanRewardEnv(FloodEnv):
    name = "nan_reward"
    size = 10
    reward = float("nan")


class HugeRewardEnv(FloodEnv):
    name = "huge_reward"
    size = 10
    reward = 1e9


class LongPromptEnv(FloodEnv):
    name = "long_prompt"
    instruction = "Read this. " * 2000
