"""Our checker for ACEBench's normal and special categories, written to ACEBench's rules (its evaluation code).

Normal (answers are function calls; the answer is `{name: {param: value}}`, or a list of alternatives, and a
name may carry a `_<n>` suffix when a function is called more than once):
  * as many calls as the answer has, with the same names the same number of times;
  * for every expected call, some model call of that name passes:
      - a call without arguments passes only for a function without parameters;
      - every required parameter is present; every given one is in the document and in the answer;
      - types follow the document (string, integer, number, boolean, array, object, ...; an int for a float);
        where the answer's value has another type than the document's, only that type is checked;
      - values: a string passes when the normalized answer is contained in the normalized value (ACEBench
        grades by containment; normalization drops spaces and `,./-_*^`, lower-cases, ' -> "); a list must
        equal the answer element-wise after normalization; an object must have the answer's keys and, key by
        key, contain the answer's value (nested objects recursively; other values compare as text by
        containment); a list of objects is compared position by position.
    Numbers and booleans are type-checked only, never compared by value: that is ACEBench's rule, and it makes
    a wrong number pass (`wrong_value` on a number is not caught; the mutation tests record it).
Special (answers are text):
  * incomplete: the output says "Missing necessary parameters" and names the function and every missing
    parameter;
  * error_param: the output says "There is incorrect value" and quotes every wrong value;
  * irrelevant: the output says "the limitations of the function".
The phrases are English in both languages, as ACEBench's prompts ask.

Where we depart from ACEBench's code (each one makes a correct answer pass that ACEBench's code can never
pass: tests/bench/test_acebench_ground_truth.py plays ACEBench's own ground truth, in both languages, through it):
  * a function document is looked up by exact name before ACEBench's substring fallback;
  * an answer key `f_2` names the function `f_2` when the document declares it (similar_api has such
    names); only otherwise is `_2` read as "the second call of `f`";
  * an empty answer list or object passes the item type check (ACEBench's check loops over the answer's
    items and fails when there are none);
  * an array whose document gives no item type is compared as a list of objects only when the answer's
    items are objects (ACEBench always assumes objects, so a list of strings never matches);
  * an unknown type fails the call instead of raising; documents that spell `parameters` as `arguments` are
    read; raw text is parsed without first deleting every space (ACEBench's decoder does, which turns
    'New York' into 'NewYork' inside lists).
"""

from __future__ import annotations

import re
from collections import Counter

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
    "list": list,
    "object": dict,
    "objectArray": list,
    "list(string)": list,
    "list(enum)": list,
    "int": int,
    "number": int,
}
ITEM_TYPED = ("array", "tuple", "list(string)", "list(enum)", "object", "objectArray")
_NORMALIZE = re.compile(r"[ ,./\-_*^]")
_SUFFIX = re.compile(r"_\d+$")

INCOMPLETE_PHRASE = "Missing necessary parameters"
ERROR_PHRASE = "There is incorrect value"
IRRELEVANT_PHRASE = "the limitations of the function"


def normalize(text: str) -> str:
    return _NORMALIZE.sub("", text).lower().replace("'", '"')


def _norm(value):
    return normalize(value) if isinstance(value, str) else value


def base_name(answer_key: str, functions: list[dict] = ()) -> str:
    """The function an answer key names: `f_2` is the second call of `f`, unless `f_2` is itself a function."""
    if any(f.get("name") == answer_key for f in functions):
        return answer_key
    return _SUFFIX.sub("", answer_key)


def parameter_schema(doc: dict) -> dict:
    return doc.get("parameters", doc.get("arguments")) or {}


def find_doc(functions: list[dict], answer_key: str) -> dict | None:
    exact = next((f for f in functions if f["name"] == base_name(answer_key, functions)), None)
    return exact or next((f for f in functions if f["name"] in answer_key), None)


def _item_type(details: dict, type_name: str, answer) -> type | None:
    """The type of a list's items (or None). Without `items` in the document, ACEBench assumes objects; we
    assume them only when the answer's items are objects (else no list of strings could ever pass)."""
    if type_name not in ITEM_TYPED:
        return None
    item = details.get("items", {}).get("type") if isinstance(details.get("items"), dict) else None
    if item is None:
        item = "string" if "string" in type_name else "enum" if "enum" in type_name else "dict"
        if item == "dict" and isinstance(answer, list) and answer and not all(isinstance(a, dict) for a in answer):
            return None
    return PY_TYPES.get(item, str) if item != "enum" else str


def type_matches(value, answer, py_type: type, item_type: type | None) -> tuple[bool, bool]:
    """(ok, is_variable), ACEBench's way: the answer's own type decides where it differs from the document."""
    answer_type = type(answer) if answer != "" else None
    is_variable = answer_type is not None and answer_type is not py_type
    if value == "true":
        value = True
    elif value == "false":
        value = False
    if type(value) is py_type:
        if item_type is None or (isinstance(answer, (list, dict)) and not answer):  # nothing to check items by
            return True, is_variable
        for option in answer if hasattr(answer, "__iter__") else []:
            if type(option) is not list or all(type_matches(v, option, item_type, None)[0] for v in value):
                return True, is_variable
        return False, is_variable
    if answer_type is not None and (type(value) is answer_type or answer == value):
        return True, True
    return False, is_variable


def dict_matches(value, answer: dict) -> bool:
    if not isinstance(value, dict) or len(value) != len(answer):
        return False
    for key, v in value.items():
        v = {"true": True, "false": False}.get(v, v) if isinstance(v, str) else v
        if key not in answer:
            return False
        expected = answer[key]
        if isinstance(expected, dict):
            if not dict_matches(v, expected):
                return False
        elif str(_norm(expected)) not in str(_norm(v)):
            return False
    return True


def list_matches(value: list, answer: list) -> bool:
    return [_norm(v) for v in value] == [_norm(a) for a in answer]


def check_call(doc: dict, call: ToolCall, answer_params: dict) -> Verdict:
    schema = parameter_schema(doc)
    if not call.arguments:
        return PASS if not schema else fail("wrong_param", "a call without arguments to a function that has some")
    if not schema:
        return fail("wrong_param", "arguments given to a function without parameters")
    properties = schema.get("properties", {})
    if answer_params == properties:
        return PASS
    if not answer_params:
        return fail("wrong_param", "the answer expects no arguments")
    if call.name != doc["name"]:
        return fail("wrong_function_name", f"expected {doc['name']!r}, got {call.name!r}")
    for param in schema.get("required", []):
        if param not in call.arguments:
            return fail("lack_args", f"missing required parameter {param!r}")
    for param, value in call.arguments.items():
        if param not in properties or param not in answer_params:
            return fail("addition_args", f"unexpected parameter {param!r}")
        details = properties[param]
        type_name = details.get("type")
        if type_name not in PY_TYPES:
            return fail("type_error", f"parameter {param!r} has a type ACEBench does not define: {type_name!r}")
        expected = answer_params[param]
        py_type, item_type = PY_TYPES[type_name], _item_type(details, type_name, expected)
        if type_name == "tuple" and type(value) is tuple:
            value = list(value)
        if type_name == "float" and type(value) is int:
            value = float(value)
        ok, is_variable = type_matches(value, expected, py_type, item_type)
        if not ok:
            return fail("type_error", f"parameter {param!r}: expected {type_name}, got {type(value).__name__}")
        if is_variable:
            continue
        if py_type is dict:
            matched = dict_matches(value, expected)
        elif py_type is list and item_type is dict:
            matched = len(value) == len(expected) and all(dict_matches(v, e) for v, e in zip(value, expected))
        elif py_type is str:
            matched = normalize(expected) in normalize(value) if isinstance(expected, str) else value == expected
        elif py_type is list:
            matched = list_matches(value, expected)
        else:  # numbers and booleans: type only (ACEBench's rule)
            matched = True
        if not matched:
            return fail("value_error", f"parameter {param!r}: {value!r} does not match {expected!r}")
    return PASS


def _check_alternative(functions: list[dict], calls: list[ToolCall], answer: dict) -> Verdict:
    if len(calls) != len(answer):
        return fail("wrong_count", f"expected {len(answer)} calls, got {len(calls)}")
    expected_names = [base_name(k, functions) for k in answer]
    if Counter(c.name for c in calls) != Counter(expected_names):
        return fail("function_mismatch", f"expected {sorted(expected_names)}, got {sorted(c.name for c in calls)}")
    for key, params in answer.items():
        doc = find_doc(functions, key)
        if doc is None:
            return fail("no_document", f"no function document for {key!r}")
        verdicts = [check_call(doc, c, params) for c in calls if c.name == base_name(key, functions)]
        if not any(v.valid for v in verdicts):
            return verdicts[-1]
    return PASS


def check_normal(functions: list[dict], calls: list[ToolCall], answer) -> Verdict:
    alternatives = answer if isinstance(answer, list) else [answer]
    verdicts = [_check_alternative(functions, calls, alt) for alt in alternatives]
    return next((v for v in verdicts if v.valid), verdicts[0])


def check_special(category: str, text: str, answer) -> Verdict:
    if category == "special_irrelevant":
        return PASS if IRRELEVANT_PHRASE in text else fail("error_detection", "did not say the functions cannot help")
    phrase = INCOMPLETE_PHRASE if category == "special_incomplete" else ERROR_PHRASE
    if phrase not in text:
        return fail("error_detection", f"did not say {phrase!r}")
    for name, values in answer.items():
        if category == "special_incomplete" and name not in text:
            return fail("error_correction", f"did not name the function {name!r}")
        for value in values:
            if str(value) not in text:
                return fail("error_correction", f"did not name {value!r}")
    return PASS
