"""`POST /admin/reload {"model": DIR}`: load a checkpoint folder (or, without one, the registry's champion),
smoke-test it and swap it in; what a trainer rolling out here calls after each update
(lopd_core/rollout/served.py `sync_weights`).

It has its own key (deps.may_reload) and loads only under `serve.reload_roots`: a chat client must not choose
what the server serves, nor make it read any folder it can name. A refused candidate leaves the current model
serving: 422 when it loads but cannot serve (models.Unservable), 400 when it does not load.

`POST /admin/store/rotate` (`lopd serve store rotate`, same key): the server closes its store's live segments and
moves them into an archive folder it names in the answer, then goes on in a new segment; open sessions go on in
trajectories that carry their history (sessions.py `keep_turn`), so neither store holds a turn without its turn 0.
The cure for a full store while serving: the archive is then snapshot, moved away or deleted by hand.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends

from lopd_serve.deps import Config, Holder, Sessions, Store, may_reload
from lopd_serve.models import Unservable
from lopd_serve.protocol import ApiError, Reload
from lopd_serve.responses import ReloadAnswer, StoreRotation

router = APIRouter(dependencies=[Depends(may_reload)])


@router.post("/admin/reload")
async def reload(cfg: Config, holder: Holder, body: Reload | None = None) -> ReloadAnswer:
    folder = body.model if body else None
    roots = cfg.reload_folders()
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
        raise ApiError(422, f"refused, still serving {holder.current.version}: {exc}", "reload_unservable") from None
    except Exception as exc:  # noqa: BLE001  a broken checkpoint is the caller's error, never a 500
        raise ApiError(400, f"reload failed, still serving {holder.current.version}: {exc}", "reload_failed") from None
    return ReloadAnswer(model_version=version, changed=changed)


@router.post("/admin/store/rotate")
async def rotate_store(store: Store, sessions: Sessions) -> StoreRotation:
    try:
        done = await asyncio.to_thread(store.rotate)
    except OSError as exc:  # the store finishes the move when next opened; until then readers wait for it
        why = f"trace store {store.dir}: the rotation failed ({exc.strerror})"
        raise ApiError(507, why, "rotation_failed", kind="server_error") from None
    open_sessions = [s for s in sessions.sessions.values() if s.trajectory_id and s.judged != s.trajectory_id]
    carried_on = sum(s.epoch != done.epoch for s in open_sessions)
    return StoreRotation(
        store=str(store.dir),
        archive=str(done.archive) if done.archive else None,
        segments=done.segments,
        bytes=done.bytes,
        epoch=done.epoch,
        sessions_carried_on=carried_on,
    )
