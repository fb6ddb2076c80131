"""The search gallery as immutable segments: what the gallery indexer writes and API replicas
open, so that no replica replays the stream.

A segment is a checkpoint blob (:func:`~streamxm.storage.checkpoint.encode_blob`: arrays + JSON,
never a pickle, verified by SHA-256) of gallery rows: ids (UTF-8 bytes and end offsets), unit
rows and norms of both modalities (:class:`~streamxm.storage.rows.GalleryRows`). Segments are
stored like checkpoints (Redis or the checkpoint directory) under the name ``_gallery``.

The manifest (``sxm:{<ns>}:gallery``, a Redis hash written only in the indexer's lease-fenced
commit transaction) lists the live segments, oldest first, how many rows of the first are
retired (``skip``), the stream position the segments cover (``last_id``) and a ``revision``
that changes with every commit (readers poll it and reread the rest only when it changed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm.storage.checkpoint import Checkpoint, CheckpointStore, decode_blob, encode_blob
from streamxm.storage.rows import GalleryRows
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
    "open_segment",
    "read_manifest",
]

#: The name segments are stored under in the checkpoint store.
SEGMENTS = "_gallery"


@dataclass(frozen=True)
class SegmentRef:
    seq: int
    sha: str
    rows: int


@dataclass(frozen=True)
class Manifest:
    """The live segments (oldest first), rows retired from the first, the stream position
    covered and the revision."""

    segments: tuple[SegmentRef, ...] = ()
    skip: int = 0
    last_id: str = "0-0"
    revision: int = 0
    next_seq: int = 1

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments) - self.skip

    def live_rows(self, ref: SegmentRef) -> int:
        """The rows of ``ref`` the gallery holds (the first segment's retired ones are not)."""
        return ref.rows - (self.skip if self.segments and ref == self.segments[0] else 0)

    def fields(self) -> dict[str, str]:
        return {
            "segments": ",".join(f"{s.seq}:{s.sha}:{s.rows}" for s in self.segments),
            "skip": str(self.skip),
            "last_id": self.last_id,
            "revision": str(self.revision),
            "next_seq": str(self.next_seq),
        }

    @classmethod
    def parse(cls, raw: dict[str, str]) -> Manifest:
        refs = []
        for item in raw.get("segments", "").split(","):
            if item:
                seq, sha, rows = item.split(":")
                refs.append(SegmentRef(int(seq), sha, int(rows)))
        return cls(
            tuple(refs),
            int(raw.get("skip", 0)),
            raw.get("last_id", "0-0"),
            int(raw.get("revision", 0)),
            int(raw.get("next_seq", 1)),
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


def encode_segment(seq: int, chunk: GalleryRows, last_id: str) -> bytes:
    """One segment's blob."""
    encoded = [i.encode() for i in chunk.ids.tolist()]
    arrays: dict[str, NDArray[Any]] = {
        "ids_utf8": np.frombuffer(b"".join(encoded), dtype=np.uint8),
        "ids_end": np.cumsum([len(b) for b in encoded], dtype=np.int64),
        "unit_img": chunk.unit_img,
        "unit_txt": chunk.unit_txt,
        "norm_img": chunk.norm_img,
        "norm_txt": chunk.norm_txt,
    }
    return encode_blob(Checkpoint(seq, arrays, {"rows": len(chunk)}, last_id=last_id))


def decode_segment(blob: bytes) -> GalleryRows:
    """The rows of a segment blob (checked: every array has one row per id)."""
    a = decode_blob(blob).arrays
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
    blob = store.read_blob(SEGMENTS, ref.seq, ref.sha)
    if blob is None:
        return None
    try:
        chunk = decode_segment(blob)
    except (ValueError, KeyError, UnicodeDecodeError):
        return None
    return chunk if len(chunk) == ref.rows else None


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
