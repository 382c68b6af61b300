"""What a route reads of the running server, as FastAPI dependencies on `app.state`, and the key checks.

Why: vLLM's OpenAI server keeps its engine client and handlers on `app.state` and gives each route what it needs
through a dependency, so a route's signature says what it reads and the app factory passes nothing down by hand.
`create_app` (app.py) sets the state once: the settings (`cfg`), the decoder (`batcher`), the admission count,
the session table, the model holder, the trace store, the recorded trajectories feedback may label, and the two
keys.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from lopd_core.traces import StoreFull, TraceStore
from lopd_serve.admission import Admission
from lopd_serve.batching import Batcher
from lopd_serve.config import ServeConfig
from lopd_serve.engine_process import EngineProcess
from lopd_serve.models import ModelHolder
from lopd_serve.protocol import ApiError
from lopd_serve.sessions import Recorded, SessionTable


def _config(request: Request) -> ServeConfig:
    return request.app.state.cfg


def _batcher(request: Request) -> Batcher | EngineProcess:
    return request.app.state.batcher


def _sessions(request: Request) -> SessionTable:
    return request.app.state.sessions


def _holder(request: Request) -> ModelHolder:
    return request.app.state.holder


def _store(request: Request) -> TraceStore:
    return request.app.state.store


def _recorded(request: Request) -> Recorded:
    return request.app.state.recorded


def _admission(request: Request) -> Admission:
    return request.app.state.admission


Config = Annotated[ServeConfig, Depends(_config)]
Decoder = Annotated[Batcher | EngineProcess, Depends(_batcher)]
Sessions = Annotated[SessionTable, Depends(_sessions)]
Holder = Annotated[ModelHolder, Depends(_holder)]
Store = Annotated[TraceStore, Depends(_store)]
RecordedTrajectories = Annotated[Recorded, Depends(_recorded)]
Admitted = Annotated[Admission, Depends(_admission)]


def _bearer(request: Request, expected: str) -> bool:
    given = request.headers.get("authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), expected.encode())


def authorized(request: Request) -> None:
    """The API key (serve.api_key_env) or the reload key, which also serves the API; none needed when the
    server has no key (it then answers loopback names only: app.py's HostAllowList)."""
    key, reload_key = request.app.state.api_key, request.app.state.reload_key
    if key is None or _bearer(request, key) or (reload_key is not None and _bearer(request, reload_key)):
        return
    raise ApiError(
        401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_api_key", kind="authentication_error"
    )


def may_reload(request: Request) -> None:
    """Reload (and the store's rotation) has its own key: a chat client must not choose what the server serves.
    Behind an API key and without a reload key, the admin routes are off; a keyless loopback server serves them
    to its local callers."""
    key, reload_key = request.app.state.api_key, request.app.state.reload_key
    env = request.app.state.cfg.reload_key_env
    if reload_key is not None:
        if not _bearer(request, reload_key):
            raise ApiError(
                401,
                f"{request.url.path} needs the reload key (Authorization: Bearer KEY, from {env})",
                "invalid_reload_key",
                kind="authentication_error",
            )
    elif key is not None:
        raise ApiError(
            403,
            f"{request.url.path} is off behind an API key: set a reload key in {env}",
            "reload_off",
            kind="permission_error",
        )


def ensure_room(store: TraceStore, *, feedback: bool = False) -> None:
    """503 when the store is at its bound (feedback may use its reserve past it): never a silent drop."""
    try:
        store.ensure_room(feedback=feedback)
    except StoreFull as exc:
        raise ApiError(503, str(exc), "trace_store_full", kind="server_error") from None
