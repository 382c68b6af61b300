"""Environment contract shared by every LOPD environment (toolworld now, codegen later).

The rollout engine, the trainer and the evaluation flows only ever see these types, so an
environment can be swapped without touching them. Everything here is plain data: a Task
serialises to JSON and back exactly, which lets task sets be versioned as files.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

# train / val / test_id / test_ood / test_final are drawn in the deployment worlds; pretrain_test holds out instances
# of the pretraining worlds (the warm start's), to measure what adaptation forgets. val (design choices) and
# test_final (read by no decision, reported only) are held out like test_id, disjoint by content (held_out.py).
SPLITS = ("train", "val", "test_id", "test_ood", "pretrain_test", "test_final")

# The most turns a task may allow. Why a bound: every turn adds at least an action, its closing token, an
# observation and the next turn header to one context of at most `rollout.max_context` tokens, so no run plays
# more than a few hundred turns, while a typo (1e9) made the contract checker build a billion-item list.
MAX_TURNS = 256


@dataclass(frozen=True)
class Task:
    """One episode's full, JSON-serialisable definition."""

    task_id: str
    env: str
    split: str
    template: str
    world: str
    instruction: str
    spec: dict = field(hash=False, compare=True)
    max_turns: int

    def __post_init__(self) -> None:
        turns = self.max_turns
        if not isinstance(turns, int) or isinstance(turns, bool) or not 1 <= turns <= MAX_TURNS:
            raise ValueError(
                f"task {self.task_id!r} of env {self.env!r}: max_turns must be an integer in "
                f"[1, {MAX_TURNS}], got {turns!r}"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(s: str) -> Task:
        d = json.loads(s)
        return Task(
            task_id=d["task_id"],
            env=d["env"],
            split=d["split"],
            template=d["template"],
            world=d["world"],
            instruction=d["instruction"],
            spec=d["spec"],
            max_turns=int(d["max_turns"]),
        )


@dataclass(frozen=True)
class FirstObservation:
    system: str  # compact tool listing for the task's domains
    user: str  # == task.instruction
    # JSON schemas ({name, description, parameters}) of the tools this episode may call. A chat format whose
    # template takes `tools=` (a real model's) renders them in its own way; the embedded format reads `system`.
    tools: tuple[dict, ...] = field(default=(), hash=False, compare=True)


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict = field(hash=False, compare=True)


def checked_result(task: Task, result: StepResult) -> StepResult:
    """`result` as it leaves the environment of `task`, its reward checked: a number in [0, 1]. Why here: a
    reward out of range poisons everything after it (a NaN in eval.json, a β driven without bound into the
    checkpoint), and only here is it still known which environment and task produced it."""
    from lopd_core.errors import EnvironmentFault

    if not isinstance(result, StepResult) or not isinstance(result.observation, str):
        raise EnvironmentFault(
            f"env {task.env!r} returned {result!r:.120} from step() for task {task.task_id!r}, "
            "expected a StepResult whose observation is a str"
        )
    reward = result.reward
    if (
        not isinstance(reward, (int, float))
        or isinstance(reward, bool)
        or not math.isfinite(reward)
        or not 0.0 <= reward <= 1.0
    ):
        raise EnvironmentFault(
            f"env {task.env!r} returned reward {reward!r} for task {task.task_id!r}, expected a "
            "number in [0, 1]: fix the environment's reward (`lopd envs check "
            f"{task.env}` runs its contract checker)"
        )
    return result


@runtime_checkable
class Environment(Protocol):
    name: str

    def reset(self, task: Task) -> FirstObservation: ...

    def step(self, action: str) -> StepResult: ...

    @property
    def episode(self) -> list[dict]: ...
