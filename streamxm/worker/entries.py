"""What a learner worker makes of each stream entry: a validated pair of the namespace's
dimensions, or a bounded dead letter saying why not; and of each read (:class:`SortedRead`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from streamxm.stream.keys import Keys
from streamxm.stream.messages import InvalidPair, Limits, Pair, decode_pair, field_name
from streamxm.stream.producer import check_dims, ensure_schema, read_schema
from streamxm.stream.redis_conn import StreamEntry
from streamxm.stream.retention import entry_id_key
from streamxm.worker.failures import LearnFailures

__all__ = ["DEAD_MAX_FIELDS", "DEAD_MAX_VALUE", "EntryDecoder", "SortedRead"]

log = logging.getLogger(__name__)

#: Original fields a dead letter carries, and the bytes of each: a garbage entry must not turn
#: into a garbage dead letter of any size.
DEAD_MAX_FIELDS = 16
DEAD_MAX_VALUE = 1 << 20


@dataclass
class SortedRead:
    """One read of the stream, sorted against the learner's position (the last entry it
    applied, ``last_id`` once the read is applied)."""

    last_id: str
    #: Entries at or before the position: applied before a restart, only the ack was lost.
    already: list[str] = field(default_factory=list)
    #: The others, acknowledged by the commit that makes their effect durable.
    ack: list[str] = field(default_factory=list)
    #: The dead letters of those refused.
    dead: list[dict[str, str | bytes]] = field(default_factory=list)
    #: The pairs to learn, and their entry ids.
    pairs: list[Pair] = field(default_factory=list)
    pair_entries: list[str] = field(default_factory=list)


class EntryDecoder:
    """Decodes entries against the namespace's schema (its dimensions, fixed by the first pair
    any producer or worker saw; cached until :meth:`forget`) and writes up the ones that fail.

    Parameters
    ----------
    client, keys
        Redis and the namespace's keys (the schema lives there).
    model, consumer
        Who dead-letters: written into each letter.
    limits
        Input bounds every field is checked against.
    """

    def __init__(
        self, client: redis.Redis, keys: Keys, model: str, consumer: str, limits: Limits
    ) -> None:
        self.r, self.keys = client, keys
        self.model, self.consumer, self.limits = model, consumer, limits
        self._schema: tuple[int, int] | None = None

    def forget(self) -> None:
        """Read the schema again at the next entry (after the worker's state was dropped)."""
        self._schema = None

    def decode(self, fields: dict[bytes, bytes]) -> Pair:
        """The entry's pair; :class:`InvalidPair` with the reason when it breaks message v1
        or the namespace's dimensions."""
        if self._schema is None:
            self._schema = read_schema(self.r, self.keys)
        if self._schema is None:
            pair = decode_pair(fields, limits=self.limits)
            self._schema = ensure_schema(self.r, self.keys, pair.img.shape[0], pair.txt.shape[0])
            check_dims(pair, self._schema)
            return pair
        return decode_pair(fields, self._schema[0], self._schema[1], self.limits)

    def sort(self, entries: list[StreamEntry], last_id: str, failures: LearnFailures) -> SortedRead:
        """``entries`` sorted against the position ``last_id`` (:class:`SortedRead`). An entry
        deleted while pending is only acknowledged; one that does not decode, or whose learning
        failed on every attempt ``failures`` gives it, is dead-lettered."""
        read = SortedRead(last_id)
        for entry_id, fields in entries:
            if entry_id_key(entry_id) <= entry_id_key(read.last_id):
                read.already.append(entry_id)  # applied before the restart; only the ack was lost
                continue
            read.ack.append(entry_id)
            read.last_id = entry_id
            if fields is None:  # deleted from the stream while pending
                continue
            try:
                failures.check(entry_id)
                read.pairs.append(self.decode(fields))
                read.pair_entries.append(entry_id)
            except InvalidPair as exc:
                read.dead.append(self.dead_letter(entry_id, fields, exc))
        return read

    def dead_letter(
        self, entry_id: str, fields: dict[bytes, bytes], exc: InvalidPair
    ) -> dict[str, str | bytes]:
        """The dead letter of an entry refused for ``exc``, with its original fields (at most
        :data:`DEAD_MAX_FIELDS` of at most :data:`DEAD_MAX_VALUE` bytes each)."""
        log.warning("dead letter %s (%s): %s", entry_id, exc.reason, exc)
        letter: dict[str, str | bytes] = {
            "entry_id": entry_id,
            "model": self.model,
            "reason": exc.reason,
            "field": exc.field,
            "detail": exc.detail,
            "consumer": self.consumer,
        }
        for i, (name, value) in enumerate(fields.items()):
            if i == DEAD_MAX_FIELDS:
                letter["truncated"] = f"{len(fields) - i} more fields dropped"
                break
            if len(value) > DEAD_MAX_VALUE:
                letter["truncated"] = f"values cut to {DEAD_MAX_VALUE} bytes"
                value = value[:DEAD_MAX_VALUE]
            letter[f"orig.{field_name(name)}"] = value
        return letter
