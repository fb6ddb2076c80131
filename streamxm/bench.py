"""``streamxm bench``: quality on a benchmark file, through the learning code the worker runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from streamxm.datasets import Dataset, iter_pairs, load_dataset
from streamxm.evaluation import label_relevance, mean_average_precision
from streamxm.learner import Learner

__all__ = ["evaluate_model", "quality"]


def evaluate_model(learner: Learner, ds: Dataset) -> dict[str, float]:
    """Test-split mAP, whole gallery, relevant = shares a label; for models with a shared space
    also the same-modality directions (``map_i2i``, ``map_t2t``: the query itself stays in the
    gallery, as in the papers that report them)."""
    learner.flush()
    model = learner.model
    scores = model.similarity(ds.img_test, ds.txt_test)
    rel = label_relevance(ds.y_test, ds.y_test)
    out = {"map_i2t": mean_average_precision(scores, rel),
           "map_t2i": mean_average_precision(scores.T, rel.T)}
    if model.shared_space:
        img = model.embed_images(ds.img_test).astype(np.float64)
        txt = model.embed_texts(ds.txt_test).astype(np.float64)
        out["map_i2i"] = mean_average_precision(img @ img.T, rel)
        out["map_t2t"] = mean_average_precision(txt @ txt.T, rel)
    return out


def quality(
    dataset: str | Path,
    model: str,
    protocol: str = "stream",
    unlabelled: bool = False,
    seed: int = 0,
    epochs: int = 5,
    params: dict[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Train on the train split and score the test split.

    ``stream`` feeds each training row once, in file order; ``offline`` gives models with a
    batch fit (``batch_fit``) the whole training set at once, and feeds the others the training
    rows ``epochs`` times (file order each time: they see the data as a longer stream).
    """
    if protocol not in ("stream", "offline"):
        raise ValueError("protocol must be 'stream' or 'offline'")
    ds = load_dataset(dataset)
    learner = Learner(model, ds.img_train.shape[1], ds.txt_train.shape[1], params, seed=seed)
    batch = protocol == "offline" and learner.model.batch_fit
    passes = 1 if protocol == "stream" or batch else epochs
    start = time.perf_counter()
    with tqdm(total=passes * len(ds.img_train), disable=not progress, unit="pair",
              desc=f"{model} {protocol}") as bar:
        for _ in range(passes):
            pairs = list(iter_pairs(ds, unlabelled=unlabelled))
            if batch:
                learner.fit(pairs)
                bar.update(len(pairs))
                continue
            for i in range(0, len(pairs), 256):
                learner.learn(pairs[i : i + 256])
                bar.update(len(pairs[i : i + 256]))
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "dataset": str(dataset),
        "model": model,
        "protocol": protocol,
        "unlabelled": unlabelled,
        "seed": seed,
        "passes": passes,
        "train_pairs": len(ds.img_train),
        "test_pairs": len(ds.img_test),
        **evaluate_model(learner, ds),
        "mistakes": dict(learner.stats.mistakes),
        "triplets": dict(learner.stats.triplets),
        "rolling_map": learner.rolling_map(),
        "params": learner.model.params(),
        "train_seconds": round(seconds, 3),
    }
    return result
