"""BFCL ground truth as predictions: what a perfect model would have answered.

Single-turn: for each expected call, every parameter the function document declares, with its first acceptable
value that is not the optional marker "" (inside dicts and lists of dicts, the same rule key by key). A
parameter is left out when it has no such value, or when the document does not declare it (a slip in a few
answers, e.g. parallel_multiple_26's `type`). A handful of live answers cannot be met by any call (a required
parameter with no acceptable value, or a parameter the document does not declare); they fail under BFCL's
checker as under ours, and `unsatisfiable_ids` lists them.

Multi-turn: the ground-truth call strings of each turn. Relevance categories: no call for irrelevance, some
call for live_relevance (its entries carry no answer, so we call the first function with placeholder values
for its required parameters; only "a call was made" is graded).

These feed the evidence that the checker accepts every ground truth and the mutation suite.
"""

from __future__ import annotations

from lopd_core.bench.bfcl.data import BfclEntry
from lopd_core.bench.tool_calls import ToolCall


def _first(options: list):
    """The first acceptable value that is not the optional marker ("" when there is none)."""
    return next((o for o in options if o != ""), "") if isinstance(options, list) else options


def _reduce_dict(option: dict) -> dict:
    """{key: [acceptable...]} -> {key: first acceptable}, leaving out keys with no non-optional choice."""
    return {k: _first(v) for k, v in option.items() if _first(v) != ""}


def first_acceptable(options: list, schema: dict):
    value = _first(options)
    type_name = schema.get("type")
    if type_name == "dict" and isinstance(value, dict):
        return _reduce_dict(value)
    item_type = schema.get("items", {}).get("type")
    if type_name == "array" and item_type == "dict" and isinstance(value, list):
        return [_reduce_dict(d) if isinstance(d, dict) else d for d in value]
    return value


def expected_to_call(expected: dict, functions: list[dict]) -> ToolCall:
    ((name, params),) = expected.items()
    doc = next((f for f in functions if f["name"] == name), {})
    properties = doc.get("parameters", {}).get("properties", {})
    arguments = {
        p: first_acceptable(options, properties[p])
        for p, options in params.items()
        if p in properties and _first(options) != ""
    }
    return ToolCall(name, arguments)


def unsatisfiable_ids(entries: list[BfclEntry]) -> list[str]:
    """Single-turn cases no call can pass under BFCL's rules: the answer leaves a required parameter without an
    acceptable value, or demands a parameter the function document does not declare."""
    bad = []
    for entry in entries:
        for expected in [] if entry.multi_turn else entry.answer or []:
            ((name, params),) = expected.items()
            schema = next((f for f in entry.functions if f["name"] == name), {}).get("parameters", {})
            properties = schema.get("properties", {})
            if any(p not in params or _first(params[p]) == "" for p in schema.get("required", [])) or any(
                p not in properties and "" not in options for p, options in params.items()
            ):
                bad.append(entry.id)
                break
    return bad


def placeholder_call(functions: list[dict]) -> ToolCall:
    doc = functions[0]
    schema = doc.get("parameters", {})
    dummy = {"string": "x", "integer": 1, "float": 1.0, "boolean": True, "array": [], "dict": {}}
    return ToolCall(
        doc["name"],
        {p: dummy.get(schema.get("properties", {}).get(p, {}).get("type"), "x") for p in schema.get("required", [])},
    )


def ground_truth_calls(entry: BfclEntry) -> list[ToolCall]:
    if entry.category == "live_relevance":
        return [placeholder_call(entry.functions)]
    if entry.answer is None:  # irrelevance
        return []
    return [expected_to_call(expected, entry.functions) for expected in entry.answer]


def ground_truth_prediction(entry: BfclEntry) -> dict:
    """The ground truth as one record of the predictions JSONL `lopd bench score bfcl` reads."""
    if entry.multi_turn:
        return {"id": entry.id, "turns": [list(turn) for turn in entry.answer]}
    return {"id": entry.id, "calls": [c.to_dict() for c in ground_truth_calls(entry)]}
