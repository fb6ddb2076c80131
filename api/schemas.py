"""Request and response bodies, bounded before any element is validated.

A hostile body must cost the API little: every list and string has a length bound, the bounds
of this deployment (:class:`RequestLimits`, from the settings) are checked on the raw JSON
before its elements are (so a million bad entries are refused by their count, not one by one),
element validation stops at the first error, and types are strict (``"1.5"``, ``true`` and
``"3"`` are not numbers). The schema declares the ceilings the settings may lower.
"""

from __future__ import annotations

import binascii
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from streamxm.config import (
    MAX_BATCH_CEILING,
    MAX_DIM_CEILING,
    MAX_K_CEILING,
    MAX_LABELS_CEILING,
    Settings,
)


@dataclass(frozen=True)
class RequestLimits:
    """The bounds a request is held to before its elements are validated."""

    max_dim: int = MAX_DIM_CEILING
    max_batch: int = 1024
    max_values: int = 1 << 19
    max_k: int = 1000
    max_labels: int = 64

    @classmethod
    def from_settings(cls, settings: Settings) -> RequestLimits:
        return cls(
            max_dim=settings.max_dim,
            max_batch=settings.max_batch,
            max_values=settings.max_request_values,
            max_k=settings.max_k,
            max_labels=settings.max_labels,
        )


#: The limits of the app serving the current request (set per request by the app).
request_limits: ContextVar[RequestLimits] = ContextVar("request_limits", default=RequestLimits())


def _base64_values(text: str) -> int:
    """How many float32 values a padded base64 string of that length holds (4 n bytes take
    4 ceil(4 n / 3) characters), known before decoding it."""
    return len(text) * 3 // 16


def _vector_or_base64(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A JSON list of numbers (validated as such), or a base64 string of little-endian
    float32 bytes, decoded straight to a float32 array: far less to parse and validate
    than decimals, and exactly the bytes a client holds."""
    if not isinstance(value, str):
        return handler(value)
    limit = request_limits.get().max_dim
    if _base64_values(value) > limit:  # refused by its length, before decoding
        raise _too_large(f"a vector of {_base64_values(value)} values exceeds the limit {limit}")
    try:
        raw = binascii.a2b_base64(value, strict_mode=True)  # C-level check, no regex
    except (binascii.Error, ValueError):
        raise PydanticCustomError(
            "base64", "not valid base64 (standard alphabet, padded)"
        ) from None
    if not raw:
        raise PydanticCustomError("too_short", "an empty vector")
    if len(raw) % 4:
        raise PydanticCustomError(
            "base64_float32",
            "{n} bytes are not a whole number of float32 values (4 bytes each, little-endian)",
            {"n": len(raw)},
        )
    return np.frombuffer(raw, dtype="<f4")


#: A vector: a JSON list of numbers, or a base64 string of little-endian float32 bytes (then
#: a float32 array after validation; both are sequences of floats to the code after it).
Vector = Annotated[
    list[StrictFloat],
    Field(min_length=1, max_length=MAX_DIM_CEILING, fail_fast=True),
    WrapValidator(_vector_or_base64),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "array", "items": {"type": "number"}, "minItems": 1},
                {
                    "type": "string",
                    "contentEncoding": "base64",
                    "description": "little-endian float32 bytes, base64 (standard alphabet, "
                    "padded)",
                },
            ]
        }
    ),
]
Vectors = Annotated[list[Vector], Field(min_length=1, max_length=MAX_BATCH_CEILING, fail_fast=True)]
Label = Annotated[StrictInt, Field(ge=0)]


def _too_large(message: str) -> PydanticCustomError:
    return PydanticCustomError("too_large", message)


def _check_batch(rows: list[Any], what: str) -> None:
    limit = request_limits.get().max_batch
    if len(rows) > limit:
        raise _too_large(f"{len(rows)} {what} exceed the limit {limit}")


def _check_values(vectors: list[Any]) -> None:
    """Refuse too long a vector, or too many values in all; anything not shaped like a vector
    is left to the element validation."""
    limits = request_limits.get()
    total = 0
    for row in vectors:
        size = (
            len(row)
            if isinstance(row, list)
            else _base64_values(row)
            if isinstance(row, str)
            else 0
        )
        if size > limits.max_dim:
            raise _too_large(f"a vector of {size} values exceeds the limit {limits.max_dim}")
        total += size
    if total > limits.max_values:
        raise _too_large(f"{total} vector values exceed the limit {limits.max_values} per request")


def _check_k(k: int) -> int:
    limit = request_limits.get().max_k
    if k > limit:
        raise _too_large(f"k must be <= {limit}")
    return k


class _Strict(BaseModel):
    """Strict types: a string is never a number, nor a boolean an integer; and closed, like
    message v1: a field the body does not define is refused (a misspelt ``verison`` must not
    quietly answer with the newest version)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class PairIn(_Strict):
    id: str = Field(min_length=1, max_length=256, description="producer's pair id")
    img: Vector = Field(description="image feature vector")
    txt: Vector = Field(description="text feature vector")
    labels: list[Label] | None = Field(
        default=None, max_length=MAX_LABELS_CEILING, description="optional non-negative labels"
    )
    ts: StrictFloat | None = Field(
        default=None, allow_inf_nan=False, description="event time, unix seconds"
    )

    @field_validator("labels", mode="before")
    @classmethod
    def _few_labels(cls, value: Any) -> Any:
        # Refused on its length before a single label is validated, as frames are.
        limit = request_limits.get().max_labels
        if isinstance(value, list) and len(value) > limit:
            raise _too_large(f"{len(value)} labels exceed the limit {limit}")
        return value


class PairsIn(_Strict):
    pairs: list[PairIn] = Field(min_length=1, max_length=MAX_BATCH_CEILING, fail_fast=True)

    @field_validator("pairs", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        if isinstance(value, list):
            _check_batch(value, "pairs")
            _check_values([p.get(k) for p in value if isinstance(p, dict) for k in ("img", "txt")])
        return value


class PairsOut(BaseModel):
    accepted: int
    entry_ids: list[str]


PinnedVersion = Annotated[
    StrictInt | None,
    Field(
        ge=1,
        description="a kept model version to answer with (default: the newest loaded); 404 "
        "when the store no longer keeps it",
    ),
]

ModelName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=256,
        description="model name (default from settings): a learned model, `auto` (the champion of "
        "the query's direction) or `ensemble:<a>+<b>...` (its members' per-query standardised "
        "scores summed; `<a>*<weight>` weights a member)",
    ),
]

#: The members' versions that answered an ensemble query.
MemberVersions = Annotated[
    dict[str, int] | None,
    Field(
        default=None,
        description="ensembles: each member's version that scored (`version` is "
        "null: an ensemble has none of its own)",
    ),
]


class SimilarityIn(_Strict):
    model: ModelName | None = None
    version: PinnedVersion = None
    images: Vectors
    texts: Vectors
    mode: Literal["paired", "matrix"] = Field(
        default="paired", description="paired: score (images[i], texts[i]); matrix: all pairs"
    )
    direction: Literal["i2t", "t2i"] = Field(
        default="i2t",
        description="which side is the query: picks the champion for "
        "model=auto, and an ensemble standardises each member's scores per query (a single "
        "model scores both directions the same)",
    )

    @field_validator("images", "texts", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        if isinstance(value, list):
            _check_batch(value, "vectors")
            _check_values(value)
        return value


class SimilarityOut(BaseModel):
    model: str
    version: int | None
    members: MemberVersions
    scores: list[float] | list[list[float]]


class SearchIn(_Strict):
    model: ModelName | None = None
    version: PinnedVersion = None
    modality: Literal["image", "text"] = Field(description="modality of the query vector")
    target: Literal["image", "text"] | None = Field(
        default=None,
        description="modality of the results; default the other one. The same "
        "modality as the query needs a model with a shared space (sam, sdsrl, scsm, cca, "
        "pairwise:marginal)",
    )
    vector: Vector
    k: StrictInt = Field(default=10, ge=1, le=MAX_K_CEILING)
    partial: StrictBool = Field(
        default=False,
        description="with a sharded gallery, answer from the shards that answer in time when "
        "some do not (`covered` says how much of the gallery that is) instead of a 503",
    )

    @field_validator("vector", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        _check_values([value])
        return value

    _k = field_validator("k")(_check_k)


class Hit(BaseModel):
    id: str
    score: float


class SearchOut(BaseModel):
    model: str
    version: int | None = Field(
        description="model version that scored the results (null for an ensemble: see `members`)"
    )
    members: MemberVersions
    target: Literal["image", "text"]
    version_lag_s: float = Field(
        description="seconds since a checkpoint newer than `version` was written (0: none is)"
    )
    index_version: int | None = Field(
        description="version whose embeddings of the gallery proposed the candidates: "
        "`version` (the answer is its exact ranking), or an earlier one while a model that "
        "embeds raw vectors (sam, cmomks) embeds the gallery with `version` (its best "
        "candidates re-ranked by `version`'s exact scores); null for an ensemble"
    )
    covered: float = Field(
        default=1.0,
        description="share of the gallery the results cover: 1.0, or less for a partial "
        "answer (`partial: true`) while some gallery shards do not answer",
    )
    results: list[Hit]


class ModelInfo(BaseModel):
    name: str
    loaded: bool
    version: int | None = Field(description="version the API serves")
    checkpoint_version: int | None = Field(description="newest version the worker wrote")
    pairs_seen: int
    last_entry_id: str | None = Field(
        default=None,
        description="newest stream entry the served `version` has learned: "
        "every pair pushed up to it is in the model (`Client.wait_learned` polls for it)",
    )
    mistakes: dict[str, int]
    triplets: dict[str, int]
    rolling_map: dict[str, float | None]
    checkpoint_time: float | None
    gallery_items: int
    index_version: int | None = Field(
        default=None,
        description="version whose embeddings of the gallery propose this "
        "model's search candidates (`version` but while a model that embeds raw vectors "
        "embeds the gallery again)",
    )
    champion_of: list[str] = Field(
        default_factory=list, description="directions in which this model answers model=auto"
    )


class GalleryHealth(BaseModel):
    """Whether the search gallery lost rows to corrupt segments (``degraded``): search serves
    every other segment and the stream after them."""

    degraded: bool = False
    corrupt_segments: list[int] = Field(
        default_factory=list,
        description="sequence numbers of the segments found corrupt and quarantined",
    )
    rows_lost: int = Field(default=0, description="gallery rows those segments held")

    @classmethod
    def of(cls, corrupt: dict[str, int]) -> GalleryHealth:
        seqs = sorted(int(field.split(":", 1)[0]) for field in corrupt)
        return cls(degraded=bool(corrupt), corrupt_segments=seqs, rows_lost=sum(corrupt.values()))


class ModelsOut(BaseModel):
    models: list[ModelInfo]
    gallery: GalleryHealth = Field(default_factory=GalleryHealth)
    champions: dict[str, str | None] = Field(
        default_factory=dict,
        description="direction -> the model answering model=auto (null "
        "until a model has enough pairs behind its rolling mAP)",
    )


class ErrorOut(BaseModel):
    """Every rejection: a message, or FastAPI's list of ``{loc, msg, type}`` for a 422."""

    detail: str | list[dict[str, Any]] = Field(description="what is wrong with the request")


class LimitsOut(BaseModel):
    """What one request may hold here (``STREAMXM_MAX_*``), and which routes this process
    serves."""

    role: Literal["all", "ingest", "query"] = Field(
        description="all: every route; ingest: writes only; query: reads only"
    )
    max_batch: int = Field(description="pairs (or vectors) per request")
    max_request_values: int = Field(description="vector values per request, all vectors")
    max_body_bytes: int = Field(description="bytes of a request body")
    max_dim: int = Field(description="values per vector")
    max_k: int = Field(description="results per search")
    max_labels: int = Field(description="labels per pair")


class HealthOut(BaseModel):
    status: str


class ShardHealth(BaseModel):
    shard: int
    up: bool = Field(description="the shard answered the last refresh and has read its part")
    rows: int | None = None
    versions: dict[str, int] | None = Field(
        default=None, description="newest version of each model the shard holds"
    )
    build_seconds: dict[str, float] | None = Field(
        default=None, description="seconds its part's index of that version took"
    )
    resident_bytes: int | None = None
    device: str | None = Field(
        default=None, description="where the shard's towers run: `cuda` (it holds a GPU) or `cpu`"
    )


class ReadyOut(BaseModel):
    status: str
    models: list[str] = Field(default_factory=list, description="models being served")
    gallery: GalleryHealth = Field(default_factory=GalleryHealth)
    shards: list[ShardHealth] | None = Field(
        default=None, description="each gallery shard (the `ray` backend only)"
    )


_ERRORS = {
    400: "a body that cannot be parsed",
    401: "missing or invalid bearer token",
    404: "the model has no learner in this namespace",
    413: "request body larger than STREAMXM_MAX_BODY_BYTES",
    415: "a body of another media type than the route takes",
    422: "the body, or the field `loc` names, breaks the route's contract (`type` says how)",
    503: "not ready (no checkpoint of the model loaded yet) or the stream store is unavailable; "
    "retry after the Retry-After header",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the given rejection codes (422 FastAPI documents itself)."""
    return {code: {"model": ErrorOut, "description": _ERRORS[code]} for code in codes}
