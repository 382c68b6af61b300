"""`GET /health` and `GET /v1/models`: what is served. A liveness probe needs no key and hears only "ok"; the
served version, the traffic and the store's fill are for a caller with the key (they name what is served and from
where)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from lopd_serve.deps import Admitted, Decoder, Holder, Sessions, Store, authorized
from lopd_serve.protocol import ApiError
from lopd_serve.responses import EngineStatus, Health, ModelCard, ModelList, QueueStatus, StoreStatus

router = APIRouter()


@router.get("/health", response_model_exclude_none=True)
async def health(
    request: Request, holder: Holder, sessions: Sessions, decoder: Decoder, store: Store, admission: Admitted
) -> Health:
    try:
        authorized(request)
    except ApiError:
        return Health()
    return Health(
        model_version=holder.current.version,
        sessions=len(sessions.sessions),
        batches=decoder.batches,
        batched_requests=decoder.rows,
        engine=EngineStatus(
            busy_s=round(decoder.busy_s, 3),
            cpu_s=round(decoder.cpu_s, 3),
            steps=decoder.batches,
            tokens=decoder.tokens,
            restarts=decoder.restarts,
            ready=decoder.ready,
        ),
        queue=QueueStatus(admitted=admission.active, limit=admission.limit, refused=admission.refused),
        store=StoreStatus(dir=str(store.dir), bytes=store.total_bytes, max_bytes=store.max_bytes),
    )


@router.get("/v1/models", dependencies=[Depends(authorized)])
async def models(holder: Holder) -> ModelList:
    current = holder.current
    return ModelList(data=[ModelCard(id=current.name, lopd_version=current.version)])
