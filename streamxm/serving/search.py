"""Top-k search of the gallery, exact for the served version: candidates from a version-independent
index, re-ranked by the served version's own scores.

A model whose score is bilinear in the gallery's unit rows (``fixed_space``) moves the
*query* into the target modality's unit rows with the served
version, O(model), and the rows are the index; a reduced-precision scan of them is proven
complete or redone in float32. The other models search an index of embeddings
(:class:`~streamxm.serving.served.EmbeddedGallery`): the served version's own, whose float32
scan bounds the rows it leaves out, or, for a model that embeds raw vectors while its new
version embeds the gallery, an earlier version's, whose best rows are re-ranked without a bound.
Either way the candidates are re-ranked exactly, so scores are the similarity's and ties keep
gallery order. A search is a generator of steps (scans, heavy work) that a driver runs: on a
thread (:meth:`Searcher.search`) or on an event loop (:meth:`Searcher.search_async`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from streamxm import defaults as D
from streamxm.models import CrossModalModel
from streamxm.models.ensemble import REFERENCE_ITEMS, is_ensemble
from streamxm.serving.fused import FusedSpace, scan_query
from streamxm.serving.gallery import CHUNK_MAX, Gallery
from streamxm.serving.index import Block, Int8Block, QueryCoalescer
from streamxm.serving.served import (
    EmbeddedGallery,
    ModelNotReady,
    SameModalityUnsupported,
    SearchAnswer,
    ServedEnsemble,
    ServedModel,
    direction_of,
    other_modality,
)

__all__ = ["Catalogue", "Searcher", "ensemble_reference", "proof_candidates"]


class Catalogue(Protocol):
    """What a search reads from the server: the gallery snapshot and the served versions."""

    @property
    def gallery(self) -> Gallery: ...

    def get(self, name: str, version: int | None = None) -> ServedModel: ...

    def is_loaded(self, name: str, version: int | None) -> bool: ...

    def pin(self, name: str, version: int) -> ServedModel: ...

    def ensemble(self, name: str, version: int | None = None) -> ServedEnsemble: ...

    def index_of(self, served: ServedModel) -> EmbeddedGallery: ...


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


def _exact_blocks(blocks: Any) -> bool:
    return all(isinstance(b, np.ndarray) for b in blocks)


def _proven_complete(
    ceiling: float, units: NDArray[np.float32], query: NDArray[np.float32], k: int, blocks: Any
) -> bool:
    """Whether candidates from a reduced-precision scan surely hold the exact top ``k`` of the
    unit rows against ``query``.

    No row left out scores above ``ceiling`` exactly (:func:`top_k_bounded` raises every scan
    score by its backend's error bound): when the exact k-th best candidate is above it,
    nothing left out can enter the top ``k``.
    """
    if ceiling == -np.inf or _exact_blocks(blocks):
        return True  # nothing left out, or float32 blocks: the scan itself was exact
    exact = units.astype(np.float64) @ query.astype(np.float64)
    if len(exact) < k:
        return False
    kth = np.partition(exact, len(exact) - k)[len(exact) - k]
    return bool(kth > ceiling)


def _exact_scores(
    model: CrossModalModel,
    modality: str,
    target: str,
    query: NDArray[np.float32],
    items: NDArray[np.float32],
) -> NDArray[np.float64]:
    """The served version's own scores of one query against candidate items."""
    if modality == "image" and target == "text":
        return np.asarray(model.similarity(query[None, :], items)[0], dtype=np.float64)
    if modality == "text" and target == "image":
        return np.asarray(model.similarity(items, query[None, :])[:, 0], dtype=np.float64)
    embed = model.embed_images if modality == "image" else model.embed_texts
    scores = embed(items).astype(np.float64) @ embed(query[None, :]).astype(np.float64)[0]
    return np.asarray(scores, dtype=np.float64)


def ensemble_reference(gallery: Gallery, modality: str) -> NDArray[np.float32]:
    """The gallery items an ensemble's member scores are standardised over (per query)."""
    reference = gallery.reference(modality, REFERENCE_ITEMS)
    if len(reference) < 2:
        raise ModelNotReady(
            "an ensemble standardises its members' scores over the gallery, "
            "which has fewer than 2 items yet"
        )
    return reference


class Searcher:
    """Answers top-k searches against a :class:`Catalogue`.

    Parameters
    ----------
    catalogue
        The gallery and the served versions (the model server).
    lag
        Seconds since a checkpoint newer than what answers was written (the answer's
        ``version_lag_s``).
    candidates
        Candidates re-ranked per query: ``max(candidates, 4 k)``.
    """

    def __init__(
        self,
        catalogue: Catalogue,
        lag: Callable[[ServedModel | ServedEnsemble], float],
        candidates: int = D.SEARCH_CANDIDATES,
    ) -> None:
        self.catalogue = catalogue
        self.lag = lag
        self.candidates = candidates
        self.coalescer = QueryCoalescer()
        #: Searches whose reduced-precision candidates could not be proven complete and were
        #: answered by a float32 scan instead.
        self.exact_scans = 0
        #: Candidate scans repeated with four times as many rows because the first could not
        #: prove the top k complete (an embedded index's or an ensemble's).
        self.expansions = 0
        #: Candidate scans of an earlier version's index (a model that embeds raw vectors,
        #: while its served version embeds the gallery): re-ranked, not proven complete.
        self.earlier_index_scans = 0
        # Per (ensemble, target): its members' rows side by side, while they are current.
        self._fused: dict[tuple[str, str], FusedSpace] = {}
        self._fused_lock = threading.Lock()

    def close(self) -> None:
        self.coalescer.close()

    def search(
        self,
        name: str,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        target: str | None = None,
        version: int | None = None,
    ) -> SearchAnswer:
        """The ``k`` best gallery items of modality ``target`` (default: the other modality)
        for one query vector of ``modality``, scored by the served version exactly as
        :meth:`similarity` scores them, ties in gallery order.

        Candidates come from a version-independent index: the gallery's unit rows against
        the query moved into them (:attr:`CrossModalModel.fixed_space`), or else the newest
        embedded index. Same-modality search needs a model whose embeddings share one space;
        others raise :class:`SameModalityUnsupported`. ``version`` pins a kept version.
        """
        steps = self._steps(name, modality, vector, k, target, version)
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Scan):
                    step = steps.send(
                        self.coalescer.search(step.blocks, step.query, step.k, step.per_chunk)
                    )
                else:
                    step = steps.send(step.run())
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    async def search_async(
        self,
        name: str,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        offload: Callable[[Callable[[], Any]], Awaitable[Any]],
        target: str | None = None,
        version: int | None = None,
    ) -> SearchAnswer:
        """:meth:`search` for an event loop: the light steps (query transform, exact re-rank
        of the candidates) run on the loop, the scan is awaited from the coalescing thread,
        and heavy work (loading a pinned version, building a missing index) goes to ``offload``.
        Under load this saves two thread hand-offs per search, a measurable part of the API's
        CPU per search (``docs/benchmarks.md``)."""
        steps = self._steps(name, modality, vector, k, target, version)
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Scan):
                    found = await asyncio.wrap_future(
                        self.coalescer.submit(step.blocks, step.query, step.k, step.per_chunk)
                    )
                else:
                    found = await offload(step.run)
                step = steps.send(found)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _steps(
        self,
        name: str,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        target: str | None,
        version: int | None,
    ) -> Generator[_Scan | _Work, Any, SearchAnswer]:
        """The search, yielding each scan (and any heavy step) for a driver to run."""
        target = target or other_modality(modality)
        if is_ensemble(name):
            return (yield from self._ensemble_steps(name, modality, vector, k, target, version))
        if version is not None and not self.catalogue.is_loaded(name, version):
            yield _Work(partial(self.catalogue.pin, name, version))  # read from the store: heavy
        served = self.catalogue.get(name, version)
        if target == modality and not served.model.shared_space:
            raise SameModalityUnsupported(
                f"model {name!r} embeds images and texts in different spaces: it answers "
                f"cross-modal search only (target must be {other_modality(modality)})"
            )
        lag = self.lag(served)
        if len(self.catalogue.gallery) == 0:
            return SearchAnswer(served, [], lag, served.version)
        wanted = min(len(self.catalogue.gallery), max(self.candidates, 4 * k))
        while True:
            found = yield from self._candidates(served, modality, vector, wanted, target, k)
            if found.holds_top(k) or wanted >= len(found.gallery):
                break
            # Rows left out could still score above the k-th candidate: scan for more.
            self.expansions += 1
            wanted = min(len(found.gallery), 4 * wanted)
        order = np.argsort(-found.scores, kind="stable")[:k]
        ids = found.gallery.ids_at(found.rows[order])
        return SearchAnswer(
            served,
            list(zip(ids, found.scores[order].tolist(), strict=True)),
            lag,
            served.index_version,
        )

    def _candidates(
        self,
        served: ServedModel,
        modality: str,
        vector: NDArray[np.float32],
        wanted: int,
        target: str,
        k: int | None,
    ) -> Generator[_Scan | _Work, Any, _Candidates]:
        """The best ``wanted`` rows of a gallery snapshot by the served version's index (more
        from a reduced-precision scan of a large gallery, :data:`_ROWS_PER_PROOF_CANDIDATE`),
        in gallery order (so that ties keep it), with the version's exact scores and a bound
        on the score of every row left out.

        A fixed space scans the unit rows against the query moved into them; with ``k``, a
        reduced-precision scan that cannot be proven to hold the exact top ``k`` is redone in
        float32. Other models scan the embeddings their served version made of the gallery
        (:class:`~streamxm.serving.served.EmbeddedGallery`)."""
        model = served.model
        if model.fixed_space and target != modality:
            return (yield from self._fixed_candidates(served, modality, vector, wanted, target, k))
        index = served.index
        if index is None or index.version > served.version:  # a pinned version's first use
            index = yield _Work(partial(self.catalogue.index_of, served))
        gallery = index.gallery
        query, _ = scan_query(model, modality, target, vector)
        _, rows, ceiling = yield _Scan(index.blocks(target), query, min(wanted, len(gallery)))
        if index.version < served.version:
            # An earlier version's embeddings (the served one's are being made): its best
            # rows, re-ranked by the served version, without a bound on the rest.
            self.earlier_index_scans += 1
        if not index.float32(target) or index.version < served.version:
            return _Candidates.of(gallery, rows, model, modality, target, vector, np.inf)
        bound = raised(float(ceiling), reach=float(np.linalg.norm(query)) * index.norm(target))
        error = index.scan_error(target, query)
        if error > 0.0:
            # Embeddings made from rounded features (a feature map that keeps float16 rows, in
            # a gallery of COMPACT_FEATURES_ROWS or more): each row's exact score is within
            # ``error`` of its scan score, so the bound moves up by it and the candidates are
            # scored from their raw vectors.
            return _Candidates.of(gallery, rows, model, modality, target, vector, bound + error)
        # The version's own embeddings of the candidates are in the index: scoring them again
        # would cost a tower or kernel pass per candidate for the same numbers (to float32
        # rounding of the kept features, well inside the scan margin: tests/test_heads.py).
        rows = np.sort(rows)
        scores = index.embedded_at(rows, target).astype(np.float64) @ query.astype(np.float64)
        return _Candidates(gallery, rows, gallery.vectors_at(rows, target), scores, bound)

    def _fixed_candidates(
        self,
        served: ServedModel,
        modality: str,
        vector: NDArray[np.float32],
        wanted: int,
        target: str,
        k: int | None,
    ) -> Generator[_Scan | _Work, Any, _Candidates]:
        """:meth:`_candidates` of a fixed space (scan scores differ from the version's by
        the query's constant ``c``)."""
        gallery, model = self.catalogue.gallery, served.model
        wanted = min(len(gallery), wanted)
        query, c = scan_query(model, modality, target, vector)
        blocks = gallery.blocks(target)
        scanned, per_chunk = wanted, None
        if not _exact_blocks(blocks):
            scanned = proof_candidates(len(gallery), wanted, isinstance(blocks[0], Int8Block))
            if scanned > wanted:
                # Each chunk offers twice its expected share of the best ``scanned`` (a chunk
                # holds at most CHUNK_MAX rows) and the best ``scanned`` of their union are
                # re-ranked: the ceiling of a larger top at a smaller selection's cost. At 1M:
                # 50 of each 65,536, the union's 800 hold the best 400. A gallery of a few
                # chunks gets a plain top ``scanned`` (each chunk's share is most of it; at
                # 100k, 50 per chunk left a share of the searches unproven).
                per_chunk = max(1, wanted // 2, -(-2 * scanned * CHUNK_MAX // len(gallery)))
        _, rows, ceiling = yield _Scan(blocks, query, scanned, per_chunk)
        bound = raised(float(ceiling), c, float(np.linalg.norm(query)))  # unit rows
        if k is not None:  # this model's own search: its top k is settled here
            if not _proven_complete(
                float(ceiling), gallery.locate(rows, target)[0], query, k, blocks
            ):
                # The reduced-precision scan could have missed part of the exact top k
                # (scores flatter than its rounding): scan the float32 rows instead.
                self.exact_scans += 1
                # Coalesced too: the fallbacks of concurrent searches share one pass.
                _, rows, _ = yield _Scan(gallery.exact_blocks(target), query, wanted)
            bound = -np.inf
        return _Candidates.of(gallery, rows, model, modality, target, vector, bound)

    def _ensemble_steps(
        self,
        name: str,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        target: str,
        version: int | None,
    ) -> Generator[_Scan | _Work, Any, SearchAnswer]:
        """An ensemble's search: one scan of the members' rows side by side
        (:class:`~streamxm.serving.fused.FusedSpace`) when every member has exact float32 rows
        over the served gallery, else member by member; either way re-ranked by the fused
        score exactly, with more candidates until no row left out can enter the top ``k``."""
        ensemble = self.catalogue.ensemble(name, version)
        if target == modality:
            raise SameModalityUnsupported(
                f"ensemble {name!r} answers cross-modal search only (target must be "
                f"{other_modality(modality)})"
            )
        lag = self.lag(ensemble)
        gallery = self.catalogue.gallery
        if len(gallery) == 0:
            return SearchAnswer(ensemble, [], lag, None)
        reference = ensemble_reference(gallery, target)
        sources = FusedSpace.sources_of(ensemble, gallery, target)
        if sources is None:
            hits = yield from self._members_steps(ensemble, modality, vector, k, target, reference)
        else:
            space = self._fused.get((name, target))
            if space is None or not space.current(sources):
                space = yield _Work(partial(self._fused_space, name, sources, gallery, target))
            hits = yield from self._fused_steps(ensemble, space, modality, vector, k, target)
        return SearchAnswer(ensemble, hits, lag, None)

    def _fused_space(
        self, name: str, sources: tuple[object, ...], gallery: Gallery, target: str
    ) -> FusedSpace:
        """The ensemble's fused space over ``sources``, built once however many searches ask
        for it at the same time (they wait for the first)."""
        with self._fused_lock:
            space = self._fused.get((name, target))
            if space is None or not space.current(sources):
                space = FusedSpace.build(sources, gallery, target)
                self._fused[(name, target)] = space
            return space

    def _fused_steps(
        self,
        ensemble: ServedEnsemble,
        space: FusedSpace,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        target: str,
    ) -> Generator[_Scan | _Work, Any, list[tuple[str, float]]]:
        """The fused top ``k`` from scans of ``space``: its float32 score is the fused score
        less a constant per query, to rounding (a margin scaled by each member's largest
        possible term); the candidates are scored from the same rows in float64, the members
        standardised over the rows of the reference sample."""
        weights = ensemble.spec.weights
        query, constant, reach = space.standardised(
            [scan_query(m.model, modality, target, vector) for m in ensemble.members], weights
        )
        gallery = space.gallery
        wanted = min(len(gallery), max(self.candidates, 4 * k))
        while True:
            _, rows, ceiling = yield _Scan(space.blocks, query, wanted)
            rows = np.sort(rows)
            # The fused scores of the members' own rows, in float64.
            scores = space.rows_at(rows).astype(np.float64) @ query.astype(np.float64) + constant
            found = _Candidates(
                gallery,
                rows,
                np.empty((0, 0), np.float32),
                scores,
                raised(float(ceiling), constant, reach),
            )
            if found.holds_top(k) or wanted >= len(gallery):
                break
            self.expansions += 1
            wanted = min(len(gallery), 4 * wanted)
        order = np.argsort(-scores, kind="stable")[:k]
        return list(zip(gallery.ids_at(rows[order]), scores[order].tolist(), strict=True))

    def _members_steps(
        self,
        ensemble: ServedEnsemble,
        modality: str,
        vector: NDArray[np.float32],
        k: int,
        target: str,
        reference: NDArray[np.float32],
    ) -> Generator[_Scan | _Work, Any, list[tuple[str, float]]]:
        """Each member proposes its best candidates by its own index, the union is ranked by
        the fused score exactly, and members propose more until the fused k-th best is above
        what any row left out can reach (a threshold-algorithm stop: the fused score increases
        with each member's score, so the members' bounds on rows they left out bound those
        rows' fused score)."""
        fused, direction = ensemble.fused, direction_of(modality)
        standards = fused.standardisers(direction, vector[None, :], reference)
        size = len(self.catalogue.gallery)
        wanted = min(size, max(self.candidates, 4 * k))
        while True:
            ids: list[str] = []
            items: list[NDArray[np.float32]] = []
            threshold = 0.0
            for served, (offset, scale) in zip(ensemble.members, standards, strict=True):
                found = yield from self._candidates(served, modality, vector, wanted, target, None)
                threshold += (found.bound - offset[0]) / scale[0]
                ids.extend(found.gallery.ids_at(found.rows))
                items.append(found.items)
            unique = {id_: i for i, id_ in reversed(list(enumerate(ids)))}  # first of each
            keep = sorted(unique.values())
            ids, union = [ids[i] for i in keep], np.vstack(items)[keep]
            scores = fused.scores(direction, vector[None, :], union, reference)[0]
            order = np.argsort(-scores, kind="stable")[:k]
            if (
                wanted >= size
                or threshold == np.inf
                or (len(order) == k and scores[order[-1]] > threshold)
            ):
                break  # (an infinite threshold: a member's index cannot bound its scores)
            self.expansions += 1
            wanted = min(size, 4 * wanted)
        return [(ids[i], float(scores[i])) for i in order]


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


@dataclass(frozen=True, eq=False)
class _Candidates:
    """Rows a search re-ranks: in gallery order, with their raw vectors, the version's exact
    scores, and ``bound``: no row of ``gallery`` left out scores above it (``-inf``: none can
    enter the top; ``inf``: unknown)."""

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
        model: CrossModalModel,
        modality: str,
        target: str,
        vector: NDArray[np.float32],
        bound: float,
    ) -> _Candidates:
        rows = np.sort(rows)
        items = gallery.vectors_at(rows, target)
        return cls(
            gallery, rows, items, _exact_scores(model, modality, target, vector, items), bound
        )

    def holds_top(self, k: int) -> bool:
        """Whether the exact top ``k`` of the gallery is surely among these rows (or, without
        a bound, the scan is all there is to go by)."""
        if self.bound == -np.inf or self.bound == np.inf or len(self.scores) < k:
            return True
        kth = np.partition(self.scores, len(self.scores) - k)[len(self.scores) - k]
        return bool(kth > self.bound)


@dataclass(frozen=True, eq=False)
class _Scan:
    """A top-k scan a search needs, answered by the coalescing thread with the concurrent
    searches' scans of the same blocks."""

    blocks: tuple[Block, ...]
    query: NDArray[np.float32]  # one query vector
    k: int
    per_chunk: int | None = None  # rows each chunk offers (top_k_bounded); None: k


@dataclass(frozen=True, eq=False)
class _Work:
    """A heavy step of a search (loading a pinned version, building a missing index), run
    off the event loop."""

    run: Callable[[], Any]
