"""A lease in Redis: one holder at a time, by ``SET NX PX``, extended and released by scripts
that act only for the holder named in the key."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis

__all__ = ["REFRESH_LEASE", "RELEASE_LEASE", "Lease"]

REFRESH_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """The lease ``key`` as held by ``owner`` for ``ttl_ms`` after each acquire or extend."""

    def __init__(self, client: redis.Redis, key: str, owner: str, ttl_ms: int) -> None:
        self.r = client
        self.key = key
        self.owner = owner
        self.ttl_ms = ttl_ms
        #: Held by a commit of this process from its ``WATCH`` of the key to its ``EXEC``
        #: (:meth:`~streamxm.storage.checkpoint.CheckpointStore.commit`).
        self.fence = threading.Lock()
        self._refresh = client.register_script(REFRESH_LEASE)
        self._release = client.register_script(RELEASE_LEASE)

    def acquire(self) -> bool:
        """Take the lease if it is free, or keep it if ``owner`` still holds it."""
        return bool(self.r.set(self.key, self.owner, nx=True, px=self.ttl_ms)) or self.extend()

    def extend(self) -> bool:
        """Extend the lease if ``owner`` holds it. While a commit of this process holds
        :attr:`fence` it is not extended (that would abort the commit, which watches the key)
        and counts as held: the commit checks the holder itself, and fails if it changed."""
        if not self.fence.acquire(blocking=False):
            return True
        try:
            return bool(self._refresh(keys=[self.key], args=[self.owner, self.ttl_ms]))
        finally:
            self.fence.release()

    def release(self) -> None:
        self._release(keys=[self.key], args=[self.owner])

    @contextmanager
    def heartbeat(self) -> Iterator[threading.Event]:
        """Extend the lease every third of its time from a helper thread while the body runs
        (a long batch must not outlive it); the event yielded is set if it was lost meanwhile."""
        lost, done = threading.Event(), threading.Event()

        def beat() -> None:
            while not done.wait(self.ttl_ms / 3000):
                if not self.extend():
                    lost.set()
                    return

        thread = threading.Thread(target=beat, name="lease-heartbeat", daemon=True)
        thread.start()
        try:
            yield lost
        finally:
            done.set()
            thread.join()
