"""``streamxm bench hostile``: junk request bodies of growing size and a labels bomb, the
answer's size and the API's memory, and ``/healthz`` latency meanwhile beside its latency at
rest."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any

import httpx
from tqdm import tqdm

from streamxm.stream.messages import (
    FRAMES_MEDIA_TYPE,
    encode_frame,
    encode_pair,
    make_pair,
)
from streamxm.stream.producer import StreamProducer
from streamxm.tools.bench_hostile_client import client_cases
from streamxm.tools.datasets import synthetic_pairs
from streamxm.tools.stack import NAMESPACE, percentile, rss_mb, stack
from streamxm.tools.waiting import wait_for

__all__ = ["hostile"]


# -- hostile bodies ---------------------------------------------------------------------------
def _junk_body(mib: float) -> bytes:
    """A junk body: one image "vector" of strings, ``mib`` MiB long."""
    n = max(1, int(mib * (1 << 20)) // 4)
    return b'{"images":[[' + b",".join([b'"a"'] * n) + b']],"texts":[[1]]}'


def _labels_bomb(mib: float) -> bytes:
    """One message v1 frame of a valid pair whose ``labels`` field is ``1,1,1,...`` (``mib``
    MiB): the API must refuse it by the field's byte limit, which follows from the 64-label
    limit, without first splitting it into ints."""
    fields = encode_pair(make_pair("bomb", [0.5] * 64, [0.5] * 32))
    fields[b"labels"] = b",".join([b"1"] * max(1, int(mib * (1 << 20)) // 2))
    return encode_frame(fields)


def _under_junk(
    url: str, api_pid: int, path: str, body: bytes, content_type: str, repeats: int
) -> dict[str, Any]:
    """``repeats`` posts of ``body`` to ``path`` while a thread probes ``/healthz`` and samples
    the API's resident memory every 10 ms: statuses, answer size and time, probe latency."""
    during: list[float] = []
    peak = [rss_mb(api_pid)]
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=120) as own:
            while not done.is_set():
                start = time.perf_counter()
                own.get(f"{url}/healthz")
                during.append((time.perf_counter() - start) * 1000)
                peak.append(rss_mb(api_pid))
                done.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    seconds, sizes_out, statuses = [], [], set()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            answer = httpx.post(
                f"{url}{path}", content=body, timeout=120, headers={"content-type": content_type}
            )
            seconds.append(time.perf_counter() - start)
            sizes_out.append(len(answer.content))
            statuses.add(answer.status_code)
    finally:
        done.set()
        watcher.join()
    return {
        "status": sorted(statuses),
        "answer_bytes_max": max(sizes_out),
        "answer_seconds_p50": round(statistics.median(seconds), 4),
        "healthz_during_p50_ms": round(percentile(during, 50), 2),
        "healthz_during_max_ms": round(max(during), 2) if during else None,
        "api_rss_peak_mb": round(max(peak), 1),
        "api_rss_after_mb": round(rss_mb(api_pid), 1),
    }


def hostile(
    sizes: str = "1,4,24,64",
    repeats: int = 3,
    probes: int = 200,
    seed: int = 0,
    labels_mib: float = 11.5,
    part: str = "all",
    client_gib: float = 1.0,
) -> dict[str, Any]:
    """Junk bodies of each size (MiB) to ``POST /v1/similarity`` of a serving API, ``repeats``
    times each, while one thread probes ``/healthz``; beside the probe latency at rest in the
    same run. Then the labels bomb: one frame whose ``labels`` field is ``labels_mib`` MiB to
    ``POST /v1/pairs/frames`` (inside the default body limit). Reports the answer's status and
    size, the time to answer, the probe latency while junk is being processed, and the API's
    resident memory (peak sampled every 10 ms).

    ``part``: ``server`` (the above), ``client`` (the client against a malicious server,
    :func:`~streamxm.tools.bench_hostile_client.client_cases`, bodies of ``client_gib`` GiB)
    or ``all``."""
    result: dict[str, Any] = {"benchmark": "hostile"}
    if part in ("all", "client"):
        result["client"] = client_cases(client_gib)
    if part in ("all", "server"):
        result.update(_server_side(sizes, repeats, probes, seed, labels_mib))
    return result


def _server_side(
    sizes: str, repeats: int, probes: int, seed: int, labels_mib: float
) -> dict[str, Any]:
    mibs = [float(x) for x in sizes.split(",") if x.strip()]
    data = synthetic_pairs(500, 64, 32, seed=seed)
    with stack(checkpoint_every_seconds=0.5) as st, httpx.Client(timeout=120) as http:
        StreamProducer(st.r, NAMESPACE).push_pairs(data)
        st.spawn("worker", "--model", "cmos")
        url = st.api()
        wait_for(lambda: http.get(f"{url}/readyz").status_code == 200, 120, "a model")
        api_pid = st.procs[-1].pid

        def probe_ms() -> float:
            start = time.perf_counter()
            http.get(f"{url}/healthz")
            return (time.perf_counter() - start) * 1000

        rest = [probe_ms() for _ in range(probes)]
        rss_rest = rss_mb(api_pid)
        results = [
            {
                "body_mib": mib,
                **_under_junk(
                    url, api_pid, "/v1/similarity", _junk_body(mib), "application/json", repeats
                ),
            }
            for mib in tqdm(mibs, desc="junk bodies", file=sys.stderr)
        ]
        bomb = _labels_bomb(labels_mib)
        labels = {
            "labels_mib": labels_mib,
            "body_bytes": len(bomb),
            **_under_junk(url, api_pid, "/v1/pairs/frames", bomb, FRAMES_MEDIA_TYPE, repeats),
        }
        return {
            "max_body_bytes": st.settings.max_body_bytes,
            "healthz_rest_p50_ms": round(percentile(rest, 50), 2),
            "healthz_rest_p99_ms": round(percentile(rest, 99), 2),
            "api_rss_rest_mb": round(rss_rest, 1),
            "bodies": results,
            "labels_bomb": labels,
        }
