"""Build the served app from a ServeConfig and run it under uvicorn (`lopd serve`)."""

from __future__ import annotations

import uvicorn

from lopd_core.traces import TraceStore
from lopd_serve.app import create_app
from lopd_serve.config import ServeConfig, ServeConfigError
from lopd_serve.models import ModelHolder, Registry, Unservable, check_positions, initial_model


def open_store(cfg: ServeConfig) -> TraceStore:
    return TraceStore(
        cfg.store_dir,
        segment_bytes=cfg.store_segment_bytes,
        max_bytes=cfg.store_max_bytes,
        feedback_bytes=cfg.store_feedback_bytes,
    )


def build_app(cfg: ServeConfig):
    """The store first: a second server on the same store is refused before it spends a minute loading a model."""
    cfg.check_exposure()
    store = open_store(cfg)
    try:
        registry = (
            None if cfg.model else Registry(cfg.tracking_uri, cfg.registered_model, cfg.alias, cfg.model_cache_dir)
        )
        loaded = initial_model(cfg.model, registry, cfg.server_device())
        try:  # a context limit past the model's positions would fail (or silently degrade) its longest requests
            check_positions(loaded, cfg.max_context)
        except Unservable as exc:
            raise ServeConfigError(str(exc)) from None
        holder = ModelHolder(loaded, registry=registry, device=cfg.server_device(), max_context=cfg.max_context)
    except BaseException:
        store.close()
        raise
    return create_app(cfg, holder, store)


def run(cfg: ServeConfig, log=print) -> None:
    app = build_app(cfg)
    log(
        f"serving {app.state.holder.current.version} on http://{cfg.host}:{cfg.port}/v1 "
        f"(traces in {cfg.store_dir}; API key {'required' if cfg.api_key() else 'off: loopback only'})"
    )
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        # requests in flight get the first part of the stop's grace; the rest is the engine's and the store's
        timeout_graceful_shutdown=min(5.0, cfg.stop_grace_s / 2),
        timeout_keep_alive=cfg.keep_alive_s,  # an idle kept-alive connection is closed (slow clients)
    )
    server = _StoppableServer(config)
    server.run()
    if not server.started:  # the port is taken, the app failed to start: uvicorn.run's status
        raise SystemExit(3)


class _StoppableServer(uvicorn.Server):
    """uvicorn's server, its SIGTERM/SIGINT also reported to lopd_core/stopping.py: uvicorn's handler replaces
    ours while it serves, and without the report a stop during a slow start or shutdown had no grace and no
    second-signal exit (measured: 46 s after SIGTERM while the engine was starting)."""

    def handle_exit(self, sig, frame) -> None:
        from lopd_core.stopping import note_signal

        note_signal(sig, "uvicorn")
        super().handle_exit(sig, frame)
