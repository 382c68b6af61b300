"""Tools of a declarative environment: plain functions on a state dict, or JSON-schema specs with a function.

A tool is either

- a function ``fn(state, arg1, ...)``: its schema is derived from the signature (type hints -> JSON types,
  required = no default) and the docstring (first line = description, ``Args:`` lines = parameters), as
  toolworld derives its methods' (toolworld/tools.py); ``state`` is the episode's state dict, which the tool
  reads and changes in place; or
- ``ToolSpec(schema, fn)``: a JSON schema written out (``{"name", "description", "parameters": {"type":
  "object", "properties", "required"}}``, the function-calling format) and the function that implements it.

``tool_table`` turns the declared list into the explicit ``name -> Tool`` table that is the only dispatch path:
a name the model writes is looked up there and nowhere else. Argument types a schema may use are the ones the
validator checks: string, integer, number, boolean, array (with ``items``), object, and ``enum``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..toolworld.tools import derive_schema, validate_arguments

TYPES = ("string", "integer", "number", "boolean", "array", "object")


@dataclass(frozen=True)
class ToolSpec:
    """A tool whose JSON schema is given rather than derived; ``fn(state, **arguments)`` implements it."""

    schema: dict
    fn: Callable


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict
    fn: Callable


def _property_error(where: str, prop) -> str | None:
    if not isinstance(prop, dict) or prop.get("type") not in TYPES:
        return f"{where}: type must be one of {', '.join(TYPES)}"
    if "enum" in prop and not (isinstance(prop["enum"], list) and prop["enum"]):
        return f"{where}: enum must be a non-empty list"
    if prop["type"] == "array" and "items" in prop and prop["items"]:
        return _property_error(f"{where}.items", prop["items"])
    return None


def schema_error(schema) -> str | None:
    """Why ``schema`` is not a tool schema the validator can enforce (None when it is)."""
    if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or not schema["name"].isidentifier():
        return "a tool schema needs a `name` that is an identifier"
    params = schema.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(params.get("properties"), dict):
        return f"tool {schema['name']}: parameters must be {{'type': 'object', 'properties': {{...}}}}"
    for pname, prop in params["properties"].items():
        why = _property_error(f"tool {schema['name']}: parameter {pname}", prop)
        if why:
            return why
    required = params.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(params["properties"]):
        return f"tool {schema['name']}: required must list declared parameters"
    return None


def _from_function(fn: Callable) -> Tool:
    params = list(inspect.signature(fn).parameters)
    if not params or params[0] != "state":
        raise TypeError(f"tool {getattr(fn, '__name__', fn)!r}: the first parameter must be `state`")
    schema = derive_schema(fn, skip=("state",))
    return Tool(schema["name"], schema, fn)


def signature_error(schema: dict, fn: Callable) -> str | None:
    """Why ``fn`` cannot take the calls ``schema`` admits (None when it can): ``fn(state, **arguments)`` must
    accept every parameter the schema declares, and each of its own parameters without a default must be one the
    schema requires. Why at class definition: a schema naming another parameter than the function passes every
    validation and then fails each call inside the tool, as "failed" to the agent."""
    name = schema["name"]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin or C function without a signature: its calls are checked when made
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return f"tool {name}: its function must take the state as its first positional parameter"
    rest = params[1:]
    if any(p.kind is p.VAR_KEYWORD for p in rest):
        return None
    takes = {p.name for p in rest if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    declared = schema["parameters"]["properties"]
    required = set(schema["parameters"].get("required", []))
    unknown = [k for k in declared if k not in takes]
    if unknown:
        return (
            f"tool {name}: the schema declares parameter {unknown[0]!r}, which its function "
            f"{getattr(fn, '__name__', fn)}({', '.join(p.name for p in params)}) does not take"
        )
    needed = [p.name for p in rest if p.default is p.empty and p.kind is not p.VAR_POSITIONAL]
    missing = [k for k in needed if k not in required]
    if missing:
        return (
            f"tool {name}: its function needs {missing[0]!r}, which the schema "
            f"{'does not declare' if missing[0] not in declared else 'does not require'}"
        )
    return None


def _from_spec(spec: ToolSpec) -> Tool:
    why = schema_error(spec.schema) or signature_error(spec.schema, spec.fn)
    if why:
        raise TypeError(why)
    params = spec.schema["parameters"]
    schema = {
        "name": spec.schema["name"],
        "description": spec.schema.get("description", ""),
        "parameters": {
            "type": "object",
            "properties": dict(params["properties"]),
            "required": list(params.get("required", [])),
            "additionalProperties": False,
        },
    }
    return Tool(schema["name"], schema, spec.fn)


def examples_error(table: dict[str, Tool], examples) -> str | None:
    """Why a class's ``tool_examples`` (tool name -> list of argument objects, what the contract checker calls
    the tool with) are unusable: an unknown tool, or arguments its schema refuses."""
    if not isinstance(examples, dict):
        return "tool_examples must map tool names to lists of argument objects"
    for name, calls in examples.items():
        if name not in table:
            return f"tool_examples names {name!r}, which is not a declared tool"
        if not isinstance(calls, (list, tuple)) or not calls:
            return f"tool_examples[{name!r}] must be a non-empty list of argument objects"
        for i, arguments in enumerate(calls):
            why = validate_arguments(table[name].schema, arguments)
            if why:
                return f"tool_examples[{name!r}][{i}]: {why}"
    return None


def tool_table(tools: Iterable[Callable | ToolSpec]) -> dict[str, Tool]:
    """The explicit name -> Tool table of the declared tools (names must be unique and not private)."""
    table: dict[str, Tool] = {}
    for item in tools:
        tool = _from_spec(item) if isinstance(item, ToolSpec) else _from_function(item)
        if tool.name.startswith("_") or tool.name in table:
            raise TypeError(f"tool name {tool.name!r} is private or declared twice")
        table[tool.name] = tool
    return table
