"""What a learner worker makes of each stream entry: a validated pair of the namespace's
dimensions, or a bounded dead letter saying why not."""

from __future__ import annotations

import logging

import redis

from streamxm.stream.keys import Keys
from streamxm.stream.messages import InvalidPair, Limits, Pair, decode_pair, field_name
from streamxm.stream.producer import check_dims, ensure_schema, read_schema

__all__ = ["DEAD_MAX_FIELDS", "DEAD_MAX_VALUE", "EntryDecoder"]

log = logging.getLogger(__name__)

#: Original fields a dead letter carries, and the bytes of each: a garbage entry must not turn
#: into a garbage dead letter of any size.
DEAD_MAX_FIELDS = 16
DEAD_MAX_VALUE = 1 << 20


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
