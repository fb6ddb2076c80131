"""How a learner worker reads its model's consumer group: after taking the lease, the entries
the group delivered after the checkpoint again (a replay, in stream order), then new ones.

Taking over (:meth:`GroupReader.take_over`) moves every pending entry of the group to this
consumer (the lease holder: the others are dead, or stale and fenced off at commit),
acknowledges those the checkpoint already contains (only their acknowledgement was lost) and
replays from the checkpoint's last applied entry up to the group's last delivered one. Replaying
from the checkpoint rather than from the pending list also covers a corrupt newest checkpoint
and a read whose reply was lost (:mod:`streamxm.worker.loop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import StreamEntry, stream_entries, text

__all__ = ["GroupReader"]


class GroupReader:
    """Reads one model's consumer group as one consumer.

    Parameters
    ----------
    client, keys
        Redis and the namespace's keys.
    group, consumer
        The model's consumer group and this worker's name in it.
    block_ms
        How long a read of new entries blocks (``XREADGROUP BLOCK``).
    """

    def __init__(
        self, client: redis.Redis, keys: Keys, group: str, consumer: str, block_ms: int
    ) -> None:
        self.r, self.keys = client, keys
        self.group, self.consumer, self.block_ms = group, consumer, block_ms
        #: Whether reads replay the group's delivered entries (after :meth:`take_over`).
        self.replaying = False
        self._cursor = "0-0"  # the last entry replayed
        self._end = "0-0"  # the group's last delivered entry when the replay began

    def create_group(self) -> None:
        """Create the consumer group, from the stream's start, unless it exists."""
        try:
            self.r.xgroup_create(self.keys.pairs, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def take_over(self, last_id: str) -> str:
        """Claim the group's pending entries, acknowledge those up to the checkpoint's
        ``last_id`` and replay from it (the module's docstring); the entry the replay ends at."""
        self._claim_orphans()
        self._ack_applied(last_id)
        self.replaying, self._cursor = True, last_id
        self._end = self._last_delivered()
        return self._end

    def read(self, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries: the replay's next ones, else new ones (blocking)."""
        if not self.replaying:
            reply = self.r.xreadgroup(
                self.group,
                self.consumer,
                {self.keys.pairs: ">"},
                count=count,
                block=self.block_ms,
            )
            return stream_entries(reply)
        # Everything after the checkpoint that the group has delivered: replayed in order.
        rows: Any = self.r.xrange(
            self.keys.pairs, min=f"({self._cursor}", max=self._end, count=count
        )
        entries = [(text(entry_id), fields) for entry_id, fields in rows]
        if not entries:
            self.replaying = False
        else:
            self._cursor = entries[-1][0]
        return entries

    def ack(self, entry_ids: Sequence[str | bytes | int]) -> None:
        """Acknowledge entries at once (ones applied before; the others go with a commit)."""
        self.r.xack(self.keys.pairs, self.group, *entry_ids)

    def _claim_orphans(self) -> None:
        """Move every pending entry of other consumers to us: we hold the lease, so they are
        dead (or stale and fenced off by the lease check at commit)."""
        cursor = "0-0"
        while True:
            # Not JUSTID: redis-py drops the cursor from a JUSTID reply.
            reply = self.r.xautoclaim(
                self.keys.pairs,
                self.group,
                self.consumer,
                min_idle_time=0,
                start_id=cursor,
                count=500,
            )
            cursor = text(reply[0])
            if cursor == "0-0":
                break

    def _ack_applied(self, last_id: str) -> None:
        """Acknowledge pending entries the checkpoint already contains (the ack was lost)."""
        if last_id == "0-0":
            return
        while True:
            rows = self.r.xpending_range(
                self.keys.pairs, self.group, min="-", max=last_id, count=1000
            )
            if not rows:
                return
            self.ack([row["message_id"] for row in rows])

    def _last_delivered(self) -> str:
        for info in self.r.xinfo_groups(self.keys.pairs):
            if text(info["name"]) == self.group:
                return text(info["last-delivered-id"])
        return "0-0"
