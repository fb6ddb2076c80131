"""``streamxm bench end-to-end``: pairs/s one worker learns from the stream (a backlog
drained), beside the same learner fed in-process; then the lag it keeps while pairs are pushed
at a fixed rate."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import redis
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from streamxm.learning.schedule import EvalEvery
from streamxm.learning.stream_learner import StreamLearner
from streamxm.stream.messages import (
    Pair,
)
from streamxm.stream.producer import StreamProducer
from streamxm.tools.datasets import synthetic_pairs
from streamxm.tools.stack import NAMESPACE, Stack, percentile, stack
from streamxm.tools.waiting import wait_for

__all__ = ["end_to_end", "in_process_rate"]


# -- end to end -----------------------------------------------------------------------------
def in_process_rate(
    model: str,
    data: list[Pair],
    eval_every: EvalEvery,
    seed: int,
    threads: int = 1,
    warmup: int = 0,
) -> float:
    """The reference: the same learner, options and pairs, fed in-process on ``threads``
    threads; pairs/s over the pairs after the first ``warmup``."""
    img_dim, txt_dim = data[0].img.shape[0], data[0].txt.shape[0]
    with threadpool_limits(limits=threads):
        learner = StreamLearner(model, img_dim, txt_dim, seed=seed, eval_every=eval_every)
        learner.learn(data[:warmup])
        start = time.perf_counter()
        for i in range(warmup, len(data), 256):
            learner.learn(data[i : i + 256])
        learner.flush()
        return (len(data) - warmup) / (time.perf_counter() - start)


def _delivered(st: Stack, model: str) -> int:
    """Entries the worker has read: those acknowledged with a checkpoint (``pairs_processed``,
    written in the same transaction as the acknowledgements) plus those read since."""
    try:
        pending = st.r.xpending(st.keys.pairs, st.keys.group(model))["pending"]
    except redis.ResponseError:  # NOGROUP: the worker has not started yet
        return 0
    return st.processed(model) + int(pending)


def _drain_rate(st: Stack, model: str, backlog: int) -> float:
    """Pairs/s the worker learns while it drains the backlog: from its first read to its last
    (it reads a batch once it has learned the one before, so the pairs learned in between are
    all but the last batch). Reads, not checkpoints, mark the progress: checkpoints come as
    rarely as their share of the time allows, and would quantise the figure."""
    reads: list[tuple[float, int]] = []
    with tqdm(total=backlog, desc="draining the backlog", file=sys.stderr) as bar:
        while (read := _delivered(st, model)) < backlog:
            if read and (not reads or read > reads[-1][1]):
                reads.append((time.perf_counter(), read))
            bar.update(read - bar.n)
            time.sleep(0.02)
    reads.append((time.perf_counter(), backlog))
    if len(reads) < 3:
        raise ValueError(
            f"the worker read the backlog of {backlog} pairs in {len(reads)} "
            "batches: raise --backlog to measure a rate"
        )
    (t0, _), (_, before_last), (t2, _) = reads[0], reads[-2], reads[-1]
    return before_last / (t2 - t0) if t2 > t0 else float("nan")


def end_to_end(
    model: str = "cmos",
    img_dim: int = 4096,
    txt_dim: int = 1000,
    backlog: int = 4000,
    rate: float | None = None,
    seconds: float = 60.0,
    eval_every: EvalEvery = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """Drain a backlog with one worker (learned pairs/s), then push at ``rate`` (default half
    the measured rate) for ``seconds`` and sample the lag every 0.25 s."""
    data = synthetic_pairs(backlog, img_dim, txt_dim, seed=seed)
    reference = in_process_rate(model, data, eval_every, seed)
    with stack(eval_every=eval_every) as st:  # the service's checkpoint schedule
        client = StreamProducer(st.r, NAMESPACE)
        client.push_pairs(data)
        st.spawn("worker", "--model", model)
        learned = _drain_rate(st, model, backlog)
        push_rate = rate or round(learned / 2, 1)
        more = synthetic_pairs(int(push_rate * seconds) + 1, img_dim, txt_dim, seed=seed + 1)
        lags: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                ingested = int(st.r.get(st.keys.ingested) or 0)
                lags.append(ingested - st.processed(model))
                stop.wait(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        step = max(1, int(push_rate / 20))  # 20 pushes per second
        for i in tqdm(range(0, len(more), step), desc=f"pushing at {push_rate}/s", file=sys.stderr):
            client.push_pairs(more[i : i + step])
            wait = start + (i + step) / push_rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        pushed_at = time.perf_counter()
        total = backlog + len(more)
        wait_for(lambda: st.processed(model) >= total, 600, "the worker to catch up")
        drain = time.perf_counter() - pushed_at
        stop.set()
        sampler.join()
    return {
        "benchmark": "end_to_end",
        "model": model,
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "eval_every": eval_every,
        "backlog": backlog,
        "learned_pairs_per_s": round(learned, 1),
        "in_process_pairs_per_s": round(reference, 1),
        "ratio_to_in_process": round(learned / reference, 3),
        "push_rate": push_rate,
        "push_seconds": seconds,
        "lag_p50": percentile([float(x) for x in lags], 50),
        "lag_p99": percentile([float(x) for x in lags], 99),
        "lag_max": max(lags),
        "lag_seconds_p99": round(percentile([float(x) for x in lags], 99) / push_rate, 3),
        "drain_seconds_after_push": round(drain, 3),
        "note": "lag = pairs ingested - pairs in the newest checkpoint (the service's "
        "checkpoint schedule: every 2 s or 2000 pairs, at most 10% of the worker's time)",
    }
