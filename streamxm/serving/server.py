"""Serving: the newest checkpoint of every model, hot-swapped, and a search gallery kept from
the pairs stream.

One background thread (:meth:`ModelServer.refresh`) does all the writing: it reads new pairs into
the gallery and loads new checkpoint versions. Readers take a reference to an immutable
:class:`ServedModel` and never lock, so a query sees one model version and the gallery
embeddings computed with it, never half of a swap.

The gallery is a tuple of immutable chunks (ids, images, texts); a new chunk is added for each
batch read, small trailing chunks are merged, and the oldest chunks leave once the total passes
``gallery_max`` (so the cap holds to within one chunk). Each served model keeps one embedding
array per chunk; unchanged chunks keep theirs when the gallery grows, and a new model version
re-embeds all of them before it is swapped in.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm.learning.learner import StreamLearner
from streamxm.models import CrossModalModel, split_name
from streamxm.stream.client import read_schema
from streamxm.stream.keys import Keys
from streamxm.stream.messages import InvalidPair, Limits, decode_pair
from streamxm.stream.redis_conn import str_set, stream_entries
from streamxm.worker.checkpoint import CheckpointStore

__all__ = ["GalleryChunk", "InvalidModelName", "ModelNotReady", "ModelServer",
           "SameModalityUnsupported", "ServedModel", "UnknownModel", "other_modality"]

log = logging.getLogger(__name__)

_MERGE_BELOW = 4096  # rows: a trailing chunk smaller than this absorbs the next batch


class InvalidModelName(ValueError):
    """A name that is no model at all (not merely one without a learner here)."""


class UnknownModel(LookupError):
    """No learner of this model exists in the namespace."""


class ModelNotReady(LookupError):
    """The model exists (or the server has not looked yet) but no checkpoint is loaded."""


def other_modality(modality: str) -> Literal["image", "text"]:
    """``"image"`` <-> ``"text"``: the default search target of a query."""
    return "text" if modality == "image" else "image"


class SameModalityUnsupported(ValueError):
    """A same-modality search on a model without a shared embedding space."""


@dataclass(frozen=True, eq=False)
class GalleryChunk:
    """Immutable rows of the gallery, identified by object identity."""

    ids: NDArray[np.str_]
    img: NDArray[np.float32]
    txt: NDArray[np.float32]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One model version with the gallery embedded by it."""

    name: str
    version: int
    model: CrossModalModel
    head: dict[str, Any]
    loaded_at: float
    # chunk -> (image embeddings, text embeddings), in gallery order
    embedded: tuple[tuple[GalleryChunk, NDArray[np.float32], NDArray[np.float32]], ...]

    @property
    def gallery_size(self) -> int:
        return sum(len(c) for c, _, _ in self.embedded)


def _embed(model: CrossModalModel, chunk: GalleryChunk) -> tuple[
        GalleryChunk, NDArray[np.float32], NDArray[np.float32]]:
    return chunk, model.embed_images(chunk.img), model.embed_texts(chunk.txt)


class ModelServer:
    """Keeps the served models and the gallery current.

    Parameters
    ----------
    client
        Redis client.
    store
        Checkpoint store the workers write to.
    namespace
        Stream namespace.
    gallery_max
        Gallery size cap (items; within one chunk).
    """

    def __init__(self, client: redis.Redis, store: CheckpointStore, namespace: str = "default",
                 gallery_max: int = 100_000, limits: Limits = Limits(),
                 read_count: int = 5000) -> None:
        self.r = client
        self.store = store
        self.keys = Keys(namespace)
        self.gallery_max = gallery_max
        self.limits = limits
        self.read_count = read_count
        self.chunks: tuple[GalleryChunk, ...] = ()
        self.served: dict[str, ServedModel] = {}
        self.last_gallery_id = "0-0"
        self.gallery_skipped = 0
        self.known: frozenset[str] = frozenset()  # models registered in the namespace
        self.refreshed = False  # one full refresh done: until then every model is "not ready"
        # Head version last tried per model: a corrupt newest version (served: the previous
        # good one) is tried once, not on every refresh.
        self._attempted: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- background refresh ------------------------------------------------------------------
    def start(self, interval: float = 0.25) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.refresh()
                except redis.RedisError as exc:
                    log.warning("refresh failed (will retry): %s", exc)
                except Exception:  # the thread must outlive any one bad checkpoint
                    log.exception("refresh failed (will retry)")
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="streamxm-refresh", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def refresh(self) -> None:
        """Read new gallery pairs, load new checkpoint versions, re-embed as needed."""
        gallery_changed = self._read_gallery()
        names = str_set(self.r.smembers(self.keys.models))
        self.known = frozenset(names)
        for name in names:
            head = self.store.head(name)
            if head is None:
                continue
            current = self.served.get(name)
            if head["version"] != self._attempted.get(name):
                self._attempted[name] = head["version"]
                self._load(name)
            elif current is not None and gallery_changed:
                self._reembed(current)
        self.refreshed = True

    def _read_gallery(self) -> bool:
        changed = False
        while True:
            reply = self.r.xread({self.keys.pairs: self.last_gallery_id}, count=self.read_count)
            entries = stream_entries(reply)
            if not entries:
                return changed
            img_dim, txt_dim = read_schema(self.r, self.keys) or (None, None)
            ids, imgs, txts = [], [], []
            for _entry_id, fields in entries:
                if fields is None:
                    continue
                try:
                    pair = decode_pair(fields, img_dim, txt_dim, limits=self.limits)
                except InvalidPair:
                    self.gallery_skipped += 1
                    continue
                ids.append(pair.id)
                imgs.append(pair.img)
                txts.append(pair.txt)
            self.last_gallery_id = entries[-1][0]
            if ids:
                self._append(GalleryChunk(np.asarray(ids), np.vstack(imgs), np.vstack(txts)))
                changed = True

    def _append(self, chunk: GalleryChunk) -> None:
        chunks = list(self.chunks)
        if chunks and len(chunks[-1]) < _MERGE_BELOW:
            tail = chunks.pop()
            chunk = GalleryChunk(np.concatenate([tail.ids, chunk.ids]),
                                 np.vstack([tail.img, chunk.img]), np.vstack([tail.txt, chunk.txt]))
        chunks.append(chunk)
        total = sum(len(c) for c in chunks)
        while total > self.gallery_max and chunks:
            excess = total - self.gallery_max
            oldest = chunks[0]
            if excess >= len(oldest):
                chunks.pop(0)
                total -= len(oldest)
            else:
                chunks[0] = GalleryChunk(oldest.ids[excess:], oldest.img[excess:],
                                         oldest.txt[excess:])
                total -= excess
        self.chunks = tuple(chunks)

    def _load(self, name: str) -> None:
        ckpt = self.store.load_latest(name)
        if ckpt is None:
            return
        learner = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
        learner.flush()  # before publishing: queries then only read the model
        head = dict(self.store.head(name) or {})
        head["pairs_seen"] = learner.pairs_seen
        served = ServedModel(
            name=name, version=ckpt.version, model=learner.model, head=head,
            loaded_at=time.time(), embedded=tuple(_embed(learner.model, c) for c in self.chunks),
        )
        self.served[name] = served  # one reference assignment: the atomic swap
        log.info("serving %s version %d (%d pairs seen)", name, ckpt.version, learner.pairs_seen)

    def _reembed(self, current: ServedModel) -> None:
        known = {id(c): (c, a, b) for c, a, b in current.embedded}
        embedded = tuple(known.get(id(c)) or _embed(current.model, c) for c in self.chunks)
        self.served[current.name] = ServedModel(
            current.name, current.version, current.model, current.head, current.loaded_at,
            embedded)

    # -- queries -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self.served)

    def get(self, name: str) -> ServedModel:
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

    def similarity(self, name: str, images: NDArray[np.float32], texts: NDArray[np.float32],
                   matrix: bool) -> tuple[ServedModel, NDArray[np.float64]]:
        """Scores of (image_i, text_i) pairs, or the full image x text matrix."""
        served = self.get(name)
        if matrix:
            return served, served.model.similarity(images, texts)
        a = served.model.embed_images(images).astype(np.float64)
        b = served.model.embed_texts(texts).astype(np.float64)
        return served, np.einsum("ij,ij->i", a, b)

    def search(self, name: str, modality: str, vector: NDArray[np.float32], k: int,
               target: str | None = None) -> tuple[ServedModel, list[tuple[str, float]]]:
        """The ``k`` best gallery items of modality ``target`` (default: the other modality)
        for one query vector of ``modality``. Same-modality search needs a model whose
        embeddings share one space; others raise :class:`SameModalityUnsupported`."""
        served = self.get(name)
        target = target or other_modality(modality)
        if target == modality and not served.model.shared_space:
            raise SameModalityUnsupported(
                f"model {name!r} embeds images and texts in different spaces: it answers "
                f"cross-modal search only (target must be {other_modality(modality)})")
        if modality == "image":
            query = served.model.embed_images(vector[None, :])[0]
        else:
            query = served.model.embed_texts(vector[None, :])[0]
        best_ids: list[NDArray[np.str_]] = []
        best_scores: list[NDArray[np.float32]] = []
        for chunk, img_emb, txt_emb in served.embedded:
            scores = (txt_emb if target == "text" else img_emb) @ query
            if len(scores) > k:
                top = np.argpartition(-scores, k - 1)[:k]
                best_ids.append(chunk.ids[top])
                best_scores.append(scores[top])
            else:
                best_ids.append(chunk.ids)
                best_scores.append(scores)
        if not best_ids:
            return served, []
        ids, scores = np.concatenate(best_ids), np.concatenate(best_scores)
        order = np.argsort(-scores, kind="stable")[:k]
        return served, [(str(ids[i]), float(scores[i])) for i in order]
