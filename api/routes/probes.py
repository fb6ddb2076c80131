"""Liveness, readiness and the Prometheus scrape: open to every prober, never waiting on Redis."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import AppSettings, Context, Server
from api.schemas import GalleryHealth, HealthOut, ReadyOut
from streamxm.serving.server import ModelServer

router = APIRouter(tags=["probes"])


# Probes are async and touch nothing but memory: they answer on the event loop even when every
# worker thread waits on a stalled Redis.
@router.get("/healthz", response_model=HealthOut)
async def healthz() -> HealthOut:
    return HealthOut(status="ok")


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "no model checkpoint loaded"}},
)
async def readyz(server: Server, settings: AppSettings) -> JSONResponse:
    if settings.api_role == "ingest":  # takes pairs from the start; serves no model
        return JSONResponse({"status": "ready", "models": []})
    if server.ready:
        # Ready but degraded: search serves every segment but the corrupt ones (named).
        gallery = GalleryHealth.of(server.gallery_corrupt)
        shards = _shards(server)
        degraded = gallery.degraded or any(not s["up"] for s in shards)
        body: dict[str, object] = {
            "status": "degraded" if degraded else "ready",
            "models": sorted(server.served),
            "gallery": gallery.model_dump(),
        }
        if server.shards is not None:
            body["shards"] = shards
        return JSONResponse(body)
    return JSONResponse({"status": "waiting for a model checkpoint", "models": []}, status_code=503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition"}},
)
async def prometheus_metrics(context: Context) -> Response:
    text = await anyio.to_thread.run_sync(
        generate_latest, context.metrics.registry, limiter=context.scrape_threads
    )
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def _shards(server: ModelServer) -> list[dict[str, object]]:
    """Each gallery shard of the ``ray`` backend as the last refresh saw it (none: local)."""
    if server.shards is None:
        return []
    out: list[dict[str, object]] = []
    for index, status in enumerate(server.shards.statuses):
        if status is None:
            out.append({"shard": index, "up": False})
            continue
        out.append(
            {
                "shard": index,
                "up": status.caught_up,
                "rows": status.rows,
                "versions": {m: max(v) for m, v in status.versions.items() if v},
                "build_seconds": {m: round(t, 3) for m, t in status.build_seconds.items()},
                "resident_bytes": status.resident_bytes,
                "device": status.device,
            }
        )
    return out
