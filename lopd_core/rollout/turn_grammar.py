"""What a constrained turn must be (`OutputConstraint`: a JSON answer, a tool call, either) and its grammar over
json_grammar.py's items: `Call` writes `{"name": <a tool>, <arguments key>: <its arguments>}` in that order, between
the chat format's tags taken as `Forced` token ids; `Repeat` lets another call follow, one per line; `Either` is a
call or a JSON answer, chosen by the first input one of them takes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from lopd_core.rollout.json_grammar import (
    COLON,
    Forced,
    Grammar,
    Item,
    OneOf,
    Space,
    Value,
    feed_byte,
    feed_token,
    offered,
)
from lopd_core.rollout.json_schema import MAX_DEPTH, Node, SchemaError, compile_schema, free_object, schema_text


@dataclass(frozen=True)
class OutputConstraint:
    """What a turn must be. `schema`: a JSON answer of that schema (its JSON text; OpenAI's json_object is
    `{"type": "object"}`); `tools`: a call of one of these tools, each (name, the JSON text of the schema its
    arguments follow, or None: any JSON object), in the chat format's call syntax (`call_open` "" is a bare JSON
    object, Llama 3's); both: either of them (the first token tells). `several_calls`: one call or more, one per
    line (tag syntaxes only)."""

    schema: str | None = None
    tools: tuple[tuple[str, str | None], ...] = ()
    call_open: str = ""
    call_close: str = ""
    arguments_key: str = "arguments"
    several_calls: bool = False

    def record(self) -> dict:
        """As a trace records it (schemas as JSON, not text)."""
        out = asdict(self)
        out["schema"] = _parsed(self.schema)
        out["tools"] = [{"name": name, "parameters": _parsed(parameters)} for name, parameters in self.tools]
        return out

    @staticmethod
    def from_record(record: dict) -> OutputConstraint:
        tools = tuple((t["name"], _text(t["parameters"])) for t in record.get("tools", ()))
        return OutputConstraint(**{**record, "schema": _text(record.get("schema")), "tools": tools})


def _parsed(text: str | None):
    return None if text is None else json.loads(text)


def _text(schema) -> str | None:
    return None if schema is None else schema_text(schema)


@dataclass(frozen=True, slots=True)
class Repeat(Item):
    """Another call may follow: `body` is one call's items (top last), its top a Forced separator and opening."""

    body: tuple
    nullable = True

    def token(self, t, g):
        started = self.body[-1].token(t, g)
        return None if started is None else (self, *self.body[:-1], *started)

    def offers(self, g):
        return self.body[-1].offers(g)


@dataclass(frozen=True, slots=True)
class Either(Item):
    """One of several outputs (a call or a JSON answer), chosen by the first input some branch takes."""

    branches: tuple[tuple, ...]

    def byte(self, b, g):
        return next((s for branch in self.branches if (s := feed_byte(branch, b, g)) is not None), None)

    def token(self, t, g):
        return next((s for branch in self.branches if (s := feed_token(branch, t, g)) is not None), None)

    def offers(self, g):
        return tuple(t for branch in self.branches for t in offered(branch, g)[0])


@dataclass(frozen=True, eq=False)
class CallSchema:
    arguments: dict[bytes, Node]  # each tool's name as JSON text (quotes included) -> the schema of its arguments
    arguments_key: bytes  # "arguments" (or a template's own key, Llama 3's "parameters"), quotes included


@dataclass(frozen=True, slots=True)
class Call(Item):
    """A tool call's JSON: `{"name": <a tool>, <arguments_key>: <its arguments>}`, in that order (as templates
    and the environment's syntax write it), the arguments of the schema of the tool named."""

    schema: CallSchema

    def byte(self, b, g):
        if b != ord("{"):
            return None
        return (
            CallName(self.schema, tuple(self.schema.arguments)),
            Space(),
            COLON,
            Space(),
            OneOf((b'"name"',)),
            Space(),
        )


@dataclass(frozen=True, slots=True)
class CallName(Item):
    schema: CallSchema
    names: tuple[
        bytes, ...
    ]  # the names still matching (as JSON text: each ends with a quote, none is another's prefix)
    at: int = 0

    def byte(self, b, g):
        left = tuple(n for n in self.names if n[self.at] == b)
        if not left:
            return None
        if len(left[0]) > self.at + 1 or len(left) > 1:
            return (CallName(self.schema, left, self.at + 1),)
        arguments = Value(self.schema.arguments[left[0]])
        comma, key = OneOf((b",",)), OneOf((self.schema.arguments_key,))
        return (OneOf((b"}",)), Space(), arguments, Space(), COLON, Space(), key, Space(), comma, Space())


def _object_schema(text: str) -> Node:
    node = compile_schema(json.loads(text))
    if node.kind != "object":
        raise SchemaError("schema.type", 'the answer is a JSON object: the schema needs "type": "object"')
    return node


def build_grammar(constraint: OutputConstraint, encode) -> Grammar:
    """The grammar of `constraint`; `encode(text)` gives the tokenizer's ids of the call syntax's tags."""
    if constraint.schema is None and not constraint.tools:
        raise ValueError("a constraint names a schema, tools or both")
    answer = None
    if constraint.schema is not None:
        answer = (Value(_object_schema(constraint.schema)), Space())
    if not constraint.tools:
        return Grammar(answer)
    arguments = {
        json.dumps(name, ensure_ascii=False).encode(): free_object(MAX_DEPTH)
        if schema is None
        else _object_schema(schema)
        for name, schema in constraint.tools
    }
    call = Call(CallSchema(arguments, json.dumps(constraint.arguments_key).encode()))
    if not constraint.call_open:  # a bare JSON object is the whole turn
        calls = (call, Space())
        if answer is not None:
            raise ValueError("a bare-JSON call syntax cannot tell a call from a JSON answer")
        return Grammar(calls)
    close, opening = Forced(tuple(encode(constraint.call_close))), tuple(encode(constraint.call_open))
    one = (close, Space(), call, Space())
    calls = (*one, Forced(opening))
    if constraint.several_calls:
        calls = (Repeat((*one, Forced(tuple(encode("\n")) + opening))), *calls)
    forbidden = frozenset(tag.encode()[:2] for tag in (constraint.call_open, constraint.call_close) if tag)
    return Grammar(calls if answer is None else (Either((calls, answer)),), forbidden)
