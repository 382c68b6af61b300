"""The OpenAI chat-completions and completions protocols as pydantic models, and their error shape.

Only what `lopd serve` honours is accepted: a field it would have to ignore silently (`n` > 1, `stop`, a
non-text `response_format`) is refused with a 400 naming it. Errors are OpenAI's object
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's form)


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    _storable = field_validator("parameters")(storable_json)


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    _utf8 = model_validator(mode="before")(utf8_text)
    _temperature = field_validator("temperature")(effective_temperature)
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stream: bool = False
    user: str | None = Field(default=None, max_length=256)
    n: int = 1
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's extensions, so one client speaks to both: tokens as "token_id:N", and the ids themselves
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False


class CompletionRequest(BaseModel):
    """The completions API as vLLM serves it for token-exact clients: `prompt` may be token ids, `logprobs` k
    returns the sampled tokens' log-probs and top-k, `prompt_logprobs` k scores the prompt, `return_token_ids`
    returns the ids of both. Generation ends at the model's end-of-turn token (`stop_token_ids` may name only it)."""

    model_config = ConfigDict(extra="ignore")
    _utf8 = model_validator(mode="before")(utf8_text)
    _temperature = field_validator("temperature")(effective_temperature)
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
    n: int = 1
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
