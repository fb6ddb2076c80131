"""Top-k search of the gallery, exact for the served version, as one pipeline: scan for
candidates with the embedding kind's stated error bound, re-rank them exactly, and scan for more
until no row left out can enter the top k (:meth:`Searcher.proven_top`).

What is scanned depends on the served version's embedding kind (:mod:`streamxm.models.
embedding`), never on the model: a fixed space's query moves into the gallery's unit rows; the
other kinds' rows are the served version's index (:class:`~streamxm.serving.served.
EmbeddedGallery`), or, for a kind that re-embeds raw vectors while its new version embeds the
gallery, an earlier version's, whose best rows are re-ranked without a bound
(:mod:`streamxm.serving.candidates`). An ensemble goes through the same loop: one scan of its
members' rows side by side (:class:`~streamxm.serving.fused.FusedSpace`), or member by member.
Candidates are re-ranked exactly, so scores are the similarity's and ties keep gallery order.
A search is a generator of steps (scans, heavy work) that a driver runs: on a thread
(:meth:`Searcher.search`) or on an event loop (:meth:`Searcher.search_async`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, cast

import numpy as np
from numpy.typing import NDArray

from streamxm import defaults as D
from streamxm.models.ensemble import is_ensemble
from streamxm.serving.candidates import (
    Candidates,
    CandidateScans,
    Proposal,
    Scan,
    Step,
    Union,
    Work,
    proof_candidates,
    raised,
)
from streamxm.serving.fused import FusedSpace
from streamxm.serving.gallery import Gallery, GalleryRows
from streamxm.serving.index import QueryCoalescer, scan_together
from streamxm.serving.served import (
    EmbeddedGallery,
    ModelNotReady,
    SameModalityUnsupported,
    SearchAnswer,
    SearchQuery,
    ServedEnsemble,
    ServedModel,
    direction_of,
    other_modality,
)

__all__ = [
    "Catalogue",
    "Searcher",
    "check_target",
    "ensemble_reference",
    "proof_candidates",
]


class Catalogue(Protocol):
    """What a search reads from the server: the gallery snapshot and the served versions."""

    @property
    def gallery(self) -> Gallery: ...

    def get(self, name: str, version: int | None = None) -> ServedModel: ...

    def is_loaded(self, name: str, version: int | None) -> bool: ...

    def pin(self, name: str, version: int) -> ServedModel: ...

    def ensemble(
        self, name: str, version: int | None = None, members: Mapping[str, int] | None = None
    ) -> ServedEnsemble: ...

    def index_of(self, served: ServedModel) -> EmbeddedGallery: ...

    def reference_sample(self) -> GalleryRows: ...


def check_target(served: ServedModel | ServedEnsemble, modality: str, target: str) -> None:
    """Refuse a same-modality search where it has no meaning
    (:class:`~streamxm.serving.served.SameModalityUnsupported`): an ensemble, or a model whose
    images and texts embed in different spaces."""
    if target != modality:
        return
    if isinstance(served, ServedEnsemble):
        raise SameModalityUnsupported(
            f"ensemble {served.name!r} answers cross-modal search only (target must be "
            f"{other_modality(modality)})"
        )
    if not served.embedding.shared_space:
        raise SameModalityUnsupported(
            f"model {served.name!r} embeds images and texts in different spaces: it answers "
            f"cross-modal search only (target must be {other_modality(modality)})"
        )


def ensemble_reference(sample: GalleryRows, modality: str) -> NDArray[np.float32]:
    """The raw vectors of ``modality`` an ensemble's member scores are standardised over (per
    query): the gallery's reference sample
    (:meth:`~streamxm.serving.gallery.Gallery.reference_sample`)."""
    if len(sample) < 2:
        raise ModelNotReady(
            "an ensemble standardises its members' scores over the gallery, "
            "which has fewer than 2 items yet"
        )
    return sample.raw(modality)


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
        self.scans = CandidateScans(lambda: catalogue.gallery, catalogue.index_of)
        #: Candidate scans repeated with four times as many rows because the first could not
        #: prove the top k complete (an embedded index's or an ensemble's).
        self.expansions = 0
        # Per (ensemble, target): its members' rows side by side, while they are current.
        self._fused: dict[tuple[str, str], FusedSpace] = {}
        self._fused_lock = threading.Lock()

    @property
    def exact_scans(self) -> int:
        """Searches answered by a float32 scan after an unproven reduced-precision one."""
        return self.scans.exact_scans

    @property
    def earlier_index_scans(self) -> int:
        """Candidate scans of an earlier version's index (re-ranked, not proven)."""
        return self.scans.earlier_index_scans

    def close(self) -> None:
        self.coalescer.close()

    def search(self, query: SearchQuery) -> SearchAnswer:
        """The ``query``'s ``k`` best gallery items, scored by the served version exactly as
        :meth:`similarity` scores them, ties in gallery order.

        Candidates come from the served version's embedding kind: the gallery's unit rows
        against the query moved into them (a fixed space), or else the newest embedded index.
        Same-modality search needs a model whose embeddings share one space; others raise
        :class:`SameModalityUnsupported`.
        """
        steps = self._steps(query)
        try:
            step = next(steps)
            while True:
                if isinstance(step, Scan):
                    scan = self.coalescer.submit(step.blocks, step.query, step.k, step.per_chunk)
                    step = steps.send(scan.result())
                else:
                    step = steps.send(step.run())
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def search_many(self, queries: Sequence[SearchQuery]) -> list[SearchAnswer | Exception]:
        """:meth:`search` of several queries on this thread, each round's scans of the same
        blocks in one product (:func:`~streamxm.serving.index.scan_together`): how a gallery
        shard answers a batch of the API's searches, with no thread hand-off per search. A
        query's error is its answer; the answers are those :meth:`search` gives."""
        answers: list[SearchAnswer | Exception | None] = [None] * len(queries)
        running: dict[int, tuple[Generator[Step, Any, SearchAnswer], Step]] = {}

        def advance(i: int, steps: Generator[Step, Any, SearchAnswer], sent: Any) -> None:
            """Send query ``i`` what its last step gave (an error ends it: its answer)."""
            try:
                running[i] = (
                    steps,
                    steps.throw(sent) if isinstance(sent, Exception) else steps.send(sent),
                )
            except StopIteration as done:
                running.pop(i, None)
                answers[i] = done.value
            except Exception as exc:  # this query's answer; the others go on
                running.pop(i, None)
                answers[i] = exc

        for i, query in enumerate(queries):
            advance(i, self._steps(query), None)
        while running:
            scans: dict[tuple[int, int], list[int]] = {}
            for i, (steps, step) in list(running.items()):
                if isinstance(step, Scan):
                    scans.setdefault((id(step.blocks), step.query.shape[-1]), []).append(i)
                    continue
                try:
                    done = step.run()
                except Exception as exc:
                    done = exc
                advance(i, steps, done)
            for group in scans.values():
                asked = [cast(Scan, running[i][1]) for i in group]
                requests = [
                    (np.ascontiguousarray(s.query, np.float32), s.k, s.per_chunk) for s in asked
                ]
                try:
                    found: list[Any] = scan_together(asked[0].blocks, requests)
                except Exception as exc:
                    found = [exc] * len(group)
                for i, its in zip(group, found, strict=True):
                    advance(i, running[i][0], its)
        return [a if a is not None else RuntimeError("no answer") for a in answers]

    async def search_async(
        self, query: SearchQuery, offload: Callable[[Callable[[], Any]], Awaitable[Any]]
    ) -> SearchAnswer:
        """:meth:`search` for an event loop: the light steps (query transform, exact re-rank
        of the candidates) run on the loop, the scan is awaited from the coalescing thread,
        and heavy work (loading a pinned version, building a missing index) goes to ``offload``.
        Under load this saves two thread hand-offs per search, a measurable part of the API's
        CPU per search (``docs/benchmarks.md``)."""
        steps = self._steps(query)
        try:
            step = next(steps)
            while True:
                if isinstance(step, Scan):
                    found = await asyncio.wrap_future(
                        self.coalescer.submit(step.blocks, step.query, step.k, step.per_chunk)
                    )
                else:
                    found = await offload(step.run)
                step = steps.send(found)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _steps(self, query: SearchQuery) -> Generator[Step, Any, SearchAnswer]:
        """The search, yielding each scan (and any heavy step) for a driver to run."""
        name, version, k = query.name, query.version, query.k
        if is_ensemble(name):
            ensemble = self.catalogue.ensemble(name, version, query.members)
            return (yield from self._ensemble_steps(ensemble, query))
        if version is not None and not self.catalogue.is_loaded(name, version):
            yield Work(partial(self.catalogue.pin, name, version))  # read from the store: heavy
        served = self.catalogue.get(name, version)
        check_target(served, query.modality, query.searched)
        lag = self.lag(served)
        if len(self.catalogue.gallery) == 0:
            return SearchAnswer(served, [], lag, served.version)
        found = yield from self.proven_top(
            partial(self.scans.propose, served, query, k=k), k, len(self.catalogue.gallery)
        )
        return SearchAnswer(served, found.best(k), lag, served.index_version)

    def proven_top(
        self, propose: Callable[[int], Generator[Step, Any, Proposal]], k: int, size: int
    ) -> Generator[Step, Any, Proposal]:
        """The search pipeline: ``propose(wanted)`` candidates (scanned, re-ranked exactly,
        with a bound on every row left out), four times as many while rows left out could
        still score above the k-th candidate, until the top ``k`` is proven or the whole
        gallery (``size`` rows at first) is proposed."""
        wanted = min(size, max(self.candidates, 4 * k))
        while True:
            found = yield from propose(wanted)
            if found.holds_top(k) or wanted >= found.size:
                return found
            self.expansions += 1
            wanted = min(found.size, 4 * wanted)

    def _ensemble_steps(
        self, ensemble: ServedEnsemble, query: SearchQuery
    ) -> Generator[Step, Any, SearchAnswer]:
        """An ensemble's search: one scan of the members' rows side by side
        (:class:`~streamxm.serving.fused.FusedSpace`) when every member has exact float32 rows
        over the served gallery, else member by member; either way re-ranked by the fused
        score exactly, with more candidates until no row left out can enter the top ``k``."""
        name, target = ensemble.name, query.searched
        check_target(ensemble, query.modality, target)
        lag = self.lag(ensemble)
        gallery = self.catalogue.gallery
        if len(gallery) == 0:
            return SearchAnswer(ensemble, [], lag, None)
        sample = self.catalogue.reference_sample()
        reference = ensemble_reference(sample, target)
        sources = FusedSpace.sources_of(ensemble, gallery, target)
        if sources is None:
            hits = yield from self._members_steps(ensemble, query, reference)
        else:
            space = self._fused.get((name, target))
            if space is None or not space.current(sources):
                space = yield Work(partial(self._fused_space, name, sources, gallery, target))
            kinds = [m.embedding for m in ensemble.members]
            rows = space.kept_reference(sample)
            if rows is None:  # towers or kernel terms over the sample: off the event loop
                rows = yield Work(partial(space.reference_rows, kinds, sample))
            hits = yield from self._fused_steps(ensemble, space, rows, query)
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
        reference: NDArray[np.float32],
        query: SearchQuery,
    ) -> Generator[Step, Any, list[tuple[str, float]]]:
        """The fused top ``k`` from scans of ``space``: its float32 score is the fused score
        less a constant per query, to rounding (a margin scaled by each member's largest
        possible term); the candidates are scored from the same rows in float64, the members
        standardised over their ``reference`` rows (:meth:`FusedSpace.reference_rows`)."""
        weights, target, modality = ensemble.spec.weights, space.target, query.modality
        fused_query, constant, reach = space.standardised(
            [m.embedding.scan_query(modality, target, query.vector) for m in ensemble.members],
            weights,
            reference,
        )
        gallery = space.gallery

        def propose(wanted: int) -> Generator[Step, Any, Candidates]:
            _, rows, ceiling = yield Scan(space.blocks, fused_query, wanted)
            rows = np.sort(rows)
            # The fused scores of the members' own rows, in float64.
            scores = (
                space.rows_at(rows).astype(np.float64) @ fused_query.astype(np.float64) + constant
            )
            no_items = np.empty((0, 0), np.float32)
            return Candidates(gallery, rows, no_items, scores, raised(ceiling, constant, reach))

        found = yield from self.proven_top(propose, query.k, len(gallery))
        return found.best(query.k)

    def _members_steps(
        self, ensemble: ServedEnsemble, query: SearchQuery, reference: NDArray[np.float32]
    ) -> Generator[Step, Any, list[tuple[str, float]]]:
        """Each member proposes its best candidates by its own index, the union is ranked by
        the fused score exactly, and members propose more until the fused k-th best is above
        what any row left out can reach (a threshold-algorithm stop: the fused score increases
        with each member's score, so the members' bounds on rows they left out bound those
        rows' fused score)."""
        fused, direction, vector = ensemble.fused, direction_of(query.modality), query.vector
        standards = fused.standardisers(direction, vector[None, :], reference)
        size = len(self.catalogue.gallery)

        def propose(wanted: int) -> Generator[Step, Any, Union]:
            ids: list[str] = []
            items: list[NDArray[np.float32]] = []
            threshold = 0.0
            for served, (offset, scale) in zip(ensemble.members, standards, strict=True):
                found = yield from self.scans.propose(served, query, wanted)
                threshold += (found.bound - offset[0]) / scale[0]
                ids.extend(found.gallery.ids_at(found.rows))
                items.append(found.items)
            unique = {id_: i for i, id_ in reversed(list(enumerate(ids)))}  # first of each
            keep = sorted(unique.values())
            union = np.vstack(items)[keep]
            scores = fused.scores(direction, vector[None, :], union, reference)[0]
            # (an infinite threshold: a member's index cannot bound its scores)
            return Union([ids[i] for i in keep], scores, threshold, size)

        found = yield from self.proven_top(propose, query.k, size)
        return found.best(query.k)
