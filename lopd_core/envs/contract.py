"""The contract every LOPD environment must satisfy, as one reusable checker.

``check_env_contract(env_factory, tasks)`` raises AssertionError with a clear message on the
first violation. It only uses the public contract (reset / step / episode, Task JSON), so the
future codegen environment is checked by the same function. ``scripted(task)`` may supply a
meaningful action sequence (e.g. an oracle's) to replay for the determinism and record checks;
by default a few malformed probes and a final answer are used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .base import FirstObservation, StepResult, Task

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
        if r.info["success"] != (
            r.info["checks_total"] > 0 and r.info["checks_passed"] == r.info["checks_total"]
        ):
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
    return env, results


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
        # Task JSON round trip
        if (
            Task.from_json(task.to_json()) != task
            or Task.from_json(task.to_json()).to_json() != task.to_json()
        ):
            _fail(task, "Task JSON round trip is not exact")
        if task.max_turns < 1:
            _fail(task, "max_turns < 1")
        # reset
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
                for t in first.tools):
            _fail(task, "tools must be a tuple of JSON schemas, each with a name (and parameters)")
        try:
            env.reset(task)
        except RuntimeError:
            pass
        else:
            _fail(task, "second reset() must raise RuntimeError")
        # malformed actions are error observations, never exceptions
        for probe in MALFORMED_PROBES:
            env, (r,) = _play(env_factory, task, [probe])
            if not r.observation.strip():
                _fail(task, f"malformed action {probe!r} gave an empty observation")
            if r.done and r.info.get("stop_reason") != "turn_limit":
                _fail(task, f"malformed action {probe!r} ended the episode")
            if not r.done and r.info.get("error") is None:
                _fail(task, f"malformed action {probe!r} reported no error")
        # turn limit
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
        # determinism + episode record on a scripted (or default) action sequence
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
    return count
