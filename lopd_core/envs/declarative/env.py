"""A tool environment declared as data: a list of tools, and tasks of (instruction, initial state, checks).

Subclass it with a name, the tools and (usually) a task file; that is a complete environment:

    class LibraryEnv(DeclarativeToolEnv):
        name = "library"
        tools = (find_book, lend_book, return_book)      # functions fn(state, ...) or ToolSpec(schema, fn)
        task_file = Path(__file__).with_name("tasks.jsonl")

A task's spec is ``{"state": {...}, "checks": [...]}`` (a task file line: task_files.py). The episode plays as
toolworld's does (toolworld/episode.py), with the same text protocol (toolworld/tools.py ``parse_action``: one
``<tool_call>{"name", "arguments"}</tool_call>`` per turn, a message without a call is the final answer): a
call is looked up in the class's explicit tool table, its arguments are validated against the tool's schema,
and the function runs on the episode's own copy of the state; a malformed or failing call becomes an
``{"error": ...}`` observation and uses the turn. When the agent answers (or runs out of turns) the checks are
evaluated on the final state and answer with toolworld's check language (toolworld/checks.py: paths into the
state, eq / contains / count / has / present / absent, answer_contains / answer_eq; checks are data, never
code), and the reward is the share passed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import ClassVar

from ..base import MAX_TURNS, FirstObservation, Task
from ..task_files import file_splits, tasks_from_file
from ..toolworld.checks import check_error
from ..toolworld.episode import ToolEpisode
from ..toolworld.tools import ToolError, signature_text, validate_arguments
from .tools import Tool, examples_error, tool_table

SPEC_KEYS = ("state", "checks")


class DeclarativeToolEnv(ToolEpisode):
    name: ClassVar[str] = ""
    tools: ClassVar[tuple] = ()
    task_file: ClassVar[str | Path | None] = None  # JSON Lines; envs.task_files overrides it
    max_turns: ClassVar[int] = 8  # a task line's default
    system_intro: ClassVar[str] = ""  # optional text before the tool listing of the system turn
    splits: ClassVar[tuple[str, ...]] = ("train", "test_id", "test_ood")  # the task file's, when it has one
    # Arguments the contract checker calls a tool with, name -> [arguments, ...] (else one object its schema
    # admits): give them where made-up arguments are not calls the tool should meet.
    tool_examples: ClassVar[dict[str, list[dict]]] = {}
    _table: ClassVar[dict[str, Tool]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.name:
            raise TypeError(f"{cls.__name__}: a declarative environment needs a `name`")
        turns = cls.max_turns
        if not isinstance(turns, int) or isinstance(turns, bool) or not 1 <= turns <= MAX_TURNS:
            raise TypeError(
                f"{cls.__name__}: max_turns must be an integer in [1, {MAX_TURNS}] (base.MAX_TURNS says "
                f"why), got {turns!r}"
            )
        cls._table = tool_table(cls.tools)  # the only dispatch path (no attribute lookup by a model's name)
        why = examples_error(cls._table, cls.tool_examples)
        if why:
            raise TypeError(f"{cls.__name__}: {why}")
        if cls.task_file is not None and "splits" not in vars(cls):
            cls.splits = file_splits(cls.task_file, cls.name, max_turns=cls.max_turns, validate_spec=cls.validate_spec)

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
            why = check_error(check, spec["state"])  # operand types against the initial state, at load
            if why:
                return f"checks[{i}]: {why}"
        return None

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split`` from the class's task file (task_files.py: order, repeats)."""
        if cls.task_file is None:
            raise ValueError(f"env {cls.name!r} has no task_file: set one on the class or envs.task_files")
        return tasks_from_file(
            cls.task_file, cls.name, split, n, seed, max_turns=cls.max_turns, validate_spec=cls.validate_spec
        )

    @classmethod
    def tool_schemas(cls) -> list[dict]:
        """The declared tools' JSON schemas, in declaration order."""
        return [copy.deepcopy(t.schema) for t in cls._table.values()]

    # ------------------------------------------------------------------ contract
    def __init__(self) -> None:
        super().__init__()
        self._state: dict = {}

    def reset(self, task: Task) -> FirstObservation:
        self._begin(task)
        self._state = copy.deepcopy(task.spec["state"])  # the task stays untouched by the episode
        listing = "tools: " + " ".join(signature_text(t.schema) for t in self._table.values())
        system = f"{self.system_intro.strip()}\n{listing}" if self.system_intro.strip() else listing
        return FirstObservation(system=system, user=task.instruction, tools=tuple(self.tool_schemas()))

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
        except ToolError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001  a tool bug must not kill a rollout; internal_errors keeps it
            self.internal_errors.append(f"{name}: {exc!r}")
            return {"error": "failed"}
        try:  # what the agent reads must be JSON: no NaN or Infinity, no object json cannot write
            json.dumps(result, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            self.internal_errors.append(f"{name}: returned a value that is not JSON ({exc})")
            return {"error": "failed: the tool's result is not JSON (NaN, Infinity or an object)"}
        return {"result": result}
