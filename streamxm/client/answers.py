"""What the client reads of a response, bounded: its body decompressed under a byte cap that
the request sets, then parsed, every failure a :class:`~streamxm.client.errors.BadResponse`.

A server (or anything posing as one) decides how much it sends and how well it compresses, so
the client never reads a body whole: the drivers feed the raw bytes to a :class:`BodyReader`,
which inflates ``gzip`` and ``deflate`` with ``zlib``'s ``max_length`` (a small compressed
chunk cannot inflate past the cap in memory) and stops at ``Request.max_answer_bytes``. The
cap follows from the request: ``k`` hits, the cells of a similarity block, the ids of a push
batch (:mod:`streamxm.client.calls`). An error status's body is cut at the cap instead (its
detail is only a message), so the status is never lost to a long page.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from streamxm.client.errors import BadResponse, ResponseTooLarge

__all__ = ["ACCEPT_ENCODING", "Answer", "BodyReader", "decoded"]

#: What the client asks servers to compress with: the encodings :class:`BodyReader` inflates.
ACCEPT_ENCODING = "gzip, deflate"


@dataclass(frozen=True)
class Answer:
    """A response read whole within its cap: status, headers and the decoded body."""

    status_code: int
    headers: httpx.Headers
    content: bytes
    truncated: bool = False  # an error body cut at the cap

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` (not JSON) or ``RecursionError`` (nested past
        Python's recursion limit) for a body that is not an answer."""
        return json.loads(self.content)


class BodyReader:
    """Decodes a response's raw bytes as they arrive and refuses more than ``limit`` decoded
    bytes (more than ``limit`` raw bytes too, so an endless body of nothing is refused)."""

    def __init__(
        self, what: str, status: int, headers: httpx.Headers, limit: int, writes: bool = False
    ) -> None:
        self.what, self.status, self.headers, self.limit = what, status, headers, limit
        self.writes = writes  # a push: a 2xx says its batch landed
        self.body = bytearray()  # one buffer: a list of tiny chunks costs ~40 bytes a chunk
        self.size = 0
        self.raw = 0
        self.truncated = False
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("gzip", "x-gzip"):
            self._inflate: Any = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._inflate = zlib.decompressobj()
        elif encoding in ("identity", ""):
            self._inflate = None
        else:
            raise self._bad(
                f"a body in the content-encoding {encoding!r}, which the client "
                f"did not ask for (it accepts {ACCEPT_ENCODING})"
            )
        length = headers.get("content-length", "")
        if self._inflate is None and length.isdigit() and int(length) > limit:
            self._overflow(f"Content-Length {int(length)}")

    @property
    def done(self) -> bool:
        """An error body cut at the cap: the rest need not be read."""
        return self.truncated

    def feed(self, raw: bytes) -> None:
        self.raw += len(raw)
        if self.raw > 8 * self.limit + 65_536 and self._inflate is not None:
            self._overflow(f"more than {8 * self.limit + 65_536} compressed bytes")
        if self._inflate is None:
            self._keep(raw)
            return
        data = raw
        while data and not self.truncated:
            if self._inflate.eof:  # zlib would keep what follows whole, in unused_data
                raise self._bad("data after the end of the compressed body")
            try:
                out = self._inflate.decompress(data, self.limit - self.size + 1)
            except zlib.error as exc:
                raise self._bad(f"a body that does not inflate ({exc})") from None
            self._keep(out)
            data = self._inflate.unconsumed_tail

    def _keep(self, chunk: bytes) -> None:
        if self.size + len(chunk) > self.limit:
            self._overflow(f"more than {self.limit} bytes")
            chunk = chunk[: self.limit - self.size]  # an error body: keep its start
        self.body += chunk
        self.size += len(chunk)

    def _overflow(self, seen: str) -> None:
        if self.status >= 400:
            self.truncated = True
            return
        raise ResponseTooLarge(
            f"{self.what}: {self.status} with {seen}, past the client's cap of {self.limit} "
            f"bytes for this request",
            self.status,
            written=self._written(),
        )

    def answer(self) -> Answer:
        if self._inflate is not None and not self._inflate.eof and self.status < 400:
            raise self._bad("a compressed body cut off before its end")
        return Answer(self.status, self.headers, bytes(self.body), self.truncated)

    def _written(self) -> bool | None:
        return True if self.writes and 200 <= self.status < 300 else None

    def _bad(self, why: str) -> BadResponse:
        return BadResponse(
            f"{self.what}: {self.status} with {why}", self.status, written=self._written()
        )


@contextmanager
def decoded(what: str, answer: Answer, writes: bool = False) -> Iterator[None]:
    """Turns a body that is not the answer's shape (missing keys, wrong types, not JSON, too
    deep) into :class:`BadResponse` naming the request; ``writes``: the request was a push,
    whose batch a 2xx says landed."""
    try:
        yield
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError, IndexError) as exc:
        written = True if writes and 200 <= answer.status_code < 300 else None
        raise BadResponse(
            f"{what}: {answer.status_code} with a body that is not its answer "
            f"({type(exc).__name__}: {str(exc)[:200]})",
            answer.status_code,
            written=written,
        ) from None
