"""Issue 21's pinned versions, rollback and binary vectors: a query names a kept version (404
naming it otherwise), ``streamxm rollback`` makes a kept version the served one and the one
the learner continues from while a real worker runs, and vectors travel as base64 float32."""

from __future__ import annotations

import base64
import json
import time

import httpx
import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.service import build_worker, open_store
from streamxm.storage.checkpoint import VersionNotKept
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.stream.retention import entry_id_key
from streamxm.worker.rollback import history, rollback
from tests.conftest import (
    ApiServer,
    WorkerProcess,
    assert_same_learner,
    class_stream,
    cli_json,
    latest,
    reference,
    run_cli,
    wait_for,
    worker_env,
)


def b64(vector: np.ndarray) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _seen(settings: Settings, r: redis.Redis) -> int:
    """Pairs in the newest checkpoint (0 before the first)."""
    return 0 if open_store(settings, r).head("cmos") is None else latest(settings, r).pairs_seen


def _kept(settings: Settings, r: redis.Redis) -> list[int]:
    head = open_store(settings, r).head("cmos")
    assert head is not None
    return [v for v, _ in head["history"]]


def test_a_query_names_a_kept_version_and_gets_its_scores(
    r: redis.Redis, settings: Settings
) -> None:
    settings = settings.model_copy(update={"checkpoint_keep": 10})
    pairs = class_stream(400, 8, 4, seed=5)
    client = StreamProducer(r, settings.namespace)
    store = open_store(settings, r)
    client.push_pairs(pairs[:200])
    build_worker(settings, r, "cmos").run(until_idle=True)
    first = _kept(settings, r)[0]
    client.push_pairs(pairs[200:])
    build_worker(settings, r, "cmos").run(until_idle=True)
    newest = _kept(settings, r)[0]
    assert newest > first
    old = store.load("cmos", first)
    assert old is not None
    from streamxm.learning.stream_learner import StreamLearner

    old_model = StreamLearner.from_state(old.arrays, old.meta).model
    q = pairs[0]
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, 30, "ready")
        sim = {"images": [q.img.tolist()], "texts": [q.txt.tolist()]}
        pinned = http.post("/v1/similarity", json={**sim, "version": first}).json()
        served = http.post("/v1/similarity", json=sim).json()
        assert pinned["version"] == first and served["version"] == newest
        want = float(old_model.similarity(q.img[None, :], q.txt[None, :])[0, 0])
        assert pinned["scores"][0] == pytest.approx(want, rel=1e-6)
        assert pinned["scores"][0] != pytest.approx(served["scores"][0], rel=1e-6)
        # Search with the pinned version: its exact scores, the same as its similarity.
        found = http.post(
            "/v1/search", json={"modality": "image", "vector": b64(q.img), "k": 3, "version": first}
        ).json()
        assert found["version"] == first
        gallery = {p.id: p for p in pairs}
        for hit in found["results"]:
            item = gallery[hit["id"]]
            score = float(old_model.similarity(q.img[None, :], item.txt[None, :])[0, 0])
            assert hit["score"] == pytest.approx(score, rel=1e-5)
        # A version the store does not keep: 404 naming it and what is kept.
        gone = http.post(
            "/v1/search", json={"modality": "image", "vector": q.img.tolist(), "version": 999}
        )
        assert gone.status_code == 404 and "version 999" in gone.json()["detail"]
        assert str(newest) in gone.json()["detail"]


def test_vectors_travel_as_base64_float32_with_the_same_validation(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    pairs = class_stream(50, 8, 4, seed=6)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    build_worker(settings, r, "cmos").run(until_idle=True)
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, 30, "ready")
        before = r.xlen(keys.pairs)
        body = {
            "pairs": [
                {"id": "b1", "img": b64(pairs[0].img), "txt": b64(pairs[0].txt), "labels": [1]},
                {"id": "b2", "img": pairs[1].img.tolist(), "txt": b64(pairs[1].txt)},
            ]
        }
        answer = http.post("/v1/pairs", json=body)
        assert answer.status_code == 202, answer.text
        assert r.xlen(keys.pairs) == before + 2
        entry = r.xrange(keys.pairs, min=answer.json()["entry_ids"][0], count=1)[0][1]
        np.testing.assert_array_equal(np.frombuffer(entry[b"img"], "<f4"), pairs[0].img)
        # Same answers as with JSON numbers.
        as_json = http.post(
            "/v1/search", json={"modality": "text", "vector": pairs[2].txt.tolist()}
        ).json()
        as_b64 = http.post(
            "/v1/search", json={"modality": "text", "vector": b64(pairs[2].txt)}
        ).json()
        assert as_json["results"] == as_b64["results"]
        # Bad base64, a length that is no float32 count, NaN inside, the wrong width, too
        # long: 422 naming the field.
        nan = b64(np.array([np.nan, 1, 1, 1, 1, 1, 1, 1]))
        cases = [
            ("not base64!", "base64"),
            (base64.b64encode(b"12345").decode(), "base64_float32"),
            (nan, "non_finite"),
            (b64(np.ones(3)), "dim_mismatch"),
            (b64(np.ones(settings.max_dim + 1)), "too_large"),
        ]
        for vector, reason in cases:
            bad = http.post("/v1/search", json={"modality": "image", "vector": vector})
            assert bad.status_code == 422, (reason, bad.text)
            detail = bad.json()["detail"][0]
            assert detail["loc"][:2] == ["body", "vector"] and detail["type"] == reason
        bad = http.post(
            "/v1/pairs", json={"pairs": [{"id": "x", "img": b64(pairs[0].img), "txt": nan}]}
        )
        assert bad.status_code == 422
        assert bad.json()["detail"][0]["loc"][:4] == ["body", "pairs", 0, "txt"]
        assert r.xlen(keys.pairs) == before + 2  # nothing of a refused batch was written


@pytest.mark.slow
def test_rollback_under_a_live_worker_replays_the_stream_after_the_kept_version(
    r: redis.Redis, settings: Settings
) -> None:
    n = 1200
    keys = Keys(settings.namespace)
    pairs = class_stream(n, 8, 4, seed=7)
    env = worker_env(settings, STREAMXM_CHECKPOINT_EVERY_PAIRS="100", STREAMXM_CHECKPOINT_KEEP="20")
    settings = settings.model_copy(update={"checkpoint_keep": 20})
    client = StreamProducer(r, settings.namespace)
    client.push_pairs(pairs[:800])
    worker = WorkerProcess(env)
    try:
        wait_for(lambda: _seen(settings, r) == 800, 60, "800 pairs learned")
        kept = _kept(settings, r)
        target = kept[len(kept) // 2]  # a version in the middle of the kept ones
        store = open_store(settings, r)
        target_ckpt = store.load("cmos", target)
        assert target_ckpt is not None
        with pytest.raises(VersionNotKept, match="version 99999 is not kept"):
            rollback(r, store, keys, "cmos", 99999)
        done = cli_json("rollback", "--model", "cmos", "--to", str(target), env=env)
        assert done["to_version"] == target and done["new_version"] > kept[0]
        assert done["replay_from"] == target_ckpt.last_id
        # The rolled-back state is the newest version, at the kept version's position.
        head = store.head("cmos")
        assert head is not None and head["version"] >= done["new_version"]
        # Retention keeps the stream from the earliest kept position: the replay is there.
        assert entry_id_key(head["kept_from"]) <= entry_id_key(target_ckpt.last_id)
        # More pairs arrive; the worker (fenced, reloaded) replays and learns them all.
        client.push_pairs(pairs[800:])
        wait_for(
            lambda: (
                _seen(settings, r) == n
                and (store.head("cmos") or {}).get("version", 0) > done["new_version"]
            ),
            90,
            "the worker to replay after the rollback and learn the rest",
        )
        time.sleep(0.5)
    finally:
        assert worker.stop() == 0, worker.tail()
    # Nothing lost, nothing applied twice: the same learner as one pass over the stream.
    assert_same_learner(latest(settings, r), reference(pairs))
    events = history(r, keys, "cmos")
    assert events[0]["event"] == "rollback" and events[0]["to_version"] == target


def test_a_kept_but_corrupt_version_is_named_unreadable_counted_and_listed(
    r: redis.Redis, settings: Settings
) -> None:
    """Version V kept but its blob garbled: a query pinning it answers 404 "kept but
    unreadable" (not "not kept; kept versions: ..., V"), the corruption is counted in
    ``streamxm_checkpoint_corrupt_total``, the rollback listing names it unreadable, and a
    rollback to it exits 2 saying so."""
    from tests.conftest import metric

    settings = settings.model_copy(update={"checkpoint_keep": 10})
    pairs = class_stream(400, 8, 4, seed=6)
    client = StreamProducer(r, settings.namespace)
    keys = Keys(settings.namespace)
    for half in (pairs[:200], pairs[200:]):
        client.push_pairs(half)
        build_worker(settings, r, "cmos").run(until_idle=True)
    newest, *_, oldest = _kept(settings, r)
    r.set(keys.checkpoint_blob("cmos", oldest), b"garbage")
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, 30, "ready")
        query = {"modality": "image", "vector": pairs[0].img.tolist(), "version": oldest}
        answer = http.post("/v1/search", json=query)
        assert answer.status_code == 404
        assert f"version {oldest} is kept but unreadable (checksum mismatch)" in answer.text
        scrape = http.get("/metrics").text
    assert metric(scrape, "streamxm_checkpoint_corrupt_total", model="cmos") == 1
    env = worker_env(settings)
    listing = run_cli("rollback", "--model", "cmos", env=env, timeout=120)
    assert json.loads(listing.stdout)["unreadable"] == {str(oldest): "checksum mismatch"}
    refused = run_cli("rollback", "--model", "cmos", "--to", str(oldest), env=env, timeout=120)
    assert refused.returncode == 2 and "kept but unreadable" in refused.stderr
    assert _kept(settings, r)[0] == newest  # nothing was rolled back
