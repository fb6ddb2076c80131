"""Message v1 validation and checkpoint stores, against a real Redis and real files."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import redis

from streamxm.storage.checkpoint import (
    Checkpoint,
    DirectoryCheckpointStore,
    LeaseLost,
    RedisCheckpointStore,
    decode_blob,
    encode_blob,
)
from streamxm.stream.keys import Keys
from streamxm.stream.messages import InvalidPair, decode_pair, encode_pair, make_pair


def test_message_round_trip() -> None:
    pair = make_pair("a", [1.5, -2.0], [0.25], labels=[3, 1, 3], ts=12.5)
    back = decode_pair(encode_pair(pair), 2, 1)
    assert back.id == "a" and back.labels == (1, 3) and back.ts == 12.5
    assert np.array_equal(back.img, pair.img) and back.img.dtype == np.float32


@pytest.mark.parametrize(
    ("fields", "reason", "field"),
    [
        ({b"v": b"1", b"id": b"x", b"img": b"\x00" * 7, b"txt": b"\x00" * 4}, "bad_length", "img"),
        (
            {
                b"v": b"1",
                b"id": b"x",
                b"img": np.array([np.nan, 1], "<f4").tobytes(),
                b"txt": b"\x00" * 4,
            },
            "non_finite",
            "img",
        ),
        ({b"v": b"1", b"id": b"x", b"img": b"\x00" * 8}, "missing_field", "txt"),
        ({b"v": b"2", b"id": b"x", b"img": b"\x00" * 8, b"txt": b"\x00" * 4}, "bad_version", "v"),
        (
            {b"v": b"1", b"id": b"\xff\xfe", b"img": b"\x00" * 8, b"txt": b"\x00" * 4},
            "bad_id",
            "id",
        ),
        (
            {b"v": b"1", b"id": b"x", b"img": b"\x00" * 8, b"txt": b"\x00" * 4, b"labels": b"a,1"},
            "bad_labels",
            "labels",
        ),
        (
            {b"v": b"1", b"id": b"x", b"img": b"\x00" * 12, b"txt": b"\x00" * 4},
            "dim_mismatch",
            "img",
        ),
    ],
)
def test_malformed_messages_name_field_and_reason(
    fields: dict[bytes, bytes], reason: str, field: str
) -> None:
    with pytest.raises(InvalidPair) as info:
        decode_pair(fields, 2, 1)
    assert (info.value.reason, info.value.field) == (reason, field)


def test_negative_and_non_integer_labels_are_rejected() -> None:
    with pytest.raises(InvalidPair, match="outside"):
        make_pair("a", [1.0], [1.0], labels=[-1])
    with pytest.raises(InvalidPair, match="not an integer"):
        make_pair("a", [1.0], [1.0], labels=[1.5])  # type: ignore[list-item]


def _ckpt(version: int, value: float) -> Checkpoint:
    return Checkpoint(
        version, {"w": np.full((3, 2), value)}, {"note": "x", "n": version}, last_id=f"{version}-0"
    )


def test_blob_round_trip_and_no_object_arrays() -> None:
    back = decode_blob(encode_blob(_ckpt(4, 1.5)))
    assert back.version == 4 and back.last_id == "4-0" and back.meta == {"note": "x", "n": 4}
    assert np.array_equal(back.arrays["w"], np.full((3, 2), 1.5))
    with pytest.raises(TypeError):
        encode_blob(Checkpoint(1, {"o": np.array([{}], dtype=object)}, {}))


@pytest.mark.parametrize("kind", ["redis", "dir"])
def test_store_keeps_versions_and_falls_back_on_corruption(
    kind: str, r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    store = (
        RedisCheckpointStore(r, keys, keep=2)
        if kind == "redis"
        else DirectoryCheckpointStore(r, keys, tmp_path, keep=2)
    )
    for v in (1, 2, 3):
        store.commit("cmos", _ckpt(v, float(v)), {"pairs_seen": v})
    head = store.head("cmos")
    assert head is not None and head["version"] == 3 and head["pairs_seen"] == "3"
    assert [v for v, _ in head["history"]] == [3, 2]
    loaded = store.load_latest("cmos")
    assert loaded is not None and loaded.version == 3
    # Truncate the newest blob: the checksum catches it and version 2 is served instead.
    if kind == "redis":
        key = keys.checkpoint_blob("cmos", 3)
        r.set(key, r.get(key)[:-10])  # type: ignore[index]
    else:
        # Immutable files named by version and checksum; only the kept versions remain.
        files = sorted(p.name for p in (tmp_path / namespace / "cmos").iterdir())
        assert [f[:13] for f in files] == [f"v{2:012d}", f"v{3:012d}"], files
        path = tmp_path / namespace / "cmos" / files[1]
        path.write_bytes(path.read_bytes()[:-10])
    assert store.corrupt_count("cmos") == 0
    loaded = store.load_latest("cmos")
    assert loaded is not None and loaded.version == 2
    assert store.corrupt_count("cmos") == 1


def test_directory_store_reads_the_layout_before_the_head_moved_to_redis(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    blob = encode_blob(_ckpt(4, 4.0))
    legacy = tmp_path / namespace / "cmos"
    legacy.mkdir(parents=True)
    (legacy / f"v{4:012d}.npz").write_bytes(blob)
    (legacy / "HEAD.json").write_text(
        json.dumps(
            {
                "version": "4",
                "created": "1.0",
                "last_id": "5-0",
                "history": f"4:{hashlib.sha256(blob).hexdigest()}",
            }
        )
    )
    store = DirectoryCheckpointStore(r, keys, tmp_path)
    loaded = store.load_latest("cmos")
    assert loaded is not None and loaded.version == 4
    store.commit("cmos", _ckpt(5, 5.0), {})  # from now on the head lives in Redis
    head = store.head("cmos")
    assert head is not None and [v for v, _ in head["history"]] == [5, 4]


def test_commit_is_refused_without_the_lease(r: redis.Redis, namespace: str) -> None:
    keys = Keys(namespace)
    store = RedisCheckpointStore(r, keys)
    r.set(keys.lease("cmos"), "someone-else")
    with pytest.raises(LeaseLost):
        store.commit("cmos", _ckpt(1, 1.0), {}, lease=(keys.lease("cmos"), "me"))
    assert store.head("cmos") is None
