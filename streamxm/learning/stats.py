"""The learning statistics a worker writes to Redis with every checkpoint
(``sxm:{<ns>}:stats:<model>``), as one typed record: the worker writes it with :meth:`to_hash`, the
API's ``/v1/models`` and the metrics collector read it with :meth:`from_hash`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamxm.learning.stream_learner import UPDATE_BUCKETS, StreamLearner
from streamxm.models import DIRECTIONS

__all__ = ["WorkerStats"]


def _zeros() -> dict[str, int]:
    return dict.fromkeys(DIRECTIONS, 0)


@dataclass(frozen=True)
class WorkerStats:
    """One model's learner as of its newest checkpoint.

    Examples
    --------
    >>> stats = WorkerStats(version=3, pairs_processed=120, rolling_map={"i2t": 0.5, "t2i": None})
    >>> WorkerStats.from_hash(stats.to_hash()) == stats
    True
    >>> WorkerStats.from_hash({}).version is None  # no checkpoint yet
    True
    """

    version: int | None = None
    last_id: str = "0-0"
    checkpoint_time: float | None = None
    #: When the newest pair in the checkpoint had been learned (unix seconds): the checkpoint
    #: may be written later, when its interval is up.
    learned_time: float | None = None
    dead_letters: int = 0
    consumer: str = ""
    pairs_processed: int = 0
    pairs_unlabelled: int = 0
    #: Pairs that arrived while the learner's buffer said the stream was in a burst of few
    #: classes (:meth:`~streamxm.buffer.replay.ReplayBuffer.bursty`).
    pairs_in_burst: int = 0
    update_seconds_sum: float = 0.0
    drift_detected: int = 0
    triplets: dict[str, int] = field(default_factory=_zeros)
    mistakes: dict[str, int] = field(default_factory=_zeros)
    loss: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    rolling_map: dict[str, float | None] = field(
        default_factory=lambda: dict.fromkeys(DIRECTIONS, None)
    )
    #: Per-pair update latency histogram: counts per bucket of ``UPDATE_BUCKETS``.
    update_buckets: tuple[int, ...] = (0,) * len(UPDATE_BUCKETS)

    @classmethod
    def of_learner(cls, learner: StreamLearner | None, **fields: Any) -> WorkerStats:
        """The record of ``learner`` (none yet: only ``fields``), with the worker's own
        ``fields`` (version, position, times, dead letters, consumer)."""
        if learner is None:
            return cls(**fields)
        return cls(
            **fields,
            pairs_processed=learner.pairs_seen,
            pairs_unlabelled=learner.pairs_unlabelled,
            pairs_in_burst=learner.pairs_in_burst,
            update_seconds_sum=learner.update_seconds,
            drift_detected=learner.drift.detections,
            triplets=dict(learner.stats.triplets),
            mistakes=dict(learner.stats.mistakes),
            loss=dict(learner.stats.loss),
            rolling_map=learner.rolling_map(),
            update_buckets=tuple(learner.update_hist),
        )

    def to_hash(self) -> dict[str, str]:
        fields = {
            "last_id": self.last_id,
            "dead_letters": str(self.dead_letters),
            "consumer": self.consumer,
            "pairs_processed": str(self.pairs_processed),
            "pairs_unlabelled": str(self.pairs_unlabelled),
            "pairs_in_burst": str(self.pairs_in_burst),
            "update_seconds_sum": repr(self.update_seconds_sum),
            "drift_detected": str(self.drift_detected),
        }
        if self.version is not None:
            fields["version"] = str(self.version)
        if self.checkpoint_time is not None:
            fields["checkpoint_time"] = repr(self.checkpoint_time)
        if self.learned_time is not None:
            fields["learned_time"] = repr(self.learned_time)
        for d in DIRECTIONS:
            fields[f"triplets_{d}"] = str(self.triplets[d])
            fields[f"mistakes_{d}"] = str(self.mistakes[d])
            fields[f"loss_{d}"] = repr(self.loss[d])
            value = self.rolling_map[d]
            fields[f"rolling_map_{d}"] = "" if value is None else repr(value)
        for bound, count in zip(UPDATE_BUCKETS, self.update_buckets, strict=True):
            fields[f"update_bucket_{bound}"] = str(count)
        return fields

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> WorkerStats:
        def number(key: str) -> float:
            value = raw.get(key, "")
            return float(value) if value else 0.0

        return cls(
            version=int(raw["version"]) if raw.get("version") else None,
            last_id=raw.get("last_id", "0-0"),
            checkpoint_time=float(raw["checkpoint_time"]) if raw.get("checkpoint_time") else None,
            learned_time=float(raw["learned_time"]) if raw.get("learned_time") else None,
            dead_letters=int(number("dead_letters")),
            consumer=raw.get("consumer", ""),
            pairs_processed=int(number("pairs_processed")),
            pairs_unlabelled=int(number("pairs_unlabelled")),
            pairs_in_burst=int(number("pairs_in_burst")),
            update_seconds_sum=number("update_seconds_sum"),
            drift_detected=int(number("drift_detected")),
            triplets={d: int(number(f"triplets_{d}")) for d in DIRECTIONS},
            mistakes={d: int(number(f"mistakes_{d}")) for d in DIRECTIONS},
            loss={d: number(f"loss_{d}") for d in DIRECTIONS},
            rolling_map={
                d: float(raw[f"rolling_map_{d}"]) if raw.get(f"rolling_map_{d}") else None
                for d in DIRECTIONS
            },
            update_buckets=tuple(int(number(f"update_bucket_{b}")) for b in UPDATE_BUCKETS),
        )
