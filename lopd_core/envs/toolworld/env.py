"""The toolworld Environment: text actions in, compact JSON observations out.

One instance plays exactly one episode (the turn loop is episode.py's). ``reset`` builds the task's domains
from the spec (initial state + the world's conventions); a call is dispatched through the explicit table of
the domains' declared tools, and at the end the final state and answer are scored with the task's data checks.
Malformed actions never raise: they produce an error observation and consume the turn.
"""

from __future__ import annotations

import json

from ..base import FirstObservation, Task
from .domains import DOMAINS
from .episode import ToolEpisode
from .tools import ALL_SCHEMAS, ToolError, signature_text, validate_arguments


def system_prompt(domains) -> str:
    names = [s["name"] for d in domains for s in DOMAINS[d].schemas()]
    return "tools: " + " ".join(signature_text(ALL_SCHEMAS[n]) for n in names)


class ToolWorldEnv(ToolEpisode):
    name = "toolworld"

    def __init__(self) -> None:
        super().__init__()
        self._domains: dict = {}
        self._table: dict = {}

    # ------------------------------------------------------------------ contract
    def reset(self, task: Task) -> FirstObservation:
        self._begin(task)
        spec = task.spec
        self._domains = {d: DOMAINS[d](spec["state"].get(d, {}), spec["conventions"][d]) for d in spec["domains"]}
        for dom in self._domains.values():
            self._table.update(dom.tool_table())
        tools = tuple(ALL_SCHEMAS[s["name"]] for d in spec["domains"] for s in DOMAINS[d].schemas())
        return FirstObservation(system=system_prompt(spec["domains"]), user=task.instruction, tools=tools)

    # ------------------------------------------------------------------ helpers
    def state(self) -> dict:
        """Deep copy of the current state ``{domain: state}``."""
        return json.loads(json.dumps({d: dom.state for d, dom in self._domains.items()}))

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
