"""``streamxm push --url`` whose API is killed part-way: it says what landed and how to resume,
and resuming from there leaves every pair in the stream once (real processes, Redis, HTTP)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections import Counter

import httpx
import pytest
import redis

from streamxm.config import Settings
from streamxm.stream.keys import Keys
from streamxm.tools.processes import Child
from tests.conftest import PY, free_port, wait_for, worker_env

pytestmark = pytest.mark.slow


def _api(env: dict[str, str], port: int) -> Child:
    api = Child("api", "--port", str(port), env=env, watch=True)
    wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200,
        60,
        "the API",
        tolerate=(httpx.HTTPError,),
    )
    return api


def _stream_ids(r: redis.Redis, keys: Keys) -> Counter[str]:
    return Counter(f[b"id"].decode() for _, f in r.xrange(keys.pairs))


def test_a_push_stopped_by_a_dead_api_resumes_without_duplicates(
    settings: Settings, r: redis.Redis
) -> None:
    env = worker_env(settings)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    keys = Keys(settings.namespace)
    total = 1200
    command = [
        *PY,
        "push",
        "--dataset",
        "wiki",
        "--limit",
        str(total),
        "--url",
        url,
        "--rate",
        "400",
    ]
    api = _api(env, port)
    push = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: r.xlen(keys.pairs) >= 400, 60, "the first pairs to land")
    api.proc.send_signal(signal.SIGKILL)
    api.proc.wait(timeout=10)
    _, err = push.communicate(timeout=120)
    assert push.returncode == 3, err[-2000:]
    landed = int(re.findall(r"--start (\d+)", err)[-1])
    uncertain = re.search(r"the (\d+) pairs after them got no answer", err)
    maybe = int(uncertain.group(1)) if uncertain else 0
    # A kill between a batch's XADD and its answer leaves that batch in doubt, not landed.
    said = f"pushed pairs 0..{landed - 1} of {total}" if landed else "pushed no pairs"
    assert said in err, err[-2000:]
    seen = _stream_ids(r, keys)
    assert {f"train-{i}" for i in range(landed)} <= set(seen)
    assert landed <= sum(seen.values()) <= landed + maybe < total
    if landed:
        last = re.search(r"last entry id (\d+-\d+)", err)
        assert last is not None and r.xrange(keys.pairs, last.group(1), last.group(1))

    time.sleep(0.5)
    api = _api(env, port)
    try:
        again = subprocess.run(
            [*command, "--start", str(landed)], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        api.proc.terminate()
        api.proc.wait(timeout=20)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"pushed pairs {landed}..{total - 1} of {total}" in again.stdout
    seen = _stream_ids(r, keys)
    assert set(seen) == {f"train-{i}" for i in range(total)}
    assert sum(seen.values()) - total <= maybe, "only a send without an answer repeats"
