"""The asynchronous HTTP client: :class:`~streamxm.client.Client`'s calls, awaited."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeVar

import anyio
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

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient(ClientBase[httpx.AsyncClient]):
    """:class:`~streamxm.client.Client` for asyncio (or trio): the same parameters, calls,
    results, errors and retries; every call is awaited::

        async with AsyncClient("http://127.0.0.1:8000") as client:
            hits = await client.search(vector, modality="text", k=10)
    """

    def _open(self, url: str, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    async def _run(self, call: Call[T]) -> T:
        reply: Reply = None
        while True:
            try:
                step = call.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply = await self._do(step)

    async def _do(self, step: Request | Sleep) -> Reply:
        if isinstance(step, Sleep):
            await anyio.sleep(step.seconds)
            return None
        try:
            response = await self.http.send(build(self.http, step), stream=True)
            try:
                reader = reader_for(step, response)
                async for chunk in response.aiter_raw():
                    reader.feed(chunk)
                    if reader.done:
                        break
            finally:
                await response.aclose()
            return reader.answer()
        except (httpx.TransportError, StreamxmError) as exc:
            return exc

    async def push(self, pairs: Iterable[PairLike], binary: bool = True) -> list[str]:
        """As :meth:`Client.push`."""
        return await self._run(self.calls.push_call(pairs, binary))

    async def search(
        self,
        vector: ArrayLike,
        modality: Literal["image", "text"] = "image",
        k: int = 10,
        model: str | None = None,
        version: int | None = None,
        target: Literal["image", "text"] | None = None,
    ) -> SearchResult:
        """As :meth:`Client.search`."""
        return await self._run(self.calls.search_call(vector, modality, k, model, version, target))

    async def similarity(
        self,
        images: ArrayLike,
        texts: ArrayLike,
        mode: Literal["paired", "matrix"] = "paired",
        model: str | None = None,
        version: int | None = None,
        direction: Literal["i2t", "t2i"] = "i2t",
    ) -> SimilarityResult:
        """As :meth:`Client.similarity`."""
        return await self._run(
            self.calls.similarity_call(images, texts, mode, model, version, direction)
        )

    async def wait_learned(
        self, entry_id: str, model: str | None = None, timeout: float = 60.0, interval: float = 0.2
    ) -> list[ModelInfo]:
        """As :meth:`Client.wait_learned`."""
        return await self._run(self.calls.learned_call(entry_id, model, timeout, interval))

    async def models(self) -> list[ModelInfo]:
        return await self._run(self.calls.models_call())

    async def limits(self) -> ServerLimits:
        return await self._run(self.calls.limits_call())

    async def health(self) -> bool:
        return await self._run(self.calls.health_call())

    async def ready(self) -> Readiness:
        return await self._run(self.calls.ready_call())
