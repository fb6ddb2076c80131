"""The learner worker as a process: run one model's learner until SIGTERM/SIGINT, then
checkpoint and exit (``streamxm worker``)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.redis_conn import connect

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


def run_worker(settings: Settings, model: str, params: dict[str, Any] | None = None) -> int:
    """Learn ``model`` from the namespace's stream until a signal; returns the exit code."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: finishing the batch, checkpointing and stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # No silent command retries: the worker handles a lost connection itself (reload, replay).
    worker = build_worker(settings, connect(settings, retries=0), model, params=params)
    worker.run(stop)
    return 0
