"""The learner worker and the gallery indexer as processes: run until SIGTERM/SIGINT, then
commit and exit (``streamxm worker``, ``streamxm indexer``)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from streamxm.config import Settings
from streamxm.models import check_params
from streamxm.service import build_indexer, build_worker
from streamxm.stream.redis_conn import connect
from streamxm.threads import thread_report

__all__ = ["run_indexer", "run_worker"]

log = logging.getLogger(__name__)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: finishing the batch, committing and stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def run_worker(
    settings: Settings,
    model: str,
    params: dict[str, Any] | None = None,
    world: int = 1,
    rank: int = 0,
) -> int:
    """Learn ``model`` from the namespace's stream until a signal; returns the exit code.
    With ``world > 1`` this process is rank ``rank`` of a distributed learner."""
    if not 0 <= rank < max(world, 1):
        raise SystemExit(f"--rank must be in 0..{world - 1}, got {rank}")
    check_params(model, params)  # before the lease, the ranks or a standby's wait
    log.info("worker for %s: compute threads %s", model, thread_report())
    stop = _stop_on_signals()
    # No silent command retries: the worker handles a lost connection itself (reload, replay).
    client = connect(settings, retries=0)
    if rank > 0:
        from streamxm.worker.ranks import RankFollower  # torch: the ``sam`` extra

        RankFollower(
            client,
            model,
            rank,
            world,
            namespace=settings.namespace,
            timeout_s=settings.dist_timeout_s,
            host=settings.dist_host,
        ).run(stop)
        return 0
    build_worker(settings, client, model, params=params, world=world).run(stop)
    return 0


def run_indexer(settings: Settings) -> int:
    """Keep the namespace's gallery segments current until a signal (``streamxm indexer``)."""
    stop = _stop_on_signals()
    build_indexer(settings, connect(settings, retries=0)).run(stop)
    return 0
