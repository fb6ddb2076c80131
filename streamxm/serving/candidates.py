"""What a search proposes and proves: candidates from a scan of a version's rows, with the
version's exact scores and a bound on every row left out.

One step of the pipeline (:mod:`streamxm.serving.search` runs it): scan the rows of the served
version's embedding kind (:mod:`streamxm.models.embedding`) for the best ``wanted``, score them
exactly, and bound the rows left out by the scan's ceiling raised by the kind's error (float32
rounding; float16 kept features through a linear head; a reduced-precision copy proven against
the float32 rows). A search widens ``wanted`` until the bound proves its top k.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.models.embedding import EmbeddingKind
from streamxm.serving.gallery import CHUNK_MAX, Gallery
from streamxm.serving.index import Block, Int8Block
from streamxm.serving.served import EmbeddedGallery, SearchQuery, ServedModel

__all__ = [
    "CandidateScans",
    "Candidates",
    "Proposal",
    "Scan",
    "Step",
    "Union",
    "Work",
    "proof_candidates",
    "proven_complete",
    "raised",
    "scan_margin",
]


#: A reduced-precision (int8 or bfloat16) scan of a fixed space proposes at least one candidate
#: per this many gallery rows. The rows whose scores the error bound cannot tell from the k-th
#: best lie in a band of fixed width, so their number grows with the gallery, and a fixed
#: count of candidates leaves more searches unproven (a float32 pass) as it grows
#: (docs/benchmarks.md). With chunks offering half the re-ranked count and the grouped
#: selection of :func:`~streamxm.serving.index.top_k_bounded`, the larger count costs no more
#: per scan.
_ROWS_PER_PROOF_CANDIDATE = 2_500


def proof_candidates(gallery_rows: int, wanted: int, int8: bool = False) -> int:
    """Candidates a reduced-precision scan of a fixed space proposes for ``wanted`` re-ranked
    ones; at least twice ``wanted`` from an int8 scan, whose error bound is wider than
    bfloat16's.

    >>> proof_candidates(100_000, 100), proof_candidates(1_000_000, 100), proof_candidates(50, 100)
    (100, 400, 50)
    >>> proof_candidates(100_000, 100, int8=True), proof_candidates(1_000_000, 100, int8=True)
    (200, 400)
    """
    floor = 2 * wanted if int8 else wanted
    return min(gallery_rows, max(floor, -(-gallery_rows // _ROWS_PER_PROOF_CANDIDATE)))


def exact_blocks(blocks: Any) -> bool:
    return all(isinstance(b, np.ndarray) for b in blocks)


def proven_complete(
    ceiling: float, units: NDArray[np.float32], query: NDArray[np.float32], k: int, blocks: Any
) -> bool:
    """Whether candidates from a reduced-precision scan surely hold the exact top ``k`` of the
    unit rows against ``query``.

    No row left out scores above ``ceiling`` exactly (:func:`top_k_bounded` raises every scan
    score by its backend's error bound): when the exact k-th best candidate is above it,
    nothing left out can enter the top ``k``.
    """
    if ceiling == -np.inf or exact_blocks(blocks):
        return True  # nothing left out, or float32 blocks: the scan itself was exact
    exact = units.astype(np.float64) @ query.astype(np.float64)
    if len(exact) < k:
        return False
    kth = np.partition(exact, len(exact) - k)[len(exact) - k]
    return bool(kth > ceiling)


def raised(ceiling: float, shift: float = 0.0, reach: float = 0.0) -> float:
    """A scan's ceiling as a bound on exact scores: moved by ``shift`` (a query's constant),
    then raised by :func:`scan_margin` (``-inf``, nothing left out, stays)."""
    if ceiling == -np.inf:
        return -np.inf
    bound = ceiling + shift
    return bound + scan_margin(bound, reach)


def scan_margin(score: float, reach: float) -> float:
    """How far an exact score can lie above a float32 scan's score of the same row, for a
    query whose scores are at most ``reach`` in size (its norm times the largest row's): the
    scan reads float32 copies (unit rows, embeddings made from float32 features) where the
    model computes in float64 from the raw vectors, so the error is relative to the terms of
    the product, not to the score, which can be near 0. ``tests/test_heads.py`` checks the
    margin on every model with a linear head; it is orders of magnitude below the spread of
    their scores."""
    return 1e-4 * abs(score) + 2e-5 * reach


class Proposal:
    """Candidates re-ranked exactly: their ``scores`` and ``bound``, no row left out scoring
    above it (``-inf``: none can enter the top; ``inf``: unknown), of a gallery of ``size``
    rows."""

    scores: NDArray[np.float64]
    bound: float

    @property
    def size(self) -> int:
        raise NotImplementedError

    def ids_at(self, order: NDArray[np.intp]) -> list[str]:
        """The ids of the candidates at positions ``order``."""
        raise NotImplementedError

    def best(self, k: int) -> list[tuple[str, float]]:
        """The ``k`` best candidates' ids and scores, ties in the candidates' order."""
        order = np.argsort(-self.scores, kind="stable")[:k]
        return list(zip(self.ids_at(order), self.scores[order].tolist(), strict=True))

    def holds_top(self, k: int) -> bool:
        """Whether the exact top ``k`` of the gallery is surely among these candidates (or,
        without a bound, the scan is all there is to go by)."""
        if self.bound == -np.inf or self.bound == np.inf or len(self.scores) < k:
            return True
        kth = np.partition(self.scores, len(self.scores) - k)[len(self.scores) - k]
        return bool(kth > self.bound)


@dataclass(frozen=True, eq=False)
class Candidates(Proposal):
    """Rows of ``gallery`` a search re-ranks, in gallery order (so that ties keep it), with
    their raw vectors (``items``) and the version's exact scores."""

    gallery: Gallery
    rows: NDArray[np.int64]
    items: NDArray[np.float32]
    scores: NDArray[np.float64]
    bound: float

    @classmethod
    def of(
        cls,
        gallery: Gallery,
        rows: NDArray[np.int64],
        kind: EmbeddingKind,
        modality: str,
        target: str,
        vector: NDArray[np.float32],
        bound: float,
    ) -> Candidates:
        rows = np.sort(rows)
        items = gallery.vectors_at(rows, target)
        return cls(gallery, rows, items, kind.exact_scores(modality, target, vector, items), bound)

    @property
    def size(self) -> int:
        return len(self.gallery)

    def ids_at(self, order: NDArray[np.intp]) -> list[str]:
        return self.gallery.ids_at(self.rows[order])


@dataclass(frozen=True, eq=False)
class Union(Proposal):
    """The union of several proposals by item id (an ensemble's members'), first seen first,
    scored by the fused score; ``bound`` bounds the fused score of every item left out."""

    ids: list[str]
    scores: NDArray[np.float64]
    bound: float
    gallery_size: int

    @property
    def size(self) -> int:
        return self.gallery_size

    def ids_at(self, order: NDArray[np.intp]) -> list[str]:
        return [self.ids[i] for i in order]


@dataclass(frozen=True, eq=False)
class Scan:
    """A top-k scan a search needs, answered by the coalescing thread with the concurrent
    searches' scans of the same blocks."""

    blocks: tuple[Block, ...]
    query: NDArray[np.float32]  # one query vector
    k: int
    per_chunk: int | None = None  # rows each chunk offers (top_k_bounded); None: k


@dataclass(frozen=True, eq=False)
class Work:
    """A heavy step of a search (loading a pinned version, building a missing index), run
    off the event loop."""

    run: Callable[[], Any]


#: What a search yields for its driver to run.
Step = Scan | Work


class CandidateScans:
    """Proposes a served version's candidates: the steps of one scan (and its float32 redo),
    counted for the metrics.

    Parameters
    ----------
    gallery
        The served gallery snapshot, read at each proposal.
    index_of
        The served version's embedded index (built for a pinned version's first search).
    """

    def __init__(
        self, gallery: Callable[[], Gallery], index_of: Callable[[ServedModel], EmbeddedGallery]
    ) -> None:
        self.gallery = gallery
        self.index_of = index_of
        #: Searches whose reduced-precision candidates could not be proven complete and were
        #: answered by a float32 scan instead.
        self.exact_scans = 0
        #: Candidate scans of an earlier version's index (a model that embeds raw vectors,
        #: while its served version embeds the gallery): re-ranked, not proven complete.
        self.earlier_index_scans = 0

    def propose(
        self, served: ServedModel, search: SearchQuery, wanted: int, k: int | None = None
    ) -> Generator[Step, Any, Candidates]:
        """The best ``wanted`` rows for ``search``'s vector of a gallery snapshot by the served
        version's index (more from a reduced-precision scan of a large gallery,
        :data:`_ROWS_PER_PROOF_CANDIDATE`), in gallery order (so that ties keep it), with the
        version's exact scores and a bound on the score of every row left out.

        A fixed space scans the unit rows against the query moved into them; with ``k``, a
        reduced-precision scan that cannot be proven to hold the exact top ``k`` is redone in
        float32. Other models scan the embeddings their served version made of the gallery
        (:class:`~streamxm.serving.served.EmbeddedGallery`)."""
        kind = served.embedding
        modality, vector, target = search.modality, search.vector, search.searched
        if kind.fixed and target != modality:
            return (yield from self._fixed(served, search, wanted, k))
        index = served.index
        if index is None or index.version > served.version:  # a pinned version's first use
            index = yield Work(partial(self.index_of, served))
        gallery = index.gallery
        query, _ = kind.scan_query(modality, target, vector)
        _, rows, ceiling = yield Scan(index.blocks(target), query, min(wanted, len(gallery)))
        if index.version < served.version:
            # An earlier version's embeddings (the served one's are being made): its best
            # rows, re-ranked by the served version, without a bound on the rest.
            self.earlier_index_scans += 1
        if not index.float32(target) or index.version < served.version:
            return Candidates.of(gallery, rows, kind, modality, target, vector, np.inf)
        bound = raised(float(ceiling), reach=float(np.linalg.norm(query)) * index.norm(target))
        error = index.scan_error(target, query)
        if error > 0.0:
            # Embeddings made from rounded features (a feature map that keeps float16 rows, in
            # a gallery of at least its ``compact_from_rows``): each row's exact score is within
            # ``error`` of its scan score, so the bound moves up by it and the candidates are
            # scored from their raw vectors.
            return Candidates.of(gallery, rows, kind, modality, target, vector, bound + error)
        # The version's own embeddings of the candidates are in the index: scoring them again
        # would cost a tower or kernel pass per candidate for the same numbers (to float32
        # rounding of the kept features, well inside the scan margin: tests/test_heads.py).
        rows = np.sort(rows)
        scores = index.embedded_at(rows, target).astype(np.float64) @ query.astype(np.float64)
        return Candidates(gallery, rows, gallery.vectors_at(rows, target), scores, bound)

    def _fixed(
        self, served: ServedModel, search: SearchQuery, wanted: int, k: int | None
    ) -> Generator[Step, Any, Candidates]:
        """:meth:`propose` of a fixed space (scan scores differ from the version's by
        the query's constant ``c``)."""
        gallery, kind = self.gallery(), served.embedding
        modality, vector, target = search.modality, search.vector, search.searched
        wanted = min(len(gallery), wanted)
        query, c = kind.scan_query(modality, target, vector)
        blocks = gallery.blocks(target)
        scanned, per_chunk = wanted, None
        if not exact_blocks(blocks):
            scanned = proof_candidates(len(gallery), wanted, isinstance(blocks[0], Int8Block))
            if scanned > wanted:
                # Each chunk offers twice its expected share of the best ``scanned`` (a chunk
                # holds at most CHUNK_MAX rows) and the best ``scanned`` of their union are
                # re-ranked: the ceiling of a larger top at a smaller selection's cost. At 1M:
                # 50 of each 65,536, the union's 800 hold the best 400. A gallery of a few
                # chunks gets a plain top ``scanned`` (each chunk's share is most of it; at
                # 100k, 50 per chunk left a share of the searches unproven).
                per_chunk = max(1, wanted // 2, -(-2 * scanned * CHUNK_MAX // len(gallery)))
        _, rows, ceiling = yield Scan(blocks, query, scanned, per_chunk)
        bound = raised(float(ceiling), c, float(np.linalg.norm(query)))  # unit rows
        if k is not None:  # this model's own search: its top k is settled here
            if not proven_complete(
                float(ceiling), gallery.locate(rows, target)[0], query, k, blocks
            ):
                # The reduced-precision scan could have missed part of the exact top k
                # (scores flatter than its rounding): scan the float32 rows instead.
                self.exact_scans += 1
                # Coalesced too: the fallbacks of concurrent searches share one pass.
                _, rows, _ = yield Scan(gallery.exact_blocks(target), query, wanted)
            bound = -np.inf
        return Candidates.of(gallery, rows, kind, modality, target, vector, bound)
