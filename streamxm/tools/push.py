"""``streamxm push``: a dataset's training pairs into a namespace, with a progress bar, a
report of what landed and a way to resume after a failure without pushing anything twice.

The pairs go in a fixed order (ids ``<prefix>-<row>``), so a push is resumed by its position:
``--start N`` skips the first N. When a send fails, :class:`PushStopped` says how many pairs
landed for certain (the sends before it and the server batches of the failed send the API
confirmed), the last entry id, and how many after them may also have landed (a send whose
answer never came): resuming from the certain count pushes those again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisClusterException, RedisError
from tqdm import tqdm

from streamxm.client.errors import StreamxmError, Unavailable
from streamxm.stream.messages import InvalidPair as PairRefused
from streamxm.stream.messages import Pair

__all__ = ["PushReport", "PushStopped", "push_pairs"]

#: Pairs per send: a progress step, and the most a failed send can leave unknown.
PUSH_CHUNK = 500


@dataclass(frozen=True)
class PushReport:
    """Where a push stands: pairs ``[start, landed)`` of the dataset are in the stream,
    ``last_entry_id`` is the newest of them (None: none yet), and up to ``uncertain`` pairs
    after ``landed`` may be too."""

    start: int
    landed: int
    total: int
    last_entry_id: str | None
    uncertain: int = 0

    def summary(self) -> str:
        last = f", last entry id {self.last_entry_id}" if self.last_entry_id else ""
        return (
            f"pushed pairs {self.start}..{self.landed - 1} of {self.total} "
            f"({self.landed - self.start} pairs{last})"
            if self.landed > self.start
            else f"pushed no pairs (from pair {self.start} of {self.total})"
        )


class PushStopped(Exception):
    """A push that failed part-way: ``report`` says what landed, ``cause`` why it stopped."""

    def __init__(self, report: PushReport, cause: Exception) -> None:
        self.report = report
        self.cause = cause
        # The service was unreachable (try again later), not the push refused.
        self.transient = isinstance(cause, (Unavailable, RedisError, RedisClusterException))
        uncertain = (
            f"; the {report.uncertain} pairs after them got no answer and may have "
            f"landed too (resuming pushes them again)"
            if report.uncertain
            else ""
        )
        super().__init__(
            f"{cause}\n{report.summary()}{uncertain}.\n"
            f"Resume with the same command and --start {report.landed}"
        )


def _landed_in(error: Exception, sent: int) -> tuple[int, str | None, int]:
    """Of a failed send of ``sent`` pairs: how many landed for certain, the newest of their
    entry ids (None: none in this send; "": unknown), and how many after them may also
    have."""
    if isinstance(error, StreamxmError):
        certain = len(error.accepted) + error.unconfirmed  # a 2xx whose ids were unreadable
        if error.unconfirmed:
            return certain, "", error.in_doubt
        return certain, error.accepted[-1] if error.accepted else None, error.in_doubt
    if isinstance(error, PairRefused):
        return 0, None, 0  # validated before anything was written
    # Straight into Redis: a pipeline that failed may have applied any prefix of itself.
    return 0, None, sent


def push_pairs(
    pairs: Sequence[Pair],
    send: Callable[[Sequence[Pair]], list[str]],
    start: int = 0,
    rate: float | None = None,
) -> PushReport:
    """Send ``pairs[start:]`` in chunks (at most ``rate`` per second on average) with a
    progress bar; :class:`PushStopped` when a send fails."""
    if not 0 <= start <= len(pairs):
        raise ValueError(f"--start {start}: the dataset has {len(pairs)} pairs to push")
    chunk = max(1, min(PUSH_CHUNK, int(rate) if rate else PUSH_CHUNK))
    began = time.monotonic()
    at, last = start, None
    with tqdm(total=len(pairs), initial=start, unit="pair", desc="pushed") as bar:
        while at < len(pairs):
            part = pairs[at : at + chunk]
            try:
                ids = send(part)
            except (StreamxmError, RedisError, RedisClusterException, PairRefused) as exc:
                certain, newest, uncertain = _landed_in(exc, len(part))
                report = PushReport(
                    start,
                    at + certain,
                    len(pairs),
                    last if newest is None else newest or None,
                    uncertain,
                )
                raise PushStopped(report, exc) from exc
            at, last = at + len(part), ids[-1] if ids else last
            bar.update(len(part))
            if rate:
                # Hold the average rate: sleep until this many pairs are due.
                due = began + (at - start) / rate
                time.sleep(max(0.0, due - time.monotonic()))
    return PushReport(start, at, len(pairs), last)
