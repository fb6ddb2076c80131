"""Scenarios of the ``ray`` gallery backend, run by ``tests/test_ray_gallery.py`` inside a
network namespace that has only loopback (``unshare -rn``): a Ray cluster of two nodes on this
machine, started here, and every Ray process bound to 127.0.0.1.

``python -m tests.ray_scenarios NAME SETTINGS_JSON`` runs one and prints a JSON summary; a
failed check raises (exit status 1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np

from streamxm.config import Settings
from streamxm.models import MODEL_NAMES
from streamxm.ray_gallery import RayGallery, wait_for_shards
from streamxm.service import build_indexer, build_worker, open_store
from streamxm.serving.server import ModelServer
from streamxm.serving.shard import ShardsUnavailable
from streamxm.storage.segments import read_manifest
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import connect
from tests.conftest import ApiServer, class_stream, metric, wait_for

# Small settings of the slower models: the contract tests' own.
from tests.test_model_contract import SMALL

IMG, TXT = 12, 6
ENSEMBLE = "ensemble:sdsrl+pairwise:marginal+sam"


@contextmanager
def ray_cluster(nodes: int = 2, gpus: int = 0) -> Iterator[str]:
    """A Ray cluster of ``nodes`` nodes on 127.0.0.1, one logical CPU each and ``gpus``
    logical GPUs each (Ray's bookkeeping: torch in a shard still finds no CUDA here)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": gpus,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1, num_gpus=gpus, node_ip_address="127.0.0.1")
    try:
        yield str(cluster.address)
    finally:
        ray.shutdown()
        cluster.shutdown()


def listeners() -> list[str]:
    """Local addresses of every listening TCP socket (``ss -ltnH``)."""
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


#: The stream the scenarios push, a part at a time.
STREAM = class_stream(1200, IMG, TXT, seed=11)


def learn(settings: Settings, models: list[str], part: slice) -> None:
    """Push ``STREAM[part]`` and let a worker of each model learn every pair pushed."""
    r = connect(settings, settings.redis_url or "", retries=1, timeout=30)
    StreamProducer(r, settings.namespace).push_pairs(STREAM[part])
    for model in models:
        build_worker(settings, r, model, SMALL.get(model)).run(until_idle=True)


def queries(seed: int, n: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        ("image", rng.random(IMG).astype(np.float32))
        if i % 2
        else ("text", rng.random(TXT).astype(np.float32))
        for i in range(n)
    ]


def same_answers(local: ModelServer, sharded: ModelServer, model: str, k: int) -> int:
    """Every query's sharded answer equals the local one: ids, order, version, scores."""
    compared = 0
    for modality, vector in queries(hash(model) % 1000, 6):
        want = local.search(model, modality, vector, k)
        got = sharded.search(model, modality, vector, k)
        assert got.served.versions == want.served.versions, (model, got.served.versions)
        assert [i for i, _ in got.hits] == [i for i, _ in want.hits], (model, got.hits, want.hits)
        np.testing.assert_allclose(
            [s for _, s in got.hits], [s for _, s in want.hits], rtol=2e-6, atol=1e-6
        )
        compared += 1
    return compared


def servers(
    settings: Settings, address: str, shards: int, timeout: float = 30.0
) -> tuple[ModelServer, ModelServer]:
    r = connect(settings, settings.redis_url or "", retries=1, timeout=30)
    local = ModelServer(r, open_store(settings, r), settings.namespace)
    gallery = RayGallery(settings, settings.redis_url or "", address, shards, timeout=timeout)
    sharded = ModelServer(r, open_store(settings, r), settings.namespace, shards=gallery)
    wait_for_shards(gallery, 120)
    return local, sharded


def settle(local: ModelServer, sharded: ModelServer, rows: int) -> None:
    """Both servers hold the newest versions and ``rows`` gallery items."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        local.refresh()
        sharded.refresh()
        shard_rows = sum(s.rows for s in sharded.shards.status() if s is not None)  # type: ignore[union-attr]
        if (
            len(local.gallery) == rows
            and shard_rows == rows
            and {n: s.version for n, s in local.served.items()}
            == {n: s.version for n, s in sharded.served.items()}
        ):
            return
        time.sleep(0.2)
    raise TimeoutError("the local and sharded servers did not settle")


def answers_equal(settings: Settings) -> dict[str, Any]:
    """After each of three versions, every model's sharded answers equal the local ones. The
    gallery indexer writes segments per shard for the first two (each shard reads its own),
    the third's rows are the stream tail after them."""
    models = list(MODEL_NAMES)
    with ray_cluster() as address:
        local, sharded = servers(settings, address, 2)
        r = connect(settings, settings.redis_url or "", retries=1, timeout=30)
        indexer = build_indexer(settings.model_copy(update={"gallery_parts": 2}), r)
        compared, rows = 0, 0
        for version in range(3):
            learn(settings, models, slice(rows, rows + 120))
            rows += 120
            if version < 2:
                indexer.run(until_idle=True)
            settle(local, sharded, rows)
            for model in [*models, ENSEMBLE]:
                compared += same_answers(local, sharded, model, k=7)
        outside = [
            a for a in listeners() if not a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:"))
        ]
        assert not outside, f"listening beyond loopback: {outside}"
        statuses = sharded.shards.status()  # type: ignore[union-attr]
        sharded.stop()
        local.stop()
    manifest = read_manifest(r, Keys(settings.namespace))
    return {
        "compared": compared,
        "rows": [s.rows for s in statuses if s is not None],
        "segment_parts": sorted({(ref.part, ref.parts) for ref in manifest.segments})
        if manifest
        else [],
    }


class QueryLoad:
    """Searches of the sharded server on two threads, each answer checked against the local
    one: an answer is right, refused (:class:`ShardsUnavailable`), or wrong; a partial one must
    say it covers less than the whole gallery and hold only right hits. One thread never asks
    for a partial answer and one always does, so an outage of any length meets both."""

    def __init__(self, local: ModelServer, sharded: ModelServer, models: list[str]) -> None:
        self.sharded = sharded
        self.asked = [
            (model, modality, vector, local.search(model, modality, vector, 5).hits)
            for model in models
            for modality, vector in queries(7, 4)
        ]
        self.counts = {"right": 0, "refused": 0, "wrong": 0, "partial": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(partial,), daemon=True)
            for partial in (False, True)
        ]

    def __enter__(self) -> QueryLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _run(self, partial: bool) -> None:
        at = 0
        while not self._stop.is_set():
            model, modality, vector, want = self.asked[at % len(self.asked)]
            at += 1
            try:
                got = self.sharded.search(model, modality, vector, 5, partial=partial)
            except ShardsUnavailable:
                self._count("refused")
                continue
            if got.covered < 1.0:
                right = dict(want)
                ok = all(i in right or s <= want[-1][1] for i, s in got.hits)
                self._count("partial" if ok and got.covered > 0 else "wrong")
            elif got.hits == want or _close(got.hits, want):
                self._count("right")
            else:
                self._count("wrong")

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1


def _close(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> bool:
    return [i for i, _ in got] == [i for i, _ in want] and bool(
        np.allclose([s for _, s in got], [s for _, s in want], rtol=2e-6, atol=1e-6)
    )


def shard_killed(settings: Settings) -> dict[str, Any]:
    """A shard SIGKILLed under query load: no wrong answer and no silently partial one; Ray
    restarts it, it reads its part again and is given the served versions; then every answer
    is right again and no row is lost."""
    models = ["cmos", "sdsrl", "sam"]
    with ray_cluster() as address:
        local, sharded = servers(settings, address, 2, timeout=2.0)
        learn(settings, models, slice(0, 240))
        settle(local, sharded, 240)
        sharded.start()
        victim = sharded.shards.status()[0]  # type: ignore[union-attr]
        assert victim is not None
        with QueryLoad(local, sharded, models) as load:
            time.sleep(1.0)
            before = load.snapshot()
            killed = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            back = None
            while time.monotonic() - killed < 120:
                status = sharded.shards.status()[0]  # type: ignore[union-attr]
                if (
                    status is not None
                    and status.pid != victim.pid
                    and all(sharded.served[m].version in status.versions.get(m, []) for m in models)
                ):
                    back = time.monotonic() - killed
                    break
                time.sleep(0.1)
            assert back is not None, "the killed shard did not come back"
            time.sleep(1.0)  # a search begun before the return may still time out
            after_back = load.snapshot()
            time.sleep(2.0)
        assert load.counts["wrong"] == 0, load.counts
        assert load.counts["refused"] > before["refused"], (before, load.counts)
        assert load.counts["partial"] > before["partial"], (before, load.counts)
        assert load.counts["right"] > after_back["right"], (after_back, load.counts)
        rows = [s.rows for s in sharded.shards.status() if s is not None]  # type: ignore[union-attr]
        assert sum(rows) == 240, rows
        compared = sum(same_answers(local, sharded, m, k=7) for m in models)
        sharded.stop()
        local.stop()
    return {"counts": load.counts, "back_s": round(back, 2), "rows": rows, "compared": compared}


def http_api(settings: Settings) -> dict[str, Any]:
    """The API with ``STREAMXM_GALLERY_BACKEND=ray`` over HTTP: answers equal the local
    backend's, ``/readyz`` and ``/metrics`` name each shard, and while a killed shard is away
    a search is a 503 with ``Retry-After``, or with ``partial`` an answer covering half. The
    cluster's nodes each declare a GPU: every shard asks for one (all the cluster has)."""
    import ray

    with ray_cluster(gpus=1) as address:
        learn(settings, ["cmos"], slice(0, 200))
        r = connect(settings, settings.redis_url or "", retries=1, timeout=30)
        local = ModelServer(r, open_store(settings, r), settings.namespace)
        local.refresh()
        changes = {
            "gallery_backend": "ray",
            "ray_address": address,
            "gallery_shards": 2,
            "shard_timeout_seconds": 1.0,
        }
        with (
            ApiServer(settings.model_copy(update=changes)) as api,
            httpx.Client(base_url=api.url, timeout=30) as http,
        ):
            wait_for(lambda: _shards_up(http) == 2, 120, "two shards up")
            ready = http.get("/readyz").json()
            ready["gpus_per_shard"] = api.app.state.context.server.shards.gpus
            ready["gpus_left"] = ray.available_resources().get("GPU", 0.0)
            for modality, vector in queries(3, 6):
                got = _search(http, modality, vector)
                assert got.status_code == 200, got.text
                want = local.search("cmos", modality, vector, 5)
                assert _close([(h["id"], h["score"]) for h in got.json()["results"]], want.hits)
                assert got.json()["covered"] == 1.0
            same = {"model": "cmos", "modality": "image", "target": "image", "k": 5}
            refused = http.post("/v1/search", json={**same, "vector": [0.5] * IMG})
            assert refused.status_code == 422, refused.text  # checked before any fan-out
            scrape = http.get("/metrics").text
            assert metric(scrape, "streamxm_gallery_shard_rows", shard="0")
            shards = api.app.state.context.server.shards
            os.kill(shards.statuses[0].pid, signal.SIGKILL)
            seen: dict[str, Any] = {}
            modality, vector = queries(3, 1)[0]
            deadline = time.monotonic() + 60
            while len(seen) < 2 and time.monotonic() < deadline:
                refused = _search(http, modality, vector)
                if refused.status_code == 503:
                    seen["retry_after"] = refused.headers.get("retry-after")
                partial = _search(http, modality, vector, partial=True)
                if partial.status_code == 200 and partial.json()["covered"] < 1.0:
                    seen["covered"] = partial.json()["covered"]
            wait_for(lambda: _search(http, modality, vector).status_code == 200, 120, "back")
    return {"ready": ready, "seen": seen}


def _shards_up(http: httpx.Client) -> int:
    ready = http.get("/readyz")
    shards = ready.json().get("shards") or [] if ready.status_code == 200 else []
    return sum(1 for s in shards if s["up"])


def _search(
    http: httpx.Client, modality: str, vector: np.ndarray, partial: bool = False
) -> httpx.Response:
    body = {"model": "cmos", "modality": modality, "vector": vector.tolist(), "k": 5}
    return http.post("/v1/search", json={**body, "partial": partial})


SCENARIOS: dict[str, Callable[[Settings], dict[str, Any]]] = {
    "answers_equal": answers_equal,
    "shard_killed": shard_killed,
    "http_api": http_api,
}


def main() -> None:
    name, settings_json = sys.argv[1], sys.argv[2]
    settings = Settings.model_validate_json(settings_json)
    print(json.dumps(SCENARIOS[name](settings)))


if __name__ == "__main__":
    main()
