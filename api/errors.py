"""How the API answers what the library raises: each error class once, with its status."""

from __future__ import annotations

from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisClusterException

from streamxm.serving.served import InvalidModelName, ModelNotReady, UnknownModel
from streamxm.storage.checkpoint import VersionNotKept

__all__ = ["add_error_handlers", "bounded_errors"]

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
    return (
        value if isinstance(value, int | float | bool) or value is None else repr(value)[:_MAX_ECHO]
    )


def bounded_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """At most ten validation errors, each input cut short: a rejected body of any size gets a
    small answer (FastAPI's default lists every error with its whole input)."""
    out = [
        {
            "loc": [x if isinstance(x, int) else str(x)[:_MAX_ECHO] for x in e.get("loc", ())],
            "msg": str(e.get("msg", ""))[:300],
            "type": str(e.get("type", "")),
            "input": _echo(e.get("input")),
        }
        for e in errors[:_MAX_ERRORS]
    ]
    if len(errors) > _MAX_ERRORS:
        out.append(
            {
                "loc": ["body"],
                "msg": f"{len(errors) - _MAX_ERRORS} more errors not shown",
                "type": "too_many_errors",
            }
        )
    return out


def add_error_handlers(app: FastAPI) -> None:
    """Map the library's errors to statuses. No blanket ValueError handler: a bad request is
    refused where it is recognised, naming its field, and anything else is a bug that must
    surface as a 500 with its traceback logged."""

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
        return JSONResponse(
            {"detail": f"stream store unavailable: {type(exc).__name__}"},
            status_code=503,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(InvalidModelName)
    async def invalid_model(request: Request, exc: InvalidModelName) -> JSONResponse:
        return JSONResponse(
            {"detail": [{"loc": ["body", "model"], "msg": str(exc), "type": "unknown_model"}]},
            status_code=422,
        )
