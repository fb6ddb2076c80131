"""Issue 58's HTTP edge cases, over raw sockets against the real app under uvicorn: a path that
is not in plain form (percent-encoding, dot segments, ``//``, backslashes) is refused before
routing, and a request framed by both Content-Length and Transfer-Encoding is refused and its
connection closed, so nothing after it is answered as a request of its own."""

from __future__ import annotations

import socket

import pytest
import redis

from streamxm.config import Settings
from streamxm.stream.keys import Keys
from streamxm.stream.messages import FRAMES_MEDIA_TYPE, encode_frames, make_pair
from tests.conftest import ApiServer
from tests.test_api_hostile import _closed_by_server, _connect


def _frames() -> bytes:
    return encode_frames([make_pair("edge", [0.5] * 8, [0.5] * 4)])


def _request(method: str, path: str, body: bytes = b"", media: str = "application/json") -> bytes:
    """One request as a client that sends its path exactly as written would."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if method == "POST":
        head += f"Content-Type: {media}\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


def _exchange(api: ApiServer, data: bytes) -> tuple[bytes, bool]:
    """Send ``data`` on one connection; everything the server answers, and whether it closed
    the connection itself (within the socket's timeout, shorter than the 5 s keep-alive)."""
    sock = _connect(api.url)
    sock.settimeout(3)
    with sock:
        sock.sendall(data)
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except TimeoutError:
            return reply, False
        except ConnectionResetError:
            pass
        return reply, True


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/%76%31/pairs/frames"),  # /v1/pairs/frames, every letter of the prefix encoded
        ("POST", "/v1/pairs/%66rames"),
        ("POST", "/v1/%70airs/frames"),
        ("GET", "/v1/mod%65ls"),
        ("GET", "/v1/models%20"),
        ("POST", "/v1%2Fpairs%2Fframes"),  # an encoded slash, refused as before
        ("POST", "/v1/pairs/./frames"),
        ("POST", "/v1/x/../pairs/frames"),
        ("POST", "/v1//pairs/frames"),
        ("POST", "//v1/pairs/frames"),
        ("POST", "/v1\\pairs/frames"),
        ("GET", "/v1/models/.."),
    ],
)
def test_a_path_not_in_plain_form_is_refused_before_routing(
    api: ApiServer, r: redis.Redis, settings: Settings, method: str, path: str
) -> None:
    """The server decodes ``%76`` to ``v`` before routing, so ``/%76%31/pairs/frames`` reached
    the write route past a proxy that guards ``/v1/pairs`` by its raw prefix: every
    percent-encoding in the path, every dot segment, ``//`` and backslash is now a 400 (and the
    frames never reach the stream)."""
    pairs = Keys(settings.namespace).pairs
    before = r.xlen(pairs)
    reply, _ = _exchange(api, _request(method, path, _frames(), FRAMES_MEDIA_TYPE))
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"the path must be plain" in reply
    assert r.xlen(pairs) == before


def test_a_plain_path_is_served_and_the_query_string_may_be_encoded(api: ApiServer) -> None:
    reply, _ = _exchange(api, _request("POST", "/v1/pairs/frames", _frames(), FRAMES_MEDIA_TYPE))
    assert reply.startswith(b"HTTP/1.1 202"), reply[:300]
    reply, _ = _exchange(api, _request("GET", "/v1/models?next=%2Fv1%2F..%2Fpairs%76"))
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n",
        b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n",
    ],
)
def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
    api: ApiServer, framing: bytes
) -> None:
    """Read as chunked, the bytes after the last chunk were answered as a second request: a
    proxy that framed the body by Content-Length forwards them as part of the first, so a
    request it never saw (here ``GET /v1/models``) was smuggled past it and answered 200. Now
    the ambiguous request gets a 400 and the connection is closed: one answer, nothing more."""
    request = b"POST /v1/pairs HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n0\r\n\r\n"
    reply, closed = _exchange(api, request + SMUGGLED)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    assert b"200 OK" not in reply
    assert closed and b"connection: close" in reply.lower()


def _one_response(sock: socket.socket) -> bytes:
    """The next response on a keep-alive connection: its head, then Content-Length bytes."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    assert len(body) == length, "a response longer than it declared"
    return head


def test_a_request_with_one_framing_keeps_its_connection(api: ApiServer) -> None:
    """Chunked alone, or Content-Length alone, is served and the connection kept alive for the
    next request."""
    empty = b'{"pairs": []}'
    framings = [
        (b"Transfer-Encoding: chunked\r\n", b"d\r\n" + empty + b"\r\n0\r\n\r\n"),
        (b"Content-Length: 13\r\n", empty),
    ]
    with _connect(api.url) as sock:
        for framing, body in framings:
            sock.sendall(
                b"POST /v1/pairs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\n" + framing + b"\r\n" + body
            )
            assert _one_response(sock).startswith(b"HTTP/1.1 "), framing
        sock.sendall(SMUGGLED)
        assert _one_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _one_response(sock).startswith(b"HTTP/1.1 200")
        assert _closed_by_server(sock)
