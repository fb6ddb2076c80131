"""The load benchmarks run end to end on a tiny scale and report what they claim (no timing is
asserted: figures live in docs/benchmarks.md)."""

from __future__ import annotations

import os
import shutil

import pytest

from streamxm.tools.bench_ingest import ingest
from streamxm.tools.bench_query import ensemble_recall, query
from streamxm.tools.stack import rss_mb

pytestmark = pytest.mark.slow  # whole stacks of processes: a minute or more


@pytest.mark.long
def test_ingest_reports_client_http_and_redis_benchmark_rates() -> None:
    result = ingest(img_dim=16, txt_dim=8, pairs=300, http_batch=50, repeats=1)
    assert result["client_pairs_per_s"] > 0 and result["http_pairs_per_s"] > 0
    assert result["http_base64_pairs_per_s"] > 0 and result["http_binary_pairs_per_s"] > 0
    assert result["api_role"] == "ingest" and result["search_replica_binary_pairs_per_s"] > 0
    assert result["entry_bytes"] == 4 * (16 + 8)
    if shutil.which("redis-benchmark"):
        assert result["redis_benchmark_xadd_per_s"] > 0
        assert result["client_ratio"] > 0
    else:
        assert "redis-tools" in result["note"]


def test_query_serves_every_request_while_the_worker_learns() -> None:
    result = query(gallery=3000, img_dim=16, txt_dim=8, clients=4, seconds=2.0)
    assert result["requests"] > 0 and result["errors"] == 0, result["statuses"]
    assert result["model_versions_served"] >= 1
    assert result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]


def test_rss_of_this_process() -> None:
    assert rss_mb(os.getpid()) > 1


def test_ensemble_recall_is_exact_when_the_candidates_cover_the_gallery() -> None:
    # Each member proposing the whole gallery: the fused search must be the exact ranking.
    result = ensemble_recall(gallery=400, img_dim=8, txt_dim=4, queries=10, candidates=400)
    assert result["recall_at_k"] == 1.0 and result["candidates_per_member"] == 400


def test_a_terminated_bench_leaves_no_process_behind() -> None:
    """SIGTERM to ``streamxm bench query`` mid-run: its worker, indexer, API and Redis all go
    (the stack's cleanup runs; the children also die with it if it is killed outright)."""
    import signal
    import subprocess
    import sys

    import psutil

    from tests.conftest import wait_for

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamxm",
            "bench",
            "query",
            "--gallery",
            "3000",
            "--img-dim",
            "16",
            "--txt-dim",
            "8",
            "--clients",
            "2",
            "--seconds",
            "300",
            "--json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bench = psutil.Process(proc.pid)

    def serving() -> list[psutil.Process]:
        children = bench.children(recursive=True)
        commands = [" ".join(c.cmdline()) for c in children]
        return children if any(c.endswith("streamxm api") for c in commands) else []

    try:
        children = wait_for(
            serving, 120, "the bench's API to start", tolerate=(psutil.NoSuchProcess,)
        )
        assert len(children) >= 4  # redis, worker, indexer, api
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) != 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
