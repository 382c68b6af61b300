"""The toolworld Environment: text actions in, compact JSON observations out.

One instance plays exactly one episode. ``reset`` builds the task's domains from the spec
(initial state + the world's conventions); ``step`` parses the assistant message, dispatches
a declared tool through the explicit table, and at the end scores the final state and answer
with the task's data checks. Malformed actions never raise: they produce an error
observation and consume the turn.
"""

from __future__ import annotations

import json

from ..base import FirstObservation, StepResult, Task
from .checks import evaluate
from .domains import DOMAINS
from .tools import ALL_SCHEMAS, ToolError, observation_text, parse_action, signature_text, validate_arguments


def system_prompt(domains) -> str:
    names = [s["name"] for d in domains for s in DOMAINS[d].schemas()]
    return "tools: " + " ".join(signature_text(ALL_SCHEMAS[n]) for n in names)


class ToolWorldEnv:
    name = "toolworld"

    def __init__(self) -> None:
        self._task: Task | None = None
        self._domains: dict = {}
        self._table: dict = {}
        self._turns = 0
        self._done = False
        self._episode: list[dict] = []
        self.internal_errors: list[str] = []  # tool bugs caught in _dispatch (should stay empty)

    # ------------------------------------------------------------------ contract
    def reset(self, task: Task) -> FirstObservation:
        if self._task is not None:
            raise RuntimeError("ToolWorldEnv is single-use: create a new instance per episode")
        if task.env != self.name:
            raise ValueError(f"task {task.task_id} is for env {task.env!r}, not {self.name!r}")
        spec = task.spec
        self._task = task
        self._domains = {
            d: DOMAINS[d](spec["state"].get(d, {}), spec["conventions"][d]) for d in spec["domains"]
        }
        for dom in self._domains.values():
            self._table.update(dom.tool_table())
        return FirstObservation(system=system_prompt(spec["domains"]), user=task.instruction,
                                tools=tuple(ALL_SCHEMAS[s["name"]] for d in spec["domains"] for s in DOMAINS[d].schemas()))

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
        if kind == "error":
            payload, error = {"error": a}, a
        else:
            payload = self._dispatch(a, b)
            error = payload.get("error")
        observation = observation_text(payload)
        if self._turns >= self._task.max_turns:
            return self._finish(action, call, observation, error, "turn_limit", answer=None)
        self._record(action, call, observation, error)
        return StepResult(
            observation=observation, reward=0.0, done=False, info={"error": error, "call": call}
        )

    @property
    def episode(self) -> list[dict]:
        return [dict(e) for e in self._episode]

    # ------------------------------------------------------------------ helpers
    def state(self) -> dict:
        """Deep copy of the current state ``{domain: state}``."""
        return json.loads(json.dumps({d: dom.state for d, dom in self._domains.items()}))

    @property
    def done(self) -> bool:
        return self._done

    def _dispatch(self, name: str, arguments: dict) -> dict:
        fn = self._table.get(name)
        if fn is None:
            return {"error": "unknown tool"}
        err = validate_arguments(ALL_SCHEMAS[name], arguments)
        if err is not None:
            return {"error": err}
        try:
            return {"result": fn(**arguments)}
        except ToolError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001  a tool bug must not kill a rollout; tests assert it never happens
            self.internal_errors.append(f"{name}: {exc!r}")
            return {"error": "failed"}

    def _record(self, action, call, observation, error) -> None:
        self._episode.append({"action": action, "call": call, "observation": observation, "error": error})

    def _finish(self, action, call, observation, error, stop_reason, answer) -> StepResult:
        self._record(action, call, observation, error)
        self._done = True
        passed, total = evaluate(self._task.spec["checks"], self.state(), answer)
        reward = passed / total if total else 0.0
        info = {
            "success": total > 0 and passed == total,
            "stop_reason": stop_reason,
            "checks_passed": passed,
            "checks_total": total,
            "error": error,
            "call": call,
        }
        return StepResult(observation=observation, reward=reward, done=True, info=info)
