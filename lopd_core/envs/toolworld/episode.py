"""One tool-calling episode, as every tool environment plays it (toolworld, and the declarative environments).

Why one class: the turn protocol is the contract's, and two copies of it drift. A turn is parsed with the text
protocol of tools.py (one ``<tool_call>`` per turn, a message without a call is the final answer); a call goes
to the subclass's ``_dispatch(name, arguments)``, which looks it up in its explicit tool table and returns
``{"result": ...}`` or ``{"error": ...}``; a malformed call is an error observation that uses the turn. The
episode ends at the answer or at ``task.max_turns``, and the task's data checks (checks.py) are evaluated on
``state()`` and the answer: reward = the share passed. The subclass builds its tools and state in ``reset``
(after ``_begin``) and says what ``state()`` is.
"""

from __future__ import annotations

from ..base import StepResult, Task
from .checks import evaluate
from .tools import observation_text, parse_action


class ToolEpisode:
    name = ""

    def __init__(self) -> None:
        self._task: Task | None = None
        self._turns = 0
        self._done = False
        self._episode: list[dict] = []
        self.internal_errors: list[str] = []  # tool bugs caught in _dispatch

    def _begin(self, task: Task) -> None:
        """The start of ``reset``: one episode per instance, and only this environment's tasks."""
        if self._task is not None:
            raise RuntimeError(f"{type(self).__name__} is single-use: create a new instance per episode")
        if task.env != self.name:
            raise ValueError(f"task {task.task_id} is for env {task.env!r}, not {self.name!r}")
        self._task = task

    def state(self) -> dict:
        raise NotImplementedError

    def _dispatch(self, name: str, arguments: dict) -> dict:
        raise NotImplementedError

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

    @property
    def done(self) -> bool:
        return self._done

    def _record(self, action, call, observation, error) -> None:
        self._episode.append({"action": action, "call": call, "observation": observation, "error": error})

    def _finish(self, action, call, observation, error, stop_reason, answer) -> StepResult:
        self._record(action, call, observation, error)
        self._done = True
        passed, total = evaluate(self._task.spec["checks"], self.state(), answer)
        info = {
            "success": total > 0 and passed == total,
            "stop_reason": stop_reason,
            "checks_passed": passed,
            "checks_total": total,
            "error": error,
            "call": call,
        }
        reward = passed / total if total else 0.0
        return StepResult(observation=observation, reward=reward, done=True, info=info)
