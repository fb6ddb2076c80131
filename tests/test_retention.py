"""Stream retention with a real Redis and real workers: the stream stays bounded, and no entry a
restarted learner would replay is ever trimmed, even when workers die while learning or in the
middle of a trim."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import str_hash
from streamxm.stream.retention import BEFORE_TRIM, entry_id_key, retention_bound, trim_stream
from tests import conftest as fx


def _learn_all(settings: Settings, r: redis.Redis, model: str = "cmos") -> None:
    build_worker(settings, r, model).run(until_idle=True)


def test_the_stream_is_trimmed_to_what_learners_and_gallery_need(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    cfg = fx.checkpoints_every(settings, 97, gallery_max=300, checkpoint_keep=3)
    pairs = fx.class_stream(2000, fx.IMG, fx.TXT, seed=5)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    _learn_all(cfg, r)
    head = str_hash(r.hgetall(keys.checkpoint_head("cmos")))
    length = r.xlen(keys.pairs)
    # The gallery's 300 newest entries, and the ones after the oldest kept checkpoint (3 x 97).
    assert 300 <= length <= 300 + 3 * 97, length
    first = r.xrange(keys.pairs, count=1)[0][0].decode()
    # Nothing the oldest kept checkpoint needs is gone (ids compare as numbers, not strings).
    assert entry_id_key(first) <= entry_id_key(head["kept_from"]) or length == 300
    info = str_hash(r.hgetall(keys.retention))
    assert int(info["trimmed_total"]) == 2000 - length
    with fx.ApiServer(cfg) as api:
        text = httpx.get(f"{api.url}/metrics", timeout=10).text
    ns = settings.namespace
    assert fx.metric(text, "streamxm_stream_trimmed_total", namespace=ns) == 2000 - length
    assert fx.metric(text, "streamxm_stream_length", namespace=ns) == length
    position = fx.metric(text, "streamxm_stream_trim_position_seconds", namespace=ns)
    assert position is not None and abs(position - time.time()) < 600
    # The learner learned every pair once.
    fx.assert_same_learner(fx.latest(cfg, r), fx.reference(pairs))


def test_nothing_is_trimmed_while_a_registered_learner_has_no_checkpoint(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    cfg = settings.model_copy(update={"gallery_max": 100, "checkpoint_every_pairs": 50})
    StreamProducer(r, settings.namespace).push_pairs(fx.class_stream(600, fx.IMG, fx.TXT, seed=6))
    r.sadd(keys.models, "pairwise")  # a second learner that has not started: it needs all
    _learn_all(cfg, r)
    assert r.xlen(keys.pairs) == 600
    assert retention_bound(r, keys, 100) is None
    _learn_all(cfg, r, "pairwise")  # its checkpoints let the trims go ahead
    assert 100 <= r.xlen(keys.pairs) < 600
    assert trim_stream(r, keys, 100) == 0  # already as short as allowed


def test_a_pending_entry_bounds_the_trim(r: redis.Redis, settings: Settings, keys: Keys) -> None:
    cfg = settings.model_copy(update={"gallery_max": 10, "checkpoint_every_pairs": 20})
    client = StreamProducer(r, settings.namespace)
    client.push_pairs(fx.class_stream(200, fx.IMG, fx.TXT, seed=7))
    _learn_all(cfg, r)
    # A read that is never acknowledged (a consumer that died holding it).
    client.push_pairs(fx.class_stream(50, fx.IMG, fx.TXT, seed=8))
    held = r.xreadgroup("cmos", "ghost", {keys.pairs: ">"}, count=5)[0][1]
    bound = retention_bound(r, keys, 10)
    assert bound is not None and bound <= held[0][0].decode()
    trim_stream(r, keys, 10)
    assert r.xrange(keys.pairs, min=held[0][0], max=held[0][0])  # still there


@pytest.mark.slow
def test_sigkill_while_learning_and_while_trimming_loses_nothing(
    r: redis.Redis, settings: Settings, keys: Keys
) -> None:
    n = 3000
    pairs = fx.class_stream(n, fx.IMG, fx.TXT, seed=9)
    # A checkpoint every 89 pairs, with no hold-back after a slow write (share 1): the bound on
    # the trimmed stream below counts on it.
    env = fx.worker_env(
        settings,
        STREAMXM_CHECKPOINT_EVERY_PAIRS="89",
        STREAMXM_READ_BATCH="40",
        STREAMXM_GALLERY_MAX="150",
        STREAMXM_CHECKPOINT_KEEP="2",
        STREAMXM_CHECKPOINT_MAX_SHARE="1",
    )
    producer = fx.push_slowly(StreamProducer(r, settings.namespace), pairs, pause=0.03)
    rng = np.random.default_rng(2)
    kills = 0
    for step in range(4):
        if step % 2:  # frozen between computing the bound and trimming
            fx.frozen_worker(env, BEFORE_TRIM, "the trim fail point").kill()
        else:
            target = fx.processed(r, keys) + int(rng.integers(300, 600))
            fx.kill_at_progress(env, r, keys, min(target, n), rng, 0.2, "progress")
        kills += 1
    producer.join(timeout=120)
    with fx.last_worker(env, r, keys, n):
        fx.wait_for(lambda: r.xlen(keys.pairs) <= 150 + 2 * 89 + 40, 30, "the stream trimmed")
    assert kills == 4
    assert int(str_hash(r.hgetall(keys.retention))["trimmed_total"]) > n // 2
    cfg = settings.model_copy(update={"gallery_max": 150})
    fx.assert_same_learner(fx.latest(cfg, r), fx.reference(pairs))
