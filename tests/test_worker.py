"""The learner worker against a real Redis: dead letters, crash and restart, reclaiming."""

import signal
import socket
import subprocess
import threading

import numpy as np
import redis

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.service import build_worker, open_store
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.tools.datasets import bundled_wiki_path, iter_pairs, load_dataset
from tests.conftest import (
    IMG,
    PY,
    TXT,
    WorkerProcess,
    assert_same_learner,
    class_stream,
    latest,
    processed,
    reference,
    stats,
    wait_for,
    worker_env,
)


def test_malformed_entries_are_dead_lettered_and_the_worker_keeps_going(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    client = StreamProducer(r, settings.namespace)
    rng = np.random.default_rng(0)
    client.push("good-0", rng.random(4), rng.random(3), labels=[1])
    good = np.ones(4, "<f4").tobytes()
    bad = [
        {"v": "1", "id": "short", "img": good[:-4], "txt": np.ones(3, "<f4").tobytes()},
        {
            "v": "1",
            "id": "nan",
            "img": np.array([1, np.nan, 0, 0], "<f4").tobytes(),
            "txt": np.ones(3, "<f4").tobytes(),
        },
        {"v": "1", "id": "no-txt", "img": good},
        {"garbage": b"\x00\xff\x13binary"},
    ]
    for fields in bad:
        r.xadd(keys.pairs, fields)  # type: ignore[arg-type]
    client.push("good-1", rng.random(4), rng.random(3), labels=[2])
    worker = build_worker(settings, r, "cmos")
    worker.run(until_idle=True)
    letters = r.xrange(keys.dead)
    reasons = [fields[b"reason"].decode() for _, fields in letters]
    assert reasons == ["dim_mismatch", "non_finite", "missing_field", "missing_field"]
    assert letters[0][1][b"orig.id"] == b"short"
    assert stats(r, keys)["pairs_processed"] == "2"
    assert r.xpending(keys.pairs, "cmos")["pending"] == 0
    counts = r.hgetall(keys.dead_counts)
    assert counts[b"cmos|missing_field"] == b"2"


def test_sigkill_and_restart_lose_nothing_and_apply_nothing_twice(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    ds = load_dataset(bundled_wiki_path())
    pairs = list(iter_pairs(ds, limit=1500))
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    env = worker_env(settings, STREAMXM_CHECKPOINT_EVERY_PAIRS="97", STREAMXM_READ_BATCH="40")
    kills = 0
    for threshold in (200, 600, 1000):
        proc = subprocess.Popen(
            [*PY, "worker", "--model", "cmos"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(
            lambda t=threshold: int(stats(r, keys).get("pairs_processed", 0)) >= t,
            60,
            f"{threshold} pairs",
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    proc = subprocess.Popen(
        [*PY, "worker", "--model", "cmos"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: stats(r, keys).get("pairs_processed") == "1500", 60, "all pairs")
        wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
        # The killed workers may have committed every pair: the last must be running (its
        # SIGTERM handler installed) before it is asked to stop.
        wait_for(
            lambda: r.get(keys.lease("cmos")) == f"{socket.gethostname()}-{proc.pid}".encode(),
            60,
            "the last worker to lead",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert kills == 3
    restored = latest(settings, r)
    want = reference(pairs)
    assert restored.pairs_seen == 1500
    # Bit for bit the model of an uninterrupted run over the same stream.
    assert np.array_equal(restored.model.W, want.model.W)  # type: ignore[attr-defined]
    assert restored.stats.as_dict() == want.stats.as_dict()
    # Several consumers took part (each restart is a new consumer). Not one per process: a
    # worker that checkpoints in the background reads ahead of its last checkpoint, and its
    # successor may replay (XRANGE, no consumer) all it needs before the next kill.
    consumers = r.xinfo_consumers(keys.pairs, "cmos")
    assert len(consumers) >= 2


def test_standby_takes_over_and_reclaims_pending(r: redis.Redis, settings: Settings) -> None:
    keys = Keys(settings.namespace)
    ds = load_dataset(bundled_wiki_path())
    pairs = list(iter_pairs(ds, limit=300))
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    # A consumer that read entries and died before acknowledging them.
    r.xgroup_create(keys.pairs, "cmos", id="0", mkstream=True)
    r.xreadgroup("cmos", "dead-consumer", {keys.pairs: ">"}, count=120)
    assert r.xpending(keys.pairs, "cmos")["pending"] == 120
    stop = threading.Event()
    worker = build_worker(settings, r, "cmos")
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    try:
        wait_for(lambda: stats(r, keys).get("pairs_processed") == "300", 30, "all pairs")
        wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
    finally:
        stop.set()
        thread.join()
    assert np.array_equal(worker.learner.model.W, reference(pairs).model.W)  # type: ignore[union-attr, attr-defined]


def test_directory_checkpoints_resume_too(r: redis.Redis, settings: Settings) -> None:
    dir_settings = settings.model_copy(update={"checkpoint_store": "dir"})
    keys = Keys(settings.namespace)
    ds = load_dataset(bundled_wiki_path())
    pairs = list(iter_pairs(ds, limit=400))
    client = StreamProducer(r, settings.namespace)
    client.push_pairs(pairs[:250])
    build_worker(dir_settings, r, "cmos").run(until_idle=True)
    client.push_pairs(pairs[250:])
    second = build_worker(dir_settings, r, "cmos")
    second.run(until_idle=True)
    assert second.learner is not None and second.learner.pairs_seen == 400
    assert np.array_equal(second.learner.model.W, reference(pairs).model.W)  # type: ignore[attr-defined]
    assert r.xpending(keys.pairs, "cmos")["pending"] == 0


def test_every_dead_letter_series_exists_at_zero_before_the_first(
    r: redis.Redis, settings: Settings
) -> None:
    """Each registered model's ``streamxm_dead_letters_total`` is scraped at 0 for every reason
    before anything is dead-lettered (so ``increase()`` sees the first one), then counts it."""
    import httpx

    from streamxm.stream.messages import REASONS
    from tests.conftest import ApiServer, metric

    keys = Keys(settings.namespace)
    client = StreamProducer(r, settings.namespace)
    rng = np.random.default_rng(1)
    client.push("good-0", rng.random(4), rng.random(3), labels=[1])
    build_worker(settings, r, "cmos").run(until_idle=True)
    with ApiServer(settings) as api:
        before = httpx.get(f"{api.url}/metrics", timeout=10).text
        assert metric(before, "streamxm_checkpoint_corrupt_total", model="cmos") == 0
        for reason in REASONS:
            assert (
                metric(before, "streamxm_dead_letters_total", model="cmos", reason=reason) == 0
            ), reason
        r.xadd(
            keys.pairs,
            {
                "v": "1",
                "id": "no-txt",  # type: ignore[arg-type]
                "img": np.ones(4, "<f4").tobytes(),
            },
        )
        build_worker(settings, r, "cmos").run(until_idle=True)
        after = httpx.get(f"{api.url}/metrics", timeout=10).text
    assert metric(after, "streamxm_dead_letters_total", model="cmos", reason="missing_field") == 1
    assert metric(after, "streamxm_dead_letters_total", model="cmos", reason="bad_labels") == 0


def test_checkpoints_wait_until_they_are_within_their_share_of_the_time(
    r: redis.Redis, settings: Settings
) -> None:
    """A checkpoint that took ``c`` seconds holds the next back ``c (1 - share) / share``
    seconds, past the pairs interval; what is learned and committed in the end is the same."""
    pairs = list(iter_pairs(load_dataset(bundled_wiki_path()), limit=300))

    def run(share: float, namespace: str) -> tuple[int, StreamLearner]:
        s = settings.model_copy(
            update={
                "namespace": namespace,
                "checkpoint_every_pairs": 50,
                "read_batch": 50,
                "checkpoint_every_seconds": 3600.0,
                "checkpoint_max_share": share,
            }
        )
        StreamProducer(r, namespace).push_pairs(pairs)
        worker = build_worker(s, r, "cmos")
        worker.run(until_idle=True)
        assert (
            worker.learner is not None and r.xpending(Keys(namespace).pairs, "cmos")["pending"] == 0
        )
        return worker.version, worker.learner

    every, learned = run(1.0, settings.namespace)
    held, held_learned = run(1e-4, settings.namespace + "-held")
    assert every == 6  # one per 50 pairs
    assert held == 2  # the first after 50 pairs, then the final one at the end
    assert held_learned.pairs_seen == learned.pairs_seen == 300
    assert np.array_equal(held_learned.model.W, learned.model.W)  # type: ignore[attr-defined]


def test_learning_goes_on_while_a_checkpoint_is_written(r: redis.Redis, settings: Settings) -> None:
    """Every checkpoint's commit stalls for 3 s between its WATCH of the lease and its EXEC (a
    slow store): the worker learns the next interval's pairs meanwhile, its own refreshes of
    the lease do not abort the commit, and what it commits in the end is the uninterrupted
    learner's, bit for bit."""
    keys = Keys(settings.namespace)
    pairs = class_stream(400, IMG, TXT, seed=31)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    env = worker_env(
        settings,
        STREAMXM_READ_BATCH="50",
        STREAMXM_CHECKPOINT_EVERY_PAIRS="100",
        STREAMXM_CHECKPOINT_MAX_SHARE="1",
        STREAMXM_LEASE_TTL_MS="30000",
        STREAMXM_FAULT_PAUSE="checkpoint.before_exec:3",
    )
    worker = WorkerProcess(env)
    store = open_store(settings, r)
    try:
        wait_for(lambda: worker.saw("fail point"), 60, "the first commit to stall")
        # The first checkpoint holds 100 pairs; the next 100 are read and learned before it
        # lands (they stay pending: acknowledged by the checkpoint that holds them).
        wait_for(
            lambda: r.xpending(keys.pairs, "cmos")["pending"] >= 200,
            2.5,
            "the next interval's pairs while the commit stalls",
        )
        assert store.head("cmos") is None
        wait_for(lambda: processed(r, keys) == 400, 60, "every pair committed")
        wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
        assert worker.alive() and not worker.saw("lost the lease"), worker.tail()
    finally:
        worker.stop()
    assert_same_learner(latest(settings, r), reference(pairs))
