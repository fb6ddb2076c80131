"""Issue 17's data defects, reproduced with real worker processes and a real Redis: an exception
inside learning must not drop a batch, and a worker paused past its lease in the middle of a
checkpoint write must not damage its successor's checkpoint."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import redis

from streamxm.config import Settings
from streamxm.service import open_store
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import str_hash
from tests import conftest as fx

pytestmark = pytest.mark.slow  # real processes and fault windows: minutes


def _dead_letters(r: redis.Redis, keys: Keys) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
        for _, fields in r.xrange(keys.dead)
    ]  # type: ignore[union-attr]


def test_a_transient_learning_failure_mid_batch_loses_nothing(
    r: redis.Redis, settings: Settings
) -> None:
    """One exception at the 101st of 300 pairs read in one batch: before the fix the worker
    committed the whole batch with a third of it learned; now it reloads, replays and ends
    bit-identical to an uninterrupted run."""
    keys = Keys(settings.namespace)
    pairs = fx.class_stream(300, fx.IMG, fx.TXT, seed=21)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    env = fx.worker_env(settings, STREAMXM_READ_BATCH="300", STREAMXM_FAULT_RAISE="learn:100*1")
    worker = fx.WorkerProcess(env)
    try:
        fx.wait_for(
            lambda: fx.processed(r, keys) == 300 and worker.alive(),
            60,
            "every pair learned by a living worker",
        )
        fx.wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
    finally:
        code = worker.stop() if worker.alive() else worker.proc.returncode
    assert code == 0, worker.tail()
    assert any("learning entry" in line and "attempt 1 of 3" in line for line in worker.lines)
    assert r.xlen(keys.dead) == 0
    fx.assert_same_learner(fx.latest(settings, r), fx.reference(pairs))


def test_an_entry_that_always_fails_is_dead_lettered_after_three_attempts(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    pairs = fx.class_stream(300, fx.IMG, fx.TXT, seed=22)
    ids = StreamProducer(r, settings.namespace).push_pairs(pairs)
    env = fx.worker_env(settings, STREAMXM_READ_BATCH="300", STREAMXM_FAULT_RAISE="learn:100")
    worker = fx.WorkerProcess(env)
    try:
        fx.wait_for(lambda: fx.processed(r, keys) == 299, 60, "every other pair learned")
        fx.wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
        assert worker.alive(), worker.tail()
    finally:
        worker.stop()
    letters = _dead_letters(r, keys)
    assert len(letters) == 1
    letter = letters[0]
    assert letter["entry_id"] == ids[100] and letter["reason"] == "learn_error"
    assert "InjectedFault" in letter["detail"] or "fail point" in letter["detail"]
    assert letter["orig.id"] == "100"
    assert sum("learning entry" in line for line in worker.lines) == 3
    assert str_hash(r.hgetall(keys.dead_counts)) == {"cmos|learn_error": "1"}
    fx.assert_same_learner(fx.latest(settings, r), fx.reference(pairs[:100] + pairs[101:]))


def test_a_worker_paused_past_its_lease_mid_write_cannot_damage_its_successor(
    r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    """Worker a freezes half-way through writing version 1 (a GC or VM pause) for longer than
    its lease; b takes over and commits its own version 1 and more. When a resumes, its bytes
    must not land in b's files, it must not make its version current, and it must live on."""
    keys = Keys(settings.namespace)
    ckpt_dir = tmp_path / "ckpt"
    pairs = fx.class_stream(1500, fx.IMG, fx.TXT, seed=23)
    client = StreamProducer(r, settings.namespace)
    client.push_pairs(pairs[:500])
    # The whole process freezes: with its checkpoint written on the learning path, the pause
    # in the write stops the loop that refreshes the lease too.
    env = fx.worker_env(
        settings,
        STREAMXM_CHECKPOINT_STORE="dir",
        STREAMXM_CHECKPOINT_DIR=str(ckpt_dir),
        STREAMXM_READ_BATCH="50",
        STREAMXM_CHECKPOINT_IN_BACKGROUND="false",
    )
    stale = fx.WorkerProcess(
        {**env, "STREAMXM_CONSUMER": "a", "STREAMXM_FAULT_PAUSE": "checkpoint.partial_write:8"}
    )
    successor = None
    try:
        fx.wait_for(lambda: stale.saw("fail point"), 60, "worker a to freeze mid-write")
        successor = fx.WorkerProcess({**env, "STREAMXM_CONSUMER": "b"})
        fx.wait_for(lambda: fx.stats(r, keys).get("consumer") == "b", 30, "b to commit")
        client.push_pairs(pairs[500:])
        fx.wait_for(lambda: fx.processed(r, keys) == 1500, 60, "b to learn every pair")
        # a wakes up (8 s after freezing), finds the lease gone and stands by.
        fx.wait_for(lambda: stale.saw("lost the lease"), 30, "a to notice it lost the lease")
        time.sleep(0.5)
        assert stale.alive(), stale.tail()
        assert r.get(keys.lease("cmos")) == b"b"
        fx.wait_for(lambda: r.xpending(keys.pairs, "cmos")["pending"] == 0, 30, "all acks")
    finally:
        for w in (stale, successor):
            if w is not None:
                w.stop()
    dir_settings = settings.model_copy(
        update={"checkpoint_store": "dir", "checkpoint_dir": ckpt_dir}
    )
    store = open_store(dir_settings, r)
    head = store.head("cmos")
    assert head is not None
    # Every version the head names verifies; nothing was counted corrupt.
    for version, sha in head["history"]:
        blob = store._read("cmos", version, sha)
        assert blob is not None
        assert hashlib.sha256(blob).hexdigest() == sha, version
    assert store.corrupt_count("cmos") == 0
    fx.assert_same_learner(fx.latest(dir_settings, r), fx.reference(pairs))
