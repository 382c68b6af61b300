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

`logprobs` / `top_logprobs` return the sampled tokens' log-probs (the end-of-turn token included when sampled);
`return_token_ids` adds `prompt_token_ids` and `choices[].token_ids` (vLLM's names).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from lopd_core.model.chat import is_embedded_format
from lopd_core.traces import DiskFull
from lopd_serve.conversation import parse_messages, reply
from lopd_serve.logprobs import chat_logprobs
from lopd_serve.protocol import ApiError, ChatRequest
from lopd_serve.sessions import plan_turn

SESSION_HEADER = "x-session-id"
MAX_SESSION_NAME = 256  # the bound of `user` and of feedback's `session` (protocol.py)


@dataclass
class Turn:
    """What the handler prepared under the session's lock, for answering whole or streamed."""

    req: ChatRequest
    session: object
    parsed: object
    plan: object
    loaded: object
    tools_key: str
    max_tokens: int
    seed: int


def _max_tokens(req: ChatRequest, cfg) -> int:
    refused = req.unsupported()
    if refused is not None:
        raise ApiError(400, f"{refused[0]}: {refused[1]}", "unsupported", param=refused[0])
    if req.top_logprobs is not None and req.top_logprobs > cfg.max_top_logprobs:
        raise ApiError(
            400,
            f"top_logprobs={req.top_logprobs}: at most {cfg.max_top_logprobs} (serve.max_top_logprobs)",
            "too_many_logprobs",
            param="top_logprobs",
        )
    max_tokens = req.max_completion_tokens or req.max_tokens or cfg.default_max_tokens
    if max_tokens > cfg.max_tokens_limit:
        raise ApiError(
            400,
            f"max_tokens={max_tokens}: at most {cfg.max_tokens_limit} (serve.max_tokens_limit)",
            "max_tokens_too_large",
            param="max_tokens",
        )
    return max_tokens


def add_chat(app, cfg, *, batcher, sessions, holder, store, recorded, authorized, room) -> None:
    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(req: ChatRequest, request: Request):
        max_tokens = _max_tokens(req, cfg)
        # parsing, rendering and tokenizing run in a worker thread: a large request (even one refused for its
        # length once tokenized) must not hold the event loop, and with it health checks and every stream
        parsed = await asyncio.to_thread(parse_messages, req, max_messages=cfg.max_messages)
        room()
        name = request.headers.get(SESSION_HEADER) or req.user
        if name is not None and len(name) > MAX_SESSION_NAME:  # feedback could never name it (its own bound)
            raise ApiError(
                400,
                f"{SESSION_HEADER}: a session name has at most {MAX_SESSION_NAME} characters",
                "invalid_session",
                param=SESSION_HEADER,
            )
        session = sessions.get(name, client=request.client.host if request.client else "")
        await session.lock.acquire()  # released when the turn is answered (or its stream ends)
        streaming = False
        try:
            loaded = holder.current  # this request's model, kept to the end even if a swap happens meanwhile
            tools_key = json.dumps(parsed.tools, sort_keys=True)
            plan = await asyncio.to_thread(plan_turn, session, parsed, tools_key, loaded.chat, loaded.version)
            if len(plan.context) + max_tokens > cfg.max_context:
                raise ApiError(
                    400,
                    f"the conversation is {len(plan.context)} tokens; with max_tokens={max_tokens} "
                    f"it exceeds the context limit of {cfg.max_context} (serve.max_context)",
                    "context_length_exceeded",
                    param="messages",
                )
            seed = req.seed if req.seed is not None else batcher.draw_seed()
            turn = Turn(req, session, parsed, plan, loaded, tools_key, max_tokens, seed % 2**63)
            if req.stream:
                response = StreamingResponse(
                    _stream(turn, batcher, store, recorded, request), media_type="text/event-stream"
                )
                streaming = True  # the stream releases the lock when it ends
                return response
            job = asyncio.ensure_future(_generate(turn, batcher))
            watch = asyncio.ensure_future(_cancel_when_gone(request, job))
            try:
                out = await job
            except asyncio.CancelledError:
                if not job.cancelled():
                    raise
                # nobody hears this answer (nginx's 499): the turn is not recorded, the session does not advance
                raise ApiError(499, "the client closed the request", "client_closed") from None
            finally:
                watch.cancel()
            return await _record(turn, out, store, recorded)
        finally:
            if not streaming:
                session.lock.release()


def _top_k(req: ChatRequest) -> int:
    return (req.top_logprobs or 0) if req.logprobs else 0


async def _generate(turn: Turn, batcher, on_token=None):
    return await batcher.generate(
        turn.loaded,
        turn.plan.context,
        temperature=turn.req.temperature,
        top_p=turn.req.top_p,
        max_tokens=turn.max_tokens,
        seed=turn.seed,
        top_logprobs=_top_k(turn.req),
        on_token=on_token,
    )


async def _record(turn: Turn, out, store, recorded) -> dict:
    """The sampled turn as an OpenAI message, appended to the trace store (on disk before the client hears of
    it), the session advanced; returns the response body."""
    req, plan, loaded, session = turn.req, turn.plan, turn.loaded, turn.session
    declared = {t["function"]["name"] for t in turn.parsed.tools}
    message, finish, reply_key = reply(
        loaded.chat,
        out.token_ids,
        stopped=out.stopped,
        declared=declared,
        tool_choice=req.tool_choice,
        parallel=req.parallel_tool_calls is not False,
    )
    segment = plan.segment
    prompt_length = len(segment) if plan.turn == 0 else 0
    segment.add_action(out.token_ids, out.logprobs)
    if not out.stopped:
        segment.add_forced([loaded.chat.im_end_id])  # closed by the server, as the engine closes a turn
    request_messages = [m.model_dump(exclude_none=True) for m in req.messages]
    record = {
        "kind": "turn",
        "trajectory_id": plan.trajectory_id,
        "turn": plan.turn,
        "session": session.id,
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
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_tokens": turn.max_tokens,
            "seed": turn.seed,
        },
        "time": time.time(),
    }
    if plan.turn == 0:
        record["tools"] = turn.parsed.tools
    await asyncio.to_thread(store.append, record)
    recorded.add(plan.trajectory_id, session.id, turns=plan.turn + 1)
    session.advance(
        plan, segment, version=loaded.version, tools_key=turn.tools_key, keys=turn.parsed.keys + [reply_key]
    )
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if req.logprobs:
        choice["logprobs"] = chat_logprobs(
            loaded.tokenizer, out.token_ids, out.logprobs, out.top, req.return_tokens_as_token_ids
        )
    body = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": loaded.name,
        "system_fingerprint": loaded.version,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(plan.context),
            "completion_tokens": len(out.token_ids),
            "total_tokens": len(plan.context) + len(out.token_ids),
        },
        "lopd": {"session": session.id, "trajectory_id": plan.trajectory_id, "model_version": loaded.version},
    }
    if req.return_token_ids:
        body["prompt_token_ids"], choice["token_ids"] = list(plan.context), list(out.token_ids)
    return body


def _chunk(head: dict, delta: dict, finish=None, logprobs=None) -> str:
    event = {
        **head,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
    }
    return f"data: {json.dumps(event)}\n\n"


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


async def _stream(turn: Turn, batcher, store, recorded, request: Request):
    """Server-sent events of one turn: the role, each token's text as it is sampled (unless held, see the
    module's docstring), then the closing events once the turn is recorded, then [DONE]."""
    req, loaded = turn.req, turn.loaded
    job = watch = None
    try:
        head = {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": loaded.name,
            "system_fingerprint": loaded.version,
            "lopd": {"session": turn.session.id, "model_version": loaded.version},
        }
        live = is_embedded_format(loaded.tokenizer) and not (turn.parsed.tools and req.tool_choice != "none")
        tokens: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_token(token_id: int, logprob: float, top: list) -> None:  # in the decoder's thread
            loop.call_soon_threadsafe(tokens.put_nowait, (token_id, logprob, top))

        job = asyncio.ensure_future(_generate(turn, batcher, on_token))
        watch = asyncio.ensure_future(_cancel_when_gone(request, job))
        yield _chunk(head, {"role": "assistant", "content": ""})
        text = _Text(loaded.tokenizer, loaded.chat.im_end_id)
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
                yield _chunk(head, {"content": piece}, logprobs={"content": pending} if req.logprobs else None)
                pending = []
        if job.cancelled():  # the client went away: nothing is recorded, the session does not advance
            return
        try:
            body = await _record(turn, job.result(), store, recorded)
        except DiskFull as exc:  # the turn is not kept: the client hears so instead of a finish reason
            error = {"error": {"message": str(exc), "type": "server_error", "code": "disk_full", "param": None}}
            yield f"data: {json.dumps(error)}\n\n"
            yield "data: [DONE]\n\n"
            return
        head["lopd"] = body["lopd"]
        choice = body["choices"][0]
        message = choice["message"]
        if message.get("tool_calls"):  # every call of the turn, each with its index (OpenAI's parallel calls)
            delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}
            if message.get("content"):
                delta["content"] = message["content"]
            yield _chunk(head, delta)
        else:
            content = message["content"]
            # what was streamed is a prefix of the message's text; anything else cannot be taken back
            rest = (content[len(text.shown) :] if content.startswith(text.shown) else "") if live else content
            if rest or (live and pending):  # the tokens not sent yet (the end token's log-prob among them)
                yield _chunk(
                    head,
                    {"content": rest},
                    logprobs=(None if not req.logprobs else {"content": pending} if live else choice["logprobs"]),
                )
        yield _chunk(head, {}, choice["finish_reason"])
        if req.stream_options is not None and req.stream_options.include_usage:  # OpenAI's last chunk: no choices
            usage = {**head, "object": "chat.completion.chunk", "choices": [], "usage": body["usage"]}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if job is not None and not job.done():  # the client went away: its row leaves the batch (batching.py)
            job.cancel()
        if watch is not None:
            watch.cancel()
        turn.session.lock.release()


class _Text:
    """The turn's text grown token by token: each new piece is what decoding the longer prefix adds, sent only
    once it decodes cleanly (a byte-level token may be half a character)."""

    def __init__(self, tokenizer, end_id: int):
        self.tokenizer, self.end_id = tokenizer, end_id
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token_id: int) -> str:
        if token_id == self.end_id:
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if not text.startswith(self.shown) or len(text) <= len(self.shown) or text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece
