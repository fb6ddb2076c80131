"""Serving: the newest checkpoint of every model, hot-swapped, a search gallery kept from the pairs
stream, and the queries against them.

:class:`ModelServer` puts the parts together: :class:`~streamxm.serving.versions.ServedVersions`
(hot swap and the gallery index of models without a fixed space),
:class:`~streamxm.serving.following.GalleryFollower` (the gallery from the indexer's segments
and the stream), :class:`~streamxm.serving.pins.PinnedVersions` (kept versions queries name),
:class:`~streamxm.serving.champion.ChampionRule` (who answers ``model: "auto"``) and
:class:`~streamxm.serving.search.Searcher` (top-k). Three background threads do all the writing:
:meth:`ModelServer.refresh_versions` loads new versions (a model with a linear head embeds the
gallery before it is swapped in), :meth:`ModelServer.refresh_gallery` reads new gallery rows,
:meth:`ModelServer.refresh_index` embeds the gallery with the served version of a model that
embeds raw vectors; :meth:`ModelServer.refresh` does all three. Readers take a reference to an
immutable :class:`~streamxm.serving.served.ServedModel` and
:class:`~streamxm.serving.gallery.Gallery` and never lock, so a query sees one model version,
never half of a swap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm import defaults as D
from streamxm.learning.stats import WorkerStats
from streamxm.models import DIRECTIONS, split_name
from streamxm.models.ensemble import (
    REFERENCE_ITEMS,
    is_ensemble,
    member_scores,
    parse_ensemble,
)
from streamxm.serving.champion import ChampionRule, Evidence
from streamxm.serving.following import GalleryFollower
from streamxm.serving.gallery import Gallery, GalleryRows
from streamxm.serving.pins import PinnedVersions
from streamxm.serving.search import Searcher, check_target, ensemble_reference
from streamxm.serving.served import (
    AUTO,
    EmbeddedGallery,
    EnsembleUnsupported,
    InvalidModelName,
    ModelNotReady,
    SearchAnswer,
    SearchQuery,
    ServedEnsemble,
    ServedModel,
    UnknownModel,
)
from streamxm.serving.shard import ShardedGallery, ShardedHits
from streamxm.serving.versions import ServedVersions
from streamxm.storage.checkpoint import CheckpointStore
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits
from streamxm.stream.redis_conn import str_hash, str_set

__all__ = ["ModelServer"]

log = logging.getLogger(__name__)


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
    limits
        Input bounds the stream's entries are decoded with.
    read_count
        Stream entries read per ``XREAD`` of the gallery.
    candidates
        Candidates re-ranked per query: ``max(candidates, 4 k)``.
    champion
        The rule that picks who answers ``model: "auto"`` (:mod:`streamxm.serving.champion`).
    request_client
        The Redis client for what a request waits on (short timeouts: a stalled Redis answers
        503 quickly); default ``client``, which the background threads use.
    wait_for_index
        See :class:`~streamxm.serving.versions.ServedVersions`.
    shards
        The gallery spread over shards (the ``ray`` backend, :mod:`streamxm.ray_gallery`):
        this process then holds no gallery, applies each version on every shard and merges
        their answers; ``None`` (the ``local`` backend): the gallery is this process's.
    """

    def __init__(
        self,
        client: redis.Redis,
        store: CheckpointStore,
        namespace: str = "default",
        gallery_max: int = D.GALLERY_MAX,
        limits: Limits = Limits(),
        read_count: int = D.GALLERY_READ_COUNT,
        candidates: int = D.SEARCH_CANDIDATES,
        champion: ChampionRule | None = None,
        request_client: redis.Redis | None = None,
        wait_for_index: bool = D.WAIT_FOR_INDEX,
        shards: ShardedGallery | None = None,
    ) -> None:
        self.r = client
        self.shards = shards
        self.request_r = request_client or client
        self.store = store
        self.keys = Keys(namespace)
        self.versions = ServedVersions(store, wait_for_index, shards)
        self.following = GalleryFollower(client, store, self.keys, gallery_max, limits, read_count)
        self.pins = PinnedVersions(store)
        self.searcher = Searcher(self, self.versions.lag, candidates)
        #: The champion per direction: who answers ``model: "auto"`` (updated every refresh).
        self.champion = champion or ChampionRule()
        self.known: frozenset[str] = frozenset()  # models registered in the namespace
        self.refreshed = False  # one full refresh done: until then every model is "not ready"
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    # -- what the parts hold -------------------------------------------------------------------
    @property
    def served(self) -> dict[str, ServedModel]:
        """Model name -> the version served now."""
        return self.versions.served

    @property
    def gallery(self) -> Gallery:
        """The gallery snapshot queries search now."""
        return self.following.gallery

    @property
    def gallery_corrupt(self) -> dict[str, int]:
        """Corrupt segments recorded in the namespace (``<seq>:<sha>`` -> rows lost)."""
        return self.following.gallery_corrupt

    @property
    def ready(self) -> bool:
        return bool(self.served)

    def model_stats(self) -> dict[str, WorkerStats]:
        """Each registered model's learning statistics, as its worker last wrote them (read
        while a request waits: through the request client)."""
        r = self.request_r
        return {
            name: WorkerStats.from_hash(str_hash(r.hgetall(self.keys.stats(name))))
            for name in sorted(str_set(r.smembers(self.keys.models)))
        }

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

        for name, step in (
            ("versions", self.refresh_versions),
            ("gallery", self.refresh_gallery),
            ("index", self.refresh_index),
        ):
            thread = threading.Thread(
                target=every(step, interval), name=f"streamxm-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self.searcher.close()
        if self.shards is not None:
            self.shards.close()

    def refresh(self) -> None:
        """Load new checkpoint versions, read new gallery rows (a bounded amount per call),
        then embed the gallery with every served version still searching an earlier one's
        index."""
        self.refresh_versions()
        self.refresh_gallery()
        self.refresh_index()

    def refresh_versions(self) -> None:
        """Load each model's new checkpoint version, if any, and swap it in (after embedding
        the gallery, for a model without a fixed space)."""
        names = str_set(self.r.smembers(self.keys.models))
        self.known = frozenset(names)
        self.versions.follow(set(names), lambda: self.gallery)
        if self.shards is not None:  # restarted shards get the served versions again
            self.shards.heal({name: s.version for name, s in list(self.served.items())})
            self.versions.count_items(
                sum(s.rows for s in self.shards.statuses if s is not None and s.caught_up)
            )
        self._judge()
        self._warm_unit_index()
        self.refreshed = True

    def refresh_gallery(self) -> None:
        """Read new gallery rows (a bounded amount per call) and embed them for the served
        versions that need it (with shards, the shards read theirs: nothing here)."""
        if self.shards is None and self.following.read():
            self.versions.cover(self.gallery)
            self._warm_unit_index()

    def refresh_index(self) -> None:
        """Embed the gallery with each served version of a model that embeds raw vectors
        whose candidates still come from an earlier version's index (a thread of its own:
        new versions are swapped in meanwhile)."""
        self.versions.embed_behind(lambda: self.gallery)

    def _warm_unit_index(self) -> None:
        """Make the reduced-precision copy of the unit rows here, in the background, when a
        served model scans them (a fixed space), not in the first query that needs it."""
        if self.shards is None and any(s.embedding.fixed for s in list(self.served.values())):
            self.gallery.warm()

    def _judge(self) -> None:
        """Feed the served models' rolling test-then-train mAP to the champion rule."""
        evidence = {}
        for name in list(self.served):
            stats = WorkerStats.from_hash(str_hash(self.r.hgetall(self.keys.stats(name))))
            evidence[name] = {
                d: Evidence(stats.rolling_map.get(d), stats.pairs_processed) for d in DIRECTIONS
            }
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

    # -- queries -------------------------------------------------------------------------------
    def get(self, name: str, version: int | None = None) -> ServedModel:
        """The served version of ``name``, or the kept ``version`` of it (loaded from the store
        on first use; :class:`~streamxm.storage.checkpoint.VersionNotKept` when the store no
        longer keeps it)."""
        served = self._served(name)
        if version is None or version == served.version:
            return served
        pinned = self.pins.cached(name, version) or self.pin(name, version)
        index = pinned.index
        if index is not None and not index.covers(self.gallery):
            index = None  # the search embeds the new rows first (index_of)
        return replace(pinned, index=index, gallery_items=served.gallery_items)

    def is_loaded(self, name: str, version: int | None) -> bool:
        """Whether :meth:`get` answers without reading the store."""
        served = self.served.get(name)
        return (
            served is None
            or version is None
            or version == served.version
            or (name, version) in self.pins
        )

    def pin(self, name: str, version: int) -> ServedModel:
        """Load a kept version of ``name`` for queries that name it (a few are cached)."""
        self._served(name)
        return self.pins.load(name, version)

    def reference_sample(self) -> GalleryRows:
        """The gallery's reference sample an ensemble standardises over (with shards: the one
        gathered from them, :attr:`~streamxm.serving.shard.ShardedGallery.reference`)."""
        if self.shards is not None:
            return self.shards.reference or GalleryRows.empty()
        return self.gallery.reference_sample(REFERENCE_ITEMS)

    def index_of(self, served: ServedModel) -> EmbeddedGallery:
        """The gallery embedded by ``served``'s version (a pinned version's: built on its
        first search and kept with it; new rows are embedded as they arrive)."""
        index = served.index
        if index is not None and index.version == served.version:
            index = index.covering(self.gallery)
        else:
            index = EmbeddedGallery.build(served.version, served.embedding, self.gallery)
        self.pins.keep_index(served.name, served.version, index)
        return index

    def ensemble(
        self, name: str, version: int | None = None, members: Mapping[str, int] | None = None
    ) -> ServedEnsemble:
        """The served version of each member of the ensemble ``name`` (``members``: the kept
        version of those it names); an ensemble has no version of its own to pin."""
        try:
            spec = parse_ensemble(name)
        except ValueError as exc:
            raise InvalidModelName(str(exc)) from None
        if version is not None:
            raise EnsembleUnsupported(
                "version",
                f"{name!r} has no versions of its own: it answers with its members' newest ones",
            )
        members = members or {}
        return ServedEnsemble(
            spec,
            tuple(
                self.get(m, members[m]) if m in members else self._served(m) for m in spec.members
            ),
        )

    def dims(self, name: str) -> tuple[int, int]:
        """Image and text dimensions of what answers ``name`` (raises as :meth:`get`)."""
        served = self.ensemble(name) if is_ensemble(name) else self._served(name)
        model = served.members[0].model if isinstance(served, ServedEnsemble) else served.model
        return model.img_dim, model.txt_dim

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

    def similarity(
        self,
        name: str,
        images: NDArray[np.float32],
        texts: NDArray[np.float32],
        matrix: bool,
        version: int | None = None,
        direction: str = "i2t",
    ) -> tuple[ServedModel | ServedEnsemble, NDArray[np.float64]]:
        """Scores of (image_i, text_i) pairs, or the full image x text matrix.

        ``direction`` says which side is the query; only ensembles score differently by it
        (each member standardised per query over the other side's gallery)."""
        if is_ensemble(name):
            ensemble = self.ensemble(name, version)
            queries, items = (images, texts) if direction == "i2t" else (texts, images)
            target = "text" if direction == "i2t" else "image"
            reference = ensemble_reference(self.reference_sample(), target)
            scores = ensemble.fused.scores(direction, queries, items, reference, not matrix)
            return ensemble, scores.T if matrix and direction == "t2i" else scores
        served = self.get(name, version)
        return served, member_scores(served.embedding, "i2t", images, texts, paired=not matrix)

    def search(
        self,
        name: str,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        target: str | None = None,
        version: int | None = None,
        partial: bool = False,
    ) -> SearchAnswer:
        """The ``k`` best gallery items (:meth:`~streamxm.serving.search.Searcher.search`;
        with shards, the merge of their answers; ``partial``: answer from the shards that do
        when some do not, :attr:`~streamxm.serving.served.SearchAnswer.covered` saying how
        much of the gallery that is)."""
        query = SearchQuery(name, modality, vector, k, target, version)
        if self.shards is not None:
            served, sharded = _sharded_query(self, query)
            return _sharded_answer(self, served, self.shards.search(sharded, partial))
        return self.searcher.search(query)

    async def search_async(
        self,
        name: str,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        offload: Callable[[Callable[[], Any]], Awaitable[Any]],
        target: str | None = None,
        version: int | None = None,
        partial: bool = False,
    ) -> SearchAnswer:
        """:meth:`search` on an event loop
        (:meth:`~streamxm.serving.search.Searcher.search_async`)."""
        query = SearchQuery(name, modality, vector, k, target, version)
        if self.shards is not None:
            served, sharded = _sharded_query(self, query)
            return _sharded_answer(self, served, await self.shards.search_async(sharded, partial))
        return await self.searcher.search_async(query, offload)


def _sharded_query(
    server: ModelServer, query: SearchQuery
) -> tuple[ServedModel | ServedEnsemble, SearchQuery]:
    """What answers ``query`` and the query every shard runs: naming the versions every shard
    is to read (a pinned one must be among those the shards keep), the target checked before
    any shard is asked."""
    name, version = query.name, query.version
    if is_ensemble(name):
        served: ServedModel | ServedEnsemble = server.ensemble(name, version)
    else:
        served = server._served(name)
        if version is not None and version != served.version:
            served = replace(served, version=version)
    check_target(served, query.modality, query.searched)
    versions = dict(served.versions)
    return served, query._replace(version=versions.get(name), members=versions)


def _sharded_answer(
    server: ModelServer, served: ServedModel | ServedEnsemble, found: ShardedHits
) -> SearchAnswer:
    return SearchAnswer(
        served,
        found.hits,
        server.versions.lag(served),
        served.version if isinstance(served, ServedModel) else None,
        covered=found.covered,
    )
