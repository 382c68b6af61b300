"""JSON schemas compiled for constrained decoding (constrained.py): the subset of JSON Schema a turn's JSON can be
held to, step by step, as a tree of `Node`s the grammar's items walk (json_grammar.py). A keyword outside it is a
SchemaError naming where it stands, so a request is refused rather than served against a schema it ignored."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache

MAX_DEPTH = 16  # nesting of free JSON (an object without `properties`, a tool call's arguments)


class SchemaError(ValueError):
    """A JSON schema outside the enforced subset: `path` names the keyword (`schema.properties.age.minimum`)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


def schema_text(schema: dict) -> str:
    """A schema's canonical JSON text: equal schemas share their compiled grammar and cached masks."""
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


# ---- JSON schemas, compiled ---------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # compared and hashed by identity: states hold nodes, and hash on every lookup
class Node:
    """A compiled schema. kind: object, array, string, integer, number, boolean, null, enum, anyof or any."""

    kind: str
    properties: dict[bytes, Node] | None = None  # object: each key's JSON text (no quotes) -> its schema; None: any
    required: frozenset[bytes] = frozenset()
    items: Node | None = None  # array
    literals: tuple[bytes, ...] = ()  # enum: each value's JSON text
    options: tuple[Node, ...] = ()  # anyof: schemas whose values begin with different bytes
    depth: int = 0  # free JSON (kind any, an object without properties): how much deeper it may nest


@cache
def free_json(depth: int) -> Node:
    return Node("any", depth=depth)


@cache
def free_object(depth: int) -> Node:
    return Node("object", depth=depth)


@cache
def free_array(depth: int) -> Node:
    return Node("array", items=free_json(depth - 1))


TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "oneOf", "$ref"}
)
OBJECT_ONLY, ARRAY_ONLY = ("properties", "required", "additionalProperties"), ("items",)
DEFINITIONS = ("$defs", "definitions")  # at the schema's root: what `$ref` may name


def compile_schema(schema, path: str = "schema") -> Node:
    """The enforced subset of JSON Schema: `type` (one of TYPES, or a list of them), `properties`, `required` (keys
    among the properties), `additionalProperties` (a boolean: only the declared properties are ever written, which
    satisfies either), `items` (one schema), `enum` and `const` (JSON scalars), `anyOf` / `oneOf` of schemas whose
    values begin differently (a type or null, as pydantic writes an Optional), `$ref` to the root's `$defs` (not
    recursive), annotations (title, description, default, ...); `{}` is any JSON value, `{"type": "object"}`
    without properties any object. Anything else — `pattern`, `minimum`, `format`, `allOf`, `prefixItems`, ... —
    is a SchemaError naming it."""
    definitions = {}
    if isinstance(schema, dict):
        for key in DEFINITIONS:
            if not isinstance(schema.get(key, {}), dict):
                raise SchemaError(f"{path}.{key}", f"{key} is an object of schemas")
            definitions |= {f"#/{key}/{name}": s for name, s in schema.get(key, {}).items()}
        schema = {k: v for k, v in schema.items() if k not in DEFINITIONS}
    return _Compiler(definitions).node(schema, path)


class _Compiler:
    def __init__(self, definitions: dict):
        self.definitions = definitions
        self.compiled: dict[str, Node] = {}  # a definition referred to twice is one node (its masks cached once)
        self.open: list[str] = []  # the references being compiled (a cycle is a recursive schema)

    def node(self, schema, path: str) -> Node:
        if not isinstance(schema, dict):
            raise SchemaError(path, "a schema is a JSON object")
        unknown = sorted(set(schema) - KEYWORDS - ANNOTATIONS)
        if unknown:
            raise SchemaError(
                f"{path}.{unknown[0]}",
                f"'{unknown[0]}' is not enforced (enforced: {', '.join(sorted(KEYWORDS))}; annotations such as "
                "title and description are accepted)",
            )
        alone = next((k for k in ("$ref", "anyOf", "oneOf") if k in schema), None)
        if alone is not None:
            beside = sorted(set(schema) & KEYWORDS - {alone})
            if beside:
                raise SchemaError(f"{path}.{beside[0]}", f"beside {alone} only annotations are enforced")
            return (
                self._reference(schema["$ref"], path) if alone == "$ref" else self._any_of(schema[alone], path, alone)
            )
        kind = schema.get("type")
        if isinstance(kind, list):
            if set(schema) & (KEYWORDS - {"type"}):
                raise SchemaError(f"{path}.type", "a list of types is enforced alone (with annotations)")
            return self._any_of([{"type": k} for k in kind], path, "type")
        if kind is not None and kind not in TYPES:
            raise SchemaError(f"{path}.type", f"a type is one of {', '.join(TYPES)}, or a list of them")
        misplaced = [k for k in OBJECT_ONLY if k in schema and kind != "object"]
        misplaced += [k for k in ARRAY_ONLY if k in schema and kind != "array"]
        if misplaced:
            owner = "object" if misplaced[0] in OBJECT_ONLY else "array"
            raise SchemaError(f"{path}.{misplaced[0]}", f'\'{misplaced[0]}\' needs "type": "{owner}"')
        if "enum" in schema or "const" in schema:
            return _enum(schema, kind, path)
        if kind == "object":
            return self._object(schema, path)
        if kind == "array":
            if "items" not in schema:
                return free_array(MAX_DEPTH)
            return Node("array", items=self.node(schema["items"], f"{path}.items"))
        return free_json(MAX_DEPTH) if kind is None else Node(kind)

    def _reference(self, ref, path: str) -> Node:
        if ref not in self.definitions:
            raise SchemaError(f"{path}.$ref", f"{ref!r}: only a reference to the root's $defs is enforced")
        if ref in self.open:
            raise SchemaError(f"{path}.$ref", f"{ref!r} refers to itself: a recursive schema is not enforced")
        if ref not in self.compiled:
            self.open.append(ref)
            self.compiled[ref] = self.node(self.definitions[ref], ref[2:].replace("/", "."))
            self.open.pop()
        return self.compiled[ref]

    def _any_of(self, options, path: str, keyword: str) -> Node:
        if not isinstance(options, list) or not options:
            raise SchemaError(f"{path}.{keyword}", f"{keyword} is a non-empty list of schemas")
        nodes = tuple(self.node(o, f"{path}.{keyword}.{n}") for n, o in enumerate(options))
        seen: set[int] = set()
        for n, node in enumerate(nodes):
            first = _first_bytes(node)
            if seen & first:  # the first byte would not tell which one is being written
                raise SchemaError(
                    f"{path}.{keyword}.{n}",
                    f"{keyword} is enforced where its schemas' values begin differently (a type or null, not two "
                    "objects or two strings)",
                )
            seen |= first
        return nodes[0] if len(nodes) == 1 else Node("anyof", options=nodes)

    def _object(self, schema: dict, path: str) -> Node:
        additional = schema.get("additionalProperties", False)
        if not isinstance(additional, bool):
            raise SchemaError(f"{path}.additionalProperties", "only true or false is enforced (not a schema)")
        if "properties" not in schema:
            if schema.get("required"):
                raise SchemaError(f"{path}.required", "required keys need their properties")
            return free_object(MAX_DEPTH)
        properties = schema["properties"]
        if not isinstance(properties, dict):
            raise SchemaError(f"{path}.properties", "properties is an object of schemas")
        nodes = {_key_text(k): self.node(v, f"{path}.properties.{k}") for k, v in properties.items()}
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise SchemaError(f"{path}.required", "required is a list of property names")
        missing = [k for k in required if k not in properties]
        if missing:
            raise SchemaError(f"{path}.required", f"{missing[0]!r} is required but not among the properties")
        return Node("object", properties=nodes, required=frozenset(_key_text(k) for k in required))


def _first_bytes(node: Node) -> frozenset[int]:
    """The bytes a value of `node` may begin with."""
    if node.kind == "anyof":
        return frozenset().union(*map(_first_bytes, node.options))
    if node.kind == "enum":
        return frozenset(t[0] for t in node.literals)
    if node.kind == "any":
        return frozenset(range(256))
    starts = {"object": b"{", "array": b"[", "string": b'"', "boolean": b"tf", "null": b"n"}
    return frozenset(starts.get(node.kind, b"-0123456789"))


def _key_text(key: str) -> bytes:
    return json.dumps(key, ensure_ascii=False).encode()[1:-1]


def _enum(schema: dict, kind: str | None, path: str) -> Node:
    where = f"{path}.enum" if "enum" in schema else f"{path}.const"
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list) or not values:
        raise SchemaError(where, "enum is a non-empty list")
    for value in values:
        if isinstance(value, dict | list) or (isinstance(value, float) and not math.isfinite(value)):
            raise SchemaError(where, "only strings, numbers, booleans and null are enforced as values")
        if kind is not None and not _is(value, kind):
            raise SchemaError(where, f"{value!r} is not of type {kind}")
    return Node("enum", literals=tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False).encode() for v in values)))


def _is(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    types = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}
    return isinstance(value, types[kind])
