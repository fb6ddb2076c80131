"""``streamxm bench soak``: push, learn, index and query for a long time; resident memory of
every process and Redis sampled every minute, and the slopes after warm-up."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from streamxm.storage.segments import SEGMENTS, read_manifest
from streamxm.stream.messages import (
    Pair,
)
from streamxm.stream.producer import StreamProducer
from streamxm.tools.datasets import synthetic_pairs
from streamxm.tools.stack import NAMESPACE, Stack, rss_mb, stack
from streamxm.tools.waiting import wait_for

__all__ = ["soak"]


# -- soak -----------------------------------------------------------------------------------
def _gallery_bytes(st: Stack) -> int:
    """Bytes of the gallery's live segments stored in Redis (the Redis checkpoint store)."""
    manifest = read_manifest(st.r, st.keys)
    if manifest is None:
        return 0
    return sum(
        int(st.r.strlen(st.keys.checkpoint_blob(SEGMENTS, ref.seq))) for ref in manifest.segments
    )


def _slope(samples: list[dict[str, float]], key: str) -> float:
    x = np.array([s["minute"] for s in samples])
    return float(np.polyfit(x, np.array([s[key] for s in samples]), 1)[0])


def soak(
    minutes: float = 20.0,
    rate: float = 100.0,
    qps: float = 20.0,
    img_dim: int = 512,
    txt_dim: int = 128,
    gallery_max: int = 20_000,
    sample_seconds: float = 60.0,
    warmup_minutes: float = 5.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Push at ``rate``, query at ``qps``, learn and index; memory sampled every minute.

    Per sample: resident memory of the worker, the indexer and the API, Redis ``used_memory``,
    the stream's length and the bytes of the gallery's segments (stored in Redis here), and the
    largest stream length seen between samples (polled every 2 s). The gallery cap is reached
    after ``gallery_max / rate`` seconds; memory may grow until then by design, so slopes are
    fitted to the samples after ``warmup_minutes``.
    """
    pool = synthetic_pairs(2000, img_dim, txt_dim, seed=seed)
    samples: list[dict[str, float]] = []
    with stack(gallery_max=gallery_max, checkpoint_every_seconds=2.0) as st:
        worker = st.spawn("worker", "--model", "cmos")
        indexer = st.spawn("indexer")
        client = StreamProducer(st.r, NAMESPACE)
        client.push_pairs(pool[:200])
        url = st.api()
        api = st.procs[-1]
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, 120, "ready")
        load = _SoakLoad(st, client, url, pool)
        threads = load.start(rate, qps)
        start = time.perf_counter()
        total = int(minutes * 60 / sample_seconds)
        for n in tqdm(range(total + 1), desc="soak samples", file=sys.stderr):
            load.stop.wait(max(0.0, start + n * sample_seconds - time.perf_counter()))
            samples.append(_sample(st, start, worker.pid, indexer.pid, api.pid))
        load.stop.set()
        for t in threads:
            t.join(timeout=30)
        alive = {"worker": worker.alive(), "indexer": indexer.alive(), "api": api.alive()}
    result: dict[str, Any] = {
        "benchmark": "soak",
        "minutes": minutes,
        "push_rate": rate,
        "qps": qps,
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "gallery_max": gallery_max,
        "warmup_minutes": warmup_minutes,
        **load.counts,
        "alive_at_end": alive,
        "samples": samples,
    }
    result.update(_slopes([s for s in samples if s["minute"] >= warmup_minutes]))
    return result


class _SoakLoad:
    """The soak's load, each part a thread until :attr:`stop` is set: pairs pushed at a rate,
    searches at a rate, and the stream's length polled every 2 s; :attr:`counts` says what
    they did."""

    def __init__(self, st: Stack, client: StreamProducer, url: str, pool: list[Pair]) -> None:
        self.st, self.client, self.url, self.pool = st, client, url, pool
        self.stop = threading.Event()
        self.counts = {"pushed": 0, "queries": 0, "query_errors": 0, "stream_length_max": 0}

    def start(self, rate: float, qps: float) -> list[threading.Thread]:
        """Start pushing at ``rate`` pairs/s and searching at ``qps``; the threads."""
        threads = [
            threading.Thread(target=self._produce, args=(rate,), daemon=True),
            threading.Thread(target=self._ask, args=(qps,), daemon=True),
            threading.Thread(target=self._watch_stream, daemon=True),
        ]
        for t in threads:
            t.start()
        return threads

    def _produce(self, rate: float) -> None:
        pool, counts = self.pool, self.counts
        step, i = max(1, int(rate / 10)), 0
        start = time.perf_counter()
        while not self.stop.is_set():
            part = [
                Pair(f"s{i + j}", p.img, p.txt, p.labels)
                for j, p in enumerate(pool[i % len(pool) : i % len(pool) + step])
            ]
            self.client.push_pairs(part)
            i += len(part)
            counts["pushed"] = i
            self.stop.wait(max(0.0, start + i / rate - time.perf_counter()))

    def _ask(self, qps: float) -> None:
        pool, counts = self.pool, self.counts
        with httpx.Client(base_url=self.url, timeout=30) as http:
            j = 0
            while not self.stop.is_set():
                p = pool[j % len(pool)]
                response = http.post(
                    "/v1/search", json={"modality": "image", "vector": p.img.tolist(), "k": 10}
                )
                counts["queries"] += 1
                counts["query_errors"] += response.status_code != 200
                j += 1
                self.stop.wait(1 / qps)

    def _watch_stream(self) -> None:
        st, counts = self.st, self.counts
        while not self.stop.wait(2.0):
            counts["stream_length_max"] = max(
                counts["stream_length_max"], int(st.r.xlen(st.keys.pairs))
            )


def _sample(st: Stack, start: float, worker: int, indexer: int, api: int) -> dict[str, float]:
    """One sample: each process's resident memory, Redis's with and without the segments, the
    stream's length, the pairs learned."""
    used = int(st.r.info("memory")["used_memory"])
    gallery_bytes = _gallery_bytes(st)
    return {
        "minute": round((time.perf_counter() - start) / 60, 2),
        "worker_rss_mb": round(rss_mb(worker), 1),
        "indexer_rss_mb": round(rss_mb(indexer), 1),
        "api_rss_mb": round(rss_mb(api), 1),
        "redis_used_mb": round(used / 2**20, 1),
        "gallery_segments_mb": round(gallery_bytes / 2**20, 1),
        "redis_less_gallery_mb": round((used - gallery_bytes) / 2**20, 1),
        "stream_length": int(st.r.xlen(st.keys.pairs)),
        "pairs_learned": st.processed("cmos"),
    }


def _slopes(late: list[dict[str, float]]) -> dict[str, float]:
    """Memory growth after warm-up: per series the slope (MB a minute) and the growth it makes
    in an hour (% of its mean)."""
    out: dict[str, float] = {}
    if len(late) < 2:
        return out
    for key in (
        "worker_rss_mb",
        "indexer_rss_mb",
        "api_rss_mb",
        "redis_used_mb",
        "redis_less_gallery_mb",
    ):
        slope = _slope(late, key)
        mean = float(np.mean([s[key] for s in late]))
        name = key.removesuffix("_mb")
        out[f"{name}_slope_mb_per_min"] = round(slope, 3)
        out[f"{name}_growth_pct_per_hour"] = round(100 * slope * 60 / mean, 2)
    return out
