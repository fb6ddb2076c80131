"""Model registry: names used everywhere (CLI, API, metrics, checkpoints), per ``DESIGN.md``."""

from __future__ import annotations

from typing import Any

from streamxm.models.base import DIRECTIONS, CrossModalModel, LearnStats
from streamxm.models.cmomks import CMOMKS
from streamxm.models.cmos import CMOS

__all__ = ["DIRECTIONS", "MODELS", "CrossModalModel", "LearnStats", "create_model", "split_name"]

MODELS: dict[str, type[CrossModalModel]] = {CMOS.name: CMOS, CMOMKS.name: CMOMKS}


def split_name(name: str) -> tuple[str, str | None]:
    """``"pairwise:bipartite"`` -> ``("pairwise", "bipartite")``; unknown names raise."""
    base, _, variant = name.partition(":")
    if base not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return base, variant or None


def create_model(
    name: str, img_dim: int, txt_dim: int, params: dict[str, Any] | None = None
) -> CrossModalModel:
    """Build a model by its name (with an optional ``:variant``)."""
    base, variant = split_name(name)
    kwargs = dict(params or {})
    if variant is not None:
        kwargs["variant"] = variant
    return MODELS[base](img_dim, txt_dim, **kwargs)
