"""The mutation suite: ground-truth answers broken in one known way, with the verdict BFCL's rules give them.

Single-turn kinds, applied to the ground-truth calls of a test case (each only where it applies):
  wrong_function    the first call names a function that is not offered                      -> fail
  missing_required  the first call drops a parameter its document requires                   -> fail
  wrong_type        a parameter gets a value of another type (string <-> number, ...)         -> fail
  wrong_value       a parameter gets a value of the right type that no answer accepts         -> fail
  extra_call        the first call is made twice                                             -> fail
  dropped_call      the last call is left out                                                -> fail
  swapped_order     the calls in reverse order (parallel categories only: order is free)      -> pass
  irrelevance cases get a call (-> fail); live_relevance cases get none (-> fail).
Multi-turn kinds act on one turn's call strings; whether they fail depends on the state they leave (a dropped
read-only call whose result shows up elsewhere still passes), so their verdict is left open (None) and is
compared with BFCL's own checking instead (scripts/bfcl_agreement.py). Hand-made multi-turn cases with known
verdicts live in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from lopd_core.bench.bfcl.answers import ground_truth_calls
from lopd_core.bench.bfcl.checker import PY_TYPES, normalize
from lopd_core.bench.bfcl.data import BfclEntry
from lopd_core.bench.tool_calls import ToolCall, parse_call_string


@dataclass(frozen=True)
class Mutation:
    kind: str
    prediction: dict  # a predictions record, as `lopd bench score bfcl` reads it
    expected_valid: bool | None  # the verdict BFCL's rules give; None where the rules leave it to the state


def _record(entry: BfclEntry, calls: list[ToolCall]) -> dict:
    return {"id": entry.id, "calls": [c.to_dict() for c in calls]}


def _doc(entry: BfclEntry, name: str) -> dict:
    return next((f for f in entry.functions if f["name"] == name), {})


def _expected_params(entry: BfclEntry, index: int) -> dict:
    return next(iter(entry.answer[index].values()))


def _swap_type(value, type_name: str):
    """A value of another type than `type_name` asks for (None when we have no clear one)."""
    return {
        "string": 12345,
        "any": 12345,
        "integer": str(value),
        "float": str(value),
        "boolean": str(value).lower(),
        "array": str(value),
        "tuple": str(value),
        "dict": str(value),
    }.get(type_name)


def _other_value(value, acceptable: list):
    """A value of the same type that no acceptable value matches (None when we cannot be sure)."""
    if type(value) is str:
        candidate = value + " zq"
        return None if normalize(candidate) in [normalize(a) for a in acceptable if type(a) is str] else candidate
    if type(value) is bool:
        candidate = not value
    elif type(value) in (int, float):
        candidate = value + 1000
    else:
        return None
    return None if candidate in acceptable else candidate


def _answer_type_is_doc_type(acceptable: list, type_name: str) -> bool:
    first = next((a for a in acceptable if a != ""), None)
    py = PY_TYPES.get(type_name)
    return first is not None and (type(first) is py or (py is float and type(first) is int))


def _param_mutation(entry: BfclEntry, calls: list[ToolCall], make) -> list[ToolCall] | None:
    """Replace the first parameter `make(value, type_name, acceptable)` has an answer for; None if none does."""
    for index, call in enumerate(calls):
        properties = _doc(entry, call.name).get("parameters", {}).get("properties", {})
        acceptable_by_param = _expected_params(entry, index)  # ground-truth calls follow the answer's order
        for param, value in call.arguments.items():
            type_name = properties.get(param, {}).get("type")
            acceptable = acceptable_by_param.get(param, [])
            if type_name not in PY_TYPES or not _answer_type_is_doc_type(acceptable, type_name):
                continue
            new = make(value, type_name, acceptable)
            if new is not None:
                changed = ToolCall(call.name, {**call.arguments, param: new})
                return calls[:index] + [changed] + calls[index + 1 :]
    return None


def _relevance_mutations(entry: BfclEntry) -> list[Mutation]:
    if entry.category == "live_relevance":
        return [Mutation("no_call", _record(entry, []), False)]
    doc = entry.functions[0] if entry.functions else {"name": "lookup"}  # some live cases offer no function
    call = ToolCall(doc["name"], {p: "x" for p in doc.get("parameters", {}).get("required", [])})
    return [Mutation("extra_call", _record(entry, [call]), False)]


def single_turn_mutations(entry: BfclEntry) -> list[Mutation]:
    if entry.answer is None:
        return _relevance_mutations(entry)
    calls = ground_truth_calls(entry)
    out = [
        Mutation(
            "wrong_function", _record(entry, [ToolCall(calls[0].name + "_v2", calls[0].arguments)] + calls[1:]), False
        )
    ]
    required = _doc(entry, calls[0].name).get("parameters", {}).get("required", [])
    present = [p for p in required if p in calls[0].arguments]
    if present:
        dropped = {k: v for k, v in calls[0].arguments.items() if k != present[0]}
        out.append(Mutation("missing_required", _record(entry, [ToolCall(calls[0].name, dropped)] + calls[1:]), False))
    for kind, make in (
        ("wrong_type", lambda v, t, a: _swap_type(v, t)),
        ("wrong_value", lambda v, t, a: _other_value(v, a)),
    ):
        mutated = _param_mutation(entry, calls, make)
        if mutated is not None:
            out.append(Mutation(kind, _record(entry, mutated), False))
    out.append(Mutation("extra_call", _record(entry, calls + [calls[0]]), False))
    if len(calls) > 1:
        out.append(Mutation("dropped_call", _record(entry, calls[:-1]), False))
        if "parallel" in entry.category and calls[::-1] != calls:
            out.append(Mutation("swapped_order", _record(entry, calls[::-1]), True))
    return out


def _turns(entry: BfclEntry, turn: int, calls: list[str]) -> dict:
    turns = [list(t) for t in entry.answer]
    turns[turn] = calls
    return {"id": entry.id, "turns": turns}


def multi_turn_mutations(entry: BfclEntry) -> list[Mutation]:
    """One mutation of each kind on the first turn with a ground truth (verdicts left open)."""
    turn = next((i for i, t in enumerate(entry.answer) if t), None)
    if turn is None:
        return []
    calls = list(entry.answer[turn])
    first = parse_call_string(calls[0])
    out = [
        Mutation(
            "wrong_function",
            _turns(
                entry,
                turn,
                [ToolCall(first.name + "_v2", first.arguments, first.positional).python_source()] + calls[1:],
            ),
            None,
        ),
        Mutation("dropped_call", _turns(entry, turn, calls[:-1]), None),
        Mutation("extra_call", _turns(entry, turn, calls + [calls[-1]]), None),
        Mutation("empty_turn", _turns(entry, turn, []), False),
    ]
    if first.arguments:
        param, value = next(iter(first.arguments.items()))
        for kind, new in (
            ("wrong_value", _other_value(value, [value])),
            ("wrong_type", _swap_type(value, "string") if type(value) is str else str(value)),
        ):
            if new is not None:
                changed = ToolCall(first.name, {**first.arguments, param: new}, first.positional).python_source()
                out.append(Mutation(kind, _turns(entry, turn, [changed] + calls[1:]), None))
        missing = ToolCall(first.name, {k: v for k, v in first.arguments.items() if k != param}, first.positional)
        out.append(Mutation("missing_param", _turns(entry, turn, [missing.python_source()] + calls[1:]), None))
    if len(calls) > 1 and calls[0] != calls[1]:
        out.append(Mutation("swapped_order", _turns(entry, turn, [calls[1], calls[0]] + calls[2:]), None))
    return out


def mutations(entry: BfclEntry) -> list[Mutation]:
    return multi_turn_mutations(entry) if entry.multi_turn else single_turn_mutations(entry)
