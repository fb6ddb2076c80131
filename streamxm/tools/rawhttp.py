"""A minimal HTTP/1.1 client over one keep-alive socket: the query benchmark's clients, so the
client's own cost (httpx's is several times the API's) does not set the figures."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

import httpx

__all__ = ["Answer", "host_port", "post_each", "raw_request", "run_clients"]


@dataclass
class Answer:
    """What one search answered: which request body, the version (an ensemble: its members'),
    its lag and the ids."""

    body: int  # index into the request bodies
    versions: tuple[tuple[str, int], ...]  # (model, version) that scored, sorted
    lag_s: float
    ids: list[str]


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, bytes]:
    """One keep-alive HTTP/1.1 exchange: status and body (the API always sends a length)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if match is None:
        raise ConnectionError("answer without content-length")
    return status, await reader.readexactly(int(match.group(1)))


def host_port(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port or 80


def raw_request(url: str, path: str, content_type: str, body: bytes) -> bytes:
    """One POST as bytes on the wire, encoded once before the clock starts."""
    host, port = host_port(url)
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: {content_type}"
        f"\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def post_each(url: str, requests: list[bytes], clients: int) -> float:
    """Post every request once over ``clients`` keep-alive connections (each takes the next
    one not yet sent); seconds from the first byte to the last answer. Any answer but 202
    is an error: the figure is of pairs accepted."""
    host, port = host_port(url)
    connections = [await asyncio.open_connection(host, port) for _ in range(clients)]
    queue = iter(requests)

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for request in queue:
            status, answer = await _post(reader, writer, request)
            if status != 202:
                raise RuntimeError(f"{request[:40]!r}...: {status} {answer[:200]!r}")

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(r, w) for r, w in connections))
        return time.perf_counter() - start
    finally:
        for _, writer in connections:
            writer.close()


async def run_clients(
    url: str,
    bodies: list[bytes],
    clients: int,
    seconds: float,
    refusals: dict[str, int] | None = None,
) -> tuple[list[float], dict[str, int], list[Answer]]:
    """``clients`` keep-alive connections posting ``bodies`` to ``/v1/search`` in turn;
    ``refusals`` (when given) counts the first few distinct ``detail``s of non-200 answers.

    Written on raw asyncio streams with the requests encoded once, like ``wrk``: the load
    generator shares the machine's two cores with the API and the worker, and an HTTP client
    library's per-request CPU cost (httpx's is of the order of the API's own per search) would
    take them from the server measured.
    """
    host, port = host_port(url)
    requests = [raw_request(url, "/v1/search", "application/json", body) for body in bodies]
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    answers: list[Answer] = []
    deadline = time.perf_counter() + seconds

    async def one(worker: int) -> None:
        i = worker
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                try:
                    status, body = await _post(reader, writer, requests[i % len(requests)])
                except (OSError, asyncio.IncompleteReadError) as exc:
                    key = type(exc).__name__
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                else:
                    key = str(status)
                    if status == 200:
                        latencies.append(time.perf_counter() - start)
                        found = json.loads(body)
                        named = found["members"] or {found["model"]: found["version"]}
                        answers.append(
                            Answer(
                                i % len(bodies),
                                tuple(sorted(named.items())),
                                float(found["version_lag_s"]),
                                [hit["id"] for hit in found["results"]],
                            )
                        )
                    elif refusals is not None:
                        _count_refusal(refusals, status, body)
                statuses[key] = statuses.get(key, 0) + 1
                i += clients
        finally:
            writer.close()

    await asyncio.gather(*(one(w) for w in range(clients)))
    return latencies, statuses, answers


def _count_refusal(refusals: dict[str, int], status: int, body: bytes, distinct: int = 5) -> None:
    """Count a non-200 answer under its status and the start of its ``detail`` (at most
    ``distinct`` keys; the rest under ``"other"``)."""
    try:
        detail = str(json.loads(body).get("detail", ""))[:160]
    except (ValueError, AttributeError):
        detail = body[:160].decode("utf-8", "replace")
    key = f"{status}: {detail}"
    if key not in refusals and len(refusals) >= distinct:
        key = "other"
    refusals[key] = refusals.get(key, 0) + 1
