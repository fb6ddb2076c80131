"""The HTTP server's connection handling: uvicorn's h11 protocol with a read deadline.

uvicorn times out idle keep-alive connections but not a client that sends its request slowly: a
few bytes of header every few seconds hold a connection (and its memory) forever, and enough of
them exhaust the server. Here every request's headers *and* body must arrive within
``read_timeout`` seconds of the connection opening or of the previous response; otherwise the
connection is closed. Time the application spends answering does not count.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from streamxm.config import Settings

__all__ = ["guarded_h11", "server_options"]


class _ReadDeadlineH11(H11Protocol):
    read_timeout = 30.0
    _read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection gets a deadline of its own

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._expired)

    def _expired(self) -> None:
        self._read_deadline = None
        cycle = self.cycle
        # Still reading: no request yet (or only the previous one's), or its body incomplete.
        reading = cycle is None or cycle.response_complete or cycle.more_body
        if reading and not self.transport.is_closing():
            self.logger.info(
                "closing a connection that sent no complete request in %.0f s", self.read_timeout
            )
            self.transport.close()


def guarded_h11(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a per-request read deadline of ``read_timeout`` s."""
    return type("ReadDeadlineH11", (_ReadDeadlineH11,), {"read_timeout": read_timeout})


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn options every API server of the project runs with."""
    return {"http": guarded_h11(settings.request_read_timeout_seconds), "timeout_keep_alive": 5}


def freeze_startup_objects() -> None:
    """Leave the objects made at import time out of every later garbage collection.

    PyTorch, FastAPI and pydantic leave hundreds of thousands of long-lived objects after
    import, and each full collection walks all of them: in ``bench query`` at 100,000 items
    those pauses set the p99 latency, far above the median. Frozen, a full collection only
    walks what the server made since; call it once the app is imported, before serving.
    """
    gc.collect()
    gc.freeze()
