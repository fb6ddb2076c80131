"""``streamxm bench ingest``: pairs/s through the Python client (pipelined ``XADD``) and
through ``POST /v1/pairs`` and ``/v1/pairs/frames``, beside ``redis-benchmark``'s ``XADD`` rate
for entries of the same size on the same server; ``ingest_cluster`` the same on a Redis
Cluster."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from streamxm.config import Settings
from streamxm.stream.keys import Keys
from streamxm.stream.messages import (
    FRAMES_MEDIA_TYPE,
    Pair,
    encode_frames,
)
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import connect
from streamxm.tools.datasets import synthetic_pairs
from streamxm.tools.rawhttp import post_each, raw_request
from streamxm.tools.stack import NAMESPACE, Stack, pair_json, stack

__all__ = ["ingest", "ingest_cluster"]


# -- ingest ---------------------------------------------------------------------------------
def _redis_benchmark(st: Stack, img_dim: int, txt_dim: int, n: int, pipeline: int) -> float | None:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    # Entries of the same shape and size as message v1 (bytes as printable filler).
    args = [
        binary,
        "-s",
        str(st.redis_server.socket),
        "-n",
        str(n),
        "-c",
        "1",
        "-P",
        str(pipeline),
        "-q",
        "XADD",
        "sxm:bench:redis-benchmark",
        "*",
        "v",
        "1",
        "id",
        "rb-__rand_int__",
        "img",
        "x" * (4 * img_dim),
        "txt",
        "x" * (4 * txt_dim),
        "labels",
        "1",
    ]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    st.r.delete("sxm:bench:redis-benchmark")
    rates = re.findall(r"([\d.]+) requests per second", out)
    return float(rates[-1]) if rates else None


def ingest(
    img_dim: int = 4096,
    txt_dim: int = 1000,
    pairs: int = 6000,
    http_batch: int = 64,
    chunk: int = 500,
    repeats: int = 5,
    seed: int = 0,
    cluster: bool = False,
    http_clients: int = 4,
) -> dict[str, Any]:
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
    paths = _request_bodies(batches)
    with stack() as st:
        posts = _Posts(st, paths, http_clients, pairs)
        client_rates, http_rates, rb_rates = _ingest_role_rates(
            st, posts, data, (img_dim, txt_dim), chunk, repeats
        )
        # The default role: the same API also keeps the search gallery, reading every pair back.
        url = st.api()
        posts.rate(url, "frames")
        replica_rates = [
            posts.rate(url, "frames")
            for _ in tqdm(range(repeats), desc="search replica repeats", file=sys.stderr)
        ]
    client_rate = statistics.median(client_rates)
    median = {name: statistics.median(rates) for name, rates in http_rates.items()}
    result: dict[str, Any] = {
        "benchmark": "ingest",
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "pairs": pairs,
        "entry_bytes": 4 * (img_dim + txt_dim),
        "client_pipeline": chunk,
        "http_batch": http_batch,
        "http_clients": http_clients,
        "repeats": repeats,
        "client_pairs_per_s": round(client_rate, 1),
        "http_pairs_per_s": round(median["json"], 1),
        "http_base64_pairs_per_s": round(median["base64"], 1),
        "http_binary_pairs_per_s": round(median["frames"], 1),
        "http_binary_to_client": round(median["frames"] / client_rate, 3),
        "api_role": "ingest",
        "search_replica_binary_pairs_per_s": round(statistics.median(replica_rates), 1),
        "search_replica_binary_to_client": round(statistics.median(replica_rates) / client_rate, 3),
        "client_runs": [round(x, 1) for x in client_rates],
        "http_runs": [round(x, 1) for x in http_rates["json"]],
        "http_base64_runs": [round(x, 1) for x in http_rates["base64"]],
        "http_binary_runs": [round(x, 1) for x in http_rates["frames"]],
        "search_replica_binary_runs": [round(x, 1) for x in replica_rates],
    }
    result.update(_beside_redis_benchmark(rb_rates, client_rate, median))
    return result


def _request_bodies(batches: list[list[Pair]]) -> dict[str, tuple[str, str, list[bytes]]]:
    """Each HTTP path's name: its route, media type and the bodies of ``batches``. Encoded up
    front: the figure is the API's rate, not this process's encoder."""
    json_type, frames_type = "application/json", FRAMES_MEDIA_TYPE
    return {
        "json": (
            "/v1/pairs",
            json_type,
            [json.dumps({"pairs": [pair_json(p) for p in b]}).encode() for b in batches],
        ),
        "base64": (
            "/v1/pairs",
            json_type,
            [json.dumps({"pairs": [pair_json(p, True) for p in b]}).encode() for b in batches],
        ),
        "frames": ("/v1/pairs/frames", frames_type, [encode_frames(b) for b in batches]),
    }


class _Posts:
    """Posts a path's bodies to an API, ``clients`` connections at once, and empties the
    stream after them."""

    def __init__(
        self,
        st: Stack,
        paths: dict[str, tuple[str, str, list[bytes]]],
        clients: int,
        pairs: int,
    ) -> None:
        self.st, self.paths, self.clients, self.pairs = st, paths, clients, pairs

    def rate(self, url: str, name: str) -> float:
        """Pairs/s of the bodies of path ``name`` posted to the API at ``url``."""
        path, media, bodies = self.paths[name]
        seconds = asyncio.run(
            post_each(url, [raw_request(url, path, media, body) for body in bodies], self.clients)
        )
        self.st.r.delete(self.st.keys.pairs)
        return self.pairs / seconds


def _ingest_role_rates(
    st: Stack,
    posts: _Posts,
    data: list[Pair],
    dims: tuple[int, int],
    chunk: int,
    repeats: int,
) -> tuple[list[float], dict[str, list[float]], list[float]]:
    """Each repeat's pairs/s of the client, of each HTTP path into an ingest replica and of
    ``redis-benchmark`` for entries of the pairs' ``dims`` (when installed); the replica is
    stopped after them."""
    (img_dim, txt_dim), pairs = dims, posts.pairs
    client_rates: list[float] = []
    rb_rates: list[float] = []
    http_rates: dict[str, list[float]] = {name: [] for name in posts.paths}
    # An ingest replica: no search gallery reading every pair back during any of these.
    url = st.api(STREAMXM_API_ROLE="ingest")
    client = StreamProducer(st.r, NAMESPACE)
    # One untimed round first: Redis's first round of entries (page faults, allocator
    # growth) would otherwise land on whichever path runs first, the client.
    client.push_pairs(data, chunk=chunk)
    st.r.delete(st.keys.pairs)
    for name in posts.paths:
        posts.rate(url, name)
    for _ in tqdm(range(repeats), desc="ingest repeats", file=sys.stderr):
        start = time.perf_counter()
        client.push_pairs(data, chunk=chunk)
        client_rates.append(pairs / (time.perf_counter() - start))
        st.r.delete(st.keys.pairs)
        for name in posts.paths:
            http_rates[name].append(posts.rate(url, name))
        rate = _redis_benchmark(st, img_dim, txt_dim, max(pairs, 5000), chunk)
        if rate is not None:
            rb_rates.append(rate)
    st.procs.pop().stop(timeout=30)
    return client_rates, http_rates, rb_rates


def _beside_redis_benchmark(
    rb_rates: list[float], client_rate: float, http: dict[str, float]
) -> dict[str, Any]:
    """The reference: ``redis-benchmark``'s XADD rate for the same entries, and each path's
    ratio to it."""
    if not rb_rates:
        return {
            "redis_benchmark_xadd_per_s": None,
            "note": "redis-benchmark not found (Debian: apt-get install redis-tools)",
        }
    rb = statistics.median(rb_rates)
    return {
        "redis_benchmark_xadd_per_s": round(rb, 1),
        "redis_benchmark_runs": [round(x, 1) for x in rb_rates],
        "client_ratio": round(round(client_rate, 1) / rb, 3),
        "http_ratio": round(http["json"] / rb, 3),
        "http_binary_ratio": round(http["frames"] / rb, 3),
    }


def _push_timed(
    url: str,
    namespace: str,
    img_dim: int,
    txt_dim: int,
    pairs: int,
    chunk: int,
    seed: int,
    start_at: float,
) -> tuple[float, float]:
    """In a producer process: make the pairs, wait for ``start_at`` (wall clock, so that the
    producers of one round start together), push them; returns (start, end)."""
    data = synthetic_pairs(pairs, img_dim, txt_dim, seed=seed)
    client = StreamProducer(
        connect(
            Settings(
                _env_file=None,
                redis_url=url,  # type: ignore[call-arg]
                namespace=namespace,
            )
        ),
        namespace,
    )
    client.push_pairs(data[:1])  # the connections and the namespace's schema, untimed
    time.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    client.push_pairs(data[1:], chunk=chunk)
    return start, time.time()


def ingest_cluster(
    img_dim: int = 4096,
    txt_dim: int = 1000,
    pairs: int = 2000,
    chunk: int = 500,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
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
        with LocalCluster(root) as local, multiprocessing.get_context("spawn").Pool(3) as pool:
            names = namespace_on_each_master(local, 3, prefix="bench")
            masters = [local.master_for_key(Keys(ns).pairs) for ns in names]
            client = local.client()
            for _ in tqdm(range(repeats), desc="cluster ingest repeats", file=sys.stderr):
                for label, spaces in (("one", names[:1]), ("three", names)):
                    start_at = time.time() + 3.0  # after every producer made its pairs
                    spans = pool.starmap(
                        _push_timed,
                        [
                            (local.url, ns, img_dim, txt_dim, pairs + 1, chunk, seed + j, start_at)
                            for j, ns in enumerate(spaces)
                        ],
                    )
                    elapsed = max(e for _, e in spans) - min(s for s, _ in spans)
                    rates[label].append(pairs * len(spaces) / elapsed)
                    for ns in spaces:
                        client.delete(Keys(ns).pairs)
            client.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one, three = statistics.median(rates["one"]), statistics.median(rates["three"])
    return {
        "benchmark": "ingest",
        "cluster": True,
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "pairs_per_namespace": pairs,
        "client_pipeline": chunk,
        "repeats": repeats,
        "masters": 3,
        "replicas_per_master": 1,
        "namespaces": names,
        "namespace_masters": masters,
        "one_namespace_pairs_per_s": round(one, 1),
        "three_namespaces_pairs_per_s": round(three, 1),
        "speedup": round(three / one, 3),
        "one_namespace_runs": [round(x, 1) for x in rates["one"]],
        "three_namespaces_runs": [round(x, 1) for x in rates["three"]],
        "cores": os.cpu_count(),
    }
