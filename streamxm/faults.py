"""Fail points: named places where a fault-injection test may freeze a process.

Tests kill workers at random moments, but "during a checkpoint write" is a window of
milliseconds. A fail point widens it: with ``STREAMXM_FAULT_PAUSE="checkpoint.partial_write:5"``
the process sleeps five seconds when it reaches that point (here: half of a checkpoint file
written), so a test can SIGKILL it exactly there. Without the variable every point is a no-op
costing one dictionary lookup; production deployments never set it.

Points: ``checkpoint.partial_write`` (directory store, half the bytes of the new version in its
temporary file), ``checkpoint.before_commit`` (the new version on disk, head updated, the Redis
transaction with the acknowledgements not yet sent), ``checkpoint.before_exec`` (Redis store,
transaction built, not sent).

Examples
--------
>>> pause_point("checkpoint.partial_write")  # inert unless the variable names it
"""

from __future__ import annotations

import logging
import os
import time
from functools import lru_cache

__all__ = ["pause_point"]

log = logging.getLogger(__name__)

ENV = "STREAMXM_FAULT_PAUSE"


@lru_cache(maxsize=1)
def _pauses(raw: str) -> dict[str, float]:
    out = {}
    for item in raw.split(","):
        name, _, seconds = item.strip().partition(":")
        if name:
            out[name] = float(seconds or 1.0)
    return out


def pause_point(name: str) -> None:
    """Sleep here if ``STREAMXM_FAULT_PAUSE`` names this point (``name:seconds,...``)."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    seconds = _pauses(raw).get(name)
    if seconds:
        log.warning("fail point %s: pausing %.1f s (pid %d)", name, seconds, os.getpid())
        time.sleep(seconds)
