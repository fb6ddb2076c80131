"""The harness every load benchmark runs in: a fresh embedded Redis in a temporary directory,
``streamxm api``, ``streamxm worker`` and ``streamxm indexer`` as child processes exactly as a
user runs them, and the measurements they share (CPU seconds, resident memory, percentiles)."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis

from streamxm.config import Settings
from streamxm.stream.keys import Keys
from streamxm.stream.messages import (
    Pair,
)
from streamxm.stream.redis_conn import EmbeddedRedis, connect, str_hash
from streamxm.tools.processes import Child
from streamxm.tools.waiting import free_port, wait_for

__all__ = [
    "NAMESPACE",
    "Stack",
    "b64_float32",
    "cpu_seconds",
    "pair_json",
    "percentile",
    "rss_mb",
    "stack",
]


NAMESPACE = "load"


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``; ``None``: this one)."""
    fields = Path(f"/proc/{pid or 'self'}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident set size of a process, MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Stack:
    """A private Redis plus the processes a benchmark starts against it."""

    root: Path
    redis_server: EmbeddedRedis
    settings: Settings
    r: redis.Redis
    env: dict[str, str]
    procs: list[Child]

    @property
    def keys(self) -> Keys:
        return Keys(self.settings.namespace)

    def spawn(self, *args: str, **env: str) -> Child:
        child = Child(
            *args,
            env={**self.env, **env},
            log=self.root / f"{args[0]}-{len(self.procs)}.log",
            die_with_parent=True,
        )
        self.procs.append(child)
        return child

    def api(self, **env: str) -> str:
        port = free_port()
        self.spawn("api", STREAMXM_API_PORT=str(port), **env)
        url = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200,
            60,
            f"the API to start (its log is in {self.root})",
            tolerate=(httpx.TransportError,),
        )
        return url

    def stats(self, model: str = "cmos") -> dict[str, str]:
        return str_hash(self.r.hgetall(self.keys.stats(model)))

    def processed(self, model: str = "cmos") -> int:
        return int(self.stats(model).get("pairs_processed", 0))


@contextlib.contextmanager
def stack(**settings: Any) -> Iterator[Stack]:
    """Fresh Redis (AOF on, as the embedded default) in a temporary directory; children are
    stopped and everything removed on exit."""
    root = Path(tempfile.mkdtemp(prefix="sxm-load-"))
    server = EmbeddedRedis(root / "redis")
    url = server.start()
    values: dict[str, Any] = {
        "redis_url": url,
        "namespace": NAMESPACE,
        "data_dir": root / "data",
        "checkpoint_dir": root / "checkpoints",
        **settings,
    }
    cfg = Settings(_env_file=None, **values)  # type: ignore[call-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMXM_")}
    env.update({f"STREAMXM_{k.upper()}": str(v) for k, v in values.items()}, STREAMXM_THREADS="1")
    st = Stack(root, server, cfg, connect(cfg), env, [])
    terminated = _exit_on_sigterm()
    try:
        yield st
    finally:
        if terminated is not None:
            signal.signal(signal.SIGTERM, terminated)
        for child in st.procs:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)  # all at once, then wait for each
        for child in st.procs:
            child.stop(timeout=30)
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _exit_on_sigterm() -> Any:
    """While a stack runs in the main thread, SIGTERM raises ``SystemExit`` (as Ctrl-C raises
    ``KeyboardInterrupt``), so the stack's cleanup stops its processes and Redis; returns the
    handler to put back (``None`` off the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def pair_json(pair: Pair, binary: bool = False) -> dict[str, Any]:
    """A pair as ``POST /v1/pairs`` takes it: vectors as JSON numbers, or as base64 strings of
    little-endian float32 bytes (``binary``)."""

    def vector(x: Any) -> Any:
        return b64_float32(x) if binary else x.tolist()

    return {
        "id": pair.id,
        "img": vector(pair.img),
        "txt": vector(pair.txt),
        "labels": list(pair.labels),
    }


def b64_float32(vector: Any) -> str:
    """A vector as the API's binary form: base64 of its little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")
