"""``streamxm bench scan``: the search candidate scan's backends side by side, one thread.

For each dimension, the unit rows of :func:`~streamxm.tools.datasets.synthetic_arrays` (images
for 512, texts for 128 by default) are scanned by ``queries`` Gaussian queries at once, top
``candidates``; each backend reports the median seconds of ``repeats`` scans and the recall@10 of
its candidates against the exact float64 ranking. Backends: float32 blocked products
(:func:`~streamxm.serving.index.top_k`, always), bfloat16 and int8 (with PyTorch; int8 where its
product is exact), and FAISS flat and
8-bit scalar-quantised inner-product indexes when ``faiss`` is importable (it is not a
dependency: ``pip install faiss-cpu`` to include it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray
from threadpoolctl import threadpool_limits

from streamxm.serving.index import index_block, int8_available, top_k, torch
from streamxm.tools.datasets import synthetic_arrays

__all__ = ["scan"]

Search = Callable[[NDArray[np.float32]], NDArray[np.int64]]


def _backends(rows: NDArray[np.float32], candidates: int) -> dict[str, Search]:
    found: dict[str, Search] = {"float32": lambda q: top_k(q, [rows], candidates)[1]}
    if torch is not None:
        block = index_block(rows, "bfloat16")
        found["bfloat16"] = lambda q: top_k(q, [block], candidates)[1]
    if torch is not None and int8_available():
        codes = index_block(rows, "int8")
        found["int8"] = lambda q: top_k(q, [codes], candidates)[1]
    try:
        import faiss  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return found
    faiss.omp_set_num_threads(1)
    flat = faiss.IndexFlatIP(rows.shape[1])
    flat.add(rows)
    found["faiss_flat"] = lambda q: flat.search(q, candidates)[1]
    sq8 = faiss.IndexScalarQuantizer(
        rows.shape[1], faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
    )
    sq8.train(rows[: min(len(rows), 100_000)])
    sq8.add(rows)
    found["faiss_sq8"] = lambda q: sq8.search(q, candidates)[1]
    return found


def scan(
    rows: int = 1_000_000,
    dims: str = "128,512",
    queries: int = 32,
    candidates: int = 100,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Seconds per scan of ``queries`` queries and candidate recall, per backend and dimension."""
    wanted = [int(d) for d in dims.split(",")]
    imgs, txts, _ = synthetic_arrays(rows, max(wanted), min(wanted), n_classes=100, seed=seed)
    result: dict[str, Any] = {
        "benchmark": "scan",
        "rows": rows,
        "queries": queries,
        "candidates": candidates,
        "repeats": repeats,
        "threads": 1,
        "dims": {},
    }
    rng = np.random.default_rng(seed + 1)
    if torch is not None:
        torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        for data in (txts, imgs):
            unit = (data / np.linalg.norm(data, axis=1, keepdims=True)).astype(np.float32)
            q = rng.normal(size=(queries, unit.shape[1])).astype(np.float32)
            exact = np.argsort(-(q.astype(np.float64) @ unit.T.astype(np.float64)), axis=1)
            truth = [set(row[:10].tolist()) for row in exact]
            out = {}
            for name, search in _backends(unit, candidates).items():
                times, got = [], search(q)
                for _ in range(repeats):
                    start = time.perf_counter()
                    search(q)
                    times.append(time.perf_counter() - start)
                recall = np.mean(
                    [len(t & set(g.tolist())) / 10 for t, g in zip(truth, got, strict=True)]
                )
                out[name] = {
                    "seconds": round(statistics.median(times), 4),
                    "recall_at_10": round(float(recall), 4),
                }
            result["dims"][str(unit.shape[1])] = out
            del unit
    return result
