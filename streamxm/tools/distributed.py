"""``streamxm bench distributed``: one model learned by 1, 2, ... ranks from the same backlog.

For each rank count, in the same run: a fresh Redis holding the same pairs, then ``N`` processes
``streamxm worker --model M --world-size N --rank R`` (``threads_per_rank`` BLAS/torch threads
each), timed from their first checkpoint to the one that holds every pair (start-up excluded).
With a dataset, the pairs are its training split in file order and the final checkpoint's
test-split mAP is reported per rank count, so quality and speed come from the same runs.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tqdm import tqdm

from streamxm.learning.learner import StreamLearner
from streamxm.service import open_store
from streamxm.stream.client import StreamClient
from streamxm.stream.messages import Pair
from streamxm.tools.bench import evaluate_model
from streamxm.tools.datasets import iter_pairs, load_dataset, synthetic_pairs
from streamxm.tools.load import NAMESPACE, stack

__all__ = ["distributed"]


def _run(model: str, pairs: list[Pair], ranks: int, threads: int, read_batch: int,
         eval_every: int, params: dict[str, Any] | None, timeout_s: float
         ) -> tuple[dict[str, Any], StreamLearner]:
    total = len(pairs)
    with stack(eval_every=eval_every, checkpoint_every_seconds=0.5, read_batch=read_batch,
               dist_host="127.0.0.1", lease_ttl_ms=5000) as st:
        StreamClient(st.r, NAMESPACE).push_pairs(pairs)
        threads_env = {name: str(threads) for name in
                       ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        extra = [arg for key, value in (params or {}).items()
                 for arg in ("--param", f"{key}={json.dumps(value)}")]
        for rank in range(ranks):
            st.spawn("worker", "--model", model, "--world-size", str(ranks), "--rank", str(rank),
                     *extra, **threads_env)
        samples: list[tuple[float, int]] = []
        deadline = time.monotonic() + timeout_s
        with tqdm(total=total, desc=f"{model}, {ranks} rank(s)", file=sys.stderr) as bar:
            while True:
                stats = st.stats(model)
                done = int(stats.get("pairs_processed", 0))
                if done and (not samples or samples[-1][1] != done):
                    samples.append((float(stats["checkpoint_time"]), done))
                    bar.update(done - bar.n)
                if done >= total:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{ranks} rank(s) learned {done} of {total} pairs in "
                                       f"{timeout_s:.0f} s (logs in {st.root})")
                time.sleep(0.05)
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        if n0 > total // 2:
            raise ValueError(f"the first checkpoint already held {n0} of {total} pairs: "
                             "give more pairs to measure a rate")
        rounds = int(stats.get("dist_split_rounds", 0))
        collective = float(stats.get("dist_collective_seconds", 0.0))
        scatter = float(stats.get("dist_scatter_seconds", 0.0))
        figures: dict[str, Any] = {
            "ranks": ranks, "pairs_per_s": round((n1 - n0) / (t1 - t0), 1),
            "pairs_counted": n1, "checkpoints": len(samples),
        }
        if ranks > 1:
            figures.update({
                "rounds": int(stats.get("dist_rounds", 0)), "split_rounds": rounds,
                "collective_s_per_round": round(collective / max(rounds, 1), 4),
                "scatter_s_per_round": round(scatter / max(int(stats.get("dist_rounds", 0)), 1),
                                             4),
                "merge_bytes_per_round": int(stats.get("dist_merge_bytes", 0)),
            })
        ckpt = open_store(st.settings, st.r).load_latest(model)
        assert ckpt is not None
        return figures, StreamLearner.from_state(ckpt.arrays, ckpt.meta)


def distributed(model: str = "cmos", ranks: tuple[int, ...] = (1, 2), img_dim: int = 4096,
                txt_dim: int = 1000, pairs: int = 2000, threads_per_rank: int = 1,
                read_batch: int = 256, eval_every: int = 10, dataset: str | None = None,
                params: dict[str, Any] | None = None, seed: int = 0,
                timeout_s: float = 1800.0) -> dict[str, Any]:
    """Pairs/s (and, with ``dataset``, test mAP) per rank count; ``speedup`` of each count
    over the first one in ``ranks``."""
    ds = load_dataset(dataset) if dataset else None
    data = (list(iter_pairs(ds, limit=pairs or None)) if ds is not None
            else synthetic_pairs(pairs, img_dim, txt_dim, seed=seed))
    results = []
    for count in ranks:
        figures, learner = _run(model, data, count, threads_per_rank, read_batch, eval_every,
                                params, timeout_s)
        if ds is not None:
            maps = evaluate_model(learner, ds)
            figures["map_i2t"], figures["map_t2i"] = (round(maps["map_i2t"], 4),
                                                      round(maps["map_t2i"], 4))
        results.append(figures)
    base = results[0]
    for figures in results[1:]:
        figures["speedup"] = round(figures["pairs_per_s"] / base["pairs_per_s"], 3)
        if ds is not None:
            for d in ("i2t", "t2i"):
                figures[f"map_{d}_relative"] = round(
                    figures[f"map_{d}"] / base[f"map_{d}"] - 1.0, 4)
    return {
        "benchmark": "distributed", "model": model, "backend": "gloo",
        "img_dim": data[0].img.shape[0], "txt_dim": data[0].txt.shape[0], "pairs": len(data),
        "dataset": dataset, "threads_per_rank": threads_per_rank,
        "read_batch_per_rank": read_batch, "eval_every": eval_every, "runs": results,
        "speedup": results[-1].get("speedup"),
    }
