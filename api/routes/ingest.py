"""Writes: pairs into the stream, through the same validator as every other door."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import Context, unprocessable
from api.schemas import PairsIn, PairsOut, error_responses
from streamxm.stream.messages import InvalidPair, make_pair

router = APIRouter()


@router.post("/v1/pairs", response_model=PairsOut, status_code=202,
             responses=error_responses(400, 413, 503))
def pairs(body: PairsIn, context: Context) -> PairsOut:
    validated = []
    for i, p in enumerate(body.pairs):
        try:
            validated.append(make_pair(p.id, p.img, p.txt, p.labels, p.ts, context.limits))
        except InvalidPair as exc:
            raise unprocessable(["pairs", i, exc.field], exc.reason, exc.detail) from None
    try:
        ids = context.producer.push_pairs(validated)
    except InvalidPair as exc:
        index = 0 if exc.index is None else exc.index
        raise unprocessable(["pairs", index, exc.field], exc.reason, exc.detail) from None
    context.metrics.pairs_accepted.inc(len(ids))
    return PairsOut(accepted=len(ids), entry_ids=ids)
