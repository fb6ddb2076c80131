"""The worker's periodic progress line (issue 58, item 12): a real worker process, its stderr."""

from __future__ import annotations

import itertools
import logging
import re
import time

import pytest
import redis

from streamxm.config import Settings
from streamxm.learning.stats import WorkerStats
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from streamxm.tools.processes import Child
from streamxm.tools.waiting import wait_for
from streamxm.worker.progress import ProgressLine, unapplied_entries
from tests.conftest import IMG, TXT, WorkerProcess, class_stream, processed, worker_env

# The line as docs/cli.md shows it; the groups are what the assertions read.
PROGRESS = re.compile(
    r"streamxm\.worker\.progress: worker \S+: cmos (?P<total>\d+) pairs learned "
    r"\(\+(?P<new>\d+) in [\d.]+ s: [\d.]+/s\), version (?P<version>\d+), "
    r"mistakes since the last line i2t (?P<i2t>\d+) t2i (?P<t2i>\d+), "
    r"rolling mAP i2t (?:[\d.]+|-) t2i (?:[\d.]+|-), lag (?P<lag>\d+|\?)(?P<idle>, idle)?$"
)


def _progress(worker: Child) -> list[re.Match[str]]:
    return [m for line in list(worker.lines) if (m := PROGRESS.search(line.rstrip("\n")))]


def _wait_processed(r: redis.Redis, keys: Keys, pairs: int) -> None:
    wait_for(lambda: processed(r, keys) == pairs, 30, f"{pairs} pairs checkpointed")


def test_progress_lines_count_every_pair_once_and_show_version_mistakes_and_lag(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    pairs = class_stream(300, IMG, TXT, seed=58)
    env = worker_env(
        settings,
        STREAMXM_PROGRESS_EVERY_SECONDS="0.5",
        STREAMXM_CHECKPOINT_EVERY_SECONDS="0.2",
        STREAMXM_READ_BATCH="50",
    )
    client = StreamProducer(r, settings.namespace)
    with WorkerProcess(env) as worker:
        wait_for(lambda: worker.saw("leads cmos"), 30, "the worker to lead")
        # Three bursts with idle stretches between them: lines while learning, one idle line
        # after each burst and silence for the rest of the stretch.
        for part in range(3):
            client.push_pairs(pairs[part * 100 : (part + 1) * 100])
            _wait_processed(r, keys, (part + 1) * 100)
            time.sleep(1.6)
        wait_for(
            lambda: any(
                m["idle"] and int(m["total"]) == 300 and int(m["version"]) > 0
                for m in _progress(worker)
            ),
            10,
            "the idle line after the last pairs",
        )
        assert worker.alive(), worker.tail()
    lines = _progress(worker)
    assert sum(int(m["new"]) for m in lines) == 300, worker.tail(40)
    assert int(lines[-1]["total"]) == 300
    # Running totals: each line's total is the previous one's plus its new pairs.
    totals = [int(m["total"]) for m in lines]
    assert totals == [sum(int(m["new"]) for m in lines[: i + 1]) for i in range(len(lines))]
    assert max(int(m["version"]) for m in lines) >= 1
    # A fresh cmos ranks badly at first: the early lines show its mistakes.
    assert sum(int(m["i2t"]) + int(m["t2i"]) for m in lines) > 0
    assert lines[-1]["lag"] == "0"
    # At most one idle line per idle stretch: the first line after a stretch learned pairs.
    idle = [i for i, m in enumerate(lines) if m["idle"]]
    assert all(int(m["new"]) == 0 for m in lines if m["idle"])
    assert all(b - a > 1 for a, b in itertools.pairwise(idle)), worker.tail(40)
    assert len(idle) >= 3  # one after each burst (and maybe one before the first)


def test_no_progress_line_when_the_setting_is_zero(r: redis.Redis, settings: Settings) -> None:
    keys = Keys(settings.namespace)
    env = worker_env(settings, STREAMXM_PROGRESS_EVERY_SECONDS="0")
    with WorkerProcess(env) as worker:
        wait_for(lambda: worker.saw("leads cmos"), 30, "the worker to lead")
        StreamProducer(r, settings.namespace).push_pairs(class_stream(200, IMG, TXT, seed=12))
        _wait_processed(r, keys, 200)
        time.sleep(1.0)
        assert worker.alive(), worker.tail()
    assert not any("streamxm.worker.progress" in line for line in worker.lines), worker.tail()


def test_the_lag_counts_the_entries_the_group_has_not_applied(
    r: redis.Redis, settings: Settings
) -> None:
    """Against the server's real replies (Redis 6.2 has no group lag: the count from the
    stream's length; Redis >= 7 its own)."""
    keys = Keys(settings.namespace)
    StreamProducer(r, settings.namespace).push_pairs(class_stream(300, IMG, TXT, seed=3))
    r.xgroup_create(keys.pairs, "cmos", id="0")
    r.xreadgroup("cmos", "c1", {keys.pairs: ">"}, count=50)
    groups = r.xinfo_groups(keys.pairs)
    applied = WorkerStats(pairs_processed=48, dead_letters=2)
    assert unapplied_entries(groups, "cmos", int(r.xlen(keys.pairs)), 0, applied) == 250


def test_one_line_per_idle_stretch(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    progress = ProgressLine("c1", "cmos", 10.0, clock=lambda: now[0])
    asked = []

    def lag() -> int:
        asked.append(now[0])
        return 0

    def tick(pairs: int) -> None:
        now[0] += 10.0
        assert progress.due()
        progress.report(WorkerStats(version=1, pairs_processed=pairs), lag)

    with caplog.at_level(logging.INFO, logger="streamxm.worker.progress"):
        progress.restart(WorkerStats(pairs_processed=100))
        assert not progress.due()
        for pairs in (150, 150, 150, 150, 170, 170):
            tick(pairs)
    lines = [f"streamxm.worker.progress: {record.getMessage()}" for record in caplog.records]
    new = [m["new"] for line in lines if (m := PROGRESS.search(line))]
    assert new == ["50", "0", "20", "0"], lines  # the second and third idle ticks are silent
    assert "worker c1: cmos 150 pairs learned (+50 in 10.0 s: 5.0/s)" in lines[0]
    assert lines[1].endswith(", idle") and len(asked) == 4  # Redis is asked only for a line
    assert not ProgressLine("c1", "cmos", 0.0).due()
