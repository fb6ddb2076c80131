"""One shard of a gallery spread over processes: its part of the items, and each applied model
version's index of that part.

A :class:`GalleryShard` follows the namespace's segments and stream as a single server does
(:class:`~streamxm.serving.following.GalleryFollower`), keeping only the items its
:class:`~streamxm.storage.slots.ShardPart` owns. It never loads a version by itself: the
coordinator hands it each new version's checkpoint state (:meth:`GalleryShard.apply`, every
shard at once), and names the version each search reads, so the shards of one answer always
read the same versions. A shard keeps the few newest versions it was given, so the version
served while a newer one is applied elsewhere still answers.

Searches run the single-process pipeline (:class:`~streamxm.serving.search.Searcher`) on the
shard's part: each shard's answer is its part's proven top k, which is what
:func:`~streamxm.serving.sharding.merge_hits` needs. Nothing here imports Ray: the Ray
backend (:mod:`streamxm.ray_gallery`) hosts this class in an actor.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm import defaults as D
from streamxm.learning.stream_learner import model_from_state
from streamxm.models.ensemble import REFERENCE_ITEMS, EnsembleSpec, parse_ensemble
from streamxm.serving.following import GalleryFollower
from streamxm.serving.gallery import Gallery, GalleryRows
from streamxm.serving.search import Searcher
from streamxm.serving.served import (
    EmbeddedGallery,
    InvalidModelName,
    ModelNotReady,
    SearchQuery,
    ServedEnsemble,
    ServedModel,
)
from streamxm.storage.checkpoint import Checkpoint, CheckpointStore
from streamxm.storage.slots import ShardPart
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits

__all__ = [
    "AppliedVersion",
    "GalleryShard",
    "ShardAnswer",
    "ShardError",
    "ShardQuery",
    "ShardStatus",
    "ShardedGallery",
    "ShardedHits",
    "ShardsUnavailable",
    "resident_bytes",
]

log = logging.getLogger(__name__)

#: Most versions of each model a shard keeps.
KEPT_VERSIONS = 8


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class AppliedVersion:
    """What applying one version cost a shard."""

    name: str
    version: int
    build_seconds: float
    rows: int


@dataclass(frozen=True)
class ShardAnswer:
    """A shard's top k of its part, best first, and the versions that scored it."""

    hits: list[tuple[str, float]]
    versions: dict[str, int]
    rows: int


#: One search as a shard runs it: its ``version`` and ``members`` name the versions every
#: shard of one answer reads.
ShardQuery = SearchQuery


@dataclass(frozen=True)
class ShardError:
    """A shard's search that failed, sent back as data (exception classes with arguments of
    their own do not survive pickling)."""

    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class ShardedHits:
    """The shards' answers merged: hits best first, the share of the item space they cover
    (1.0: every shard answered) and the shards that did not."""

    hits: list[tuple[str, float]]
    covered: float
    missing: list[int]


class ShardsUnavailable(ModelNotReady):
    """Some shards gave no answer in time (restarting, or their node gone): a search never
    answers from part of the gallery unless the request asks for it."""

    def __init__(self, missing: list[int], count: int, why: str) -> None:
        super().__init__(
            f"gallery shards {missing} of {count} did not answer ({why}); retry, or ask for a "
            "partial answer (`partial: true`)"
        )
        self.missing = missing


@dataclass(frozen=True)
class ShardStatus:
    """What ``/readyz`` and ``/metrics`` show of a shard."""

    index: int
    count: int
    rows: int
    caught_up: bool
    versions: dict[str, list[int]]
    build_seconds: dict[str, float]
    resident_bytes: int
    #: A digest of the shard's candidates for the ensembles' reference sample: the
    #: coordinator gathers them again when it changes.
    reference_digest: str = ""
    pid: int = field(default_factory=os.getpid)
    #: Where the shard's towers run: ``"cuda"`` when its process sees a GPU, else ``"cpu"``.
    device: str = "cpu"


class GalleryShard:
    """A part of the gallery and the versions applied to it.

    Parameters
    ----------
    client, store, keys, gallery_max, limits, read_count
        As :class:`~streamxm.serving.following.GalleryFollower` takes them (``gallery_max``
        caps this shard's part).
    part
        The items this shard owns.
    candidates
        Candidates re-ranked per query (:class:`~streamxm.serving.search.Searcher`).
    grace
        Seconds a version stays held after a newer one was applied (searches the API sent
        before it served the newer one still name it): at least the API's search timeout.
    """

    def __init__(
        self,
        client: redis.Redis,
        store: CheckpointStore,
        keys: Keys,
        part: ShardPart,
        gallery_max: int = D.GALLERY_MAX,
        limits: Limits = Limits(),
        read_count: int = D.GALLERY_READ_COUNT,
        candidates: int = D.SEARCH_CANDIDATES,
        grace: float = 10.0,
    ) -> None:
        self.part = part
        self.device = torch_device()
        self.following = GalleryFollower(
            client, store, keys, gallery_max, limits, read_count, part=part
        )
        self.held: dict[str, dict[int, ServedModel]] = {}
        self.build_seconds: dict[str, float] = {}
        self.caught_up = False
        #: Per model, when each held version was superseded by a newer one (None: newest):
        #: a search the API sent just before it swapped in the newer one still names the
        #: older, so an older version is dropped only ``grace`` seconds after.
        self._superseded: dict[str, dict[int, float | None]] = {}
        self.grace = grace
        #: The whole gallery's reference sample, gathered by the coordinator from every shard.
        self.reference: GalleryRows | None = None
        self._lock = threading.Lock()  # applies and covers swap `held` entries
        self.searcher = Searcher(self, lambda _: 0.0, candidates)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the catalogue a search reads (streamxm.serving.search.Catalogue) ----------------------
    @property
    def gallery(self) -> Gallery:
        return self.following.gallery

    def get(self, name: str, version: int | None = None) -> ServedModel:
        versions = self.held.get(name, {})
        chosen = version if version is not None else max(versions, default=None)
        if chosen is None or chosen not in versions:
            raise ModelNotReady(f"shard {self.part.index} holds no version {chosen} of {name!r}")
        return versions[chosen]

    def is_loaded(self, name: str, version: int | None) -> bool:
        return version is None or version in self.held.get(name, {})

    def pin(self, name: str, version: int) -> ServedModel:
        return self.get(name, version)

    def ensemble(
        self, name: str, version: int | None = None, members: Mapping[str, int] | None = None
    ) -> ServedEnsemble:
        try:
            spec: EnsembleSpec = parse_ensemble(name)
        except ValueError as exc:
            raise InvalidModelName(str(exc)) from None
        members = members or {}
        return ServedEnsemble(spec, tuple(self.get(m, members.get(m)) for m in spec.members))

    def reference_sample(self) -> GalleryRows:
        return self.reference or GalleryRows.empty()

    def reference_candidates(self) -> GalleryRows:
        """This part's reference sample: the whole gallery's is the smallest keys of all
        the shards' (:func:`~streamxm.serving.sharding.smallest`)."""
        return self.gallery.reference_sample(REFERENCE_ITEMS)

    def set_reference(self, sample: GalleryRows) -> None:
        self.reference = sample

    def index_of(self, served: ServedModel) -> EmbeddedGallery:
        index = served.index
        if index is not None and index.version == served.version:
            return index.covering(self.gallery)
        return EmbeddedGallery.build(served.version, served.embedding, self.gallery)

    # -- what the coordinator asks -------------------------------------------------------------
    def apply(
        self, name: str, version: int, state: tuple[dict[str, Any], dict[str, Any]]
    ) -> AppliedVersion:
        """Hold ``version`` of ``name`` made from its checkpoint ``state`` (arrays, meta), with
        its index of this shard's part built (from the newest held version's, where the kind
        recomputes only what changed)."""
        if not self.caught_up:  # its index would cover part of the part: tried again later
            raise ModelNotReady(f"shard {self.part.index} is still reading its part")
        held = self.held.get(name, {})
        if version in held:
            return AppliedVersion(
                name, version, self.build_seconds.get(name, 0.0), len(self.gallery)
            )
        started = time.perf_counter()
        model = model_from_state(*state)
        kind = model.embedding()
        gallery = self.gallery
        earlier = held[max(held)].index if held else None
        index = None if kind.fixed else EmbeddedGallery.build(version, kind, gallery, earlier)
        if kind.fixed:  # its searches scan the unit rows: made before it is served, once
            gallery.warm()
        served = ServedModel(
            name=name,
            version=version,
            model=model,
            head={},
            loaded_at=time.time(),
            index=index,
            gallery_items=len(gallery),
            embedding=kind,
        )
        took = time.perf_counter() - started
        with self._lock:
            versions = dict(self.held.get(name, {}))
            versions[version] = served
            for old in self._stale(name, versions):
                del versions[old]
            self.held[name] = versions
            self.build_seconds[name] = took
        log.info("shard %d: %s version %d applied in %.2f s", self.part.index, name, version, took)
        return AppliedVersion(name, version, took, len(gallery))

    def search_many(self, queries: Sequence[ShardQuery]) -> list[ShardAnswer | Exception]:
        """This part's top ``k`` of each query by the versions it names (a model's, or every
        ensemble member's), the batch on this thread with its scans together
        (:meth:`~streamxm.serving.search.Searcher.search_many`); a query's error is its
        answer."""
        if not self.caught_up:
            return [
                ModelNotReady(f"shard {self.part.index} is still reading its part of the gallery")
            ] * len(queries)
        answers = self.searcher.search_many(queries)
        rows = len(self.gallery)
        return [
            a if isinstance(a, Exception) else ShardAnswer(a.hits, dict(a.served.versions), rows)
            for a in answers
        ]

    def _stale(self, name: str, versions: Mapping[int, ServedModel]) -> list[int]:
        """Held versions no search can name any more: superseded more than ``grace`` seconds
        ago, and any beyond the :data:`KEPT_VERSIONS` newest (the newest always stays)."""
        now, newest = time.monotonic(), max(versions)
        since = self._superseded.setdefault(name, {})
        for version in versions:
            if version != newest and since.get(version) is None:
                since[version] = now
        stale = [v for v in versions if v != newest and now - (since.get(v) or now) > self.grace]
        stale += [v for v in sorted(versions)[:-KEPT_VERSIONS] if v not in stale]
        for version in stale:
            since.pop(version, None)
        return stale

    def status(self) -> ShardStatus:
        return ShardStatus(
            index=self.part.index,
            count=self.part.count,
            rows=len(self.gallery),
            caught_up=self.caught_up,
            versions={name: sorted(v) for name, v in self.held.items()},
            build_seconds=dict(self.build_seconds),
            resident_bytes=resident_bytes(),
            reference_digest=_digest(self.reference_candidates().ids),
            device=self.device,
        )

    # -- following the gallery -----------------------------------------------------------------
    def refresh(self) -> None:
        """Read new gallery rows (until the stream's end on the first call) and have every
        held version's index cover them."""
        while self.following.read() and not self.caught_up:
            pass
        gallery = self.gallery
        with self._lock:
            for name, versions in list(self.held.items()):
                self.held[name] = {
                    v: served if served.index is None else _covering(served, gallery)
                    for v, served in versions.items()
                }
            scans_units = any(
                s.embedding.fixed for versions in self.held.values() for s in versions.values()
            )
        if scans_units:  # here, not in the first searches after the part changed
            gallery.warm()
        # Only now: a version applied while the part was being read has an index of less
        # than the part until it is covered, and a search must not read it before.
        self.caught_up = True

    def start(self, interval: float = 0.25) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.refresh()
                except redis.RedisError as exc:
                    log.warning(
                        "shard %d gallery read failed (will retry): %s", self.part.index, exc
                    )
                except Exception:
                    log.exception("shard %d gallery read failed (will retry)", self.part.index)
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="streamxm-shard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.searcher.close()


def torch_device() -> str:
    """``"cuda"`` when this process sees a CUDA device (a Ray actor sees only the GPUs it was
    given), else ``"cpu"``; without torch installed, ``"cpu"``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _digest(ids: NDArray[np.str_]) -> str:
    return hashlib.blake2b("\n".join(ids.tolist()).encode(), digest_size=12).hexdigest()


def _covering(served: ServedModel, gallery: Gallery) -> ServedModel:
    assert served.index is not None
    return replace(served, index=served.index.covering(gallery), gallery_items=len(gallery))


class ShardedGallery(Protocol):
    """What the API's model server asks of a gallery spread over shards (the Ray backend,
    :class:`streamxm.ray_gallery.RayGallery`)."""

    statuses: list[ShardStatus | None]
    #: GPUs each shard holds (``STREAMXM_SHARD_GPUS``, or its share of the cluster's).
    gpus: float
    #: The whole gallery's reference sample (:meth:`GalleryShard.reference_candidates`).
    reference: GalleryRows | None

    def apply(self, name: str, ckpt: Checkpoint) -> list[AppliedVersion]: ...

    def heal(self, served: Mapping[str, int]) -> None: ...

    def search(self, query: ShardQuery, partial: bool = False) -> ShardedHits: ...

    async def search_async(self, query: ShardQuery, partial: bool = False) -> ShardedHits: ...

    def close(self) -> None: ...
