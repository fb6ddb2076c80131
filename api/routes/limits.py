"""The request bounds of this deployment, so a client can split its batches to fit them."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AppSettings
from api.schemas import LimitsOut

router = APIRouter(prefix="/v1", tags=["limits"])


@router.get("/limits", response_model=LimitsOut)
async def limits(settings: AppSettings) -> LimitsOut:
    return LimitsOut(
        role=settings.api_role,
        max_batch=settings.max_batch,
        max_request_values=settings.max_request_values,
        max_body_bytes=settings.max_body_bytes,
        max_dim=settings.max_dim,
        max_k=settings.max_k,
        max_labels=settings.max_labels,
    )
