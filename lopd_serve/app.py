"""The HTTP app of `lopd serve` (FastAPI): chat completions, models, health, feedback, reload.

One request's path: validate (every limit a 4xx in OpenAI's error shape), take the session's lock, plan the turn
against the session's trajectory (sessions.py), queue the context for the batched decoder (batching.py), turn
the sampled ids into an OpenAI message (conversation.py), append the turn to the trace store (fsync'd) and
only then answer. Streaming sends the finished turn as server-sent events, token by token, ending in `[DONE]`:
the turn is decoded in a batch before the first event, so a stream's first token comes when the turn is done.

Extensions beside OpenAI's fields (as vLLM adds its own): a response carries `lopd: {session, trajectory_id,
model_version}`, and a session is named by the `X-Session-Id` header or `user`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lopd_core.traces import StoreFull, TraceStore
from lopd_serve.batching import Batcher
from lopd_serve.config import ServeConfig
from lopd_serve.conversation import parse_messages, reply
from lopd_serve.models import ModelHolder
from lopd_serve.protocol import ApiError, ChatRequest, Feedback, Reload, error_response
from lopd_serve.sessions import SessionTable, plan_turn

log = logging.getLogger("lopd.serve")
SESSION_HEADER = "x-session-id"


class BodyLimit:
    """Refuse a request body over `limit` bytes with 413 before it is parsed (a declared length or a chunked
    body that outgrows it alike)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._refuse(scope, receive, send)
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(413, f"request body over {self.limit} bytes (serve.max_body_bytes)",
                                  "request_too_large")
        await response(scope, receive, send)


def create_app(cfg: ServeConfig, holder: ModelHolder, store: TraceStore) -> FastAPI:
    batcher = Batcher(window_s=cfg.batch_window_ms / 1000, max_batch=cfg.max_batch, seed=cfg.seed)
    sessions = SessionTable(cfg.max_sessions, idle_s=900.0)
    key = cfg.api_key()
    recorded: dict[str, str] = {}  # trajectory id -> session, of what this process wrote (feedback targets)

    async def poll_registry():
        while True:
            await asyncio.sleep(cfg.poll_s)
            try:
                version, changed = await asyncio.to_thread(holder.reload)
                if changed:
                    log.warning("now serving %s", version)
            except Exception as exc:  # noqa: BLE001  an unreachable registry keeps the current model
                log.warning("registry poll failed, still serving %s: %s", holder.current.version, exc)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        poller = asyncio.create_task(poll_registry()) if cfg.poll_s > 0 and holder.registry else None
        yield
        if poller:
            poller.cancel()
        await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="lopd serve", lifespan=lifespan)
    app.state.batcher, app.state.sessions, app.state.holder, app.state.store = batcher, sessions, holder, store
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse')}",
                                  "invalid_json")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where}: {first.get('msg', 'invalid')}", "invalid_request", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http")

    @app.exception_handler(Exception)
    async def crash(request, exc):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error", kind="server_error")

    def authorized(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_api_key",
                           kind="authentication_error")

    def room() -> None:
        try:
            store.ensure_room()
        except StoreFull as exc:
            raise ApiError(503, str(exc), "trace_store_full", kind="server_error") from None

    @app.get("/health")
    async def health():
        return {"status": "ok", "model_version": holder.current.version, "sessions": len(sessions.sessions),
                "batches": batcher.batches, "batched_requests": batcher.rows,
                "store": {"dir": str(store.dir), "bytes": store.total_bytes, "max_bytes": store.max_bytes}}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        current = holder.current
        return {"object": "list", "data": [{"id": current.name, "object": "model", "created": 0,
                                            "owned_by": "lopd", "lopd_version": current.version}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(req: ChatRequest, request: Request):
        if req.n != 1:
            raise ApiError(400, "n: only 1 choice per request is supported", "unsupported", param="n")
        if req.stop:
            raise ApiError(400, "stop: stop sequences are not supported (a turn ends at the model's end token)",
                           "unsupported", param="stop")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise ApiError(400, "response_format: only text is supported", "unsupported", param="response_format")
        max_tokens = req.max_completion_tokens or req.max_tokens or cfg.default_max_tokens
        if max_tokens > cfg.max_tokens_limit:
            raise ApiError(400, f"max_tokens={max_tokens}: at most {cfg.max_tokens_limit} (serve.max_tokens_limit)",
                           "max_tokens_too_large", param="max_tokens")
        parsed = parse_messages(req, max_messages=cfg.max_messages)
        room()
        session = sessions.get(request.headers.get(SESSION_HEADER) or req.user)
        async with session.lock:
            loaded = holder.current  # this request's model, kept to the end even if a swap happens meanwhile
            tools_key = json.dumps(parsed.tools, sort_keys=True)
            plan = plan_turn(session, parsed, tools_key, loaded.chat, loaded.version)
            if len(plan.context) + max_tokens > cfg.max_context:
                raise ApiError(400, f"the conversation is {len(plan.context)} tokens; with max_tokens={max_tokens} "
                               f"it exceeds the context limit of {cfg.max_context} (serve.max_context)",
                               "context_length_exceeded", param="messages")
            seed = req.seed if req.seed is not None else batcher.draw_seed()
            out = await batcher.generate(loaded, plan.context, temperature=req.temperature, top_p=req.top_p,
                                         max_tokens=max_tokens, seed=seed % 2**63)
            declared = {t["function"]["name"] for t in parsed.tools}
            message, finish, reply_key = reply(loaded.chat, out.token_ids, stopped=out.stopped, declared=declared,
                                               tool_choice=req.tool_choice)
            segment = plan.segment
            prompt_length = len(segment) if plan.turn == 0 else 0
            segment.add_action(out.token_ids, out.logprobs)
            if not out.stopped:
                segment.add_forced([loaded.chat.im_end_id])  # closed by the server, as the engine closes a turn
            request_messages = [m.model_dump(exclude_none=True) for m in req.messages]
            record = {"kind": "turn", "trajectory_id": plan.trajectory_id, "turn": plan.turn,
                      "session": session.id, "origin": plan.origin if plan.turn == 0 else "extends",
                      "parent": plan.parent, "model_version": loaded.version, "prompt_length": prompt_length,
                      "token_ids": segment.token_ids, "action_mask": segment.action_mask,
                      "sample_logprobs": segment.sample_logprobs, "finish_reason": finish,
                      "messages": request_messages[-plan.new_messages:] + [message],
                      "sampling": {"temperature": req.temperature, "top_p": req.top_p, "max_tokens": max_tokens,
                                   "seed": seed}, "time": time.time()}
            if plan.turn == 0:
                record["tools"] = parsed.tools
            await asyncio.to_thread(store.append, record)  # on disk before the client hears of it
            recorded[plan.trajectory_id] = session.id
            session.advance(plan, segment, version=loaded.version, tools_key=tools_key,
                            keys=parsed.keys + [reply_key])
        body = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
                "model": loaded.name, "system_fingerprint": loaded.version,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(plan.context), "completion_tokens": len(out.token_ids),
                          "total_tokens": len(plan.context) + len(out.token_ids)},
                "lopd": {"session": session.id, "trajectory_id": plan.trajectory_id,
                         "model_version": loaded.version}}
        if not req.stream:
            return body
        return StreamingResponse(_events(body, loaded.tokenizer, out.token_ids, loaded.chat.im_end_id),
                                 media_type="text/event-stream")

    @app.post("/v1/feedback", dependencies=[Depends(authorized)])
    async def feedback(fb: Feedback):
        if not math.isfinite(fb.reward) or not 0.0 <= fb.reward <= 1.0:
            raise ApiError(422, f"reward={fb.reward}: expected a number in [0, 1]", "invalid_reward", param="reward")
        if fb.success and fb.reward != 1.0:
            raise ApiError(422, f"success with reward={fb.reward}: a success passes every check (reward 1)",
                           "invalid_reward", param="success")
        session = sessions.find(fb.session)
        trajectory_id = fb.trajectory_id or (session.trajectory_id if session else "")
        if not trajectory_id:
            raise ApiError(404, f"session {fb.session!r}: no conversation recorded (or it was closed for "
                           "idleness: name trajectory_id)", "unknown_session", param="session")
        if recorded.get(trajectory_id) != fb.session:  # a label must land on a conversation of that session
            raise ApiError(404, f"trajectory {trajectory_id!r}: not a conversation of session {fb.session!r} "
                           "served by this process", "unknown_trajectory", param="trajectory_id")
        room()
        record = {"kind": "feedback", "session": fb.session, "trajectory_id": trajectory_id,
                  "reward": fb.reward, "success": fb.success, "checks": fb.checks, "time": time.time()}
        await asyncio.to_thread(store.append, record)
        return {"ok": True, "trajectory_id": trajectory_id}

    @app.post("/admin/reload", dependencies=[Depends(authorized)])
    async def reload(body: Reload | None = None):
        try:
            version, changed = await asyncio.to_thread(holder.reload, body.model if body else None)
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ApiError(400, f"reload failed, still serving {holder.current.version}: {exc}",
                           "reload_failed") from None
        return {"model_version": version, "changed": changed}

    return app


async def _events(body: dict, tokenizer, token_ids: list[int], end_id: int):
    """The finished turn as chat.completion.chunk events: the role, the content token by token (or the tool
    call whole), the finish reason, then [DONE]."""
    def chunk(delta: dict, finish=None) -> str:
        event = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                 "model": body["model"], "system_fingerprint": body["system_fingerprint"],
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                 "lopd": body["lopd"]}
        return f"data: {json.dumps(event)}\n\n"

    choice = body["choices"][0]
    message = choice["message"]
    yield chunk({"role": "assistant", "content": ""})
    if message.get("tool_calls"):
        calls = [{"index": 0, **message["tool_calls"][0]}]
        yield chunk({"tool_calls": calls})
    else:
        for piece in _pieces(tokenizer, token_ids, end_id, message["content"]):
            yield chunk({"content": piece})
    yield chunk({}, choice["finish_reason"])
    yield "data: [DONE]\n\n"


def _pieces(tokenizer, token_ids: list[int], end_id: int, content: str) -> list[str]:
    """The content in one piece per token where decoding prefixes reproduces it exactly; else whole (a model's
    own template may rewrite the text: a dropped think block, a call in another syntax)."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] == end_id else token_ids
    pieces, shown = [], ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=False)
        if text.startswith(shown) and len(text) > len(shown) and not text.endswith("\ufffd"):
            pieces.append(text[len(shown):])
            shown = text
    return pieces if shown == content else [content]
