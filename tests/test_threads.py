"""``STREAMXM_THREADS`` sizes every numeric pool of every process: BLAS and PyTorch, loaded
before or after it is applied, in the service's own processes and in the processes they start."""

from __future__ import annotations

import json
import subprocess
import sys

import redis

from streamxm.config import Settings
from streamxm.tools.processes import Child
from tests.conftest import wait_for, worker_env

_PROBE = """
import json, sys
from streamxm.threads import apply_threads, thread_report
threads, torch_first = int(sys.argv[1]), sys.argv[2] == "before"
if torch_first:
    import torch
apply_threads(threads)
import numpy, torch
numpy.ones((64, 64)) @ numpy.ones((64, 64))
print(json.dumps(thread_report()))
"""


def _pools(threads: int, torch_loaded: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(threads), torch_loaded],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    pools: dict[str, int] = json.loads(out.stdout)
    return pools


def test_every_pool_takes_the_setting_whether_loaded_before_or_after() -> None:
    for torch_loaded in ("before", "after"):
        pools = _pools(1, torch_loaded)
        assert "torch" in pools and "blas" in pools, pools
        assert set(pools.values()) == {1}, (torch_loaded, pools)
    assert set(_pools(2, "after").values()) == {2}  # the setting, not a fixed 1


def test_a_worker_computes_with_the_threads_its_setting_says(
    settings: Settings, r: redis.Redis
) -> None:
    """The suite's own environment says one thread (OMP_NUM_THREADS=1, inherited); a worker
    started with STREAMXM_THREADS=2 sizes its pools from the setting, not from that."""
    env = worker_env(settings, STREAMXM_THREADS="2")
    assert env["OMP_NUM_THREADS"] == "1"
    with Child("worker", "--model", "cmos", env=env, watch=True) as child:
        wait_for(lambda: child.saw("compute threads"), 60, "the worker's start-up line")
    (line,) = [x for x in child.lines if "compute threads" in x]
    assert "'blas': 2" in line, line
