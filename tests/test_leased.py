"""The leased consumer's loop (:class:`~streamxm.worker.leased.LeasedConsumer`) with a real
lease in Redis: one holder works at a time, a recoverable failure is recovered from, and the
holder's finish releases the lease to the standby."""

from __future__ import annotations

import threading
import time

import redis

from streamxm.config import Settings
from streamxm.stream.keys import Keys
from streamxm.worker.lease import Lease
from streamxm.worker.leased import LeasedConsumer


class _Counting(LeasedConsumer):
    """Counts to ``steps`` while it holds the lease; the third step fails once."""

    recoverable = (ValueError,)

    def __init__(self, r: redis.Redis, key: str, name: str, steps: int, log: list[str]) -> None:
        self.lease = Lease(r, key, name, 500)
        self.name, self.steps, self.log = name, steps, log
        self.done, self.leader, self.failed = 0, False, False

    def hold_lease(self) -> bool:
        if self.leader and self.lease.extend():
            return True
        self.leader = self.lease.acquire()
        return self.leader

    def work(self) -> bool:
        if self.done == 2 and not self.failed:
            self.failed = True
            raise ValueError("once")
        self.done += 1
        self.log.append(self.name)
        return self.done >= self.steps

    def recover(self, stop: threading.Event, exc: Exception) -> None:
        self.log.append(f"{self.name} recovered from {exc}")

    def commit(self) -> None:  # the base finish() commits, then releases the lease
        self.log.append(f"{self.name} committed")


def test_one_holder_at_a_time_and_the_standby_takes_over(
    r: redis.Redis, settings: Settings
) -> None:
    key = Keys(settings.namespace).lease("leased-test")
    log: list[str] = []
    first = _Counting(r, key, "a", 5, log)
    first.run(until_idle=True)
    assert log == ["a", "a", "a recovered from once", "a", "a", "a", "a committed"]
    assert r.get(key) is None
    # A standby waits while another holds the lease, then works once it is released.
    holder = Lease(r, key, "z", 60_000)
    assert holder.acquire()
    second = _Counting(r, key, "b", 3, log)
    stop = threading.Event()
    thread = threading.Thread(target=second.run, args=(stop, True))
    thread.start()
    try:
        time.sleep(0.6)  # several of the standby's attempts (a quarter of its 500 ms TTL)
        assert thread.is_alive() and "b" not in log and r.get(key) == b"z"
        holder.release()
        thread.join(timeout=10)
        assert log[-5:] == ["b", "b", "b recovered from once", "b", "b committed"]
    finally:
        stop.set()
        thread.join(timeout=10)
