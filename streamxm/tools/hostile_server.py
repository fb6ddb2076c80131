"""A real HTTP/1.1 server on loopback that answers as a broken or malicious API would: bodies
without end, compression bombs, pages that are not JSON, JSON nested past any parser, limits of
the wrong type, a push answered with too few entry ids. The client's tests and
``streamxm bench hostile --client`` point :class:`~streamxm.client.Client` at it."""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import zlib
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["HostileServer", "chunked_flood", "gzip_bomb", "plain"]

#: Writes one answer to the client's socket.
Handler = Callable[[socket.socket], None]


def plain(
    status: int, body: bytes, content_type: str = "application/json", extra: str = ""
) -> Handler:
    """A whole answer with its length."""

    def send(conn: socket.socket) -> None:
        head = (
            f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n"
        )
        conn.sendall(head.encode() + body)

    return send


def chunked_flood(total: int, status: int = 200) -> Handler:
    """``total`` bytes of JSON-looking text in 64 KiB chunks, until the client hangs up."""
    chunk = b"[" * 65_536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"

    def send(conn: socket.socket) -> None:
        conn.sendall(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            "transfer-encoding: chunked\r\n\r\n".encode()
        )
        for _ in range(total // len(chunk)):
            conn.sendall(frame)
        conn.sendall(b"0\r\n\r\n")

    return send


@cache
def _bomb(size: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\0" * (1 << 20)
    parts = [packer.compress(block) for _ in range(size >> 20)]
    return b"".join([*parts, packer.flush()])


def gzip_bomb(size: int, status: int = 200) -> Handler:
    """A gzip body of ``size`` zero bytes (1 GiB packs into about 1 MB)."""
    return plain(status, _bomb(size), extra="content-encoding: gzip\r\n")


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def limits_json(**fields: Any) -> bytes:
    return json.dumps({"role": "all", "max_batch": 1024, **fields}).encode()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        conn: socket.socket = self.request
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65_536)
            if not more:
                return
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        line = head.split(b"\r\n", 1)[0].decode(errors="replace").split()
        length = 0
        for header in head.split(b"\r\n")[1:]:
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip() or 0)
        while len(body) < length:
            more = conn.recv(65_536)
            if not more:
                return
            body += more
        path = line[1] if len(line) > 1 else "/"
        self.server.seen.append(path)
        handler = self.server.answers.get(path, plain(404, b'{"detail":"not here"}'))
        with contextlib.suppress(OSError):  # the client hung up: what a cap should do
            handler(conn)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, answers: dict[str, Handler]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answers = answers
        self.seen: list[str] = []


class HostileServer:
    """Serves ``answers`` (path -> handler) on a loopback port, in a thread, until closed;
    ``seen`` lists the paths asked for."""

    def __init__(self, answers: dict[str, Handler]) -> None:
        self._server = _Server(answers)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def seen(self) -> list[str]:
        return self._server.seen

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
