"""The record of corrupt gallery segments is fenced like the manifest (issue 58, item 8).

A stale indexer paused inside its read-and-merge window while its lease expired, and whose
successor merged and deleted a segment meanwhile, must not record that segment as corrupt when
it resumes (healthy rows would count as lost and ``/readyz`` would say degraded); the current
lease holder still records a genuinely corrupt one. A reader without the lease (an API) records
only a segment the manifest still lists. Real Redis, both segment stores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from api.schemas import GalleryHealth
from streamxm.config import Settings
from streamxm.service import build_indexer, open_store
from streamxm.serving.following import GalleryFollower
from streamxm.storage.checkpoint import LeaseLost
from streamxm.storage.segments import SEGMENTS, CorruptSegments, Manifest, SegmentRef, read_manifest
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits
from streamxm.stream.producer import StreamProducer
from streamxm.tools.waiting import wait_for
from streamxm.worker.indexer import GalleryIndexer
from tests import conftest as fx


def _config(settings: Settings, kind: str, tmp_path: Path) -> Settings:
    return settings.model_copy(
        update={"checkpoint_store": kind, "lease_ttl_ms": 200, "checkpoint_dir": tmp_path / "ckpt"}
    )


def _indexer(cfg: Settings, r: redis.Redis, consumer: str) -> GalleryIndexer:
    """An indexer that commits only when told to: its steps are called by hand."""
    indexer = build_indexer(cfg.model_copy(update={"consumer": consumer}), r)
    indexer.segment_rows, indexer.flush_seconds = 1_000_000, 3600.0
    return indexer


def _lead(indexer: GalleryIndexer) -> None:
    """What the indexer's loop does on taking the lease."""
    assert indexer.lease.acquire()
    indexer._load()


def _manifest(r: redis.Redis, keys: Keys) -> Manifest:
    manifest = read_manifest(r, keys)
    assert manifest is not None
    return manifest


def _spoil(cfg: Settings, r: redis.Redis, ref: SegmentRef) -> None:
    """Replace a stored segment's bytes with garbage (a failing disk, a bad copy)."""
    if cfg.checkpoint_store == "redis":
        r.set(Keys(cfg.namespace).checkpoint_blob(SEGMENTS, ref.seq), b"garbage")
        return
    # By sha too: the stale indexer's orphan file of the same sequence number lies beside it.
    path = Path(cfg.checkpoint_dir, cfg.namespace, SEGMENTS, f"v{ref.seq:012d}-{ref.sha[:16]}.npz")
    assert path.is_file()
    path.write_bytes(b"garbage")


def _health(cfg: Settings, r: redis.Redis) -> tuple[GalleryHealth, int]:
    """What ``/readyz`` and ``/v1/models`` say of the gallery (an API's follower reads the
    namespace's record), and the rows that follower serves."""
    keys = Keys(cfg.namespace)
    follower = GalleryFollower(r, open_store(cfg, r), keys, 1000, Limits(), 64)
    follower.read()
    return GalleryHealth.of(follower.gallery_corrupt), len(follower.gallery)


@pytest.mark.parametrize("kind", ["redis", "dir"])
def test_a_stale_indexer_cannot_record_a_segment_its_successor_merged(
    kind: str, r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    cfg = _config(settings, kind, tmp_path)
    keys = Keys(cfg.namespace)
    client = StreamProducer(r, cfg.namespace)
    pairs = fx.class_stream(300, fx.IMG, fx.TXT, seed=58)
    client.push_pairs(pairs[:100])
    _indexer(cfg, r, "first").run(until_idle=True)  # segment 1: 100 rows
    before = _manifest(r, keys)

    # The stale indexer leads, reads the next 100 entries and pauses before merging them with
    # segment 1, past its lease.
    stale = _indexer(cfg, r, "stale")
    client.push_pairs(pairs[100:200])
    _lead(stale)
    assert stale.step() == 100
    wait_for(lambda: r.get(stale.lease.key) is None, 10, "the stale indexer's lease to lapse")

    # Its successor takes over, merges segment 1 with the same entries and deletes it.
    successor = _indexer(cfg, r, "successor")
    _lead(successor)
    assert successor.step() == 100
    successor.commit()
    after = _manifest(r, keys)
    gone = before.segments[0]
    assert [s.rows for s in after.segments] == [200] and gone not in after.segments
    assert open_store(cfg, r).read_blob(SEGMENTS, gone.seq, gone.sha) is None

    # The stale indexer resumes: segment 1 is missing, but it no longer holds the lease.
    with pytest.raises(LeaseLost):
        stale.commit()
    assert CorruptSegments(r, keys).read() == {}
    assert _health(cfg, r) == (GalleryHealth(), 200)
    assert _manifest(r, keys) == after

    # The lease holder still records a segment that really is corrupt, with its rows.
    merged = after.segments[0]
    _spoil(cfg, r, merged)
    client.push_pairs(pairs[200:])
    assert successor.step() == 100
    successor.commit()
    assert CorruptSegments(r, keys).read() == {CorruptSegments.field(merged): 200}
    assert [s.rows for s in _manifest(r, keys).segments] == [100]
    health, served = _health(cfg, r)
    assert health == GalleryHealth(degraded=True, corrupt_segments=[merged.seq], rows_lost=200)
    assert served == 100


def test_a_reader_without_the_lease_records_only_a_listed_segment(
    r: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    """An API records a segment only while the manifest lists it: one the indexer merged away
    (and deleted) after the API read the manifest is not corrupt; a listed one that is gone
    is."""
    cfg = _config(settings, "redis", tmp_path)
    keys = Keys(cfg.namespace)
    client = StreamProducer(r, cfg.namespace)
    pairs = fx.class_stream(200, fx.IMG, fx.TXT, seed=59)
    indexer = _indexer(cfg, r, "indexer")
    client.push_pairs(pairs[:100])
    indexer.run(until_idle=True)
    gone = _manifest(r, keys).segments[0]
    client.push_pairs(pairs[100:])
    indexer.run(until_idle=True)  # merges segment 1 away
    corrupt = CorruptSegments(r, keys)
    assert not corrupt.record(gone, gone.rows)
    assert corrupt.read() == {}

    listed = _manifest(r, keys).segments[0]
    r.delete(keys.checkpoint_blob(SEGMENTS, listed.seq))  # lost while listed
    assert corrupt.record(listed, listed.rows)
    assert corrupt.record(listed, listed.rows)  # once: the second finds it recorded
    assert corrupt.read() == {CorruptSegments.field(listed): 200}
