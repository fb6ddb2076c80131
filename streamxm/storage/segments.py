"""The search gallery as immutable segments: what the gallery indexer writes and API replicas
open, so that no replica replays the stream.

A segment is a checkpoint blob (:func:`~streamxm.storage.checkpoint.encode_blob`: arrays + JSON,
never a pickle, verified by SHA-256) of gallery rows: ids (UTF-8 bytes and end offsets), unit
rows and norms of both modalities (:class:`~streamxm.storage.rows.GalleryRows`). Segments are
stored like checkpoints (Redis or the checkpoint directory) under the name ``_gallery``.

Each segment holds the rows of one part of the item space (by a hash of the item id:
:class:`~streamxm.storage.slots.ShardPart`; ``STREAMXM_GALLERY_PARTS`` parts, 1 by default), so
that a gallery shard reads the segments of its own part and no other. Every row indexed takes
the next *row number* (stream order), stored with it.

The manifest (``sxm:{<ns>}:gallery``, a Redis hash written only in the indexer's lease-fenced
commit transaction) lists the live segments in the order they were written, how many of each
one's oldest rows are retired (``skip``: the rows numbered below ``retired_below``), the stream
position the segments cover (``last_id``) and a ``revision`` that changes with every commit
(readers poll it and reread the rest only when it changed).
"""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm.storage.checkpoint import Checkpoint, CheckpointStore, decode_blob, encode_blob
from streamxm.storage.rows import GalleryRows
from streamxm.storage.slots import ShardPart
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import str_hash, text

log = logging.getLogger(__name__)

__all__ = [
    "SEGMENTS",
    "CorruptSegments",
    "Manifest",
    "SegmentRef",
    "decode_segment",
    "encode_segment",
    "open_numbered_segment",
    "open_segment",
    "read_manifest",
]

#: The name segments are stored under in the checkpoint store.
SEGMENTS = "_gallery"


@dataclass(frozen=True)
class SegmentRef:
    """One stored segment as the manifest lists it.

    ``part`` of ``parts``: the part of the item space its rows belong to
    (:class:`~streamxm.storage.slots.ShardPart`; ``0`` of ``1``: every item). ``first_row`` and
    ``end_row``: the gallery row numbers (given in stream order, one per row ever indexed) of
    its first row and one past its last; a segment of one part of several holds every
    ``parts``-th row or so of that range. ``skip``: its oldest rows that are retired.
    """

    seq: int
    sha: str
    rows: int
    skip: int = 0
    part: int = 0
    parts: int = 1
    first_row: int = 0
    end_row: int = 0

    @property
    def live_rows(self) -> int:
        """The rows of the segment the gallery holds."""
        return self.rows - self.skip

    @property
    def slots(self) -> ShardPart:
        """The part of the item space its rows belong to."""
        return ShardPart(self.part, self.parts)

    @property
    def contiguous(self) -> bool:
        """Whether its rows are numbered ``first_row, first_row + 1, ...`` (no gap)."""
        return self.end_row - self.first_row == self.rows

    def field(self) -> str:
        """The manifest's entry: the fields in order, ``:``-separated."""
        return ":".join(str(v) for v in astuple(self))


@dataclass(frozen=True)
class Manifest:
    """The live segments (in the order they were written), the stream position covered, the
    revision, and the row numbers: rows numbered below ``retired_below`` are retired, the next
    row indexed takes ``next_row``.

    Manifests written before segments had parts list ``seq:sha:rows`` and one ``skip`` for the
    first segment; they parse as one part whose rows are numbered from 0 in order.
    """

    segments: tuple[SegmentRef, ...] = ()
    last_id: str = "0-0"
    revision: int = 0
    next_seq: int = 1
    retired_below: int = 0
    next_row: int = 0

    @property
    def rows(self) -> int:
        return sum(s.live_rows for s in self.segments)

    def fields(self) -> dict[str, str]:
        return {
            "segments": ",".join(s.field() for s in self.segments),
            "last_id": self.last_id,
            "revision": str(self.revision),
            "next_seq": str(self.next_seq),
            "retired_below": str(self.retired_below),
            "next_row": str(self.next_row),
        }

    @classmethod
    def parse(cls, raw: dict[str, str]) -> Manifest:
        refs: list[SegmentRef] = []
        first_skip, row = int(raw.get("skip", 0)), 0
        for item in raw.get("segments", "").split(","):
            if not item:
                continue
            seq, sha, rows, *rest = item.split(":")
            if rest:  # seq:sha:rows:skip:part:parts:first_row:end_row
                refs.append(SegmentRef(int(seq), sha, int(rows), *(int(v) for v in rest)))
            else:  # the layout before parts: one part, rows numbered in order
                skip = first_skip if not refs else 0
                refs.append(SegmentRef(int(seq), sha, int(rows), skip, 0, 1, row, row + int(rows)))
                row += int(rows)
        return cls(
            tuple(refs),
            raw.get("last_id", "0-0"),
            int(raw.get("revision", 0)),
            int(raw.get("next_seq", 1)),
            int(raw.get("retired_below", first_skip)),
            int(raw.get("next_row", row)),
        )


def read_manifest(r: redis.Redis, keys: Keys, if_not: int | None = None) -> Manifest | None:
    """The namespace's manifest; ``None`` when no indexer ever committed, or when its revision
    is still ``if_not`` (a cheap poll)."""
    if if_not is not None:
        revision = r.hget(keys.gallery, "revision")
        if revision is None or int(text(revision)) == if_not:
            return None
    raw = str_hash(r.hgetall(keys.gallery))
    return Manifest.parse(raw) if raw else None


def encode_segment(
    seq: int, chunk: GalleryRows, last_id: str, row_numbers: NDArray[np.int64]
) -> bytes:
    """One segment's blob: its rows and their gallery row numbers."""
    encoded = [i.encode() for i in chunk.ids.tolist()]
    arrays: dict[str, NDArray[Any]] = {
        "ids_utf8": np.frombuffer(b"".join(encoded), dtype=np.uint8),
        "ids_end": np.cumsum([len(b) for b in encoded], dtype=np.int64),
        "unit_img": chunk.unit_img,
        "unit_txt": chunk.unit_txt,
        "norm_img": chunk.norm_img,
        "norm_txt": chunk.norm_txt,
        "row_numbers": np.asarray(row_numbers, dtype=np.int64),
    }
    return encode_blob(Checkpoint(seq, arrays, {"rows": len(chunk)}, last_id=last_id))


def decode_segment(blob: bytes) -> GalleryRows:
    """The rows of a segment blob (checked: every array has one row per id)."""
    return _segment_rows(decode_blob(blob).arrays)


def _segment_rows(a: dict[str, NDArray[Any]]) -> GalleryRows:
    raw = bytes(a["ids_utf8"])
    ends = a["ids_end"].tolist()
    ids = [raw[s:e].decode() for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    chunk = GalleryRows(
        np.asarray(ids, dtype=np.str_), a["unit_img"], a["unit_txt"], a["norm_img"], a["norm_txt"]
    )
    if not all(
        len(getattr(chunk, f)) == len(ids) for f in ("unit_img", "unit_txt", "norm_img", "norm_txt")
    ):
        raise ValueError("segment arrays disagree on their number of rows")
    return chunk


def open_segment(store: CheckpointStore, ref: SegmentRef) -> GalleryRows | None:
    """The rows of a stored segment; ``None`` when its file is missing, fails its checksum or
    does not parse (nothing in it was unpickled, so nothing else can go wrong)."""
    opened = open_numbered_segment(store, ref)
    return None if opened is None else opened[0]


def open_numbered_segment(
    store: CheckpointStore, ref: SegmentRef
) -> tuple[GalleryRows, NDArray[np.int64]] | None:
    """The rows of a stored segment and their row numbers (a segment written before rows
    were numbered: ``ref``'s contiguous range); ``None`` as for :func:`open_segment`."""
    blob = store.read_blob(SEGMENTS, ref.seq, ref.sha)
    if blob is None:
        return None
    try:
        arrays = decode_blob(blob).arrays
        chunk = _segment_rows(arrays)
    except (ValueError, KeyError, UnicodeDecodeError):
        return None
    numbers = arrays.get("row_numbers")
    if numbers is None:
        numbers = np.arange(ref.first_row, ref.first_row + ref.rows, dtype=np.int64)
    if len(chunk) != ref.rows or len(numbers) != ref.rows:
        return None
    return chunk, np.asarray(numbers, dtype=np.int64)


#: HSETNX the record (KEYS[1]) only while the manifest (KEYS[2]) lists the segment (ARGV[1]:
#: ``<seq>:<sha>``, listed as ``<seq>:<sha>:<rows>``): 1 recorded, 0 recorded before, -1 not listed.
RECORD_IF_LISTED = """
local listed = redis.call('HGET', KEYS[2], 'segments')
if not listed or not string.find(',' .. listed .. ',', ',' .. ARGV[1] .. ':', 1, true) then
  return -1
end
return redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
"""


class CorruptSegments:
    """The namespace's record of corrupt gallery segments (``sxm:{<ns>}:gallery:corrupt``):
    each one found, once, with the rows the gallery lost with it.

    A reader that finds one (the indexer merging it, an API opening it) records it and goes on
    without its rows; the indexer's next commit drops it from the manifest, so the rest of the
    gallery, the stream after it and retention keep moving. The record stays (the loss is
    permanent) until an operator clears the key after recovering the rows.

    A segment missing because a newer manifest merged or retired it (and deleted it) is not
    corrupt, so no record is written for a segment the current manifest does not list: the
    indexer records inside its commit transaction, fenced by the gallery lease (:meth:`add`),
    so a stale indexer whose successor merged the segment records nothing; a reader without
    the lease records only while the manifest lists the segment, checked in the same script
    (:meth:`record`).
    """

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.r, self.key, self.manifest_key = client, keys.gallery_corrupt, keys.gallery
        self._record = client.register_script(RECORD_IF_LISTED)

    @staticmethod
    def field(ref: SegmentRef) -> str:
        return f"{ref.seq}:{ref.sha}"

    def record(self, ref: SegmentRef, rows_lost: int) -> bool:
        """Record ``ref`` if the manifest still lists it (by a reader that does not hold the
        gallery lease). Whether it is quarantined: False when a newer manifest left it out (a
        missing segment is then merged away, not lost)."""
        done = int(
            self._record(keys=[self.key, self.manifest_key], args=[self.field(ref), rows_lost])
        )
        if done == 1:
            self.report(ref, rows_lost)
        return done >= 0

    def add(self, pipe: redis.client.Pipeline, ref: SegmentRef, rows_lost: int) -> None:
        """Record ``ref`` in the indexer's commit transaction: written only if its lease
        still holds at ``EXEC`` (call :meth:`report` once the commit went through)."""
        pipe.hsetnx(self.key, self.field(ref), rows_lost)

    @staticmethod
    def report(ref: SegmentRef, rows_lost: int) -> None:
        log.error(
            "gallery segment %d (sha %s) is missing or corrupt: quarantined, its %d "
            "rows are lost to search",
            ref.seq,
            ref.sha[:16],
            rows_lost,
        )

    def read(self) -> dict[str, int]:
        """Every corrupt segment recorded (``<seq>:<sha>``) and the rows lost with it."""
        return {text(k): int(text(v)) for k, v in self.r.hgetall(self.key).items()}
