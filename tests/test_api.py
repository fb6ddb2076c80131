"""End to end over real HTTP: client -> stream -> worker -> checkpoint -> API."""

import threading

import httpx
import numpy as np
import pytest
import redis
from pydantic import SecretStr

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.tools.datasets import bundled_wiki_path, iter_pairs, load_dataset
from tests.conftest import ApiServer, metric, wait_for, wait_gallery_items


@pytest.fixture
def running_worker(r: redis.Redis, settings: Settings):  # type: ignore[no-untyped-def]
    stop = threading.Event()
    worker = build_worker(settings, r, "cmos")
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    yield worker
    stop.set()
    thread.join(timeout=30)


def test_end_to_end_search_and_metrics(
    r: redis.Redis, settings: Settings, running_worker: object
) -> None:
    ds = load_dataset(bundled_wiki_path())
    pairs = list(iter_pairs(ds, limit=600))
    client = StreamProducer(r, settings.namespace)
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").status_code == 503  # no model yet
        client.push_pairs(pairs[:300])
        wait_for(lambda: http.get("/readyz").status_code == 200, 30, "a model to load")
        first = wait_for(
            lambda: metric(
                http.get("/metrics").text, "streamxm_mistakes_total", model="cmos", direction="i2t"
            ),
            30,
            "mistakes > 0",
        )
        assert first > 0
        client.push_pairs(pairs[300:])

        def caught_up() -> dict | None:  # type: ignore[type-arg]
            info = http.get("/v1/models").json()["models"][0]
            ok = info["pairs_seen"] == 600 and info["version"] == info["checkpoint_version"]
            return info if ok else None

        info = wait_for(caught_up, 30, "the API to serve the newest checkpoint")
        assert info["name"] == "cmos" and info["loaded"]
        assert info["mistakes"]["i2t"] > 0 and 0 < info["rolling_map"]["t2i"] <= 1
        text = http.get("/metrics").text
        later = metric(text, "streamxm_mistakes_total", model="cmos", direction="i2t")
        assert later is not None and later > first  # mistakes moved with the stream
        rolling = metric(text, "streamxm_rolling_map", model="cmos", direction="i2t")
        assert rolling is not None and 0 < rolling <= 1
        assert metric(text, "streamxm_pairs_ingested_total", namespace=settings.namespace) == 600
        assert metric(text, "streamxm_pairs_processed_total", model="cmos") == 600
        assert metric(text, "streamxm_stream_lag", model="cmos") == 0
        assert metric(text, "streamxm_update_duration_seconds_count", model="cmos") == 600

        # Search: an image query ranks texts of the gallery kept from the stream.
        wait_gallery_items(http, 600, "the gallery", timeout=10)
        reply = http.post(
            "/v1/search", json={"modality": "image", "vector": pairs[5].img.tolist(), "k": 7}
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["target"] == "text" and len(body["results"]) == 7
        scores = [hit["score"] for hit in body["results"]]
        assert scores == sorted(scores, reverse=True)
        # The served scores are the model's: recompute the best hit from /v1/similarity.
        best = next(p for p in pairs if p.id == body["results"][0]["id"])
        sim = http.post(
            "/v1/similarity", json={"images": [pairs[5].img.tolist()], "texts": [best.txt.tolist()]}
        ).json()
        assert sim["scores"][0] == pytest.approx(scores[0], rel=1e-4, abs=1e-6)
        reply = http.post(
            "/v1/search", json={"modality": "text", "vector": pairs[5].txt.tolist(), "k": 3}
        )
        assert reply.json()["target"] == "image" and len(reply.json()["results"]) == 3


def test_pairs_endpoint_validates_and_ingests(r: redis.Redis, settings: Settings) -> None:
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        ok = http.post(
            "/v1/pairs",
            json={
                "pairs": [
                    {"id": "a", "img": [0.1, 0.2, 0.3], "txt": [1.0, 0.0], "labels": [1]},
                    {"id": "b", "img": [0.3, 0.2, 0.1], "txt": [0.0, 1.0]},
                ]
            },
        )
        assert ok.status_code == 202 and ok.json()["accepted"] == 2
        assert r.xlen(Keys(settings.namespace).pairs) == 2
        cases = [
            ({"id": "c", "img": [0.1, 0.2], "txt": [1.0, 0.0]}, "img", "dim_mismatch"),
            ({"id": "c", "img": [0.1, 0.2, 1e39], "txt": [1.0, 0.0]}, "img", "non_finite"),
            (
                {"id": "c", "img": [0.1, 0.2, 0.3], "txt": [1.0, 0.0], "labels": [-2]},
                "labels",
                "greater_than_equal",
            ),
        ]
        for pair, field, reason in cases:
            bad = http.post("/v1/pairs", json={"pairs": [pair]})
            assert bad.status_code == 422, bad.text
            detail = bad.json()["detail"][0]
            assert field in detail["loc"] and detail["type"] == reason
        missing = http.post("/v1/pairs", json={"pairs": [{"id": "d", "img": [1.0]}]})
        assert missing.status_code == 422 and "txt" in missing.text
        assert r.xlen(Keys(settings.namespace).pairs) == 2  # nothing invalid got in
        assert (
            http.post(
                "/v1/search", json={"modality": "image", "vector": [1.0, 2.0, 3.0], "k": 5}
            ).status_code
            == 404
        )  # no model yet
        nope = http.post(
            "/v1/search", json={"model": "nope", "modality": "image", "vector": [1.0], "k": 5}
        )
        assert nope.status_code == 422 and nope.json()["detail"][0]["loc"] == ["body", "model"]


def test_write_endpoints_require_the_token(settings: Settings) -> None:
    secured = settings.model_copy(update={"api_token": SecretStr("s3cret")})
    pair = {"pairs": [{"id": "a", "img": [0.1], "txt": [1.0]}]}
    with ApiServer(secured) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        assert http.post("/v1/pairs", json=pair).status_code == 401
        assert (
            http.post("/v1/pairs", json=pair, headers={"Authorization": "Bearer wrong"}).status_code
            == 401
        )
        assert (
            http.post(
                "/v1/pairs", json=pair, headers={"Authorization": "Bearer s3cret"}
            ).status_code
            == 202
        )
        assert http.get("/v1/models").status_code == 200  # reads stay open by default


def test_api_swaps_to_a_new_checkpoint_within_a_second(
    r: redis.Redis, settings: Settings, running_worker: object
) -> None:
    rng = np.random.default_rng(0)
    client = StreamProducer(r, settings.namespace)
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        client.push_many((str(i), rng.random(5), rng.random(3), [i % 3]) for i in range(50))
        wait_for(lambda: http.get("/readyz").status_code == 200, 30, "a model")
        seen = http.get("/v1/models").json()["models"][0]["version"]
        client.push_many((f"b{i}", rng.random(5), rng.random(3), [i % 3]) for i in range(50))
        head_key = Keys(settings.namespace).checkpoint_head("cmos")
        head = wait_for(
            lambda: (lambda v: v if v and int(v) > seen else None)(r.hget(head_key, "version")),
            30,
            "a checkpoint",
        )
        wait_for(
            lambda: http.get("/v1/models").json()["models"][0]["version"] >= int(head),
            1.5,
            "the swap",
        )
