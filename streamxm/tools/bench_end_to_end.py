"""``streamxm bench end-to-end``: pairs/s one worker learns from the stream (a backlog
drained), beside the same learner fed in-process; then the lag it keeps while pairs are pushed
at a fixed rate."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from threadpoolctl import threadpool_limits
from tqdm import tqdm

from streamxm.learning.learner import StreamLearner
from streamxm.learning.schedule import EvalEvery
from streamxm.stream.client import StreamClient
from streamxm.stream.messages import (
    Pair,
)
from streamxm.tools.datasets import synthetic_pairs
from streamxm.tools.stack import NAMESPACE, percentile, stack
from streamxm.tools.waiting import wait_for

__all__ = ["end_to_end", "in_process_rate"]


# -- end to end -----------------------------------------------------------------------------
def in_process_rate(model: str, data: list[Pair], eval_every: EvalEvery, seed: int,
                    threads: int = 1, warmup: int = 0) -> float:
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


def end_to_end(model: str = "cmos", img_dim: int = 4096, txt_dim: int = 1000,
               backlog: int = 4000, rate: float | None = None, seconds: float = 60.0,
               eval_every: EvalEvery = "auto", seed: int = 0) -> dict[str, Any]:
    """Drain a backlog with one worker (learned pairs/s), then push at ``rate`` (default half
    the measured rate) for ``seconds`` and sample the lag every 0.25 s."""
    data = synthetic_pairs(backlog, img_dim, txt_dim, seed=seed)
    reference = in_process_rate(model, data, eval_every, seed)
    with stack(eval_every=eval_every, checkpoint_every_seconds=0.5) as st:
        client = StreamClient(st.r, NAMESPACE)
        client.push_pairs(data)
        st.spawn("worker", "--model", model)
        samples: list[tuple[float, int]] = []
        with tqdm(total=backlog, desc="draining the backlog", file=sys.stderr) as bar:
            while (done := st.processed(model)) < backlog:
                samples.append((time.perf_counter(), done))
                bar.update(done - bar.n)
                time.sleep(0.05)
        samples.append((time.perf_counter(), backlog))
        # Rate from the first checkpoint to the last: start-up (imports, first read) excluded.
        t0, n0 = next((t, n) for t, n in samples if n > 0)
        if n0 > backlog // 2:
            raise ValueError(f"the first checkpoint already held {n0} of {backlog} pairs: "
                             "raise --backlog to measure a rate")
        learned = (backlog - n0) / (samples[-1][0] - t0)
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
        for i in tqdm(range(0, len(more), step), desc=f"pushing at {push_rate}/s",
                      file=sys.stderr):
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
        "benchmark": "end_to_end", "model": model, "img_dim": img_dim, "txt_dim": txt_dim,
        "eval_every": eval_every, "backlog": backlog,
        "learned_pairs_per_s": round(learned, 1),
        "in_process_pairs_per_s": round(reference, 1),
        "ratio_to_in_process": round(learned / reference, 3),
        "push_rate": push_rate, "push_seconds": seconds,
        "lag_p50": percentile([float(x) for x in lags], 50),
        "lag_p99": percentile([float(x) for x in lags], 99), "lag_max": max(lags),
        "lag_seconds_p99": round(percentile([float(x) for x in lags], 99) / push_rate, 3),
        "drain_seconds_after_push": round(drain, 3),
        "note": "lag = pairs ingested - pairs in the newest checkpoint (checkpoints every 0.5 s)",
    }
