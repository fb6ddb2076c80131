"""Issue 21's binary ingest: a batch of pairs as one body of message v1 frames
(``POST /v1/pairs/frames``), checked by the worker's own decoder and written as it came."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import redis
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.keys import Keys
from streamxm.stream.messages import (
    FRAMES_MEDIA_TYPE,
    InvalidPair,
    Limits,
    decode_frames,
    decode_pair,
    encode_frames,
    encode_pair,
    make_pair,
)
from streamxm.stream.producer import StreamProducer, decode_entries
from tests.conftest import ApiServer, class_stream, latest, wait_for

FRAMES = {"content-type": FRAMES_MEDIA_TYPE}


#: Ids as the contract allows them: any printable characters (docs/design.md).
_IDS = st.text(st.characters(codec="utf-8").filter(str.isprintable), min_size=1, max_size=20)


@given(
    st.lists(
        st.tuples(
            _IDS,
            st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=6),
            st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=6),
            st.lists(st.integers(0, 1000), max_size=3),
        ),
        min_size=1,
        max_size=8,
    )
)
@hsettings(max_examples=60, deadline=None, derandomize=True)
def test_frames_round_trip_every_pair(
    rows: list[tuple[str, list[float], list[float], list[int]]],
) -> None:
    pairs = [make_pair(i, img, txt, labels) for i, img, txt, labels in rows]
    frames = decode_frames(encode_frames(pairs), max_pairs=len(pairs))
    assert frames == [encode_pair(p) for p in pairs]
    for pair, fields in zip(pairs, frames, strict=True):
        got = decode_pair(fields, copy=False)
        assert got.id == pair.id and got.labels == pair.labels
        np.testing.assert_array_equal(got.img, pair.img)


@pytest.mark.parametrize(
    "body, reason",
    [
        (b"", "empty"),
        (b"\x00\x00", "bad_frame"),  # a frame of no fields
        (b"\x01\x00\x05v", "bad_frame"),  # a name longer than the body
        (b"\x01\x00\x01v\xff\xff\xff\xff1", "bad_frame"),  # a value of 4 GB announced
        (b"\x02\x00\x01v\x01\x00\x00\x001\x01v\x01\x00\x00\x001", "duplicate_field"),
    ],
)
def test_a_body_that_is_not_whole_frames_is_refused_naming_where(body: bytes, reason: str) -> None:
    with pytest.raises(InvalidPair) as refused:
        decode_frames(body, max_pairs=10)
    assert refused.value.reason == reason


def test_frames_over_http_reach_the_worker_like_any_pair(
    r: redis.Redis, settings: Settings
) -> None:
    pairs = class_stream(120, 8, 4, seed=2)
    keys = Keys(settings.namespace)
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        accepted = http.post("/v1/pairs/frames", content=encode_frames(pairs[:60]), headers=FRAMES)
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["accepted"] == 60
        # The stream holds exactly the message the client's own push would have written.
        entries = r.xrange(keys.pairs, count=60)
        assert [fields for _, fields in entries] == [encode_pair(p) for p in pairs[:60]]
        # A bad pair anywhere refuses the whole body, naming the frame and its field.
        bad = encode_frames([*pairs[60:70], make_pair("x", [0.5] * 9, [0.5] * 4)])
        refused = http.post("/v1/pairs/frames", content=bad, headers=FRAMES)
        assert refused.status_code == 422
        assert refused.json()["detail"][0]["loc"] == ["body", "pairs", 10, "img"]
        nan = bytearray(encode_frames([pairs[60]]))
        at = nan.index(b"img") + 3 + 4  # the first float of the image vector
        nan[at : at + 4] = np.float32("nan").tobytes()
        refused = http.post("/v1/pairs/frames", content=bytes(nan), headers=FRAMES)
        assert refused.status_code == 422 and refused.json()["detail"][0]["type"] == "non_finite"
        garbled = http.post(
            "/v1/pairs/frames", content=encode_frames(pairs[60:62])[:-3], headers=FRAMES
        )
        assert garbled.status_code == 422
        assert garbled.json()["detail"][0]["loc"] == ["body"]
        assert "frame 1" in garbled.json()["detail"][0]["msg"]
        wrong_type = http.post(
            "/v1/pairs/frames",
            content=encode_frames(pairs[60:61]),
            headers={"content-type": "application/json"},
        )
        assert wrong_type.status_code == 415 and FRAMES_MEDIA_TYPE in wrong_type.text
        too_many = http.post(
            "/v1/pairs/frames",
            headers=FRAMES,
            content=encode_frames(class_stream(settings.max_batch + 1, 8, 4, seed=3)),
        )
        assert (
            too_many.status_code == 422 and too_many.json()["detail"][0]["type"] == "too_many_pairs"
        )
        assert r.xlen(keys.pairs) == 60  # nothing of a refused body was written
        http.post(
            "/v1/pairs/frames", content=encode_frames(pairs[60:]), headers=FRAMES
        ).raise_for_status()
    # A worker learns the framed pairs as it learns pushed ones: the same model.
    build_worker(settings, r, "cmos").run(until_idle=True)
    framed = latest(settings, r)
    everything = [(entry_id.decode(), fields) for entry_id, fields in r.xrange(keys.pairs)]
    decoded, skipped = decode_entries(r, keys, everything, Limits())
    assert skipped == 0 and [p.id for _, p in decoded] == [p.id for p in pairs]
    other = settings.model_copy(update={"namespace": settings.namespace + "-client"})
    StreamProducer(r, other.namespace).push_pairs(pairs)
    build_worker(other, r, "cmos").run(until_idle=True)
    np.testing.assert_array_equal(
        latest(other, r).model.state()[0]["W"], framed.model.state()[0]["W"]
    )


def test_frames_obey_the_values_bound_of_every_request(r: redis.Redis, settings: Settings) -> None:
    bounded = settings.model_copy(update={"max_request_values": 100})
    with ApiServer(bounded) as api:
        answer = httpx.post(
            f"{api.url}/v1/pairs/frames",
            headers=FRAMES,
            content=encode_frames(class_stream(9, 8, 4, seed=6)),
        )
        assert answer.status_code == 422 and answer.json()["detail"][0]["type"] == "too_large"
        assert (
            httpx.post(
                f"{api.url}/v1/pairs/frames",
                headers=FRAMES,
                content=encode_frames(class_stream(8, 8, 4, seed=6)),
            ).status_code
            == 202
        )  # 96 values: within


def test_frames_need_the_token_when_one_is_set(r: redis.Redis, settings: Settings) -> None:
    from pydantic import SecretStr

    secured = settings.model_copy(update={"api_token": SecretStr("t0ken")})
    body = encode_frames(class_stream(3, 8, 4, seed=4))
    with ApiServer(secured) as api:
        wait_for(lambda: httpx.get(f"{api.url}/healthz").status_code == 200, 10, "up")
        assert (
            httpx.post(f"{api.url}/v1/pairs/frames", content=body, headers=FRAMES).status_code
            == 401
        )
        assert (
            httpx.post(
                f"{api.url}/v1/pairs/frames",
                content=body,
                headers={**FRAMES, "authorization": "Bearer t0ken"},
            ).status_code
            == 202
        )


def test_an_ingest_replica_takes_pairs_and_refuses_queries_naming_its_role(
    r: redis.Redis, settings: Settings
) -> None:
    """STREAMXM_API_ROLE=ingest: ready at once, every write route works, the read routes are
    404s that say where to send them; role query is the mirror image."""
    keys = Keys(settings.namespace)
    pairs = class_stream(6, 8, 4, seed=8)
    with ApiServer(settings.model_copy(update={"api_role": "ingest"})) as api:
        ready = httpx.get(f"{api.url}/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "models": []}
        assert (
            httpx.post(
                f"{api.url}/v1/pairs/frames", headers=FRAMES, content=encode_frames(pairs[:3])
            ).status_code
            == 202
        )
        assert (
            httpx.post(
                f"{api.url}/v1/pairs",
                json={
                    "pairs": [
                        {
                            "id": p.id,
                            "img": p.img.tolist(),
                            "txt": p.txt.tolist(),
                            "labels": list(p.labels),
                        }
                        for p in pairs[3:]
                    ]
                },
            ).status_code
            == 202
        )
        refused = httpx.post(
            f"{api.url}/v1/search", json={"modality": "image", "vector": [0.5] * 8, "k": 3}
        )
        assert refused.status_code == 404 and "STREAMXM_API_ROLE=ingest" in refused.text
        assert httpx.get(f"{api.url}/v1/models").status_code == 404
        paths = httpx.get(f"{api.url}/openapi.json").json()["paths"]
        assert "/v1/pairs/frames" in paths and "/v1/search" not in paths
        time.sleep(1.0)  # four refresh intervals: a replica of role "all" reads them back
        assert len(api.app.state.context.server.gallery) == 0
    assert [decode_pair(f).id for _, f in r.xrange(keys.pairs)] == [p.id for p in pairs]
    with ApiServer(settings.model_copy(update={"api_role": "query"})) as api:
        refused = httpx.post(
            f"{api.url}/v1/pairs/frames", headers=FRAMES, content=encode_frames(pairs[:1])
        )
        assert refused.status_code == 404 and "STREAMXM_API_ROLE=query" in refused.text
        assert httpx.get(f"{api.url}/v1/models").status_code == 200
    assert r.xlen(keys.pairs) == len(pairs)
