"""Our checker for BFCL's single-turn categories, written to BFCL's published rules (its AST checker).

Per call, against one expected call `{name: {param: [acceptable values]}}`:
  1. the function name matches the document's name exactly;
  2. every parameter the document marks required is present;
  3. every given parameter is in the document and in the answer (anything else is an unexpected parameter);
  4. types follow the document (string, integer, float, boolean, array, tuple, dict, any); an int is accepted
     for a float; a tuple for a tuple; array/tuple items are type-checked one level deep. Where the answer's
     values have another type than the document's (BFCL writes "variables" that way), the answer's type rules;
  5. values: strings compare after normalization (spaces and `,./-_*^` removed, lower case, ' -> "), lists
     element-wise with the same normalization, dicts key by key against their own acceptable lists, lists of
     dicts position by position, anything else by equality with one acceptable value;
  6. a parameter of the answer that was not given must be optional there (its acceptable values contain "").

Per test case: `simple` takes exactly one call; `multiple` one call, checked against the document of the
expected function; `parallel*` as many calls as expected, matched in any order; `irrelevance` passes only when
no call is made, `live_relevance` only when some call is made.

Where we depart: parallel calls are matched with a maximum bipartite matching, while BFCL matches greedily
(first unmatched call that fits, expected calls in order). The two differ only when one call fits two expected
calls; the agreement script counts such cases. Values never go through `eval` (see tool_calls.literal_value).
"""

from __future__ import annotations

import re

from lopd_core.bench.bfcl.data import RELEVANCE_CATEGORIES
from lopd_core.bench.results import PASS, Verdict, fail
from lopd_core.bench.tool_calls import ToolCall

PY_TYPES = {
    "string": str,
    "integer": int,
    "float": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "any": str,
}
ITEM_TYPED = ("array", "tuple")  # their items are type-checked one level deep
_NORMALIZE = re.compile(r"[ ,./\-_*^]")


def normalize(text: str) -> str:
    """`April 1, 2024` and `april 1 2024` compare equal: BFCL does not grade punctuation or case."""
    return _NORMALIZE.sub("", text).lower().replace("'", '"')


def _norm(value):
    return normalize(value) if type(value) is str else value


def _answer_type(acceptable: list):
    """The type of the first non-optional acceptable value (None when all are optional)."""
    for value in acceptable:
        if value != "":
            return type(value)
    return None


def type_matches(value, acceptable: list, py_type: type, item_type: type | None) -> tuple[bool, bool]:
    """(ok, is_variable). is_variable: the answer holds another type than the document says, so the value is
    compared as-is instead of through the type-specific comparison."""
    answer_type = _answer_type(acceptable)
    is_variable = answer_type is not None and answer_type is not py_type
    if type(value) is py_type:
        if item_type is None:
            return True, is_variable
        for option in acceptable:  # items must fit at least one acceptable list (non-list options fit trivially)
            if type(option) is not list or all(type_matches(v, option, item_type, None)[0] for v in value):
                return True, is_variable
        return False, is_variable
    if answer_type is not None and type(value) is answer_type:
        return True, True
    return False, is_variable


def dict_matches(value, options: list) -> bool:
    for option in options:
        if option == "" or not isinstance(option, dict) or not isinstance(value, dict):
            continue
        given_ok = all(key in option and _norm(v) in [_norm(a) for a in option[key]] for key, v in value.items())
        missing_ok = all(key in value or "" in accepted for key, accepted in option.items())
        if given_ok and missing_ok:
            return True
    return False


def list_of_dicts_matches(value: list, options: list) -> bool:
    for option in options:
        sized = hasattr(option, "__len__") and len(value) == len(option)
        if sized and all(dict_matches(v, [o]) for v, o in zip(value, option)):
            return True
    return False


def list_matches(value: list, options: list) -> bool:
    normalized = [_norm(v) for v in value]
    return any(normalized == [_norm(a) for a in option] for option in options if isinstance(option, (list, str)))


def string_matches(value: str, options: list) -> bool:
    return normalize(value) in [normalize(a) for a in options if type(a) is str]


def check_call(doc: dict, call: ToolCall, expected: dict) -> Verdict:
    """One model call against one expected call, under the function document `doc`."""
    (expected_params,) = expected.values()
    if call.name != doc["name"]:
        return fail("wrong_func_name", f"expected {doc['name']!r}, got {call.name!r}")
    schema = doc.get("parameters", {})
    properties, required = schema.get("properties", {}), schema.get("required", [])
    args = call.arguments
    for param in required:
        if param not in args:
            return fail("missing_required", f"missing required parameter {param!r}")
    for param, value in args.items():
        if param not in properties or param not in expected_params:
            return fail("unexpected_param", f"unexpected parameter {param!r}")
        acceptable = expected_params[param]
        type_name = properties[param].get("type")
        if type_name not in PY_TYPES:
            return fail("unsupported_type", f"parameter {param!r} has a type we do not check: {type_name!r}")
        py_type = PY_TYPES[type_name]
        item_type = PY_TYPES.get(properties[param].get("items", {}).get("type")) if type_name in ITEM_TYPED else None
        if type_name == "tuple" and type(value) is tuple:
            value = list(value)
        if type_name == "float" and type(value) is int:
            value = float(value)
        ok, is_variable = type_matches(value, acceptable, py_type, item_type)
        if not ok:
            return fail(
                "type_error", f"parameter {param!r}: expected {type_name}, got {type(value).__name__} ({value!r})"
            )
        if is_variable:
            matched = value in acceptable
        elif py_type is dict:
            matched = dict_matches(value, acceptable)
        elif py_type is list and item_type is dict:
            matched = list_of_dicts_matches(value, acceptable)
        elif py_type is str:
            matched = string_matches(value, acceptable)
        elif py_type is list:
            matched = list_matches(value, acceptable)
        else:
            matched = value in acceptable
        if not matched:
            return fail("value_error", f"parameter {param!r}: {value!r} is not one of {acceptable!r}")
    for param, acceptable in expected_params.items():
        if param not in args and "" not in acceptable:
            return fail("missing_optional", f"parameter {param!r} of the answer is not given and not optional")
    return PASS


def _find_doc(functions: list[dict], name: str) -> dict | None:
    return next((f for f in functions if f["name"] == name), None)


def _max_matching(fits: list[list[bool]]) -> int:
    """Size of a maximum matching of expected calls (rows) to model calls (columns) — augmenting paths."""
    owner: dict[int, int] = {}

    def assign(row: int, seen: set[int]) -> bool:
        for col, ok in enumerate(fits[row]):
            if ok and col not in seen:
                seen.add(col)
                if col not in owner or assign(owner[col], seen):
                    owner[col] = row
                    return True
        return False

    return sum(assign(row, set()) for row in range(len(fits)))


def check_parallel(functions: list[dict], calls: list[ToolCall], answer: list[dict]) -> Verdict:
    if len(calls) != len(answer):
        return fail("wrong_count", f"expected {len(answer)} calls, got {len(calls)}")
    fits = []
    for expected in answer:
        doc = _find_doc(functions, next(iter(expected)))
        fits.append([doc is not None and check_call(doc, c, expected).valid for c in calls])
    matched = _max_matching(fits)
    if matched < len(answer):
        return fail("no_match", f"only {matched} of {len(answer)} expected calls are matched by a model call")
    return PASS


def check_single_turn(category: str, functions: list[dict], calls: list[ToolCall], answer: list | None) -> Verdict:
    """The verdict of BFCL's rules for one single-turn test case."""
    if category in RELEVANCE_CATEGORIES:
        if category == "live_relevance":
            return PASS if calls else fail("relevance_no_call", "expected a function call, got none")
        return fail("irrelevance_call", f"expected no call, got {len(calls)}") if calls else PASS
    if "parallel" in category:
        return check_parallel(functions, calls, answer)
    if len(calls) != 1:
        return fail("wrong_count", f"expected 1 call, got {len(calls)}")
    if "multiple" in category:
        doc = _find_doc(functions, next(iter(answer[0])))
        if doc is None:
            return fail("no_document", f"no function document for the expected {next(iter(answer[0]))!r}")
        return check_call(doc, calls[0], answer[0])
    return check_call(functions[0], calls[0], answer[0])
