"""``streamxm bench hostile``'s client side: :class:`~streamxm.client.Client` pointed at a
malicious server (:mod:`streamxm.tools.hostile_server`), each case in a fresh process so its
peak resident memory is the client's own: an endless chunked body, a gzip bomb, a page instead
of JSON on a push's 202, JSON nested past the parser, limits of the wrong type and a push
answered with too few entry ids. Reports what the client raised, how long it took and its
peak memory beside the same process's memory before the call."""

from __future__ import annotations

import multiprocessing
import resource
import sys
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from streamxm.tools.hostile_server import (
    Handler,
    HostileServer,
    chunked_flood,
    deep_json,
    gzip_bomb,
    limits_json,
    plain,
)

__all__ = ["client_cases"]

_LIMITS = plain(200, limits_json(max_batch=5))


def _cases(gib: float) -> dict[str, tuple[str, dict[str, Handler]]]:
    """Each case: the client call, and the server's answers by path."""
    size = int(gib * (1 << 30))
    return {
        "chunked_body": ("models", {"/v1/models": chunked_flood(size)}),
        "gzip_bomb": ("models", {"/v1/models": gzip_bomb(size)}),
        "html_on_push": (
            "push",
            {
                "/v1/limits": _LIMITS,
                "/v1/pairs/frames": plain(202, b"<html><body>accepted</body></html>", "text/html"),
            },
        ),
        "too_few_entry_ids": (
            "push",
            {"/v1/limits": _LIMITS, "/v1/pairs/frames": plain(202, b'{"entry_ids": ["1-0"]}')},
        ),
        "deep_json": ("models", {"/v1/models": plain(200, deep_json(100_000))}),
        "limits_of_wrong_type": ("push", {"/v1/limits": plain(200, limits_json(max_batch="x"))}),
    }


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _run_case(call: str, url: str) -> dict[str, Any]:
    """In the child: one client call against the server; what it raised and its memory."""
    from streamxm.client import Client, StreamxmError

    before = _rss_mb()
    started = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        with Client(url, timeout=30) as client:
            if call == "models":
                client.models()
            else:
                rng = np.random.default_rng(0)
                client.push([(f"p{i}", rng.random(8), rng.random(4), [0]) for i in range(5)])
        out["raised"] = None
    except StreamxmError as exc:
        out.update(
            raised=type(exc).__name__,
            message=str(exc)[:200],
            written=getattr(exc, "written", None),
            unconfirmed=exc.unconfirmed,
        )
    except Exception as exc:  # anything else is the finding this benchmark looks for
        out.update(raised=type(exc).__name__, message=str(exc)[:200], escaped=True)
    out.update(
        seconds=round(time.perf_counter() - started, 3),
        client_rss_before_mb=round(before, 1),
        client_rss_peak_mb=round(_rss_mb(), 1),
    )
    return out


def _child(call: str, url: str, queue: Any) -> None:
    queue.put(_run_case(call, url))


def client_cases(gib: float = 1.0) -> dict[str, Any]:
    """Every case of :func:`_cases` with bodies of ``gib`` GiB, each in a fresh process."""
    spawn = multiprocessing.get_context("spawn")
    results: dict[str, Any] = {}
    for name, (call, answers) in tqdm(_cases(gib).items(), desc="hostile server", file=sys.stderr):
        with HostileServer(answers) as server:
            queue = spawn.Queue()
            child = spawn.Process(target=_child, args=(call, server.url, queue))
            child.start()
            results[name] = queue.get(timeout=300)
            child.join(timeout=30)
    escaped = [name for name, r in results.items() if r.get("escaped") or not r["raised"]]
    return {
        "body_gib": gib,
        "cases": results,
        "client_rss_peak_mb_max": max(r["client_rss_peak_mb"] for r in results.values()),
        "not_streamxm_errors": escaped,
    }
