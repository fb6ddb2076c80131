"""Reads: the models and their state, similarity scores and top-k search."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import ApiContext, Context, matrix, unprocessable
from api.schemas import (
    Hit,
    ModelInfo,
    ModelsOut,
    SearchIn,
    SearchOut,
    SimilarityIn,
    SimilarityOut,
    error_responses,
)
from streamxm.serving.server import SameModalityUnsupported, direction_of, other_modality
from streamxm.stream.redis_conn import str_hash, str_set
from streamxm.worker.stats import WorkerStats

router = APIRouter()

_QUERY_ERRORS = error_responses(400, 404, 413, 503)


@router.get("/v1/models", response_model=ModelsOut, responses=error_responses(503))
def models(context: Context) -> ModelsOut:
    r, keys, server = context.r, context.keys, context.server
    out = []
    for name in str_set(r.smembers(keys.models)):
        stats = WorkerStats.from_hash(str_hash(r.hgetall(keys.stats(name))))
        served = server.served.get(name)
        out.append(ModelInfo(
            name=name, loaded=served is not None,
            version=served.version if served else None,
            checkpoint_version=stats.version, pairs_seen=stats.pairs_processed,
            mistakes=stats.mistakes, triplets=stats.triplets, rolling_map=stats.rolling_map,
            checkpoint_time=stats.checkpoint_time,
            gallery_items=served.gallery_size if served else 0,
            champion_of=[d for d, m in server.champion.champions.items() if m == name],
        ))
    return ModelsOut(models=out, champions=dict(server.champion.champions))


def _model_name(context: ApiContext, name: str | None, direction: str) -> str:
    """The model a query names, or the default; ``auto``: the direction's champion now."""
    return context.server.resolve(name or context.settings.default_model, direction)


@router.post("/v1/similarity", response_model=SimilarityOut, responses=_QUERY_ERRORS)
async def similarity(body: SimilarityIn, context: Context) -> SimilarityOut:
    def score() -> SimilarityOut:
        # Paired or matrix scores have no query direction: auto answers with image->text's.
        name = _model_name(context, body.model, "i2t")
        model = context.server.get(name).model
        images = matrix(body.images, "images", model.img_dim)
        texts = matrix(body.texts, "texts", model.txt_dim)
        if body.mode == "paired" and len(images) != len(texts):
            raise unprocessable(["texts"], "length_mismatch",
                                "paired mode needs as many texts as images")
        served, scores = context.server.similarity(name, images, texts, body.mode == "matrix",
                                                   body.version)
        return SimilarityOut(model=name, version=served.version, scores=scores.tolist())

    return await context.compute(score)


@router.post("/v1/search", response_model=SearchOut, responses=_QUERY_ERRORS)
async def search(body: SearchIn, context: Context) -> SearchOut:
    # On the event loop: only light steps run here (validation, the query transform, the exact
    # re-rank of ~100 candidates); the scan is awaited and heavy work goes to the query threads.
    name = _model_name(context, body.model, direction_of(body.modality))
    model = context.server.get(name).model
    dim = model.img_dim if body.modality == "image" else model.txt_dim
    vector = matrix([body.vector], "vector", dim)[0]
    target = body.target or other_modality(body.modality)
    try:
        answer = await context.server.search_async(name, body.modality, vector, body.k,
                                                   context.compute, target, body.version)
    except SameModalityUnsupported as exc:
        raise unprocessable(["target"], "not_shared_space", str(exc)) from None
    context.metrics.version_lag.labels(name).observe(answer.version_lag_s)
    return SearchOut(model=name, version=answer.served.version, target=target,
                     version_lag_s=round(answer.version_lag_s, 3),
                     index_version=answer.index_version,
                     results=[Hit(id=i, score=s) for i, s in answer.hits])
