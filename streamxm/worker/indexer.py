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

import numpy as np
import redis

from streamxm import defaults as D
from streamxm.storage.checkpoint import CheckpointStore, LeaseLost, blob_sha
from streamxm.storage.rows import CHUNK_MAX, GalleryRows, merge_count
from streamxm.storage.segments import (
    SEGMENTS,
    CorruptSegments,
    Manifest,
    SegmentRef,
    encode_segment,
    open_segment,
    read_manifest,
)
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
    ) -> None:
        self.r = client
        self.store = store
        self.keys = Keys(namespace)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.max_items = max_items
        self.flush_seconds = flush_seconds
        self.segment_rows = segment_rows
        self.max_segment_rows = max_segment_rows
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
        self._buffer, self._since = [], time.monotonic()
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
        """Write the buffered rows as a segment (merged with the small newest ones) and move
        the manifest to it and to the stream position, in one lease-fenced transaction."""
        self._since = time.monotonic()
        old = self.manifest
        if self.position == old.last_id:
            return
        segments, skip, dropped = self._quarantined(old)
        seq, blob = old.next_seq, None
        found: list[tuple[SegmentRef, int]] = []  # corrupt segments met merging, rows lost
        if self._buffer:
            ids, imgs, txts = zip(*self._buffer, strict=True)
            chunk = GalleryRows.of(np.asarray(ids), np.vstack(imgs), np.vstack(txts))
            merged = merge_count([s.rows for s in segments], len(chunk), self.max_segment_rows)
            parts = []
            for i in range(len(segments) - merged, len(segments)):
                part = self._segment(segments[i], skip if i == 0 else 0, found)
                if part is not None:
                    parts.append(part.sliced(slice(skip, None)) if i == 0 and skip else part)
                if i == 0:
                    skip = 0
            dropped += segments[len(segments) - merged :]
            segments = segments[: len(segments) - merged]
            chunk = GalleryRows.joined([*parts, chunk])
            blob = encode_segment(seq, chunk, self.position)
            segments.append(SegmentRef(seq, blob_sha(blob), len(chunk)))
        # Retire the oldest rows past the cap: whole segments, then rows of the first.
        total = sum(s.rows for s in segments) - skip
        while len(segments) > 1 and total - (segments[0].rows - skip) >= self.max_items:
            total -= segments[0].rows - skip
            dropped.append(segments.pop(0))
            skip = 0
        skip += max(0, total - self.max_items)
        manifest = Manifest(
            tuple(segments), skip, self.position, old.revision + 1, seq + (blob is not None)
        )

        def move(pipe: redis.client.Pipeline) -> None:
            pipe.delete(self.keys.gallery)
            pipe.hset(self.keys.gallery, mapping=manifest.fields())  # type: ignore[arg-type]
            for ref, rows_lost in found:  # fenced with the manifest: only while we lead
                self.corrupt.add(pipe, ref, rows_lost)

        self.store.commit_blob(
            SEGMENTS,
            seq,
            blob,
            [(s.seq, s.sha) for s in segments],
            [(s.seq, s.sha) for s in dropped],
            move,
            (self.lease.key, self.consumer),
        )
        for ref, rows_lost in found:
            CorruptSegments.report(ref, rows_lost)
        self.manifest, self._buffer = manifest, []
        log.debug(
            "gallery %s: revision %d, %d rows in %d segments, at %s",
            self.keys.namespace,
            manifest.revision,
            manifest.rows,
            len(segments),
            self.position,
        )

    def _quarantined(self, manifest: Manifest) -> tuple[list[SegmentRef], int, list[SegmentRef]]:
        """The manifest's segments less those recorded corrupt, the first one's retired rows,
        and the segments left out (deleted with the commit)."""
        corrupt = self.corrupt.read()
        segments, skip, dropped = [], manifest.skip, []
        for i, ref in enumerate(manifest.segments):
            if CorruptSegments.field(ref) in corrupt:
                dropped.append(ref)
                skip = 0 if i == 0 else skip
            else:
                segments.append(ref)
        return segments, skip, dropped

    def _segment(
        self, ref: SegmentRef, skip: int, found: list[tuple[SegmentRef, int]]
    ) -> GalleryRows | None:
        """A segment's rows to merge; ``None`` when it is missing or corrupt, noted in
        ``found`` with its rows past ``skip`` for the commit to record. Not recorded here: our
        lease may have lapsed, and the segment be missing because our successor merged it."""
        chunk = open_segment(self.store, ref)
        if chunk is None:
            found.append((ref, ref.rows - skip))
        return chunk
