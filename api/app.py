"""The FastAPI app: builds the parts from the settings, includes the routers of ``api/routes``
and maps the library's exceptions to HTTP answers. Logic lives in streamxm."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import redis
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from redis.exceptions import RedisClusterException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import ApiContext, require_token
from api.routes import ingest, probes, queries
from api.schemas import RequestLimits, error_responses, request_limits
from streamxm.config import Settings, get_settings
from streamxm.service import limits_from, open_namespace, open_store
from streamxm.serving.champion import ChampionRule
from streamxm.serving.httpserver import freeze_startup_objects
from streamxm.serving.metrics import ApiMetrics, method_label
from streamxm.serving.server import InvalidModelName, ModelNotReady, ModelServer, UnknownModel
from streamxm.storage.checkpoint import VersionNotKept
from streamxm.stream.client import StreamClient
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import UNAVAILABLE, Replication, connect, resolve_url

log = logging.getLogger(__name__)

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


class _PlainPath:
    """Refuses a path with an encoded slash or backslash (``%2F``, ``%5C``): the server decodes
    them before routing, so ``/v1%2Fpairs`` would reach ``/v1/pairs`` past a proxy that guards
    writes by the raw path's prefix."""

    _ENCODED = (b"%2f", b"%5c")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = (scope.get("raw_path") or b"").lower() if scope["type"] == "http" else b""
        if any(code in raw for code in self._ENCODED):
            await JSONResponse({"detail": "an encoded slash (%2F) or backslash (%5C) in the "
                                "path is refused"}, status_code=400)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Observe:
    """Request latency and status per route template (plain ASGI: a ``BaseHTTPMiddleware``
    costs a task and a body copy per request, a large share of a search's time)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # an exception escaping the app becomes a 500: it must be counted too

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            # The route template, not the raw path: arbitrary paths must not grow the label set.
            route = getattr(scope.get("route"), "path", "unmatched")
            method = method_label(scope.get("method", ""))
            self.metrics.request_seconds.labels(route, method).observe(
                time.perf_counter() - start)
            self.metrics.requests.labels(route, method, str(status)).inc()


def _refuse_routes(app: FastAPI, router: APIRouter, role: str) -> None:
    """The routes another role serves answer 404 naming this process's role (and stay out of
    its OpenAPI schema), not a bare "Not Found" that reads like a wrong URL."""
    detail = (f"this API process serves {role} only (STREAMXM_API_ROLE={role}); send this "
              f"request to one with the role 'all' or '{'ingest' if role == 'query' else 'query'}'")

    async def refuse() -> JSONResponse:
        return JSONResponse({"detail": detail}, status_code=404)

    for route in router.routes:
        if isinstance(route, APIRoute):
            app.add_api_route(route.path, refuse, methods=sorted(route.methods or ()),
                              include_in_schema=False)


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
    try:
        open_namespace(settings, background)
    except UNAVAILABLE as exc:  # unreachable now: the API starts and answers 503 meanwhile
        log.warning("could not check the namespace's key names: %s", exc)
    limits = limits_from(settings)
    server = ModelServer(background, open_store(settings, background), settings.namespace,
                         gallery_max=settings.gallery_max, limits=limits,
                         reembed_seconds=settings.reembed_seconds,
                         candidates=settings.search_candidates,
                         champion=ChampionRule(min_pairs=settings.champion_min_pairs,
                                               margin=settings.champion_margin,
                                               confirmations=settings.champion_confirmations))
    metrics = ApiMetrics(r, server, keys, timeout=settings.metrics_timeout_seconds)
    context = ApiContext(settings=settings, r=r, keys=keys, limits=limits, server=server,
                         metrics=metrics, producer=StreamClient(r, settings.namespace, limits,
                                                 replication=Replication.of(settings)),
                         query_threads=anyio.CapacityLimiter(settings.query_threads),
                         scrape_threads=anyio.CapacityLimiter(2),
                         write_threads=anyio.CapacityLimiter(1))
    queries_served = settings.api_role != "ingest"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if queries_served:  # an ingest replica loads no model and reads no gallery
            server.start(settings.reload_interval_seconds)
        yield
        server.stop()

    # No trailing-slash redirects: they echo the request's Host header into Location.
    app = FastAPI(title="streamxm", version="0.1.0", lifespan=lifespan,
                  max_body_size=settings.max_body_bytes, redirect_slashes=False,
                  description="Streaming cross-modal retrieval: similarity and top-k search "
                              "from the newest online model.")
    app.state.context = context
    app.add_middleware(_Limits, limits=RequestLimits.from_settings(settings))
    app.add_middleware(_PlainPath)

    # Only routers that do check a token declare the bearer scheme and its 401, so the OpenAPI
    # schema tells clients the truth about which calls need one.
    guarded: dict[str, Any] = {"dependencies": [Depends(require_token)],
                               "responses": error_responses(401)}
    app.include_router(probes.router)
    if queries_served:
        app.include_router(queries.router, **(
            guarded if settings.api_token and settings.api_token_for_reads else {}))
    else:
        _refuse_routes(app, queries.router, settings.api_role)
    if settings.api_role != "query":
        app.include_router(ingest.router, **(guarded if settings.api_token else {}))
    else:
        _refuse_routes(app, ingest.router, settings.api_role)

    app.add_middleware(_Observe, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": bounded_errors(list(exc.errors()))}, status_code=422)

    @app.exception_handler(UnknownModel)
    async def unknown_model(request: Request, exc: UnknownModel) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(VersionNotKept)
    async def version_not_kept(request: Request, exc: VersionNotKept) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(ModelNotReady)
    async def not_ready(request: Request, exc: ModelNotReady) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    # A cluster's "no node serves this slot" is no RedisError: the same 503.
    @app.exception_handler(redis.RedisError)
    @app.exception_handler(RedisClusterException)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"stream store unavailable: {type(exc).__name__}"},
                            status_code=503, headers={"Retry-After": "1"})

    # No blanket ValueError handler: a bad request is refused where it is recognised, naming
    # its field, and anything else is a bug that must surface as a 500 with its traceback logged.
    @app.exception_handler(InvalidModelName)
    async def invalid_model(request: Request, exc: InvalidModelName) -> JSONResponse:
        return JSONResponse({"detail": [{"loc": ["body", "model"], "msg": str(exc),
                                         "type": "unknown_model"}]}, status_code=422)

    return app


def serve_app() -> FastAPI:
    """The app ``streamxm api`` serves: :func:`create_app` from the environment's settings, then
    the objects made at import and start-up frozen out of later garbage collections."""
    app = create_app()
    freeze_startup_objects()
    return app
