"""The newest checkpoint version of every model, hot-swapped, with the gallery index of the
models that need one (those without a fixed space) kept at a bounded cost."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from streamxm import defaults as D
from streamxm.learning.learner import model_from_state
from streamxm.serving.gallery import Gallery
from streamxm.serving.served import EmbeddedGallery, ServedEnsemble, ServedModel
from streamxm.storage.checkpoint import CheckpointStore

__all__ = ["ServedVersions"]

log = logging.getLogger(__name__)


class ServedVersions:
    """What each model serves now (:attr:`served`, replaced by one reference assignment per
    swap) and the newest version its store holds (:attr:`newest`).

    Parameters
    ----------
    store
        Checkpoint store the workers write to.
    reembed_seconds
        Least time between two re-embeddings of the whole gallery for one model without a
        fixed space: the bound on what new versions cost. Between them the last index proposes
        candidates and the served version re-ranks them exactly.
    """

    def __init__(self, store: CheckpointStore,
                 reembed_seconds: float = D.REEMBED_SECONDS) -> None:
        self.store = store
        self.reembed_seconds = reembed_seconds
        self.served: dict[str, ServedModel] = {}
        self.newest: dict[str, tuple[int, float]] = {}  # model -> (head version, created)
        # Head version last tried per model: a corrupt newest version (served: the previous
        # good one) is tried once, not on every refresh.
        self._attempted: dict[str, int] = {}
        self._reembed_after: dict[str, float] = {}  # model -> monotonic time of the next
        self._swap = threading.Lock()  # writers of self.served (refresh and re-embed threads)

    def follow(self, names: set[str], gallery: Gallery) -> None:
        """Load the new head version of each of ``names``, if any."""
        for name in names:
            head = self.store.head(name)
            if head is None:
                continue
            self.newest[name] = (int(head["version"]), float(head.get("created", time.time())))
            if head["version"] != self._attempted.get(name):
                self._attempted[name] = head["version"]
                self._load(name, gallery)

    def _load(self, name: str, gallery: Gallery) -> None:
        ckpt = self.store.load_latest(name)
        if ckpt is None:
            return
        model = model_from_state(ckpt.arrays, ckpt.meta)  # flushed: queries only read it
        head = dict(self.store.head(name) or {})
        head["pairs_seen"] = int(ckpt.meta["pairs_seen"])
        with self._swap:
            previous = self.served.get(name)
            index = None
            if not model.fixed_space:
                index = (previous.index.covering(gallery) if previous and previous.index
                         else EmbeddedGallery.build(ckpt.version, model, gallery))
            self.served[name] = ServedModel(  # one reference assignment: the atomic swap
                name=name, version=ckpt.version, model=model, head=head, loaded_at=time.time(),
                index=index, gallery_items=len(gallery))
        log.info("serving %s version %d (%d pairs seen)", name, ckpt.version,
                 head["pairs_seen"])

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

    def reembed(self, gallery: Gallery) -> None:
        """Re-embed ``gallery`` with the served version of each model without a fixed space
        whose index is older: per model, at most once per ``reembed_seconds`` and never more
        than a third of the time (the next one waits twice as long as the last one took), so
        a gallery that takes long to embed cannot take the API's CPU from the queries."""
        for name, served in list(self.served.items()):
            if served.index is None or served.index.version == served.version:
                continue
            if time.monotonic() < self._reembed_after.get(name, 0.0):
                continue
            started = time.monotonic()
            index = EmbeddedGallery.build(served.version, served.model, gallery)
            took = time.monotonic() - started
            self._reembed_after[name] = started + max(self.reembed_seconds, 3 * took)
            with self._swap:
                current = self.served.get(name)
                if current is not None and current.index is not None \
                        and current.index.version < index.version:
                    self.served[name] = replace(current, index=index.covering(gallery))
            log.info("re-embedded the gallery for %s version %d in %.1f s", name,
                     served.version, took)
