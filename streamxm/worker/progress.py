"""The learner worker's progress line: while it leads, one INFO line every
``progress_every_seconds`` (``STREAMXM_PROGRESS_EVERY_SECONDS``), as queue workers print::

    worker h-4242: cmos 12800 pairs learned (+2560 in 10.0 s: 256.0/s), version 14, mistakes
    since the last line i2t 312 t2i 287, rolling mAP i2t 0.412 t2i 0.398, lag 0

(one line in the log). Pairs are the model's total (its checkpoints carry it) and those learned
since the last line; the mistakes are since the last line, per direction; the rolling mAP is
the learner's test-then-train mAP (``-`` before any pair was scored); the lag is the stream's
entries not yet applied (``?`` when Redis cannot say). The counters are the ones the worker
writes with its checkpoints (:class:`~streamxm.learning.stats.WorkerStats`), read afresh.

Idle: rq and celery print nothing while no job arrives, so neither does this, except for one
line (ending ``, idle``) at the first interval without pairs: it shows the totals, version and
lag the burst ended at, and that the worker is alive; the next line comes with the next pairs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from streamxm.learning.stats import WorkerStats
from streamxm.models import DIRECTIONS
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import text

__all__ = ["ProgressLine", "stream_lag", "unapplied_entries"]

log = logging.getLogger(__name__)


class ProgressLine:
    """When the worker's progress line is due, and the line itself.

    ``every_seconds`` 0 never writes one. The worker calls :meth:`restart` when it takes the
    lease (its counters may have moved back to a checkpoint's), checks :meth:`due` once per
    read (a clock read) and only then builds a reading and calls :meth:`report`.
    """

    def __init__(
        self,
        consumer: str,
        model: str,
        every_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.consumer = consumer
        self.model = model
        self.every_seconds = every_seconds
        self._clock = clock
        self._last = WorkerStats()
        self._since = clock()
        self._idle_said = False

    def restart(self, stats: WorkerStats) -> None:
        """Count from ``stats`` (the state just loaded) on: the next line's new pairs are
        those learned after it."""
        self._last, self._since, self._idle_said = stats, self._clock(), False

    def due(self) -> bool:
        return self.every_seconds > 0 and self._clock() - self._since >= self.every_seconds

    def report(self, stats: WorkerStats, lag: Callable[[], int | None]) -> None:
        """Write the line for the interval that ends at ``stats`` (``lag`` is asked only when a
        line is written: it costs a Redis round trip), unless it is idle and said so already;
        the next interval starts now either way, so a rate never spans an idle stretch."""
        now = self._clock()
        new = stats.pairs_processed - self._last.pairs_processed
        idle = new == 0
        # Idle: one line per stretch, then silence until pairs come (as rq and celery, which
        # print nothing between jobs; the one line shows where the burst ended).
        if not (idle and self._idle_said):
            log.info(self.line(stats, new, now - self._since, lag(), idle))
        self._last, self._since, self._idle_said = stats, now, idle

    def line(
        self, stats: WorkerStats, new: int, seconds: float, lag: int | None, idle: bool
    ) -> str:
        rate = new / seconds if seconds > 0 else 0.0
        mistakes = {d: stats.mistakes[d] - self._last.mistakes[d] for d in DIRECTIONS}
        maps = {d: "-" if v is None else f"{v:.3f}" for d, v in stats.rolling_map.items()}
        return (
            f"worker {self.consumer}: {self.model} {stats.pairs_processed} pairs learned "
            f"(+{new} in {seconds:.1f} s: {rate:.1f}/s), version {stats.version or 0}, "
            f"mistakes since the last line {_per_direction(mistakes)}, "
            f"rolling mAP {_per_direction(maps)}, lag {'?' if lag is None else lag}"
            + (", idle" if idle else "")
        )


def _per_direction(values: Mapping[str, object]) -> str:
    return " ".join(f"{d} {values[d]}" for d in DIRECTIONS)


def unapplied_entries(
    groups: Iterable[Mapping[str, Any]], group: str, length: int, trimmed: int, stats: WorkerStats
) -> int:
    """Entries of the stream the model's learner has not applied yet, from one read of
    ``XINFO GROUPS``, the stream's length and the entries retention ``trimmed`` so far.

    Redis >= 7 says how many entries its group has not been delivered; the worker applies
    what it reads in the same step, so that is the count (a replay after taking the lease
    reads delivered entries again, which it leaves out). Older servers do not say: then every
    entry ever added (those in the stream and those retention trimmed, all applied) less
    those applied, pairs and dead letters; exact unless something else removed entries
    (a producer's ``MAXLEN``) or the group was made after a trim, and never below 0.

    >>> unapplied_entries([{"name": b"cmos", "lag": 7}], "cmos", 100, 0, WorkerStats())
    7
    >>> unapplied_entries([{"name": b"cmos"}], "cmos", 100, 40,
    ...                   WorkerStats(pairs_processed=120, dead_letters=5))
    15
    """
    for info in groups:
        if text(info["name"]) == group and info.get("lag") is not None:
            return int(info["lag"])
    return max(0, length + trimmed - stats.pairs_processed - stats.dead_letters)


def stream_lag(
    client: redis.Redis, keys: Keys, group: str, consumer: str, stats: WorkerStats
) -> int | None:
    """:func:`unapplied_entries` of ``group`` at ``stats`` (what ``consumer`` has applied), in
    one round trip; ``None`` when it cannot be read (a progress line never stops or slows the
    worker: a lost connection is noticed by its next read, as without it)."""
    try:
        with client.pipeline(transaction=False) as pipe:
            pipe.xinfo_groups(keys.pairs)
            pipe.xlen(keys.pairs)
            pipe.hget(keys.retention, "trimmed_total")
            groups, length, trimmed = pipe.execute()
    except (redis.RedisError, RedisClusterException) as exc:
        log.debug("worker %s: no stream lag for the progress line (%s)", consumer, exc)
        return None
    return unapplied_entries(groups, group, int(length), int(trimmed or 0), stats)
