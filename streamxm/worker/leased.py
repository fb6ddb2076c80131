"""The loop every leased consumer runs: the learner worker (and a distributed model's rank 0)
and the gallery indexer.

One process at a time does a stream consumer's work: the one holding its lease. The loop is a
sequence of named steps, as rq's ``BaseWorker`` has them, which the consumers fill in::

    prepare                    once, before anything (register, create groups)
    while not stopped:
        hold_lease             take or extend the lease; on taking it, load the state
        work                   one read of the stream, applied; True when nothing was read
        recover(exc)           a failure the consumer survives (its ``recoverable`` types)
    finish                     the holder's final commit, and the lease released
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

import redis

from streamxm.storage.checkpoint import LeaseLost
from streamxm.worker.lease import Lease

log = logging.getLogger(__name__)

__all__ = ["LeasedConsumer"]


class LeasedConsumer(ABC):
    """A stream consumer that works only while it holds its lease (the module's docstring).

    Attributes
    ----------
    lease
        The lease; its ``ttl_ms`` sets how often a standby asks for it (a quarter of it).
    recoverable
        The exceptions :meth:`recover` handles; any other ends :meth:`run` (after
        :meth:`finish`).
    """

    lease: Lease
    consumer: str
    #: Whether this process holds the lease with its state loaded.
    leader: bool = False
    recoverable: tuple[type[Exception], ...] = ()

    def run(self, stop: threading.Event | None = None, until_idle: bool = False) -> None:
        """Loop until ``stop`` is set (or, with ``until_idle``, until a step reads nothing)."""
        stop = stop or threading.Event()
        self.prepare(stop)
        try:
            while not stop.is_set():
                try:
                    if not self.hold_lease():
                        stop.wait(self.lease.ttl_ms / 4000)
                        continue
                    idle = self.work()
                except self.recoverable as exc:
                    self.recover(stop, exc)
                    continue
                if until_idle and idle:
                    break
        finally:
            self.finish()

    def prepare(self, stop: threading.Event) -> None:  # noqa: B027 - optional, empty on purpose
        """Once, before the loop (nothing by default)."""

    @abstractmethod
    def hold_lease(self) -> bool:
        """Whether this process holds the lease now (taken, with its state loaded, or
        extended); False: a standby's turn to wait."""

    @abstractmethod
    def work(self) -> bool:
        """One step of the holder's work; True when there was nothing to do."""

    @abstractmethod
    def recover(self, stop: threading.Event, exc: Exception) -> None:
        """After a failure of type ``recoverable``: drop what is not durable, wait as the
        failure asks; the next :meth:`hold_lease` starts again from the durable state."""

    @abstractmethod
    def commit(self) -> None:
        """Make what the holder has applied durable (fenced by the lease)."""

    def finish(self) -> None:
        """On the way out: the holder commits what it has and releases the lease; a commit
        that fails leaves the successor to read again from the last durable point."""
        if self.leader:
            try:
                self.commit()
                self.lease.release()
            except (redis.RedisError, LeaseLost) as exc:
                log.error(
                    "%s: final commit failed (%s); the successor starts from the last durable one",
                    self.consumer,
                    exc,
                )
            self.leader = False
