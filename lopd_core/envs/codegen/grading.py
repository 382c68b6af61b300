"""Grade one attempt: run the code on the task's inputs in the sandbox, compare in the parent, say what failed.

Only inputs go to the sandbox; expected outputs stay here and are compared with the JSON values the child
reported (`same_value`), so nothing the code returns can make a comparison answer true. The feedback names the
first failing test — the call, what came back (or what was raised) and what was expected — because that is
what a programmer needs to fix the code, and it is short enough for a small model's context.

Runs are cached by (code, function, inputs): the same attempt always gets the same verdict (a rollout group's
greedy samples, the contract checker's replays) and costs one execution.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from lopd_core.envs.sandbox import NO_RESULT, SandboxLimits, SandboxResult, run_calls

CODEGEN_LIMITS = SandboxLimits(
    timeout_s=3.0, cpu_s=2.0, memory_mb=256, max_processes=4, max_file_mb=1.0, max_open_files=32, max_output_bytes=4096
)
MAX_SHOWN_CHARS = 80
_CACHE_SIZE = 4096
_cache: OrderedDict[str, SandboxResult] = OrderedDict()
_cache_lock = threading.Lock()
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Grade:
    passed: int
    total: int
    feedback: str  # the observation the policy reads
    failure: str | None  # first failure in a few words (None when everything passed)


def extract_code(action: str) -> str:
    """The code in an answer: the first fenced block if there is one, else the whole text."""
    match = _FENCE.search(action)
    return match.group(1) if match else action


def same_value(actual, expected) -> bool:
    """Equality on JSON values; bool is not a number here, and numbers compare with a float tolerance."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        if isinstance(expected, int) and isinstance(actual, int):
            return actual == expected
        return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(same_value(a, e) for a, e in zip(actual, expected))
        )
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and actual.keys() == expected.keys()
            and all(same_value(actual[k], expected[k]) for k in expected)
        )
    return type(actual) is type(expected) and actual == expected


def shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    text = (
        text.replace("true", "True").replace("false", "False").replace("null", "None")
        if not isinstance(value, str)
        else text
    )
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def call_text(function: str, args: list) -> str:
    text = f"{function}({', '.join(shown(a) for a in args)})"
    return text if len(text) <= 2 * MAX_SHOWN_CHARS else text[: 2 * MAX_SHOWN_CHARS - 3] + "..."


def execute(code: str, function: str, inputs: list[list], limits: SandboxLimits = CODEGEN_LIMITS) -> SandboxResult:
    key = hashlib.sha256(json.dumps([code, function, inputs, repr(limits)]).encode()).hexdigest()
    with _cache_lock:  # environments may grade from several threads (warm-start demonstrations do)
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    result = run_calls(code, function, inputs, limits)
    with _cache_lock:
        _cache[key] = result
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return result


def grade(code: str, function: str, tests: list[dict], limits: SandboxLimits = CODEGEN_LIMITS) -> Grade:
    """tests: [{"args": [...], "expected": value}, ...]"""
    total = len(tests)
    if not code.strip():
        return Grade(0, total, f"passed 0/{total} tests; no code given", "no code")
    result = execute(code, function, [t["args"] for t in tests], limits)
    passed, first = 0, None
    for test, outcome in zip(tests, result.calls):
        if "value" in outcome and same_value(outcome["value"], test["expected"]):
            passed += 1
        elif first is None:
            first = (test, outcome)
    if passed == total:
        return Grade(passed, total, f"passed {total}/{total} tests", None)
    failure = _describe_failure(function, result, *first)
    return Grade(passed, total, f"passed {passed}/{total} tests; first failure: {failure}", failure)


def _describe_failure(function: str, result: SandboxResult, test: dict, outcome: dict) -> str:
    call = call_text(function, test["args"])
    if "value" in outcome:
        return f"{call} returned {shown(outcome['value'])}, expected {shown(test['expected'])}"
    if outcome["error"] != NO_RESULT:
        return f"{call} raised {outcome['error']}"
    if result.status == "timeout":
        return f"{call} did not finish in time"
    if result.status == "killed":
        return f"{call} was stopped ({result.stop_reason})"
    if result.error and not any("value" in c or c.get("error") != NO_RESULT for c in result.calls):
        return f"error: {result.error}"  # the code did not run or did not define the function
    return f"{call} ended the program (exit code {result.returncode})"
