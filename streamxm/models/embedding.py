"""Embedding kinds: what one model version offers the serving side, and all it offers.

A model makes one kind from its state (:meth:`~streamxm.models.base.CrossModalModel.embedding`);
serving holds the kind, never the model's class or name. Each kind says how a gallery item's
*row* (what an index keeps) and a query's *scan query* score as one inner product, how a new
version's rows follow from an earlier version's, and how precise a scan of its rows is, which is
the error bound a search proves its top k against.

==================  ==========================================  ==================================
kind                the rows an index keeps                     what a new version costs the rows
==================  ==========================================  ==================================
:class:`FixedSpace`  the gallery's unit rows (the query moves)   nothing
:class:`LinearHeads` ``finish(features(x) W + b)``: the          one product with the kept features
                     features do not change between versions
:class:`Towers`      the version's embeddings of the raw rows    a pass of the model over the rows
:class:`KernelTerms` kernel terms that change where the          the columns of the rewritten terms
                     version's support changed
==================  ==========================================  ==================================

Rows of :class:`Towers`, :class:`LinearHeads` and :class:`FixedSpace` are scanned in float32,
whose scores are the version's own to float32 rounding (a fixed space's reduced-precision copy is
proven against the float32 rows); :class:`KernelTerms` rows are as wide as the model's pool and
support, and past ``float32_width`` are scanned in the backend's reduced precision, their
candidates re-ranked without a proof (:meth:`EmbeddingKind.scans_float32`).

Every kind also carries the version's exact scores (``similarity``, ``embed_images``,
``embed_texts``), which a search re-ranks its candidates with.

>>> import numpy as np
>>> kind = Towers(
...     embed_images=lambda x: np.asarray(x, np.float32),
...     embed_texts=lambda x: np.asarray(x, np.float32),
...     similarity=lambda a, b: np.asarray(a, np.float64) @ np.asarray(b, np.float64).T,
... )
>>> query, constant = kind.scan_query("image", "text", np.array([1.0, 2.0], np.float32))
>>> float(kind.rows("text", np.array([[3.0, 4.0]]))[0] @ query + constant)
11.0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from streamxm.models.array_types import F32, F64, Vectors
from streamxm.models.heads import LinearHead

__all__ = [
    "EmbeddingKind",
    "FixedSpace",
    "IndexUpdate",
    "KernelTerms",
    "LinearHeads",
    "Scores",
    "Towers",
]

#: ``(kept rows, raw vectors) -> rows``: an earlier version's rows of some items made this
#: version's (:meth:`EmbeddingKind.updater`).
IndexUpdate = Callable[[F32, Vectors], F32]
#: ``vectors -> (q, c)`` with the score of a row ``= q . unit(row) + c`` (:class:`FixedSpace`).
MoveQueries = Callable[[Vectors], tuple[F64, F64]]


class Scores(Protocol):
    """A version's exact scores: what an ensemble fuses and a search re-ranks with."""

    def embed_images(self, x: Vectors) -> F32: ...

    def embed_texts(self, x: Vectors) -> F32: ...

    def similarity(self, imgs: Vectors, txts: Vectors) -> F64: ...


@dataclass(frozen=True, eq=False)
class EmbeddingKind:
    """The serving side of one model version (immutable: a search sees one version).

    Parameters
    ----------
    embed_images, embed_texts
        Raw vectors ``(n, dim)`` -> embeddings whose inner products are the similarity.
    similarity
        ``(imgs, txts) -> (n_imgs, n_txts)`` scores, the version's exact ones.
    shared_space
        Whether images and texts embed in one space (same-modality search makes sense).
    """

    embed_images: Callable[[Vectors], F32]
    embed_texts: Callable[[Vectors], F32]
    similarity: Callable[[Vectors, Vectors], F64]
    shared_space: bool = False

    #: Whether the query moves into the gallery's unit rows (the rows need no index).
    fixed: ClassVar[bool] = False

    def scans_float32(self, width: int) -> bool:
        """Whether an index keeps rows ``width`` wide as float32, whose scans give the
        version's scores to float32 rounding (so a scan bounds the rows it leaves out), rather
        than in the backend's reduced precision, whose candidates are re-ranked without a
        bound. Every row of these kinds is float32."""
        return True

    def embed(self, modality: str, x: Vectors) -> F32:
        """Embeddings of raw vectors of ``modality`` (``"image"`` or ``"text"``)."""
        return self.embed_images(x) if modality == "image" else self.embed_texts(x)

    def rows(self, modality: str, x: Vectors) -> F32:
        """The rows an index keeps for gallery items of ``modality`` from their raw vectors,
        scored against :meth:`query` of a query of the other modality."""
        return self.embed(modality, x)

    def query(self, modality: str, x: Vectors) -> F32:
        """Queries of ``modality`` against the other modality's :meth:`rows`."""
        return self.embed(modality, x)

    def head(self, modality: str) -> LinearHead | None:
        """The linear head that embeds ``modality`` from kept features, if any."""
        return None

    def updater(self, earlier: EmbeddingKind, modality: str) -> IndexUpdate | None:
        """A function from ``earlier``'s :meth:`rows` of some items (and their raw vectors) to
        this version's, recomputing only what changed; ``None``: compute the rows anew."""
        return None

    @property
    def reembeds_raw_vectors(self) -> bool:
        """Whether a new version passes the gallery's raw vectors through the model (no fixed
        space, no linear head on some side): the costly kind of version change."""
        return not self.fixed and any(self.head(m) is None for m in ("image", "text"))

    def feature_keys(self) -> set[tuple[object, ...]]:
        """Keys ``(modality, *map key)`` of the gallery features the heads read."""
        keys = set()
        for modality in ("image", "text"):
            head = self.head(modality)
            if head is not None and head.features is not None:
                keys.add((modality, *head.features.key))
        return keys

    def scan_query(self, modality: str, target: str, vector: F32) -> tuple[F32, float]:
        """``(query, c)``: a query of ``modality`` against items of ``target``, with the score
        of an item ``= row . query + c`` (``row``: :meth:`rows`; the unit row in a fixed
        space's cross-modal search; the embedding in a same-modality one)."""
        if target != modality:
            return self.query(modality, vector[None, :])[0].astype(np.float32), 0.0
        return self.embed(modality, vector[None, :])[0].astype(np.float32), 0.0

    def exact_scores(self, modality: str, target: str, query: F32, items: F32) -> F64:
        """The version's own scores of one query of ``modality`` against ``items`` of
        ``target``."""
        if modality == "image" and target == "text":
            return np.asarray(self.similarity(query[None, :], items)[0], dtype=np.float64)
        if modality == "text" and target == "image":
            return np.asarray(self.similarity(items, query[None, :])[:, 0], dtype=np.float64)
        own = self.embed(modality, items).astype(np.float64)
        return np.asarray(own @ self.embed(modality, query[None, :]).astype(np.float64)[0])


@dataclass(frozen=True, eq=False)
class Towers(EmbeddingKind):
    """Embeddings computed from the raw rows by the version's own model (SAM's towers): every
    new version re-embeds the gallery. The default kind."""


@dataclass(frozen=True, eq=False)
class LinearHeads(EmbeddingKind):
    """Embeddings ``finish(features(x) W + b)`` per side (:class:`~streamxm.models.heads.
    LinearHead`), whose features a server keeps, so a version costs one product per item;
    a side without a head (``None``) embeds raw vectors as :class:`Towers` do."""

    image_head: LinearHead | None = None
    text_head: LinearHead | None = None

    def head(self, modality: str) -> LinearHead | None:
        return self.image_head if modality == "image" else self.text_head


@dataclass(frozen=True, eq=False)
class FixedSpace(EmbeddingKind):
    """A score bilinear in the gallery's unit rows: ``s(q, x) = move(q) . unit(x) + c(q)``, so
    a version moves each query, O(model), and the unit rows are the index of every version.

    Parameters
    ----------
    to_texts, to_images
        Image queries against unit text rows, text queries against unit image rows, as
        ``(moved queries, constants)``.
    """

    to_texts: MoveQueries | None = None
    to_images: MoveQueries | None = None

    fixed: ClassVar[bool] = True

    def moved(self, target: str, x: Vectors) -> tuple[F64, F64]:
        """Queries moved into ``target``'s unit rows, with their constants."""
        move = self.to_texts if target == "text" else self.to_images
        assert move is not None, "a fixed space moves queries both ways"
        return move(x)

    def scan_query(self, modality: str, target: str, vector: F32) -> tuple[F32, float]:
        if target == modality:
            return super().scan_query(modality, target, vector)
        moved, constant = self.moved(target, vector[None, :])
        return moved[0].astype(np.float32), float(constant[0])


@dataclass(frozen=True, eq=False)
class KernelTerms(EmbeddingKind):
    """Rows of kernel terms (CMOMKS's): rows that change only where the version's support
    changed, the version's learned weights carried by the query.

    Parameters
    ----------
    index_rows, index_query
        ``(modality, vectors) -> rows`` and the queries scored against them.
    update
        ``(earlier kind, modality) -> IndexUpdate | None`` (:meth:`EmbeddingKind.updater`).
    """

    index_rows: Callable[[str, Vectors], F32] | None = None
    index_query: Callable[[str, Vectors], F32] | None = None
    update: Callable[[KernelTerms, str], IndexUpdate | None] | None = None
    #: What the model reads of an earlier version in :attr:`update` (its own state).
    source: Any = None
    #: Widest rows kept as float32; wider ones (a large pool and support: several times the
    #: gallery's own bytes) are kept in the backend's reduced precision.
    float32_width: int = 256

    def scans_float32(self, width: int) -> bool:
        return width <= self.float32_width

    def rows(self, modality: str, x: Vectors) -> F32:
        assert self.index_rows is not None, "kernel terms name their rows"
        return self.index_rows(modality, x)

    def query(self, modality: str, x: Vectors) -> F32:
        assert self.index_query is not None, "kernel terms name their queries"
        return self.index_query(modality, x)

    def updater(self, earlier: EmbeddingKind, modality: str) -> IndexUpdate | None:
        if self.update is None or not isinstance(earlier, KernelTerms):
            return None
        return self.update(earlier, modality)


class HasLinearHeads(Scores, Protocol):
    """A model whose sides may embed through linear heads."""

    @property
    def shared_space(self) -> bool: ...

    def linear_head(self, modality: str) -> LinearHead | None: ...


def linear_heads(model: HasLinearHeads) -> LinearHeads:
    """The :class:`LinearHeads` kind of a model with ``linear_head(modality)``."""
    return LinearHeads(
        model.embed_images,
        model.embed_texts,
        model.similarity,
        model.shared_space,
        image_head=model.linear_head("image"),
        text_head=model.linear_head("text"),
    )


class MovesQueries(Scores, Protocol):
    """A model whose score is bilinear in the unit rows when ``fixed_space`` holds."""

    @property
    def shared_space(self) -> bool: ...

    @property
    def fixed_space(self) -> bool: ...

    def queries_for_texts(self, imgs: Vectors) -> tuple[F64, F64]: ...

    def queries_for_images(self, txts: Vectors) -> tuple[F64, F64]: ...


def fixed_space_or_towers(model: MovesQueries) -> EmbeddingKind:
    """The :class:`FixedSpace` of a model whose settings make its score bilinear in the unit
    rows (``fixed_space``), else its :class:`Towers`."""
    parts = (model.embed_images, model.embed_texts, model.similarity, model.shared_space)
    if not model.fixed_space:
        return Towers(*parts)
    return FixedSpace(*parts, to_texts=model.queries_for_texts, to_images=model.queries_for_images)
