"""How the ranks of a distributed learner find each other: through Redis, and nothing else.

The process group's rendezvous store (the key-value store through which gloo's ranks exchange
their addresses and rank 0 and the others claim their slots) is :class:`RedisStore`: keys in
the deployment's own Redis under ``sxm:{<ns>}:dist:<model>:g<generation>:``. No rendezvous port
is opened, so only a process that holds the Redis credentials can claim a rank or read another
rank's address; a process that merely reaches a rank's host learns nothing and joins nothing.

What remains on the network are gloo's own sockets between the ranks, bound to the address each
rank is configured with (``STREAMXM_DIST_HOST``, loopback by default). They carry learner state
and training pairs **unencrypted and unauthenticated**: beyond one machine they belong on a
private network.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import redis
import torch.distributed as dist

from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import text

__all__ = ["RedisStore", "Rendezvous"]


class RedisStore(dist.Store):  # type: ignore[misc,name-defined]
    """A ``torch.distributed`` store in Redis: every key under ``prefix``, expiring after
    ``ttl_s`` (a generation's keys are only read while it forms), ``timeout_s`` bounding how
    long :meth:`get` and :meth:`wait` wait for a key another rank has not written yet.

    Blocking reads poll with a backoff from 1 ms to 50 ms: a formation reads a few keys per
    rank, so polling costs nothing that matters and needs no Redis feature beyond strings.
    """

    def __init__(
        self, client: redis.Redis, prefix: str, timeout_s: float, ttl_s: int = 3600
    ) -> None:
        super().__init__()
        self.r, self.prefix, self.ttl_s = client, prefix, ttl_s
        self._timeout = datetime.timedelta(seconds=timeout_s)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes | str | list[int]) -> None:
        # gloo hands over bytes, a list of ints or a str depending on the caller.
        data = value if isinstance(value, bytes | str) else bytes(value)
        self.r.set(self._key(key), data, ex=self.ttl_s)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self.r.get(self._key(key))
        if value is None:  # expired between the wait and the read
            raise dist.DistStoreError(f"rendezvous key {key!r} vanished")
        return value if isinstance(value, bytes) else text(value).encode()

    def add(self, key: str, amount: int) -> int:
        with self.r.pipeline(transaction=True) as pipe:
            pipe.incrby(self._key(key), amount)
            pipe.expire(self._key(key), self.ttl_s)
            value, _ = pipe.execute()
        return int(value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        # Lua keeps the compare and the set one step; gloo's rendezvous does not use it, but a
        # store that answered wrongly would break whatever does.
        script = (
            "local v = redis.call('GET', KEYS[1]) "
            "if (v == false and ARGV[1] == '') or v == ARGV[1] then "
            "redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) return ARGV[2] end "
            "if v == false then return ARGV[1] end return v"
        )
        out = self.r.eval(script, 1, self._key(key), expected, desired, self.ttl_s)
        return out if isinstance(out, bytes) else text(out).encode()

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.r.exists(*(self._key(k) for k in keys)) == len(keys))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self._timeout).total_seconds()
        delay = 0.001
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"rendezvous keys {list(keys)} not written in time")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def delete_key(self, key: str) -> bool:
        return bool(self.r.delete(self._key(key)))

    def num_keys(self) -> int:
        raise NotImplementedError("a RedisStore does not count its keys")

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout


class Rendezvous:
    """The Redis side of forming a distributed learner's process group: the generation
    counter, the world size, and each generation's store."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str) -> None:
        self.r = client
        self.key = keys.dist(model)

    def publish(self, world: int) -> int:
        """Rank 0: a new generation of ``world`` ranks; returns it."""
        with self.r.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.key, "gen", 1)
            pipe.hset(self.key, mapping={"world": world})
            gen, _ = pipe.execute()
        return int(gen)

    def current(self) -> tuple[int, int] | None:
        """The newest generation and its world size, if rank 0 published one."""
        raw = {text(k): text(v) for k, v in self.r.hgetall(self.key).items()}
        if not raw.get("gen"):
            return None
        return int(raw["gen"]), int(raw.get("world", 0))

    def store(self, generation: int, timeout_s: float) -> RedisStore:
        """The rendezvous store of ``generation``; its keys outlive any formation's wait."""
        return RedisStore(
            self.r, f"{self.key}:g{generation}:", timeout_s, ttl_s=max(600, int(10 * timeout_s))
        )
