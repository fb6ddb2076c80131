"""The producer client: validate pairs and add them to the namespace's stream as message v1.

Examples
--------
>>> from streamxm.stream.redis_conn import EmbeddedRedis
>>> import tempfile, redis
>>> tmp = tempfile.TemporaryDirectory()
>>> server = EmbeddedRedis(tmp.name); url = server.start()
>>> client = StreamProducer(redis.Redis.from_url(url), namespace="doc")
>>> entry_id = client.push("p1", [0.1, 0.2, 0.3], [1.0, 0.0], labels=[2])
>>> client.push("p2", [0.1, 0.2], [1.0, 0.0])
Traceback (most recent call last):
...
streamxm.stream.messages.InvalidPair: img: 2 values, the namespace expects 3
>>> server.stop(); tmp.cleanup()
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import redis
from numpy.typing import ArrayLike

from streamxm.stream.keys import Keys
from streamxm.stream.messages import InvalidPair, Limits, Pair, decode_pair, encode_pair, make_pair
from streamxm.stream.migrate import require_migrated
from streamxm.stream.redis_conn import Replication, StreamEntry, text, wait_replicated

__all__ = ["StreamProducer", "decode_entries", "ensure_schema", "read_schema"]


def read_schema(r: redis.Redis, keys: Keys) -> tuple[int, int] | None:
    raw = r.get(keys.schema)
    if raw is None:
        return None
    data = json.loads(text(raw))
    return int(data["img_dim"]), int(data["txt_dim"])


def decode_entries(
    r: redis.Redis, keys: Keys, entries: Sequence[StreamEntry], limits: Limits
) -> tuple[list[tuple[str, Pair]], int]:
    """The pairs of stream entries that decode under the namespace's schema, with their entry
    ids, and how many did not (invalid, or deleted before anyone read them): what readers that
    keep no dead letters (the gallery's) take from the stream."""
    img_dim, txt_dim = read_schema(r, keys) or (None, None)
    pairs, skipped = [], 0
    for entry_id, fields in entries:
        try:
            if fields is None:
                skipped += 1
                continue
            pairs.append((entry_id, decode_pair(fields, img_dim, txt_dim, limits=limits)))
        except InvalidPair:
            skipped += 1
    return pairs, skipped


def ensure_schema(r: redis.Redis, keys: Keys, img_dim: int, txt_dim: int) -> tuple[int, int]:
    """Fix the namespace's dimensions on first use; return the dimensions in force."""
    r.set(keys.schema, json.dumps({"img_dim": img_dim, "txt_dim": txt_dim}), nx=True)
    schema = read_schema(r, keys)
    assert schema is not None
    return schema


def check_dims(pair: Pair, schema: tuple[int, int]) -> None:
    for name, vec, dim in (("img", pair.img, schema[0]), ("txt", pair.txt, schema[1])):
        if vec.shape[0] != dim:
            raise InvalidPair(
                name, "dim_mismatch", f"{vec.shape[0]} values, the namespace expects {dim}"
            )


class StreamProducer:
    """Push image-text pairs to ``sxm:{<ns>}:pairs``.

    Parameters
    ----------
    client
        A redis-py client.
    namespace
        Stream namespace.
    limits
        Input bounds (the same the API and worker enforce).
    maxlen
        Optional approximate cap on the stream length (``XADD MAXLEN ~``); unset keeps every
        entry, which restarts and new consumer groups rely on.
    replication
        Replicas that must hold each pushed batch before the push returns
        (:class:`~streamxm.stream.redis_conn.NotReplicated` otherwise: the pairs may be on the
        master only, and a failover would lose them; push again).
    """

    def __init__(
        self,
        client: redis.Redis,
        namespace: str = "default",
        limits: Limits = Limits(),
        maxlen: int | None = None,
        replication: Replication = Replication(),
    ) -> None:
        self.r = client
        self.keys = Keys(namespace)
        self.limits = limits
        self.maxlen = maxlen
        self.replication = replication
        self._schema: tuple[int, int] | None = None

    def _check(self, pair: Pair) -> None:
        if self._schema is None:
            # Before the first write: a push must not start the namespace under the new key
            # names beside data still under the old ones (streamxm migrate-keys).
            require_migrated(self.r, self.keys)
            self._schema = ensure_schema(self.r, self.keys, pair.img.shape[0], pair.txt.shape[0])
        check_dims(pair, self._schema)

    def push(
        self,
        id: str,
        img: ArrayLike,
        txt: ArrayLike,
        labels: Sequence[int] | None = None,
        ts: float | None = None,
    ) -> str:
        """Validate and add one pair; return its stream entry id."""
        return self.push_pairs([make_pair(id, img, txt, labels, ts, self.limits)])[0]

    def push_many(
        self,
        pairs: Iterable[tuple[str, ArrayLike, ArrayLike, Sequence[int] | None]],
        chunk: int = 500,
    ) -> list[str]:
        """Validate every ``(id, img, txt, labels)`` first, then add them pipelined.

        Nothing is added when any pair is invalid (the error names it).
        """
        validated = []
        for i, (pid, img, txt, labels) in enumerate(pairs):
            try:
                validated.append(make_pair(pid, img, txt, labels, None, self.limits))
            except InvalidPair as exc:
                raise InvalidPair(exc.field, exc.reason, exc.detail, index=i) from None
        return self.push_pairs(validated, chunk)

    def push_pairs(
        self,
        pairs: Sequence[Pair],
        chunk: int = 500,
        messages: Sequence[Mapping[bytes, bytes]] | None = None,
    ) -> list[str]:
        """Add already validated pairs, ``chunk`` per round trip. ``messages``: the pairs'
        message v1 fields when the caller holds them already (decoded from frames by
        :func:`~streamxm.stream.messages.decode_pair`), written as they came instead of
        encoded again."""
        if messages is not None and len(messages) != len(pairs):
            raise ValueError("messages must be one per pair")
        for i, pair in enumerate(pairs):
            try:
                self._check(pair)
            except InvalidPair as exc:
                index = i if len(pairs) > 1 else None
                raise InvalidPair(exc.field, exc.reason, exc.detail, index=index) from None
        ids: list[str] = []
        for start in range(0, len(pairs), chunk):
            part = pairs[start : start + chunk]
            encoded = (
                messages[start : start + chunk]
                if messages is not None
                else [encode_pair(pair) for pair in part]
            )
            with self.r.pipeline(transaction=False) as pipe:
                for fields in encoded:
                    pipe.xadd(
                        self.keys.pairs,
                        fields,  # type: ignore[arg-type]
                        maxlen=self.maxlen,
                        approximate=True,
                    )
                pipe.incrby(self.keys.ingested, len(part))
                out = pipe.execute()
            wait_replicated(self.r, self.keys.replicated, self.replication)
            ids.extend(text(x) for x in out[:-1])
        return ids
