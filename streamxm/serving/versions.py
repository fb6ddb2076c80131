"""The newest checkpoint version of every model, hot-swapped; a model without a fixed space is
swapped only once its new version has embedded the whole gallery, so every answer is ranked by
the version it names."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from streamxm.learning.learner import model_from_state
from streamxm.serving.gallery import Gallery
from streamxm.serving.served import EmbeddedGallery, ServedEnsemble, ServedModel, feature_keys
from streamxm.storage.checkpoint import CheckpointStore

__all__ = ["ServedVersions"]

log = logging.getLogger(__name__)


class ServedVersions:
    """What each model serves now (:attr:`served`, replaced by one reference assignment per
    swap) and the newest version its store holds (:attr:`newest`).

    A new version of a model without a fixed space embeds the gallery before it is swapped in
    (from the features the gallery keeps for its linear head, one product, or from the raw
    vectors); until then the previous version answers, and the lag
    (:meth:`lag`) says for how long a newer one has existed.

    Parameters
    ----------
    store
        Checkpoint store the workers write to.
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.served: dict[str, ServedModel] = {}
        self.newest: dict[str, tuple[int, float]] = {}  # model -> (head version, created)
        # Head version last tried per model: a corrupt newest version (served: the previous
        # good one) is tried once, not on every refresh.
        self._attempted: dict[str, int] = {}
        self._swap = threading.Lock()  # writers of self.served (version and gallery threads)

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
        head = dict(self.store.head(name) or {})
        head["pairs_seen"] = int(ckpt.meta["pairs_seen"])
        started = time.perf_counter()
        index = None if model.fixed_space else EmbeddedGallery.build(ckpt.version, model,
                                                                     gallery())
        with self._swap:
            latest = gallery()
            if index is not None:
                index = index.covering(latest)  # rows that arrived while it was built
            took = time.perf_counter() - started if index is not None else 0.0
            self.served[name] = ServedModel(  # one reference assignment: the atomic swap
                name=name, version=ckpt.version, model=model, head=head, loaded_at=time.time(),
                index=index, gallery_items=len(latest), index_seconds=took)
        self.keep_features(latest)
        log.info("serving %s version %d (%d pairs seen; gallery embedded in %.2f s)", name,
                 ckpt.version, head["pairs_seen"], took)

    def keep_features(self, gallery: Gallery) -> None:
        """Drop the gallery features no served model reads any more (an earlier version's
        landmarks, say)."""
        keys: set[tuple[object, ...]] = set()
        for served in list(self.served.values()):
            keys |= feature_keys(served.model)
        gallery.keep_features(keys)

    def lag(self, served: ServedModel | ServedEnsemble) -> float:
        """Seconds since a checkpoint newer than ``served`` was written; 0 when none is (an
        ensemble: its most lagging member's)."""
        if isinstance(served, ServedEnsemble):
            return max(self.lag(m) for m in served.members)
        version, created = self.newest.get(served.name, (served.version, 0.0))
        return max(0.0, time.time() - created) if version > served.version else 0.0

    def cover(self, gallery: Gallery) -> None:
        """Every served model's index over ``gallery`` (only new chunks are embedded)."""
        for name in list(self.served):
            with self._swap:
                current = self.served[name]
                index = current.index.covering(gallery) if current.index else None
                self.served[name] = replace(current, index=index, gallery_items=len(gallery))
