"""Tool declaration, schema derivation, argument validation and the call text protocol.

A tool is a method marked with ``@tool``. Its JSON schema is derived once, at decoration
time, from the signature (type hints -> JSON types, required = no default) and from the
docstring (first line = description, ``Args:`` lines = parameter descriptions). Dispatch never
looks attributes up by a name coming from model output: environments build an explicit
``name -> bound callable`` table from the declared tools and validate arguments against the
schema with the small validator below before calling.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

TOOL_SPEC_ATTR = "__tool_spec__"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# Every declared tool's schema, by tool name (filled as domain classes are defined).
ALL_SCHEMAS: dict[str, dict] = {}


class ToolError(Exception):
    """Raised by a tool to produce an ``{"error": msg}`` observation."""


def tool(fn: Callable) -> Callable:
    """Mark a method as a tool and attach its derived JSON schema."""
    setattr(fn, TOOL_SPEC_ATTR, derive_schema(fn))
    return fn


def _json_type(hint: Any) -> dict:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # `X | None`: an optional X (the model passes an X or nothing)
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _json_type(inner[0])
    if origin is Literal:
        values = list(typing.get_args(hint))
        base = _json_type(type(values[0]))
        return {**base, "enum": values}
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return {"type": "array", "items": _json_type(args[0]) if args else {}}
    if origin is dict or hint is dict:
        return {"type": "object"}
    mapping = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array"}
    if hint in mapping:
        return {"type": mapping[hint]}
    raise TypeError(f"unsupported tool parameter type: {hint!r}")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    lines = inspect.cleandoc(doc or "").splitlines()
    description = lines[0].strip() if lines else ""
    params: dict[str, str] = {}
    in_args = False
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if in_args:
            if re.match(r"^[A-Z]\w*:$", stripped):
                in_args = False  # another section (Returns:, Raises:, ...) begins
                continue
            m = re.match(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
            if m:
                params[m.group(1)] = m.group(2).strip()
    return description, params


def derive_schema(fn: Callable, *, skip: tuple[str, ...] = ("self",)) -> dict:
    """JSON schema of a tool from its signature and docstring. Parameters in ``skip`` are supplied by the
    environment, not the model (a method's ``self``; a declarative tool's ``state``), so they are not in it."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    description, param_docs = _parse_docstring(fn.__doc__ or "")
    properties: dict[str, dict] = {}
    required: list[str] = []
    for pname, param in sig.parameters.items():
        if pname in skip:
            continue
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs are not allowed")
        prop = dict(_json_type(hints[pname]))
        if pname in param_docs:
            prop["description"] = param_docs[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            prop["default"] = param.default
        properties[pname] = prop
    return {
        "name": fn.__name__,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        },
    }


def _type_ok(value: Any, prop: dict) -> bool:
    t = prop.get("type")
    if t == "string":
        return isinstance(value, str)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        items = prop.get("items") or {}
        return isinstance(value, list) and all(not items or _type_ok(v, items) for v in value)
    return True


def validate_arguments(schema: dict, arguments: Any) -> str | None:
    """Return an error message, or None when ``arguments`` fit the tool's schema."""
    if not isinstance(arguments, dict):
        return "arguments must be an object"
    params = schema["parameters"]
    props = params["properties"]
    for key in arguments:
        if key not in props:
            return f"unexpected argument: {key}"
    for key in params["required"]:
        if key not in arguments:
            return f"missing argument: {key}"
    for key, value in arguments.items():
        prop = props[key]
        if not _type_ok(value, prop):
            return f"bad type for {key}: expected {prop.get('type')}"
        if "enum" in prop and value not in prop["enum"]:
            return f"bad value for {key}"
    return None


def ordered_arguments(name: str, arguments: dict) -> dict:
    """Arguments re-ordered to the tool's signature order (unknown keys keep their place at the end)."""
    schema = ALL_SCHEMAS.get(name)
    if schema is None:
        return dict(arguments)
    order = list(schema["parameters"]["properties"])
    out = {k: arguments[k] for k in order if k in arguments}
    out.update({k: v for k, v in arguments.items() if k not in out})
    return out


def format_call(name: str, arguments: dict) -> str:
    """Canonical text of a tool call, exactly as the model should emit it."""
    payload = {"name": name, "arguments": ordered_arguments(name, arguments)}
    return f"{CALL_OPEN}{json.dumps(payload)}{CALL_CLOSE}"


def signature_text(schema: dict) -> str:
    """Compact signature for the system prompt, e.g. ``bank_transfer(src,dst,amount)``."""
    parts = []
    for pname in schema["parameters"]["properties"]:
        parts.append(pname if pname in schema["parameters"]["required"] else pname + "?")
    return f"{schema['name']}({','.join(parts)})"


class _NonFinite(ValueError):
    pass


def _not_a_number(name: str):
    """Python's json reads NaN, Infinity and -Infinity, which JSON has not: a tool never gets them as numbers."""
    raise _NonFinite(name)


def _finite(value):
    """The same JSON value with every non-finite float written as a string ("NaN", "Infinity"): the escape for a
    result that holds one, so the observation stays JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def parse_action(text: str) -> tuple[str, Any, Any]:
    """Classify one assistant message.

    Returns ``("answer", text, None)`` for a message without a tool call,
    ``("call", name, arguments)`` for a well-formed call, ``("error", message, None)`` otherwise.
    """
    if not isinstance(text, str):
        return ("error", "action must be text", None)
    start = text.find(CALL_OPEN)
    if start < 0:
        return ("answer", text, None)
    end = text.find(CALL_CLOSE, start)
    if end < 0:
        return ("error", "unclosed tool_call", None)
    if text.find(CALL_OPEN, end) >= 0:
        return ("error", "one tool call per turn", None)
    body = text[start + len(CALL_OPEN) : end].strip()
    try:
        payload = json.loads(body, parse_constant=_not_a_number)
    except _NonFinite:
        return ("error", "NaN and Infinity are not JSON numbers: arguments must be finite", None)
    except (json.JSONDecodeError, ValueError, RecursionError):
        return ("error", "malformed json", None)
    if not isinstance(payload, dict):
        return ("error", "tool call must be an object", None)
    extra = set(payload) - {"name", "arguments"}
    if extra:
        return ("error", f"unexpected field: {min(extra)}", None)
    name = payload.get("name")
    if not isinstance(name, str):
        return ("error", "missing tool name", None)
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        return ("error", "arguments must be an object", None)
    return ("call", name, arguments)


def parse_calls(text: str) -> tuple[str, list[tuple[str, dict]]] | None:
    """Every call of one assistant message that may hold several (a chat API's parallel tool calls; an
    environment takes one per turn, `parse_action`): the text outside the calls, stripped, and the calls in order
    as (name, arguments). No call: (text, []). None when a call is malformed (unclosed, bad JSON, a stray closing
    tag): the message is then text, as `parse_action` reports an error."""
    content, calls, at = [], [], 0
    while (start := text.find(CALL_OPEN, at)) >= 0:
        end = text.find(CALL_CLOSE, start)
        if end < 0:
            return None
        kind, name, arguments = parse_action(text[start : end + len(CALL_CLOSE)])
        if kind != "call":
            return None
        content.append(text[at:start])
        calls.append((name, arguments))
        at = end + len(CALL_CLOSE)
    content.append(text[at:])
    if any(CALL_CLOSE in piece for piece in content):
        return None
    return (" ".join(p.strip() for p in content if p.strip()) if calls else text), calls


def _id_last(value):
    """The same JSON value with every object's `id` moved after its other fields."""
    if isinstance(value, dict):
        fields = {k: _id_last(v) for k, v in value.items() if k != "id"}
        return {**fields, "id": value["id"]} if "id" in value else fields
    if isinstance(value, list):
        return [_id_last(v) for v in value]
    return value


def observation_text(payload: dict) -> str:
    """Observation text (``{"result": ...}`` or ``{"error": ...}``) shown to the agent.

    A record names itself before its id (`{"label": "savings", "id": "a73"}`). An agent reads left to right: a
    lookup by label then finds the id right after the label it matched. With the id first, the id's token can
    never see its own label, and a small causal model must learn a second hop back; with the id first, some
    builds of the embedded base never learned the lookup at all (`probes/failure_probe.py` measures it).
    """
    try:
        return json.dumps(_id_last(payload), allow_nan=False)
    except ValueError:  # a NaN or Infinity in a result: escaped as a string, never written as bare NaN
        return json.dumps(_finite(_id_last(payload)), allow_nan=False)
