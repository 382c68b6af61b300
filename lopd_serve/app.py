"""The HTTP app of `lopd serve` (FastAPI), laid out as vLLM's OpenAI server is: one router per endpoint
(chat.py, completions.py, feedback.py, admin.py, health.py), each reading what it needs of `app.state`
through dependencies (deps.py); request and response models in protocol.py and responses.py; two middlewares
in front (middleware.py). This file builds the state, mounts the routers and maps every error to OpenAI's shape.

Every limit is a 4xx in OpenAI's error shape. Extensions beside OpenAI's fields (as vLLM adds its own): a
response carries `lopd: {session, trajectory_id, model_version}`, and a session is named by the `X-Session-Id`
header or `user`.

A server started on a store goes on with the conversations it holds: its session table and feedback targets are
rebuilt from the store's records (resume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lopd_core.traces import DiskFull, TraceStore
from lopd_serve import admin, chat, completions, feedback, health
from lopd_serve.admission import Admission, decoder_error
from lopd_serve.batching import Batcher, DeadlineExceeded, Unavailable
from lopd_serve.config import ServeConfig
from lopd_serve.engine_process import EngineProcess
from lopd_serve.middleware import LOOPBACK_HOSTS, BodyLimit, HostAllowList
from lopd_serve.models import ModelHolder
from lopd_serve.protocol import ApiError, error_response
from lopd_serve.resume import resume_sessions
from lopd_serve.sessions import Recorded, SessionTable

log = logging.getLogger("lopd.serve")
RECORDED_PER_SESSION = 64  # feedback targets kept per session slot (serve.max_sessions): the oldest go first


def decoder_for(cfg: ServeConfig) -> Batcher | EngineProcess:
    """The decoder `serve.engine` names: a process of its own (the default), or a thread of the server's."""
    window_s, timeout_s = cfg.batch_window_ms / 1000, cfg.request_timeout_s
    if cfg.engine == "process":
        return EngineProcess(
            window_s=window_s,
            max_batch=cfg.max_batch,
            seed=cfg.seed,
            device=cfg.device,
            timeout_s=timeout_s,
            heartbeat_s=cfg.engine_heartbeat_s,
            engine_timeout_s=cfg.engine_timeout_s,
        )
    return Batcher(window_s=window_s, max_batch=cfg.max_batch, seed=cfg.seed, timeout_s=timeout_s)


def create_app(cfg: ServeConfig, holder: ModelHolder, store: TraceStore) -> FastAPI:
    batcher = decoder_for(cfg)
    holder.before_swap = batcher.prepare  # the engine loads a new model before requests are rendered for it
    key = cfg.api_key()
    # behind a key, the schema pages are not served to whoever asks: they name every route and field
    pages = {} if key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="lopd serve", lifespan=_lifespan(cfg, batcher, holder, store), **pages)
    app.state.cfg, app.state.batcher, app.state.holder, app.state.store = cfg, batcher, holder, store
    app.state.admission = Admission(limit=cfg.max_batch + cfg.max_queue, timeout_s=cfg.request_timeout_s)
    app.state.sessions = SessionTable(cfg.max_sessions, idle_s=900.0, per_client=cfg.max_sessions_per_client)
    app.state.recorded = Recorded(cap=RECORDED_PER_SESSION * cfg.max_sessions)  # feedback targets, the latest
    # a restarted server goes on with the conversations its store holds (resume.py)
    resumed = resume_sessions(store.dir, app.state.sessions, app.state.recorded, epoch=store.epoch)
    if resumed:
        log.warning("resumed %d sessions from %s", resumed, store.dir)
    app.state.api_key, app.state.reload_key = key, cfg.reload_key()
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, timeout_s=cfg.body_timeout_s)
    if key is None:  # a keyless server trusts whoever reaches it: only through a loopback name
        app.add_middleware(HostAllowList, allowed=(*LOOPBACK_HOSTS, *cfg.allowed_hosts))
    _add_error_handlers(app)
    for module in (health, chat, completions, feedback, admin):
        app.include_router(module.router)
    return app


def _where(error: dict) -> str:
    """A validation error's field as a path (`messages.2.name`), the union branch pydantic tried left out."""
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    return ".".join(p for p in loc if p not in ("str", "int", "float", "bool") and "[" not in p)


def _add_error_handlers(app) -> None:
    """Every error in OpenAI's shape: validation 400 (a validator's own code kept: `unsupported`), unknown route
    404, a full disk 507, a decoder that cannot answer (restarting, past the deadline) 503 with Retry-After,
    anything unexpected 500."""

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(Unavailable)
    @app.exception_handler(DeadlineExceeded)
    async def decoder_unavailable(request, exc):
        return decoder_error(exc).response()

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
        where, ctx = _where(first), first.get("ctx") or {}
        message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid")
        return error_response(400, message, ctx.get("code", "invalid_request"), param=where or ctx.get("param"))

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


def disk_full_error(exc: DiskFull) -> ApiError:
    """A record that could not be written (the disk is full): 507, the request's turn not kept, nothing partial on
    disk; the client may retry once space is freed."""
    return ApiError(507, str(exc), "disk_full", kind="server_error")


def _lifespan(cfg: ServeConfig, batcher: Batcher | EngineProcess, holder: ModelHolder, store: TraceStore):
    """Start the decoder with the served model loaded (and the registry poller, serving the registry) with the
    app; stop them after, then close the store (its writer lock goes with it)."""

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
        await asyncio.to_thread(batcher.start)
        await asyncio.to_thread(batcher.prepare, holder.current)
        poller = asyncio.create_task(poll_registry()) if cfg.poll_s > 0 and holder.registry else None
        yield
        if poller:
            poller.cancel()
        await asyncio.to_thread(batcher.stop)
        store.close()

    return lifespan
