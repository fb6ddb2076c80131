"""Issue 17's API defects, each reproduced as a hostile but fair client would, over real HTTP
against a real Redis: oversized and ill-typed bodies, invented HTTP methods, a stalled Redis,
slow clients, a Host header fishing for a redirect, and stream entries from other producers."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.keys import Keys
from streamxm.stream.messages import encode_pair, make_pair
from streamxm.stream.redis_conn import EmbeddedRedis, connect
from tests.conftest import ApiServer, class_stream, local_settings, metric, serve_cmos, wait_for

KB = 1024


def _timed_get(url: str) -> float:
    start = time.perf_counter()
    assert httpx.get(url, timeout=30).status_code == 200
    return time.perf_counter() - start


def _post_raw(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=120)


@pytest.mark.parametrize("mib", [1, 4])
def test_a_body_of_junk_gets_a_small_answer_while_health_stays_fast(
    api: ApiServer, mib: int
) -> None:
    """The reported attack: one vector of n strings. FastAPI's default answer listed n errors,
    each with its input (39 MB for 1 MiB); now it is refused on its size or its first bad
    element, in a body of at most 64 KB."""
    n = (mib << 20) // 4
    body = ('{"images":[[' + ",".join(['"a"'] * n) + ']],"texts":[[1]]}').encode()
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            health.append(_timed_get(f"{api.url}/healthz"))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        answers = [_post_raw(f"{api.url}/v1/similarity", body) for _ in range(3)]
    finally:
        done.set()
        prober.join()
    for answer in answers:
        assert answer.status_code == 422
        assert len(answer.content) <= 64 * KB
        detail = answer.json()["detail"]
        assert 1 <= len(detail) <= 11 and detail[0]["loc"][:2] == ["body", "images"]
    assert health and max(health) < 1.0, health


def test_every_list_and_string_is_bounded_and_errors_are_few(api: ApiServer) -> None:
    url = api.url
    cases = [
        # A vector longer than the deployment's max_dim, refused by its length.
        ("/v1/search", {"modality": "image", "vector": [0.5] * 70_000}, ["body", "vector"]),
        # More values than max_request_values in all, though each vector is legal.
        ("/v1/similarity", {"images": [[0.5] * 60_000] * 20, "texts": [[1.0]]}, ["body", "images"]),
        ("/v1/similarity", {"images": [[0.5]] * 5000, "texts": [[1.0]]}, ["body", "images"]),
        (
            "/v1/pairs",
            {"pairs": [{"id": "x", "img": [0.5], "txt": [0.5]}] * 5000},
            ["body", "pairs"],
        ),
        ("/v1/search", {"modality": "image", "vector": [0.5], "k": 10**9}, ["body", "k"]),
        (
            "/v1/search",
            {"model": "m" * 10_000, "modality": "image", "vector": [0.5]},
            ["body", "model"],
        ),
    ]
    for path, payload, loc in cases:
        answer = httpx.post(url + path, json=payload, timeout=60)
        assert answer.status_code == 422, (path, answer.text[:300])
        assert len(answer.content) <= 64 * KB
        first = answer.json()["detail"][0]
        assert first["loc"][: len(loc)] == loc, first
        assert not isinstance(first["input"], list)  # inputs are summarised, never echoed
    # Many bad pairs: at most ten errors (fail-fast), each input clipped.
    junk = {"pairs": [{"id": "y" * 300, "img": ["a"] * 100, "txt": [True]}] * 500}
    answer = httpx.post(url + "/v1/pairs", json=junk, timeout=60)
    assert answer.status_code == 422 and len(answer.json()["detail"]) <= 11
    assert len(answer.content) <= 4 * KB
    # Over the body limit (derived from max_request_values): 413 before any parsing.
    huge = b'{"images":[[' + b"0," * (13 << 20) + b'0]],"texts":[[1]]}'
    assert _post_raw(url + "/v1/similarity", huge).status_code == 413


@pytest.mark.parametrize(
    "payload,loc",
    [
        (
            {"modality": "image", "vector": ["1.5", 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]},
            ["body", "vector", 0],
        ),
        (
            {"modality": "image", "vector": [True, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]},
            ["body", "vector", 0],
        ),
        ({"modality": "image", "vector": [0.5] * 8, "k": "3"}, ["body", "k"]),
    ],
)
def test_types_are_strict(api: ApiServer, payload: dict[str, object], loc: list[object]) -> None:
    answer = httpx.post(f"{api.url}/v1/search", json=payload)
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == loc


def test_strict_labels_at_the_http_door(api: ApiServer, r: redis.Redis, settings: Settings) -> None:
    before = r.xlen(Keys(settings.namespace).pairs)
    for labels in (["3"], [True], [1.5]):
        pair = {"id": "z", "img": [0.5] * 8, "txt": [0.5] * 4, "labels": labels}
        answer = httpx.post(f"{api.url}/v1/pairs", json={"pairs": [pair]})
        assert answer.status_code == 422, labels
        assert answer.json()["detail"][0]["loc"][:4] == ["body", "pairs", 0, "labels"]
    assert r.xlen(Keys(settings.namespace).pairs) == before


def test_invented_http_methods_share_one_metric_label(api: ApiServer) -> None:
    rng = np.random.default_rng(0)
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    with httpx.Client(base_url=api.url, timeout=30) as http:
        size_before = len(http.get("/metrics").content)
        for _ in range(50):
            method = "".join(rng.choice(letters, 8000))
            assert http.request(method, "/healthz").status_code == 405
        text = http.get("/metrics").text
    assert len(text) < size_before + 8 * KB
    methods = {
        s.labels["method"]
        for f in text_string_to_metric_families(text)
        if f.name == "streamxm_requests"
        for s in f.samples
    }
    assert methods <= {"GET", "POST", "other"} and "other" in methods


def test_a_trailing_slash_is_not_redirected_to_the_clients_host(api: ApiServer) -> None:
    answer = httpx.get(
        f"{api.url}/healthz/", headers={"Host": "evil.example"}, follow_redirects=False
    )
    assert answer.status_code == 404
    assert "evil.example" not in answer.headers.get("location", "")
    assert "evil.example" not in answer.text


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(6)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (anything it still sends is skipped)."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_slow_clients_are_disconnected(r: redis.Redis, settings: Settings) -> None:
    quick = settings.model_copy(update={"request_read_timeout_seconds": 1.0})
    with ApiServer(quick) as api:
        headers = _connect(api.url)
        headers.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
        body = _connect(api.url)
        body.sendall(
            b"POST /v1/pairs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b'\r\nContent-Length: 1000\r\n\r\n{"pairs": ['
        )  # 989 bytes missing
        idle_after_answer = _connect(api.url)
        idle_after_answer.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in idle_after_answer.recv(4096)
        idle_after_answer.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next request, stalled
        start = time.monotonic()
        for sock in (headers, body, idle_after_answer):
            assert _closed_by_server(sock)
            sock.close()
        assert time.monotonic() - start < 5
        # A client that takes its time but stays within the deadline is served.
        polite = _connect(api.url)
        for part in (b"GET /healthz HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
            polite.sendall(part)
            time.sleep(0.2)
        assert b"200 OK" in polite.recv(4096)
        polite.close()


def test_lag_counts_entries_of_every_producer(
    r: redis.Redis, settings: Settings, api: ApiServer
) -> None:
    """Entries written by another producer (here: raw XADD, as a non-Python client would) are
    lag too; the project's own ingest counter does not see them."""
    keys = Keys(settings.namespace)
    rng = np.random.default_rng(2)
    for i in range(25):
        r.xadd(
            keys.pairs,
            encode_pair(
                make_pair(
                    f"other-{i}",
                    rng.random(8),  # type: ignore[arg-type]
                    rng.random(4),
                )
            ),
        )

    def lag() -> float | None:
        return metric(httpx.get(f"{api.url}/metrics").text, "streamxm_stream_lag", model="cmos")

    wait_for(lambda: lag() == 25, 10, "the lag to show the foreign entries")
    build_worker(settings, r, "cmos").run(until_idle=True)
    wait_for(lambda: lag() == 0, 10, "the lag to drop once they are learned")


def _families(text: str) -> dict[str, float]:
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


@pytest.mark.slow
def test_a_stalled_redis_slows_no_probe_search_or_scrape(tmp_path: Path, namespace: str) -> None:
    """Redis frozen (SIGSTOP) for 8 s while 48 clients call routes that need it: the probes and
    search (which need only memory) answer at once, a scrape within a second with the last
    known values and redis_up 0, and the Redis-bound routes fail fast with a 503."""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    settings = local_settings(url, namespace, tmp_path)
    r = connect(settings)
    pairs = class_stream(200, 8, 4, seed=3)
    serve_cmos(r, settings)
    pid = int((server.data_dir / "redis.pid").read_text())
    timings: dict[str, list[float]] = {
        "/healthz": [],
        "/readyz": [],
        "/v1/search": [],
        "/metrics": [],
    }
    statuses: list[int] = []
    stalled = threading.Event()
    try:
        with ApiServer(settings) as api:
            api.wait_ready()
            before = _families(httpx.get(f"{api.url}/metrics").text)
            assert before["streamxm_redis_up{}"] == 1.0
            search = {"modality": "image", "vector": pairs[0].img.tolist(), "k": 5}

            def hammer() -> None:
                with httpx.Client(base_url=api.url, timeout=60) as http:
                    while stalled.is_set():
                        statuses.append(http.get("/v1/models").status_code)

            os.kill(pid, signal.SIGSTOP)
            stalled.set()
            hammers = [threading.Thread(target=hammer) for _ in range(48)]
            for t in hammers:
                t.start()
            time.sleep(1.0)
            last_scrape = ""
            with httpx.Client(base_url=api.url, timeout=60) as http:
                deadline = time.monotonic() + 7
                while time.monotonic() < deadline:
                    for path in timings:
                        start = time.perf_counter()
                        answer = (
                            http.post(path, json=search) if path == "/v1/search" else http.get(path)
                        )
                        timings[path].append(time.perf_counter() - start)
                        assert answer.status_code == 200, (path, answer.text[:200])
                        if path == "/metrics":
                            last_scrape = answer.text
            os.kill(pid, signal.SIGCONT)
            stalled.clear()
            for t in hammers:
                t.join()
            during = _families(last_scrape)
            assert during["streamxm_redis_up{}"] == 0.0
            processed = 'streamxm_pairs_processed_total{"model": "cmos"}'
            assert during[processed] == before[processed] == 200.0  # the last known values
            wait_for(
                lambda: (
                    _families(httpx.get(f"{api.url}/metrics").text)["streamxm_redis_up{}"] == 1.0
                ),
                10,
                "redis_up to recover",
            )
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()
    assert 503 in statuses  # the Redis-bound route failed fast instead of hanging
    assert max(timings["/healthz"]) < 0.5 and max(timings["/readyz"]) < 0.5, timings
    assert max(timings["/v1/search"]) < 1.0, timings["/v1/search"]
    assert max(timings["/metrics"]) < 1.5, timings["/metrics"]


def test_an_internal_error_is_a_500_with_its_traceback_logged(
    api: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No blanket ValueError -> 400: a bug inside a route must not pass for the client's fault."""
    from streamxm.serving.server import ModelServer

    async def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug, not a bad request")

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    server_log = logging.getLogger("uvicorn.error")  # where uvicorn logs unhandled errors
    server_log.addHandler(handler)
    monkeypatch.setattr(ModelServer, "search_async", broken)
    try:
        answer = httpx.post(
            f"{api.url}/v1/search", json={"modality": "image", "vector": [0.5] * 8, "k": 3}
        )
        # uvicorn logs the exception once the 500 is on its way, so the record may come later.
        wait_for(
            lambda: any(
                r.exc_info and "a bug, not a bad request" in str(r.exc_info[1]) for r in records
            ),
            10,
            "the traceback in the server log",
        )
    finally:
        server_log.removeHandler(handler)
    assert answer.status_code == 500
    assert "a bug, not a bad request" not in answer.text  # internals stay in the log
    text = httpx.get(f"{api.url}/metrics").text
    assert metric(text, "streamxm_requests_total", route="/v1/search", status="500") == 1.0


def _labels_bomb(n_labels: int = 6_000_000) -> dict[bytes, bytes]:
    """The reported frame: a valid pair whose ``labels`` value is ``1,1,1,...`` (12 MB)."""
    fields = encode_pair(make_pair("bomb", [0.5] * 8, [0.5] * 4))
    fields[b"labels"] = b"1," * (n_labels - 1) + b"1"
    return fields


def test_a_labels_bomb_is_refused_on_its_length_before_parsing(
    api: ApiServer, r: redis.Redis, settings: Settings
) -> None:
    """A 12 MB ``labels`` field: the decoder refuses it on its byte length (too_large) with
    less than a megabyte allocated, where it used to split it into 6 million ints; over HTTP
    the frame is answered 422 naming the field, and a stream entry holding it is
    dead-lettered by the worker as too_large."""
    import tracemalloc

    from streamxm.stream.messages import FRAMES_MEDIA_TYPE, InvalidPair, decode_pair, encode_frame

    fields = _labels_bomb()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidPair) as refused:
            decode_pair(fields)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.reason == "too_large" and refused.value.field == "labels"
    assert peak < 1 << 20, peak
    answer = httpx.post(
        f"{api.url}/v1/pairs/frames",
        content=encode_frame(fields),
        timeout=60,
        headers={"Content-Type": FRAMES_MEDIA_TYPE},
    )
    assert answer.status_code == 422, answer.text
    assert "labels" in answer.text and "too_large" in answer.text
    # The JSON door: the list is refused on its length before any label is validated.
    body = (
        '{"pairs": [{"id": "bomb", "img": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], '
        '"txt": [0.5, 0.5, 0.5, 0.5], "labels": [' + ",".join(["1"] * 5_000_000) + "]}]}"
    )
    answer = _post_raw(f"{api.url}/v1/pairs", body.encode())
    assert answer.status_code == 422 and "5000000 labels exceed the limit 64" in answer.text
    assert len(answer.content) < 4096
    keys = Keys(settings.namespace)
    r.xadd(keys.pairs, fields)  # type: ignore[arg-type]  # a producer that skips the API
    build_worker(settings, r, "cmos").run(until_idle=True)
    ((_, letter),) = r.xrange(keys.dead)
    assert letter[b"reason"] == b"too_large", letter


def test_a_misspelt_query_field_is_refused_naming_it(api: ApiServer) -> None:
    """``verison`` for ``version`` answered 200 with the newest version; now 422 naming it,
    in every query body (the pairs' JSON too, as frames already were)."""
    query = {"modality": "image", "vector": [0.5] * 8, "verison": 1}
    answer = httpx.post(f"{api.url}/v1/search", json=query, timeout=30)
    assert answer.status_code == 422, answer.text
    (error,) = answer.json()["detail"]
    assert error["loc"] == ["body", "verison"] and error["type"] == "extra_forbidden"
    answer = httpx.post(
        f"{api.url}/v1/similarity",
        timeout=30,
        json={"images": [[0.5] * 8], "texts": [[0.5] * 4], "mod": "matrix"},
    )
    assert answer.status_code == 422 and "mod" in answer.text
    answer = httpx.post(
        f"{api.url}/v1/pairs",
        timeout=30,
        json={"pairs": [{"id": "p", "img": [0.5] * 8, "txt": [0.5] * 4, "label": [1]}]},
    )
    assert answer.status_code == 422 and "label" in answer.text


@pytest.mark.parametrize(
    "path", ["/v1%2Fpairs%2Fframes", "/v1%2fpairs", "/v1%5Csearch", "/v1/pairs%2F"]
)
def test_an_encoded_slash_in_the_path_is_refused(api: ApiServer, path: str) -> None:
    """The server decodes ``%2F`` before routing, so a proxy guarding ``/v1/pairs`` by its raw
    prefix could be bypassed: such paths are refused with 400, whatever they decode to."""
    host, port = api.url.removeprefix("http://").split(":")
    body = b'{"pairs": []}'
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"encoded slash" in reply
    assert httpx.get(f"{api.url}/v1/models?next=%2Fv1%2Fpairs", timeout=10).status_code == 200


@pytest.mark.parametrize("pair_id", ["nul\x00id", "line\r\nFORGED", "\x1b[31mred", "tab\tid"])
def test_an_id_with_a_control_character_is_refused_at_every_door(
    api: ApiServer, r: redis.Redis, settings: Settings, pair_id: str
) -> None:
    """The id contract: printable characters only. JSON and frames answer 422 ``bad_id``; a
    stream entry written past the API is dead-lettered ``bad_id`` by the worker. Glob
    characters are ordinary characters and go through."""
    from streamxm.stream.messages import FRAMES_MEDIA_TYPE, encode_frame

    pair = {"id": pair_id, "img": [0.5] * 8, "txt": [0.5] * 4}
    answer = httpx.post(f"{api.url}/v1/pairs", json={"pairs": [pair]}, timeout=30)
    assert answer.status_code == 422 and "bad_id" in answer.text, answer.text
    fields = encode_pair(make_pair("placeholder", [0.5] * 8, [0.5] * 4))
    fields[b"id"] = pair_id.encode()
    answer = httpx.post(
        f"{api.url}/v1/pairs/frames",
        content=encode_frame(fields),
        headers={"Content-Type": FRAMES_MEDIA_TYPE},
        timeout=30,
    )
    assert answer.status_code == 422 and "bad_id" in answer.text, answer.text
    keys = Keys(settings.namespace)
    r.xadd(keys.pairs, fields)  # type: ignore[arg-type]
    glob = httpx.post(
        f"{api.url}/v1/pairs", timeout=30, json={"pairs": [{**pair, "id": "photos/*?[ab]-{1}"}]}
    )
    assert glob.status_code == 202, glob.text
    build_worker(settings, r, "cmos").run(until_idle=True)
    ((_, letter),) = r.xrange(keys.dead)
    assert letter[b"reason"] == b"bad_id", letter
