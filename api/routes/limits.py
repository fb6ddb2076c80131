"""The request bounds of this deployment, so a client can split its batches to fit them."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AppSettings
from api.schemas import LimitsOut
from streamxm.service import settings_group

router = APIRouter(prefix="/v1", tags=["limits"])


@router.get("/limits", response_model=LimitsOut)
async def limits(settings: AppSettings) -> LimitsOut:
    # Every bound is the setting of its name; the role is the process's api_role.
    bounds = [name for name in LimitsOut.model_fields if name != "role"]
    return LimitsOut(role=settings.api_role, **settings_group(settings, "", bounds))
