"""Serving: the newest checkpoint of every model, hot-swapped, and a search gallery kept from
the pairs stream.

Two background threads do all the writing: :meth:`ModelServer.refresh` reads new pairs into
the gallery and loads new checkpoint versions, :meth:`ModelServer.reembed` rebuilds the gallery
index of models without a fixed space at a bounded rate. Readers take a reference to an
immutable :class:`ServedModel` and :class:`Gallery` and never lock, so a query sees one model
version, never half of a swap.

Search never re-embeds the gallery per version. The gallery keeps its vectors once, as unit
rows plus norms (:class:`GalleryChunk`). A model whose score is bilinear in the unit rows
(``fixed_space``: cmos, pairwise, pairwise:bipartite) moves the *query* into the target
modality's unit rows with the served version, O(model), and the rows are the index. The other
models search an index of embeddings made by some version (:class:`EmbeddedGallery`), rebuilt
in the background; either way the candidates are re-ranked by the served version exactly, so
scores are :meth:`ModelServer.similarity`'s and ties keep gallery order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm.learning.learner import StreamLearner
from streamxm.learning.stats import WorkerStats
from streamxm.models import DIRECTIONS, CrossModalModel, split_name
from streamxm.models.ensemble import (
    REFERENCE_ITEMS,
    Ensemble,
    EnsembleSpec,
    is_ensemble,
    member_scores,
    parse_ensemble,
)
from streamxm.serving.champion import ChampionRule, Evidence
from streamxm.serving.gallery import CHUNK_MAX, Gallery, GalleryChunk, merge_count
from streamxm.serving.index import Block, Int8Block, QueryCoalescer, index_block
from streamxm.storage.checkpoint import CheckpointStore
from streamxm.storage.segments import CorruptSegments, Manifest, open_segment, read_manifest
from streamxm.stream.client import decode_entries
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits
from streamxm.stream.redis_conn import str_hash, str_set, stream_entries, text
from streamxm.stream.retention import entry_id_key

__all__ = ["AUTO", "EmbeddedGallery", "EnsembleUnsupported", "InvalidModelName", "ModelNotReady",
           "ModelServer", "SameModalityUnsupported", "SearchAnswer", "ServedEnsemble",
           "ServedModel", "UnknownModel", "other_modality"]

log = logging.getLogger(__name__)


class InvalidModelName(ValueError):
    """A name that is no model at all (not merely one without a learner here)."""


class UnknownModel(LookupError):
    """No learner of this model exists in the namespace."""


class ModelNotReady(LookupError):
    """The model exists (or the server has not looked yet) but no checkpoint is loaded."""


#: The model name that answers with the champion of the query's direction.
AUTO = "auto"


def direction_of(modality: str) -> str:
    """The retrieval direction of a query: ``"i2t"`` for image queries, ``"t2i"`` for text."""
    return "i2t" if modality == "image" else "t2i"


def other_modality(modality: str) -> Literal["image", "text"]:
    """``"image"`` <-> ``"text"``: the default search target of a query."""
    return "text" if modality == "image" else "image"


class SameModalityUnsupported(ValueError):
    """A same-modality search on a model without a shared embedding space."""


class EnsembleUnsupported(ValueError):
    """A query option an ensemble does not take (``field`` names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, eq=False)
class EmbeddedGallery:
    """The gallery embedded by one model version: the search index of the models without a
    fixed space (candidates from it are re-ranked exactly by the newest version)."""

    version: int
    model: CrossModalModel
    # chunk -> (image embeddings, text embeddings) as the backend scans them, in gallery order
    embedded: tuple[tuple[GalleryChunk, Block, Block], ...]
    #: The gallery snapshot of exactly these chunks (what the index's rows refer to).
    gallery: Gallery = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_blocks", {
            "image": tuple(a for _, a, _ in self.embedded),
            "text": tuple(b for _, _, b in self.embedded)})
        object.__setattr__(self, "gallery", Gallery(tuple(c for c, _, _ in self.embedded)))

    def blocks(self, modality: str) -> tuple[Block, ...]:
        return self._blocks[modality]  # type: ignore[attr-defined,no-any-return]

    def covers(self, gallery: Gallery) -> bool:
        """Whether this index is over exactly ``gallery``'s chunks (nothing to embed)."""
        return len(self.embedded) == len(gallery.chunks) and all(
            c is e[0] for c, e in zip(gallery.chunks, self.embedded, strict=True))

    def covering(self, gallery: Gallery) -> EmbeddedGallery:
        """The same version over ``gallery``: chunks it has keep their embeddings, new ones
        are embedded now (O(new rows))."""
        if self.covers(gallery):
            return self  # the common case on the query path: nothing to build
        known = {id(c): (c, a, b) for c, a, b in self.embedded}
        return EmbeddedGallery(self.version, self.model, tuple(
            known.get(id(c)) or _embed(self.model, c) for c in gallery.chunks))

    @classmethod
    def build(cls, version: int, model: CrossModalModel, gallery: Gallery) -> EmbeddedGallery:
        return cls(version, model, tuple(_embed(model, c) for c in gallery.chunks))


def _embed(model: CrossModalModel, chunk: GalleryChunk) -> tuple[GalleryChunk, Block, Block]:
    return (chunk, index_block(model.embed_images(chunk.raw("image")).astype(np.float32)),
            index_block(model.embed_texts(chunk.raw("text")).astype(np.float32)))


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One model version; for a model without a fixed space also the newest gallery index
    embedded by some version (possibly older: it only proposes candidates)."""

    name: str
    version: int
    model: CrossModalModel
    head: dict[str, Any]
    loaded_at: float
    index: EmbeddedGallery | None = None
    gallery_items: int = 0

    @property
    def gallery_size(self) -> int:
        return self.gallery_items

    @property
    def versions(self) -> dict[str, int]:
        return {self.name: self.version}


@dataclass(frozen=True, eq=False)
class ServedEnsemble:
    """An ensemble (:mod:`streamxm.models.ensemble`) of the served version of each member: it
    has no version of its own (``version`` is None; ``versions`` has the members')."""

    spec: EnsembleSpec
    members: tuple[ServedModel, ...]
    version: None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def versions(self) -> dict[str, int]:
        return {m.name: m.version for m in self.members}

    @property
    def fused(self) -> Ensemble:
        return Ensemble(self.spec, {m.name: m.model for m in self.members})


@dataclass(frozen=True)
class SearchAnswer:
    """What :meth:`ModelServer.search` found: hits best first, and how fresh the answer is."""

    served: ServedModel | ServedEnsemble
    hits: list[tuple[str, float]]
    #: Seconds since a newer checkpoint than the served one was written (0 when none is; an
    #: ensemble's: its most lagging member's).
    version_lag_s: float
    #: Version whose gallery index proposed the candidates (the served one on a fixed space;
    #: None for an ensemble, whose members each propose theirs).
    index_version: int | None


#: A reduced-precision (int8 or bfloat16) scan of a fixed space proposes at least one candidate
#: per this many gallery rows (400 at 1,000,000). The rows whose scores the error bound cannot
#: tell from the k-th best lie in a band of fixed width, so their number grows with the
#: gallery; with 100 candidates at 1M, 15% of searches in ``bench query`` could not be proven
#: complete and paid a float32 pass (0.15-0.27 s at 512 dimensions). With chunks offering half
#: the re-ranked count and the grouped selection of
#: :func:`~streamxm.serving.index.top_k_bounded`, 400 cost no more per bfloat16 pass than a
#: plain top 100 did.
_ROWS_PER_PROOF_CANDIDATE = 2_500


def proof_candidates(gallery_rows: int, wanted: int, int8: bool = False) -> int:
    """Candidates a reduced-precision scan of a fixed space proposes for ``wanted`` re-ranked
    ones; at least twice ``wanted`` from an int8 scan, whose error bound is ~1.6 times as wide
    as bfloat16's (at 100k, ``bench query`` with 100 int8 candidates sent 3,125 of 11,330
    searches to the float32 pass, with 200 none).

    >>> proof_candidates(100_000, 100), proof_candidates(1_000_000, 100), proof_candidates(50, 100)
    (100, 400, 50)
    >>> proof_candidates(100_000, 100, int8=True), proof_candidates(1_000_000, 100, int8=True)
    (200, 400)
    """
    floor = 2 * wanted if int8 else wanted
    return min(gallery_rows, max(floor, -(-gallery_rows // _ROWS_PER_PROOF_CANDIDATE)))


def _exact_blocks(blocks: Any) -> bool:
    return all(isinstance(b, np.ndarray) for b in blocks)


def _proven_complete(ceiling: float, units: NDArray[np.float32], query: NDArray[np.float32],
                     k: int, blocks: Any) -> bool:
    """Whether candidates from a reduced-precision scan surely hold the exact top ``k`` of the
    unit rows against ``query``.

    No row left out scores above ``ceiling`` exactly (:func:`top_k_bounded` raises every scan
    score by its backend's error bound): when the exact k-th best candidate is above it,
    nothing left out can enter the top ``k``.
    """
    if ceiling == -np.inf or _exact_blocks(blocks):
        return True  # nothing left out, or float32 blocks: the scan itself was exact
    exact = units.astype(np.float64) @ query.astype(np.float64)
    if len(exact) < k:
        return False
    kth = np.partition(exact, len(exact) - k)[len(exact) - k]
    return bool(kth > ceiling)


def _exact_scores(model: CrossModalModel, modality: str, target: str,
                  query: NDArray[np.float32], items: NDArray[np.float32]) -> NDArray[np.float64]:
    """The served version's own scores of one query against candidate items."""
    if modality == "image" and target == "text":
        return np.asarray(model.similarity(query[None, :], items)[0], dtype=np.float64)
    if modality == "text" and target == "image":
        return np.asarray(model.similarity(items, query[None, :])[:, 0], dtype=np.float64)
    embed = model.embed_images if modality == "image" else model.embed_texts
    scores = embed(items).astype(np.float64) @ embed(query[None, :]).astype(np.float64)[0]
    return np.asarray(scores, dtype=np.float64)


class ModelServer:
    """Keeps the served models and the gallery current, and answers queries.

    Parameters
    ----------
    client
        Redis client.
    store
        Checkpoint store the workers write to.
    namespace
        Stream namespace.
    gallery_max
        Gallery size cap (items).
    reembed_seconds
        Least time between two re-embeddings of the whole gallery for one model without a
        fixed space (sam, cmomks, cca, scsm, sdsrl, pairwise:marginal): the bound on what new
        versions cost. Between them the last index proposes candidates and the served version
        re-ranks them exactly.
    candidates
        Candidates re-ranked per query: ``max(candidates, 4 k)``.
    champion
        The rule that picks who answers ``model: "auto"`` (:mod:`streamxm.serving.champion`).
    """

    def __init__(self, client: redis.Redis, store: CheckpointStore, namespace: str = "default",
                 gallery_max: int = 100_000, limits: Limits = Limits(),
                 read_count: int = 5000, reembed_seconds: float = 10.0,
                 candidates: int = 100, champion: ChampionRule | None = None) -> None:
        self.r = client
        self.store = store
        self.keys = Keys(namespace)
        self.gallery_max = gallery_max
        self.limits = limits
        self.read_count = read_count
        self.reembed_seconds = reembed_seconds
        self.candidates = candidates
        self.gallery = Gallery()
        self.served: dict[str, ServedModel] = {}
        self.newest: dict[str, tuple[int, float]] = {}  # model -> (head version, created)
        self.last_gallery_id = "0-0"
        self.gallery_skipped = 0
        self.known: frozenset[str] = frozenset()  # models registered in the namespace
        self.refreshed = False  # one full refresh done: until then every model is "not ready"
        # Head version last tried per model: a corrupt newest version (served: the previous
        # good one) is tried once, not on every refresh.
        self._attempted: dict[str, int] = {}
        self._reembed_after: dict[str, float] = {}  # model -> monotonic time of the next
        # With a gallery indexer: the manifest revision in use, its open segments and the
        # chunks made of them (the first one sliced by the manifest's skip).
        self._revision: int | None = None
        self._segments: dict[tuple[int, str], GalleryChunk] = {}
        self._sliced: dict[tuple[int, str, int], GalleryChunk] = {}
        self._segment_chunks: tuple[GalleryChunk, ...] = ()
        # Segments found corrupt (seq, sha) -> rows lost: never read again; the gallery is
        # served without them (degraded) and the namespace's record counts every one.
        self.corrupt_segments: dict[tuple[int, str], int] = {}
        self._corrupt = CorruptSegments(client, self.keys)
        #: The namespace's record of corrupt segments (``<seq>:<sha>`` -> rows lost): the
        #: gallery is degraded while it is not empty.
        self.gallery_corrupt: dict[str, int] = {}
        self._tail: list[tuple[GalleryChunk, list[str]]] = []  # rows after them, entry ids
        self._swap = threading.Lock()  # writers of self.served (refresh and re-embed threads)
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.coalescer = QueryCoalescer()
        #: The champion per direction: who answers ``model: "auto"`` (updated every refresh).
        self.champion = champion or ChampionRule()
        # Pinned versions loaded for queries that name one, most recently used last.
        self._pins: OrderedDict[tuple[str, int], ServedModel] = OrderedDict()
        self.pins_max = 4
        self._pins_lock = threading.Lock()  # the event loop and the query threads share it
        #: Searches whose reduced-precision candidates could not be proven complete and were
        #: answered by a float32 scan instead.
        self.exact_scans = 0

    # -- background work -----------------------------------------------------------------------
    def start(self, interval: float = 0.25) -> None:
        def every(step: Callable[[], None], pause: float) -> Callable[[], None]:
            def loop() -> None:
                while not self._stop.is_set():
                    try:
                        step()
                    except redis.RedisError as exc:
                        log.warning("%s failed (will retry): %s", step.__name__, exc)
                    except Exception:  # the thread must outlive any one bad checkpoint
                        log.exception("%s failed (will retry)", step.__name__)
                    self._stop.wait(pause)
            return loop

        for name, step in (("refresh", self.refresh), ("reembed", self.reembed)):
            thread = threading.Thread(target=every(step, interval), name=f"streamxm-{name}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self.coalescer.close()

    def refresh(self) -> None:
        """Load new checkpoint versions, then read new gallery rows (a bounded amount per call,
        so a long gallery read never holds back a new version)."""
        names = str_set(self.r.smembers(self.keys.models))
        self.known = frozenset(names)
        for name in names:
            head = self.store.head(name)
            if head is None:
                continue
            self.newest[name] = (int(head["version"]), float(head.get("created", time.time())))
            if head["version"] != self._attempted.get(name):
                self._attempted[name] = head["version"]
                self._load(name)
        self._judge()
        if self._read_gallery():
            for name in list(self.served):
                self._cover_gallery(name)
        self.refreshed = True

    def _judge(self) -> None:
        """Feed the served models' rolling test-then-train mAP to the champion rule."""
        evidence = {}
        for name in list(self.served):
            stats = WorkerStats.from_hash(str_hash(self.r.hgetall(self.keys.stats(name))))
            evidence[name] = {d: Evidence(stats.rolling_map.get(d), stats.pairs_processed)
                              for d in DIRECTIONS}
        before = dict(self.champion.champions)
        self.champion.update(evidence)
        if self.champion.champions != before:
            log.info("champions now %s (were %s)", self.champion.champions, before)

    def resolve(self, name: str, direction: str) -> str:
        """``name``, or for ``"auto"`` the model that answers ``direction`` now."""
        if name != AUTO:
            return name
        # Before the first judgement (a moment after the first load): any served model.
        chosen = self.champion.answer(direction) or next(iter(self.served), None)
        if chosen is None:
            if self.refreshed and not self.known:
                raise UnknownModel("model 'auto': no learner in this namespace")
            raise ModelNotReady("model 'auto': no model has a checkpoint loaded yet")
        return chosen

    def reembed(self) -> None:
        """Re-embed the gallery with the served version of each model without a fixed space
        whose index is older: per model, at most once per ``reembed_seconds`` and never more
        than a third of the time (the next one waits twice as long as the last one took), so
        a gallery that takes long to embed cannot take the API's CPU from the queries."""
        for name, served in list(self.served.items()):
            if served.index is None or served.index.version == served.version:
                continue
            if time.monotonic() < self._reembed_after.get(name, 0.0):
                continue
            started = time.monotonic()
            index = EmbeddedGallery.build(served.version, served.model, self.gallery)
            took = time.monotonic() - started
            self._reembed_after[name] = started + max(self.reembed_seconds, 3 * took)
            with self._swap:
                current = self.served.get(name)
                if current is not None and current.index is not None \
                        and current.index.version < index.version:
                    self.served[name] = replace(current, index=index.covering(self.gallery))
            log.info("re-embedded the gallery for %s version %d in %.1f s", name,
                     served.version, took)

    def _read_gallery(self) -> bool:
        """Bring the gallery up to the stream: from the indexer's segments plus the stream
        after them when a gallery indexer runs, else from the stream itself."""
        revision = self.r.hget(self.keys.gallery, "revision")
        if revision is None:
            return self._read_stream()
        changed = False
        if int(text(revision)) != self._revision:
            manifest = read_manifest(self.r, self.keys)
            if manifest is not None:
                self._open(manifest)
                changed = True
        return self._read_stream() or changed

    def _open(self, manifest: Manifest) -> None:
        """Use the manifest's segments (those already open are kept, not reread); rows of the
        stream tail that the segments now cover leave the tail."""
        opened = {}
        for ref in manifest.segments:
            key = (ref.seq, ref.sha)
            chunk = self._segments.get(key)
            if chunk is None and key not in self.corrupt_segments:
                rows = open_segment(self.store, ref)
                if rows is None:  # quarantined: the rest of the gallery is served
                    self.corrupt_segments[key] = manifest.live_rows(ref)
                    self._corrupt.record(ref, manifest.live_rows(ref))
                else:
                    chunk = GalleryChunk.from_rows(rows)
            if chunk is not None:
                opened[key] = chunk
        self._segments = opened
        self.gallery_corrupt = self._corrupt.read()
        chunks = [opened[(r.seq, r.sha)] for r in manifest.segments if (r.seq, r.sha) in opened]
        first = manifest.segments[0] if manifest.segments else None
        if chunks and manifest.skip and first is not None and (first.seq, first.sha) in opened:
            sliced = (first.seq, first.sha, manifest.skip)
            self._sliced = {sliced: self._sliced.get(sliced) or chunks[0].sliced(
                slice(manifest.skip, None))}
            chunks[0] = self._sliced[sliced]
        self._segment_chunks = tuple(chunks)
        if self._revision is None:  # from the stream alone to segments: the tail is reread
            self.last_gallery_id, self._tail = manifest.last_id, []
        covered = entry_id_key(manifest.last_id)
        tail = []
        for chunk, entries in self._tail:
            keep = [i for i, e in enumerate(entries) if entry_id_key(e) > covered]
            if len(keep) == len(entries):
                tail.append((chunk, entries))
            elif keep:
                tail.append((chunk.sliced(slice(keep[0], None)), entries[keep[0]:]))
        self._tail = tail
        if entry_id_key(self.last_gallery_id) < covered:
            self.last_gallery_id = manifest.last_id
        self._revision = manifest.revision
        self._publish_gallery()

    def _publish_gallery(self) -> None:
        self.gallery = Gallery((*self._segment_chunks, *(c for c, _ in self._tail)))

    def _read_stream(self, budget: int = 50_000) -> bool:
        """Read up to ``budget`` new stream entries into the gallery."""
        changed = False
        while budget > 0:
            reply = self.r.xread({self.keys.pairs: self.last_gallery_id},
                                 count=min(self.read_count, budget))
            entries = stream_entries(reply)
            if not entries:
                return changed
            budget -= len(entries)
            pairs, skipped = decode_entries(self.r, self.keys, entries, self.limits)
            self.gallery_skipped += skipped
            self.last_gallery_id = entries[-1][0]
            if pairs:
                at = [entry_id for entry_id, _ in pairs]
                chunk = GalleryChunk.of(np.asarray([p.id for _, p in pairs]),
                                        np.vstack([p.img for _, p in pairs]),
                                        np.vstack([p.txt for _, p in pairs]))
                if self._revision is None:
                    self.gallery = self.gallery.appended(chunk, self.gallery_max)
                else:  # the indexer caps the segments; the tail after them only grows here
                    merged = merge_count([len(c) for c, _ in self._tail], len(chunk), CHUNK_MAX)
                    if merged:
                        older = self._tail[len(self._tail) - merged :]
                        chunk = GalleryChunk.joined([*(c for c, _ in older), chunk])
                        at = [e for _, entries in older for e in entries] + at
                        self._tail = self._tail[: len(self._tail) - merged]
                    self._tail.append((chunk, at))
                    self._publish_gallery()
                changed = True
        return changed

    def _load(self, name: str) -> None:
        ckpt = self.store.load_latest(name)
        if ckpt is None:
            return
        learner = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
        learner.flush()  # before publishing: queries then only read the model
        head = dict(self.store.head(name) or {})
        head["pairs_seen"] = learner.pairs_seen
        model, gallery = learner.model, self.gallery
        with self._swap:
            previous = self.served.get(name)
            index = None
            if not model.fixed_space:
                index = (previous.index.covering(gallery) if previous and previous.index
                         else EmbeddedGallery.build(ckpt.version, model, gallery))
            self.served[name] = ServedModel(  # one reference assignment: the atomic swap
                name=name, version=ckpt.version, model=model, head=head, loaded_at=time.time(),
                index=index, gallery_items=len(gallery))
        log.info("serving %s version %d (%d pairs seen)", name, ckpt.version, learner.pairs_seen)

    def _cover_gallery(self, name: str) -> None:
        gallery = self.gallery
        with self._swap:
            current = self.served[name]
            index = current.index.covering(gallery) if current.index else None
            self.served[name] = replace(current, index=index, gallery_items=len(gallery))

    # -- queries -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self.served)

    def get(self, name: str, version: int | None = None) -> ServedModel:
        """The served version of ``name``, or the kept ``version`` of it (loaded from the store
        on first use; :class:`~streamxm.storage.checkpoint.VersionNotKept` when the store no
        longer keeps it)."""
        served = self._served(name)
        if version is None or version == served.version:
            return served
        with self._pins_lock:
            pinned = self._pins.get((name, version))
            if pinned is not None:
                self._pins.move_to_end((name, version))
        if pinned is None:
            pinned = self.pin(name, version)
        # Candidates for models without a fixed space come from the newest embedded index.
        return replace(pinned, index=served.index, gallery_items=served.gallery_items)

    def is_loaded(self, name: str, version: int | None) -> bool:
        """Whether :meth:`get` answers without reading the store."""
        served = self.served.get(name)
        return (served is None or version is None or version == served.version
                or (name, version) in self._pins)

    def pin(self, name: str, version: int) -> ServedModel:
        """Load a kept version of ``name`` for queries that name it (a few are cached)."""
        self._served(name)
        ckpt = self.store.load_kept(name, version)
        learner = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
        learner.flush()
        pinned = ServedModel(name=name, version=ckpt.version, model=learner.model,
                             head={"version": ckpt.version, "created": ckpt.created,
                                   "last_id": ckpt.last_id, "pairs_seen": learner.pairs_seen},
                             loaded_at=time.time())
        with self._pins_lock:
            self._pins[(name, version)] = pinned
            while len(self._pins) > self.pins_max:
                self._pins.popitem(last=False)
        return pinned

    def ensemble(self, name: str, version: int | None = None) -> ServedEnsemble:
        """The served version of each member of the ensemble ``name``; an ensemble has no
        version to pin (pin a member by querying it)."""
        try:
            spec = parse_ensemble(name)
        except ValueError as exc:
            raise InvalidModelName(str(exc)) from None
        if version is not None:
            raise EnsembleUnsupported("version", f"{name!r} has no versions of its own: it "
                                      f"answers with its members' newest ones")
        return ServedEnsemble(spec, tuple(self._served(m) for m in spec.members))

    def answering(self, name: str) -> ServedModel | ServedEnsemble:
        """What answers a query naming ``name`` now: a served model or an ensemble."""
        return self.ensemble(name) if is_ensemble(name) else self._served(name)

    def dims(self, name: str) -> tuple[int, int]:
        """Image and text dimensions of what answers ``name`` (raises as :meth:`get`)."""
        served = self.answering(name)
        model = served.members[0].model if isinstance(served, ServedEnsemble) else served.model
        return model.img_dim, model.txt_dim

    def _reference(self, gallery: Gallery, modality: str) -> NDArray[np.float32]:
        """The items an ensemble's member scores are standardised over (per query)."""
        reference = gallery.reference(modality, REFERENCE_ITEMS)
        if len(reference) < 2:
            raise ModelNotReady("an ensemble standardises its members' scores over the "
                                "gallery, which has fewer than 2 items yet")
        return reference

    def _served(self, name: str) -> ServedModel:
        try:
            split_name(name)
        except ValueError as exc:
            raise InvalidModelName(str(exc)) from None
        served = self.served.get(name)
        if served is None:
            if name in self.known or not self.refreshed:
                raise ModelNotReady(f"model {name!r} has no checkpoint loaded yet")
            raise UnknownModel(f"model {name!r} has no learner in this namespace")
        return served

    def version_lag(self, served: ServedModel | ServedEnsemble) -> float:
        """Seconds since a checkpoint newer than ``served`` was written; 0 when none is (an
        ensemble: its most lagging member's)."""
        if isinstance(served, ServedEnsemble):
            return max(self.version_lag(m) for m in served.members)
        version, created = self.newest.get(served.name, (served.version, 0.0))
        return max(0.0, time.time() - created) if version > served.version else 0.0

    def similarity(self, name: str, images: NDArray[np.float32], texts: NDArray[np.float32],
                   matrix: bool, version: int | None = None, direction: str = "i2t"
                   ) -> tuple[ServedModel | ServedEnsemble, NDArray[np.float64]]:
        """Scores of (image_i, text_i) pairs, or the full image x text matrix.

        ``direction`` says which side is the query; only ensembles score differently by it
        (each member standardised per query over the other side's gallery)."""
        if is_ensemble(name):
            ensemble = self.ensemble(name, version)
            queries, items = (images, texts) if direction == "i2t" else (texts, images)
            reference = self._reference(self.gallery, "text" if direction == "i2t" else "image")
            scores = ensemble.fused.scores(direction, queries, items, reference, not matrix)
            return ensemble, scores.T if matrix and direction == "t2i" else scores
        served = self.get(name, version)
        return served, member_scores(served.model, "i2t", images, texts, paired=not matrix)

    def search(self, name: str, modality: str, vector: NDArray[np.float32], k: int,
               target: str | None = None, version: int | None = None) -> SearchAnswer:
        """The ``k`` best gallery items of modality ``target`` (default: the other modality)
        for one query vector of ``modality``, scored by the served version exactly as
        :meth:`similarity` scores them, ties in gallery order.

        Candidates come from a version-independent index: the gallery's unit rows against
        the query moved into them (:attr:`CrossModalModel.fixed_space`), or else the newest
        embedded index. Same-modality search needs a model whose embeddings share one space;
        others raise :class:`SameModalityUnsupported`. ``version`` pins a kept version.
        """
        steps = self._search_steps(name, modality, vector, k, target, version)
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Scan):
                    step = steps.send(self.coalescer.search(step.blocks, step.query, step.k,
                                                            step.per_chunk))
                else:
                    step = steps.send(step.run())
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    async def search_async(self, name: str, modality: str, vector: NDArray[np.float32], k: int,
                           offload: Callable[[Callable[[], Any]], Awaitable[Any]],
                           target: str | None = None, version: int | None = None
                           ) -> SearchAnswer:
        """:meth:`search` for an event loop: the light steps (query transform, exact re-rank
        of the candidates) run on the loop, the scan is awaited from the coalescing thread,
        and heavy work (loading a pinned version, building a missing index) goes to ``offload``.
        Under load this saves two thread hand-offs per search (2.4 ms of API CPU a search
        where it was 3.0, docs/benchmarks.md)."""
        steps = self._search_steps(name, modality, vector, k, target, version)
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Scan):
                    found = await asyncio.wrap_future(
                        self.coalescer.submit(step.blocks, step.query, step.k,
                                              step.per_chunk))
                else:
                    found = await offload(step.run)
                step = steps.send(found)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _search_steps(self, name: str, modality: str, vector: NDArray[np.float32], k: int,
                      target: str | None, version: int | None
                      ) -> Generator[_Scan | _Work, Any, SearchAnswer]:
        """The search, yielding each scan (and any heavy step) for a driver to run."""
        target = target or other_modality(modality)
        if is_ensemble(name):
            return (yield from self._ensemble_steps(name, modality, vector, k, target, version))
        if version is not None and not self.is_loaded(name, version):
            yield _Work(partial(self.pin, name, version))  # read from the store: heavy
        served = self.get(name, version)
        model = served.model
        if target == modality and not model.shared_space:
            raise SameModalityUnsupported(
                f"model {name!r} embeds images and texts in different spaces: it answers "
                f"cross-modal search only (target must be {other_modality(modality)})")
        lag = self.version_lag(served)
        if len(self.gallery) == 0:
            return SearchAnswer(served, [], lag, served.version)
        gallery, rows, items, index_version = yield from self._candidates(
            served, modality, vector, k, target)
        scores = _exact_scores(model, modality, target, vector, items)
        order = np.argsort(-scores, kind="stable")[:k]
        ids = gallery.ids_at(rows[order])
        return SearchAnswer(served, list(zip(ids, scores[order].tolist(), strict=True)), lag,
                            index_version)

    def _candidates(self, served: ServedModel, modality: str, vector: NDArray[np.float32],
                    k: int, target: str
                    ) -> Generator[_Scan | _Work, Any, tuple[Gallery, NDArray[np.int64],
                                                             NDArray[np.float32], int]]:
        """Rows of a gallery snapshot holding the served version's top ``k`` (or nearly, from
        an embedded index): ``max(candidates, 4 k)`` of them, more from a reduced-precision scan
        of a large gallery (:data:`_ROWS_PER_PROOF_CANDIDATE`), in gallery order (so that ties
        keep it), with the snapshot, their raw vectors and the version whose index proposed
        them."""
        gallery, model = self.gallery, served.model
        wanted = min(len(gallery), max(self.candidates, 4 * k))
        fixed = model.fixed_space and target != modality
        if fixed:
            transform = model.queries_for_texts if target == "text" else model.queries_for_images
            query = transform(vector[None, :])[0][0].astype(np.float32)
            blocks, index_version = gallery.blocks(target), served.version
        else:
            # The embedded index and the gallery snapshot it covers: rows that arrived since
            # join it when the refresh thread embeds them (once, not per query).
            index = served.index
            if index is None:  # not built yet (a moment after a model's first load)
                index = yield _Work(partial(EmbeddedGallery.build, served.version, model,
                                            gallery))
            gallery = index.gallery
            embed = index.model.embed_images if modality == "image" else index.model.embed_texts
            query = embed(vector[None, :])[0].astype(np.float32)
            blocks, index_version = index.blocks(target), index.version
        scanned, per_chunk = wanted, None
        if fixed and not _exact_blocks(blocks):
            scanned = proof_candidates(len(gallery), wanted, isinstance(blocks[0], Int8Block))
            if scanned > wanted:
                # Each chunk offers twice its expected share of the best ``scanned`` (a chunk
                # holds at most CHUNK_MAX rows) and the best ``scanned`` of their union are
                # re-ranked: the ceiling of a larger top at a smaller selection's cost. At 1M:
                # 50 of each 65,536, the union's 800 hold the best 400. A gallery of a few
                # chunks gets a plain top ``scanned`` (each chunk's share is most of it; 50
                # per chunk left 747 of 14,383 searches unproven at 100k).
                per_chunk = max(1, wanted // 2,
                                -(-2 * scanned * CHUNK_MAX // len(gallery)))
        _, rows, ceiling = yield _Scan(blocks, query, scanned, per_chunk)
        units, norms = gallery.locate(rows, target)
        if fixed and not _proven_complete(ceiling, units, query, k, blocks):
            # The reduced-precision scan could have missed part of the exact top k (scores
            # flatter than its rounding): scan the float32 rows instead.
            self.exact_scans += 1
            # Coalesced too: the fallbacks of concurrent searches share one pass.
            _, rows, _ = yield _Scan(gallery.exact_blocks(target), query, wanted)
            units, norms = gallery.locate(rows, target)
        by_row = np.argsort(rows, kind="stable")
        return (gallery, rows[by_row], units[by_row] * norms[by_row, None], index_version)

    def _ensemble_steps(self, name: str, modality: str, vector: NDArray[np.float32], k: int,
                        target: str, version: int | None
                        ) -> Generator[_Scan | _Work, Any, SearchAnswer]:
        """An ensemble's search: each member proposes its candidates (as its own search
        would), and the union is ranked by the fused score exactly."""
        ensemble = self.ensemble(name, version)
        if target == modality:
            raise SameModalityUnsupported(
                f"ensemble {name!r} answers cross-modal search only (target must be "
                f"{other_modality(modality)})")
        lag = self.version_lag(ensemble)
        if len(self.gallery) == 0:
            return SearchAnswer(ensemble, [], lag, None)
        reference = self._reference(self.gallery, target)
        ids: list[str] = []
        items: list[NDArray[np.float32]] = []
        seen: set[str] = set()
        for served in ensemble.members:
            gallery, rows, vectors, _ = yield from self._candidates(served, modality, vector, k,
                                                                    target)
            fresh = [(i, id_) for i, id_ in enumerate(gallery.ids_at(rows)) if id_ not in seen]
            seen.update(id_ for _, id_ in fresh)
            ids.extend(id_ for _, id_ in fresh)
            items.append(vectors[[i for i, _ in fresh]])
        scores = ensemble.fused.scores(direction_of(modality), vector[None, :], np.vstack(items),
                                       reference)[0]
        order = np.argsort(-scores, kind="stable")[:k]
        return SearchAnswer(ensemble, [(ids[i], float(scores[i])) for i in order], lag, None)


@dataclass(frozen=True, eq=False)
class _Scan:
    """A top-k scan a search needs, answered by the coalescing thread with the concurrent
    searches' scans of the same blocks."""

    blocks: tuple[Block, ...]
    query: NDArray[np.float32]  # one query vector
    k: int
    per_chunk: int | None = None  # rows each chunk offers (top_k_bounded); None: k


@dataclass(frozen=True, eq=False)
class _Work:
    """A heavy step of a search (loading a pinned version, building a missing index), run
    off the event loop."""

    run: Callable[[], Any]
