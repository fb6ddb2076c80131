"""Writes: pairs into the stream, through the same validator as every other door."""

from __future__ import annotations

import redis
from fastapi import APIRouter, HTTPException, Request
from redis.exceptions import RedisClusterException

from api.deps import ApiContext, Context, unprocessable
from api.schemas import PairsIn, PairsOut, error_responses
from streamxm.stream.messages import (
    FRAMES_MEDIA_TYPE,
    WRITTEN_HEADER,
    InvalidPair,
    Pair,
    decode_frames,
    decode_pair,
    make_pair,
)

router = APIRouter(prefix="/v1/pairs", tags=["ingest"])


@router.post("", response_model=PairsOut, status_code=202, responses=error_responses(400, 413, 503))
async def pairs(body: PairsIn, context: Context) -> PairsOut:
    def accept() -> PairsOut:
        validated = []
        for i, p in enumerate(body.pairs):
            try:
                validated.append(make_pair(p.id, p.img, p.txt, p.labels, p.ts, context.limits))
            except InvalidPair as exc:
                raise unprocessable(["pairs", i, exc.field], exc.reason, exc.detail) from None
        return _push(context, validated)

    return await context.write(accept)


@router.post(
    "/frames",
    response_model=PairsOut,
    status_code=202,
    responses=error_responses(400, 413, 415, 422, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {FRAMES_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    description="A batch of pairs as one binary body of message v1 frames "
    "(`streamxm.stream.messages.encode_frames`): the bytes each stream entry holds, checked by "
    "the worker's own decoder. The fastest way in over HTTP.",
)
async def pair_frames(request: Request, context: Context) -> PairsOut:
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != FRAMES_MEDIA_TYPE:
        raise HTTPException(415, f"this route takes Content-Type: {FRAMES_MEDIA_TYPE}")
    body = await request.body()

    def accept() -> PairsOut:
        try:
            frames = decode_frames(body, context.settings.max_batch)
        except InvalidPair as exc:
            raise unprocessable([], exc.reason, exc.detail) from None
        values = sum(len(f.get(b"img", b"")) + len(f.get(b"txt", b"")) for f in frames) // 4
        if values > context.settings.max_request_values:  # the JSON doors' bound, the same
            raise unprocessable(
                [],
                "too_large",
                f"{values} vector values exceed the limit "
                f"{context.settings.max_request_values} per request",
            )
        validated = []
        for i, fields in enumerate(frames):
            try:  # views of the body: the frames go to the stream as they came
                validated.append(decode_pair(fields, limits=context.limits, copy=False))
            except InvalidPair as exc:
                raise unprocessable(["pairs", i, exc.field], exc.reason, exc.detail) from None
        return _push(context, validated, frames)

    return await context.write(accept)


def _unavailable(exc: Exception, written: str) -> HTTPException:
    """The store's 503, saying whether any pair of the request may have reached the stream
    (:data:`~streamxm.stream.messages.WRITTEN_HEADER`): a client pushes again only on ``none``."""
    what = (
        "nothing was written; push again"
        if written == "none"
        else "some pairs may have been written; pushing again may add them twice"
    )
    return HTTPException(
        503,
        f"stream store unavailable: {type(exc).__name__} ({what})",
        headers={"Retry-After": "1", WRITTEN_HEADER: written},
    )


def _push(
    context: ApiContext, validated: list[Pair], messages: list[dict[bytes, bytes]] | None = None
) -> PairsOut:
    # One read on the namespace's slot before the writes: a store that cannot be reached now
    # is refused with "nothing written", which a client may retry without adding pairs twice
    # (a failure once the writes are sent cannot say how many landed).
    try:
        context.r.exists(context.keys.schema)
    except (redis.RedisError, RedisClusterException) as exc:
        raise _unavailable(exc, "none") from None
    try:
        ids = context.producer.push_pairs(validated, messages=messages)
    except (redis.RedisError, RedisClusterException) as exc:
        raise _unavailable(exc, "unknown") from None
    except InvalidPair as exc:
        index = 0 if exc.index is None else exc.index
        raise unprocessable(["pairs", index, exc.field], exc.reason, exc.detail) from None
    context.metrics.pairs_accepted.inc(len(ids))
    return PairsOut(accepted=len(ids), entry_ids=ids)
