"""``streamxm bench distributed``: one model learned by 1, 2, ... ranks from the same backlog.

For each rank count, in the same run: a fresh Redis holding the same pairs, then ``N`` processes
``streamxm worker --model M --world-size N --rank R`` (``threads_per_rank`` BLAS/torch threads
each), timed by the learning time recorded in their first checkpoint and in the one that holds
every pair (start-up excluded; checkpoints as the service writes them, every 2 s).
With a dataset, the pairs are its training split in file order and the final checkpoint's
test-split mAP is reported per rank count, so quality and speed come from the same runs.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from streamxm.learning.schedule import EvalEvery
from streamxm.learning.stream_learner import StreamLearner
from streamxm.service import open_store
from streamxm.stream.messages import Pair
from streamxm.stream.producer import StreamProducer
from streamxm.tools.bench import evaluate_model
from streamxm.tools.bench_end_to_end import in_process_rate
from streamxm.tools.datasets import iter_pairs, load_dataset, synthetic_pairs
from streamxm.tools.stack import NAMESPACE, Stack, stack

__all__ = ["distributed", "independent_rate"]


def independent_rate(
    model: str,
    img_dim: int,
    txt_dim: int,
    pairs: int,
    eval_every: EvalEvery,
    threads: int,
    seed: int,
) -> float:
    """Pairs/s of an in-process learner on synthetic pairs (after 256 warm-up pairs), limited
    to ``threads`` threads: run in ``N`` processes at once, the sum is what ``N`` ranks that
    never communicate would reach on this machine (they still share its caches and memory)."""
    torch.set_num_threads(threads)
    data = synthetic_pairs(pairs + 256, img_dim, txt_dim, seed=seed)
    return in_process_rate(model, data, eval_every, seed, threads=threads, warmup=256)


def _independent(
    counts: tuple[int, ...], rate: Callable[[int], float], seed: int
) -> dict[int, float]:
    """Per count ``N`` of ``counts``: the sum of ``rate(seed + i)`` run in ``N`` processes at
    once, ``i`` from 0 to ``N - 1`` (``rate``: :func:`independent_rate` but for its seed)."""
    context = multiprocessing.get_context("spawn")
    totals = {}
    for count in counts:
        with ProcessPoolExecutor(count, mp_context=context) as pool:
            rates = list(pool.map(rate, [seed + i for i in range(count)]))
        totals[count] = sum(rates)
    return totals


def _run(
    model: str,
    pairs: list[Pair],
    ranks: int,
    threads: int,
    read_batch: int,
    eval_every: EvalEvery,
    params: dict[str, Any] | None,
    timeout_s: float,
    seed: int,
) -> tuple[dict[str, Any], StreamLearner]:
    total = len(pairs)
    # Checkpoints as the service writes them (every 2 s or 2,000 pairs); each records when its
    # newest pair had been learned, which times the run (the last checkpoint may come up to
    # its interval after the last pair).
    with stack(
        eval_every=eval_every,
        read_batch=read_batch,
        seed=seed,
        dist_host="127.0.0.1",
        lease_ttl_ms=5000,
    ) as st:
        StreamProducer(st.r, NAMESPACE).push_pairs(pairs)
        _spawn_ranks(st, model, ranks, threads, params)
        samples, stats = _follow_checkpoints(st, model, ranks, total, timeout_s)
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        # Too few pairs after the first checkpoint to time (a fast model on a small dataset):
        # no rate rather than a wrong one.
        rate = round((n1 - n0) / (t1 - t0), 1) if n0 <= total // 2 and t1 > t0 else None
        figures: dict[str, Any] = {
            "ranks": ranks,
            "pairs_per_s": rate,
            "pairs_counted": n1,
            "checkpoints": len(samples),
        }
        if ranks > 1:
            figures.update(_round_figures(stats))
        ckpt = open_store(st.settings, st.r).load_latest(model)
        assert ckpt is not None
        return figures, StreamLearner.from_state(ckpt.arrays, ckpt.meta)


def _spawn_ranks(
    st: Stack, model: str, ranks: int, threads: int, params: dict[str, Any] | None
) -> None:
    """``ranks`` processes ``streamxm worker --world-size ranks --rank R`` of ``model``, each
    with ``threads`` threads and the same ``params``."""
    threads_env = {"STREAMXM_THREADS": str(threads)}
    extra = [
        arg
        for key, value in (params or {}).items()
        for arg in ("--param", f"{key}={json.dumps(value)}")
    ]
    for rank in range(ranks):
        st.spawn(
            "worker",
            "--model",
            model,
            "--world-size",
            str(ranks),
            "--rank",
            str(rank),
            *extra,
            **threads_env,
        )


def _follow_checkpoints(
    st: Stack, model: str, ranks: int, total: int, timeout_s: float
) -> tuple[list[tuple[float, int]], dict[str, str]]:
    """Poll the model's statistics until its checkpoints hold all ``total`` pairs: each new
    checkpoint's (learning time, pairs), and the last statistics read; :class:`TimeoutError`
    after ``timeout_s``."""
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout_s
    with tqdm(total=total, desc=f"{model}, {ranks} rank(s)", file=sys.stderr) as bar:
        while True:
            stats = st.stats(model)
            done = int(stats.get("pairs_processed", 0))
            if done and (not samples or samples[-1][1] != done):
                samples.append((float(stats["learned_time"]), done))
                bar.update(done - bar.n)
            if done >= total:
                return samples, stats
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{ranks} rank(s) learned {done} of {total} pairs in "
                    f"{timeout_s:.0f} s (logs in {st.root})"
                )
            time.sleep(0.05)


def _round_figures(stats: dict[str, str]) -> dict[str, Any]:
    """A distributed learner's rounds, from rank 0's statistics: how many, and the time per
    round in each part of one."""
    rounds = int(stats.get("dist_split_rounds", 0))
    collective = float(stats.get("dist_collective_seconds", 0.0))
    scatter = float(stats.get("dist_scatter_seconds", 0.0))
    return {
        "rounds": int(stats.get("dist_rounds", 0)),
        "split_rounds": rounds,
        "collective_s_per_round": round(collective / max(rounds, 1), 4),
        "scatter_s_per_round": round(scatter / max(int(stats.get("dist_rounds", 0)), 1), 4),
        "merge_bytes_per_round": int(stats.get("dist_merge_bytes", 0)),
        "rank0_learn_s_per_round": round(
            float(stats.get("dist_learn_seconds", 0.0)) / max(rounds, 1), 4
        ),
        "rank0_commit_s_per_round": round(
            float(stats.get("dist_commit_seconds", 0.0)) / max(rounds, 1), 4
        ),
        "rank0_between_rounds_s_per_round": round(
            float(stats.get("dist_between_seconds", 0.0)) / max(rounds, 1), 4
        ),
        "other_ranks_learn_s_per_round": round(
            float(stats.get("dist_peer_learn_seconds", 0.0)) / max(rounds, 1), 4
        ),
    }


def distributed(
    model: str = "cmos",
    ranks: tuple[int, ...] = (1, 2),
    img_dim: int = 4096,
    txt_dim: int = 1000,
    pairs: int = 12288,
    threads_per_rank: int = 1,
    read_batch: int = 256,
    eval_every: EvalEvery = "auto",
    dataset: str | None = None,
    params: dict[str, Any] | None = None,
    seed: int = 0,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Pairs/s (and, with ``dataset``, test mAP) per rank count; ``speedup`` of each count
    over the first one in ``ranks``. ``seed`` seeds the learners (and the synthetic pairs).
    Synthetic pair counts are rounded up to whole rounds of
    the largest rank count."""
    ds = load_dataset(dataset) if dataset else None
    if ds is None:  # whole rounds of the largest rank count
        pairs = -(-pairs // (read_batch * max(ranks))) * read_batch * max(ranks)
    data = (
        list(iter_pairs(ds, limit=pairs or None))
        if ds is not None
        else synthetic_pairs(pairs, img_dim, txt_dim, seed=seed)
    )
    results = []
    for count in ranks:
        figures, learner = _run(
            model, data, count, threads_per_rank, read_batch, eval_every, params, timeout_s, seed
        )
        if ds is not None:
            maps = evaluate_model(learner, ds)
            figures["map_i2t"], figures["map_t2i"] = (
                round(maps["map_i2t"], 4),
                round(maps["map_t2i"], 4),
            )
        results.append(figures)
    if ds is None:
        rate = partial(
            independent_rate,
            model,
            img_dim,
            txt_dim,
            min(len(data), 1536),
            eval_every,
            threads_per_rank,
        )
        ceiling = _independent(ranks, rate, seed)
        for figures in results:
            figures["independent_pairs_per_s"] = round(ceiling[figures["ranks"]], 1)
    base = results[0]
    for figures in results[1:]:
        if figures["pairs_per_s"] and base["pairs_per_s"]:
            figures["speedup"] = round(figures["pairs_per_s"] / base["pairs_per_s"], 3)
        if "independent_pairs_per_s" in figures:
            figures["independent_speedup"] = round(
                figures["independent_pairs_per_s"] / base["independent_pairs_per_s"], 3
            )
        if ds is not None:
            for d in ("i2t", "t2i"):
                figures[f"map_{d}_relative"] = round(
                    figures[f"map_{d}"] / base[f"map_{d}"] - 1.0, 4
                )
    return {
        "benchmark": "distributed",
        "model": model,
        "backend": "gloo",
        "img_dim": data[0].img.shape[0],
        "txt_dim": data[0].txt.shape[0],
        "pairs": len(data),
        "dataset": dataset,
        "threads_per_rank": threads_per_rank,
        "read_batch_per_rank": read_batch,
        "eval_every": eval_every,
        "runs": results,
        "speedup": results[-1].get("speedup"),
        "note": "independent_*: the same learner in N processes at once that never "
        "communicate (in-process, no Redis): the machine's own ceiling for N ranks",
    }
