"""The gallery indexer: reads the pairs stream and appends its rows to immutable segments, once.

One indexer per namespace is active at a time (a lease, like a model's learner; more are hot
standbys). It reads the stream after the manifest's position, buffers the rows and every
``flush_seconds`` (or ``segment_rows`` rows) commits: the new segment is written durably, then
one lease-fenced transaction moves the manifest to it and its stream position. A killed indexer
loses only its buffer; its successor reads again from the manifest's position, so every entry
lands in exactly one live segment. Segments merge tier by tier as they are written (the newest
few while they are small, up to ``max_segment_rows``), and the oldest rows retire once the
gallery passes ``max_items``. Entries that do not decode are skipped (the learners dead-letter
them). A segment found corrupt (by this indexer merging it, or by an API opening it) is
quarantined: recorded with the rows lost (:class:`~streamxm.storage.segments.CorruptSegments`)
and dropped from the manifest at the next commit, so one bad file costs its own rows and
nothing else. The indexer records one in its lease-fenced commit transaction, so an indexer
that lost its lease while merging (its successor may have merged and deleted the segment
meanwhile) records nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import replace

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm import defaults as D
from streamxm.storage.checkpoint import CheckpointStore, LeaseLost, blob_sha
from streamxm.storage.rows import CHUNK_MAX, GalleryRows, merge_count
from streamxm.storage.segments import (
    SEGMENTS,
    CorruptSegments,
    Manifest,
    SegmentRef,
    encode_segment,
    open_numbered_segment,
    read_manifest,
)
from streamxm.storage.slots import parts_of
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits
from streamxm.stream.migrate import require_migrated
from streamxm.stream.producer import decode_entries
from streamxm.stream.redis_conn import UNAVAILABLE, NotReplicated, stream_entries
from streamxm.worker.lease import Lease
from streamxm.worker.leased import LeasedConsumer

__all__ = ["GalleryIndexer"]

log = logging.getLogger(__name__)

# What makes the indexer drop its buffer and start over from the committed segments.
_STARTS_OVER: tuple[type[Exception], ...] = (
    *UNAVAILABLE,
    LeaseLost,
    NotReplicated,
    redis.WatchError,
)


class GalleryIndexer(LeasedConsumer):
    """Keep the namespace's gallery segments current with its stream: a leased consumer
    (:class:`~streamxm.worker.leased.LeasedConsumer`) whose work is :meth:`step`.

    Parameters
    ----------
    client, store
        Redis client and the checkpoint store the segments live in.
    namespace
        Stream namespace.
    max_items
        Gallery cap (``STREAMXM_GALLERY_MAX``): older rows retire.
    flush_seconds, segment_rows
        Commit the buffered rows after this long or this many rows.
    max_segment_rows
        Largest segment the tier merge makes.
    parts
        Parts of the item space (``STREAMXM_GALLERY_PARTS``) the segments are cut along: a
        commit writes one segment per part that has rows, and merges it only with segments of
        the same part, so a gallery shard whose part is a run of them reads its own segments
        and no other's. Segments of another count (written before it changed) keep their rows
        until they retire. 1: every segment holds every part.
    """

    recoverable = _STARTS_OVER

    def __init__(
        self,
        client: redis.Redis,
        store: CheckpointStore,
        namespace: str = "default",
        consumer: str | None = None,
        max_items: int = D.GALLERY_MAX,
        flush_seconds: float = D.INDEXER_FLUSH_SECONDS,
        segment_rows: int = D.INDEXER_SEGMENT_ROWS,
        max_segment_rows: int = CHUNK_MAX,
        read_batch: int = D.INDEXER_READ_BATCH,
        block_ms: int = D.BLOCK_MS,
        lease_ttl_ms: int = D.LEASE_TTL_MS,
        limits: Limits = Limits(),
        parts: int = D.GALLERY_PARTS,
    ) -> None:
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        self.r = client
        self.store = store
        self.keys = Keys(namespace)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.max_items = max_items
        self.flush_seconds = flush_seconds
        self.segment_rows = segment_rows
        self.max_segment_rows = max_segment_rows
        self.parts = parts
        self.read_batch = read_batch
        self.block_ms = block_ms
        self.limits = limits
        self.lease = Lease(client, self.keys.lease(SEGMENTS), self.consumer, lease_ttl_ms)
        self.corrupt = CorruptSegments(client, self.keys)
        self.leader = False
        self.manifest = Manifest()
        self.position = "0-0"
        self.skipped = 0
        self._buffer: list[tuple[str, np.ndarray, np.ndarray]] = []
        self._since = time.monotonic()
        # Row numbers of segments whose rows are not numbered contiguously (a part's), as
        # written or read: the cap retires by them.
        self._numbers: dict[tuple[int, str], NDArray[np.int64]] = {}

    # -- the leased consumer's steps (streamxm/worker/leased.py) --------------------------
    def hold_lease(self) -> bool:
        """Extend the gallery lease, or take it (and read the manifest); a lease lost drops
        the buffer, which the successor reads again from the manifest's position."""
        if self.leader:
            if self.lease.extend():
                return True
            log.warning("indexer %s lost the gallery lease", self.consumer)
            self.leader, self._buffer = False, []
            return False  # the loop looks at its stop before asking again
        if not self.lease.acquire():
            return False
        self._load()
        self.leader = True  # only once loaded: finish() never commits a previous lead's state
        return True

    def work(self) -> bool:
        """One :meth:`step`; idle when it read nothing."""
        return self.step() == 0

    def recover(self, stop: threading.Event, exc: Exception) -> None:
        """Drop the buffer and start over from the committed segments."""
        log.warning("indexer %s: %s; buffer dropped, starting over", self.consumer, exc)
        self.leader, self._buffer = False, []
        stop.wait(0.5)

    def _load(self) -> None:
        require_migrated(self.r, self.keys)  # data under the old key names: refuse, say how
        self.manifest = read_manifest(self.r, self.keys) or Manifest()
        self.position = self.manifest.last_id
        self._buffer, self._since, self._numbers = [], time.monotonic(), {}
        log.info(
            "indexer %s leads the gallery of %s from %s (%d rows)",
            self.consumer,
            self.keys.namespace,
            self.position,
            self.manifest.rows,
        )

    def step(self) -> int:
        """Read one batch after the position; commit when the buffer is due. Entries read."""
        reply = self.r.xread(
            {self.keys.pairs: self.position}, count=self.read_batch, block=self.block_ms
        )
        entries = stream_entries(reply)
        if entries:
            pairs, skipped = decode_entries(self.r, self.keys, entries, self.limits)
            self.skipped += skipped
            self._buffer.extend((pair.id, pair.img, pair.txt) for _, pair in pairs)
            self.position = entries[-1][0]
        due = time.monotonic() - self._since >= self.flush_seconds
        if len(self._buffer) >= self.segment_rows or (
            due and self.position != self.manifest.last_id
        ):
            self.commit()
        return len(entries)

    def commit(self) -> None:
        """Write the buffered rows as one segment per part of the item space (each merged with
        its part's small newest ones), retire the rows numbered past the cap and move the
        manifest to them and to the stream position, in one lease-fenced transaction."""
        self._since = time.monotonic()
        old = self.manifest
        if self.position == old.last_id:
            return
        segments, dropped = self._quarantined(old)
        found: list[tuple[SegmentRef, int]] = []  # corrupt segments met reading, rows lost
        blobs: list[tuple[int, str, bytes]] = []
        next_row = old.next_row
        if self._buffer:
            ids, imgs, txts = zip(*self._buffer, strict=True)
            rows = GalleryRows.of(np.asarray(ids), np.vstack(imgs), np.vstack(txts))
            numbers = np.arange(next_row, next_row + len(rows), dtype=np.int64)
            next_row += len(rows)
            owners = parts_of(rows.ids, self.parts) if self.parts > 1 else None
            for part in range(self.parts):
                at = np.flatnonzero(owners == part) if owners is not None else None
                if at is not None and not len(at):
                    continue
                chunk = rows if at is None else rows.taken(at)
                mine = numbers if at is None else numbers[at]
                seq = old.next_seq + len(blobs)
                segments, blob = self._appended(segments, part, chunk, mine, seq, dropped, found)
                blobs.append((seq, blob_sha(blob), blob))
        retired = max(old.retired_below, next_row - self.max_items)
        segments = self._retired(segments, retired, dropped, found)
        manifest = Manifest(
            tuple(segments),
            self.position,
            old.revision + 1,
            old.next_seq + len(blobs),
            retired,
            next_row,
        )

        def move(pipe: redis.client.Pipeline) -> None:
            pipe.delete(self.keys.gallery)
            pipe.hset(self.keys.gallery, mapping=manifest.fields())  # type: ignore[arg-type]
            for ref, rows_lost in found:  # fenced with the manifest: only while we lead
                self.corrupt.add(pipe, ref, rows_lost)

        self.store.commit_blobs(
            SEGMENTS,
            blobs,
            [(s.seq, s.sha) for s in segments],
            [(s.seq, s.sha) for s in dropped],
            move,
            (self.lease.key, self.consumer),
        )
        for ref, rows_lost in found:
            CorruptSegments.report(ref, rows_lost)
        self.manifest, self._buffer = manifest, []
        live = {(s.seq, s.sha) for s in segments}
        self._numbers = {key: n for key, n in self._numbers.items() if key in live}
        log.debug(
            "gallery %s: revision %d, %d rows in %d segments, at %s",
            self.keys.namespace,
            manifest.revision,
            manifest.rows,
            len(segments),
            self.position,
        )

    def _appended(
        self,
        segments: list[SegmentRef],
        part: int,
        chunk: GalleryRows,
        numbers: NDArray[np.int64],
        seq: int,
        dropped: list[SegmentRef],
        found: list[tuple[SegmentRef, int]],
    ) -> tuple[list[SegmentRef], bytes]:
        """``segments`` with new rows of ``part`` added as segment ``seq`` (merged with the
        part's small newest segments, which move to ``dropped``), and the new segment's blob."""
        chain = [s for s in segments if (s.part, s.parts) == (part, self.parts)]
        merged = chain[
            len(chain) - merge_count([s.rows for s in chain], len(chunk), self.max_segment_rows) :
        ]
        rows, row_numbers = [], []
        for ref in merged:
            opened = self._segment(ref, found)
            if opened is not None:
                rows.append(opened[0].sliced(slice(ref.skip, None)))
                row_numbers.append(opened[1][ref.skip :])
        chunk = GalleryRows.joined([*rows, chunk])
        numbers = np.concatenate([*row_numbers, numbers])
        blob = encode_segment(seq, chunk, self.position, numbers)
        first, end = int(numbers[0]), int(numbers[-1]) + 1
        ref = SegmentRef(seq, blob_sha(blob), len(chunk), 0, part, self.parts, first, end)
        if not ref.contiguous:
            self._numbers[(ref.seq, ref.sha)] = numbers
        dropped.extend(merged)
        return [s for s in segments if s not in merged] + [ref], blob

    def _retired(
        self,
        segments: list[SegmentRef],
        retired: int,
        dropped: list[SegmentRef],
        found: list[tuple[SegmentRef, int]],
    ) -> list[SegmentRef]:
        """``segments`` without the rows numbered below ``retired``: whole segments move to
        ``dropped``, the others skip their retired rows."""
        kept = []
        for ref in segments:
            if ref.end_row <= retired:
                dropped.append(ref)
                continue
            if ref.first_row < retired:
                numbers = self._row_numbers(ref, found)
                if numbers is None:  # corrupt: recorded in found, dropped with the commit
                    dropped.append(ref)
                    continue
                ref = replace(ref, skip=max(ref.skip, int(np.searchsorted(numbers, retired))))
            kept.append(ref)
        return kept

    def _row_numbers(
        self, ref: SegmentRef, found: list[tuple[SegmentRef, int]]
    ) -> NDArray[np.int64] | None:
        """The row numbers of a segment's rows: its range when contiguous, else as this
        indexer wrote or last read them, else read from the store (``None``: corrupt)."""
        if ref.contiguous:
            return np.arange(ref.first_row, ref.end_row, dtype=np.int64)
        key = (ref.seq, ref.sha)
        if key not in self._numbers:
            opened = self._segment(ref, found)
            if opened is None:
                return None
            self._numbers[key] = opened[1]
        return self._numbers[key]

    def _quarantined(self, manifest: Manifest) -> tuple[list[SegmentRef], list[SegmentRef]]:
        """The manifest's segments less those recorded corrupt, and the segments left out
        (deleted with the commit)."""
        corrupt = self.corrupt.read()
        segments: list[SegmentRef] = []
        dropped: list[SegmentRef] = []
        for ref in manifest.segments:
            (dropped if CorruptSegments.field(ref) in corrupt else segments).append(ref)
        return segments, dropped

    def _segment(
        self, ref: SegmentRef, found: list[tuple[SegmentRef, int]]
    ) -> tuple[GalleryRows, NDArray[np.int64]] | None:
        """A segment's rows and row numbers; ``None`` when it is missing or corrupt, noted in
        ``found`` with its live rows for the commit to record. Not recorded here: our lease may
        have lapsed, and the segment be missing because our successor merged it."""
        opened = open_numbered_segment(self.store, ref)
        if opened is None and all(r != ref for r, _ in found):
            found.append((ref, ref.live_rows))
        return opened
