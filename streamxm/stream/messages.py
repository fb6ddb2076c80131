"""Pair message, version 1 (``docs/design.md``): encoding, decoding and validation.

One validator serves every entry point: the Python client and ``POST /v1/pairs`` reject a bad
pair before it reaches the stream, and the worker dead-letters whatever reaches it anyway, with
the same field name and reason.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "FRAMES_MEDIA_TYPE",
    "MESSAGE_VERSION",
    "REASONS",
    "WRITTEN_HEADER",
    "InvalidPair",
    "Limits",
    "Pair",
    "decode_frames",
    "decode_pair",
    "encode_frame",
    "encode_frames",
    "encode_pair",
    "field_name",
    "make_pair",
]

MESSAGE_VERSION = b"1"
REQUIRED_FIELDS = (b"v", b"id", b"img", b"txt")
KNOWN_FIELDS = (*REQUIRED_FIELDS, b"labels", b"ts")


#: Every reason a pair is refused or dead-lettered for: the ``reason`` label of
#: ``streamxm_dead_letters_total``, exported at 0 for each model from the start so an alert on
#: its increase fires on the first one.
REASONS = (
    "bad_frame",
    "bad_id",
    "bad_labels",
    "bad_length",
    "bad_shape",
    "bad_ts",
    "bad_version",
    "dim_mismatch",
    "duplicate_field",
    "empty",
    "learn_error",
    "missing_field",
    "non_finite",
    "not_numeric",
    "too_large",
    "too_many_pairs",
    "unknown_field",
)


class InvalidPair(ValueError):
    """A pair that breaks message v1. ``reason`` is a short code used as a metric label, one
    of :data:`REASONS`."""

    def __init__(self, field: str, reason: str, detail: str, index: int | None = None) -> None:
        if reason not in REASONS:  # a new code must be exported (at 0) like the others
            raise AssertionError(f"unregistered dead-letter reason {reason!r}")
        where = field if index is None else f"pairs[{index}].{field}"
        super().__init__(f"{where}: {detail}")
        self.field = field
        self.reason = reason
        self.detail = detail
        self.index = index  # position in a batch, when the pair came in one


@dataclass(frozen=True)
class Limits:
    """Input bounds shared by the client, the API and the worker."""

    max_dim: int = 65_536
    max_labels: int = 64
    max_label_value: int = 1_000_000
    max_id_length: int = 256

    def field_bytes(self, name: bytes) -> int | None:
        """The most bytes a parsed message v1 field may hold, checked before it is parsed, so
        a huge value costs a length comparison, not a parse (UTF-8 ids up to 4 bytes a
        character, labels up to 18 digits and a comma each, as the decoder's pattern admits).
        ``None`` for the vectors, which are never parsed: their length is checked against the
        namespace's dimension (``dim_mismatch``) or :attr:`max_dim` (``too_large``) before
        they are viewed."""
        return {
            b"v": 8,
            b"id": 4 * self.max_id_length,
            b"labels": 19 * self.max_labels,
            b"ts": 64,
        }.get(name)


@dataclass(frozen=True)
class Pair:
    """One validated image-text pair. ``labels`` is empty for an unlabelled pair."""

    id: str
    img: NDArray[np.float32]
    txt: NDArray[np.float32]
    labels: tuple[int, ...] = ()
    ts: float | None = None


def _vector(name: str, value: ArrayLike, limits: Limits) -> NDArray[np.float32]:
    if isinstance(value, np.ndarray) and value.dtype == np.float32:
        arr = value  # decoded frames and the client's own arrays: nothing to convert
    else:
        try:
            with np.errstate(over="ignore"):  # overflow to Inf is reported just below
                arr = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise InvalidPair(name, "not_numeric", f"not a numeric vector ({exc})") from None
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidPair(
            name, "bad_shape", f"must be a non-empty 1-d vector, got shape {arr.shape}"
        )
    if arr.size > limits.max_dim:
        raise InvalidPair(name, "too_large", f"{arr.size} values exceed the limit {limits.max_dim}")
    if not np.isfinite(arr).all():
        raise InvalidPair(name, "non_finite", "contains NaN or Inf (after float32 conversion)")
    return arr


def _labels(value: Iterable[object] | None, limits: Limits) -> tuple[int, ...]:
    if value is None:
        return ()
    out: list[int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | np.integer):
            raise InvalidPair("labels", "bad_labels", f"label {item!r} is not an integer")
        if not 0 <= int(item) <= limits.max_label_value:
            raise InvalidPair(
                "labels", "bad_labels", f"label {item} outside 0..{limits.max_label_value}"
            )
        out.append(int(item))
    if len(out) > limits.max_labels:
        raise InvalidPair("labels", "bad_labels", f"{len(out)} labels exceed {limits.max_labels}")
    return tuple(sorted(set(out)))


def _pair_id(value: object, limits: Limits) -> str:
    """The id contract (docs/design.md): 1 to ``max_id_length`` printable characters. Control
    characters (NUL, CR/LF, ESC, TAB, ...) are refused, so an id can neither cut a log line nor
    carry terminal escapes; any other Unicode is the producer's, glob characters included
    (nothing matches patterns against ids). Ids are not keys: a reused id is another pair."""
    if not isinstance(value, str) or not value:
        raise InvalidPair("id", "bad_id", "must be a non-empty string")
    if len(value) > limits.max_id_length:
        raise InvalidPair("id", "bad_id", f"longer than {limits.max_id_length} characters")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise InvalidPair(
            "id",
            "bad_id",
            f"holds the control character {bad!r}: ids are printable characters only",
        )
    return value


def make_pair(
    id: str,
    img: ArrayLike,
    txt: ArrayLike,
    labels: Sequence[int] | None = None,
    ts: float | None = None,
    limits: Limits = Limits(),
) -> Pair:
    """Validate Python values into a :class:`Pair` or raise :class:`InvalidPair`.

    Examples
    --------
    >>> make_pair("p1", [0.5, 0.5], [1.0], labels=[3]).labels
    (3,)
    >>> make_pair("p1", [float("nan")], [1.0])
    Traceback (most recent call last):
    ...
    streamxm.stream.messages.InvalidPair: img: contains NaN or Inf (after float32 conversion)
    """
    if ts is not None and (not isinstance(ts, int | float) or not math.isfinite(ts)):
        raise InvalidPair("ts", "bad_ts", "must be a finite number of unix seconds")
    return Pair(
        id=_pair_id(id, limits),
        img=_vector("img", img, limits),
        txt=_vector("txt", txt, limits),
        labels=_labels(labels, limits),
        ts=None if ts is None else float(ts),
    )


def encode_pair(pair: Pair) -> dict[bytes, bytes]:
    """Stream fields of message v1 for a validated pair."""
    fields = {
        b"v": MESSAGE_VERSION,
        b"id": pair.id.encode(),
        b"img": pair.img.astype("<f4", copy=False).tobytes(),
        b"txt": pair.txt.astype("<f4", copy=False).tobytes(),
    }
    if pair.labels:
        fields[b"labels"] = ",".join(map(str, pair.labels)).encode()
    if pair.ts is not None:
        fields[b"ts"] = repr(pair.ts).encode()
    return fields


def _decode_vector(
    name: str, raw: bytes, dim: int | None, limits: Limits, copy: bool = True
) -> NDArray[np.float32]:
    if len(raw) % 4:
        raise InvalidPair(name, "bad_length", f"{len(raw)} bytes is not a whole number of float32")
    n = len(raw) // 4
    if dim is not None and n != dim:
        raise InvalidPair(name, "dim_mismatch", f"{n} values, the namespace expects {dim}")
    if n > limits.max_dim:
        raise InvalidPair(name, "too_large", f"{n} values exceed the limit {limits.max_dim}")
    # Checked once, by make_pair, like a vector from any other door.
    return np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=copy)


def field_name(raw: bytes | str, limit: int = 64) -> str:
    r"""A field name fit for a log line or a metric label, whatever bytes it came as: invalid
    UTF-8 and every non-printable character escaped (a newline must not forge a log line),
    long names cut.

    >>> field_name(b"label\nFORGED \xff")
    'label\\nFORGED \\xff'
    """
    name = raw if isinstance(raw, str) else raw.decode("utf-8", errors="backslashreplace")
    name = name[: limit + 1]
    name = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name
    )
    return name if len(name) <= limit else name[:limit] + "..."


# Message v1's number fields, exactly as encode_pair writes them: no spaces, signs on labels,
# underscores or other spellings Python's int() and float() would also accept.
_LABELS = re.compile(rb"[0-9]{1,18}(?:,[0-9]{1,18})*")
_TS = re.compile(rb"-?[0-9]{1,20}(?:\.[0-9]{1,20})?(?:e[-+]?[0-9]{1,3})?")


def decode_pair(
    fields: Mapping[bytes, bytes],
    img_dim: int | None = None,
    txt_dim: int | None = None,
    limits: Limits = Limits(),
    copy: bool = True,
) -> Pair:
    """Decode and validate raw stream fields; raise :class:`InvalidPair` with the reason.
    Without ``copy`` the pair's vectors are read-only views of ``fields``' bytes.

    Message v1 is closed: a field it does not define is refused (``unknown_field``) rather than
    ignored, since a misspelt optional field (``label`` for ``labels``) would otherwise turn a
    labelled pair into an unlabelled one without a word. New fields come with a new ``v``.
    """
    for name in REQUIRED_FIELDS:
        if name not in fields:
            raise InvalidPair(name.decode(), "missing_field", "required field is missing")
    if fields[b"v"] != MESSAGE_VERSION:
        raise InvalidPair("v", "bad_version", f"unsupported message version {fields[b'v'][:32]!r}")
    for name, value in fields.items():
        if name not in KNOWN_FIELDS:
            raise InvalidPair(
                field_name(name),
                "unknown_field",
                "not a field of message v1 (v, id, img, txt, labels, ts)",
            )
        bound = limits.field_bytes(name)
        if bound is not None and len(value) > bound:
            raise InvalidPair(
                name.decode(),
                "too_large",
                f"{len(value)} bytes exceed the field's limit of {bound}",
            )
    try:
        pair_id = fields[b"id"].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidPair("id", "bad_id", "not valid UTF-8") from None
    labels: list[int] | None = None
    raw_labels = fields.get(b"labels", b"")
    if raw_labels:
        if not _LABELS.fullmatch(raw_labels):
            raise InvalidPair("labels", "bad_labels", "not comma-separated decimal integers")
        if raw_labels.count(b",") >= limits.max_labels:
            raise InvalidPair(
                "labels",
                "bad_labels",
                f"{raw_labels.count(b',') + 1} labels exceed {limits.max_labels}",
            )
        labels = [int(x) for x in raw_labels.split(b",")]
    ts: float | None = None
    if fields.get(b"ts"):
        if not _TS.fullmatch(fields[b"ts"]):
            raise InvalidPair("ts", "bad_ts", "not a decimal number")
        ts = float(fields[b"ts"])
    return make_pair(
        pair_id,
        _decode_vector("img", fields[b"img"], img_dim, limits, copy),
        _decode_vector("txt", fields[b"txt"], txt_dim, limits, copy),
        labels=labels,
        ts=ts,
        limits=limits,
    )


# -- frames: a batch of messages in one binary body ------------------------------------------
#: Media type of a body of message v1 frames (``POST /v1/pairs/frames``).
FRAMES_MEDIA_TYPE = "application/x-streamxm-frames"
#: Header of a push's 503: ``none`` when the API knows no pair of the request reached the
#: stream (the store was unreachable before anything was sent), so pushing again cannot add
#: a pair twice; ``unknown`` otherwise.
WRITTEN_HEADER = "streamxm-written"
_FRAME_FIELDS_MAX = 16  # v1 has 6 fields; a few more reach decode_pair, which names them
_U16, _U32 = struct.Struct("<H").unpack_from, struct.Struct("<I").unpack_from


def encode_frames(pairs: Iterable[Pair]) -> bytes:
    """Pairs as one body of message v1 frames: per pair a ``uint16`` field count, then per
    field a ``uint8`` name length, the name, a ``uint32`` value length and the value, exactly
    the bytes the stream entry will hold (little-endian throughout).

    >>> body = encode_frames([make_pair("p1", [0.5, 0.25], [1.0], labels=[3])])
    >>> [decode_pair(f).labels for f in decode_frames(body, max_pairs=10)]
    [(3,)]
    """
    return b"".join(encode_frame(encode_pair(pair)) for pair in pairs)


def encode_frame(fields: Mapping[bytes, bytes]) -> bytes:
    """One frame of :func:`encode_frames` holding ``fields`` as they are (not validated: what
    a producer that builds its own frames would send)."""
    out = bytearray(len(fields).to_bytes(2, "little"))
    for name, value in fields.items():
        out += len(name).to_bytes(1, "little") + name
        out += len(value).to_bytes(4, "little") + value
    return bytes(out)


def decode_frames(body: bytes, max_pairs: int) -> list[dict[bytes, bytes]]:
    """Split a body of :func:`encode_frames` frames into stream fields (each then validated by
    :func:`decode_pair`); a body that is not whole frames, or holds more than ``max_pairs``,
    raises :class:`InvalidPair` on field ``body`` with the frame's index and byte offset.

    >>> decode_frames(b"\\x01\\x00\\x01v\\x09\\x00\\x00\\x001", max_pairs=10)
    Traceback (most recent call last):
    ...
    streamxm.stream.messages.InvalidPair: pairs[0].body: frame 0 at byte 4: value of 9 bytes runs \
past the end of the body
    """
    frames: list[dict[bytes, bytes]] = []
    end, at = len(body), 0

    def short(what: str) -> InvalidPair:
        return InvalidPair(
            "body",
            "bad_frame",
            f"frame {len(frames)} at byte {at}: {what} runs past the end of the body",
            len(frames),
        )

    # Plain slices of ``body`` and inline bounds checks: this loop runs per field of every
    # pair posted, and helper calls and memoryview copies were a third of its time.
    while at < end:
        if len(frames) == max_pairs:
            raise InvalidPair(
                "body",
                "too_many_pairs",
                f"more than {max_pairs} frames (STREAMXM_MAX_BATCH)",
                len(frames),
            )
        if at + 2 > end:
            raise short("the field count")
        (count,) = _U16(body, at)
        at += 2
        if not 0 < count <= _FRAME_FIELDS_MAX:
            raise InvalidPair(
                "body",
                "bad_frame",
                f"frame {len(frames)}: {count} fields (1 to {_FRAME_FIELDS_MAX})",
                len(frames),
            )
        fields: dict[bytes, bytes] = {}
        for _ in range(count):
            if at + 1 > end:
                raise short("a field name's length")
            size = body[at]
            if at + 1 + size > end:
                raise short(f"a field name of {size} bytes")
            name = body[at + 1 : at + 1 + size]
            at += 1 + size
            if at + 4 > end:
                raise short("a value's length")
            (size,) = _U32(body, at)
            if at + 4 + size > end:
                raise short(f"value of {size} bytes")
            if name in fields:
                raise InvalidPair(
                    field_name(name),
                    "duplicate_field",
                    "the field appears twice in one frame",
                    len(frames),
                )
            fields[name] = body[at + 4 : at + 4 + size]
            at += 4 + size
        frames.append(fields)
    if not frames:
        raise InvalidPair("body", "empty", "no frames in the body")
    return frames
