"""Scripted oracle policy: solves any toolworld task, optionally with wrong conventions or slips.

The policy drives a template's oracle generator: each call it yields becomes a canonical
action text; each observation the environment returns is parsed and sent back in. With the
task's own conventions and ``slip=0`` it solves every task. ``conventions`` (a world name or a
``{domain: conventions}`` mapping) replaces the true ones to make plausible-but-wrong
demonstrations; ``slip`` is the per-call probability of one wrong-but-well-typed argument.
Whatever happens, the policy ends with a final answer (or the env's turn limit ends it).
"""

from __future__ import annotations

import json
import random
import re

from ..base import StepResult, Task
from .env import ToolWorldEnv
from .templates import TEMPLATES
from .templates.common import Stuck
from .tools import ALL_SCHEMAS, format_call
from .worlds import conventions_for

GIVE_UP = "I could not finish the task."
_ID_RE = re.compile(r"^([a-z]{1,2})(\d+)$")


def _parse_observation(text: str) -> dict:
    try:
        obs = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return {"error": text}
    return obs if isinstance(obs, dict) else {"error": text}


def _value_pool(state) -> tuple[dict[str, list[str]], list[str]]:
    """Ids (by prefix) and short strings present in a state: material for plausible slips."""
    id_pool: dict[str, set] = {}
    strings: set = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                m = _ID_RE.match(str(k))
                if m:
                    id_pool.setdefault(m.group(1), set()).add(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str) and len(x) <= 30:
            m = _ID_RE.match(x)
            if m:
                id_pool.setdefault(m.group(1), set()).add(x)
            else:
                strings.add(x)

    walk(state)
    return {p: sorted(v) for p, v in id_pool.items()}, sorted(strings)


class OraclePolicy:
    """``act(history)`` returns the next action text given the StepResults so far."""

    def __init__(self, task: Task, *, conventions=None, slip: float = 0.0, rng: random.Random | None = None):
        domains = task.spec["domains"]
        conv = task.spec["conventions"] if conventions is None else conventions_for(conventions, domains)
        self._gen = TEMPLATES[task.template].oracle(task.spec["params"], conv)
        self._slip = slip
        self._rng = rng if rng is not None else random.Random(0)
        self._ids, self._strings = _value_pool(task.spec["state"])
        self._started = False
        self.finished = False
        self.slips = 0

    def act(self, history: list[StepResult] | None = None) -> str:
        if self.finished:
            raise RuntimeError("oracle already gave its final answer")
        try:
            if not self._started:
                self._started = True
                item = next(self._gen)
            else:
                obs = _parse_observation(history[-1].observation) if history else {}
                item = self._gen.send(obs)
        except StopIteration as stop:
            self.finished = True
            return stop.value if stop.value else "done"
        except (Stuck, KeyError, TypeError, IndexError, ValueError, ZeroDivisionError, RuntimeError):
            # RuntimeError: a next(...) that found nothing inside the generator (PEP 479)
            self.finished = True
            return GIVE_UP
        name, arguments = item
        if self._slip > 0 and self._rng.random() < self._slip:
            arguments = self._mutate(name, arguments)
        return format_call(name, arguments)

    # ----------------------------------------------------------------- slips
    def _mutate(self, name: str, arguments: dict) -> dict:
        props = ALL_SCHEMAS.get(name, {}).get("parameters", {}).get("properties", {})
        keys = list(arguments)
        self._rng.shuffle(keys)
        for key in keys:
            new = self._alternative(props.get(key, {}), arguments[key])
            if new is not None and new != arguments[key]:
                self.slips += 1
                return {**arguments, key: new}
        return arguments

    def _alternative(self, prop: dict, value):
        rng = self._rng
        if "enum" in prop:
            others = [e for e in prop["enum"] if e != value]
            return rng.choice(others) if others else None
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            if value >= 20:
                return value + rng.choice([-10, 10])
            return value + 1 if value <= 1 else value + rng.choice([-1, 1])
        if isinstance(value, float):
            return value + 10
        if isinstance(value, str):
            m = _ID_RE.match(value)
            pool = self._ids.get(m.group(1), []) if m else self._strings
            others = [v for v in pool if v != value]
            return rng.choice(others) if others else None
        return None


def oracle_actions(task: Task, *, conventions=None, slip: float = 0.0, rng: random.Random | None = None):
    """The oracle as a policy object (see OraclePolicy.act)."""
    return OraclePolicy(task, conventions=conventions, slip=slip, rng=rng)


def run_oracle(task: Task, *, conventions=None, slip: float = 0.0, rng: random.Random | None = None):
    """Play a full episode with the oracle in a fresh env: (actions, step results, finished env)."""
    env = ToolWorldEnv()
    env.reset(task)
    policy = OraclePolicy(task, conventions=conventions, slip=slip, rng=rng)
    actions: list[str] = []
    results: list[StepResult] = []
    while True:
        action = policy.act(results)
        result = env.step(action)
        actions.append(action)
        results.append(result)
        if result.done:
            return actions, results, env
