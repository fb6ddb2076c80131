"""The API's routers, one module per concern, collected here: :func:`include_routers` mounts
the ones this process's role serves (``STREAMXM_API_ROLE``) and answers the others with a 404
that names the role."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from api.deps import require_token
from api.routes import ingest, limits, probes, queries
from api.schemas import error_responses
from streamxm.config import Settings

__all__ = ["include_routers"]


def include_routers(app: FastAPI, settings: Settings) -> None:
    """Probes and the limits always; queries unless the role is ``ingest``; writes unless it
    is ``query``. A token guards writes when set, and reads too with
    ``STREAMXM_API_TOKEN_FOR_READS``."""
    # Only routers that do check a token declare the bearer scheme and its 401, so the OpenAPI
    # schema tells clients the truth about which calls need one.
    guarded: dict[str, Any] = {
        "dependencies": [Depends(require_token)],
        "responses": error_responses(401),
    }
    app.include_router(probes.router)
    app.include_router(
        limits.router, **(guarded if settings.api_token and settings.api_token_for_reads else {})
    )
    if settings.api_role != "ingest":
        app.include_router(
            queries.router,
            **(guarded if settings.api_token and settings.api_token_for_reads else {}),
        )
    else:
        _refuse_routes(app, queries.router, settings.api_role)
    if settings.api_role != "query":
        app.include_router(ingest.router, **(guarded if settings.api_token else {}))
    else:
        _refuse_routes(app, ingest.router, settings.api_role)


def _refuse_routes(app: FastAPI, router: APIRouter, role: str) -> None:
    """The routes another role serves answer 404 naming this process's role (and stay out of
    its OpenAPI schema), not a bare "Not Found" that reads like a wrong URL."""
    detail = (
        f"this API process serves {role} only (STREAMXM_API_ROLE={role}); send this "
        f"request to one with the role 'all' or '{'ingest' if role == 'query' else 'query'}'"
    )

    async def refuse() -> JSONResponse:
        return JSONResponse({"detail": detail}, status_code=404)

    for route in router.routes:
        if isinstance(route, APIRoute):
            app.add_api_route(
                route.path, refuse, methods=sorted(route.methods or ()), include_in_schema=False
            )
