"""The contract every LOPD environment must satisfy, as one reusable checker.

``check_env_contract(env_factory, tasks)`` raises AssertionError with a clear message on the
first violation. It only uses the public contract (reset / step / episode, Task JSON), so the
future codegen environment is checked by the same function. ``scripted(task)`` may supply a
meaningful action sequence (e.g. an oracle's) to replay for the determinism and record checks;
by default a few malformed probes and a final answer are used.

Tools are called, not only listed: every tool the first observation declares (``first.tools``) is called at
least once in the text protocol (``<tool_call>{"name", "arguments"}</tool_call>``), with the class's own
``tool_examples`` (name -> list of argument objects) where it has them, else with one argument object its schema
admits. A tool that raises inside (``internal_errors``: the agent would see "failed") fails the check, and so do
tool calls whose observations differ between two fresh instances (a tool that keeps state outside the episode,
in a module or class attribute). Why: a checker that only reads the schemas passed environments whose every tool
raised. An environment without ``tools`` in its first observation (codegen) has nothing to call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from .base import FirstObservation, StepResult, Task

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # the text protocol of toolworld/tools.py

MALFORMED_PROBES = (
    '<tool_call>{"name": "x", "arguments": {</tool_call>',  # bad JSON
    "<tool_call>[1, 2]</tool_call>",  # not an object
    '<tool_call>{"name": "__class__", "arguments": {}}</tool_call>',  # dunder attribute
    '<tool_call>{"name": "_private", "arguments": {}}</tool_call>',  # private attribute
    '<tool_call>{"name": "no_such_tool", "arguments": {"a": 1}}</tool_call>',  # unknown tool
    '<tool_call>{"name": "x", "arguments": []}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "x"',  # unclosed tag
)
DONE_KEYS = {"success", "stop_reason", "checks_passed", "checks_total"}


def _fail(task: Task, what: str) -> None:
    raise AssertionError(f"[env contract] task {task.task_id}: {what}")


def _check_result(task: Task, r, *, last_turn: bool) -> None:
    if not isinstance(r, StepResult):
        _fail(task, f"step() returned {type(r).__name__}, not StepResult")
    if not isinstance(r.observation, str):
        _fail(task, "observation is not a str")
    if not isinstance(r.reward, float) or not 0.0 <= r.reward <= 1.0:
        _fail(task, f"reward {r.reward!r} is not a float in [0, 1]")
    if not r.done and r.reward != 0.0:
        _fail(task, f"reward {r.reward} before done (must be 0.0)")
    if not isinstance(r.info, dict):
        _fail(task, "info is not a dict")
    if r.done:
        missing = DONE_KEYS - set(r.info)
        if missing:
            _fail(task, f"done info lacks {sorted(missing)}")
        if r.info["stop_reason"] not in ("answer", "turn_limit"):
            _fail(task, f"bad stop_reason {r.info['stop_reason']!r}")
        if not 0 <= r.info["checks_passed"] <= r.info["checks_total"]:
            _fail(task, "checks_passed out of range")
        if r.info["success"] != (r.info["checks_total"] > 0 and r.info["checks_passed"] == r.info["checks_total"]):
            _fail(task, "success disagrees with checks_passed/checks_total")
    else:
        if "error" not in r.info or "call" not in r.info:
            _fail(task, "per-step info must have 'error' and 'call'")
        if last_turn:
            _fail(task, "episode did not end at max_turns")


def _play(env_factory: Callable, task: Task, actions: list[str]) -> tuple[object, list[StepResult]]:
    env = env_factory()
    first = env.reset(task)
    if not isinstance(first, FirstObservation):
        _fail(task, f"reset() returned {type(first).__name__}, not FirstObservation")
    results: list[StepResult] = []
    for i, action in enumerate(actions):
        r = env.step(action)
        _check_result(task, r, last_turn=(i + 1 == task.max_turns))
        results.append(r)
        if r.done:
            break
    _check_internal_errors(task, env, actions)
    return env, results


def _check_internal_errors(task: Task, env, actions: list[str]) -> None:
    errors = getattr(env, "internal_errors", None)
    if errors:
        played = " | ".join(actions)
        _fail(
            task,
            f"a tool raised inside ({str(errors[0])[:300]}) on the actions {played[:400]!r}; the agent saw "
            "'failed'. Raise ToolError for a bad call; give the class tool_examples if the checker's "
            "arguments are not ones the tool should meet",
        )


def _value(prop: dict):
    """One value a schema property admits (its default, its first enum value, else a plain one of its type)."""
    if not isinstance(prop, dict):
        return "a"
    if "default" in prop and prop["default"] is not None:
        return prop["default"]
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return prop["enum"][0]
    kind = prop.get("type")
    if kind == "array":
        items = prop.get("items")
        return [_value(items)] if isinstance(items, dict) and items else []
    return {"integer": 1, "number": 1.0, "boolean": False, "object": {}}.get(kind, "a")


def schema_arguments(schema: dict) -> dict:
    """An argument object the tool's schema admits: every declared parameter, each with `_value`."""
    params = schema.get("parameters") if isinstance(schema.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    return {name: _value(prop) for name, prop in props.items()}


def tool_calls(first: FirstObservation, examples: dict | None) -> list[tuple[str, dict]]:
    """(name, arguments) for every declared tool: the class's examples where it gives them, else one made up."""
    calls: list[tuple[str, dict]] = []
    for schema in first.tools:
        name = schema["name"]
        given = (examples or {}).get(name)
        calls += [(name, dict(a)) for a in given] if given else [(name, schema_arguments(schema))]
    return calls


def _call_text(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def _check_tools(env_factory: Callable, task: Task, first: FirstObservation, examples: dict | None) -> None:
    """Call every declared tool; each episode holds as many calls as its turns allow, and is played twice."""
    calls = tool_calls(first, examples)
    per_episode = max(1, task.max_turns - 1)  # room for the closing answer where there is any
    for start in range(0, len(calls), per_episode):
        chunk = calls[start : start + per_episode]
        actions = [_call_text(n, a) for n, a in chunk] + (["done"] if task.max_turns > len(chunk) else [])
        _, first_play = _play(env_factory, task, actions)
        _, second_play = _play(env_factory, task, actions)
        for (name, arguments), a, b in zip(chunk, first_play, second_play):
            if (a.observation, a.reward, a.done, a.info) != (b.observation, b.reward, b.done, b.info):
                _fail(
                    task,
                    f"tool {name} answered {a.observation[:200]!r}, then {b.observation[:200]!r} in a "
                    f"fresh instance on the same call {arguments!r}: does it keep state outside the "
                    "episode (a module or class attribute)?",
                )


def _check_episode(task: Task, env, actions: list[str], results: list[StepResult]) -> None:
    record = env.episode
    if len(record) != len(results):
        _fail(task, f"episode has {len(record)} entries for {len(results)} steps")
    for i, (entry, r) in enumerate(zip(record, results)):
        if set(entry) != {"action", "call", "observation", "error"}:
            _fail(task, f"episode[{i}] keys {sorted(entry)}")
        if entry["action"] != actions[i] or entry["observation"] != r.observation:
            _fail(task, f"episode[{i}] does not match step {i}")
        if not r.done and (entry["error"] != r.info["error"] or entry["call"] != r.info["call"]):
            _fail(task, f"episode[{i}] error/call differ from the step info")


def check_env_contract(
    env_factory: Callable[[], object],
    tasks: Iterable[Task],
    scripted: Callable[[Task], list[str]] | None = None,
) -> int:
    """Check the environment contract on each task; returns the number of tasks checked."""
    count = 0
    for task in tasks:
        count += 1
        if Task.from_json(task.to_json()) != task or Task.from_json(task.to_json()).to_json() != task.to_json():
            _fail(task, "Task JSON round trip is not exact")
        if task.max_turns < 1:
            _fail(task, "max_turns < 1")
        first = _check_reset(env_factory, task)
        _check_malformed(env_factory, task)
        _check_turn_limit(env_factory, task)
        env_a = _check_determinism(env_factory, task, scripted)
        _check_tools(env_factory, task, first, getattr(env_a, "tool_examples", None))
    return count


def _check_reset(env_factory, task: Task) -> FirstObservation:
    """reset() gives a system text, the task's instruction and tool schemas, once: a second reset raises."""
    env = env_factory()
    first = env.reset(task)
    if not isinstance(first, FirstObservation):
        _fail(task, "reset() must return FirstObservation")
    if not (isinstance(first.system, str) and first.system.strip()):
        _fail(task, "empty system text")
    if not (isinstance(first.user, str) and first.user.strip()) or first.user != task.instruction:
        _fail(task, "user text must be the non-empty task instruction")
    if not isinstance(first.tools, tuple) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("parameters", {}), dict)
        for t in first.tools
    ):
        _fail(task, "tools must be a tuple of JSON schemas, each with a name (and parameters)")
    try:
        env.reset(task)
    except RuntimeError:
        pass
    else:
        _fail(task, "second reset() must raise RuntimeError")
    return first


def _check_malformed(env_factory, task: Task) -> None:
    """Malformed actions are error observations, never exceptions, and never end the episode early."""
    for probe in MALFORMED_PROBES:
        _, (r,) = _play(env_factory, task, [probe])
        if not r.observation.strip():
            _fail(task, f"malformed action {probe!r} gave an empty observation")
        if r.done and r.info.get("stop_reason") != "turn_limit":
            _fail(task, f"malformed action {probe!r} ended the episode")
        if not r.done and r.info.get("error") is None:
            _fail(task, f"malformed action {probe!r} reported no error")


def _check_turn_limit(env_factory, task: Task) -> None:
    """max_turns actions end the episode with stop_reason 'turn_limit'; a step after the end raises."""
    probes = [MALFORMED_PROBES[i % len(MALFORMED_PROBES)] for i in range(task.max_turns)]
    env, results = _play(env_factory, task, probes)
    if len(results) != task.max_turns or not results[-1].done:
        _fail(task, f"turn limit {task.max_turns} did not end the episode")
    if results[-1].info["stop_reason"] != "turn_limit":
        _fail(task, "episode ended by the turn limit must have stop_reason 'turn_limit'")
    try:
        env.step("done")
    except RuntimeError:
        pass
    else:
        _fail(task, "step() after done must raise RuntimeError")
    _check_episode(task, env, probes, results)


def _check_determinism(env_factory, task: Task, scripted) -> object:
    """The same task and actions give the same results, and the episode record, on a scripted (or default)
    action sequence; returns the first of the two environments played."""
    actions = list(scripted(task)) if scripted else [MALFORMED_PROBES[0], "done"]
    env_a, res_a = _play(env_factory, task, actions)
    _, res_b = _play(env_factory, task, actions)
    if [(r.observation, r.reward, r.done, r.info) for r in res_a] != [
        (r.observation, r.reward, r.done, r.info) for r in res_b
    ]:
        _fail(task, "same task + same actions gave different results (non-deterministic)")
    if not res_a[-1].done:
        _fail(task, "scripted actions did not finish the episode")
    _check_episode(task, env_a, actions, res_a)
    return env_a
