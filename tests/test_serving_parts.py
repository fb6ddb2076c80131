"""The model server's parts on their own, against a real Redis and a real checkpoint store: the
served versions (hot swap, lag), the gallery follower (the stream, then segments), and the
pinned versions (an LRU of kept versions, refusing corrupt ones)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.heads import PowerFeatures, RbfFeatures
from streamxm.service import build_indexer, build_worker, open_store
from streamxm.serving.following import GalleryFollower
from streamxm.serving.gallery import Gallery, GalleryChunk
from streamxm.serving.pins import PinnedVersions
from streamxm.serving.served import EmbeddedGallery, SearchAnswer, SearchQuery
from streamxm.serving.server import ModelServer
from streamxm.serving.shard import GalleryShard
from streamxm.serving.versions import ServedVersions
from streamxm.storage.checkpoint import Checkpoint, VersionUnreadable
from streamxm.storage.segments import read_manifest
from streamxm.storage.slots import ShardPart
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits, Pair, make_pair
from streamxm.stream.producer import StreamProducer
from tests.conftest import class_stream, latest, two_versions, wait_for
from tests.test_model_contract import SMALL


def _learned(settings: Settings, r: redis.Redis, pairs: int, keep: int = 10) -> Settings:
    cfg = settings.model_copy(update={"checkpoint_keep": keep})
    data = class_stream(pairs, 8, 4, seed=3)
    for start in range(0, pairs, 100):  # a version per 100 pairs
        StreamProducer(r, cfg.namespace).push_pairs(data[start : start + 100])
        build_worker(cfg, r, "cmos").run(until_idle=True)
    return cfg


def test_served_versions_swap_to_the_newest_and_report_lag(
    settings: Settings, r: redis.Redis
) -> None:
    cfg = _learned(settings, r, 200)
    store = open_store(cfg, r)
    versions = ServedVersions(store)
    follower = GalleryFollower(r, store, Keys(cfg.namespace), 1000, Limits(), 500)
    follower.read()
    versions.follow({"cmos"}, lambda: follower.gallery)
    served = versions.served["cmos"]
    newest = latest(cfg, r)
    newest.flush()
    assert served.version == store.head("cmos")["version"]  # type: ignore[index]
    probe = np.random.default_rng(0).random((3, 8), dtype=np.float32)
    texts = np.random.default_rng(1).random((5, 4), dtype=np.float32)
    np.testing.assert_array_equal(
        served.model.similarity(probe, texts), newest.model.similarity(probe, texts)
    )
    assert versions.lag(served) == 0.0
    versions.newest["cmos"] = (served.version + 1, 0.0)  # a newer checkpoint, long ago
    assert versions.lag(served) > 0


def test_the_gallery_follower_reads_the_stream_then_the_segments(
    settings: Settings, r: redis.Redis
) -> None:
    pairs = class_stream(300, 8, 4, seed=4)
    StreamProducer(r, settings.namespace).push_pairs(pairs[:200])
    store = open_store(settings, r)
    follower = GalleryFollower(r, store, Keys(settings.namespace), 1000, Limits(), 64)
    assert follower.read() and len(follower.gallery) == 200  # no indexer: the stream itself
    build_indexer(settings, r).run(until_idle=True)
    StreamProducer(r, settings.namespace).push_pairs(pairs[200:])
    assert follower.read()
    assert len(follower.gallery) == 300  # the segments, then the stream after them
    ids = follower.gallery.ids_at(np.arange(300, dtype=np.int64))
    assert sorted(ids) == sorted(p.id for p in pairs)
    assert not follower.read()  # nothing new


def test_shard_followers_decode_only_their_part_of_the_stream(
    settings: Settings, r: redis.Redis
) -> None:
    """Two shards' followers split the stream's items between them; an entry whose item is
    another shard's is not decoded (its broken vector is not counted here), one without a
    readable id is refused by both."""
    pairs = class_stream(120, 8, 4, seed=5)
    keys = Keys(settings.namespace)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    parts = [ShardPart(0, 2), ShardPart(1, 2)]
    owner = parts[0] if parts[0].holds(["broken"])[0] else parts[1]
    r.xadd(keys.pairs, {b"v": b"1", b"id": b"broken", b"img": b"xx", b"txt": b"yy"})
    r.xadd(keys.pairs, {b"v": b"1", b"img": b"xx", b"txt": b"yy"})  # no id
    store = open_store(settings, r)
    held = []
    for part in parts:
        follower = GalleryFollower(r, store, keys, 1000, Limits(), 64, part=part)
        assert follower.read()
        ids = follower.gallery.ids_at(np.arange(len(follower.gallery), dtype=np.int64))
        assert part.holds(ids).all()
        assert follower.gallery_skipped == (2 if part == owner else 1)
        held.append(set(ids))
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == {p.id for p in pairs}
    assert all(held)  # each shard holds a part, not none


def test_shard_followers_read_only_the_segments_of_their_part(
    settings: Settings, r: redis.Redis
) -> None:
    """With segments written per part (four parts, two shards), a shard never reads another
    shard's segments: with those blobs gone from the store it still holds its whole part,
    retired rows included, and records nothing corrupt; a follower of the whole gallery holds
    what the shards hold together."""
    cfg = settings.model_copy(update={"gallery_parts": 4, "gallery_max": 250})
    pairs = class_stream(300, 8, 4, seed=6)
    keys = Keys(cfg.namespace)
    indexer = build_indexer(cfg, r)
    for start in range(0, 300, 60):  # several commits: merges within each part, then the cap
        StreamProducer(r, cfg.namespace).push_pairs(pairs[start : start + 60])
        indexer.run(until_idle=True)
    manifest = read_manifest(r, keys)
    assert manifest is not None and manifest.rows == 250
    assert {ref.part for ref in manifest.segments} == {0, 1, 2, 3}
    assert any(ref.skip for ref in manifest.segments)  # the cap cut into a part's segment
    store = open_store(cfg, r)
    whole = GalleryFollower(r, store, keys, 1000, Limits(), 64)
    assert whole.read()
    every = set(whole.gallery.ids_at(np.arange(len(whole.gallery), dtype=np.int64)))
    assert every == {p.id for p in pairs[50:]}
    blobs = {ref: r.get(keys.checkpoint_blob("_gallery", ref.seq)) for ref in manifest.segments}
    held = []
    for shard in (ShardPart(0, 2), ShardPart(1, 2)):
        for ref, blob in blobs.items():  # the other shard's segments are gone
            blob_key = keys.checkpoint_blob("_gallery", ref.seq)
            r.set(blob_key, blob) if shard.meets(ref.slots) else r.delete(blob_key)
        follower = GalleryFollower(r, store, keys, 1000, Limits(), 64, part=shard)
        assert follower.read() and not follower.corrupt_segments
        held.append(set(follower.gallery.ids_at(np.arange(len(follower.gallery)))))
        assert held[-1] == {i for i in every if shard.holds([i])[0]}
    assert held[0] | held[1] == every


class _CountedPower(PowerFeatures):
    """The power map, counting the rows it computes."""

    computed: list[int]

    def apply(self, x: np.ndarray) -> np.ndarray:
        self.computed.append(len(x))
        return super().apply(x)


def _features(gallery: Gallery, fmap: PowerFeatures) -> np.ndarray:
    return np.vstack([c.features("image", fmap) for c in gallery.chunks])


def test_rows_moving_into_segments_keep_their_features(settings: Settings, r: redis.Redis) -> None:
    """A model's kept features (sdsrl's kernel rows) follow the rows from the stream tail into
    the indexer's segments and through merges; only rows the snapshot did not hold, or held
    with other vectors under the same id, are computed."""
    pairs = class_stream(300, 8, 4, seed=5)
    client = StreamProducer(r, settings.namespace)
    store = open_store(settings, r)
    follower = GalleryFollower(r, store, Keys(settings.namespace), 1000, Limits(), 64)
    fmap = _CountedPower(0.5)
    object.__setattr__(fmap, "computed", [])
    indexer = build_indexer(settings, r)
    client.push_pairs(pairs[:100])
    indexer.run(until_idle=True)
    follower.read()
    client.push_pairs(pairs[100:200])
    follower.read()  # the segment, then 100 rows of the stream tail
    _features(follower.gallery, fmap)
    assert sum(fmap.computed) == 200
    # The indexer merges the tail's rows into the segment; one more pair the follower has not
    # seen, and one that repeats an id with other vectors.
    again = make_pair(pairs[10].id, pairs[20].img, pairs[20].txt, labels=[0])
    client.push_pairs([pairs[200], again])
    indexer.run(until_idle=True)
    fmap.computed.clear()
    assert follower.read() and len(follower.gallery) == 202
    got = _features(follower.gallery, fmap)
    assert sum(fmap.computed) == 2  # the unseen pair and the repeated id
    units = np.vstack([c.unit("image") for c in follower.gallery.chunks])
    np.testing.assert_array_equal(got, fmap(units))


def test_a_segment_merged_away_meanwhile_is_not_taken_for_corrupt(
    settings: Settings, r: redis.Redis
) -> None:
    """An API that read the manifest just before the indexer merged a segment into a larger one
    (and deleted it) finds the segment gone: it opens the newer manifest instead of recording
    the segment corrupt and dropping its rows."""
    pairs = class_stream(300, 8, 4, seed=7)
    client = StreamProducer(r, settings.namespace)
    keys = Keys(settings.namespace)
    indexer = build_indexer(settings, r)
    client.push_pairs(pairs[:100])
    indexer.run(until_idle=True)
    before = read_manifest(r, keys)
    client.push_pairs(pairs[100:])
    indexer.run(until_idle=True)
    after = read_manifest(r, keys)
    assert before is not None and after is not None
    assert before.segments[0] not in after.segments  # merged away, its blob deleted
    follower = GalleryFollower(r, open_store(settings, r), keys, 1000, Limits(), 64)
    assert not follower._open(before)
    assert follower.read() and len(follower.gallery) == 300
    assert not follower.corrupt_segments and follower.gallery_corrupt == {}


def test_a_raw_vector_index_carries_the_embeddings_of_rows_it_holds() -> None:
    """A chunk made of rows the index embedded (segments merged, the tail moved into one)
    takes their embeddings; only its new rows pass through the model (sam's towers)."""
    pairs = class_stream(300, 8, 4, seed=6)
    learner = StreamLearner("sam", 8, 4, SMALL["sam"], seed=0)
    learner.learn(pairs[:200])
    learner.flush()
    kind = learner.model.embedding()
    assert kind.reembeds_raw_vectors and kind.head("image") is None  # sam's towers

    def chunk(rows: list[Pair]) -> GalleryChunk:
        return GalleryChunk.of(
            np.array([p.id for p in rows]),
            np.vstack([p.img for p in rows]),
            np.vstack([p.txt for p in rows]),
        )

    old = [chunk(pairs[:100]), chunk(pairs[100:150])]
    index = EmbeddedGallery.build(1, kind, Gallery(tuple(old)))
    embedded: list[int] = []
    embed_images = kind.embed_images

    def counted(x: np.ndarray) -> np.ndarray:
        embedded.append(len(x))
        return embed_images(x)

    object.__setattr__(kind, "embed_images", counted)
    merged = GalleryChunk.joined([*old, chunk(pairs[150:160])])
    covered = index.covering(Gallery((merged,)))
    assert sum(embedded) == 10
    fresh = EmbeddedGallery.build(1, learner.model.embedding(), Gallery((merged,)))
    for modality in ("image", "text"):
        np.testing.assert_allclose(
            covered.blocks(modality)[0], fresh.blocks(modality)[0], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_array_equal(
            covered.blocks(modality)[0][:150], np.vstack(index.blocks(modality))
        )


def test_cmomks_builds_a_new_version_index_from_the_earlier_versions_rows() -> None:
    """cmomks's next index recomputes only the support slots written since the version whose
    index the server holds, for the chunks that index has (a new chunk is computed whole), and
    ranks as the new version's own index built from nothing."""
    pairs = class_stream(400, 8, 4, seed=6)
    params = {"landmarks": 20, "budget": 60, "triplets_per_pair": 2}
    earlier, later = two_versions("cmomks", pairs, params, 150, 10)

    def chunk(rows: list[Pair]) -> GalleryChunk:
        return GalleryChunk.of(
            np.array([p.id for p in rows]),
            np.vstack([p.img for p in rows]),
            np.vstack([p.txt for p in rows]),
        )

    held = chunk(pairs[200:300])
    index = EmbeddedGallery.build(1, earlier.embedding(), Gallery((held,)))
    gallery = Gallery((held, chunk(pairs[300:])))
    computed: list[int] = []
    index_rows = later.index_rows

    def counted(modality: str, x: np.ndarray) -> np.ndarray:
        computed.append(len(x))
        return index_rows(modality, x)

    object.__setattr__(later, "index_rows", counted)
    since = EmbeddedGallery.build(2, later.embedding(), gallery, index)
    assert computed == [100, 100]  # the new chunk's rows, both modalities: the held one updated
    fresh = EmbeddedGallery.build(2, later.embedding(), gallery)
    for modality in ("image", "text"):
        for got, want in zip(since.blocks(modality), fresh.blocks(modality), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(since.blocks(modality)[0], index.blocks(modality)[0])
    query = later.index_query("image", pairs[5].img[None, :])[0]
    np.testing.assert_allclose(
        since.blocks("text")[0] @ query,
        later.similarity(pairs[5].img[None, :], np.vstack([p.txt for p in pairs[200:300]]))[0],
        rtol=1e-4,
        atol=1e-5,
    )


def test_pinned_versions_keep_the_most_recent_few_and_refuse_a_corrupt_one(
    settings: Settings, r: redis.Redis
) -> None:
    cfg = _learned(settings, r, 400)
    store = open_store(cfg, r)
    kept = sorted(store.kept_versions("cmos"))
    assert len(kept) >= 4
    pins = PinnedVersions(store, capacity=2)
    for version in kept[:3]:
        pinned = pins.load("cmos", version)
        ckpt = store.load_kept("cmos", version)
        restored = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
        restored.flush()
        probe = np.ones((1, 8), dtype=np.float32)
        np.testing.assert_array_equal(
            pinned.model.similarity(probe, np.eye(4, dtype=np.float32)),
            restored.model.similarity(probe, np.eye(4, dtype=np.float32)),
        )
    assert ("cmos", kept[0]) not in pins and ("cmos", kept[2]) in pins  # oldest evicted
    assert pins.cached("cmos", kept[1]) is not None
    r.set(Keys(cfg.namespace).checkpoint_blob("cmos", kept[3]), b"garbage")
    with pytest.raises(VersionUnreadable, match="kept but unreadable"):
        pins.load("cmos", kept[3])


def _commit(cfg: Settings, r: redis.Redis, learner: StreamLearner, version: int) -> None:
    learner.flush()
    arrays, meta = learner.state()
    open_store(cfg, r).commit(learner.model_name, Checkpoint(version, arrays, meta), {})
    r.sadd(Keys(cfg.namespace).models, learner.model_name)


def _exact_top(model: object, query: np.ndarray, items: np.ndarray, k: int) -> list[int]:
    scores = model.similarity(query[None, :], items)[0]  # type: ignore[attr-defined]
    return np.argsort(-scores, kind="stable")[:k].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("wait", [False, True])
def test_a_raw_vector_model_embeds_a_new_version_on_the_index_thread(
    settings: Settings, r: redis.Redis, wait: bool
) -> None:
    """sam's new version is embedded by the index thread, not the version thread. Waiting for
    its index (the default), the earlier version answers until then; not waiting, the new
    version answers at once from the earlier version's index (the answer names it), scored by
    the new version. Either way it ends as the new version's exact ranking."""
    pairs = class_stream(300, 8, 4, seed=8)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    learner = StreamLearner("sam", 8, 4, SMALL["sam"], seed=0)
    learner.learn(pairs[:100])
    _commit(settings, r, learner, 1)
    server = ModelServer(r, open_store(settings, r), settings.namespace, wait_for_index=wait)
    server.refresh()
    assert server.served["sam"].index_version == 1
    learner.learn(pairs[100:300])
    _commit(settings, r, learner, 2)
    server.refresh_versions()
    served = server.served["sam"]
    assert (served.version, served.index_version) == ((1, 1) if wait else (2, 1))
    texts = np.vstack([p.txt for p in pairs])
    ids = np.array([p.id for p in pairs])
    query = pairs[17].img.astype(np.float32)
    answer = server.search("sam", "image", query, k=10)
    assert (answer.served.version, answer.index_version) == (served.version, 1)
    hits = dict(answer.hits)
    held = np.isin(ids, list(hits))
    np.testing.assert_allclose(
        [hits[i] for i in ids[held]],
        served.model.similarity(query[None, :], texts)[0][held],
        rtol=1e-5,
        atol=1e-6,
    )
    assert server.searcher.earlier_index_scans == (0 if wait else 1)
    server.refresh_index()
    served = server.served["sam"]
    assert (served.version, served.index_version) == (2, 2)
    answer = server.search("sam", "image", query, k=10)
    assert answer.index_version == 2
    assert [h[0] for h in answer.hits] == ids[_exact_top(served.model, query, texts, 10)].tolist()


def test_float16_kernel_rows_are_joined_and_carried_only_beside_their_kind() -> None:
    """Chunks merging keep their kernel rows when all keep the same kind (float32, or float16
    as a large gallery keeps them); float32 beside float16 is never concatenated (the float16
    rows are complements, 1 - k) but computed again for the merged chunk, in the kind asked."""
    rng = np.random.default_rng(2)
    landmarks = rng.random((30, 8))
    fmap = RbfFeatures(None, landmarks / np.linalg.norm(landmarks, axis=1, keepdims=True), 0.5)

    def chunk(at: int) -> GalleryChunk:
        return GalleryChunk.of(
            np.array([f"p{i}" for i in range(at, at + 50)]),
            rng.random((50, 8), dtype=np.float32),
            rng.random((50, 4), dtype=np.float32),
        )

    a, b, c = chunk(0), chunk(50), chunk(100)
    assert a.kept_error("image", fmap) == 0.0  # float32, as a small gallery keeps them
    kinds = [
        a.features("image", fmap, compact=True),
        b.features("image", fmap, compact=True),
        c.features("image", fmap),
    ]
    assert [k.dtype for k in kinds] == [np.float16, np.float16, np.float32]
    assert a.kept_error("image", fmap) > 0.0  # the bound of the rows it keeps now
    same = GalleryChunk.joined([a, b])
    assert (("image", *fmap.key)) in same.feature_keys()
    np.testing.assert_array_equal(same.features("image", fmap), np.vstack(kinds[:2]))
    mixed = GalleryChunk.joined([b, c])
    assert not mixed.feature_keys()
    rows = mixed.features("image", fmap, compact=True)
    assert rows.dtype == np.float16
    np.testing.assert_array_equal(rows, fmap.keep(fmap(mixed.unit("image"))))
    carried = GalleryChunk.joined([a, c])  # as a merge's new chunk: rows from both donors
    assert carried.carry_features(Gallery((a, c))) == 0  # no key both keep in one kind
    assert carried.carry_features(Gallery((a, b))) == 50  # a's rows, float16 as a keeps them
    assert carried.features("image", fmap).dtype == np.float16


def test_concurrent_searches_make_a_chunks_scanned_blocks_once() -> None:
    """Searches that meet a chunk's blocks unmade at the same time wait for one build: every
    thread gets the same block, and the snapshot hands all of them one tuple."""
    rng = np.random.default_rng(4)
    unit = rng.random((5000, 64)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    ids = np.array([f"0-{i}" for i in range(5000)])
    ones = np.ones(5000, dtype=np.float32)
    gallery = Gallery((GalleryChunk(ids, unit, unit, ones, ones),))
    start = threading.Barrier(8)

    def build(_: int) -> tuple[object, object]:
        start.wait()
        return gallery.chunks[0].index("image"), gallery.blocks("image")

    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(build, range(8)))
    assert len({id(block) for block, _ in made}) == 1
    assert len({id(blocks) for _, blocks in made}) == 1


def test_a_shard_makes_a_fixed_space_versions_scanned_blocks_before_serving_it(
    settings: Settings, r: redis.Redis
) -> None:
    """A fixed-space version (cmos) scans the part's unit rows: the shard makes their blocks
    when it applies the version, so its first searches do not."""
    cfg = _learned(settings, r, 200)
    store = open_store(cfg, r)
    shard = GalleryShard(r, store, Keys(cfg.namespace), ShardPart(0, 2))
    shard.refresh()
    assert shard.caught_up and len(shard.gallery) > 0
    assert not shard.gallery._blocks  # type: ignore[attr-defined]
    ckpt = store.load_latest("cmos")
    assert ckpt is not None
    shard.apply("cmos", ckpt.version, (ckpt.arrays, ckpt.meta))
    assert set(shard.gallery._blocks) == {"image", "text"}  # type: ignore[attr-defined]


def test_a_batch_of_searches_on_one_thread_answers_as_each_search_alone(
    settings: Settings, r: redis.Redis
) -> None:
    """``Searcher.search_many`` (how a shard answers the API's batches) gives each query the
    answer ``search`` gives it alone, for a fixed space (cmos), an embedded index (sdsrl) and
    an ensemble of both, with ``k`` and modalities mixed; an unknown model's error is that
    query's answer and the others are answered."""
    cfg = _learned(settings, r, 200)
    build_worker(cfg, r, "sdsrl").run(until_idle=True)
    server = ModelServer(r, open_store(cfg, r), cfg.namespace)
    server.refresh()
    wait_for(lambda: (server.refresh(), "sdsrl" in server.served)[1], 60, "sdsrl served")
    rng = np.random.default_rng(9)
    queries = [
        SearchQuery(name, modality, rng.random(8 if modality == "image" else 4).astype("f4"), k)
        for name in ("cmos", "sdsrl", "ensemble:cmos+sdsrl")
        for modality in ("image", "text")
        for k in (1, 7)
    ]
    queries.insert(3, SearchQuery("nope", "image", queries[0].vector, 5))
    together = server.searcher.search_many(queries)
    assert isinstance(together[3], Exception)
    with pytest.raises(type(together[3])):
        server.searcher.search(queries[3])
    for query, answer in zip(queries, together, strict=True):
        if query.name == "nope":
            continue
        alone = server.searcher.search(query)
        assert isinstance(answer, SearchAnswer) and answer.hits == alone.hits
    server.stop()
