"""What serving hands out: a served model version, an ensemble of served members, the gallery
index a version embedded, a search's answer, and the errors a query can meet.

All of them are immutable: a query takes one reference and sees one version, never half of a
swap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from streamxm.models import CrossModalModel
from streamxm.models.embedding import EmbeddingKind, IndexUpdate
from streamxm.models.ensemble import Ensemble, EnsembleSpec
from streamxm.serving.gallery import Gallery, GalleryChunk, largest_norm
from streamxm.serving.index import Block, index_block

__all__ = [
    "AUTO",
    "EmbeddedGallery",
    "EnsembleUnsupported",
    "InvalidModelName",
    "ModelNotReady",
    "SameModalityUnsupported",
    "SearchAnswer",
    "SearchQuery",
    "ServedEnsemble",
    "ServedModel",
    "UnknownModel",
    "direction_of",
    "other_modality",
]


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
    fixed space, always the served version's own (a version is served once its index is
    built).

    A kind with a linear head (:class:`~streamxm.models.embedding.LinearHeads`) embeds each
    chunk from the chunk's kept features, one product per version; others compute their rows
    from the raw vectors. Rows the kind keeps as float32
    (:meth:`~streamxm.models.embedding.EmbeddingKind.scans_float32`) are scanned so, their
    scan scores the rows' inner products (to float32 rounding); others in the backend's
    reduced precision.
    """

    version: int
    embedding: EmbeddingKind
    # chunk -> (image embeddings, text embeddings) as the backend scans them, in gallery order
    embedded: tuple[tuple[GalleryChunk, Block, Block], ...]
    #: The gallery snapshot of exactly these chunks (what the index's rows refer to).
    gallery: Gallery = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "_blocks",
            {
                "image": tuple(a for _, a, _ in self.embedded),
                "text": tuple(b for _, _, b in self.embedded),
            },
        )
        object.__setattr__(self, "gallery", Gallery(tuple(c for c, _, _ in self.embedded)))
        object.__setattr__(self, "_norms", {})
        object.__setattr__(self, "_errors", {})

    def blocks(self, modality: str) -> tuple[Block, ...]:
        return self._blocks[modality]  # type: ignore[attr-defined,no-any-return]

    def embedded_at(self, rows: NDArray[np.int64], modality: str) -> NDArray[np.float32]:
        """The float32 embeddings of ``modality`` at global row positions (an exact index)."""
        return self.gallery.gather(self.blocks(modality), rows)

    def norm(self, modality: str) -> float:
        """The largest row norm of ``modality``'s float32 embeddings (computed once)."""
        norms: dict[str, float] = self._norms  # type: ignore[attr-defined]
        if modality not in norms:
            norms[modality] = largest_norm(self.blocks(modality))
        return norms[modality]

    def float32(self, modality: str) -> bool:
        """Whether ``modality``'s blocks are float32 (scan scores are the embeddings')."""
        return all(isinstance(b, np.ndarray) for b in self.blocks(modality))

    def exact(self, modality: str) -> bool:
        """Whether ``modality``'s scan scores are the version's own (to float32 rounding):
        float32 blocks embedded from features kept as computed."""
        return self.float32(modality) and self._feature_error(modality) == 0.0

    def scan_error(self, modality: str, query: NDArray[np.float32]) -> float:
        """How far the version's exact score of any row of ``modality`` can lie from its
        embedding's inner product with ``query`` beyond float32 rounding: the rounding of the
        chunks' kept features (:meth:`~streamxm.models.heads.FeatureMap.kept_error`) through
        the version's linear head (:meth:`~streamxm.models.heads.LinearHead.score_error`);
        0 where the features are kept as computed. The embeddings' own scores then stand
        for the version's only as a bound, and a search scores its candidates from the raw
        vectors."""
        head = self.embedding.head(modality)
        if head is None:
            return 0.0
        return head.score_error(self._feature_error(modality), query)

    def _feature_error(self, modality: str) -> float:
        """The largest :meth:`~streamxm.serving.gallery.GalleryChunk.kept_error` of the
        chunks' features of ``modality`` (computed once)."""
        errors: dict[str, float] = self._errors  # type: ignore[attr-defined]
        if modality not in errors:
            head = self.embedding.head(modality)
            fmap = head.features if head is not None else None
            errors[modality] = (
                0.0
                if fmap is None
                else max((c.kept_error(modality, fmap) for c in self.gallery.chunks), default=0.0)
            )
        return errors[modality]

    def covers(self, gallery: Gallery) -> bool:
        """Whether this index is over exactly ``gallery``'s chunks (nothing to embed)."""
        return len(self.embedded) == len(gallery.chunks) and all(
            c is e[0] for c, e in zip(gallery.chunks, self.embedded, strict=True)
        )

    def covering(self, gallery: Gallery) -> EmbeddedGallery:
        """The same version over ``gallery``: chunks it has keep their embeddings, new ones
        are embedded now (O(new rows))."""
        if self.covers(gallery):
            return self  # the common case on the query path: nothing to build
        known = {id(c): (c, a, b) for c, a, b in self.embedded}
        rows = len(gallery)
        staying = {id(c) for c in gallery.chunks}
        # What new chunks can take rows from: the chunks they replace, not the whole index.
        replaced = EmbeddedGallery(
            self.version,
            self.embedding,
            tuple(e for e in self.embedded if id(e[0]) not in staying),
        )
        return EmbeddedGallery(
            self.version,
            self.embedding,
            tuple(known.get(id(c)) or replaced._carried(c, rows) for c in gallery.chunks),
        ).bounded()

    def bounded(self) -> EmbeddedGallery:
        """This index with the bound of its kept features' rounding worked out
        (:meth:`scan_error`): a pass over the kept float16 rows of chunks new to it, on the
        thread that builds it, not on the first search (the event loop)."""
        for modality in ("image", "text"):
            self._feature_error(modality)
        return self

    def _carried(self, chunk: GalleryChunk, gallery_rows: int) -> tuple[GalleryChunk, Block, Block]:
        """A new chunk's embeddings, those of the rows this index holds already taken from it
        (:meth:`~streamxm.serving.gallery.GalleryChunk.rows_in`) when the model embeds raw
        vectors into float32 rows: rows moving from the stream tail into a segment would
        otherwise pass through the model's towers again, as costly as a new version. (A linear
        head embeds from the features its chunk carries: one product.)"""
        kind = self.embedding
        if (
            not self.embedded
            or any(kind.head(m) is not None for m in ("image", "text"))
            or not (self.exact("image") and self.exact("text"))
        ):
            return _embed(kind, chunk, gallery_rows)
        rows, source = chunk.rows_in(self.gallery)
        if not len(rows):
            return _embed(kind, chunk, gallery_rows)
        missing = np.ones(len(chunk), dtype=bool)
        missing[rows] = False
        blocks = []
        for modality in ("image", "text"):
            known = self.embedded_at(source, modality)
            out = np.empty((len(chunk), known.shape[1]), dtype=np.float32)
            out[rows] = known
            if missing.any():
                out[missing] = _embedded_raw(kind, chunk, modality, np.flatnonzero(missing))
            blocks.append(out)
        return chunk, blocks[0], blocks[1]

    @classmethod
    def build(
        cls,
        version: int,
        embedding: EmbeddingKind,
        gallery: Gallery,
        earlier: EmbeddedGallery | None = None,
    ) -> EmbeddedGallery:
        """``embedding``'s index of ``gallery``; ``earlier`` (an earlier version's index) lends
        the rows of the chunks it holds to a kind that recomputes only what changed since
        (:meth:`~streamxm.models.embedding.EmbeddingKind.updater`)."""
        updates = (
            (
                embedding.updater(earlier.embedding, "image"),
                embedding.updater(earlier.embedding, "text"),
            )
            if earlier is not None
            else (None, None)
        )
        known = {id(e[0]): e for e in earlier.embedded} if earlier is not None else {}
        embedded = []
        for chunk in gallery.chunks:
            found = known.get(id(chunk))
            since = _embedded_since(embedding, updates, found) if found is not None else None
            embedded.append(since or _embed(embedding, chunk, len(gallery)))
        return cls(version, embedding, tuple(embedded)).bounded()


def _embed(
    kind: EmbeddingKind, chunk: GalleryChunk, gallery_rows: int
) -> tuple[GalleryChunk, Block, Block]:
    """A chunk's rows of both modalities: from its kept features through a linear head, or
    from its raw vectors; features kept compact in a gallery of ``gallery_rows`` that the
    head's feature map keeps so (:meth:`~streamxm.models.heads.FeatureMap.compact`)."""
    blocks = []
    for modality in ("image", "text"):
        head = kind.head(modality)
        fmap = head.features if head is not None else None
        rows = (
            head.embed(
                chunk.features(modality, fmap, fmap is not None and fmap.compact(gallery_rows))
            )
            if head is not None
            else _embedded_raw(kind, chunk, modality)
        )
        blocks.append(_scanned(kind, rows))
    return chunk, blocks[0], blocks[1]


def _scanned(kind: EmbeddingKind, rows: NDArray[np.float32]) -> Block:
    """Rows as the kind's scans read them: float32, or the backend's reduced precision."""
    return rows if kind.scans_float32(rows.shape[1]) else index_block(rows)


def _embedded_since(
    kind: EmbeddingKind,
    updates: tuple[IndexUpdate | None, IndexUpdate | None],
    found: tuple[GalleryChunk, Block, Block],
) -> tuple[GalleryChunk, Block, Block] | None:
    """A chunk's rows updated from an earlier version's float32 rows of it (``updates``: the
    kind's :meth:`~streamxm.models.embedding.EmbeddingKind.updater` per modality); ``None``
    when the kind has no update or the earlier rows are reduced-precision codes, kept without
    their float32."""
    chunk, *kept = found
    blocks = []
    for modality, update, rows in zip(("image", "text"), updates, kept, strict=True):
        if update is None or not isinstance(rows, np.ndarray):
            return None
        parts = [
            update(rows[at : at + _EMBED_ROWS], chunk.raw(modality, slice(at, at + _EMBED_ROWS)))
            for at in range(0, len(chunk), _EMBED_ROWS)
        ]
        blocks.append(_scanned(kind, np.concatenate(parts) if parts else rows.copy()))
    return chunk, blocks[0], blocks[1]


#: Rows a model without a linear head embeds at once: bounds its temporaries (a kernel model
#: keeps float64 kernel terms, several per row and landmark, before it flattens them).
_EMBED_ROWS = 8192


def _embedded_raw(
    kind: EmbeddingKind,
    chunk: GalleryChunk,
    modality: str,
    rows: NDArray[np.int64] | None = None,
) -> NDArray[np.float32]:
    """The index rows of the chunk's raw vectors (``rows``: of those rows only)."""
    size = len(chunk) if rows is None else len(rows)

    def part(at: int) -> NDArray[np.float32]:
        which = slice(at, at + _EMBED_ROWS) if rows is None else rows[at : at + _EMBED_ROWS]
        return kind.rows(modality, chunk.raw(modality, which)).astype(np.float32)

    parts = [part(at) for at in range(0, size, _EMBED_ROWS)]
    return (
        np.concatenate(parts)
        if parts
        else kind.rows(modality, chunk.raw(modality)).astype(np.float32)
    )


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One model version; for a model without a fixed space also its gallery index (this
    version's embeddings, or an earlier version's while a model that embeds raw vectors makes
    its own) and how long the newest one took (``index_seconds``: what a version costs the
    server)."""

    name: str
    version: int
    model: CrossModalModel
    head: dict[str, Any]
    loaded_at: float
    index: EmbeddedGallery | None = None
    gallery_items: int = 0
    index_seconds: float = 0.0
    #: What the version offers search (:meth:`~streamxm.models.base.CrossModalModel.
    #: embedding`), made once per version: search reads this, never the model.
    embedding: EmbeddingKind = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.embedding is None:
            object.__setattr__(self, "embedding", self.model.embedding())

    @property
    def index_version(self) -> int:
        """Version whose embeddings of the gallery propose this version's candidates: its own,
        or an earlier one while its own are being made (``wait_for_index`` off)."""
        return self.index.version if self.index is not None else self.version

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
        return Ensemble(self.spec, {m.name: m.embedding for m in self.members})


class SearchQuery(NamedTuple):
    """One top-k search: the ``k`` best gallery items of modality ``target`` (default: the
    other modality) for ``vector``, a query of ``modality``, by what answers ``name``.

    ``version`` pins a kept version of a model; ``members`` names an ensemble's members'
    versions (what a gallery shard is asked: every shard of one answer reads the same)."""

    name: str
    modality: str
    vector: NDArray[np.float32]
    k: int
    target: str | None = None
    version: int | None = None
    members: Mapping[str, int] | None = None

    @property
    def searched(self) -> str:
        """The modality searched: ``target``, or the other modality."""
        return self.target or other_modality(self.modality)


@dataclass(frozen=True)
class SearchAnswer:
    """What :meth:`~streamxm.serving.server.ModelServer.search` found: hits best first, and
    how fresh the answer is."""

    served: ServedModel | ServedEnsemble
    hits: list[tuple[str, float]]
    #: Seconds since a newer checkpoint than the served one was written (0 when none is; an
    #: ensemble's: its most lagging member's).
    version_lag_s: float
    #: Version whose gallery index proposed the candidates (the served one; None for an
    #: ensemble, whose members each propose theirs).
    index_version: int | None
    #: The share of the gallery the answer covers: 1.0, or less for a partial answer of a
    #: sharded gallery some of whose shards did not answer.
    covered: float = 1.0
