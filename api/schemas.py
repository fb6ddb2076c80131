"""Request and response bodies. Sizes are bounded here and again by the settings' limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Vector = list[float]


class PairIn(BaseModel):
    id: str = Field(min_length=1, max_length=256, description="producer's pair id")
    img: Vector = Field(min_length=1, description="image feature vector")
    txt: Vector = Field(min_length=1, description="text feature vector")
    labels: list[int] | None = Field(default=None, description="optional non-negative labels")
    ts: float | None = Field(default=None, description="event time, unix seconds")


class PairsIn(BaseModel):
    pairs: list[PairIn] = Field(min_length=1)


class PairsOut(BaseModel):
    accepted: int
    entry_ids: list[str]


class SimilarityIn(BaseModel):
    model: str | None = Field(default=None, description="model name; default from settings")
    images: list[Vector] = Field(min_length=1)
    texts: list[Vector] = Field(min_length=1)
    mode: Literal["paired", "matrix"] = Field(
        default="paired", description="paired: score (images[i], texts[i]); matrix: all pairs")


class SimilarityOut(BaseModel):
    model: str
    version: int
    scores: list[float] | list[list[float]]


class SearchIn(BaseModel):
    model: str | None = None
    modality: Literal["image", "text"] = Field(description="modality of the query vector")
    target: Literal["image", "text"] | None = Field(
        default=None, description="modality of the results; default the other one. The same "
        "modality as the query needs a model with a shared space (sdsrl, scsm, cca, "
        "pairwise:marginal)")
    vector: Vector = Field(min_length=1)
    k: int = Field(default=10, ge=1)


class Hit(BaseModel):
    id: str
    score: float


class SearchOut(BaseModel):
    model: str
    version: int
    target: Literal["image", "text"]
    results: list[Hit]


class ModelInfo(BaseModel):
    name: str
    loaded: bool
    version: int | None = Field(description="version the API serves")
    checkpoint_version: int | None = Field(description="newest version the worker wrote")
    pairs_seen: int
    mistakes: dict[str, int]
    triplets: dict[str, int]
    rolling_map: dict[str, float | None]
    checkpoint_time: float | None
    gallery_items: int


class ModelsOut(BaseModel):
    models: list[ModelInfo]


class ErrorOut(BaseModel):
    """Every rejection: a message, or FastAPI's list of ``{loc, msg, type}`` for a 422."""

    detail: str | list[dict[str, Any]] = Field(description="what is wrong with the request")


class HealthOut(BaseModel):
    status: str


class ReadyOut(BaseModel):
    status: str
    models: list[str] = Field(default_factory=list, description="models being served")


_ERRORS = {
    400: "a body that is not JSON, or a value the model cannot take (e.g. a model name that "
         "does not exist)",
    401: "missing or invalid bearer token",
    404: "the model has no learner in this namespace",
    413: "request body larger than STREAMXM_MAX_BODY_BYTES",
    503: "not ready (no checkpoint of the model loaded yet) or the stream store is unavailable; "
         "retry after the Retry-After header",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the given rejection codes (422 FastAPI documents itself)."""
    return {code: {"model": ErrorOut, "description": _ERRORS[code]} for code in codes}
