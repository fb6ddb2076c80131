"""Drift detection on the learner's mistakes: river's ADWIN over one mistake indicator per pair.

Models record their triplets at different moments: CMOS when it merges a block of updates, SAM
once per mini-batch step for hundreds of triplets, the statistics models one observed triplet per
pair. Fed to ADWIN as they land (all of a step's mistakes, then all its correct ones), every
block would look like a change in the mistake rate, and a SAM run raised about a thousand alarms.
So ADWIN sees one value per *pair*: the mistake rate of the triplets that landed since the last
value, spread evenly over the pairs they cover and turned into 0/1 by error diffusion (a running
carry: over any stretch the share of ones equals the rate, with no block structure). The input is
then on the scale of a per-pair Bernoulli mistake, the same for every model, so a real change in
the rate (a label switch) is found within a few dozen to a few hundred pairs while a model that
is slowly getting better does not raise alarms.

Only a *rise* in the mistake rate counts as drift: a fall is the model learning. river's ADWIN
restarts its window after any change it finds, which after a fall would leave it blind to a rise
that follows within a few dozen pairs (nothing left to compare with); so after a fall the last
``warm_up`` values are fed again to the fresh window. The same values, kept in checkpoints, warm up
the window of a restored learner.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from river import drift

__all__ = ["DriftMonitor"]

log = logging.getLogger(__name__)


class DriftMonitor:
    """Counts the changes ADWIN finds in a model's mistake rate.

    The counts, the stream positions of the last ``keep`` detections and the last ``warm_up``
    values fed go into checkpoints; ADWIN's window does not (it is river's object, and
    checkpoints hold no pickles), so a restored learner warms a fresh window up from those
    values.

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

    A step of 400 triplets every 4 pairs at a steady 30% mistakes raises nothing:

    >>> steady = DriftMonitor()
    >>> for pair in range(4000):
    ...     _ = steady.follow(mistakes=(pair // 4) * 120, triplets=(pair // 4) * 400,
    ...                       position=pair)
    >>> steady.detections
    0
    """

    def __init__(self, delta: float = 0.002, keep: int = 100, warm_up: int = 64) -> None:
        self.delta = delta
        self.keep = keep
        self.adwin = drift.ADWIN(delta=delta)  # type: ignore[no-untyped-call]
        self.recent: deque[int] = deque(maxlen=warm_up)  # the last values fed
        self.detections = 0
        self.positions: list[int] = []
        self.fed = (0, 0)  # the (mistakes, triplets) totals fed so far
        self.waiting = 0  # pairs seen since triplets last landed
        self.carry = 0.0  # error diffusion's running remainder

    def follow(self, mistakes: int, triplets: int, position: int) -> bool:
        """Called once per pair with the running totals: models that defer their updates (CMOS
        merges them at the next flush, SAM steps every few pairs) count a pair's triplets late,
        and this spreads them over the pairs they cover whenever they land."""
        new_mistakes, new_triplets = mistakes - self.fed[0], triplets - self.fed[1]
        self.fed = (mistakes, triplets)
        return self.update(new_mistakes, new_triplets, position)

    def update(self, mistakes: int, triplets: int, position: int) -> bool:
        """One pair at stream index ``position`` done; ``mistakes`` of ``triplets`` triplets
        landed with it (none: they land later, with a following pair). Returns whether a change
        was detected."""
        self.waiting += 1
        if triplets <= 0:
            return False
        rate = mistakes / triplets
        found = False
        for _ in range(self.waiting):
            self.carry += rate
            bit = int(self.carry >= 0.5)
            self.carry -= bit
            before = self.adwin.estimation
            self.adwin.update(float(bit))  # type: ignore[no-untyped-call]
            self.recent.append(bit)
            if self.adwin.drift_detected:
                if self.adwin.estimation > before:
                    found = True
                else:  # a fall: give the restarted window the recent past to compare with
                    self._warm_up()
        self.waiting = 0
        if found:
            self.detections += 1
            self.positions = [*self.positions, position][-self.keep :]
            log.warning(
                "drift: the mistake rate changed at stream position %d (ADWIN, delta=%g)",
                position,
                self.delta,
            )
        return found

    def _warm_up(self) -> None:
        self.adwin = drift.ADWIN(delta=self.delta)  # type: ignore[no-untyped-call]
        for value in self.recent:
            self.adwin.update(float(value))  # type: ignore[no-untyped-call]

    def state(self) -> dict[str, Any]:
        return {
            "delta": self.delta,
            "keep": self.keep,
            "detections": self.detections,
            "positions": self.positions,
            "fed": list(self.fed),
            "waiting": self.waiting,
            "carry": self.carry,
            "recent": list(self.recent),
        }

    @classmethod
    def from_state(cls, meta: dict[str, Any]) -> DriftMonitor:
        monitor = cls(float(meta["delta"]), int(meta["keep"]))
        monitor.detections = int(meta["detections"])
        monitor.positions = [int(p) for p in meta["positions"]]
        monitor.fed = (int(meta["fed"][0]), int(meta["fed"][1]))
        monitor.waiting = int(meta.get("waiting", 0))  # absent from older checkpoints
        monitor.carry = float(meta.get("carry", 0.0))
        monitor.recent.extend(int(v) for v in meta.get("recent", ()))
        monitor._warm_up()
        return monitor
