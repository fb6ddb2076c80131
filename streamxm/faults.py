"""Fail points: named places where a fault-injection test may freeze a process or make it raise.

Tests kill workers at random moments, but "during a checkpoint write" is a window of
milliseconds. A fail point widens it: with ``STREAMXM_FAULT_PAUSE="checkpoint.partial_write:5"``
the process sleeps five seconds when it reaches that point (here: half of a checkpoint file
written), so a test can SIGKILL it exactly there. ``STREAMXM_FAULT_RAISE="learn:p42"`` makes the
learner raise :class:`InjectedFault` whenever it learns the pair whose producer id is ``p42``
(after the pairs before it in the same batch were applied), and ``learn:p42*2`` only the first
two times in the process: a permanent and a transient failure inside learning. Without the
variables every point is a no-op costing one dictionary lookup; production never sets them.

Pause points: ``checkpoint.partial_write`` (directory store, half the bytes of the new version in
its temporary file), ``checkpoint.before_commit`` (directory store, the new version's file on
disk, the transaction with the head and the acknowledgements not yet sent),
``checkpoint.before_exec`` (Redis store, transaction built, not sent). Raise points: ``learn``.

Examples
--------
>>> pause_point("checkpoint.partial_write")  # inert unless the variable names it
>>> raise_point("learn", "p42")
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from functools import lru_cache

__all__ = ["InjectedFault", "pause_point", "raise_point"]

log = logging.getLogger(__name__)

ENV = "STREAMXM_FAULT_PAUSE"
RAISE_ENV = "STREAMXM_FAULT_RAISE"

_raised: Counter[tuple[str, str]] = Counter()  # raise points fired so far in this process


class InjectedFault(RuntimeError):
    """Raised by a raise point that ``STREAMXM_FAULT_RAISE`` names."""


@lru_cache(maxsize=1)
def _pauses(raw: str) -> dict[str, float]:
    out = {}
    for item in raw.split(","):
        name, _, seconds = item.strip().partition(":")
        if name:
            out[name] = float(seconds or 1.0)
    return out


@lru_cache(maxsize=1)
def _raises(raw: str) -> dict[tuple[str, str], int | None]:
    """``name:target[*times]`` items -> how often each fires (None: every time)."""
    out: dict[tuple[str, str], int | None] = {}
    for item in raw.split(","):
        name, _, target = item.strip().partition(":")
        target, star, times = target.partition("*")
        if name and target:
            out[name, target] = int(times) if star else None
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


def raise_point(name: str, target: str) -> None:
    """Raise :class:`InjectedFault` if ``STREAMXM_FAULT_RAISE`` names ``name:target``."""
    raw = os.environ.get(RAISE_ENV)
    if not raw:
        return
    key = (name, target)
    rules = _raises(raw)
    if key not in rules:
        return
    times = rules[key]
    if times is not None and _raised[key] >= times:
        return
    _raised[key] += 1
    log.warning("fail point %s:%s raising (pid %d)", name, target, os.getpid())
    raise InjectedFault(f"fail point {name}:{target}")
