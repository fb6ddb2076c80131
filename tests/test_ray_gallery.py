"""The ``ray`` gallery backend against the ``local`` one, on a real two-node Ray cluster started
on this machine inside a network namespace with only loopback (``unshare -rn``), so no Ray
process can listen or send beyond 127.0.0.1 (each scenario also checks ``ss -ltn``)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streamxm.config import Settings

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs streamxm[ray]"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)"),
]

ROOT = Path(__file__).resolve().parent.parent


def run_scenario(name: str, settings: Settings, timeout: float = 600) -> dict[str, object]:
    """Run ``tests/ray_scenarios.py NAME`` in a loopback-only network namespace."""
    command = (
        "ip link set lo up && exec "
        f"{sys.executable} -m tests.ray_scenarios {name} '{settings.model_dump_json()}'"
    )
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["unshare", "-rn", "sh", "-c", command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_sharded_answers_equal_the_local_ones_for_every_model(settings: Settings) -> None:
    """Three versions of every model; after each, every answer of two shards on two nodes is
    the local backend's, and so is the ensemble's: the same ids in the same order, the same
    versions, the same scores; from segments written per shard, then the stream after them."""
    summary = run_scenario("answers_equal", settings)
    assert summary["compared"] == 3 * (9 + 1) * 6
    rows = summary["rows"]
    assert isinstance(rows, list) and len(rows) == 2 and sum(rows) == 360
    assert all(r > 0 for r in rows)  # each shard holds a part, not all
    assert summary["segment_parts"] == [[0, 2], [1, 2]]


def test_a_shard_killed_under_load_gives_no_wrong_or_silently_partial_answer(
    settings: Settings,
) -> None:
    """SIGKILL one of two shards while searches run: each answer is right, a 503 (no shard
    answer in time), or a partial answer that says so; Ray restarts the shard, which reads its
    part again and is given the served versions, and then every answer is right again with no
    row lost."""
    summary = run_scenario("shard_killed", settings)
    counts = summary["counts"]
    assert isinstance(counts, dict)
    assert counts["wrong"] == 0 and counts["refused"] > 0 and counts["partial"] > 0
    assert summary["rows"] is not None and sum(summary["rows"]) == 240  # type: ignore[arg-type]
    assert summary["compared"] == 18


def test_the_api_on_the_ray_backend_answers_names_its_shards_and_refuses_partial_answers(
    settings: Settings,
) -> None:
    """Over HTTP: the answers equal the local backend's, ``/readyz`` names each shard with its
    rows, versions and device, the shards hold the cluster's GPUs, and while a killed shard is
    away a search is a 503 with ``Retry-After`` or, asked for, a partial answer that covers
    half the gallery."""
    summary = run_scenario("http_api", settings)
    ready = summary["ready"]
    assert isinstance(ready, dict) and ready["status"] == "ready"
    shards = ready["shards"]
    assert [s["shard"] for s in shards] == [0, 1] and all(s["up"] for s in shards)
    assert sum(s["rows"] for s in shards) == 200 and all(s["rows"] < 200 for s in shards)
    assert all(s["versions"]["cmos"] >= 1 for s in shards)
    # Each node declares a GPU: each shard asks for one and holds it (torch finds no CUDA here).
    assert ready["gpus_per_shard"] == 1.0 and ready["gpus_left"] == 0.0
    assert all(s["device"] in ("cpu", "cuda") for s in shards)
    assert summary["seen"] == {"retry_after": "1", "covered": 0.5}
