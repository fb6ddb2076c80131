"""The search gallery in memory: immutable chunks of rows (unit vectors and norms) and the
snapshots that list them."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

import numpy as np
from numpy.typing import NDArray

from streamxm.models.heads import FeatureMap
from streamxm.serving.index import Block, index_block
from streamxm.serving.sharding import reference_keys, smallest
from streamxm.storage.rows import CHUNK_MAX, GalleryRows, merge_count

#: Held while a chunk's scanned blocks are made: concurrent searches that need the same blocks
#: wait for one build instead of each making its own (every search thread of a shard quantising
#: the same rows at once held its cores for seconds).
_BUILDING = threading.Lock()

_Value = TypeVar("_Value", bound=np.generic)

__all__ = [
    "CHUNK_MAX",
    "Gallery",
    "GalleryChunk",
    "GalleryRows",
    "largest_norm",
    "merge_count",
    "reference_rows",
]


def reference_rows(ids: Sequence[str] | NDArray[np.str_], items: int) -> NDArray[np.int64]:
    """Positions of at most ``items`` of the items ``ids``: the sample an ensemble standardises
    its members' scores over, those of the smallest reference keys
    (:func:`~streamxm.serving.sharding.reference_keys`), in key order. A uniform sample, and
    the same one however the gallery is split into shards or chunks."""
    return smallest(reference_keys(ids), items)


def largest_norm(blocks: Iterable[Block]) -> float:
    """The largest L2 norm of a row of the float32 arrays among ``blocks`` (0 if none)."""
    return max(
        (
            float(np.sqrt(np.einsum("ij,ij->i", b, b).max(initial=0.0)))
            for b in blocks
            if isinstance(b, np.ndarray)
        ),
        default=0.0,
    )


@dataclass(frozen=True, eq=False)
class GalleryChunk(GalleryRows):
    """Gallery rows with their search index: the unit rows of each modality as the search
    backend scans them, made once per chunk (a gallery snapshot reuses the blocks of the chunks
    it keeps), and the version-independent features that models' linear heads read
    (:mod:`streamxm.models.heads`), computed on first use and kept while a served model uses
    them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {})
        object.__setattr__(self, "_features", {})
        # key -> (rows already known, features with those rows filled): carried from an
        # earlier snapshot's chunks (carry_features), the other rows computed on first use.
        object.__setattr__(self, "_partial", {})
        object.__setattr__(self, "_errors", {})  # key -> kept_error

    def features(
        self, modality: str, fmap: FeatureMap | None, compact: bool = False
    ) -> NDArray[np.floating]:
        """``fmap``'s features of this chunk's unit rows of ``modality`` (``None``: the unit
        rows), computed once and kept (two threads computing the same one at once both get
        equal arrays): float32, or with ``compact`` as the map keeps them
        (:meth:`~streamxm.models.heads.FeatureMap.keep`; float32 ones kept before are
        converted). The maps below ``fmap`` in its chain are computed for it and not kept:
        only the head's own features are read again by later versions."""
        if fmap is None:
            return self.unit(modality)
        cache: dict[tuple[object, ...], NDArray[np.floating]] = self._features  # type: ignore
        key = (modality, *fmap.key)
        found = cache.get(key)
        if found is None:
            partial = self._partial.pop(key, None)  # type: ignore[attr-defined]
            if partial is not None:
                known, found = partial
                fill = fmap.apply(self._inputs(modality, fmap, ~known))
                found[~known] = fill if found.dtype == np.float32 else fmap.keep(fill)
            else:
                x = self._inputs(modality, fmap)
                kept = {k[1:]: v for k, v in list(cache.items()) if k[0] == modality}
                extended = fmap.extend(kept, x)
                found = fmap.apply(x) if extended is None else extended
        if compact and found.dtype == np.float32:
            found = fmap.keep(found)
            self._errors.pop(key, None)  # type: ignore[attr-defined]  # the float32 rows' bound
        cache[key] = found
        return found

    def _inputs(
        self, modality: str, fmap: FeatureMap, rows: NDArray[np.bool_] | slice = slice(None)
    ) -> NDArray[np.float32]:
        """The features ``fmap`` reads of ``rows``, computed through the chain below it."""
        units = self.unit(modality)[rows]
        return units if fmap.inputs is None else fmap.inputs(units)

    def kept_error(self, modality: str, fmap: FeatureMap) -> float:
        """:meth:`~streamxm.models.heads.FeatureMap.kept_error` of this chunk's kept features
        of ``fmap`` (computed once: a pass over them)."""
        errors: dict[tuple[object, ...], float] = self._errors  # type: ignore[attr-defined]
        key = (modality, *fmap.key)
        if key not in errors:
            errors[key] = fmap.kept_error(self.features(modality, fmap))
        return errors[key]

    def rows_in(self, previous: Gallery) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """This chunk's rows that ``previous`` holds, and their global rows there: a row is
        found when ``previous`` has a row with the same id and the same unit rows of both
        modalities, bit for bit (what a row's features and embeddings are computed from, so
        a repeated id with other vectors is not mistaken for it; of repeated ids the newest
        is tried)."""
        if not len(self) or not len(previous):
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        ids = np.concatenate([c.ids for c in previous.chunks])
        order = np.argsort(ids, kind="stable")
        ordered = ids[order]
        at = np.maximum(np.searchsorted(ordered, self.ids, side="right") - 1, 0)
        rows = np.flatnonzero(ordered[at] == self.ids)
        source = order[at[rows]].astype(np.int64)
        for modality in ("image", "text"):
            same = (
                previous.gather(previous.exact_blocks(modality), source)
                == self.unit(modality)[rows]
            ).all(axis=1)
            rows, source = rows[same], source[same]
        return rows.astype(np.int64), source

    def carry_features(self, previous: Gallery) -> int:
        """Take the kept features of the rows ``previous`` already holds (:meth:`rows_in`),
        so that rows moving into a new chunk (the stream tail or merged segments becoming one
        segment) are not computed again: a model's kernel rows at 100,000 items take
        seconds, and a version waits for them. The other rows are computed on first use,
        alone. Returns the rows carried."""
        # Copies of the donors' dicts: a served version may drop features meanwhile.
        kept = [(c, dict(c._features)) for c in previous.chunks]  # type: ignore[attr-defined]
        kept = [(c, features) for c, features in kept if features]
        keys = set.intersection(*(set(f) for _, f in kept)) if kept else set()
        # float32 beside kept float16 (complements) is never mixed: computed again instead.
        keys = {key for key in keys if len({f[key].dtype for _, f in kept}) == 1}
        if not keys:
            return 0
        donors = Gallery(tuple(c for c, _ in kept))
        rows, source = self.rows_in(donors)
        if not len(rows):
            return 0
        known = np.zeros(len(self), dtype=bool)
        known[rows] = True
        for key in keys:
            values = donors.gather([features[key] for _, features in kept], source)
            if len(rows) == len(self):  # rows is then every row, in order
                self._features[key] = values  # type: ignore[attr-defined]
            else:
                full = np.empty((len(self), *values.shape[1:]), dtype=values.dtype)
                full[rows] = values
                self._partial[key] = (known, full)  # type: ignore[attr-defined]
        return len(rows)

    def feature_keys(self) -> set[tuple[object, ...]]:
        return set(self._features)  # type: ignore[attr-defined]

    def keep_features(self, keys: set[tuple[object, ...]]) -> None:
        """Drop the kept (and carried) features whose key is not in ``keys``."""
        for cache in (self._features, self._partial, self._errors):  # type: ignore[attr-defined]
            for key in list(cache):
                if key not in keys:
                    cache.pop(key, None)

    def sliced(self, rows: slice) -> Self:
        chunk = super().sliced(rows)
        for key, values in list(self._features.items()):  # type: ignore[attr-defined]
            chunk._features[key] = values[rows]  # type: ignore[attr-defined]
        return chunk

    @classmethod
    def joined(cls, chunks: Sequence[GalleryRows]) -> Self:
        """One chunk of ``chunks``' rows; features every part has are joined, not recomputed."""
        chunk = super().joined(chunks)
        parts = [c for c in chunks if isinstance(c, GalleryChunk)]
        if len(parts) == len(chunks):
            for key in set.intersection(*(c.feature_keys() for c in parts)):
                values = [c._features[key] for c in parts]  # type: ignore[attr-defined]
                if len({v.dtype for v in values}) == 1:  # float32 and float16 are not joined
                    chunk._features[key] = np.concatenate(values)  # type: ignore[attr-defined]
        return chunk

    @classmethod
    def from_rows(cls, rows: GalleryRows) -> GalleryChunk:
        """The stored rows (a segment) indexed for search."""
        return cls(rows.ids, rows.unit_img, rows.unit_txt, rows.norm_img, rows.norm_txt)

    def reference_keys(self) -> NDArray[np.uint64]:
        """Each row's reference key (:func:`~streamxm.serving.sharding.reference_keys`),
        computed once."""
        found: NDArray[np.uint64] | None = getattr(self, "_reference_keys", None)
        if found is None:
            found = reference_keys(self.ids)
            object.__setattr__(self, "_reference_keys", found)
        return found

    def index(self, modality: str) -> Block:
        """The unit rows as the search backend scans them, made on first use (only the models
        with a fixed space scan them: a gallery served to others never pays for them)."""
        made: dict[str, Block] = self._index  # type: ignore[attr-defined]
        if modality not in made:
            with _BUILDING:
                if modality not in made:
                    made[modality] = index_block(self.unit(modality))
        return made[modality]


@dataclass(frozen=True, eq=False)
class Gallery:
    """An immutable snapshot of the gallery: its chunks, oldest first."""

    chunks: tuple[GalleryChunk, ...] = ()

    def __post_init__(self) -> None:
        sizes = [len(c) for c in self.chunks]
        object.__setattr__(self, "starts", np.cumsum([0, *sizes]))
        object.__setattr__(self, "_blocks", {})
        object.__setattr__(
            self, "_exact", {m: tuple(c.unit(m) for c in self.chunks) for m in ("image", "text")}
        )
        object.__setattr__(self, "_references", {})

    def __len__(self) -> int:
        return int(self.starts[-1])  # type: ignore[attr-defined]

    def blocks(self, modality: str) -> tuple[Block, ...]:
        """The unit rows of ``modality`` as the index scans them, one block per chunk (one
        tuple object per snapshot, so concurrent queries against it coalesce; made on first
        use)."""
        made: dict[str, tuple[Block, ...]] = self._blocks  # type: ignore[attr-defined]
        if modality not in made:
            blocks = tuple(c.index(modality) for c in self.chunks)
            made.setdefault(modality, blocks)  # one tuple object, whoever made it first
        return made[modality]

    def warm(self) -> None:
        """Make the scanned blocks of both modalities now (off the query path; the models with
        a fixed space scan them)."""
        for modality in ("image", "text"):
            self.blocks(modality)

    def exact_blocks(self, modality: str) -> tuple[NDArray[np.float32], ...]:
        """The unit rows of ``modality`` in float32, one block per chunk (the exact scan)."""
        return self._exact[modality]  # type: ignore[attr-defined,no-any-return]

    def locate(
        self, rows: NDArray[np.int64], modality: str
    ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """Unit rows and norms of ``modality`` at global row positions (a raw vector is
        ``unit * norm``)."""
        norms = [c.norm_img if modality == "image" else c.norm_txt for c in self.chunks]
        return (
            self.gather(
                self.exact_blocks(modality),
                rows,
                self.chunks[0].unit(modality).shape[1:] if self.chunks else (0,),
            ),
            self.gather(norms, rows, ()),
        )

    def gather(
        self,
        blocks: Sequence[NDArray[_Value]],
        rows: NDArray[np.int64],
        shape: tuple[int, ...] | None = None,
    ) -> NDArray[_Value]:
        """The rows at global row positions of per-chunk arrays (one per chunk of this
        snapshot, in order: its unit rows, an index's embeddings); ``shape``: a row's, when
        ``blocks`` may be empty."""
        if shape is None:
            shape = blocks[0].shape[1:] if blocks else (0,)
        which, local = self.split(rows)
        out = np.empty((len(rows), *shape), dtype=blocks[0].dtype if blocks else np.float32)
        for c in np.unique(which):
            at = which == c
            out[at] = blocks[c][local[at]]
        return out

    def vectors_at(self, rows: NDArray[np.int64], modality: str) -> NDArray[np.float32]:
        """Raw vectors of ``modality`` at global row positions."""
        units, norms = self.locate(rows, modality)
        return units * norms[:, None]

    def reference(self, modality: str, items: int) -> NDArray[np.float32]:
        """At most ``items`` raw vectors of ``modality``, the gallery's reference sample
        (:meth:`reference_sample`)."""
        return self.reference_sample(items).raw(modality)

    def reference_sample(self, items: int) -> GalleryRows:
        """The rows of :meth:`reference_rows` (unit rows and norms of both modalities, in key
        order; computed once per snapshot)."""
        cache: dict[tuple[str, int], GalleryRows] = self._references  # type: ignore
        if ("sample", items) not in cache:
            rows = self.reference_rows(items)
            units = [self.locate(rows, m) for m in ("image", "text")]
            cache[("sample", items)] = GalleryRows(
                np.asarray(self.ids_at(rows), dtype=np.str_),
                units[0][0],
                units[1][0],
                units[0][1],
                units[1][1],
            )
        return cache[("sample", items)]

    def reference_rows(self, items: int) -> NDArray[np.int64]:
        """The row positions of :meth:`reference` (:func:`reference_rows`)."""
        keys = [c.reference_keys() for c in self.chunks]
        return smallest(np.concatenate(keys) if keys else np.empty(0, np.uint64), items)

    def reference_candidates(self, items: int) -> tuple[NDArray[np.uint64], list[str]]:
        """The reference keys and ids of this gallery's :meth:`reference_rows`: what a shard
        offers the global sample."""
        rows = self.reference_rows(items)
        keys = np.concatenate([c.reference_keys() for c in self.chunks]) if self.chunks else None
        return (keys[rows] if keys is not None else np.empty(0, np.uint64)), self.ids_at(rows)

    def ids_at(self, rows: NDArray[np.int64]) -> list[str]:
        """Item ids at global row positions."""
        which, local = self.split(rows)
        pairs = zip(which.tolist(), local.tolist(), strict=True)
        return [str(self.chunks[c].ids[i]) for c, i in pairs]

    def split(self, rows: NDArray[np.int64]) -> tuple[NDArray[np.intp], NDArray[np.int64]]:
        """Global row positions as (chunk, row within it)."""
        starts = self.starts  # type: ignore[attr-defined]
        which = np.searchsorted(starts, rows, side="right") - 1
        return which, rows - starts[which]

    def feature_bytes(self) -> int:
        """Bytes of the features the chunks keep."""
        kept: list[NDArray[np.float32]] = [v for c in self.chunks for v in c._features.values()]  # type: ignore[attr-defined]
        kept += [v for c in self.chunks for _, v in c._partial.values()]  # type: ignore
        return sum(int(v.nbytes) for v in kept)

    def keep_features(self, keys: Iterable[tuple[object, ...]]) -> None:
        """Drop every chunk's kept features but those of ``keys`` (see
        :meth:`GalleryChunk.features`)."""
        wanted = set(keys)
        for chunk in self.chunks:
            chunk.keep_features(wanted)

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
