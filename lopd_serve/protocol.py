"""The OpenAI chat-completions and completions protocols as pydantic models, and their error shape.

Only what `lopd serve` honours is accepted: a field it does not know, or one it would have to ignore silently
(`n` > 1, `stop`, a non-text `response_format`, penalties), is refused with a 400 naming it, and values are
strictly typed (the `Strict` base). Errors are OpenAI's object
`{"error": {"message", "type", "code", "param"}}` with a 4xx status.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, code: str, *, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.code, kind=self.kind, param=self.param)


def error_response(
    status: int, message: str, code: str, *, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": param}}, status_code=status)


MAX_JSON_DEPTH = 32  # nesting of free-form JSON a request hands to the store (tool schemas, feedback checks)


def storable_json(value: Any) -> Any:
    """Free-form JSON that goes into a trace record as it came: refused (a 400) when the store could not hold
    it or read it back. NaN and infinities parse from a request body but cannot be written as JSON (the record's
    write would fail after the turn was sampled: a 500); a nesting near the parser's recursion limit could be
    written and then break every later read of the store."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{item} is not a JSON number")
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
    return value


def utf8_text(value: Any) -> Any:
    """A request body whose every string (keys included) is text UTF-8 can hold, else a ValueError naming where.
    JSON's `\\ud800` escape carries a lone surrogate, which is no character: the tokenizer cannot encode it (it
    raised, a 500) and a trace holding it could not be written as a parquet snapshot. NUL, noncharacters and the
    like are characters: they are served."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"{where or 'body'}: {item[exc.start]!r} at character {exc.start} is a lone surrogate, "
                    "not text (send valid UTF-8)"
                ) from None
        elif isinstance(item, dict):
            stack += [(k, f"{where}.{k!r} (a key)".lstrip(".")) for k in item]
            stack += [(v, f"{where}.{k}".lstrip(".")) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{where}.{n}".lstrip(".")) for n, v in enumerate(item)]
    return value


# below this a temperature is greedy (vLLM's threshold): dividing float32 logits by less overflows to infinity
MIN_TEMPERATURE = 1e-5


def effective_temperature(value: float) -> float:
    return 0.0 if value < MIN_TEMPERATURE else value


def _without_nulls(data: Any, model: type[BaseModel]) -> Any:
    """An explicit null is the field left out (OpenAI's optional fields are nullable, and clients send them)."""
    if isinstance(data, dict):
        optional = {name for name, f in model.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}
    return data


class Strict(BaseModel):
    """A request object as strict as `/v1/feedback`: a field the server does not know is refused (400 naming it,
    `unsupported_field`), never ignored, and a value of the wrong JSON type is refused rather than coerced
    (`"1"` is not a number, `1` is not `true`): what a client meant must be what the server does and records."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's form)


class ToolCall(Strict):
    id: str  # required in a request's history, as OpenAI's: a tool message names the call it answers by it
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    """One message of a chat request. Which fields a role may carry is checked where the conversation is parsed
    (conversation.parse_messages), with the message's index in the error. `name`, `refusal`, `audio` and
    `function_call` are OpenAI's, accepted only empty (null): the chat layer does not render them, and a message
    the model never saw as sent must not be recorded as if it had. `annotations` is a response field the openai
    package includes when a client sends a reply back as it came (`message.model_dump()`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


# OpenAI's tool names (the API refuses others): they are written into the model's context and the trace
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # OpenAI's structured outputs for calls: only off (null or false) is served

    _storable = field_validator("parameters")(storable_json)

    @field_validator("strict")
    @classmethod
    def _not_strict(cls, value):
        if value:
            raise ValueError("strict function calling (constrained arguments) is not supported; leave it out")
        return value


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices, before [DONE] (OpenAI's)


class ChatRequest(Strict):
    """OpenAI's chat request as served. Fields that would change what the model samples in a way the server does
    not implement (penalties, logit bias, stop strings, n > 1, structured output) are accepted only at their
    no-op value, so a client that sends its library's defaults is served and one that asks for more is told."""

    _utf8 = model_validator(mode="before")(utf8_text)
    _temperature = field_validator("temperature")(effective_temperature)
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None  # None/true: a turn may hold several calls; false: the first only
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    n: int | None = None
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's extensions, so one client speaks to both: tokens as "token_id:N", and the ids themselves
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False

    _nulls = model_validator(mode="before")(lambda data: _without_nulls(data, ChatRequest))

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to something this server would otherwise ignore, else None."""
        if self.n not in (None, 1):
            return "n", "only 1 choice per request is supported"
        if self.stop:
            return "stop", "stop sequences are not supported (a turn ends at the model's end token)"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only text is supported"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, "sampling penalties are not supported (the recorded log-probs are the sampler's)"
        if self.logit_bias:
            return "logit_bias", "logit bias is not supported (the recorded log-probs are the sampler's)"
        if self.store is False:
            return "store", "this server records every conversation (it learns from them): leave store out"
        if self.modalities not in (None, ["text"]):
            return "modalities", "only text is supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options needs stream: true"
        return None


class CompletionRequest(Strict):
    """The completions API as vLLM serves it for token-exact clients: `prompt` may be token ids, `logprobs` k
    returns the sampled tokens' log-probs and top-k, `prompt_logprobs` k scores the prompt, `return_token_ids`
    returns the ids of both. Generation ends at the model's end-of-turn token (`stop_token_ids` may name only it)."""

    _utf8 = model_validator(mode="before")(utf8_text)
    _temperature = field_validator("temperature")(effective_temperature)
    _nulls = model_validator(mode="before")(lambda data: _without_nulls(data, CompletionRequest))
    model: str = ""
    # strict ids: `true` is not token 1 (a client's wrong type must not become a token the model reads)
    prompt: str | list[StrictInt] | list[list[StrictInt]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # vLLM's: the end-of-turn token is always the last of the returned ids when sampled, so only true is served
    include_stop_str_in_output: bool | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(default=None, max_length=256)


class Feedback(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _utf8 = model_validator(mode="before")(utf8_text)
    session: str = Field(min_length=1, max_length=256)
    # strict: a label lands in training data, so `true` or "1" is refused rather than read as 1.0 (an int is a
    # number and passes); out of [0, 1], NaN included, is a 422 checked by hand
    reward: float = Field(strict=True)
    success: StrictBool
    checks: list[Any] | dict[str, Any] | None = None
    trajectory_id: str | None = None  # default: the session's latest trajectory

    _storable = field_validator("checks")(storable_json)


class Reload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # a checkpoint folder; default: the registry's champion
