"""Message v1 fuzzed field by field (hypothesis): each bad entry is refused with its own reason,
by the decoder and by a real worker, which dead-letters it and learns the good pairs around it."""

from __future__ import annotations

import logging
import uuid

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.keys import Keys
from streamxm.stream.messages import (
    KNOWN_FIELDS,
    InvalidPair,
    Pair,
    decode_pair,
    field_name,
    make_pair,
)
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import str_hash

IMG, TXT = 8, 4
Fields = dict[bytes, bytes]
# (raw fields, expected reason, expected field)
Case = tuple[Fields, str, str]


def _f32(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def valid(i: int = 0) -> Fields:
    return {
        b"v": b"1",
        b"id": f"p-{i}".encode(),
        b"img": _f32([0.5] * IMG),
        b"txt": _f32([0.25] * TXT),
        b"labels": b"1,2",
        b"ts": b"1700000000.5",
    }


finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@st.composite
def bad_vector(draw: st.DrawFn, name: str, dim: int) -> Case:
    kind = draw(st.sampled_from(["bad_length", "dim_mismatch", "huge", "non_finite"]))
    if kind == "bad_length":
        raw = draw(st.binary(min_size=1, max_size=64).filter(lambda b: len(b) % 4 != 0))
    elif kind == "dim_mismatch":
        n = draw(st.integers(0, 64).filter(lambda k: k != dim))
        raw = _f32(draw(st.lists(finite, min_size=n, max_size=n)))
    elif kind == "huge":  # more than any limit; the namespace's dimensions refuse it first
        raw = _f32([1.0] * draw(st.integers(70_000, 100_000)))
        kind = "dim_mismatch"
    else:
        values = draw(st.lists(finite, min_size=dim, max_size=dim))
        values[draw(st.integers(0, dim - 1))] = draw(
            st.sampled_from([float("nan"), float("inf"), -float("inf")])
        )
        raw = _f32(values)
    return {name.encode(): raw}, kind, name


@st.composite
def mutation(draw: st.DrawFn) -> Case:
    """A valid message with exactly one field broken, and what the decoder must say."""
    fields = valid()
    which = draw(st.sampled_from(["missing", "v", "extra", "id", "img", "txt", "labels", "ts"]))
    if which == "missing":
        name = draw(st.sampled_from([b"v", b"id", b"img", b"txt"]))
        del fields[name]
        return fields, "missing_field", name.decode()
    if which == "v":
        fields[b"v"] = draw(st.binary(max_size=8).filter(lambda b: b != b"1"))
        return fields, "bad_version", "v"
    if which == "extra":
        name = draw(st.binary(min_size=1, max_size=12).filter(lambda b: b not in KNOWN_FIELDS))
        fields[name] = draw(st.binary(max_size=16))
        return fields, "unknown_field", ""
    if which == "id":
        fields[b"id"] = draw(
            st.one_of(
                st.just(b""),
                st.binary(min_size=1, max_size=8).map(lambda b: b"\xff" + b),  # not UTF-8
                st.text(min_size=1, max_size=20).map(lambda t: (t + "\x00").encode()),
                st.sampled_from([b"a\r\nb", b"\x1b[31mred", b"tab\tid", b"\x7f"]),
                # Too long: by characters, or past the most bytes 256 characters take (too_large).
                st.text(min_size=257, max_size=300).map(str.encode),
            )
        )
        if len(fields[b"id"]) > 4 * 256:
            return fields, "too_large", "id"
        return fields, "bad_id", "id"
    if which in ("img", "txt"):
        update, reason, name = draw(bad_vector(which, IMG if which == "img" else TXT))
        fields.update(update)
        return fields, reason, name
    if which == "labels":
        fields[b"labels"] = draw(
            st.one_of(
                st.sampled_from([b"a", b"1.5", b"1;2", b"-1", b"1,,2", b" ", b"0x10", b"\xc3\xa9"]),
                st.integers(1_000_001, 10**12).map(lambda n: str(n).encode()),
                st.just(",".join(map(str, range(65))).encode()),
                non_canonical(st.integers(0, 1000).map(str)),
            )
        )
        return fields, "bad_labels", "labels"
    fields[b"ts"] = draw(
        st.one_of(
            st.sampled_from([b"abc", b"nan", b"inf", b"-inf", b"1e999", b"1,5"]),
            non_canonical(st.floats(0, 2e9, allow_nan=False).map(repr)),
        )
    )
    return fields, "bad_ts", "ts"


def non_canonical(numbers: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    """A number spelt in a way Python's int()/float() accept but message v1 does not: padded
    with whitespace, with an underscore, a plus sign or non-ASCII digits."""

    def spoil(text: str, how: str) -> bytes:
        if how == "space":
            return f" {text} ".encode()
        if how == "newline":
            return f"{text}\n".encode()
        if how == "plus":
            return f"+{text}".encode()
        if how == "underscore":
            return (text[0] + "_" + text[1:] if len(text) > 1 else f"{text}_0").encode()
        return text.translate({ord(str(d)): chr(0x0660 + d) for d in range(10)}).encode()

    return st.builds(
        spoil, numbers, st.sampled_from(["space", "newline", "plus", "underscore", "arabic"])
    )


@examples(max_examples=400, deadline=None)
@given(mutation())
def test_each_broken_field_is_refused_with_its_reason(case: Case) -> None:
    fields, reason, name = case
    try:
        decode_pair(fields, IMG, TXT)
    except InvalidPair as exc:
        assert exc.reason == reason, (exc, fields)
        if name:
            assert exc.field == name
    else:
        raise AssertionError(f"accepted {fields!r}")


def test_the_untouched_message_decodes() -> None:
    pair = decode_pair(valid(), IMG, TXT)
    assert pair.labels == (1, 2) and pair.img.shape == (IMG,)


def test_a_huge_first_vector_is_too_large_without_a_schema() -> None:
    fields = valid()
    fields[b"img"] = _f32([1.0] * 70_000)
    try:
        decode_pair(fields)
    except InvalidPair as exc:
        assert (exc.reason, exc.field) == ("too_large", "img")
    else:
        raise AssertionError("accepted")


@examples(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.one_of(st.sampled_from(list(KNOWN_FIELDS)), st.binary(max_size=6)),
        st.binary(max_size=40),
        max_size=8,
    )
)
def test_arbitrary_bytes_are_a_pair_or_an_invalid_pair(fields: Fields) -> None:
    try:
        assert isinstance(decode_pair(fields), Pair)
    except InvalidPair as exc:
        assert exc.reason and str(exc)


@examples(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=100))
def test_field_names_reach_logs_and_labels_as_one_printable_line(raw: bytes) -> None:
    name = field_name(raw)
    assert name.isprintable() and len(name) <= 67
    try:
        decode_pair({**valid(), raw: b"x"}, IMG, TXT)
    except InvalidPair as exc:
        assert str(exc).isprintable()


def test_a_forged_log_line_in_a_field_name_stays_on_its_line(
    r: redis.Redis, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(settings.namespace)
    StreamProducer(r, settings.namespace).push_pairs([_good(0)])
    r.xadd(keys.pairs, {**valid(1), b"x\nCRITICAL forged line": b"1"})  # type: ignore[arg-type]
    caplog.set_level(logging.DEBUG)
    build_worker(settings, r, "cmos").run(until_idle=True)
    lines = caplog.text.splitlines()
    assert any("dead letter" in line and "forged line" in line for line in lines)
    assert not any(line.startswith("CRITICAL forged") for line in lines)


def _good(i: int) -> Pair:
    rng = np.random.default_rng(i)
    return make_pair(f"good-{i}", rng.random(IMG), rng.random(TXT), labels=[i % 3])


@examples(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cases=st.lists(mutation(), min_size=1, max_size=6))
@pytest.mark.slow
def test_worker_dead_letters_each_bad_entry_and_learns_the_good_ones(
    cases: list[Case], r: redis.Redis, settings: Settings
) -> None:
    ns = "f" + uuid.uuid4().hex[:10]
    keys = Keys(ns)
    client = StreamProducer(r, ns)
    client.push_pairs([_good(0)])  # fixes the namespace's dimensions
    for i, (fields, _, _) in enumerate(cases, start=1):
        r.xadd(keys.pairs, fields)  # type: ignore[arg-type]
        client.push_pairs([_good(i)])
    worker = build_worker(settings.model_copy(update={"namespace": ns}), r, "cmos")
    worker.run(until_idle=True)  # returns: the worker never stopped on a bad entry
    letters = r.xrange(keys.dead)
    assert [f[b"reason"].decode() for _, f in letters] == [reason for _, reason, _ in cases]
    for (_, fields), (_, _, name) in zip(letters, cases, strict=True):
        if name:
            assert fields[b"field"].decode() == name
        assert fields[b"detail"]  # says what is wrong
    stats = str_hash(r.hgetall(keys.stats("cmos")))
    assert stats["pairs_processed"] == str(len(cases) + 1)
    assert stats["dead_letters"] == str(len(cases))
    assert r.xpending(keys.pairs, "cmos")["pending"] == 0
