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
        if (
            isinstance(cur, dict)
            and key in cur
            or isinstance(cur, list)
            and isinstance(key, int)
            and -len(cur) <= key < len(cur)
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
        return isinstance(found, (list, dict, str)) and check["value"] in found
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
    "eq": ("path", "value"), "absent": ("path",), "present": ("path",), "contains": ("path", "value"),
    "count": ("path", "value"), "has": ("path", "value"), "answer_contains": ("value",), "answer_eq": ("value",),
}
_OPTIONAL_KEYS = {"has": ("n", "like")}


def check_error(check: Any) -> str | None:
    """Why ``check`` is not a well-formed check (None when it is): lets task files fail at load, naming the
    check, instead of in the middle of a rollout."""
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
    return None


def evaluate(checks: list[dict], state: dict, answer: str | None) -> tuple[int, int]:
    """(passed, total) for a list of checks on the final state and answer."""
    passed = sum(1 for c in checks if check_passes(c, state, answer))
    return passed, len(checks)
