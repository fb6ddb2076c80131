"""HTTP API: health, models, similarity, search, ingest and metrics. Logic lives in streamxm."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import anyio
import numpy as np
import redis
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from api.schemas import (
    HealthOut,
    Hit,
    ModelInfo,
    ModelsOut,
    PairsIn,
    PairsOut,
    ReadyOut,
    RequestLimits,
    SearchIn,
    SearchOut,
    SimilarityIn,
    SimilarityOut,
    error_responses,
    request_limits,
)
from streamxm.config import Settings, get_settings
from streamxm.service import limits_from, open_store
from streamxm.serving.metrics import ApiMetrics, method_label
from streamxm.serving.server import (
    InvalidModelName,
    ModelNotReady,
    ModelServer,
    SameModalityUnsupported,
    UnknownModel,
    other_modality,
)
from streamxm.stream.client import StreamClient
from streamxm.stream.keys import Keys
from streamxm.stream.messages import InvalidPair, make_pair
from streamxm.stream.redis_conn import connect, resolve_url, str_hash, str_set
from streamxm.worker.stats import WorkerStats

Body = TypeVar("Body")
Out = TypeVar("Out")

_bearer = HTTPBearer(auto_error=False)
Creds = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _unprocessable(field: list[str | int], reason: str, message: str) -> HTTPException:
    return HTTPException(422, detail=[{"loc": ["body", *field], "msg": message, "type": reason}])


_MAX_ERRORS = 10
_MAX_ECHO = 80


def _echo(value: Any) -> Any:
    """A bounded stand-in for an invalid input in an error body."""
    if isinstance(value, str):
        return value if len(value) <= _MAX_ECHO else value[:_MAX_ECHO] + "..."
    if isinstance(value, list | tuple):
        return f"<list of {len(value)} items>"
    if isinstance(value, dict):
        return f"<object with {len(value)} keys>"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value if isinstance(value, int | float | bool) or value is None else repr(value)[
        :_MAX_ECHO]


def bounded_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """At most ten validation errors, each input cut short: a rejected body of any size gets a
    small answer (FastAPI's default lists every error with its whole input)."""
    out = [{"loc": [x if isinstance(x, int) else str(x)[:_MAX_ECHO] for x in e.get("loc", ())],
            "msg": str(e.get("msg", ""))[:300], "type": str(e.get("type", "")),
            "input": _echo(e.get("input"))} for e in errors[:_MAX_ERRORS]]
    if len(errors) > _MAX_ERRORS:
        out.append({"loc": ["body"], "msg": f"{len(errors) - _MAX_ERRORS} more errors not shown",
                    "type": "too_many_errors"})
    return out


class _Limits:
    """Makes this app's request bounds visible to the schema validators (a context variable:
    each app, and each request, sees its own)."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = request_limits.set(self.limits)
        try:
            await self.app(scope, receive, send)
        finally:
            request_limits.reset(token)


def create_app(settings: Settings | None = None, client: redis.Redis | None = None) -> FastAPI:
    """Build the app. Without arguments it reads settings from the environment."""
    settings = settings or get_settings()
    # Two connections: a request waiting on Redis gets a 503 within the short timeout, while the
    # background refresh may take longer over a large checkpoint or gallery read.
    url = resolve_url(settings)
    r = client or connect(settings, url, retries=1,
                          timeout=settings.redis_request_timeout_seconds)
    background = client or connect(settings, url, retries=2, timeout=30.0)
    keys = Keys(settings.namespace)
    limits = limits_from(settings)
    server = ModelServer(background, open_store(settings, background), settings.namespace,
                         gallery_max=settings.gallery_max, limits=limits)
    metrics = ApiMetrics(r, server, keys, timeout=settings.metrics_timeout_seconds)
    producer = StreamClient(r, settings.namespace, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start(settings.reload_interval_seconds)
        yield
        server.stop()

    # No trailing-slash redirects: they echo the request's Host header into Location.
    app = FastAPI(title="streamxm", version="0.1.0", lifespan=lifespan,
                  max_body_size=settings.max_body_bytes, redirect_slashes=False,
                  description="Streaming cross-modal retrieval: similarity and top-k search "
                              "from the newest online model.")
    app.add_middleware(_Limits, limits=RequestLimits.from_settings(settings))

    def check_token(credentials: HTTPAuthorizationCredentials | None) -> None:
        token = settings.api_token
        if token is None:
            return
        given = credentials.credentials if credentials else ""
        # Constant-time comparison; the token itself is never logged.
        if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
            raise HTTPException(401, detail="missing or invalid bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    def bearer(credentials: Creds) -> None:
        check_token(credentials)

    # Only routes that do check a token declare the bearer scheme, so the OpenAPI schema tells
    # clients the truth about which calls need one.
    write_auth = [Depends(bearer)] if settings.api_token else []
    read_auth = write_auth if settings.api_token_for_reads else []
    write_errors = error_responses(400, 413, 503, *([401] if write_auth else []))
    read_errors = error_responses(400, 404, 413, 503, *([401] if read_auth else []))

    # Queries run on threads of their own: routes waiting on a stalled Redis (ingest, models,
    # metrics) hold the default pool's threads, and must not hold up a search, which reads
    # only memory.
    query_threads = anyio.CapacityLimiter(settings.query_threads)
    scrape_threads = anyio.CapacityLimiter(2)

    async def compute(fn: Callable[[Body], Out], body: Body) -> Out:
        return await anyio.to_thread.run_sync(fn, body, limiter=query_threads)

    def model_name(name: str | None) -> str:
        return name or settings.default_model

    def matrix(rows: list[list[float]], field: str, dim: int | None) -> np.ndarray[Any, Any]:
        lengths = {len(row) for row in rows}
        if len(lengths) != 1 or (dim is not None and lengths != {dim}):
            raise _unprocessable([field], "dim_mismatch",
                                 f"every vector must have {dim or 'the same'} values")
        with np.errstate(over="ignore"):  # overflow to Inf is refused just below
            arr = np.asarray(rows, dtype=np.float32)
        if not np.isfinite(arr).all():
            raise _unprocessable([field], "non_finite", "contains NaN or Inf")
        return arr

    @app.middleware("http")
    async def observe(request: Request,
                      call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        # The route template, not the raw path: arbitrary paths must not grow the label set.
        matched = request.scope.get("route")
        route = getattr(matched, "path", "unmatched")
        method = method_label(request.method)
        metrics.request_seconds.labels(route, method).observe(time.perf_counter() - start)
        metrics.requests.labels(route, method, str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": bounded_errors(list(exc.errors()))}, status_code=422)

    @app.exception_handler(UnknownModel)
    async def unknown_model(request: Request, exc: UnknownModel) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(ModelNotReady)
    async def not_ready(request: Request, exc: ModelNotReady) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(redis.RedisError)
    async def redis_down(request: Request, exc: redis.RedisError) -> JSONResponse:
        return JSONResponse({"detail": f"stream store unavailable: {type(exc).__name__}"},
                            status_code=503, headers={"Retry-After": "1"})

    # No blanket ValueError handler: a bad request is refused where it is recognised, naming
    # its field, and anything else is a bug that must surface as a 500 with its traceback logged.
    @app.exception_handler(InvalidModelName)
    async def invalid_model(request: Request, exc: InvalidModelName) -> JSONResponse:
        return JSONResponse({"detail": [{"loc": ["body", "model"], "msg": str(exc),
                                         "type": "unknown_model"}]}, status_code=422)

    # Probes are async and touch nothing but memory: they answer on the event loop even when
    # every worker thread waits on a stalled Redis.
    @app.get("/healthz", response_model=HealthOut)
    async def healthz() -> HealthOut:
        return HealthOut(status="ok")

    @app.get("/readyz", response_model=ReadyOut,
             responses={503: {"model": ReadyOut, "description": "no model checkpoint loaded"}})
    async def readyz() -> JSONResponse:
        if server.ready:
            return JSONResponse({"status": "ready", "models": sorted(server.served)})
        return JSONResponse({"status": "waiting for a model checkpoint", "models": []},
                            status_code=503)

    @app.get("/v1/models", response_model=ModelsOut, dependencies=read_auth,
             responses=error_responses(503, *([401] if read_auth else [])))
    def models() -> ModelsOut:
        out = []
        for name in str_set(r.smembers(keys.models)):
            stats = WorkerStats.from_hash(str_hash(r.hgetall(keys.stats(name))))
            served = server.served.get(name)
            out.append(ModelInfo(
                name=name, loaded=served is not None,
                version=served.version if served else None,
                checkpoint_version=stats.version, pairs_seen=stats.pairs_processed,
                mistakes=stats.mistakes, triplets=stats.triplets, rolling_map=stats.rolling_map,
                checkpoint_time=stats.checkpoint_time,
                gallery_items=served.gallery_size if served else 0,
            ))
        return ModelsOut(models=out)

    @app.post("/v1/similarity", response_model=SimilarityOut, dependencies=read_auth,
              responses=read_errors)
    async def similarity(body: SimilarityIn) -> SimilarityOut:
        return await compute(score, body)

    def score(body: SimilarityIn) -> SimilarityOut:
        name = model_name(body.model)
        dims = server.get(name).model
        images = matrix(body.images, "images", dims.img_dim)
        texts = matrix(body.texts, "texts", dims.txt_dim)
        if body.mode == "paired" and len(images) != len(texts):
            raise _unprocessable(["texts"], "length_mismatch",
                                 "paired mode needs as many texts as images")
        served, scores = server.similarity(name, images, texts, body.mode == "matrix")
        return SimilarityOut(model=name, version=served.version, scores=scores.tolist())

    @app.post("/v1/search", response_model=SearchOut, dependencies=read_auth,
              responses=read_errors)
    async def search(body: SearchIn) -> SearchOut:
        return await compute(rank, body)

    def rank(body: SearchIn) -> SearchOut:
        name = model_name(body.model)
        model = server.get(name).model
        dim = model.img_dim if body.modality == "image" else model.txt_dim
        vector = matrix([body.vector], "vector", dim)[0]
        target = body.target or other_modality(body.modality)
        try:
            served, hits = server.search(name, body.modality, vector, body.k, target)
        except SameModalityUnsupported as exc:
            raise _unprocessable(["target"], "not_shared_space", str(exc)) from None
        return SearchOut(model=name, version=served.version, target=target,
                         results=[Hit(id=i, score=s) for i, s in hits])

    @app.post("/v1/pairs", response_model=PairsOut, status_code=202,
              dependencies=write_auth, responses=write_errors)
    def pairs(body: PairsIn) -> PairsOut:
        validated = []
        for i, p in enumerate(body.pairs):
            try:
                validated.append(make_pair(p.id, p.img, p.txt, p.labels, p.ts, limits))
            except InvalidPair as exc:
                raise _unprocessable(["pairs", i, exc.field], exc.reason, exc.detail) from None
        try:
            ids = producer.push_pairs(validated)
        except InvalidPair as exc:
            index = 0 if exc.index is None else exc.index
            raise _unprocessable(["pairs", index, exc.field], exc.reason, exc.detail) from None
        metrics.pairs_accepted.inc(len(ids))
        return PairsOut(accepted=len(ids), entry_ids=ids)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}},
                              "description": "Prometheus text exposition"}})
    async def prometheus_metrics() -> Response:
        # Threads of its own, like queries: a scrape must not queue behind requests that wait on
        # a stalled Redis (the collector itself waits at most metrics_timeout_seconds).
        text = await anyio.to_thread.run_sync(generate_latest, metrics.registry,
                                              limiter=scrape_threads)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
