"""Drift detection on the learner's mistakes: river's ADWIN over the per-triplet mistake
indicator (1 = the triplet was ranked wrongly before the update)."""

from __future__ import annotations

import logging
from typing import Any

from river import drift

__all__ = ["DriftMonitor"]

log = logging.getLogger(__name__)


class DriftMonitor:
    """Counts the changes ADWIN finds in a model's mistake rate.

    The counts and the stream positions of the last ``keep`` detections go into checkpoints;
    ADWIN's window does not (it is river's object, and checkpoints hold no pickles), so a
    restored learner starts a fresh window and needs a few hundred triplets before it can
    detect again.

    Parameters
    ----------
    delta
        ADWIN's confidence: smaller means fewer false alarms and later detections.
    keep
        Detection positions remembered.

    Examples
    --------
    >>> monitor = DriftMonitor()
    >>> for pair in range(4000):
    ...     _ = monitor.update(mistakes=int(pair >= 2000 and pair % 2 == 0), triplets=1,
    ...                        position=pair)
    >>> monitor.detections >= 1 and 2000 <= monitor.positions[0] < 2300
    True
    """

    def __init__(self, delta: float = 0.002, keep: int = 100) -> None:
        self.delta = delta
        self.keep = keep
        self.adwin = drift.ADWIN(delta=delta)  # type: ignore[no-untyped-call]
        self.detections = 0
        self.positions: list[int] = []
        self.fed = (0, 0)  # the (mistakes, triplets) totals fed so far

    def follow(self, mistakes: int, triplets: int, position: int) -> bool:
        """Feed what running totals gained since the last call: models that defer their
        updates (CMOS merges them at the next flush) count a pair's triplets late, and this
        picks them up whenever they land."""
        new_mistakes, new_triplets = mistakes - self.fed[0], triplets - self.fed[1]
        self.fed = (mistakes, triplets)
        return self.update(new_mistakes, new_triplets, position)

    def update(self, mistakes: int, triplets: int, position: int) -> bool:
        """Feed one pair's triplets (``mistakes`` of them wrong); ``position`` is the pair's
        index in the stream. Returns whether a change was detected."""
        found = False
        for i in range(triplets):
            self.adwin.update(1.0 if i < mistakes else 0.0)  # type: ignore[no-untyped-call]
            found |= self.adwin.drift_detected
        if found:
            self.detections += 1
            self.positions = [*self.positions, position][-self.keep :]
            log.warning("drift: the mistake rate changed at stream position %d "
                        "(ADWIN, delta=%g)", position, self.delta)
        return found

    def state(self) -> dict[str, Any]:
        return {"delta": self.delta, "keep": self.keep, "detections": self.detections,
                "positions": self.positions, "fed": list(self.fed)}

    @classmethod
    def from_state(cls, meta: dict[str, Any]) -> DriftMonitor:
        monitor = cls(float(meta["delta"]), int(meta["keep"]))
        monitor.detections = int(meta["detections"])
        monitor.positions = [int(p) for p in meta["positions"]]
        monitor.fed = (int(meta["fed"][0]), int(meta["fed"][1]))
        return monitor
