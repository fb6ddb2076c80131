"""``streamxm worker``: run one model's learner until SIGTERM/SIGINT, then checkpoint and exit."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from streamxm.config import Settings
from streamxm.redis_conn import connect
from streamxm.service import build_worker

log = logging.getLogger("streamxm.worker")


def run_worker(settings: Settings, model: str, params: dict[str, Any] | None = None) -> int:
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
