"""Success checks as data, evaluated by one function.

A check is a small JSON dict (no lambdas) so that tasks serialise. ``path`` addresses the
environment state ``{domain: domain_state}`` by keys (list indices as ints).

ops:
  eq        value at path == value
  absent    path does not exist
  present   path exists
  contains  container at path contains value (list element / dict key / substring)
  count     len(container at path) == value
  has       list (or dict values) at path has an element whose fields match ``value``;
            with ``n``: exactly n such elements; with ``like`` ({field: text}): those fields
            must also contain the text (as answer_contains does)
  answer_contains   normalised answer contains normalised value as a whole token run
  answer_eq         normalised answer == normalised value
"""

from __future__ import annotations

import re
from typing import Any

_MISSING = object()


def normalise(text: Any) -> str:
    s = " ".join(str(text).lower().split())
    return s.strip().rstrip(".!").strip().strip("'\"").strip()


def get_path(state: Any, path: list) -> Any:
    cur = state
    for key in path:
        if (isinstance(cur, dict) and key in cur) or (
            isinstance(cur, list) and isinstance(key, int) and -len(cur) <= key < len(cur)
        ):
            cur = cur[key]
        else:
            return _MISSING
    return cur


def _token_in(needle: Any, hay: Any) -> bool:
    value = re.escape(normalise(needle))
    return re.search(rf"(?<![a-z0-9]){value}(?![a-z0-9])", normalise(hay)) is not None


def _matches(item: Any, pattern: dict, like: dict) -> bool:
    return (
        isinstance(item, dict)
        and all(k in item and item[k] == v for k, v in pattern.items())
        and all(k in item and _token_in(v, item[k]) for k, v in like.items())
    )


def _contains(found: Any, value: Any) -> bool:
    """`value in found` where the operands' types allow it: a substring of a string, a key of an object, an
    element of a list. Any other pairing is a failed check, never a TypeError at the end of an episode (the
    state a tool leaves may hold another type than the task file's initial state)."""
    if isinstance(found, str):
        return isinstance(value, str) and value in found
    if isinstance(found, dict):
        try:
            return value in found
        except TypeError:  # an unhashable value (a list, an object) is never a key
            return False
    if isinstance(found, list):
        return value in found
    return False


def check_passes(check: dict, state: dict, answer: str | None) -> bool:
    op = check["op"]
    if op == "answer_contains":
        return answer is not None and _token_in(check["value"], answer)
    if op == "answer_eq":
        return answer is not None and normalise(answer) == normalise(check["value"])
    found = get_path(state, check["path"])
    if op == "absent":
        return found is _MISSING
    if op == "present":
        return found is not _MISSING
    if found is _MISSING:
        return False
    if op == "eq":
        return found == check["value"] and type(found) is type(check["value"])
    if op == "contains":
        return _contains(found, check["value"])
    if op == "count":
        return isinstance(found, (list, dict)) and len(found) == check["value"]
    if op == "has":
        items = list(found.values()) if isinstance(found, dict) else found
        if not isinstance(items, list):
            return False
        hits = sum(1 for item in items if _matches(item, check["value"], check.get("like", {})))
        return hits == check["n"] if "n" in check else hits >= 1
    raise ValueError(f"unknown check op: {op}")


# What each op reads besides "op" (lists of alternatives are optional keys).
CHECK_KEYS = {
    "eq": ("path", "value"),
    "absent": ("path",),
    "present": ("path",),
    "contains": ("path", "value"),
    "count": ("path", "value"),
    "has": ("path", "value"),
    "answer_contains": ("value",),
    "answer_eq": ("value",),
}
_OPTIONAL_KEYS = {"has": ("n", "like")}


_SCALAR = (str, int, float)  # what an answer is compared with, as text (bool and null are not answers)


def _operand_error(op: str, value: Any, found: Any) -> str | None:
    """Why `value` cannot be compared by `op` with what the path holds in the initial state (`found`, or
    _MISSING when the path is not there yet), None when it can."""
    if op in ("answer_contains", "answer_eq"):
        if not isinstance(value, _SCALAR) or isinstance(value, bool):
            return f"check {op!r}: value must be a string or a number (the answer is text), got {value!r}"
        return None
    if found is _MISSING or op in ("eq", "absent", "present"):
        return None
    kind = type(found).__name__
    if op == "contains":
        if isinstance(found, (str, dict)) and not isinstance(value, str):
            what = "a substring" if isinstance(found, str) else "a key"
            return (
                f"check 'contains': value {value!r} cannot be {what} of the {kind} at path "
                f"{found!r:.60}: expected a string"
            )
        if not isinstance(found, (str, dict, list)):
            return f"check 'contains': the path holds a {kind} ({found!r:.60}), expected a list, object or string"
    if op in ("count", "has") and not isinstance(found, (list, dict)):
        return f"check {op!r}: the path holds a {kind} ({found!r:.60}), expected a list or object"
    return None


def check_error(check: Any, state: Any = None) -> str | None:
    """Why ``check`` is not a well-formed check (None when it is): lets task files fail at load, naming the
    check, instead of in the middle of a rollout. With the task's initial ``state``, the operands' types are
    checked against what the check's path holds there."""
    if not isinstance(check, dict) or check.get("op") not in CHECK_KEYS:
        op = check.get("op") if isinstance(check, dict) else None
        return f"unknown check op {op!r}; known: {', '.join(CHECK_KEYS)}"
    op = check["op"]
    allowed = {"op", *CHECK_KEYS[op], *_OPTIONAL_KEYS.get(op, ())}
    missing = [k for k in CHECK_KEYS[op] if k not in check]
    if missing or set(check) - allowed:
        return f"check {op!r} needs {', '.join(CHECK_KEYS[op])} (got {', '.join(sorted(check))})"
    path = check.get("path", [])
    if not isinstance(path, list) or not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
        return f"check {op!r}: path must be a list of keys (strings) and list indices (integers)"
    if op == "count" and (not isinstance(check["value"], int) or isinstance(check["value"], bool)):
        return "check 'count': value must be an integer"
    if op == "has" and (not isinstance(check["value"], dict) or not isinstance(check.get("like", {}), dict)):
        return "check 'has': value (and like) must be objects of fields"
    if op == "count" and check["value"] < 0:
        return "check 'count': value must be >= 0"
    if (
        op == "has"
        and "n" in check
        and (not isinstance(check["n"], int) or isinstance(check["n"], bool) or check["n"] < 0)
    ):
        return "check 'has': n must be an integer >= 0"
    if op == "has" and not all(
        isinstance(v, _SCALAR) and not isinstance(v, bool) for v in check.get("like", {}).values()
    ):
        return "check 'has': like must map fields to strings or numbers (matched as text)"
    found = get_path(state, path) if state is not None and "path" in check else _MISSING
    return _operand_error(op, check.get("value"), found)


def evaluate(checks: list[dict], state: dict, answer: str | None) -> tuple[int, int]:
    """(passed, total) for a list of checks on the final state and answer."""
    passed = sum(1 for c in checks if check_passes(c, state, answer))
    return passed, len(checks)
