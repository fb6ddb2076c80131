"""What the HTTP client raises: one class per way a call can fail, each carrying the server's
``detail``."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadResponse",
    "InvalidPair",
    "InvalidRequest",
    "NotFound",
    "ResponseTooLarge",
    "ServerError",
    "StreamxmError",
    "Unauthorized",
    "Unavailable",
]


class StreamxmError(Exception):
    """A call the server refused or could not answer.

    Attributes
    ----------
    status
        The HTTP status (``None``: no answer came: the connection failed or timed out).
    detail
        The server's ``detail``: a message, or the list of ``{loc, msg, type}`` of a 422.
    accepted
        For :meth:`~streamxm.client.Client.push`: the stream entry ids of the batches the
        server had accepted before this one failed, in order (the pairs after them did not
        land, unless ``unconfirmed`` says otherwise).
    unconfirmed
        For a push: how many pairs after ``accepted`` the server did take (it answered 2xx)
        but whose entry ids the client could not read (:class:`BadResponse`); pushing them
        again adds them twice.
    written
        For a push that failed: ``True`` it reached the stream, ``False`` it did not, ``None``
        unknown (:class:`Unavailable`, :class:`BadResponse` say which they know).
    in_doubt
        For a push: how many pairs after ``accepted`` may or may not have landed (their batch
        got no answer: :class:`Unavailable` with ``written`` None); the pairs after those were
        not sent.
    """

    def __init__(
        self,
        message: str,
        status: int | None = None,
        detail: Any = None,
        written: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.written = written
        self.status = status
        self.detail = message if detail is None else detail
        self.accepted: list[str] = []
        self.unconfirmed = 0
        self.in_doubt = 0


class InvalidRequest(StreamxmError):
    """The request breaks the route's contract (400, 413, 415, 422)."""


class InvalidPair(InvalidRequest):
    """A pair the client or the server refused. ``path`` locates the field in the request
    body (``["pairs", 3, "img"]``), ``index`` is the pair's position in the pushed sequence,
    ``field`` its field and ``reason`` the code (``dim_mismatch``, ``non_finite``, ...)."""

    def __init__(
        self,
        message: str,
        path: list[str | int],
        reason: str,
        index: int | None,
        status: int | None = None,
        detail: Any = None,
    ) -> None:
        super().__init__(message, status, detail)
        self.path = path
        self.reason = reason
        self.index = index
        self.field = str(path[-1]) if path else "body"


class Unauthorized(StreamxmError):
    """401: the route needs the bearer token (``Client(token=...)``) and it is missing or
    wrong."""


class NotFound(StreamxmError):
    """404: a model with no learner in the namespace, a version the store no longer keeps, or
    a route this API process's role does not serve (the message names the role)."""


class Unavailable(StreamxmError):
    """503 or no answer, after the client's retries: no model loaded yet, the stream store
    unreachable, or the API itself.

    ``written`` (pushes): ``False`` when the server said, or the client knows, that nothing of
    the failed batch reached the stream; ``None`` when that is unknown (pushing it again may
    add its pairs twice).
    """


class ServerError(StreamxmError):
    """Any other status: a bug in the server (its log has the traceback)."""


class BadResponse(StreamxmError):
    """An answer the client cannot read: not JSON, nested too deep, the wrong shape or types,
    a push answered with a different number of entry ids than pairs, an encoding it did not
    ask for. ``written``: ``True`` when a push was answered 2xx (its batch landed), else
    ``None``."""


class ResponseTooLarge(BadResponse):
    """An answer past the byte cap the request allows (after decompression): the client
    stopped reading it."""
