"""Faults against real processes and real Redis servers: SIGKILLed workers (also in the middle
of a checkpoint write), a SIGKILLed Redis restarted from its AOF, an API restarted under query
load, a dead consumer's entries reclaimed by the survivor, corrupt checkpoints."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.storage.checkpoint import RedisCheckpointStore
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair, decode_pair
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import EmbeddedRedis, connect
from tests.conftest import (
    IMG,
    PY,
    TXT,
    ApiServer,
    WorkerProcess,
    assert_same_learner,
    checkpoints_every,
    class_stream,
    free_port,
    frozen_worker,
    kill_at_progress,
    last_worker,
    latest,
    local_settings,
    processed,
    push_slowly,
    reference,
    stats,
    wait_for,
    worker_env,
)

pytestmark = pytest.mark.slow  # real processes and fault windows: minutes


# (kind, fail points to kill at): the directory store has two windows inside a checkpoint
# write (half a file on disk; file and head on disk, acknowledgements not yet committed), the
# Redis store one (transaction built, not sent).
@pytest.mark.parametrize(
    "kind,fail_points",
    [
        ("dir", ["checkpoint.partial_write", "checkpoint.before_commit"]),
        ("redis", ["checkpoint.before_exec", "checkpoint.before_exec"]),
    ],
)
def test_sigkill_at_random_points_applies_every_pair_exactly_once(
    kind: str, fail_points: list[str], r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    n = 4000
    keys = Keys(settings.namespace)
    pairs = class_stream(n, IMG, TXT, seed=3)
    ckpt_dir = tmp_path / "ckpt"
    env = worker_env(
        settings,
        STREAMXM_CHECKPOINT_EVERY_PAIRS="97",
        STREAMXM_READ_BATCH="40",
        STREAMXM_CHECKPOINT_STORE=kind,
        STREAMXM_CHECKPOINT_DIR=str(ckpt_dir),
    )
    producer = push_slowly(StreamProducer(r, settings.namespace), pairs)
    rng = np.random.default_rng(11)
    thresholds = sorted(int(t) for t in rng.choice(np.arange(200, n - 400), 4, replace=False))
    # Kills at random stream positions (plus a random delay, so mid-batch) with the two
    # fail-point kills between them.
    plan: list[tuple[str, Any]] = [
        ("pairs", thresholds[0]),
        ("fail", fail_points[0]),
        ("pairs", thresholds[1]),
        ("pairs", thresholds[2]),
        ("fail", fail_points[1]),
        ("pairs", thresholds[3]),
    ]
    kills = 0
    for what, arg in plan:
        if what == "fail":
            worker = frozen_worker(env, arg, f"fail point {arg}")
            if arg == "checkpoint.partial_write":
                assert list(ckpt_dir.rglob("*.tmp")), "no half-written checkpoint on disk"
            worker.kill()
        else:
            kill_at_progress(env, r, keys, arg, rng, 0.3, f"{arg} pairs")
        kills += 1
    producer.join(timeout=120)
    with last_worker(env, r, keys, n):
        wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
    assert kills >= 6
    settings_kind = settings.model_copy(
        update={"checkpoint_store": kind, "checkpoint_dir": ckpt_dir}
    )
    restored = latest(settings_kind, r)
    assert restored.pairs_seen == n
    assert_same_learner(restored, reference(pairs))


def test_survivor_reclaims_the_pending_entries_of_a_killed_worker(
    r: redis.Redis, settings: Settings
) -> None:
    n = 2500
    keys = Keys(settings.namespace)
    pairs = class_stream(n, IMG, TXT, seed=4)
    env = worker_env(
        settings,
        STREAMXM_CHECKPOINT_EVERY_PAIRS="500",
        STREAMXM_CHECKPOINT_EVERY_SECONDS="2",
        STREAMXM_READ_BATCH="40",
    )
    producer = push_slowly(StreamProducer(r, settings.namespace), pairs)
    workers = {name: WorkerProcess({**env, "STREAMXM_CONSUMER": name}) for name in ("a", "b")}
    try:
        leader = wait_for(lambda: r.get(keys.lease("cmos")), 60, "a leader").decode()
        survivor = "b" if leader == "a" else "a"

        def leader_pending() -> int:
            summary = r.xpending(keys.pairs, "cmos")
            return int(
                dict(
                    (c["name"].decode(), c["pending"])  # type: ignore[misc]
                    for c in summary["consumers"]
                ).get(leader, 0)
            )

        wait_for(
            lambda: processed(r, keys) > 0 and leader_pending() >= 100,
            60,
            "the leader to hold unacknowledged entries",
        )
        workers[leader].kill()
        orphaned = leader_pending()
        assert orphaned > 0
        producer.join(timeout=120)
        wait_for(lambda: processed(r, keys) == n, 120, "all pairs by the survivor")
        wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
        assert r.get(keys.lease("cmos")) == survivor.encode()
        assert workers[survivor].alive()
    finally:
        for w in workers.values():
            if w.alive():
                w.stop()
    assert stats(r, keys)["consumer"] == survivor
    assert_same_learner(latest(settings, r), reference(pairs))


def _stream_pairs(r: redis.Redis, keys: Keys) -> list[Pair]:
    return [decode_pair(fields) for _, fields in r.xrange(keys.pairs)]  # type: ignore[union-attr]


def test_redis_killed_and_restarted_loses_no_acknowledged_pair(
    tmp_path: Path, namespace: str
) -> None:
    # AOF with an fsync per write: under everysec a slow disk lets Redis postpone the write
    # behind its acknowledgement (docs/scaling.md), and the test asserts nothing is lost.
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always")
    url = server.start()
    settings = local_settings(url, namespace, tmp_path, lease_ttl_ms=3000)
    keys = Keys(namespace)
    r = connect(settings)
    n = 3000
    pairs = class_stream(n, IMG, TXT, seed=5)
    acknowledged: list[str] = []
    errors: list[BaseException] = []

    def produce() -> None:
        client = StreamProducer(connect(settings), namespace)  # retries with backoff
        try:
            for start in range(0, n, 50):
                part = pairs[start : start + 50]
                client.push_pairs(part)
                acknowledged.extend(p.id for p in part)
                time.sleep(0.01)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    worker = WorkerProcess(worker_env(settings, STREAMXM_LEASE_TTL_MS="3000"))
    producer = threading.Thread(target=produce)
    producer.start()
    try:
        with ApiServer(settings) as api:
            for mark in (800, 1800):
                wait_for(lambda m=mark: len(acknowledged) >= m, 60, f"{mark} pushes")
                pid = int((server.data_dir / "redis.pid").read_text())
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda s=server: not s.is_running(), 10, "redis to die")
                time.sleep(0.5)  # everyone sees connection errors meanwhile
                server = EmbeddedRedis(tmp_path / "redis", appendfsync="always")
                server.start()
            producer.join(timeout=120)
            assert not errors, errors
            assert len(acknowledged) == n
            xlen = wait_for(lambda: r.xlen(keys.pairs), 10, "the stream")
            wait_for(lambda: processed(r, keys) == xlen, 120, "every stream entry learned")
            wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
            assert worker.alive(), "the worker died"
            # The API reconnected too: it serves the newest version.
            version = int(stats(r, keys)["version"])
            wait_for(
                lambda: httpx.get(f"{api.url}/v1/models").json()["models"][0]["version"] == version,
                30,
                "the API to serve the newest checkpoint",
            )
            search = httpx.post(
                f"{api.url}/v1/search",
                json={"modality": "image", "vector": pairs[0].img.tolist(), "k": 3},
            )
            assert search.status_code == 200, search.text
        stream = _stream_pairs(r, keys)
        # Every acknowledged pair is in the stream (a retried push may add one twice).
        assert set(acknowledged) <= {p.id for p in stream}
        assert worker.stop() == 0
        assert any("Redis unavailable" in line for line in worker.lines)
        # Learned exactly once per stream entry: the uninterrupted run over the same stream.
        assert_same_learner(latest(settings, r), reference(stream))
    finally:
        if worker.alive():
            worker.kill()
        server.stop()


def test_api_restarted_under_query_load_is_ready_only_with_a_model(
    r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    keys = Keys(settings.namespace)
    pairs = class_stream(600, IMG, TXT, seed=6)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    r.sadd(keys.models, "cmos")  # a worker registered, no checkpoint yet
    port = free_port()
    env = worker_env(settings, STREAMXM_API_PORT=str(port))
    base = f"http://127.0.0.1:{port}"
    results: list[tuple[str, int | str]] = []
    timed: list[tuple[float, float, str, int | str]] = []  # (sent, answered, path, status)
    bodies: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                for path, body in (
                    ("/readyz", None),
                    ("/v1/search", {"modality": "text", "vector": pairs[1].txt.tolist(), "k": 5}),
                ):
                    sent = time.monotonic()
                    status: int | str
                    try:
                        resp = (
                            client.get(base + path)
                            if body is None
                            else client.post(base + path, json=body)
                        )
                        status = resp.status_code
                        if status not in (200, 503):
                            bodies.append(resp.text)
                    except httpx.TransportError:
                        status = "down"
                    timed.append((sent, time.monotonic(), path, status))
                    results.append((path, status))
                time.sleep(0.005)

    def start_api() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*PY, "api"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    loaders = [threading.Thread(target=load) for _ in range(4)]
    for t in loaders:
        t.start()
    api = start_api()
    try:
        # Up but no model: not ready, and queries say why with a 503.
        wait_for(lambda: ("/readyz", 503) in results, 60, "the API to answer not-ready")
        assert ("/v1/search", 200) not in results
        build_worker(settings, r, "cmos").run(until_idle=True)
        wait_for(lambda: ("/v1/search", 200) in results, 30, "the API to serve the model")
        api.send_signal(signal.SIGKILL)  # under load
        api.wait()
        mark = len(results)
        wait_for(lambda: ("/v1/search", "down") in results[mark:], 10, "queries to fail")
        api = start_api()
        restarted = time.monotonic()
        wait_for(lambda: ("/v1/search", 200) in results[mark:], 60, "serving after restart")
        time.sleep(0.3)
    finally:
        stop.set()
        for t in loaders:
            t.join()
        api.send_signal(signal.SIGTERM)
        api.wait(timeout=30)
    statuses = {status for _, status in results}
    assert statuses <= {200, 503, "down"}, bodies[:3]
    # Once ready, every query is served: a search sent after the restarted API's first 200 was
    # answered is answered 200. (Sending times, not list order: threads record out of order.)
    searches = [
        (sent, answered, status)
        for sent, answered, path, status in timed
        if path == "/v1/search" and sent > restarted
    ]
    first_ok = min(answered for _, answered, status in searches if status == 200)
    late = [status for sent, _, status in searches if sent > first_ok and status != 200]
    assert not late, late[:5]


def test_corrupt_checkpoint_falls_back_replays_and_counts(
    r: redis.Redis, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(settings.namespace)
    pairs = class_stream(900, IMG, TXT, seed=7)
    client = StreamProducer(r, settings.namespace)
    client.push_pairs(pairs[:600])
    every = checkpoints_every(settings, 150, read_batch=50, checkpoint_every_seconds=60.0)
    build_worker(every, r, "cmos").run(until_idle=True)
    store = RedisCheckpointStore(r, keys)
    head = store.head("cmos")
    assert head is not None and head["version"] >= 3
    newest = head["version"]
    blob = r.get(keys.checkpoint_blob("cmos", newest))
    assert isinstance(blob, bytes)
    r.set(keys.checkpoint_blob("cmos", newest), blob[: len(blob) // 2])  # truncated
    # The API serves the previous good version and counts the bad one.
    with ApiServer(settings) as api:
        api.wait_ready()
        served = httpx.get(f"{api.url}/v1/models").json()["models"][0]["version"]
        assert served == newest - 1
        metrics = httpx.get(f"{api.url}/metrics").text
        assert 'streamxm_checkpoint_corrupt_total{model="cmos"}' in metrics
    # A worker falls back too, replays what the bad version had covered, and carries on.
    client.push_pairs(pairs[600:])
    caplog.set_level(logging.ERROR, logger="streamxm.storage.checkpoint")
    worker = build_worker(every, r, "cmos")
    worker.run(until_idle=True)
    assert any("checksum mismatch" in rec.getMessage() for rec in caplog.records)
    assert store.corrupt_count("cmos") >= 2  # the API's find and the worker's
    assert worker.learner is not None
    assert_same_learner(worker.learner, reference(pairs))
    assert_same_learner(latest(settings, r), reference(pairs))
    assert r.xpending(keys.pairs, "cmos")["pending"] == 0
