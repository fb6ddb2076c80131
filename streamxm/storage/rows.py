"""The gallery's rows as the store holds them: ids, unit rows and norms of both modalities, and
the tier merge that keeps their blocks few (the indexer's segments, the API's stream tail)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
from numpy.typing import NDArray

__all__ = ["CHUNK_MAX", "GalleryRows", "merge_count"]


@dataclass(frozen=True, eq=False)
class GalleryRows:
    """Immutable rows of the gallery (ids, unit rows and norms of both modalities), identified by
    object identity: what a segment stores and the indexer merges.

    Vectors are kept as unit rows (L2-normalised, float32) plus their norms: the unit rows are
    the fixed space that the bilinear models' transformed queries are scored against, and a raw
    vector is ``unit * norm`` (equal to what was pushed to float32 rounding), so the gallery
    holds each vector once.
    """

    ids: NDArray[np.str_]
    unit_img: NDArray[np.float32]
    unit_txt: NDArray[np.float32]
    norm_img: NDArray[np.float32]
    norm_txt: NDArray[np.float32]

    @classmethod
    def of(cls, ids: NDArray[np.str_], img: NDArray[np.float32], txt: NDArray[np.float32]) -> Self:
        ui, ni = _unit_rows(img)
        ut, nt = _unit_rows(txt)
        return cls(ids, ui, ut, ni, nt)

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def empty(cls) -> Self:
        """No rows."""
        none = np.empty((0, 0), dtype=np.float32)
        return cls(np.empty(0, dtype=np.str_), none, none, none[:, 0], none[:, 0])

    def unit(self, modality: str) -> NDArray[np.float32]:
        return self.unit_img if modality == "image" else self.unit_txt

    def raw(
        self, modality: str, rows: NDArray[np.intp] | slice = slice(None)
    ) -> NDArray[np.float32]:
        unit, norm = (
            (self.unit_img, self.norm_img)
            if modality == "image"
            else (self.unit_txt, self.norm_txt)
        )
        return unit[rows] * norm[rows, None]

    def sliced(self, rows: slice) -> Self:
        return self.taken(rows)

    def taken(self, rows: slice | NDArray[np.intp]) -> Self:
        """The rows at ``rows`` (a slice: views; positions: copies)."""
        return type(self)(
            self.ids[rows],
            self.unit_img[rows],
            self.unit_txt[rows],
            self.norm_img[rows],
            self.norm_txt[rows],
        )

    @classmethod
    def joined(cls, chunks: Sequence[GalleryRows]) -> Self:
        return cls(
            *(
                np.concatenate([getattr(c, f) for c in chunks])
                for f in ("ids", "unit_img", "unit_txt", "norm_img", "norm_txt")
            )
        )


def _unit_rows(x: NDArray[np.float32]) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    # Norms accumulated in float64, rows scaled in float32: no float64 copy of the rows (at
    # 4096-d such a copy makes this the largest cost of reading the stream).
    norms = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))
    safe = np.where(norms > 0, norms, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):  # the tiny rows, redone just below
        unit = np.asarray(x * (1.0 / safe).astype(np.float32)[:, None], dtype=np.float32)
    tiny = safe < 1e-30  # 1 / norm would overflow float32: these few rows in float64
    if tiny.any():
        unit[tiny] = (x[tiny].astype(np.float64) / safe[tiny, None]).astype(np.float32)
    return unit, norms.astype(np.float32)


def merge_count(sizes: list[int], new: int, largest: int) -> int:
    """How many of the newest blocks (``sizes``, oldest first) to merge with ``new`` rows: the
    newest while it is at most twice the merged size and the sum stays within ``largest``. Blocks
    then grow tier by tier, so n rows make O(log n) small blocks plus n / ``largest`` full
    ones, and each row is copied O(log n) times.

    >>> merge_count([4000, 1000, 500], 400, 65_536), merge_count([60_000], 10_000, 65_536)
    (2, 0)
    """
    count, total = 0, new
    for size in reversed(sizes):
        if size > 2 * total or size + total > largest:
            break
        count, total = count + 1, total + size
    return count


#: Largest block the tier merge makes (rows), in memory and in the indexer's segments.
CHUNK_MAX = 65_536
