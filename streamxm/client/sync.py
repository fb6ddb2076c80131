"""The blocking HTTP client."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Literal, TypeVar

import httpx
from numpy.typing import ArrayLike

from streamxm.client.calls import (
    Call,
    ModelInfo,
    PairLike,
    Readiness,
    Reply,
    Request,
    SearchResult,
    ServerLimits,
    SimilarityResult,
    Sleep,
)
from streamxm.client.errors import StreamxmError
from streamxm.client.transport import ClientBase, build, reader_for
from streamxm.client.transport import headers as headers  # re-exported: it was defined here

__all__ = ["Client"]

T = TypeVar("T")


class Client(ClientBase[httpx.Client]):
    """The streamxm HTTP API from Python: push pairs, search, score, read the models' state.

    Vectors go in as numpy arrays (or anything ``np.asarray`` takes) and are sent as float32
    bytes; scores come back as numpy arrays. Every failure is an exception of
    :mod:`streamxm.client.errors` (a :class:`StreamxmError`), carrying the server's ``detail``
    and, for a push, what landed. What the client reads of a reply is capped by what the
    request can need (:mod:`streamxm.client.answers`). Reads are retried on a 503
    or a failed connection with exponential backoff; a push only when nothing of it can have
    reached the stream (:mod:`streamxm.client.calls`).

    Parameters
    ----------
    url
        The API's base URL, e.g. ``http://127.0.0.1:8000``.
    token
        Bearer token (``STREAMXM_API_TOKEN`` of the server), sent with every call.
    timeout
        Seconds per request (connect, read, write).
    retries
        Retry policy (:class:`~streamxm.client.calls.Retries`).
    http
        An ``httpx.Client`` to use instead of the client's own (its base URL is kept).

    Examples
    --------
    With an API at the default address (the README's example runs it in the test suite)::

        with Client("http://127.0.0.1:8000") as client:
            ids = client.push([("p1", np.random.rand(128), np.random.rand(10), [3])])
            hits = client.search(np.random.rand(128), modality="image", k=5)
            print(hits.version, hits.ids, hits.scores)
    """

    def _open(self, url: str, timeout: float) -> httpx.Client:
        return httpx.Client(base_url=url, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.http.close()

    def _run(self, call: Call[T]) -> T:
        reply: Reply = None
        while True:
            try:
                step = call.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply = self._do(step)

    def _do(self, step: Request | Sleep) -> Reply:
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            return None
        try:
            response = self.http.send(build(self.http, step), stream=True)
            try:
                reader = reader_for(step, response)
                for chunk in response.iter_raw():
                    reader.feed(chunk)
                    if reader.done:
                        break
            finally:
                response.close()
            return reader.answer()
        except (httpx.TransportError, StreamxmError) as exc:
            return exc

    def push(self, pairs: Iterable[PairLike], binary: bool = True) -> list[str]:
        """Validate the pairs, send them in batches that fit the server's limits and return
        their stream entry ids, in order.

        ``pairs``: :class:`~streamxm.stream.messages.Pair`, ``(id, img, txt[, labels])``
        tuples or mappings with those keys. ``binary``: message v1 frames
        (``/v1/pairs/frames``), else JSON (``/v1/pairs``). A bad pair raises
        :class:`~streamxm.client.errors.InvalidPair` before anything is sent; a failed batch
        raises with ``accepted`` holding the ids of the batches before it.
        """
        return self._run(self.calls.push_call(pairs, binary))

    def search(
        self,
        vector: ArrayLike,
        modality: Literal["image", "text"] = "image",
        k: int = 10,
        model: str | None = None,
        version: int | None = None,
        target: Literal["image", "text"] | None = None,
    ) -> SearchResult:
        """The ``k`` gallery items of ``target`` (default: the other modality) that score best
        with the query ``vector`` of ``modality``; ``model``: default the server's;
        ``version``: a kept version to answer with."""
        return self._run(self.calls.search_call(vector, modality, k, model, version, target))

    def similarity(
        self,
        images: ArrayLike,
        texts: ArrayLike,
        mode: Literal["paired", "matrix"] = "paired",
        model: str | None = None,
        version: int | None = None,
        direction: Literal["i2t", "t2i"] = "i2t",
    ) -> SimilarityResult:
        """Scores of ``(images[i], texts[i])`` (paired) or of every image with every text
        (matrix), in as many requests as the server's limits need, all by one version."""
        return self._run(self.calls.similarity_call(images, texts, mode, model, version, direction))

    def models(self) -> list[ModelInfo]:
        """Every model's state: versions, pairs seen, mistakes per triplet, rolling mAP."""
        return self._run(self.calls.models_call())

    def limits(self) -> ServerLimits:
        """What one request may hold on this server (read once)."""
        return self._run(self.calls.limits_call())

    def wait_learned(
        self, entry_id: str, model: str | None = None, timeout: float = 60.0, interval: float = 0.2
    ) -> list[ModelInfo]:
        """Wait until the version the API serves of ``model`` (None: of every model) has
        learned the stream up to ``entry_id`` (e.g. the last id :meth:`push` returned), and
        return the models' state; :class:`~streamxm.client.errors.Unavailable` after
        ``timeout`` seconds."""
        return self._run(self.calls.learned_call(entry_id, model, timeout, interval))

    def health(self) -> bool:
        """Whether the API process answers (no retries)."""
        return self._run(self.calls.health_call())

    def ready(self) -> Readiness:
        """Whether the API serves a model (an ingest process: at once)."""
        return self._run(self.calls.ready_call())

    def __repr__(self) -> str:
        return f"Client({str(self.http.base_url)!r})"
