"""`tool_choice` "required" or a named function, and `response_format` json_object / json_schema: what the turn
must be, as the decoder's OutputConstraint (lopd_core/rollout/turn_grammar.py), whose masks (constrained.py) keep
each step's logits to the tokens that keep the output a valid prefix.

* A forced call (`tool_choice` "required" or `{"type": "function", "function": {"name": ...}}`): the turn is a
  call of a declared tool (the named one) in the call syntax the server parses for the model's chat format — the
  embedded format's `<tool_call>{...}</tool_call>`, a template's own tags or bare JSON object — then the end token.
  "required" lets a tag syntax write several calls, one per line, unless `parallel_tool_calls` is false; a named
  function is one call. The arguments follow the tool's `parameters` where that schema lies in the enforced subset
  of JSON Schema, else they are any JSON object (what OpenAI's calls without `strict` promise). A response_format
  does not apply to a forced call's turn.
* A JSON answer (`response_format`): a JSON object, of the schema's enforced subset for json_schema. With tools
  the model may call (`tool_choice` auto), the turn is a call or a JSON answer, told apart by the first token;
  a bare-JSON call syntax cannot tell them apart and is refused.

A model whose vocabulary cannot write constrained output (neither byte-level BPE nor SentencePiece pieces, or a
printable ASCII character with no token of its own) is refused with a 400 naming the field, on every engine.
"""

from __future__ import annotations

from lopd_core.model.chat.template import CANONICAL_SYNTAX
from lopd_core.rollout.constrained import vocabulary
from lopd_core.rollout.json_schema import SchemaError, compile_schema, schema_text
from lopd_core.rollout.turn_grammar import OutputConstraint
from lopd_serve.protocol import ApiError, ChatRequest


def output_constraint(req: ChatRequest, chat) -> OutputConstraint | None:
    """What the request's turn must be for this chat format, or None (free text). Cheap: no tokenizer work."""
    forced = req.forced_tools()
    schema = req.response_format.answer_schema() if req.response_format is not None else None
    if not forced and schema is None:
        return None
    syntax = getattr(chat, "syntax", CANONICAL_SYNTAX)  # the embedded format writes the canonical one
    calls = dict(call_open=syntax.open, call_close=syntax.close, arguments_key=syntax.arguments_key)
    parameters = {t.function.name: _enforced(t.function.parameters) for t in req.tools or ()}
    if forced:
        several = req.tool_choice == "required" and req.parallel_tool_calls is not False and bool(syntax.open)
        return OutputConstraint(tools=tuple((n, parameters[n]) for n in forced), several_calls=several, **calls)
    if not req.tools or req.tool_choice == "none":
        return OutputConstraint(schema=schema_text(schema))
    if not syntax.open:
        raise ApiError(
            400,
            "response_format with tools the model may call: this model writes a call as a bare JSON object, which "
            'cannot be told from a JSON answer (send tool_choice "none", "required" or a named function)',
            "unsupported",
            param="response_format",
        )
    several = req.parallel_tool_calls is not False
    return OutputConstraint(schema=schema_text(schema), tools=tuple(parameters.items()), several_calls=several, **calls)


def _enforced(parameters: dict) -> str | None:
    """A tool's parameters as the schema its arguments follow, or None (any JSON object) where that schema lies
    outside the enforced subset: a tool's schema is the client's description of it, accepted whatever it holds."""
    try:
        return schema_text(parameters) if compile_schema(parameters).kind == "object" else None
    except SchemaError:
        return None


def check_writable(constraint: OutputConstraint, tokenizer) -> None:
    """A 400 where this model's vocabulary cannot write constrained output (the first call for a tokenizer reads
    its whole vocabulary: run it off the event loop)."""
    why = vocabulary(tokenizer).cannot_write()
    if why is not None:
        param = "tool_choice" if constraint.tools and constraint.schema is None else "response_format"
        raise ApiError(
            400, f"{param}: constrained decoding is not available for this model: {why}", "unsupported", param=param
        )


def is_answer_only(constraint: OutputConstraint | None) -> bool:
    """The turn is a JSON answer and nothing else: its message is the sampled text as it decodes (no call syntax
    is read into it)."""
    return constraint is not None and not constraint.tools
