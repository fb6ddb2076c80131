"""The newest checkpoint version of every model, hot-swapped. A model with a linear head is
swapped once its new version has embedded the whole gallery (one product), so its answers are
the exact ranking of the version they name; a model that embeds raw vectors (towers, kernels) has
its new version embed the gallery on the index thread and is swapped in then (or at once,
``wait_for_index`` off, ranking candidates from the earlier version's index meanwhile)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from streamxm import defaults as D
from streamxm.learning.stream_learner import model_from_state
from streamxm.models.embedding import EmbeddingKind
from streamxm.serving.gallery import Gallery
from streamxm.serving.served import EmbeddedGallery, ServedEnsemble, ServedModel
from streamxm.serving.shard import ShardedGallery
from streamxm.storage.checkpoint import Checkpoint, CheckpointStore

__all__ = ["ServedVersions"]

#: What a swap serves: a version and its index.
_Swap = tuple[ServedModel, EmbeddedGallery | None]

log = logging.getLogger(__name__)


class ServedVersions:
    """What each model serves now (:attr:`served`, replaced by one reference assignment per
    swap) and the newest version its store holds (:attr:`newest`).

    A new version of a model with a linear head embeds the gallery from the features the
    gallery keeps for it (one product) before it is swapped in; until then the previous
    version answers, and the lag (:meth:`lag`) says for how long a newer one has existed.
    A model that embeds raw vectors pays a forward pass over every item per version (seconds
    at 100,000 items for towers), longer than a worker takes to write the next version:
    :meth:`embed_behind` (the index thread) embeds the gallery with its newest version and
    swaps both in, so the version thread goes on loading the other models meanwhile. With
    ``wait_for_index`` off the new version is swapped in at once and searches the newest index
    there is, its candidates re-ranked by its exact scores, until then.

    Parameters
    ----------
    store
        Checkpoint store the workers write to.
    wait_for_index
        Swap a model that embeds raw vectors in only once its version has embedded the
        gallery, as a linear head is: every answer exact, the lag up to two embedding passes.
    shards
        A gallery spread over shards (:mod:`streamxm.serving.shard`): each new version is
        applied on every shard, which build their parts' indexes at once, and served once every
        shard holds it; ``None``: the gallery is this process's.
    """

    def __init__(
        self,
        store: CheckpointStore,
        wait_for_index: bool = D.WAIT_FOR_INDEX,
        shards: ShardedGallery | None = None,
    ) -> None:
        self.store = store
        self.wait_for_index = wait_for_index
        self.shards = shards
        self.served: dict[str, ServedModel] = {}
        self.newest: dict[str, tuple[int, float]] = {}  # model -> (head version, created)
        # Head version last tried per model: a corrupt newest version (served: the previous
        # good one) is tried once, not on every refresh.
        self._attempted: dict[str, int] = {}
        self._swap = threading.Lock()  # writers of self.served (version, gallery, index threads)
        # Model -> its newest version whose index the index thread is to embed.
        self._staged: dict[str, ServedModel] = {}

    def follow(self, names: set[str], gallery: Callable[[], Gallery]) -> None:
        """Load the new head version of each of ``names``, if any (``gallery``: the snapshot
        to embed, read again at the swap)."""
        for name in names:
            head = self.store.head(name)
            if head is None:
                continue
            self.newest[name] = (int(head["version"]), float(head.get("created", time.time())))
            if head["version"] != self._attempted.get(name):
                self._attempted[name] = head["version"]
                self._load(name, gallery)

    def _load(self, name: str, gallery: Callable[[], Gallery]) -> None:
        ckpt = self.store.load_latest(name)
        if ckpt is None:
            return
        model = model_from_state(ckpt.arrays, ckpt.meta)  # flushed: queries only read it
        head = self._head_of(name, ckpt)
        started = time.perf_counter()
        earlier = self.served.get(name)
        kind = model.embedding()
        served = ServedModel(name, ckpt.version, model, head, time.time(), embedding=kind)
        if self.shards is not None:
            self._apply_to_shards(self.shards, ckpt, served)
            return
        if earlier is not None and self._embedded_behind(kind, model.img_dim, earlier):
            self._stage(served, earlier, gallery)
            return
        index = (
            None
            if kind.fixed
            else EmbeddedGallery.build(
                ckpt.version, kind, gallery(), earlier.index if earlier is not None else None
            )
        )
        self._staged.pop(name, None)
        self._swap_in(
            name,
            lambda _: (served, index),
            gallery,
            time.perf_counter() - started if index is not None else 0.0,
        )
        log.info(
            "serving %s version %d (%d pairs seen; gallery embedded in %.2f s)",
            name,
            ckpt.version,
            head["pairs_seen"],
            self.served[name].index_seconds,
        )

    def _stage(
        self, loaded: ServedModel, earlier: ServedModel, gallery: Callable[[], Gallery]
    ) -> None:
        """Have the index thread embed the gallery with ``loaded`` (:meth:`embed_behind`);
        meanwhile it waits, or answers from ``earlier``'s index."""
        name = loaded.name
        staged = replace(
            loaded,
            index=earlier.index,
            gallery_items=earlier.gallery_items,
            index_seconds=earlier.index_seconds,
        )
        self._staged[name] = staged
        if not self.wait_for_index:  # with the newest index then (the index thread's)
            self._swap_in(
                name,
                lambda current: (
                    staged,
                    current.index if current is not None else staged.index,
                ),
                gallery,
            )
        log.info(
            "%s version %d (%d pairs seen) %s",
            name,
            staged.version,
            staged.head["pairs_seen"],
            "waits for its index"
            if self.wait_for_index
            else f"serves candidates from version {staged.index_version}'s index",
        )

    def _head_of(self, name: str, ckpt: Checkpoint) -> dict[str, Any]:
        """The store's head of ``name`` with what ``ckpt`` itself learned (the head may
        already name a newer version)."""
        head = dict(self.store.head(name) or {})
        head["pairs_seen"] = int(ckpt.meta["pairs_seen"])
        head["last_id"] = ckpt.last_id
        return head

    def _apply_to_shards(
        self, shards: ShardedGallery, ckpt: Checkpoint, served: ServedModel
    ) -> None:
        """Serve ``served`` once every shard holds its version with its part's index built;
        on a failure (a shard restarting) the version is tried again on the next refresh."""
        started = time.perf_counter()
        try:
            applied = shards.apply(served.name, ckpt)
        except Exception as exc:
            self._attempted.pop(served.name, None)
            log.warning(
                "%s version %d not applied on every shard (will retry): %s",
                served.name,
                served.version,
                exc,
            )
            return
        took = time.perf_counter() - started
        with self._swap:
            self.served[served.name] = replace(
                served, gallery_items=sum(a.rows for a in applied), index_seconds=took
            )
        log.info(
            "serving %s version %d (%d pairs seen; applied on %d shards in %.2f s)",
            served.name,
            served.version,
            served.head["pairs_seen"],
            len(applied),
            took,
        )

    def _swap_in(
        self,
        name: str,
        pick: Callable[[ServedModel | None], _Swap | None],
        gallery: Callable[[], Gallery],
        took: float | None = None,
    ) -> None:
        """Serve what ``pick`` chooses, given what is served now (under the swap lock: the
        other threads swap too), with its index over the newest gallery snapshot, in one
        reference assignment (the atomic swap); ``took``: the index's embedding time, when
        the index is new."""
        with self._swap:
            chosen = pick(self.served.get(name))
            if chosen is None:
                return
            served, index = chosen
            latest = gallery()
            if index is not None:
                index = index.covering(latest)  # rows that arrived while it was built
            self.served[name] = replace(
                served,
                index=index,
                gallery_items=len(latest),
                index_seconds=served.index_seconds if took is None else took,
            )
        self.keep_features(latest)

    def _embedded_behind(self, kind: EmbeddingKind, img_dim: int, earlier: ServedModel) -> bool:
        """Whether a new version (``kind``) has the index thread embed the gallery
        (:meth:`embed_behind`), the version thread going on to other models: it re-embeds raw
        vectors, and its rows are as wide as ``earlier``'s index, which answers meanwhile
        when ``wait_for_index`` is off."""
        if earlier.index is None or not kind.reembeds_raw_vectors:
            return False
        probe = np.zeros((1, img_dim), dtype=np.float32)
        widths = (k.rows("image", probe).shape[1] for k in (kind, earlier.index.embedding))
        return bool(next(widths) == next(widths))

    def embed_behind(self, gallery: Callable[[], Gallery]) -> None:
        """Embed the gallery with the newest version of each model that embeds raw vectors
        and swap it in with its index; a newer version served meanwhile (``wait_for_index``
        off) takes the fresher index."""
        for name, staged in list(self._staged.items()):
            started = time.perf_counter()
            index = EmbeddedGallery.build(
                staged.version, staged.embedding, gallery(), self.served[name].index
            )
            took = time.perf_counter() - started

            def pick(
                current: ServedModel | None,
                staged: ServedModel = staged,
                index: EmbeddedGallery = index,
            ) -> _Swap | None:
                if current is None or current.version <= staged.version:
                    return staged, index
                # A newer version answers from an earlier index: this one is fresher.
                return (current, index) if current.index_version < index.version else None

            self._swap_in(name, pick, gallery, took)
            if self._staged.get(name) is staged:
                del self._staged[name]
            log.info(
                "serving %s version %d (%d pairs seen; gallery embedded by version %d in %.2f s)",
                name,
                self.served[name].version,
                self.served[name].head.get("pairs_seen", 0),
                index.version,
                took,
            )

    def keep_features(self, gallery: Gallery) -> None:
        """Drop the gallery features no served model reads any more (an earlier version's
        landmarks, say)."""
        keys: set[tuple[object, ...]] = set()
        for served in list(self.served.values()):
            keys |= served.embedding.feature_keys()
        gallery.keep_features(keys)

    def lag(self, served: ServedModel | ServedEnsemble) -> float:
        """Seconds since a checkpoint newer than ``served`` was written; 0 when none is (an
        ensemble: its most lagging member's)."""
        if isinstance(served, ServedEnsemble):
            return max(self.lag(m) for m in served.members)
        version, created = self.newest.get(served.name, (served.version, 0.0))
        return max(0.0, time.time() - created) if version > served.version else 0.0

    def count_items(self, items: int) -> None:
        """Every served version's gallery size as ``items`` (the shards' rows together)."""
        with self._swap:
            for name, served in list(self.served.items()):
                self.served[name] = replace(served, gallery_items=items)

    def cover(self, gallery: Gallery) -> None:
        """Every served model's index over ``gallery`` (only new chunks are embedded)."""
        for name in list(self.served):
            with self._swap:
                current = self.served[name]
                index = current.index.covering(gallery) if current.index else None
                self.served[name] = replace(current, index=index, gallery_items=len(gallery))
