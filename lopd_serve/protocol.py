"""The OpenAI chat-completions and completions protocols as pydantic models, and their error shape.

Only what `lopd serve` honours is served as asked. An unknown top-level field is ignored with a `Warning` header
and a log line (as vLLM does), unless ignoring it would change what was asked (REFUSED_UNKNOWN: a 400
`unsupported_field` naming it); an unknown field inside a message is refused. A known field the server would have
to ignore (`n` > 1, penalties, a JSON schema keyword outside the enforced subset) is refused by a validator of the
request model, a 400 `unsupported` naming it. Values are strictly typed (the `Strict` base) and an explicit null is
the field left out. The limits that depend on the server's settings (max_tokens, top-k log-probs) are checked in
one place, `to_sampling`, which turns a request into what the decoder is asked for.
Errors are OpenAI's object `{"error": {"message", "type", "code", "param"}}` (responses.ErrorResponse) with a 4xx
status.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lopd_core.rollout.json_schema import SchemaError, compile_schema
from lopd_serve.responses import ErrorInfo, ErrorResponse

log = logging.getLogger("lopd.serve")


class ApiError(Exception):
    """An error in OpenAI's shape; `retry_after_s` adds a Retry-After header (a 429 or 503 the client may retry)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        response = error_response(self.status, self.message, self.code, kind=self.kind, param=self.param)
        if self.retry_after_s is not None:
            response.headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return response


def ignored_warning(req: SamplingFields) -> dict[str, str]:
    """The headers that tell a client which of its fields were ignored (none: {}), and the log line that tells the
    operator. A `Warning` header (RFC 7234's code 299, a persistent warning): SDKs expose response headers."""
    ignored = req.ignored_fields()
    if not ignored:
        return {}
    named = ", ".join(ignored[:MAX_WARNED]) + (
        f" and {len(ignored) - MAX_WARNED} more" if len(ignored) > MAX_WARNED else ""
    )
    log.warning("ignored unknown request fields: %s", named)
    return {"warning": f'299 lopd "unknown fields ignored: {named.replace(chr(34), chr(39))}"'}


def error_response(
    status: int, message: str, code: str, *, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=code, param=param))
    return JSONResponse(body.model_dump(), status_code=status)


def unsupported(message: str) -> PydanticCustomError:
    """A validator's refusal of a field the server would have to ignore: a 400 with code `unsupported`, naming
    the field (app.py's validation handler reads the code from the error's context)."""
    return PydanticCustomError("unsupported", message, {"code": "unsupported"})


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


class ToolChoiceFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    """OpenAI's `{"type": "function", "function": {"name": ...}}`: the turn is a call of that tool."""

    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`. The schema is compiled as it is validated: a keyword outside the
    enforced subset (lopd_core/rollout/json_schema.py, `compile_schema`) is a 400 naming it, never ignored."""

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the enforced subset is enforced either way

    _storable = field_validator("schema_")(storable_json)

    @field_validator("schema_")
    @classmethod
    def _enforced(cls, schema):
        if schema is None:
            return schema
        try:
            node = compile_schema(schema)
        except SchemaError as exc:
            raise unsupported(f"{exc} (lopd serve refuses a schema it would not enforce)") from None
        if node.kind != "object":
            raise unsupported('the answer is a JSON object: the schema needs "type": "object"')
        return schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema goes with type "json_schema", and only with it')
        return self

    def answer_schema(self) -> dict | None:
        """The schema the answer must meet (json_object: any JSON object); None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return {"type": "object"}
        return self.json_schema.schema_


@dataclass(frozen=True)
class SamplingRequest:
    """What one request asks the decoder for, every limit checked (`to_sampling`)."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int  # the request's, else one drawn from the server's seeded stream; below 2**63
    top_logprobs: int  # top-k log-probs per sampled token (0: none)
    stop: tuple[str, ...] = ()  # stop strings: the first the sampled text holds ends the turn


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices, before [DONE] (OpenAI's)


# Fields of OpenAI's and vLLM's request APIs (and the deprecated `functions`) that this server does not implement
# and whose meaning it would change by ignoring them: a 400 naming them. Any other unknown top-level field is
# ignored, with a `Warning` header and a log line (as vLLM does): SDKs add fields faster than servers learn them.
REFUSED_UNKNOWN = frozenset(
    {
        "functions",
        "function_call",
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "verbosity",
        "best_of",
        "use_beam_search",
        "suffix",
        "top_k",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        "min_tokens",
        "ignore_eos",
        "bad_words",
        "allowed_token_ids",
        "logits_processors",
        "truncate_prompt_tokens",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "chat_template",
        "response_format",  # /v1/completions (chat completions enforce it)
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
    }
)
MAX_STOP, MAX_STOP_CHARS = 4, 256  # stop strings per request (OpenAI's limit), characters per stop string
MAX_WARNED = 16  # unknown fields named in the warning header; beyond, a count


class SamplingFields(Strict):
    """The fields chat and completions requests share, and the one place their limits are checked. Fields that
    would change what the model samples in a way the server does not implement are accepted only at their no-op
    value, so a client that sends its library's defaults is served and one that asks for more is told. An unknown
    top-level field is kept aside (`ignored_fields`) unless REFUSED_UNKNOWN names it; nested objects stay strict
    (a message's unknown field would be text the model never saw)."""

    model_config = ConfigDict(extra="allow", strict=True)
    _utf8 = model_validator(mode="before")(utf8_text)
    _temperature = field_validator("temperature")(effective_temperature)
    model: str = ""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    n: int | None = None
    stop: str | list[str] | None = None
    # vLLM's extensions, so one client speaks to both: tokens as "token_id:N", and the ids themselves
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _without_nulls(data, cls)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise unsupported("only 1 choice per request is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in strings):
            raise ValueError(f"at most {MAX_STOP} stop strings of 1 to {MAX_STOP_CHARS} characters")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(dict.fromkeys(self.stop or ()))

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise unsupported("stream_options needs stream: true")
        return options

    @model_validator(mode="after")
    def _meaningful_unknowns(self):
        refused = sorted(k for k, v in (self.model_extra or {}).items() if k in REFUSED_UNKNOWN and v is not None)
        if refused:
            raise PydanticCustomError(
                "unsupported_field",
                f"unsupported field{'s' if len(refused) > 1 else ''} {', '.join(refused)}: lopd serve does not "
                "implement it, and ignoring it would serve something else than asked",
                {"code": "unsupported_field", "param": refused[0]},
            )
        return self

    def ignored_fields(self) -> list[str]:
        """The unknown fields this request sent, ignored (each as printable ASCII, at most 64 characters)."""
        return sorted(json.dumps(k)[1:-1][:64] for k in self.model_extra or {})

    def asked_max_tokens(self) -> int | None:
        return self.max_tokens

    def asked_logprobs(self) -> dict[str, int | None]:
        """Each log-prob count the request asks for, by field name (each bounded by serve.max_top_logprobs)."""
        return {}

    def sampled_top_logprobs(self) -> int:
        return 0

    def to_sampling(self, limits, draw_seed) -> SamplingRequest:
        """The decoder's request, refused (400 naming the field) past the server's limits: `limits` holds
        max_top_logprobs, default_max_tokens and max_tokens_limit (the serve section); `draw_seed()` gives a
        seed to a request that names none."""
        for name, k in self.asked_logprobs().items():
            if k is not None and k > limits.max_top_logprobs:
                raise ApiError(
                    400,
                    f"{name}={k}: at most {limits.max_top_logprobs} (serve.max_top_logprobs)",
                    "too_many_logprobs",
                    param=name,
                )
        max_tokens = self.asked_max_tokens() or limits.default_max_tokens
        if max_tokens > limits.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens}: at most {limits.max_tokens_limit} (serve.max_tokens_limit)",
                "max_tokens_too_large",
                param="max_tokens",
            )
        seed = self.seed if self.seed is not None else draw_seed()
        top_logprobs = self.sampled_top_logprobs()
        return SamplingRequest(
            self.temperature, self.top_p, max_tokens, seed % 2**63, top_logprobs, self.stop_strings()
        )


SAMPLER_LOGPROBS = "(the recorded log-probs are the sampler's)"


class ChatRequest(SamplingFields):
    """OpenAI's chat request as served (the shared fields in SamplingFields)."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    # "required" or a named function: the turn is a call (constrained decoding, lopd_serve/structured.py)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None/true: a turn may hold several calls; false: the first only
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None  # json_object / json_schema: a JSON answer (constrained)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _declared_choice(self):
        """tool_choice "required" or a named function needs tools; a named one, a declared tool (OpenAI's 400s)."""
        choice, declared = self.tool_choice, [t.function.name for t in self.tools or ()]
        if choice == "required" and not declared:
            raise PydanticCustomError(
                "invalid_tool_choice",
                'tool_choice "required" needs tools',
                {"code": "invalid_tool_choice", "param": "tool_choice"},
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in declared:
            raise PydanticCustomError(
                "invalid_tool_choice",
                f"tool_choice names {choice.function.name!r}, which is not among the declared tools {declared}",
                {"code": "invalid_tool_choice", "param": "tool_choice"},
            )
        return self

    def forced_tools(self) -> tuple[str, ...]:
        """The tools the turn must call one of (tool_choice "required" or a named function), else ()."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return (self.tool_choice.function.name,)
        if self.tool_choice == "required":
            return tuple(t.function.name for t in self.tools)
        return ()

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value not in (None, 0):
            raise unsupported(f"sampling penalties are not supported {SAMPLER_LOGPROBS}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise unsupported(f"logit bias is not supported {SAMPLER_LOGPROBS}")
        return value

    @field_validator("store")
    @classmethod
    def _stored(cls, value):
        if value is False:
            raise unsupported("this server records every conversation (it learns from them): leave store out")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value not in (None, ["text"]):
            raise unsupported("only text is supported")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise unsupported("top_logprobs needs logprobs: true")
        return value

    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def asked_logprobs(self) -> dict[str, int | None]:
        return {"top_logprobs": self.top_logprobs}

    def sampled_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(SamplingFields):
    """The completions API as vLLM serves it for token-exact clients: `prompt` may be token ids, `logprobs` k
    returns the sampled tokens' log-probs and top-k, `prompt_logprobs` k scores the prompt, `return_token_ids`
    returns the ids of both. Generation ends at the model's end-of-turn token (`stop_token_ids` may name only it)."""

    # strict ids: `true` is not token 1 (a client's wrong type must not become a token the model reads)
    prompt: str | list[StrictInt] | list[list[StrictInt]] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # vLLM's: the end-of-turn token is always the last of the returned ids when sampled, so only true is served
    include_stop_str_in_output: bool | None = None

    @field_validator("stream")
    @classmethod
    def _not_streamed(cls, stream: bool) -> bool:
        if stream:
            raise unsupported("not supported on /v1/completions (chat completions stream)")
        return stream

    @field_validator("include_stop_str_in_output")
    @classmethod
    def _stop_included(cls, value):
        if value is False:
            raise unsupported("the end-of-turn token is always returned when sampled (leave it out)")
        return value

    def asked_logprobs(self) -> dict[str, int | None]:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}

    def sampled_top_logprobs(self) -> int:
        return self.logprobs or 0


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
