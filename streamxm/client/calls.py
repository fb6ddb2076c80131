"""Every client call as a generator of steps, with no I/O of its own (sans-I/O).

A call yields a :class:`Request` and receives the :class:`~streamxm.client.answers.Answer`
(or the ``httpx.TransportError`` the send raised, or the error reading the reply), or yields a
:class:`Sleep` before a retry; its return value is the call's result.
:class:`~streamxm.client.Client` and :class:`~streamxm.client.AsyncClient` only drive these
generators, one with blocking sends and sleeps, the other awaiting them, so the two cannot
drift apart.

What a reply may hold is capped per request (``Request.max_answer_bytes``, from ``k``, a
block's cells or a batch's pairs) and read by the drivers through
:class:`~streamxm.client.answers.BodyReader`; a body that is too large or not the answer's
shape raises :class:`~streamxm.client.errors.BadResponse`.

Retries (:func:`exchange`): an idempotent call (every read) is sent again after a 503 or a
failed connection, ``Retries.attempts`` times in all, waiting ``backoff * 2**attempt`` seconds
(at most ``max_backoff``) or the server's ``Retry-After`` when it is longer. A push is sent
again only when nothing of it can have reached the stream: the server answered 503 with
``streamxm-written: none``, or the connection to the API failed before the request was sent.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import httpx
import numpy as np
from numpy.typing import ArrayLike, NDArray

from streamxm.client.answers import Answer, decoded
from streamxm.client.errors import (
    BadResponse,
    InvalidPair,
    InvalidRequest,
    NotFound,
    ServerError,
    StreamxmError,
    Unauthorized,
    Unavailable,
)
from streamxm.stream.messages import (
    FRAMES_MEDIA_TYPE,
    WRITTEN_HEADER,
    Pair,
    encode_frame,
    encode_pair,
    make_pair,
)
from streamxm.stream.messages import InvalidPair as PairRefused

__all__ = [
    "Calls",
    "Hit",
    "ModelInfo",
    "PairLike",
    "Readiness",
    "Request",
    "Retries",
    "SearchResult",
    "ServerLimits",
    "SimilarityResult",
    "Sleep",
    "exchange",
]

T = TypeVar("T")

#: A pair to push: a validated :class:`~streamxm.stream.messages.Pair`, a tuple
#: ``(id, img, txt)`` or ``(id, img, txt, labels)``, or a mapping with those keys (and ``ts``).
PairLike = Pair | Sequence[Any] | Mapping[str, Any]


#: The cap on a reply's decoded body when a call sets none (``/healthz``, ``/readyz``, an
#: error's detail), and the room every capped answer has for its fixed fields.
ANSWER_BYTES = 64 << 10
#: Bytes a search hit may take in JSON: an id of 256 characters, each escaped as ``\\uXXXX``,
#: and its score and keys.
HIT_BYTES = 6 * 256 + 64
#: Bytes a score may take in JSON (``-1.2345678901234567e-308,``).
SCORE_BYTES = 32
#: Bytes a stream entry id may take in JSON (two 20-digit integers, quotes, a comma).
ENTRY_ID_BYTES = 48
#: ``GET /v1/models``: one model's record is under 2 KB; this is room for thousands.
MODELS_BYTES = 8 << 20


@dataclass(frozen=True)
class Request:
    """One HTTP request. ``idempotent``: sending it twice is harmless (every read);
    ``answers``: statuses that are answers rather than errors (``/readyz``'s 503);
    ``max_answer_bytes``: the most the client reads of the reply's body, decoded."""

    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    content_type: str | None = None
    idempotent: bool = True
    answers: frozenset[int] = frozenset()
    attempts: int | None = None  # None: the client's Retries.attempts
    max_answer_bytes: int = ANSWER_BYTES

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class Sleep:
    seconds: float


Step = Request | Sleep
#: What a driver hands back: the answer read within its cap, the failed send, the reason the
#: reply could not be read (too large, an unknown encoding), or nothing after a sleep.
Reply = Answer | httpx.TransportError | StreamxmError | None
Call = Generator[Step, Reply, T]


@dataclass(frozen=True)
class Retries:
    """How often and how patiently a call is sent again (see the module's docstring)."""

    attempts: int = 4
    backoff: float = 0.25
    max_backoff: float = 5.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        wait = min(self.max_backoff, self.backoff * 2.0**attempt)
        return float(min(self.max_backoff, max(wait, retry_after or 0.0)))


@dataclass(frozen=True)
class ServerLimits:
    """What one request may hold (``GET /v1/limits``; the server's defaults until read)."""

    role: str = "all"
    max_batch: int = 1024
    max_request_values: int = 1 << 19
    max_body_bytes: int = 24 * (1 << 19) + (64 << 10)
    max_dim: int = 65_536
    max_k: int = 1000
    max_labels: int = 64


@dataclass(frozen=True)
class Hit:
    id: str
    score: float


@dataclass(frozen=True)
class SearchResult:
    """A search's answer: ``hits`` best first, and which version ranked them. ``version`` is
    None for an ensemble (``members`` has its members' versions); ``version_lag_s`` is how
    long a newer checkpoint than ``version`` has existed."""

    model: str
    version: int | None
    members: dict[str, int] | None
    target: str
    version_lag_s: float
    index_version: int | None
    hits: list[Hit]

    @property
    def ids(self) -> list[str]:
        return [h.id for h in self.hits]

    @property
    def scores(self) -> NDArray[np.float64]:
        return np.array([h.score for h in self.hits], dtype=np.float64)


@dataclass(frozen=True)
class SimilarityResult:
    """Scores of ``(images[i], texts[i])`` (paired: shape ``(n,)``) or of every image with
    every text (matrix: ``(n_images, n_texts)``), all from one version of the model."""

    model: str
    version: int | None
    members: dict[str, int] | None
    scores: NDArray[np.float64]


@dataclass(frozen=True)
class ModelInfo:
    """One model of ``GET /v1/models``; ``mistakes`` are counted per triplet (``triplets``
    has how many were scored)."""

    name: str
    loaded: bool
    version: int | None
    checkpoint_version: int | None
    pairs_seen: int
    mistakes: dict[str, int]
    triplets: dict[str, int]
    rolling_map: dict[str, float | None]
    checkpoint_time: float | None
    gallery_items: int
    champion_of: list[str] = field(default_factory=list)
    last_entry_id: str | None = None  # newest stream entry the served version has learned


#: What :func:`decoded` names as the answer of a value read after its call returned.
_NO_ANSWER = Answer(200, httpx.Headers(), b"")


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as a key that sorts as Redis orders entries."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True)
class Readiness:
    ready: bool
    status: str
    models: list[str]


def _retry_after(reply: Answer) -> float | None:
    try:
        return float(str(reply.headers.get("retry-after", "")))
    except ValueError:
        return None


def _message(detail: Any) -> str:
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        where = ".".join(str(x) for x in first.get("loc", [])[1:]) or "body"
        return f"{where}: {first.get('msg', '')} ({first.get('type', '')})"
    return str(detail)


def error_of(request: Request, reply: Answer | httpx.TransportError) -> StreamxmError:
    """The exception for a failed send or an error status."""
    if isinstance(reply, httpx.TransportError):
        # A connection that was never made carried nothing: a push may be sent again.
        written = False if isinstance(reply, httpx.ConnectError) else None
        return Unavailable(
            f"{request.method} {request.path}: no answer ({type(reply).__name__}: {reply})",
            None,
            written=written,
        )
    status = reply.status_code
    # The status decides the class; the body only the message, whatever shape it has.
    try:
        detail = reply.json().get("detail", reply.text)
        message = f"{request.method} {request.path}: {status} {_message(detail)}"
    except (ValueError, AttributeError, TypeError, KeyError, IndexError, RecursionError):
        detail = reply.text[:2000]
        message = f"{request.method} {request.path}: {status} {detail}"
    if status == 503:
        written = False if reply.headers.get(WRITTEN_HEADER) == "none" else None
        return Unavailable(message, status, detail, written=written)
    kinds: dict[int, type[StreamxmError]] = {401: Unauthorized, 404: NotFound}
    if status in kinds:
        return kinds[status](message, status, detail)
    if status in (400, 413, 415, 422):
        with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError, IndexError):
            loc = detail[0].get("loc", []) if isinstance(detail, list) and detail else []
            if request.path.startswith("/v1/pairs") and len(loc) >= 3 and loc[1] == "pairs":
                return InvalidPair(
                    message,
                    list(loc[1:]),
                    str(detail[0].get("type", "")),
                    int(loc[2]),
                    status,
                    detail,
                )
        return InvalidRequest(message, status, detail)
    return ServerError(message, status, detail)


def exchange(request: Request, retries: Retries) -> Call[Answer]:
    """Send ``request`` until it is answered, or raise the typed error (module docstring)."""
    attempts = request.attempts or retries.attempts
    for attempt in range(attempts):
        reply = yield request
        assert reply is not None
        if isinstance(reply, StreamxmError):
            raise reply
        if isinstance(reply, Answer) and (
            reply.status_code < 400 or reply.status_code in request.answers
        ):
            return reply
        error = error_of(request, reply)
        again = isinstance(error, Unavailable) and (request.idempotent or error.written is False)
        if not again or attempt == attempts - 1:
            raise error
        yield Sleep(
            retries.delay(attempt, _retry_after(reply) if isinstance(reply, Answer) else None)
        )
    raise AssertionError("unreachable: the last attempt returns or raises")


def _b64(vector: NDArray[np.float32]) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()


def _rows(x: ArrayLike, what: str) -> NDArray[np.float32]:
    rows = np.asarray(x, dtype=np.float32)
    if rows.ndim == 1:
        rows = rows[None, :]
    if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] == 0:
        raise InvalidRequest(
            f"{what}: expected a vector or a non-empty 2-d array, got shape {rows.shape}"
        )
    return rows


def as_pairs(items: Iterable[PairLike]) -> list[Pair]:
    """Validate what :meth:`~streamxm.client.Client.push` takes into pairs, with the stream's
    own validator, naming the first bad one by its position."""
    pairs: list[Pair] = []
    for i, item in enumerate(items):
        try:
            if isinstance(item, Pair):
                pairs.append(item)
            elif isinstance(item, Mapping):
                pairs.append(
                    make_pair(
                        item["id"], item["img"], item["txt"], item.get("labels"), item.get("ts")
                    )
                )
            else:
                pairs.append(make_pair(*item))
        except PairRefused as exc:
            raise InvalidPair(
                f"pairs[{i}].{exc.field}: {exc.detail}", ["pairs", i, exc.field], exc.reason, i
            ) from None
        except (KeyError, TypeError) as exc:
            raise InvalidPair(
                f"pairs[{i}]: not a pair ({exc}); give (id, img, txt[, labels]) "
                "or a mapping with those keys",
                ["pairs", i],
                "bad_shape",
                i,
            ) from None
    if not pairs:
        raise InvalidRequest("no pairs to push")
    return pairs


def _pair_json(pair: Pair) -> bytes:
    body: dict[str, Any] = {"id": pair.id, "img": pair.img.tolist(), "txt": pair.txt.tolist()}
    if pair.labels:
        body["labels"] = list(pair.labels)
    if pair.ts is not None:
        body["ts"] = pair.ts
    return json.dumps(body, separators=(",", ":")).encode()


def push_batches(
    pairs: Sequence[Pair], limits: ServerLimits, binary: bool
) -> list[tuple[int, Request]]:
    """The pairs as requests that each fit the server's limits (pairs, values and bytes per
    request), with the position of each batch's first pair."""
    head, sep, tail = (b"", b"", b"") if binary else (b'{"pairs":[', b",", b"]}")
    parts = [encode_frame(encode_pair(p)) if binary else _pair_json(p) for p in pairs]
    batches: list[tuple[int, Request]] = []
    start, size, values = 0, len(head) + len(tail), 0

    def close(stop: int) -> None:
        body = head + sep.join(parts[start:stop]) + tail
        batches.append(
            (
                start,
                Request(
                    "POST",
                    "/v1/pairs/frames" if binary else "/v1/pairs",
                    content=body,
                    content_type=FRAMES_MEDIA_TYPE if binary else "application/json",
                    idempotent=False,
                    max_answer_bytes=ANSWER_BYTES + (stop - start) * ENTRY_ID_BYTES,
                ),
            )
        )

    for i, (pair, part) in enumerate(zip(pairs, parts, strict=True)):
        n = pair.img.shape[0] + pair.txt.shape[0]
        fits = (
            i - start < limits.max_batch
            and values + n <= limits.max_request_values
            and size + len(part) + len(sep) <= limits.max_body_bytes
        )
        if i > start and not fits:
            close(i)
            start, size, values = i, len(head) + len(tail), 0
        size += len(part) + len(sep)
        values += n
    close(len(pairs))
    return batches


def _blocks(count: int, size: int) -> list[slice]:
    return [slice(at, min(at + size, count)) for at in range(0, count, size)]


def _limits_of(body: Any) -> ServerLimits:
    """``GET /v1/limits``'s body as limits: every known field of the right type and positive
    (a server's other fields are ignored)."""
    if not isinstance(body, dict):
        raise TypeError(f"not an object: {type(body).__name__}")
    out: dict[str, Any] = {}
    for f in fields(ServerLimits):
        if f.name not in body:
            continue
        value = body[f.name]
        if f.name == "role":
            if not isinstance(value, str):
                raise TypeError(f"role: {value!r} is not a string")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TypeError(f"{f.name}: {value!r} is not a positive integer")
        out[f.name] = value
    return ServerLimits(**out)


def _entry_ids(body: Any, count: int) -> list[str]:
    """A push's entry ids, one string per pair pushed."""
    ids = body["entry_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise TypeError("entry_ids: not a list of strings")
    if len(ids) != count:
        raise ValueError(f"{len(ids)} entry ids for a batch of {count} pairs")
    return ids


class Calls:
    """The calls of the HTTP API as generators (module docstring); the clients drive them.

    Parameters
    ----------
    retries
        Retry policy for the calls that may be sent again.
    """

    def __init__(self, retries: Retries) -> None:
        self.retries = retries
        self.server_limits: ServerLimits | None = None  # read on first need

    def _json(self, request: Request) -> Call[Any]:
        reply = yield from exchange(request, self.retries)
        with decoded(request.what, reply):
            return reply.json()

    def limits_call(self) -> Call[ServerLimits]:
        """``GET /v1/limits``, read once (a server without it: its defaults)."""
        if self.server_limits is None:
            request = Request("GET", "/v1/limits")
            try:
                reply = yield from exchange(request, self.retries)
            except NotFound:
                self.server_limits = ServerLimits()
            else:
                with decoded(request.what, reply):
                    self.server_limits = _limits_of(reply.json())
        return self.server_limits

    def push_call(self, items: Iterable[PairLike], binary: bool) -> Call[list[str]]:
        pairs = as_pairs(items)
        try:
            limits = yield from self.limits_call()
        except Unavailable as exc:
            exc.written = False  # only the limits were asked for: nothing was pushed
            raise
        ids: list[str] = []
        batches = push_batches(pairs, limits, binary)
        for n, (start, request) in enumerate(batches):
            count = (batches[n + 1][0] if n + 1 < len(batches) else len(pairs)) - start
            try:
                reply = yield from exchange(request, self.retries)
                with decoded(request.what, reply, writes=True):
                    got = _entry_ids(reply.json(), count)
            except StreamxmError as exc:
                if isinstance(exc, InvalidPair) and exc.index is not None:
                    exc.index += start  # the server counts within the batch
                    exc.path = ["pairs", exc.index, *exc.path[2:]]
                exc.accepted = ids
                if isinstance(exc, BadResponse) and exc.written:
                    exc.unconfirmed = count
                elif isinstance(exc, Unavailable) and exc.written is None:
                    exc.in_doubt = count
                raise
            ids.extend(got)
        return ids

    def search_call(
        self,
        vector: ArrayLike,
        modality: str,
        k: int,
        model: str | None,
        version: int | None,
        target: str | None,
    ) -> Call[SearchResult]:
        rows = _rows(vector, "vector")
        if rows.shape[0] != 1:
            raise InvalidRequest(f"vector: one query vector, got {rows.shape[0]} rows")
        body: dict[str, Any] = {"modality": modality, "vector": _b64(rows[0]), "k": k}
        body.update(
            {
                key: value
                for key, value in (("model", model), ("version", version), ("target", target))
                if value is not None
            }
        )
        request = Request(
            "POST",
            "/v1/search",
            json=body,
            max_answer_bytes=ANSWER_BYTES + max(0, int(k)) * HIT_BYTES,
        )
        reply = yield from exchange(request, self.retries)
        with decoded(request.what, reply):
            out = reply.json()
            hits = [Hit(str(h["id"]), float(h["score"])) for h in out["results"]]
            if len(hits) > k:
                raise ValueError(f"{len(hits)} hits for k={k}")
            return SearchResult(
                out["model"],
                out["version"],
                out["members"],
                out["target"],
                float(out["version_lag_s"]),
                out["index_version"],
                hits,
            )

    def similarity_call(
        self,
        images: ArrayLike,
        texts: ArrayLike,
        mode: str,
        model: str | None,
        version: int | None,
        direction: str,
    ) -> Call[SimilarityResult]:
        """Split into requests within the server's limits; every block after the first is
        pinned to the version that scored the first (an ensemble's members: checked equal)."""
        imgs, txts = _rows(images, "images"), _rows(texts, "texts")
        if mode == "paired" and len(imgs) != len(txts):
            raise InvalidRequest("paired mode needs as many texts as images")
        limits = yield from self.limits_call()
        size = max(
            1, min(limits.max_batch, limits.max_request_values // (imgs.shape[1] + txts.shape[1]))
        )
        scores = np.zeros((len(imgs), len(txts)) if mode == "matrix" else len(imgs))
        blocks = (
            [(i, j) for i in _blocks(len(imgs), size) for j in _blocks(len(txts), size)]
            if mode == "matrix"
            else [(i, i) for i in _blocks(len(imgs), size)]
        )
        first: dict[str, Any] | None = None
        pinned: int | None = None
        for i, j in blocks:
            body: dict[str, Any] = {
                "images": [_b64(v) for v in imgs[i]],
                "mode": mode,
                "texts": [_b64(v) for v in txts[j]],
                "direction": direction,
            }
            pin = version if first is None else pinned
            body.update(
                {
                    key: value
                    for key, value in (("model", model), ("version", pin))
                    if value is not None
                }
            )
            block = scores[(i, j) if mode == "matrix" else i]
            request = Request(
                "POST",
                "/v1/similarity",
                json=body,
                max_answer_bytes=ANSWER_BYTES + block.size * SCORE_BYTES,
            )
            reply = yield from exchange(request, self.retries)
            with decoded(request.what, reply):
                out = reply.json()
                got = np.asarray(out["scores"], dtype=np.float64)
                if got.shape != block.shape:
                    raise ValueError(f"scores of shape {got.shape} for a block of {block.shape}")
                first = first or out
                members, pinned = out["members"], first["version"]
            if members != first["members"]:
                raise Unavailable(
                    f"the ensemble's members changed version between blocks "
                    f"({first['members']} -> {members}); ask again"
                )
            scores[(i, j) if mode == "matrix" else i] = got
        assert first is not None
        with decoded("POST /v1/similarity", reply):
            return SimilarityResult(first["model"], first["version"], first["members"], scores)

    def models_call(self) -> Call[list[ModelInfo]]:
        request = Request("GET", "/v1/models", max_answer_bytes=MODELS_BYTES)
        reply = yield from exchange(request, self.retries)
        known = {f.name for f in fields(ModelInfo)}
        with decoded(request.what, reply):
            return [
                ModelInfo(**{k: v for k, v in m.items() if k in known})
                for m in reply.json()["models"]
            ]

    def learned_call(
        self, entry_id: str, model: str | None, timeout: float, interval: float
    ) -> Call[list[ModelInfo]]:
        """Poll ``/v1/models`` until the served version of ``model`` (None: of every model
        the API lists, at least one) has learned the stream up to ``entry_id``."""
        try:
            wanted = entry_order(entry_id)
        except ValueError:
            raise InvalidRequest(f"entry_id: {entry_id!r} is not a stream entry id") from None
        if not interval > 0:
            raise InvalidRequest(f"interval: {interval} is not a positive number of seconds")
        deadline = time.monotonic() + timeout  # the clock, not a count: polls take time too
        while True:
            infos = yield from self.models_call()
            chosen = [m for m in infos if model is None or m.name == model]
            with decoded("GET /v1/models", _NO_ANSWER):
                if chosen and all(
                    m.last_entry_id and entry_order(str(m.last_entry_id)) >= wanted for m in chosen
                ):
                    return infos
            if time.monotonic() + interval > deadline:
                break
            yield Sleep(interval)
        where = {m.name: m.last_entry_id for m in infos}
        raise Unavailable(
            f"after {timeout:g} s no served version of {model or 'every model'} "
            f"had learned entry {entry_id} (served up to: {where})"
        )

    def health_call(self) -> Call[bool]:
        """Liveness: answered at once, never retried; ``False`` when the API cannot be
        reached or does not say ``ok``."""
        try:
            out = yield from self._json(Request("GET", "/healthz", attempts=1))
        except Unavailable:
            return False
        return isinstance(out, dict) and out.get("status") == "ok"

    def ready_call(self) -> Call[Readiness]:
        """Readiness: ``/readyz``'s answer, 503 included; unreachable is not ready."""
        request = Request("GET", "/readyz", answers=frozenset({503}), attempts=1)
        try:
            reply = yield from exchange(request, self.retries)
        except Unavailable as exc:
            return Readiness(False, str(exc), [])
        with decoded(request.what, reply):
            out = reply.json()
            return Readiness(
                out["status"] in ("ready", "degraded"),
                str(out["status"]),
                [str(m) for m in out.get("models", [])],
            )
