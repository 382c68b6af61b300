"""What the server answers, as pydantic models (vLLM's protocol.py does the same for its OpenAI server): the chat
completion and its stream chunks, the completion, usage, the error object, the model list, health, feedback and
reload answers.

Why typed: a handler that builds a dict can drop or misspell a field the OpenAI clients read, and nothing notices
until a client does; a model names every field once, and FastAPI's schema pages show them. The shapes are
OpenAI's, with vLLM's extensions where a token-exact client needs them (`prompt_token_ids`, `token_ids`,
`prompt_logprobs`) and ours under `lopd` (the session, trajectory and model version a turn was recorded under).
Log-prob blocks are built by logprobs.py in the shapes documented there.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @staticmethod
    def of(prompt: int, completion: int) -> Usage:
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class ErrorInfo(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, permission_error, rate_limit_error, server_error
    code: str
    param: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object; every refusal is one, with a 4xx status (a 5xx only for a full disk or store)."""

    error: ErrorInfo


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's form)


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class LopdTurn(BaseModel):
    """Where the turn was recorded: name `session` (or `trajectory_id`) in feedback to label it."""

    session: str
    trajectory_id: str | None = None  # not known to a stream's first chunks (the turn is recorded at its end)
    model_version: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str  # the served version: what a client can tell two models apart by
    choices: list[ChatChoice]
    usage: Usage
    lopd: LopdTurn
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's delta form: each call with its `index`


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    lopd: LopdTurn
    usage: Usage | None = None  # OpenAI's last chunk under stream_options.include_usage (no choices)

    def event(self) -> str:
        """One server-sent event; a delta carries only the fields it sets, as OpenAI's do."""
        body = self.model_dump(exclude_none=True)
        body["choices"] = [
            {**c.model_dump(exclude={"delta"}), "delta": c.delta.model_dump(exclude_none=True)} for c in self.choices
        ]
        body["lopd"] = self.lopd.model_dump()
        return f"data: {json.dumps(body)}\n\n"


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str = Field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "lopd"
    lopd_version: str  # the registry version or the folder (with its stamp) served


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StoreStatus(BaseModel):
    dir: str
    bytes: int
    max_bytes: int


class EngineStatus(BaseModel):
    busy_s: float  # wall time the decoder spent decoding or scoring
    cpu_s: float  # its CPU time meanwhile
    steps: int  # decoding steps (one forward each over the rows present)
    tokens: int  # tokens kept for requests
    restarts: int = 0  # engine processes replaced (died, or stopped answering its heartbeat)
    ready: bool = True  # false while an engine process is being replaced (requests get 503)


class QueueStatus(BaseModel):
    admitted: int  # requests decoding or waiting for a row (or for their session's previous turn)
    limit: int  # serve.max_batch + serve.max_queue: beyond, 429
    refused: int  # 429s answered since the start


class Health(BaseModel):
    """A liveness probe's answer; what is served and the traffic only to a caller with the key."""

    status: Literal["ok"] = "ok"
    model_version: str | None = None
    sessions: int | None = None
    batches: int | None = None
    batched_requests: int | None = None
    engine: EngineStatus | None = None
    queue: QueueStatus | None = None
    store: StoreStatus | None = None


class FeedbackAnswer(BaseModel):
    ok: bool = True
    trajectory_id: str
    turns: int  # the turns the label judges


class ReloadAnswer(BaseModel):
    model_version: str
    changed: bool


class StoreRotation(BaseModel):
    """What `POST /admin/store/rotate` did: the segments it moved into `archive` (None: the live store held no
    record, nothing moved), and how many open sessions go on in a trajectory that carries their history."""

    store: str
    archive: str | None
    segments: list[str]
    bytes: int
    epoch: int
    sessions_carried_on: int
