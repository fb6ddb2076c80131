"""Kept versions that queries name (``"version": V``), loaded from the store on first use and
cached, most recently used last."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import replace

from streamxm.learning.stream_learner import model_from_state
from streamxm.serving.served import EmbeddedGallery, ServedModel
from streamxm.storage.checkpoint import CheckpointStore

__all__ = ["PinnedVersions"]


class PinnedVersions:
    """At most ``capacity`` pinned versions in memory; the least recently used one goes first.

    The event loop and the query threads share it (a lock guards the cache, not the load).
    """

    def __init__(self, store: CheckpointStore, capacity: int = 4) -> None:
        self.store = store
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, int], ServedModel] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._cache

    def cached(self, name: str, version: int) -> ServedModel | None:
        """The pinned version if it is in memory (then the most recently used)."""
        with self._lock:
            pinned = self._cache.get((name, version))
            if pinned is not None:
                self._cache.move_to_end((name, version))
        return pinned

    def keep_index(self, name: str, version: int, index: EmbeddedGallery) -> None:
        """Keep the gallery embedded by a pinned version with it (if it is still cached)."""
        with self._lock:
            pinned = self._cache.get((name, version))
            if pinned is not None:
                self._cache[(name, version)] = replace(pinned, index=index)

    def load(self, name: str, version: int) -> ServedModel:
        """Read kept ``version`` of ``name`` from the store
        (:class:`~streamxm.storage.checkpoint.VersionNotKept` or its ``VersionUnreadable``
        when it cannot) and cache it."""
        ckpt = self.store.load_kept(name, version)
        pinned = ServedModel(
            name=name,
            version=ckpt.version,
            model=model_from_state(ckpt.arrays, ckpt.meta),
            head={
                "version": ckpt.version,
                "created": ckpt.created,
                "last_id": ckpt.last_id,
                "pairs_seen": int(ckpt.meta["pairs_seen"]),
            },
            loaded_at=time.time(),
        )
        with self._lock:
            self._cache[(name, version)] = pinned
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return pinned
