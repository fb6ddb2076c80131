"""Reads: the models and their state, similarity scores and top-k search."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import ApiContext, Context, Server, matrix, unprocessable
from api.schemas import (
    GalleryHealth,
    Hit,
    ModelInfo,
    ModelsOut,
    SearchIn,
    SearchOut,
    SimilarityIn,
    SimilarityOut,
    error_responses,
)
from streamxm.models.ensemble import is_ensemble
from streamxm.serving.served import (
    EnsembleUnsupported,
    SameModalityUnsupported,
    ServedEnsemble,
    ServedModel,
    direction_of,
    other_modality,
)

router = APIRouter(prefix="/v1", tags=["queries"])

_QUERY_ERRORS = error_responses(400, 404, 413, 503)


@router.get("/models", response_model=ModelsOut, responses=error_responses(503))
def models(server: Server) -> ModelsOut:
    out = []
    for name, stats in server.model_stats().items():
        served = server.served.get(name)
        out.append(
            ModelInfo(
                name=name,
                loaded=served is not None,
                version=served.version if served else None,
                checkpoint_version=stats.version,
                pairs_seen=stats.pairs_processed,
                last_entry_id=str(served.head.get("last_id", "")) or None if served else None,
                mistakes=stats.mistakes,
                triplets=stats.triplets,
                rolling_map=stats.rolling_map,
                checkpoint_time=stats.checkpoint_time,
                gallery_items=served.gallery_size if served else 0,
                index_version=served.index_version if served else None,
                champion_of=[d for d, m in server.champion.champions.items() if m == name],
            )
        )
    return ModelsOut(
        models=out,
        champions=dict(server.champion.champions),
        gallery=GalleryHealth.of(server.gallery_corrupt),
    )


def _model_name(context: ApiContext, name: str | None, direction: str) -> str:
    """The model a query names, or the default; ``auto``: the direction's champion now."""
    return context.server.resolve(name or context.settings.default_model, direction)


@router.post("/similarity", response_model=SimilarityOut, responses=_QUERY_ERRORS)
async def similarity(body: SimilarityIn, context: Context) -> SimilarityOut:
    def score() -> SimilarityOut:
        name = _model_name(context, body.model, body.direction)
        img_dim, txt_dim = context.server.dims(name)
        images = matrix(body.images, "images", img_dim)
        texts = matrix(body.texts, "texts", txt_dim)
        if body.mode == "paired" and len(images) != len(texts):
            raise unprocessable(
                ["texts"], "length_mismatch", "paired mode needs as many texts as images"
            )
        served, scores = context.server.similarity(
            name, images, texts, body.mode == "matrix", body.version, body.direction
        )
        return SimilarityOut(
            model=name, version=served.version, members=_members(served), scores=scores.tolist()
        )

    try:
        return await context.compute(score)
    except EnsembleUnsupported as exc:
        raise unprocessable([exc.field], "ensemble", str(exc)) from None


@router.post("/search", response_model=SearchOut, responses=_QUERY_ERRORS)
async def search(body: SearchIn, context: Context) -> SearchOut:
    # On the event loop: only light steps run here (validation, the query transform, the exact
    # re-rank of ~100 candidates); the scan is awaited and heavy work goes to the query threads.
    name = _model_name(context, body.model, direction_of(body.modality))
    img_dim, txt_dim = context.server.dims(name)
    vector = matrix([body.vector], "vector", img_dim if body.modality == "image" else txt_dim)[0]
    target = body.target or other_modality(body.modality)
    try:
        answer = await context.server.search_async(
            name, body.modality, vector, body.k, context.compute, target, body.version, body.partial
        )
    except SameModalityUnsupported as exc:
        raise unprocessable(["target"], "not_shared_space", str(exc)) from None
    except EnsembleUnsupported as exc:
        raise unprocessable([exc.field], "ensemble", str(exc)) from None
    # One label for every ensemble: names a client writes must not grow the label set.
    context.metrics.version_lag.labels("ensemble" if is_ensemble(name) else name).observe(
        answer.version_lag_s
    )
    return SearchOut(
        model=name,
        version=answer.served.version,
        members=_members(answer.served),
        target=target,
        version_lag_s=round(answer.version_lag_s, 3),
        index_version=answer.index_version,
        covered=answer.covered,
        results=[Hit(id=i, score=s) for i, s in answer.hits],
    )


def _members(served: ServedModel | ServedEnsemble) -> dict[str, int] | None:
    return served.versions if isinstance(served, ServedEnsemble) else None
