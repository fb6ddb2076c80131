"""The gallery indexer and its segments, with a real Redis, real HTTP and real processes: every
stream entry lands in exactly one live segment (also across SIGKILLs mid-commit), API replicas
open the segments instead of replaying the stream, and the cap retires the oldest rows."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.service import build_indexer, build_worker, open_store
from streamxm.serving.following import GalleryFollower
from streamxm.storage.segments import (
    SEGMENTS,
    open_numbered_segment,
    read_manifest,
)
from streamxm.storage.slots import ShardPart
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits, Pair
from streamxm.stream.producer import StreamProducer
from tests import conftest as fx


def _indexed_ids(settings: Settings, r: redis.Redis) -> list[str]:
    """The ids of the live gallery rows, oldest first (by row number), read back from the
    stored segments."""
    manifest = read_manifest(r, Keys(settings.namespace))
    assert manifest is not None
    store = open_store(settings, r)
    numbered: list[tuple[int, str]] = []
    for ref in manifest.segments:
        opened = open_numbered_segment(store, ref)
        assert opened is not None, f"segment {ref.seq} missing or corrupt"
        chunk, numbers = opened
        assert len(chunk) == ref.rows and ref.first_row == numbers[0] <= numbers[-1] < ref.end_row
        assert (numbers[: ref.skip] < manifest.retired_below).all()
        assert (numbers[ref.skip :] >= manifest.retired_below).all()
        numbered.extend(
            zip(numbers[ref.skip :].tolist(), chunk.ids[ref.skip :].tolist(), strict=True)
        )
    numbers_seen = [n for n, _ in sorted(numbered)]
    assert len(set(numbers_seen)) == len(numbers_seen)  # every row in one live segment
    return [item for _, item in sorted(numbered)]


def _push(settings: Settings, r: redis.Redis, pairs: list[Pair]) -> None:
    StreamProducer(r, settings.namespace).push_pairs(pairs)


@pytest.mark.parametrize("kind,parts", [("redis", 1), ("dir", 1), ("redis", 3), ("dir", 4)])
def test_every_entry_lands_once_and_the_cap_retires_the_oldest(
    kind: str, parts: int, r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    cfg = settings.model_copy(
        update={
            "checkpoint_store": kind,
            "gallery_max": 700,
            "checkpoint_dir": tmp_path / "ckpt",
            "gallery_parts": parts,
        }
    )
    pairs = fx.class_stream(1000, fx.IMG, fx.TXT, seed=1)
    indexer = build_indexer(cfg, r)
    indexer.segment_rows = 64  # many small commits: the tier merge has work to do
    for start in range(0, 1000, 150):
        _push(cfg, r, pairs[start : start + 150])
        indexer.run(until_idle=True)
    manifest = read_manifest(r, Keys(cfg.namespace))
    assert manifest is not None and manifest.rows == 700
    assert _indexed_ids(cfg, r) == [p.id for p in pairs[300:]]
    assert len(manifest.segments) <= 8 * parts  # merged tier by tier, not one per commit
    for ref in manifest.segments:  # each segment holds one part's items
        opened = open_numbered_segment(open_store(cfg, r), ref)
        assert opened is not None and ref.parts == parts
        assert ShardPart(ref.part, parts).holds(opened[0].ids).all()
    # Retired and merged-away segments are deleted with the commit that drops them.
    if kind == "dir":
        files = sorted(p.name for p in (tmp_path / "ckpt" / cfg.namespace / SEGMENTS).iterdir())
        assert len(files) == len(manifest.segments), files


def test_a_manifest_of_the_former_layout_goes_on_in_parts(
    r: redis.Redis, settings: Settings
) -> None:
    """A manifest written before segments had parts (``seq:sha:rows`` and one ``skip``) reads
    as one part numbered from 0; an indexer set to two parts goes on from it: its new rows go
    into segments per part, the old segment keeps its rows until they retire, and a replica
    serves exactly the newest rows under the cap throughout."""
    keys = Keys(settings.namespace)
    cfg = settings.model_copy(update={"gallery_max": 500})
    pairs = fx.class_stream(900, fx.IMG, fx.TXT, seed=3)
    _push(cfg, r, pairs[:300])
    build_indexer(cfg, r).run(until_idle=True)
    now = read_manifest(r, keys)
    assert now is not None and [ref.parts for ref in now.segments] == [1]
    legacy = {  # the same segment, as the former layout listed it
        "segments": ",".join(f"{ref.seq}:{ref.sha}:{ref.rows}" for ref in now.segments),
        "skip": "20",
        "last_id": now.last_id,
        "revision": str(now.revision),
        "next_seq": str(now.next_seq),
    }
    r.delete(keys.gallery)
    r.hset(keys.gallery, mapping=legacy)
    parsed = read_manifest(r, keys)
    assert parsed is not None and parsed.rows == 280 and parsed.retired_below == 20
    assert (parsed.segments[0].first_row, parsed.segments[0].end_row) == (0, 300)
    assert _indexed_ids(cfg, r) == [p.id for p in pairs[20:300]]
    parted = build_indexer(cfg.model_copy(update={"gallery_parts": 2}), r)
    for start in (300, 600):
        _push(cfg, r, pairs[start : start + 300])
        parted.run(until_idle=True)
        assert _indexed_ids(cfg, r) == [p.id for p in pairs[start + 300 - 500 : start + 300]]
        replica = GalleryFollower(r, open_store(cfg, r), keys, 1000, Limits(), 64)
        assert replica.read() and len(replica.gallery) == 500
    manifest = read_manifest(r, keys)
    assert manifest is not None
    assert sorted({(ref.part, ref.parts) for ref in manifest.segments}) == [(0, 2), (1, 2)]


def test_a_replica_opens_the_segments_without_the_stream(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    cfg = settings.model_copy(update={"checkpoint_every_pairs": 100, "checkpoint_keep": 1})
    pairs = fx.class_stream(900, fx.IMG, fx.TXT, seed=2)
    _push(cfg, r, pairs[:600])
    build_indexer(cfg, r).run(until_idle=True)
    build_worker(cfg, r, "cmos").run(until_idle=True)
    # The learner's only kept checkpoint and the segments hold everything: retention trims
    # the stream to their position (approximately: whole nodes of at most 100 entries).
    assert r.xlen(keys.pairs) <= 100
    _push(cfg, r, pairs[600:])  # not indexed yet: the API reads them from the stream
    build_worker(cfg, r, "cmos").run(until_idle=True)
    with fx.ApiServer(cfg) as api, httpx.Client(base_url=api.url, timeout=30) as http:

        def gallery_items() -> int:
            models = http.get("/v1/models").json()["models"]
            return int(models[0]["gallery_items"]) if models else 0

        fx.wait_for(lambda: gallery_items() == 900, 30, "segments plus the stream's tail")
        probe = pairs[10]
        hits = http.post(
            "/v1/search", json={"modality": "image", "vector": probe.img.tolist(), "k": 900}
        ).json()["results"]
        assert sorted(h["id"] for h in hits) == sorted(p.id for p in pairs)  # each once
        build_indexer(cfg, r).run(until_idle=True)  # the tail becomes a segment
        fx.wait_for(
            lambda: read_manifest(r, keys) is not None and read_manifest(r, keys).rows == 900,
            10,
            "the new segment",
        )
        time.sleep(1.0)  # a few refreshes of the API
        assert gallery_items() == 900
        hits = http.post(
            "/v1/search", json={"modality": "image", "vector": probe.img.tolist(), "k": 900}
        ).json()["results"]
        assert sorted(h["id"] for h in hits) == sorted(p.id for p in pairs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,fail_point", [("redis", "checkpoint.before_exec"), ("dir", "checkpoint.before_commit")]
)
def test_sigkill_mid_commit_leaves_every_entry_in_exactly_one_segment(
    kind: str, fail_point: str, r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    n = 3000
    ckpt = tmp_path / "ckpt"
    pairs = fx.class_stream(n, fx.IMG, fx.TXT, seed=3)
    env = fx.worker_env(settings, STREAMXM_CHECKPOINT_STORE=kind, STREAMXM_CHECKPOINT_DIR=str(ckpt))
    client = StreamProducer(r, settings.namespace)
    keys = Keys(settings.namespace)
    rng = np.random.default_rng(4)

    def indexed() -> int:
        manifest = read_manifest(r, keys)
        return manifest.rows if manifest else 0

    for step in range(4):
        client.push_pairs(pairs[step * 600 : (step + 1) * 600])
        if step % 2:
            proc = fx.Child(
                "indexer", env={**env, "STREAMXM_FAULT_PAUSE": f"{fail_point}:30"}, watch=True
            )
            fx.wait_for(lambda p=proc: p.saw("fail point"), 60, "the commit fail point")
        else:
            proc = fx.Child("indexer", env=env, watch=True)
            target = indexed() + int(rng.integers(50, 500))
            fx.wait_for(lambda t=target: indexed() >= t, 60, "some segments")
            time.sleep(float(rng.uniform(0, 0.5)))
        proc.kill()
    client.push_pairs(pairs[2400:])
    final = fx.Child("indexer", env=env, watch=True)
    try:
        fx.wait_for(lambda: indexed() == n, 60, "every entry indexed")
    finally:
        assert final.stop() == 0, final.tail()
    cfg = settings.model_copy(update={"checkpoint_store": kind, "checkpoint_dir": ckpt})
    assert _indexed_ids(cfg, r) == [p.id for p in pairs]


def test_an_api_started_before_the_indexer_moves_to_segments_without_loss(
    r: redis.Redis, settings: Settings
) -> None:
    pairs = fx.class_stream(700, fx.IMG, fx.TXT, seed=5)
    _push(settings, r, pairs)
    build_worker(settings, r, "cmos").run(until_idle=True)
    with fx.ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:

        def ids_found() -> list[str]:
            hits = http.post(
                "/v1/search", json={"modality": "text", "k": 1000, "vector": pairs[0].txt.tolist()}
            )
            return sorted(h["id"] for h in hits.json()["results"]) if hits.is_success else []

        want = sorted(p.id for p in pairs)
        fx.wait_for(lambda: ids_found() == want, 30, "the gallery read from the stream")
        # The first segments cover only 500 entries, fewer than the API has read itself.
        indexer = build_indexer(settings, r)
        indexer.read_batch = 500
        assert indexer.lease.acquire()
        indexer._load()
        indexer.step()
        indexer.commit()
        assert read_manifest(r, Keys(settings.namespace)).rows == 500  # type: ignore[union-attr]
        time.sleep(1.0)  # a few refreshes: the API now serves segments plus the stream after
        assert ids_found() == want


def test_a_corrupt_segment_is_quarantined_and_the_rest_of_the_gallery_served(
    r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    """Two segment files replaced by garbage: the indexer (a real process) finds the one it
    merges, the API the one it opens; both are recorded with their rows and dropped from the
    manifest, the indexer keeps indexing, the API stays ready (``degraded``, naming them) and
    serves every other row, and only the two segments' rows are lost."""
    ckpt = tmp_path / "ckpt"
    cfg = settings.model_copy(update={"checkpoint_store": "dir", "checkpoint_dir": ckpt})
    keys = Keys(cfg.namespace)
    pairs = fx.class_stream(800, fx.IMG, fx.TXT, seed=6)
    for batch in (pairs[:600], pairs[600:700]):  # segments of 600 and 100 rows
        _push(cfg, r, batch)
        build_indexer(cfg, r).run(until_idle=True)
    build_worker(cfg, r, "cmos").run(until_idle=True)
    manifest = read_manifest(r, keys)
    assert manifest is not None and [s.rows for s in manifest.segments] == [600, 100]
    for ref in manifest.segments:
        (path,) = (ckpt / cfg.namespace / SEGMENTS).glob(f"v{ref.seq:012d}-*")
        path.write_bytes(np.random.default_rng(ref.seq).bytes(path.stat().st_size))
    env = fx.worker_env(cfg, STREAMXM_CHECKPOINT_STORE="dir", STREAMXM_CHECKPOINT_DIR=str(ckpt))
    _push(cfg, r, pairs[700:750])  # the indexer merges the 100-row segment with these
    indexer = fx.Child("indexer", env=env, watch=True)
    try:
        fx.wait_for(
            lambda: (
                read_manifest(r, keys).last_id  # type: ignore[union-attr]
                != manifest.last_id
            ),
            30,
            "the indexer's first commit",
        )
        with fx.ApiServer(cfg) as api, httpx.Client(base_url=api.url, timeout=30) as http:
            fx.wait_for(
                lambda: http.get("/readyz").json()["status"] == "degraded",
                30,
                "the API to open the segments",
            )
            ready = http.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["gallery"] == {
                "degraded": True,
                "corrupt_segments": [1, 2],
                "rows_lost": 700,
            }
            _push(cfg, r, pairs[750:])  # the next commit drops segment 1 from the manifest
            fx.wait_for(
                lambda: read_manifest(r, keys).rows == 100,  # type: ignore[union-attr]
                30,
                "the corrupt segments out of the manifest",
            )
            build_worker(cfg, r, "cmos").run(until_idle=True)
            models = http.get("/v1/models").json()
            assert models["gallery"]["degraded"] and models["gallery"]["rows_lost"] == 700
            fx.wait_gallery_items(http, 100, "the rest of the gallery served")
            hits = http.post(
                "/v1/search", json={"modality": "image", "k": 1000, "vector": pairs[0].img.tolist()}
            ).json()
            assert sorted(h["id"] for h in hits["results"]) == sorted(p.id for p in pairs[700:])
            # A model with no learner is unknown (404), not "not ready".
            assert (
                http.post(
                    "/v1/search",
                    json={"modality": "image", "model": "cca", "vector": pairs[0].img.tolist()},
                ).status_code
                == 404
            )
            scrape = http.get("/metrics").text
        assert fx.metric(scrape, "streamxm_gallery_segments_corrupt_total") == 2
        assert fx.metric(scrape, "streamxm_gallery_rows_lost_total") == 700
        assert indexer.alive(), indexer.tail()
    finally:
        assert indexer.stop() == 0, indexer.tail()
    assert _indexed_ids(cfg, r) == [p.id for p in pairs[700:]]
