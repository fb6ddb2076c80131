"""Issue 22: the service on a real Redis Cluster (3 masters, 3 replicas on loopback): namespaces
on different masters end to end, SIGKILLed workers, and a master SIGKILLed under push and learn
with its replica promoted. ``pytest -k cluster`` selects these."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from redis.crc import key_slot

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.service import build_indexer, build_worker
from streamxm.storage.segments import read_manifest
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits, Pair
from streamxm.stream.producer import StreamProducer, decode_entries
from streamxm.stream.redis_conn import UNAVAILABLE, NotReplicated, Replication, connect, text
from streamxm.tools.cluster import LocalCluster, namespace_on_each_master
from streamxm.tools.datasets import iter_pairs, load_dataset
from tests.conftest import (
    IMG,
    TXT,
    ApiServer,
    WorkerProcess,
    assert_same_learner,
    class_stream,
    kill_at_progress,
    last_worker,
    latest,
    metric,
    processed,
    reference,
    run_cli,
    wait_for,
    wait_gallery_items,
    worker_env,
)

pytestmark = pytest.mark.slow  # six redis-server processes, failovers: tens of seconds


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


def _settings(cluster: LocalCluster, namespace: str, root: Path, **extra: object) -> Settings:
    return Settings(
        _env_file=None,
        redis_url=cluster.url,  # type: ignore[call-arg]
        namespace=namespace,
        data_dir=root / namespace,
        checkpoint_dir=root / namespace / "checkpoints",
        **extra,
    )


def _learned_from_stream(r: redis.Redis, keys: Keys) -> StreamLearner:
    """A fresh learner fed the namespace's stream in order: what one uninterrupted worker
    would hold."""
    entries = [(text(i), f) for i, f in r.xrange(keys.pairs)]
    pairs, skipped = decode_entries(r, keys, entries, Limits())
    assert skipped == 0
    return reference([p for _, p in pairs])


def test_cluster_end_to_end_in_three_namespaces_on_three_masters(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Push (client; the CLI for one namespace) -> learn -> checkpoint -> gallery segments ->
    search -> metrics, in three namespaces whose slots are on three different masters."""
    names = namespace_on_each_master(cluster, 3, prefix="e2e")
    masters = [cluster.master_for_key(Keys(ns).pairs) for ns in names]
    assert len(set(masters)) == 3
    wiki = list(iter_pairs(load_dataset("wiki"), limit=200))
    for i, ns in enumerate(names):
        settings = _settings(cluster, ns, tmp_path)
        r = connect(settings)
        keys = Keys(ns)
        if i == 0:  # the CLI, in its own process, on the cluster URL
            pairs = wiki
            pushed = run_cli(
                "push", "--dataset", "wiki", "--limit", "200", env=worker_env(settings), timeout=120
            )
            assert pushed.returncode == 0, pushed.stderr
        else:
            pairs = class_stream(200, 8, 4, seed=i)
            StreamProducer(r, ns).push_pairs(pairs)
        build_worker(settings, r, "cmos").run(until_idle=True)
        build_indexer(settings, r).run(until_idle=True)
        # Every key of the namespace is in its one slot, on its master.
        slots = {key_slot(k) for k in r.scan_iter(match=f"{keys.prefix}:*")}
        assert slots == {key_slot(keys.pairs.encode())}
        assert cluster.master_for_slot(slots.pop()) == masters[i]
        assert_same_learner(latest(settings, r), reference(pairs))
        manifest = read_manifest(r, keys)
        assert manifest is not None and sum(ref.rows for ref in manifest.segments) == 200
        with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, 30, "ready")
            dim_img, dim_txt = len(pairs[0].img), len(pairs[0].txt)
            accepted = http.post(
                "/v1/pairs",
                json={
                    "pairs": [
                        {
                            "id": "http-1",
                            "img": [0.5] * dim_img,
                            "txt": [0.5] * dim_txt,
                            "labels": [1],
                        }
                    ]
                },
            )
            assert accepted.status_code == 202, accepted.text
            wait_gallery_items(http, 201, "the gallery to hold every pair")
            found = http.post(
                "/v1/search", json={"modality": "image", "k": 5, "vector": pairs[3].img.tolist()}
            ).json()
            assert len(found["results"]) == 5 and found["model"] == "cmos"
            text_ = http.get("/metrics").text
            assert metric(text_, "streamxm_pairs_processed_total", model="cmos") == 200
            assert metric(text_, "streamxm_redis_up") == 1
            assert metric(text_, "streamxm_stream_length") == 201


def test_cluster_sigkilled_workers_end_bit_identical(cluster: LocalCluster, tmp_path: Path) -> None:
    ns = namespace_on_each_master(cluster, 1, prefix="kill")[0]
    settings = _settings(cluster, ns, tmp_path)
    r = connect(settings)
    keys = Keys(ns)
    n = 1500
    pairs = class_stream(n, IMG, TXT, seed=5)
    StreamProducer(r, ns).push_pairs(pairs)
    env = worker_env(settings, STREAMXM_CHECKPOINT_EVERY_PAIRS="97", STREAMXM_READ_BATCH="40")
    rng = np.random.default_rng(7)
    for threshold in sorted(int(t) for t in rng.choice(np.arange(100, n - 200), 3, replace=False)):
        kill_at_progress(env, r, keys, threshold, rng, 0.2, f"{threshold} pairs")
    with last_worker(env, r, keys, n) as final:
        wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
        # A killed worker may have learned the whole stream already: the last one must be up
        # (its SIGTERM handler in place) before it is asked to stop.
        wait_for(lambda: final.saw("leads cmos"), 60, "the last worker to lead")
    assert_same_learner(latest(settings, r), reference(pairs))


def test_cluster_master_killed_under_push_and_learn_loses_no_acknowledged_pair(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """WAIT 1 after every push and every commit (``STREAMXM_REDIS_WAIT_REPLICAS=1``) and AOF
    on every node: the namespace's master is SIGKILLed while a producer pushes and a worker
    learns; its replica takes over. Every pair whose push returned is in the stream, and the
    final model is one pass over the stream exactly (nothing applied twice)."""
    ns = namespace_on_each_master(cluster, 1, prefix="failover")[0]
    settings = _settings(cluster, ns, tmp_path, redis_wait_replicas=1, redis_wait_timeout_ms=2000)
    r = connect(settings)
    keys = Keys(ns)
    pairs = class_stream(3000, IMG, TXT, seed=9)
    acknowledged: list[str] = []
    refused: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        client = StreamProducer(connect(settings), ns, replication=Replication.of(settings))
        for start in range(0, len(pairs), 25):
            batch: list[Pair] = pairs[start : start + 25]
            while not stop.is_set():
                try:
                    client.push_pairs(batch)
                    acknowledged.extend(p.id for p in batch)
                    break
                except (*UNAVAILABLE, NotReplicated):
                    refused.extend(p.id for p in batch)  # pushed again: at least once
                    time.sleep(0.2)
            time.sleep(0.05)  # paced: the failover lands while pairs still arrive

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    env = worker_env(
        settings,
        STREAMXM_CHECKPOINT_EVERY_PAIRS="97",
        STREAMXM_READ_BATCH="40",
        STREAMXM_REDIS_WAIT_REPLICAS="1",
        STREAMXM_REDIS_WAIT_TIMEOUT_MS="2000",
    )
    worker = WorkerProcess(env)
    try:
        wait_for(
            lambda: processed(r, keys) >= 200 and len(acknowledged) >= 1200,
            90,
            "learning under way",
        )
        master = cluster.master_for_key(keys.pairs)
        pushed_before_kill = len(acknowledged)
        cluster.kill(master)
        promoted = cluster.wait_failover(master)
        assert cluster.master_for_key(keys.pairs) == promoted
        # The promoted master has no replica: every push and commit is refused (WAIT 1) until
        # the failed node is back, as a replica of it.
        time.sleep(1.0)
        cluster.restart(master)
        assert cluster.replica_of(promoted) == master
        producer.join(timeout=180)
        assert not producer.is_alive()
        wait_for(lambda: _settled(r, keys), 180, "the worker to learn the whole stream")
    finally:
        stop.set()
        code = worker.stop()
    assert code == 0, worker.tail()
    # The kill landed mid-stream: pairs were still being pushed (and learned) after it.
    assert pushed_before_kill < len(pairs)
    print(
        f"failover: {pushed_before_kill} pairs acknowledged before the kill, "
        f"{len(refused)} refused and pushed again"
    )
    in_stream = [text(f[b"id"]) for _, f in r.xrange(keys.pairs)]
    assert set(acknowledged) <= set(in_stream)  # no acknowledged pair lost
    assert len(set(acknowledged)) == len(pairs)
    final = latest(settings, r)
    assert final.pairs_seen == len(in_stream)  # every entry once: none applied twice
    assert_same_learner(final, _learned_from_stream(r, keys))


def _settled(r: redis.Redis, keys: Keys) -> bool:
    try:
        return (
            processed(r, keys) == r.xlen(keys.pairs)
            and r.xpending(keys.pairs, "cmos")["pending"] == 0
        )
    except UNAVAILABLE:
        return False


@pytest.mark.long
def test_cluster_bench_ingest_reports_one_and_three_namespaces() -> None:
    from streamxm.tools.bench_ingest import ingest

    result = ingest(img_dim=16, txt_dim=8, pairs=200, repeats=1, cluster=True)
    assert result["one_namespace_pairs_per_s"] > 0 and result["three_namespaces_pairs_per_s"] > 0
    assert len(set(result["namespace_masters"])) == 3
