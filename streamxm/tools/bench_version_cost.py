"""``streamxm bench version-cost``: what one new model version costs a search server, per
model: the seconds to embed the whole gallery with it before it is served, and the memory the
gallery's kept features and embeddings take."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import MODEL_NAMES, CrossModalModel
from streamxm.serving.gallery import CHUNK_MAX, Gallery, GalleryChunk
from streamxm.serving.served import EmbeddedGallery
from streamxm.tools.datasets import synthetic_arrays, synthetic_pairs
from streamxm.tools.stack import rss_mb

__all__ = ["version_cost"]


def _gallery(n: int, img_dim: int, txt_dim: int, seed: int) -> Gallery:
    """A gallery of ``n`` synthetic items in chunks of :data:`CHUNK_MAX` rows (the API's
    largest tier), as a long-running server holds it."""
    imgs, txts, _ = synthetic_arrays(n, img_dim, txt_dim, n_classes=100, seed=seed)
    chunks = []
    for at in tqdm(range(0, n, CHUNK_MAX), desc="indexing the gallery", file=sys.stderr):
        ids = np.array([f"s{i}" for i in range(at, min(n, at + CHUNK_MAX))])
        chunks.append(GalleryChunk.of(ids, imgs[at : at + CHUNK_MAX], txts[at : at + CHUNK_MAX]))
    return Gallery(tuple(chunks))


def _nbytes(index: EmbeddedGallery) -> int:
    """Bytes of the embedded index: float32 arrays, or int8 codes (one byte a number)."""
    total = 0
    for modality in ("image", "text"):
        width = index.embedding.rows(
            modality, index.gallery.vectors_at(np.zeros(1, np.int64), modality)
        ).shape[1]
        for block in index.blocks(modality):
            total += int(block.nbytes) if isinstance(block, np.ndarray) else len(block) * width
    return total


def _embedding_pass(model: CrossModalModel, rows: Gallery) -> float:
    """Seconds to embed the gallery's raw vectors with ``model`` (both modalities): what a
    version costs an index of the version's embeddings, the reference for a model whose index
    keeps rows it recomputes in part."""
    started = time.perf_counter()
    for chunk in rows.chunks:
        for modality, embed in (("image", model.embed_images), ("text", model.embed_texts)):
            for at in range(0, len(chunk), 8192):
                embed(chunk.raw(modality, slice(at, at + 8192)))
    return time.perf_counter() - started


def version_cost(
    gallery: int = 100_000,
    img_dim: int = 512,
    txt_dim: int = 128,
    models: str = ",".join(MODEL_NAMES),
    pairs: int = 1500,
    versions: int = 3,
    pairs_between: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Per model: learn ``pairs`` synthetic pairs, then time embedding a ``gallery``-item
    gallery with ``versions`` versions of the model, ``pairs_between`` more pairs learned
    before each later one, each built from the one before as the API does: the first build
    computes the features a linear head keeps (``first_build_s``), the later ones reuse them,
    and a model that recomputes only what changed since its earlier version (cmomks) does so
    (``per_version_s``, their median). ``features_mb``: the kept features;
    ``embeddings_mb``: one version's embedded index (fixed-space models need neither);
    ``embed_s``, for such a model: one pass of its embeddings over the gallery, what a
    version cost when the index kept them (the reference)."""
    rows = _gallery(gallery, img_dim, txt_dim, seed)
    stream = synthetic_pairs(
        pairs + pairs_between * versions, img_dim, txt_dim, n_classes=100, seed=seed + 1
    )
    results: dict[str, Any] = {}
    for name in tqdm(models.split(","), desc="models", file=sys.stderr):
        learner = StreamLearner(name, img_dim, txt_dim, eval_every=len(stream) + 1, seed=seed)
        learner.learn(stream[:pairs])
        learner.flush()
        model = learner.model
        if model.embedding().fixed:
            results[name] = {
                "fixed_space": True,
                "per_version_s": 0.0,
                "features_mb": 0.0,
                "embeddings_mb": 0.0,
            }
            continue
        rows.keep_features(set())
        times = []
        index = None
        for version in range(versions):
            at = pairs + version * pairs_between
            if version:
                learner.learn(stream[at : at + pairs_between])
                learner.flush()
            model = StreamLearner.from_state(*learner.state()).model  # a version, as loaded
            started = time.perf_counter()
            index = EmbeddedGallery.build(version + 1, model.embedding(), rows, index)
            times.append(time.perf_counter() - started)
        assert index is not None
        features = rows.feature_bytes()
        kind = index.embedding
        results[name] = {
            "fixed_space": False,
            "linear_head": kind.head("image") is not None,
            "first_build_s": round(times[0], 3),
            "per_version_s": round(float(np.median(times[1:] or times)), 3),
            "features_mb": round(features / 2**20, 1),
            "embeddings_mb": round(_nbytes(index) / 2**20, 1),
        }
        if kind.updater(kind, "image") is not None:
            results[name]["embed_s"] = round(_embedding_pass(model, rows), 3)
    return {
        "benchmark": "version-cost",
        "gallery": gallery,
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "pairs_learned": pairs,
        "versions": versions,
        "pairs_between": pairs_between,
        "gallery_float32_mb": round(gallery * (img_dim + txt_dim) * 4 / 2**20, 1),
        "rss_mb": round(rss_mb(os.getpid()), 1),
        "models": results,
    }
