"""The FastAPI app: builds the parts from the settings, includes the routers of ``api/routes``
and maps the library's exceptions to HTTP answers. Logic lives in streamxm."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import redis
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import ApiContext
from api.errors import add_error_handlers
from api.routes import include_routers
from api.schemas import RequestLimits, request_limits
from streamxm.config import Settings, get_settings
from streamxm.service import limits_from, open_namespace, open_store, settings_group
from streamxm.serving.champion import ChampionRule
from streamxm.serving.httpserver import freeze_startup_objects
from streamxm.serving.metrics import ApiMetrics, method_label
from streamxm.serving.server import ModelServer
from streamxm.serving.shard import ShardedGallery
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import UNAVAILABLE, Replication, connect, resolve_url

log = logging.getLogger(__name__)


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


class _PlainRequest:
    """Refuses, before routing, what a proxy in front could read otherwise than the server does.

    A path not in plain form: any percent-encoding, a dot segment, ``//`` or a backslash. The
    server decodes ``%76`` to ``v`` (and ``%2F`` to ``/``) before routing, so
    ``/%76%31/pairs/frames`` would reach the write route past a proxy that guards ``/v1/pairs``
    by the raw path's prefix; the others are what a proxy may normalise and the router does
    not. No route of this API has a path parameter, so no legitimate path needs any of them.

    A request framed by both ``Content-Length`` and ``Transfer-Encoding``: the server reads the
    body as chunked, a proxy may read it by its length, and bytes the proxy forwarded as body
    would be answered as a request it never saw. It gets a 400 with ``Connection: close``
    (RFC 9112, section 6.3), before its body is read, so nothing after it on the connection is
    answered.
    """

    _FRAMING = (b"content-length", b"transfer-encoding")
    _NOT_PLAIN = (
        "the path must be plain: percent-encoding (an encoded slash %2F or any other), "
        "dot segments, '//' and backslashes are refused"
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if all(name in names for name in self._FRAMING):
                # Checked first: a path refused alone keeps the connection, this must not.
                await JSONResponse(
                    {
                        "detail": "a request with both Content-Length and "
                        "Transfer-Encoding is refused"
                    },
                    status_code=400,
                    headers={"Connection": "close"},
                )(scope, receive, send)
                return
            if not _plain_path(scope.get("raw_path") or b""):
                await JSONResponse({"detail": self._NOT_PLAIN}, status_code=400)(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def _plain_path(raw: bytes) -> bool:
    """Whether a raw path (the query string is not part of it) routes as it reads."""
    if b"%" in raw or b"\\" in raw or b"//" in raw:
        return False
    segments = raw.split(b"/")
    return b"." not in segments and b".." not in segments


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
            self.metrics.request_seconds.labels(route, method).observe(time.perf_counter() - start)
            self.metrics.requests.labels(route, method, str(status)).inc()


def create_app(settings: Settings | None = None, client: redis.Redis | None = None) -> FastAPI:
    """Build the app. Without arguments it reads settings from the environment."""
    settings = settings or get_settings()
    context = _context(settings, client)
    server = context.server

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.api_role != "ingest":  # an ingest replica loads no model, reads no gallery
            server.start(settings.reload_interval_seconds)
        yield
        server.stop()

    # No trailing-slash redirects: they echo the request's Host header into Location.
    app = FastAPI(
        title="streamxm",
        version="0.1.0",
        lifespan=lifespan,
        max_body_size=settings.max_body_bytes,
        redirect_slashes=False,
        description="Streaming cross-modal retrieval: similarity and top-k search "
        "from the newest online model.",
    )
    app.state.context = context
    app.add_middleware(_Limits, limits=RequestLimits.from_settings(settings))
    app.add_middleware(_PlainRequest)
    include_routers(app, settings)
    app.add_middleware(_Observe, metrics=context.metrics)
    add_error_handlers(app)
    return app


#: The settings ``champion_<name>`` the serving :class:`ChampionRule` takes.
_CHAMPION = ("min_pairs", "margin", "confirmations")


def _shards(settings: Settings, url: str) -> ShardedGallery | None:
    """The ``ray`` gallery backend's shards (imported only when chosen), or ``None``."""
    if settings.gallery_backend != "ray" or settings.api_role == "ingest":
        return None
    from streamxm.ray_gallery import RayGallery

    return RayGallery(
        settings,
        url,
        settings.ray_address,
        settings.gallery_shards,
        settings.shard_timeout_seconds,
    )


def _context(settings: Settings, client: redis.Redis | None) -> ApiContext:
    """The app's parts: Redis connections, the model server, metrics, the producer."""
    # Two connections: a request waiting on Redis gets a 503 within the short timeout, while the
    # background refresh may take longer over a large checkpoint or gallery read.
    url = resolve_url(settings)
    r = client or connect(settings, url, retries=1, timeout=settings.redis_request_timeout_seconds)
    background = client or connect(settings, url, retries=2, timeout=30.0)
    keys = Keys(settings.namespace)
    try:
        open_namespace(settings, background)
    except UNAVAILABLE as exc:  # unreachable now: the API starts and answers 503 meanwhile
        log.warning("could not check the namespace's key names: %s", exc)
    limits = limits_from(settings)
    server = ModelServer(
        background,
        open_store(settings, background),
        settings.namespace,
        gallery_max=settings.gallery_max,
        limits=limits,
        candidates=settings.search_candidates,
        champion=ChampionRule(**settings_group(settings, "champion_", _CHAMPION)),
        request_client=r,
        wait_for_index=settings.wait_for_index,
        shards=_shards(settings, url),
    )
    metrics = ApiMetrics(r, server, keys, timeout=settings.metrics_timeout_seconds)
    return ApiContext(
        settings=settings,
        r=r,
        keys=keys,
        limits=limits,
        server=server,
        metrics=metrics,
        producer=StreamProducer(
            r, settings.namespace, limits, replication=Replication.of(settings)
        ),
        query_threads=anyio.CapacityLimiter(settings.query_threads),
        scrape_threads=anyio.CapacityLimiter(2),
        write_threads=anyio.CapacityLimiter(1),
    )


def serve_app() -> FastAPI:
    """The app ``streamxm api`` serves: :func:`create_app` from the environment's settings, then
    the objects made at import and start-up frozen out of later garbage collections."""
    app = create_app()
    freeze_startup_objects()
    return app
