"""The embedded Redis lives as long as the streamxm processes that use it: the last to exit
stops it and says so, unless ``streamxm redis start`` started it on purpose (real processes,
a real redis-server, real signals)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from streamxm.stream.redis_conn import EmbeddedRedis
from streamxm.tools.processes import Child
from tests.conftest import free_port, run_cli, wait_for

pytestmark = pytest.mark.slow


def _env(data: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMXM_")}
    return {**env, "STREAMXM_DATA_DIR": str(data), "STREAMXM_BLOCK_MS": "50"}


def _interrupt(child: Child) -> str:
    """Ctrl-C, as in a terminal; what the process said on its way out."""
    child.proc.send_signal(signal.SIGINT)
    child.proc.wait(timeout=30)
    return "\n".join(child.lines)


def test_the_last_process_to_exit_stops_the_embedded_redis(tmp_path: Path) -> None:
    data = tmp_path / "d"
    server = EmbeddedRedis(data / "redis")
    port = free_port()
    worker = Child("worker", "--model", "cmos", env=_env(data), watch=True)
    api = Child("api", "--port", str(port), env=_env(data), watch=True)
    try:
        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200,
            60,
            "the API",
            tolerate=(httpx.HTTPError,),
        )
        wait_for(lambda: len(server.live_users()) == 2, 30, "both to use the embedded Redis")
        said = _interrupt(worker)
        assert "keeps running for 1 other streamxm process" in said, said[-2000:]
        assert server.is_running()
        said = _interrupt(api)
        assert "stopped the embedded Redis" in said, said[-2000:]
        assert not server.is_running() and server.live_users() == []
    finally:
        for child in (worker, api):
            if child.proc.poll() is None:
                child.proc.kill()
        server.stop()


def test_a_redis_started_on_purpose_keeps_running(tmp_path: Path) -> None:
    data = tmp_path / "d"
    server = EmbeddedRedis(data / "redis")
    started = run_cli("redis", "start", env=_env(data))
    assert started.returncode == 0, started.stderr
    try:
        pushed = run_cli("push", "--dataset", "wiki", "--limit", "20", env=_env(data), timeout=120)
        assert pushed.returncode == 0, pushed.stderr
        assert "`streamxm redis start` started it" in pushed.stderr
        assert server.is_running()
        stopped = run_cli("redis", "stop", env=_env(data))
        assert "stopped the embedded Redis" in stopped.stdout and not server.is_running()
        # Without the pin, a push that started it stops it when done.
        pushed = run_cli("push", "--dataset", "wiki", "--limit", "20", env=_env(data), timeout=120)
        assert pushed.returncode == 0 and "stopped the embedded Redis" in pushed.stderr
        assert not server.is_running()
    finally:
        server.stop()
