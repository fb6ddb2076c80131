"""The search gallery kept current: from the gallery indexer's segments plus the stream after
them, or from the stream alone when no indexer runs.

:class:`GalleryFollower` is written by the server's refresh thread only; readers take its
:attr:`~GalleryFollower.gallery`, an immutable snapshot.
"""

from __future__ import annotations

import logging

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm.serving.gallery import CHUNK_MAX, Gallery, GalleryChunk, merge_count
from streamxm.storage.checkpoint import CheckpointStore
from streamxm.storage.segments import (
    CorruptSegments,
    Manifest,
    SegmentRef,
    open_segment,
    read_manifest,
)
from streamxm.storage.slots import ShardPart
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits
from streamxm.stream.producer import decode_entries
from streamxm.stream.redis_conn import StreamEntry, stream_entries, text
from streamxm.stream.retention import entry_id_key

__all__ = ["GalleryFollower"]

log = logging.getLogger(__name__)


class GalleryFollower:
    """The gallery of a namespace, brought up to its stream by :meth:`read`.

    Parameters
    ----------
    client, store, keys
        Redis, the store the segments live in, the namespace's keys.
    gallery_max
        Gallery cap (items) when the gallery is read from the stream alone (the indexer caps
        its segments itself).
    limits
        Input bounds the stream's entries are decoded with (the ones that break them are
        skipped: the learners dead-letter them).
    read_count
        Stream entries read per ``XREAD``.
    part
        The items to keep (a gallery shard's part: :mod:`streamxm.serving.sharding`);
        ``None``: every item.
    """

    def __init__(
        self,
        client: redis.Redis,
        store: CheckpointStore,
        keys: Keys,
        gallery_max: int,
        limits: Limits,
        read_count: int,
        part: ShardPart | None = None,
    ) -> None:
        self.r, self.store, self.keys, self.part = client, store, keys, part
        self.gallery_max, self.limits, self.read_count = gallery_max, limits, read_count
        self.gallery = Gallery()
        self.last_gallery_id = "0-0"
        self.gallery_skipped = 0
        # With a gallery indexer: the manifest revision in use, its open segments and the
        # chunks made of them (the first one sliced by the manifest's skip).
        self._revision: int | None = None
        self._segments: dict[tuple[int, str], GalleryChunk] = {}
        # Per open segment: how many of its rows up to each one this follower keeps.
        self._kept_before: dict[tuple[int, str], tuple[GalleryChunk, NDArray[np.int64]]] = {}
        self._sliced: dict[tuple[int, str, int], GalleryChunk] = {}
        self._segment_chunks: tuple[GalleryChunk, ...] = ()
        self._tail: list[tuple[GalleryChunk, list[str]]] = []  # rows after them, entry ids
        # Segments found corrupt (seq, sha): never read again; the gallery is served without
        # them (degraded) and the namespace's record counts every one with its rows.
        self.corrupt_segments: set[tuple[int, str]] = set()
        self._corrupt = CorruptSegments(client, keys)
        #: The namespace's record of corrupt segments (``<seq>:<sha>`` -> rows lost): the
        #: gallery is degraded while it is not empty.
        self.gallery_corrupt: dict[str, int] = {}

    def read(self) -> bool:
        """Bring the gallery up to the stream: from the indexer's segments plus the stream
        after them when a gallery indexer runs, else from the stream itself."""
        revision = self.r.hget(self.keys.gallery, "revision")
        if revision is None:
            return self._read_stream()
        changed = False
        if int(text(revision)) != self._revision:
            manifest = read_manifest(self.r, self.keys)
            if manifest is not None and self._open(manifest):
                changed = True
        return self._read_stream() or changed

    def _open(self, manifest: Manifest) -> bool:
        """Use the manifest's segments (those already open are kept, not reread; a shard's
        follower reads only those whose part meets its own); rows of the stream tail that the
        segments now cover leave the tail. False, with nothing changed, when a segment is gone
        because a newer manifest replaced it meanwhile."""
        opened = {}
        for ref in manifest.segments:
            key = (ref.seq, ref.sha)
            if self.part is not None and not self.part.meets(ref.slots):
                continue  # rows of other shards only
            chunk = self._segments.get(key)
            if chunk is None and key not in self.corrupt_segments:
                rows = open_segment(self.store, ref)
                if rows is None and not self._corrupt.record(ref, ref.live_rows):
                    # Not recorded: the manifest in Redis no longer lists it (checked with the
                    # write, atomically), so the indexer merged or retired it and deleted its
                    # blob after this manifest was read: not corrupt. The next read opens the
                    # newer manifest.
                    return False
                if rows is None:  # quarantined: the rest of the gallery is served
                    self.corrupt_segments.add(key)
                else:
                    chunk = GalleryChunk.from_rows(rows)
                    self._kept_before[key] = self._keep_mine(chunk, ref)
                    chunk = self._kept_before[key][0]
            if chunk is not None:
                opened[key] = chunk
        self._segments = opened
        self._kept_before = {key: self._kept_before[key] for key in opened}
        self.gallery_corrupt = self._corrupt.read()
        chunks, sliced = [], {}
        for ref in manifest.segments:
            key = (ref.seq, ref.sha)
            if key not in opened:
                continue
            chunk = opened[key]
            if ref.skip:  # its oldest rows are retired; the skip counts the segment's rows
                cut = (ref.seq, ref.sha, ref.skip)
                skip = int(self._kept_before[key][1][ref.skip])
                sliced[cut] = self._sliced.get(cut) or chunk.sliced(slice(skip, None))
                chunk = sliced[cut]
            chunks.append(chunk)
        self._sliced = sliced
        self._segment_chunks = tuple(chunks)
        self._carry(chunks)
        if self._revision is None:  # from the stream alone to segments: the tail is reread
            self.last_gallery_id, self._tail = manifest.last_id, []
        covered = entry_id_key(manifest.last_id)
        tail = []
        for chunk, entries in self._tail:
            keep = [i for i, e in enumerate(entries) if entry_id_key(e) > covered]
            if len(keep) == len(entries):
                tail.append((chunk, entries))
            elif keep:
                tail.append((chunk.sliced(slice(keep[0], None)), entries[keep[0] :]))
        self._tail = tail
        if entry_id_key(self.last_gallery_id) < covered:
            self.last_gallery_id = manifest.last_id
        self._revision = manifest.revision
        self._publish()
        return True

    def _carry(self, chunks: list[GalleryChunk]) -> None:
        """New chunks take the features that the published snapshot keeps for their rows,
        from the chunks they replace (matching against the whole gallery would cost a sort
        of every id at each indexer commit)."""
        published = {id(c) for c in self.gallery.chunks}
        staying = {id(c) for c in chunks}
        replaced = Gallery(tuple(c for c in self.gallery.chunks if id(c) not in staying))
        for chunk in chunks:
            if id(chunk) not in published:
                carried = chunk.carry_features(replaced)
                log.debug("gallery chunk of %d rows: features of %d carried", len(chunk), carried)

    def _keep_mine(
        self, chunk: GalleryChunk, ref: SegmentRef
    ) -> tuple[GalleryChunk, NDArray[np.int64]]:
        """The rows of a segment's chunk this follower keeps (all but a shard's others), and
        how many of them come before each row of the segment (to map the manifest's skip)."""
        if self.part is None or self.part.covers(ref.slots):
            return chunk, np.arange(len(chunk) + 1)
        mine = self.part.holds(chunk.ids)
        before = np.concatenate([[0], np.cumsum(mine)])
        if mine.all():
            return chunk, before
        return GalleryChunk.from_rows(chunk.taken(np.flatnonzero(mine))), before

    def _publish(self) -> None:
        chunks = (*self._segment_chunks, *(c for c, _ in self._tail))
        self.gallery = Gallery(tuple(c for c in chunks if len(c)))

    def _read_stream(self, budget: int = 50_000) -> bool:
        """Read up to ``budget`` new stream entries into the gallery."""
        changed = False
        while budget > 0:
            reply = self.r.xread(
                {self.keys.pairs: self.last_gallery_id}, count=min(self.read_count, budget)
            )
            entries = stream_entries(reply)
            if not entries:
                return changed
            budget -= len(entries)
            self.last_gallery_id = entries[-1][0]
            if self.part is not None:
                entries = _entries_of_part(entries, self.part, self.limits.max_id_length)
            pairs, skipped = decode_entries(self.r, self.keys, entries, self.limits)
            self.gallery_skipped += skipped
            if pairs:
                at = [entry_id for entry_id, _ in pairs]
                chunk = GalleryChunk.of(
                    np.asarray([p.id for _, p in pairs]),
                    np.vstack([p.img for _, p in pairs]),
                    np.vstack([p.txt for _, p in pairs]),
                )
                if self._revision is None:
                    self.gallery = self.gallery.appended(chunk, self.gallery_max)
                else:  # the indexer caps the segments; the tail after them only grows here
                    merged = merge_count([len(c) for c, _ in self._tail], len(chunk), CHUNK_MAX)
                    if merged:
                        older = self._tail[len(self._tail) - merged :]
                        chunk = GalleryChunk.joined([*(c for c, _ in older), chunk])
                        at = [e for _, entries in older for e in entries] + at
                        self._tail = self._tail[: len(self._tail) - merged]
                    self._tail.append((chunk, at))
                    self._publish()
                changed = True
        return changed


def _entries_of_part(
    entries: list[StreamEntry], part: ShardPart, max_id_length: int
) -> list[StreamEntry]:
    """The entries whose item ``part`` holds, found from their raw ids before anything is
    decoded (a shard would otherwise decode every pair of the stream to keep its share).
    An entry whose id cannot be read here (missing, not UTF-8, too long) is kept: decoding
    refuses it and counts it skipped, as a follower of the whole gallery would."""
    ids: list[str] = []
    readable: list[int] = []
    for at, (_, fields) in enumerate(entries):
        raw = fields.get(b"id") if fields is not None else None
        if raw is None or len(raw) > 4 * max_id_length:
            continue
        try:
            ids.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        readable.append(at)
    if not ids:
        return entries
    others = set(np.asarray(readable)[~part.holds(ids)].tolist())
    return [entry for at, entry in enumerate(entries) if at not in others]
