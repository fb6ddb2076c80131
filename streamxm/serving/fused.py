"""An ensemble's gallery as one space: its members' float32 rows side by side, so that the fused
score of every item is one inner product and an ensemble searches as exactly as one model.

Each member ``m`` scores an item ``x`` as ``s_m(q, x) = row_m(x) . query_m(q) + c_m(q)``: its
unit row against the query moved into the fixed space (:class:`~streamxm.models.embedding.
FixedSpace`), or its row by the served version against the query's (``c_m = 0``). The fused
score ``sum_m (s_m - offset_m) / scale_m`` (:meth:`~streamxm.models.ensemble.Ensemble.
standardisers`) is then ``[row_1(x), row_2(x), ...] . [query_1 / scale_1, query_2 / scale_2,
...]`` plus a constant per query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from streamxm.models.embedding import EmbeddingKind
from streamxm.serving.gallery import Gallery, GalleryRows, largest_norm
from streamxm.serving.served import EmbeddedGallery, ServedEnsemble

__all__ = ["FusedSpace"]

F32 = NDArray[np.float32]


@dataclass(frozen=True, eq=False)
class FusedSpace:
    """The members' rows of ``target`` items side by side, one float32 block per gallery chunk.

    ``sources`` are the objects the rows came from (each member's embedded index, or the
    gallery for a fixed space): the space is current while they are the served ones.
    ``widths`` and ``norms``: each member's columns and largest row norm.
    """

    sources: tuple[object, ...]
    gallery: Gallery
    target: str
    blocks: tuple[F32, ...]
    widths: tuple[int, ...]
    norms: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_reference", {})  # "rows" -> (sample, its rows)

    def reference_rows(self, kinds: Sequence[EmbeddingKind], sample: GalleryRows) -> F32:
        """The members' rows of the reference sample (what their scores are standardised
        over: :meth:`~streamxm.serving.gallery.Gallery.reference_sample`) side by side: a
        fixed space's unit rows, the other kinds' rows of the raw vectors (computed once per
        sample, the same on one server and on every gallery shard)."""
        found = self.kept_reference(sample)
        if found is not None:
            return found
        parts = [
            sample.unit(self.target)
            if kind.fixed
            else kind.rows(self.target, sample.raw(self.target)).astype(np.float32)
            for kind in kinds
        ]
        rows = np.hstack(parts).astype(np.float32)
        self._reference["rows"] = (sample, rows)  # type: ignore[attr-defined]
        return rows

    def kept_reference(self, sample: GalleryRows) -> F32 | None:
        """:meth:`reference_rows` of ``sample`` when they are made already (for the same
        items: a new gallery snapshot usually has the same sample)."""
        found: tuple[GalleryRows, F32] | None = self._reference.get("rows")  # type: ignore
        if found is None or not np.array_equal(found[0].ids, sample.ids):
            return None
        return found[1]

    def rows_at(self, rows: NDArray[np.int64]) -> F32:
        """The side-by-side rows at global row positions."""
        return self.gallery.gather(self.blocks, rows, (sum(self.widths),))

    def standardised(
        self, queries: list[tuple[F32, float]], weights: tuple[float, ...], reference: F32
    ) -> tuple[F32, float, float]:
        """The scan query of one search and its constant: each member's query divided by
        its scale, where offset and scale are the mean and standard deviation (1 when 0) of
        its scores over the ``reference`` rows (:meth:`reference_rows`), the scale divided by
        the member's weight, as
        :meth:`~streamxm.models.ensemble.Ensemble.standardisers`; and the largest term any
        row can contribute (for the rounding margin)."""
        parts, constant, reach, at = [], 0.0, 0.0, 0
        for (query, c), width, norm, weight in zip(
            queries, self.widths, self.norms, weights, strict=True
        ):
            scores = reference[:, at : at + width].astype(np.float64) @ query + c
            at += width
            std = float(scores.std())
            scale = (std if std > 0 else 1.0) / weight
            parts.append(query / np.float32(scale))
            constant += (c - float(scores.mean())) / scale
            reach += float(np.linalg.norm(query)) * norm / scale
        return np.concatenate(parts).astype(np.float32), constant, reach

    @staticmethod
    def sources_of(
        ensemble: ServedEnsemble, gallery: Gallery, target: str
    ) -> tuple[object, ...] | None:
        """What each member's rows come from, or ``None`` when a member's rows are not exact
        float32 ones over exactly ``gallery`` (an index still embedding new rows, or an
        int8 one): the ensemble is then searched member by member."""
        sources: list[object] = []
        for served in ensemble.members:
            if served.embedding.fixed:
                sources.append(gallery)
                continue
            index = served.index
            if (
                index is None
                or index.version != served.version
                or not index.exact(target)
                or not index.covers(gallery)
            ):
                return None
            sources.append(index)
        return tuple(sources)

    def current(self, sources: tuple[object, ...]) -> bool:
        return len(sources) == len(self.sources) and all(
            a is b for a, b in zip(sources, self.sources, strict=True)
        )

    @classmethod
    def build(cls, sources: tuple[object, ...], gallery: Gallery, target: str) -> FusedSpace:
        parts = [
            s.blocks(target) if isinstance(s, EmbeddedGallery) else gallery.exact_blocks(target)
            for s in sources
        ]
        blocks = tuple(np.hstack(chunk_parts) for chunk_parts in zip(*parts, strict=True))
        widths = tuple(int(p[0].shape[1]) if p else 0 for p in parts)
        norms = tuple(largest_norm(p) for p in parts)
        return cls(sources, gallery, target, blocks, widths, norms)
