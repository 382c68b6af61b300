"""Tool calls out of model text: JSON tool-call syntax and Python call syntax, parsed without running anything.

Why both: a model served through a chat template with native tool support answers in that template's JSON
syntax (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, or a bare JSON object/list), while the
prompt-based protocol of BFCL and ACEBench asks for Python syntax (`[f(a=1), g(b='x')]`). Both parse to the
same `ToolCall`.

Python syntax is read with `ast` and turned into values by `literal_value`, a small interpreter over literal
nodes: constants, lists, tuples, dicts, sets, signs, and arithmetic on numbers (what BFCL's decoder gets by
calling `eval` on such nodes; here no code ever runs). Where BFCL's decoder keeps a bare name (`x`) or a
nested call without keyword arguments, it keeps its source text; a nested call with keyword arguments becomes
`{name: {arg: value}}`, as in BFCL. Positional arguments are kept apart in `ToolCall.positional`: the
single-turn checkers ignore them, as BFCL's decoder does, while the multi-turn executor binds them to the
method's parameters.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any


class CallParseError(ValueError):
    """The text holds no call in any syntax we read."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    positional: tuple = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}

    def python_source(self) -> str:
        """The call in Python syntax, as BFCL writes its multi-turn answers: `mv(source='a', destination='b')`."""
        parts = [repr(v) for v in self.positional] + [f"{k}={v!r}" for k, v in self.arguments.items()]
        return f"{self.name}({', '.join(parts)})"


# ---- Python call syntax --------------------------------------------------------------------------------------

_ARITHMETIC = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_EXPONENT = 64  # keeps `10**10**10` from tying up the process


def _dotted_name(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise CallParseError(f"not a function name: {ast.unparse(node)!r}")
    parts.append(node.id)
    return ".".join(reversed(parts))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float, complex)) and not isinstance(value, bool)


def literal_value(node: ast.AST) -> Any:
    """The value a literal expression node stands for; raises CallParseError for anything that would run code."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.List):
        return [literal_value(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(literal_value(v) for v in node.elts)
    if isinstance(node, ast.Set):
        return {literal_value(v) for v in node.elts}
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise CallParseError("dict unpacking (**) is not a literal")
        return {literal_value(k): literal_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = literal_value(node.operand)
        if not _number(operand):
            raise CallParseError(f"sign on a non-number: {ast.unparse(node)!r}")
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = literal_value(node.left), literal_value(node.right)
        if not (_number(left) and _number(right)):
            raise CallParseError(f"arithmetic on non-numbers: {ast.unparse(node)!r}")
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise CallParseError(f"exponent too large: {ast.unparse(node)!r}")
        try:
            return _ARITHMETIC[type(node.op)](left, right)
        except (ArithmeticError, ValueError) as exc:
            raise CallParseError(f"{ast.unparse(node)!r}: {exc}") from None
    if isinstance(node, ast.Name):  # a variable name: kept as its text, as BFCL's decoder does
        return node.id
    if isinstance(node, ast.Call):
        if not node.keywords:
            return ast.unparse(node)
        call = call_from_node(node)
        return {call.name: call.arguments}
    if isinstance(node, (ast.Subscript, ast.Lambda, ast.Attribute)):
        return ast.unparse(node)
    raise CallParseError(f"unsupported expression in an argument: {ast.unparse(node)!r}")


def call_from_node(node: ast.Call) -> ToolCall:
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise CallParseError("keyword unpacking (**) is not supported")
        kwargs[kw.arg] = literal_value(kw.value)
    positional = tuple(literal_value(a) for a in node.args)
    return ToolCall(_dotted_name(node.func), kwargs, positional)


def parse_python_calls(text: str) -> list[ToolCall]:
    """`[f(a=1), g(b='x')]` or `f(a=1)` -> calls. Raises CallParseError when the text is not that shape."""
    source = text.strip().strip("`").strip()
    source = source.removeprefix("python\n")
    source = source.strip().strip("'").strip()
    if not source:
        raise CallParseError("empty output")
    if not source.startswith("["):
        source = "[" + source
    if not source.endswith("]"):
        source = source + "]"
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise CallParseError(f"not Python call syntax: {exc}") from None
    elements = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for element in elements:
        if not isinstance(element, ast.Call):
            raise CallParseError(f"not a call: {ast.unparse(element)!r}")
        calls.append(call_from_node(element))
    return calls


def parse_call_string(text: str) -> ToolCall:
    """One call in Python syntax, as in BFCL's multi-turn answers (`sort('final_report.pdf')`)."""
    calls = parse_python_calls(text)
    if len(calls) != 1:
        raise CallParseError(f"expected one call, found {len(calls)}: {text!r}")
    return calls[0]


# ---- JSON tool-call syntax -----------------------------------------------------------------------------------

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def _call_from_json(obj: Any) -> ToolCall:
    if not isinstance(obj, dict):
        raise CallParseError(f"a JSON tool call must be an object, got {type(obj).__name__}")
    if isinstance(obj.get("function"), dict):  # OpenAI style: {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name", obj.get("function"))
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise CallParseError(f"arguments are not JSON: {exc}") from None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise CallParseError(f"not a tool call object: {json.dumps(obj)[:200]}")
    return ToolCall(name, arguments)


def parse_json_calls(text: str) -> list[ToolCall]:
    """`<tool_call>{...}</tool_call>` blocks, or one JSON object / list of objects (optionally fenced)."""
    blocks = [b.strip() for b in _TOOL_CALL_BLOCK.findall(text)]
    if not blocks:
        fenced = _JSON_FENCE.search(text)
        blocks = [(fenced.group(1) if fenced else text).strip()]
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as exc:
            raise CallParseError(f"not JSON: {exc}") from None
        for item in obj if isinstance(obj, list) else [obj]:
            calls.append(_call_from_json(item))
    return calls


def parse_calls(text: str) -> list[ToolCall]:
    """Calls in model output, JSON tool-call syntax first when the text carries it, else Python syntax.

    Raises CallParseError when neither reading works; an empty list means the model wrote `[]`."""
    if "<tool_call>" in text:
        return parse_json_calls(text)
    try:
        return parse_python_calls(text)
    except CallParseError as python_error:
        try:
            return parse_json_calls(text)
        except CallParseError:
            raise python_error from None


def calls_or_none(text: str) -> list[ToolCall]:
    """Calls in the text, or [] where it holds none (what relevance checks need)."""
    try:
        return parse_calls(text)
    except CallParseError:
        return []
