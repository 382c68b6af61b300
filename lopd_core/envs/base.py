"""Environment contract shared by every LOPD environment (toolworld now, codegen later).

The rollout engine, the trainer and the evaluation flows only ever see these types, so an
environment can be swapped without touching them. Everything here is plain data: a Task
serialises to JSON and back exactly, which lets task sets be versioned as files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

# train / test_id / test_ood are drawn in the deployment worlds; pretrain_test holds out instances of the
# pretraining worlds (the warm start's), to measure what adaptation forgets.
SPLITS = ("train", "test_id", "test_ood", "pretrain_test")


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


@runtime_checkable
class Environment(Protocol):
    name: str

    def reset(self, task: Task) -> FirstObservation: ...

    def step(self, action: str) -> StepResult: ...

    @property
    def episode(self) -> list[dict]: ...
