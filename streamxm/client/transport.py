"""What :class:`~streamxm.client.Client` and :class:`~streamxm.client.AsyncClient` share: the
connection's set-up, the requests they build and the reader of an answer; each adds only its
way of waiting (blocking or awaited) for the calls of :mod:`streamxm.client.calls`."""

from __future__ import annotations

from typing import Generic, TypeVar

import httpx

from streamxm.client.answers import ACCEPT_ENCODING, BodyReader
from streamxm.client.calls import Calls, Request, Retries

__all__ = ["ClientBase", "build", "headers", "reader_for"]

#: The httpx client a front end sends with: blocking or asynchronous.
H = TypeVar("H", httpx.Client, httpx.AsyncClient)


def headers(token: str | None) -> dict[str, str]:
    """The headers of every call: the token, and only the encodings the client inflates."""
    auth = {"authorization": f"Bearer {token}"} if token else {}
    return {"accept-encoding": ACCEPT_ENCODING, **auth}


def reader_for(request: Request, response: httpx.Response) -> BodyReader:
    return BodyReader(
        request.what,
        response.status_code,
        response.headers,
        request.max_answer_bytes,
        writes=not request.idempotent,
    )


def build(http: httpx.Client | httpx.AsyncClient, request: Request) -> httpx.Request:
    headers = {"content-type": request.content_type} if request.content_type else {}
    return http.build_request(
        request.method, request.path, json=request.json, content=request.content, headers=headers
    )


class ClientBase(Generic[H]):
    """A client's connection (its own httpx client unless one is given, closed with it only
    then) and its :class:`~streamxm.client.calls.Calls`; the parameters are
    :class:`~streamxm.client.Client`'s."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        timeout: float = 30.0,
        retries: Retries = Retries(),
        http: H | None = None,
    ) -> None:
        self._own = http is None
        self.http: H = http or self._open(url, timeout)
        self.http.headers.update(headers(token))
        self.calls = Calls(retries)

    def _open(self, url: str, timeout: float) -> H:
        """The client's own httpx client, for ``url`` with ``timeout``."""
        raise NotImplementedError
