"""The failures a learner worker survives: a lost Redis (it waits, doubling the wait) and an
entry whose learning raised (counted against the entry, dead-lettered as ``learn_error`` after
the last attempt). Either way the worker's state was dropped; the next lease reloads the
checkpoint and replays the stream after it (:mod:`streamxm.worker.loop`)."""

from __future__ import annotations

import logging
import threading

from streamxm.stream.messages import InvalidPair
from streamxm.stream.retention import entry_id_key

__all__ = ["EntryFailed", "LearnFailures", "back_off", "next_delay"]

log = logging.getLogger(__name__)


class EntryFailed(RuntimeError):
    """Learning the stream entry ``entry_id`` raised; the worker's state was dropped."""

    def __init__(self, entry_id: str, detail: str) -> None:
        super().__init__(f"entry {entry_id}: {detail}")
        self.entry_id = entry_id
        self.detail = detail


def next_delay(previous: float) -> float:
    """Back-off after a failure: doubling, from 0.1 s up to 5 s."""
    return min(5.0, max(0.1, previous * 2))


def back_off(stop: threading.Event, previous: float, consumer: str, exc: Exception) -> float:
    """Wait out a lost Redis (the state was dropped); the delay waited."""
    delay = next_delay(previous)
    log.warning(
        "worker %s: Redis unavailable (%s); state dropped, retrying in %.1f s", consumer, exc, delay
    )
    stop.wait(delay)
    return delay


class LearnFailures:
    """The entries whose learning raised and that no checkpoint covers yet: how often, and the
    last error; bounded by the entries between two checkpoints.

    Parameters
    ----------
    consumer
        The worker's name, for its log lines.
    max_attempts
        Failures of learning one entry before it is dead-lettered as ``learn_error``.
    """

    def __init__(self, consumer: str, max_attempts: int) -> None:
        self.consumer = consumer
        self.max_attempts = max_attempts
        self._failures: dict[str, tuple[int, str]] = {}  # entry id -> (failures, last error)

    def failed(self, stop: threading.Event, previous: float, exc: EntryFailed) -> float:
        """Count the failure against its entry and back off; the delay waited."""
        count = self._failures.get(exc.entry_id, (0, ""))[0] + 1
        self._failures[exc.entry_id] = (count, exc.detail)
        delay = next_delay(previous)
        then = "dead-lettering it" if count >= self.max_attempts else "reloading the checkpoint"
        log.error(
            "worker %s: learning entry %s failed (attempt %d of %d); state dropped, %s in %.1f s",
            self.consumer,
            exc.entry_id,
            count,
            self.max_attempts,
            then,
            delay,
            exc_info=exc.__cause__,
        )
        stop.wait(delay)
        return delay

    def check(self, entry_id: str) -> None:
        """:class:`InvalidPair` (reason ``learn_error``) when learning the entry failed on
        every attempt it is given."""
        count, error = self._failures.get(entry_id, (0, ""))
        if count >= self.max_attempts:
            raise InvalidPair("", "learn_error", f"learning failed {count} times: {error}"[:1000])

    def committed(self, last_id: str) -> None:
        """Forget the entries up to ``last_id``: a checkpoint covers them now."""
        done = entry_id_key(last_id)
        self._failures = {k: v for k, v in self._failures.items() if entry_id_key(k) > done}
