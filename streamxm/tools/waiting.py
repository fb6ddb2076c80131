"""Small process-orchestration helpers shared by the demo, the load benchmarks and the tests."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "wait_for"]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.05,
    tolerate: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``predicate`` until it returns something truthy and return that; exceptions of the
    ``tolerate`` types count as "not yet". :class:`TimeoutError` after ``timeout`` seconds.

    Examples
    --------
    >>> wait_for(lambda: 42, 1.0, "the answer")
    42
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except tolerate:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
