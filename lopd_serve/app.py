"""The HTTP app of `lopd serve` (FastAPI): chat completions (chat.py), completions on token ids
(completions.py), models, health, feedback, reload.

Every limit is a 4xx in OpenAI's error shape. `POST /admin/reload {"model": DIR}` swaps in a checkpoint folder
(what a trainer calls after each update when it rolls out here: lopd_core/rollout/served.py `sync_weights`);
without a folder it reloads the registry's champion.

A server started on a store goes on with the conversations it holds: its session table and feedback targets are
rebuilt from the store's records (resume.py).

Extensions beside OpenAI's fields (as vLLM adds its own): a response carries `lopd: {session, trajectory_id,
model_version}`, and a session is named by the `X-Session-Id` header or `user`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lopd_core.traces import DiskFull, StoreFull, TraceStore
from lopd_serve.batching import Batcher
from lopd_serve.chat import add_chat
from lopd_serve.completions import add_completions
from lopd_serve.config import ServeConfig
from lopd_serve.models import ModelHolder, Unservable
from lopd_serve.protocol import ApiError, Feedback, Reload, error_response
from lopd_serve.resume import resume_sessions
from lopd_serve.sessions import Recorded, SessionTable

log = logging.getLogger("lopd.serve")
RECORDED_PER_SESSION = 64  # feedback targets kept per session slot (serve.max_sessions): the oldest go first


class BodyLimit:
    """Refuse a request body over `limit` bytes with 413 before it is parsed (a declared length or a chunked
    body that outgrows it alike), and one that does not arrive within `timeout_s` with 408: a client sending a
    byte a minute would otherwise hold its connection and its task for ever."""

    def __init__(self, app, limit: int, timeout_s: float = 30.0):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                response = error_response(
                    408, f"the request body did not arrive within {self.timeout_s:g}s (serve.body_timeout_s)", "timeout"
                )
                return await response(scope, receive, send)
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
        response = error_response(
            413, f"request body over {self.limit} bytes (serve.max_body_bytes)", "request_too_large"
        )
        await response(scope, receive, send)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class HostAllowList:
    """Refuse (400) a request whose Host header names none of `allowed` (the port aside). DNS rebinding: a web
    page on evil.example re-points its name to 127.0.0.1, and the browser then lets its script talk to a keyless
    loopback server as if it were the page's own, Host still reading evil.example."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, {a.lower() for a in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
        name = host[: host.find("]") + 1] if host.startswith("[") else host.split(":", 1)[0]  # the port aside
        if name in self.allowed:
            return await self.app(scope, receive, send)
        response = error_response(
            400,
            f"Host {host!r} is not a loopback name; a keyless server answers only those (serve.allowed_hosts)",
            "invalid_host",
        )
        return await response(scope, receive, send)


def create_app(cfg: ServeConfig, holder: ModelHolder, store: TraceStore) -> FastAPI:
    batcher = Batcher(window_s=cfg.batch_window_ms / 1000, max_batch=cfg.max_batch, seed=cfg.seed)
    sessions = SessionTable(cfg.max_sessions, idle_s=900.0, per_client=cfg.max_sessions_per_client)
    key = cfg.api_key()
    recorded = Recorded(cap=RECORDED_PER_SESSION * cfg.max_sessions)  # feedback targets, the latest kept
    # a restarted server goes on with the conversations its store holds (resume.py)
    resumed = resume_sessions(store.dir, sessions, recorded)
    if resumed:
        log.warning("resumed %d sessions from %s", resumed, store.dir)

    # behind a key, the schema pages are not served to whoever asks: they name every route and field
    pages = {} if key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="lopd serve", lifespan=_lifespan(cfg, batcher, holder, store), **pages)
    app.state.batcher, app.state.sessions, app.state.holder, app.state.store = batcher, sessions, holder, store
    app.state.recorded = recorded
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, timeout_s=cfg.body_timeout_s)
    if key is None:  # a keyless server trusts whoever reaches it: only through a loopback name
        app.add_middleware(HostAllowList, allowed=(*LOOPBACK_HOSTS, *cfg.allowed_hosts))

    _add_error_handlers(app)

    reload_key = cfg.reload_key()

    def bearer(request: Request, expected: str) -> bool:
        given = request.headers.get("authorization", "")
        return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), expected.encode())

    def authorized(request: Request) -> None:
        if key is None or bearer(request, key) or (reload_key is not None and bearer(request, reload_key)):
            return
        raise ApiError(
            401,
            "missing or wrong API key (Authorization: Bearer KEY)",
            "invalid_api_key",
            kind="authentication_error",
        )

    def may_reload(request: Request) -> None:
        """Reload has its own key: a chat client must not choose what the server serves. Behind an API key and
        without a reload key, reload is off; a keyless loopback server reloads for its local callers."""
        if reload_key is not None:
            if not bearer(request, reload_key):
                raise ApiError(
                    401,
                    f"/admin/reload needs the reload key (Authorization: Bearer KEY, from {cfg.reload_key_env})",
                    "invalid_reload_key",
                    kind="authentication_error",
                )
        elif key is not None:
            raise ApiError(
                403,
                f"/admin/reload is off behind an API key: set a reload key in {cfg.reload_key_env}",
                "reload_off",
                kind="permission_error",
            )

    def room(*, feedback: bool = False) -> None:
        try:
            store.ensure_room(feedback=feedback)
        except StoreFull as exc:
            raise ApiError(503, str(exc), "trace_store_full", kind="server_error") from None

    @app.get("/health")
    async def health(request: Request):
        try:
            authorized(request)
        except ApiError:  # a liveness probe needs no key; what is served, from where, and the traffic does
            return {"status": "ok"}
        return {
            "status": "ok",
            "model_version": holder.current.version,
            "sessions": len(sessions.sessions),
            "batches": batcher.batches,
            "batched_requests": batcher.rows,
            "store": {"dir": str(store.dir), "bytes": store.total_bytes, "max_bytes": store.max_bytes},
        }

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        current = holder.current
        return {
            "object": "list",
            "data": [
                {
                    "id": current.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "lopd",
                    "lopd_version": current.version,
                }
            ],
        }

    add_chat(
        app,
        cfg,
        batcher=batcher,
        sessions=sessions,
        holder=holder,
        store=store,
        recorded=recorded,
        authorized=authorized,
        room=room,
    )
    add_completions(app, cfg, batcher, holder, authorized)

    _add_feedback(app, sessions=sessions, store=store, recorded=recorded, authorized=authorized, room=room)
    _add_reload(app, holder, may_reload, cfg.reload_folders())
    return app


def disk_full_error(exc: DiskFull) -> ApiError:
    """A record that could not be written (the disk is full): 507, the request's turn not kept, nothing partial on
    disk; the client may retry once space is freed."""
    return ApiError(507, str(exc), "disk_full", kind="server_error")


def _where(error: dict) -> str:
    """A validation error's field as a path (`messages.2.name`), the union branch pydantic tried left out."""
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    return ".".join(p for p in loc if p not in ("str", "int", "float", "bool") and "[" not in p)


def _add_error_handlers(app) -> None:
    """Every error in OpenAI's shape: validation 400, unknown route 404, anything unexpected 500."""

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(
                400, f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse')}", "invalid_json"
            )
        unknown = [_where(e) for e in errors if e.get("type") == "extra_forbidden"]
        if unknown:  # a field the server would ignore is named, never dropped (protocol.Strict)
            return error_response(
                400,
                f"unsupported field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: lopd serve does not "
                "implement it, and ignoring it would serve something else than asked",
                "unsupported_field",
                param=unknown[0],
            )
        where = _where(first)
        return error_response(400, f"{where}: {first.get('msg', 'invalid')}", "invalid_request", param=where or None)

    @app.exception_handler(DiskFull)
    async def disk_full(request, exc: DiskFull):
        return disk_full_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http")

    @app.exception_handler(Exception)
    async def crash(request, exc):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error", kind="server_error")


def _add_feedback(app, *, sessions, store, recorded: Recorded, authorized, room) -> None:
    @app.post("/v1/feedback", dependencies=[Depends(authorized)])
    async def feedback(fb: Feedback):
        if not math.isfinite(fb.reward) or not 0.0 <= fb.reward <= 1.0:
            raise ApiError(422, f"reward={fb.reward}: expected a number in [0, 1]", "invalid_reward", param="reward")
        if fb.success and fb.reward != 1.0:
            raise ApiError(
                422,
                f"success with reward={fb.reward}: a success passes every check (reward 1)",
                "invalid_reward",
                param="success",
            )
        session = sessions.find(fb.session)
        trajectory_id = fb.trajectory_id or (session.trajectory_id if session else "")
        if not trajectory_id:
            raise ApiError(
                404,
                f"session {fb.session!r}: no conversation recorded (or it was closed for idleness: name trajectory_id)",
                "unknown_session",
                param="session",
            )
        if recorded.get(trajectory_id) != fb.session:  # a label must land on a conversation of that session
            raise ApiError(
                404,
                f"trajectory {trajectory_id!r}: not a conversation of session {fb.session!r} in this server's "
                f"store (among its latest {recorded.cap})",
                "unknown_trajectory",
                param="trajectory_id",
            )
        room(feedback=True)  # labels of conversations already answered may pass the bound (its reserve)
        turns = recorded.turns(trajectory_id)
        record = {
            "kind": "feedback",
            "session": fb.session,
            "trajectory_id": trajectory_id,
            "reward": fb.reward,
            "success": fb.success,
            "checks": fb.checks,
            "time": time.time(),
            "turns": turns,  # the turns this label judges; a turn recorded after them clears it (store.py)
        }
        await asyncio.to_thread(store.append, record)
        if session is not None and session.trajectory_id == trajectory_id:
            session.labeled = True  # its conversation is judged: the first to make room (sessions.py)
            session.judged = trajectory_id  # and its next turn starts a new trajectory (plan_turn)
        return {"ok": True, "trajectory_id": trajectory_id, "turns": turns}


def _add_reload(app, holder, may_reload, roots: list[Path]) -> None:
    @app.post("/admin/reload", dependencies=[Depends(may_reload)])
    async def reload(body: Reload | None = None):
        folder = body.model if body else None
        if folder and not any(Path(folder).resolve().is_relative_to(root) for root in roots):
            raise ApiError(
                403,
                f"{folder}: not under a reload root ({', '.join(map(str, roots))}; serve.reload_roots)",
                "reload_outside_roots",
                kind="permission_error",
                param="model",
            )
        try:
            version, changed = await asyncio.to_thread(holder.reload, folder)
        except Unservable as exc:
            raise ApiError(
                422, f"refused, still serving {holder.current.version}: {exc}", "reload_unservable"
            ) from None
        except Exception as exc:  # noqa: BLE001  a broken checkpoint is the caller's error, never a 500
            raise ApiError(
                400, f"reload failed, still serving {holder.current.version}: {exc}", "reload_failed"
            ) from None
        return {"model_version": version, "changed": changed}


def _lifespan(cfg: ServeConfig, batcher: Batcher, holder: ModelHolder, store: TraceStore):
    """Start the decoder thread (and the registry poller, serving the registry) with the app; stop them after,
    then close the store (its writer lock goes with it)."""

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
        store.close()

    return lifespan
