"""The search gallery in memory: immutable chunks of rows (unit vectors and norms) and the
snapshots that list them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from streamxm.serving.index import Block, index_block

__all__ = ["CHUNK_MAX", "Gallery", "GalleryChunk", "merge_count"]


@dataclass(frozen=True, eq=False)
class GalleryChunk:
    """Immutable rows of the gallery, identified by object identity.

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
    def of(cls, ids: NDArray[np.str_], img: NDArray[np.float32], txt: NDArray[np.float32]
           ) -> GalleryChunk:
        ui, ni = _unit_rows(img)
        ut, nt = _unit_rows(txt)
        return cls(ids, ui, ut, ni, nt)

    def __len__(self) -> int:
        return len(self.ids)

    def __post_init__(self) -> None:
        # Made once per chunk: a gallery snapshot reuses the blocks of the chunks it keeps.
        object.__setattr__(self, "_index", {"image": index_block(self.unit_img),
                                            "text": index_block(self.unit_txt)})

    def unit(self, modality: str) -> NDArray[np.float32]:
        return self.unit_img if modality == "image" else self.unit_txt

    def index(self, modality: str) -> Block:
        """The unit rows as the search backend scans them."""
        return self._index[modality]  # type: ignore[attr-defined]

    def raw(self, modality: str, rows: NDArray[np.intp] | slice = slice(None)
            ) -> NDArray[np.float32]:
        unit, norm = ((self.unit_img, self.norm_img) if modality == "image"
                      else (self.unit_txt, self.norm_txt))
        return unit[rows] * norm[rows, None]

    def sliced(self, rows: slice) -> GalleryChunk:
        return GalleryChunk(self.ids[rows], self.unit_img[rows], self.unit_txt[rows],
                            self.norm_img[rows], self.norm_txt[rows])

    @staticmethod
    def joined(chunks: list[GalleryChunk]) -> GalleryChunk:
        return GalleryChunk(*(np.concatenate([getattr(c, f) for c in chunks])
                              for f in ("ids", "unit_img", "unit_txt", "norm_img", "norm_txt")))


def _unit_rows(x: NDArray[np.float32]) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    # Norms accumulated in float64, rows scaled in float32: no float64 copy of the rows (11x
    # faster at 4096-d, where the copy made this the largest cost of reading the stream).
    norms = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))
    safe = np.where(norms > 0, norms, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):  # the tiny rows, redone just below
        unit = np.asarray(x * (1.0 / safe).astype(np.float32)[:, None], dtype=np.float32)
    tiny = safe < 1e-30  # 1 / norm would overflow float32: these few rows in float64
    if tiny.any():
        unit[tiny] = (x[tiny].astype(np.float64) / safe[tiny, None]).astype(np.float32)
    return unit, norms.astype(np.float32)


@dataclass(frozen=True, eq=False)
class Gallery:
    """An immutable snapshot of the gallery: its chunks, oldest first."""

    chunks: tuple[GalleryChunk, ...] = ()

    def __post_init__(self) -> None:
        sizes = [len(c) for c in self.chunks]
        object.__setattr__(self, "starts", np.cumsum([0, *sizes]))
        object.__setattr__(self, "_blocks", {m: tuple(c.index(m) for c in self.chunks)
                                             for m in ("image", "text")})
        object.__setattr__(self, "_exact", {m: tuple(c.unit(m) for c in self.chunks)
                                            for m in ("image", "text")})
        object.__setattr__(self, "_references", {})

    def __len__(self) -> int:
        return int(self.starts[-1])  # type: ignore[attr-defined]

    def blocks(self, modality: str) -> tuple[Block, ...]:
        """The unit rows of ``modality`` as the index scans them, one block per chunk (one
        tuple object per snapshot, so concurrent queries against it coalesce)."""
        return self._blocks[modality]  # type: ignore[attr-defined,no-any-return]

    def exact_blocks(self, modality: str) -> tuple[NDArray[np.float32], ...]:
        """The unit rows of ``modality`` in float32, one block per chunk (the exact scan)."""
        return self._exact[modality]  # type: ignore[attr-defined,no-any-return]

    def locate(self, rows: NDArray[np.int64], modality: str
               ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """Unit rows and norms of ``modality`` at global row positions (a raw vector is
        ``unit * norm``)."""
        which, local = self._split(rows)
        dim = self.chunks[0].unit(modality).shape[1] if self.chunks else 0
        units = np.empty((len(rows), dim), dtype=np.float32)
        norms = np.empty(len(rows), dtype=np.float32)
        for c in np.unique(which):
            at = which == c
            chunk = self.chunks[c]
            units[at] = chunk.unit(modality)[local[at]]
            norms[at] = (chunk.norm_img if modality == "image" else chunk.norm_txt)[local[at]]
        return units, norms

    def vectors_at(self, rows: NDArray[np.int64], modality: str) -> NDArray[np.float32]:
        """Raw vectors of ``modality`` at global row positions."""
        units, norms = self.locate(rows, modality)
        return units * norms[:, None]

    def reference(self, modality: str, items: int) -> NDArray[np.float32]:
        """At most ``items`` raw vectors of ``modality``, evenly strided over the gallery (the
        same ones for every query against this snapshot: computed once)."""
        cache: dict[tuple[str, int], NDArray[np.float32]] = self._references  # type: ignore
        if (modality, items) not in cache:
            n = len(self)
            rows = np.unique(np.linspace(0, n - 1, min(n, items)).astype(np.int64))
            cache[(modality, items)] = (self.vectors_at(rows, modality) if n
                                        else np.empty((0, 0), dtype=np.float32))
        return cache[(modality, items)]

    def ids_at(self, rows: NDArray[np.int64]) -> list[str]:
        """Item ids at global row positions."""
        which, local = self._split(rows)
        pairs = zip(which.tolist(), local.tolist(), strict=True)
        return [str(self.chunks[c].ids[i]) for c, i in pairs]

    def _split(self, rows: NDArray[np.int64]) -> tuple[NDArray[np.intp], NDArray[np.int64]]:
        starts = self.starts  # type: ignore[attr-defined]
        which = np.searchsorted(starts, rows, side="right") - 1
        return which, rows - starts[which]

    def appended(self, chunk: GalleryChunk, max_items: int) -> Gallery:
        """This gallery with ``chunk`` added and the oldest rows past ``max_items`` removed.

        Chunks merge tier by tier (:func:`merge_count`, up to :data:`CHUNK_MAX` rows), so a
        long gallery is a few dozen blocks.
        """
        chunks = list(self.chunks)
        merged = merge_count([len(c) for c in chunks], len(chunk), CHUNK_MAX)
        if merged:
            chunk = GalleryChunk.joined([*chunks[len(chunks) - merged :], chunk])
            chunks = chunks[: len(chunks) - merged]
        chunks.append(chunk)
        total = sum(len(c) for c in chunks)
        while total > max_items and chunks:
            excess = total - max_items
            if excess >= len(chunks[0]):
                total -= len(chunks.pop(0))
            else:
                chunks[0] = chunks[0].sliced(slice(excess, None))
                total -= excess
        return Gallery(tuple(chunks))


#: Largest block the tier merge makes (rows), in memory and in the indexer's segments.
CHUNK_MAX = 65_536


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
