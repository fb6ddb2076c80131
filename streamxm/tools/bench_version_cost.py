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

from streamxm.learning.learner import StreamLearner
from streamxm.models import MODEL_NAMES
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
    for modality, embed in (("image", index.model.embed_images),
                            ("text", index.model.embed_texts)):
        width = embed(index.gallery.vectors_at(np.zeros(1, np.int64), modality)).shape[1]
        for block in index.blocks(modality):
            total += int(block.nbytes) if isinstance(block, np.ndarray) else len(block) * width
    return total


def version_cost(gallery: int = 100_000, img_dim: int = 512, txt_dim: int = 128,
                 models: str = ",".join(MODEL_NAMES), pairs: int = 1500, versions: int = 3,
                 seed: int = 0) -> dict[str, Any]:
    """Per model: learn ``pairs`` synthetic pairs, then time embedding a ``gallery``-item
    gallery with the model ``versions`` times, as the API does for each new version: the
    first build computes the features a linear head keeps (``first_build_s``), the later ones
    reuse them (``per_version_s``, their median). ``features_mb``: the kept features;
    ``embeddings_mb``: one version's embedded index (fixed-space models need neither)."""
    rows = _gallery(gallery, img_dim, txt_dim, seed)
    stream = synthetic_pairs(pairs, img_dim, txt_dim, n_classes=100, seed=seed + 1)
    results: dict[str, Any] = {}
    for name in tqdm(models.split(","), desc="models", file=sys.stderr):
        learner = StreamLearner(name, img_dim, txt_dim, eval_every=pairs + 1, seed=seed)
        learner.learn(stream)
        learner.flush()
        model = learner.model
        if model.fixed_space:
            results[name] = {"fixed_space": True, "per_version_s": 0.0, "features_mb": 0.0,
                             "embeddings_mb": 0.0}
            continue
        rows.keep_features(set())
        times = []
        index = None
        for _ in range(versions):
            started = time.perf_counter()
            index = EmbeddedGallery.build(1, model, rows)
            times.append(time.perf_counter() - started)
        assert index is not None
        features = rows.feature_bytes()
        results[name] = {
            "fixed_space": False, "linear_head": model.linear_head("image") is not None,
            "first_build_s": round(times[0], 3),
            "per_version_s": round(float(np.median(times[1:] or times)), 3),
            "features_mb": round(features / 2**20, 1),
            "embeddings_mb": round(_nbytes(index) / 2**20, 1)}
    return {"benchmark": "version-cost", "gallery": gallery, "img_dim": img_dim,
            "txt_dim": txt_dim, "pairs_learned": pairs, "versions": versions,
            "gallery_float32_mb": round(gallery * (img_dim + txt_dim) * 4 / 2**20, 1),
            "rss_mb": round(rss_mb(os.getpid()), 1), "models": results}
