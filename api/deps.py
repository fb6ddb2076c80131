"""What routes depend on, as typed dependencies: the app's parts and the bearer-token check."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import anyio
import numpy as np
import redis
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from streamxm.config import Settings
from streamxm.serving.metrics import ApiMetrics
from streamxm.serving.server import ModelServer
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits
from streamxm.stream.producer import StreamProducer

Out = TypeVar("Out")


@dataclass(frozen=True)
class ApiContext:
    """One app's parts, built once by :func:`api.app.create_app`."""

    settings: Settings
    r: redis.Redis  # short timeouts: calls made while a request waits
    keys: Keys
    limits: Limits
    server: ModelServer
    metrics: ApiMetrics
    producer: StreamProducer
    # Queries and scrapes run on threads of their own: routes waiting on a stalled Redis
    # (ingest, models) hold the default pool's threads and must not hold up a search, which
    # reads only memory, or a scrape, which waits at most metrics_timeout_seconds.
    query_threads: anyio.CapacityLimiter
    scrape_threads: anyio.CapacityLimiter
    # Writes run one at a time: Redis takes them one at a time anyway, and several threads
    # decoding and sending megabyte bodies at once spent more CPU passing the GIL between
    # them (futex waits and wake-ups, by perf) than on the pairs.
    write_threads: anyio.CapacityLimiter

    async def compute(self, fn: Callable[[], Out]) -> Out:
        """Run a query's work on the query threads."""
        return await anyio.to_thread.run_sync(fn, limiter=self.query_threads)

    async def write(self, fn: Callable[[], Out]) -> Out:
        """Run a write's validation and push on the one write thread."""
        return await anyio.to_thread.run_sync(fn, limiter=self.write_threads)


async def get_context(request: Request) -> ApiContext:
    # Async on purpose: FastAPI runs sync dependencies on the thread pool, which routes waiting
    # on a stalled Redis may hold; the probes must never wait for it.
    context: ApiContext = request.app.state.context
    return context


Context = Annotated[ApiContext, Depends(get_context)]


async def get_server(context: Context) -> ModelServer:
    return context.server


async def get_settings_of(context: Context) -> Settings:
    return context.settings


#: The model server alone, for routes that read nothing else.
Server = Annotated[ModelServer, Depends(get_server)]
#: The app's settings alone.
AppSettings = Annotated[Settings, Depends(get_settings_of)]

_bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def require_token(context: Context, credentials: Credentials) -> None:
    """The bearer token, compared in constant time and never logged. Attached only to the
    routers that check it, so the OpenAPI schema tells clients which calls need one."""
    token = context.settings.api_token
    if token is None:
        return
    given = credentials.credentials if credentials else ""
    if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        raise HTTPException(
            401, detail="missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


def unprocessable(field: list[str | int], reason: str, message: str) -> HTTPException:
    """A 422 naming the field of the body that is wrong."""
    return HTTPException(422, detail=[{"loc": ["body", *field], "msg": message, "type": reason}])


def matrix(rows: list[list[float]], field: str, dim: int | None) -> np.ndarray[Any, Any]:
    """Vectors of a request as a float32 matrix of the model's width, finite."""
    lengths = {len(row) for row in rows}
    if len(lengths) != 1 or (dim is not None and lengths != {dim}):
        raise unprocessable(
            [field], "dim_mismatch", f"every vector must have {dim or 'the same'} values"
        )
    with np.errstate(over="ignore"):  # overflow to Inf is refused just below
        arr = np.asarray(rows, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise unprocessable([field], "non_finite", "contains NaN or Inf")
    return arr
