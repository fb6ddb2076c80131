"""The HTTP API fuzzed against its own OpenAPI schema (schemathesis), over real HTTP, with a
model loaded and a token required for writes; and the token rules themselves."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from pydantic import SecretStr
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from streamxm.config import Settings
from streamxm.stream.messages import FRAMES_MEDIA_TYPE
from tests.conftest import ApiServer, serve_cmos

# The frames route takes raw bytes: schemathesis sends what it generates for a binary body.
schemathesis.serializer.alias(FRAMES_MEDIA_TYPE, "application/octet-stream")

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api(r: redis.Redis, settings: Settings) -> Iterator[ApiServer]:
    """An API serving a CMOS model over a 300-pair gallery; writes need the token."""
    serve_cmos(r, settings, 300)
    secured = settings.model_copy(
        update={"api_token": SecretStr(TOKEN), "max_k": 50, "max_batch": 64}
    )
    with ApiServer(secured) as server:
        server.wait_ready()
        yield server


def derandomized(max_examples: int) -> examples:
    """Hypothesis settings for a fuzz run that CI can reproduce: derandomized, no example
    database, no deadline and no health check (the calls go over real HTTP)."""
    return examples(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


def fuzz(operation: Any, mode: GenerationMode, base_url: str, problems: list[str]) -> int:
    """Run one operation's generated cases; collect every failure. Returns the call count.

    Derandomized so that CI is reproducible; random exploration is a matter of running
    schemathesis's own CLI against a dev server (README)."""
    calls = 0

    @derandomized(60)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal calls
        calls += 1
        # positive_data_acceptance is left out: a schema-valid vector of the wrong length is
        # refused (422) because dimensions are fixed per namespace at run time, which no
        # static schema can say.
        try:
            response = case.call_and_validate(
                base_url=base_url, headers=AUTH, excluded_checks=[positive_data_acceptance]
            )
        except Exception as exc:  # every failure is collected, not just the first
            problems.append(f"{operation.label} {mode.value}: {exc}"[:2000])
            return
        if 400 <= response.status_code < 500 and not response.json().get("detail"):
            problems.append(
                f"{operation.label}: {response.status_code} without a message: "
                f"{response.text[:200]}"
            )

    with contextlib.suppress(Unsatisfiable):  # nothing to break (GET /healthz, negative)
        run()
    return calls


@pytest.mark.slow
def test_no_request_from_the_schema_gets_a_500_and_every_rejection_says_why(api: ApiServer) -> None:
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    problems: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            calls += fuzz(result.ok(), mode, api.url, problems)
    assert calls > 200
    assert not problems, "\n\n".join(problems[:5])


junk = st.one_of(
    st.text(max_size=20),
    st.booleans(),
    st.none(),
    st.just([1.0]),
    st.just({"a": 1}),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**70), 2**70),
)


@st.composite
def hostile_body(draw: st.DrawFn) -> tuple[str, bytes]:
    """A body for a real route with one vector stretched to any length and salted with junk
    (bad types, wrong nesting), JSON-encoded as an attacker would send it."""
    path = draw(st.sampled_from(["/v1/similarity", "/v1/search", "/v1/pairs"]))
    n = draw(st.integers(1, 300_000))
    filler = draw(st.sampled_from([0.5, "a", True, None, [0.5]]))
    vector: list[object] = [filler] * n
    for _ in range(draw(st.integers(0, 5))):
        vector[draw(st.integers(0, n - 1))] = draw(junk)
    rows = draw(st.integers(1, 3))
    body: dict[str, object]
    if path == "/v1/similarity":
        body = {"images": [vector] * rows, "texts": [[0.5] * 4]}
    elif path == "/v1/search":
        body = {"modality": "image", "vector": vector, "k": draw(st.integers(-5, 10**6))}
    else:
        body = {
            "pairs": [
                {
                    "id": draw(st.text(max_size=400)),
                    "img": vector,
                    "txt": [0.5] * 4,
                    "labels": draw(st.lists(junk, max_size=3)),
                }
            ]
            * rows
        }
    return path, json.dumps(body).encode()


def test_hostile_bodies_get_small_answers_and_never_a_500(api: ApiServer) -> None:
    """Issue 17: whatever a client sends, the answer is a 4xx of at most 64 KB."""
    seen: set[int] = set()

    @derandomized(40)
    @given(case=hostile_body())
    def run(case: tuple[str, bytes]) -> None:
        path, body = case
        answer = httpx.post(
            api.url + path,
            content=body,
            headers={**AUTH, "Content-Type": "application/json"},
            timeout=60,
        )
        seen.add(answer.status_code)
        assert 400 <= answer.status_code < 500 or answer.status_code in (200, 202), answer.text
        assert len(answer.content) <= 64 * 1024, (path, len(answer.content))
        if answer.status_code == 422:
            assert len(answer.json()["detail"]) <= 11

    run()
    assert 422 in seen


def test_bounds_on_k_batch_and_body(api: ApiServer) -> None:
    query = {"modality": "image", "vector": [0.1] * 8}
    too_many = httpx.post(f"{api.url}/v1/search", json={**query, "k": 51})
    assert too_many.status_code == 422 and "k must be <= 50" in too_many.text
    batch = httpx.post(
        f"{api.url}/v1/similarity", json={"images": [[0.1] * 8] * 65, "texts": [[0.1] * 4] * 65}
    )
    assert batch.status_code == 422 and "exceed the limit 64" in batch.text


def test_bodies_over_the_limit_are_refused_before_they_are_read(
    r: redis.Redis, settings: Settings
) -> None:
    small = settings.model_copy(update={"max_body_bytes": 4096})
    with ApiServer(small) as server:
        body = b'{"modality": "image", "vector": [' + b"0.1," * 5000 + b"0.1]}"
        declared = httpx.post(
            f"{server.url}/v1/search", content=body, headers={"content-type": "application/json"}
        )
        assert declared.status_code == 413

        def chunks() -> Iterator[bytes]:  # no content-length: counted as it streams in
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        streamed = httpx.post(
            f"{server.url}/v1/search",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert streamed.status_code == 413


def test_tokens_guard_writes_and_optionally_reads_and_are_never_logged(
    r: redis.Redis, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    pair = {"id": "x", "img": [0.1] * 8, "txt": [0.2] * 4}
    caplog.set_level(logging.DEBUG)
    for reads_too in (False, True):
        secured = settings.model_copy(
            update={"api_token": SecretStr(TOKEN), "api_token_for_reads": reads_too}
        )
        with ApiServer(secured) as server:
            url = server.url
            assert httpx.post(f"{url}/v1/pairs", json={"pairs": [pair]}).status_code == 401
            wrong = {"Authorization": f"Bearer {TOKEN[:-1]}x"}
            denied = httpx.post(f"{url}/v1/pairs", json={"pairs": [pair]}, headers=wrong)
            assert denied.status_code == 401
            assert denied.headers["www-authenticate"] == "Bearer"
            ok = httpx.post(f"{url}/v1/pairs", json={"pairs": [pair]}, headers=AUTH)
            assert ok.status_code == 202, ok.text
            read = httpx.get(f"{url}/v1/models")
            assert read.status_code == (401 if reads_too else 200)
            assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
            assert httpx.get(f"{url}/healthz").status_code == 200  # probes stay open
            schema = httpx.get(f"{url}/openapi.json").json()
            secured_ops = {
                path
                for path, ops in schema["paths"].items()
                for op in ops.values()
                if op.get("security")
            }
            assert "/v1/pairs" in secured_ops
            assert ("/v1/models" in secured_ops) == reads_too
    assert TOKEN not in caplog.text and TOKEN[:-1] not in caplog.text
