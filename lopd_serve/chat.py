"""`POST /v1/chat/completions`: one turn of a session's conversation, recorded, answered whole or streamed.

One request's path: validate (every limit a 4xx in OpenAI's error shape), take the session's lock, plan the turn
against the session's trajectory (sessions.py), queue the context for the batched decoder (batching.py), turn
the sampled ids into an OpenAI message (conversation.py), append the turn to the trace store (fsync'd) and only
then answer, or, streaming, send the closing events.

A stream is a true stream: each token is sent as a chunk as soon as it is sampled (the decoder's per-token
callback), the record is written when the turn is done, then the finish reason and `[DONE]`. Two cases hold the
text until the turn is done and send it whole: a request that declares tools (the turn may be a tool call, which
is only known once it is complete) and a model speaking its own chat template (its message text is rewritten
from the sampled text: a dropped think block, another call syntax). A stream its client abandons is not
recorded: the client never received the turn, so the session does not advance past it. A turn whose record
cannot be written (a full disk: DiskFull) is answered 507, or, streaming, with an error event: it is not kept and
the session does not advance.

`tool_choice` "required" or a named function, and a JSON `response_format`, constrain the decoding (structured.py):
the decoder samples only tokens that keep the turn a valid call or JSON answer; the trace records the constraint
under `sampling.constraint`, beside every sampled id.

`logprobs` / `top_logprobs` return the sampled tokens' log-probs (the end-of-turn token included when sampled);
`return_token_ids` adds `prompt_token_ids` and `choices[].token_ids` (vLLM's names).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from lopd_core.model.chat import is_embedded_format
from lopd_core.rollout.turn_grammar import OutputConstraint
from lopd_core.traces import DiskFull
from lopd_serve.admission import decoder_error
from lopd_serve.batching import DeadlineExceeded, Unavailable
from lopd_serve.conversation import parse_messages, reply
from lopd_serve.deps import (
    Admitted,
    Config,
    Decoder,
    Holder,
    RecordedTrajectories,
    Sessions,
    Store,
    authorized,
    ensure_room,
)
from lopd_serve.logprobs import chat_logprobs
from lopd_serve.protocol import ApiError, ChatRequest, SamplingRequest, ignored_warning
from lopd_serve.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    ErrorInfo,
    ErrorResponse,
    LopdTurn,
    Usage,
)
from lopd_serve.sessions import keep_turn, plan_turn
from lopd_serve.structured import check_writable, is_answer_only, output_constraint

SESSION_HEADER = "x-session-id"
MAX_SESSION_NAME = 256  # the bound of `user` and of feedback's `session` (protocol.py)

router = APIRouter(dependencies=[Depends(authorized)])


@dataclass
class Turn:
    """What the handler prepared under the session's lock, for answering whole or streamed."""

    req: ChatRequest
    session: object
    parsed: object
    plan: object
    loaded: object
    tools_key: str
    sampling: SamplingRequest
    slot: object  # its admission slot, holding the session's lock (admission.Slot): released when answered
    constraint: OutputConstraint | None = None  # what the turn must be (a call, a JSON answer); None: free text


def _session_name(req: ChatRequest, request: Request) -> str | None:
    name = request.headers.get(SESSION_HEADER) or req.user
    if name is not None and len(name) > MAX_SESSION_NAME:  # feedback could never name it (its own bound)
        raise ApiError(
            400,
            f"{SESSION_HEADER}: a session name has at most {MAX_SESSION_NAME} characters",
            "invalid_session",
            param=SESSION_HEADER,
        )
    return name


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    req: ChatRequest,
    request: Request,
    cfg: Config,
    decoder: Decoder,
    sessions: Sessions,
    holder: Holder,
    store: Store,
    recorded: RecordedTrajectories,
    admission: Admitted,
    response: Response,
):
    warning = ignored_warning(req)  # unknown fields, ignored: named in a header of the answer
    response.headers.update(warning)
    sampling = req.to_sampling(cfg, decoder.draw_seed)
    # parsing, rendering and tokenizing run in a worker thread: a large request (even one refused for its
    # length once tokenized) must not hold the event loop, and with it health checks and every stream
    parsed = await asyncio.to_thread(parse_messages, req, max_messages=cfg.max_messages)
    ensure_room(store)
    session = sessions.get(_session_name(req, request), client=request.client.host if request.client else "")
    # 429 beyond the queue's bound, 503 past the deadline for the session's previous turn; released when the turn
    # is answered (or its stream ends)
    slot = await admission.turn(session.lock)
    streaming = False
    try:
        loaded = holder.current  # this request's model, kept to the end even if a swap happens meanwhile
        constraint = output_constraint(req, loaded.chat)
        if constraint is not None:
            await asyncio.to_thread(check_writable, constraint, loaded.tokenizer)
        tools_key = json.dumps(parsed.tools, sort_keys=True)
        plan = await asyncio.to_thread(plan_turn, session, parsed, tools_key, loaded.chat, loaded.version)
        if len(plan.context) + sampling.max_tokens > cfg.max_context:
            raise ApiError(
                400,
                f"the conversation is {len(plan.context)} tokens; with max_tokens={sampling.max_tokens} "
                f"it exceeds the context limit of {cfg.max_context} (serve.max_context)",
                "context_length_exceeded",
                param="messages",
            )
        turn = Turn(req, session, parsed, plan, loaded, tools_key, sampling, slot, constraint)
        if req.stream:
            decoder.check_available()  # a stream's 503 comes with its status, before the stream starts
            stream = StreamingResponse(
                _stream(turn, decoder, store, recorded, request), media_type="text/event-stream", headers=warning
            )
            streaming = True  # the stream releases the lock when it ends
            return stream
        return await _record(turn, await _answer(turn, decoder, request), store, recorded)
    finally:
        if not streaming:
            slot.release()


async def _answer(turn: Turn, decoder, request: Request):
    """The decoded turn of a whole (not streamed) answer; 499 when its client went away meanwhile."""
    job = asyncio.ensure_future(_generate(turn, decoder))
    watch = asyncio.ensure_future(_cancel_when_gone(request, job))
    try:
        return await job
    except asyncio.CancelledError:
        if not job.cancelled():
            raise
        # nobody hears this answer (nginx's 499): the turn is not recorded, the session does not advance
        raise ApiError(499, "the client closed the request", "client_closed") from None
    finally:
        watch.cancel()


async def _generate(turn: Turn, decoder, on_token=None):
    s = turn.sampling
    return await decoder.generate(
        turn.loaded,
        turn.plan.context,
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        seed=s.seed,
        top_logprobs=s.top_logprobs,
        stop=s.stop,
        constraint=turn.constraint,
        on_token=on_token,
    )


async def _record(turn: Turn, out, store, recorded) -> ChatCompletion:
    """The sampled turn as an OpenAI message, appended to the trace store (on disk before the client hears of
    it), the session advanced; returns the response."""
    req, plan, loaded, session = turn.req, turn.plan, turn.loaded, turn.session
    declared = {t["function"]["name"] for t in turn.parsed.tools}
    message, finish, reply_key = reply(
        loaded.chat,
        out.token_ids,
        stopped=out.stopped,
        declared=declared,
        tool_choice=req.tool_choice,
        parallel=req.parallel_tool_calls is not False,
        stop_string=out.stop_string,
        verbatim=is_answer_only(turn.constraint),
    )
    segment = plan.segment
    segment.add_action(out.token_ids, out.logprobs)
    if not out.stopped:
        segment.add_forced([loaded.chat.im_end_id])  # closed by the server, as the engine closes a turn
    # written as planned, or as a turn 0 carrying the trajectory when a rotation archived it (sessions.keep_turn)
    plan = turn.plan = await keep_turn(
        store, recorded, session, plan, lambda p: _turn_record(turn, p, message, finish), messages=len(req.messages)
    )
    session.advance(
        plan, plan.segment, version=loaded.version, tools_key=turn.tools_key, keys=turn.parsed.keys + [reply_key]
    )
    return _completion(turn, out, message, finish)


def _turn_record(turn: Turn, plan, message: dict, finish: str) -> dict:
    """The store's `turn` record (lopd_core/traces/schema.py): what the turn added, token for token."""
    req, loaded = turn.req, turn.loaded
    segment, prompt_length = plan.segment, plan.prompt_length if plan.turn == 0 else 0
    request_messages = [m.model_dump(exclude_none=True) for m in req.messages]
    record = {
        "kind": "turn",
        "trajectory_id": plan.trajectory_id,
        "turn": plan.turn,
        "session": turn.session.id,
        "origin": plan.origin if plan.turn == 0 else "extends",
        "parent": plan.parent,
        "model_version": loaded.version,
        "tokenizer": loaded.tokenizer_fingerprint,
        "prompt_length": prompt_length,
        "token_ids": segment.token_ids,
        "action_mask": segment.action_mask,
        "sample_logprobs": segment.sample_logprobs,
        "finish_reason": finish,
        "messages": request_messages[-plan.new_messages :] + [message],
        "sampling": {
            "temperature": turn.sampling.temperature,
            "top_p": turn.sampling.top_p,
            "max_tokens": turn.sampling.max_tokens,
            "seed": turn.sampling.seed,
            **({"stop": list(turn.sampling.stop)} if turn.sampling.stop else {}),
            **({"constraint": turn.constraint.record()} if turn.constraint is not None else {}),
        },
        "time": time.time(),
    }
    if plan.turn == 0:
        record["tools"] = turn.parsed.tools
    if plan.carried:  # the turns of its parent it carries whole (after a rotation: sessions.carried)
        record.update(carried_turns=plan.carried, started=plan.started)
    return record


def _completion(turn: Turn, out, message: dict, finish: str) -> ChatCompletion:
    req, plan, loaded = turn.req, turn.plan, turn.loaded
    choice = ChatChoice(message=AssistantMessage.model_validate(message), finish_reason=finish)
    if req.logprobs:
        choice.logprobs = chat_logprobs(
            loaded.tokenizer, out.token_ids, out.logprobs, out.top, req.return_tokens_as_token_ids
        )
    body = ChatCompletion(
        model=loaded.name,
        system_fingerprint=loaded.version,
        choices=[choice],
        usage=Usage.of(len(plan.context), len(out.token_ids)),
        lopd=LopdTurn(session=turn.session.id, trajectory_id=plan.trajectory_id, model_version=loaded.version),
    )
    if req.return_token_ids:
        body.prompt_token_ids, choice.token_ids = list(plan.context), list(out.token_ids)
    return body


DISCONNECT_POLL_S = 0.25  # how often a request in decoding looks whether its client is still there


async def _cancel_when_gone(request: Request, job: asyncio.Future) -> None:
    """Cancel `job` (its row then leaves its batch) once the client has disconnected. A stream notices a closed
    connection only when it next sends, and a held stream or a whole answer sends nothing until the turn is done:
    without a look at the connection an abandoned request decoded to its max_tokens."""
    while not job.done():
        if await request.is_disconnected():
            job.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


class _Chunks:
    """The stream's chunks: each one OpenAI's `chat.completion.chunk` with the turn's id and model."""

    def __init__(self, turn: Turn):
        self.id, self.created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        self.loaded = turn.loaded
        self.lopd = LopdTurn(session=turn.session.id, model_version=turn.loaded.version)

    def event(self, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.loaded.name,
            system_fingerprint=self.loaded.version,
            choices=[ChunkChoice(delta=ChunkDelta(**delta), finish_reason=finish, logprobs=logprobs)],
            lopd=self.lopd,
        )
        return chunk.event()

    def usage_event(self, usage) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.loaded.name,
            system_fingerprint=self.loaded.version,
            choices=[],
            lopd=self.lopd,
            usage=usage,
        )
        return chunk.event()


async def _stream(turn: Turn, decoder, store, recorded, request: Request):
    """Server-sent events of one turn: the role, each token's text as it is sampled (unless held, see the
    module's docstring), then the closing events once the turn is recorded, then [DONE]."""
    req, loaded = turn.req, turn.loaded
    job = watch = None
    try:
        chunks = _Chunks(turn)
        live = is_embedded_format(loaded.tokenizer) and not (turn.parsed.tools and req.tool_choice != "none")
        tokens: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_token(token_id: int, logprob: float, top: list) -> None:  # in the decoder's thread
            loop.call_soon_threadsafe(tokens.put_nowait, (token_id, logprob, top))

        job = asyncio.ensure_future(_generate(turn, decoder, on_token))
        watch = asyncio.ensure_future(_cancel_when_gone(request, job))
        yield chunks.event({"role": "assistant", "content": ""})
        text = _Text(loaded.tokenizer, loaded.chat.im_end_id, turn.sampling.stop)
        pending: list = []  # log-prob entries of tokens not sent yet (a token may add no text of its own)
        while not (job.done() and tokens.empty()):
            getter = asyncio.ensure_future(tokens.get())
            await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            token_id, logprob, top = getter.result()
            piece = text.add(token_id)
            if req.logprobs:
                pending += chat_logprobs(
                    loaded.tokenizer, [token_id], [logprob], [top], req.return_tokens_as_token_ids
                )["content"]
            if live and piece:
                yield chunks.event({"content": piece}, logprobs={"content": pending} if req.logprobs else None)
                pending = []
        if job.cancelled():  # the client went away: nothing is recorded, the session does not advance
            return
        if job.exception() is not None:  # nothing recorded; the client hears why, then [DONE]
            yield _error_event(job.exception())
            return
        async for event in _closing(turn, job.result(), store, recorded, chunks, text, pending, live):
            yield event
    finally:
        if job is not None and not job.done():  # the client went away: its row leaves the batch (batching.py)
            job.cancel()
        if watch is not None:
            watch.cancel()
        turn.slot.release()


def _error_event(exc: BaseException) -> str:
    """A stream's failure as OpenAI's error object in one event, then [DONE]: a decoder that cannot answer
    (503: retry) or a request the model could not decode."""
    if isinstance(exc, Unavailable | DeadlineExceeded):
        error = decoder_error(exc)
        info = ErrorInfo(message=error.message, type=error.kind, code=error.code)
    else:
        info = ErrorInfo(message=f"{type(exc).__name__}: {exc}", type="server_error", code="decoding_failed")
    return f"data: {json.dumps(ErrorResponse(error=info).model_dump())}\n\ndata: [DONE]\n\n"


async def _closing(turn: Turn, out, store, recorded, chunks: _Chunks, text, pending: list, live: bool):
    """The turn recorded, then what was not streamed yet, the finish reason and [DONE]; a turn that could not be
    recorded (a full disk) is an error event instead: the client hears it was not kept."""
    try:
        body = await _record(turn, out, store, recorded)
    except DiskFull as exc:
        error = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error", code="disk_full"))
        yield f"data: {json.dumps(error.model_dump())}\n\n"
        yield "data: [DONE]\n\n"
        return
    chunks.lopd = body.lopd
    choice = body.choices[0]
    message = choice.message
    if message.tool_calls:  # every call of the turn, each with its index (OpenAI's parallel calls)
        calls = [{"index": k, **call.model_dump()} for k, call in enumerate(message.tool_calls)]
        yield chunks.event({"tool_calls": calls, "content": message.content or None})
    else:
        content = message.content or ""
        # what was streamed is a prefix of the message's text; anything else cannot be taken back
        rest = (content[len(text.shown) :] if content.startswith(text.shown) else "") if live else content
        if rest or (live and pending):  # the tokens not sent yet (the end token's log-prob among them)
            logprobs = None if not turn.req.logprobs else {"content": pending} if live else choice.logprobs
            yield chunks.event({"content": rest}, logprobs=logprobs)
    yield chunks.event({}, choice.finish_reason)
    if turn.req.stream_options is not None and turn.req.stream_options.include_usage:
        yield chunks.usage_event(body.usage)  # OpenAI's last chunk: the usage, no choices
    yield "data: [DONE]\n\n"


class _Text:
    """The turn's text grown token by token: each new piece is what decoding the longer prefix adds, sent only
    once it decodes cleanly (a byte-level token may be half a character). With stop strings, the text's last
    characters that could still begin one are held back, and nothing from a stop string on is ever sent (OpenAI
    leaves the stop string out of the message)."""

    def __init__(self, tokenizer, end_id: int, stop: tuple[str, ...] = ()):
        self.tokenizer, self.end_id, self.stop = tokenizer, end_id, stop
        self.hold = max(map(len, stop), default=1) - 1
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token_id: int) -> str:
        if token_id == self.end_id:
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return ""
        cut = min((i for s in self.stop if (i := text.find(s)) >= 0), default=len(text) - self.hold)
        text = text[: max(cut, 0)]
        if not text.startswith(self.shown) or len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece
