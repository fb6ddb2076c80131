"""The GPU check: SAM learning and a gallery shard's tower rebuild on CUDA against the CPU.

Run whenever a machine with CUDA is at hand (``make gpu-check``; a few minutes): it learns the
same stream with ``device="cuda"`` and ``device="cpu"``, compares the two models' embeddings
and the streaming mAP, then rebuilds one shard's part of a 100,000-item gallery with the CUDA
model's towers and with the same state on the CPU, and compares rows and times. Prints one JSON
object; exits 1 when a comparison fails, 0 with ``"cuda": false`` where torch finds no CUDA.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np


def _learned(device: str, pairs: list[Any], img_dim: int, txt_dim: int) -> Any:
    from streamxm.learning.stream_learner import StreamLearner

    learner = StreamLearner("sam", img_dim, txt_dim, {"device": device}, seed=0)
    started = time.perf_counter()
    learner.learn(pairs)
    learner.flush()
    return learner, time.perf_counter() - started


def _rebuild(model: Any, gallery: Any) -> tuple[np.ndarray, float]:
    from streamxm.serving.served import EmbeddedGallery

    started = time.perf_counter()
    index = EmbeddedGallery.build(1, model.embedding(), gallery)
    took = time.perf_counter() - started
    return np.vstack(index.blocks("text")), took


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "checked": "nothing: torch finds no CUDA device"}))
        return 0
    from streamxm.learning.stream_learner import StreamLearner
    from streamxm.serving.gallery import Gallery, GalleryChunk
    from streamxm.tools.datasets import synthetic_arrays, synthetic_pairs

    img_dim, txt_dim = 512, 128
    pairs = synthetic_pairs(3000, img_dim, txt_dim, n_classes=20, seed=1)
    (on_cuda, cuda_s), (on_cpu, cpu_s) = (
        _learned(d, pairs, img_dim, txt_dim) for d in ("cuda", "cpu")
    )
    probe = np.stack([p.txt for p in pairs[:200]])
    emb_cuda, emb_cpu = on_cuda.model.embed_texts(probe), on_cpu.model.embed_texts(probe)
    learning_ok = bool(np.allclose(emb_cuda, emb_cpu, rtol=1e-3, atol=1e-3))
    maps = {"cuda": on_cuda.rolling_map, "cpu": on_cpu.rolling_map}

    imgs, txts, _ = synthetic_arrays(100_000, img_dim, txt_dim, n_classes=100, seed=2)
    ids = np.array([f"s{i}" for i in range(len(imgs))])
    gallery = Gallery((GalleryChunk.of(ids, imgs, txts),))
    arrays, meta = on_cuda.state()
    cpu_meta = {**meta, "params": {**meta["params"], "device": "cpu"}}
    same_state_on_cpu = StreamLearner.from_state(arrays, cpu_meta).model
    rows_cuda, rebuild_cuda_s = _rebuild(on_cuda.model, gallery)
    rows_cpu, rebuild_cpu_s = _rebuild(same_state_on_cpu, gallery)
    rebuild_ok = bool(np.allclose(rows_cuda, rows_cpu, rtol=1e-4, atol=1e-5))
    summary = {
        "cuda": True,
        "device": torch.cuda.get_device_name(0),
        "learning_s": {"cuda": round(cuda_s, 2), "cpu": round(cpu_s, 2)},
        "embeddings_close": learning_ok,
        "rolling_map": maps,
        "shard_rebuild_s": {"cuda": round(rebuild_cuda_s, 2), "cpu": round(rebuild_cpu_s, 2)},
        "rebuild_rows_close": rebuild_ok,
    }
    print(json.dumps(summary))
    return 0 if learning_ok and rebuild_ok else 1


if __name__ == "__main__":
    sys.exit(main())
