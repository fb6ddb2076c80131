"""The client against a malicious server (a real HTTP server on loopback): what it reads and
unpacks is capped by what the request can need, and every failure is a ``StreamxmError`` that
says what of a push landed."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

from streamxm.client import (
    AsyncClient,
    BadResponse,
    Client,
    InvalidRequest,
    ResponseTooLarge,
    Retries,
    StreamxmError,
    Unavailable,
)
from streamxm.tools.hostile_server import (
    Handler,
    HostileServer,
    chunked_flood,
    deep_json,
    gzip_bomb,
    limits_json,
    plain,
)

GIB = 1 << 30
LIMITS = plain(200, limits_json())


def _pairs(n: int) -> list[tuple[str, Any, Any, list[int]]]:
    rng = np.random.default_rng(0)
    return [(f"p{i}", rng.random(8), rng.random(4), [i % 2]) for i in range(n)]


@pytest.fixture
def serve() -> Iterator[Callable[[dict[str, Handler]], HostileServer]]:
    servers: list[HostileServer] = []

    def start(answers: dict[str, Handler]) -> HostileServer:
        servers.append(HostileServer(answers).__enter__())
        return servers[-1]

    yield start
    for server in servers:
        server.__exit__()


def _peak_mib(call: Callable[[], object]) -> tuple[Exception | None, float]:
    """What ``call`` raised and the most memory Python allocated meanwhile, in MiB."""
    tracemalloc.start()
    try:
        call()
        raised: Exception | None = None
    except Exception as exc:  # the test inspects what was raised
        raised = exc
    peak = tracemalloc.get_traced_memory()[1] / (1 << 20)
    tracemalloc.stop()
    return raised, peak


@pytest.mark.parametrize("answer", [chunked_flood(GIB), gzip_bomb(GIB)], ids=["chunked", "gzip"])
def test_a_body_past_the_cap_is_refused_without_reading_it(
    serve: Callable[[dict[str, Handler]], HostileServer], answer: Handler
) -> None:
    server = serve({"/v1/models": answer, "/v1/search": answer})
    with Client(server.url, timeout=10) as client:
        raised, peak = _peak_mib(client.models)
        assert isinstance(raised, ResponseTooLarge), raised
        assert peak < 48, f"{peak:.0f} MiB read for GET /v1/models"
        # A search's cap follows from k: far below the models' cap.
        raised, peak = _peak_mib(lambda: client.search(np.ones(8), k=5))
        assert isinstance(raised, ResponseTooLarge) and "cap of" in str(raised)
        assert peak < 8, f"{peak:.0f} MiB read for a k=5 search"


def test_the_async_client_caps_the_same(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    server = serve({"/v1/models": gzip_bomb(GIB)})

    async def ask() -> None:
        async with AsyncClient(server.url, timeout=10) as client:
            await client.models()

    raised, peak = _peak_mib(lambda: anyio.run(ask))
    assert isinstance(raised, ResponseTooLarge) and peak < 48


def test_an_error_page_past_the_cap_keeps_its_status(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    server = serve({"/v1/models": chunked_flood(GIB, status=404)})
    with Client(server.url, timeout=10) as client, pytest.raises(StreamxmError) as caught:
        client.models()
    assert caught.value.status == 404 and not isinstance(caught.value, BadResponse)


def test_a_push_answered_with_a_page_says_its_batch_landed(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    server = serve(
        {"/v1/limits": LIMITS, "/v1/pairs/frames": plain(202, b"<html>ok</html>", "text/html")}
    )
    with Client(server.url) as client, pytest.raises(BadResponse) as caught:
        client.push(_pairs(5))
    assert caught.value.status == 202 and caught.value.written is True
    assert caught.value.accepted == [] and caught.value.unconfirmed == 5


def test_a_push_answered_with_too_few_entry_ids_is_not_a_success(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    server = serve(
        {
            "/v1/limits": plain(200, limits_json(max_batch=5)),
            "/v1/pairs/frames": plain(202, b'{"entry_ids": ["1-0"]}'),
        }
    )
    with Client(server.url) as client, pytest.raises(BadResponse) as caught:
        client.push(_pairs(5))
    assert "1 entry ids for a batch of 5" in str(caught.value)
    assert caught.value.unconfirmed == 5


@pytest.mark.parametrize(
    "body",
    [deep_json(100_000), b'{"models": [{"name": 1}]}', b'{"models": 7}', b"\xff\xfe"],
    ids=["deep", "fields", "type", "bytes"],
)
def test_answers_of_the_wrong_shape_are_bad_responses(
    serve: Callable[[dict[str, Handler]], HostileServer], body: bytes
) -> None:
    server = serve({"/v1/models": plain(200, body)})
    with Client(server.url) as client, pytest.raises(BadResponse):
        client.models()


@pytest.mark.parametrize(
    "limits",
    [limits_json(max_batch="x"), limits_json(max_batch=0), limits_json(max_batch=True), b"[1, 2]"],
)
def test_limits_of_the_wrong_type_are_bad_responses(
    serve: Callable[[dict[str, Handler]], HostileServer], limits: bytes
) -> None:
    server = serve({"/v1/limits": plain(200, limits)})
    with Client(server.url) as client, pytest.raises(BadResponse) as caught:
        client.push(_pairs(3))
    assert caught.value.accepted == [] and caught.value.unconfirmed == 0
    assert server.seen == ["/v1/limits"], "nothing was pushed"


def test_an_encoding_the_client_did_not_ask_for_is_refused(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    server = serve({"/readyz": plain(200, b"xx", extra="content-encoding: br\r\n")})
    with Client(server.url) as client, pytest.raises(BadResponse, match="content-encoding"):
        client.ready()


def test_wait_learned_gives_up_when_the_served_version_stays_behind(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    model = {
        "name": "cmos",
        "loaded": True,
        "version": 1,
        "checkpoint_version": 1,
        "pairs_seen": 1,
        "last_entry_id": "17-0",
        "mistakes": {},
        "triplets": {},
        "rolling_map": {},
        "checkpoint_time": None,
        "gallery_items": 1,
    }
    server = serve({"/v1/models": plain(200, json.dumps({"models": [model]}).encode())})
    with Client(server.url) as client:
        assert client.wait_learned("17-0", "cmos", timeout=1)[0].last_entry_id == "17-0"
        assert client.wait_learned("16-99", timeout=1)[0].name == "cmos"
        with pytest.raises(Unavailable, match="had learned entry 17-1"):
            client.wait_learned("17-1", "cmos", timeout=0.3, interval=0.1)
        with pytest.raises(Unavailable):  # a model the API does not list
            client.wait_learned("1-0", "sam", timeout=0.2, interval=0.1)


@pytest.mark.slow
def test_bench_hostile_client_part_reports_each_case() -> None:
    from streamxm.tools.bench_hostile import hostile

    result = hostile(part="client", client_gib=0.25)
    cases = result["client"]["cases"]
    assert result["client"]["not_streamxm_errors"] == []
    assert cases["gzip_bomb"]["raised"] == cases["chunked_body"]["raised"] == "ResponseTooLarge"
    assert cases["html_on_push"]["written"] is True and cases["deep_json"]["written"] is None
    for case in cases.values():  # bodies of 256 MiB never reached the client's memory
        assert case["client_rss_peak_mb"] - case["client_rss_before_mb"] < 64


def test_a_large_batch_reads_all_its_entry_ids(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    ids = [f"{1764150000000 + i}-0" for i in range(4000)]  # ~100 KB of JSON: past 64 KiB
    server = serve(
        {
            "/v1/limits": plain(200, limits_json(max_batch=4000)),
            "/v1/pairs/frames": plain(202, json.dumps({"entry_ids": ids}).encode()),
        }
    )
    with Client(server.url) as client:
        assert client.push(_pairs(4000)) == ids


@pytest.mark.parametrize("tail", [b"x" * 200_000, b""], ids=["data-after-end", "cut-off"])
def test_a_gzip_body_must_end_where_its_stream_ends(
    serve: Callable[[dict[str, Handler]], HostileServer], tail: bytes
) -> None:
    packed = gzip.compress(b'{"status": "ok"}')
    body = packed + tail if tail else packed[:-6]  # junk after the member, or no trailer
    server = serve({"/readyz": plain(200, body, extra="content-encoding: gzip\r\n")})
    with Client(server.url) as client, pytest.raises(BadResponse, match="compressed body"):
        client.ready()


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (400, b'{"detail": [{"loc": 5}]}', "InvalidRequest"),
        (400, b'{"detail": [{"loc": ["body", "pairs", "x"]}]}', "InvalidRequest"),
        (500, b'{"detail": [1]}', "ServerError"),
        (503, b'{"detail": {"a": [1]}}', "Unavailable"),
    ],
)
def test_error_details_of_any_shape_keep_the_statuss_class(
    serve: Callable[[dict[str, Handler]], HostileServer], status: int, body: bytes, kind: str
) -> None:
    server = serve({"/v1/limits": LIMITS, "/v1/pairs/frames": plain(status, body)})
    client = Client(server.url, retries=Retries(attempts=1))
    with client, pytest.raises(StreamxmError) as caught:
        client.push(_pairs(2))
    assert type(caught.value).__name__ == kind and caught.value.status == status


def test_push_resume_counts_a_batch_that_landed_without_readable_ids(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    from streamxm.client.calls import as_pairs
    from streamxm.tools.push import PushStopped, push_pairs

    server = serve(
        {
            "/v1/limits": plain(200, limits_json(max_batch=3)),
            "/v1/pairs/frames": plain(202, b"<html>ok</html>", "text/html"),
        }
    )
    with Client(server.url) as client, pytest.raises(PushStopped) as caught:
        push_pairs(as_pairs(_pairs(10)), client.push, start=4)
    report = caught.value.report
    # The first batch of three (pairs 4-6) was answered 202: landed, ids unknown.
    assert (report.landed, report.uncertain, report.last_entry_id) == (7, 0, None)
    assert "--start 7" in str(caught.value) and not caught.value.transient


def test_wait_learned_refuses_a_zero_interval(
    serve: Callable[[dict[str, Handler]], HostileServer],
) -> None:
    server = serve({})
    with Client(server.url) as client, pytest.raises(InvalidRequest, match="interval"):
        client.wait_learned("1-0", interval=0)
