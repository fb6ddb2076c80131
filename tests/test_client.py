"""The Python client against the real API, a real Redis and a real worker."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from pydantic import SecretStr

from streamxm.client import (
    AsyncClient,
    Client,
    InvalidPair,
    NotFound,
    Retries,
    Unauthorized,
    Unavailable,
)
from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.keys import Keys
from streamxm.stream.messages import make_pair
from streamxm.stream.redis_conn import EmbeddedRedis
from tests.conftest import PY, ApiServer, metric, wait_for

FAST = Retries(attempts=3, backoff=0.01, max_backoff=0.05)
README = Path(__file__).resolve().parents[1] / "README.md"


def _pairs(
    n: int, start: int = 0, img: int = 128, txt: int = 10, seed: int = 0
) -> list[tuple[str, np.ndarray, np.ndarray, list[int]]]:
    rng = np.random.default_rng(seed)
    return [(f"p{start + i}", rng.random(img), rng.random(txt), [i % 3]) for i in range(n)]


def _requests(api: ApiServer, route: str, status: str, method: str = "POST") -> float:
    text = httpx.get(f"{api.url}/metrics").text
    return metric(text, "streamxm_requests_total", route=route, method=method, status=status) or 0.0


@pytest.fixture
def worker(r: redis.Redis, settings: Settings) -> Iterator[None]:
    stop = threading.Event()
    learner = build_worker(settings, r, "cmos")
    thread = threading.Thread(target=learner.run, args=(stop,), daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(timeout=30)


def test_push_binary_and_json_in_batches_that_fit_the_server(
    r: redis.Redis, settings: Settings
) -> None:
    settings = settings.model_copy(update={"max_batch": 16})
    with ApiServer(settings) as api, Client(api.url) as client:
        assert client.limits().max_batch == 16
        ids = client.push(_pairs(40))  # frames: 16 + 16 + 8
        ids += client.push(_pairs(20, start=40), binary=False)  # JSON: 16 + 4
        assert _requests(api, "/v1/pairs/frames", "202") == 3
        assert _requests(api, "/v1/pairs", "202") == 2
    entries = r.xrange(Keys(settings.namespace).pairs)
    assert [e[0].decode() for e in entries] == ids
    assert [e[1][b"id"].decode() for e in entries] == [f"p{i}" for i in range(60)]
    assert entries[3][1][b"img"] == make_pair(*_pairs(4)[3]).img.tobytes()


@pytest.mark.parametrize("binary", [True, False])
def test_a_pair_the_server_refuses_is_named_by_its_position(
    settings: Settings, binary: bool
) -> None:
    settings = settings.model_copy(update={"max_batch": 16})
    pairs = _pairs(30)
    pairs[20] = ("p20", np.ones(64), np.ones(10), [1])  # the namespace's images are 128-d
    with ApiServer(settings) as api, Client(api.url) as client:
        with pytest.raises(InvalidPair) as caught:
            client.push(pairs, binary=binary)
        assert caught.value.status == 422 and caught.value.reason == "dim_mismatch"
        assert caught.value.index == 20 and caught.value.path == ["pairs", 20, "img"]
        assert len(caught.value.accepted) == 16  # the first batch landed; the second did not
        # Invalid before anything is sent: NaN, with its position.
        with pytest.raises(InvalidPair, match=r"pairs\[2\]\.txt") as local:
            client.push([*_pairs(2), ("x", np.ones(128), [np.nan] * 10)])
        assert local.value.status is None and local.value.reason == "non_finite"


def test_search_similarity_and_models_from_the_served_model(
    settings: Settings, worker: None
) -> None:
    settings = settings.model_copy(update={"max_batch": 16})
    with ApiServer(settings) as api, Client(api.url) as client:
        assert client.health() and not client.ready().ready
        client.push(_pairs(300))
        wait_for(lambda: client.ready().ready, 30, "a model to load")

        def settled() -> bool:  # the gallery and the served version hold every pair
            (m,) = client.models()
            return m.pairs_seen == 300 == m.gallery_items and m.version == m.checkpoint_version

        wait_for(settled, 30, "the API to serve every pair")
        query = np.random.default_rng(1).random(128).astype(np.float32)
        hits = client.search(query, modality="image", k=5)
        raw = httpx.post(
            f"{api.url}/v1/search",
            json={"modality": "image", "vector": query.tolist(), "k": 5, "version": hits.version},
        ).json()
        assert hits.model == "cmos" and hits.version is not None and hits.target == "text"
        assert hits.ids == [h["id"] for h in raw["results"]] and len(hits.ids) == 5
        np.testing.assert_allclose(hits.scores, [h["score"] for h in raw["results"]], rtol=1e-6)
        # 40 x 30 in blocks of at most 16 vectors a side, all by one version.
        rng = np.random.default_rng(2)
        images, texts = rng.random((40, 128)), rng.random((30, 10))
        whole = client.similarity(images, texts, mode="matrix")
        assert whole.scores.shape == (40, 30) and whole.version is not None
        block = httpx.post(
            f"{api.url}/v1/similarity",
            json={
                "images": images[16:24].tolist(),
                "texts": texts[8:16].tolist(),
                "mode": "matrix",
                "version": whole.version,
            },
        ).json()
        np.testing.assert_allclose(whole.scores[16:24, 8:16], block["scores"], rtol=1e-6)
        paired = client.similarity(images[:30], texts, version=whole.version)
        np.testing.assert_allclose(paired.scores, np.diag(whole.scores[:30]), rtol=1e-6)
        (info,) = client.models()
        assert info.name == "cmos" and info.pairs_seen > 0 and info.loaded


def test_async_client_pushes_and_searches(settings: Settings, worker: None) -> None:
    async def run(url: str) -> tuple[int, list[str]]:
        async with AsyncClient(url) as client:
            ids = await client.push(_pairs(200), binary=False)
            while not (await client.ready()).ready:
                await asyncio.sleep(0.1)
            hits = await client.search(np.ones(10), modality="text", k=3)
            return len(ids), hits.ids

    with ApiServer(settings) as api:
        pushed, found = asyncio.run(asyncio.wait_for(run(api.url), 60))
    assert pushed == 200 and len(found) == 3


def test_503s_are_retried_then_raised_and_a_push_only_when_nothing_was_written(
    tmp_path: Path, settings: Settings
) -> None:
    server = EmbeddedRedis(tmp_path / "own-redis")
    url = server.start()
    own = settings.model_copy(update={"redis_url": url, "redis_request_timeout_seconds": 1.0})
    try:
        with ApiServer(own) as api, Client(api.url, retries=FAST) as client:
            client.push(_pairs(2))
            server.stop()
            with pytest.raises(Unavailable) as caught:
                client.push(_pairs(2, start=2))
            assert caught.value.written is False and "nothing was written" in str(caught.value)
            assert _requests(api, "/v1/pairs/frames", "503") == 3  # retried: no duplicate
            with pytest.raises(Unavailable, match="stream store unavailable") as read:
                client.models()  # a read: retried whatever the 503
            assert read.value.status == 503
            assert _requests(api, "/v1/models", "503", method="GET") == 3
    finally:
        server.stop()
    # Written to the master, not acknowledged by the replica asked for: not retried.
    waiting = settings.model_copy(update={"redis_wait_replicas": 1, "redis_wait_timeout_ms": 50})
    with ApiServer(waiting) as api, Client(api.url, retries=FAST) as client:
        with pytest.raises(Unavailable) as caught:
            client.push(_pairs(2))
        assert caught.value.written is None and "twice" in str(caught.value)
        assert _requests(api, "/v1/pairs/frames", "503") == 1


def test_a_role_404_and_a_missing_token_are_raised_with_the_servers_message(
    settings: Settings,
) -> None:
    ingest = settings.model_copy(update={"api_role": "ingest"})
    with ApiServer(ingest) as api, Client(api.url, retries=FAST) as client:
        assert client.ready().ready and client.limits().role == "ingest"
        with pytest.raises(NotFound, match="serves ingest only") as caught:
            client.search(np.ones(128))
        assert caught.value.status == 404
    guarded = settings.model_copy(update={"api_token": SecretStr("s3cret")})
    with ApiServer(guarded) as api:
        with Client(api.url) as client, pytest.raises(Unauthorized):
            client.push(_pairs(1))
        with Client(api.url, token="s3cret") as client:
            assert len(client.push(_pairs(1))) == 1


def test_the_readme_example_runs_as_written(settings: Settings, worker: None) -> None:
    text = README.read_text()
    example = re.search(r"<!-- client example -->\n```python\n(.*?)```", text, re.S)
    assert example, "the README's client example is marked <!-- client example -->"
    with ApiServer(settings) as api:
        code = example.group(1).replace("http://127.0.0.1:8000", api.url)
        scope: dict[str, object] = {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, str(README), "exec"), scope)
    hits = scope["hits"]
    assert len(hits.ids) == 5  # type: ignore[attr-defined]
    # The model it prints has learned every pair it pushed, and the search came from a version
    # that had: the query's own class ranks first (pair ids i with i % 5 == 3).
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("cmos ") and lines[1].startswith("cmos 500 "), lines
    assert all(int(i.split("-")[1]) % 5 == 3 for i in hits.ids), hits.ids  # type: ignore[attr-defined]
    shown = re.search(r"It prints.*?\n```\n(.*?)```", text, re.S)
    assert shown, "the README shows what the example prints"
    assert [line.split()[0] for line in shown.group(1).splitlines()] == ["cmos", "cmos"]
    assert shown.group(1).splitlines()[1].startswith("cmos 500 ")


def test_streamxm_push_url_goes_through_the_api(r: redis.Redis, settings: Settings) -> None:
    guarded = settings.model_copy(update={"api_token": SecretStr("s3cret")})
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMXM_")}
    with ApiServer(guarded) as api:
        refused = subprocess.run(
            [*PY, "push", "--dataset", "wiki", "--limit", "50", "--url", api.url],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2 and "401" in refused.stderr
        done = subprocess.run(
            [
                *PY,
                "push",
                "--dataset",
                "wiki",
                "--limit",
                "50",
                "--url",
                api.url,
                "--token",
                "s3cret",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert _requests(api, "/v1/pairs/frames", "202") == 1
    assert r.xlen(Keys(settings.namespace).pairs) == 50
