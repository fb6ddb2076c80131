"""Load benchmarks: ingest, end-to-end learning, query latency under load, and a memory soak.

Every benchmark starts its own stack in a temporary directory (a fresh embedded Redis with AOF,
``streamxm api`` and ``streamxm worker`` as child processes, exactly as a user runs them) and
measures its reference in the same run, so figures are ratios on the same noisy machine:

- :func:`ingest`: pairs/s through :class:`~streamxm.stream.client.StreamClient` (pipelined
  ``XADD``) and through ``POST /v1/pairs``, beside ``redis-benchmark``'s ``XADD`` rate for
  entries of the same size on the same server.
- :func:`end_to_end`: pairs/s one worker learns from the stream (a backlog drained), beside the
  same learner fed in-process; then the lag it keeps while pairs are pushed at a fixed rate.
- :func:`query`: ``/v1/search`` latency and throughput from concurrent clients over a large
  gallery, while a worker learns and the API swaps new checkpoints in.
- :func:`soak`: push, learn and query for a long time, resident memory of worker and API sampled
  every minute; the slope after warm-up.
- :func:`hostile`: junk request bodies of growing size, the answer's size and the API's memory,
  and ``/healthz`` latency meanwhile beside its latency at rest.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis
from numpy.typing import NDArray
from prometheus_client.parser import text_string_to_metric_families
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from streamxm.config import Settings
from streamxm.learning.learner import StreamLearner
from streamxm.models import CrossModalModel
from streamxm.models.ensemble import REFERENCE_ITEMS
from streamxm.service import open_store
from streamxm.storage.segments import SEGMENTS, read_manifest
from streamxm.stream.client import StreamClient
from streamxm.stream.keys import Keys
from streamxm.stream.messages import (
    FRAMES_MEDIA_TYPE,
    Pair,
    encode_frame,
    encode_frames,
    encode_pair,
    make_pair,
)
from streamxm.stream.redis_conn import EmbeddedRedis, connect, str_hash, text
from streamxm.stream.retention import entry_id_key
from streamxm.tools.datasets import synthetic_arrays, synthetic_pairs
from streamxm.tools.processes import Child
from streamxm.tools.waiting import free_port, wait_for

__all__ = ["end_to_end", "hostile", "in_process_rate", "ingest", "query", "rss_mb", "soak",
           "stack"]

NAMESPACE = "load"


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``; ``None``: this one)."""
    fields = Path(f"/proc/{pid or 'self'}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident set size of a process, MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Stack:
    """A private Redis plus the processes a benchmark starts against it."""

    root: Path
    redis_server: EmbeddedRedis
    settings: Settings
    r: redis.Redis
    env: dict[str, str]
    procs: list[Child]

    @property
    def keys(self) -> Keys:
        return Keys(self.settings.namespace)

    def spawn(self, *args: str, **env: str) -> Child:
        child = Child(*args, env={**self.env, **env},
                      log=self.root / f"{args[0]}-{len(self.procs)}.log")
        self.procs.append(child)
        return child

    def api(self, **env: str) -> str:
        port = free_port()
        self.spawn("api", STREAMXM_API_PORT=str(port), **env)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 60,
                 f"the API to start (its log is in {self.root})", tolerate=(httpx.TransportError,))
        return url

    def stats(self, model: str = "cmos") -> dict[str, str]:
        return str_hash(self.r.hgetall(self.keys.stats(model)))

    def processed(self, model: str = "cmos") -> int:
        return int(self.stats(model).get("pairs_processed", 0))


@contextlib.contextmanager
def stack(**settings: Any) -> Iterator[Stack]:
    """Fresh Redis (AOF on, as the embedded default) in a temporary directory; children are
    stopped and everything removed on exit."""
    root = Path(tempfile.mkdtemp(prefix="sxm-load-"))
    server = EmbeddedRedis(root / "redis")
    url = server.start()
    values: dict[str, Any] = {"redis_url": url, "namespace": NAMESPACE,
                              "data_dir": root / "data",
                              "checkpoint_dir": root / "checkpoints", **settings}
    cfg = Settings(_env_file=None, **values)  # type: ignore[call-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMXM_")}
    env.update({f"STREAMXM_{k.upper()}": str(v) for k, v in values.items()},
               STREAMXM_THREADS="1")
    st = Stack(root, server, cfg, connect(cfg), env, [])
    try:
        yield st
    finally:
        for child in st.procs:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)  # all at once, then wait for each
        for child in st.procs:
            child.stop(timeout=30)
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _pair_json(pair: Pair, binary: bool = False) -> dict[str, Any]:
    """A pair as ``POST /v1/pairs`` takes it: vectors as JSON numbers, or as base64 strings of
    little-endian float32 bytes (``binary``)."""
    def vector(x: Any) -> Any:
        return b64_float32(x) if binary else x.tolist()

    return {"id": pair.id, "img": vector(pair.img), "txt": vector(pair.txt),
            "labels": list(pair.labels)}


def b64_float32(vector: Any) -> str:
    """A vector as the API's binary form: base64 of its little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# -- ingest ---------------------------------------------------------------------------------
def _redis_benchmark(st: Stack, img_dim: int, txt_dim: int, n: int, pipeline: int) -> float | None:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    # Entries of the same shape and size as message v1 (bytes as printable filler).
    args = [binary, "-s", str(st.redis_server.socket), "-n", str(n), "-c", "1",
            "-P", str(pipeline), "-q", "XADD", "sxm:bench:redis-benchmark", "*", "v", "1",
            "id", "rb-__rand_int__", "img", "x" * (4 * img_dim), "txt", "x" * (4 * txt_dim),
            "labels", "1"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    st.r.delete("sxm:bench:redis-benchmark")
    rates = re.findall(r"([\d.]+) requests per second", out)
    return float(rates[-1]) if rates else None


def ingest(img_dim: int = 4096, txt_dim: int = 1000, pairs: int = 6000, http_batch: int = 64,
           chunk: int = 500, repeats: int = 5, seed: int = 0, cluster: bool = False,
           http_clients: int = 4) -> dict[str, Any]:
    """Median pairs/s of the client, of HTTP with JSON numbers, with base64 float32 vectors in
    JSON and with binary bodies of message v1 frames, and of ``redis-benchmark`` XADD, and
    their ratios; all in the same run. The HTTP figures are of an ingest replica
    (``STREAMXM_API_ROLE=ingest``), posted by ``http_clients`` connections at once; then
    frames again into an API of the default role, which also reads every pair back into its
    search gallery (``search_replica_*``). ``cluster``: :func:`ingest_cluster` instead."""
    if cluster:
        return ingest_cluster(img_dim, txt_dim, pairs, chunk, repeats, seed)
    data = synthetic_pairs(pairs, img_dim, txt_dim, seed=seed)
    batches = [data[i : i + http_batch] for i in range(0, pairs, http_batch)]
    # Bodies encoded up front: the figure is the API's rate, not this process's encoder.
    json_type, frames_type = "application/json", FRAMES_MEDIA_TYPE
    paths: dict[str, tuple[str, str, list[bytes]]] = {
        "json": ("/v1/pairs", json_type, [json.dumps({"pairs": [
            _pair_json(p) for p in b]}).encode() for b in batches]),
        "base64": ("/v1/pairs", json_type, [json.dumps({"pairs": [
            _pair_json(p, True) for p in b]}).encode() for b in batches]),
        "frames": ("/v1/pairs/frames", frames_type, [encode_frames(b) for b in batches]),
    }
    client_rates, rb_rates, replica_rates = [], [], []
    http_rates: dict[str, list[float]] = {name: [] for name in paths}

    def post_all(url: str, name: str) -> float:
        path, media, bodies = paths[name]
        seconds = asyncio.run(_post_each(url, [_request(url, path, media, body)
                                               for body in bodies], http_clients))
        st.r.delete(st.keys.pairs)
        return pairs / seconds

    with stack() as st:
        # An ingest replica: no search gallery reading every pair back during any of these.
        url = st.api(STREAMXM_API_ROLE="ingest")
        client = StreamClient(st.r, NAMESPACE)
        # One untimed round first: Redis's first round of entries (page faults, allocator
        # growth) would otherwise land on whichever path runs first, the client.
        client.push_pairs(data, chunk=chunk)
        st.r.delete(st.keys.pairs)
        for name in paths:
            post_all(url, name)
        for _ in tqdm(range(repeats), desc="ingest repeats", file=sys.stderr):
            start = time.perf_counter()
            client.push_pairs(data, chunk=chunk)
            client_rates.append(pairs / (time.perf_counter() - start))
            st.r.delete(st.keys.pairs)
            for name in paths:
                http_rates[name].append(post_all(url, name))
            rate = _redis_benchmark(st, img_dim, txt_dim, max(pairs, 5000), chunk)
            if rate is not None:
                rb_rates.append(rate)
        st.procs.pop().stop(timeout=30)
        # The default role: the same API also keeps the search gallery, reading every pair back.
        url = st.api()
        post_all(url, "frames")
        for _ in tqdm(range(repeats), desc="search replica repeats", file=sys.stderr):
            replica_rates.append(post_all(url, "frames"))
    client_rate = statistics.median(client_rates)
    median = {name: statistics.median(rates) for name, rates in http_rates.items()}
    result: dict[str, Any] = {
        "benchmark": "ingest", "img_dim": img_dim, "txt_dim": txt_dim, "pairs": pairs,
        "entry_bytes": 4 * (img_dim + txt_dim), "client_pipeline": chunk,
        "http_batch": http_batch, "http_clients": http_clients, "repeats": repeats,
        "client_pairs_per_s": round(client_rate, 1),
        "http_pairs_per_s": round(median["json"], 1),
        "http_base64_pairs_per_s": round(median["base64"], 1),
        "http_binary_pairs_per_s": round(median["frames"], 1),
        "http_binary_to_client": round(median["frames"] / client_rate, 3),
        "api_role": "ingest",
        "search_replica_binary_pairs_per_s": round(statistics.median(replica_rates), 1),
        "search_replica_binary_to_client": round(
            statistics.median(replica_rates) / client_rate, 3),
        "client_runs": [round(x, 1) for x in client_rates],
        "http_runs": [round(x, 1) for x in http_rates["json"]],
        "http_base64_runs": [round(x, 1) for x in http_rates["base64"]],
        "http_binary_runs": [round(x, 1) for x in http_rates["frames"]],
        "search_replica_binary_runs": [round(x, 1) for x in replica_rates],
    }
    if rb_rates:
        rb = statistics.median(rb_rates)
        result.update(redis_benchmark_xadd_per_s=round(rb, 1),
                      redis_benchmark_runs=[round(x, 1) for x in rb_rates],
                      client_ratio=round(result["client_pairs_per_s"] / rb, 3),
                      http_ratio=round(median["json"] / rb, 3),
                      http_binary_ratio=round(median["frames"] / rb, 3))
    else:
        result["redis_benchmark_xadd_per_s"] = None
        result["note"] = "redis-benchmark not found (Debian: apt-get install redis-tools)"
    return result


def _push_timed(url: str, namespace: str, img_dim: int, txt_dim: int, pairs: int, chunk: int,
                seed: int, start_at: float) -> tuple[float, float]:
    """In a producer process: make the pairs, wait for ``start_at`` (wall clock, so that the
    producers of one round start together), push them; returns (start, end)."""
    data = synthetic_pairs(pairs, img_dim, txt_dim, seed=seed)
    client = StreamClient(connect(Settings(_env_file=None, redis_url=url,  # type: ignore[call-arg]
                                           namespace=namespace)), namespace)
    client.push_pairs(data[:1])  # the connections and the namespace's schema, untimed
    time.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    client.push_pairs(data[1:], chunk=chunk)
    return start, time.time()


def ingest_cluster(img_dim: int = 4096, txt_dim: int = 1000, pairs: int = 2000,
                   chunk: int = 500, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Pairs/s the client pushes into a local Redis Cluster (3 masters, 3 replicas, AOF
    ``everysec``, asynchronous replication): one namespace (one master) by one producer
    process, then three namespaces on three different masters by three producer processes at
    once; medians over ``repeats`` rounds of each, in the same run. A round's rate is its
    pairs over the time from the first producer's start to the last one's end."""
    import multiprocessing

    from streamxm.tools.cluster import LocalCluster, namespace_on_each_master

    root = Path(tempfile.mkdtemp(prefix="sxm-cluster-"))
    rates: dict[str, list[float]] = {"one": [], "three": []}
    try:
        with LocalCluster(root) as local, \
                multiprocessing.get_context("spawn").Pool(3) as pool:
            names = namespace_on_each_master(local, 3, prefix="bench")
            masters = [local.master_for_key(Keys(ns).pairs) for ns in names]
            client = local.client()
            for _ in tqdm(range(repeats), desc="cluster ingest repeats", file=sys.stderr):
                for label, spaces in (("one", names[:1]), ("three", names)):
                    start_at = time.time() + 3.0  # after every producer made its pairs
                    spans = pool.starmap(_push_timed, [
                        (local.url, ns, img_dim, txt_dim, pairs + 1, chunk, seed + j, start_at)
                        for j, ns in enumerate(spaces)])
                    elapsed = max(e for _, e in spans) - min(s for s, _ in spans)
                    rates[label].append(pairs * len(spaces) / elapsed)
                    for ns in spaces:
                        client.delete(Keys(ns).pairs)
            client.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one, three = statistics.median(rates["one"]), statistics.median(rates["three"])
    return {
        "benchmark": "ingest", "cluster": True, "img_dim": img_dim, "txt_dim": txt_dim,
        "pairs_per_namespace": pairs, "client_pipeline": chunk, "repeats": repeats,
        "masters": 3, "replicas_per_master": 1, "namespaces": names,
        "namespace_masters": masters,
        "one_namespace_pairs_per_s": round(one, 1),
        "three_namespaces_pairs_per_s": round(three, 1),
        "speedup": round(three / one, 3),
        "one_namespace_runs": [round(x, 1) for x in rates["one"]],
        "three_namespaces_runs": [round(x, 1) for x in rates["three"]],
        "cores": os.cpu_count(),
    }


# -- end to end -----------------------------------------------------------------------------
def in_process_rate(model: str, data: list[Pair], eval_every: int, seed: int,
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
               eval_every: int = 10, seed: int = 0) -> dict[str, Any]:
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
        "lag_p50": _percentile([float(x) for x in lags], 50),
        "lag_p99": _percentile([float(x) for x in lags], 99), "lag_max": max(lags),
        "lag_seconds_p99": round(_percentile([float(x) for x in lags], 99) / push_rate, 3),
        "drain_seconds_after_push": round(drain, 3),
        "note": "lag = pairs ingested - pairs in the newest checkpoint (checkpoints every 0.5 s)",
    }


# -- query ----------------------------------------------------------------------------------
@dataclass
class _Answer:
    body: int  # index into the request bodies
    version: int
    lag_s: float
    ids: list[str]


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
                ) -> tuple[int, bytes]:
    """One keep-alive HTTP/1.1 exchange: status and body (the API always sends a length)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if match is None:
        raise ConnectionError("answer without content-length")
    return status, await reader.readexactly(int(match.group(1)))


def _host_port(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port or 80


def _request(url: str, path: str, content_type: str, body: bytes) -> bytes:
    """One POST as bytes on the wire, encoded once before the clock starts."""
    host, port = _host_port(url)
    return (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: {content_type}"
            f"\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


async def _post_each(url: str, requests: list[bytes], clients: int) -> float:
    """Post every request once over ``clients`` keep-alive connections (each takes the next
    one not yet sent); seconds from the first byte to the last answer. Any answer but 202
    is an error: the figure is of pairs accepted."""
    host, port = _host_port(url)
    connections = [await asyncio.open_connection(host, port) for _ in range(clients)]
    queue = iter(requests)

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for request in queue:
            status, answer = await _post(reader, writer, request)
            if status != 202:
                raise RuntimeError(f"{request[:40]!r}...: {status} {answer[:200]!r}")

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(r, w) for r, w in connections))
        return time.perf_counter() - start
    finally:
        for _, writer in connections:
            writer.close()


async def _load(url: str, bodies: list[bytes], clients: int, seconds: float
                ) -> tuple[list[float], dict[str, int], list[_Answer]]:
    """``clients`` keep-alive connections posting ``bodies`` to ``/v1/search`` in turn.

    Written on raw asyncio streams with the requests encoded once, like ``wrk``: the load
    generator shares the machine's two cores with the API and the worker, and an HTTP client
    library's per-request cost (httpx: ~3 ms of CPU) would take them from the server measured.
    """
    host, port = _host_port(url)
    requests = [_request(url, "/v1/search", "application/json", body) for body in bodies]
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    answers: list[_Answer] = []
    deadline = time.perf_counter() + seconds

    async def one(worker: int) -> None:
        i = worker
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                try:
                    status, body = await _post(reader, writer, requests[i % len(requests)])
                except (OSError, asyncio.IncompleteReadError) as exc:
                    key = type(exc).__name__
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                else:
                    key = str(status)
                    if status == 200:
                        latencies.append(time.perf_counter() - start)
                        found = json.loads(body)
                        answers.append(_Answer(i % len(bodies), int(found["version"]),
                                               float(found["version_lag_s"]),
                                               [hit["id"] for hit in found["results"]]))
                statuses[key] = statuses.get(key, 0) + 1
                i += clients
        finally:
            writer.close()

    await asyncio.gather(*(one(w) for w in range(clients)))
    return latencies, statuses, answers


def _metric_value(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def _embedded(model: CrossModalModel, modality: str, rows: NDArray[np.float32]
              ) -> NDArray[np.float64]:
    embed = model.embed_images if modality == "image" else model.embed_texts
    return np.concatenate([embed(rows[i : i + 50_000]).astype(np.float64)
                           for i in range(0, len(rows), 50_000)])


def _recall(st: Stack, model: str, answers: list[_Answer], queries: list[tuple[str, Any]],
            imgs: NDArray[np.float32], txts: NDArray[np.float32], k: int, sample: int,
            seed: int) -> float | None:
    """Mean recall@k of sampled answers against the exact ranking (ties in row order) by the
    version that served each, loaded from the store, which the benchmark tells to keep every
    version. Scores are inner products of embeddings (the models' contract: they equal the
    similarity); each version embeds the gallery once."""
    if not answers:
        return None
    store = open_store(st.settings, st.r)
    rng = np.random.default_rng(seed)
    picked = [answers[i] for i in rng.choice(len(answers), min(sample, len(answers)),
                                             replace=False)]
    picked.sort(key=lambda a: a.version)
    recalls: list[float] = []
    version, current = -1, None
    gallery_of: dict[str, NDArray[np.float64]] = {}
    for answer in tqdm(picked, desc="recall against exact rankings", file=sys.stderr):
        if answer.version != version:
            version, gallery_of = answer.version, {}
            ckpt = store.load(model, version)
            current = None
            if ckpt is not None:
                learner = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
                learner.flush()
                current = learner.model
        if current is None:
            continue
        modality, vector = queries[answer.body]
        target = "text" if modality == "image" else "image"
        if target not in gallery_of:
            gallery_of[target] = _embedded(current, target, txts if target == "text" else imgs)
        scores = gallery_of[target] @ _embedded(current, modality, vector[None, :])[0]
        exact = np.argsort(-scores, kind="stable")[:k].tolist()
        got = {int(i[1:]) for i in answer.ids}  # ids are "s<row>"
        recalls.append(len(got & set(exact)) / k)
    return round(float(np.mean(recalls)), 4) if recalls else None


def query(gallery: int = 100_000, img_dim: int = 512, txt_dim: int = 128, clients: int = 32,
          seconds: float = 30.0, k: int = 10, model: str = "cmos", recall_sample: int = 200,
          candidates: int = 100, seed: int = 0) -> dict[str, Any]:
    """``/v1/search`` under ``clients`` concurrent connections for ``seconds`` while a worker
    learns from the stream and checkpoints every 2 s; image and text queries alternate.

    The gallery is :func:`~streamxm.tools.datasets.synthetic_pairs` (non-negative rows around
    100 cluster centres, like bag-of-words histograms), so an index that relies on the items'
    structure gets the structure real features have. A gallery indexer writes the segments the
    API opens; the load starts once the API serves the whole gallery and the indexer has
    covered every pushed pair (steady state). Afterwards a second API process is started on
    the same data and timed until it serves the whole gallery (``replica_ready_s``), and a
    sample of answers is compared with the exact ranking of the version that served each
    (``recall_at_10``).
    """
    imgs, txts, classes = synthetic_arrays(gallery, img_dim, txt_dim, n_classes=100, seed=seed)
    rng = np.random.default_rng(seed + 1)
    queries: list[tuple[str, Any]] = []
    for j in range(64):
        row = int(rng.integers(gallery))
        queries.append(("image", imgs[row]) if j % 2 else ("text", txts[row]))
    bodies = [json.dumps({"model": model, "modality": m, "k": k, "vector": v.tolist()}).encode()
              for m, v in queries]
    # Checkpoints and segments on disk (the directory store): Redis then holds only the stream.
    with stack(gallery_max=gallery, checkpoint_every_seconds=2.0, checkpoint_keep=1000,
               checkpoint_store="dir", search_candidates=candidates) as st:
        client = StreamClient(st.r, NAMESPACE)
        for i in tqdm(range(0, gallery, 5000), desc="filling the gallery", file=sys.stderr):
            client.push_pairs([make_pair(f"s{j}", imgs[j], txts[j], labels=[int(classes[j])])
                               for j in range(i, min(gallery, i + 5000))])
        st.spawn("worker", "--model", model)
        st.spawn("indexer")
        url = st.api()

        def served(at: str = url) -> bool:
            response = httpx.get(f"{at}/v1/models", timeout=10)
            if response.status_code != 200:  # 503 while Redis is busy with the gallery load
                return False
            models = response.json()["models"]
            return any(m["name"] == model and m["loaded"] and m["gallery_items"] >= gallery
                       for m in models)

        wait_for(served, 900, "the API to load a model and the whole gallery")
        # Steady state: the indexer has written every pushed pair into segments (the API can
        # serve the whole gallery earlier, from the stream tail, while the indexer catches up).
        pushed = text(st.r.xinfo_stream(st.keys.pairs)["last-generated-id"])

        def indexed() -> bool:
            manifest = read_manifest(st.r, st.keys)
            return manifest is not None and entry_id_key(manifest.last_id) >= entry_id_key(pushed)

        wait_for(indexed, 900, "the gallery indexer to cover every pushed pair")
        before = st.processed(model)
        pids = {"worker": st.procs[0].pid, "indexer": st.procs[1].pid, "api": st.procs[2].pid,
                "load_generator": None}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        latencies, statuses, answers = asyncio.run(_load(url, bodies, clients, seconds))
        elapsed = time.perf_counter() - start
        cpu = {name: round((cpu_seconds(pid) - cpu_before[name]) / elapsed, 2)
               for name, pid in pids.items()}
        learned = st.processed(model) - before
        api_rss = rss_mb(st.procs[2].pid)
        exact_scans = _metric_value(httpx.get(f"{url}/metrics", timeout=30).text,
                                    "streamxm_search_exact_scans_total")
        ready_start = time.perf_counter()
        replica = st.api()
        wait_for(lambda: served(replica), 900, "a second API to load the whole gallery")
        replica_ready = time.perf_counter() - ready_start
        recall = _recall(st, model, answers, queries, imgs, txts, k, recall_sample, seed)
    ms = [x * 1000 for x in latencies]
    lags = [a.lag_s for a in answers]
    errors = sum(n for code, n in statuses.items() if code != "200")
    return {
        "benchmark": "query", "gallery": gallery, "img_dim": img_dim, "txt_dim": txt_dim,
        "model": model, "k": k, "clients": clients, "candidates": candidates,
        "seconds": round(elapsed, 2),
        "requests": len(ms), "requests_per_s": round(len(ms) / elapsed, 1),
        "p50_ms": round(_percentile(ms, 50), 2), "p90_ms": round(_percentile(ms, 90), 2),
        "p99_ms": round(_percentile(ms, 99), 2), "max_ms": round(max(ms), 2) if ms else None,
        "errors": errors, "statuses": statuses, "recall_at_10": recall,
        "served_version_lag_p99_s": round(_percentile(lags, 99), 3) if lags else None,
        "model_versions_served": len({a.version for a in answers}),
        "pairs_learned_meanwhile": learned, "api_rss_mb": round(api_rss, 1),
        "gallery_float32_mb": round(gallery * (img_dim + txt_dim) * 4 / 2**20, 1),
        "replica_ready_s": round(replica_ready, 2),
        # Cores each process used during the load (the machine has os.cpu_count() of them).
        "cores_used": cpu, "cores": os.cpu_count(),
        "api_cpu_ms_per_request": round(1000 * cpu["api"] * elapsed / max(1, len(ms)), 2),
        # Searches whose int8/bfloat16 candidates were not proven complete: a float32 scan answered.
        "exact_scans": exact_scans,
    }


def ensemble_recall(model: str = "ensemble:cmos+sdsrl", gallery: int = 20_000,
                    img_dim: int = 128, txt_dim: int = 32, queries: int = 100, k: int = 10,
                    candidates: int = 100, seed: int = 0) -> dict[str, Any]:
    """Recall@k of an ensemble's search against the exact fused ranking of the whole gallery.

    Every member learns the gallery's pairs (:func:`~streamxm.tools.datasets.synthetic_pairs`,
    100 topics) in-process from a private Redis; a :class:`ModelServer` then answers
    ``queries`` searches (image and text alternating, each a gallery item's own vector) the way
    the API does, each member proposing ``max(candidates, 4k)`` candidates; the reference is
    every gallery item scored by the same fused score (same members' versions, same reference
    sample)."""
    from streamxm.models.ensemble import parse_ensemble
    from streamxm.service import build_worker
    from streamxm.serving.served import direction_of, other_modality
    from streamxm.serving.server import ModelServer

    spec = parse_ensemble(model)
    pairs = synthetic_pairs(gallery, img_dim, txt_dim, n_classes=100, seed=seed)
    vectors = {"image": np.stack([p.img for p in pairs]),
               "text": np.stack([p.txt for p in pairs])}
    with stack(gallery_max=gallery) as st:
        StreamClient(st.r, NAMESPACE).push_pairs(pairs)
        for member in tqdm(spec.members, desc="members learning", file=sys.stderr):
            build_worker(st.settings, st.r, member).run(until_idle=True)
        server = ModelServer(st.r, open_store(st.settings, st.r), NAMESPACE,
                             gallery_max=gallery, candidates=candidates)
        while len(server.gallery) < gallery or len(server.served) < len(spec.members):
            server.refresh()
        server.reembed()  # the members' embedded indexes by their served versions
        fused = server.ensemble(model)
        rng = np.random.default_rng(seed + 1)
        recalls = []
        for j in tqdm(range(queries), desc="queries", file=sys.stderr):
            modality = "image" if j % 2 else "text"
            query = vectors[modality][int(rng.integers(gallery))]
            found = {i for i, _ in server.search(model, modality, query, k).hits}
            target = other_modality(modality)
            exact = fused.fused.scores(direction_of(modality), query[None, :], vectors[target],
                                       server.gallery.reference(target, REFERENCE_ITEMS))[0]
            best = {pairs[i].id for i in np.argsort(-exact, kind="stable")[:k]}
            recalls.append(len(found & best) / k)
    return {"benchmark": "ensemble-recall", "model": model, "gallery": gallery,
            "img_dim": img_dim, "txt_dim": txt_dim, "queries": queries, "k": k,
            "candidates_per_member": max(candidates, 4 * k),
            "recall_at_k": round(float(np.mean(recalls)), 4),
            "min_recall_at_k": round(float(np.min(recalls)), 2)}


# -- soak -----------------------------------------------------------------------------------
def _gallery_bytes(st: Stack) -> int:
    """Bytes of the gallery's live segments stored in Redis (the Redis checkpoint store)."""
    manifest = read_manifest(st.r, st.keys)
    if manifest is None:
        return 0
    return sum(int(st.r.strlen(st.keys.checkpoint_blob(SEGMENTS, ref.seq)))
               for ref in manifest.segments)


def _slope(samples: list[dict[str, float]], key: str) -> float:
    x = np.array([s["minute"] for s in samples])
    return float(np.polyfit(x, np.array([s[key] for s in samples]), 1)[0])


def soak(minutes: float = 20.0, rate: float = 100.0, qps: float = 20.0, img_dim: int = 512,
         txt_dim: int = 128, gallery_max: int = 20_000, sample_seconds: float = 60.0,
         warmup_minutes: float = 5.0, seed: int = 0) -> dict[str, Any]:
    """Push at ``rate``, query at ``qps``, learn and index; memory sampled every minute.

    Per sample: resident memory of the worker, the indexer and the API, Redis ``used_memory``,
    the stream's length and the bytes of the gallery's segments (stored in Redis here), and the
    largest stream length seen between samples (polled every 2 s). The gallery cap is reached
    after ``gallery_max / rate`` seconds; memory may grow until then by design, so slopes are
    fitted to the samples after ``warmup_minutes``.
    """
    pool = synthetic_pairs(2000, img_dim, txt_dim, seed=seed)
    stop = threading.Event()
    counts = {"pushed": 0, "queries": 0, "query_errors": 0, "stream_length_max": 0}
    samples: list[dict[str, float]] = []
    with stack(gallery_max=gallery_max, checkpoint_every_seconds=2.0) as st:
        worker = st.spawn("worker", "--model", "cmos")
        indexer = st.spawn("indexer")
        client = StreamClient(st.r, NAMESPACE)
        client.push_pairs(pool[:200])
        url = st.api()
        api = st.procs[-1]
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, 120, "ready")

        def produce() -> None:
            step, i = max(1, int(rate / 10)), 0
            start = time.perf_counter()
            while not stop.is_set():
                part = [Pair(f"s{i + j}", p.img, p.txt, p.labels) for j, p in
                        enumerate(pool[i % len(pool) : i % len(pool) + step])]
                client.push_pairs(part)
                i += len(part)
                counts["pushed"] = i
                stop.wait(max(0.0, start + i / rate - time.perf_counter()))

        def ask() -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                j = 0
                while not stop.is_set():
                    p = pool[j % len(pool)]
                    response = http.post("/v1/search", json={
                        "modality": "image", "vector": p.img.tolist(), "k": 10})
                    counts["queries"] += 1
                    counts["query_errors"] += response.status_code != 200
                    j += 1
                    stop.wait(1 / qps)

        def watch_stream() -> None:
            while not stop.wait(2.0):
                counts["stream_length_max"] = max(counts["stream_length_max"],
                                                  int(st.r.xlen(st.keys.pairs)))

        threads = [threading.Thread(target=f, daemon=True) for f in (produce, ask, watch_stream)]
        for t in threads:
            t.start()
        start = time.perf_counter()
        total = int(minutes * 60 / sample_seconds)
        for n in tqdm(range(total + 1), desc="soak samples", file=sys.stderr):
            stop.wait(max(0.0, start + n * sample_seconds - time.perf_counter()))
            used = int(st.r.info("memory")["used_memory"])
            gallery_bytes = _gallery_bytes(st)
            samples.append({"minute": round((time.perf_counter() - start) / 60, 2),
                            "worker_rss_mb": round(rss_mb(worker.pid), 1),
                            "indexer_rss_mb": round(rss_mb(indexer.pid), 1),
                            "api_rss_mb": round(rss_mb(api.pid), 1),
                            "redis_used_mb": round(used / 2**20, 1),
                            "gallery_segments_mb": round(gallery_bytes / 2**20, 1),
                            "redis_less_gallery_mb": round((used - gallery_bytes) / 2**20, 1),
                            "stream_length": int(st.r.xlen(st.keys.pairs)),
                            "pairs_learned": st.processed("cmos")})
        stop.set()
        for t in threads:
            t.join(timeout=30)
        alive = {"worker": worker.alive(), "indexer": indexer.alive(), "api": api.alive()}
    result: dict[str, Any] = {
        "benchmark": "soak", "minutes": minutes, "push_rate": rate, "qps": qps,
        "img_dim": img_dim, "txt_dim": txt_dim, "gallery_max": gallery_max,
        "warmup_minutes": warmup_minutes, **counts, "alive_at_end": alive, "samples": samples,
    }
    late = [s for s in samples if s["minute"] >= warmup_minutes]
    if len(late) >= 2:
        for key in ("worker_rss_mb", "indexer_rss_mb", "api_rss_mb", "redis_used_mb",
                    "redis_less_gallery_mb"):
            slope = _slope(late, key)
            mean = float(np.mean([s[key] for s in late]))
            name = key.removesuffix("_mb")
            result[f"{name}_slope_mb_per_min"] = round(slope, 3)
            result[f"{name}_growth_pct_per_hour"] = round(100 * slope * 60 / mean, 2)
    return result


# -- hostile bodies ---------------------------------------------------------------------------
def _junk_body(mib: float) -> bytes:
    """The body issue 17 reported: one image "vector" of strings, ``mib`` MiB long."""
    n = max(1, int(mib * (1 << 20)) // 4)
    return b'{"images":[[' + b",".join([b'"a"'] * n) + b']],"texts":[[1]]}'


def _labels_bomb(mib: float) -> bytes:
    """One message v1 frame of a valid pair whose ``labels`` field is ``1,1,1,...`` (``mib``
    MiB): it used to be split into ints before the 64-label limit applied."""
    fields = encode_pair(make_pair("bomb", [0.5] * 64, [0.5] * 32))
    fields[b"labels"] = b",".join([b"1"] * max(1, int(mib * (1 << 20)) // 2))
    return encode_frame(fields)


def _under_junk(url: str, api_pid: int, path: str, body: bytes, content_type: str,
                repeats: int) -> dict[str, Any]:
    """``repeats`` posts of ``body`` to ``path`` while a thread probes ``/healthz`` and samples
    the API's resident memory every 10 ms: statuses, answer size and time, probe latency."""
    during: list[float] = []
    peak = [rss_mb(api_pid)]
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=120) as own:
            while not done.is_set():
                start = time.perf_counter()
                own.get(f"{url}/healthz")
                during.append((time.perf_counter() - start) * 1000)
                peak.append(rss_mb(api_pid))
                done.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    seconds, sizes_out, statuses = [], [], set()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            answer = httpx.post(f"{url}{path}", content=body, timeout=120,
                                headers={"content-type": content_type})
            seconds.append(time.perf_counter() - start)
            sizes_out.append(len(answer.content))
            statuses.add(answer.status_code)
    finally:
        done.set()
        watcher.join()
    return {"status": sorted(statuses), "answer_bytes_max": max(sizes_out),
            "answer_seconds_p50": round(statistics.median(seconds), 4),
            "healthz_during_p50_ms": round(_percentile(during, 50), 2),
            "healthz_during_max_ms": round(max(during), 2) if during else None,
            "api_rss_peak_mb": round(max(peak), 1), "api_rss_after_mb": round(
                rss_mb(api_pid), 1)}


def hostile(sizes: str = "1,4,24,64", repeats: int = 3, probes: int = 200,
            seed: int = 0, labels_mib: float = 11.5) -> dict[str, Any]:
    """Junk bodies of each size (MiB) to ``POST /v1/similarity`` of a serving API, ``repeats``
    times each, while one thread probes ``/healthz``; beside the probe latency at rest in the
    same run. Then the labels bomb: one frame whose ``labels`` field is ``labels_mib`` MiB to
    ``POST /v1/pairs/frames`` (inside the default body limit). Reports the answer's status and
    size, the time to answer, the probe latency while junk is being processed, and the API's
    resident memory (peak sampled every 10 ms)."""
    mibs = [float(x) for x in sizes.split(",") if x.strip()]
    data = synthetic_pairs(500, 64, 32, seed=seed)
    with stack(checkpoint_every_seconds=0.5) as st, httpx.Client(timeout=120) as http:
        StreamClient(st.r, NAMESPACE).push_pairs(data)
        st.spawn("worker", "--model", "cmos")
        url = st.api()
        wait_for(lambda: http.get(f"{url}/readyz").status_code == 200, 120, "a model")
        api_pid = st.procs[-1].pid

        def probe_ms() -> float:
            start = time.perf_counter()
            http.get(f"{url}/healthz")
            return (time.perf_counter() - start) * 1000

        rest = [probe_ms() for _ in range(probes)]
        rss_rest = rss_mb(api_pid)
        results = [{"body_mib": mib, **_under_junk(url, api_pid, "/v1/similarity",
                                                   _junk_body(mib), "application/json",
                                                   repeats)}
                   for mib in tqdm(mibs, desc="junk bodies", file=sys.stderr)]
        bomb = _labels_bomb(labels_mib)
        labels = {"labels_mib": labels_mib, "body_bytes": len(bomb),
                  **_under_junk(url, api_pid, "/v1/pairs/frames", bomb, FRAMES_MEDIA_TYPE,
                                repeats)}
        return {"benchmark": "hostile", "max_body_bytes": st.settings.max_body_bytes,
                "healthz_rest_p50_ms": round(_percentile(rest, 50), 2),
                "healthz_rest_p99_ms": round(_percentile(rest, 99), 2),
                "api_rss_rest_mb": round(rss_rest, 1), "bodies": results,
                "labels_bomb": labels}
