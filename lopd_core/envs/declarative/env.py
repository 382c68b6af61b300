"""A tool environment declared as data: a list of tools, and tasks of (instruction, initial state, checks).

Subclass it with a name, the tools and (usually) a task file; that is a complete environment:

    class LibraryEnv(DeclarativeToolEnv):
        name = "library"
        tools = (find_book, lend_book, return_book)      # functions fn(state, ...) or ToolSpec(schema, fn)
        task_file = Path(__file__).with_name("tasks.jsonl")

A task's spec is ``{"state": {...}, "checks": [...]}`` (a task file line: task_files.py). The episode plays as
toolworld's does, with the same text protocol (toolworld/tools.py ``parse_action``: one ``<tool_call>{"name",
"arguments"}</tool_call>`` per turn, a message without a call is the final answer): a call is looked up in the
class's explicit tool table, its arguments are validated against the tool's schema, and the function runs on the
episode's own copy of the state; a malformed or failing call becomes an ``{"error": ...}`` observation and uses
the turn. When the agent answers (or runs out of turns) the checks are evaluated on the final state and answer
with toolworld's check language (toolworld/checks.py: paths into the state, eq / contains / count / has /
present / absent, answer_contains / answer_eq; checks are data, never code), and the reward is the share passed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import ClassVar

from ..base import FirstObservation, StepResult, Task
from ..task_files import file_splits, tasks_from_file
from ..toolworld.checks import check_error, evaluate
from ..toolworld.tools import ToolError, observation_text, parse_action, signature_text, validate_arguments
from .tools import Tool, tool_table

SPEC_KEYS = ("state", "checks")


class DeclarativeToolEnv:
    name: ClassVar[str] = ""
    tools: ClassVar[tuple] = ()
    task_file: ClassVar[str | Path | None] = None  # JSON Lines; envs.task_files overrides it
    max_turns: ClassVar[int] = 8  # a task line's default
    system_intro: ClassVar[str] = ""  # optional text before the tool listing of the system turn
    splits: ClassVar[tuple[str, ...]] = ("train", "test_id", "test_ood")  # the task file's, when it has one
    _table: ClassVar[dict[str, Tool]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.name:
            raise TypeError(f"{cls.__name__}: a declarative environment needs a `name`")
        cls._table = tool_table(cls.tools)  # the only dispatch path (no attribute lookup by a model's name)
        if cls.task_file is not None and "splits" not in vars(cls):
            cls.splits = file_splits(cls.task_file, cls.name, max_turns=cls.max_turns,
                                     validate_spec=cls.validate_spec)

    # ------------------------------------------------------------------ tasks
    @classmethod
    def validate_spec(cls, spec: dict) -> str | None:
        """Why a task spec is unusable (None when it is fine): checked for every line of a task file."""
        extra = sorted(set(spec) - set(SPEC_KEYS))
        if extra:
            return f"unexpected key {extra[0]!r}; a task has {', '.join(SPEC_KEYS)} besides the task fields"
        if not isinstance(spec.get("state"), dict):
            return "state must be an object"
        checks = spec.get("checks")
        if not isinstance(checks, list) or not checks:
            return "checks must be a non-empty list"
        for i, check in enumerate(checks):
            why = check_error(check)
            if why:
                return f"checks[{i}]: {why}"
        return None

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split`` from the class's task file (task_files.py: order, repeats)."""
        if cls.task_file is None:
            raise ValueError(f"env {cls.name!r} has no task_file: set one on the class or envs.task_files")
        return tasks_from_file(cls.task_file, cls.name, split, n, seed, max_turns=cls.max_turns,
                               validate_spec=cls.validate_spec)

    @classmethod
    def tool_schemas(cls) -> list[dict]:
        """The declared tools' JSON schemas, in declaration order."""
        return [copy.deepcopy(t.schema) for t in cls._table.values()]

    # ------------------------------------------------------------------ contract
    def __init__(self) -> None:
        self._task: Task | None = None
        self._state: dict = {}
        self._turns = 0
        self._done = False
        self._episode: list[dict] = []
        self.internal_errors: list[str] = []  # tool bugs caught in _dispatch

    def reset(self, task: Task) -> FirstObservation:
        if self._task is not None:
            raise RuntimeError(f"{type(self).__name__} is single-use: create a new instance per episode")
        if task.env != self.name:
            raise ValueError(f"task {task.task_id} is for env {task.env!r}, not {self.name!r}")
        self._task = task
        self._state = copy.deepcopy(task.spec["state"])  # the task stays untouched by the episode
        listing = "tools: " + " ".join(signature_text(t.schema) for t in self._table.values())
        system = f"{self.system_intro.strip()}\n{listing}" if self.system_intro.strip() else listing
        return FirstObservation(system=system, user=task.instruction, tools=tuple(self.tool_schemas()))

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if self._done:
            raise RuntimeError("episode is over: step() after done")
        self._turns += 1
        kind, a, b = parse_action(action)
        if kind == "answer":
            return self._finish(action, None, "", None, "answer", answer=a)
        call = {"name": a, "arguments": b} if kind == "call" else None
        payload = {"error": a} if kind == "error" else self._dispatch(a, b)
        observation, error = observation_text(payload), payload.get("error")
        if self._turns >= self._task.max_turns:
            return self._finish(action, call, observation, error, "turn_limit", answer=None)
        self._record(action, call, observation, error)
        return StepResult(observation=observation, reward=0.0, done=False, info={"error": error, "call": call})

    @property
    def episode(self) -> list[dict]:
        return [dict(e) for e in self._episode]

    # ------------------------------------------------------------------ helpers
    def state(self) -> dict:
        """A deep copy of the episode's current state."""
        return copy.deepcopy(self._state)

    def _dispatch(self, name: str, arguments: dict) -> dict:
        tool = self._table.get(name)
        if tool is None:
            return {"error": "unknown tool"}
        err = validate_arguments(tool.schema, arguments)
        if err is not None:
            return {"error": err}
        try:
            result = tool.fn(self._state, **arguments)
            json.dumps(result)  # what the agent reads must be JSON
        except ToolError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001  a tool bug must not kill a rollout; internal_errors keeps it
            self.internal_errors.append(f"{name}: {exc!r}")
            return {"error": "failed"}
        return {"result": result}

    def _record(self, action, call, observation, error) -> None:
        self._episode.append({"action": action, "call": call, "observation": observation, "error": error})

    def _finish(self, action, call, observation, error, stop_reason, answer) -> StepResult:
        self._record(action, call, observation, error)
        self._done = True
        passed, total = evaluate(self._task.spec["checks"], self._state, answer)
        info = {"success": total > 0 and passed == total, "stop_reason": stop_reason, "checks_passed": passed,
                "checks_total": total, "error": error, "call": call}
        return StepResult(observation=observation, reward=passed / total if total else 0.0, done=True, info=info)
